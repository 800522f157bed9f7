#pragma once
/// \file The full_shard strategy (ZeRO-3, FSDP FULL_SHARD): parameters live as owned blocks only. When the
/// user opens an unshard scope on a unit (dp.unshard(model.fc2)), the unit's parameters are bound to a pooled
/// buffer (the smallest idle one that fits; see unit_pool) and all-gathered into it, and the next unit in
/// the direction of travel (forward or backward) is prefetched into another. "Next" follows the execution
/// order: the order in which the scopes of the first step first opened the units (as FSDP2 records its
/// forward order), the same on every rank that runs the same program, turning around where a unit at either
/// end of it is opened again (the backward after the forward); during the first step, and for units it did
/// not use, the order of the fields. When the last scope on a unit
/// closes, the buffer goes back to the pool (full_shard::reshard_after_forward) and the parameters point
/// at zero pages again. Gradients are pooled and reduce-scattered as in shard_grad_op.

#include <cstddef>
#include <string>
#include <optional>
#include <span>
#include <vector>

#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>
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
struct strategy<full_shard, Comm> : sharded_core<Comm> {
  static constexpr unit_phase initial_units = unit_phase::sharded;
  /// A shadow step must issue the all-gathers of the units' scopes: it replays the last step's scopes and reports.
  static constexpr bool join_replays_scopes = true;
  static std::size_t multiple(const Comm& comm, const full_shard& /*policy*/) {
    return static_cast<std::size_t>(comm.size());
  }
  /// A rank keeps only its owned blocks, so every leaf must compute on ddp's memory (adopt it).
  static void check_leaves(const parameter_layout& layout, int rank) { require_adopting(layout, rank); }
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm comm, const full_shard& policy)
      : sharded_core<Comm>(layout, plan, state, std::move(comm), std::nullopt, "full_shard", policy.keep_unit_buffers,
                           policy.deterministic, owned_value_home::own_copy),
        reshard_(policy.reshard_after_forward) {
    this->release_arena_values();
  }
  /// hybrid: shards over `shard`, replicas over `replica`.
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm shard, Comm replica,
           const full_shard& policy)
      : sharded_core<Comm>(layout, plan, state, std::move(shard), std::move(replica), "full_shard",
                           policy.keep_unit_buffers, policy.deterministic, owned_value_home::own_copy),
        reshard_(policy.reshard_after_forward) {
    this->release_arena_values();
  }

  /// Unshards the units (all-gathering them, or waiting for a prefetch) and gives them gradient storage, then
  /// prefetches the next unit in the direction of travel. Collective over the shard group, in the same order
  /// on every rank. In the first step it records the order in which units are first opened.
  void acquire(std::span<const std::size_t> units) {
    for (const std::size_t u : units) {
      if (this->state().unit(u).values == unit_phase::sharded) unshard(u);
      if (this->state().unit(u).values == unit_phase::unsharding) this->unsharded(u);
      this->open_scope(u);
      if (!recorded_ && position_[u] == unrecorded) {
        position_[u] = order_.size();
        order_.push_back(u);
      }
    }
    if (units.empty()) return;
    const std::size_t u = units.back();
    if (last_)
      if (const auto next = next_unit(*last_, u)) prefetch(*next);
    last_ = u;
  }
  /// Ends a use of the units; a unit no scope holds any more is resharded (when resharding after forward)
  /// and releases its gradient storage once its gradients are reduced.
  void release(std::span<const std::size_t> units) {
    for (const std::size_t u : units) {
      this->close_scope(u);
      if (this->state().unit(u).scopes == 0 && reshard_) reshard(u);
    }
  }
  /// The owned blocks changed (and the step consumed the owned gradients): every unit no scope holds is resharded
  /// (the next scope unshards it again), a unit still held is unsharded again in place; then the pooled buffers
  /// this step did not need are freed.
  void after_step() {
    recorded_ = true;  // the execution order of the first step is known
    this->consume_owned_gradients();
    for (std::size_t u = 0; u < this->state().units(); ++u) {
      if (this->state().unit(u).values == unit_phase::unsharding) this->settle_unsharding(u);
      if (this->state().unit(u).scopes == 0) {
        reshard(u);
      } else if (this->state().unit(u).values == unit_phase::unsharded) {  // a scope open across the step
        this->state().reshard(u);
        unshard(u);
        this->settle_unsharding(u);
      }
    }
    this->trim_pools();
  }
  /// A skipped update: the units reshard and the gradients are consumed as after any step (no value moved).
  void after_skipped_step() { after_step(); }
  /// Collective: all-gathers every bucket into the value arena and points every parameter there, so the
  /// model's own parameters hold the full values (also once the wrapper is gone). No unshard scope may be open.
  void unshard_model() {
    for (std::size_t u = 0; u < this->state().units(); ++u) {
      if (this->state().unit(u).scopes > 0)
        throw error("unshard_model: unit '" + this->unit_name(u) + "' is inside an unshard scope; close every "
                    "dp.unshard(...) scope before unsharding the whole model", this->shard_group().rank());
      reshard(u);
    }
    this->restore_arena_values();
    std::vector<work> works;
    for (std::size_t b = 0; b < this->plan().buckets.size(); ++b) works.push_back(this->all_gather_bucket(b));
    this->order_buckets(works);
    this->arena_holds_values();
  }
  /// The units' forwards open scopes and their backwards reopen them (backward_opener, ddp::forward of the
  /// LibTorch adapter): nothing to hold for the framework's backward.
  void leaves_report_themselves() noexcept {}
  /// A rank holds only its owned blocks: those are hashed and compared with the ranks owning the same blocks
  /// (the other groups under hybrid; without replicas every value has one owner and nothing is compared).
  [[nodiscard]] replica_digest digest() const {
    return digest_owned(this->layout(), this->optimizer_buffers(), this->shard_group().rank());
  }

 private:
  static constexpr std::size_t unrecorded = static_cast<std::size_t>(-1);

  /// The unit after `u` in the direction of travel from `last`: in the recorded execution order once the
  /// first step is over and both units are in it, else in field order; none at either end. In the recorded
  /// order a unit at either end opened again turns the travel around (the backward reopening the forward's
  /// last unit, as autograd's hooks do, prefetches the one before it; the next forward, the one after the first).
  [[nodiscard]] std::optional<std::size_t> next_unit(std::size_t last, std::size_t u) const {
    if (recorded_ && position_[u] != unrecorded && position_[last] != unrecorded) {
      const std::size_t at = position_[u], from = position_[last], end = order_.size() - 1;
      if (at > from || (at == from && at == 0 && end > 0))
        return at < end ? std::optional(order_[at + 1]) : std::nullopt;
      if (at < from || (at == from && at == end && end > 0)) return at > 0 ? std::optional(order_[at - 1]) : std::nullopt;
      return std::nullopt;
    }
    if (u == last) return std::nullopt;
    if (u > last) return u + 1 < position_.size() ? std::optional(u + 1) : std::nullopt;
    return u > 0 ? std::optional(u - 1) : std::nullopt;
  }
  /// sharded → unsharding: a pooled buffer and the all-gathers of the unit's buckets into it.
  void unshard(std::size_t u) {
    this->take_values(u);
    std::vector<work> all_gathers;
    for (const std::size_t b : this->state().unit_buckets(u)) all_gathers.push_back(this->all_gather_bucket(b));
    this->state().unshard(u, std::move(all_gathers));
  }
  void prefetch(std::size_t u) {
    if (this->state().unit(u).values == unit_phase::sharded) unshard(u);
  }
  /// → sharded: waits for all-gathers in flight, gives the values buffer back.
  void reshard(std::size_t u) {
    if (this->state().unit(u).values == unit_phase::unsharding) this->settle_unsharding(u);
    if (this->state().unit(u).values == unit_phase::unsharded) {
      this->give_values(u);
      this->state().reshard(u);
    }
  }

  bool reshard_ = true;
  std::optional<std::size_t> last_;  // the unit unsharded last (direction of travel)
  std::vector<std::size_t> order_;   // units in the order the first step's scopes first opened them
  std::vector<std::size_t> position_ = std::vector<std::size_t>(this->state().units(), unrecorded);  // in order_
  bool recorded_ = false;            // the first step is over: order_ is the execution order
};
static_assert(sharding_strategy<strategy<full_shard, archetype_communicator>, archetype_communicator, full_shard>,
              "ddp: the full_shard strategy must model sharding_strategy; add what the concept names.");

}  // namespace ddp::detail
