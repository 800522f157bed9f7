// ddp::mpi::communicator::all_reduce (f32, sum, in place) against the raw MPI calls it wraps, in one run:
// blocking MPI_Allreduce and non-blocking MPI_Iallreduce + MPI_Wait. Sizes 4 KiB .. 64 MiB in powers of 4.
// A fourth variant, MPI_Iallreduce + an MPI_Test loop, is what ddp's non-blocking path does without ddp: it
// separates ddp's own cost from the difference between polling and MPI_Wait. ddp runs twice: with the default
// config (collectives up to config::eager_bytes run MPI_Allreduce and complete on start) and with
// eager_bytes = 0 (every all-reduce through MPI_Iallreduce, the path that overlaps and times out).
// The variants alternate call by call (A B C D E, B C D E A, ...), so a burst of load from other processes hits
// all of them alike; every call starts after a barrier and is timed on its own; each rank takes the median per
// variant and the slowest rank's median is the round's figure. The whole sweep runs --rounds times, spread over
// time; the table shows the median of the rounds and, for ddp vs MPI_Allreduce, the range over rounds.
//
//   mpirun -np 2 ddp_bench_mpi [--calls 400] [--min 4096] [--max 67108864] [--factor 4] [--budget-ms 1000]
//                              [--rounds 5]
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/comm/mpi/communicator.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

