#pragma once
/// \file The checks that ranks hold the same model: at construction, the same parameter names, shapes and dtypes
/// (verify_same_model); and data_parallel::verify_in_sync: each rank hashes, per parameter, the values
/// it holds (FNV-1a over the bytes, so replicas must agree bit for bit) and says which ranks hold the same
/// values (its peer key); one all_gather of two words per rank compares the combined hashes of peers. On a
/// difference the per-parameter hashes are exchanged and every rank throws ddp::mismatch_error naming the
/// first differing parameter and the ranks that disagree.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <ddp/comm/object.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/detail/hash.hpp>
#include <ddp/core/error.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host_copy.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/arena.hpp>

namespace ddp::detail {

/// FNV-1a over the parameter descriptions: the cheap first check that ranks hold the same model.
inline std::uint64_t layout_hash(const std::vector<std::string>& descriptions) {
  std::uint64_t h = fnv1a_basis;
  for (const auto& d : descriptions) h = fnv1a("\n", fnv1a(d, h));
  return h;
}

/// Throws ddp::mismatch_error unless every rank's list equals rank 0's, naming the first differing entry on each rank.
template <class Comm>
void verify_same_model(Comm& comm, const std::vector<std::string>& mine) {
  const auto h = static_cast<std::int64_t>(layout_hash(mine));
  std::vector<std::int64_t> hashes(static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(&h, 1), std::span<std::int64_t>(hashes)).wait();
  if (std::all_of(hashes.begin(), hashes.end(), [&](std::int64_t x) { return x == hashes[0]; })) return;
  const auto all = all_gather_object(comm, mine);
  std::size_t first = SIZE_MAX;  // the earliest entry where some rank disagrees with rank 0
  for (const auto& other : all) {
    const auto diff = std::mismatch(all[0].begin(), all[0].end(), other.begin(), other.end());
    if (diff.first != all[0].end() || diff.second != other.end())
      first = std::min(first, static_cast<std::size_t>(diff.first - all[0].begin()));
  }
  std::string what = "the model differs across ranks at parameter #" + std::to_string(first) + ":";
  for (std::size_t r = 0; r < all.size(); ++r)
    what += " rank " + std::to_string(r) + " has " + (first < all[r].size() ? "'" + all[r][first] + "'" : "nothing") +
            (r + 1 < all.size() ? ";" : "");
  throw mismatch_error(what + ". Every rank must build the same model (names, shapes and dtypes)", comm.rank());
}

/// What one rank holds of the model, for the replica check.
struct replica_digest {
  std::int64_t peers = 0;              ///< ranks with the same key must hold the same values
  std::vector<std::uint64_t> hashes;   ///< per parameter, in visit order: FNV-1a of the values held
};

/// The digest of a rank holding every parameter's full values at its place in the arenas.
inline replica_digest digest_full(const parameter_layout& layout) {
  replica_digest d;
  std::vector<raw_tensor> arenas;  // each arena's values where the host reads them
  std::vector<domain_buffer> scratch(layout.arenas().size());
  for (std::size_t a = 0; a < layout.arenas().size(); ++a) {
    const auto& arena = layout.arenas()[a];
    arenas.push_back(readable_on_host(arena.value_view(0, arena.numel), scratch[a]));
  }
  for (const auto& slot : layout.slots()) {
    const std::size_t w = size_of(slot.type);
    d.hashes.push_back(fnv1a(std::span(static_cast<const std::byte*>(arenas[slot.arena].data) + slot.offset * w,
                                       slot.numel * w)));
  }
  return d;
}

/// The digest of a rank holding only its owned blocks (full_shard): the pieces of each parameter in `owned`,
/// compared with the ranks of the same `peers` key (the same shard-group rank).
inline replica_digest digest_owned(const parameter_layout& layout, std::span<const optim::flat_buffer> owned,
                                   int peers) {
  replica_digest d;
  d.peers = peers;
  d.hashes.assign(layout.slots().size(), fnv1a_basis);
  std::unordered_map<std::string_view, std::size_t> slot_of;
  for (std::size_t s = 0; s < layout.slots().size(); ++s) slot_of.emplace(layout.slots()[s].name, s);
  domain_buffer scratch;
  for (const auto& b : owned) {
    const auto* values = static_cast<const std::byte*>(readable_on_host(b.values, scratch).data);
    const std::size_t w = size_of(b.values.type);
    for (const auto& seg : b.segments) {
      auto& h = d.hashes[slot_of.at(seg.name)];
      h = fnv1a(std::span(values + seg.offset * w, seg.numel * w), h);
    }
  }
  return d;
}

/// "ranks 0, 2 hold one value; rank 1 holds another": the ranks of `members`, grouped by their hash of `slot`.
inline std::string describe_disagreement(const std::vector<std::vector<std::uint64_t>>& hashes,
                                         const std::vector<int>& members, std::size_t slot) {
  std::vector<std::uint64_t> seen;
  std::string out;
  for (const int r : members) {
    const std::uint64_t h = hashes[static_cast<std::size_t>(r)][slot];
    if (std::find(seen.begin(), seen.end(), h) != seen.end()) continue;
    seen.push_back(h);
    std::vector<int> same;
    for (const int q : members)
      if (hashes[static_cast<std::size_t>(q)][slot] == h) same.push_back(q);
    std::string ranks = same.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < same.size(); ++i) ranks += (i ? ", " : "") + std::to_string(same[i]);
    out += (out.empty() ? "" : "; ") + ranks + (same.size() == 1 ? " holds " : " hold ") +
           (seen.size() == 1 ? "one value" : "another");
  }
  return out;
}

/// Collective over `comm`: returns when every rank's hashes equal those of each rank with its peer key;
/// otherwise throws ddp::mismatch_error on every rank, naming (through `name_of(slot)`) the first parameter
/// where some peers differ, and those peers' ranks grouped by value.
template <class Comm, class NameOf>
void verify_replicas(Comm& comm, const replica_digest& mine, NameOf name_of) {
  std::uint64_t combined = fnv1a_basis;
  for (const std::uint64_t h : mine.hashes) combined = fnv1a(std::as_bytes(std::span(&h, 1)), combined);
  const std::int64_t word[2] = {mine.peers, static_cast<std::int64_t>(combined)};
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> words(2 * n);
  comm.all_gather(std::span<const std::int64_t>(word, 2), std::span<std::int64_t>(words)).wait();
  bool in_sync = true;
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t q = 0; q < r; ++q)
      if (words[2 * r] == words[2 * q] && words[2 * r + 1] != words[2 * q + 1]) in_sync = false;
  if (in_sync) return;

  const auto hashes = all_gather_object(comm, mine.hashes);
  for (std::size_t slot = 0; slot < mine.hashes.size(); ++slot)
    for (std::size_t r = 0; r < n; ++r) {
      std::vector<int> peers;  // the ranks with r's key
      bool differ = false;
      for (std::size_t q = 0; q < n; ++q)
        if (words[2 * q] == words[2 * r]) {
          peers.push_back(static_cast<int>(q));
          differ = differ || hashes[q][slot] != hashes[r][slot];
        }
      if (!differ) continue;
      throw mismatch_error("verify_in_sync: the replicas differ at parameter '" + std::string(name_of(slot)) + "': " +
                               describe_disagreement(hashes, peers, slot) +
                               ". A gradient was reported before it was final, or ranks stepped different "
                               "optimizers (or changed parameters on some ranks only); call dp.gradient_ready(p) "
                               "only after p's gradient is complete, and step the same optimizer with the same "
                               "settings on every rank",
                           comm.rank());
    }
}

}  // namespace ddp::detail
