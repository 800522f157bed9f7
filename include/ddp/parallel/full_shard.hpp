#pragma once
/// \file The full_shard strategy (ZeRO-3, FSDP FULL_SHARD): parameters live as owned blocks only. When the
/// user opens a gather scope on a unit (dp.gather(model.fc2)), the unit's parameters are bound to a pooled
/// buffer (the smallest idle one that fits; see unit_pool) and all-gathered into it, and the next unit in
/// the direction of travel (forward or backward) is prefetched into another; when the last scope on a unit
/// closes, the buffer goes back to the pool (reshard after forward, configurable) and the parameters point
/// at zero pages again. Gradients are pooled and reduce-scattered as in shard_grad_op.

#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include <ddp/comm/work.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/options.hpp>
#include <ddp/parallel/policies.hpp>
#include <ddp/parallel/sharded.hpp>
#include <ddp/parallel/strategy.hpp>

namespace ddp::detail {

template <class Comm>
struct strategy<full_shard, Comm> : sharded_core<Comm> {
  static std::size_t multiple(const Comm& comm, const data_parallel_options& /*options*/) {
    return static_cast<std::size_t>(comm.size());
  }
  strategy(parameter_layout& layout, const bucket_plan& plan, Comm comm, const data_parallel_options& options)
      : sharded_core<Comm>(layout, plan, std::move(comm), std::nullopt, "full_shard", options, false) {
    setup(options);
  }
  /// hybrid: shards over `shard`, replicas over `replica`.
  strategy(parameter_layout& layout, const bucket_plan& plan, Comm shard, Comm replica,
           const data_parallel_options& options)
      : sharded_core<Comm>(layout, plan, std::move(shard), std::move(replica), "full_shard", options, false) {
    setup(options);
  }
  strategy(const strategy&) = delete;
  strategy& operator=(const strategy&) = delete;
  ~strategy() {
    for (auto& unit : in_flight_)
      for (auto& w : unit) try { w.wait(); } catch (...) {}  // NOLINT: no throw from a destructor
  }

  /// Makes the units' full parameters available (gathering, or waiting for a prefetch) with gradient
  /// storage, then prefetches the next unit in the direction of travel. Collective over the shard group,
  /// in the same order on every rank.
  void acquire(std::span<const std::size_t> units) {
    for (const std::size_t u : units) {
      if (this->holders(u) == 0 && !resident_[u]) {
        if (in_flight_[u].empty()) launch(u);
        finish(u);
      }
      this->hold(u);
    }
    if (units.empty()) return;
    const std::size_t u = units.back();
    if (last_ && *last_ != u) {
      const bool forward = u > *last_;
      if (forward && u + 1 < this->units()) prefetch(u + 1);
      if (!forward && u > 0) prefetch(u - 1);
    }
    last_ = u;
  }
  /// Ends a use of the units; a unit no scope holds any more gives its values buffer back (when resharding
  /// after forward) and its gradient buffer once its gradients are reduced.
  void release(std::span<const std::size_t> units) {
    for (const std::size_t u : units) {
      this->let_go(u);
      if (this->holders(u) == 0 && reshard_) drop(u);
    }
  }
  /// The owned blocks changed: wait for prefetches and drop every gathered unit (the next scope re-gathers);
  /// then free the pooled buffers this step did not need.
  void after_step() {
    for (std::size_t u = 0; u < this->units(); ++u) {
      if (!in_flight_[u].empty()) finish(u);
      if (this->holders(u) == 0) {
        drop(u);
      } else {  // a scope still open across the step sees the updated values
        launch(u);
        finish(u);
      }
    }
    this->trim_pools();
  }
  /// Collective: gathers every bucket into the value arena and points every parameter there, so the model
  /// keeps its trained values once the wrapper is gone.
  void finalize() {
    for (std::size_t u = 0; u < this->units(); ++u) drop(u);
    std::vector<work> works;
    for (std::size_t b = 0; b < this->plan().buckets.size(); ++b) works.push_back(this->gather_bucket(b));
    wait_all(works);
  }

 private:
  void setup(const data_parallel_options& options) {
    reshard_ = options.reshard_after_forward;
    resident_.assign(this->units(), 0);
    in_flight_.resize(this->units());
    this->park_values();
  }
  void launch(std::size_t u) {
    this->take_values(u);
    for (const std::size_t b : this->unit_buckets(u)) in_flight_[u].push_back(this->gather_bucket(b));
  }
  void finish(std::size_t u) {
    wait_all(in_flight_[u]);
    in_flight_[u].clear();
    resident_[u] = 1;
  }
  void prefetch(std::size_t u) {
    if (!resident_[u] && in_flight_[u].empty()) launch(u);
  }
  void drop(std::size_t u) {
    if (!in_flight_[u].empty()) finish(u);
    this->give_values(u);
    resident_[u] = 0;
  }

  bool reshard_ = true;
  std::vector<char> resident_;                // per unit: full parameters present
  std::vector<std::vector<work>> in_flight_;  // per unit: gathers under way (prefetch)
  std::optional<std::size_t> last_;           // the unit gathered last (direction of travel)
};

}  // namespace ddp::detail
