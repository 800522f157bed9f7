#pragma once
/// \file The ddp::communicator concept every backend (tcp, mpi, nccl) models.
///
/// Buffers are any ddp::tensor (std::span, std::vector, ddp::raw_tensor for device memory or a
/// runtime dtype). Sizes: with N = size(), reduce_scatter takes N*k elements in and gives k out;
/// all_gather takes k and gives N*k; gather and scatter use the N*k side on the root only;
/// all_to_all sends block i of its N*k input to rank i and receives block j from rank j. All
/// ranks of a group must call the same collectives in the same order with the same counts,
/// dtypes, operators and roots; a backend reports a difference as ddp::mismatch_error where it
/// can see it, and as ddp::timeout_error otherwise.

#include <concepts>
#include <span>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp {

/// A group of ranks with asynchronous collectives and point-to-point transfers.
template <class C>
concept communicator =
    std::copy_constructible<C> &&
    requires(C& c, const C& cc, std::span<float> s, std::span<const float> in, raw_tensor r, int i, reduce_op op) {
      { cc.rank() } -> std::same_as<int>;
      { cc.size() } -> std::same_as<int>;
      { c.split(i, i) } -> std::same_as<C>;
      { c.all_reduce(s, op) } -> std::same_as<work>;
      { c.all_reduce(r, op) } -> std::same_as<work>;
      { c.reduce_scatter(in, s, op) } -> std::same_as<work>;
      { c.all_gather(in, s) } -> std::same_as<work>;
      { c.all_gather(r, r) } -> std::same_as<work>;
      { c.broadcast(s, i) } -> std::same_as<work>;
      { c.reduce(s, op, i) } -> std::same_as<work>;
      { c.gather(in, s, i) } -> std::same_as<work>;
      { c.scatter(in, s, i) } -> std::same_as<work>;
      { c.all_to_all(in, s) } -> std::same_as<work>;
      { c.barrier() } -> std::same_as<work>;
      { c.send(in, i, i) } -> std::same_as<work>;
      { c.recv(s, i, i) } -> std::same_as<work>;
      { cc.stats() } -> std::same_as<comm_stats>;
    };

}  // namespace ddp
