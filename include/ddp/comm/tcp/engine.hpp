#pragma once
/// \file The progress engine: ONE background thread per job that owns the mesh sockets (non-blocking),
/// runs the queued calls in call order, and sleeps in poll() when idle. Sends are queued per peer and
/// drained by the same poll loop, so a call never blocks on its own sends; receives check every frame's
/// header against the call. Errors abort the call, notify the peers with an abort frame, and poison the
/// engine so later calls fail at once with the same error. Between ranks on one host, large collective
/// frames carry only the address of their data, which the receiver copies straight out of the sender's
/// memory (process_vm_readv: one copy instead of the socket's two) and acknowledges.

#include <sys/eventfd.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/frame.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// A set of ranks sharing the mesh: the world, or a subgroup made by split().
struct group {
  std::vector<int> members;  ///< world rank of each group rank
  int me = 0;                ///< this process's group rank
  std::uint32_t id = 0;      ///< identifier carried in every frame
  std::chrono::milliseconds timeout{};
  std::uint64_t next_seq = 0;             ///< guarded by the engine's queue mutex
  std::uint64_t splits = 0;               ///< splits made from this group, for the children's ids
  ddp::detail::stats_counter stats;

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
  int root = -1;               ///< root, or peer for send/recv
  std::int32_t tag = 0;        ///< send/recv tag
  std::uint64_t count = 0;     ///< the count frames carry
  const void* in = nullptr;
  void* out = nullptr;
  std::size_t in_count = 0;
  std::size_t out_count = 0;
  std::shared_ptr<group> grp;
  std::uint64_t seq = 0;
  std::shared_ptr<ddp::detail::completion> done;
};

/// The header every frame of `c` carries, with payload `length`.
inline frame_header header_of(const call& c, std::uint64_t length) {
  frame_header h;
  h.op = static_cast<std::uint8_t>(c.kind);
  h.type = static_cast<std::uint8_t>(c.type);
  h.reduce = has_reduce(h.op) ? static_cast<std::uint8_t>(c.op) : 0;
  h.root = has_root(h.op) ? c.root : (c.kind == collective::send_recv ? c.tag : -1);
  h.group = c.grp->id;
  h.seq = c.seq;
  h.count = c.count;
  h.length = length;
  return h;
}

/// One receive the current call waits for.
struct recv_part {
  int peer = 0;        ///< group rank
  void* dest = nullptr;
  std::size_t bytes = 0;
};

/// Collective frames of at least this many payload bytes travel as remote frames where the peer can read
/// this process; below it, the acknowledgement's round trip costs more than the socket's second copy.
inline constexpr std::size_t remote_min_bytes = 512 << 10;

/// What a rank knows about reaching one peer's memory directly (both on one host, same user).
struct peer_memory {
  ::pid_t pid = 0;         ///< the peer's process id, as this rank sees it
  bool readable = false;   ///< this rank can copy from the peer's memory
  bool reads_us = false;   ///< the peer can copy from this rank's memory: send it remote frames
  std::uint64_t live_address = 0;  ///< where the peer keeps its live word
  std::uint64_t live_value = 0;    ///< the live word's value while the peer has not aborted
};

/// After a call has waited this long without a byte moving, the engine tells the group what it waits in
/// (op_waiting) and publishes whom it waits for; a peer at the same step in another call then raises
/// mismatch_error at once.
inline constexpr std::chrono::milliseconds stall_notice_after{250};

class channel;
/// Runs one call's algorithm on the engine thread (ddp::tcp::detail::execute in algorithms.hpp).
using executor = void (*)(channel&);

