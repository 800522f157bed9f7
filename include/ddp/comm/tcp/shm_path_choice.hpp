#pragma once
/// \file Which way a large shared-memory all_reduce runs: single copies out of the peers' buffers, or the
/// pipeline through the group's segment. Neither wins everywhere. Measured on the 2-core VM (N = 2, ddp-launch):
/// on an idle host the pipeline takes half the time (16 MiB 2.1-2.5 ms against 3.9-4.7; 64 MiB 9.0-11.0 against
/// 18.7-20.9); with the cores busy each of its 32-128 barriers waits for a preempted peer, and it takes 2-5 times
/// as long (16 MiB 30-67 ms against 13-14). So the group's rank 0 times each such call after its first phase,
/// keeps the latest timings of each way per size class, takes the way whose median is less, and tries the other
/// again after probe_first calls, twice as many each time the trial confirms the choice. The call's first phase
/// tells every rank which way rank 0 took. DDP_SHM_LARGE_ALL_REDUCE fixes the way instead (config.hpp).

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include <ddp/comm/tcp/config.hpp>

namespace ddp::tcp::detail {

/// all_reduce payloads from this size may copy straight out of the peers' buffers, where they can. Measured on
/// the 2-core VM (bench/comm, ddp-launch, N = 2), single copies against the pipeline: 1 MiB 118 us against 72 idle,
/// 3.6 ms against 0.16 busy; 4 MiB 0.56 ms against 0.33 idle, 6.3 ms against 12.2 busy.
inline constexpr std::size_t shm_single_copy_bytes = 4 << 20;

/// Chooses, per size class, the way a large all_reduce runs (on the group's rank 0), from the timings record()
/// gets. A group runs one call at a time, so it needs no lock.
class large_path_choice {
 public:
  /// Size classes from shm_single_copy_bytes, each twice the one before, the last one open.
  static constexpr std::size_t classes = 8;
  /// Timings kept per way and class; their median counts, so one preempted call does not swing the choice.
  static constexpr std::size_t kept = 3;
  /// Calls the chosen way makes before the other is tried again, after a change of choice.
  static constexpr unsigned probe_first = 4;
  /// At most this many calls between trials of the other way, however often it lost.
  static constexpr unsigned probe_most = 256;

  /// The way the next all_reduce of `bytes` takes: each way once, then the faster one, the other at a trial.
  [[nodiscard]] shm_large_all_reduce choose(std::size_t bytes) const {
    const size_class& k = classes_[class_of(bytes)];
    if (k.ways[0].count == 0) return way(0);
    if (k.ways[1].count == 0) return way(1);
    return k.since_trial >= k.trial_after ? way(1 - k.best) : way(k.best);
  }

  /// Records that an all_reduce of `bytes` took `took` (after its first phase) the way `w`.
  void record(std::size_t bytes, shm_large_all_reduce w, std::chrono::nanoseconds took) {
    size_class& k = classes_[class_of(bytes)];
    const std::size_t i = index(w);
    timings& t = k.ways[i];
    t.ns_per_kib[t.count++ % kept] = static_cast<std::uint64_t>(took.count()) * 1024 / std::max<std::size_t>(bytes, 1);
    if (k.ways[0].count == 0 || k.ways[1].count == 0) return;
    const std::size_t best = median(k.ways[1]) < median(k.ways[0]) ? 1 : 0;
    if (best != k.best) {  // the other way is faster now
      k = size_class{k.ways, best};
    } else if (i == best) {
      ++k.since_trial;
    } else {  // a trial of the other way confirmed the choice
      k.since_trial = 0;
      k.trial_after = std::min(2 * k.trial_after, probe_most);
    }
  }

 private:
  struct timings {
    std::array<std::uint64_t, kept> ns_per_kib{};
    std::size_t count = 0;
  };
  struct size_class {
    std::array<timings, 2> ways;  ///< single copies, the pipeline
    std::size_t best = 0;
    unsigned since_trial = 0;  ///< calls the best way made since the other was last tried
    unsigned trial_after = probe_first;
  };

  static std::size_t class_of(std::size_t bytes) {
    const auto bits = static_cast<std::size_t>(std::bit_width(bytes / shm_single_copy_bytes));  // the first class: 1
    return std::min(classes - 1, bits == 0 ? 0 : bits - 1);
  }
  static shm_large_all_reduce way(std::size_t i) {
    return i == 0 ? shm_large_all_reduce::single_copy : shm_large_all_reduce::pipeline;
  }
  static std::size_t index(shm_large_all_reduce w) { return w == shm_large_all_reduce::pipeline ? 1 : 0; }
  static std::uint64_t median(const timings& t) {
    std::array<std::uint64_t, kept> v = t.ns_per_kib;
    const std::size_t n = std::min(t.count, kept);
    std::sort(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
    return v[n / 2];
  }

  std::array<size_class, classes> classes_{};
};

}  // namespace ddp::tcp::detail
