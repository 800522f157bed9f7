#pragma once
/// \file Gradient buckets: byte ranges of a gradient arena, planned in reverse visit order so the
/// buckets whose gradients the backward produces first are started first, and replanned in the order a
/// step's gradients became ready (parallel/bucket_rebuild.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <tuple>
#include <utility>
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
  std::size_t last_slot = 0;        ///< the highest slot (latest in visit order) it holds; orders starts
  std::size_t unit = 0;             ///< the unit of `last_slot` (the only unit when planned unit-aligned)
};

/// Where a bucket may begin: anywhere in its arena (replicate), or never across the start of a unit (the
/// sharded strategies, so that unsharding a unit all-gathers whole buckets).
enum class bucket_cut : std::uint8_t { anywhere, within_units };

/// The buckets of a layout in start order, and for every slot the buckets it overlaps.
struct bucket_plan {
  std::vector<bucket> buckets;                        ///< start order: reverse visit order, or ready order once rebuilt
  std::vector<std::vector<std::size_t>> of_param;     ///< per slot, indices into `buckets`

  /// Fills `of_param` from `buckets` for a layout of `slots` parameters.
  void index(std::size_t slots) {
    of_param.assign(slots, {});
    for (std::size_t b = 0; b < buckets.size(); ++b)
      for (const std::size_t s : buckets[b].params) of_param[s].push_back(b);
  }
};

/// Where arena `a`'s gradients that become ready last begin: the end of its first unit in visit order (the
/// backward reaches it last), when the gradients before it in the backward (the rest of the arena) fill at least
/// a first bucket; else 0. A bucket that ended beyond this point could start only after the whole backward, so
/// a model whose largest layers come late in the backward would overlap none of its communication (PyTorch's
/// fixed 25 MiB buckets leave an MLP of 23 MB one bucket that waits for the end); cut here, everything but the
/// last unit's gradients is on the wire while that unit's backward runs.
inline std::size_t tail_start(const parameter_layout& layout, std::size_t a, std::size_t first_bytes) {
  const auto& arena = layout.arenas()[a];
  const auto slots = layout.slots();
  for (std::size_t k = 1; k < arena.params.size(); ++k)
    if (slots[arena.params[k]].unit != slots[arena.params[0]].unit) {
      const std::size_t cut = slots[arena.params[k]].offset;
      return (arena.numel - cut) * size_of(arena.type) >= first_bytes ? cut : 0;
    }
  return 0;
}

/// The bucket [begin, end) of arena `a`, holding every non-empty slot it overlaps.
inline bucket make_bucket(const parameter_layout& layout, std::size_t a, std::size_t begin, std::size_t end) {
  const auto slots = layout.slots();
  bucket b{.arena = a, .begin = begin, .end = end, .params = {}, .last_slot = 0, .unit = 0};
  for (const std::size_t s : layout.arenas()[a].params)
    if (slots[s].offset < end && slots[s].offset + slots[s].numel > begin && slots[s].numel > 0) b.params.push_back(s);
  b.last_slot = b.params.empty() ? 0 : b.params.back();
  b.unit = slots[b.last_slot].unit;
  return b;
}

/// Cuts each arena from its end into buckets of `first_bytes` (the first), then `capacity_bytes` each,
/// and orders all buckets by their latest parameter, last first. No bucket crosses the tail_start of its arena.
/// For the sharded strategies (on a layout padded to `multiple`) bucket lengths are multiples of `multiple`
/// elements so each splits into equal shards, and with bucket_cut::within_units no bucket crosses the start of a
/// unit.
inline bucket_plan plan_buckets(const parameter_layout& layout, std::size_t capacity_bytes, std::size_t first_bytes,
                                std::size_t multiple = 1, bucket_cut cut = bucket_cut::anywhere) {
  bucket_plan plan;
  const auto arenas = layout.arenas();
  const auto slots = layout.slots();
  for (std::size_t a = 0; a < arenas.size(); ++a) {
    const std::size_t width = size_of(arenas[a].type);
    std::vector<std::size_t> unit_starts{0};  // where buckets must break, ascending
    if (cut == bucket_cut::within_units) {
      for (std::size_t k = 1; k < arenas[a].params.size(); ++k)
        if (slots[arenas[a].params[k]].unit != slots[arenas[a].params[k - 1]].unit)
          unit_starts.push_back(slots[arenas[a].params[k]].offset);
    } else if (const std::size_t tail = tail_start(layout, a, first_bytes); tail > 0) {
      unit_starts.push_back(tail);
    }
    std::size_t end = arenas[a].numel;
    bool first = true;
    while (end > 0) {
      const std::size_t cap = std::max(multiple, (first ? first_bytes : capacity_bytes) / width / multiple * multiple);
      const std::size_t floor = *std::prev(std::lower_bound(unit_starts.begin(), unit_starts.end(), end));
      const std::size_t begin = std::max(end > cap ? end - cap : 0, floor);
      plan.buckets.push_back(make_bucket(layout, a, begin, end));
      end = begin;
      first = false;
    }
  }
  std::stable_sort(plan.buckets.begin(), plan.buckets.end(), [](const bucket& x, const bucket& y) {
    return std::tie(x.last_slot, x.end) > std::tie(y.last_slot, y.end);
  });
  plan.index(slots.size());
  return plan;
}

