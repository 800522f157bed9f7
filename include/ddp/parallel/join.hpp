#pragma once
/// \file Uneven inputs (PyTorch's `Join`): ranks with different numbers of batches finish an epoch together.
///
/// `auto j = dp.join();` opens a join scope on every rank before the loop. Inside it each step's first
/// collective is a one-integer all-reduce that counts the ranks still training (data_parallel calls
/// join_state::begin_step at the step's first unshard scope or gradient report), and the step's reduced
/// gradients, averaged over all N ranks as always, are scaled by N / active (join_state::rescale): the mean over
/// the active ranks' batches, whatever the comm hook or the deterministic knob. A rank that runs out calls
/// `j.finish(opt)`: it counts 0 and, while some rank still counts 1, shadows that rank's step with zero
/// gradients: the same collectives in the same order (the reductions through the same hook, full_shard's
/// all-gathers by replaying this rank's last step's unshard scopes and reports), then its own optimizer step on
/// the reduced gradients, so parameters and optimizer state stay the same on every rank. It returns once every
/// rank has called finish (the count is 0). No collective runs in the scope's destructor: a scope left
/// without finish(opt) makes the wrapper's next call throw ddp::error saying so.

#include <ddp/core/error.hpp>
#include <ddp/parallel/join_state.hpp>
#include <ddp/parallel/step_state.hpp>

namespace ddp {

/// Scope returned by data_parallel::join() (PyTorch's `with model.join():`): open it on every rank before an
/// epoch whose ranks hold different numbers of batches, step as usual, and call finish(opt) after the rank's
/// last step. Its destructor issues no collective: a scope left without finish(opt) makes the wrapper's next
/// call throw ddp::error.
template <class DP>
class [[nodiscard]] join_scope {
 public:
  explicit join_scope(DP& dp) : dp_(&dp), rank_(dp.rank()) { dp.state_.join().open_scope(dp.state_.phase(), rank_); }
  join_scope(const join_scope&) = delete;
  join_scope& operator=(const join_scope&) = delete;
  ~join_scope() {
    if (dp_) dp_->state_.join().drop();
  }

  /// Collective: this rank has no batch left. While another rank still trains, shadows its step: zero
  /// gradients through the same collectives (full_shard: this rank's last step's unshard scopes and reports,
  /// replayed), then `dp.step(opt)` on the gradients reduced over the active ranks. Returns when every rank has
  /// called finish; afterwards the wrapper trains as outside a join scope.
  template <class Opt>
  void finish(Opt& opt) {
    if (!dp_) throw error("join_scope::finish: this scope is finished already; open a new one with dp.join()", rank_);
    DP& dp = *dp_;
    dp.state_.join().leave(dp.state_.phase(), rank_);
    while (const int active = detail::join_state::count(dp.comm_, 0)) {
      dp.zero_grad();
      const detail::step_record& replay = dp.state_.join().shadow(active, rank_);
      for (const auto& e : replay.events) {
        if (e.what == detail::step_event::kind::acquire) dp.strategy_->acquire(replay.units_of(e));
        else if (e.what == detail::step_event::kind::release) dp.strategy_->release(replay.units_of(e));
        else dp.report(e.slot);
      }
      dp.step(opt);
    }
    dp.state_.join().close();
    dp_ = nullptr;
  }

 private:
  DP* dp_;
  int rank_;
};

}  // namespace ddp
