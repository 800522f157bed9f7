#pragma once
/// \file Point-to-point between ranks of one host: per ordered pair of ranks a single-producer,
/// single-consumer byte ring in the job's segment `<job segment>-p2p`, carrying the same frames (header and
/// payload) a socket would. Only engine threads touch the rings: the sender's writes what fits and the
/// receiver's reads what is there, straight into the matched recv. No system call on the fast path; a rank's
/// engine that sleeps in poll says so in its bell word, and a peer that wrote to it (or freed room in a ring
/// the sleeper waits to write) rings it with an op_ring frame on the socket. Every rank maps the segment with
/// O_CREAT at the rendezvous; the last to map it unlinks it. The segment is sparse (a ring for every pair of
/// ranks): a rank takes the pages of its incoming rings' heads when it maps the segment, and those of a ring it
/// sends through before its first send, so that a full /dev/shm is an error naming it, never a SIGBUS.

#include <sys/mman.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/tcp/shm_copy.hpp>
#include <ddp/comm/tcp/shm_segment.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// Data bytes of one ring: a larger frame passes in pieces as the receiver reads.
inline constexpr std::size_t ring_bytes = 1 << 20;

/// A ring's counters, each on its own cache line; the bytes in the ring are written - read.
struct ring_head {
  alignas(64) std::atomic<std::uint64_t> written{0};     ///< bytes the sender has put in, ever
  alignas(64) std::atomic<std::uint64_t> read{0};        ///< bytes the receiver has taken out, ever
  alignas(64) std::atomic<std::uint32_t> room_wanted{0};  ///< the sender found it full: ring it on reading
};

/// A rank's bell word: 1 while its engine sleeps in poll (a writer must ring it), on its own cache line.
struct ring_bell {
  alignas(64) std::atomic<std::uint32_t> asleep{0};
};

/// One direction between two ranks, seen from either end.
class shm_ring {
 public:
  shm_ring(ring_head* head, char* data) : head_(head), data_(data) {}

  /// Sender: copies what fits of `n` bytes at `src` in; returns how many.
  std::size_t write(const char* src, std::size_t n) {
    const std::uint64_t w = head_->written.load(std::memory_order_relaxed);
    const std::uint64_t r = head_->read.load(std::memory_order_seq_cst);
    const std::size_t k = std::min<std::size_t>(n, ring_bytes - static_cast<std::size_t>(w - r));
    const std::size_t at = static_cast<std::size_t>(w % ring_bytes), first = std::min(k, ring_bytes - at);
    shared_stores().copy(data_ + at, src, first);  // the receiver holds the ring's lines (shm_copy.hpp)
    shared_stores().copy(data_, src + first, k - first);
    head_->written.store(w + k, std::memory_order_seq_cst);
    return k;
  }
  /// Receiver: copies up to `n` bytes out to `dest`; returns how many, or -1 with errno EAGAIN when empty
  /// (frame_reader's read function).
  ssize_t read(char* dest, std::size_t n) {
    const std::uint64_t r = head_->read.load(std::memory_order_relaxed);
    const std::uint64_t w = head_->written.load(std::memory_order_seq_cst);
    const std::size_t k = std::min<std::size_t>(n, static_cast<std::size_t>(w - r));
    if (k == 0) {
      errno = EAGAIN;
      return -1;
    }
    const std::size_t at = static_cast<std::size_t>(r % ring_bytes), first = std::min(k, ring_bytes - at);
    std::memcpy(dest, data_ + at, first);
    std::memcpy(dest + first, data_, k - first);
    head_->read.store(r + k, std::memory_order_seq_cst);
    return static_cast<ssize_t>(k);
  }
  /// True when the receiver has bytes to read.
  [[nodiscard]] bool readable() const {
    return head_->written.load(std::memory_order_seq_cst) != head_->read.load(std::memory_order_seq_cst);
  }
  /// Sender, on a full ring: asks the receiver to ring it when it reads; true if room appeared meanwhile.
  bool want_room() {
    head_->room_wanted.store(1, std::memory_order_seq_cst);
    return head_->written.load(std::memory_order_relaxed) - head_->read.load(std::memory_order_seq_cst) < ring_bytes;
  }
  /// Receiver, after reading: true (once) when the sender waits for room and must be rung.
  bool room_wanted() {
    return head_->room_wanted.load(std::memory_order_seq_cst) != 0 && head_->room_wanted.exchange(0) != 0;
  }

