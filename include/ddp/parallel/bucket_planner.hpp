#pragma once
/// \file Gradient buckets: byte ranges of a gradient arena, planned in reverse visit order so the
/// buckets whose gradients the backward produces first are launched first.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <tuple>
#include <vector>

#include <ddp/core/dtype.hpp>
#include <ddp/parallel/arena.hpp>

namespace ddp::detail {

/// A zero-copy slice [begin, end) of one arena's gradients. Its boundaries may fall inside a parameter:
/// a parameter completes every bucket it overlaps.
struct bucket {
  std::size_t arena = 0;            ///< arena index
  std::size_t begin = 0;            ///< first element
  std::size_t end = 0;              ///< one past the last element
  std::vector<std::size_t> params;  ///< slots overlapping the range
  std::size_t last_slot = 0;        ///< the highest slot (latest in visit order) it holds; orders launches
  std::size_t unit = 0;             ///< the unit of `last_slot` (the only unit when planned unit-aligned)
};

/// Where a bucket may begin: anywhere in its arena (replicate), or never across the start of a unit (the
/// sharded strategies, so that unsharding a unit gathers whole buckets).
enum class bucket_cut : std::uint8_t { anywhere, within_units };

/// The buckets of a layout in launch order, and for every slot the buckets it overlaps.
struct bucket_plan {
  std::vector<bucket> buckets;                        ///< launch order: reverse visit order
  std::vector<std::vector<std::size_t>> of_param;     ///< per slot, indices into `buckets`
};

/// Cuts each arena from its end into buckets of `first_bytes` (the first), then `capacity_bytes` each,
/// and orders all buckets by their latest parameter, last first. For the sharded strategies (on a layout
/// padded to `multiple`) bucket lengths are multiples of `multiple` elements so each splits into equal
/// shards, and with bucket_cut::within_units no bucket crosses the start of a unit.
inline bucket_plan plan_buckets(const parameter_layout& layout, std::size_t capacity_bytes, std::size_t first_bytes,
                                std::size_t multiple = 1, bucket_cut cut = bucket_cut::anywhere) {
  bucket_plan plan;
  const auto arenas = layout.arenas();
  const auto slots = layout.slots();
  for (std::size_t a = 0; a < arenas.size(); ++a) {
    const std::size_t width = size_of(arenas[a].type);
    std::vector<std::size_t> unit_starts{0};
    if (cut == bucket_cut::within_units)
      for (std::size_t k = 1; k < arenas[a].params.size(); ++k)
        if (slots[arenas[a].params[k]].unit != slots[arenas[a].params[k - 1]].unit)
          unit_starts.push_back(slots[arenas[a].params[k]].offset);
    std::size_t end = arenas[a].numel;
    bool first = true;
    while (end > 0) {
      const std::size_t cap = std::max(multiple, (first ? first_bytes : capacity_bytes) / width / multiple * multiple);
      const std::size_t floor = *std::prev(std::lower_bound(unit_starts.begin(), unit_starts.end(), end));
      const std::size_t begin = std::max(end > cap ? end - cap : 0, floor);
      bucket b{.arena = a, .begin = begin, .end = end, .params = {}, .last_slot = 0, .unit = 0};
      for (const std::size_t s : arenas[a].params)
        if (slots[s].offset < end && slots[s].offset + slots[s].numel > begin && slots[s].numel > 0) b.params.push_back(s);
      b.last_slot = b.params.empty() ? 0 : b.params.back();
      b.unit = slots[b.last_slot].unit;
      plan.buckets.push_back(std::move(b));
      end = begin;
      first = false;
    }
  }
  std::stable_sort(plan.buckets.begin(), plan.buckets.end(), [](const bucket& x, const bucket& y) {
    return std::tie(x.last_slot, x.end) > std::tie(y.last_slot, y.end);
  });
  plan.of_param.resize(slots.size());
  for (std::size_t b = 0; b < plan.buckets.size(); ++b)
    for (const std::size_t s : plan.buckets[b].params) plan.of_param[s].push_back(b);
  return plan;
}

}  // namespace ddp::detail
