#pragma once
// The naive MLP of the sharding benchmarks (bench_sharding, bench/multihost's link bench): layers "fc1",
// "fc2", ... as the sharding units, deterministic weights, and one step's forward and backward in plain loops,
// each layer inside an unshard scope so that every policy (replicate .. full_shard) can run it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <ddp/ddp.hpp>

namespace bench {

/// One fully connected layer.
struct linear {
  ddp::parameter<float> weight, bias;
};

/// An MLP whose layers are the units ("fc1", "fc2", ...).
struct mlp {
  std::vector<linear> fc;
  template <class F>
  void visit_parameters(F&& f) {
    for (std::size_t i = 0; i < fc.size(); ++i) f("fc" + std::to_string(i + 1), fc[i]);
  }
};

/// An MLP of the given layer widths, weights from a fixed-seed generator (the same on every rank).
inline mlp make_mlp(const std::vector<std::size_t>& dims) {
  mlp m;
  std::uint64_t state = 42;
  for (std::size_t l = 0; l + 1 < dims.size(); ++l) {
    std::vector<float> w(dims[l] * dims[l + 1]);
    const float bound = 1.0F / static_cast<float>(std::sqrt(double(dims[l])));
    for (auto& v : w) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      v = bound * (static_cast<float>(state >> 40) / float(1 << 23) - 1.0F);
    }
    m.fc.push_back({ddp::parameter<float>({dims[l + 1], dims[l]}, std::move(w)), ddp::parameter<float>({dims[l + 1]})});
  }
  return m;
}

/// x·y over n elements in 16 running sums, which the compiler vectorizes (a single running sum is a chain of
/// dependent scalar additions, which made the forward five times slower than the backward).
inline float dot(const float* x, const float* y, std::size_t n) {
  float part[16] = {};
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (std::size_t k = 0; k < 16; ++k) part[k] += x[i + k] * y[i + k];
  float acc = 0;
  for (; i < n; ++i) acc += x[i] * y[i];
  for (const float p : part) acc += p;
  return acc;
}

/// Does nothing (forward_backward's default for `at_backward`).
struct no_callback {
  void operator()() const noexcept {}
};

/// One training step's forward and backward (ReLU hidden layers, squared error), each layer inside an unshard
/// scope; `at_backward()` runs between them.
template <class DP, class AtBackward = no_callback>
void forward_backward(DP& dp, mlp& m, std::size_t batch, AtBackward at_backward = {}) {
  const std::size_t layers = m.fc.size();
  std::vector<std::vector<float>> acts(layers + 1);
  acts[0].assign(batch * m.fc[0].weight.shape()[1], 0.5F);
  for (std::size_t l = 0; l < layers; ++l) {
    auto g = dp.unshard(m.fc[l]);
    const std::size_t out = m.fc[l].weight.shape()[0], in = m.fc[l].weight.shape()[1];
    acts[l + 1].assign(batch * out, 0.0F);
    const float* w = m.fc[l].weight.value().data();
    for (std::size_t o = 0; o < out; ++o)  // a row of weights stays in cache across the batch
      for (std::size_t s = 0; s < batch; ++s) {
        const float acc = m.fc[l].bias.value()[o] + dot(&w[o * in], &acts[l][s * in], in);
        acts[l + 1][s * out + o] = l + 1 < layers ? std::max(acc, 0.0F) : acc;
      }
  }
  at_backward();
  std::vector<float> delta = acts[layers];  // d(½‖y‖²)/dy = y
  for (std::size_t l = layers; l-- > 0;) {
    auto g = dp.unshard(m.fc[l]);
    const std::size_t out = m.fc[l].weight.shape()[0], in = m.fc[l].weight.shape()[1];
    std::vector<float> back(batch * in, 0.0F);
    float* gw = m.fc[l].weight.grad().data();
    const float* w = m.fc[l].weight.value().data();
    for (std::size_t s = 0; s < batch; ++s)
      for (std::size_t o = 0; o < out; ++o) {
        const float d = delta[s * out + o] / static_cast<float>(batch);
        m.fc[l].bias.grad()[o] += d;
        const float* x = &acts[l][s * in];
        float* b = &back[s * in];
        for (std::size_t i = 0; i < in; ++i) {
          gw[o * in + i] += d * x[i];
          b[i] += d * w[o * in + i];
        }
      }
    dp.gradient_ready(m.fc[l].bias);
    dp.gradient_ready(m.fc[l].weight);
    if (l > 0)
      for (std::size_t i = 0; i < back.size(); ++i) back[i] = acts[l][i] > 0 ? back[i] * static_cast<float>(batch) : 0;
    delta = std::move(back);
  }
}

}  // namespace bench
