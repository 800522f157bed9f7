#pragma once
/// \file Element-wise reduction kernels of the TCP backend: dst = a (op) b over n elements, for every
/// dtype; bf16/f16 widen to float for the arithmetic. Plain loops the compiler vectorizes.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/dtype.hpp>

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

/// dst[i] = a[i] (op) b[i]; dst may alias a (not b). avg sums here; finish_avg divides at the end.
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

/// Divides n elements by `ranks` in place when op is avg (integers divide truncating).
template <class T>
void finish_avg(T* data, std::size_t n, reduce_op op, int ranks) {
  if (op != reduce_op::avg || ranks == 1) return;
  using A = accumulate_t<T>;
  if constexpr (std::is_floating_point_v<A>) {
    const A scale = A(1) / static_cast<A>(ranks);
    for (std::size_t i = 0; i < n; ++i) data[i] = T(static_cast<A>(data[i]) * scale);
  } else {
    const A d = static_cast<A>(ranks);
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<T>(data[i] / d);
  }
}

/// Runtime-dtype dispatch of reduce_into over raw bytes.
inline void reduce_bytes(dtype t, void* dst, const void* a, const void* b, std::size_t n, reduce_op op) {
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    reduce_into(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n, op);
  });
}

/// Runtime-dtype dispatch of finish_avg over raw bytes.
inline void finish_avg_bytes(dtype t, void* data, std::size_t n, reduce_op op, int ranks) {
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    finish_avg(static_cast<T*>(data), n, op, ranks);
  });
}

}  // namespace ddp::tcp::detail
