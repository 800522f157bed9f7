#pragma once
/// \file The job's rendezvous port and token when the caller of spawn gives none: a port free right now and 128
/// random bits.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <utility>

#include <ddp/launch/exit_order.hpp>

namespace ddp::launch::detail {

/// The range the kernel draws ports from for connect() and bind(0) (ip_local_port_range), or Linux's default.
inline std::pair<int, int> ephemeral_ports() {
  int lo = 0;
  int hi = 0;
  if (std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range"); in >> lo >> hi && lo <= hi) return {lo, hi};
  return {32768, 60999};
}

/// Binds a TCP socket to `port` on every interface (0: the kernel picks one) and closes it: the port it got, or
/// 0 where the port is taken (a listener, a connection, a TIME_WAIT).
inline std::uint16_t probe_port(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw_errno("open a socket to find a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(port);
  socklen_t len = sizeof a;
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int code = errno;
  ::close(fd);
  errno = code;
  return bound ? ntohs(a.sin_port) : 0;
}

/// A TCP port free on every interface right now, drawn at random from 20000..65535 outside the ephemeral range:
/// no connection or bind(0) of another process on the host can take it before the job binds it.
inline std::uint16_t free_port() {
  const auto [lo, hi] = ephemeral_ports();
  constexpr int first = 20000;
  constexpr int last = 65535;
  const int below = std::max(0, std::min(lo, last + 1) - first);  // first..lo-1
  const int above_first = std::max(hi + 1, first);
  const int above = std::max(0, last + 1 - above_first);  // above_first..last
  if (below + above > 0) {
    std::random_device entropy;
    std::uniform_int_distribution<int> pick(0, below + above - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int i = pick(entropy);
      const auto port = static_cast<std::uint16_t>(i < below ? first + i : above_first + (i - below));
      if (probe_port(port) == port) return port;
    }
  }
  // Every port outside the ephemeral range is taken (or there is none): let the kernel choose one inside it.
  const std::uint16_t port = probe_port(0);
  if (port == 0) throw_errno("bind a socket to port 0 to find a free port");
  return port;
}

/// 128 random bits as 32 hex digits.
inline std::string random_token() {
  std::random_device rd;
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t w = rd();
    for (int b = 28; b >= 0; b -= 4) s += digits[(w >> b) & 0xFU];
  }
  return s;
}

}  // namespace ddp::launch::detail
