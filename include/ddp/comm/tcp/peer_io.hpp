#pragma once
/// \file The engine's peers and the transfers outside a collective's algorithm: frames posted on the
/// sockets, and point-to-point sends and recvs, over the sockets or, on one host with shared memory, the
/// rings (shm_rings.hpp), on the engine thread or, where the engine is idle, on the caller's. A send's frame, from either, goes to the recv it matches (mailbox, matching.hpp) or
/// aside until its recv comes, so both carry the same errors: a count or dtype mismatch, a recv's timeout,
/// peer_lost when the peer's socket ends. The engine (engine.hpp) derives from this; whoever holds its io mutex calls it.

#include <emmintrin.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <vector>

#include <ddp/comm/tcp/call.hpp>
#include <ddp/comm/tcp/engine_errors.hpp>
#include <ddp/comm/tcp/frame_reader.hpp>
#include <ddp/comm/tcp/matching.hpp>
#include <ddp/comm/tcp/peer.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/shm_rings.hpp>
#include <ddp/comm/tcp/shm_world.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/work.hpp>

namespace ddp::tcp::detail {

class peer_io : protected engine_errors {
 protected:
  peer_io(int rank, int size) : engine_errors(rank, size), peers_(static_cast<std::size_t>(size)) {}

  peer& at(int world_rank) { return peers_[static_cast<std::size_t>(world_rank)]; }

  /// Point-to-point goes through `rings` from now on (mapped at the rendezvous; null: the sockets).
  void use_rings(std::unique_ptr<shm_rings> rings) {
    rings_ = std::move(rings);
    for (int r = 0; rings_ && r < size_; ++r)
      if (r != rank_) at(r).ring = ring_link{rings_->ring(r, rank_), rings_->ring(rank_, r), {}, {}, {}};
  }

  /// send: queue the frame (or deliver it locally); recv: take a stray frame or post the receive.
  void point_to_point(call& c) {
    const int world_peer = c.grp->members[static_cast<std::size_t>(c.root)];
    const frame_header h = header_of(c, c.count * size_of(c.type));
    peer& p = at(world_peer);
    if (c.side == p2p::send && world_peer != rank_) {
      c.grp->stats.add_bytes(c.kind, h.length);
      if (!p.ring) return post(world_peer, h, c.in, c.done);
      if (p.in.ended()) throw lost(world_peer, 0, farewell(p.in));
      rings_->before_sending(world_peer);
      p.ring->queue.push_back({h, static_cast<const char*>(c.in), 0, c.done});
      write_ring(world_peer);
      return;
    }
    if (c.side == p2p::send) {  // to itself
      const auto* in = static_cast<const char*>(c.in);
      if (auto r = p.mail.take_recv(h)) deliver(*r, h, in, rank_);
      else p.mail.keep({h, std::vector<char>(in, in + h.length)});
      return c.done->finish();
    }
    posted_recv want{h.group, c.tag, h, static_cast<char*>(c.out), c.done, clock::now() + c.grp->timeout, c.grp->timeout};
    if (auto s = p.mail.take_stray(h.group, c.tag)) return deliver(want, s->hdr, s->data.data(), world_peer);
    if (p.in.ended()) throw lost(world_peer, 0, farewell(p.in));
    p.mail.post(std::move(want));
  }

