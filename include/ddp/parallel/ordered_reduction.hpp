#pragma once
/// \file Deterministic reduction (the sharding policies' deterministic knob): every element is summed in rank order,
/// ((g0 + g1) + g2) + ..., by ddp on the host, whatever the backend, bucket size or algorithm. The collectives
/// only move bytes: an all_to_all for a reduce-scatter (the same bytes as a ring reduce-scatter) and an
/// all_gather for an all-reduce ((N-1)·S bytes per rank against a ring's 2·(N-1)/N·S: equal at N = 2, N/2
/// times more beyond); the sum then runs where the operation completes. A group of two needs none of it: each
/// element of its sum is one addition, whose bits IEEE 754 makes the same in either order (ordered_sum_needed).

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include <ddp/memory/average.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/memory/host.hpp>

namespace ddp::detail {

/// Whether a group of `n` ranks must sum in rank order itself: with n ≤ 2 every element of a sum is a single
/// addition, which commutes bit for bit, so any backend's all-reduce gives the rank-order bits at its own cost.
constexpr bool ordered_sum_needed(int n) noexcept { return n > 2; }

/// Scratch of one group's deterministic reductions, one buffer per key (a bucket), kept across steps.
class ordered_reduction {
 public:
  /// Starts all-gathering every rank's `part` into key's scratch (the all-reduce of `part`).
  template <class Comm>
  work all_gather_part(Comm& comm, std::size_t key, const raw_tensor& part) {
    return comm.all_gather(part, scratch(key, part, static_cast<std::size_t>(comm.size())));
  }
  /// Starts sending block j of `whole` to rank j, into key's scratch (the reduce-scatter of `whole`).
  template <class Comm>
  work exchange(Comm& comm, std::size_t key, const raw_tensor& whole) {
    return comm.all_to_all(whole, scratch(key, whole, 1));
  }
  /// Writes the average of the `n` blocks in key's scratch, summed in rank order, to `out` (one block): one pass,
  /// with the bits of the sum followed by detail::divide. `out` on a device receives the host's sum through its
  /// domain, waited for (the sum runs on the host).
  void average_into(std::size_t key, const raw_tensor& out, int n) {
    if (out.where.is_cuda()) {
      if (result_.size() < out.bytes()) result_ = host_memory().allocate(out.bytes());
      const raw_tensor host = result_.view(out.type, 0, out.size);
      average_into(key, host, n);
      memory_domain& d = require_domain_of(out.where, "deterministic reduction");
      d.copy(host, out);
      d.synchronize();  // result_ is the next bucket's
      return;
    }
    const std::byte* blocks = scratch_[key].data();
    visit_dtype(out.type, [&](auto zero) {
      using T = decltype(zero);
      const T* in = reinterpret_cast<const T*>(blocks);
      T* dst = static_cast<T*>(out.data);
      const std::size_t k = out.size, ranks = static_cast<std::size_t>(n);
      if constexpr (std::is_floating_point_v<T>) {
        const bool exact = (n & (n - 1)) == 0;  // as divide(): a power of two multiplies by its exact reciprocal
        const T inverse = T(1) / static_cast<T>(n), count = static_cast<T>(n);
        for (std::size_t i = 0; i < k; ++i) {
          T acc = in[i];
          for (std::size_t j = 1; j < ranks; ++j) acc = acc + in[j * k + i];
          dst[i] = exact ? acc * inverse : acc / count;
        }
      } else {
        for (std::size_t i = 0; i < k; ++i) {
          T acc = in[i];
          for (std::size_t j = 1; j < ranks; ++j) acc = static_cast<T>(acc + in[j * k + i]);
          dst[i] = acc;
        }
        divide(out, n);
      }
    });
  }

 private:
  raw_tensor scratch(std::size_t key, const raw_tensor& like, std::size_t times) {
    if (scratch_.size() <= key) scratch_.resize(key + 1);
    const std::size_t bytes = like.bytes() * times;
    if (scratch_[key].size() != bytes) scratch_[key] = host_memory().allocate(bytes);
    return scratch_[key].view(like.type, 0, like.size * times);
  }
  std::vector<domain_buffer> scratch_;  // host memory: the rank-order sum runs on the host
  domain_buffer result_;                // host memory: the sum of a block bound for a device
};

}  // namespace ddp::detail
