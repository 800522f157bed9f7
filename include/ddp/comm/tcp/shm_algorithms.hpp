#pragma once
/// \file The collectives of the same-host transport, over a group's shared-memory segment (shm_channel):
/// every rank publishes pieces of its input in its region, then reads what it needs straight from the
/// others' regions. Reductions sum in rank order, so every rank gets the same bits. all_reduce of up to
/// shm_direct_bytes reduces the whole buffer on every rank after one barrier; larger ones are pipelined
/// (each phase: every rank publishes the others' slices of one piece, reduces its own slice of the piece
/// into its next region, and copies the others' reduced slices of the previous piece out). all_reduce,
/// reduce_scatter and all_gather from shm_single_copy_bytes, where every peer's memory is readable, start with a
/// phase that publishes each rank's buffer address and the algorithm rank 0 chose (shm_algo_choice.hpp): the
/// pipeline, or single copies straight out of the others' buffers (same_host.hpp) whatever the size. Both sum in
/// the same order. Single-copy all_reduce takes two more phases: reduce this rank's slice from the others'
/// buffers; copy the others' reduced slices out of their buffers. reduce_scatter and all_gather take one.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include <ddp/comm/tcp/reduce.hpp>
#include <ddp/comm/tcp/shm_algo_choice.hpp>
#include <ddp/comm/tcp/shm_channel.hpp>

