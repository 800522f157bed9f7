#pragma once
/// \file What a shared-memory collective sees while it executes one call: its region to fill, the phase
/// barrier (post, then wait for every rank: spin briefly, yielding the core after a few microseconds, or from
/// the first look where ranks outnumber the cores, then sleep on the futex in bounded slices that check each
/// awaited rank's life, its abort notice and the deadline), and the regions to read after it. Every phase
/// compares each rank's call description with this rank's, so mismatched calls raise mismatch_error naming both
/// calls.

#include <emmintrin.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

#include <ddp/comm/tcp/call.hpp>
#include <ddp/comm/tcp/messages.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/same_host.hpp>
#include <ddp/comm/tcp/shm_copy.hpp>
#include <ddp/comm/tcp/shm_group.hpp>
#include <ddp/comm/tcp/shm_world.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// Thrown by the caller's first phase barrier when the peers have not arrived within its spin: the engine
/// thread resumes the call, so the caller gets its work back at once.
struct shm_handoff {};

/// Spin this long at a barrier before sleeping on the futex (where the job has a core per rank).
inline constexpr std::chrono::microseconds shm_spin{50};

/// The engine thread's longest sleep in a flat shared-memory wait, between which it serves its sockets: a rank
/// that waits long for its peers costs 1.3-2.3 ms of CPU a second (1 ms slices throughout cost 19-21 ms a second;
/// 16 ms slices 2.7-4.1; measured on the 2-core VM, loaded, a 4 s wait at N = 2 and 3). The call itself ends as
/// soon as the peers post (they wake the sleeper); only bytes arriving on the sockets meanwhile wait this long.
inline constexpr std::chrono::milliseconds shm_longest_engine_slice{32};

/// How a shared-memory call waits for its peers.
struct shm_waiting {
  /// How long a barrier spins before it sleeps.
  std::chrono::nanoseconds spin{shm_spin};
  /// A spinning barrier yields its core between looks after this long (its peers' threads may need the core).
  std::chrono::nanoseconds yield_after{shm_yield_after};
  /// The first barrier gives up (shm_handoff) after spinning this long; zero: never.
  std::chrono::nanoseconds handoff_after{0};
  /// The call was handed off: its first region is filled and posted already.
  bool resumed = false;
  /// How long the first futex sleep lasts before the checks (and `between`) run again; each later one doubles,
  /// up to longest_slice, while the peers stay away (a long wait costs little CPU).
  std::chrono::milliseconds slice{20};
  /// The longest futex sleep.
  std::chrono::milliseconds longest_slice{20};
  /// Runs between sleeps (the engine thread serves its sockets); empty on the caller's thread.
  std::function<void()> between;
  /// Where wait() reads whom the call waits for while it sleeps.
  ddp::detail::stall_note* note = nullptr;
};

/// How long a thread waiting on group `g`'s shared memory (a barrier, a send or recv through a ring) spins before
/// it yields its core between looks: shm_yield_after, or not at all where ranks outnumber the cores, so a peer
/// waiting for this core runs at once. Measured on the 2-core VM at N = 4 (ddp_bench_collectives --ddp-only): a
/// 4 KiB all_reduce took 8 us so, 89 us where such barriers slept on the futex at once; 64 KiB 15 against 160 us,
/// 64 MiB 13.5 against 20 ms. With two ranks on one core: 6.5 us against 16 us yielding after shm_yield_after.
inline std::chrono::nanoseconds yield_after_among(const shm_group& g) {
  return g.oversubscribed() ? std::chrono::nanoseconds(0) : std::chrono::nanoseconds(shm_yield_after);
}

/// How a call among shared-memory group `g` waits.
inline shm_waiting waiting_among(const shm_group& g) {
  shm_waiting how;
  how.yield_after = yield_after_among(g);
  return how;
}

class shm_channel {
 public:
  shm_channel(shm_group& g, const call& c, clock::time_point deadline, shm_waiting how)
      : g_(g), c_(c), desc_(header_of(c, 0)), deadline_(deadline), how_(std::move(how)), skip_(how_.resumed) {}

  [[nodiscard]] const call& what() const { return c_; }
  [[nodiscard]] int rank() const { return g_.me(); }
  [[nodiscard]] int size() const { return g_.size(); }

  /// This rank's region of the coming phase (write it before sync()).
  char* fill() { return g_.data(g_.me(), g_.phase); }
  /// Copies `bytes` from `src` into this rank's coming region at `offset` (done already where resumed).
  void put(std::size_t offset, const void* src, std::size_t bytes) {
    if (skip_ || bytes == 0) return;
    shared_stores().copy(fill() + offset, src, bytes);
    c_.grp->stats.add_bytes(c_.kind, bytes);
  }
  /// Counts `bytes` this rank published for the others outside put().
  void count(std::size_t bytes) { c_.grp->stats.add_bytes(c_.kind, bytes); }
  /// Group rank `r`'s region of the phase just completed by sync().
  const char* at(int r) { return g_.data(r, g_.phase - 1); }

