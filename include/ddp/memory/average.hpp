#pragma once
/// \file The host-side finish of reduce_op::avg: a sum divided by the group size, the same way on every backend
/// that averages on the host (integers truncate toward zero, bf16/f16 divide in float); and scaling by a factor.

#include <cstddef>
#include <type_traits>

#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::detail {

/// Multiplies every element of the host buffer `t` by `factor`: in the element type where `factor` is exact in
/// it (the product then rounds once, as it would through double), else in double, rounded to the element type
/// (bf16/f16 through float; integers truncate toward zero).
inline void scale(const raw_tensor& t, double factor) {
  visit_dtype(t.type, [&](auto zero) {
    using T = decltype(zero);
    auto* p = static_cast<T*>(t.data);
    if constexpr (std::is_floating_point_v<T>) {
      if (static_cast<double>(static_cast<T>(factor)) == factor) {
        const T exact = static_cast<T>(factor);
        for (std::size_t i = 0; i < t.size; ++i) p[i] *= exact;
        return;
      }
    }
    for (std::size_t i = 0; i < t.size; ++i)
      if constexpr (std::is_arithmetic_v<T>)
        p[i] = static_cast<T>(static_cast<double>(p[i]) * factor);
      else
        p[i] = T(static_cast<float>(static_cast<double>(static_cast<float>(p[i])) * factor));
  });
}

/// Divides every element of the host buffer `t` by `n`; nothing to do for n = 1.
inline void divide(const raw_tensor& t, int n) {
  if (n == 1) return;
  visit_dtype(t.type, [&](auto zero) {
    using T = decltype(zero);
    auto* p = static_cast<T*>(t.data);
    if constexpr (std::is_integral_v<T>) {
      for (std::size_t i = 0; i < t.size; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(n));
    } else if ((n & (n - 1)) == 0) {
      // A power of two's reciprocal is exact, so multiplying by it gives the quotient's bits at a fraction of
      // a division's cost.
      scale(t, 1.0 / n);
    } else if constexpr (std::is_floating_point_v<T>) {
      for (std::size_t i = 0; i < t.size; ++i) p[i] /= static_cast<T>(n);
    } else {
      for (std::size_t i = 0; i < t.size; ++i) p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
    }
  });
}

}  // namespace ddp::detail
