#pragma once
/// \file The flight recorder: each group keeps its last K collectives (call, sequence, state, times). When an
/// operation fails or times out, the rank writes what it knows to DDP_FLIGHT_RECORDER_DIR (ddp-launch sets
/// one per job and reads every rank's record when the job fails) and the timeout's message names the first
/// sequence this rank has not seen complete. DDP_FLIGHT_RECORDER=K sets the entries kept (default 1024, 0 off).

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/comm/call.hpp>
#include <ddp/comm/env.hpp>
#include <ddp/core/work.hpp>

namespace ddp::detail {

/// Where a recorded operation stands.
enum class flight_state : std::uint8_t { started, completed, failed };

/// "started", "completed", "failed".
constexpr std::string_view to_string(flight_state s) noexcept {
  return s == flight_state::started ? "started" : s == flight_state::completed ? "completed" : "failed";
}

/// One collective of a group, as the recorder keeps it.
struct flight_entry {
  using clock = std::chrono::steady_clock;
  std::uint64_t sequence = 0;           ///< the group's count of collectives before this one
  call_info call{};                     ///< what was called
  flight_state state = flight_state::started;
  clock::time_point started{};         ///< when it was started
  std::optional<clock::time_point> settled{};  ///< when this rank saw it complete or fail
};

/// The last K collectives of one group on this rank (thread-safe).
class flight_recorder {
 public:
  using clock = flight_entry::clock;

  /// Keeps `capacity` entries; `label` names the group in the record's file name (the same on every rank).
  flight_recorder(std::size_t capacity, std::string label) : ring_(capacity), label_(std::move(label)) {}

  /// Entries kept per group: DDP_FLIGHT_RECORDER (default 1024; 0 turns the recorder off).
  static std::size_t capacity_from_env() {
    return static_cast<std::size_t>(env_integer("DDP_FLIGHT_RECORDER", 0, 1 << 20, "the flight recorder's entries per group")
                                        .value_or(1024));
  }

  /// Records the start of `c` (collectives only); returns its sequence number.
  std::uint64_t start(const call_info& c) {
    std::lock_guard lock(mutex_);
    const std::uint64_t seq = next_++;
    ring_[seq % ring_.size()] = {seq, c, flight_state::started, clock::now(), std::nullopt};
    return seq;
  }
  /// Records `c`, which completed as it was started (an eager call): one lock and one clock read, where
  /// start() and settle() take two of each.
  void completed(const call_info& c) {
    std::lock_guard lock(mutex_);
    const std::uint64_t seq = next_++;
    const auto now = clock::now();
    ring_[seq % ring_.size()] = {seq, c, flight_state::completed, now, now};
  }
  /// This rank saw operation `seq` complete (ok) or fail.
  void settle(std::uint64_t seq, bool ok) {
    std::lock_guard lock(mutex_);
    auto& e = ring_[seq % ring_.size()];
    if (e.sequence != seq || e.state != flight_state::started) return;  // overwritten, or settled already
    e.state = ok ? flight_state::completed : flight_state::failed;
    e.settled = clock::now();
  }

  /// "sequence 42 (all_reduce(sum) of 1024 f32, started 5.0 s ago) is the first this rank has not seen
  /// complete; the last complete is 41"; empty when every recorded operation completed.
  [[nodiscard]] std::string first_incomplete() const {
    std::lock_guard lock(mutex_);
    const flight_entry* first = nullptr;
    for (const auto& e : ordered())
      if (e->state != flight_state::completed) {
        first = e;
        break;
      }
    if (first == nullptr) return {};
    const double ago = std::chrono::duration<double>(clock::now() - first->started).count();
    std::string s = "sequence " + std::to_string(first->sequence) + " (" + describe_call(first->call) + ", started " +
                    seconds(ago) + " ago) is the first this rank has not seen complete";
    return s;
  }

  /// Writes every entry to DDP_FLIGHT_RECORDER_DIR/flight.rank<R>.group<label>.txt, once (the first failure
  /// is the one worth keeping); returns the path, or empty when no directory is set or it was written before.
  std::string dump(int rank, int size, std::string_view reason) {
    const char* dir = std::getenv("DDP_FLIGHT_RECORDER_DIR");
    if (dir == nullptr || *dir == '\0') return {};
    std::string text;
    {
      std::lock_guard lock(mutex_);
      if (dumped_) return {};
      dumped_ = true;
      const auto now = clock::now();
      text = "# ddp flight recorder: rank " + std::to_string(rank) + " of " + std::to_string(size) + ", group " +
             label_ + ", reason: " + std::string(reason) + "\n# sequence\tstate\tstarted_s_ago\tsettled_s_ago\tcall\n";
      for (const auto* e : ordered()) {
        const double started = std::chrono::duration<double>(now - e->started).count();
        text += std::to_string(e->sequence) + "\t" + std::string(to_string(e->state)) + "\t" + seconds(started, false) +
                "\t" + (e->settled ? seconds(std::chrono::duration<double>(now - *e->settled).count(), false) : "-") +
                "\t" + describe_call(e->call) + "\n";
      }
    }
    const std::filesystem::path path =
        std::filesystem::path(dir) / ("flight.rank" + std::to_string(rank) + ".group" + label_ + ".txt");
    const auto temporary = path.string() + ".tmp." + std::to_string(::getpid());
    {
      std::ofstream out(temporary, std::ios::trunc);
      out << text;
      if (!out) return {};
    }
    std::error_code ec;
    std::filesystem::rename(temporary, path, ec);
    if (ec) {
      std::filesystem::remove(temporary, ec);
      return {};
    }
    return path.string();
  }