  /// On the caller's thread, with the engine's io mutex held and the queue claimed (engine.hpp): runs point-to-point
  /// call `c` through its peer's ring (false, untouched, where the peer has none: the engine thread runs it).
  /// Until the call completes it moves bytes through the ring itself, with its bell down (no peer rings this rank
  /// meanwhile), giving up after `patience` without a byte moving: the engine thread then goes on with it. It
  /// spins for `yield_after`, then yields the core between looks (on a loaded host the peer may need this core to
  /// send: measured on the 2-core VM, 4 KiB ping-pong took 125 us one way with a 100 us spin, 8 us yielding).
  /// `wake` says the engine thread must be woken: to heed a recv's deadline, or to finish a socket write.
  bool point_to_point_on_caller(call& c, std::chrono::nanoseconds patience, std::chrono::nanoseconds yield_after,
                                bool& wake) {
    const int world_peer = c.grp->members[static_cast<std::size_t>(c.root)];
    if (world_peer != rank_ && !at(world_peer).ring) return false;
    point_to_point(c);
    if (world_peer != rank_ && !c.done->test()) {
      auto& bell = rings_->bell(rank_).asleep;
      bell.store(0, std::memory_order_seq_cst);  // the engine sleeps in poll: this thread serves the ring for it
      const auto start = clock::now();
      auto until = start + patience;
      for (int i = 0; !c.done->test(); ++i) {
        if (c.side == p2p::send ? write_ring(world_peer) : read_ring(world_peer)) until = clock::now() + patience;
        if ((i & 15) != 15) {
          _mm_pause();
          continue;
        }
        const auto now = clock::now();
        if (now >= until) break;
        if (now - start >= yield_after) sched_yield();
      }
      // The bell stays down while the engine has nothing to read or write in a ring: the next call on this thread
      // reads what comes, and no peer wakes the sleeping engine for it. Else raise it, then look once more.
      if (ring_work()) {
        bell.store(1, std::memory_order_seq_cst);
        serve_rings();
      }
    }
    wake = !c.done->test() || std::any_of(peers_.begin(), peers_.end(), [](const peer& p) { return p.out.pending(); });
    return true;
  }

  /// True while a recv is posted or a frame is half read or half written in a ring: the engine must hear of
  /// ring traffic.
  [[nodiscard]] bool ring_work() const {
    return std::any_of(peers_.begin(), peers_.end(),
                       [](const peer& p) { return p.mail.waiting() || (p.ring && p.ring->busy()); });
  }

  /// Raises mismatch_error, on the recv `r` (taken from its mailbox, so no abort reaches it) and in the
  /// engine, unless the send `got` from `world_peer` fits it.
  void check_fits(const posted_recv& r, const frame_header& got, int world_peer) const {
    if (fits(r, got)) return;
    const auto e = p2p_mismatch(r, got, world_peer);
    r.done->fail(std::make_exception_ptr(e));
    throw e;
  }

  /// Completes the recv `r` with the send `got` whose payload is `data`.
  void deliver(const posted_recv& r, const frame_header& got, const char* data, int world_peer) {
    check_fits(r, got, world_peer);
    if (got.length > 0) std::memcpy(r.dest, data, got.length);
    r.done->finish();
  }

  /// A send's header arrived on `in` (`world_peer`'s socket or ring): its payload goes straight into the recv
  /// it matches, else into a buffer of `s` until its recv comes.
  void route_send(int world_peer, payload_sink& s, frame_reader& in) {
    const frame_header& h = in.header();
    if (auto r = at(world_peer).mail.take_recv(h)) {
      check_fits(*r, h, world_peer);
      s.matched = std::move(r);
      s.into = target::posted;
      return in.accept(s.matched->dest);
    }
    s.stray_buf.resize(h.length);
    s.into = target::stray;
    in.accept(s.stray_buf.data());
  }

  /// The payload of send `h`, routed into `s` by route_send, has arrived.
  void finish_send(int world_peer, payload_sink& s, const frame_header& h) {
    auto& p = at(world_peer);
    if (s.into == target::posted) {
      s.matched->done->finish();
      s.matched.reset();
    } else {  // its recv may have been posted while the payload was arriving
      if (auto r = p.mail.take_recv(h)) deliver(*r, h, s.stray_buf.data(), world_peer);
      else p.mail.keep({h, std::move(s.stray_buf)});
      s.stray_buf = {};
    }
    s.into = target::control;
  }

  /// Fails the recvs no send matched within the timeout.
  void expire_recvs() {
    const auto now = clock::now();
    for (std::size_t r = 0; r < peers_.size(); ++r)
      peers_[r].mail.expire(now, [&](const posted_recv& x) { return recv_expired(x, static_cast<int>(r)); });
  }

  void post(int world_peer, const frame_header& h, const void* data, std::shared_ptr<ddp::detail::completion> done) {
    at(world_peer).out.push({h, static_cast<const char*>(data), 0, std::move(done)});
    write_some(world_peer);  // most small frames leave at once, before any poll
  }

