#pragma once
/// \file Which algorithm a large shared-memory all_reduce, reduce_scatter or all_gather runs: single copies out
/// of the peers' buffers, or the pipeline through the group's segment. Neither wins everywhere. Measured on the
/// 2-core VM (all_reduce, N = 2, ddp-launch): on an idle host the pipeline takes half the time or less (16 MiB
/// 2.5 ms against 5.4; 64 MiB 10.3 against 19.7); with the cores busy each of its barriers (one per 512 KiB)
/// waits for a preempted peer, and it takes up to five times as long (16 MiB 64 ms against 13.9). So the
/// group's rank 0 times each such call after its first phase, keeps the latest timings of each algorithm per
/// collective and size class, takes the one whose median is less, and tries the other again after
/// probe_first calls, twice as many each time the trial confirms the choice. The call's first phase tells
/// every rank which algorithm rank 0 took. DDP_SHM_ALGO fixes the algorithm instead (config.hpp).

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/config.hpp>

namespace ddp::tcp::detail {

/// Collectives whose buffers, from this size, may be copied straight out of the peers' memory where it is
/// readable. Measured on the 2-core VM (all_reduce, N = 2, ddp-launch), single copies against the pipeline:
/// 1 MiB 118 us against 72 idle, 3.6 ms against 0.16 busy; 4 MiB 0.56 ms against 0.33 idle, 6.3 ms against
/// 12.2 busy.
inline constexpr std::size_t shm_single_copy_bytes = 4 << 20;

/// Chooses, per collective and size class, the algorithm a large call runs (on the group's rank 0), from the
/// timings record() gets. A group runs one call at a time, so it needs no lock.
class algo_choice {
 public:
  /// Size classes from shm_single_copy_bytes, each twice the one before, the last one open.
  static constexpr std::size_t classes = 8;
  /// Timings kept per algorithm and class; their median counts (the lower of two), so one preempted call does not
  /// swing the choice, nor keep an algorithm that was slow once from being chosen.
  static constexpr std::size_t kept = 3;
  /// Calls the chosen algorithm makes before the other is tried again, after a change of choice.
  static constexpr unsigned probe_first = 4;
  /// At most this many calls between trials of the other algorithm, however often it lost.
  static constexpr unsigned probe_most = 256;

  /// The algorithm the next `kind` call of `bytes` runs: each once, then the faster one, the other at a trial.
  [[nodiscard]] shm_algo choose(collective kind, std::size_t bytes) const {
    const size_class& k = table_[row(kind)][class_of(bytes)];
    if (k.algos[0].count == 0) return algo(0);
    if (k.algos[1].count == 0) return algo(1);
    return k.since_trial >= k.trial_after ? algo(1 - k.best) : algo(k.best);
  }

  /// Records that a `kind` call of `bytes` took `took` (after its first phase) with algorithm `a`.
  void record(collective kind, std::size_t bytes, shm_algo a, std::chrono::nanoseconds took) {
    size_class& k = table_[row(kind)][class_of(bytes)];
    const std::size_t i = a == shm_algo::pipeline ? 1 : 0;
    timings& t = k.algos[i];
    t.ns_per_kib[t.count++ % kept] = static_cast<std::uint64_t>(took.count()) * 1024 / std::max<std::size_t>(bytes, 1);
    if (k.algos[0].count == 0 || k.algos[1].count == 0) return;
    const std::size_t best = median(k.algos[1]) < median(k.algos[0]) ? 1 : 0;
    if (best != k.best) {  // the other algorithm is faster now
      k = size_class{k.algos, best};
    } else if (i == best) {
      ++k.since_trial;
    } else {  // a trial of the other algorithm confirmed the choice
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
    std::array<timings, 2> algos;  ///< single copies, the pipeline
    std::size_t best = 0;
    unsigned since_trial = 0;  ///< calls the best algorithm made since the other was last tried
    unsigned trial_after = probe_first;
  };

  /// all_reduce, reduce_scatter, all_gather (the collectives that may take single copies).
  static std::size_t row(collective kind) {
    return kind == collective::reduce_scatter ? 1 : kind == collective::all_gather ? 2 : 0;
  }
  static std::size_t class_of(std::size_t bytes) {
    const auto bits = static_cast<std::size_t>(std::bit_width(bytes / shm_single_copy_bytes));  // the first class: 1
    return std::min(classes - 1, bits == 0 ? 0 : bits - 1);
  }
  static shm_algo algo(std::size_t i) { return i == 0 ? shm_algo::single_copy : shm_algo::pipeline; }
  static std::uint64_t median(const timings& t) {
    std::array<std::uint64_t, kept> v = t.ns_per_kib;
    const std::size_t n = std::min(t.count, kept);
    std::sort(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
    return v[(n - 1) / 2];
  }

  std::array<std::array<size_class, classes>, 3> table_{};
};

}  // namespace ddp::tcp::detail
