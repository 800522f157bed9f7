#pragma once
/// \file The strategy a sharding policy selects: how a bucket is reduced, what the optimizer steps over, what
/// happens after the step and around a unit's use. Each sharding policy specializes strategy in its own header,
/// and a static_assert beside it checks that it models sharding_strategy. data_parallel owns the step_state;
/// the strategy moves the buckets and units through it.

#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/archetype.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/comm_hooks.hpp>
#include <ddp/parallel/step_state.hpp>

namespace ddp::detail {

/// Specialized by <ddp/parallel/replicate.hpp> and the sharding headers.
template <class Sharding, class Comm>
struct strategy {
  static_assert(dependent_false<Sharding>,
                "ddp::data_parallel: this sharding policy has no strategy; use ddp::replicate, ddp::shard_grad_op, "
                "ddp::full_shard or ddp::hybrid<ddp::full_shard or ddp::shard_grad_op>.");
};

/// What data_parallel asks of a strategy S over communicator Comm, for the sharding policy value of type Policy:
///   S(layout, plan, state, comm, policy)      collective; `multiple(comm, policy)` pads the arenas first
///   sharded                                   gradients are reduced even under no_sync (the sharded ones)
///   initial_units                             the unit phase the strategy starts in
///   reduce(hook, b): bucket b waiting → launched (and, under hybrid, chains earlier buckets without waiting)
///   reduced(hook, b): waits for bucket b, → reduced, finishes its gradients
///   acquire(units) / release(units)           an unshard scope opens / closes on units
///   on_report(slot)                           checks (and notes) a gradient report
///   optimizer_buffers(), after_step(), zero_grad()
///   unshard_model()                           collective: the model's parameters hold the full values
template <class S, class Comm, class Policy>
concept sharding_strategy =
    std::constructible_from<S, parameter_layout&, const bucket_plan&, step_state&, Comm, const Policy&> &&
    requires(S& s, const S& cs, const Comm& comm, const Policy& policy, plain_hook& hook, std::size_t i,
             std::span<const std::size_t> units) {
      { S::multiple(comm, policy) } -> std::same_as<std::size_t>;
      { S::sharded } -> std::convertible_to<bool>;
      { S::initial_units } -> std::convertible_to<unit_phase>;
      { s.reduce(hook, i) } -> std::same_as<void>;
      { s.reduced(hook, i) } -> std::same_as<void>;
      s.acquire(units);
      s.release(units);
      s.on_report(i);
      { cs.optimizer_buffers() } -> std::same_as<const std::vector<optim::flat_buffer>&>;
      s.after_step();
      s.zero_grad();
      s.unshard_model();
    };

}  // namespace ddp::detail
