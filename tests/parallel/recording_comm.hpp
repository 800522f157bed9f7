#pragma once
// A loopback communicator for single-process tests of data_parallel: it models ddp::communicator as rank r of
// a group of N ranks that all send what this rank sends, and records every collective it is asked for, in order,
// as "group op sizes dtype #k". Its work handles stay in flight until waited for (which records "wait #k") or
// until the test calls complete_all(), so a test sees which operation the wrapper waits for, and when.
// Data: all_reduce (avg) and broadcast leave the buffer as it is; reduce_scatter copies block r of its input to
// its output; all_gather copies its input to every block of its output; every other operation only records.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp_test {

/// What every recording_comm split from one world shares: the calls in order and the handles in flight.
class recording_log {
 public:
  /// Every collective and every wait since the last clear().
  [[nodiscard]] const std::vector<std::string>& calls() const noexcept { return calls_; }
  /// Forgets the calls and restarts the numbering (operations in flight keep their numbers).
  void clear() {
    calls_.clear();
    next_ = 0;
  }
  /// Marks every operation in flight complete, without a wait (as if the network had delivered them).
  void complete_all() {
    for (auto& s : in_flight_) s->done = true;
    in_flight_.clear();
  }
  /// The next split() returns a group called `name` of `size` ranks in which this process has `rank`.
  void plan_split(std::string name, int size, int rank) { splits_.push_back({std::move(name), size, rank}); }

  struct state final : ddp::detail::work_state {
    recording_log* log = nullptr;
    std::size_t number = 0;
    int rank_ = 0;
    bool done = false;
    bool test() override { return done; }
    bool wait_until(clock::time_point /*deadline*/) override {
      if (!done) log->calls_.push_back("wait #" + std::to_string(number));
      done = true;
      return true;
    }
    [[nodiscard]] std::chrono::milliseconds timeout() const override { return std::chrono::seconds(5); }
    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] std::string describe() const override { return "recorded operation #" + std::to_string(number); }
  };
  struct planned_split {
    std::string name;
    int size, rank;
  };

  ddp::work record(const std::string& what, int rank) {
    auto s = std::make_shared<state>();
    s->log = this;
    s->number = next_++;
    s->rank_ = rank;
    calls_.push_back(what + " #" + std::to_string(s->number));
    in_flight_.push_back(s);
    return ddp::work(s);
  }
  planned_split next_split() {
    if (splits_.empty()) throw std::logic_error("recording_comm: split() without a plan_split() for it");
    auto s = splits_.front();
    splits_.pop_front();
    return s;
  }

 private:
  std::vector<std::string> calls_;
  std::vector<std::shared_ptr<state>> in_flight_;
  std::deque<planned_split> splits_;
  std::size_t next_ = 0;
};

/// Rank `rank` of `size` loopback ranks named `name`, recording into a shared log.
class recording_comm {
 public:
  recording_comm(int rank, int size, std::string name = "world", std::shared_ptr<recording_log> log = nullptr)
      : rank_(rank), size_(size), name_(std::move(name)), log_(log ? std::move(log) : std::make_shared<recording_log>()) {}

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return size_; }
  /// The group log_->plan_split() planned for this call.
  recording_comm split(int /*color*/, int /*key*/) {
    const auto s = log_->next_split();
    return recording_comm(s.rank, s.size, s.name, log_);
  }
  template <class T>
  ddp::work all_reduce(T&& t, ddp::reduce_op /*op*/) {
    return record("all_reduce", ddp::as_raw(t));
  }
  template <class I, class O>
  ddp::work reduce_scatter(I&& in, O&& out, ddp::reduce_op /*op*/) {
    const auto i = ddp::as_raw(in), o = ddp::as_raw(out);
    std::memmove(o.data, static_cast<const std::byte*>(i.data) + static_cast<std::size_t>(rank_) * o.bytes(), o.bytes());
    return record("reduce_scatter", i, o);
  }
  template <class I, class O>
  ddp::work all_gather(I&& in, O&& out) {
    const auto i = ddp::as_raw(in), o = ddp::as_raw(out);
    for (int r = 0; r < size_; ++r)  // every rank sends what this one sends
      std::memmove(static_cast<std::byte*>(o.data) + static_cast<std::size_t>(r) * i.bytes(), i.data, i.bytes());
    return record("all_gather", i, o);
  }
  template <class T>
  ddp::work broadcast(T&& t, int /*root*/) {
    return record("broadcast", ddp::as_raw(t));
  }
  template <class T>
  ddp::work reduce(T&& t, ddp::reduce_op /*op*/, int /*root*/) {
    return record("reduce", ddp::as_raw(t));
  }
  template <class I, class O>
  ddp::work gather(I&& in, O&& out, int /*root*/) {
    return record("gather", ddp::as_raw(in), ddp::as_raw(out));
  }
  template <class I, class O>
  ddp::work scatter(I&& in, O&& out, int /*root*/) {
    return record("scatter", ddp::as_raw(in), ddp::as_raw(out));
  }
  template <class I, class O>
  ddp::work all_to_all(I&& in, O&& out) {
    return record("all_to_all", ddp::as_raw(in), ddp::as_raw(out));
  }
  ddp::work barrier() { return log_->record(name_ + " barrier", rank_); }
  template <class T>
  ddp::work send(T&& t, int /*peer*/, int /*tag*/) {
    return record("send", ddp::as_raw(t));
  }
  template <class T>
  ddp::work recv(T&& t, int /*peer*/, int /*tag*/) {
    return record("recv", ddp::as_raw(t));
  }
  [[nodiscard]] ddp::comm_stats stats() const { return {}; }

  /// The log every group split from this one shares.
  [[nodiscard]] recording_log& log() const noexcept { return *log_; }

 private:
  ddp::work record(const char* op, ddp::raw_tensor t) {
    return log_->record(name_ + " " + op + " " + std::to_string(t.size) + " " + std::string(ddp::to_string(t.type)), rank_);
  }
  ddp::work record(const char* op, ddp::raw_tensor in, ddp::raw_tensor out) {
    return log_->record(name_ + " " + op + " " + std::to_string(in.size) + ">" + std::to_string(out.size) + " " +
                            std::string(ddp::to_string(in.type)),
                        rank_);
  }

  int rank_, size_;
  std::string name_;
  std::shared_ptr<recording_log> log_;
};
static_assert(ddp::communicator<recording_comm>);

/// The backend policy whose communicator is recording_comm.
struct recording_backend {
  using policy_category = ddp::detail::backend_category;
};

}  // namespace ddp_test

template <>
struct ddp::backend_traits<ddp_test::recording_backend> {
  using communicator = ddp_test::recording_comm;
};
template <>
struct ddp::backend_of<ddp_test::recording_comm> {
  using type = ddp_test::recording_backend;
};
