#pragma once
/// \file Copying into shared memory that peers read (the collectives' regions, the point-to-point rings). A
/// rank rewrites its regions while the peers still hold the previous contents in their caches, and an
/// ordinary store must first take each such line back. How much that costs depends on how far apart the
/// cores sit, which on a virtual machine changes while a job runs. Measured on the 2-core VM (two processes
/// on two cores, 512 KiB copied into lines the other had read, then read by it): with the two cores close,
/// ordinary stores took 53 us and the reader 13 us, streaming stores 18 us and the reader some 50 us from
/// memory (f32 all_reduce of 1 MiB: 68 us against 158 us); with them far apart, ordinary stores took 210-230 us
/// and the reader 47 us, streaming stores 18 us and the reader 51 us (1 MiB: 458 us against 113 us). So every
/// process times its large copies and uses whichever kind of store costs less, both sides counted: ordinary
/// stores unless they take more than stream_penalty times as long as streaming ones. DDP_SHM_STORES fixes the
/// kind instead (config.hpp).

#include <emmintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <ddp/comm/tcp/config.hpp>

namespace ddp::tcp::detail {

/// Copies `n` bytes from `src` to `dst` (not overlapping) with streaming stores, which leave no line in this
/// core's cache and take none back from the peers'.
inline void stream_copy(void* dst, const void* src, std::size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const std::size_t head = std::min<std::size_t>(n, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const std::size_t body = n / 64 * 64;
  for (std::size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, n - body);
  _mm_sfence();  // the streamed lines are visible before the phase (or the ring's count) is posted
}

/// Copies `n` bytes from `src` to `dst` (not overlapping) with streaming stores or with ordinary ones.
inline void copy_by(bool streaming, void* dst, const void* src, std::size_t n) {
  if (streaming) stream_copy(dst, src, n);
  else std::memcpy(dst, src, n);
}

/// Streaming stores win where ordinary ones take more than this many times as long: the reader then fetches
/// the streamed lines from memory, which costs it about as much again as the streaming stores cost the writer.
inline constexpr unsigned stream_penalty = 4;

/// Copies from this size are timed; smaller ones follow the latest choice (a few lines: nothing to measure).
inline constexpr std::size_t store_probe_bytes = 16 << 10;

/// Copies below this size always use ordinary stores: a few lines cost less than the store fence.
inline constexpr std::size_t stream_min_bytes = 4 << 10;

/// Which kind of store this process uses for copies into shared memory, chosen from its timed copies. Shared
/// by every thread of the process (the choice follows the cores, not the call); races only blur a sample.
class store_choice {
 public:
  /// Fixes the kind of store every later copy uses, or (automatic) lets the timed copies choose.
  void fix(shm_stores kind) { fixed_.store(kind, std::memory_order_relaxed); }

  /// Copies `n` bytes from `src` to `dst` (not overlapping) with the store kind that costs less now.
  void copy(void* dst, const void* src, std::size_t n) {
    if (n < stream_min_bytes) return static_cast<void>(std::memcpy(dst, src, n));
    const shm_stores fixed = fixed_.load(std::memory_order_relaxed);
    if (fixed != shm_stores::automatic)
      return copy_by(fixed == shm_stores::streaming, dst, src, n);
    const bool streaming = streaming_.load(std::memory_order_relaxed);
    if (n < store_probe_bytes) return copy_by(streaming, dst, src, n);
    // Every probe_every-th large copy tries the other kind, so a change of placement is seen.
    const bool probe = (copies_.fetch_add(1, std::memory_order_relaxed) % probe_every) == probe_every - 1;
    const bool stream = streaming != probe;
    const auto t0 = std::chrono::steady_clock::now();
    copy_by(stream, dst, src, n);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    record(stream ? stream_ : ordinary_, static_cast<std::uint64_t>(ns) * 1024 / n);
    const std::uint64_t o = best(ordinary_), s = best(stream_);
    if (o != 0 && s != 0) streaming_.store(o > stream_penalty * s, std::memory_order_relaxed);
  }

 private:
  static constexpr unsigned probe_every = 32;
  static constexpr unsigned kept = 4;  ///< samples kept per kind; the least counts (a preempted copy only inflates)
  /// The latest `kept` timings of one kind of store, in ns per KiB (0: none yet).
  struct samples {
    std::atomic<std::uint64_t> ns[kept]{};
    std::atomic<unsigned> next{0};
  };

  static void record(samples& s, std::uint64_t ns_per_kib) {
    s.ns[s.next.fetch_add(1, std::memory_order_relaxed) % kept].store(ns_per_kib, std::memory_order_relaxed);
  }
  static std::uint64_t best(const samples& s) {
    std::uint64_t least = 0;
    for (const auto& x : s.ns) {
      const std::uint64_t v = x.load(std::memory_order_relaxed);
      if (v != 0 && (least == 0 || v < least)) least = v;
    }
    return least;
  }

  std::atomic<shm_stores> fixed_{shm_stores::automatic};
  std::atomic<bool> streaming_{false};
  std::atomic<unsigned> copies_{probe_every - 1};  ///< the first large copy probes streaming stores
  samples ordinary_{};
  samples stream_{};
};

/// The process's store choice.
inline store_choice& shared_stores() {
  static store_choice choice;
  return choice;
}

}  // namespace ddp::tcp::detail
