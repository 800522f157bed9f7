#pragma once
/// \file One in-flight operation of ddp::local::communicator: its rank's place at a rendezvous. Waiting runs the
/// rank's shares that are ready (of any of its operations, so ranks waiting in different orders never block each
/// other) and the shares of this rendezvous no other rank has started, then polls and sleeps until every share has
/// run; avg is divided here once it is done.

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/call.hpp>
#include <ddp/comm/local/group.hpp>
#include <ddp/comm/local/slot.hpp>
#include <ddp/comm/local/world.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/work.hpp>
#include <ddp/memory/average.hpp>

namespace ddp::local::detail {

/// Raises the error `f` means for group rank `rank` in call `c`.
[[noreturn]] inline void raise(const fault& f, const ddp::detail::call_info& c, int rank) {
  const std::string what = ddp::detail::describe(c) + ": " + f.text;
  if (f.what == fault::kind::mismatch) throw mismatch_error(what, rank);
  throw peer_lost(what, rank, f.lost);
}

/// A rank's place at rendezvous `at`, for group rank `rank` (world rank `world_rank`) of `group`.
class operation final : public ddp::detail::work_state {
 public:
  /// Group rank `rank`'s place at `at` for call `c`, keeping `scratch` (a copy of an overlapping input) until done.
  operation(std::shared_ptr<group_state> group, std::shared_ptr<slot> at, int rank, ddp::detail::call_info c,
            std::vector<std::byte> scratch = {})
      : group_(std::move(group)), slot_(std::move(at)), rank_(rank),
        world_rank_(group_->members[static_cast<std::size_t>(rank)]), call_(std::move(c)),
        scratch_(std::move(scratch)) {}
  operation(const operation&) = delete;
  operation& operator=(const operation&) = delete;

  /// Dropped before it completed: waits for it up to the timeout like a wait() would, except while its thread
  /// unwinds an exception; then fails the rendezvous for the others and waits until no share reads or writes this
  /// rank's buffers any more.
  ~operation() override {
    world& w = *group_->home;
    try {
      if (done_ || (std::uncaught_exceptions() == 0 && wait_until(clock::now() + w.cfg.timeout))) return;
    } catch (const std::exception&) {  // the error was the caller's to wait for; the buffers still must be let go
    }
    std::unique_lock lock(w.mutex);
    if (call_.kind == collective::send_recv && !slot_->full()) withdraw(*group_, slot_);
    if (!slot_->complete())
      slot_->fail({fault::kind::lost, rank_,
                   group_->label(rank_) + " dropped its " + ddp::detail::describe_call(call_) +
                       " before it completed" + (std::uncaught_exceptions() > 0 ? " (its thread threw)" : "")});
    w.notify();
    while (slot_->running != 0) w.pause(lock, w.epoch(), clock::now() + std::chrono::milliseconds(10));
  }

  bool test() override {
    group_->home->drive(world_rank_);
    std::lock_guard lock(group_->home->mutex);
    return settled();
  }

  bool wait_until(clock::time_point deadline) override {
    world& w = *group_->home;
    for (;;) {
      const std::uint64_t seen = w.epoch();  // before drive: a share that becomes ready meanwhile ends the pause
      w.drive(world_rank_);
      w.help(slot_);
      std::unique_lock lock(w.mutex);
      if (settled()) return true;
      if (clock::now() >= deadline) return false;
      w.pause(lock, seen, deadline);
    }
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const override { return group_->home->cfg.timeout; }
  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] std::string describe() const override { return ddp::detail::describe(call_); }

  /// The ranks that have not reached this call, or not run their share of it yet.
  [[nodiscard]] std::string waiting_for() const override {
    std::lock_guard lock(group_->home->mutex);
    std::string who;
    for (std::size_t i = 0; i < slot_->parts.size(); ++i) {
      if (slot_->arrived[i] != 0 && (slot_->owes[i] == 0 || !slot_->full())) continue;
      if (!who.empty()) who += ", ";
      const int q = slot_->arrived[i] != 0 ? slot_->ranks[i]
                    : call_.kind == collective::send_recv ? call_.peer : static_cast<int>(i);
      who += group_->label(q) + (slot_->arrived[i] == 0 ? " (not there yet)" : " (its share)");
    }
    return who;
  }

 private:
  /// True once complete (finishing avg the first time); raises the rendezvous' failure. Caller holds the mutex.
  bool settled() {
    if (done_) return true;
    if (slot_->failure.what != fault::kind::none) raise(slot_->failure, call_, rank_);
    if (!slot_->complete()) return false;
    if (call_.average.size != 0) ddp::detail::divide(call_.average, call_.group_size);
    scratch_ = {};
    done_ = true;
    return true;
  }

  std::shared_ptr<group_state> group_;
  std::shared_ptr<slot> slot_;
  int rank_;
  int world_rank_;
  ddp::detail::call_info call_;
  std::vector<std::byte> scratch_;  ///< a copy of an input that overlaps the output, alive until done
  bool done_ = false;
};

}  // namespace ddp::local::detail
