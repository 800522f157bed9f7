// Bytes moved per step and memory per rank of data_parallel under replicate, shard_grad_op and
// full_shard, beside the theory; plus step time. Every configuration runs as its own job of N forked
// ranks over the TCP backend (ddp::launch::spawn); rank 0 prints one result line.
//
//   bench_sharding [--model small|large] [--ranks 1,2,4] [--steps 3] [--batch 64]
//
// small: MLP 784-2048-2048-10 (the bench MLP); large: 784-10000-6000-6000-10 (≈ 100 M parameters,
// run at batch 1 so the naive CPU loops stay fast). Optimizer AdamW (2 state arrays).
// Sharded policies run twice: with the pooled unit buffers kept between steps (the default) and "lean"
// (the policy's keep_unit_buffers = false: freed after every step). hybrid<full_shard> runs at even
// N ≥ 4 in groups of G = 2: bytes inside a group (theory 3·Ψ·(G−1)/G) and across groups (an all_reduce of the
// Ψ/G shard among W/G replicas: 2·(Ψ/G)·(W/G − 1)/(W/G)), ZeRO formula 16Ψ'/G.
// "persistent" is the rank's resident memory between steps (after malloc_trim) minus its resident memory
// before the communicator and model were made; the ZeRO formula (f32, AdamW) is 16Ψ' bytes for replicate,
// 4Ψ' + 12Ψ'/N for shard_grad_op and 16Ψ'/N for full_shard (Ψ' parameters).
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/ddp.hpp>
#include <ddp/launch.hpp>

#include "bench/common/numbers.hpp"
#include "naive_mlp.hpp"

namespace {

using bench::forward_backward;
using bench::make_mlp;
using bench::mlp;

double rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}
double peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

struct settings {
  std::string model = "small";
  std::vector<int> ranks{1, 2, 4};
  int steps = 3;
  std::size_t batch = 64;
};

template <class Sharding>
void run_rank(const settings& s, const std::vector<std::size_t>& dims, std::string_view policy) {
  const double base = rss_mib();
  auto comm = ddp::tcp::communicator::from_env();
  mlp model = make_mlp(dims);
  Sharding sharding{};
  const bool hybrid = policy.starts_with("hybrid");
  if constexpr (requires { sharding.group_size; }) {
    sharding.group_size = 2;
    sharding.inner.keep_unit_buffers = !policy.ends_with(" lean");  // lean: pooled unit buffers freed after every step
  } else if constexpr (requires { sharding.keep_unit_buffers; }) {
    sharding.keep_unit_buffers = !policy.ends_with(" lean");
  }
  ddp::data_parallel dp{model, comm, sharding, ddp::bucket_bytes<(25U << 20)>{}};
  ddp::optim::adamw opt({.lr = 1e-4});
  dp.attach(opt);
  dp.zero_grad();
  forward_backward(dp, model, s.batch);  // warm-up step: state allocated, pages touched
  dp.step(opt);
  const auto group = dp.shard_group();
  const auto replicas = dp.replica_group();
  // Bytes this rank sent: on the world (and, under hybrid, inside its shard group), and across the groups.
  const auto inside = [&] { return comm.stats().total_bytes() + (hybrid ? group.stats().total_bytes() : 0); };
  const auto across = [&] { return replicas ? replicas->stats().total_bytes() : std::uint64_t{0}; };
  const auto before_inside = inside();
  const auto before_across = across();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < s.steps; ++i) {
    dp.zero_grad();
    forward_backward(dp, model, s.batch);
    dp.step(opt);
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / s.steps;
  const double moved = static_cast<double>(inside() - before_inside) / s.steps;
  const double moved_across = static_cast<double>(across() - before_across) / s.steps;
  ::malloc_trim(0);  // freed heap (the model's own storage before binding, activations) back to the OS
  const double persistent = rss_mib() - base;
  double params = 0;
  dp.for_each_parameter([&](std::string_view, ddp::parameter<float>& p) { params += static_cast<double>(p.numel()); });
  if (comm.rank() == 0) {
    const double psi = params * 4, n = comm.size();
    const double factor = policy.find("full_shard") != std::string_view::npos ? 3.0 : 2.0;
    const double mib = 1 << 20;
    if (hybrid) {  // inside a group of G: Inner's bytes over G ranks; across the W/G groups: all_reduce of Ψ/G
      const double g = group.size(), replicas_n = n / g;
      const double zero = 4 * psi / g;  // full_shard inside the group
      std::printf("| %s, G = %d | %d | %.1f | %.3f inside + %.3f across | %.3f + %.3f | %.1f | %.1f | %.1f | %.0f |\n",
                  std::string(policy).c_str(), group.size(), comm.size(), params / 1e6, moved / mib, moved_across / mib,
                  factor * psi * (g - 1) / g / mib, 2 * psi / g * (replicas_n - 1) / replicas_n / mib, persistent,
                  zero / mib, peak_rss_mib(), ms);
      return;
    }
    const double zero = policy == "replicate" ? 4 * psi : policy.starts_with("shard_grad_op") ? psi + 3 * psi / n : 4 * psi / n;
    std::printf("| %s | %d | %.1f | %.3f | %.3f | %.1f | %.1f | %.1f | %.0f |\n", std::string(policy).c_str(),
                comm.size(), params / 1e6, moved / mib, factor * psi * (n - 1) / n / mib, persistent,
                zero / mib, peak_rss_mib(), ms);
  }
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view key = argv[i];
    const std::string value = argv[i + 1];
    if (key == "--model") s.model = value;
    else if (key == "--steps") s.steps = std::stoi(value);
    else if (key == "--batch") s.batch = std::stoul(value);
    else if (key == "--ranks") s.ranks = bench::comma_list<int>(value, "--ranks");
    else {
      std::cerr << "usage: bench_sharding [--model small|large] [--ranks 1,2,4] [--steps 3] [--batch 64]\n";
      return 2;
    }
  }
  const std::vector<std::size_t> dims = s.model == "large" ? std::vector<std::size_t>{784, 10000, 6000, 6000, 10}
                                                           : std::vector<std::size_t>{784, 2048, 2048, 10};
  if (s.model == "large" && s.batch == 64) s.batch = 1;
  std::printf("model %s, batch %zu per rank, AdamW, %d timed steps, TCP backend\n\n", s.model.c_str(), s.batch, s.steps);
  std::printf("| policy | N | params (M) | MiB moved/step/rank | theory MiB | persistent MiB/rank | ZeRO formula MiB | peak RSS MiB | step ms |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  int status = 0;
  for (const int n : s.ranks) {
    for (const std::string_view policy :
         {"replicate", "shard_grad_op", "shard_grad_op lean", "full_shard", "full_shard lean", "hybrid<full_shard>"}) {
      if (policy.starts_with("hybrid") && (n < 4 || n % 2 != 0)) continue;  // 2 groups of 2 or more
      ddp::launch::spawn_options o;
      o.timeout = std::chrono::minutes(10);
      const auto result = ddp::launch::spawn(
          n,
          [&](int) {
            if (policy == "replicate") run_rank<ddp::replicate>(s, dims, policy);
            else if (policy.starts_with("shard_grad_op")) run_rank<ddp::shard_grad_op>(s, dims, policy);
            else if (policy.starts_with("hybrid")) run_rank<ddp::hybrid<ddp::full_shard>>(s, dims, policy);
            else run_rank<ddp::full_shard>(s, dims, policy);
            std::fflush(stdout);
          },
          o);
      if (!result.ok()) {
        std::cerr << policy << " at N=" << n << ": " << result.describe() << "\n";
        status = 1;
      }
    }
  }
  return status;
}
