#pragma once
/// \file A three-layer perceptron (ReLU, softmax cross-entropy) whose parameters are ddp::parameter<float> in a
/// plain aggregate, with forward and backward on OpenBLAS GEMMs. The backward reports each layer's gradients to
/// a callback as soon as they are final, which is where data_parallel's gradient_ready goes.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include <cblas.h>

#include <ddp/core/parameter.hpp>

#include "batch_result.hpp"

namespace example {

/// y = x·weightᵀ + bias; weight is [out, in].
struct linear {
  ddp::parameter<float> weight;  ///< [out, in]
  ddp::parameter<float> bias;    ///< [out]
  [[nodiscard]] std::size_t in() const noexcept { return weight.shape()[1]; }
  [[nodiscard]] std::size_t out() const noexcept { return weight.shape()[0]; }
};

/// fc1 → ReLU → fc2 → ReLU → fc3 (logits). Visited by ddp's aggregate reflection (core/detail/reflect.hpp) as fc1.weight, fc1.bias, ...
struct mlp {
  linear fc1, fc2, fc3;
};

/// A layer initialized as torch.nn.Linear: weights and biases uniform in ±1/√in.
inline linear make_linear(std::size_t in, std::size_t out, std::mt19937_64& rng) {
  const float bound = 1.0F / std::sqrt(static_cast<float>(in));
  const auto draw = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = bound * (2.0F * static_cast<float>(rng() >> 40) / static_cast<float>(1 << 24) - 1.0F);
    return v;
  };
  return {ddp::parameter<float>({out, in}, draw(out * in)), ddp::parameter<float>({out}, draw(out))};
}

/// An MLP in → h1 → h2 → classes with seeded initial values.
inline mlp make_mlp(std::size_t in, std::size_t h1, std::size_t h2, std::size_t classes, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  linear a = make_linear(in, h1, rng);
  linear b = make_linear(h1, h2, rng);
  linear c = make_linear(h2, classes, rng);
  return {std::move(a), std::move(b), std::move(c)};
}

/// Forward and backward of an mlp with reused activation buffers.
class mlp_trainer {
 public:
  /// Forward on `batch` rows of `x` ([batch, in]); keeps what backward() needs. Returns loss sum and correct count.
  batch_result forward(const mlp& m, std::span<const float> x, std::span<const std::uint8_t> labels) {
    batch_ = labels.size();
    x_.assign(x.begin(), x.end());
    layer_forward(m.fc1, x_, h1_, true);
    layer_forward(m.fc2, h1_, h2_, true);
    layer_forward(m.fc3, h2_, logits_, false);
    const std::size_t k = m.fc3.out();
    dlogits_.resize(batch_ * k);
    batch_result r;
    for (std::size_t i = 0; i < batch_; ++i) {
      const float* z = logits_.data() + i * k;
      float* d = dlogits_.data() + i * k;
      const std::size_t best = static_cast<std::size_t>(std::max_element(z, z + k) - z);
      const float zmax = z[best];
      double sum = 0;
      for (std::size_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(z[j] - zmax));
      const double log_sum = std::log(sum) + zmax;
      r.loss_sum += log_sum - z[labels[i]];
      r.correct += best == labels[i] ? 1 : 0;
      for (std::size_t j = 0; j < k; ++j)  // d(mean loss)/d logit = (softmax − one-hot) / batch
        d[j] = static_cast<float>((std::exp(static_cast<double>(z[j]) - log_sum) - (j == labels[i] ? 1.0 : 0.0)) /
                                  static_cast<double>(batch_));
    }
    return r;
  }

  /// Backward of the mean loss of the last forward: adds into the gradients and calls `ready(param)` for each
  /// parameter as soon as its gradient is final (fc3 first).
  template <class Ready>
  void backward(mlp& m, Ready&& ready) {
    layer_backward(m.fc3, h2_, dlogits_, &dh2_, ready);
    relu_backward(h2_, dh2_);
    layer_backward(m.fc2, h1_, dh2_, &dh1_, ready);
    relu_backward(h1_, dh1_);
    layer_backward(m.fc1, x_, dh1_, nullptr, ready);
  }

 private:
  void layer_forward(const linear& l, const std::vector<float>& in, std::vector<float>& out, bool relu) const {
    const auto n = static_cast<int>(batch_), o = static_cast<int>(l.out()), i = static_cast<int>(l.in());
    out.resize(batch_ * l.out());
    for (std::size_t r = 0; r < batch_; ++r) std::copy(l.bias.value().begin(), l.bias.value().end(), out.begin() + static_cast<std::ptrdiff_t>(r * l.out()));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, o, i, 1.0F, in.data(), i, l.weight.value().data(), i, 1.0F,
                out.data(), o);
    if (relu)
      for (auto& v : out) v = std::max(v, 0.0F);
  }
  template <class Ready>
  void layer_backward(linear& l, const std::vector<float>& in, const std::vector<float>& dout, std::vector<float>* din,
                      Ready& ready) {
    const auto n = static_cast<int>(batch_), o = static_cast<int>(l.out()), i = static_cast<int>(l.in());
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, o, i, n, 1.0F, dout.data(), o, in.data(), i, 1.0F,
                l.weight.grad().data(), i);
    ready(l.weight);
    auto db = l.bias.grad();
    for (std::size_t r = 0; r < batch_; ++r)
      for (std::size_t j = 0; j < l.out(); ++j) db[j] += dout[r * l.out() + j];
    ready(l.bias);
    if (din == nullptr) return;
    din->resize(batch_ * l.in());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, i, o, 1.0F, dout.data(), o, l.weight.value().data(), i,
                0.0F, din->data(), i);
  }
  static void relu_backward(const std::vector<float>& activation, std::vector<float>& grad) {
    for (std::size_t j = 0; j < grad.size(); ++j)
      if (activation[j] <= 0.0F) grad[j] = 0.0F;
  }

  std::size_t batch_ = 0;
  std::vector<float> x_, h1_, h2_, logits_, dlogits_, dh1_, dh2_;
};

}  // namespace example
