#pragma once
/// \file What the comm hook policies do to a bucket: plain_hook all-reduces it with the average;
/// bf16_compress_hook and fp16_compress_hook divide by the world size, round into a reused half-precision
/// buffer, all-reduce the sum in that dtype and widen the result back (PyTorch's compression hooks).

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/policies.hpp>

namespace ddp::detail {

/// A hook's behaviour; specialized for each hook policy.
template <class Hook>
struct hook_impl {
  static_assert(dependent_false<Hook>,
                "ddp::data_parallel: unknown comm hook; use ddp::plain_hook, ddp::bf16_compress_hook or "
                "ddp::fp16_compress_hook.");
};

/// Gradients are averaged in their own dtype.
template <>
struct hook_impl<plain_hook> {
  explicit hook_impl(const parameter_layout&) {}
  /// Starts the average of `grads` (elements [begin, ...) of arena `a`) across the group.
  template <class Comm>
  work launch(Comm& comm, raw_tensor grads, std::size_t /*a*/, std::size_t /*begin*/) {
    return comm.all_reduce(grads, reduce_op::avg);
  }
  /// Nothing to undo once the reduction is done.
  void complete(raw_tensor /*grads*/, std::size_t /*a*/, std::size_t /*begin*/) {}
};

/// Gradients of f32/f64 arenas travel as Half: pre-divided by the world size (so sums of large values
/// do not overflow float16), summed in Half, widened back. Other dtypes travel as they are.
template <class Half>
struct compress_hook {
  explicit compress_hook(const parameter_layout& layout) : scratch_(layout.arenas().size()) {
    for (std::size_t a = 0; a < layout.arenas().size(); ++a) {
      const dtype t = layout.arenas()[a].type;
      if (t == dtype::f32 || t == dtype::f64) scratch_[a].resize(layout.arenas()[a].numel);
    }
  }
  template <class Comm>
  work launch(Comm& comm, raw_tensor grads, std::size_t a, std::size_t begin) {
    if (scratch_[a].empty()) return comm.all_reduce(grads, reduce_op::avg);
    const std::span<Half> half(scratch_[a].data() + begin, grads.size);
    const double scale = 1.0 / comm.size();
    visit_typed(grads, [&](auto* g) {
      for (std::size_t i = 0; i < half.size(); ++i) half[i] = Half(static_cast<float>(g[i] * scale));
    });
    return comm.all_reduce(half, reduce_op::sum);
  }
  void complete(raw_tensor grads, std::size_t a, std::size_t begin) {
    if (scratch_[a].empty()) return;
    const Half* half = scratch_[a].data() + begin;
    visit_typed(grads, [&](auto* g) {
      using T = std::remove_pointer_t<decltype(g)>;
      for (std::size_t i = 0; i < grads.size; ++i) g[i] = static_cast<T>(static_cast<float>(half[i]));
    });
  }

 private:
  template <class F>
  static void visit_typed(raw_tensor t, F&& f) {
    if (t.type == dtype::f64)
      f(static_cast<double*>(t.data));
    else
      f(static_cast<float*>(t.data));
  }
  std::vector<std::vector<Half>> scratch_;  // per arena; empty where gradients travel uncompressed
};

template <>
struct hook_impl<bf16_compress_hook> : compress_hook<bfloat16> {
  using compress_hook::compress_hook;
};
template <>
struct hook_impl<fp16_compress_hook> : compress_hook<float16> {
  using compress_hook::compress_hook;
};

}  // namespace ddp::detail
