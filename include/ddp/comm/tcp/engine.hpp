#pragma once
/// \file The progress engine: ONE thread per job owns the mesh sockets, runs the queued calls in order and
/// sleeps in poll() when idle. Per peer (peer.hpp), sends queue in a frame_writer drained by the same loop;
/// a frame_reader routes point-to-point frames to the mailbox (peer_io.hpp, which also moves them through
/// the shared-memory rings on one host) and holds a collective frame until its call expects it. Errors abort the call, reach the peers in an abort frame and poison the engine.
/// Calls arrive through a call_queue; collectives of groups on one host run over shared memory, on the
/// caller's thread when the engine is idle, else on the engine thread between sleeps that serve the sockets
/// (shm_run.hpp).

#include <sys/eventfd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/call.hpp>
#include <ddp/comm/tcp/call_queue.hpp>
#include <ddp/comm/tcp/engine_errors.hpp>
#include <ddp/comm/tcp/frame_reader.hpp>
#include <ddp/comm/tcp/frame_writer.hpp>
#include <ddp/comm/tcp/matching.hpp>
#include <ddp/comm/tcp/peer.hpp>
#include <ddp/comm/tcp/peer_io.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/same_host.hpp>
#include <ddp/comm/tcp/scratch.hpp>
#include <ddp/comm/tcp/shm_run.hpp>
#include <ddp/comm/tcp/shm_world.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

class engine;
/// Runs one collective call's algorithm on the engine thread (ddp::tcp::detail::run_collective).
using executor = void (*)(engine&, call&);

