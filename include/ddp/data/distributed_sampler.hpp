#pragma once
/// \file ddp::distributed_sampler: which dataset indices each rank visits in an epoch, with PyTorch's
/// DistributedSampler semantics (seed + epoch shuffle, padding by repetition or drop_last, rank r takes
/// positions r, r+N, ...), plus an exact-once mode for evaluation (no padding: every sample on one rank).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/core/error.hpp>

namespace ddp {

namespace detail {

/// SplitMix64: a tiny, fully specified generator, so every rank and every standard library draws the same numbers.
class splitmix64 {
 public:
  explicit splitmix64(std::uint64_t seed) noexcept : state_(seed) {}
  std::uint64_t operator()() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, bound) without modulo bias (rejection of the short top range).
  std::uint64_t below(std::uint64_t bound) noexcept {
    const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % bound);
    std::uint64_t x = 0;
    do x = (*this)(); while (x >= limit);
    return x % bound;
  }

 private:
  std::uint64_t state_;
};

/// 0..n-1 in the order of a Fisher-Yates shuffle driven by splitmix64(seed).
inline std::vector<std::size_t> seeded_permutation(std::size_t n, std::uint64_t seed) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  splitmix64 rng(seed);
  for (std::size_t i = n; i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  return order;
}

}  // namespace detail

/// A rank's indices for one epoch, iterated as consecutive batches (std::span<const std::size_t>).
class index_batches {
 public:
  /// Iterator over the batches.
  class iterator {
   public:
    using value_type = std::span<const std::size_t>;    ///< one batch
    using difference_type = std::ptrdiff_t;              ///< distance in batches
    iterator() = default;
    iterator(const index_batches* owner, std::size_t batch) noexcept : owner_(owner), batch_(batch) {}
    value_type operator*() const noexcept { return (*owner_)[batch_]; }
    iterator& operator++() noexcept { ++batch_; return *this; }
    iterator operator++(int) noexcept { auto copy = *this; ++batch_; return copy; }
    bool operator==(const iterator& other) const noexcept { return batch_ == other.batch_; }

   private:
    const index_batches* owner_ = nullptr;
    std::size_t batch_ = 0;
  };

  /// Splits `indices` into batches of `batch_size`; the last one is shorter unless `drop_last_batch`.
  index_batches(std::vector<std::size_t> indices, std::size_t batch_size, bool drop_last_batch)
      : indices_(std::move(indices)), batch_(batch_size) {
    if (batch_size == 0) throw config_error("distributed_sampler::batches: the batch size must be at least 1");
    count_ = drop_last_batch ? indices_.size() / batch_ : (indices_.size() + batch_ - 1) / batch_;
  }
  /// Number of batches.
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  /// Batch `b` (b < size()).
  [[nodiscard]] std::span<const std::size_t> operator[](std::size_t b) const noexcept {
    const std::size_t first = b * batch_;
    return std::span<const std::size_t>(indices_).subspan(first, std::min(batch_, indices_.size() - first));
  }
  /// First batch.
  [[nodiscard]] iterator begin() const noexcept { return {this, 0}; }
  /// Past the last batch.
  [[nodiscard]] iterator end() const noexcept { return {this, count_}; }
  /// All indices of the epoch for this rank, in order.
  [[nodiscard]] const std::vector<std::size_t>& indices() const noexcept { return indices_; }

 private:
  std::vector<std::size_t> indices_;
  std::size_t batch_;
  std::size_t count_ = 0;
};

/// How the sampler splits the dataset.
struct sampler_options {
  bool shuffle = true;        ///< permute by seed + epoch (PyTorch's shuffle=True)
  std::uint64_t seed = 0;     ///< base seed, the same on every rank
  bool drop_last = false;     ///< drop the tail so ranks get equal counts, instead of padding by repetition
  bool exact_once = false;    ///< evaluation: no padding, no dropping; every sample on exactly one rank
};

