#pragma once
// The test MLP of tests/parallel/mlp.hpp (7-13-11-5, tanh, ½‖f(x) − y‖²) written with Eigen: each layer keeps its
// weight and bias, and their gradients, as Eigen members handed to ddp as ddp::trainable(W, dW) with no shape
// (the adapter's layout rule gives it). Forward and backward are Eigen GEMMs. Weight is either an owning
// Eigen::Matrix (ddp copies it at the step's edges) or an Eigen::Map over memory the model keeps (ddp points it
// at its arenas); RowMajor weights are out×in, ColMajor weights in×out, so both record PyTorch's [out, in].

#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include <ddp/adapters/eigen.hpp>
#include <ddp/core/trainable.hpp>

#include "parallel/mlp.hpp"

namespace ddp_test {

using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class T>
inline constexpr bool is_map = false;
template <class P, int O, class S>
inline constexpr bool is_map<Eigen::Map<P, O, S>> = true;

/// One linear layer: y = x·Wᵀ + b with W out×in (RowMajor) or y = x·W + b with W in×out (ColMajor).
template <class Weight, class Bias>
struct eigen_linear {
  Weight weight, weight_grad;
  Bias bias, bias_grad;
  template <class F>
  void visit_parameters(F&& f) {
    f("weight", ddp::trainable(weight, weight_grad));
    f("bias", ddp::trainable(bias, bias_grad));
  }
};

/// fc1..fc3; `memory` is where the maps of a Map model point while ddp does not wrap it.
template <class Weight, class Bias>
struct eigen_mlp {
  using weight_type = Weight;
  eigen_linear<Weight, Bias> fc1, fc2, fc3;
  std::vector<std::vector<float>> memory;
  template <class F>
  void visit_parameters(F&& f) {
    f("fc1", fc1);
    f("fc2", fc2);
    f("fc3", fc3);
  }
};

using owning_rows = eigen_mlp<row_matrix, Eigen::VectorXf>;                         ///< Matrix, RowMajor out×in
using owning_cols = eigen_mlp<Eigen::MatrixXf, Eigen::VectorXf>;                    ///< Matrix, ColMajor in×out
using mapped_rows = eigen_mlp<Eigen::Map<row_matrix>, Eigen::Map<Eigen::VectorXf>>;  ///< Map, RowMajor out×in
using mapped_cols = eigen_mlp<Eigen::Map<Eigen::MatrixXf>, Eigen::Map<Eigen::VectorXf>>;  ///< Map, ColMajor in×out

namespace detail {
/// A tensor of `rows`×`cols` holding `values`: a Map over them, or a matrix copying them.
template <class T>
T make_tensor(std::vector<float>& values, Eigen::Index rows, Eigen::Index cols) {
  if constexpr (is_map<T>) {
    if constexpr (T::IsVectorAtCompileTime)
      return T(values.data(), rows * cols);
    else
      return T(values.data(), rows, cols);
  } else {
    T t(rows, cols);
    std::copy(values.begin(), values.end(), t.data());
    return t;
  }
}

template <class Weight, class Bias>
eigen_linear<Weight, Bias> make_layer(const linear& l, std::vector<std::vector<float>>& memory) {
  const auto out = static_cast<Eigen::Index>(l.weight.shape()[0]), in = static_cast<Eigen::Index>(l.weight.shape()[1]);
  // RowMajor out×in and ColMajor in×out have the same memory: [out, in] read row-major, as the parameter's.
  const Eigen::Index rows = Weight::IsRowMajor ? out : in, cols = Weight::IsRowMajor ? in : out;
  auto& w = memory.emplace_back(l.weight.value().begin(), l.weight.value().end());
  auto& dw = memory.emplace_back(w.size(), 0.0F);
  auto& b = memory.emplace_back(l.bias.value().begin(), l.bias.value().end());
  auto& db = memory.emplace_back(b.size(), 0.0F);
  return {make_tensor<Weight>(w, rows, cols), make_tensor<Weight>(dw, rows, cols), make_tensor<Bias>(b, out, 1),
          make_tensor<Bias>(db, out, 1)};
}

/// z = in·Wᵀ + b for either weight orientation.
template <class Layer>
row_matrix layer_forward(const Layer& l, const row_matrix& in) {
  row_matrix z(in.rows(), l.bias.size());
  if constexpr (std::remove_cvref_t<decltype(l.weight)>::IsRowMajor)
    z.noalias() = in * l.weight.transpose();
  else
    z.noalias() = in * l.weight;
  z.rowwise() += l.bias.transpose();
  return z;
}

/// Adds dW = δᵀ·in (in the weight's orientation) and db = Σδ; returns δ·W, the gradient of the layer's input.
template <class Layer>
row_matrix layer_backward(Layer& l, const row_matrix& in, const row_matrix& delta) {
  if constexpr (std::remove_cvref_t<decltype(l.weight)>::IsRowMajor) {
    l.weight_grad.noalias() += delta.transpose() * in;
    l.bias_grad += delta.colwise().sum().transpose();
    return delta * l.weight;
  } else {
    l.weight_grad.noalias() += in.transpose() * delta;
    l.bias_grad += delta.colwise().sum().transpose();
    return delta * l.weight.transpose();
  }
}
}  // namespace detail

/// The values of `m` in an Eigen model of type Model.
template <class Model>
Model make_eigen(const mlp& m) {
  std::vector<std::vector<float>> memory;
  memory.reserve(12);  // the maps point into these vectors; moving the outer vector keeps them in place
  using W = typename Model::weight_type;
  using B = std::remove_cvref_t<decltype(std::declval<Model&>().fc1.bias)>;
  auto fc1 = detail::make_layer<W, B>(m.fc1, memory);
  auto fc2 = detail::make_layer<W, B>(m.fc2, memory);
  auto fc3 = detail::make_layer<W, B>(m.fc3, memory);
  return Model{std::move(fc1), std::move(fc2), std::move(fc3), std::move(memory)};
}

/// Copies the Eigen model's values into `m` (to compare with require_close).
template <class Model>
void copy_back(const Model& e, mlp& m) {
  auto one = [](const auto& t, ddp::parameter<float>& p) { std::copy(t.data(), t.data() + t.size(), p.value().begin()); };
  one(e.fc1.weight, m.fc1.weight);
  one(e.fc1.bias, m.fc1.bias);
  one(e.fc2.weight, m.fc2.weight);
  one(e.fc2.bias, m.fc2.bias);
  one(e.fc3.weight, m.fc3.weight);
  one(e.fc3.bias, m.fc3.bias);
}

/// Logits of `x` ([n, in_dim], row-major).
template <class Model>
row_matrix eigen_forward(const Model& m, const std::vector<float>& x, std::size_t n) {
  const row_matrix in = Eigen::Map<const row_matrix>(x.data(), static_cast<Eigen::Index>(n), in_dim);
  const row_matrix a1 = detail::layer_forward(m.fc1, in).array().tanh();
  const row_matrix a2 = detail::layer_forward(m.fc2, a1).array().tanh();
  return detail::layer_forward(m.fc3, a2);
}

/// mlp.hpp's forward_backward for the Eigen model: loss = scale · Σ ½‖f(x) − y‖², gradients added, report(leaf)
/// for each weight and bias once final (fc3 first), each layer's forward and backward inside `scope(layer)`.
template <class Model, class Report, class Scope = no_scope>
float eigen_forward_backward(Model& m, const batch& b, float scale, Report&& report, Scope&& scope = {}) {
  const auto n = static_cast<Eigen::Index>(b.n);
  const row_matrix x = Eigen::Map<const row_matrix>(b.x.data(), n, in_dim);
  const row_matrix y = Eigen::Map<const row_matrix>(b.y.data(), n, out_dim);
  row_matrix a1, a2, out;
  { [[maybe_unused]] auto g = scope(m.fc1); a1 = detail::layer_forward(m.fc1, x).array().tanh(); }
  { [[maybe_unused]] auto g = scope(m.fc2); a2 = detail::layer_forward(m.fc2, a1).array().tanh(); }
  { [[maybe_unused]] auto g = scope(m.fc3); out = detail::layer_forward(m.fc3, a2); }
  const row_matrix error = out - y;
  const float loss = 0.5F * scale * error.squaredNorm();
  row_matrix delta = scale * error;
  {
    [[maybe_unused]] auto g = scope(m.fc3);
    const row_matrix back = detail::layer_backward(m.fc3, a2, delta);
    report(m.fc3.bias);
    report(m.fc3.weight);
    delta = back.array() * (1.0F - a2.array().square());
  }
  {
    [[maybe_unused]] auto g = scope(m.fc2);
    const row_matrix back = detail::layer_backward(m.fc2, a1, delta);
    report(m.fc2.bias);
    report(m.fc2.weight);
    delta = back.array() * (1.0F - a1.array().square());
  }
  {
    [[maybe_unused]] auto g = scope(m.fc1);
    detail::layer_backward(m.fc1, x, delta);
    report(m.fc1.bias);
    report(m.fc1.weight);
  }
  return loss;
}

}  // namespace ddp_test
