#pragma once
/// \file The errors the TCP engine raises, the checks that find a mismatched step before a sleep, and the
/// abort notices that carry errors to the peers. Every message names this rank, the peer, the call and what
/// to do; the engine derives from this to build them.

#include <algorithm>
#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include <ddp/comm/tcp/call.hpp>
#include <ddp/comm/tcp/frame_reader.hpp>
#include <ddp/comm/tcp/matching.hpp>
#include <ddp/comm/tcp/messages.hpp>
#include <ddp/comm/tcp/peer.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

class engine_errors {
 protected:
  engine_errors(int rank, int size) : rank_(rank), size_(size) {}

  /// The rank label errors use: the group rank, plus the world rank inside a subgroup.
  [[nodiscard]] std::string label(int world_rank) const {
    if (current_ == nullptr) return "rank " + std::to_string(world_rank);
    const auto& m = current_->grp->members;
    for (std::size_t i = 0; i < m.size(); ++i)
      if (m[i] == world_rank) return rank_label(i, world_rank, m.size() != static_cast<std::size_t>(size_));
    return "world rank " + std::to_string(world_rank);
  }
  [[nodiscard]] std::string what_now() const {
    return current_ != nullptr ? describe(header_of(*current_, 0)) : std::string("a point-to-point transfer");
  }

  /// How a peer's stream ended, for peer_lost.
  [[nodiscard]] static std::string farewell(const frame_reader& in) {
    if (in.state() == read_state::said_bye) return "it closed its communicator";
    if (in.error_code() != 0) return "receiving from it failed (" + errno_text(in.error_code()) + ")";
    return "it closed the connection or died";
  }

  [[nodiscard]] peer_lost lost(int world_peer, int code, const std::string& how) const {
    return lost_peer(label(world_peer), what_now(), how, rank_, world_peer, code);
  }

  /// The mismatch_error naming this rank's call `want` and what the peer `got` sent (or waits in) instead.
  [[noreturn]] void throw_mismatch(int world_peer, const frame_header& want, const frame_header& got,
                                   const char* how = " sent ") const {
    // A frame of this rank's previous step: both calls of that step went through (each only sent).
    const bool earlier = got.group == finished_.group && got.seq == finished_.seq && got.group == want.group;
    throw different_calls(label(rank_) + " called " + describe(want) +
                              (earlier ? " after " + describe(finished_) : std::string()) + ", " + label(world_peer) +
                              how + describe(got) +
                              (same_call(want, got) ? " with a payload of " + std::to_string(got.length) +
                                                          " bytes where " + std::to_string(want.length) +
                                                          " were expected"
                                                    : std::string()),
                          rank_);
  }

  /// Raises mismatch_error where one of `peers` (by world rank) is at the executing call's step (group and
  /// sequence number) in another call: a frame of it waits unread, or it said it waits in that call. Runs
  /// before every sleep, so calls that only receive, or only send, on both sides fail at once instead of at
  /// the timeout.
  void check_same_step(const std::vector<peer>& peers) const {
    const frame_header mine = header_of(*current_, 0);
    const auto other = [&](const frame_header& h) { return h.group == mine.group && h.seq == mine.seq && !same_call(mine, h); };
    for (std::size_t r = 0; r < peers.size(); ++r) {
      const peer& p = peers[r];
      if (p.in.state() == read_state::holding && other(p.in.header())) throw_mismatch(static_cast<int>(r), mine, p.in.header());
      if (p.waiting && other(*p.waiting)) throw_mismatch(static_cast<int>(r), mine, *p.waiting, " waits in ");
    }
  }

  /// The ranks of `peers` the executing call waits for: "rank 1, rank 3".
  [[nodiscard]] std::string waiting_list(const std::vector<peer>& peers) const {
    std::string waiting;
    for (std::size_t r = 0; r < peers.size(); ++r)
      if (peers[r].awaited()) waiting += (waiting.empty() ? "" : ", ") + label(static_cast<int>(r));
    return waiting;
  }

  [[nodiscard]] mismatch_error p2p_mismatch(const posted_recv& r, const frame_header& got, int world_peer) const {
    return mismatch_error(label(rank_) + " called recv of " + std::to_string(r.want.count) + " " +
                              std::string(to_string(static_cast<dtype>(r.want.type))) + " with tag " +
                              std::to_string(r.tag) + ", " + label(world_peer) + " sent " + describe(got) +
                              "; a send and its recv must have the same count and dtype",
                          rank_);
  }

