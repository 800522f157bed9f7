#pragma once
/// \file ddp::local::communicator: the ddp::communicator whose ranks are threads of one process (ddp::local::run
/// starts them). Collectives work in the shared address space: each rank leaves its buffers at a rendezvous and,
/// once every rank is there, runs its share on its own thread, reading and writing its peers' buffers directly
/// (comm/local/shares.hpp): no sockets, no shared-memory segments, no copies in or out.
///
/// Conventions:
/// - The collective front end (comm/front_end.hpp) checks the arguments, numbers and counts each operation, runs
///   avg as a sum divided on each rank once done, and with DDP_CHECK_COLLECTIVES=1 compares each collective across
///   the ranks first; a rendezvous checks every call against the first rank's anyway, so ranks calling different
///   collectives raise ddp::mismatch_error at once.
/// - Reductions fold in rank order, in the dtype (bf16/f16 in float, rounded after each step), as ddp::tcp's direct
///   exchange does: the bits of one process summing its ranks' values in rank order.
/// - stats() counts what the other backends count (comm/front_end.hpp), so byte budgets compare across backends.
/// - A send completes once its recv has copied it; a recv must take the count and dtype of its send.
/// - Device tensors are staged through host memory (comm/staging.hpp), each rank's on its own device's domain.

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/call.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/front_end.hpp>
#include <ddp/comm/local/group.hpp>
#include <ddp/comm/local/operation.hpp>
#include <ddp/comm/local/slot.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/split.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/work.hpp>

namespace ddp::local {

class communicator;

namespace detail {

/// One rank's view of a group: the group, its rank there and the front end's state of that rank.
struct place {
  /// Rank `r` of `g`.
  place(std::shared_ptr<group_state> g, int r) : group(std::move(g)), rank(r) {}
  std::shared_ptr<group_state> group;  ///< the group
  int rank;                            ///< this rank's place in it
  ddp::detail::front_state front;      ///< sequence numbers, statistics, flight record and call check of this rank
};

/// How run() makes the world's communicators.
struct access {
  /// Rank `rank`'s communicator of `g`.
  static communicator make(std::shared_ptr<group_state> g, int rank);
};

}  // namespace detail

/// A rank (thread) of one ddp::local::run modelling ddp::communicator. Copies share the rank's place in the
/// group; split() makes subgroups of the same threads.
class communicator : public ddp::detail::collective_front<communicator> {
 public:
  using backend_tag = ddp::backend::local;  ///< the backend tag data_parallel deduces from this communicator

  /// This thread's rank in the group.
  [[nodiscard]] int rank() const noexcept { return place_->rank; }
  /// Number of ranks (threads) in the group.
  [[nodiscard]] int size() const noexcept { return place_->group->size(); }
  /// This thread's rank in the world of its run (its index in ddp::local::run).
  [[nodiscard]] int world_rank() const noexcept { return place_->group->members[static_cast<std::size_t>(rank())]; }
  /// The deadline every operation gets.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return place_->group->home->cfg.timeout; }
  /// Payload bytes sent and calls made by this rank in this group, by operation.
  [[nodiscard]] comm_stats stats() const noexcept { return place_->front.stats.snapshot(); }
  /// The largest tag send and recv accept.
  [[nodiscard]] static constexpr int max_tag() noexcept { return INT_MAX; }

  /// Collective: ranks with the same `color` form a new group, ordered by (key, rank).
  [[nodiscard]] communicator split(int color, int key) {
    const std::vector<int> ranks = ddp::detail::split_members(*this, color, key);
    const std::uint64_t nth = place_->group->splits[static_cast<std::size_t>(rank())]++;
    auto child = detail::child_of(*place_->group, nth, color, ranks);
    const auto me = std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin();
    return communicator(std::make_shared<detail::place>(std::move(child), static_cast<int>(me)));
  }

 private:
  friend class ddp::detail::collective_front<communicator>;
  friend struct detail::access;
  using call = ddp::detail::call_info;

  /// The front end does every duty: sequence, statistics, avg (divided on each rank when done), call check.
  static constexpr ddp::detail::front_duties duties{.group = "a local group"};

  explicit communicator(std::shared_ptr<detail::place> p) : place_(std::move(p)) {}

  [[nodiscard]] ddp::detail::front_state& front() const noexcept { return place_->front; }
  [[nodiscard]] const std::shared_ptr<ddp::detail::flight_recorder>& flight() const noexcept { return place_->front.flight; }

