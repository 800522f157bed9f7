#pragma once
/// \file The collective algorithms of the TCP backend, run by the progress engine one call at a time.
/// Small payloads take latency-optimal direct exchanges (one round); large ones take bandwidth-optimal
/// pipelined rings (reduce-scatter then all-gather, forwarding each segment as soon as it is ready)
/// and chains (broadcast, reduce). Sends go out of the caller's buffers without copies.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <vector>

#include <ddp/comm/tcp/channel.hpp>
#include <ddp/comm/tcp/reduce.hpp>

namespace ddp::tcp::detail {

/// Below this many payload bytes per rank, collectives exchange directly in one round.
inline constexpr std::size_t direct_limit = 64 << 10;
/// Ring and chain frames carry at most this many bytes, so receiving, reducing and forwarding overlap.
inline constexpr std::size_t segment_bytes = 512 << 10;

inline int wrap(int a, int n) { return ((a % n) + n) % n; }

/// How `count` elements split into `parts` near-equal chunks (the first ones one element shorter).
struct chunking {
  std::size_t count;
  int parts;
  std::size_t elem;
  [[nodiscard]] std::size_t first(int c) const { return static_cast<std::size_t>(c) * count / static_cast<std::size_t>(parts); }
  [[nodiscard]] std::size_t offset(int c) const { return first(c) * elem; }
  [[nodiscard]] std::size_t bytes(int c) const { return (first(c + 1) - first(c)) * elem; }
};

/// Calls f(offset, length) for each segment of `bytes`.
template <class F>
void for_segments(std::size_t bytes, F f) {
  for (std::size_t off = 0; off < bytes; off += segment_bytes) f(off, std::min(segment_bytes, bytes - off));
}

/// Ring reduce-scatter: chunk c of the result is the reduction of every rank's chunk c of `in`;
/// intermediate chunks land in `acc` (may be `in`), this rank's final chunk in `mine`. With
/// `forward`, each finished segment of `mine` is averaged if needed and sent on as the first
/// all-gather step.
inline void ring_reduce_scatter(channel& ch, const char* in, char* acc, char* mine, const chunking& L, bool forward) {
  const int n = ch.size();
  const int r = ch.rank();
  const int left = wrap(r - 1, n);
  const int right = wrap(r + 1, n);
  const auto& c = ch.what();
  char* tmp = ch.scratch(0, segment_bytes);
  const int first = wrap(r - 1, n);
  for_segments(L.bytes(first), [&](std::size_t off, std::size_t len) { ch.send(right, in + L.offset(first) + off, len); });
  for (int s = 0; s < n - 1; ++s) {
    const int k = wrap(r - s - 2, n);
    const bool last = s == n - 2;
    char* dst = last ? mine : acc + L.offset(k);
    for_segments(L.bytes(k), [&](std::size_t off, std::size_t len) {
      ch.recv(left, tmp, len);
      reduce_bytes(c.type, dst + off, in + L.offset(k) + off, tmp, len / L.elem, c.op);
      if (last && forward) finish_avg_bytes(c.type, dst + off, len / L.elem, c.op, n);
      if (!last || forward) ch.send(right, dst + off, len);
    });
  }
}

/// Ring all-gather over `out` (this rank's chunk already in place and, unless `post_own` is false,
/// not yet sent): each segment received from the left is forwarded to the right at once.
inline void ring_all_gather(channel& ch, char* out, const chunking& L, bool post_own) {
  const int n = ch.size();
  const int r = ch.rank();
  const int left = wrap(r - 1, n);
  const int right = wrap(r + 1, n);
  if (post_own)
    for_segments(L.bytes(r), [&](std::size_t off, std::size_t len) { ch.send(right, out + L.offset(r) + off, len); });
  for (int s = 0; s < n - 1; ++s) {
    const int k = wrap(r - s - 1, n);
    for_segments(L.bytes(k), [&](std::size_t off, std::size_t len) {
      ch.recv(left, out + L.offset(k) + off, len);
      if (s < n - 2) ch.send(right, out + L.offset(k) + off, len);
    });
  }
  ch.flush();
}

/// Receives one block of `bytes` from every other rank into block p of `blocks` (stride `bytes`).
inline void recv_from_each(channel& ch, char* blocks, std::size_t stride, std::size_t bytes) {
  thread_local std::vector<recv_part> parts;
  parts.clear();
  for (int p = 0; p < ch.size(); ++p)
    if (p != ch.rank()) parts.push_back({p, blocks + static_cast<std::size_t>(p) * stride, bytes});
  ch.recv_all(parts);
}

/// dst = block 0 (op) block 1 (op) ... in rank order over `blocks` (stride `bytes`), after copying
/// `own_data` into block `own`: every rank computes the same bits.
inline void reduce_in_rank_order(channel& ch, char* dst, char* blocks, std::size_t bytes, int own,
                                 const char* own_data) {
  const auto& c = ch.what();
  const auto block = [&](int p) { return blocks + static_cast<std::size_t>(p) * bytes; };
  std::memcpy(block(own), own_data, bytes);
  const std::size_t n_elems = bytes / size_of(c.type);
  if (ch.size() == 1) {
    std::memcpy(dst, block(0), bytes);
  } else {
    reduce_bytes(c.type, dst, block(0), block(1), n_elems, c.op);
    for (int p = 2; p < ch.size(); ++p) reduce_bytes(c.type, dst, dst, block(p), n_elems, c.op);
  }
  finish_avg_bytes(c.type, dst, n_elems, c.op, ch.size());
}

inline void all_reduce(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  auto* buf = static_cast<char*>(c.out);
  const std::size_t bytes = c.count * size_of(c.type);
  if (n == 1 || bytes == 0) return finish_avg_bytes(c.type, buf, c.count, c.op, n);
  if (bytes <= direct_limit) {
    char* blocks = ch.scratch(1, bytes * static_cast<std::size_t>(n));
    for (int p = 0; p < n; ++p)
      if (p != ch.rank()) ch.send(p, buf, bytes);
    recv_from_each(ch, blocks, bytes, bytes);
    ch.flush();
    return reduce_in_rank_order(ch, buf, blocks, bytes, ch.rank(), buf);
  }
  const chunking L{c.count, n, size_of(c.type)};
  ring_reduce_scatter(ch, buf, buf, buf + L.offset(ch.rank()), L, true);
  ring_all_gather(ch, buf, L, false);
}

inline void reduce_scatter(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  const std::size_t es = size_of(c.type);
  const std::size_t block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  if (block == 0) return;
  if (n == 1) {
    if (out != in) std::memmove(out, in, block);
    return;
  }
  if (block <= direct_limit) {
    char* received = ch.scratch(1, block * static_cast<std::size_t>(n));
    for (int p = 0; p < n; ++p)
      if (p != ch.rank()) ch.send(p, in + static_cast<std::size_t>(p) * block, block);
    recv_from_each(ch, received, block, block);
    ch.flush();
    return reduce_in_rank_order(ch, out, received, block, ch.rank(), in + static_cast<std::size_t>(ch.rank()) * block);
  }
  const chunking L{c.count * static_cast<std::size_t>(n), n, es};
  ring_reduce_scatter(ch, in, ch.scratch(1, block * static_cast<std::size_t>(n)), out, L, false);
  ch.flush();
  finish_avg_bytes(c.type, out, c.count, c.op, n);
}

inline void all_gather(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  const std::size_t block = c.count * size_of(c.type);
  auto* out = static_cast<char*>(c.out);
  char* own = out + static_cast<std::size_t>(ch.rank()) * block;
  if (block > 0 && own != c.in) std::memmove(own, c.in, block);
  if (n == 1 || block == 0) return;
  if (block * static_cast<std::size_t>(n) <= direct_limit) {
    for (int p = 0; p < n; ++p)
      if (p != ch.rank()) ch.send(p, own, block);
    recv_from_each(ch, out, block, block);
    return ch.flush();
  }
  ring_all_gather(ch, out, chunking{c.count * static_cast<std::size_t>(n), n, size_of(c.type)}, true);
}

inline void broadcast(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  auto* buf = static_cast<char*>(c.out);
  const std::size_t bytes = c.count * size_of(c.type);
  if (n == 1 || bytes == 0) return;
  if (bytes <= direct_limit) {
    if (ch.rank() == c.root) {
      for (int p = 0; p < n; ++p)
        if (p != c.root) ch.send(p, buf, bytes);
      return ch.flush();
    }
    return ch.recv(c.root, buf, bytes);
  }
  const int v = wrap(ch.rank() - c.root, n);  // position in the chain root -> root+1 -> ...
  const int prev = wrap(ch.rank() - 1, n);
  const int next = wrap(ch.rank() + 1, n);
  for_segments(bytes, [&](std::size_t off, std::size_t len) {
    if (v > 0) ch.recv(prev, buf + off, len);
    if (v < n - 1) ch.send(next, buf + off, len);
  });
  ch.flush();
}

inline void reduce(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  auto* buf = static_cast<char*>(c.out);
  const std::size_t es = size_of(c.type);
  const std::size_t bytes = c.count * es;
  if (n == 1 || bytes == 0) {
    if (ch.rank() == c.root) finish_avg_bytes(c.type, buf, c.count, c.op, n);
    return;
  }
  if (bytes <= direct_limit) {
    if (ch.rank() != c.root) {
      ch.send(c.root, buf, bytes);
      return ch.flush();
    }
    char* received = ch.scratch(1, bytes * static_cast<std::size_t>(n));
    recv_from_each(ch, received, bytes, bytes);
    return reduce_in_rank_order(ch, buf, received, bytes, ch.rank(), buf);
  }
  // Chain towards the root: position n-1 starts, each rank adds its part and forwards, the root ends.
  const int v = wrap(ch.rank() - c.root, n);
  const int toward_root = wrap(ch.rank() - 1, n);
  const int from_tail = wrap(ch.rank() + 1, n);
  char* tmp = ch.scratch(0, segment_bytes);
  char* partial = v == 0 || v == n - 1 ? nullptr : ch.scratch(1, bytes);
  for_segments(bytes, [&](std::size_t off, std::size_t len) {
    if (v == n - 1) return ch.send(toward_root, buf + off, len);
    ch.recv(from_tail, tmp, len);
    char* dst = v == 0 ? buf + off : partial + off;
    reduce_bytes(c.type, dst, buf + off, tmp, len / es, c.op);
    if (v != 0) ch.send(toward_root, dst, len);
  });
  ch.flush();
  if (v == 0) finish_avg_bytes(c.type, buf, c.count, c.op, n);
}

inline void gather(channel& ch) {
  const auto& c = ch.what();
  const std::size_t block = c.count * size_of(c.type);
  if (block == 0) return;
  if (ch.rank() != c.root) {
    ch.send(c.root, c.in, block);
    return ch.flush();
  }
  auto* out = static_cast<char*>(c.out);
  std::memmove(out + static_cast<std::size_t>(c.root) * block, c.in, block);
  recv_from_each(ch, out, block, block);
}

inline void scatter(channel& ch) {
  const auto& c = ch.what();
  const std::size_t block = c.count * size_of(c.type);
  if (block == 0) return;
  if (ch.rank() != c.root) return ch.recv(c.root, c.out, block);
  const auto* in = static_cast<const char*>(c.in);
  for (int p = 0; p < ch.size(); ++p)
    if (p != c.root) ch.send(p, in + static_cast<std::size_t>(p) * block, block);
  std::memmove(c.out, in + static_cast<std::size_t>(c.root) * block, block);
  ch.flush();
}

inline void all_to_all(channel& ch) {
  const auto& c = ch.what();
  const std::size_t block = c.count / static_cast<std::size_t>(ch.size()) * size_of(c.type);
  if (block == 0) return;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  for (int p = 0; p < ch.size(); ++p)
    if (p != ch.rank()) ch.send(p, in + static_cast<std::size_t>(p) * block, block);
  recv_from_each(ch, out, block, block);
  const std::size_t mine = static_cast<std::size_t>(ch.rank()) * block;
  ch.flush();
  std::memmove(out + mine, in + mine, block);
}

/// Dissemination barrier: ceil(log2 N) rounds of empty frames.
inline void barrier(channel& ch) {
  const int n = ch.size();
  for (int d = 1; d < n; d *= 2) {
    ch.send(wrap(ch.rank() + d, n), nullptr, 0);
    ch.recv(wrap(ch.rank() - d, n), nullptr, 0);
  }
  ch.flush();
}

/// Runs the collective `ch` describes.
inline void execute(channel& ch) {
  switch (ch.what().kind) {
    case collective::all_reduce: return all_reduce(ch);
    case collective::reduce_scatter: return reduce_scatter(ch);
    case collective::all_gather: return all_gather(ch);
    case collective::broadcast: return broadcast(ch);
    case collective::reduce: return reduce(ch);
    case collective::gather: return gather(ch);
    case collective::scatter: return scatter(ch);
    case collective::all_to_all: return all_to_all(ch);
    case collective::barrier: return barrier(ch);
    case collective::send_recv: break;  // the engine matches sends and recvs itself
  }
}

/// The engine's executor: runs collective call `c` on the engine thread.
inline void run_collective(engine& e, call& c) {
  channel ch(e, c);
  execute(ch);
}

}  // namespace ddp::tcp::detail
