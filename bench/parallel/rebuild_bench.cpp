// When the first gradient bucket starts, with buckets planned in reverse visit order and rebuilt in the first
// step's ready order (data_parallel_options::rebuild_buckets), on the MLP 784-2048-2048-10 visited last layer
// first (fc3, fc2, fc1), so its visit order differs from its backward's (fc3 first). N ranks over TCP
// (forked by ddp::launch::spawn), batch 64 per rank, OpenBLAS on one thread. Per step, rank 0 measures the
// time from the backward's start to the first collective it started, and the backward's duration; it prints
// one JSON line per setting with their medians over the steps after the first.
//
//   rebuild_bench [--world 2] [--steps 30] [--warmup 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <cblas.h>

#include <ddp/ddp.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/launch.hpp>

#include "common/mlp.hpp"

namespace {

/// example::mlp visited fc3, fc2, fc1.
struct reversed_mlp {
  example::mlp& m;
  template <class F>
  void visit_parameters(F&& f) {
    f("fc3.weight", m.fc3.weight);
    f("fc3.bias", m.fc3.bias);
    f("fc2.weight", m.fc2.weight);
    f("fc2.bias", m.fc2.bias);
    f("fc1.weight", m.fc1.weight);
    f("fc1.bias", m.fc1.bias);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run(bool rebuild, int steps, int warmup) {
  using clock = std::chrono::steady_clock;
  auto comm = ddp::tcp::communicator::from_env();
  constexpr std::size_t in = 784, hidden = 2048, classes = 10, batch = 64;
  example::mlp model = example::make_mlp(in, hidden, hidden, classes, 7);
  reversed_mlp view{model};
  ddp::data_parallel dp{view, comm, ddp::data_parallel_options{.rebuild_buckets = rebuild}};
  ddp::optim::sgd opt({.lr = 0.01, .momentum = 0.9});
  std::mt19937_64 rng(static_cast<std::uint64_t>(comm.rank()) + 1);
  std::vector<float> x(batch * in);
  std::vector<std::uint8_t> y(batch);
  for (auto& v : x) v = static_cast<float>(rng() % 1000) / 1000.0F;
  for (auto& v : y) v = static_cast<std::uint8_t>(rng() % classes);
  example::mlp_trainer trainer;
  std::vector<double> first_start_ms, backward_ms;
  for (int s = 0; s < warmup + steps; ++s) {
    dp.zero_grad();
    (void)trainer.forward(model, x, y);
    const auto started = [&] { return dp.comm().stats().count(ddp::collective::all_reduce); };
    const auto before = started();
    const auto t0 = clock::now();
    double first = -1;
    trainer.backward(model, [&](auto& p) {
      dp.gradient_ready(p);
      if (first < 0 && started() != before) first = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
    });
    const double whole = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
    dp.step(opt);
    if (s < warmup) continue;
    first_start_ms.push_back(first < 0 ? whole : first);
    backward_ms.push_back(whole);
  }
  if (comm.rank() == 0) {
    const double f = median(first_start_ms), b = median(backward_ms);
    std::printf("{\"rebuild_buckets\": %s, \"world\": %d, \"steps\": %d, \"buckets\": %zu, \"first_start_ms\": %.3f, "
                "\"backward_ms\": %.3f, \"first_start_fraction\": %.3f}\n",
                rebuild ? "true" : "false", comm.size(), steps, dp.bucket_count(), f, b, f / b);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  openblas_set_num_threads(1);
  int world = 2, steps = 30, warmup = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--world") world = v;
    else if (a == "--steps") steps = v;
    else if (a == "--warmup") warmup = v;
    else {
      std::fprintf(stderr, "rebuild_bench: unknown argument '%s'; use --world, --steps, --warmup\n", argv[i]);
      return 2;
    }
  }
  if (steps < 1 || warmup < 1) {
    std::fprintf(stderr, "rebuild_bench: --steps and --warmup must be at least 1 (the first step records the order)\n");
    return 2;
  }
  for (const bool rebuild : {false, true}) {
    const auto result = ddp::launch::spawn(world, [&](int) { run(rebuild, steps, warmup); });
    if (!result.ok()) {
      std::fprintf(stderr, "rebuild_bench: a rank failed\n");
      return 1;
    }
  }
  return 0;
}
