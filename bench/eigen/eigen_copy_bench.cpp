// The per-step cost of the copies the Eigen adapter makes for owning Eigen::Matrix members, against Eigen::Map
// members that ddp points at its arenas (zero copies): the MLP 784-2048-2048-10 (5.8 M parameters, 23 MB of
// f32), Eigen GEMMs on one thread, batch 64 per rank, SGD with momentum, replicate. Both models are wrapped in
// the same run and stepped alternately, so they share the machine's noise; rank 0 prints each one's median and
// fastest step, the difference (the copies: each step copies every gradient in, every value out and zeroes the
// matrices' own gradients), the ratio, and the difference of each phase's median.
//
//   eigen_copy_bench [--steps S] [--warmup W] [--batch B]         (one process)
//   ddp-launch -n 2 eigen_copy_bench                               (two ranks over TCP)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/ddp.hpp>

#include "bench/common/numbers.hpp"
#include "common/eigen_mlp.hpp"

namespace {

struct settings {
  int steps = 20;
  int warmup = 3;
  std::size_t batch = 64;
};

settings parse(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) throw ddp::config_error(std::string(a) + " needs a value; usage: eigen_copy_bench [--steps S] [--warmup W] [--batch B]");
    if (a == "--steps") s.steps = std::stoi(argv[++i]);
    else if (a == "--warmup") s.warmup = std::stoi(argv[++i]);
    else if (a == "--batch") s.batch = std::stoul(argv[++i]);
    else throw ddp::config_error("unknown argument '" + std::string(a) + "'; usage: eigen_copy_bench [--steps S] [--warmup W] [--batch B]");
  }
  if (s.steps < 1 || s.batch < 1) throw ddp::config_error("--steps and --batch must be at least 1");
  return s;
}

/// One model of Storage wrapped by data_parallel, and its step times.
template <example::eigen_storage Storage>
struct runner {
  using model_type = example::eigen_mlp<Storage>;
  model_type model;
  ddp::data_parallel<model_type, ddp::backend::tcp> dp;
  ddp::optim::sgd opt;
  example::eigen_trainer trainer;
  std::vector<double> ms, zero_ms, backward_ms, step_ms;  // whole step; its zero_grad, forward+backward, step

  runner(ddp::tcp::communicator comm, std::size_t in, std::size_t hidden, std::size_t classes)
      : model(in, hidden, hidden, classes, 7), dp(model, std::move(comm)), opt({.lr = 0.01, .momentum = 0.9}) {}
  void step(const std::vector<float>& x, const std::vector<std::uint8_t>& y, bool timed) {
    using clock = std::chrono::steady_clock;
    const auto ms_between = [](clock::time_point a, clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    const auto t0 = clock::now();
    dp.zero_grad();  // Matrix members: also zeroes their own gradients
    const auto t1 = clock::now();
    (void)trainer.forward(model, x, y);
    trainer.backward(model, [&](auto& leaf) { dp.gradient_ready(leaf); });  // Matrix members: gradient copied in
    const auto t2 = clock::now();
    dp.step(opt);  // Matrix members: values copied out
    const auto t3 = clock::now();
    if (!timed) return;
    ms.push_back(ms_between(t0, t3));
    zero_ms.push_back(ms_between(t0, t1));
    backward_ms.push_back(ms_between(t1, t2));
    step_ms.push_back(ms_between(t2, t3));
  }
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const settings s = parse(argc, argv);
    const bool launched = std::getenv("WORLD_SIZE") != nullptr;
    auto comm = launched ? ddp::tcp::communicator::from_env() : ddp::tcp::communicator(ddp::tcp::config{});
    constexpr std::size_t in = 784, hidden = 2048, classes = 10;
    runner<example::eigen_storage::matrix> copied(comm, in, hidden, classes);
    runner<example::eigen_storage::map> adopted(comm, in, hidden, classes);
    std::mt19937_64 rng(static_cast<std::uint64_t>(comm.rank()) + 1);
    std::vector<float> x(s.batch * in);
    std::vector<std::uint8_t> y(s.batch);
    for (auto& v : x) v = static_cast<float>(rng() % 1000) / 1000.0F;
    for (auto& v : y) v = static_cast<std::uint8_t>(rng() % classes);
    for (int i = 0; i < s.warmup + s.steps; ++i) {  // alternate, so both see the same machine
      copied.step(x, y, i >= s.warmup);
      adopted.step(x, y, i >= s.warmup);
    }
    double params = 0;
    copied.dp.for_each_parameter([&](std::string_view, const auto& leaf) { params += static_cast<double>(leaf.values().size()); });
    const double matrix_ms = bench::median(copied.ms), map_ms = bench::median(adopted.ms);
    const double matrix_min = *std::min_element(copied.ms.begin(), copied.ms.end());
    const double map_min = *std::min_element(adopted.ms.begin(), adopted.ms.end());
    if (comm.rank() == 0)
      std::printf("eigen_copy_bench: N = %d, MLP %zu-%zu-%zu-%zu (%.2f M parameters, %.1f MB f32), batch %zu per rank, "
                  "%d steps each\n"
                  "  Eigen::Matrix members (copied): median %8.2f ms/step, min %8.2f\n"
                  "  Eigen::Map members (adopted):   median %8.2f ms/step, min %8.2f\n"
                  "  copies: median %.2f ms/step (%.1f%% of the Map step, Matrix/Map ratio %.3f); min %.2f ms (ratio %.3f)\n"
                  "  by phase (medians), Matrix - Map: zero_grad %+.2f ms, forward+backward (gradients in) %+.2f ms, "
                  "step (values out) %+.2f ms\n",
                  comm.size(), in, hidden, hidden, classes, params / 1e6, params * 4 / 1e6, s.batch, s.steps,
                  matrix_ms, matrix_min, map_ms, map_min, matrix_ms - map_ms, 100 * (matrix_ms - map_ms) / map_ms,
                  matrix_ms / map_ms, matrix_min - map_min, matrix_min / map_min,
                  bench::median(copied.zero_ms) - bench::median(adopted.zero_ms),
                  bench::median(copied.backward_ms) - bench::median(adopted.backward_ms),
                  bench::median(copied.step_ms) - bench::median(adopted.step_ms));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "eigen_copy_bench: %s\n", e.what());
    return 2;
  }
}
