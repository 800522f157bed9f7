#pragma once
/// \file The hybrid<Inner> strategy (HSDP): ranks split into groups of G consecutive ranks; Inner
/// (full_shard or shard_grad_op) shards inside each group, and each reduce-scattered block is then
/// averaged across the groups (over the ranks holding the same block), built on split(). That average is
/// chained when the next bucket starts (sharded_core::reduce), at the same point of the call sequence on
/// every rank; the last bucket's at the waiting point in finish_gradients.

#include <cstddef>
#include <string>
#include <utility>

#include <ddp/comm/env.hpp>
#include <ddp/core/error.hpp>
#include <ddp/parallel/archetype.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/full_shard.hpp>
#include <ddp/parallel/policies.hpp>
#include <ddp/parallel/shard_grad_op.hpp>
#include <ddp/parallel/step_state.hpp>
#include <ddp/parallel/strategy.hpp>

namespace ddp::detail {

template <class Inner, class Comm>
struct strategy<hybrid<Inner>, Comm> : strategy<Inner, Comm> {
  /// G: policy.group_size, else the processes on this host (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, or srun's
  /// count for this node), else the world.
  static std::size_t multiple(const Comm& comm, const hybrid<Inner>& policy) {
    const long long g = policy.group_size > 0 ? policy.group_size : env_local_world_size().value_or(comm.size());
    if (g <= 0 || comm.size() % g != 0)
      throw config_error("hybrid: " + std::to_string(comm.size()) + " ranks do not split into groups of " +
                             std::to_string(g) + "; give ddp::hybrid<>{.group_size = G} (or set LOCAL_WORLD_SIZE) "
                             "with G a divisor of the world size",
                         comm.rank());
    return static_cast<std::size_t>(g);
  }
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm comm,
           const hybrid<Inner>& policy)
      : strategy(layout, plan, state, groups(comm, static_cast<int>(multiple(comm, policy))), policy.inner) {}

 private:
  /// The shard group (G consecutive ranks) and the replica group (the ranks at the same place in every
  /// group), split in this order on every rank.
  static std::pair<Comm, Comm> groups(Comm& comm, int g) {
    Comm shard = comm.split(comm.rank() / g, comm.rank());
    Comm replica = comm.split(comm.rank() % g, comm.rank());
    return {std::move(shard), std::move(replica)};
  }
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, std::pair<Comm, Comm> g,
           const Inner& inner)
      : strategy<Inner, Comm>(layout, plan, state, std::move(g.first), std::move(g.second), inner) {}
};
static_assert(sharding_strategy<strategy<hybrid<full_shard>, archetype_communicator>, archetype_communicator,
                                hybrid<full_shard>> &&
                  sharding_strategy<strategy<hybrid<shard_grad_op>, archetype_communicator>, archetype_communicator,
                                    hybrid<shard_grad_op>>,
              "ddp: the hybrid strategies must model sharding_strategy; add what the concept names.");

}  // namespace ddp::detail