namespace ddp::tcp::detail {

/// all_reduce payloads up to this size are reduced whole by every rank after a single barrier.
inline constexpr std::size_t shm_direct_bytes = 32 << 10;

/// dst = src(0) (op) src(1) (op) ... src(n-1), in rank order, over `elems` elements.
template <class Src>
void reduce_ranks(const call& c, char* dst, int n, std::size_t elems, Src src) {
  const std::size_t bytes = elems * size_of(c.type);
  if (n == 1) {
    std::memmove(dst, src(0), bytes);
    return;
  }
  reduce_bytes(c.type, dst, src(0), src(1), elems, c.op);
  for (int p = 2; p < n; ++p) reduce_bytes(c.type, dst, dst, src(p), elems, c.op);
}

/// Splits `count` elements into pieces of at most `piece` elements: f(first element, elements) per piece.
template <class F>
void for_pieces(std::size_t count, std::size_t piece, F f) {
  for (std::size_t first = 0; first < count; first += piece) f(first, std::min(piece, count - first));
}

/// Element offset of rank r's slice of `elems` elements split among n ranks.
inline std::size_t slice_first(std::size_t elems, int r, int n) {
  return static_cast<std::size_t>(r) * elems / static_cast<std::size_t>(n);
}

/// all_reduce by single copies out of the peers' buffers, whose addresses g.addresses holds (see the file comment).
inline void shm_all_reduce_single_copy(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  const std::vector<std::uint64_t>& where = g.addresses;
  const auto first = [&](int r) { return slice_first(c.count, r, n); };
  // This rank's slice, a piece at a time: the others' parts into scratch, then the sum in rank order.
  const std::size_t piece = shm_region_bytes / es;
  char* parts = g.scratch(static_cast<std::size_t>(n + 1) * piece * es);
  char* sum = parts + static_cast<std::size_t>(n) * piece * es;
  for_pieces(first(me + 1) - first(me), piece, [&](std::size_t off, std::size_t k) {
    const std::size_t at = (first(me) + off) * es;
    for (int r = 0; r < n; ++r)
      if (r != me) ch.copy_from(r, where[static_cast<std::size_t>(r)] + at, k * es, parts + r * piece * es);
    reduce_ranks(c, sum, n, k, [&](int r) { return r == me ? buf + at : parts + r * piece * es; });
    finish_avg_bytes(c.type, sum, k, c.op, n);
    std::memcpy(buf + at, sum, k * es);
  });
  ch.count(2 * (first(me + 1) - first(me)) * es * static_cast<std::size_t>(n - 1));  // as a ring would send
  ch.sync();  // every slice reduced in its owner's buffer
  for (int r = 0; r < n; ++r)
    if (r != me) ch.copy_from(r, where[static_cast<std::size_t>(r)] + first(r) * es, (first(r + 1) - first(r)) * es, buf + first(r) * es);
  ch.sync();  // nobody reads this rank's buffer any more
}

/// all_reduce pipelined through the segment (see the file comment).
inline void shm_all_reduce_pipeline(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  const std::size_t half = shm_region_bytes / 2;
  const std::size_t piece = half / es;
  const std::size_t passes = (c.count + piece - 1) / piece;
  const auto elems = [&](std::size_t j) { return std::min(piece, c.count - j * piece); };
  const auto slice = [&](std::size_t j, int r) { return slice_first(elems(j), r, n); };
  for (std::size_t j = 0; j <= passes; ++j) {
    for (int r = 0; j < passes && r < n; ++r)  // every slice but this rank's own, which it reads in place
      if (r != me) ch.put(slice(j, r) * es, buf + (j * piece + slice(j, r)) * es, (slice(j, r + 1) - slice(j, r)) * es);
    ch.sync();
    if (j > 0) {  // the others' reduced slices of the previous piece
      const std::size_t k = elems(j - 1);
      for (int r = 0; r < n; ++r) {
        if (r == me) continue;
        const std::size_t a = slice_first(k, r, n), b = slice_first(k, r + 1, n);
        std::memcpy(buf + ((j - 1) * piece + a) * es, ch.at(r) + half, (b - a) * es);
      }
    }
    if (j < passes) {  // this rank's slice of this piece, into its next region and its buffer
      const std::size_t k = elems(j);
      const std::size_t a = slice_first(k, me, n), b = slice_first(k, me + 1, n);
      // Reduced in private memory, then copied into the buffer and the region (shm_copy.hpp: the peers hold
      // the region's lines, so it takes the stores that cost less).
      char* out = g.scratch((b - a) * es);
      const char* own = buf + (j * piece + a) * es;
      reduce_ranks(c, out, n, b - a, [&](int r) { return r == me ? own : ch.at(r) + a * es; });
      finish_avg_bytes(c.type, out, b - a, c.op, n);
      std::memcpy(buf + (j * piece + a) * es, out, (b - a) * es);
      shared_stores().copy(ch.fill() + half, out, (b - a) * es);
      ch.count((b - a) * es);
    }
  }
}

/// Runs a call of `bytes` by `pipeline`, or, from shm_single_copy_bytes where its buffers `allow` single copies
/// and every peer's memory is readable, by the algorithm the group's rank 0 chose (shm_algo_choice.hpp): a first
/// phase publishes this rank's buffer address `mine` and rank 0's choice, then every rank runs `single` (the
/// addresses in g.addresses) or `pipeline`. Rank 0 times the rest of the call for its next choices.
template <class Single, class Pipeline>
void shm_run_sized(shm_channel& ch, shm_group& g, const void* mine, bool allow, Single single, Pipeline pipeline) {
  const collective kind = ch.what().kind;
  const std::size_t bytes = ch.what().count * size_of(ch.what().type) *
                            (kind == collective::all_reduce ? 1 : static_cast<std::size_t>(ch.size()));
  if (bytes < shm_single_copy_bytes || !allow || !g.reads_all()) return pipeline();
  const std::uint64_t head[2] = {reinterpret_cast<std::uintptr_t>(mine), static_cast<std::uint64_t>(g.algo(kind, bytes))};
  ch.put(0, head, sizeof head);
  ch.sync();
  g.addresses.resize(static_cast<std::size_t>(ch.size()));
  for (int r = 0; r < ch.size(); ++r) std::memcpy(&g.addresses[static_cast<std::size_t>(r)], ch.at(r), sizeof head[0]);
  std::uint64_t chosen = 0;
  std::memcpy(&chosen, ch.at(0) + sizeof head[0], sizeof chosen);
  const shm_algo algo = chosen == static_cast<std::uint64_t>(shm_algo::pipeline) ? shm_algo::pipeline : shm_algo::single_copy;
  const auto start = clock::now();
  if (algo == shm_algo::pipeline) pipeline();
  else single();
  if (ch.rank() == 0) g.algos.record(kind, bytes, algo, clock::now() - start);
}

inline void shm_all_reduce(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size();
  const std::size_t bytes = c.count * size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  if (bytes > shm_direct_bytes)
    return shm_run_sized(ch, g, buf, true, [&] { shm_all_reduce_single_copy(ch, g); },
                         [&] { shm_all_reduce_pipeline(ch, g); });
  ch.put(0, buf, bytes);
  ch.sync();
  reduce_ranks(c, buf, n, c.count, [&](int r) { return ch.at(r); });
  finish_avg_bytes(c.type, buf, c.count, c.op, n);
}

/// reduce_scatter through the segment: per piece, every rank publishes every block's piece, then reduces its own.
inline void shm_reduce_scatter_pipeline(shm_channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type), block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const std::size_t piece = shm_region_bytes / static_cast<std::size_t>(n) / es;
  // This rank's own block is read in place, unless the output overlaps the input (then from its region).
  const bool apart = out + block <= in || in + n * block <= out;
  for_pieces(c.count, piece, [&](std::size_t first, std::size_t k) {
    for (int r = 0; r < n; ++r)
      if (r != me || !apart) ch.put(static_cast<std::size_t>(r) * piece * es, in + r * block + first * es, k * es);
    ch.sync();
    const char* own = apart ? in + me * block + first * es : ch.at(me) + me * piece * es;
    reduce_ranks(c, out + first * es, n, k, [&](int r) { return r == me ? own : ch.at(r) + me * piece * es; });
  });
  finish_avg_bytes(c.type, out, c.count, c.op, n);
}

