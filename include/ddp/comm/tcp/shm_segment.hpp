#pragma once
/// \file POSIX shared-memory segments of the same-host transport: named per job
/// ("/ddp-<uid>-<pid namespace>-<creator pid>-<nonce>[-<group>]"), mapped by every rank of a group and unlinked
/// as soon as all of them have mapped it, so nothing is left behind on any later exit path. A segment whose job
/// died before every rank mapped it (its creator's pid is gone) is removed by the next job on the host that runs
/// in the same PID namespace (a container sharing /dev/shm but not the pids never judges another's segments).

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include <ddp/comm/tcp/same_host.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// The job's segment name prefix for this user in this PID namespace: "/ddp-<uid>-<pid namespace inode>-".
inline std::string shm_user_prefix() {
  static const std::string prefix =
      "/ddp-" + std::to_string(::getuid()) + "-" + std::to_string(this_host().pid_ns) + "-";
  return prefix;
}

/// Removes this user's segments whose creator process is gone (jobs killed before every rank mapped them).
inline void reap_stale_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const std::string prefix = shm_user_prefix().substr(1);
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && ::kill(static_cast<::pid_t>(pid), 0) != 0 && errno == ESRCH) ::shm_unlink(("/" + name).c_str());
  }
  ::closedir(dir);
}

/// A mapped shared-memory segment; unmapped on destruction.
class shm_mapping {
 public:
  shm_mapping() = default;
  shm_mapping(shm_mapping&& o) noexcept : base_(std::exchange(o.base_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  shm_mapping& operator=(shm_mapping&& o) noexcept {
    if (this != &o) {
      reset();
      base_ = std::exchange(o.base_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~shm_mapping() { reset(); }

  /// Opens (creating it where `create`; exclusively where `exclusive`) segment `name` of `bytes`, zero-filled
  /// when new, and maps it; throws ddp::error naming `rank` when the system refuses. A segment every byte of which
  /// is used (`reserve`) takes its pages at once; a sparse one (the point-to-point rings, sized for every pair of
  /// ranks but touched only by the pairs that talk) takes them as they are touched.
  static shm_mapping open(const std::string& name, std::size_t bytes, bool create, bool exclusive, int rank,
                          bool reserve = true) {
    const int flags = O_RDWR | (create ? O_CREAT : 0) | (exclusive ? O_EXCL : 0);
    socket_fd fd(::shm_open(name.c_str(), flags, 0600));
    if (!fd.valid() || (create && ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0))
      throw error("cannot open the shared-memory segment " + name + ": " + errno_text(errno) +
                      "; check that /dev/shm is mounted with room, or set DDP_SHM=0 to use the sockets only",
                  rank, errno);
    if (create && reserve)
      if (const int code = take_pages(fd.get(), bytes); code != 0) {
        ::shm_unlink(name.c_str());
        throw error("cannot reserve " + std::to_string(bytes >> 10) + " KiB of /dev/shm for the shared-memory "
                        "segment " + name + no_room(code),
                    rank, code);
      }
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED)
      throw error("cannot map the shared-memory segment " + name + ": " + errno_text(errno) +
                      "; raise the memory limits, or set DDP_SHM=0 to use the sockets only",
                  rank, errno);
    shm_mapping m;
    m.base_ = static_cast<char*>(p);
    m.bytes_ = bytes;
    return m;
  }

  /// Takes the pages of the segment behind `fd` now, so that a full /dev/shm is an error here and not a SIGBUS at
  /// the first touch: 0, or the error (no room is ENOSPC, also when /dev/shm reports too little free before).
  static int take_pages(int fd, std::size_t bytes) {
    struct stat st {};
    struct statvfs fs {};
    if (::fstat(fd, &st) == 0 && ::fstatvfs(fd, &fs) == 0) {
      const std::size_t held = static_cast<std::size_t>(st.st_blocks) * 512;  // pages another rank reserved
      const std::size_t free = static_cast<std::size_t>(fs.f_bavail) * fs.f_frsize;
      if (held < bytes && bytes - held > free) return ENOSPC;
    }
    int code = 0;
    while ((code = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes))) == EINTR) {
    }
    return code;
  }

  /// What follows "cannot ... of /dev/shm for X" when /dev/shm had no room: the error `code`, the room left and
  /// the fixes.
  static std::string no_room(int code) {
    return ": " + errno_text(code) + " (" + shm_room() + "); give /dev/shm more room (docker run --shm-size=1g, "
           "or mount -o remount,size=1g /dev/shm), or set DDP_SHM=0 to use the sockets only";
  }
  /// "/dev/shm: 12 MiB free of 64 MiB" (KiB below 4 MiB), or what stopped the look.
  static std::string shm_room() {
    struct statvfs fs {};
    if (::statvfs("/dev/shm", &fs) != 0) return "/dev/shm: " + errno_text(errno);
    const auto size = [&](fsblkcnt_t blocks) {
      const std::size_t bytes = static_cast<std::size_t>(blocks) * fs.f_frsize;
      return bytes >= (std::size_t{4} << 20) ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes >> 10) + " KiB";
    };
    return "/dev/shm: " + size(fs.f_bavail) + " free of " + size(fs.f_blocks);
  }

  [[nodiscard]] char* data() const noexcept { return base_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  [[nodiscard]] bool valid() const noexcept { return base_ != nullptr; }
  void reset() noexcept {
    if (base_ != nullptr) ::munmap(base_, bytes_);
    base_ = nullptr;
    bytes_ = 0;
  }

 private:
  char* base_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Counts a mapping of segment `name` in its word `mapped`; the rank that completes the count of `ranks`
/// unlinks the name (every rank has the segment mapped by then, so none opens it afterwards).
inline void count_mapping(std::atomic<std::uint32_t>& mapped, const std::string& name, int ranks) {
  if (mapped.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint32_t>(ranks)) ::shm_unlink(name.c_str());
}

}  // namespace ddp::tcp::detail
