// Step time of a LibTorch CNN (examples/common/cnn.hpp, the one of examples/libtorch_fashion_mnist; batch 64 of
// 1×28×28, SGD with momentum, one LibTorch thread) at N = 1: plain LibTorch against the same model under ddp's LibTorch
// adapter (data_parallel over TCP in one process: arenas, autograd hooks, buckets, the step), in the same run. Rounds
// of each alternate (by default single steps, 401 of each: on a shared machine longer rounds catch different load), so
// both see the same machine; the median round of each is compared.
//
//   libtorch_step_bench [--rounds R] [--steps S (per round)] [--batch B] [--only plain|ddp]
//
// Prints one line per variant and the ratio (ddp / plain), with each variant's minor page faults and context
// switches per step, then one JSON line. --only runs one variant alone, as a user's program would run (the driver
// run_libtorch_step.py interleaves such processes). `--only ddp` under a launcher (WORLD_SIZE set: ddp-launch, mpirun
// with the env:// variables) trains at N ranks, each on its own batch, and rank 0 prints the median over rounds of
// the slowest rank's round: the side of run_libtorch_ddp.py that torch_ddp_cnn.py's PyTorch DDP stands against.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include <ddp/adapters/libtorch.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/ddp.hpp>

#include "common/cnn.hpp"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 401, steps = 1;
  std::int64_t batch = 64;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    if (a == "--rounds") rounds = std::stoi(argv[i + 1]);
    else if (a == "--steps") steps = std::stoi(argv[i + 1]);
    else if (a == "--batch") batch = std::stoll(argv[i + 1]);
    else if (a == "--only") only = argv[i + 1];
  }
  if (!only.empty() && only != "plain" && only != "ddp") {
    std::fprintf(stderr, "libtorch_step_bench: --only takes plain or ddp, not '%s'\n", only.c_str());
    return 2;
  }
  torch::set_num_threads(1);
  const bool launched = only == "ddp" && std::getenv("WORLD_SIZE") != nullptr;
  std::optional<ddp::tcp::communicator> comm;
  if (only != "plain")
    comm.emplace(launched ? ddp::tcp::communicator::from_env() : ddp::tcp::communicator(ddp::tcp::config{}));
  const int rank = comm ? comm->rank() : 0;
  torch::manual_seed(1 + rank);  // each rank its own batch
  const torch::Tensor x = torch::randn({batch, 1, 28, 28});
  const torch::Tensor y = torch::randint(0, 10, {batch}, torch::kLong);

  torch::manual_seed(2);
  auto plain = std::make_shared<example::cnn_impl>();
  torch::manual_seed(2);
  auto wrapped = std::make_shared<example::cnn_impl>();
  // Not made for --only plain: that process runs as a program without ddp would.
  std::optional<ddp::data_parallel<example::cnn_impl, ddp::backend::tcp>> dp;
  if (only != "plain") dp.emplace(*wrapped, std::move(*comm));
  const auto sgd = torch::optim::SGDOptions(0.01).momentum(0.9);
  torch::optim::SGD plain_opt(plain->parameters(), sgd), dp_opt(wrapped->parameters(), sgd);

  auto plain_step = [&] {
    plain_opt.zero_grad();
    torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
    plain_opt.step();
  };
  auto dp_step = [&] {
    dp->zero_grad();
    torch::nn::functional::cross_entropy(wrapped->forward(x), y).backward();
    dp->step(dp_opt);
  };
  struct counts {
    long faults = 0, switches = 0, steps = 0;
    [[nodiscard]] double faults_per_step() const { return steps ? static_cast<double>(faults) / steps : 0; }
    [[nodiscard]] double switches_per_step() const { return steps ? static_cast<double>(switches) / steps : 0; }
  } plain_counts, dp_counts;
  auto round_ms = [&](auto& step, counts& c) {
    rusage before{}, after{};
    ::getrusage(RUSAGE_SELF, &before);
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s) step();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
    ::getrusage(RUSAGE_SELF, &after);
    c.faults += after.ru_minflt - before.ru_minflt;
    c.switches += (after.ru_nvcsw - before.ru_nvcsw) + (after.ru_nivcsw - before.ru_nivcsw);
    c.steps += steps;
    return ms;
  };
  for (int w = 0; w < 10; ++w) {  // warm-up: allocator, first touch of the optimizer state
    if (only != "ddp") plain_step();
    if (only != "plain") dp_step();
  }
  if (!only.empty()) {  // one variant, as its own program
    std::vector<double> ms;
    counts& c = only == "plain" ? plain_counts : dp_counts;
    for (int r = 0; r < rounds; ++r) ms.push_back(only == "plain" ? round_ms(plain_step, c) : round_ms(dp_step, c));
    int world = 1;
    if (dp) {  // a round of the job lasts as long as its slowest rank's
      auto& group = dp->comm();
      world = group.size();
      group.all_reduce(std::span<double>(ms), ddp::reduce_op::max).wait();
    }
    if (rank == 0)
      std::printf("{\"bench\": \"libtorch_step\", \"variant\": \"%s\", \"world\": %d, \"median_ms\": %.4f, "
                  "\"batch\": %lld, \"faults_per_step\": %.2f, \"switches_per_step\": %.3f}\n",
                  only.c_str(), world, median(ms), static_cast<long long>(batch), c.faults_per_step(),
                  c.switches_per_step());
    return 0;
  }
  std::vector<double> plain_ms, dp_ms;
  for (int r = 0; r < rounds; ++r) {
    if (r % 2 == 0) {
      plain_ms.push_back(round_ms(plain_step, plain_counts));
      dp_ms.push_back(round_ms(dp_step, dp_counts));
    } else {
      dp_ms.push_back(round_ms(dp_step, dp_counts));
      plain_ms.push_back(round_ms(plain_step, plain_counts));
    }
  }
  const double p = median(plain_ms), d = median(dp_ms);
  const bool same = torch::allclose(plain->fc2->weight, wrapped->fc2->weight, 1e-4, 1e-5);
  std::printf("plain LibTorch          %8.3f ms/step (median of %d rounds of %d steps, batch %lld)\n", p, rounds, steps,
              static_cast<long long>(batch));
  std::printf("ddp LibTorch adapter    %8.3f ms/step\n", d);
  std::printf("per step: minor page faults plain %.1f, ddp %.1f; context switches plain %.2f, ddp %.2f\n",
              plain_counts.faults_per_step(), dp_counts.faults_per_step(), plain_counts.switches_per_step(),
              dp_counts.switches_per_step());
  std::printf("ratio ddp/plain         %8.4f (%+.2f %% overhead); same parameters after training: %s\n", d / p,
              (d / p - 1) * 100, same ? "yes" : "NO");
  std::printf("{\"bench\": \"libtorch_step\", \"plain_ms\": %.4f, \"ddp_ms\": %.4f, \"ratio\": %.4f, \"batch\": %lld}\n", p,
              d, d / p, static_cast<long long>(batch));
  return same ? 0 : 1;
}
