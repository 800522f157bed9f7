#pragma once
/// \file The progress thread of ddp::mpi: MPI moves a non-blocking operation forward only inside MPI calls, and
/// nothing calls MPI while a backward computes, so a bucket's all-reduce started early would otherwise sit still
/// until the step waits for it (measured on 2 cores, 2026-11-28: 11.6 ms of the step's tail after the last backward
/// against 2.0 ms for that bucket's all-reduce alone). While any operation of the process is in flight, one thread
/// calls MPI_Iprobe on a private communicator every config::progress_interval (Open MPI runs its whole progress
/// loop, libnbc's schedules included, inside any MPI call), and sleeps otherwise. It competes with the computing
/// ranks for cores, so by default (progress_mode::spare_cores) it runs only where this process may run on two cores
/// or more and the host has two cores for each of its ranks (DDP_MPI_PROGRESS=1 or 0 decides instead).

#include <ddp/comm/mpi/group.hpp>  // first: it keeps MPI's C++ bindings out of <mpi.h>

#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>

#include <ddp/comm/env.hpp>

namespace ddp::mpi::detail {

/// Whether the progress thread should run for `mode` on this host (see the file comment).
inline bool progress_wanted(progress_mode mode) {
  static constexpr std::pair<std::string_view, progress_mode> choices[] = {{"1", progress_mode::on},
                                                                           {"0", progress_mode::off}};
  mode = ddp::detail::env_choice("DDP_MPI_PROGRESS", choices, "1 (run ddp::mpi's progress thread) or 0 (never)")
             .value_or(mode);
  if (mode != progress_mode::spare_cores) return mode == progress_mode::on;
  cpu_set_t mine;
  CPU_ZERO(&mine);
  const int allowed = ::sched_getaffinity(0, sizeof mine, &mine) == 0 ? CPU_COUNT(&mine) : 1;
  const long long local = ddp::detail::env_local_world_size().value_or(1);  // the launchers' count of this host's ranks
  return allowed >= 2 && ::sysconf(_SC_NPROCESSORS_ONLN) >= 2 * local;
}

/// The process's progress thread (see the file comment); operations claim it while in flight.
class progress_thread {
 public:
  /// The thread of this process, polling every `interval` while claimed; null where MPI is not thread-multiple.
  static progress_thread* get(std::chrono::microseconds interval) {
    static progress_thread* const instance = [interval]() -> progress_thread* {
      int level = 0;
      MPI_Query_thread(&level);
      if (level != MPI_THREAD_MULTIPLE) return nullptr;
      static progress_thread t(interval);
      return &t;
    }();
    return instance;
  }
  progress_thread(const progress_thread&) = delete;
  progress_thread& operator=(const progress_thread&) = delete;
  ~progress_thread() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
    if (!finalized()) MPI_Comm_free(&probe_);
  }

  /// An operation went in flight: the thread polls until every claim is released.
  void claim() {
    {
      std::lock_guard lock(mutex_);
      ++claims_;
    }
    wake_.notify_one();
  }
  /// An operation completed or was dropped.
  void release() {
    std::lock_guard lock(mutex_);
    --claims_;
  }

 private:
  explicit progress_thread(std::chrono::microseconds interval) : interval_(interval) {
    check(MPI_Comm_dup(MPI_COMM_SELF, &probe_), "MPI_Comm_dup(MPI_COMM_SELF) for the progress thread", -1);
    thread_ = std::thread([this] { run(); });
  }

  void run() {
    std::unique_lock lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stopping_ || claims_ > 0; });
      if (stopping_) return;
      lock.unlock();
      int flag = 0;
      if (!finalized()) MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, probe_, &flag, MPI_STATUS_IGNORE);
      std::this_thread::sleep_for(interval_);
      lock.lock();
    }
  }

  std::chrono::microseconds interval_;
  MPI_Comm probe_ = MPI_COMM_NULL;  // nothing is ever sent on it: probing it only runs MPI's progress loop
  std::mutex mutex_;
  std::condition_variable wake_;
  int claims_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

/// The progress thread `g`'s operations claim (decided once per group), or null where none runs.
inline progress_thread* progress_of(group& g) {
  std::call_once(g.progress_once, [&] {
    if (progress_wanted(g.cfg.progress)) g.progress = progress_thread::get(g.cfg.progress_interval);
  });
  return g.progress;
}

/// One operation's claim on the progress thread (none until take()), released when it completes or goes away.
class progress_claim {
 public:
  progress_claim() = default;
  progress_claim(const progress_claim&) = delete;
  progress_claim& operator=(const progress_claim&) = delete;
  ~progress_claim() { reset(); }
  /// Claims `t` (null: nothing) in place of any earlier claim.
  void take(progress_thread* t) {
    reset();
    thread_ = t;
    if (thread_ != nullptr) thread_->claim();
  }
  /// Releases the claim (once).
  void reset() {
    if (thread_ != nullptr) thread_->release();
    thread_ = nullptr;
  }

 private:
  progress_thread* thread_ = nullptr;
};

}  // namespace ddp::mpi::detail
