#pragma once
/// \file What each of ddp::local's ranks does in a collective, reading and writing its peers' buffers in place:
/// no copy in or out. A reduction is split into one chunk per participant (on 64-byte boundaries, so no two
/// threads write one cache line); each folds its chunk over the participants in rank order (the bits of one process
/// summing in rank order) in cache-sized pieces and writes the result where it belongs. Moves of data are pulls
/// (all_gather, broadcast, scatter, all_to_all, recv) or pushes (gather) of whole blocks.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <utility>

#include <ddp/comm/local/slot.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/reduce.hpp>
#include <ddp/core/dtype.hpp>

namespace ddp::local::detail {

/// Bytes a reduction folds at a time: the accumulator stays in the L1 cache.
inline constexpr std::size_t piece_bytes = std::size_t{16} << 10;

/// Elements [first, second) of `count` that participant `i` of `m` reduces: near-equal runs of whole 64-byte lines.
inline std::pair<std::size_t, std::size_t> chunk_of(std::size_t count, std::size_t element_bytes, int i, int m) {
  const std::size_t unit = std::max<std::size_t>(1, 64 / element_bytes);
  const std::size_t units = (count + unit - 1) / unit, per = units / static_cast<std::size_t>(m);
  const std::size_t extra = units % static_cast<std::size_t>(m), k = static_cast<std::size_t>(i);
  const std::size_t lo = (k * per + std::min(k, extra)) * unit;
  const std::size_t hi = lo + (per + (k < extra ? 1 : 0)) * unit;
  return {std::min(lo, count), std::min(hi, count)};
}

/// The byte `offset` bytes into `t`'s elements.
inline std::byte* at(const raw_tensor& t, std::size_t offset) noexcept { return static_cast<std::byte*>(t.data) + offset; }

/// Copies unless source and destination are one place (an in-place block).
inline void move_block(std::byte* to, const std::byte* from, std::size_t bytes) noexcept {
  if (to != from && bytes != 0) std::memcpy(to, from, bytes);
}

/// Folds elements [lo, hi) (byte offsets `offset(q)` of participant q's buffer `which`) over every participant in
/// rank order, a piece at a time, and hands each piece's result to `deliver(result, byte offset into the chunk,
/// bytes)`.
template <class Source, class Deliver>
void fold_chunk(const slot& s, std::size_t lo, std::size_t hi, Source source, Deliver deliver) {
  alignas(64) thread_local std::array<std::byte, piece_bytes> acc;
  const std::size_t size = size_of(s.call.type), per_piece = piece_bytes / size;
  const std::size_t m = s.parts.size();
  for (std::size_t p = lo; p < hi; p += per_piece) {
    const std::size_t n = std::min(per_piece, hi - p), offset = p * size;
    if (m == 1) {
      std::memcpy(acc.data(), source(0, offset), n * size);
    } else {
      tcp::detail::reduce_bytes(s.call.type, acc.data(), source(0, offset), source(1, offset), n, s.op);
      for (std::size_t q = 2; q < m; ++q)
        tcp::detail::reduce_bytes(s.call.type, acc.data(), acc.data(), source(q, offset), n, s.op);
    }
    deliver(acc.data(), offset, n * size);
  }
}

/// all_reduce: participant i reduces its chunk of every buffer and writes the result into every buffer.
inline void share_all_reduce(const slot& s, int i) {
  if (s.parts.size() == 1) return;
  const auto [lo, hi] = chunk_of(s.call.count, size_of(s.call.type), i, static_cast<int>(s.parts.size()));
  fold_chunk(s, lo, hi, [&](std::size_t q, std::size_t off) { return at(s.parts[q].out, off); },
             [&](const std::byte* r, std::size_t off, std::size_t bytes) {
               for (const auto& p : s.parts) std::memcpy(at(p.out, off), r, bytes);
             });
}

/// reduce: participant i reduces its chunk of every buffer into the root's.
inline void share_reduce(const slot& s, int i) {
  if (s.parts.size() == 1) return;
  const auto [lo, hi] = chunk_of(s.call.count, size_of(s.call.type), i, static_cast<int>(s.parts.size()));
  const raw_tensor& root = s.parts[static_cast<std::size_t>(s.call.peer)].out;
  fold_chunk(s, lo, hi, [&](std::size_t q, std::size_t off) { return at(s.parts[q].out, off); },
             [&](const std::byte* r, std::size_t off, std::size_t bytes) { std::memcpy(at(root, off), r, bytes); });
}

/// reduce_scatter: participant i reduces block i of every input into its output.
inline void share_reduce_scatter(const slot& s, int i) {
  const std::size_t block = s.call.count * size_of(s.call.type) * static_cast<std::size_t>(i);
  const raw_tensor& out = s.parts[static_cast<std::size_t>(i)].out;
  fold_chunk(s, 0, s.call.count, [&](std::size_t q, std::size_t off) { return at(s.parts[q].in, block + off); },
             [&](const std::byte* r, std::size_t off, std::size_t bytes) { std::memcpy(at(out, off), r, bytes); });
}

/// all_gather: participant i copies every input into its output, rank q's at block q.
inline void share_all_gather(const slot& s, int i) {
  const std::size_t bytes = s.call.count * size_of(s.call.type);
  const raw_tensor& out = s.parts[static_cast<std::size_t>(i)].out;
  for (std::size_t q = 0; q < s.parts.size(); ++q) move_block(at(out, q * bytes), at(s.parts[q].in, 0), bytes);
}

/// broadcast: every participant but the root copies the root's buffer.
inline void share_broadcast(const slot& s, int i) {
  move_block(at(s.parts[static_cast<std::size_t>(i)].out, 0), at(s.parts[static_cast<std::size_t>(s.call.peer)].out, 0),
             s.call.count * size_of(s.call.type));
}

/// gather: participant i copies its input into block i of the root's output.
inline void share_gather(const slot& s, int i) {
  const std::size_t bytes = s.call.count * size_of(s.call.type);
  move_block(at(s.parts[static_cast<std::size_t>(s.call.peer)].out, static_cast<std::size_t>(i) * bytes),
             at(s.parts[static_cast<std::size_t>(i)].in, 0), bytes);
}

/// scatter: participant i copies block i of the root's input into its output.
inline void share_scatter(const slot& s, int i) {
  const std::size_t bytes = s.call.count * size_of(s.call.type);
  move_block(at(s.parts[static_cast<std::size_t>(i)].out, 0),
             at(s.parts[static_cast<std::size_t>(s.call.peer)].in, static_cast<std::size_t>(i) * bytes), bytes);
}

/// all_to_all: participant i copies block i of rank q's input into block q of its output.
inline void share_all_to_all(const slot& s, int i) {
  const std::size_t bytes = s.call.count / s.parts.size() * size_of(s.call.type);
  const raw_tensor& out = s.parts[static_cast<std::size_t>(i)].out;
  for (std::size_t q = 0; q < s.parts.size(); ++q)
    move_block(at(out, q * bytes), at(s.parts[q].in, static_cast<std::size_t>(i) * bytes), bytes);
}

/// A matched send (participant 0) and recv (participant 1): the receiver copies the sender's buffer.
inline void share_message(const slot& s, int i) {
  if (i == 1) move_block(at(s.parts[1].out, 0), at(s.parts[0].in, 0), s.parts[0].in.bytes());
}

/// Barriers only meet.
inline void share_nothing(const slot&, int) {}

/// The share of collective `kind`.
inline slot::share_fn share_of(collective kind) noexcept {
  switch (kind) {
    case collective::all_reduce: return &share_all_reduce;
    case collective::reduce: return &share_reduce;
    case collective::reduce_scatter: return &share_reduce_scatter;
    case collective::all_gather: return &share_all_gather;
    case collective::broadcast: return &share_broadcast;
    case collective::gather: return &share_gather;
    case collective::scatter: return &share_scatter;
    case collective::all_to_all: return &share_all_to_all;
    case collective::send_recv: return &share_message;
    default: return &share_nothing;
  }
}

}  // namespace ddp::local::detail
