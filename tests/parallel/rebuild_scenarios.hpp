#pragma once
// Buckets rebuilt in the first step's ready order (parallel/bucket_rebuild.hpp), for any communicator (run under
// TCP and MPI): a model whose visit order (fc3, fc2, fc1) differs from its backward's order, so the planned
// buckets (reverse visit order) would all wait for fc1, the backward's last layer.

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <algorithm>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/comm/object.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "scenarios.hpp"

namespace ddp_test {

/// The mlp visited last layer first: fc3.weight, fc3.bias, fc2.weight, ..., fc1.bias. Its backward reports
/// fc3.bias, fc3.weight, fc2.bias, ...: slots 1, 0, 3, 2, 5, 4, which is not the reverse visit order.
struct reversed_mlp {
  mlp& m;
  template <class F>
  void visit_parameters(F&& f) {
    for (const auto& [name, l] : std::initializer_list<std::pair<const char*, linear*>>{{"fc3", &m.fc3}, {"fc2", &m.fc2}, {"fc1", &m.fc1}}) {
      f(std::string(name) + ".weight", l->weight);
      f(std::string(name) + ".bias", l->bias);
    }
  }
};
/// The slots of reversed_mlp in the order its backward reports them.
inline const std::vector<std::size_t> reversed_backward_order{1, 0, 3, 2, 5, 4};

/// Each bucket's latest slot in `ready` order: buckets started in ready order have non-decreasing ones.
inline std::vector<std::size_t> ready_positions(const ddp::detail::bucket_plan& plan, const std::vector<std::size_t>& ready) {
  std::vector<std::size_t> at(ready.size()), out;
  for (std::size_t i = 0; i < ready.size(); ++i) at[ready[i]] = i;
  for (const auto& b : plan.buckets) {
    std::size_t latest = 0;
    for (const std::size_t s : b.params) latest = std::max(latest, at[s]);
    out.push_back(latest);
  }
  return out;
}
/// Every bucket as (arena, begin, end): what ranks compare.
template <class DP>
std::vector<std::int64_t> bucket_ranges(const DP& dp) {
  std::vector<std::int64_t> out;
  for (const auto& b : dp.buckets().buckets)
    for (const std::size_t v : {b.arena, b.begin, b.end}) out.push_back(static_cast<std::int64_t>(v));
  return out;
}

/// N ranks train reversed_mlp with policies Ps (`micro` micro-batches a step, all but the last under no_sync):
/// after the first step every rank's buckets start in the backward's order, the same buckets on every rank, and
/// the parameters equal one process's (tol). With `scrambled`, rank 1 reports in another order (visit order, at
/// the end of each backward): every rank still takes rank 0's order. Returns the trained parameters.
template <class... Ps, class Comm>
mlp check_rebuilt_training(Comm comm, optimizer_kind k, double tol, closeness how = closeness::per_element, int micro = 1,
                           typename ddp::policies<Ps...>::sharding sharding = {},
                           ddp::data_parallel_options options = {}, bool scrambled = false) {
  mlp base = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));
  reversed_mlp view{base};
  {
    ddp::data_parallel<reversed_mlp, Ps...> dp{view, comm, sharding, options};
    const auto planned = ready_positions(dp.buckets(), reversed_backward_order);
    const auto [begin, count] = shard_of(comm.rank(), comm.size());
    const float scale = static_cast<float>(comm.size()) / global_batch;
    const bool late = scrambled && comm.rank() == 1;
    std::vector<ddp::parameter<float>*> held;
    auto report = [&](auto& p) {
      if (late) held.push_back(&p);
      else dp.gradient_ready(p);
    };
    const auto backward = [&](const batch& b) {
      forward_backward(base, b, scale, report);
      for (auto it = held.rbegin(); it != held.rend(); ++it) dp.gradient_ready(**it);
      held.clear();
    };
    with_optimizer(k, [&](auto& opt) {
      for (int s = 0; s < steps; ++s) {
        dp.zero_grad();
        const batch mine = make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count);
        over_micro_batches(dp, mine, micro, backward);
        dp.step(opt);
        const auto positions = ready_positions(dp.buckets(), reversed_backward_order);
        if (options.rebuild_buckets) {
          REQUIRE(std::is_sorted(positions.begin(), positions.end()));
          if (dp.bucket_count() > 1)  // fc3.bias alone fills the small first bucket, which starts first
            REQUIRE(dp.buckets().buckets.front().params == std::vector<std::size_t>{1});
        } else {
          REQUIRE(positions == planned);
        }
        const auto all = ddp::all_gather_object(comm, bucket_ranges(dp));
        for (const auto& r : all) REQUIRE(r == all.front());
      }
    });
  }
  mlp want = reference_training(k);
  require_close(base, want, tol, how);
  return base;
}

/// The planned buckets would start fc1's first: not sorted by the backward's order.
inline void require_planned_order_is_late() {
  mlp base = make_mlp(1);
  reversed_mlp view{base};
  ddp::detail::parameter_layout layout(view);
  const auto positions = ready_positions(ddp::detail::plan_buckets(layout, 200, 60), reversed_backward_order);
  REQUIRE(positions.front() == reversed_backward_order.size() - 1);
}

/// Deterministic reduction gives the same bits with the buckets rebuilt or planned, at any bucket size.
template <class Backend, class Comm>
void check_rebuilt_deterministic(Comm comm) {
  const ddp::replicate exact{.deterministic = true};
  using tiny = ddp::bucket_bytes<200, 60>;
  const auto how = closeness::per_element;
  mlp rebuilt = check_rebuilt_training<Backend, tiny>(comm, optimizer_kind::adamw, 1e-5, how, 1, exact);
  mlp planned = check_rebuilt_training<Backend, tiny>(comm, optimizer_kind::adamw, 1e-5, how, 1, exact,
                                                      {.rebuild_buckets = false});
  mlp one_bucket = check_rebuilt_training<Backend>(comm, optimizer_kind::adamw, 1e-5, how, 1, exact);
  for (mlp* other : {&planned, &one_bucket})
    for (auto [a, b] : {std::pair{&rebuilt.fc1, &other->fc1}, {&rebuilt.fc2, &other->fc2}, {&rebuilt.fc3, &other->fc3}}) {
      REQUIRE(std::equal(a->weight.value().begin(), a->weight.value().end(), b->weight.value().begin()));
      REQUIRE(std::equal(a->bias.value().begin(), a->bias.value().end(), b->bias.value().begin()));
    }
}

}  // namespace ddp_test