/// reduce_scatter by single copies: this rank's block of every peer's input (g.addresses), a piece at a time into
/// scratch, summed in rank order into the output (which does not overlap the input).
inline void shm_reduce_scatter_single_copy(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type), block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const std::size_t piece = shm_region_bytes / es;
  char* parts = g.scratch(static_cast<std::size_t>(n) * piece * es);
  for_pieces(c.count, piece, [&](std::size_t first, std::size_t k) {
    for (int r = 0; r < n; ++r)
      if (r != me) ch.copy_from(r, g.addresses[static_cast<std::size_t>(r)] + me * block + first * es, k * es, parts + r * piece * es);
    reduce_ranks(c, out + first * es, n, k, [&](int r) { return r == me ? in + me * block + first * es : parts + r * piece * es; });
  });
  finish_avg_bytes(c.type, out, c.count, c.op, n);
  ch.count(block * static_cast<std::size_t>(n - 1));  // the blocks the others read, as the pipeline publishes them
  ch.sync();  // nobody reads this rank's input any more
}

inline void shm_reduce_scatter(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const std::size_t block = c.count * size_of(c.type);
  const auto* in = static_cast<const char*>(c.in);
  const auto* out = static_cast<const char*>(c.out);
  const bool apart = out + block <= in || in + block * static_cast<std::size_t>(ch.size()) <= out;
  shm_run_sized(ch, g, in, apart, [&] { shm_reduce_scatter_single_copy(ch, g); }, [&] { shm_reduce_scatter_pipeline(ch); });
}

/// all_gather through the segment: per piece, every rank publishes its block's piece and copies the others'.
inline void shm_all_gather_pipeline(shm_channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type), block = c.count * es;
  auto* out = static_cast<char*>(c.out);
  if (out + me * block != c.in) std::memmove(out + me * block, c.in, block);
  for_pieces(c.count, shm_region_bytes / es, [&](std::size_t first, std::size_t k) {
    ch.put(0, out + me * block + first * es, k * es);
    ch.sync();
    for (int r = 0; r < n; ++r)
      if (r != me) std::memcpy(out + r * block + first * es, ch.at(r), k * es);
  });
}

/// all_gather by single copies: every peer's input (g.addresses) straight into its block of the output (which
/// holds the input in this rank's block, or does not overlap it).
inline void shm_all_gather_single_copy(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t block = c.count * size_of(c.type);
  auto* out = static_cast<char*>(c.out);
  for (int r = 0; r < n; ++r)
    if (r != me) ch.copy_from(r, g.addresses[static_cast<std::size_t>(r)], block, out + r * block);
  if (out + me * block != c.in) std::memcpy(out + me * block, c.in, block);
  ch.count(block);  // this rank's block, which the others read, as the pipeline publishes it
  ch.sync();  // nobody reads this rank's input any more
}