  [[nodiscard]] std::exception_ptr recv_expired(const posted_recv& x, int world_peer) const {
    return std::make_exception_ptr(timeout_error(
        "recv of " + std::to_string(x.want.count) + " " + std::string(to_string(static_cast<dtype>(x.want.type))) +
            " with tag " + std::to_string(x.tag) + " from " + label(world_peer) + " found no matching send within " +
            std::to_string(x.timeout.count()) + " ms; check that the peer sends with the same tag, or raise the timeout",
        rank_));
  }

  [[nodiscard]] error corrupt_stream(int world_peer, const char* why) const {
    return error(label(world_peer) + " sent " + why + (current_ != nullptr ? " during " + what_now() : std::string()) +
                     "; every rank must run the same ddp version, and nothing else may write to the mesh sockets",
                 rank_);
  }
  [[nodiscard]] error unreadable(int world_peer) const {
    return error(label(world_peer) + " sent the address of its data, but this rank cannot read that process's "
                                     "memory; every rank must run the same ddp version",
                 rank_);
  }
  [[nodiscard]] error abandoned_copy(int world_peer) const {
    return error(label(world_peer) + " aborted " + what_now() + " while this rank copied its data, and its abort "
                                     "notice did not arrive within 2 s; check that rank's log for the first error",
                 rank_);
  }
  [[nodiscard]] peer_lost cancelled() const {
    return peer_lost(what_now() + " was cancelled because its communicator was destroyed; wait() for every "
                                  "operation before the communicator goes out of scope",
                     rank_, rank_);
  }
  [[nodiscard]] std::exception_ptr destroyed() const {
    return std::make_exception_ptr(
        error("the communicator was destroyed before this operation ran; wait() for every operation before the "
              "communicator goes out of scope",
              rank_));
  }
  [[nodiscard]] timeout_error timed_out(const std::string& waiting) const {
    return call_timeout(what_now(), current_->grp->timeout, waiting.empty() ? std::string("nothing") : waiting, rank_);
  }

  /// The abort frame that tells the peers of `e`, with the error's kind so they raise the same type.
  [[nodiscard]] static abort_notice notice_of(const std::exception_ptr& e) {
    abort_notice n;
    n.header.op = op_abort;
    auto kind = abort_kind::other;
    try {
      std::rethrow_exception(e);
    } catch (const peer_lost& x) {
      kind = abort_kind::peer_lost;
      n.header.lost_rank = x.peer();
      n.text = x.what();
    } catch (const mismatch_error& x) {
      kind = abort_kind::mismatch;
      n.text = x.what();
    } catch (const timeout_error& x) {
      kind = abort_kind::timeout;
      n.text = x.what();
    } catch (const std::exception& x) {
      n.text = x.what();
    }
    n.text.resize(std::min<std::size_t>(n.text.size(), max_abort_text));
    n.header.flags = static_cast<std::uint8_t>(kind);
    n.header.length = n.text.size();
    return n;
  }

  /// Reads the abort frame `h` announced on `fd` and raises the error it carries.
  [[noreturn]] void raise_abort(int world_peer, const frame_header& h, int fd) const {
    std::string text(std::min<std::uint64_t>(h.length, max_abort_text), '\0');
    if (h.length > max_abort_text || recv_all(fd, text.data(), text.size(), clock::now() + std::chrono::seconds(2)) != io_status::ok)
      text = "(its message was lost)";
    raise_notice(static_cast<abort_kind>(h.flags), label(world_peer),
                 current_ != nullptr ? what_now() : std::string("while this rank ran no operation"), text, rank_,
                 h.lost_rank);
  }

  /// Looks behind the frame just received on `fd` for the peer's abort notice (2 s at most, skipping the
  /// frames it wrote before aborting) and raises it; returns if the stream ends or holds none.
  void raise_abort_behind(int world_peer, int fd) const {
    const auto limit = clock::now() + std::chrono::seconds(2);
    char sink[4096];
    frame_header h;
    while (recv_all(fd, &h, sizeof h, limit) == io_status::ok && malformed(h) == nullptr && h.op != op_bye) {
      if (h.op == op_abort) raise_abort(world_peer, h, fd);
      for (std::uint64_t left = h.length; left > 0;) {
        const auto k = static_cast<std::size_t>(std::min<std::uint64_t>(left, sizeof sink));
        if (recv_all(fd, sink, k, limit) != io_status::ok) return;
        left -= k;
      }
    }
  }

  int rank_;
  int size_;
  const call* current_ = nullptr;  ///< the call executing now, or nullptr
  frame_header finished_;          ///< the last collective this rank completed, named when a peer's frame of it arrives late
};

}  // namespace ddp::tcp::detail
