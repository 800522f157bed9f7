#pragma once
/// \file The opt-in cross-rank call check (DDP_CHECK_COLLECTIVES=1): before each collective every rank shares the
/// fields that must agree (operation, operator, dtype, count, root), so that ranks calling different collectives
/// raise ddp::mismatch_error naming both calls at once instead of a timeout much later.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <ddp/comm/call.hpp>
#include <ddp/comm/env.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>

namespace ddp::detail {

/// True when the environment asks for the cross-rank call check (DDP_CHECK_COLLECTIVES=1; 0 or unset: off).
inline bool call_check_requested() {
  return env_integer("DDP_CHECK_COLLECTIVES", 0, 1,
                     "1 to compare every collective's operation, dtype, count and root across the ranks before it "
                     "runs (on every rank), or 0 for no check")
             .value_or(0) == 1;
}

/// The fields of a collective that must agree on every rank, as the words one rank contributes to the check.
using call_fingerprint = std::array<std::int64_t, 4>;

/// Marks a word set as a fingerprint; anything else came from a rank running without the check.
inline constexpr std::int64_t call_fingerprint_mark = 0x4444504343484b31;  // "DDPCCHK1"

/// `c` as the words every rank compares.
inline call_fingerprint fingerprint(const call_info& c) noexcept {
  const auto op = c.op ? static_cast<std::int64_t>(*c.op) + 1 : 0;
  return {static_cast<std::int64_t>(c.kind) | op << 8 | static_cast<std::int64_t>(c.type) << 16,
          static_cast<std::int64_t>(c.count), c.peer, call_fingerprint_mark};
}

/// The call another rank described with `f` ("broadcast of 8 f32 rooted at rank 1"), or why it cannot be read.
inline std::string describe_fingerprint(std::span<const std::int64_t, 4> f) {
  const auto kind = static_cast<std::size_t>(f[0] & 0xff);
  const auto op = static_cast<std::size_t>((f[0] >> 8) & 0xff);
  const auto type = static_cast<std::size_t>((f[0] >> 16) & 0xff);
  if (f[3] != call_fingerprint_mark || kind >= collective_count || op > 5 || type > static_cast<std::size_t>(dtype::u8))
    return "no collective with the call check (it runs without DDP_CHECK_COLLECTIVES=1, or another ddp version)";
  call_info c;
  c.kind = static_cast<collective>(kind);
  c.name = to_string(c.kind).data();
  if (op != 0) c.op = static_cast<reduce_op>(op - 1);
  c.type = static_cast<dtype>(type);
  c.count = static_cast<std::size_t>(f[1]);
  c.peer = static_cast<int>(f[2]);
  return describe_call(c);
}

/// Throws ddp::mismatch_error on `rank` when a rank's fingerprint in `all` (size() of them, in rank order) differs
/// from the one of `mine`, naming this rank's call and the first differing rank's.
inline void compare_calls(const call_info& mine, std::span<const std::int64_t> all, int rank) {
  const call_fingerprint ours = fingerprint(mine);
  for (std::size_t r = 0; r * ours.size() < all.size(); ++r) {
    const std::span<const std::int64_t, 4> theirs(all.data() + r * ours.size(), ours.size());
    if (std::equal(theirs.begin(), theirs.end(), ours.begin())) continue;
    throw mismatch_error(describe(mine) + ": rank " + std::to_string(r) + " called " + describe_fingerprint(theirs) +
                             " where this rank called " + describe_call(mine) +
                             "; every rank of the group must call the same collectives in the same order with the "
                             "same counts, dtypes, operators and roots (found by DDP_CHECK_COLLECTIVES=1)",
                         rank);
  }
}

}  // namespace ddp::detail
