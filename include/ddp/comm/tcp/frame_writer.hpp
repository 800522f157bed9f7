#pragma once
/// \file The sending half of a peer stream: a queue of frames written with sendmsg as the socket accepts
/// them, header and payload in one call, straight out of the caller's buffers (no copy). On abort the frame
/// already half written is completed, so the peer can still parse the abort notice behind it.

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstddef>
#include <exception>
#include <memory>
#include <vector>

#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/work.hpp>

namespace ddp::tcp::detail {

/// One queued frame.
struct tx_item {
  frame_header hdr;
  const char* data = nullptr;
  std::size_t sent = 0;                           ///< bytes of header + payload already written
  std::shared_ptr<ddp::detail::completion> done;  ///< finished when written (point-to-point sends)
  remote_block where{};                           ///< a remote frame's payload
  [[nodiscard]] std::size_t total() const { return sizeof(frame_header) + hdr.length; }
  [[nodiscard]] const char* payload() const {
    return (hdr.flags & frame_remote) != 0 ? reinterpret_cast<const char*>(&where) : data;
  }
};

class frame_writer {
 public:
  /// True while frames wait to be written.
  [[nodiscard]] bool pending() const { return head_ < queue_.size(); }

  /// Queues a frame; `data` (hdr.length bytes) must stay valid until it is written.
  void push(tx_item item) { queue_.push_back(std::move(item)); }

  /// Writes what the socket `fd` accepts; true if bytes moved. Returns the errno of a failed write in
  /// `failure` (0 when none); finished frames complete their `done`.
  bool write_some(int fd, int& failure) {
    bool moved = false;
    failure = 0;
    while (pending()) {
      tx_item& t = queue_[head_];
      iovec iov[2];
      int n = 0;
      if (t.sent < sizeof(frame_header))
        iov[n++] = {reinterpret_cast<char*>(&t.hdr) + t.sent, sizeof(frame_header) - t.sent};
      const std::size_t payload_done = t.sent > sizeof(frame_header) ? t.sent - sizeof(frame_header) : 0;
      if (t.hdr.length > payload_done)
        iov[n++] = {const_cast<char*>(t.payload()) + payload_done, t.hdr.length - payload_done};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(n);
      const ssize_t k = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) failure = errno;
        break;
      }
      moved = moved || k > 0;
      t.sent += static_cast<std::size_t>(k);
      if (t.sent < t.total()) break;
      if (t.done) t.done->finish();
      t.done.reset();
      if (++head_ == queue_.size()) clear();
    }
    return moved;
  }

  /// On abort: completes the frame already half written (blocking until `limit`), fails the completions of
  /// every frame still queued with `e`, and empties the queue. False if the stream was left mid-frame.
  bool abandon(int fd, std::exception_ptr e, clock::time_point limit) {
    bool clean = true;
    if (pending() && queue_[head_].sent > 0) {
      const tx_item& t = queue_[head_];
      const std::size_t header_left = t.sent < sizeof(frame_header) ? sizeof(frame_header) - t.sent : 0;
      const std::size_t payload_done = t.sent > sizeof(frame_header) ? t.sent - sizeof(frame_header) : 0;
      clean = send_all(fd, reinterpret_cast<const char*>(&t.hdr) + (sizeof(frame_header) - header_left), header_left,
                       limit) == io_status::ok &&
              send_all(fd, t.payload() + payload_done, t.hdr.length - payload_done, limit) == io_status::ok;
    }
    for (std::size_t i = head_; i < queue_.size(); ++i)
      if (queue_[i].done) queue_[i].done->fail(e);
    clear();
    return clean;
  }

 private:
  void clear() {
    queue_.clear();
    head_ = 0;
  }
  std::vector<tx_item> queue_;
  std::size_t head_ = 0;
};

}  // namespace ddp::tcp::detail