inline void shm_all_gather(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const std::size_t block = c.count * size_of(c.type);
  const auto* in = static_cast<const char*>(c.in);
  const auto* out = static_cast<const char*>(c.out);
  const bool fits = in == out + static_cast<std::size_t>(ch.rank()) * block || in + block <= out ||
                    out + block * static_cast<std::size_t>(ch.size()) <= in;
  shm_run_sized(ch, g, in, fits, [&] { shm_all_gather_single_copy(ch, g); }, [&] { shm_all_gather_pipeline(ch); });
}

inline void shm_broadcast(shm_channel& ch) {
  const auto& c = ch.what();
  const std::size_t es = size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  const bool root = ch.rank() == c.root;
  for_pieces(c.count, shm_region_bytes / es, [&](std::size_t first, std::size_t k) {
    if (root) ch.put(0, buf + first * es, k * es);
    ch.sync();
    if (!root) std::memcpy(buf + first * es, ch.at(c.root), k * es);
  });
}

inline void shm_reduce(shm_channel& ch) {
  const auto& c = ch.what();
  const std::size_t es = size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  const bool root = ch.rank() == c.root;
  for_pieces(c.count, shm_region_bytes / es, [&](std::size_t first, std::size_t k) {
    ch.put(0, buf + first * es, k * es);
    ch.sync();
    if (root) reduce_ranks(c, buf + first * es, ch.size(), k, [&](int r) { return ch.at(r); });
  });
  if (root) finish_avg_bytes(c.type, buf, c.count, c.op, ch.size());
}

inline void shm_gather(shm_channel& ch) {
  const auto& c = ch.what();
  const std::size_t es = size_of(c.type), block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const bool root = ch.rank() == c.root;
  if (root) std::memmove(out + static_cast<std::size_t>(c.root) * block, in, block);
  for_pieces(c.count, shm_region_bytes / es, [&](std::size_t first, std::size_t k) {
    if (!root) ch.put(0, in + first * es, k * es);
    ch.sync();
    if (root)
      for (int r = 0; r < ch.size(); ++r)
        if (r != c.root) std::memcpy(out + r * block + first * es, ch.at(r), k * es);
  });
}

inline void shm_scatter(shm_channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  const std::size_t es = size_of(c.type), block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const bool root = ch.rank() == c.root;
  const std::size_t piece = shm_region_bytes / static_cast<std::size_t>(n) / es;
  for_pieces(c.count, piece, [&](std::size_t first, std::size_t k) {
    if (root)
      for (int r = 0; r < n; ++r)
        if (r != c.root) ch.put(r * piece * es, in + r * block + first * es, k * es);
    ch.sync();
    if (!root) std::memcpy(out + first * es, ch.at(c.root) + ch.rank() * piece * es, k * es);
  });
  if (root) std::memmove(out, in + static_cast<std::size_t>(c.root) * block, block);
}

inline void shm_all_to_all(shm_channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type), per = c.count / static_cast<std::size_t>(n), block = per * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const std::size_t piece = shm_region_bytes / static_cast<std::size_t>(n) / es;
  for_pieces(per, piece, [&](std::size_t first, std::size_t k) {
    for (int r = 0; r < n; ++r)
      if (r != me) ch.put(r * piece * es, in + r * block + first * es, k * es);
    ch.sync();
    for (int r = 0; r < n; ++r)
      if (r != me) std::memcpy(out + r * block + first * es, ch.at(r) + me * piece * es, k * es);
  });
  if (in != out) std::memmove(out + me * block, in + me * block, block);
}

/// Runs the collective `ch` describes over group segment `g`. A call with no elements moves nothing, as on
/// the sockets.
inline void shm_execute(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  if (c.kind == collective::barrier) return ch.sync();
  if (c.count == 0) return;
  switch (c.kind) {
    case collective::all_reduce: return shm_all_reduce(ch, g);
    case collective::reduce_scatter: return shm_reduce_scatter(ch, g);
    case collective::all_gather: return shm_all_gather(ch, g);
    case collective::broadcast: return shm_broadcast(ch);
    case collective::reduce: return shm_reduce(ch);
    case collective::gather: return shm_gather(ch);
    case collective::scatter: return shm_scatter(ch);
    case collective::all_to_all: return shm_all_to_all(ch);
    case collective::barrier:
    case collective::send_recv: break;  // barrier above; the engine matches sends and recvs over the sockets
  }
}

}  // namespace ddp::tcp::detail
