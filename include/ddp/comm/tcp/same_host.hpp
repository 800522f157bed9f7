#pragma once
/// \file The same-host copy protocol. Between ranks on one host (same user), a large collective frame
/// carries only the address of its data (a remote frame); the receiver copies the data straight out of the
/// sender's memory with process_vm_readv (one copy instead of the socket's two) and answers op_ack, and the
/// sender keeps the buffer unchanged until then. A sender that aborts first changes its live word, then
/// releases its buffers; the receiver reads that word after the data, in the same system call, so a copy
/// that overlapped the release is recognised and discarded (the kernel takes the address space's lock per
/// remote region, so the word is read after the data).

#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>

#include <ddp/comm/tcp/protocol.hpp>

namespace ddp::tcp::detail {

/// Collective frames of at least this many payload bytes travel as remote frames where the peer can read
/// this process; below it, the acknowledgement's round trip costs more than the socket's second copy.
inline constexpr std::size_t remote_min_bytes = 512 << 10;

/// Which machine and process-id space a process lives in: a process id names the same process for two ranks
/// only when both agree. Another machine has another boot id; a container or a simulated host in its own PID
/// namespace has another namespace, where a pid names some unrelated process.
struct host_identity {
  std::uint64_t boot = 0;      ///< a hash of /proc/sys/kernel/random/boot_id (0 where it cannot be read)
  std::uint64_t pid_ns = 0;    ///< the inode of /proc/self/ns/pid (0 where it cannot be read)
  std::uint64_t pid_ns_dev = 0;///< its device

  /// Both known and equal: the pids of one process mean the same process for the other.
  [[nodiscard]] bool shares_pids_with(const host_identity& o) const noexcept {
    return boot != 0 && pid_ns != 0 && boot == o.boot && pid_ns == o.pid_ns && pid_ns_dev == o.pid_ns_dev;
  }
};

/// This process's host identity.
inline host_identity this_host() {
  host_identity id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  if (in >> boot) {
    id.boot = 0xcbf29ce484222325ULL;  // FNV-1a
    for (const unsigned char c : boot) id.boot = (id.boot ^ c) * 0x100000001b3ULL;
  }
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) == 0) {
    id.pid_ns = static_cast<std::uint64_t>(ns.st_ino);
    id.pid_ns_dev = static_cast<std::uint64_t>(ns.st_dev);
  }
  return id;
}

/// What a rank knows about reaching one peer's memory directly (both on one host, same user).
struct peer_memory {
  ::pid_t pid = 0;                 ///< the peer's process id, as this rank sees it
  bool readable = false;           ///< this rank can copy from the peer's memory
  bool reads_us = false;           ///< the peer can copy from this rank's memory: send it remote frames
  std::uint64_t live_address = 0;  ///< where the peer keeps its live word
  std::uint64_t live_value = 0;    ///< the live word's value while the peer has not aborted
};

/// This process's live word, which peers on this host read after each copy from its memory: it changes once
/// when the engine aborts, before any buffer is released, so a copy that overlapped the release is recognised
/// and discarded.
class live_word {
 public:
  live_word() {
    std::random_device random;
    value_ = ((std::uint64_t{random()} << 32) ^ random()) | 1U;
    word_.store(value_);
  }
  /// The word itself (peers read it at its address).
  [[nodiscard]] const std::atomic<std::uint64_t>& word() const { return word_; }
  /// Changes the word, once, from either thread: after it, no copy out of this process's buffers counts.
  void end() {
    std::uint64_t alive = value_;
    word_.compare_exchange_strong(alive, ~value_);
  }

 private:
  std::atomic<std::uint64_t> word_{0};
  std::uint64_t value_ = 0;  ///< the word's value until the engine aborts
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
                "ddp: peers read the live word with process_vm_readv; it must be a plain lock-free word.");
};

/// How a copy out of a peer's memory ended.
enum class copy_result : std::uint8_t {
  copied,   ///< every byte, and the peer had not aborted when the copy ended
  aborted,  ///< the peer aborted (and may have released the buffer) before the copy ended: discard the bytes
  failed,   ///< the system call failed (errno in `code`): the peer died, or released the buffer
};

/// Copies `from` (in the peer's memory) to `dest`, then reads the peer's live word in the same call.
inline copy_result copy_from_peer(const peer_memory& peer, const remote_block& from, char* dest, int& code) {
  std::uint64_t live = 0;
  const std::size_t total = from.bytes + sizeof live;
  for (std::size_t done = 0; done < total;) {
    iovec local[2];
    iovec remote[2];
    unsigned long n = 0;
    if (done < from.bytes) {
      local[n] = {dest + done, from.bytes - done};
      remote[n++] = {reinterpret_cast<void*>(static_cast<std::uintptr_t>(from.address + done)), from.bytes - done};
    }
    const std::size_t word_done = done > from.bytes ? done - from.bytes : 0;
    local[n] = {reinterpret_cast<char*>(&live) + word_done, sizeof live - word_done};
    remote[n++] = {reinterpret_cast<void*>(static_cast<std::uintptr_t>(peer.live_address + word_done)),
                   sizeof live - word_done};
    const ssize_t k = ::process_vm_readv(peer.pid, local, n, remote, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      code = k < 0 ? errno : EFAULT;  // 0 bytes: its buffer ended early
      return copy_result::failed;
    }
    done += static_cast<std::size_t>(k);
  }
  return live == peer.live_value ? copy_result::copied : copy_result::aborted;
}

}  // namespace ddp::tcp::detail
