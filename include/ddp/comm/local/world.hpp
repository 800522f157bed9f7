#pragma once
/// \file The state the threads of one ddp::local::run share: one mutex over every rendezvous, each rank's agenda of
/// shares still to run, which ranks have left, and the waits (a short poll, yielding the core after a few
/// microseconds or at once where the ranks outnumber the cores, then a condition variable).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/local/config.hpp>
#include <ddp/comm/local/slot.hpp>

namespace ddp::local::detail {

/// The clock of every deadline.
using clock = std::chrono::steady_clock;

struct group_state;

/// A share a rank still has to run: participant `index` of `at`.
struct agenda_item {
  std::shared_ptr<slot> at;  ///< the rendezvous
  int index = 0;             ///< the participant whose share it is
};

/// One rank (thread) of the world.
struct member {
  std::vector<agenda_item> agenda;  ///< shares this rank runs once their rendezvous is full
  bool departed = false;            ///< its function has returned or thrown
  std::string cause;                ///< "returned", "threw ddp::error: ..."
};

/// The threads of one run: n ranks, the settings, and everything they meet under one mutex.
class world {
 public:
  /// A world of `n` ranks with `settings`.
  world(int n, config settings)
      : cfg(settings), members(static_cast<std::size_t>(n)),
        yield_after_(static_cast<unsigned>(n) > std::max(1U, std::thread::hardware_concurrency())
                         ? std::chrono::microseconds(0)
                         : settings.yield_after) {}
  world(const world&) = delete;
  world& operator=(const world&) = delete;

  const config cfg;                               ///< the run's settings
  std::mutex mutex;                               ///< guards every rendezvous, agenda and group of the run
  std::vector<member> members;                    ///< by world rank
  std::vector<std::weak_ptr<group_state>> groups;  ///< every group made so far, for departures

  /// Number of ranks.
  [[nodiscard]] int size() const noexcept { return static_cast<int>(members.size()); }

  /// Wakes every waiter: something it may wait for has changed. The caller holds `mutex`.
  void notify() {
    epoch_.fetch_add(1, std::memory_order_release);
    if (sleepers_ != 0) wake_.notify_all();
  }

  /// Runs every share of world rank `w` whose rendezvous is full, on this thread; drops those whose rendezvous failed.
  void drive(int w) {
    std::unique_lock lock(mutex);
    auto& agenda = members[static_cast<std::size_t>(w)].agenda;
    for (std::size_t k = 0; k < agenda.size();) {
      const slot& s = *agenda[k].at;
      if (s.failure.what != fault::kind::none) agenda.erase(agenda.begin() + static_cast<std::ptrdiff_t>(k));
      else if (!s.full()) ++k;
      else run_at(lock, agenda, k), k = 0;  // the agenda may have changed while the lock was free
    }
  }

  /// Runs, on this thread, the shares of the full rendezvous `at` that other ranks have not started: a rank late to
  /// its share (its thread not running, on a host with fewer cores than ranks) then delays no one.
  void help(const std::shared_ptr<slot>& at) {
    std::unique_lock lock(mutex);
    for (auto& m : members) {
      for (std::size_t k = 0; k < m.agenda.size();) {
        if (!at->full() || at->failure.what != fault::kind::none) return;
        if (m.agenda[k].at == at) run_at(lock, m.agenda, k);
        else ++k;
      }
    }
  }

  /// The count of changes so far; pass it to pause().
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_.load(std::memory_order_acquire); }

  /// Waits until something changes after `seen` or `deadline` passes: polls for cfg.spin, then sleeps. The caller
  /// holds `lock` (on `mutex`); it is held again on return.
  void pause(std::unique_lock<std::mutex>& lock, std::uint64_t seen, clock::time_point deadline) {
    lock.unlock();
    const auto start = clock::now();
    for (unsigned polls = 1; epoch() == seen; ++polls) {
      relax();
      if (polls % 64 != 0) continue;
      const auto waited = clock::now() - start;
      if (waited >= cfg.spin) break;
      if (waited >= yield_after_) std::this_thread::yield();  // a peer's thread may need this core
    }
    lock.lock();
    if (epoch() != seen) return;
    ++sleepers_;
    wake_.wait_until(lock, deadline, [&] { return epoch() != seen; });
    --sleepers_;
  }

 private:
  /// Takes item `k` off `agenda` and runs its share with the lock released. The caller holds `lock`.
  void run_at(std::unique_lock<std::mutex>& lock, std::vector<agenda_item>& agenda, std::size_t k) {
    const agenda_item item = agenda[k];
    agenda.erase(agenda.begin() + static_cast<std::ptrdiff_t>(k));
    slot& s = *item.at;
    ++s.running;
    lock.unlock();
    s.share(s, item.index);
    lock.lock();
    --s.running;
    s.owes[static_cast<std::size_t>(item.index)] = 0;
    notify();
  }

  /// How long a wait polls before it also yields its core between polls.
  static constexpr std::chrono::microseconds yield_after{0};

  /// Tells the core this is a polling loop.
  static void relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  std::condition_variable wake_;
  std::chrono::microseconds yield_after_;  ///< cfg.yield_after, or 0 where the ranks outnumber the cores
  std::atomic<std::uint64_t> epoch_{0};
  int sleepers_ = 0;
};

}  // namespace ddp::local::detail
