#pragma once
/// \file The model state of a data_parallel (buffers and frozen parameters, core/state.hpp) kept alike on every
/// rank: collected in visit order, described for the same-model check, hashed for verify_in_sync, and synchronized
/// as data_parallel_options::buffers says — rank 0's broadcast (PyTorch DDP's broadcast_buffers) or the mean over
/// ranks. Host tensors travel packed, one collective per dtype; device tensors one collective each, in their memory.

#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/detail/hash.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/state.hpp>
#include <ddp/core/visit.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host_copy.hpp>
#include <ddp/parallel/join_state.hpp>
#include <ddp/parallel/options.hpp>
#include <ddp/parallel/replica_check.hpp>

namespace ddp::detail {

/// One tensor of model state under its visited name.
struct named_state {
  std::string name;  ///< dotted name ("bn1.running_mean")
  state_view view;   ///< where it is, its shape and kind
};

/// The model state of `model`, in visit order.
template <class Model>
std::vector<named_state> collect_model_state(Model& model) {
  std::vector<named_state> out;
  visit_state(model, [&](std::string_view name, const state_view& v) { out.push_back({std::string(name), v}); });
  return out;
}

/// "buffer bn1.running_mean f32 [16]": a line of the same-model check.
inline std::string describe_state(const named_state& s) {
  std::string d = (s.view.kind == state_kind::frozen ? "frozen " : "buffer ") + s.name + " " +
                  std::string(to_string(s.view.tensor.type)) + " [";
  for (std::size_t i = 0; i < s.view.shape.size(); ++i) d += (i ? ", " : "") + std::to_string(s.view.shape[i]);
  return d + "]";
}

/// verify_in_sync's digest of the state every rank holds alike: frozen parameters always, buffers when
/// `buffers_in_sync` (the buffer_sync mode keeps them alike).
inline replica_digest digest_state(std::span<const named_state> state, bool buffers_in_sync) {
  replica_digest d;
  domain_buffer scratch;
  for (const auto& s : state) {
    if (s.view.kind == state_kind::buffer && !buffers_in_sync) {
      d.hashes.push_back(0);
      continue;
    }
    const raw_tensor host = readable_on_host(s.view.tensor, scratch);
    d.hashes.push_back(fnv1a(std::span(static_cast<const std::byte*>(host.data), host.bytes())));
  }
  return d;
}

/// Synchronizes the model state's buffers across ranks, reusing its packing memory from one step to the next.
class state_sync {
 public:
  /// Collective: every tensor of `state` whose kind is in `kinds` takes rank `root`'s values.
  template <class Comm>
  void broadcast(Comm& comm, std::span<const named_state> state, int root, std::span<const state_kind> kinds) {
    for_each_group(state, kinds, [&](const raw_tensor& t) { comm.broadcast(t, root).wait(); }, comm.rank() == root);
  }
  /// Collective: the floating buffers take the mean of the `active` ranks' values (a rank with `mine_counts`
  /// false adds zeros: it has left a join scope), the integer ones rank `root`'s.
  template <class Comm>
  void mean(Comm& comm, std::span<const named_state> state, int root, bool mine_counts, int active) {
    const state_kind buffers[] = {state_kind::buffer};
    for_each_group(
        state, buffers,
        [&](const raw_tensor& t) {
          if (!floating(t.type)) {
            comm.broadcast(t, root).wait();
            return;
          }
          memory_domain& d = domain_of_tensor(t);
          if (!mine_counts) d.zero(t);
          comm.all_reduce(t, reduce_op::avg).wait();
          if (active != comm.size()) d.scale(t, static_cast<double>(comm.size()) / active);
          d.synchronize();  // the host reads or steps on from here
        },
        true);
  }

 private:
  static bool floating(dtype t) noexcept {
    return t == dtype::f32 || t == dtype::f64 || t == dtype::bf16 || t == dtype::f16;
  }
  static memory_domain& domain_of_tensor(const raw_tensor& t) { return require_domain_of(t.where, "buffer sync"); }

  /// Calls `run(t)` once per dtype for the host tensors of `kinds` packed into one host tensor (copied in when
  /// `fill`, always copied back), and once per device tensor of `kinds` on the tensor itself.
  template <class Run>
  void for_each_group(std::span<const named_state> state, std::span<const state_kind> kinds, Run run, bool fill) {
    auto wanted = [&](const named_state& s) {
      return s.view.tensor.size > 0 && std::find(kinds.begin(), kinds.end(), s.view.kind) != kinds.end();
    };
    for (const dtype type : {dtype::f32, dtype::f64, dtype::bf16, dtype::f16, dtype::i32, dtype::i64, dtype::u8}) {
      std::size_t bytes = 0;
      for (const auto& s : state)
        if (wanted(s) && s.view.tensor.type == type && !s.view.tensor.where.is_cuda()) bytes += s.view.tensor.bytes();
      if (bytes == 0) continue;
      packed_.resize(bytes);
      std::size_t at = 0;
      for (const auto& s : state)
        if (wanted(s) && s.view.tensor.type == type && !s.view.tensor.where.is_cuda()) {
          if (fill) std::memcpy(packed_.data() + at, s.view.tensor.data, s.view.tensor.bytes());
          at += s.view.tensor.bytes();
        }
      run(raw_tensor{packed_.data(), bytes / size_of(type), type, device::cpu()});
      at = 0;
      for (const auto& s : state)
        if (wanted(s) && s.view.tensor.type == type && !s.view.tensor.where.is_cuda()) {
          std::memcpy(s.view.tensor.data, packed_.data() + at, s.view.tensor.bytes());
          at += s.view.tensor.bytes();
        }
    }
    for (const auto& s : state)
      if (wanted(s) && s.view.tensor.where.is_cuda()) run(s.view.tensor);
  }

  std::vector<std::byte> packed_;  // the host tensors of one dtype, one after another
};

/// Collective: the buffers of `state` become alike on every rank, as `how` says (broadcast: the source rank's;
/// mean: the mean over the ranks still training). The source is rank 0, or inside a join scope the lowest rank
/// still training (one all-reduce finds it and counts the training ranks); with none left nothing changes.
template <class Comm>
void sync_buffers(Comm& comm, const join_state& join, std::span<const named_state> state, state_sync& sync,
                  buffer_sync how) {
  const bool any = std::any_of(state.begin(), state.end(), [](const named_state& s) { return s.view.kind == state_kind::buffer; });
  if (!any || how == buffer_sync::never || how == buffer_sync::construction) return;
  int root = 0, active = comm.size();
  if (join.open()) {
    // The lowest training rank travels as size - rank under max (joined ranks give 0); the count as a sum.
    std::int64_t v[2] = {join.active() ? comm.size() - comm.rank() : 0, join.active() ? 1 : 0};
    comm.all_reduce(std::span<std::int64_t>(v, 1), reduce_op::max).wait();
    comm.all_reduce(std::span<std::int64_t>(v + 1, 1), reduce_op::sum).wait();
    if (v[1] == 0) return;
    root = comm.size() - static_cast<int>(v[0]);
    active = static_cast<int>(v[1]);
  }
  const state_kind buffers[] = {state_kind::buffer};
  if (how == buffer_sync::broadcast)
    sync.broadcast(comm, state, root, buffers);
  else
    sync.mean(comm, state, root, join.active(), active);
}

}  // namespace ddp::detail
