#pragma once
/// \file The job's shared-memory segment of one host (the whole job's where every rank runs on one host): per
/// world rank, a robust mutex its engine thread holds for its lifetime (the kernel marks it when the process
/// dies, even by SIGKILL, so a survivor sees the death with one load) and the state it left in: running,
/// closed, or aborted with the error its peers then raise. The host's lowest rank (rank 0 on one host) creates
/// it at the rendezvous; it is unlinked once all the host's ranks mapped it.

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <exception>
#include <string>
#include <vector>

#include <ddp/comm/tcp/config.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/same_host.hpp>
#include <ddp/comm/tcp/shm_segment.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// A thread waiting on shared memory (a collective's barrier, a send or recv on the caller's thread) spins this
/// long, then yields its core between looks: the peer's threads or this rank's engine thread may need the core.
inline constexpr std::chrono::microseconds shm_yield_after{5};

/// Sleeps while the shared word `w` holds `seen`, at most `ns` nanoseconds (spurious returns are fine).
inline void futex_wait(std::atomic<std::uint32_t>& w, std::uint32_t seen, long ns) {
  const timespec t{ns / 1000000000L, ns % 1000000000L};
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&w), FUTEX_WAIT, seen, &t, nullptr, 0);
}
/// Wakes every process sleeping on the shared word `w`.
inline void futex_wake(std::atomic<std::uint32_t>& w) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&w), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

/// How a rank left the job, as its peers see it in the job segment (writing: its abort notice is being
/// written, and it still counts as running).
enum class shm_state : std::uint32_t { running = 0, closed = 1, aborted = 2, writing = 3 };

/// One rank's place in the job segment.
struct shm_rank_life {
  pthread_mutex_t alive;                   ///< robust, held by the rank's engine thread while it runs
  std::atomic<std::uint32_t> state{0};     ///< shm_state
  std::uint32_t kind = 0;                  ///< abort_kind of the error it aborted with
  std::int32_t lost_rank = -1;             ///< the world rank its peer_lost names
  std::uint32_t text_bytes = 0;
  char text[max_abort_text];               ///< the error's message (as long as the sockets carry)
};

/// The job segment's layout.
struct shm_world_layout {
  std::uint64_t magic = 0;  ///< written by rank 0 before it publishes the name
};

/// The job segment, mapped by this rank.
class shm_world {
 public:
  static constexpr std::uint64_t magic = 0x444450534d574c44ULL;  // "DDPSMWLD"

  /// Maps the segment `name` of a job of `size` ranks, `local` of them on this host, as world rank `rank` (the
  /// `creator` creates it and writes the magic; the others open it).
  shm_world(std::string name, int size, int rank, bool creator, int local)
      : name_(std::move(name)), size_(size), local_(local), rank_(rank) {
    map_ = shm_mapping::open(name_, bytes(size), creator, creator, rank);
    if (creator) layout().magic = magic;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&life(rank).alive, &a);
    pthread_mutexattr_destroy(&a);
  }
  shm_world(const shm_world&) = delete;

  /// The segment's name (subgroup segments are named after it).
  [[nodiscard]] const std::string& name() const { return name_; }
  /// The job's number of ranks.
  [[nodiscard]] int size() const { return size_; }
  /// The job's ranks on this host (size() where every rank is on this host).
  [[nodiscard]] int local_size() const { return local_; }
  /// True when rank 0 wrote the magic: the segment is the job's.
  [[nodiscard]] bool genuine() { return layout().magic == magic; }

  /// On the engine thread: holds this rank's robust mutex until release() or the process's death.
  void hold() { pthread_mutex_lock(&life(rank_).alive); }
  /// On the engine thread, when the communicator closes: says so to the peers and lets the mutex go.
  void release() {
    auto& me = life(rank_);
    std::uint32_t running = 0;
    me.state.compare_exchange_strong(running, static_cast<std::uint32_t>(shm_state::closed));
    pthread_mutex_unlock(&me.alive);
  }
  /// Publishes this rank's first error, so peers waiting on it raise the same error (later ones are dropped).
  void abort(const abort_notice& n) {
    auto& me = life(rank_);
    std::uint32_t running = 0;
    if (!me.state.compare_exchange_strong(running, static_cast<std::uint32_t>(shm_state::writing))) return;
    me.kind = n.header.flags;
    me.lost_rank = n.header.lost_rank;
    me.text_bytes = static_cast<std::uint32_t>(std::min(n.text.size(), sizeof me.text));
    std::memcpy(me.text, n.text.data(), me.text_bytes);
    me.state.store(static_cast<std::uint32_t>(shm_state::aborted), std::memory_order_release);
  }

  /// How world rank `r` left, or running while it runs; a process that died counts as closed.
  [[nodiscard]] shm_state state_of(int r) {
    auto& l = life(r);
    const auto s = static_cast<shm_state>(l.state.load(std::memory_order_acquire));
    if (s == shm_state::closed || s == shm_state::aborted) return s;
    // The robust futex protocol: the kernel sets FUTEX_OWNER_DIED in the word when the holder dies.
    const int word = std::atomic_ref<int>(l.alive.__data.__lock).load(std::memory_order_acquire);
    return (word & FUTEX_OWNER_DIED) != 0 ? shm_state::closed : shm_state::running;
  }
  /// The error rank `r` aborted with (state_of(r) == aborted).
  [[nodiscard]] const shm_rank_life& notice_of(int r) { return life(r); }

  /// What this rank may read of each world rank's memory (same_host.hpp), set once at the rendezvous.
  std::vector<peer_memory> memory;
  /// Every rank on this host can copy straight out of every other one's memory: collectives may use single copies.
  bool single_copy = false;
  /// This rank's DDP_SHM_ALGO, set once at the rendezvous: how a group it leads runs collectives from
  /// shm_single_copy_bytes where single_copy holds.
  shm_algo algo = shm_algo::automatic;

 private:
  static std::size_t bytes(int size) { return sizeof(shm_world_layout) + 64 + sizeof(shm_rank_life) * static_cast<std::size_t>(size); }
  shm_world_layout& layout() { return *reinterpret_cast<shm_world_layout*>(map_.data()); }
  shm_rank_life& life(int r) {
    return reinterpret_cast<shm_rank_life*>(map_.data() + sizeof(shm_world_layout) + 64)[r];
  }

  std::string name_;
  int size_;
  int local_;
  int rank_;
  shm_mapping map_;
};

}  // namespace ddp::tcp::detail
