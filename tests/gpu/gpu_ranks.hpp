#pragma once
// How GPU tests place their ranks: one device per local rank when there are enough devices, otherwise all ranks
// share them, and then each rank gets its own NCCL_HOSTID, because NCCL refuses two ranks of one communicator on
// one GPU ("Duplicate GPU detected") unless they look like different hosts (they then talk over sockets).

#include <cstdlib>
#include <string>

#include <ddp/comm/env.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::testing {

/// The CUDA device of this rank (made current); sets NCCL_HOSTID=rank<R> when local ranks outnumber the devices.
/// Call before the first NCCL call of the process.
inline int place_rank_on_gpu() {
  const env_config env = read_env_config();
  const int devices = cuda::device_count();  // throws ddp::cuda_error where there is no GPU: the test fails, loudly
  if (env.local_world_size > devices) {
    const std::string host_id = "rank" + std::to_string(env.rank);
    ::setenv("NCCL_HOSTID", host_id.c_str(), 1);
  }
  const int device = env.local_rank % devices;
  cuda::check(cudaSetDevice(device), "cudaSetDevice", env.rank);
  return device;
}

}  // namespace ddp::testing
