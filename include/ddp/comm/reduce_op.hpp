#pragma once
/// \file Reduction operators of the collectives.

#include <cstdint>
#include <string_view>

namespace ddp {

/// How all_reduce, reduce and reduce_scatter combine the ranks' elements (avg divides the sum by the group size).
enum class reduce_op : std::uint8_t { sum, avg, min, max, prod };

/// "sum", "avg", ...
constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::prod: return "prod";
  }
  return "?";
}

}  // namespace ddp
