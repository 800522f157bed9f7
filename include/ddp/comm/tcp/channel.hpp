#pragma once
/// \file What a collective's algorithm sees of the engine while it executes one call: group ranks, frames
/// to and from them, scratch memory. It speaks group ranks; the engine speaks world ranks. A step of a
/// hierarchical collective (hierarchical.hpp) runs over some of the group's members only.

#include <cstddef>
#include <span>
#include <vector>

#include <ddp/comm/tcp/call.hpp>
#include <ddp/comm/tcp/engine.hpp>

namespace ddp::tcp::detail {

class channel {
 public:
  channel(engine& e, call& c) : channel(e, c, c.grp->members, c.grp->me) {}
  /// Over `members` (world ranks; this process is members[me]) instead of the call's whole group.
  channel(engine& e, call& c, const std::vector<int>& members, int me) : e_(e), c_(c), members_(members), me_(me) {}

  /// The call being executed.
  [[nodiscard]] const call& what() const { return c_; }
  /// This process's group rank.
  [[nodiscard]] int rank() const { return me_; }
  /// The group's size.
  [[nodiscard]] int size() const { return static_cast<int>(members_.size()); }

  /// Queues a frame of `bytes` payload to group rank `to`; `data` must stay valid and unchanged until
  /// flush() (a peer on this host may copy it straight from this process's memory until then).
  void send(int to, const void* data, std::size_t bytes) {
    c_.grp->stats.add_bytes(c_.kind, bytes);
    e_.send_collective(world(to), header_of(c_, bytes), data);
  }
  /// Receives the next frame from group rank `from` into `dest` (exactly `bytes`), sends progressing meanwhile.
  void recv(int from, void* dest, std::size_t bytes) {
    const recv_part one{from, dest, bytes};
    recv_all(std::span<const recv_part>(&one, 1));
  }
  /// Receives one frame from each listed peer (each at most once), in whatever order they arrive.
  void recv_all(std::span<const recv_part> parts) {
    for (const auto& part : parts) e_.expect(world(part.peer), header_of(c_, part.bytes), part.dest);
    e_.receive_expected();
  }
  /// Waits until every queued frame is written and every peer has copied the data of its remote frames.
  void flush() { e_.flush(); }
  /// A scratch buffer (two of them: 0 and 1) of at least `bytes`, held by the engine and reused by every
  /// later call: it only grows, uninitialized, so steady state allocates and touches no new memory.
  /// Growing discards the contents.
  char* scratch(int which, std::size_t bytes) { return e_.scratch(which, bytes); }

 private:
  [[nodiscard]] int world(int group_rank) const { return members_[static_cast<std::size_t>(group_rank)]; }
  engine& e_;
  call& c_;
  const std::vector<int>& members_;
  int me_;
};

}  // namespace ddp::tcp::detail
