#pragma once
/// \file Accepting connections that must open with a fixed-size handshake (rank 0's store, every rank's
/// mesh port, node 0's launcher), each first sent a fresh challenge to sign (auth.hpp), under limits a stranger
/// cannot exceed: at most the handshake's bytes are read before it is checked, each connection gets a handshake
/// deadline, the handshakes in progress are capped (the oldest goes first), all of them progress at once, and a
/// process out of descriptors backs off instead of spinning.

#include <sys/timerfd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/tcp/auth.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// What a listener grants a connection that has not yet sent its whole handshake.
struct handshake_limits {
  std::chrono::milliseconds timeout{10000};  ///< the handshake must arrive within this (DDP_HANDSHAKE_TIMEOUT_MS)
  std::size_t max_pending = 64;              ///< handshakes in progress at once (DDP_MAX_PENDING_HANDSHAKES)
};

/// How long a listener out of descriptors leaves new connections in the kernel's queue before retrying.
inline constexpr std::chrono::milliseconds accept_backoff{100};

/// A connection whose handshake bytes have all arrived (not yet checked).
struct arrival {
  socket_fd fd;                     ///< the connection, non-blocking
  std::string from;                 ///< its remote "addr:port"
  std::vector<std::uint8_t> hello;  ///< exactly the handshake's size
  challenge nonce{};                ///< what it was sent to sign
};

/// A listening socket and its handshakes in progress; poll its descriptors from any loop (fill, on_events).
class handshake_acceptor {
 public:
  /// Accepts on `listener`; every connection must send `hello_bytes` first. `what` names the port in logs.
  handshake_acceptor(socket_fd listener, std::size_t hello_bytes, handshake_limits limits, int rank, std::string what)
      : listener_(std::move(listener)), hello_bytes_(hello_bytes), limits_(limits), rank_(rank),
        what_(std::move(what)) {
    timer_ = socket_fd(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
    if (!timer_.valid())
      throw error("cannot create a timer for " + what_ + ": " + errno_text(errno) + "; raise the descriptor limit",
                  rank, errno);
  }

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const { return local_endpoint(listener_.get()).port; }
  /// How many descriptors fill() appends.
  [[nodiscard]] std::size_t descriptors() const { return 2 + pending_.size(); }

  /// Stops listening (the port is free for another listener); handshakes in progress go on.
  void close_listener() noexcept { listener_.reset(); }

  /// Appends the descriptors to poll: the listener (ignored while backing off or closed), the timer, the handshakes.
  void fill(std::vector<pollfd>& fds) const {
    fds.push_back({backing_off_ || !listener_.valid() ? -1 : listener_.get(), POLLIN, 0});
    fds.push_back({timer_.get(), POLLIN, 0});
    for (const auto& p : pending_) fds.push_back({p.fd.get(), POLLIN, 0});
  }

  /// Handles the poll results of the descriptors fill() appended at `base`; returns the completed handshakes.
  std::vector<arrival> on_events(const std::vector<pollfd>& fds, std::size_t base) {
    std::vector<arrival> done;
    if (fds[base + 1].revents & POLLIN) {
      std::uint64_t expirations = 0;
      [[maybe_unused]] const auto n = ::read(timer_.get(), &expirations, sizeof expirations);
    }
    const auto now = clock::now();
    for (std::size_t i = 0; i < pending_.size() && base + 2 + i < fds.size(); ++i)
      if (fds[base + 2 + i].revents != 0) read_hello(pending_[i], done);
    for (auto& p : pending_)
      if (p.fd.valid() && now >= p.deadline)
        refuse(p.fd, p.from, "no complete handshake within " + std::to_string(limits_.timeout.count()) +
                                 " ms (DDP_HANDSHAKE_TIMEOUT_MS)");
    std::erase_if(pending_, [](const pending& p) { return !p.fd.valid(); });
    if (backing_off_ && now >= retry_at_) backing_off_ = false;
    if (!backing_off_ && listener_.valid() && (fds[base].revents & POLLIN)) accept_some(now);
    arm_timer();
    return done;
  }

  /// Logs that the connection from `from` was refused because `why` (`who`: what it probably is, or the
  /// fix), and closes it: bytes already queued are discarded unread (up to 1 MiB, no copy), so a stranger that
  /// stopped sending sees an orderly close.
  void refuse(socket_fd& fd, const std::string& from, const std::string& why,
              const std::string& who = "a process outside this job, or a rank started with another DDP_TOKEN") const {
    log_line(rank_, "refused a connection to " + what_ + " from " + from + ": " + why + " (" + who + "); the job goes on");
    [[maybe_unused]] const auto n = ::recv(fd.get(), nullptr, 1 << 20, MSG_TRUNC | MSG_DONTWAIT);
    fd.reset();
  }

 private:
  struct pending {
    socket_fd fd;
    std::string from;
    std::vector<std::uint8_t> hello;
    clock::time_point deadline;
    challenge nonce{};
  };

  void read_hello(pending& p, std::vector<arrival>& done) {
    const std::size_t have = p.hello.size();
    p.hello.resize(hello_bytes_);
    const ssize_t k = ::recv(p.fd.get(), p.hello.data() + have, hello_bytes_ - have, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      p.hello.resize(have);
      return;
    }
    if (k <= 0) {
      if (have > 0) refuse(p.fd, p.from, "it closed after a partial handshake");
      p.fd.reset();
      return;
    }
    p.hello.resize(have + static_cast<std::size_t>(k));
    if (p.hello.size() < hello_bytes_) return;
    done.push_back({std::move(p.fd), std::move(p.from), std::move(p.hello), p.nonce});
  }

  void accept_some(clock::time_point now) {
    for (int n = 0; n < 256; ++n) {  // a burst at a time, so the caller's other descriptors get their turn
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int code = errno;
        if (code == EINTR || code == ECONNABORTED || code == EPROTO) continue;
        if (code == EMFILE || code == ENFILE || code == ENOBUFS || code == ENOMEM) back_off(now, code);
        return;
      }
      starved_logged_ = false;
      if (pending_.size() >= limits_.max_pending) {
        if (!crowd_logged_)
          log_line(rank_, std::to_string(limits_.max_pending) + " connections to " + what_ +
                              " are in their handshake at once (DDP_MAX_PENDING_HANDSHAKES): closing the oldest "
                              "first; the job goes on (logged once)");
        crowd_logged_ = true;
        pending_.front().fd.reset();
        pending_.erase(pending_.begin());
      }
      socket_fd owned(fd);
      std::string from = remote_endpoint(fd).str();
      const challenge nonce = random_challenge();  // a fresh socket's send buffer always takes 16 bytes
      if (::send(fd, nonce.data(), nonce.size(), MSG_DONTWAIT | MSG_NOSIGNAL) != static_cast<ssize_t>(nonce.size()))
        continue;  // gone already
      pending_.push_back({std::move(owned), std::move(from), {}, now + limits_.timeout, nonce});
    }
  }

