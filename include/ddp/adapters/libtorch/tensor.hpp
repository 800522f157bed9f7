#pragma once
/// \file ddp::storage_traits<torch::Tensor>: a LibTorch parameter as a leaf of ddp's arenas.
///
/// A parameter must be a contiguous CPU tensor of f32, f64, bf16 or f16. ddp adopts it: its values become a
/// view of its slice of the value arena (`set_data` on a tensor over ddp's memory, so the optimizer's state and
/// autograd's references stay valid) and its `.grad` a view of its slice of the gradient arena, into which
/// autograd accumulates in place.
///
/// full_shard moves a unit's values between pooled buffers while autograd holds tensors its forward saved, and
/// these facts of LibTorch 1.13 (checked by experiment) decide how. `set_data` keeps the version counter (no
/// "modified by an inplace operation" error) and keeps the TensorImpl, so a saved leaf (conv2d saves its
/// weight) sees whatever the parameter holds when the backward runs; but a saved view (linear saves
/// `weight.t()`) keeps the storage of the forward and would read a buffer given to another unit since. So the
/// parameter keeps one storage of ddp's for its lifetime and a rebinding moves that storage's memory pointer
/// (`StorageImpl::set_data_ptr_noswap`, no version bump): the parameter and every view of it, saved ones
/// included, follow. While its unit is sharded (vacate) the parameter is an empty tensor, so a forward outside
/// ddp::forward or an unshard scope fails in LibTorch (a size mismatch) instead of computing with zeros; its
/// storage then points at its zero place in the arena. Its gradient is reported by autograd itself: a post-hook on the parameter's
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

#include <torch/csrc/autograd/engine.h>
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

/// What ddp gave an adopted parameter: its values (a tensor of its full shape over the one storage ddp keeps for
/// it; the storage's memory moves with each rebinding) and its gradient slice.
struct adoption {
  torch::Tensor values;  ///< the parameter's values, whole (the parameter itself is empty while vacated)
  torch::Tensor grads;   ///< its `.grad`
  /// Its gradient accumulator, made while it was whole: autograd checks gradients against the shape the
  /// accumulator recorded when made, and one made while the parameter is vacated would expect none.
  std::shared_ptr<torch::autograd::Node> accumulator;
  torch::Tensor empty;  ///< the zero-element tensor the parameter holds while vacated, made once
};

/// The adoptions of the parameters ddp holds (by TensorImpl), so the hook can point `.grad` back and a vacated
/// parameter can get its values again.
class slice_registry {
 public:
  /// `p`'s adoption is now `a`.
  void set(const torch::Tensor& p, adoption a) {
    const std::lock_guard lock(mutex_);
    slices_[p.unsafeGetTensorImpl()] = std::move(a);
  }
  /// `p` is ddp's no more.
  void erase(const torch::Tensor& p) {
    const std::lock_guard lock(mutex_);
    slices_.erase(p.unsafeGetTensorImpl());
  }
  /// `p`'s adoption, or undefined tensors.
  [[nodiscard]] adoption find(const torch::Tensor& p) const {
    const std::lock_guard lock(mutex_);
    const auto it = slices_.find(p.unsafeGetTensorImpl());
    return it == slices_.end() ? adoption{} : it->second;
  }
  /// The process's registry.
  static slice_registry& instance() {
    static slice_registry r;
    return r;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, adoption> slices_;
};

/// Points `p`'s values and `.grad` at ddp's slices (see storage_traits<torch::Tensor>::adopt) and returns its
/// adoption, for the caller to record: tensors over ddp's memory are made once and reused while it stays put.
inline adoption adopted(torch::Tensor& p, void* values, void* grads) {
  adoption a = slice_registry::instance().find(p);
  const auto options = p.options().requires_grad(false);
  if (!a.values.defined()) {
    a.values = torch::from_blob(values, p.sizes(), options);
    a.accumulator = torch::autograd::impl::grad_accumulator(p);
  } else if (a.values.data_ptr() != values) {
    a.values.storage().unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(values, a.values.device()));
  }
  if (!p.is_alias_of(a.values) || p.sizes() != a.values.sizes()) p.set_data(a.values);
  if (!a.grads.defined() || a.grads.data_ptr() != grads) a.grads = torch::from_blob(grads, a.values.sizes(), options);
  if (!p.grad().defined() || p.grad().data_ptr() != grads) p.mutable_grad() = a.grads;
  return a;
}

/// Points `p.grad` at ddp's slice again where LibTorch replaced it, keeping the gradient it holds.
inline void relink(torch::Tensor& p) {
  const torch::Tensor slice = slice_registry::instance().find(p).grads;
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
  /// cpu or cuda:N (data_parallel needs cuda:N's memory domain registered; CUDA tensors are not yet run on a GPU).
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

  /// Points the values and `.grad` at ddp's slices, copying nothing: the first time over a storage of ddp's,
  /// later by moving that storage's memory (see this header's description), so autograd's saved references to
  /// the parameter and to its views stay intact.
  static void adopt(const torch::Tensor& t, void* values, void* grads) {
    torch::NoGradGuard no_grad;
    auto& p = const_cast<torch::Tensor&>(t);
    detail::libtorch::slice_registry::instance().set(p, detail::libtorch::adopted(p, values, grads));
  }
  /// Adopts `values` (zeros: the unit is sharded) as the storage's memory but leaves the parameter empty, so a
  /// forward that uses it fails instead of computing with zeros, and without `.grad`, so the model's zero_grad
  /// (in place or not) touches no gradient memory the unit does not hold; the next adopt makes it whole again.
  static void vacate(const torch::Tensor& t, void* values, void* grads) {
    torch::NoGradGuard no_grad;
    auto& p = const_cast<torch::Tensor&>(t);
    detail::libtorch::adoption a = detail::libtorch::adopted(p, values, grads);
    if (!a.empty.defined()) a.empty = torch::empty({0}, p.options().requires_grad(false));
    p.set_data(a.empty);
    p.mutable_grad() = torch::Tensor();
    detail::libtorch::slice_registry::instance().set(p, std::move(a));
  }
  /// Takes the values and `.grad` into memory of the tensor's own again (the wrapper is going away).
  static void release(const torch::Tensor& t) {
    torch::NoGradGuard no_grad;
    auto& p = const_cast<torch::Tensor&>(t);
    const torch::Tensor values = detail::libtorch::slice_registry::instance().find(p).values;
    p.set_data((values.defined() ? values : p.detach()).clone());
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
  /// Runs `f` when the backward in progress ends (the autograd engine's final callback; called from a watch hook).
  static void at_backward_end(const torch::Tensor& /*t*/, std::function<void()> f) {
    torch::autograd::Engine::get_default_engine().queue_callback(std::move(f));
  }
};

static_assert(watching_leaf<torch::Tensor> && adopting_leaf<torch::Tensor>,
              "ddp: storage_traits<torch::Tensor> must adopt and watch; add what <ddp/core/storage_traits.hpp> names.");

}  // namespace ddp
