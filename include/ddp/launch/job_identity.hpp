#pragma once
/// \file The job's rendezvous port and token when the caller of spawn gives none: a port free right now and 128
/// random bits.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <random>
#include <string>

#include <ddp/launch/exit_order.hpp>

namespace ddp::launch::detail {

/// A TCP port free on every interface right now (bind port 0, read it back, close).
inline std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw_errno("open a socket to find a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int code = errno;
    ::close(fd);
    errno = code;
    throw_errno("bind a socket to port 0 to find a free port");
  }
  ::close(fd);
  return ntohs(a.sin_port);
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
