#pragma once
/// \file The calls submitted to the engine, in submission order, and who runs them. The engine thread takes
/// them one at a time; a shared-memory call (a collective of a group on one host, or a send or recv through
/// the rings) submitted while nothing runs or waits may run on the caller's thread instead (shm_run.hpp,
/// peer_io.hpp): a collective goes back to the front of the queue when its peers are late, a recv stays posted. One mutex
/// guards the queue and orders the submissions (callers take it to number their calls).

#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <utility>

#include <ddp/comm/tcp/call.hpp>

namespace ddp::tcp::detail {

class call_queue {
 public:
  /// The mutex that orders submissions; callers take it to assign sequence numbers atomically with push_locked().
  std::mutex& mutex() { return mutex_; }
  /// With mutex() held: queues `c` behind the others.
  void push_locked(call c) { calls_.push_back(std::move(c)); }
  /// With mutex() held: true (and the queue claimed) when call `c` may run on the caller's thread now: a
  /// collective over shared memory or of a group of one rank, or a send or recv where the job has shared memory,
  /// with nothing running or waiting before it and the engine not failed.
  bool claim_locked(const call& c) {
    const bool alone = c.grp->size() == 1 && c.side == p2p::none;  // a collective of one rank moves no byte
    if ((c.grp->shm == nullptr && !alone) || busy_ || !calls_.empty() || failed_ || caller_failure_) return false;
    busy_ = true;
    return true;
  }
  /// Ends the caller's claim: `back` (a call handed off) goes to the front, `failure` (what a call on the
  /// caller's thread failed with) waits for the engine thread to tell the peers. True when the engine thread
  /// has work.
  bool release(std::optional<call> back, std::exception_ptr failure) {
    std::lock_guard lock(mutex_);
    if (back) calls_.push_front(std::move(*back));
    if (failure) caller_failure_ = std::move(failure);
    busy_ = false;
    return !calls_.empty() || caller_failure_;
  }

  // ---- the engine thread's side ----

  /// With mutex() held: the next call, claimed, where none runs.
  std::optional<call> take_locked() {
    if (calls_.empty() || busy_) return std::nullopt;
    std::optional<call> c(std::move(calls_.front()));
    calls_.pop_front();
    busy_ = true;
    return c;
  }
  /// The call take_locked() gave has completed.
  void finished() {
    std::lock_guard lock(mutex_);
    busy_ = false;
  }
  /// With mutex() held: what a call on the caller's thread failed with (once), or null.
  std::exception_ptr take_caller_failure_locked() { return std::exchange(caller_failure_, nullptr); }
  /// The engine aborted: later calls run (and fail) on the engine thread.
  void fail() {
    std::lock_guard lock(mutex_);
    failed_ = true;
  }
  /// Asks the engine thread to stop.
  void stop() {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  /// With mutex() held: true once stop() was called.
  [[nodiscard]] bool stopping_locked() const { return stop_; }
  /// True once stop() was called.
  [[nodiscard]] bool stopping() {
    std::lock_guard lock(mutex_);
    return stop_;
  }
  /// Removes and returns every call still queued.
  std::deque<call> drain() {
    std::lock_guard lock(mutex_);
    return std::exchange(calls_, {});
  }

 private:
  std::mutex mutex_;
  std::deque<call> calls_;
  bool busy_ = false;                  ///< a call runs, on the engine thread or the caller's
  bool failed_ = false;                ///< the engine aborted: later calls fail on the engine thread
  std::exception_ptr caller_failure_;  ///< a call on the caller's thread failed: the engine tells the peers
  bool stop_ = false;
};

}  // namespace ddp::tcp::detail
