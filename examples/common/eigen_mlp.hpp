#pragma once
/// \file A three-layer perceptron (ReLU, softmax cross-entropy) written with Eigen, handed to ddp through the Eigen
/// adapter: each layer keeps its weight and bias and their gradients as Eigen members and visits them as
/// ddp::trainable(W, dW). The members are owning RowMajor matrices (ddp copies them at the step's edges) or
/// Eigen::Map over one buffer the model owns (ddp points them at its arenas: zero copies). Weights are RowMajor
/// out×in, so checkpoints hold torch.nn.Linear's [out, in].

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include <ddp/adapters/eigen.hpp>
#include <ddp/core/trainable.hpp>

#include "batch_result.hpp"

namespace example {

/// Row-major float matrix: activations are [batch, features], weights [out, in].
using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// y = x·weightᵀ + bias.
template <class Matrix, class Vector>
struct eigen_linear {
  Matrix weight, weight_grad;  ///< [out, in] (RowMajor out×in)
  Vector bias, bias_grad;      ///< [out]
  /// Hands ddp the two leaves (the adapter gives their shapes).
  template <class F>
  void visit_parameters(F&& f) {
    f("weight", ddp::trainable(weight, weight_grad));
    f("bias", ddp::trainable(bias, bias_grad));
  }
};

/// How an eigen_mlp keeps its tensors.
enum class eigen_storage {
  matrix,  ///< owning Eigen::Matrix members: ddp copies gradients in and values out
  map,     ///< Eigen::Map members over the model's own buffer: ddp re-points them, zero copies
};

/// fc1 → ReLU → fc2 → ReLU → fc3 (logits), initialized as torch.nn.Linear (uniform in ±1/√in) from a seed.
template <eigen_storage Storage>
class eigen_mlp {
  static constexpr bool mapped = Storage == eigen_storage::map;

 public:
  using matrix = std::conditional_t<mapped, Eigen::Map<row_matrix>, row_matrix>;            ///< weight type
  using vector = std::conditional_t<mapped, Eigen::Map<Eigen::VectorXf>, Eigen::VectorXf>;  ///< bias type
  using layer = eigen_linear<matrix, vector>;                                               ///< one layer

  /// An MLP in → h1 → h2 → classes.
  eigen_mlp(std::size_t in, std::size_t h1, std::size_t h2, std::size_t classes, std::uint64_t seed)
      : memory_(mapped ? 2 * (h1 * (in + 1) + h2 * (h1 + 1) + classes * (h2 + 1)) : 0),
        fc1(make_layer(in, h1)), fc2(make_layer(h1, h2)), fc3(make_layer(h2, classes)) {
    std::mt19937_64 rng(seed);
    for (layer* l : {&fc1, &fc2, &fc3}) {
      const float bound = 1.0F / std::sqrt(static_cast<float>(l->weight.cols()));
      const auto draw = [&](float* p, Eigen::Index n) {
        for (Eigen::Index k = 0; k < n; ++k)
          p[k] = bound * (2.0F * static_cast<float>(rng() >> 40) / static_cast<float>(1 << 24) - 1.0F);
      };
      draw(l->weight.data(), l->weight.size());
      draw(l->bias.data(), l->bias.size());
    }
  }
  eigen_mlp(const eigen_mlp&) = delete;  // maps point into memory_
  eigen_mlp& operator=(const eigen_mlp&) = delete;

  /// Visits fc1, fc2, fc3.
  template <class F>
  void visit_parameters(F&& f) {
    f("fc1", fc1);
    f("fc2", fc2);
    f("fc3", fc3);
  }

 private:
  std::vector<float> memory_;  // map storage: every tensor's home while ddp does not wrap the model
  std::size_t used_ = 0;

  template <class T>
  T make_tensor(std::size_t rows, std::size_t cols) {
    const auto r = static_cast<Eigen::Index>(rows), c = static_cast<Eigen::Index>(cols);
    if constexpr (mapped) {
      float* p = memory_.data() + used_;
      used_ += rows * cols;
      return T(p, r, c);
    } else {
      return T::Zero(r, c);
    }
  }
  layer make_layer(std::size_t in, std::size_t out) {
    return {make_tensor<matrix>(out, in), make_tensor<matrix>(out, in), make_tensor<vector>(out, 1),
            make_tensor<vector>(out, 1)};
  }

 public:
  layer fc1, fc2, fc3;  ///< the layers
};

/// Forward and backward of an eigen_mlp with reused activation buffers; every product is an Eigen GEMM.
class eigen_trainer {
 public:
  /// Forward on `x` ([batch, in], row-major) with `labels`; keeps what backward() needs.
  template <class Model>
  batch_result forward(const Model& m, std::span<const float> x, std::span<const std::uint8_t> labels) {
    const auto n = static_cast<Eigen::Index>(labels.size());
    x_ = Eigen::Map<const row_matrix>(x.data(), n, m.fc1.weight.cols());
    linear_forward(m.fc1, x_, h1_, true);
    linear_forward(m.fc2, h1_, h2_, true);
    linear_forward(m.fc3, h2_, logits_, false);
    dlogits_.resize(n, logits_.cols());
    batch_result r;
    for (Eigen::Index i = 0; i < n; ++i) {
      Eigen::Index best = 0;
      const float zmax = logits_.row(i).maxCoeff(&best);
      const double log_sum = std::log(static_cast<double>((logits_.row(i).array() - zmax).exp().sum())) + zmax;
      const auto label = static_cast<Eigen::Index>(labels[static_cast<std::size_t>(i)]);
      r.loss_sum += log_sum - logits_(i, label);
      r.correct += best == label ? 1 : 0;
      // d(mean loss)/d logit = (softmax − one-hot) / batch
      dlogits_.row(i) = ((logits_.row(i).array().cast<double>() - log_sum).exp() / static_cast<double>(n)).cast<float>();
      dlogits_(i, label) -= 1.0F / static_cast<float>(n);
    }
    return r;
  }

  /// Backward of the mean loss of the last forward: adds into the gradients and calls `ready(leaf)` for each
  /// weight and bias as soon as its gradient is final (fc3 first), which is where dp.gradient_ready goes.
  template <class Model, class Ready>
  void backward(Model& m, Ready&& ready) {
    linear_backward(m.fc3, h2_, dlogits_, &dh2_, ready);
    dh2_ = (h2_.array() > 0.0F).select(dh2_, 0.0F);
    linear_backward(m.fc2, h1_, dh2_, &dh1_, ready);
    dh1_ = (h1_.array() > 0.0F).select(dh1_, 0.0F);
    linear_backward(m.fc1, x_, dh1_, nullptr, ready);
  }

 private:
  template <class Layer>
  static void linear_forward(const Layer& l, const row_matrix& in, row_matrix& out, bool relu) {
    out.noalias() = in * l.weight.transpose();
    out.rowwise() += l.bias.transpose();
    if (relu) out = out.cwiseMax(0.0F);
  }
  template <class Layer, class Ready>
  static void linear_backward(Layer& l, const row_matrix& in, const row_matrix& dout, row_matrix* din, Ready& ready) {
    l.weight_grad.noalias() += dout.transpose() * in;
    ready(l.weight);
    l.bias_grad += dout.colwise().sum().transpose();
    ready(l.bias);
    if (din != nullptr) din->noalias() = dout * l.weight;
  }

  row_matrix x_, h1_, h2_, logits_, dlogits_, dh1_, dh2_;
};

}  // namespace example
