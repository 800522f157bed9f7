#pragma once
/// \file Thin POSIX socket layer of the TCP backend: owned descriptors, listening, connecting with
/// retries, blocking transfers with a deadline, address and interface lookup.

#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <utility>

#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

using clock = std::chrono::steady_clock;

/// "what: strerror(code)".
inline std::string errno_text(int code) { return std::string(std::strerror(code)); }

/// An owned file descriptor, closed on destruction.
class socket_fd {
 public:
  socket_fd() = default;
  explicit socket_fd(int fd) noexcept : fd_(fd) {}
  socket_fd(socket_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  socket_fd& operator=(socket_fd&& o) noexcept {
    if (this != &o) { reset(); fd_ = std::exchange(o.fd_, -1); }
    return *this;
  }
  socket_fd(const socket_fd&) = delete;
  socket_fd& operator=(const socket_fd&) = delete;
  ~socket_fd() { reset(); }
  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

/// An IPv4 endpoint.
struct endpoint {
  std::string host;      ///< dotted address
  std::uint16_t port{};  ///< port
  [[nodiscard]] std::string str() const { return host + ":" + std::to_string(port); }
};

inline void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

/// TCP_NODELAY (frames are sent whole) and large kernel buffers for the data sockets.
inline void tune_data_socket(int fd, int buffer_bytes) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof buffer_bytes);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof buffer_bytes);
  }
}

/// Resolves `host` (name or dotted address) to an IPv4 address; throws config_error naming `what`.
inline sockaddr_in resolve(const std::string& host, std::uint16_t port, int rank, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr)
    throw config_error("cannot resolve " + what + " '" + host + "' (" + ::gai_strerror(rc) +
                           "); set it to an IPv4 address or a host name this machine can resolve",
                       rank);
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  addr.sin_port = htons(port);
  return addr;
}

inline endpoint to_endpoint(const sockaddr_in& a) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof text);
  return {text, ntohs(a.sin_port)};
}

/// The local address of a connected or bound socket.
inline endpoint local_endpoint(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return to_endpoint(a);
}

/// The remote address of a connected socket.
inline endpoint remote_endpoint(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  ::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return to_endpoint(a);
}

/// The interface name that carries IPv4 address `host`, or "" when none does.
inline std::string interface_of(const std::string& host) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string name;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next)
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET &&
        to_endpoint(*reinterpret_cast<sockaddr_in*>(i->ifa_addr)).host == host) {
      name = i->ifa_name;
      break;
    }
  ::freeifaddrs(list);
  return name;
}

/// The IPv4 address of `spec`: an interface name (eth0) or an address; throws config_error otherwise.
inline std::string interface_address(const std::string& spec, int rank) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    std::string address;
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next)
      if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET && spec == i->ifa_name) {
        address = to_endpoint(*reinterpret_cast<sockaddr_in*>(i->ifa_addr)).host;
        break;
      }
    ::freeifaddrs(list);
    if (!address.empty()) return address;
  }
  return to_endpoint(resolve(spec, 0, rank, "interface (DDP_INTERFACE)")).host;
}

/// A listening socket bound to `host:port` (port 0: any free port).
inline socket_fd listen_on(const std::string& host, std::uint16_t port, int rank, const std::string& what) {
  socket_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw error("cannot create a socket for " + what + ": " + errno_text(errno), rank, errno);
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr = resolve(host, port, rank, what + " address");
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd.get(), 128) != 0)
    throw config_error("cannot listen on " + host + ":" + std::to_string(port) + " for " + what + ": " +
                           errno_text(errno) + "; pick a free port (MASTER_PORT) and an address of this host",
                       rank, errno);
  set_nonblocking(fd.get());
  return fd;
}

/// Milliseconds left until `deadline`, at least 0, for poll().
inline int poll_ms(clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()).count();
  return left <= 0 ? 0 : (left > 1'000'000 ? 1'000'000 : static_cast<int>(left));
}

/// Connects non-blocking socket `fd` to `addr`, waiting until `deadline` at most (an address that drops
/// packets does not hold the caller for the kernel's minutes of SYN retries); 0, or the errno of the failure.
inline int connect_by(int fd, const sockaddr_in& addr, clock::time_point deadline) {
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  pollfd p{fd, POLLOUT, 0};
  int k = 0;
  while ((k = ::poll(&p, 1, poll_ms(deadline))) < 0 && errno == EINTR) {
  }
  if (k <= 0) return k == 0 ? ETIMEDOUT : errno;
  int code = 0;
  socklen_t len = sizeof code;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &code, &len);
  return code;
}

/// Connects to `host:port`, retrying with exponential backoff (10 ms .. 1 s) until `deadline`.
inline socket_fd connect_with_retry(const std::string& host, std::uint16_t port, clock::time_point deadline, int rank,
                                    const std::string& what, const std::string& fix) {
  const sockaddr_in addr = resolve(host, port, rank, what + " address");
  auto backoff = std::chrono::milliseconds(10);
  int last = 0;
  while (true) {
    socket_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) throw error("cannot create a socket: " + errno_text(errno), rank, errno);
    last = connect_by(fd.get(), addr, deadline);
    if (last == 0) return fd;
    if (clock::now() + backoff >= deadline)
      throw timeout_error("could not reach " + what + " at " + host + ":" + std::to_string(port) +
                              " before the connect deadline (last error: " + errno_text(last) + "); " + fix,
                          rank, last);
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

/// Why a blocking transfer stopped early.
enum class io_status { ok, closed, timed_out, failed };

/// Sends `n` bytes on non-blocking `fd`, waiting in poll up to `deadline`.
inline io_status send_all(int fd, const void* data, std::size_t n, clock::time_point deadline) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) { p += k; n -= static_cast<std::size_t>(k); continue; }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return io_status::closed;
    pollfd pfd{fd, POLLOUT, 0};
    if (::poll(&pfd, 1, poll_ms(deadline)) == 0) return io_status::timed_out;
  }
  return io_status::ok;
}

/// Receives exactly `n` bytes on non-blocking `fd`, waiting in poll up to `deadline`.
inline io_status recv_all(int fd, void* data, std::size_t n, clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) { p += k; n -= static_cast<std::size_t>(k); continue; }
    if (k == 0) return io_status::closed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return io_status::failed;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, poll_ms(deadline)) == 0) return io_status::timed_out;
  }
  return io_status::ok;
}

}  // namespace ddp::tcp::detail

namespace ddp::tcp::detail {
/// Writes "ddp [rank R]: tcp: text" to stderr in one write, so lines of concurrent ranks do not interleave.
inline void log_line(int rank, const std::string& text) {
  const std::string line = "ddp [rank " + std::to_string(rank) + "]: tcp: " + text + "\n";
  [[maybe_unused]] const auto n = ::write(2, line.data(), line.size());
}
}  // namespace ddp::tcp::detail
