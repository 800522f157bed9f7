#pragma once
/// \file ddp::detail::backward_scopes: the unshard scopes a framework's backward opens on units and that close by
/// themselves. Autograd runs a unit's part of the backward without the caller, so no RAII scope can wrap it: a
/// hook that runs when the backward reaches the unit opens one (data_parallel::unshard_guard::for_backward), and
/// it closes once every parameter of the unit has reported its gradient in that backward, or at the end of the
/// backward (finish_gradients) for a unit some of whose parameters received no gradient.

#include <cstddef>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace ddp::detail {

/// Which units a backward holds open, and when each may close (a part of the step state, parallel/step_state.hpp).
class backward_scopes {
 public:
  /// `units` units; `slot_units[s]` is the unit of parameter s.
  backward_scopes(std::span<const std::size_t> slot_units, std::size_t units) : open_(units, 0), slots_(units) {
    for (std::size_t s = 0; s < slot_units.size(); ++s) slots_[slot_units[s]].push_back(s);
  }
  /// Of `units`, those not open yet, now open (a unit reached twice in one backward is opened once).
  std::vector<std::size_t> open(std::span<const std::size_t> units) {
    std::vector<std::size_t> opened;
    for (const std::size_t u : units)
      if (!open_[u]) {
        open_[u] = 1;
        opened.push_back(u);
      }
    return opened;
  }
  /// Parameter `slot` of `unit` reported: the unit, now closed, when a backward holds it open and every parameter
  /// of it has reported in this step (`reported`, per slot).
  std::optional<std::size_t> reported(std::size_t slot, std::size_t unit, std::span<const char> reported) {
    if (!open_[unit] || !reported[slot]) return std::nullopt;
    for (const std::size_t s : slots_[unit])
      if (!reported[s]) return std::nullopt;
    open_[unit] = 0;
    return unit;
  }
  /// Every unit still open, now closed (the backward is over).
  std::vector<std::size_t> close_all() {
    std::vector<std::size_t> closed;
    for (std::size_t u = 0; u < open_.size(); ++u)
      if (open_[u]) {
        open_[u] = 0;
        closed.push_back(u);
      }
    return closed;
  }

 private:
  std::vector<char> open_;                        // per unit: a backward holds it open
  std::vector<std::vector<std::size_t>> slots_;   // per unit: its parameters
};

}  // namespace ddp::detail

namespace ddp {

/// Opens a scope on its units for their part of the backward, which closes by itself once each of their
/// parameters has reported its gradient (or in finish_gradients(), for those that received none); a unit so
/// opened already in this backward stays as it is. For frameworks that run the backward themselves (autograd):
/// call it from a hook that runs when the backward reaches the units, as ddp::forward of the LibTorch adapter
/// does. Collective under full_shard (all-gathers the units and prefetches the next one in the backward's
/// direction); a no-op under replicate. Made by data_parallel's unshard_guard::for_backward().
template <class DP>
class backward_opener {
 public:
  /// Reopens `units` of `dp` when called.
  backward_opener(DP& dp, std::vector<std::size_t> units) : dp_(&dp), units_(std::move(units)) {}
  /// Opens the scope.
  void operator()() const { dp_->open_backward(units_); }

 private:
  DP* dp_;
  std::vector<std::size_t> units_;
};

}  // namespace ddp