class engine : peer_io {
 public:
  /// Starts the engine thread; `store` is rank 0's rendezvous server (served by the same poll loop).
  engine(int rank, int size, executor exec, std::optional<store_server> store)
      : peer_io(rank, size), exec_(exec), store_(std::move(store)) {
    wake_ = socket_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_.valid()) throw error("cannot create an eventfd for the progress engine: " + errno_text(errno), rank);
    thread_ = std::thread([this] { loop(); });
  }
  engine(const engine&) = delete;

  /// Fails the calls still queued, aborts the one in flight, says goodbye to the peers and joins the thread.
  ~engine() {
    queue_.stop();
    wake();
    thread_.join();
  }

  /// Hands the connected mesh sockets and what this rank may read of each peer's memory (both indexed by
  /// world rank; own entry empty) to the engine thread, with the job's shared-memory segment and point-to-point
  /// rings (null: none).
  void attach(std::vector<socket_fd> sockets, std::vector<peer_memory> memory, std::shared_ptr<shm_world> world,
              std::unique_ptr<shm_rings> rings) {
    std::unique_lock lock(queue_.mutex());
    pending_sockets_ = std::move(sockets);
    pending_memory_ = std::move(memory);
    pending_world_ = std::move(world);
    pending_rings_ = std::move(rings);
    has_pending_sockets_ = true;
    lock.unlock();
    wake();
  }

  /// Rank 0, once every rank has joined: the store it serves accepts no more connections (store_server::retire).
  void retire_store() {
    {
      std::lock_guard lock(queue_.mutex());
      retire_store_ = true;
    }
    wake();
  }

  /// The calls submitted, and who runs them.
  call_queue& queue() { return queue_; }
  /// Runs call `c`, claimed with queue().claim_locked(), on the caller's thread: a collective of a group of one
  /// at once (no thread hand-off, as a job of one rank steps), a shared-memory call unless the peers are not there
  /// within shm_handoff_after (then the engine thread takes it).
  /// A point-to-point call runs through its peer's ring, with the engine's io mutex taken while the engine
  /// thread sleeps in poll (peer_io.hpp); a recv not there within shm_handoff_after stays posted for the engine.
  void run_on_caller(call c) {
    std::optional<call> back;
    std::exception_ptr failure;
    bool wake_engine = false;
    try {
      if (c.grp->shm == nullptr) {  // a collective of a group of one (call_queue::claim_locked): local copies
        std::lock_guard io(io_);       // the engine thread reads the peers' state only while it holds io_
        exec_(*this, c);
        c.done->finish();
      } else if (c.side != p2p::none) {
        std::lock_guard io(io_);
        if (!point_to_point_on_caller(c, shm_handoff_after, yield_after_among(*c.grp->shm), wake_engine))
          back = std::move(c);
      } else if (run_shm_on_caller(c, note_.get())) {
        c.done->finish();
      } else {
        back = std::move(c);
      }
    } catch (...) {
      failure = std::current_exception();
      live_.end();  // first: peers copying from this process's buffers must discard what they copy from now on
      if (c.grp->shm) c.grp->shm->world().abort(notice_of(failure));  // the peers must hear of it even if this process exits
      c.done->fail(failure);
    }
    if (queue_.release(std::move(back), std::move(failure)) || wake_engine) wake();
  }
  /// Wakes the engine thread from poll.
  void wake() {
    const std::uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof one) < 0) return;  // EAGAIN: the counter is full, a wake-up is pending
  }

  [[nodiscard]] int rank() const { return rank_; }
  /// This process's live word (same_host.hpp), which peers on this host read after each copy from it.
  [[nodiscard]] const live_word& live() const { return live_; }
  /// What the engine waits for while stalled; completions carry it into wait()'s timeout message.
  [[nodiscard]] std::shared_ptr<const ddp::detail::stall_note> note() const { return note_; }

  // ---- what a collective's algorithm uses (through ddp::tcp::detail::channel), on the engine thread ----

  /// Posts a collective frame: its data itself, or, where the peer can read this process, a remote frame
  /// with the data's address (`data` must then stay unchanged until the peer's op_ack).
  void send_collective(int world_peer, frame_header h, const void* data) {
    auto& p = at(world_peer);
    if (h.length < remote_min_bytes || !p.memory.reads_us) return post(world_peer, h, data, nullptr);
    const remote_block where{reinterpret_cast<std::uintptr_t>(data), h.length};
    h.flags = frame_remote;
    h.length = sizeof(remote_block);
    p.out.push({h, nullptr, 0, nullptr, where});
    ++p.unacked;
    write_some(world_peer);
  }
  /// The executing call expects its next frame from `world_peer` to carry `h`, its payload landing at `dest`.
  void expect(int world_peer, const frame_header& h, void* dest) { at(world_peer).await(h, static_cast<char*>(dest)); }
  /// Runs the poll loop until every expected frame has arrived.
  void receive_expected() {
    pump([&] { return std::none_of(peers_.begin(), peers_.end(), [](const peer& p) { return p.expecting; }); });
  }
  /// Runs the poll loop until every queued frame is written and every remote frame acknowledged.
  void flush() {
    pump([&] { return std::none_of(peers_.begin(), peers_.end(), [](const peer& p) { return p.sending(); }); });
  }
  /// Between the sleeps of a hierarchical collective's shared-memory step: serves the sockets without blocking;
  /// throws to cancel the call.
  void serve_sockets() {
    idle_wait(0);
    if (queue_.stopping()) throw cancelled();  // to the peers, this rank is lost
  }
  /// The executing call's deadline.
  [[nodiscard]] clock::time_point deadline() const { return deadline_; }
  /// Scratch buffer `which` (0 or 1) of at least `bytes`: it only grows, uninitialized, and growing discards
  /// its contents, so steady state allocates and touches no new memory.
  char* scratch(int which, std::size_t bytes) { return scratch_[which].get(bytes); }

 private:
  // ---- the thread -------------------------------------------------------------------------

  void loop() {
    const std::lock_guard io(io_lock_);  // released only while idle_wait() sleeps in poll
    while (true) {
      std::unique_lock lock(queue_.mutex());
      if (retire_store_ && store_) store_->retire();
      retire_store_ = false;
      if (has_pending_sockets_) {
        for (std::size_t r = 0; r < pending_sockets_.size(); ++r) {
          peers_[r].fd = std::move(pending_sockets_[r]);
          peers_[r].memory = pending_memory_[r];
        }
        pending_sockets_.clear();
        pending_memory_.clear();
        has_pending_sockets_ = false;
        shm_world_ = std::move(pending_world_);
        use_rings(std::move(pending_rings_));
        if (shm_world_) {
          // From now until release() or death, peers see this rank alive. Taken outside the queue's lock and the
          // io mutex, which this thread also takes while holding it: one lock order.
          lock.unlock();
          io_lock_.unlock();
          shm_world_->hold();
          io_lock_.lock();
          continue;
        }
      }
      // A call on the caller's thread failed: tell the peers over the sockets too (also when stopping, or they
      // would see a clean close).
      if (const auto e = queue_.take_caller_failure_locked()) {
        lock.unlock();
        abort_peers(e);
        continue;
      }
      if (queue_.stopping_locked()) break;
      if (auto c = queue_.take_locked()) {
        lock.unlock();
        run(*c);
        queue_.finished();
        continue;
      }
      lock.unlock();
      try {
        idle_wait();
      } catch (...) {
        abort_peers(std::current_exception());
      }
    }
    shutdown();
  }

  /// Sleeps in poll until woken (at most `max_ms` unless negative), serving the store, reading
  /// point-to-point frames and draining sends.
  void idle_wait(int max_ms = -1) {
    serve_rings();
    const std::size_t peer_base = build_poll_set();
    auto first = clock::time_point::max();
    for (const auto& p : peers_) first = std::min(first, p.mail.next_deadline());
    int ms = first == clock::time_point::max() ? -1 : std::max(poll_ms(first), 1);
    if (max_ms >= 0) ms = ms < 0 ? max_ms : std::min(ms, max_ms);
    const int sleep_ms = before_sleep(ms);
    io_lock_.unlock();  // the caller's thread may run a send or recv meanwhile
    const int rc = ::poll(fds_.data(), fds_.size(), sleep_ms);
    io_lock_.lock();
    after_sleep();
    expire_recvs();
    if (rc <= 0) return;
    if (fds_[0].revents & POLLIN) drain_wake();
    if (store_) store_->on_events(fds_, store_base_);
    for (std::size_t r = 0; r < peers_.size(); ++r) {
      if (fds_[peer_base + r].revents == 0) continue;
      if (peers_[r].out.pending()) write_some(static_cast<int>(r));
      if (peers_[r].readable()) read_some(static_cast<int>(r));
    }
    serve_rings();  // an op_ring frame may have woken it
  }

  /// Fills fds_: the wake-up descriptor, the store's, then one entry per peer; returns the peers' base.
  std::size_t build_poll_set() {
    fds_.clear();
    fds_.push_back({wake_.get(), POLLIN, 0});
    if (store_) store_->fill(fds_, store_base_);
    const std::size_t base = fds_.size();
    for (const auto& p : peers_) {
      short ev = 0;
      if (!poisoned_ && p.out.pending()) ev |= POLLOUT;
      if (!poisoned_ && p.readable()) ev |= POLLIN;
      fds_.push_back({ev != 0 ? p.fd.get() : -1, ev, 0});
    }
    return base;
  }

  void drain_wake() {
    std::uint64_t n = 0;
    if (::read(wake_.get(), &n, sizeof n) < 0) return;  // EAGAIN: another wake-up drained it
  }

  void run(call& c) {
    if (poisoned_) return c.done->fail(poisoned_);
    current_ = &c;
    deadline_ = clock::now() + c.grp->timeout;
    try {
      if (c.over_shm()) {
        run_shm_on_engine(c, deadline_, note_.get(), [this] {
          idle_wait(0);
          if (queue_.stopping()) throw cancelled();  // to the peers, this rank is lost
        });
        c.done->finish();
      } else if (c.side != p2p::none) {
        point_to_point(c);
      } else {
        exec_(*this, c);
        finished_ = header_of(c, 0);
        c.done->finish();
      }
    } catch (...) {
      const auto e = std::current_exception();
      abort_peers(e);  // first, so the peers hear of it even if this process exits once wait() throws
      c.done->fail(e);
    }
    current_ = nullptr;
    if (noted_) note_->set({});
    noted_ = false;
  }

  /// Reads what the peer has sent, frame by frame; true if bytes moved.
  bool read_some(int world_peer) {
    auto& p = at(world_peer);
    const int fd = p.fd.get();
    const auto from_socket = [fd](char* buf, std::size_t n) { return ::recv(fd, buf, n, MSG_DONTWAIT); };
    bool moved = false;
    while (p.readable()) {
      if (p.in.state() == read_state::holding) accept_collective(world_peer);
      const read_event ev = p.in.advance(from_socket, moved);
      if (ev == read_event::blocked) break;
      if (ev == read_event::ended) on_end(world_peer);
      else if (ev == read_event::header) dispatch(world_peer);
      else finish_payload(world_peer);
    }
    return moved;
  }

  /// The stream ended: fatal if anything is expected from the peer, else remembered for later calls.
  void on_end(int world_peer) {
    auto& p = at(world_peer);
    if (p.in.state() == read_state::corrupt) throw corrupt_stream(world_peer, malformed(p.in.header()));
    if (p.ring) read_ring(world_peer);  // what it sent through its ring before it left
    if (p.expecting || p.in.mid_frame() || p.mail.waiting() || p.unacked > 0 || (p.ring && p.ring->busy()))
      throw lost(world_peer, p.in.error_code(), farewell(p.in));
  }

  /// A whole header arrived: route the frame.
  void dispatch(int world_peer) {
    auto& p = at(world_peer);
    const frame_header& h = p.in.header();
    p.sink.into = target::control;
    switch (h.op) {
      case op_abort: p.in.close(); raise_abort(world_peer, h, p.fd.get());
      case op_waiting:
        p.waiting = h;
        p.waiting->op = h.flags;
        p.waiting->flags = 0;
        return p.in.accept(nullptr);
      case op_ring: return p.in.accept(nullptr);  // the rings are served after the sockets
      case op_ack:
        if (p.unacked == 0) throw corrupt_stream(world_peer, "an acknowledgement of a copy this rank never offered");
        --p.unacked;
        return p.in.accept(nullptr);
      default: break;
    }
    if (h.op == static_cast<std::uint8_t>(collective::send_recv)) route_send(world_peer, p.sink, p.in);
    // else a collective frame: held for its call
  }

  /// The executing call expects the held collective frame: check it, then receive its payload.
  void accept_collective(int world_peer) {
    auto& p = at(world_peer);
    const frame_header& got = p.in.header();
    const bool remote = (got.flags & frame_remote) != 0;
    if (!same_call(p.expect, got) || (!remote && got.length != p.expect.length)) throw_mismatch(world_peer, p.expect, got);
    p.sink.into = target::collective;
    p.in.accept(remote ? reinterpret_cast<char*>(&p.remote) : p.expect_dest);
  }

  void finish_payload(int world_peer) {
    auto& p = at(world_peer);
    switch (p.sink.into) {
      case target::control: break;
      case target::collective:
        if ((p.in.header().flags & frame_remote) != 0) copy_remote(world_peer);
        p.expecting = false;
        break;
      case target::posted:
      case target::stray: return finish_send(world_peer, p.sink, p.in.header());
    }
    p.sink.into = target::control;
  }

  /// Copies a remote frame's data out of the peer's memory into the expected destination, then acknowledges it.
  void copy_remote(int world_peer) {
    auto& p = at(world_peer);
    if (!p.memory.readable) throw unreadable(world_peer);
    if (p.remote.bytes != p.expect.length) {
      frame_header got = p.in.header();
      got.length = p.remote.bytes;
      throw_mismatch(world_peer, p.expect, got);
    }
    int code = 0;
    const copy_result result = copy_from_peer(p.memory, p.remote, p.expect_dest, code);
    if (result != copy_result::copied) {
      raise_abort_behind(world_peer, p.fd.get());  // it aborted and released the buffer: its notice says why
      if (result == copy_result::failed) throw lost(world_peer, code, "copying from its memory failed (" + errno_text(code) + ")");
      throw abandoned_copy(world_peer);
    }
    frame_header ack;
    ack.op = op_ack;
    post(world_peer, ack, nullptr, nullptr);
  }

  /// Runs the poll loop until `done()`; throws on peer loss, mismatch, timeout or destruction.
  template <class Done>
  void pump(Done done) {
    bool stall_noticed = false;
    while (true) {
      bool moved = true;
      while (moved && !done()) {
        moved = false;
        for (std::size_t r = 0; r < peers_.size(); ++r) {
          if (peers_[r].out.pending()) moved = write_some(static_cast<int>(r)) || moved;
          if (peers_[r].readable()) moved = read_some(static_cast<int>(r)) || moved;
        }
      }
      for (std::size_t r = 0; r < peers_.size(); ++r)
        if ((peers_[r].expecting || peers_[r].unacked > 0) && peers_[r].in.ended())
          throw lost(static_cast<int>(r), 0, farewell(peers_[r].in));
      if (done()) return;
      check_same_step(peers_);
      build_poll_set();
      const int until_deadline = poll_ms(deadline_);
      const bool may_stall = !stall_noticed && until_deadline > static_cast<int>(stall_notice_after.count());
      const int rc = ::poll(fds_.data(), fds_.size(), may_stall ? static_cast<int>(stall_notice_after.count()) : until_deadline);
      if (rc < 0 && errno != EINTR) throw error("poll failed: " + errno_text(errno), rank_, errno);
      if (fds_[0].revents & POLLIN) {
        drain_wake();
        if (queue_.stopping()) throw cancelled();  // to the peers, this rank is lost
      }
      if (store_) store_->on_events(fds_, store_base_);
      expire_recvs();
      if (rc == 0 && may_stall) {
        stall_noticed = true;
        notice_stall();
      }
      if (rc == 0 && clock::now() >= deadline_) throw timed_out(waiting_list(peers_));
    }
  }

  /// After a stall: tells every peer of the group which call this rank waits in, and publishes whom it waits for.
  void notice_stall() {
    frame_header h = header_of(*current_, 0);
    h.flags = h.op;
    h.op = op_waiting;
    for (const int member : current_->grp->members)
      if (member != rank_ && at(member).fd.valid() && !at(member).in.ended()) post(member, h, nullptr, nullptr);
    note_->set(waiting_list(peers_));
    noted_ = true;
  }

  // ---- failure and shutdown ----------------------------------------------------------------

  /// Changes the live word, completes frames already half written (so the streams stay parseable), drops
  /// the rest, sends every peer an abort frame carrying the error, and poisons the engine.
  void abort_peers(std::exception_ptr e) {
    live_.end();  // before any buffer is released: copies still running see it and discard
    poisoned_ = e;
    const abort_notice notice = notice_of(e);
    if (shm_world_) shm_world_->abort(notice);
    queue_.fail();
    const auto limit = clock::now() + std::chrono::seconds(1);
    for (auto& p : peers_) p.abort(e, notice, limit);
  }

  /// On destruction: fail what is queued, say goodbye where the stream is at a frame boundary, close.
  void shutdown() {
    const auto gone = destroyed();
    for (auto& c : queue_.drain()) c.done->fail(gone);
    for (auto& p : peers_) {
      if (p.ring) p.ring->fail(gone);
      p.close(gone, !poisoned_);
    }
    if (shm_world_) shm_world_->release();
  }

  executor exec_;
  std::optional<store_server> store_;
  std::size_t store_base_ = 0;
  socket_fd wake_;
  std::vector<pollfd> fds_;
  clock::time_point deadline_{};
  live_word live_;
  std::shared_ptr<ddp::detail::stall_note> note_ = std::make_shared<ddp::detail::stall_note>();
  bool noted_ = false;
  scratch_buffer scratch_[2];
  std::shared_ptr<shm_world> shm_world_;  ///< the job's segment (engine thread), null without shared memory

  /// Guards the peers, the rings and the mailboxes: held by the engine thread except while it sleeps in
  /// idle_wait()'s poll, and by the caller's thread running a send or recv (after claiming the queue).
  std::mutex io_;
  std::unique_lock<std::mutex> io_lock_{io_, std::defer_lock};  ///< the engine thread's hold on io_
  call_queue queue_;  ///< its mutex guards the attachment below too
  std::vector<socket_fd> pending_sockets_;
  std::vector<peer_memory> pending_memory_;
  std::shared_ptr<shm_world> pending_world_;
  std::unique_ptr<shm_rings> pending_rings_;
  bool has_pending_sockets_ = false;
  bool retire_store_ = false;  ///< the store is to stop accepting (retire_store)
  std::thread thread_;
};

}  // namespace ddp::tcp::detail
