#pragma once
/// \file Always-on traffic statistics: bytes each communicator sends, by operation.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string_view>

namespace ddp {

/// The operations a communicator counts.
enum class collective : std::uint8_t {
  all_reduce, reduce_scatter, all_gather, broadcast, reduce, gather, scatter, all_to_all, barrier, send_recv
};

/// Number of collective kinds.
inline constexpr std::size_t collective_count = 10;

/// "all_reduce", ...
constexpr std::string_view to_string(collective c) noexcept {
  constexpr std::array<std::string_view, collective_count> names{
      "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
      "gather",     "scatter",        "all_to_all", "barrier",   "send_recv"};
  return names[static_cast<std::size_t>(c)];
}

/// A snapshot of a communicator's counters.
struct comm_stats {
  std::array<std::uint64_t, collective_count> bytes_sent{};  ///< payload bytes this rank sent, by operation
  std::array<std::uint64_t, collective_count> calls{};       ///< operations started, by operation
  std::uint64_t call_checks = 0;  ///< cross-rank call checks exchanged (DDP_CHECK_COLLECTIVES=1), not counted above

  /// Bytes sent for operation `c`.
  [[nodiscard]] std::uint64_t bytes(collective c) const noexcept { return bytes_sent[static_cast<std::size_t>(c)]; }
  /// Operations `c` started.
  [[nodiscard]] std::uint64_t count(collective c) const noexcept { return calls[static_cast<std::size_t>(c)]; }
  /// Bytes sent for all operations.
  [[nodiscard]] std::uint64_t total_bytes() const noexcept {
    return std::accumulate(bytes_sent.begin(), bytes_sent.end(), std::uint64_t{0});
  }
};

namespace detail {

/// Thread-safe counters behind comm_stats; cheap enough to stay on always.
class stats_counter {
 public:
  void add_call(collective c) noexcept { calls_[index(c)].fetch_add(1, std::memory_order_relaxed); }
  void add_bytes(collective c, std::uint64_t n) noexcept { bytes_[index(c)].fetch_add(n, std::memory_order_relaxed); }
  void add_call_check() noexcept { call_checks_.fetch_add(1, std::memory_order_relaxed); }
  [[nodiscard]] comm_stats snapshot() const noexcept {
    comm_stats s;
    for (std::size_t i = 0; i < collective_count; ++i) {
      s.bytes_sent[i] = bytes_[i].load(std::memory_order_relaxed);
      s.calls[i] = calls_[i].load(std::memory_order_relaxed);
    }
    s.call_checks = call_checks_.load(std::memory_order_relaxed);
    return s;
  }
  void reset() noexcept {
    for (std::size_t i = 0; i < collective_count; ++i) {
      bytes_[i].store(0, std::memory_order_relaxed);
      calls_[i].store(0, std::memory_order_relaxed);
    }
    call_checks_.store(0, std::memory_order_relaxed);
  }

 private:
  static constexpr std::size_t index(collective c) noexcept { return static_cast<std::size_t>(c); }
  std::array<std::atomic<std::uint64_t>, collective_count> bytes_{};
  std::array<std::atomic<std::uint64_t>, collective_count> calls_{};
  std::atomic<std::uint64_t> call_checks_{0};
};

}  // namespace detail
}  // namespace ddp