 private:
  /// The entries in sequence order (oldest kept first); the caller holds the mutex.
  [[nodiscard]] std::vector<const flight_entry*> ordered() const {
    std::vector<const flight_entry*> out;
    const std::uint64_t kept = std::min<std::uint64_t>(next_, ring_.size());
    for (std::uint64_t s = next_ - kept; s < next_; ++s) out.push_back(&ring_[s % ring_.size()]);
    return out;
  }
  static std::string seconds(double s, bool unit = true) {
    char buf[32];
    std::snprintf(buf, sizeof buf, unit ? "%.1f s" : "%.3f", s);
    return buf;
  }

  mutable std::mutex mutex_;
  std::vector<flight_entry> ring_;
  std::string label_;
  std::uint64_t next_ = 0;
  bool dumped_ = false;
};

/// A work_state that tells the flight recorder when its operation completes or fails.
class recorded_work final : public work_state {
 public:
  recorded_work(std::shared_ptr<work_state> inner, std::shared_ptr<flight_recorder> recorder, std::uint64_t seq,
                int size)
      : inner_(std::move(inner)), recorder_(std::move(recorder)), seq_(seq), size_(size) {}

  bool test() override { return observe([&] { return inner_->test(); }); }
  bool wait_until(clock::time_point deadline) override { return observe([&] { return inner_->wait_until(deadline); }); }
  [[nodiscard]] std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  [[nodiscard]] int rank() const override { return inner_->rank(); }
  [[nodiscard]] std::string describe() const override { return inner_->describe(); }
  [[nodiscard]] std::string waiting_for() const override { return inner_->waiting_for(); }
  std::string diagnosis() override {
    std::string s = recorder_->first_incomplete();
    const auto path = recorder_->dump(rank(), size_, "timeout in " + describe());
    if (!path.empty()) s += (s.empty() ? "" : "; ") + std::string("flight record in ") + path;
    return s.empty() ? s : "flight recorder: " + s;
  }

 private:
  template <class F>
  bool observe(F&& f) {
    try {
      const bool done = f();
      if (done) recorder_->settle(seq_, true);
      return done;
    } catch (const timeout_error& e) {
      // The engine's own deadline passed before wait()'s: the same diagnosis as a timeout seen by wait(), and the
      // operation stays started -- this rank waited for it, it did not see it fail.
      const std::string record = diagnosis();
      throw timeout_error(e.message() + (record.empty() ? std::string() : " (" + record + ")"), e.rank(),
                          e.native_code());
    } catch (const std::exception& e) {
      recorder_->settle(seq_, false);
      const auto path = recorder_->dump(rank(), size_, e.what());
      if (!path.empty()) std::fprintf(stderr, "ddp: rank %d wrote its flight record to %s\n", rank(), path.c_str());
      throw;
    }
  }

  std::shared_ptr<work_state> inner_;
  std::shared_ptr<flight_recorder> recorder_;
  std::uint64_t seq_;
  int size_;
};

/// A recorder for a new group (none when DDP_FLIGHT_RECORDER=0).
inline std::shared_ptr<flight_recorder> make_flight_recorder(std::string label) {
  const auto capacity = flight_recorder::capacity_from_env();
  return capacity == 0 ? nullptr : std::make_shared<flight_recorder>(capacity, std::move(label));
}

/// `w` (the start of collective `c` in a group of `size`), recorded in `recorder`.
inline work record(const std::shared_ptr<flight_recorder>& recorder, const call_info& c, int size, work w) {
  auto& state = work_access::state(w);
  if (!state) {
    recorder->completed(c);
    return w;
  }
  const std::uint64_t seq = recorder->start(c);
  return work(std::make_shared<recorded_work>(std::move(state), recorder, seq, size));
}

/// A label for a group of a backend without group identifiers: its rank in this process's creation order,
/// the same on every rank of an SPMD program.
inline std::string next_group_label() {
  static std::atomic<std::uint64_t> created{0};
  return "g" + std::to_string(created.fetch_add(1));
}

}  // namespace ddp::detail
