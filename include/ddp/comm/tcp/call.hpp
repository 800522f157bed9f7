#pragma once
/// \file What the TCP engine executes: groups (the world or a split of it) and the calls queued on them,
/// and the frame header each call's frames carry.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ddp/comm/flight_recorder.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/shm_group.hpp>
#include <ddp/comm/tcp/shm_hosts.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>

namespace ddp::tcp::detail {

/// After a call has waited this long without a byte moving, the engine tells the group what it waits in
/// (op_waiting) and publishes whom it waits for (over shared memory: only whom); a peer at the same step in another call then raises
/// mismatch_error at once.
inline constexpr std::chrono::milliseconds stall_notice_after{250};

/// A set of ranks sharing the mesh: the world, or a subgroup made by split().
struct group {
  std::vector<int> members;  ///< world rank of each group rank
  int me = 0;                ///< this process's group rank
  std::uint32_t id = 0;      ///< identifier carried in every frame
  std::chrono::milliseconds timeout{};
  std::uint64_t next_seq = 0;  ///< guarded by the engine's queue mutex
  std::uint64_t splits = 0;    ///< splits made from this group, for the children's ids
  ddp::detail::stats_counter stats;
  std::shared_ptr<ddp::detail::flight_recorder> flight;  ///< the group's last collectives (null when off)
  std::shared_ptr<shm_group> shm;  ///< the group's shared-memory segment when every member is on this host; else null
  std::shared_ptr<const shm_hosts> hosts;  ///< the job's shared memory, for the groups split() makes; null: none
  std::shared_ptr<host_plan> hier;  ///< where the group spans hosts with two members or more on one: its hierarchy

  [[nodiscard]] int size() const { return static_cast<int>(members.size()); }
};

/// Which side of a point-to-point transfer a call is; collectives are neither. Told explicitly, never
/// guessed from the buffers (an empty send has no data pointer).
enum class p2p : std::uint8_t { none, send, recv };

/// One queued call: what the engine executes, in submission order.
struct call {
  collective kind{};
  p2p side = p2p::none;
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  int root = -1;            ///< root, or peer for send/recv
  std::int32_t tag = 0;     ///< send/recv tag
  std::uint64_t count = 0;  ///< the count frames carry
  const void* in = nullptr;
  void* out = nullptr;
  std::shared_ptr<group> grp;
  std::uint64_t seq = 0;
  std::shared_ptr<ddp::detail::completion> done;
  bool resumed = false;  ///< a shared-memory call the caller's thread started and handed to the engine
  /// Where not 0, the group its frames name instead of grp->id: a hierarchical call's step across hosts, whose
  /// frames (op, root) differ from the call's own, so no check takes them for another call at the same step.
  std::uint32_t wire_group = 0;

  /// True for a collective that runs over its group's shared-memory segment.
  [[nodiscard]] bool over_shm() const { return side == p2p::none && grp->shm != nullptr; }
};

/// The header every frame of `c` carries, with payload `length`.
inline frame_header header_of(const call& c, std::uint64_t length) {
  frame_header h;
  h.op = static_cast<std::uint8_t>(c.kind);
  h.type = static_cast<std::uint8_t>(c.type);
  h.reduce = has_reduce(h.op) ? static_cast<std::uint8_t>(c.op) : 0;
  if (has_root(h.op)) h.root = c.root;
  if (c.kind == collective::send_recv) h.tag = c.tag;
  h.group = c.wire_group != 0 ? c.wire_group : c.grp->id;
  h.seq = c.seq;
  h.count = c.count;
  h.length = length;
  return h;
}

/// A call's completion that names the call only when asked (a timeout or an error): submitting a call formats no
/// text and allocates nothing beyond the completion itself.
class call_completion final : public ddp::detail::completion {
 public:
  call_completion(const call& c, int rank, std::shared_ptr<const ddp::detail::stall_note> note)
      : completion(rank, c.grp->timeout, std::string(), std::move(note)), header_(header_of(c, 0)), peer_(c.root), side_(c.side) {}

  [[nodiscard]] std::string describe() const override {
    if (side_ == p2p::none) return detail::describe(header_);
    const bool sends = side_ == p2p::send;
    return (sends ? "send of " : "recv of ") + std::to_string(header_.count) + " " +
           std::string(to_string(static_cast<dtype>(header_.type))) + " with tag " + std::to_string(header_.tag) +
           (sends ? " to rank " : " from rank ") + std::to_string(peer_);
  }

 private:
  frame_header header_;
  int peer_;  ///< the other rank of a send or recv
  p2p side_;
};

/// One receive the current call waits for.
struct recv_part {
  int peer = 0;  ///< group rank
  void* dest = nullptr;
  std::size_t bytes = 0;
};

}  // namespace ddp::tcp::detail
