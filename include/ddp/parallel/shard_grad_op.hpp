#pragma once
/// \file The shard_grad_op strategy (ZeRO-2, FSDP SHARD_GRAD_OP): full parameters during forward and
/// backward, in the value arena; a unit's full gradients live in a pooled buffer while an unshard scope holds
/// it and until its buckets are reduce-scattered into the owned blocks; the optimizer steps the owned
/// blocks; the updated blocks are all-gathered back into the full parameters after the step.

#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include <ddp/core/work.hpp>
#include <ddp/parallel/archetype.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/policies.hpp>
#include <ddp/parallel/replica_check.hpp>
#include <ddp/parallel/sharded.hpp>
#include <ddp/parallel/step_state.hpp>
#include <ddp/parallel/strategy.hpp>

namespace ddp::detail {

template <class Comm>
struct strategy<shard_grad_op, Comm> : sharded_core<Comm> {
  static constexpr unit_phase initial_units = unit_phase::unsharded;
  static constexpr bool join_replays_scopes = false;  ///< values stay whole: a shadow step needs no unshard scope
  static std::size_t multiple(const Comm& comm, const shard_grad_op& /*policy*/) {
    return static_cast<std::size_t>(comm.size());
  }
  /// Every leaf type can be held: the values stay whole in the arenas, copied at the step's edges if need be.
  static void check_leaves(const parameter_layout& /*layout*/, int /*rank*/) noexcept {}
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm comm,
           const shard_grad_op& policy)
      : sharded_core<Comm>(layout, plan, state, std::move(comm), std::nullopt, "shard_grad_op",
                           policy.keep_unit_buffers, policy.deterministic, owned_value_home::value_arena) {}
  /// hybrid: shards over `shard`, replicas over `replica`.
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm shard, Comm replica,
           const shard_grad_op& policy)
      : sharded_core<Comm>(layout, plan, state, std::move(shard), std::move(replica), "shard_grad_op",
                           policy.keep_unit_buffers, policy.deterministic, owned_value_home::value_arena) {}

  /// All-gathers every bucket's updated owned blocks back into the full parameters; the step consumed the owned
  /// gradients; frees the pooled gradient buffers this step did not need.
  void after_step() {
    std::vector<work> works;
    for (std::size_t b = 0; b < this->plan().buckets.size(); ++b) works.push_back(this->all_gather_bucket(b));
    this->order_buckets(works);
    this->consume_owned_gradients();
    this->trim_pools();
  }
  /// A skipped update left the owned values as they were, so nothing is all-gathered; the gradients are consumed.
  void after_skipped_step() {
    this->consume_owned_gradients();
    this->trim_pools();
  }
  /// The units get gradient storage while a scope holds them; parameters are always whole.
  void acquire(std::span<const std::size_t> units) {
    for (const std::size_t u : units) this->open_scope(u);
  }
  /// Ends a use of the units.
  void release(std::span<const std::size_t> units) {
    for (const std::size_t u : units) this->close_scope(u);
  }
  /// The leaves' framework runs the whole backward (autograd), so no scope can wrap a unit's part of it: every
  /// unit is held for the wrapper's lifetime (the full gradients stay allocated, as under replicate; the
  /// reduce-scatters and the sharded optimizer state are unchanged).
  void leaves_report_themselves() {
    for (std::size_t u = 0; u < this->state().units(); ++u) this->open_scope(u);
  }
  /// Parameters are whole in the value arena already.
  void unshard_model() {}
  /// Every rank holds the full values: all are hashed and compared.
  [[nodiscard]] replica_digest digest() const { return digest_full(this->layout()); }
};
static_assert(sharding_strategy<strategy<shard_grad_op, archetype_communicator>, archetype_communicator, shard_grad_op>,
              "ddp: the shard_grad_op strategy must model sharding_strategy; add what the concept names.");

}  // namespace ddp::detail
