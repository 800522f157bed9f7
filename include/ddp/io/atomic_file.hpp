#pragma once
/// \file Atomic replacement of a file or directory (checkpoints, the file:// rendezvous file), and removal of what
/// killed saves left behind.
///
/// A save to `target` works under the temporary name `<target>.tmp.<pid>.<random hex>` and holds, for its whole
/// life, an exclusive flock on the lock file `<that name>.lock`, created before the temporary and removed after it
/// (the temporary renamed into place, or removed). Before it starts, a save removes the stale temporaries of the
/// same target: entries `<target>.tmp.<id>` and `<target>.tmp.<id>.lock` (id: digits, optionally `.` and hex
/// digits) whose lock file is absent or can be locked — their saver is dead, since the kernel drops a process's
/// locks when it dies. Nothing depends on the pid in the name (pids are reused, and differ between hosts); a lock
/// file rather than the temporary itself is locked because a directory cannot be locked over NFS (which emulates
/// flock with POSIX locks on files), so files and directories take one path. A cleaner takes the lock, checks the
/// name still leads to the file it locked, and only then removes; a saver checks the same after taking its lock,
/// and picks another name when a cleaner removed its claim in between.

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ddp/core/detail/hash.hpp>
#include <ddp/core/error.hpp>

namespace ddp::detail {

/// Throws ddp::io_error "<kind> '<path>': <what> (<errno text>); <fix>".
[[noreturn]] inline void fail_on(std::string_view kind, const std::filesystem::path& path, const std::string& what,
                                 const std::string& fix, int err = 0) {
  throw io_error(std::string(kind) + " '" + path.string() + "': " + what +
                     (err != 0 ? std::string(" (") + std::strerror(err) + ")" : "") + "; " + fix,
                 -1, err);
}

/// The directory holding `path` ("." for a bare name).
inline std::filesystem::path parent_of(const std::filesystem::path& path) {
  return path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
}

/// Flushes a directory's entries to disk (what makes a rename in it survive a power loss). A file system that
/// cannot sync directories (fsync fails with EINVAL) is let through; any other failure throws ddp::io_error.
inline void sync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail_on("directory", dir, "cannot be opened to flush its entries", "check its permissions", errno);
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) fail_on("directory", dir, "flushing its entries failed", "check the disk", err);
}

/// Whether the open file `fd` is the file `path` names now (same device and inode).
inline bool names_same_file(int fd, const std::filesystem::path& path) noexcept {
  struct stat a {}, b {};
  return ::fstat(fd, &a) == 0 && ::lstat(path.c_str(), &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/// Whether `id` is what follows "<target>.tmp." in a temporary's name: digits, optionally '.' and hex digits.
inline bool is_temp_id(std::string_view id) noexcept {
  const auto dot = id.find('.');
  const auto pid = id.substr(0, dot);
  const auto all_of = [](std::string_view s, std::string_view set) { return !s.empty() && s.find_first_not_of(set) == s.npos; };
  return all_of(pid, "0123456789") && (dot == id.npos || all_of(id.substr(dot + 1), "0123456789abcdef"));
}

/// Removes the temporaries of `target` left by dead saves (see the file comment); those of live saves stay. Best
/// effort: what cannot be removed is left for a later save.
inline void remove_stale_temps(const std::filesystem::path& target) {
  namespace fs = std::filesystem;
  const fs::path dir = parent_of(target);
  const std::string prefix = target.filename().string() + ".tmp.";
  std::set<std::string> ids;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    std::string_view name = file;
    if (!name.starts_with(prefix)) continue;
    name.remove_prefix(prefix.size());
    if (name.ends_with(".lock")) name.remove_suffix(5);
    if (is_temp_id(name)) ids.emplace(name);
  }
  for (const auto& id : ids) {
    const fs::path temp = dir / (prefix + id), lock = dir / (prefix + id + ".lock");
    const int fd = ::open(lock.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) fs::remove_all(temp, ec);  // no lock file: an earlier ddp's temporary, or an orphan
      continue;
    }
    if (::flock(fd, LOCK_SH | LOCK_NB) == 0 && names_same_file(fd, lock)) {  // its saver is dead
      fs::remove_all(temp, ec);
      ::unlink(lock.c_str());
    }
    ::close(fd);
  }
}

