#pragma once
// What the checkpoint tests share: a two-unit model, a fake backward whose rank-dependent gradients average to the
// same value at every world size (so trainings at different N agree within rounding), snapshots, shared paths.
#include <cmath>
#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include <catch2/catch.hpp>

#include <ddp/comm/object.hpp>
#include <ddp/core/parameter.hpp>
#include <ddp/parallel/data_parallel.hpp>

namespace {

struct linear {
  ddp::parameter<float> weight, bias;
};
struct net {
  linear fc1, fc2;
};

template <class Backend, class Sharding = ddp::replicate>
using dp_t = ddp::data_parallel<net, Backend, Sharding, ddp::bucket_bytes<256, 64>>;

net make_net(float seed, std::size_t hidden = 7) {
  auto fill = [&](std::vector<std::size_t> shape, float k) {
    ddp::parameter<float> p(shape);
    for (std::size_t i = 0; i < p.numel(); ++i) p.value()[i] = std::sin(seed + k + 0.37F * static_cast<float>(i));
    return p;
  };
  return {{fill({hidden, 5}, 1), fill({hidden}, 2)}, {fill({3, hidden}, 3), fill({3}, 4)}};
}

/// A fake backward, reported in reverse visit order, then one optimizer step. Rank r's gradient is a common part
/// plus (r − (N−1)/2)·sin(0.3 i), whose average over the ranks is zero: the averaged gradient is the same at any N.
template <class DP, class Opt>
void train_steps(DP& dp, Opt& opt, int steps) {
  const float spread = static_cast<float>(dp.rank()) - 0.5F * static_cast<float>(dp.world_size() - 1);
  for (int s = 0; s < steps; ++s) {
    dp.zero_grad();
    auto& m = dp.module();
    {
      auto whole = dp.unshard(m);  // full_shard: the tiny model's units are all unsharded for this backward
      for (auto* p : {&m.fc2.bias, &m.fc2.weight, &m.fc1.bias, &m.fc1.weight}) {
        for (std::size_t i = 0; i < p->numel(); ++i) {
          const auto x = static_cast<float>(i);
          p->grad()[i] = std::cos(0.1F * (x + 1) + static_cast<float>(s)) + 0.5F * p->value()[i] + spread * std::sin(0.3F * x);
        }
        dp.gradient_ready(*p);
      }
    }
    dp.step(opt);
  }
}

/// Every parameter value in visit order (unsharded under full_shard).
template <class DP>
std::vector<float> parameters_of(DP& dp) {
  std::vector<float> out;
  auto whole = dp.unshard(dp.module());
  dp.for_each_parameter([&](const auto&, ddp::parameter<float>& p) { out.insert(out.end(), p.value().begin(), p.value().end()); });
  return out;
}

/// Every value of the model and the optimizer, flattened in a fixed order (replicate: the state is whole).
template <class DP, class Opt>
std::vector<double> snapshot(DP& dp, Opt& opt) {
  std::vector<double> out;
  for (const float v : parameters_of(dp)) out.push_back(v);
  opt.for_each_state([&](const std::string&, ddp::raw_tensor v) {
    const auto* f = static_cast<const float*>(v.data);
    out.insert(out.end(), f, f + v.size);
  });
  return out;
}

/// Largest |a − b| / max(|b|, 1e-2) over the elements (the tolerance measure of the sharded-checkpoint tests).
template <class A, class B>
double relative_difference(const std::vector<A>& a, const std::vector<B>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])) / std::max(std::abs(double(b[i])), 1e-2));
  return worst;
}

/// A path every rank agrees on (rank 0's pid), removed (with its contents) at scope exit.
struct shared_path {
  std::filesystem::path path;
  template <class Comm>
  shared_path(Comm& comm, const std::string& tag, const std::string& extension = ".safetensors") {
    std::string p = (std::filesystem::temp_directory_path() / ("ddp_ckpt_" + std::to_string(::getpid()) + "_" + tag +
                                                               extension)).string();
    ddp::broadcast_object(comm, p, 0);
    path = p;
  }
  ~shared_path() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace
