#pragma once
/// \file Running a collective over its group's shared-memory segment, on either thread. On the caller's
/// thread (the engine idle: no hop between threads) until its first barrier has spun shm_handoff_after
/// without its peers; then, or from the start where the engine is busy, on the engine thread, which sleeps
/// in slices of 1 ms, doubling up to shm_longest_engine_slice while the peers stay away, and serves its sockets
/// between them.

#include <chrono>
#include <functional>
#include <utility>

#include <ddp/comm/tcp/call.hpp>
#include <ddp/comm/tcp/shm_algorithms.hpp>
#include <ddp/comm/tcp/shm_channel.hpp>
#include <ddp/core/work.hpp>

namespace ddp::tcp::detail {

/// The caller's thread spins this long at a shared-memory call's first barrier, or moves a send or recv through
/// its ring this long without a byte moving, before handing the call to the engine thread. Where ranks outnumber
/// the cores too: measured with both ranks of `bench/comm` `ddp_bench_p2p` on one core, a 4 KiB send took 7 us
/// one way so, 23 us when the engine thread took it on after a microsecond; 4 MiB 0.22 against 0.33 ms.
inline constexpr std::chrono::microseconds shm_handoff_after{100};

/// Runs shared-memory call `c` on the caller's thread: true when it completed, false when its peers were not
/// there within shm_handoff_after (c.resumed is then set: the engine thread resumes it). Throws what failed.
inline bool run_shm_on_caller(call& c, ddp::detail::stall_note* note) {
  shm_waiting how = waiting_among(*c.grp->shm);
  how.handoff_after = shm_handoff_after;
  how.note = note;
  try {
    shm_channel ch(*c.grp->shm, c, clock::now() + c.grp->timeout, std::move(how));
    shm_execute(ch, *c.grp->shm);
    return true;
  } catch (const shm_handoff&) {
    c.resumed = true;
    return false;
  }
}

/// Runs (or resumes) shared-memory call `c` on the engine thread by `deadline`, calling `serve` between
/// sleeps (it serves the sockets, and throws to cancel the call).
inline void run_shm_on_engine(call& c, clock::time_point deadline, ddp::detail::stall_note* note,
                              std::function<void()> serve) {
  shm_waiting how = waiting_among(*c.grp->shm);
  how.resumed = c.resumed;
  how.slice = std::chrono::milliseconds(1);
  how.longest_slice = shm_longest_engine_slice;
  how.note = note;
  how.between = std::move(serve);
  // One slice past the deadline, as poll's rounding gives the sockets: wait(), whose timeout message carries the
  // flight recorder's view, gives up first.
  shm_channel ch(*c.grp->shm, c, deadline + how.slice, std::move(how));
  shm_execute(ch, *c.grp->shm);
}

}  // namespace ddp::tcp::detail
