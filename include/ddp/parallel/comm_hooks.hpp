#pragma once
/// \file Comm hooks: how a bucket's gradients are reduced. A hook is a policy type (any default-constructible
/// type with `using policy_category = ddp::comm_hook_policy;`) that models ddp::comm_hook: start(bucket)
/// starts the reduction of one bucket's gradients and returns its ddp::work; complete(bucket) runs once that
/// work is done and leaves the averaged gradients in the bucket. A hook may keep state (per bucket: the
/// bucket's index is stable across steps). plain_hook all-reduces with the average; bf16_compress_hook and
/// fp16_compress_hook divide by the world size, round into a reused half-precision buffer, all-reduce the sum
/// in that dtype and widen the result back (PyTorch's compression hooks).

#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/parallel/archetype.hpp>

namespace ddp {

namespace detail {
struct hook_category {};
}  // namespace detail

/// The policy_category of a comm hook: `using policy_category = ddp::comm_hook_policy;`.
using comm_hook_policy = detail::hook_category;

/// One bucket as a comm hook sees it: its gradients (one dtype), the group reducing them and the memory domain they
/// live in (element work on them runs there).
template <class Comm>
struct bucket_gradients {
  raw_tensor grads;        ///< the bucket's gradients: reduce them in place, averaged over the group
  Comm& comm;              ///< the group (the world under replicate)
  std::size_t index;       ///< the bucket's place in start order, the same every step (for per-bucket state)
  memory_domain& memory;   ///< where `grads` live: allocate scratch and run element work there

  /// Number of ranks the gradients are averaged over.
  [[nodiscard]] int world_size() const { return comm.size(); }
  /// The gradients' element type.
  [[nodiscard]] dtype type() const noexcept { return grads.type; }
  /// The gradients as elements of type T (T must match type()).
  template <element T>
  [[nodiscard]] std::span<T> elements() const noexcept {
    return {static_cast<T*>(grads.data), grads.size};
  }
};

/// A comm hook over communicator Comm: start starts a bucket's reduction, complete finishes it.
template <class H, class Comm = detail::archetype_communicator>
concept comm_hook = std::default_initializable<H> && std::same_as<typename H::policy_category, comm_hook_policy> &&
                    requires(H& h, const bucket_gradients<Comm>& b) {
                      { h.start(b) } -> std::same_as<work>;
                      h.complete(b);
                    };

/// Gradients travel in their own dtype, averaged by the all-reduce.
struct plain_hook {
  using policy_category = comm_hook_policy;
  /// Starts the average of the bucket across the group.
  template <class Comm>
  work start(const bucket_gradients<Comm>& b) {
    return b.comm.all_reduce(b.grads, reduce_op::avg);
  }
  /// Nothing to undo once the reduction is done.
  template <class Comm>
  void complete(const bucket_gradients<Comm>& /*b*/) {}
};
static_assert(comm_hook<plain_hook>);

namespace detail {

/// Gradients of f32/f64 buckets travel as Half: pre-divided by the world size (multiplied by its reciprocal in
/// the gradients' own dtype, so sums of large values do not overflow float16), summed in Half, widened back. Other
/// dtypes travel as they are. One reused Half buffer per bucket in the gradients' domain, made on its first start.
template <class Half>
class compress_hook {
 public:
  using policy_category = comm_hook_policy;
  template <class Comm>
  work start(const bucket_gradients<Comm>& b) {
    if (!compressed(b.type())) return b.comm.all_reduce(b.grads, reduce_op::avg);
    const raw_tensor half = scratch(b);
    b.memory.convert(b.grads, half, 1.0 / b.world_size());
    return b.comm.all_reduce(half, reduce_op::sum);
  }
  template <class Comm>
  void complete(const bucket_gradients<Comm>& b) {
    if (compressed(b.type())) b.memory.convert(scratch(b), b.grads);
  }

 private:
  static bool compressed(dtype t) noexcept { return t == dtype::f32 || t == dtype::f64; }
  template <class Comm>
  raw_tensor scratch(const bucket_gradients<Comm>& b) {
    if (scratch_.size() <= b.index) scratch_.resize(b.index + 1);
    auto& s = scratch_[b.index];
    if (s.size() < b.grads.size * sizeof(Half) || s.domain() != &b.memory) s = b.memory.allocate(b.grads.size * sizeof(Half));
    return s.view(dtype_v<Half>, 0, b.grads.size);
  }
  std::vector<domain_buffer> scratch_;  // per bucket index, in the bucket's domain
};

}  // namespace detail

/// Gradients are cast to bfloat16 for the reduction and back (half the bytes).
struct bf16_compress_hook : detail::compress_hook<bfloat16> {};
static_assert(comm_hook<bf16_compress_hook>);
/// Gradients are scaled, cast to float16 for the reduction and back (half the bytes).
struct fp16_compress_hook : detail::compress_hook<float16> {};
static_assert(comm_hook<fp16_compress_hook>);

}  // namespace ddp
