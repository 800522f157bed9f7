#pragma once
/// \file ddp::storage_traits<torch::Tensor>: a LibTorch parameter as a leaf of ddp's arenas.
///
/// A parameter must be a contiguous CPU tensor of f32, f64, bf16 or f16. ddp adopts it: its values become a
/// view of its slice of the value arena (`set_data` on a tensor over ddp's memory, so the optimizer's state and
/// autograd's references stay valid) and its `.grad` a view of its slice of the gradient arena, into which
/// autograd accumulates in place. Its gradient is reported by autograd itself: a post-hook on the parameter's
/// gradient accumulator calls ddp once the gradient is final (after every contribution of the backward), so
/// buckets reduce while the backward goes on. Where LibTorch replaced `.grad` (`zero_grad(true)`, a
/// `create_graph` backward) the hook copies the new gradient into ddp's slice and points `.grad` there again.
/// A hook registered with `Tensor::register_hook` runs before the gradient is stored: never report from one.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/storage_traits.hpp>

namespace ddp {

namespace detail::libtorch {

/// "a tensor of shape [4, 3]", for messages.
inline std::string describe_shape(const torch::Tensor& t) {
  std::string s = "a tensor of shape [";
  for (std::int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

/// The ddp dtype of a LibTorch element type, or nothing for the types ddp does not handle.
inline std::optional<ddp::dtype> dtype_of(c10::ScalarType t) noexcept {
  switch (t) {
    case torch::kFloat: return dtype::f32;
    case torch::kDouble: return dtype::f64;
    case torch::kBFloat16: return dtype::bf16;
    case torch::kHalf: return dtype::f16;
    case torch::kInt: return dtype::i32;
    case torch::kLong: return dtype::i64;
    case torch::kByte: return dtype::u8;
    default: return std::nullopt;
  }
}

/// The LibTorch element type of a ddp dtype.
inline c10::ScalarType scalar_type_of(ddp::dtype t) noexcept {
  switch (t) {
    case dtype::f32: return torch::kFloat;
    case dtype::f64: return torch::kDouble;
    case dtype::bf16: return torch::kBFloat16;
    case dtype::f16: return torch::kHalf;
    case dtype::i32: return torch::kInt;
    case dtype::i64: return torch::kLong;
    case dtype::u8: return torch::kByte;
  }
  return torch::kFloat;
}

/// The gradient slices ddp gave each adopted parameter (by TensorImpl), so the hook can point `.grad` back.
class slice_registry {
 public:
  /// `p`'s slice is now `grads`.
  void set(const torch::Tensor& p, torch::Tensor grads) {
    const std::lock_guard lock(mutex_);
    slices_[p.unsafeGetTensorImpl()] = std::move(grads);
  }
  /// `p` is ddp's no more.
  void erase(const torch::Tensor& p) {
    const std::lock_guard lock(mutex_);
    slices_.erase(p.unsafeGetTensorImpl());
  }
  /// `p`'s slice, or an undefined tensor.
  [[nodiscard]] torch::Tensor find(const torch::Tensor& p) const {
    const std::lock_guard lock(mutex_);
    const auto it = slices_.find(p.unsafeGetTensorImpl());
    return it == slices_.end() ? torch::Tensor() : it->second;
  }
  /// The process's registry.
  static slice_registry& instance() {
    static slice_registry r;
    return r;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> slices_;
};

/// Points `p.grad` at ddp's slice again where LibTorch replaced it, keeping the gradient it holds.
inline void relink(torch::Tensor& p) {
  const torch::Tensor slice = slice_registry::instance().find(p);
  auto& g = p.mutable_grad();
  if (!slice.defined() || (g.defined() && g.data_ptr() == slice.data_ptr())) return;
  torch::NoGradGuard no_grad;
  if (g.defined())
    slice.copy_(g);
  else
    slice.zero_();
  g = slice;
}

/// The post-hook on a parameter's gradient accumulator: keeps `.grad` on ddp's slice, then reports.
class report_hook final : public torch::autograd::FunctionPostHook {
 public:
  report_hook(torch::Tensor parameter, std::function<void()> ready)
      : parameter_(std::move(parameter)), ready_(std::move(ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    relink(parameter_);
    ready_();
    return outputs;
  }

 private:
  torch::Tensor parameter_;
  std::function<void()> ready_;
};

}  // namespace detail::libtorch

/// LibTorch parameters: contiguous CPU tensors of f32, f64, bf16 or f16, adopted zero-copy and reported by
/// autograd (see this header's description).
template <>
struct storage_traits<torch::Tensor> {
  /// named_parameters() hands out handles; ddp keeps its own (they share the parameter's TensorImpl).
  static constexpr bool view = true;

  /// f32, f64, bf16 or f16 (another type is a config_error).
  static ddp::dtype dtype(const torch::Tensor& t) {
    const auto d = detail::libtorch::dtype_of(t.scalar_type());
    if (!d || (*d != dtype::f32 && *d != dtype::f64 && *d != dtype::bf16 && *d != dtype::f16))
      throw config_error("ddp (LibTorch): " + detail::libtorch::describe_shape(t) + " of type " +
                         std::string(c10::toString(t.scalar_type())) + " is a parameter; ddp trains f32, f64, bf16 "
                         "and f16 parameters: convert the module (module->to(torch::kFloat)) or register the tensor "
                         "as a buffer");
    return *d;
  }
  /// The sizes, outermost first.
  static std::vector<std::size_t> shape(const torch::Tensor& t) {
    std::vector<std::size_t> out;
    for (const auto d : t.sizes()) out.push_back(static_cast<std::size_t>(d));
    return out;
  }
  /// cpu or cuda:N (data_parallel refuses CUDA parameters with a config_error naming them).
  static ddp::device device(const torch::Tensor& t) {
    return t.device().is_cuda() ? device::cuda(t.device().index()) : device::cpu();
  }
  /// The values now (a non-contiguous tensor is a config_error).
  static void* values(const torch::Tensor& t) {
    if (!t.is_contiguous())
      throw config_error("ddp (LibTorch): " + detail::libtorch::describe_shape(t) + " is a non-contiguous parameter; ddp "
                         "lays parameters into flat arenas: make it contiguous before wrapping "
                         "(p.set_data(p.contiguous()) under torch::NoGradGuard)");
    return t.data_ptr();
  }
  /// The gradient now (zeros are made for a parameter without one).
  static void* grads(const torch::Tensor& t) {
    auto& g = const_cast<torch::Tensor&>(t).mutable_grad();
    if (!g.defined() || !g.is_contiguous() || g.sizes() != t.sizes()) {
      torch::NoGradGuard no_grad;
      g = g.defined() ? g.contiguous().clone() : torch::zeros_like(t);
    }
    return g.data_ptr();
  }
  /// The TensorImpl: every handle of one parameter shares it.
  static const void* key(const torch::Tensor& t) noexcept { return t.unsafeGetTensorImpl(); }

  /// Points the values and `.grad` at ddp's slices (copying nothing; a pointer that is already right is kept,
  /// so autograd's saved references to the parameter stay intact).
  static void adopt(const torch::Tensor& t, void* values, void* grads) {
    torch::NoGradGuard no_grad;
    auto& p = const_cast<torch::Tensor&>(t);
    const auto options = p.options().requires_grad(false);
    if (p.data_ptr() != values) p.set_data(torch::from_blob(values, p.sizes(), options));
    if (!p.grad().defined() || p.grad().data_ptr() != grads) {
      p.mutable_grad() = torch::from_blob(grads, p.sizes(), options);
      detail::libtorch::slice_registry::instance().set(p, p.grad());
    }
  }
  /// Takes the values and `.grad` into memory of the tensor's own again (the wrapper is going away).
  static void release(const torch::Tensor& t) {
    torch::NoGradGuard no_grad;
    auto& p = const_cast<torch::Tensor&>(t);
    p.set_data(p.detach().clone());
    if (p.grad().defined()) p.mutable_grad() = p.grad().clone();
    detail::libtorch::slice_registry::instance().erase(p);
  }
  /// Calls `ready` once the parameter's gradient of a backward is final (a post-hook on its gradient
  /// accumulator); the hook is removed when the returned handle goes.
  static std::shared_ptr<void> watch(const torch::Tensor& t, std::function<void()> ready) {
    auto acc = torch::autograd::impl::grad_accumulator(t);
    if (!acc)
      throw config_error("ddp (LibTorch): " + detail::libtorch::describe_shape(t) + " is a parameter that does not require "
                         "a gradient; set requires_grad(true), or leave it out of the model ddp wraps");
    const auto id = acc->add_post_hook(std::make_unique<detail::libtorch::report_hook>(t, std::move(ready)));
    return {acc.get(), [acc, id](void*) { acc->del_post_hook(id); }};
  }
};

static_assert(watching_leaf<torch::Tensor> && adopting_leaf<torch::Tensor>,
              "ddp: storage_traits<torch::Tensor> must adopt and watch; add what <ddp/core/storage_traits.hpp> names.");

}  // namespace ddp
