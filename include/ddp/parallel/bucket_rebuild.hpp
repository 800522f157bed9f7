#pragma once
/// \file Buckets rebuilt in the order of the first step's gradients (PyTorch DDP rebuilds its buckets after the
/// first iteration). The first synchronized step records the order in which its gradients became ready
/// (step_state::report_order); rank 0's order is broadcast, so every rank plans the same buckets whatever order
/// its own backward ran in; and unless that order is the reverse visit order the planner already assumed, the
/// buckets are planned again in it (plan_in_ready_order), once, so that later steps start each bucket as soon as
/// the backward has produced its gradients. Under replicate (data_parallel_options::rebuild_buckets); the
/// sharded strategies keep buckets inside units and follow their unshard scopes, and keep the planned order.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/step_state.hpp>

namespace ddp::detail {

/// Whether `ready` lists every arena's non-empty slots in reverse visit order (the order plan_buckets assumes).
inline bool in_reverse_visit_order(const parameter_layout& layout, std::span<const std::size_t> ready) {
  const auto slots = layout.slots();
  std::vector<std::size_t> last(layout.arenas().size(), slots.size());  // per arena, the last slot seen
  for (const std::size_t s : ready) {
    if (slots[s].numel == 0) continue;
    if (last[slots[s].arena] < s) return false;
    last[slots[s].arena] = s;
  }
  return true;
}

/// The one rebuild of a wrapper's buckets, after its first synchronized step.
class bucket_rebuild {
 public:
  /// `enabled`: rebuild after the first step; false keeps the planned buckets for good.
  explicit bucket_rebuild(bool enabled) noexcept : pending_(enabled) {}

  /// Collective the first time (a broadcast of rank 0's order over `comm` when it has several ranks), called on
  /// every rank once its step is finished: replans `plan` in rank 0's ready order and moves `state` to it.
  template <class Comm>
  void after_step(Comm& comm, const parameter_layout& layout, bucket_plan& plan, step_state& state,
                  std::size_t capacity_bytes, std::size_t first_bytes) {
    if (!pending_) return;
    pending_ = false;
    const auto slots = layout.slots();
    std::vector<std::int64_t> agreed;  // this rank's order, then the slots that never reported (empty ones)
    agreed.reserve(slots.size());
    for (const std::size_t s : state.report_order()) agreed.push_back(static_cast<std::int64_t>(s));
    for (std::size_t s = 0; s < slots.size(); ++s)
      if (!state.reported(s)) agreed.push_back(static_cast<std::int64_t>(s));
    if (comm.size() > 1) comm.broadcast(std::span<std::int64_t>(agreed), 0).wait();
    const std::vector<std::size_t> ready(agreed.begin(), agreed.end());
    if (in_reverse_visit_order(layout, ready)) return;
    plan = plan_in_ready_order(layout, ready, capacity_bytes, first_bytes);
    state.replan();
  }

 private:
  bool pending_;  // the first step has not been taken yet
};

}  // namespace ddp::detail
