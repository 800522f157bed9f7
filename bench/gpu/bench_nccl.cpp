// ddp::nccl all_reduce against raw ncclAllReduce on the same NCCL communicator and stream: what the wrapper
// (events, stream ordering, work polling) adds per call. Run under mpirun; ranks sharing a GPU get NCCL_HOSTID.
// Usage: mpirun -np N ddp_bench_gpu_nccl [repetitions, default 50]
// Rank 0 prints a Markdown table of median microseconds per all_reduce (f32 sum, device buffers).
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <ddp/comm/env.hpp>
#include <ddp/comm/mpi/communicator.hpp>
#include <ddp/comm/nccl/communicator.hpp>
#include <ddp/cuda/buffer.hpp>
#include <ddp/cuda/runtime.hpp>

namespace {

template <class F>
double median_us(int reps, F&& f) {
  f();
  f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  auto boot = ddp::mpi::communicator::world(argc, argv);
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  const ddp::env_config env = ddp::read_env_config();
  const int devices = ddp::cuda::device_count();
  if (env.local_world_size > devices) ::setenv("NCCL_HOSTID", ("rank" + std::to_string(env.rank)).c_str(), 1);
  const int device = env.local_rank % devices;
  ddp::cuda::check(cudaSetDevice(device), "cudaSetDevice");
  ddp::nccl::communicator comm(boot, {.device = device});
  if (comm.rank() == 0)
    std::printf("%d ranks, %d visible device(s), median of %d runs\n\n| bytes | raw ncclAllReduce (us) | "
                "ddp::nccl all_reduce (us) | overhead |\n|---:|---:|---:|---:|\n",
                comm.size(), devices, reps);
  for (std::size_t bytes = 4096; bytes <= (std::size_t{256} << 20); bytes *= 16) {
    const std::size_t n = bytes / sizeof(float);
    ddp::cuda::device_buffer<float> buf(n, device);
    ddp::cuda::check(cudaMemset(buf.data(), 0, bytes), "cudaMemset");
    const double raw = median_us(reps, [&] {
      boot.barrier().wait();
      ncclResult_t state =
          ncclAllReduce(buf.data(), buf.data(), n, ncclFloat32, ncclSum, comm.native_handle(), comm.stream());
      while (state == ncclInProgress) ncclCommGetAsyncError(comm.native_handle(), &state);  // non-blocking comm
      if (state != ncclSuccess) ddp::nccl::detail::fail(state, "ncclAllReduce", comm.rank(), comm.native_handle());
      ddp::cuda::check(cudaStreamSynchronize(comm.stream()), "cudaStreamSynchronize");
    });
    const double wrapped = median_us(reps, [&] {
      boot.barrier().wait();
      comm.all_reduce(buf.raw(), ddp::reduce_op::sum).wait();
    });
    if (comm.rank() == 0)
      std::printf("| %zu | %.1f | %.1f | %+.1f %% |\n", bytes, raw, wrapped, 100.0 * (wrapped - raw) / raw);
  }
  return 0;
}