  /// Copies `bytes` at `address` in group rank `r`'s memory to `dest` (same_host.hpp); a failed copy, or one
  /// that overlapped the rank's abort, raises what ended the rank.
  void copy_from(int r, std::uint64_t address, std::size_t bytes, char* dest) {
    if (bytes == 0) return;
    int code = 0;
    const auto& peer = g_.world().memory[static_cast<std::size_t>(g_.world_rank(r))];
    const copy_result got = copy_from_peer(peer, remote_block{address, bytes}, dest, code);
    if (got == copy_result::copied) return;
    // It aborted or died while this rank copied: its notice or its death shows within the next seconds.
    for (const auto give_up = clock::now() + std::chrono::seconds(2); clock::now() < give_up;) {
      check(r);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    throw peer_lost(label(r) + " failed during " + describe(desc_) + " while this rank copied from its memory (" +
                        (got == copy_result::failed ? errno_text(code) : std::string("it aborted")) +
                        "), and no notice of why arrived within 2 s. Check that rank's log for the first error",
                    me_world(), g_.world_rank(r));
  }

  /// Posts the coming phase, waits until every rank has posted it, and checks that every rank runs this call.
  void sync() {
    const std::uint32_t target = g_.phase + 1;
    auto& mine = g_.counters(g_.me());
    if (!skip_) {
      g_.head(g_.me(), g_.phase).call = desc_;
      mine.posted.store(target, std::memory_order_seq_cst);
      if (mine.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(mine.posted);
    }
    const bool first = !synced_;
    synced_ = true;
    skip_ = false;
    for (int r = 0; r < g_.size(); ++r)
      if (r != g_.me()) await(r, target, first);
    for (int r = 0; r < g_.size(); ++r) {
      const frame_header& theirs = g_.head(r, g_.phase).call;
      if (r != g_.me() && !same_call(desc_, theirs))
        throw different_calls(label(g_.me()) + " called " + describe(desc_) + ", " + label(r) + " called " + describe(theirs),
                              me_world());
    }
    g_.phase = target;
  }

 private:
  static bool reached(const shm_counters& c, std::uint32_t target) {
    return static_cast<std::int32_t>(c.posted.load(std::memory_order_acquire) - target) >= 0;
  }

  /// Waits until group rank `r` posted phase `target`: spins (yielding the core after how_.yield_after), then
  /// hands the call off (the caller's first barrier) or sleeps.
  void await(int r, std::uint32_t target, bool first) {
    auto& theirs = g_.counters(r);
    const auto start = clock::now();
    const auto spin_until = start + (first && how_.handoff_after.count() > 0 ? how_.handoff_after : how_.spin);
    for (int i = 0; !reached(theirs, target); ++i) {
      _mm_pause();
      if ((i & 15) != 15) continue;
      const auto now = clock::now();
      if (now < spin_until) {
        if (now - start >= how_.yield_after) sched_yield();
        continue;
      }
      if (first && how_.handoff_after.count() > 0) throw shm_handoff{};
      return sleep_until(r, theirs, target);
    }
  }

  void sleep_until(int r, shm_counters& theirs, std::uint32_t target) {
    theirs.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const auto notice_at = clock::now() + stall_notice_after;  // whom it waits for is published only past this
    bool noticed = false;
    struct leave {
      shm_counters& c;
      ddp::detail::stall_note* note;
      ~leave() {
        c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        if (note != nullptr) note->set({});
      }
    } on_exit{theirs, how_.note};
    long slice = std::chrono::duration_cast<std::chrono::nanoseconds>(how_.slice).count();
    const long longest = std::max(slice, static_cast<long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                              how_.longest_slice).count()));
    for (;; slice = std::min(2 * slice, longest)) {
      const std::uint32_t seen = theirs.posted.load(std::memory_order_seq_cst);
      if (static_cast<std::int32_t>(seen - target) >= 0) return;
      check(r);
      if (!noticed && how_.note != nullptr && clock::now() >= notice_at) {
        how_.note->set(label(r));
        noticed = true;
      }
      futex_wait(theirs.posted, seen, slice);
      if (how_.between) how_.between();
    }
  }

  /// Throws what keeps group rank `r` from posting: its abort, its death or exit, or the deadline.
  void check(int r) {
    const int w = g_.world_rank(r);
    switch (g_.world().state_of(w)) {
      case shm_state::running:
      case shm_state::writing: break;
      case shm_state::closed:
        throw lost_peer(label(r), describe(desc_), "it closed its communicator or died", me_world(), w);
      case shm_state::aborted: {
        const auto& n = g_.world().notice_of(w);
        raise_notice(static_cast<abort_kind>(n.kind), label(r), describe(desc_), std::string(n.text, n.text_bytes),
                     me_world(), n.lost_rank);
      }
    }
    if (clock::now() >= deadline_) throw call_timeout(describe(desc_), c_.grp->timeout, label(r), me_world());
  }

  [[nodiscard]] int me_world() const { return g_.world_rank(g_.me()); }
  /// "rank 1", plus the world rank inside a subgroup.
  [[nodiscard]] std::string label(int r) const {
    return rank_label(static_cast<std::size_t>(g_.group_rank(r)), g_.world_rank(r),
                      c_.grp->members.size() != static_cast<std::size_t>(g_.world().size()));
  }

  shm_group& g_;
  const call& c_;
  frame_header desc_;
  clock::time_point deadline_;
  shm_waiting how_;
  bool skip_;
  bool synced_ = false;
};

}  // namespace ddp::tcp::detail
