#pragma once
/// \file The phases a training step moves through: the step's, each bucket's, each unit's values and gradient
/// storage (parallel/step_state.hpp keeps them and checks every move).

#include <cstdint>

namespace ddp::detail {

/// Where a synchronized backward stands.
enum class step_phase : std::uint8_t {
  idle,       ///< no gradient reported since the last step (or since zero_grad after finish_gradients)
  reporting,  ///< gradients are being reported and buckets started
  finished,   ///< finish_gradients() completed: every bucket is reduced, step() may run
};
/// Where one bucket's reduction stands in the step.
enum class bucket_phase : std::uint8_t {
  waiting,   ///< parameters still to report, or an earlier bucket still to start
  started,  ///< its all-reduce (replicate) or reduce-scatter (sharded) is in flight
  chained,   ///< hybrid: the reduce-scatter completed and the cross-group all-reduce is in flight
  reduced,   ///< its gradients are final for this step
};
/// Where a unit's parameter values stand (shard_grad_op and replicate keep every unit unsharded).
enum class unit_phase : std::uint8_t {
  sharded,     ///< only the owned blocks exist
  unsharding,  ///< all-gathers into its pooled buffer are in flight (an unshard scope or a prefetch)
  unsharded,   ///< the full values are present
};
/// Where a unit's full-gradient storage stands (the sharded strategies).
enum class grad_phase : std::uint8_t {
  released,  ///< no storage: its parameters' gradients point at zero pages
  held,      ///< a pooled buffer, zero or already reduced: nothing pending
  reported,  ///< gradients were reported into it and its buckets are not all reduced
};

/// The phase's name, for messages.
constexpr const char* to_string(step_phase p) noexcept {
  constexpr const char* names[] = {"idle", "reporting", "finished"};
  return names[static_cast<int>(p)];
}
/// The phase's name, for messages.
constexpr const char* to_string(bucket_phase p) noexcept {
  constexpr const char* names[] = {"waiting", "started", "chained", "reduced"};
  return names[static_cast<int>(p)];
}
/// The phase's name, for messages.
constexpr const char* to_string(unit_phase p) noexcept {
  constexpr const char* names[] = {"sharded", "unsharding", "unsharded"};
  return names[static_cast<int>(p)];
}
/// The phase's name, for messages.
constexpr const char* to_string(grad_phase p) noexcept {
  constexpr const char* names[] = {"released", "held", "reported"};
  return names[static_cast<int>(p)];
}

}  // namespace ddp::detail
