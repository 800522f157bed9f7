#pragma once
/// \file ddp::optim::sgd: stochastic gradient descent with momentum, dampening, Nesterov and weight
/// decay over flat buffers, with torch.optim.SGD's exact update.

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
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

/// SGD as torch.optim.SGD: g = grad + wd·p; with momentum, buf = g on the first step, else
/// buf = momentum·buf + (1 − dampening)·g, and g = g + momentum·buf (Nesterov) or buf; p −= lr·g.
/// State array: "momentum_buffer" (only when the options or a group have momentum ≠ 0). Parameter groups
/// (options::groups) give some parameters their own lr scale, weight decay and momentum; the lr of step t is
/// lr_schedule's value at t.
class sgd : public detail::grouped_state<sgd> {
 public:
  /// A parameter group: the parameters `match` takes, stepped with the options but for what it sets
  /// (PyTorch: an entry of the param_groups list).
  struct group {
    std::string name{};                    ///< names it in errors and checkpoints ("no_decay")
    name_match match{};                    ///< which parameters: glob patterns ({"*.bias", "*norm*"}) or a predicate
    double lr_scale = 1;                   ///< its lr is the options' lr (as scheduled) times this
    std::optional<double> weight_decay{};  ///< else the options'
    std::optional<double> momentum{};      ///< else the options'
  };

  /// Hyper-parameters, named as in PyTorch.
  struct options {
    double lr = 1e-3;             ///< learning rate (the base of the schedule)
    double momentum = 0;          ///< momentum factor
    double dampening = 0;         ///< dampening of the momentum
    bool nesterov = false;        ///< Nesterov momentum (needs momentum > 0 and dampening 0)
    double weight_decay = 0;      ///< L2 penalty added to the gradient
    std::vector<group> groups{};  ///< parameter groups (disjoint); the parameters none takes use the settings above
    schedule lr_schedule{};       ///< the lr of each step (constant: lr)
  };

  /// Names the optimizer in messages.
  static constexpr const char* who = "optim::sgd";

  /// Builds the optimizer; throws ddp::config_error for settings PyTorch also rejects.
  explicit sgd(options o) : grouped_state(arrays_for(o)), opt_(std::move(o)) { check_settings(); }

  /// The hyper-parameters (lr may be changed between steps; groups are laid at the first step).
  [[nodiscard]] options& settings() noexcept { return opt_; }
  /// The hyper-parameters.
  [[nodiscard]] const options& settings() const noexcept { return opt_; }

  /// The element update of a step with settings `o`; `first`: the momentum buffer's first step.
  [[nodiscard]] static sgd_update update(const options& o, bool first) noexcept {
    return {.lr = o.lr, .momentum = o.momentum, .dampening = o.dampening, .weight_decay = o.weight_decay,
            .nesterov = o.nesterov, .first = first};
  }
  /// One update of every flat buffer, each group with its settings.
  void step(std::span<const flat_buffer> buffers) {
    std::vector<sgd_update> u;  // per group, the default first
    for (std::size_t g = 0; g <= opt_.groups.size(); ++g) u.push_back(update(group_settings(g), steps_ == 0));
    step_runs(buffers, [&](std::size_t g, memory_domain& on, raw_tensor values, raw_tensor grads,
                           std::span<const raw_tensor> arrays) {
      on.sgd(values, grads, arrays.empty() ? raw_tensor{} : arrays[0], u[g]);
    });
  }

  /// The knobs `k` sets, for checkpoints (", weight_decay=0").
  static std::string describe(const group& k) {
    std::string s;
    if (k.weight_decay) s += ", weight_decay=" + detail::exact(*k.weight_decay);
    if (k.momentum) s += ", momentum=" + detail::exact(*k.momentum);
    return s;
  }

 private:
  friend class detail::grouped_state<sgd>;

  /// The options as group `k` sets them (without its groups).
  static options with(const options& o, const group& k) {
    return {.lr = o.lr, .momentum = k.momentum.value_or(o.momentum), .dampening = o.dampening, .nesterov = o.nesterov,
            .weight_decay = k.weight_decay.value_or(o.weight_decay), .groups = {}, .lr_schedule = {}};
  }
  static void check(const options& o, const std::string& where) {
    if (o.lr < 0 || o.momentum < 0 || o.weight_decay < 0)
      throw config_error(std::string(who) + ": lr, momentum and weight_decay must be >= 0" + where);
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      throw config_error(std::string(who) + ": Nesterov momentum needs momentum > 0 and dampening 0" + where);
  }
  static std::vector<std::string_view> arrays_for(const options& o) {
    bool momentum = o.momentum != 0;
    for (const auto& k : o.groups) momentum = momentum || k.momentum.value_or(0) != 0;
    return momentum ? std::vector<std::string_view>{"momentum_buffer"} : std::vector<std::string_view>{};
  }

  options opt_;
};

static_assert(flat_optimizer<sgd>);

}  // namespace ddp::optim
