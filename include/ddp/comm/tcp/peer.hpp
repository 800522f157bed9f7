#pragma once
/// \file What the TCP engine keeps per peer: the two halves of its stream, its mailbox of point-to-point
/// transfers, what the executing call expects from it, the same-host copies in flight either way, and, on
/// one host with shared memory, its point-to-point rings (shm_rings.hpp).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ddp/comm/tcp/frame_reader.hpp>
#include <ddp/comm/tcp/frame_writer.hpp>
#include <ddp/comm/tcp/matching.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/same_host.hpp>
#include <ddp/comm/tcp/shm_rings.hpp>
#include <ddp/comm/tcp/socket.hpp>

namespace ddp::tcp::detail {

/// Where the payload being read from a peer goes.
enum class target : std::uint8_t {
  control,     ///< nowhere: a control frame (no payload)
  collective,  ///< the executing call's expected destination, or `remote` for a remote frame
  posted,      ///< the recv its send matched
  stray,       ///< a buffer of its own, until the recv is posted
};

/// Where the payload being read from one of a peer's streams goes.
struct payload_sink {
  target into = target::control;
  std::optional<posted_recv> matched;  ///< the recv of the send being read (target::posted)
  std::vector<char> stray_buf;         ///< the send being read ahead of its recv (target::stray)

  /// On abort: fails the recv being filled.
  void fail(const std::exception_ptr& e) {
    if (matched) matched->done->fail(e);
    matched.reset();
  }
};

/// A peer's point-to-point transfers through the shared-memory rings: sends queue here and go into `out`
/// as it has room; frames read out of `in` go to their recvs as from a socket.
struct ring_link {
  shm_ring in;   ///< from the peer
  shm_ring out;  ///< to the peer
  frame_reader reader;
  payload_sink sink;
  std::deque<tx_item> queue;  ///< sends not yet wholly in `out` (the first perhaps in part)

  /// A frame is half read or half written: the peer's end now loses data.
  [[nodiscard]] bool busy() const { return !queue.empty() || reader.mid_frame(); }
  /// On abort: fails the queued sends and the recv being filled.
  void fail(const std::exception_ptr& e) {
    for (auto& t : queue)
      if (t.done) t.done->fail(e);
    queue.clear();
    sink.fail(e);
  }
};

struct peer {
  socket_fd fd;
  frame_writer out;
  frame_reader in;
  peer_memory memory;
  mailbox mail;
  payload_sink sink;               ///< where the payload being read from the socket goes
  std::optional<ring_link> ring;   ///< point-to-point through shared memory (same host, DDP_SHM), else none
  bool expecting = false;  ///< the executing call waits for a frame from this peer: `expect`, into expect_dest
  frame_header expect;
  char* expect_dest = nullptr;
  remote_block remote{};                ///< the remote frame being received
  std::uint64_t unacked = 0;            ///< remote frames sent to it and not yet copied
  std::optional<frame_header> waiting;  ///< the call it last said it waits in (op_waiting)

  /// Its stream may be read now: a collective frame's header waits there until its call expects it.
  [[nodiscard]] bool readable() const {
    return fd.valid() && !in.ended() && (in.state() != read_state::holding || expecting);
  }
  /// Frames to it are still queued, or copies of remote frames it has not acknowledged.
  [[nodiscard]] bool sending() const { return out.pending() || unacked > 0; }
  /// The executing call cannot end before this peer does something.
  [[nodiscard]] bool awaited() const { return expecting || sending(); }
  /// The executing call expects the next collective frame from this peer to carry `h`, its payload for `dest`.
  void await(const frame_header& h, char* dest) {
    expecting = true;
    expect = h;
    expect_dest = dest;
  }

  /// On abort: forgets what the call expects and the copies it offered; fails every recv with `e`.
  void fail(const std::exception_ptr& e) {
    expecting = false;
    unacked = 0;
    mail.fail_all(e);
    sink.fail(e);
    if (ring) ring->fail(e);
  }

  /// On abort: fail(e), then, where the stream is open, completes the frame half written and sends `notice`
  /// behind it (until `limit`), so the peer can parse it.
  void abort(const std::exception_ptr& e, const abort_notice& notice, clock::time_point limit) {
    fail(e);
    if (!fd.valid()) return;
    const bool open = !in.ended();
    if (!out.abandon(fd.get(), e, open ? limit : clock::now()) || !open) return;
    if (send_all(fd.get(), &notice.header, sizeof notice.header, limit) == io_status::ok)
      send_all(fd.get(), notice.text.data(), notice.text.size(), limit);
  }

  /// On destruction: fails the queued frames with `gone`, says goodbye where asked and the stream is at a
  /// frame boundary, drains what the peer sent and closes.
  void close(const std::exception_ptr& gone, bool say_bye) {
    if (!fd.valid()) return;
    const auto limit = clock::now() + std::chrono::milliseconds(100);
    if (out.abandon(fd.get(), gone, limit) && say_bye) {
      frame_header bye;
      bye.op = op_bye;
      send_all(fd.get(), &bye, sizeof bye, limit);
    }
    char sink[4096];
    while (::recv(fd.get(), sink, sizeof sink, MSG_DONTWAIT) > 0) {
    }
    fd.reset();
  }
};

}  // namespace ddp::tcp::detail
