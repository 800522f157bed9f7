#pragma once
// A small real model for the data_parallel tests: a 3-layer tanh MLP (7-13-11-5, odd sizes so bucket
// boundaries fall inside and between parameters) with a hand-written forward and backward on batches,
// and a reference trainer that steps each parameter as its own flat buffer (one process, no wrapper).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/core/parameter.hpp>
#include <ddp/core/visit.hpp>
#include <ddp/optim/flat.hpp>

namespace ddp_test {

struct linear {
  ddp::parameter<float> weight;  // [out, in]
  ddp::parameter<float> bias;    // [out]
};

struct mlp {
  linear fc1, fc2, fc3;
};

/// Deterministic uniform numbers in [-1, 1).
class lcg {
 public:
  explicit lcg(std::uint64_t seed) : state_(seed * 6364136223846793005ULL + 1442695040888963407ULL) {}
  float next() {
    state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<float>(static_cast<double>(state_ >> 40) / double(1ULL << 23) - 1.0);
  }

 private:
  std::uint64_t state_;
};

inline constexpr std::size_t in_dim = 7, h1_dim = 13, h2_dim = 11, out_dim = 5;

inline linear make_linear(lcg& g, std::size_t in, std::size_t out) {
  const float bound = 1.0F / std::sqrt(static_cast<float>(in));
  std::vector<float> w(in * out), b(out);
  for (auto& v : w) v = bound * g.next();
  for (auto& v : b) v = bound * g.next();
  return {ddp::parameter<float>({out, in}, std::move(w)), ddp::parameter<float>({out}, std::move(b))};
}

/// An MLP whose values depend on `seed`; `h2` changes the second hidden width (for mismatch tests).
inline mlp make_mlp(std::uint64_t seed, std::size_t h2 = h2_dim) {
  lcg g(seed);
  mlp m;
  m.fc1 = make_linear(g, in_dim, h1_dim);
  m.fc2 = make_linear(g, h1_dim, h2);
  m.fc3 = make_linear(g, h2, out_dim);
  return m;
}

struct batch {
  std::vector<float> x;  // [n, in_dim]
  std::vector<float> y;  // [n, out_dim]
  std::size_t n = 0;
  /// Samples [begin, begin + count).
  [[nodiscard]] batch slice(std::size_t begin, std::size_t count) const {
    return {{x.begin() + long(begin * in_dim), x.begin() + long((begin + count) * in_dim)},
            {y.begin() + long(begin * out_dim), y.begin() + long((begin + count) * out_dim)},
            count};
  }
};

inline batch make_batch(std::uint64_t seed, std::size_t n) {
  lcg g(seed + 1000);
  batch b{std::vector<float>(n * in_dim), std::vector<float>(n * out_dim), n};
  for (auto& v : b.x) v = g.next();
  for (auto& v : b.y) v = g.next();
  return b;
}

namespace detail {
// out[s, o] = W[o, :]·in[s, :] + b[o], then tanh when `activate`.
template <class Linear>
std::vector<float> layer_forward(const Linear& l, const std::vector<float>& in, std::size_t n, bool activate) {
  const std::size_t out = l.bias.numel(), width = l.weight.numel() / out;
  std::vector<float> y(n * out);
  for (std::size_t s = 0; s < n; ++s)
    for (std::size_t o = 0; o < out; ++o) {
      float acc = l.bias.value()[o];
      for (std::size_t i = 0; i < width; ++i) acc += l.weight.value()[o * width + i] * in[s * width + i];
      y[s * out + o] = activate ? std::tanh(acc) : acc;
    }
  return y;
}
// Adds dW = δᵀ·in and db = Σδ, summed in float, into the gradients (once per element, as a GEMM accumulating in
// f32 writes a bf16 gradient: mixed_scenarios.hpp's bf16 model); returns δ·W (the gradient of the layer's input).
template <class Linear>
std::vector<float> layer_backward(Linear& l, const std::vector<float>& in, const std::vector<float>& delta,
                                         std::size_t n, bool skip_bias) {
  const std::size_t out = l.bias.numel(), width = l.weight.numel() / out;
  std::vector<float> back(n * width, 0.0F), dw(out * width, 0.0F), db(out, 0.0F);
  for (std::size_t s = 0; s < n; ++s)
    for (std::size_t o = 0; o < out; ++o) {
      const float d = delta[s * out + o];
      db[o] += d;
      for (std::size_t i = 0; i < width; ++i) {
        dw[o * width + i] += d * in[s * width + i];
        back[s * width + i] += d * l.weight.value()[o * width + i];
      }
    }
  using G = std::remove_reference_t<decltype(l.weight.grad()[0])>;
  for (std::size_t i = 0; i < dw.size(); ++i) l.weight.grad()[i] = static_cast<G>(l.weight.grad()[i] + dw[i]);
  if (!skip_bias)
    for (std::size_t o = 0; o < out; ++o) l.bias.grad()[o] = static_cast<G>(l.bias.grad()[o] + db[o]);
  return back;
}
}  // namespace detail

/// Scope of a layer's use when nothing needs unsharding (one process, or parameters always whole).
struct no_scope {
  template <class Linear>
  int operator()(Linear&) const { return 0; }
};

/// Forward and backward of loss = scale · Σ_samples ½‖f(x) − y‖², adding into the gradients; calls
/// report(param) for each parameter as soon as its gradient is final (fc3.bias first). Each layer's
/// forward and backward run inside `auto g = scope(layer)` (dp.unshard under full_shard). Parameters
/// named in `skip` are not reported (a skipped bias gets no gradient either). Returns the loss.
template <class Model, class Report, class Scope = no_scope>
float forward_backward(Model& m, const batch& b, float scale, Report&& report, Scope&& scope = {},
                       const std::set<std::string>& skip = {}) {
  const std::size_t n = b.n;
  std::vector<float> a1, a2, out;
  { [[maybe_unused]] auto g = scope(m.fc1); a1 = detail::layer_forward(m.fc1, b.x, n, true); }
  { [[maybe_unused]] auto g = scope(m.fc2); a2 = detail::layer_forward(m.fc2, a1, n, true); }
  { [[maybe_unused]] auto g = scope(m.fc3); out = detail::layer_forward(m.fc3, a2, n, false); }
  float loss = 0;
  std::vector<float> delta(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    const float e = out[i] - b.y[i];
    loss += 0.5F * scale * e * e;
    delta[i] = scale * e;
  }
  using layer = std::remove_reference_t<decltype(m.fc1)>;
  const std::vector<std::pair<layer*, const std::vector<float>*>> layers{{&m.fc3, &a2}, {&m.fc2, &a1}, {&m.fc1, &b.x}};
  const std::vector<std::string> names{"fc3", "fc2", "fc1"};
  const std::vector<const std::vector<float>*> activations{&a2, &a1};
  for (std::size_t k = 0; k < layers.size(); ++k) {
    auto& l = *layers[k].first;
    [[maybe_unused]] auto g = scope(l);
    const bool skip_bias = skip.count(names[k] + ".bias") > 0;
    auto back = detail::layer_backward(l, *layers[k].second, delta, n, skip_bias);
    if (!skip_bias) report(l.bias);
    if (!skip.count(names[k] + ".weight")) report(l.weight);
    if (k < activations.size()) {
      const auto& a = *activations[k];
      for (std::size_t i = 0; i < back.size(); ++i) back[i] *= 1.0F - a[i] * a[i];  // tanh'
      delta = std::move(back);
    }
  }
  return loss;
}

/// One flat buffer per parameter of `m`: how a single process steps an optimizer without the wrapper.
inline std::vector<ddp::optim::flat_buffer> per_parameter_buffers(mlp& m) {
  std::vector<ddp::optim::flat_buffer> out;
  ddp::visit_parameters(m, [&](std::string_view name, ddp::parameter<float>& p) {
    out.push_back({ddp::raw_tensor::of(p.value()), ddp::raw_tensor::of(p.grad()),
                   {{std::string(name), 0, p.numel()}}});
  });
  return out;
}

inline void zero_grad(mlp& m) {
  ddp::visit_parameters(m, [](std::string_view, ddp::parameter<float>& p) { p.zero_grad(); });
}

}  // namespace ddp_test
