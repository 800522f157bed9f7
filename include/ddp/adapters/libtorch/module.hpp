#pragma once
/// \file Walking a torch::nn::Module: its trainable parameters under the names named_parameters() gives them
/// ("conv1.weight", "fc.bias"), its frozen parameters and buffers as model state (core/state.hpp). A module is
/// taken as the object itself, a std::shared_ptr to it, or a ModuleHolder (TORCH_MODULE(Net)).

#include <concepts>
#include <memory>
#include <string>
#include <type_traits>

#include <torch/torch.h>

#include <ddp/adapters/libtorch/tensor.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/state.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/visit.hpp>

namespace ddp {

namespace detail::libtorch {

/// A module ddp can walk: a torch::nn::Module, a ModuleHolder of one or a std::shared_ptr to one.
template <class M>
concept module_holder = requires(M& m) { typename M::ContainedType; } &&
                        std::derived_from<M, torch::nn::ModuleHolder<typename M::ContainedType>>;

/// Throws ddp::config_error naming parameter `name` unless ddp can lay it out (a CUDA one is named later).
inline void check_parameter(const std::string& name, const torch::Tensor& t) {
  const auto type = dtype_of(t.scalar_type());
  if (!type || (*type != dtype::f32 && *type != dtype::f64 && *type != dtype::bf16 && *type != dtype::f16))
    throw config_error("ddp (LibTorch): parameter '" + name + "' is of type " + std::string(c10::toString(t.scalar_type())) +
                       "; ddp trains f32, f64, bf16 and f16 parameters: convert the module (net->to(torch::kFloat))");
  if (!t.device().is_cuda() && !t.is_contiguous())
    throw config_error("ddp (LibTorch): parameter '" + name + "' is non-contiguous (" + describe_shape(t) + " with strides of "
                       "a view); ddp lays parameters into flat arenas: make it contiguous before wrapping "
                       "(p.set_data(p.contiguous()) under torch::NoGradGuard)");
}

/// Calls `f(name, tensor)` for every parameter of `m` that requires a gradient (trainable).
template <class F>
void visit_trainable(torch::nn::Module& m, F&& f) {
  for (auto& item : m.named_parameters(/*recurse=*/true))
    if (item.value().requires_grad()) {
      check_parameter(item.key(), item.value());
      f(item.key(), item.value());
    }
}

/// Calls `f(name, ddp::state_view)` for every frozen parameter (no gradient) and every buffer of `m`.
template <class F>
void visit_state(torch::nn::Module& m, F&& f) {
  auto one = [&](const std::string& name, const torch::Tensor& t, state_kind kind) {
    const auto type = dtype_of(t.scalar_type());
    if (!type || !t.is_contiguous())
      throw config_error("ddp (LibTorch): " + std::string(kind == state_kind::frozen ? "frozen parameter '" : "buffer '") +
                         name + "' is not a contiguous tensor of a type ddp can synchronize and save (f32, f64, bf16, "
                         "f16, i32, i64, u8); make it one (t.set_data(t.contiguous()) under torch::NoGradGuard)");
    std::vector<std::size_t> shape;
    for (const auto d : t.sizes()) shape.push_back(static_cast<std::size_t>(d));
    f(name, state_view{raw_tensor{t.data_ptr(), static_cast<std::size_t>(t.numel()), *type,
                                  storage_traits<torch::Tensor>::device(t)},
                       std::move(shape), kind});
  };
  for (auto& item : m.named_parameters(/*recurse=*/true))
    if (!item.value().requires_grad()) one(item.key(), item.value(), state_kind::frozen);
  for (auto& item : m.named_buffers(/*recurse=*/true)) one(item.key(), item.value(), state_kind::buffer);
}

}  // namespace detail::libtorch

/// Any torch::nn::Module subclass: parameters as named_parameters() names them; frozen parameters and buffers
/// as model state.
template <class M>
  requires std::derived_from<M, torch::nn::Module>
struct parameter_visitor<M> {
  /// `f(name, tensor)` for every trainable parameter.
  template <class F>
  static void visit(M& m, F&& f) {
    detail::libtorch::visit_trainable(m, f);
  }
  /// `f(name, ddp::state_view)` for every frozen parameter and buffer.
  template <class F>
  static void visit_state(M& m, F&& f) {
    detail::libtorch::visit_state(m, f);
  }
};

/// A ModuleHolder (the class TORCH_MODULE(Net) declares): its module.
template <detail::libtorch::module_holder H>
struct parameter_visitor<H> {
  /// `f(name, tensor)` for every trainable parameter.
  template <class F>
  static void visit(H& m, F&& f) {
    detail::libtorch::visit_trainable(*m, f);
  }
  /// `f(name, ddp::state_view)` for every frozen parameter and buffer.
  template <class F>
  static void visit_state(H& m, F&& f) {
    detail::libtorch::visit_state(*m, f);
  }
};

/// A std::shared_ptr to a module: its module.
template <class M>
  requires std::derived_from<M, torch::nn::Module>
struct parameter_visitor<std::shared_ptr<M>> {
  /// `f(name, tensor)` for every trainable parameter.
  template <class F>
  static void visit(std::shared_ptr<M>& m, F&& f) {
    detail::libtorch::visit_trainable(*m, f);
  }
  /// `f(name, ddp::state_view)` for every frozen parameter and buffer.
  template <class F>
  static void visit_state(std::shared_ptr<M>& m, F&& f) {
    detail::libtorch::visit_state(*m, f);
  }
};

}  // namespace ddp