class engine {
 public:
  /// Starts the engine thread; `store` is rank 0's rendezvous server (served by the same poll loop).
  engine(int rank, int size, executor exec, std::optional<store_server> store)
      : rank_(rank), size_(size), exec_(exec), store_(std::move(store)) {
    std::random_device random;
    live_.store(((std::uint64_t{random()} << 32) ^ random()) | 1U);
    wake_ = socket_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_.valid()) throw error("cannot create an eventfd for the progress engine: " + errno_text(errno), rank);
    peers_.resize(static_cast<std::size_t>(size));
    thread_ = std::thread([this] { loop(); });
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  /// Fails the calls still queued, aborts the one in flight, says goodbye to the peers and joins the thread.
  ~engine() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake();
    thread_.join();
  }

  /// Hands the connected mesh sockets and what this rank may read of each peer's memory (both indexed by
  /// world rank; own slot empty) to the engine thread.
  void attach(std::vector<socket_fd> sockets, std::vector<peer_memory> memory) {
    std::unique_lock lock(mutex_);
    pending_sockets_ = std::move(sockets);
    pending_memory_ = std::move(memory);
    has_pending_sockets_ = true;
    lock.unlock();
    wake();
  }

  /// Queues `c` behind the calls already submitted; the mutex also orders sequence numbers.
  void submit(call c) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(c));
    }
    wake();
  }

  /// The mutex that orders submissions; callers take it to assign sequence numbers atomically with submit.
  std::mutex& queue_mutex() { return mutex_; }
  /// Queues `c` while the caller already holds queue_mutex().
  void submit_locked(call c) { queue_.push_back(std::move(c)); }
  /// Wakes the engine thread from poll.
  void wake() {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto n = ::write(wake_.get(), &one, sizeof one);
  }

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return size_; }
  /// The word peers on this host read after each copy from this process: it changes once when the engine
  /// aborts, before any buffer is released, so a copy that overlapped the release is recognised and discarded.
  [[nodiscard]] const std::atomic<std::uint64_t>& live_word() const { return live_; }
  /// What the engine waits for while stalled; completions carry it into wait()'s timeout message.
  [[nodiscard]] std::shared_ptr<const ddp::detail::stall_note> note() const { return note_; }

 private:
  friend class channel;

  struct tx_item {
    frame_header hdr;
    const char* data = nullptr;
    std::size_t sent = 0;  ///< bytes of header + payload already written
    std::shared_ptr<ddp::detail::completion> done;  ///< finished when written (point-to-point sends)
    remote_block where{};  ///< a remote frame's payload
    [[nodiscard]] std::size_t total() const { return sizeof(frame_header) + hdr.length; }
    [[nodiscard]] const char* payload() const {
      return (hdr.flags & frame_remote) != 0 ? reinterpret_cast<const char*>(&where) : data;
    }
  };
  /// A recv waiting for its send.
  struct posted_recv {
    std::uint32_t group = 0;
    std::int32_t tag = 0;
    frame_header want;
    char* dest = nullptr;
    std::shared_ptr<ddp::detail::completion> done;
    clock::time_point deadline{};  ///< past it the recv fails and forgets its buffer
    std::chrono::milliseconds timeout{};
  };
  /// A point-to-point frame that arrived before its recv.
  struct stray_frame {
    frame_header hdr;
    std::vector<char> data;
  };
  enum class target : std::uint8_t { collective, posted, stray };
  struct peer {
    socket_fd fd;
    std::vector<tx_item> tx;
    std::size_t tx_head = 0;
    // the reader: always reads point-to-point frames; a collective frame waits ("parked") for its call
    frame_header got;
    std::size_t header_got = 0;
    bool parked = false;
    bool in_payload = false;
    target into = target::collective;
    char* dest = nullptr;
    std::size_t payload_got = 0;
    posted_recv matched;
    std::vector<char> stray_buf;
    // what the executing call expects next from this peer
    bool expecting = false;
    frame_header expect;
    char* expect_dest = nullptr;
    peer_memory memory;
    remote_block remote{};         ///< the remote frame being received
    frame_header waiting;          ///< the call it said it waits in (op_waiting), if heard_waiting
    bool heard_waiting = false;
    std::uint64_t unacked = 0;     ///< remote frames sent to it and not yet copied
    bool closed = false;    ///< end of stream seen, or a goodbye
    bool said_bye = false;  ///< it closed its communicator in an orderly way
    std::deque<posted_recv> recvs;
    std::deque<stray_frame> strays;
    [[nodiscard]] bool tx_pending() const { return tx_head < tx.size(); }
    [[nodiscard]] bool readable() const { return fd.valid() && !closed && (!parked || expecting); }
  };

  // ---- the thread -------------------------------------------------------------------------

  void loop() {
    while (true) {
      std::unique_lock lock(mutex_);
      if (has_pending_sockets_) {
        for (std::size_t r = 0; r < pending_sockets_.size(); ++r) {
          peers_[r].fd = std::move(pending_sockets_[r]);
          peers_[r].memory = pending_memory_[r];
        }
        pending_sockets_.clear();
        pending_memory_.clear();
        has_pending_sockets_ = false;
      }
      if (stop_) break;
      if (!queue_.empty()) {
        call c = std::move(queue_.front());
        queue_.pop_front();
        lock.unlock();
        run(c);
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

  /// Sleeps in poll until woken, serving the store, reading point-to-point frames and draining sends.
  void idle_wait() {
    const std::size_t peer_base = build_poll_set();
    const int rc = ::poll(fds_.data(), fds_.size(), next_recv_deadline());
    expire_recvs();
    if (rc <= 0) return;
    if (fds_[0].revents & POLLIN) drain_wake();
    if (store_) store_->on_events(fds_, store_base_);
    for (std::size_t r = 0; r < peers_.size(); ++r) {
      if (fds_[peer_base + r].revents == 0) continue;
      if (peers_[r].tx_pending()) write_some(static_cast<int>(r));
      if (peers_[r].readable()) read_some(static_cast<int>(r));
    }
  }

  /// Fills fds_: the wake-up descriptor, the store's, then one entry per peer; returns the peers' base.
  std::size_t build_poll_set() {
    fds_.clear();
    fds_.push_back({wake_.get(), POLLIN, 0});
    if (store_) store_->fill(fds_, store_base_);
    const std::size_t base = fds_.size();
    for (const auto& p : peers_) {
      short ev = 0;
      if (!poisoned_ && p.tx_pending()) ev |= POLLOUT;
      if (!poisoned_ && p.readable()) ev |= POLLIN;
      fds_.push_back({ev != 0 ? p.fd.get() : -1, ev, 0});
    }
    return base;
  }

  void drain_wake() {
    std::uint64_t n = 0;
    [[maybe_unused]] const auto k = ::read(wake_.get(), &n, sizeof n);
  }

  void run(call& c) {
    if (poisoned_) {
      c.done->fail(poisoned_);
      return;
    }
    current_ = &c;
    deadline_ = clock::now() + c.grp->timeout;
    try {
      if (c.kind == collective::send_recv) {
        point_to_point(c);
      } else {
        channel_run(c);
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

  void channel_run(call& c);

  /// send: queue the frame (or deliver it locally); recv: take a stray frame or post the receive.
  void point_to_point(call& c) {
    const int world_peer = c.grp->members[static_cast<std::size_t>(c.root)];
    const frame_header h = header_of(c, c.count * size_of(c.type));
    if (c.side == p2p::send && world_peer != rank_) {
      c.grp->stats.add_bytes(c.kind, h.length);
      return post(world_peer, h, c.in, c.done);
    }
    if (c.side == p2p::send) {  // to itself
      peer& self = peers_[static_cast<std::size_t>(rank_)];
      if (const auto r = find_recv(self, h); r != self.recvs.end()) {
        check_p2p(*r, h, rank_);
        std::memcpy(r->dest, c.in, h.length);
        r->done->finish();
        self.recvs.erase(r);
      } else {
        self.strays.push_back({h, std::vector<char>(static_cast<const char*>(c.in), static_cast<const char*>(c.in) + h.length)});
      }
      return c.done->finish();
    }
    peer& p = peers_[static_cast<std::size_t>(world_peer)];
    posted_recv want{h.group, c.tag, h, static_cast<char*>(c.out), c.done, clock::now() + c.grp->timeout,
                     c.grp->timeout};
    for (auto it = p.strays.begin(); it != p.strays.end(); ++it)
      if (it->hdr.group == h.group && it->hdr.root == c.tag) {
        check_p2p(want, it->hdr, world_peer);
        std::memcpy(want.dest, it->data.data(), h.length);
        p.strays.erase(it);
        return c.done->finish();
      }
    if (p.closed) throw lost(world_peer, 0, p.said_bye ? "it closed its communicator" : "its connection is closed");
    p.recvs.push_back(std::move(want));
  }

  /// poll()'s timeout while idle: until the earliest posted recv expires, or forever.
  int next_recv_deadline() const {
    auto first = clock::time_point::max();
    for (const auto& p : peers_)
      for (const auto& r : p.recvs) first = std::min(first, r.deadline);
    return first == clock::time_point::max() ? -1 : std::max(poll_ms(first), 1);
  }

  /// Fails the recvs no send matched within the timeout; a late frame then becomes a stray, so the
  /// caller's buffer is never written after its wait() gave up.
  void expire_recvs() {
    const auto now = clock::now();
    for (std::size_t r = 0; r < peers_.size(); ++r)
      std::erase_if(peers_[r].recvs, [&](const posted_recv& x) {
        if (x.deadline > now) return false;
        x.done->fail(std::make_exception_ptr(timeout_error(
            "recv of " + std::to_string(x.want.count) + " " + std::string(to_string(static_cast<dtype>(x.want.type))) +
                " with tag " + std::to_string(x.tag) + " from " + label(static_cast<int>(r)) + " found no matching send within " +
                std::to_string(x.timeout.count()) + " ms; check that the peer sends with the same tag, or raise the timeout",
            rank_)));
        return true;
      });
  }

  /// The oldest recv posted for this frame's group and tag, or end().
  static std::deque<posted_recv>::iterator find_recv(peer& p, const frame_header& h) {
    return std::find_if(p.recvs.begin(), p.recvs.end(),
                        [&](const posted_recv& r) { return r.group == h.group && r.tag == h.root; });
  }

  void check_p2p(const posted_recv& r, const frame_header& got, int world_peer) const {
    if (got.type != r.want.type || got.count != r.want.count)
      throw mismatch_error(label(rank_) + " called recv of " + std::to_string(r.want.count) + " " +
                               std::string(to_string(static_cast<dtype>(r.want.type))) + " with tag " +
                               std::to_string(r.tag) + ", " + label(world_peer) + " sent " + describe(got) +
                               "; a send and its recv must have the same count and dtype",
                           rank_);
  }

  // ---- transfers ---------------------------------------------------------------------------

  void post(int world_peer, const frame_header& h, const void* data, std::shared_ptr<ddp::detail::completion> done) {
    auto& p = peers_[static_cast<std::size_t>(world_peer)];
    p.tx.push_back({h, static_cast<const char*>(data), 0, std::move(done)});
    write_some(world_peer);  // most small frames leave at once, before any poll
  }

  /// Posts a collective frame: its data itself, or, where the peer can read this process, a remote frame
  /// with the data's address (`data` must then stay unchanged until the peer's op_ack).
  void post_collective(int world_peer, frame_header h, const void* data) {
    auto& p = peers_[static_cast<std::size_t>(world_peer)];
    if (h.length < remote_min_bytes || !p.memory.reads_us) return post(world_peer, h, data, nullptr);
    const remote_block where{reinterpret_cast<std::uintptr_t>(data), h.length};
    h.flags = frame_remote;
    h.length = sizeof(remote_block);
    p.tx.push_back({h, nullptr, 0, nullptr, where});
    ++p.unacked;
    write_some(world_peer);
  }

  /// Copies a remote frame's data out of the peer's memory into the expected destination, then acknowledges it.
  void copy_remote(int world_peer) {
    auto& p = peers_[static_cast<std::size_t>(world_peer)];
    if (!p.memory.readable)
      throw error(label(world_peer) + " sent the address of its data, but this rank cannot read that process's "
                      "memory; every rank must run the same ddp version",
                  rank_);
    if (p.remote.bytes != p.expect.length) {
      frame_header got = p.got;
      got.length = p.remote.bytes;
      throw_mismatch(world_peer, p.expect, got);
    }
    // One call reads the data, then the peer's live word: had the peer aborted and released the buffer
    // before the copy ended, the word read after it shows so, and the bytes are discarded.
    std::uint64_t live = 0;
    const std::size_t total = p.remote.bytes + sizeof live;
    for (std::size_t done = 0; done < total;) {
      iovec local[2];
      iovec remote[2];
      int n = 0;
      if (done < p.remote.bytes) {
        local[n] = {p.expect_dest + done, p.remote.bytes - done};
        remote[n++] = {reinterpret_cast<void*>(static_cast<std::uintptr_t>(p.remote.address + done)), p.remote.bytes - done};
      }
      const std::size_t word_done = done > p.remote.bytes ? done - p.remote.bytes : 0;
      local[n] = {reinterpret_cast<char*>(&live) + word_done, sizeof live - word_done};
      remote[n++] = {reinterpret_cast<void*>(static_cast<std::uintptr_t>(p.memory.live_address + word_done)),
                     sizeof live - word_done};
      const ssize_t k = ::process_vm_readv(p.memory.pid, local, static_cast<unsigned long>(n), remote,
                                           static_cast<unsigned long>(n), 0);
      if (k < 0 && errno == EINTR) continue;
      const int code = k < 0 ? errno : EFAULT;  // 0 bytes: its buffer ended early
      if (k <= 0) {
        raise_abort_behind(world_peer);  // it aborted and released the buffer: its notice says why
        throw lost(world_peer, code, "copying from its memory failed (" + errno_text(code) + ")");
      }
      done += static_cast<std::size_t>(k);
    }
    if (live != p.memory.live_value) {
      raise_abort_behind(world_peer);
      throw error(label(world_peer) + " aborted " + what_now() + " while this rank copied its data, and its abort "
                      "notice did not arrive within 2 s; check that rank's log for the first error",
                  rank_);
    }
    frame_header ack;
    ack.op = op_ack;
    post(world_peer, ack, nullptr, nullptr);
  }

  /// Writes what the peer's socket accepts; true if bytes moved.
  bool write_some(int world_peer) {
    auto& p = peers_[static_cast<std::size_t>(world_peer)];
    bool moved = false;
    while (p.tx_pending()) {
      tx_item& t = p.tx[p.tx_head];
      iovec iov[2];
      int n = 0;
      if (t.sent < sizeof(frame_header))
        iov[n++] = {reinterpret_cast<char*>(&t.hdr) + t.sent, sizeof(frame_header) - t.sent};
      const std::size_t payload_done = t.sent > sizeof(frame_header) ? t.sent - sizeof(frame_header) : 0;
      if (t.hdr.length > payload_done)
        iov[n++] = {const_cast<char*>(t.payload()) + payload_done, t.hdr.length - payload_done};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(n);
      const ssize_t k = n == 0 ? 0 : ::sendmsg(p.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        throw lost(world_peer, errno, "sending to it failed (" + errno_text(errno) + ")");
      }
      moved = moved || k > 0;
      t.sent += static_cast<std::size_t>(k);
      if (t.sent < t.total()) break;
      if (t.done) t.done->finish();
      t.done.reset();
      if (++p.tx_head == p.tx.size()) {
        p.tx.clear();
        p.tx_head = 0;
      }
    }
    return moved;
  }

  /// Reads what the peer has sent, frame by frame; true if bytes moved. Point-to-point frames go to
  /// their recv (or are kept as strays); a collective frame waits until the executing call expects it.
  bool read_some(int world_peer) {
    auto& p = peers_[static_cast<std::size_t>(world_peer)];
    bool moved = false;
    while (p.readable()) {
      if (!p.in_payload && p.parked) {
        accept_collective(world_peer);
        continue;
      }
      char* where = nullptr;
      std::size_t want = 0;
      if (!p.in_payload) {
        where = reinterpret_cast<char*>(&p.got) + p.header_got;
        want = sizeof(frame_header) - p.header_got;
      } else {
        where = p.dest + p.payload_got;
        want = p.got.length - p.payload_got;
      }
      if (want > 0) {
        const ssize_t k = ::recv(p.fd.get(), where, want, MSG_DONTWAIT);
        if (k < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          on_close(world_peer, "receiving from it failed (" + errno_text(errno) + ")", errno);
          break;
        }
        if (k == 0) {
          on_close(world_peer, "it closed the connection or died", 0);
          break;
        }
        moved = true;
        (p.in_payload ? p.payload_got : p.header_got) += static_cast<std::size_t>(k);
      }
      if (!p.in_payload && p.header_got == sizeof(frame_header)) dispatch(world_peer);
      else if (p.in_payload && p.payload_got == p.got.length) finish_payload(p);
    }
    return moved;
  }

  /// End of stream: fatal if anything is expected from the peer, else remembered for later calls.
  void on_close(int world_peer, const std::string& how, int code) {
    auto& p = peers_[static_cast<std::size_t>(world_peer)];
    p.closed = true;
    if (p.expecting || p.in_payload || !p.recvs.empty() || p.header_got > 0 || p.unacked > 0)
      throw lost(world_peer, code, p.said_bye ? "it closed its communicator" : how);
  }

  /// A whole header arrived: route the frame.
  void dispatch(int world_peer) {
    auto& p = peers_[static_cast<std::size_t>(world_peer)];
    const frame_header& h = p.got;
    if (h.magic != frame_magic)
      throw error(label(world_peer) + " sent bytes that are not a ddp frame" +
                      (current_ != nullptr ? " during " + what_now() : std::string()) +
                      "; every rank must run the same ddp version, and nothing else may write to the mesh sockets",
                  rank_);
    if (h.op == op_abort) raise_abort(world_peer, h);
    if (h.op == op_bye) {
      p.said_bye = true;
      p.header_got = 0;
      return on_close(world_peer, "it closed its communicator", 0);
    }
    if (h.op == op_waiting) {
      p.waiting = h;
      p.waiting.op = h.flags;
      p.waiting.flags = 0;
      p.heard_waiting = true;
      p.header_got = 0;
      return;
    }
    if (h.op == op_ack) {
      if (p.unacked == 0)
        throw error(label(world_peer) + " acknowledged a copy this rank never offered; the stream is corrupt", rank_);
      --p.unacked;
      p.header_got = 0;
      return;
    }
    if (h.op >= collective_count)
      throw error(label(world_peer) + " sent a frame of unknown kind " + std::to_string(h.op) +
                      "; every rank must run the same ddp version",
                  rank_);
    if (h.op != static_cast<std::uint8_t>(collective::send_recv)) {
      p.parked = true;
      if (p.expecting) accept_collective(world_peer);
      return;
    }
    p.in_payload = true;
    p.payload_got = 0;
    if (const auto r = find_recv(p, h); r != p.recvs.end()) {
      check_p2p(*r, h, world_peer);
      p.matched = std::move(*r);
      p.recvs.erase(r);
      p.into = target::posted;
      p.dest = p.matched.dest;
    } else {
      if (h.length > (std::uint64_t{1} << 40))
        throw error(label(world_peer) + " announced a send of " + std::to_string(h.length) +
                        " bytes, beyond the frame limit; the stream is corrupt",
                    rank_);
      p.stray_buf.resize(h.length);
      p.into = target::stray;
      p.dest = p.stray_buf.data();
    }
    if (h.length == 0) finish_payload(p);
  }

  /// The executing call expects the parked collective frame: check it, then receive its payload.
  void accept_collective(int world_peer) {
    auto& p = peers_[static_cast<std::size_t>(world_peer)];
    check_header(world_peer);
    p.parked = false;
    p.in_payload = true;
    p.into = target::collective;
    p.dest = (p.got.flags & frame_remote) != 0 ? reinterpret_cast<char*>(&p.remote) : p.expect_dest;
    p.payload_got = 0;
    if (p.got.length == 0) finish_payload(p);
  }

  void finish_payload(peer& p) {
    p.in_payload = false;
    p.header_got = 0;
    switch (p.into) {
      case target::collective:
        if ((p.got.flags & frame_remote) != 0) copy_remote(static_cast<int>(&p - peers_.data()));
        p.expecting = false;
        break;
      case target::posted:
        p.matched.done->finish();
        p.matched = {};
        break;
      case target::stray:
        // Its recv may have been posted while the payload was arriving.
        if (const auto r = find_recv(p, p.got); r != p.recvs.end()) {
          check_p2p(*r, p.got, static_cast<int>(&p - peers_.data()));
          std::memcpy(r->dest, p.stray_buf.data(), p.got.length);
          r->done->finish();
          p.recvs.erase(r);
        } else {
          p.strays.push_back({p.got, std::move(p.stray_buf)});
        }
        p.stray_buf = {};
        break;
    }
  }

  /// The rank label errors use: the group rank, plus the world rank inside a subgroup.
  [[nodiscard]] std::string label(int world_rank) const {
    if (current_ == nullptr) return "rank " + std::to_string(world_rank);
    const auto& m = current_->grp->members;
    for (std::size_t i = 0; i < m.size(); ++i)
      if (m[i] == world_rank)
        return "rank " + std::to_string(i) +
               (m.size() == static_cast<std::size_t>(size_) ? "" : " (world rank " + std::to_string(world_rank) + ")");
    return "world rank " + std::to_string(world_rank);
  }
  [[nodiscard]] std::string what_now() const {
    return current_ != nullptr ? describe(header_of(*current_, 0)) : std::string("a point-to-point transfer");
  }

  [[nodiscard]] peer_lost lost(int world_peer, int code, const std::string& how) const {
    return peer_lost(label(world_peer) + " was lost during " + what_now() + ": " + how +
                         ". Check that rank's log for the first error; the job cannot continue without it",
                     rank_, world_peer, code);
  }

  /// Raises mismatch_error unless the parked frame belongs to the executing call with the expected length
  /// (a remote frame's length is checked once its remote_block has arrived).
  void check_header(int world_peer) {
    const auto& p = peers_[static_cast<std::size_t>(world_peer)];
    const bool remote = (p.got.flags & frame_remote) != 0;
    if (!same_call(p.expect, p.got) || p.got.length != (remote ? sizeof(remote_block) : p.expect.length))
      throw_mismatch(world_peer, p.expect, p.got);
  }

  /// Raises mismatch_error where a peer is at the executing call's step (group and sequence number) in
  /// another call: a frame of it waits unread, or it said it waits in that call. Runs before every sleep,
  /// so calls that only receive, or only send, on both sides fail at once instead of at the timeout.
  void check_same_step() const {
    const frame_header mine = header_of(*current_, 0);
    const auto other = [&](const frame_header& h) { return h.group == mine.group && h.seq == mine.seq && !same_call(mine, h); };
    for (std::size_t r = 0; r < peers_.size(); ++r) {
      const peer& p = peers_[r];
      if (p.parked && other(p.got)) throw_mismatch(static_cast<int>(r), mine, p.got);
      if (p.heard_waiting && other(p.waiting)) throw_mismatch(static_cast<int>(r), mine, p.waiting, " waits in ");
    }
  }

  /// After a stall: tells every peer of the group which call this rank waits in, and publishes whom it waits for.
  void notice_stall() {
    frame_header h = header_of(*current_, 0);
    h.flags = h.op;
    h.op = op_waiting;
    for (const int member : current_->grp->members) {
      const peer& p = peers_[static_cast<std::size_t>(member)];
      if (member != rank_ && p.fd.valid() && !p.closed) post(member, h, nullptr, nullptr);
    }
    note_->set(waiting_list());
    noted_ = true;
  }

  /// The mismatch_error naming this rank's call `want` and what the peer `got` sent (or waits in) instead.
  [[noreturn]] void throw_mismatch(int world_peer, const frame_header& want, const frame_header& got,
                                   const char* how = " sent ") const {
    // A frame of this rank's previous step: both calls of that step went through (each only sent).
    const bool earlier = got.group == finished_.group && got.seq == finished_.seq && got.group == want.group;
    throw mismatch_error(label(rank_) + " called " + describe(want) +
                             (earlier ? " after " + describe(finished_) : std::string()) + ", " + label(world_peer) + how +
                             describe(got) +
                             (same_call(want, got) ? " with a payload of " + std::to_string(got.length) +
                                                         " bytes where " + std::to_string(want.length) +
                                                         " were expected"
                                                   : std::string()) +
                             "; every rank must call the same collectives in the same order with the same counts, "
                             "dtypes, operators and roots",
                         rank_);
  }

  /// Looks behind the frame just received for the peer's abort notice (2 s at most, skipping the frames
  /// it wrote before aborting) and raises it; returns if the stream ends or holds none.
  void raise_abort_behind(int world_peer) {
    const int fd = peers_[static_cast<std::size_t>(world_peer)].fd.get();
    const auto limit = clock::now() + std::chrono::seconds(2);
    char sink[4096];
    frame_header h;
    while (recv_all(fd, &h, sizeof h, limit) == io_status::ok && h.magic == frame_magic && h.op != op_bye) {
      if (h.op == op_abort) raise_abort(world_peer, h);
      for (std::uint64_t left = h.length; left > 0;) {
        const auto k = static_cast<std::size_t>(std::min<std::uint64_t>(left, sizeof sink));
        if (recv_all(fd, sink, k, limit) != io_status::ok) return;
        left -= k;
      }
    }
  }

  [[noreturn]] void raise_abort(int world_peer, const frame_header& h) {
    std::string text(std::min<std::uint64_t>(h.length, max_abort_text), '\0');
    if (h.length > max_abort_text ||
        recv_all(peers_[static_cast<std::size_t>(world_peer)].fd.get(), text.data(), text.size(),
                 clock::now() + std::chrono::seconds(2)) != io_status::ok)
      text = "(its message was lost)";
    peers_[static_cast<std::size_t>(world_peer)].closed = true;
    const std::string msg = label(world_peer) + " aborted " +
                            (current_ != nullptr ? what_now() : std::string("while this rank ran no operation")) +
                            ": " + text;
    switch (static_cast<abort_kind>(h.flags)) {
      case abort_kind::peer_lost: throw peer_lost(msg, rank_, h.root);
      case abort_kind::mismatch: throw mismatch_error(msg, rank_);
      case abort_kind::timeout: throw timeout_error(msg, rank_);
      case abort_kind::other: break;
    }
    throw error(msg, rank_);
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
          if (peers_[r].tx_pending()) moved = write_some(static_cast<int>(r)) || moved;
          if (peers_[r].readable()) moved = read_some(static_cast<int>(r)) || moved;
        }
      }
      for (std::size_t r = 0; r < peers_.size(); ++r)
        if ((peers_[r].expecting || peers_[r].unacked > 0) && peers_[r].closed)
          throw lost(static_cast<int>(r), 0, peers_[r].said_bye ? "it closed its communicator" : "its connection is closed");
      if (done()) return;
      check_same_step();
      build_poll_set();
      const int until_deadline = poll_ms(deadline_);
      const bool may_stall = !stall_noticed && until_deadline > static_cast<int>(stall_notice_after.count());
      const int rc = ::poll(fds_.data(), fds_.size(), may_stall ? static_cast<int>(stall_notice_after.count()) : until_deadline);
      if (rc < 0 && errno != EINTR) throw error("poll failed: " + errno_text(errno), rank_, errno);
      if (fds_[0].revents & POLLIN) {
        drain_wake();
        std::lock_guard lock(mutex_);
        if (stop_)  // to the peers, this rank is lost
          throw peer_lost(what_now() + " was cancelled because its communicator was destroyed; wait() for every "
                                       "operation before the communicator goes out of scope",
                          rank_, rank_);
      }
      if (store_) store_->on_events(fds_, store_base_);
      expire_recvs();
      if (rc == 0 && may_stall) {
        stall_noticed = true;
        notice_stall();
      }
      if (rc == 0 && clock::now() >= deadline_) throw timed_out();
    }
  }

  /// The ranks the executing call waits for: "rank 1, rank 3".
  [[nodiscard]] std::string waiting_list() const {
    std::string waiting;
    for (std::size_t r = 0; r < peers_.size(); ++r)
      if (peers_[r].expecting || peers_[r].tx_pending() || peers_[r].unacked > 0)
        waiting += (waiting.empty() ? "" : ", ") + label(static_cast<int>(r));
    return waiting;
  }

  timeout_error timed_out() const {
    const std::string waiting = waiting_list();
    return timeout_error(what_now() + " did not complete within " + std::to_string(current_->grp->timeout.count()) +
                             " ms, waiting for " + (waiting.empty() ? std::string("nothing") : waiting) +
                             ": a peer is stuck, dead or calling a different collective; check every rank's log, or "
                             "raise the timeout (config::timeout, DDP_TIMEOUT_MS)",
                         rank_);
  }

  // ---- failure -----------------------------------------------------------------------------

  /// Completes frames already half written (so the stream stays parseable), drops the rest, sends
  /// every peer an abort frame carrying the error, and poisons the engine.
  void abort_peers(std::exception_ptr e) {
    live_.store(~live_.load());  // before any buffer is released: copies still running see it and discard
    poisoned_ = e;
    abort_kind kind = abort_kind::other;
    int lost_rank = -1;
    std::string text;
    try {
      std::rethrow_exception(e);
    } catch (const peer_lost& x) {
      kind = abort_kind::peer_lost;
      lost_rank = x.peer();
      text = x.what();
    } catch (const mismatch_error& x) {
      kind = abort_kind::mismatch;
      text = x.what();
    } catch (const timeout_error& x) {
      kind = abort_kind::timeout;
      text = x.what();
    } catch (const std::exception& x) {
      text = x.what();
    }
    text.resize(std::min<std::size_t>(text.size(), max_abort_text));
    const auto limit = clock::now() + std::chrono::seconds(1);
    for (std::size_t r = 0; r < peers_.size(); ++r) {
      auto& p = peers_[r];
      p.expecting = false;
      p.unacked = 0;
      for (auto& posted : p.recvs) posted.done->fail(e);
      p.recvs.clear();
      if (p.in_payload && p.into == target::posted) p.matched.done->fail(e);
      if (!p.fd.valid() || p.closed) continue;
      bool clean = true;
      if (p.tx_pending()) {
        tx_item& t = p.tx[p.tx_head];
        if (t.sent > 0) {
          const std::size_t header_left = t.sent < sizeof(frame_header) ? sizeof(frame_header) - t.sent : 0;
          const std::size_t payload_done = t.sent > sizeof(frame_header) ? t.sent - sizeof(frame_header) : 0;
          clean = send_all(p.fd.get(), reinterpret_cast<const char*>(&t.hdr) + (sizeof(frame_header) - header_left),
                           header_left, limit) == io_status::ok &&
                  send_all(p.fd.get(), t.payload() + payload_done, t.hdr.length - payload_done, limit) == io_status::ok;
        }
        for (std::size_t i = p.tx_head; i < p.tx.size(); ++i)
          if (p.tx[i].done) p.tx[i].done->fail(e);
        p.tx.clear();
        p.tx_head = 0;
      }
      if (!clean) continue;
      frame_header h;
      h.op = op_abort;
      h.flags = static_cast<std::uint8_t>(kind);
      h.root = lost_rank;
      h.length = text.size();
      if (send_all(p.fd.get(), &h, sizeof h, limit) == io_status::ok)
        send_all(p.fd.get(), text.data(), text.size(), limit);
    }
  }

  /// On destruction: fail what is queued, say goodbye where the stream is at a frame boundary, close.
  void shutdown() {
    std::deque<call> left;
    {
      std::lock_guard lock(mutex_);
      left.swap(queue_);
    }
    const auto gone = std::make_exception_ptr(
        error("the communicator was destroyed before this operation ran; wait() for every operation before the "
              "communicator goes out of scope",
              rank_));
    for (auto& c : left) c.done->fail(gone);
    for (auto& p : peers_) {
      if (!p.fd.valid()) continue;
      for (std::size_t i = p.tx_head; i < p.tx.size(); ++i)
        if (p.tx[i].done) p.tx[i].done->fail(gone);
      if (!poisoned_ && !(p.tx_pending() && p.tx[p.tx_head].sent > 0)) {
        frame_header bye;
        bye.op = op_bye;
        send_all(p.fd.get(), &bye, sizeof bye, clock::now() + std::chrono::milliseconds(100));
      }
      char sink[4096];
      while (::recv(p.fd.get(), sink, sizeof sink, MSG_DONTWAIT) > 0) {
      }
      p.fd.reset();
    }
  }

  int rank_;
  int size_;
  executor exec_;
  std::optional<store_server> store_;
  std::size_t store_base_ = 0;
  socket_fd wake_;
  std::vector<peer> peers_;
  std::vector<pollfd> fds_;
  std::exception_ptr poisoned_;
  call* current_ = nullptr;
  clock::time_point deadline_{};
  std::atomic<std::uint64_t> live_{0};
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
                "ddp: peers read the live word with process_vm_readv; it must be a plain lock-free word.");
  std::shared_ptr<ddp::detail::stall_note> note_ = std::make_shared<ddp::detail::stall_note>();
  bool noted_ = false;
  frame_header finished_;  ///< the last collective this rank completed, named when a peer's frame of it arrives late
  struct scratch_buffer {
    std::unique_ptr<char[]> data;
    std::size_t size = 0;
  };
  scratch_buffer scratch_[2];

  std::mutex mutex_;
  std::deque<call> queue_;
  std::vector<socket_fd> pending_sockets_;
  std::vector<peer_memory> pending_memory_;
  bool has_pending_sockets_ = false;
  bool stop_ = false;
  std::thread thread_;
};

/// What an algorithm sees of the engine while it executes one call: group ranks, frames, scratch.
class channel {
 public:
  channel(engine& e, call& c) : e_(e), c_(c), g_(*c.grp) {}

  /// The call being executed.
  [[nodiscard]] const call& what() const { return c_; }
  /// This process's group rank.
  [[nodiscard]] int rank() const { return g_.me; }
  /// The group's size.
  [[nodiscard]] int size() const { return g_.size(); }

  /// Queues a frame of `bytes` payload to group rank `to`; `data` must stay valid and unchanged until
  /// flush() (a peer on this host may copy it straight from this process's memory until then).
  void send(int to, const void* data, std::size_t bytes) {
    c_.grp->stats.add_bytes(c_.kind, bytes);
    e_.post_collective(world(to), header_of(c_, bytes), data);
  }
  /// Receives the next frame from group rank `from` into `dest` (exactly `bytes`), sends progressing meanwhile.
  void recv(int from, void* dest, std::size_t bytes) {
    const recv_part one{from, dest, bytes};
    recv_all(std::span<const recv_part>(&one, 1));
  }
  /// Receives one frame from each listed peer (each at most once), in whatever order they arrive.
  void recv_all(std::span<const recv_part> parts) {
    for (const auto& part : parts) {
      auto& p = e_.peers_[static_cast<std::size_t>(world(part.peer))];
      p.expecting = true;
      p.expect = header_of(c_, part.bytes);
      p.expect_dest = static_cast<char*>(part.dest);
    }
    e_.pump([&] {
      for (const auto& part : parts)
        if (e_.peers_[static_cast<std::size_t>(world(part.peer))].expecting) return false;
      return true;
    });
  }
  /// Waits until every queued frame is written and every peer has copied the data of its remote frames.
  void flush() {
    e_.pump([&] {
      for (const auto& p : e_.peers_)
        if (p.tx_pending() || p.unacked > 0) return false;
      return true;
    });
  }
  /// A scratch buffer (two of them: 0 and 1) of at least `bytes`, held by the engine and reused by every
  /// later call: it only grows, uninitialized, so steady state allocates and touches no new memory.
  /// Growing discards the contents.
  char* scratch(int which, std::size_t bytes) {
    auto& s = e_.scratch_[which];
    if (s.size < bytes) {
      s.data.reset();  // free first, so the peak is the new size, not both
      s.data.reset(new char[bytes]);
      s.size = bytes;
    }
    return s.data.get();
  }

 private:
  [[nodiscard]] int world(int group_rank) const { return g_.members[static_cast<std::size_t>(group_rank)]; }
  engine& e_;
  call& c_;
  group& g_;
};

inline void engine::channel_run(call& c) {
  channel ch(*this, c);
  exec_(ch);
}

}  // namespace ddp::tcp::detail