/// A fresh temporary name beside `target`, claimed by an exclusive flock on its lock file for this object's life;
/// the destructor removes the lock file (after the owner renamed or removed the temporary).
class temp_claim {
 public:
  /// Claims a name; throws ddp::io_error when the lock file cannot be created.
  explicit temp_claim(const std::filesystem::path& target) {
    std::random_device entropy;
    for (int attempt = 0; attempt < 16; ++attempt) {
      const std::uint64_t tag = (std::uint64_t{entropy()} << 32) | entropy();
      temp_ = target.string() + ".tmp." + std::to_string(::getpid()) + "." + hex(tag);
      lock_ = temp_.string() + ".lock";
      fd_ = ::open(lock_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd_ < 0 && errno == EEXIST) continue;
      if (fd_ < 0)
        fail_on("checkpoint file", temp_, "cannot create the lock file of the temporary",
                "check that the directory exists and is writable", errno);
      int rc = 0;
      while ((rc = ::flock(fd_, LOCK_EX)) != 0 && errno == EINTR) {
      }
      if (rc == 0 && names_same_file(fd_, lock_)) return;
      ::close(fd_);  // a cleaner took the new lock file for a stale one and removed it: try another name
      fd_ = -1;
    }
    fail_on("checkpoint file", target, "no temporary name could be claimed in 16 attempts",
            "check that no other program removes files in its directory");
  }
  temp_claim(const temp_claim&) = delete;
  temp_claim& operator=(const temp_claim&) = delete;
  ~temp_claim() {
    ::unlink(lock_.c_str());
    ::close(fd_);
  }
  /// The claimed temporary name (not created by the claim).
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return temp_; }

 private:
  std::filesystem::path temp_, lock_;
  int fd_ = -1;
};

/// A file written through a claimed temporary beside `path` (stale temporaries of `path` are removed first):
/// commit() flushes it to disk, renames it over `path` and flushes the directory; destroyed uncommitted, it
/// removes the temporary.
class atomic_file {
 public:
  /// Creates the temporary, readable by everyone or, with `mode` 0600, by its owner alone; throws ddp::io_error
  /// when it cannot.
  explicit atomic_file(std::filesystem::path path, mode_t mode = 0644)
      : path_((remove_stale_temps(path), std::move(path))), claim_(path_) {
    fd_ = ::open(claim_.path().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd_ < 0)
      fail_on("checkpoint file", claim_.path(), "cannot create the temporary file",
              "check that the directory exists and is writable", errno);
  }
  atomic_file(const atomic_file&) = delete;
  atomic_file& operator=(const atomic_file&) = delete;
  ~atomic_file() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(claim_.path().c_str());
  }
  /// Appends `data`, retrying short writes.
  void write(std::span<const std::byte> data) {
    while (!data.empty()) {
      const ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail_on("checkpoint file", claim_.path(), "writing failed", "check free disk space and permissions", errno);
      data = data.subspan(static_cast<std::size_t>(n));
    }
  }
  /// Overwrites bytes at `offset` (already written).
  void write_at(std::uint64_t offset, std::span<const std::byte> data) {
    if (::pwrite(fd_, data.data(), data.size(), static_cast<off_t>(offset)) != static_cast<ssize_t>(data.size()))
      fail_on("checkpoint file", claim_.path(), "writing failed", "check free disk space and permissions", errno);
  }
  /// Flushes the file, renames it over the path, flushes the directory.
  void commit() {
    if (::fsync(fd_) != 0) fail_on("checkpoint file", claim_.path(), "fsync failed", "check the disk", errno);
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) fail_on("checkpoint file", claim_.path(), "closing failed", "check the disk", errno);
    if (::rename(claim_.path().c_str(), path_.c_str()) != 0)
      fail_on("checkpoint file", path_, "renaming the temporary file over it failed",
              "check permissions of the directory", errno);
    committed_ = true;
    sync_directory(parent_of(path_));
  }

 private:
  std::filesystem::path path_;
  temp_claim claim_;  // released after the destructor's body removed an uncommitted temporary
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace ddp::detail
