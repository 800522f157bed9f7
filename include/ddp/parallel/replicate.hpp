#pragma once
/// \file The replicate strategy (PyTorch DDP): every rank keeps all parameters, gradients and optimizer
/// state; each bucket is all-reduced (through the comm hook) and the optimizer steps the whole arenas.

#include <cstddef>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include <ddp/core/work.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/accumulation.hpp>
#include <ddp/parallel/archetype.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/comm_hooks.hpp>
#include <ddp/parallel/master_weights.hpp>
#include <ddp/parallel/ordered_reduction.hpp>
#include <ddp/parallel/policies.hpp>
#include <ddp/parallel/replica_check.hpp>
#include <ddp/parallel/step_state.hpp>
#include <ddp/parallel/strategy.hpp>

namespace ddp::detail {

/// Whole flat buffers: one per arena, every parameter a segment.
inline std::vector<optim::flat_buffer> whole_arenas(const parameter_layout& layout) {
  std::vector<optim::flat_buffer> out;
  const auto names = parameter_names(layout);
  for (const auto& a : layout.arenas()) {
    optim::flat_buffer b{.values = a.value_view(0, a.numel), .grads = a.grad_view(0, a.numel), .segments = {},
                         .domain = a.domain, .parameters = names};
    for (const std::size_t s : a.params)
      b.segments.push_back({.name = layout.slots()[s].name, .offset = layout.slots()[s].offset,
                            .numel = layout.slots()[s].numel, .start = 0});
    out.push_back(std::move(b));
  }
  return out;
}

template <class Comm>
struct strategy<replicate, Comm> {
  using accumulation = local_accumulation;  ///< no_sync accumulates locally, with no traffic
  static constexpr unit_phase initial_units = unit_phase::unsharded;
  static constexpr detail::bucket_cut bucket_cut = detail::bucket_cut::anywhere;
  static constexpr bool rebuilds_buckets = true;      ///< in the first step's ready order, as PyTorch DDP does
  static constexpr bool join_replays_scopes = false;  ///< a shadow step reduces zeros; scopes do nothing here
  static std::size_t multiple(const Comm& /*comm*/, const replicate& /*policy*/) { return 1; }
  /// Every leaf type can be replicated.
  static void check_leaves(const parameter_layout& /*layout*/, int /*rank*/) noexcept {}
  /// A framework's optimizer may hold the model's own parameters: they are the whole arenas.
  template <class Opt>
  static void prepare_optimizer(Opt& /*opt*/, std::span<const optim::flat_buffer> /*buffers*/,
                                const parameter_layout& /*layout*/, int /*rank*/) noexcept {}

  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm comm,
           const replicate& policy)
      : layout_(layout), plan_(plan), state_(state), comm_(std::move(comm)), staging_(layout),
        buffers_(whole_arenas(layout)), deterministic_(policy.deterministic),
        in_rank_order_(deterministic_ && ordered_sum_needed(comm_.size())) {
    for (std::size_t a = 0; a < buffers_.size(); ++a) buffers_[a].grads = staging_.at(buffers_[a].grads, a, 0);
  }

  /// Bucket `b` waiting → started: its all-reduce starts through the hook (deterministic beyond two ranks: an
  /// all_gather; with two, the plain all-reduce's single addition per element is deterministic already).
  template <class Hook>
  void reduce(Hook& hook, std::size_t b) {
    if constexpr (!std::is_same_v<Hook, plain_hook>)
      if (deterministic_)
        throw config_error("data_parallel: deterministic reduction sums in rank order itself, so it cannot run "
                           "through a comm hook; drop the hook or the policy's deterministic knob",
                           comm_.rank());
    state_.start(b, in_rank_order_ ? ordered_.all_gather_part(comm_, b, gradients(b, true).grads)
                                    : hook.start(gradients(b, true)));
  }
  /// Orders bucket `b`'s all-reduce before the work that follows on its domain (the host waits for it, a device's
  /// stream does); the hook (deterministic beyond two ranks: the rank-order sum) writes the
  /// averaged gradients back (in the reduce dtype: under mixed precision into the staging, where the optimizer
  /// finds them); → reduced.
  template <class Hook>
  void reduced(Hook& hook, std::size_t b) {
    if (in_rank_order_) {
      state_.wait(b);  // the rank-order sum runs on the host
      ordered_.average_into(b, gradients(b).grads, comm_.size());
    } else {
      state_.order(b, *layout_.arenas()[plan_.buckets[b].arena].domain);
      hook.complete(gradients(b));
    }
    state_.complete(b);
  }
  /// What the optimizer steps over: the whole arenas.
  [[nodiscard]] const std::vector<optim::flat_buffer>& optimizer_buffers() const noexcept { return buffers_; }
  /// Nothing to all-gather after the step.
  void after_step() {}
  /// Nothing after a skipped update either.
  void after_skipped_step() {}
  /// Zeroes the gradient arenas.
  void zero_grad() noexcept {
    for (const auto& a : layout_.arenas()) a.domain->zero(a.grad_view(0, a.numel));
  }
  /// Parameters and gradients are always whole: unshard scopes do nothing.
  void acquire(std::span<const std::size_t> /*units*/) {}
  void release(std::span<const std::size_t> /*units*/) {}
  /// Every gradient may be reported at any time.
  void on_report(std::size_t /*slot*/) const {}
  /// Gradients have their storage all the time: nothing to hold for a framework's backward.
  void leaves_report_themselves() noexcept {}
  /// The model holds its values already.
  void unshard_model() {}
  /// Every rank holds the full values: all are hashed and compared.
  [[nodiscard]] replica_digest digest() const { return digest_full(layout_); }
  /// Parameters are not sharded: the whole communicator.
  [[nodiscard]] const Comm& shard_group() const noexcept { return comm_; }
  /// No replica group beside it.
  [[nodiscard]] std::optional<Comm> replica_group() const { return std::nullopt; }
  /// Every rank's optimizer buffers hold every gradient: a norm needs no collective.
  [[nodiscard]] std::optional<Comm> norm_group() const { return std::nullopt; }

 private:
  /// Bucket `b`'s gradients in its arena's reduce dtype; `stage`: widened there from the arena first.
  [[nodiscard]] bucket_gradients<Comm> gradients(std::size_t b, bool stage = false) {
    const auto& bk = plan_.buckets[b];
    const raw_tensor own = layout_.arenas()[bk.arena].grad_view(bk.begin, bk.end - bk.begin);
    return {stage ? staging_.stage(own, bk.arena, bk.begin) : staging_.at(own, bk.arena, bk.begin), comm_, b,
            *layout_.arenas()[bk.arena].domain};
  }

  parameter_layout& layout_;
  const bucket_plan& plan_;
  step_state& state_;
  Comm comm_;
  reduce_staging staging_;  // mixed precision: the gradients in the reduce dtype, where the optimizer finds them
  std::vector<optim::flat_buffer> buffers_;
  bool deterministic_;
  bool in_rank_order_;         // deterministic with more than two ranks: all-gather, then sum in rank order
  ordered_reduction ordered_;  // deterministic: each bucket's all-gathered gradients
};

static_assert(sharding_strategy<strategy<replicate, archetype_communicator>, archetype_communicator, replicate>,
              "ddp: the replicate strategy must model sharding_strategy; add what the concept names.");

}  // namespace ddp::detail
