#pragma once
/// \file ddp::nccl::communicator::from_env(): the ncclUniqueId travels from rank 0 over ddp::tcp's rendezvous
/// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the only NCCL header that includes the TCP backend.

#include <ddp/comm/env.hpp>
#include <ddp/comm/nccl/communicator.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::nccl::detail {

/// Joins the job the environment describes, on config::device or else LOCAL_RANK modulo the visible devices.
struct env_rendezvous {
  static communicator join(config settings) {
    if (settings.device < 0) settings.device = read_env_config().local_rank % cuda::device_count();
    auto bootstrap = tcp::communicator::from_env();
    return communicator(bootstrap, settings);
  }
};

}  // namespace ddp::nccl::detail
