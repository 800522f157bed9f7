// ddp::nccl with its ranks as threads of one process, one per GPU (ncclCommInitAll's shape, nn.DataParallel's):
// ddp::local::run starts a thread per visible device; each joins an NCCL communicator on its own device,
// bootstrapped over ddp::local (rank 0's ncclUniqueId broadcast through the threads' memory). Needs a GPU; on a
// machine with one it runs one thread, with more one per GPU.
#include <catch2/catch.hpp>

#include <chrono>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <conformance/conformance.hpp>
#include <ddp/comm/local/run.hpp>
#include <ddp/comm/nccl/communicator.hpp>
#include <ddp/cuda/buffer.hpp>
#include <ddp/cuda/error.hpp>

TEST_CASE("nccl: one thread per GPU bootstrapped over ddp::local all_reduces device buffers and passes the "
          "conformance suite", "[gpu][nccl][threads]") {
  using namespace std::chrono_literals;
  int devices = 0;
  ddp::cuda::check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  REQUIRE(devices >= 1);
  CHECK_NOTHROW(ddp::local::run(devices, [&](ddp::local::communicator host) {
    ddp::nccl::communicator comm(host, {.timeout = 120s, .device = host.rank()});
    if (comm.rank() != host.rank() || comm.size() != host.size() || comm.device() != host.rank())
      throw std::runtime_error("rank " + std::to_string(host.rank()) + " joined NCCL as rank " +
                               std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + " on cuda:" +
                               std::to_string(comm.device()));
    const std::vector<float> values(std::size_t{1} << 20, static_cast<float>(comm.rank() + 1));
    ddp::cuda::device_buffer<float> buf{std::span<const float>(values), comm.device()};
    comm.all_reduce(buf.raw(), ddp::reduce_op::sum).wait();
    const float want = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
    for (const float v : buf.to_host())
      if (v != want) throw std::runtime_error("all_reduce gave " + std::to_string(v) + ", expected " + std::to_string(want));
    ddp::testing::run_conformance(comm);  // host buffers, staged by the communicator
  }));
}
