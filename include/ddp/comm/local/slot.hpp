#pragma once
/// \file One rendezvous of ddp::local's ranks: a collective of a group (every member takes part) or a matched send
/// and recv (two take part). Each participant leaves its buffers here; once all have arrived, each runs its share
/// of the work on its own thread, reading and writing the others' buffers in place (comm/local/shares.hpp).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ddp/comm/call.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::local::detail {

/// Why a rendezvous failed: what each participant raises when it meets it.
struct fault {
  enum class kind : std::uint8_t { none, mismatch, lost };
  kind what = kind::none;
  int lost = -1;     ///< the group rank that went away (kind::lost)
  std::string text;  ///< the sentence after the call's description
};

/// What one participant leaves at a rendezvous: its input and output (a single buffer is the output).
struct part {
  raw_tensor in{};   ///< what the others read (empty where the call has no input of its own)
  raw_tensor out{};  ///< where results land
};

/// One rendezvous; every field is read and written under the world's mutex, the buffers by the shares.
struct slot {
  using share_fn = void (*)(const slot&, int participant);

  /// A rendezvous of `participants`, opened by `first_rank`'s call `c`.
  slot(int participants, const ddp::detail::call_info& c, int first_rank, share_fn f, reduce_op run)
      : call(c), first(first_rank), share(f), op(run), parts(static_cast<std::size_t>(participants)),
        arrived(parts.size()), owes(parts.size()), ranks(parts.size()) {}

  ddp::detail::call_info call;  ///< the first arrival's call: what the others must match
  int first;                    ///< the group rank that arrived first
  share_fn share;               ///< a participant's part of the work, run on its own thread
  reduce_op op;                 ///< the operator the shares run (avg arrives as sum; the front end divides)
  std::vector<part> parts;            ///< per participant: its buffers, once arrived
  std::vector<std::uint8_t> arrived;  ///< per participant
  std::vector<std::uint8_t> owes;     ///< per participant: it has a share still to run
  std::vector<int> ranks;             ///< per participant: its group rank
  int arrivals = 0;  ///< participants arrived so far
  int running = 0;  ///< shares running now (an abandoning rank waits for 0 before its buffers go)
  fault failure;     ///< none, or why every participant raises

  /// Every participant has arrived: the shares may run.
  [[nodiscard]] bool full() const noexcept { return arrivals == static_cast<int>(parts.size()); }
  /// Every participant has arrived and run its share: every buffer holds its result.
  [[nodiscard]] bool complete() const noexcept {
    if (!full() || running != 0) return false;
    for (const auto o : owes)
      if (o != 0) return false;
    return true;
  }
  /// The first failure stays; later ones add nothing.
  void fail(fault f) {
    if (failure.what == fault::kind::none) failure = std::move(f);
  }
};

}  // namespace ddp::local::detail
