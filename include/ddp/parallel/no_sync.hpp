#pragma once
/// \file ddp::no_sync_guard: the scope of a gradient-accumulation span, what dp.no_sync() returns (PyTorch's
/// `with model.no_sync():`). It counts the open spans in the step state; the strategy's accumulation trait
/// (parallel/accumulation.hpp) says what closing and dropping a span mean for the policy.

#include <ddp/parallel/step_state.hpp>

namespace ddp {

/// Scope returned by no_sync(): while open, gradients accumulate without a step. Under replicate they
/// accumulate locally without communication; under the sharding strategies each micro-batch is
/// reduce-scattered into the sharded gradients, which close() (or dp.finish_gradients()) completes — call
/// it at the end of the span. The destructor issues no collective: it only ends the span.
template <class DataParallel>
class [[nodiscard]] no_sync_guard {
 public:
  /// Opens a span of `dp` (dp.no_sync() checks that one may open).
  explicit no_sync_guard(DataParallel& dp) : dp_(&dp) { ++dp_->state_.no_sync().open; }
  no_sync_guard(const no_sync_guard&) = delete;
  no_sync_guard& operator=(const no_sync_guard&) = delete;
  /// Ends the span; under the sharded strategies waits for this micro-batch's reduce-scatters (collective).
  void close() {
    if (!dp_) return;
    DataParallel& dp = *dp_;
    end_span();
    DataParallel::accumulation::closing(dp);
  }
  /// Ends the span if close() did not; under the sharded strategies an unfinished micro-batch is then
  /// reported by the next gradient_ready or no_sync (call close() or dp.finish_gradients()).
  ~no_sync_guard() {
    if (!dp_) return;
    DataParallel::accumulation::dropped(dp_->state_);
    end_span();
  }

 private:
  void end_span() noexcept {
    --dp_->state_.no_sync().open;
    dp_ = nullptr;
  }
  DataParallel* dp_;
};

}  // namespace ddp
