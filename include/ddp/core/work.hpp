#pragma once
/// \file ddp::work: the handle of an in-flight operation; errors and timeouts surface here.

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include <ddp/core/error.hpp>

namespace ddp {

namespace detail {

/// What a backend implements for one in-flight operation.
class work_state {
 public:
  using clock = std::chrono::steady_clock;
  virtual ~work_state() = default;
  /// Makes progress if the backend needs polling; true once complete. Rethrows the operation's error.
  virtual bool test() = 0;
  /// Blocks until complete or `deadline`; true once complete. Rethrows the operation's error.
  virtual bool wait_until(clock::time_point deadline) = 0;
  /// The deadline wait() applies, counted from its call.
  [[nodiscard]] virtual std::chrono::milliseconds timeout() const = 0;
  /// The rank that started the operation.
  [[nodiscard]] virtual int rank() const = 0;
  /// A phrase naming the operation, such as "all_reduce of 1024 f32 (sequence 17)".
  [[nodiscard]] virtual std::string describe() const = 0;
  /// The ranks the operation waits for right now ("rank 1, rank 3"), where the backend knows; else empty.
  [[nodiscard]] virtual std::string waiting_for() const { return {}; }
  /// Called once when wait() times out: what else the message should say (the flight recorder's view).
  virtual std::string diagnosis() { return {}; }
  /// Makes the CUDA stream `cuda_stream` (a cudaStream_t) wait on its device for the operation, without blocking
  /// the host; false where the backend cannot, and the caller waits on the host instead.
  virtual bool order_stream(void* cuda_stream) {
    (void)cuda_stream;
    return false;
  }
};

/// What a progress engine waits for while it stalls ("rank 1"); empty while it moves. The engine writes
/// it only after a stall, so the fast path never touches it; wait() reads it when it times out.
class stall_note {
 public:
  /// Publishes what the engine waits for now (empty: nothing, or it moves again).
  void set(std::string text) {
    std::lock_guard lock(mutex_);
    text_ = std::move(text);
  }
  /// What the engine waits for, as last published.
  [[nodiscard]] std::string get() const {
    std::lock_guard lock(mutex_);
    return text_;
  }

 private:
  mutable std::mutex mutex_;
  std::string text_;
};

/// A work_state completed from another thread (a progress engine) with finish() or fail().
class completion : public work_state {
 public:
  completion(int rank, std::chrono::milliseconds timeout, std::string what,
             std::shared_ptr<const stall_note> note = nullptr)
      : rank_(rank), timeout_(timeout), what_(std::move(what)), note_(std::move(note)) {}

  /// Marks the operation complete.
  void finish() {
    { std::lock_guard lock(mutex_); done_ = true; }
    cv_.notify_all();
  }
  /// Marks the operation failed with `e`.
  void fail(std::exception_ptr e) {
    { std::lock_guard lock(mutex_); error_ = std::move(e); done_ = true; }
    cv_.notify_all();
  }
  bool test() override {
    std::lock_guard lock(mutex_);
    return settled();
  }
  bool wait_until(clock::time_point deadline) override {
    std::unique_lock lock(mutex_);
    cv_.wait_until(lock, deadline, [&] { return done_; });
    return settled();
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const override { return timeout_; }
  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] std::string describe() const override { return what_; }
  [[nodiscard]] std::string waiting_for() const override { return note_ ? note_->get() : std::string(); }

 private:
  bool settled() const {
    if (error_) std::rethrow_exception(error_);
    return done_;
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  std::shared_ptr<const stall_note> note_;
};

}  // namespace detail

/// Handle of an asynchronous operation. A default-constructed work is already complete.
class work;

namespace detail {
/// The state inside a work handle, for the front end that wraps it.
struct work_access {
  static std::shared_ptr<work_state>& state(work& w) noexcept;
};
}  // namespace detail

/// Handle of an asynchronous operation. A default-constructed work is already complete.
class work {
 public:
  work() = default;
  /// Wraps a backend's state.
  explicit work(std::shared_ptr<detail::work_state> state) : state_(std::move(state)) {}

  /// Blocks until done; throws the operation's error, or ddp::timeout_error past the communicator's timeout.
  void wait() {
    if (!state_ || state_->test()) return;  // done already: no clock reading on the fast path
    const auto limit = state_->timeout();
    if (!state_->wait_until(detail::work_state::clock::now() + limit)) {
      const std::string who = state_->waiting_for();
      const std::string record = state_->diagnosis();
      throw timeout_error(state_->describe() + " did not complete within " + std::to_string(limit.count()) + " ms" +
                              (who.empty() ? std::string() : ", waiting for " + who) +
                              ": a peer is stuck, dead or calling a different collective; check every rank's "
                              "log, or raise the timeout in the communicator's config" +
                              (record.empty() ? std::string() : " (" + record + ")"),
                          state_->rank());
    }
  }
  /// Waits at most `d`; true once done, false if still running. Throws the operation's error.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) {
    if (!state_) return true;
    return state_->wait_until(detail::work_state::clock::now() +
                              std::chrono::duration_cast<detail::work_state::clock::duration>(d));
  }
  /// True once done, without blocking. Throws the operation's error.
  [[nodiscard]] bool done() { return !state_ || state_->test(); }

 private:
  friend struct detail::work_access;
  std::shared_ptr<detail::work_state> state_;
};

inline std::shared_ptr<detail::work_state>& detail::work_access::state(work& w) noexcept { return w.state_; }

/// Waits for every handle in `works`, in order.
inline void wait_all(std::span<work> works) {
  for (auto& w : works) w.wait();
}

}  // namespace ddp
