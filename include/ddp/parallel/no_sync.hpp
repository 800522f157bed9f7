#pragma once
/// \file ddp::no_sync_guard: the scope of a gradient-accumulation span, what dp.no_sync() returns (PyTorch's
/// `with model.no_sync():`). It only counts the open spans; data_parallel decides what a span means for its policy.

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
  explicit no_sync_guard(DataParallel& dp) : dp_(&dp) { ++dp_->no_sync_depth_; }
  no_sync_guard(const no_sync_guard&) = delete;
  no_sync_guard& operator=(const no_sync_guard&) = delete;
  /// Ends the span; under the sharded strategies waits for this micro-batch's reduce-scatters (collective).
  void close() {
    if (!dp_) return;
    DataParallel& dp = *dp_;
    end_span();
    if constexpr (sharded) dp.finish_gradients();
  }
  /// Ends the span if close() did not; under the sharded strategies an unfinished micro-batch is then
  /// reported by the next gradient_ready or no_sync (call close() or dp.finish_gradients()).
  ~no_sync_guard() {
    if (!dp_) return;
    if (sharded && dp_->state_.phase() == detail::step_phase::reporting) dp_->no_sync_unclosed_ = true;
    end_span();
  }

 private:
  static constexpr bool sharded = DataParallel::strategy_type::sharded;
  void end_span() noexcept {
    --dp_->no_sync_depth_;
    dp_ = nullptr;
  }
  DataParallel* dp_;
};

}  // namespace ddp
