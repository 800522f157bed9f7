#pragma once
/// \file The strategy a sharding policy selects: how a bucket is reduced, what the optimizer steps over,
/// what happens after the step and around a unit's use. Each sharding policy specializes strategy in
/// its own header. A strategy provides:
///   strategy(parameter_layout&, const bucket_plan&, Comm, const data_parallel_options&)  (collective)
///   static std::size_t multiple(const Comm&, const data_parallel_options&)  padding of the arenas
///   static constexpr bool sharded                        gradients are reduced even under no_sync
///   work reduce(Hook&, b) / void reduced(Hook&, b)       a bucket's reduction and its completion
///   optimizer_buffers(), after_step(), zero_grad()
///   acquire(units) / release(units)                      a gather scope opens / closes on units
///   on_report(slot)                                      checks (and notes) a gradient report
///   finalize()                                           collective, before the layout hands values back

#include <ddp/comm/backend.hpp>

namespace ddp::detail {

/// Specialized by <ddp/parallel/replicate.hpp> and the sharding headers.
template <class Sharding, class Comm>
struct strategy {
  static_assert(dependent_false<Sharding>,
                "ddp::data_parallel: this sharding policy has no strategy; use ddp::replicate, ddp::shard_grad_op, "
                "ddp::full_shard or ddp::hybrid<ddp::full_shard or ddp::shard_grad_op>.");
};

}  // namespace ddp::detail