  work start_all_reduce(const call& c, const raw_tensor& b, reduce_op op) { return meet(c, {{}, b}, op); }
  work start_reduce(const call& c, const raw_tensor& b, reduce_op op) { return meet(c, {{}, b}, op); }
  work start_broadcast(const call& c, const raw_tensor& b) { return meet(c, {{}, b}); }
  work start_barrier(const call& c) { return meet(c, {}); }

  work start_reduce_scatter(const call& c, const raw_tensor& in, const raw_tensor& out, reduce_op op) {
    std::vector<std::byte> scratch;
    const raw_tensor src = apart(in, out, out.data == block(in, out.bytes()), scratch);
    return meet(c, {src, out}, op, std::move(scratch));
  }
  work start_all_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    std::vector<std::byte> scratch;
    const raw_tensor src = apart(in, out, in.data == block(out, in.bytes()), scratch);
    return meet(c, {src, out}, reduce_op::sum, std::move(scratch));
  }
  work start_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    std::vector<std::byte> scratch;
    const bool at_root = rank() == c.peer;
    const raw_tensor src = at_root ? apart(in, out, in.data == block(out, in.bytes()), scratch) : in;
    return meet(c, {src, at_root ? out : raw_tensor{}}, reduce_op::sum, std::move(scratch));
  }
  work start_scatter(const call& c, const raw_tensor& in, const raw_tensor& out) {
    std::vector<std::byte> scratch;
    const bool at_root = rank() == c.peer;
    const raw_tensor src = at_root ? apart(in, out, out.data == block(in, out.bytes()), scratch) : raw_tensor{};
    return meet(c, {src, out}, reduce_op::sum, std::move(scratch));
  }
  work start_all_to_all(const call& c, const raw_tensor& in, const raw_tensor& out) {
    std::vector<std::byte> scratch;
    const raw_tensor src = apart(in, out, false, scratch);
    return meet(c, {src, out}, reduce_op::sum, std::move(scratch));
  }

  work start_send(const call& c, const raw_tensor& b) {
    auto s = detail::post(*place_->group, rank(), c, {b, {}});
    return work(std::make_shared<detail::operation>(place_->group, std::move(s), rank(), c));
  }
  work start_recv(const call& c, const raw_tensor& b) {
    auto s = detail::post(*place_->group, rank(), c, {{}, b});
    return work(std::make_shared<detail::operation>(place_->group, std::move(s), rank(), c));
  }

  /// This rank reaches collective `c` with `p`; its shares that are ready run at once.
  work meet(const call& c, const detail::part& p, reduce_op run = reduce_op::sum, std::vector<std::byte> scratch = {}) {
    auto s = detail::arrive(*place_->group, rank(), c, p, run);
    place_->group->home->drive(world_rank());
    return work(std::make_shared<detail::operation>(place_->group, std::move(s), rank(), c, std::move(scratch)));
  }

  /// Where this rank's block of the group-sized buffer `whole` starts (blocks of `bytes`).
  [[nodiscard]] const void* block(const raw_tensor& whole, std::size_t bytes) const noexcept {
    return static_cast<const std::byte*>(whole.data) + static_cast<std::size_t>(rank()) * bytes;
  }

  /// `in` itself, or a copy in `scratch` where it overlaps `out` other than as this rank's own block (`in_place`):
  /// peers read `in` while this rank's share writes `out`.
  static raw_tensor apart(const raw_tensor& in, const raw_tensor& out, bool in_place, std::vector<std::byte>& scratch) {
    const auto* a = static_cast<const std::byte*>(in.data);
    const auto* b = static_cast<const std::byte*>(out.data);
    if (in_place || in.bytes() == 0 || out.bytes() == 0 || a + in.bytes() <= b || b + out.bytes() <= a) return in;
    scratch.assign(a, a + in.bytes());
    raw_tensor copy = in;
    copy.data = scratch.data();
    return copy;
  }

  std::shared_ptr<detail::place> place_;
};

inline communicator detail::access::make(std::shared_ptr<group_state> g, int rank) {
  return communicator(std::make_shared<place>(std::move(g), rank));
}

}  // namespace ddp::local

/// backend::local selects ddp::local::communicator (checked against the ddp::communicator concept there).
template <>
struct ddp::backend_traits<ddp::backend::local> : ddp::detail::backend_binding<ddp::local::communicator> {};
