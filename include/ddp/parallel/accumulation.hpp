#pragma once
/// \file How gradients accumulate over the micro-batches of a no_sync span: the trait each strategy names
/// (`using accumulation = ...`, parallel/strategy.hpp). data_parallel and ddp::no_sync_guard ask it instead of
/// branching on the policy: whether a report inside a span only accumulates, what opening, closing and dropping a
/// span do, and what becomes of an owning leaf's own gradient once it moved into ddp's memory.

#include <concepts>

#include <ddp/parallel/leaf_binding.hpp>
#include <ddp/parallel/phases.hpp>
#include <ddp/parallel/step_state.hpp>

namespace ddp::detail {

/// replicate (PyTorch DDP's no_sync): micro-batches add into the gradient arenas (and owning leaves' own
/// gradients) with no traffic; the next synchronized backward reduces their sum once.
struct local_accumulation {
  /// A report inside a span only accumulates: no bucket moves.
  static bool defers(const step_state& state) noexcept { return state.no_sync().open > 0; }
  /// A span may open inside a join scope: a rank that ran out shadows only the synchronized step.
  static void opening(step_state& /*state*/, int /*rank*/) noexcept {}
  /// close() has nothing to complete.
  template <class DP>
  static void closing(DP& /*dp*/) noexcept {}
  /// A span left without close() leaves nothing unfinished.
  static void dropped(step_state& /*state*/) noexcept {}
  /// An owning leaf keeps adding into its own gradient until the synchronized backward.
  static void moved_in(leaf_binding& /*leaf*/) noexcept {}
};

/// The sharded strategies: a unit's full gradients exist only inside its unshard scope, so each micro-batch is
/// reduce-scattered into the owned gradients during its own backward. close() completes that micro-batch; a span
/// left without close() makes the next call say so; a join scope refuses spans (a rank that ran out could not
/// mirror each micro-batch's reductions); an owning leaf's own gradient starts again from zero once moved in.
struct reduced_accumulation {
  /// Every report moves its buckets, inside a span too.
  static bool defers(const step_state& /*state*/) noexcept { return false; }
  /// Refused inside a join scope.
  static void opening(step_state& state, int rank) { state.join().refuse_no_sync(rank); }
  /// close() waits for the micro-batch's reduce-scatters (collective).
  template <class DP>
  static void closing(DP& dp) {
    dp.finish_gradients();
  }
  /// A span left without close() in the middle of a micro-batch is remembered, and named by the next call.
  static void dropped(step_state& state) noexcept {
    if (state.phase() == step_phase::reporting) state.no_sync().unclosed = true;
  }
  /// The micro-batch's gradient was reduced away: the leaf's own gradient restarts from zero.
  static void moved_in(leaf_binding& leaf) { leaf.zero_own_gradient(); }
};

/// What data_parallel asks of a strategy's accumulation trait A.
template <class A>
concept accumulation_mode = requires(step_state& state, const step_state& cstate, leaf_binding& leaf, int rank) {
  { A::defers(cstate) } -> std::same_as<bool>;
  A::opening(state, rank);
  A::dropped(state);
  A::moved_in(leaf);
};
static_assert(accumulation_mode<local_accumulation> && accumulation_mode<reduced_accumulation>,
              "ddp: an accumulation trait must give defers, opening, closing, dropped and moved_in.");

}  // namespace ddp::detail
