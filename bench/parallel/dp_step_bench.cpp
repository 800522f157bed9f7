// Step time of ddp::data_parallel (replicate) on the MLP 784-2048-2048-10, batch 64 per rank, SGD with momentum,
// OpenBLAS on one thread, and rank 0's phases: forward+backward, the tail (dp.finish_gradients after the backward;
// how much of it follows the slowest rank's backward) and the optimizer, beside a standalone all_reduce of the last
// bucket. Driven by run_data_parallel.py beside PyTorch DDP; prints one JSON line on rank 0.
//
//   dp_step_bench --backend tcp|mpi [--steps S] [--warmup W] [--batch B] [--bucket-mib 25|4|1] [--deterministic]
//
// --bucket-mib picks the bucket capacity (first bucket 1 MiB, as PyTorch; 25 is PyTorch's default);
// --deterministic sums gradients in rank order (ddp::replicate{.deterministic = true}).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <cblas.h>

#include <ddp/ddp.hpp>
#include <ddp/comm/tcp/communicator.hpp>

#include "common/blas.hpp"
#include "common/mlp.hpp"

namespace {

struct settings {
  std::string backend = "tcp";
  int steps = 30;
  int warmup = 5;
  std::size_t batch = 64;
  int bucket_mib = 25;
  bool deterministic = false;
};

template <class Backend, class Buckets>
int run(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  constexpr std::size_t in = 784, hidden = 2048, classes = 10;
  example::mlp model = example::make_mlp(in, hidden, hidden, classes, 7);
  ddp::data_parallel<example::mlp, Backend, Buckets> dp{model, comm, ddp::replicate{.deterministic = s.deterministic}};
  ddp::optim::sgd opt({.lr = 0.01, .momentum = 0.9});
  std::mt19937_64 rng(static_cast<std::uint64_t>(comm.rank()) + 1);
  std::vector<float> x(s.batch * in);
  std::vector<std::uint8_t> y(s.batch);
  for (auto& v : x) v = static_cast<float>(rng() % 1000) / 1000.0F;
  for (auto& v : y) v = static_cast<std::uint8_t>(rng() % classes);
  example::mlp_trainer trainer;
  using clock = std::chrono::steady_clock;
  const auto ms_of = [](clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  // Per step: its time, and rank 0's phases. The clock is the host's monotonic one, shared by the ranks of one host,
  // so the moment each rank's backward ended can be compared across ranks.
  std::vector<double> ms, compute_ms, tail_ms, optimizer_ms, backward_end, tail_end;
  const auto one_step = [&] {
    const auto t0 = clock::now();
    dp.zero_grad();
    (void)trainer.forward(dp.module(), x, y);
    trainer.backward(dp.module(), [&](auto& p) { dp.gradient_ready(p); });
    const auto t1 = clock::now();
    dp.finish_gradients();  // the tail: what is left of the reductions once this rank's backward is over
    const auto t2 = clock::now();
    dp.step(opt);
    const auto t3 = clock::now();
    ms.push_back(ms_of(t3 - t0));
    compute_ms.push_back(ms_of(t1 - t0));
    tail_ms.push_back(ms_of(t2 - t1));
    optimizer_ms.push_back(ms_of(t3 - t2));
    backward_end.push_back(ms_of(t1.time_since_epoch()));
    tail_end.push_back(ms_of(t2.time_since_epoch()));
  };
  for (int i = 0; i < s.warmup; ++i) one_step();
  for (auto* v : {&ms, &compute_ms, &tail_ms, &optimizer_ms, &backward_end, &tail_end}) v->clear();
  comm.barrier().wait();
  for (int i = 0; i < s.steps; ++i) one_step();
  comm.barrier().wait();
  const auto median_of = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  // The tail splits into waiting for the slowest rank's backward (a straggler: not communication) and what the
  // reductions take after it, ddp's own part: the all_reduce(max) of the backward ends gives the last one per step.
  std::vector<double> last_backward_end = backward_end;
  comm.all_reduce(std::span<double>(last_backward_end), ddp::reduce_op::max).wait();
  std::vector<double> after_last(ms.size());
  for (std::size_t i = 0; i < ms.size(); ++i) after_last[i] = tail_end[i] - last_backward_end[i];
  // The standalone all_reduce of the bucket that starts last (the one the tail waits for), for comparison.
  const auto& last = dp.buckets().buckets.back();
  const std::size_t last_bucket = last.end - last.begin;
  std::vector<float> bucket(last_bucket, 1.0F);
  std::vector<double> alone_ms;
  for (int i = 0; i < 3 + s.steps; ++i) {
    comm.barrier().wait();
    const auto t = clock::now();
    comm.all_reduce(std::span<float>(bucket), ddp::reduce_op::sum).wait();
    if (i >= 3) alone_ms.push_back(ms_of(clock::now() - t));
  }
  comm.all_reduce(std::span<double>(alone_ms), ddp::reduce_op::max).wait();
  const double compute = median_of(compute_ms), tail = median_of(tail_ms), optimizer = median_of(optimizer_ms);
  const double tail_after_last = median_of(after_last), alone = median_of(alone_ms);
  // The job's step time is the slowest rank's: reduce each step's time with max, then take the median.
  comm.all_reduce(std::span<double>(ms), ddp::reduce_op::max).wait();
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  double mean = 0;
  for (const double v : ms) mean += v / static_cast<double>(ms.size());
  if (comm.rank() == 0)
    std::printf("{\"impl\": \"ddp\", \"backend\": \"%s\", \"world\": %d, \"batch\": %zu, \"steps\": %d, "
                "\"median_ms\": %.3f, \"mean_ms\": %.3f, \"forward_backward_ms\": %.3f, \"tail_ms\": %.3f, "
                "\"tail_after_last_backward_ms\": %.3f, \"optimizer_ms\": %.3f, \"last_bucket_bytes\": %zu, "
                "\"last_bucket_all_reduce_ms\": %.3f, \"bucket_mib\": %d, \"buckets\": %zu, \"deterministic\": %s, "
                "\"blas_core\": \"%s\", \"blas_better_core\": \"%s\"}\n",
                s.backend.c_str(), comm.size(), s.batch, s.steps, median, mean, compute, tail, tail_after_last,
                optimizer, last_bucket * sizeof(float), alone, s.bucket_mib, dp.bucket_count(),
                s.deterministic ? "true" : "false", example::blas_core().c_str(), example::blas_better_core().c_str());
  return 0;
}

/// run() with the bucket capacity chosen on the command line.
template <class Backend>
int run_with_buckets(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  switch (s.bucket_mib) {
    case 25: return run<Backend, ddp::bucket_bytes<25 << 20, 1 << 20>>(std::move(comm), s);
    case 4: return run<Backend, ddp::bucket_bytes<4 << 20, 1 << 20>>(std::move(comm), s);
    case 1: return run<Backend, ddp::bucket_bytes<1 << 20, 1 << 20>>(std::move(comm), s);
    default: throw ddp::config_error("--bucket-mib must be 25, 4 or 1");
  }
}

}  // namespace

int main(int argc, char** argv) {
  openblas_set_num_threads(1);
  try {
    settings s;
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      if (a == "--deterministic") {
        s.deterministic = true;
        continue;
      }
      if (i + 1 >= argc) throw ddp::config_error("'" + std::string(a) + "' needs a value");
      const char* v = argv[++i];
      if (a == "--backend") s.backend = v;
      else if (a == "--steps") s.steps = std::atoi(v);
      else if (a == "--warmup") s.warmup = std::atoi(v);
      else if (a == "--batch") s.batch = static_cast<std::size_t>(std::atol(v));
      else if (a == "--bucket-mib") s.bucket_mib = std::atoi(v);
      else throw ddp::config_error("unknown argument '" + std::string(a) + "'; use --backend, --steps, --warmup, --batch, --bucket-mib, --deterministic");
    }
    if (s.steps < 1) throw ddp::config_error("--steps must be at least 1");
    if (s.backend == "mpi") {
#if defined(DDP_WITH_MPI)
      return run_with_buckets<ddp::backend::mpi>(ddp::mpi::communicator::world(argc, argv), s);
#else
      throw ddp::config_error("built without MPI; reconfigure with -DDDP_WITH_MPI=ON or use --backend tcp");
#endif
    }
    if (s.backend != "tcp") throw ddp::config_error("--backend must be tcp or mpi");
    return run_with_buckets<ddp::backend::tcp>(ddp::tcp::communicator::from_env(), s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_step_bench: %s\n", e.what());
    return 2;
  }
}
