#pragma once
/// \file ddp::detail::unit_pool: reused buffers (per arena, in its memory domain) that each hold one unit's values
/// or gradients at a time (full_shard's unsharded values, the sharded strategies' gradient buffers). A unit takes
/// the smallest idle buffer that fits it (the most recently returned among equals) and gives it back after use, so
/// steady-state steps reuse the same resident memory: no allocation, no page faults. trim() frees the buffers a
/// step did not need (after unsharding the whole model, say), or every idle buffer.

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>

namespace ddp::detail {

/// Which idle buffers unit_pool::trim frees.
enum class pool_trim : std::uint8_t {
  untaken,   ///< those nobody took since the previous trim (steady state keeps what steps use)
  all_idle,  ///< every idle buffer (the lowest memory between steps)
};

/// A pool of per-unit buffers, each one byte range per arena.
class unit_pool {
 public:
  /// `widths`: bytes per element of each arena; `domains`: where each arena's parts live (none given: the host).
  explicit unit_pool(std::vector<std::size_t> widths, std::vector<memory_domain*> domains = {})
      : widths_(std::move(widths)), domains_(std::move(domains)) {
    domains_.resize(widths_.size(), &host_memory());
  }

  /// A buffer holding at least `elements[a]` elements for every arena a; its bytes are unspecified.
  std::size_t take(std::span<const std::size_t> elements) {
    std::size_t best = buffers_.size();
    for (std::size_t i = 0; i < buffers_.size(); ++i) {
      const auto& b = buffers_[i];
      if (b.busy || b.parts.empty() || !fits(b, elements)) continue;
      if (best == buffers_.size() || b.bytes < buffers_[best].bytes ||
          (b.bytes == buffers_[best].bytes && b.returned > buffers_[best].returned))
        best = i;
    }
    if (best == buffers_.size()) best = allocate(elements);
    auto& b = buffers_[best];
    b.busy = true;
    b.taken_since_trim = true;
    return best;
  }
  /// Returns buffer `id` to the pool.
  void give(std::size_t id) noexcept {
    buffers_[id].busy = false;
    buffers_[id].returned = ++clock_;
  }
  /// The bytes of buffer `id` for arena `a`.
  [[nodiscard]] std::byte* data(std::size_t id, std::size_t a) const noexcept { return buffers_[id].parts[a].data(); }
  /// Frees the idle buffers `which` names.
  void trim(pool_trim which) noexcept {
    for (auto& b : buffers_) {
      if (!b.busy && (which == pool_trim::all_idle || !b.taken_since_trim)) b = buffer{};
      b.taken_since_trim = false;
    }
  }
  /// Bytes the pool holds, busy or idle.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& b : buffers_) n += b.bytes;
    return n;
  }

 private:
  struct buffer {
    std::vector<domain_buffer> parts;  // per arena; empty once freed
    std::size_t bytes = 0;             // sum of the parts
    bool busy = false;                 // taken and not given back
    bool taken_since_trim = false;     // taken since the last trim()
    std::uint64_t returned = 0;        // when given back (a counter)
  };
  [[nodiscard]] bool fits(const buffer& b, std::span<const std::size_t> elements) const noexcept {
    for (std::size_t a = 0; a < elements.size(); ++a)
      if (b.parts[a].size() < elements[a] * widths_[a]) return false;
    return true;
  }
  std::size_t allocate(std::span<const std::size_t> elements) {
    buffer fresh;
    for (std::size_t a = 0; a < elements.size(); ++a) {
      fresh.parts.push_back(domains_[a]->allocate(elements[a] * widths_[a]));
      fresh.bytes += elements[a] * widths_[a];
    }
    for (std::size_t i = 0; i < buffers_.size(); ++i)
      if (buffers_[i].parts.empty()) {
        buffers_[i] = std::move(fresh);
        return i;
      }
    buffers_.push_back(std::move(fresh));
    return buffers_.size() - 1;
  }

  std::vector<std::size_t> widths_;
  std::vector<memory_domain*> domains_;  // per arena
  std::vector<buffer> buffers_;
  std::uint64_t clock_ = 0;
};

}  // namespace ddp::detail
