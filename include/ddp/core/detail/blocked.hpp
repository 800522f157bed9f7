#pragma once
/// \file ddp::detail::for_each_blocked: an element loop the compiler vectorizes also at -O2, for the conversions
/// between f32 and the 16-bit floats (mixed precision's masters, the compression hooks' buckets).

#include <cstddef>

namespace ddp::detail {

/// Calls f(i) for every i below n, in blocks of 16 with a fixed trip count, which compilers vectorize also at -O2
/// (GCC's cost model there refuses a loop of unknown length but takes a fixed block): narrowing f32 to bf16 runs
/// several times faster than over the plain loop.
template <class F>
void for_each_blocked(std::size_t n, F&& f) {
  constexpr std::size_t block = 16;
  std::size_t i = 0;
  for (; i + block <= n; i += block)
    for (std::size_t k = 0; k < block; ++k) f(i + k);
  for (; i < n; ++i) f(i);
}

}  // namespace ddp::detail
