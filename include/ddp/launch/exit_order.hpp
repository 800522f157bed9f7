#pragma once
/// \file The launcher's errors and the order in which its ranks' exits began, for blaming the rank
/// that failed first rather than a peer that failed because it died.

#include <fcntl.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <ddp/core/error.hpp>

namespace ddp::launch {

/// A system call of the launcher itself failed (fork, pipe, socket); native_code() is errno.
class launch_error : public ddp::error {
 public:
  using error::error;
};

namespace detail {

/// A rank ended by signal `sig` crashed (SIGKILL, SIGSEGV, ...: no launcher sends those, nor does a rank that
/// fails with an exception), so it is a root cause: the peers of a lost rank fail with an exit code or SIGABRT
/// (std::terminate), and SIGTERM, SIGINT and SIGHUP come from a launcher or the user.
inline bool crash_signal(int sig) noexcept {
  return sig > 0 && sig != SIGABRT && sig != SIGTERM && sig != SIGINT && sig != SIGHUP;
}

[[noreturn]] inline void throw_errno(const std::string& what) {
  const int code = errno;
  throw launch_error("the launcher could not " + what + ": " + std::strerror(code) +
                         "; check the process and file-descriptor limits (ulimit -u, ulimit -n)",
                     -1, code);
}

/// Which ranks' exits have begun, in the kernel's order. Each rank holds the write end of a pipe of its
/// own (its "sentinel") at the highest descriptor it may open: a process's descriptors are released
/// from the highest down when it exits, so the sentinel closes before the rank's sockets do, and thus
/// before any peer can see it die. The launcher's epoll instance reports the sentinels' hang-ups in
/// the order they happened, however late it looks. SIGCHLD is blocked in the calling thread and read
/// from a signalfd in the same epoll set, so the launcher also wakes as soon as a rank can be reaped.
class exit_order {
 public:
  explicit exit_order(int n) : began_(static_cast<std::size_t>(n), 0), sentinels_(static_cast<std::size_t>(n), -1) {
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (const int code = ::pthread_sigmask(SIG_BLOCK, &chld, &saved_); code != 0) {
      errno = code;
      throw_errno("block SIGCHLD to watch the ranks' exits");
    }
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    signals_ = ::signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = signals_key;
    if (epoll_ < 0 || signals_ < 0 || ::epoll_ctl(epoll_, EPOLL_CTL_ADD, signals_, &ev) != 0) {
      const int code = errno;
      release();
      errno = code;
      throw_errno("open an epoll instance and a signalfd to watch the ranks' exits");
    }
  }
  exit_order(const exit_order&) = delete;
  exit_order& operator=(const exit_order&) = delete;
  ~exit_order() { release(); }

  /// Readable when a rank's exit began or a rank can be reaped.
  [[nodiscard]] int fd() const noexcept { return epoll_; }

  /// A new sentinel pipe for `rank`: the launcher watches its read end; returns the write end (close-on-exec,
  /// for the child to place with place_sentinel and for the parent to close after the fork), or -1 on error.
  int open_sentinel(int rank) {
    int p[2] = {-1, -1};
    if (::pipe2(p, O_CLOEXEC) != 0) return -1;
    epoll_event ev{};
    ev.events = EPOLLIN;  // a hang-up is always reported
    ev.data.u64 = static_cast<std::uint64_t>(rank);
    if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, p[0], &ev) != 0) {
      const int code = errno;
      ::close(p[0]);
      ::close(p[1]);
      errno = code;
      return -1;
    }
    sentinels_[static_cast<std::size_t>(rank)] = p[0];
    return p[1];
  }

  /// In the child: moves the sentinel to the highest descriptor the rank may open (at most 65535), kept
  /// across exec; the launcher's own descriptors of this class are closed.
  void place_sentinel(int write_end) const noexcept {
    rlimit lim{};
    const rlim_t cap = 65536;
    const rlim_t top = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 ? std::min(lim.rlim_cur, cap) : 1024;
    const int high = static_cast<int>(top) - 1;
    if (high > write_end && ::dup2(write_end, high) == high) ::close(write_end);
    ::close(epoll_);
    ::close(signals_);
    for (int fd : sentinels_)
      if (fd >= 0) ::close(fd);
  }

  /// Takes the events that are ready: every sentinel that hung up gets the next number, in the order the
  /// kernel queued them; pending SIGCHLDs are consumed (they only wake the launcher).
  void update() {
    epoll_event events[64];
    for (int got = 64; got == 64;) {
      got = ::epoll_wait(epoll_, events, 64, 0);
      for (int k = 0; k < got; ++k) {
        if (events[k].data.u64 == signals_key) {
          signalfd_siginfo si{};
          while (::read(signals_, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
          }
          continue;
        }
        const auto r = static_cast<std::size_t>(events[k].data.u64);
        if ((events[k].events & (EPOLLHUP | EPOLLERR)) == 0) continue;  // bytes written to a sentinel: ignored
        ::epoll_ctl(epoll_, EPOLL_CTL_DEL, sentinels_[r], nullptr);
        ::close(sentinels_[r]);
        sentinels_[r] = -1;
        if (began_[r] == 0) began_[r] = ++count_;
      }
    }
  }

  /// Rank r was reaped: an exit whose sentinel never hung up (a child of the rank still holds it)
  /// is numbered now.
  void reaped(int r) {
    if (began_[static_cast<std::size_t>(r)] == 0) began_[static_cast<std::size_t>(r)] = ++count_;
  }

  /// The position of rank r's exit among those begun so far (1 first), 0 while it has not begun.
  [[nodiscard]] std::uint64_t began(int r) const noexcept { return began_[static_cast<std::size_t>(r)]; }

 private:
  static constexpr std::uint64_t signals_key = ~std::uint64_t{0};

  void release() noexcept {
    for (int& fd : sentinels_)
      if (fd >= 0) ::close(std::exchange(fd, -1));
    if (signals_ >= 0) ::close(signals_);
    if (epoll_ >= 0) ::close(epoll_);
    ::pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
  }

  std::vector<std::uint64_t> began_;
  std::vector<int> sentinels_;
  std::uint64_t count_ = 0;
  int epoll_ = -1;
  int signals_ = -1;
  sigset_t saved_{};
};

}  // namespace detail
}  // namespace ddp::launch
