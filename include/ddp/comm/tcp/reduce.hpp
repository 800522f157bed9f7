#pragma once
/// \file Element-wise reduction kernels of the TCP backend: dst = a (op) b over n elements, for every
/// dtype; bf16/f16 widen to float for the arithmetic. Plain loops the compiler vectorizes.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <ddp/memory/average.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::tcp::detail {

template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

/// The arithmetic type of T: float for bf16/f16, T otherwise.
template <class T>
using accumulate_t = std::conditional_t<is_half_v<T>, float, T>;

template <class T, class F>
void combine(T* dst, const T* a, const T* b, std::size_t n, F f) {
  if constexpr (is_half_v<T>) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f(a[i], b[i]);
  }
}

/// dst[i] = a[i] (op) b[i]; dst may alias a (not b). avg sums here; finish_avg_bytes divides at the end.
template <class T>
void reduce_into(T* dst, const T* a, const T* b, std::size_t n, reduce_op op) {
  using A = accumulate_t<T>;
  switch (op) {
    case reduce_op::sum:
    case reduce_op::avg: return combine(dst, a, b, n, [](A x, A y) { return static_cast<A>(x + y); });
    case reduce_op::prod: return combine(dst, a, b, n, [](A x, A y) { return static_cast<A>(x * y); });
    case reduce_op::min: return combine(dst, a, b, n, [](A x, A y) { return y < x ? y : x; });
    case reduce_op::max: return combine(dst, a, b, n, [](A x, A y) { return x < y ? y : x; });
  }
}

/// Runtime-dtype dispatch of reduce_into over raw bytes.
inline void reduce_bytes(dtype t, void* dst, const void* a, const void* b, std::size_t n, reduce_op op) {
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    reduce_into(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n, op);
  });
}

/// Finishes avg on n elements: their sum divided by `ranks` as every backend averaging on the host does.
inline void finish_avg_bytes(dtype t, void* data, std::size_t n, reduce_op op, int ranks) {
  if (op == reduce_op::avg) ddp::detail::divide(raw_tensor{data, n, t}, ranks);
}

}  // namespace ddp::tcp::detail
