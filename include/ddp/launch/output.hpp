#pragma once
/// \file How ddp::launch::spawn hands its ranks' output on. Each rank's stdout and stderr arrive through pipes; in
/// forward mode they go to the launcher's own, line by line with a "[rank R] " prefix. A line ends at '\n', or at
/// '\r' (a progress bar redraws its line with it, and shows as it goes); a line longer than max_line bytes goes out
/// in pieces of that size, each ended with a newline, so a rank that never writes one costs bounded memory. In
/// capture mode the bytes are kept whole, in order (tests read them).

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace ddp::launch::detail {

/// The longest piece of a line the launcher holds before it forwards it.
inline constexpr std::size_t max_line = 64 * 1024;

/// write(2) all of `data`, retrying on EINTR and short writes; errors are dropped (the reader went away).
inline void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t k = ::write(fd, data.data(), data.size());
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return;
    data.remove_prefix(static_cast<std::size_t>(k));
  }
}

/// One pipe from a rank: where its bytes go and the unfinished line.
struct stream {
  int fd = -1;                     ///< read end, -1 once closed
  int target = -1;                 ///< forward: the launcher's fd (1 or 2); capture: -1
  int global = 0;                  ///< the rank's RANK, in its lines' prefix
  std::string* capture = nullptr;  ///< capture: where the bytes go
  std::string pending{};           ///< forward: bytes after the last line end (fewer than max_line)
};

/// Hands `n` bytes read from `s` on: whole lines (and pieces of max_line bytes) prefixed to the target, or
/// appended to the capture.
inline void deliver(stream& s, const char* data, std::size_t n) {
  if (s.target < 0) {
    s.capture->append(data, n);
    return;
  }
  s.pending.append(data, n);
  const std::string prefix = "[rank " + std::to_string(s.global) + "] ";
  std::string out;
  std::size_t start = 0;
  while (start < s.pending.size()) {
    std::size_t end = s.pending.find_first_of("\n\r", start);
    if (end != std::string::npos && end - start < max_line) {
      if (s.pending[end] == '\r' && end + 1 < s.pending.size() && s.pending[end + 1] == '\n') ++end;  // "\r\n": one end
      out += prefix;
      out.append(s.pending, start, end + 1 - start);
      start = end + 1;
    } else if (s.pending.size() - start >= max_line) {  // no line end within max_line bytes: a piece
      out += prefix;
      out.append(s.pending, start, max_line);
      out += '\n';
      start += max_line;
    } else {
      break;
    }
  }
  s.pending.erase(0, start);
  write_all(s.target, out);
}

/// The rank closed the stream: a last line without a newline still goes out, with one.
inline void finish(stream& s) {
  if (s.fd >= 0) ::close(s.fd);
  s.fd = -1;
  if (s.target >= 0 && !s.pending.empty()) {
    write_all(s.target, "[rank " + std::to_string(s.global) + "] " + s.pending + "\n");
    s.pending.clear();
  }
}

/// Reads what is available on every open stream, waiting at most `wait_ms` for the first byte or
/// for `wake_fd` (when >= 0) to become readable; the caller reads `wake_fd` itself.
inline void pump(std::vector<stream>& streams, int wait_ms, int wake_fd = -1) {
  std::vector<pollfd> fds;
  std::vector<std::size_t> which;
  if (wake_fd >= 0) fds.push_back({wake_fd, POLLIN, 0});
  const std::size_t first_stream = fds.size();
  for (std::size_t i = 0; i < streams.size(); ++i)
    if (streams[i].fd >= 0) {
      fds.push_back({streams[i].fd, POLLIN, 0});
      which.push_back(i);
    }
  if (::poll(fds.data(), fds.size(), wait_ms) <= 0) return;  // timeout, or EINTR: the caller looks again
  char buf[16384];
  for (std::size_t k = first_stream; k < fds.size(); ++k) {
    if (fds[k].revents == 0) continue;
    stream& s = streams[which[k - first_stream]];
    const ssize_t got = ::read(s.fd, buf, sizeof buf);
    if (got > 0)
      deliver(s, buf, static_cast<std::size_t>(got));
    else if (got == 0 || errno != EINTR)
      finish(s);
  }
}

}  // namespace ddp::launch::detail
