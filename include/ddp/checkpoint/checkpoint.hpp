#pragma once
/// \file ddp::save / ddp::load: the full training state of a data_parallel model under any sharding policy
/// (parameters under their visited names, no `module.` prefix; optimizer state as "optim.<name>.<state>"; the
/// step count in the metadata as "optim.step") in one safetensors file that PyTorch reads. Rank 0 writes
/// atomically; the other ranks stream it the ranges they hold, one range at a time, so no rank ever holds the
/// whole model unsharded. On loading rank 0 reads and verifies the file, then sends every rank the ranges it
/// holds (a broadcast where every rank holds the whole tensor). ddp::save_sharded / ddp::load_sharded
/// (<ddp/checkpoint/sharded.hpp>, included here) write a part per rank instead.

#include <algorithm>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/checkpoint/safetensors.hpp>
#include <ddp/checkpoint/sharded.hpp>
#include <ddp/checkpoint/state.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp {

namespace detail {

template <class DP, class Opt>
void save_full(const std::filesystem::path& path, DP& dp, Opt* opt, const checkpoint_metadata& metadata) {
  const auto st = collect_state(dp, opt);
  auto& comm = dp.comm();
  const int me = comm.rank();
  std::optional<safetensors::writer> out;
  first_failure rank0;  // rank 0 keeps receiving after a failed write, so no sender is left waiting
  if (me == 0)
    rank0.run([&] {
      auto meta = metadata;
      if constexpr (!std::is_void_v<Opt>) record_optimizer(meta, *opt);
      note_loss_scale(dp, meta);
      meta["ddp.world_size"] = std::to_string(dp.world_size());
      out.emplace(path, st.tensors, meta);
    });
  std::vector<std::byte> buffer;
  for (std::size_t t = 0; t < st.tensors.size(); ++t) {
    const dtype type = st.tensors[t].type;
    for (const auto& c : st.cover[t]) {
      const std::size_t bytes = c.numel * size_of(type);
      if (me == 0 && c.rank == 0) {
        rank0.run([&] { out->append({st.at(t, c.start, c.numel), bytes}); });
      } else if (me == 0) {
        buffer.resize(bytes);
        comm.recv(raw_tensor{buffer.data(), c.numel, type, device::cpu()}, c.rank).wait();
        rank0.run([&] { out->append({buffer.data(), bytes}); });
      } else if (c.rank == me) {
        comm.send(raw_tensor{st.at(t, c.start, c.numel), c.numel, type, device::cpu()}, 0).wait();
      }
    }
  }
  if (me == 0) rank0.run([&] { out->commit(); });
  share_rank0_outcome(comm, rank0.failure);
}

template <class DP, class Opt>
checkpoint_metadata load_full(const std::filesystem::path& path, DP& dp, Opt* opt) {
  const auto st = collect_state(dp, opt);
  auto& comm = dp.comm();
  const int me = comm.rank();
  std::optional<safetensors::reader> in;
  std::vector<std::string> meta_flat;  // key, value, key, value, ...
  on_rank0_then_share(comm, [&] {
    in.emplace(safetensors::reader::open(path));
    in->verify_checksum();  // first: a damaged header is an io_error, never taken for another model
    auto problem = compare_state(path.string(), in->entries(), st.tensors, std::is_void_v<Opt>);
    if (problem.empty()) problem = compare_settings(path.string(), in->metadata(), opt);
    if (!problem.empty()) throw mismatch_error(problem, 0);
    for (const auto& [k, v] : in->metadata()) meta_flat.insert(meta_flat.end(), {k, v});
  });
  first_failure rank0;  // rank 0 keeps sending after a failed read, so no receiver is left waiting
  std::vector<std::byte> buffer;
  for (std::size_t t = 0; t < st.tensors.size(); ++t) {
    const dtype type = st.tensors[t].type;
    const std::size_t numel = safetensors::detail::numel_of(st.tensors[t].shape), width = size_of(type);
    const auto* entry = me == 0 ? in->find(st.tensors[t].name) : nullptr;
    const auto& holders = st.holders[t];
    const bool everywhere = holders.size() == static_cast<std::size_t>(comm.size()) &&
                            std::all_of(holders.begin(), holders.end(), [&](const held_range& h) { return h.numel == numel; });
    if (everywhere && numel > 0) {
      std::byte* mine = st.at(t, 0, numel);
      if (me == 0) rank0.run([&] { in->read(*entry, 0, {mine, numel * width}); });
      comm.broadcast(raw_tensor{mine, numel, type, device::cpu()}, 0).wait();
      continue;
    }
    for (const auto& h : holders) {
      if (me == 0 && h.rank == 0) {
        rank0.run([&] { in->read(*entry, h.start * width, {st.at(t, h.start, h.numel), h.numel * width}); });
      } else if (me == 0) {
        buffer.resize(h.numel * width);
        rank0.run([&] { in->read(*entry, h.start * width, buffer); });
        comm.send(raw_tensor{buffer.data(), h.numel, type, device::cpu()}, h.rank).wait();
      } else if (h.rank == me) {
        comm.recv(raw_tensor{st.at(t, h.start, h.numel), h.numel, type, device::cpu()}, 0).wait();
      }
    }
  }
  share_rank0_outcome(comm, rank0.failure);
  st.to_devices();
  refresh_parameters(dp, st);
  broadcast_object(comm, meta_flat, 0);
  checkpoint_metadata meta;
  for (std::size_t i = 0; i + 1 < meta_flat.size(); i += 2) meta[meta_flat[i]] = meta_flat[i + 1];
  restore_step_count(path, meta, opt, me);
  restore_loss_scale(path, meta, dp);
  return meta;
}

}  // namespace detail

/// Saves the parameters of `dp` and the state of `opt` to `path` (one safetensors file, any sharding policy):
/// rank 0 writes to a temporary file and renames it, the other ranks stream it the ranges they hold.
/// `metadata` is stored too. Collective: every rank calls it; a failure is thrown on every rank.
template <class DP, class Opt>
  requires(!std::is_same_v<std::remove_cv_t<Opt>, checkpoint_metadata>)
void save(const std::filesystem::path& path, DP& dp, Opt& opt, const checkpoint_metadata& metadata = {}) {
  detail::save_full(path, dp, &opt, metadata);
}

/// Saves only the parameters of `dp` (an optimizer that ddp does not step, such as a torch::optim one, keeps its
/// own state): the file load(path, dp) and PyTorch read. Collective.
template <class DP>
void save(const std::filesystem::path& path, DP& dp, const checkpoint_metadata& metadata = {}) {
  detail::save_full(path, dp, static_cast<void*>(nullptr), metadata);
}

/// Loads what save() wrote (at any world size, under any policy) into `dp`'s parameters and `opt`'s state (and
/// step count) on every rank; rank 0 reads and verifies names, shapes, dtypes and the checksum, then sends each
/// rank its ranges. Throws ddp::io_error for an unreadable file and ddp::mismatch_error naming the first
/// missing, extra and differing tensor, on every rank. Returns the metadata. Collective.
template <class DP, class Opt>
checkpoint_metadata load(const std::filesystem::path& path, DP& dp, Opt& opt) {
  return detail::load_full(path, dp, &opt);
}

/// Loads only the parameters (optimizer entries in the file are ignored), e.g. for evaluation. Collective.
template <class DP>
checkpoint_metadata load(const std::filesystem::path& path, DP& dp) {
  return detail::load_full(path, dp, static_cast<void*>(nullptr));
}

}  // namespace ddp
