#pragma once
/// \file One in-flight operation of ddp::mpi::communicator: an MPI request polled with MPI_Test, finishing avg on
/// completion.

#include <ddp/comm/mpi/group.hpp>  // first: it keeps MPI's C++ bindings out of <mpi.h>
#include <ddp/comm/mpi/progress.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/memory/average.hpp>
#include <ddp/comm/call.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>

namespace ddp::mpi::detail {

/// One operation from its call to its completion: what it is, and what must happen or stay alive until then.
struct operation {
  ddp::detail::call_info info;     ///< what it is; info.average is divided by the group size on completion
  std::vector<std::byte> scratch;  ///< a copy of an input that overlaps the output, alive until done
};

/// One in-flight MPI request; polled with MPI_Test.
class request_state final : public ddp::detail::work_state {
 public:
  request_state(std::shared_ptr<group> g, operation op) : group_(std::move(g)), op_(std::move(op)) {}
  request_state(const request_state&) = delete;
  request_state& operator=(const request_state&) = delete;

  /// Drops an incomplete operation: a recv is cancelled; anything else is waited for up to the timeout, since
  /// MPI cannot cancel collectives (past the timeout a send's request is freed and a collective's abandoned).
  ~request_state() override {
    if (done_ || request == MPI_REQUEST_NULL || finalized()) return;
    if (op_.info.receive()) {
      MPI_Cancel(&request);
      MPI_Wait(&request, MPI_STATUS_IGNORE);
      return;
    }
    try {
      if (wait_until(clock::now() + group_->cfg.timeout)) return;
    } catch (const std::exception&) {  // a destructor reports nothing; the error was the caller's to wait for
      return;
    }
    if (op_.info.kind == collective::send_recv) MPI_Request_free(&request);
  }

  bool test() override {
    std::lock_guard lock(mutex_);
    return poll();
  }

  bool wait_until(clock::time_point deadline) override {
    if (test()) return true;  // the common case for short operations, before any clock reading
    const auto start = clock::now();
    std::chrono::microseconds pause{0};
    for (unsigned polls = 1;; ++polls) {
      if (test()) return true;
      if (pause.count() == 0 && polls % 64 != 0) continue;  // while spinning, read the clock every 64 polls
      const auto now = clock::now();
      if (now >= deadline) return false;
      if (now - start < group_->cfg.spin) continue;
      pause = std::clamp(pause * 2, std::chrono::microseconds(1), group_->cfg.max_sleep);
      std::this_thread::sleep_for(std::min<clock::duration>(pause, deadline - now));
    }
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const override { return group_->cfg.timeout; }
  [[nodiscard]] int rank() const override { return group_->rank; }
  [[nodiscard]] std::string describe() const override { return ddp::detail::describe(op_.info); }

  MPI_Request request = MPI_REQUEST_NULL;  ///< the MPI request to poll

  /// Keeps `t` (the progress thread, or null) driving MPI until the request completes.
  void keep_progress(progress_thread* t) {
    std::lock_guard lock(mutex_);
    if (!done_) claim_.take(t);
  }

 private:
  /// One MPI_Test; finishes avg on completion. The caller holds mutex_.
  bool poll() {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    int flag = 0;
    const int code = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      done_ = true;
      claim_.reset();
      try {
        check(code, describe(), group_->rank);
      } catch (const mpi_error&) {
        error_ = std::current_exception();
      }
      std::rethrow_exception(error_);
    }
    if (flag == 0) return false;
    claim_.reset();
    if (op_.info.average.size != 0) ddp::detail::divide(op_.info.average, op_.info.group_size);
    op_.scratch = {};
    done_ = true;
    return true;
  }

  std::shared_ptr<group> group_;
  operation op_;
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
  progress_claim claim_;  ///< the progress thread's, while in flight
};

}  // namespace ddp::mpi::detail
