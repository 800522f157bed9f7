// send/recv ping-pong between two ddp::tcp ranks on this host, started by ddp::launch::spawn (no mpirun):
// DDP_SHM=1 (point-to-point through the shared-memory rings) and DDP_SHM=0 (through the sockets), at 4 KiB
// and 4 MiB by default. Rank 0 sends, rank 1 receives and sends back; a round trip's time is rank 0's, the
// table shows the median one-way time (half a round trip) and the bandwidth of one direction. Every message
// is checked.
//
//   build/bench/comm/ddp_bench_p2p [--iters N] [--bytes B ...]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/launch/spawn.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

/// Runs the ping-pong in one rank; rank 0 prints one line per size.
void ping_pong(int rank, bool shm, const std::vector<std::size_t>& sizes, int iters) {
  auto cfg = ddp::tcp::config_from_env();
  cfg.shared_memory = shm;
  cfg.timeout = std::chrono::seconds(60);
  ddp::tcp::communicator comm(cfg);
  const int peer = 1 - rank;
  for (const std::size_t bytes : sizes) {
    std::vector<std::uint8_t> out(bytes), in(bytes);
    std::vector<double> times;
    const int warmup = std::max(3, iters / 10);
    for (int i = 0; i < warmup + iters; ++i) {
      const auto mark = static_cast<std::uint8_t>(i * 7 + 1);
      std::fill(out.begin(), out.end(), mark);
      const auto t0 = clock_type::now();
      if (rank == 0) {
        comm.send(std::span<const std::uint8_t>(out), peer, 1).wait();
        comm.recv(std::span<std::uint8_t>(in), peer, 2).wait();
      } else {
        comm.recv(std::span<std::uint8_t>(in), peer, 1).wait();
        comm.send(std::span<const std::uint8_t>(out), peer, 2).wait();
      }
      const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
      if (in.front() != mark || in.back() != mark) {
        std::fprintf(stderr, "ddp_bench_p2p: rank %d received wrong bytes at %zu\n", rank, bytes);
        std::exit(1);
      }
      if (i >= warmup) times.push_back(s);
    }
    comm.barrier().wait();
    if (rank != 0) continue;
    std::sort(times.begin(), times.end());
    const double one_way = times[times.size() / 2] / 2;
    std::printf("| %s | %zu KiB | %.1f us | %.2f GB/s |\n", shm ? "DDP_SHM=1" : "DDP_SHM=0", bytes >> 10,
                one_way * 1e6, static_cast<double>(bytes) / one_way / 1e9);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 200;
  std::vector<std::size_t> sizes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--bytes" && i + 1 < argc) sizes.push_back(std::strtoull(argv[++i], nullptr, 10));
    else {
      std::fprintf(stderr, "usage: ddp_bench_p2p [--iters N] [--bytes B ...]\n");
      return 2;
    }
  }
  if (sizes.empty()) sizes = {4 << 10, 4 << 20};
  std::printf("| transport | size | one-way (median) | bandwidth |\n|---|---:|---:|---:|\n");
  std::fflush(stdout);
  for (const bool shm : {true, false}) {
    ddp::launch::spawn_options o;
    o.timeout = std::chrono::minutes(5);
    const auto result = ddp::launch::spawn(2, [&](int rank) { ping_pong(rank, shm, sizes, iters); }, o);
    if (!result.ok()) {
      std::fprintf(stderr, "ddp_bench_p2p: %s\n", result.describe().c_str());
      return 1;
    }
  }
  return 0;
}