  void back_off(clock::time_point now, int code) {
    if (!starved_logged_)
      log_line(rank_, "cannot accept a connection to " + what_ + ": " + errno_text(code) +
                          "; new connections wait in the kernel's queue and are retried every " +
                          std::to_string(accept_backoff.count()) +
                          " ms; raise the descriptor limit (ulimit -n) or close files this process keeps open");
    starved_logged_ = true;
    backing_off_ = true;
    retry_at_ = now + accept_backoff;
  }

  /// Wakes the poll loop at the first handshake deadline or at the end of a back-off; disarmed when none.
  void arm_timer() {
    clock::time_point next = clock::time_point::max();
    for (const auto& p : pending_) next = std::min(next, p.deadline);
    if (backing_off_) next = std::min(next, retry_at_);
    itimerspec spec{};
    if (next != clock::time_point::max()) {
      const auto ns = std::max<std::int64_t>(
          1, std::chrono::duration_cast<std::chrono::nanoseconds>(next.time_since_epoch()).count());
      spec.it_value.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
      spec.it_value.tv_nsec = static_cast<long>(ns % 1'000'000'000);
    }
    ::timerfd_settime(timer_.get(), TFD_TIMER_ABSTIME, &spec, nullptr);
  }

  socket_fd listener_;
  socket_fd timer_;
  std::size_t hello_bytes_;
  handshake_limits limits_;
  int rank_;
  std::string what_;
  std::vector<pending> pending_;
  bool backing_off_ = false;
  clock::time_point retry_at_{};
  bool starved_logged_ = false;
  bool crowd_logged_ = false;
};

}  // namespace ddp::tcp::detail
