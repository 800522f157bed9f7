#pragma once
/// \file Walking a torch::nn::Module: its trainable parameters under the names named_parameters() gives them
/// ("conv1.weight", "fc.bias"), its buffers and frozen parameters as state broadcast from rank 0. A module is
/// taken as the object itself, a std::shared_ptr to it, or a ModuleHolder (TORCH_MODULE(Net)).

#include <concepts>
#include <memory>
#include <string>
#include <type_traits>

#include <torch/torch.h>

#include <ddp/adapters/libtorch/tensor.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/error.hpp>
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

/// Calls `f(name, raw_tensor)` for every buffer of `m` and every frozen parameter (no gradient).
template <class F>
void visit_state(torch::nn::Module& m, F&& f) {
  auto one = [&](const std::string& name, const torch::Tensor& t) {
    const auto type = dtype_of(t.scalar_type());
    if (!type || !t.is_contiguous() || t.device().is_cuda())
      throw config_error("ddp (LibTorch): buffer '" + name + "' is not a contiguous CPU tensor of a type ddp can "
                         "broadcast (f32, f64, bf16, f16, i32, i64, u8); make it one, or set "
                         "data_parallel_options::broadcast_parameters = false and synchronize it yourself");
    f(name, raw_tensor{t.data_ptr(), static_cast<std::size_t>(t.numel()), *type, device::cpu()});
  };
  for (auto& item : m.named_parameters(/*recurse=*/true))
    if (!item.value().requires_grad()) one(item.key(), item.value());
  for (auto& item : m.named_buffers(/*recurse=*/true)) one(item.key(), item.value());
}

}  // namespace detail::libtorch

/// Any torch::nn::Module subclass: parameters as named_parameters() names them; buffers and frozen parameters
/// are broadcast from rank 0 when the wrapper is made.
template <class M>
  requires std::derived_from<M, torch::nn::Module>
struct parameter_visitor<M> {
  /// `f(name, tensor)` for every trainable parameter.
  template <class F>
  static void visit(M& m, F&& f) {
    detail::libtorch::visit_trainable(m, f);
  }
  /// `f(name, raw_tensor)` for every buffer and frozen parameter.
  template <class F>
  static void visit_buffers(M& m, F&& f) {
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
  /// `f(name, raw_tensor)` for every buffer and frozen parameter.
  template <class F>
  static void visit_buffers(H& m, F&& f) {
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
  /// `f(name, raw_tensor)` for every buffer and frozen parameter.
  template <class F>
  static void visit_buffers(std::shared_ptr<M>& m, F&& f) {
    detail::libtorch::visit_state(*m, f);
  }
};

}  // namespace ddp