  /// Writes what the peer's socket accepts; true if bytes moved.
  bool write_some(int world_peer) {
    auto& p = at(world_peer);
    int failure = 0;
    const bool moved = p.out.write_some(p.fd.get(), failure);
    if (failure == 0) return moved;
    if (current_ != nullptr && current_->side == p2p::none) check_same_step(peers_);  // a frame shows a mismatch: say so
    throw lost(world_peer, failure, "sending to it failed (" + errno_text(failure) + ")");
  }

  // ---- the rings ----

  /// Moves point-to-point frames through every ring, both ways; true if bytes moved.
  bool serve_rings() {
    bool moved = false;
    for (int r = 0; rings_ && !poisoned_ && r < size_; ++r) {
      if (!at(r).ring) continue;
      moved = write_ring(r) || moved;
      moved = read_ring(r) || moved;
    }
    return moved;
  }

  /// Before the engine sleeps `ms` in poll: raises this rank's bell, so writers ring it, and looks at the rings
  /// once more. Returns how long to sleep (0: bytes moved). It does not spin first: measured on the loaded
  /// 2-core VM (bench/comm ddp_bench_p2p), a 50 us spin took the core the peer's threads needed (4 KiB
  /// ping-pong: 105 us one way against 34 us without).
  int before_sleep(int ms) {
    if (!rings_ || poisoned_ || ms == 0) return ms;
    rings_->bell(rank_).asleep.store(1, std::memory_order_seq_cst);
    return serve_rings() ? 0 : ms;
  }
  /// After the sleep: writers need not ring this rank.
  void after_sleep() {
    if (rings_) rings_->bell(rank_).asleep.store(0, std::memory_order_seq_cst);
  }

  /// Writes what fits of the sends queued for `world_peer`'s ring, and rings it if it sleeps; true if bytes moved.
  bool write_ring(int world_peer) {
    auto& l = *at(world_peer).ring;
    bool moved = false;
    while (!l.queue.empty()) {
      tx_item& t = l.queue.front();
      const bool header = t.sent < sizeof t.hdr;
      const char* from = header ? reinterpret_cast<const char*>(&t.hdr) + t.sent : t.data + (t.sent - sizeof t.hdr);
      const std::size_t left = header ? sizeof t.hdr - t.sent : t.total() - t.sent;
      const std::size_t k = l.out.write(from, left);
      t.sent += k;
      moved = moved || k > 0;
      if (t.sent == t.total()) {
        if (t.done) t.done->finish();
        l.queue.pop_front();
      } else if (k < left && !l.out.want_room()) {
        break;  // full: the reader rings this rank when it makes room
      }
    }
    auto& bell = rings_->bell(world_peer).asleep;
    if (moved && bell.load(std::memory_order_seq_cst) != 0 && bell.exchange(0) != 0) ring(world_peer);
    return moved;
  }

  /// Reads the frames in `world_peer`'s ring into their recvs (or aside), and rings it if it waits for room;
  /// true if bytes moved.
  bool read_ring(int world_peer) {
    auto& l = *at(world_peer).ring;
    bool moved = false;
    const auto from_ring = [&l](char* buf, std::size_t n) { return l.in.read(buf, n); };
    while (true) {
      const read_event ev = l.reader.advance(from_ring, moved);
      if (ev == read_event::blocked) break;
      const frame_header& h = l.reader.header();
      if (ev == read_event::ended || h.op != static_cast<std::uint8_t>(collective::send_recv)) {
        const char* why = malformed(h);
        throw corrupt_stream(world_peer, why != nullptr ? why : "a frame other than a send through its ring");
      }
      if (ev == read_event::header) route_send(world_peer, l.sink, l.reader);
      else finish_send(world_peer, l.sink, h);
    }
    if (moved && l.in.room_wanted()) ring(world_peer);
    return moved;
  }

  /// Wakes `world_peer`'s engine from poll: data or room waits in a ring (unless its stream ended: it left).
  void ring(int world_peer) {
    if (at(world_peer).in.ended()) return;
    frame_header h;
    h.op = op_ring;
    post(world_peer, h, nullptr, nullptr);
  }

  std::vector<peer> peers_;
  std::exception_ptr poisoned_;        ///< what aborted the engine, or null
  std::unique_ptr<shm_rings> rings_;  ///< point-to-point through shared memory, or null
};

}  // namespace ddp::tcp::detail
