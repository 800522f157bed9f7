#pragma once
/// \file ddp::forward(dp, module, args...): a submodule's forward as one full_shard unit, the LibTorch spelling of
/// FSDP2's `fully_shard(module)` (whose module hooks LibTorch's C++ API lacks).
///
/// The module's units are unsharded (all-gathered, the next unit prefetched) while its forward runs and resharded
/// after it (full_shard::reshard_after_forward). A hook on each output that requires a gradient
/// (Tensor::register_hook, which runs when the backward has computed that output's gradient, before any node of
/// the module's own backward) unshards them again for their part of the backward; they are resharded once every
/// parameter of them has reported its gradient (the post-accumulate hooks of storage_traits<torch::Tensor>), so
/// the values autograd saved are there when it reads them. Under replicate and shard_grad_op it is the module's
/// plain forward. Outside these calls a parameter of a sharded unit is an empty tensor: a plain forward of it
/// fails in LibTorch (size mismatch) rather than computing with zeros.

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <ddp/adapters/libtorch/module.hpp>

namespace ddp {

namespace detail::libtorch {

template <class T>
inline constexpr bool is_shared_ptr = false;
template <class T>
inline constexpr bool is_shared_ptr<std::shared_ptr<T>> = true;

/// The module a holder (TORCH_MODULE), a std::shared_ptr or the module itself refers to.
template <class Part>
auto& module_of(Part& part) {
  if constexpr (module_holder<Part> || is_shared_ptr<Part>)
    return *part;
  else
    return part;
}

/// Calls `open()` when the backward reaches `out` (a tensor, or a tuple or vector of tensors, or anything else:
/// nothing to hook then).
template <class Out, class Open>
void on_backward(Out& out, const Open& open) {
  if constexpr (std::is_same_v<Out, torch::Tensor>) {
    if (out.defined() && out.requires_grad()) out.register_hook([open](const torch::Tensor&) { open(); });
  } else if constexpr (requires { std::tuple_size<Out>::value; }) {
    std::apply([&](auto&... t) { (on_backward(t, open), ...); }, out);
  } else if constexpr (requires { out.begin(); out.end(); }) {
    for (auto& t : out) on_backward(t, open);
  }
}

}  // namespace detail::libtorch

/// Runs `module`'s forward on `args` as its full_shard units (see this header's description) and returns what the
/// forward returns: `x = ddp::forward(dp, net->conv1, x);` in place of `x = net->conv1(x);`. `module` is a part
/// of dp.module(): a ModuleHolder (net->conv1), a std::shared_ptr to a module, or a module. Collective under
/// full_shard (every rank runs the same units' forwards and backwards in the same order).
template <class DP, class Part, class... Args>
auto forward(DP& dp, Part& module, Args&&... args) {
  auto scope = dp.unshard(module);
  auto out = detail::libtorch::module_of(module).forward(std::forward<Args>(args)...);
  detail::libtorch::on_backward(out, scope.for_backward());
  return out;
}

}  // namespace ddp