struct options {
  int calls = 400;              // calls per variant, size and round, at most
  std::size_t min_bytes = 4096;
  std::size_t max_bytes = std::size_t{64} << 20;
  std::size_t factor = 4;       // the next size is this many times the last
  double budget_ms = 1000;      // time per size, variant and round; fewer calls (at least 15) for large sizes
  int rounds = 5;               // sweeps over every size
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--calls") o.calls = std::atoi(value);
    else if (flag == "--min") o.min_bytes = std::strtoull(value, nullptr, 10);
    else if (flag == "--max") o.max_bytes = std::strtoull(value, nullptr, 10);
    else if (flag == "--factor") o.factor = std::strtoull(value, nullptr, 10);
    else if (flag == "--budget-ms") o.budget_ms = std::atof(value);
    else if (flag == "--rounds") o.rounds = std::atoi(value);
    else
      throw ddp::config_error("unknown flag " + std::string(flag) +
                              "; use --calls, --min, --max, --factor, --budget-ms or --rounds");
  }
  if (o.factor < 2 || o.rounds < 1 || o.calls < 1 || o.min_bytes < sizeof(float))
    throw ddp::config_error("--factor must be at least 2, --rounds and --calls at least 1, --min at least 4 bytes");
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string human(std::size_t bytes) {
  if (bytes >= (std::size_t{1} << 20) && bytes % (std::size_t{1} << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= 1024 && bytes % 1024 == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

constexpr std::size_t variant_count = 5;
enum variant : std::size_t { blocking, wait, testing, ddp_default, ddp_async };

}  // namespace

int main(int argc, char** argv) {
  auto comm = ddp::mpi::communicator::world(argc, argv);
  auto async = ddp::mpi::communicator(comm.native_handle(), {.eager_bytes = 0});
  const options opt = parse(argc, argv);
  const MPI_Comm raw = comm.native_handle();
  const bool root = comm.rank() == 0;

  // Seconds of one call of `call`, started together on every rank (a barrier first, outside the timing: which
  // variant ran before must not change how far apart the ranks enter this one).
  const auto time_call = [&](const std::function<void()>& call) {
    MPI_Barrier(raw);
    const auto start = clock_type::now();
    call();
    return std::chrono::duration<double>(clock_type::now() - start).count();
  };
  // The slowest rank's value of `mine`.
  const auto slowest = [&](double mine) {
    MPI_Allreduce(MPI_IN_PLACE, &mine, 1, MPI_DOUBLE, MPI_MAX, raw);
    return mine;
  };

  std::vector<std::size_t> sizes;
  for (std::size_t bytes = opt.min_bytes; bytes <= opt.max_bytes; bytes *= opt.factor) sizes.push_back(bytes);
  // results[size][variant]: one slowest-rank median per round; calls[size]: calls per variant in the last round.
  std::vector<std::array<std::vector<double>, variant_count>> results(sizes.size());
  std::vector<int> calls(sizes.size());
  for (int round = 0; round < opt.rounds; ++round)
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<float> buf(sizes[i] / sizeof(float), 1.0F);
      const int n = static_cast<int>(buf.size());
      std::array<std::function<void()>, variant_count> variants;
      variants[blocking] = [&] { MPI_Allreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, raw); };
      variants[wait] = [&] {
        MPI_Request r = MPI_REQUEST_NULL;
        MPI_Iallreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, raw, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      };
      variants[testing] = [&] {
        MPI_Request r = MPI_REQUEST_NULL;
        MPI_Iallreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, raw, &r);
        for (int flag = 0; flag == 0;) MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
      };
      variants[ddp_default] = [&] { comm.all_reduce(std::span<float>(buf), ddp::reduce_op::sum).wait(); };
      variants[ddp_async] = [&] { async.all_reduce(std::span<float>(buf), ddp::reduce_op::sum).wait(); };
      // Warm up every variant, then size the round from the slowest rank's time of one call (same count everywhere).
      double probe = 0;
      for (const auto& v : variants)
        for (int k = 0; k < 3; ++k) probe = std::max(probe, time_call(v));
      calls[i] = std::clamp(static_cast<int>(opt.budget_ms * 1e-3 / slowest(probe)), 15, opt.calls);
      std::array<std::vector<double>, variant_count> samples;
      for (int c = 0; c < calls[i]; ++c)
        for (std::size_t k = 0; k < variant_count; ++k) {
          const std::size_t v = (k + static_cast<std::size_t>(c)) % variant_count;
          samples[v].push_back(time_call(variants[v]));
        }
      for (std::size_t v = 0; v < variant_count; ++v) results[i][v].push_back(slowest(median(samples[v])));
    }

  if (!root) return 0;
  std::printf("ddp::mpi all_reduce (f32, sum, in place) vs raw Open MPI, N = %d, eager_bytes = %zu: median of %d "
              "rounds of the slowest rank's median per call\n\n",
              comm.size(), comm.settings().eager_bytes, opt.rounds);
  std::printf("| size | calls | Allreduce µs | Iallreduce+Wait µs | Iallreduce+Test loop µs | ddp µs | ddp path | "
              "**ddp vs Allreduce** | range over rounds | ddp async µs | async vs Test loop | async vs Allreduce | "
              "busbw ddp GB/s |\n"
              "|---:|---:|---:|---:|---:|---:|:---|---:|:---|---:|---:|---:|---:|\n");
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::array<double, variant_count> m{};
    for (std::size_t v = 0; v < variant_count; ++v) m[v] = median(results[i][v]);
    double low = 1e300, high = -1e300;
    for (int r = 0; r < opt.rounds; ++r) {
      const double ratio = results[i][ddp_default][r] / results[i][blocking][r];
      low = std::min(low, ratio);
      high = std::max(high, ratio);
    }
    const double busbw = static_cast<double>(sizes[i]) * 2.0 * (comm.size() - 1) / comm.size() / m[ddp_default] / 1e9;
    std::printf("| %s | %d | %.2f | %.2f | %.2f | %.2f | %s | **%+.1f %%** | %+.1f … %+.1f %% | %.2f | %+.1f %% | "
                "%+.1f %% | %.2f |\n",
                human(sizes[i]).c_str(), calls[i], m[blocking] * 1e6, m[wait] * 1e6, m[testing] * 1e6,
                m[ddp_default] * 1e6, comm.eager(sizes[i]) ? "eager" : "async",
                (m[ddp_default] / m[blocking] - 1) * 100, (low - 1) * 100, (high - 1) * 100, m[ddp_async] * 1e6,
                (m[ddp_async] / m[testing] - 1) * 100, (m[ddp_async] / m[blocking] - 1) * 100, busbw);
  }
  return 0;
}
