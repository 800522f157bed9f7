#pragma once
/// \file How the GPU example and bench place a rank: its GPU (LOCAL_RANK modulo the devices) and an NCCL communicator
/// over the launcher's ranks, or a group of one when no launcher started the process.

#include <nccl.h>

#include <cstdlib>
#include <string>

#include <ddp/comm/nccl/communicator.hpp>
#include <ddp/comm/nccl/from_env.hpp>
#include <ddp/core/error.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>

#include "job.hpp"

namespace example::gpu {

/// This rank's GPU, made current; a clear error where ranks would share one that NCCL would refuse.
inline int pick_device() {
  const ddp::env_config env = job_env();
  const int devices = ddp::cuda::device_count();
  if (env.local_world_size > devices && std::getenv("NCCL_HOSTID") == nullptr)
    throw ddp::config_error("rank " + std::to_string(env.rank) + ": " + std::to_string(env.local_world_size) +
                            " ranks on this host share " + std::to_string(devices) + " GPU(s), which NCCL refuses; "
                            "start at most one rank per GPU, or for a test give each rank its own NCCL_HOSTID "
                            "(sh -c 'NCCL_HOSTID=rank$RANK exec ...')");
  const int device = env.local_rank % devices;
  ddp::cuda::check(cudaSetDevice(device), "cudaSetDevice", env.rank);
  return device;
}

/// An NCCL communicator with `settings` over the launcher's ranks (the id through its store), or alone a group of one.
inline ddp::nccl::communicator nccl_world(const ddp::nccl::config& settings) {
  if (launched()) return ddp::nccl::communicator::from_env(settings);
  ncclUniqueId id{};
  if (ncclGetUniqueId(&id) != ncclSuccess) throw ddp::error("ncclGetUniqueId failed");
  return ddp::nccl::communicator(id, 0, 1, settings);
}

}  // namespace example::gpu