/// Which dataset indices each rank visits per epoch. Every rank computes the same permutation (seed + epoch,
/// own generator), so no communication is needed; the communicator only supplies rank and size.
class distributed_sampler {
 public:
  using options = sampler_options;  ///< how the sampler splits the dataset

  /// A sampler of `dataset_size` samples for rank `rank` of `world_size`.
  distributed_sampler(std::size_t dataset_size, int world_size, int rank, options o = {})
      : size_(dataset_size), world_(world_size), rank_(rank), opt_(o) {
    if (world_size < 1 || rank < 0 || rank >= world_size)
      throw config_error("distributed_sampler: rank " + std::to_string(rank) + " of world size " +
                         std::to_string(world_size) + " is out of range; pass comm.rank() and comm.size()");
    if (o.exact_once && o.drop_last)
      throw config_error("distributed_sampler: exact_once and drop_last exclude each other (exact_once keeps every "
                         "sample exactly once); set only one");
  }
  /// A sampler for the rank and size of `comm` (any ddp::communicator, or anything with rank() and size()).
  template <class Comm>
    requires requires(const Comm& c) { { c.rank() } -> std::convertible_to<int>; { c.size() } -> std::convertible_to<int>; }
  distributed_sampler(std::size_t dataset_size, const Comm& comm, options o = {})
      : distributed_sampler(dataset_size, comm.size(), comm.rank(), o) {}

  /// Samples this rank visits per epoch: ceil(size/N) padded, floor(size/N) with drop_last (as PyTorch's
  /// num_samples); with exact_once, ceil or floor depending on the rank (the counts differ by at most one).
  [[nodiscard]] std::size_t num_samples() const noexcept {
    const auto n = static_cast<std::size_t>(world_), r = static_cast<std::size_t>(rank_);
    if (opt_.exact_once) return size_ / n + (r < size_ % n ? 1 : 0);
    return opt_.drop_last ? size_ / n : (size_ + n - 1) / n;
  }
  /// Samples all ranks visit together per epoch (PyTorch's total_size; the dataset size with exact_once).
  [[nodiscard]] std::size_t total_size() const noexcept {
    const auto n = static_cast<std::size_t>(world_);
    if (opt_.exact_once) return size_;
    return (opt_.drop_last ? size_ / n : (size_ + n - 1) / n) * n;
  }
  /// Dataset size.
  [[nodiscard]] std::size_t dataset_size() const noexcept { return size_; }

  /// This rank's indices in epoch `epoch` (the epoch reseeds the shuffle: pass it every epoch).
  [[nodiscard]] std::vector<std::size_t> indices(std::uint64_t epoch) const {
    std::vector<std::size_t> all;
    if (opt_.shuffle) {
      all = detail::seeded_permutation(size_, opt_.seed + epoch);
    } else {
      all.resize(size_);
      std::iota(all.begin(), all.end(), std::size_t{0});
    }
    const std::size_t total = total_size();
    if (total > size_ && size_ > 0) {  // pad by repeating from the start, as often as needed
      all.reserve(total);
      for (std::size_t i = 0; all.size() < total; ++i) all.push_back(all[i % size_]);
    }
    all.resize(std::min(all.size(), total));
    std::vector<std::size_t> mine;
    mine.reserve(num_samples());
    for (std::size_t i = static_cast<std::size_t>(rank_); i < all.size(); i += static_cast<std::size_t>(world_))
      mine.push_back(all[i]);
    return mine;
  }
  /// This rank's indices in epoch `epoch` as batches of `batch_size` (the last shorter unless `drop_last_batch`).
  [[nodiscard]] index_batches batches(std::uint64_t epoch, std::size_t batch_size, bool drop_last_batch = false) const {
    return {indices(epoch), batch_size, drop_last_batch};
  }

 private:
  std::size_t size_;
  int world_;
  int rank_;
  options opt_;
};

}  // namespace ddp
