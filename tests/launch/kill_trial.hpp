#pragma once
// Kill trials: one rank is SIGKILLed and every other rank exits non-zero as soon as it sees its peer
// die, as real ranks do on ddp::peer_lost. The launcher must blame the killed rank every time.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>

namespace kill_trial {

/// The exit code of a rank that lost its peer.
inline constexpr int peer_lost_code = 10;

/// The number of trials: DDP_KILL_TRIALS when set (1..1000), else `fallback`.
inline int trials(int fallback) {
  const char* v = std::getenv("DDP_KILL_TRIALS");
  const int n = v == nullptr ? fallback : std::atoi(v);
  return n < 1 || n > 1000 ? fallback : n;
}

/// Exits with `code` after writing `why` to stderr.
[[noreturn]] inline void leave(int code, const std::string& why) {
  const std::string line = why + "\n";
  [[maybe_unused]] const auto ignored = ::write(STDERR_FILENO, line.data(), line.size());
  ::_exit(code);
}

/// One rank of a trial, from the launcher's environment. Rank `victim` listens on 127.0.0.1:MASTER_PORT,
/// accepts a connection from each other rank, then SIGKILLs itself; the others connect (retrying for at
/// most 10 s), wait for the connection to close and exit peer_lost_code at once.
[[noreturn]] inline void run_rank(int rank, int n, int victim) {
  const auto port = static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (rank == victim) {
    const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(lfd, n) != 0)
      leave(2, "victim: cannot listen on 127.0.0.1:" + std::to_string(port));
    for (int k = 1; k < n; ++k)
      if (::accept(lfd, nullptr, nullptr) < 0) leave(2, "victim: accept failed");
    ::raise(SIGKILL);
  }
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int fd = -1;
  while (true) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    ::close(fd);
    if (std::chrono::steady_clock::now() > give_up) leave(3, "survivor: no victim to connect to");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  char byte = 0;
  while (::recv(fd, &byte, 1, 0) > 0) {
  }
  leave(peer_lost_code, "rank " + std::to_string(rank) + ": peer lost");
}

}  // namespace kill_trial
