#pragma once
/// \file The strategy a sharding policy selects: how a bucket is reduced, what the optimizer steps over, what
/// happens after the step and around a unit's use, and the traits data_parallel asks of it instead of branching
/// on the policy. Each sharding policy specializes strategy in its own header, and a static_assert beside it
/// checks that it models sharding_strategy. The step_state holds every phase; the strategy moves the buckets and
/// units through it.

#include <concepts>
#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/core/work.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/archetype.hpp>
#include <ddp/parallel/accumulation.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/comm_hooks.hpp>
#include <ddp/parallel/replica_check.hpp>
#include <ddp/parallel/step_state.hpp>

namespace ddp::detail {

/// Specialized by <ddp/parallel/replicate.hpp> and the sharding headers.
template <class Sharding, class Comm>
struct strategy {
  static_assert(dependent_false<Sharding>,
                "ddp::data_parallel: this sharding policy has no strategy; use ddp::replicate, ddp::shard_grad_op, "
                "ddp::full_shard or ddp::hybrid<ddp::full_shard or ddp::shard_grad_op>.");
};

/// What data_parallel asks of a strategy S over communicator Comm, for the sharding policy value of type Policy.
/// Traits (what the wrapper does differently per policy; each is passed through, never branched on):
///   multiple(comm, policy)      arena padding and bucket granularity (the shard group's size), before construction
///   accumulation                how micro-batches accumulate under no_sync (parallel/accumulation.hpp)
///   initial_units               the unit phase the strategy starts in
///   bucket_cut                  where buckets may end (anywhere, or inside units)
///   rebuilds_buckets            the first step's ready order may replan the buckets (parallel/bucket_rebuild.hpp)
///   join_replays_scopes         a join shadow step replays the last step's scopes and reports
///   check_leaves(layout, rank)  refuses leaves the strategy cannot hold, before any collective
///   prepare_optimizer(opt, buffers, layout, rank)   refuses a framework optimizer over the wrong tensors (or over
///                               owning leaves, where no rank holds their whole gradients), relinks its gradients to
///                               the owned ones (a template)
/// Work:
///   S(layout, plan, state, comm, policy)      collective
///   reduce(hook, b): bucket b waiting → started (and, under hybrid, chains earlier buckets without waiting)
///   reduced(hook, b): waits for bucket b, → reduced, finishes its gradients
///   acquire(units) / release(units)           an unshard scope opens / closes on units
///   on_report(slot)                           checks (and notes) a gradient report
///   leaves_report_themselves()                the leaves' framework runs the backward (autograd): no scope wraps it
///   optimizer_buffers(), after_step(), zero_grad()
///   after_skipped_step()                      a step whose update was skipped (loss scaling): the gradients are
///                                             consumed as after a step, the unchanged values not moved
///   unshard_model()                           collective: the model's parameters hold the full values
///   digest()                                  verify_in_sync's hashes of the values this rank shares
///   shard_group(), replica_group()            the groups parameters are sharded and replicated over
///   norm_group()                              the ranks whose optimizer buffers hold disjoint pieces of the
///                                             gradients (a gradient norm sums over them), none under replicate
template <class S, class Comm, class Policy>
concept sharding_strategy =
    std::constructible_from<S, parameter_layout&, const bucket_plan&, step_state&, Comm, const Policy&> &&
    accumulation_mode<typename S::accumulation> &&
    requires(S& s, const S& cs, const Comm& comm, const Policy& policy, plain_hook& hook, std::size_t i,
             std::span<const std::size_t> units, const parameter_layout& layout, int rank) {
      { S::multiple(comm, policy) } -> std::same_as<std::size_t>;
      { S::initial_units } -> std::convertible_to<unit_phase>;
      { S::bucket_cut } -> std::convertible_to<detail::bucket_cut>;
      { S::rebuilds_buckets } -> std::convertible_to<bool>;
      { S::join_replays_scopes } -> std::convertible_to<bool>;
      S::check_leaves(layout, rank);
      { s.reduce(hook, i) } -> std::same_as<void>;
      { s.reduced(hook, i) } -> std::same_as<void>;
      s.acquire(units);
      s.release(units);
      s.on_report(i);
      s.leaves_report_themselves();
      { cs.optimizer_buffers() } -> std::same_as<const std::vector<optim::flat_buffer>&>;
      s.after_step();
      s.after_skipped_step();
      s.zero_grad();
      s.unshard_model();
      { cs.digest() } -> std::same_as<replica_digest>;
      { cs.shard_group() } -> std::convertible_to<Comm>;
      { cs.replica_group() } -> std::convertible_to<std::optional<Comm>>;
      { cs.norm_group() } -> std::convertible_to<std::optional<Comm>>;
    };

}  // namespace ddp::detail
