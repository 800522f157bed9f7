// ddp::local (ranks as threads of one process, collectives over each other's buffers) against ddp::tcp's
// shared-memory transport (ranks as processes of one host, DDP_SHM on by default), f32 all_reduce(sum) from
// 4 KiB to --max-bytes, at each of --ranks, in one run: the TCP ranks are forked first (ddp::launch::spawn), then
// the same loop runs on ddp::local's threads. Every iteration starts after the backend's own barrier; its time is
// the slowest rank's (an all_reduce(max)); the table shows the median, busbw = bytes * 2(N-1)/N / time, and the
// ratios local/shm of latency and bus bandwidth. Each result is checked against the exact sum.
//
//   build/bench/comm/ddp_bench_local [--ranks 2,4] [--max-bytes 67108864] [--iters 20]

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/comm/local/run.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/launch/spawn.hpp>

#include "bench/common/numbers.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

/// The buffer sizes measured: 4 KiB, then ×4 up to `max_bytes`.
std::vector<std::size_t> sizes_up_to(std::size_t max_bytes) {
  std::vector<std::size_t> out;
  for (std::size_t b = 4096; b <= max_bytes; b *= 4) out.push_back(b);
  return out;
}

/// The median time (seconds, the slowest rank's per iteration) of an all_reduce of each size on `comm`.
template <class Comm>
std::vector<double> measure(Comm& comm, const std::vector<std::size_t>& sizes, int iters) {
  std::vector<double> medians;
  for (const std::size_t bytes : sizes) {
    std::vector<float> buf(bytes / sizeof(float));
    const int reps = bytes >= (std::size_t{8} << 20) ? std::max(3, iters / 4) : iters;
    std::vector<double> times;
    for (int i = -2; i < reps; ++i) {  // two warm-ups
      std::fill(buf.begin(), buf.end(), static_cast<float>(comm.rank() + 1));
      comm.barrier().wait();
      const auto t0 = clock_type::now();
      comm.all_reduce(std::span<float>(buf)).wait();
      double t = std::chrono::duration<double>(clock_type::now() - t0).count();
      comm.all_reduce(std::span<double>(&t, 1), ddp::reduce_op::max).wait();
      const float want = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
      if (buf.front() != want || buf.back() != want)
        throw ddp::error("all_reduce of " + std::to_string(bytes) + " bytes gave " + std::to_string(buf.back()) +
                         ", expected " + std::to_string(want), comm.rank());
      if (i >= 0) times.push_back(t);
    }
    medians.push_back(bench::median(times));
  }
  return medians;
}

/// ddp::tcp's medians at `n` forked ranks (rank 0 prints them; parsed from its captured output).
std::vector<double> tcp_medians(int n, const std::vector<std::size_t>& sizes, int iters) {
  ddp::launch::spawn_options options;
  options.output = ddp::launch::output_mode::capture;
  options.timeout = std::chrono::minutes(10);
  const auto result = ddp::launch::spawn(n, [&](int) {
    auto comm = ddp::tcp::communicator::from_env();
    const auto m = measure(comm, sizes, iters);
    if (comm.rank() == 0)
      for (const double t : m) std::printf("median %.9f\n", t);
    std::fflush(stdout);
  }, options);
  if (!result.ok()) throw ddp::error("the TCP ranks failed: " + result.describe() + "\n" + result.ranks[0].output);
  std::vector<double> out;
  std::istringstream lines(result.ranks[0].output);
  for (std::string word; lines >> word;)
    if (word == "median") {
      double t = 0;
      lines >> t;
      out.push_back(t);
    }
  if (out.size() != sizes.size()) throw ddp::error("rank 0 of the TCP job printed " + std::to_string(out.size()) + " medians");
  return out;
}

/// ddp::local's medians at `n` threads.
std::vector<double> local_medians(int n, const std::vector<std::size_t>& sizes, int iters) {
  std::vector<double> out;
  ddp::local::run(n, [&](ddp::local::communicator comm) {
    auto m = measure(comm, sizes, iters);
    if (comm.rank() == 0) out = std::move(m);
  });
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::vector<int> ranks{2, 4};
    std::size_t max_bytes = std::size_t{64} << 20;
    int iters = 20;
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      if (i + 1 >= argc) throw ddp::config_error(std::string(a) + " needs a value");
      if (a == "--ranks") ranks = bench::comma_list<int>(argv[++i], "--ranks");
      else if (a == "--max-bytes") max_bytes = bench::comma_list<std::size_t>(argv[++i], "--max-bytes").at(0);
      else if (a == "--iters") iters = bench::comma_list<int>(argv[++i], "--iters").at(0);
      else throw ddp::config_error("unknown flag " + std::string(a) + "; use --ranks, --max-bytes, --iters");
    }
    const auto sizes = sizes_up_to(max_bytes);
    std::printf("f32 all_reduce(sum): ddp::local (threads) against ddp::tcp over shared memory (processes)\n");
    std::printf("%5s %10s %12s %12s %10s %12s %12s %10s\n", "ranks", "bytes", "shm us", "local us", "lat ratio",
                "shm GB/s", "local GB/s", "bw ratio");
    for (const int n : ranks) {
      const auto shm = tcp_medians(n, sizes, iters);
      const auto local = local_medians(n, sizes, iters);
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const double factor = static_cast<double>(sizes[k]) * 2.0 * (n - 1) / n / 1e9;
        std::printf("%5d %10zu %12.1f %12.1f %10.2f %12.2f %12.2f %10.2f\n", n, sizes[k], shm[k] * 1e6, local[k] * 1e6,
                    local[k] / shm[k], factor / shm[k], factor / local[k], shm[k] / local[k]);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench_local: %s\n", e.what());
    return 2;
  }
}
