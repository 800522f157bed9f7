#pragma once
/// \file The argument checks every backend makes before a collective, as messages: empty when the arguments
/// are fine, else what is wrong and the fix. Each backend prefixes the call and the rank and throws.

#include <cstddef>
#include <string>

#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::detail {

/// Empty when `in` and `out` have one dtype, else what to fix.
inline std::string dtype_problem(const raw_tensor& in, const raw_tensor& out) {
  if (in.type == out.type) return {};
  return "input is " + std::string(to_string(in.type)) + " but output is " + std::string(to_string(out.type)) +
         "; pass buffers of one dtype";
}

/// Empty when `whole` holds `ranks` blocks of `block` elements, else what to fix.
inline std::string blocks_problem(std::size_t whole, std::size_t block, int ranks, const char* whole_name,
                                  const char* block_name) {
  if (whole == block * static_cast<std::size_t>(ranks)) return {};
  return std::string(whole_name) + " has " + std::to_string(whole) + " elements but must hold size()=" +
         std::to_string(ranks) + " times the " + std::to_string(block) + " elements of the " + block_name;
}

/// Empty when `r` is a rank of a group of `ranks`, else what to fix; `what` names the argument ("broadcast root").
inline std::string rank_problem(int r, int ranks, const char* what) {
  if (r >= 0 && r < ranks) return {};
  return std::string(what) + " " + std::to_string(r) + " is not a rank of this group (0.." +
         std::to_string(ranks - 1) + ")";
}

}  // namespace ddp::detail
