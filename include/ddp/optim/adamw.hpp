#pragma once
/// \file ddp::optim::adamw: Adam with decoupled weight decay over flat buffers, with torch.optim.AdamW's
/// exact update.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/core/updates.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/optim/groups.hpp>
#include <ddp/optim/schedule.hpp>

namespace ddp::optim {

/// AdamW as torch.optim.AdamW (amsgrad off): p ·= 1 − lr·wd; m += (1 − β1)·(g − m);
/// v = β2·v + (1 − β2)·g²; p −= lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε).
/// State arrays: "exp_avg" and "exp_avg_sq"; the step counter is step_count(). Parameter groups (options::groups)
/// give some parameters their own lr scale, weight decay and betas; the lr of step t is lr_schedule's value at t.
class adamw : public detail::grouped_state<adamw> {
 public:
  /// A parameter group: the parameters `match` takes, stepped with the options but for what it sets
  /// (PyTorch: an entry of the param_groups list).
  struct group {
    std::string name{};                    ///< names it in errors and checkpoints ("no_decay")
    name_match match{};                    ///< which parameters: glob patterns ({"*.bias", "*norm*"}) or a predicate
    double lr_scale = 1;                   ///< its lr is the options' lr (as scheduled) times this
    std::optional<double> weight_decay{};  ///< else the options'
    std::optional<double> beta1{};         ///< else the options'
    std::optional<double> beta2{};         ///< else the options'
  };

  /// Hyper-parameters, named as in PyTorch.
  struct options {
    double lr = 1e-3;             ///< learning rate (the base of the schedule)
    double beta1 = 0.9;           ///< decay of the first moment
    double beta2 = 0.999;         ///< decay of the second moment
    double eps = 1e-8;            ///< added to the denominator
    double weight_decay = 1e-2;   ///< decoupled weight decay
    std::vector<group> groups{};  ///< parameter groups (disjoint); the parameters none takes use the settings above
    schedule lr_schedule{};       ///< the lr of each step (constant: lr)
  };

  /// Names the optimizer in messages.
  static constexpr const char* who = "optim::adamw";

  /// Builds the optimizer; throws ddp::config_error for settings PyTorch also rejects.
  explicit adamw(options o) : grouped_state({"exp_avg", "exp_avg_sq"}), opt_(std::move(o)) { check_settings(); }

  /// The hyper-parameters (lr may be changed between steps; groups are laid at the first step).
  [[nodiscard]] options& settings() noexcept { return opt_; }
  /// The hyper-parameters.
  [[nodiscard]] const options& settings() const noexcept { return opt_; }

  /// The element update of step `step` (counted from 1) with settings `o`.
  [[nodiscard]] static adamw_update update(const options& o, std::uint64_t step) {
    if (step < 1) throw config_error("optim::adamw::update: step " + std::to_string(step) + " must count from 1");
    const auto t = static_cast<double>(step);
    return {.decay = 1 - o.lr * o.weight_decay, .beta1 = o.beta1, .beta2 = o.beta2,
            .step_size = o.lr / (1 - std::pow(o.beta1, t)), .correction2_sqrt = std::sqrt(1 - std::pow(o.beta2, t)),
            .eps = o.eps};
  }
  /// One update of every flat buffer, each group with its settings.
  void step(std::span<const flat_buffer> buffers) {
    std::vector<adamw_update> u;  // per group, the default first
    for (std::size_t g = 0; g <= opt_.groups.size(); ++g) u.push_back(update(group_settings(g), steps_ + 1));
    step_runs(buffers, [&](std::size_t g, memory_domain& on, raw_tensor values, raw_tensor grads,
                           std::span<const raw_tensor> arrays) { on.adamw(values, grads, arrays[0], arrays[1], u[g]); });
  }

  /// The knobs `k` sets, for checkpoints (", weight_decay=0").
  static std::string describe(const group& k) {
    std::string s;
    if (k.weight_decay) s += ", weight_decay=" + detail::exact(*k.weight_decay);
    if (k.beta1) s += ", beta1=" + detail::exact(*k.beta1);
    if (k.beta2) s += ", beta2=" + detail::exact(*k.beta2);
    return s;
  }

 private:
  friend class detail::grouped_state<adamw>;

  /// The options as group `k` sets them (without its groups).
  static options with(const options& o, const group& k) {
    return {.lr = o.lr, .beta1 = k.beta1.value_or(o.beta1), .beta2 = k.beta2.value_or(o.beta2), .eps = o.eps,
            .weight_decay = k.weight_decay.value_or(o.weight_decay), .groups = {}, .lr_schedule = {}};
  }
  static void check(const options& o, const std::string& where) {
    if (o.lr < 0 || o.eps < 0 || o.weight_decay < 0 || o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1)
      throw config_error(std::string(who) + ": need lr, eps, weight_decay >= 0 and betas in [0, 1)" + where);
  }

  options opt_;
};

static_assert(flat_optimizer<adamw>);

}  // namespace ddp::optim
