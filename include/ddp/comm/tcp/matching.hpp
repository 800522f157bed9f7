#pragma once
/// \file Point-to-point matching, per peer: a recv waits for the first send with its group and tag, in
/// posting order; a send that arrives first is kept (a stray) until its recv comes. A recv that no send
/// matches before its deadline is withdrawn, so a late frame becomes a stray and never writes into the
/// abandoned buffer.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/work.hpp>

namespace ddp::tcp::detail {

/// A recv waiting for its send.
struct posted_recv {
  std::uint32_t group = 0;
  std::int32_t tag = 0;
  frame_header want;  ///< the header its send must carry (count and dtype)
  char* dest = nullptr;
  std::shared_ptr<ddp::detail::completion> done;
  clock::time_point deadline{};  ///< past it the recv fails and forgets its buffer
  std::chrono::milliseconds timeout{};
};

/// A send frame that arrived before its recv.
struct stray_frame {
  frame_header hdr;
  std::vector<char> data;
};

/// True when a send's frame `got` fits the recv `r` (same count and dtype).
inline bool fits(const posted_recv& r, const frame_header& got) {
  return got.type == r.want.type && got.count == r.want.count;
}

/// The recvs posted for one peer and the sends it made that no recv has taken yet.
class mailbox {
 public:
  /// Posts a recv behind the others.
  void post(posted_recv r) { recvs_.push_back(std::move(r)); }

  /// Removes and returns the oldest recv for the send `h` (same group and tag), if any.
  [[nodiscard]] std::optional<posted_recv> take_recv(const frame_header& h) {
    const auto it = std::find_if(recvs_.begin(), recvs_.end(),
                                 [&](const posted_recv& r) { return r.group == h.group && r.tag == h.tag; });
    if (it == recvs_.end()) return std::nullopt;
    std::optional<posted_recv> r(std::move(*it));
    recvs_.erase(it);
    return r;
  }

  /// Keeps a send no recv has taken yet.
  void keep(stray_frame s) { strays_.push_back(std::move(s)); }

  /// Removes and returns the oldest stray send of `group` with `tag`, if any.
  [[nodiscard]] std::optional<stray_frame> take_stray(std::uint32_t group, std::int32_t tag) {
    const auto it = std::find_if(strays_.begin(), strays_.end(),
                                 [&](const stray_frame& s) { return s.hdr.group == group && s.hdr.tag == tag; });
    if (it == strays_.end()) return std::nullopt;
    std::optional<stray_frame> s(std::move(*it));
    strays_.erase(it);
    return s;
  }

  /// True while recvs wait.
  [[nodiscard]] bool waiting() const { return !recvs_.empty(); }

  /// The earliest deadline of the recvs posted, or time_point::max().
  [[nodiscard]] clock::time_point next_deadline() const {
    auto first = clock::time_point::max();
    for (const auto& r : recvs_) first = std::min(first, r.deadline);
    return first;
  }

  /// Withdraws the recvs whose deadline has passed at `now`, failing each with `error(recv)`.
  template <class MakeError>
  void expire(clock::time_point now, MakeError error) {
    std::erase_if(recvs_, [&](const posted_recv& r) {
      if (r.deadline > now) return false;
      r.done->fail(error(r));
      return true;
    });
  }

  /// Fails every posted recv with `e` and forgets them.
  void fail_all(const std::exception_ptr& e) {
    for (auto& r : recvs_) r.done->fail(e);
    recvs_.clear();
  }

 private:
  std::deque<posted_recv> recvs_;
  std::deque<stray_frame> strays_;
};

}  // namespace ddp::tcp::detail
