#pragma once
/// \file split_members: which ranks of a group one split's color forms, in the order of the new group — the part of
/// `split(color, key)` every backend that builds its own groups shares.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace ddp::detail {

/// Collective over `comm`: the ranks whose color equals this rank's `color`, ordered by (key, rank).
template <class Comm>
[[nodiscard]] std::vector<int> split_members(Comm& comm, int color, int key) {
  const std::array<std::int64_t, 2> mine{color, key};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all)).wait();
  auto key_of = [&](int p) { return all[2 * static_cast<std::size_t>(p) + 1]; };
  std::vector<int> ranks;
  for (int p = 0; p < comm.size(); ++p)
    if (all[2 * static_cast<std::size_t>(p)] == color) ranks.push_back(p);
  std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return key_of(a) < key_of(b); });
  return ranks;
}

}  // namespace ddp::detail