 private:
  ring_head* head_;
  char* data_;
};

/// The job's rings, mapped by this rank.
class shm_rings {
 public:
  /// Maps (creating it if first) the rings of the job segment `job_name` of `size` ranks, as rank `me`.
  shm_rings(const std::string& job_name, int size, int me)
      : size_(static_cast<std::size_t>(size)), me_(me), sent_before_(size_, 0) {
    const std::string name = job_name + "-p2p";
    // sparse: N² rings of 1 MiB would reserve 10 GB at 100 ranks; a pair's pages are taken when it first talks
    map_ = shm_mapping::open(name, offset_of_ring(size_ * size_), true, false, me, false);
    count_mapping(*reinterpret_cast<std::atomic<std::uint32_t>*>(map_.data()), name, size);
    take(map_.data(), offset_of_ring(0), "the rings' bells");
    for (int r = 0; r < size; ++r)  // the heads of the rings into this rank, which its engine looks at every turn
      if (r != me) take(map_.data() + offset_of_ring(index(r, me)), sizeof(ring_head), "the ring from rank " + std::to_string(r));
  }
  shm_rings(const shm_rings&) = delete;

  /// The ring from world rank `from` to world rank `to`.
  [[nodiscard]] shm_ring ring(int from, int to) const {
    char* at = map_.data() + offset_of_ring(index(from, to));
    return {reinterpret_cast<ring_head*>(at), at + sizeof(ring_head)};
  }
  /// Before this rank's first send to world rank `to`: takes the pages of that ring now, so that a full /dev/shm
  /// is an error naming it here, not a SIGBUS in the copy.
  void before_sending(int to) {
    if (std::exchange(sent_before_[static_cast<std::size_t>(to)], 1) != 0) return;
    take(map_.data() + offset_of_ring(index(me_, to)), sizeof(ring_head) + ring_bytes,
         "the ring to rank " + std::to_string(to));
  }
  /// World rank `r`'s bell.
  [[nodiscard]] ring_bell& bell(int r) const {
    return reinterpret_cast<ring_bell*>(map_.data() + 64)[static_cast<std::size_t>(r)];
  }

 private:
  [[nodiscard]] std::size_t index(int from, int to) const {
    return static_cast<std::size_t>(from) * size_ + static_cast<std::size_t>(to);
  }
  /// Takes the /dev/shm pages under [at, at + bytes) (MADV_POPULATE_WRITE, whole pages); throws ddp::error naming
  /// /dev/shm, its room and the fixes where it has none. Kernels before 5.14 lack the advice: nothing is taken.
  void take(char* at, std::size_t bytes, const std::string& what) const {
    constexpr std::size_t page = 4096;
    const auto first = reinterpret_cast<std::uintptr_t>(at) / page * page;
    const auto end = (reinterpret_cast<std::uintptr_t>(at) + bytes + page - 1) / page * page;
    if (::madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_WRITE) == 0 || errno == EINVAL) return;
    const int code = errno;
    throw error("cannot take " + std::to_string((end - first) >> 10) + " KiB of /dev/shm for " + what +
                    " (point-to-point through shared memory)" + shm_mapping::no_room(code),
                me_, code);
  }
  /// Bytes before ring `i`: the mapping count, the bells, then the rings.
  [[nodiscard]] std::size_t offset_of_ring(std::size_t i) const {
    return 64 + size_ * sizeof(ring_bell) + i * (sizeof(ring_head) + ring_bytes);
  }
  std::size_t size_;
  int me_;
  std::vector<char> sent_before_;  ///< per world rank: this rank has sent to it through its ring
  shm_mapping map_;
};

}  // namespace ddp::tcp::detail