/// Buckets in the order of `ready` (every slot once, in the order their gradients became ready), for a layout
/// without padding (replicate). Each bucket is a contiguous range of its arena: from the next slot to become
/// ready, the longest run of the slots that follow it in `ready` whose union is contiguous and fits the
/// capacity (`first_bytes` for an arena's first bucket) and that does not join the slots of the unit that became
/// ready last to earlier ones (as tail_start, where the earlier ones fill a first bucket); a slot larger than the
/// capacity alone is cut into pieces, last elements first (after the first piece, of the full capacity). Buckets
/// start in the order their last slot became ready.
inline bucket_plan plan_in_ready_order(const parameter_layout& layout, std::span<const std::size_t> ready,
                                       std::size_t capacity_bytes, std::size_t first_bytes) {
  const auto arenas = layout.arenas();
  const auto slots = layout.slots();
  std::vector<std::size_t> place(slots.size());  // a slot's index among its arena's slots
  for (const auto& a : arenas)
    for (std::size_t k = 0; k < a.params.size(); ++k) place[a.params[k]] = k;
  std::vector<std::pair<std::size_t, bucket>> made;  // (when its last slot became ready, the bucket)
  for (std::size_t a = 0; a < arenas.size(); ++a) {
    std::vector<std::size_t> seq, when;  // arena a's non-empty slots in ready order, and their places in `ready`
    for (std::size_t i = 0; i < ready.size(); ++i)
      if (slots[ready[i]].arena == a && slots[ready[i]].numel > 0) {
        seq.push_back(ready[i]);
        when.push_back(i);
      }
    const std::size_t width = size_of(arenas[a].type);
    // The tail: the slots from the first of the unit that became ready last, kept apart where the slots before
    // them fill a first bucket.
    std::size_t tail = seq.size();
    if (!seq.empty()) {
      const std::size_t last_unit = slots[seq.back()].unit;
      std::size_t k = seq.size(), before = 0;
      while (k > 0 && slots[seq[k - 1]].unit == last_unit) --k;
      for (std::size_t i = 0; i < k; ++i) before += slots[seq[i]].numel;
      if (k > 0 && before * width >= first_bytes) tail = k;
    }
    for (std::size_t i = 0; i < seq.size();) {
      const std::size_t cap = std::max<std::size_t>(1, (i == 0 ? first_bytes : capacity_bytes) / width);
      const std::size_t stop = i < tail ? tail : seq.size();
      std::size_t lo = place[seq[i]], hi = lo, total = slots[seq[i]].numel, last = i, run_lo = lo, run_hi = hi;
      for (std::size_t j = i + 1; j < stop && (total += slots[seq[j]].numel) <= cap; ++j) {
        lo = std::min(lo, place[seq[j]]);
        hi = std::max(hi, place[seq[j]]);
        if (hi - lo == j - i) std::tie(last, run_lo, run_hi) = std::tuple(j, lo, hi);
      }
      const auto& low = slots[arenas[a].params[run_lo]];
      const auto& high = slots[arenas[a].params[run_hi]];
      // One piece, unless a slot exceeds the capacity: then pieces of `cap`, further ones of the full capacity.
      for (std::size_t end = high.offset + high.numel, piece = cap; end > low.offset;) {
        const std::size_t begin = std::max(low.offset, end > piece ? end - piece : 0);
        made.emplace_back(when[last], make_bucket(layout, a, begin, end));
        end = begin;
        piece = std::max<std::size_t>(1, capacity_bytes / width);
      }
      i = last + 1;
    }
  }
  std::stable_sort(made.begin(), made.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  bucket_plan plan;
  for (auto& m : made) plan.buckets.push_back(std::move(m.second));
  plan.index(slots.size());
  return plan;
}

}  // namespace ddp::detail
