#pragma once
/// \file Learning-rate schedules as values, each torch.optim.lr_scheduler's curve in closed form: the lr of the
/// step after `t` steps (the optimizer's step count, so a resumed run continues the curve) from the group's base
/// lr. ddp::optim::sgd and adamw take one in their options (`.lr_schedule`).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numbers>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <ddp/core/error.hpp>

namespace ddp::optim {

class schedule;

namespace detail {
/// `v` as text that reads back as the same double ("0.10000000000000001").
inline std::string exact(double v) {
  char s[32];
  std::snprintf(s, sizeof s, "%.17g", v);
  return s;
}
}  // namespace detail

/// The schedule kinds, each named after the torch.optim.lr_scheduler class whose values it gives.
namespace schedules {

/// The base lr at every step (no scheduler).
struct constant {};

/// LinearLR: the factor goes linearly from `start_factor` to `end_factor` over `steps` steps, then stays
/// (a linear warmup with the defaults of its fields but `steps`).
struct linear {
  std::uint64_t steps = 5;          ///< total_iters
  double start_factor = 1.0 / 3.0;  ///< start_factor
  double end_factor = 1.0;          ///< end_factor
};

/// CosineAnnealingLR: half a cosine from the base lr down to `eta_min` over `steps` steps (T_max); past them the
/// lr stays at eta_min (PyTorch's curve rises again).
struct cosine {
  std::uint64_t steps = 1;  ///< T_max
  double eta_min = 0;       ///< the lr at the end (absolute, as PyTorch's)
};

/// A linear warmup over `warmup` steps from start_factor · base lr, then a cosine down to `eta_min` at step
/// `steps`: SequentialLR([LinearLR(start_factor, 1, warmup), CosineAnnealingLR(steps − warmup, eta_min)], [warmup]).
struct warmup_cosine {
  std::uint64_t warmup = 1;        ///< warmup steps (LinearLR's total_iters and the milestone)
  std::uint64_t steps = 2;         ///< all steps, warmup included
  double start_factor = 1e-3;      ///< the factor of the first step
  double eta_min = 0;              ///< the lr at the end
};

/// StepLR: the lr times gamma every `step_size` steps.
struct step_decay {
  std::uint64_t step_size = 1;  ///< step_size
  double gamma = 0.1;           ///< gamma
};

/// OneCycleLR with the base lr as max_lr: from max_lr / div_factor up to max_lr over pct_start of the steps,
/// then down to max_lr / (div_factor · final_div_factor); three_phase: up, back down to the start, then to the
/// minimum. The momentum is not cycled (cycle_momentum=False).
struct one_cycle {
  std::uint64_t steps = 1;         ///< total_steps
  double pct_start = 0.3;          ///< pct_start
  double div_factor = 25;          ///< div_factor
  double final_div_factor = 1e4;   ///< final_div_factor
  bool three_phase = false;        ///< three_phase
  bool linear_anneal = false;      ///< anneal_strategy='linear' (default 'cos')
};

/// LambdaLR: the base lr times `factor(t)`. `name` stands for the function in checkpoints, which compare it.
struct lambda {
  std::function<double(std::uint64_t)> factor;  ///< lr_lambda
  std::string name = "lambda";                  ///< what a checkpoint records for the function
};

/// SequentialLR: `parts[i]` from milestone i − 1 on (counting its own steps from 0 there); milestones ascend.
struct sequence {
  std::vector<schedule> parts;            ///< schedulers
  std::vector<std::uint64_t> milestones;  ///< milestones, one fewer than parts
};

}  // namespace schedules

/// A learning-rate schedule: any of the kinds in ddp::optim::schedules, as a value.
class schedule {
 public:
  using kind = std::variant<schedules::constant, schedules::linear, schedules::cosine, schedules::warmup_cosine,
                            schedules::step_decay, schedules::one_cycle, schedules::lambda, schedules::sequence>;

  /// The constant schedule.
  schedule() = default;
  /// Any kind; throws ddp::config_error for settings PyTorch also rejects.
  template <class K>
    requires std::is_constructible_v<kind, K&&> && (!std::is_same_v<std::remove_cvref_t<K>, schedule>)
  schedule(K&& k) : kind_(std::forward<K>(k)) {  // NOLINT(google-explicit-constructor): a kind is a schedule
    check();
  }

  /// The lr of the step after `t` steps, from the group's base lr `base` (PyTorch: the lr after `t` calls of
  /// scheduler.step()). Past last_step() it is the value there.
  [[nodiscard]] double lr(double base, std::uint64_t t) const {
    if (const auto end = last_step(); end && t > *end) t = *end;
    return std::visit([&](const auto& k) { return value(k, base, t); }, kind_);
  }

  /// The last step the curve defines, if it ends (cosine, warmup_cosine, one_cycle, a sequence ending in one).
  [[nodiscard]] std::optional<std::uint64_t> last_step() const {
    return std::visit([](const auto& k) { return last_of(k); }, kind_);
  }

  /// The kind and its settings as text ("cosine(steps=300, eta_min=0)"): what checkpoints record and compare.
  [[nodiscard]] std::string describe() const {
    return std::visit([](const auto& k) { return text(k); }, kind_);
  }

  /// The kind held.
  [[nodiscard]] const kind& get() const noexcept { return kind_; }

 private:
  static double value(const schedules::constant&, double base, std::uint64_t) { return base; }
  static double value(const schedules::linear& k, double base, std::uint64_t t) {
    return base * (k.start_factor + (k.end_factor - k.start_factor) * static_cast<double>(std::min(t, k.steps)) /
                                        static_cast<double>(k.steps));
  }
  static double value(const schedules::cosine& k, double base, std::uint64_t t) {
    return k.eta_min +
           (base - k.eta_min) * (1 + std::cos(std::numbers::pi * static_cast<double>(t) / static_cast<double>(k.steps))) / 2;
  }
  static double value(const schedules::warmup_cosine& k, double base, std::uint64_t t) {
    return value(as_sequence(k), base, t);
  }
  static double value(const schedules::step_decay& k, double base, std::uint64_t t) {
    return base * std::pow(k.gamma, static_cast<double>(t / k.step_size));
  }
  static double value(const schedules::one_cycle& k, double base, std::uint64_t t) {
    const double initial = base / k.div_factor, minimum = initial / k.final_div_factor;
    const double n = static_cast<double>(k.steps), up = k.pct_start * n - 1;
    struct phase {
      double end, from, to;
    };
    const std::vector<phase> phases = k.three_phase
        ? std::vector<phase>{{up, initial, base}, {2 * k.pct_start * n - 2, base, initial}, {n - 1, initial, minimum}}
        : std::vector<phase>{{up, initial, base}, {n - 1, base, minimum}};
    double start = 0;
    const double step = static_cast<double>(t);
    for (std::size_t i = 0;; ++i) {
      if (step <= phases[i].end || i + 1 == phases.size()) {
        const double pct = (step - start) / (phases[i].end - start);
        const auto& [end, from, to] = phases[i];
        if (k.linear_anneal) return (to - from) * pct + from;
        return to + (from - to) / 2.0 * (std::cos(std::numbers::pi * pct) + 1);
      }
      start = phases[i].end;
    }
  }
  static double value(const schedules::lambda& k, double base, std::uint64_t t) { return base * k.factor(t); }
  static double value(const schedules::sequence& k, double base, std::uint64_t t) {
    std::size_t i = 0;
    while (i < k.milestones.size() && k.milestones[i] <= t) ++i;
    return k.parts[i].lr(base, i == 0 ? t : t - k.milestones[i - 1]);
  }

  static schedules::sequence as_sequence(const schedules::warmup_cosine& k) {
    return {{schedules::linear{k.warmup, k.start_factor, 1.0}, schedules::cosine{k.steps - k.warmup, k.eta_min}},
            {k.warmup}};
  }

  template <class K>
  static std::optional<std::uint64_t> last_of(const K&) { return std::nullopt; }
  static std::optional<std::uint64_t> last_of(const schedules::cosine& k) { return k.steps; }
  static std::optional<std::uint64_t> last_of(const schedules::warmup_cosine& k) { return k.steps; }
  static std::optional<std::uint64_t> last_of(const schedules::one_cycle& k) { return k.steps; }
  static std::optional<std::uint64_t> last_of(const schedules::sequence& k) {
    const auto end = k.parts.back().last_step();
    if (!end) return std::nullopt;
    return *end + (k.milestones.empty() ? 0 : k.milestones.back());
  }

  static std::string number(double v) { return detail::exact(v); }
  static std::string text(const schedules::constant&) { return "constant"; }
  static std::string text(const schedules::linear& k) {
    return "linear(steps=" + std::to_string(k.steps) + ", start_factor=" + number(k.start_factor) +
           ", end_factor=" + number(k.end_factor) + ")";
  }
  static std::string text(const schedules::cosine& k) {
    return "cosine(steps=" + std::to_string(k.steps) + ", eta_min=" + number(k.eta_min) + ")";
  }
  static std::string text(const schedules::warmup_cosine& k) {
    return "warmup_cosine(warmup=" + std::to_string(k.warmup) + ", steps=" + std::to_string(k.steps) +
           ", start_factor=" + number(k.start_factor) + ", eta_min=" + number(k.eta_min) + ")";
  }
  static std::string text(const schedules::step_decay& k) {
    return "step_decay(step_size=" + std::to_string(k.step_size) + ", gamma=" + number(k.gamma) + ")";
  }
  static std::string text(const schedules::one_cycle& k) {
    return "one_cycle(steps=" + std::to_string(k.steps) + ", pct_start=" + number(k.pct_start) +
           ", div_factor=" + number(k.div_factor) + ", final_div_factor=" + number(k.final_div_factor) +
           ", three_phase=" + (k.three_phase ? "1" : "0") + ", anneal=" + (k.linear_anneal ? "linear" : "cos") + ")";
  }
  static std::string text(const schedules::lambda& k) { return "lambda(" + k.name + ")"; }
  static std::string text(const schedules::sequence& k) {
    std::string s = "sequence(";
    for (std::size_t i = 0; i < k.parts.size(); ++i) {
      if (i) s += ", " + std::to_string(k.milestones[i - 1]) + ": ";
      s += k.parts[i].describe();
    }
    return s + ")";
  }

  void check() const {
    std::visit([](const auto& k) { check_kind(k); }, kind_);
  }
  static void fail(const std::string& what) { throw config_error("optim::schedule: " + what); }
  static void check_kind(const schedules::constant&) {}
  static void check_kind(const schedules::linear& k) {
    if (k.steps == 0) fail("linear needs steps >= 1 (total_iters)");
    if (k.start_factor <= 0 || k.start_factor > 1 || k.end_factor < 0 || k.end_factor > 1)
      fail("linear needs start_factor in (0, 1] and end_factor in [0, 1], as LinearLR");
  }
  static void check_kind(const schedules::cosine& k) {
    if (k.steps == 0) fail("cosine needs steps >= 1 (T_max)");
  }
  static void check_kind(const schedules::warmup_cosine& k) {
    if (k.warmup == 0 || k.steps <= k.warmup) fail("warmup_cosine needs 1 <= warmup < steps");
    check_kind(schedules::linear{k.warmup, k.start_factor, 1.0});
  }
  static void check_kind(const schedules::step_decay& k) {
    if (k.step_size == 0) fail("step_decay needs step_size >= 1");
  }
  static void check_kind(const schedules::one_cycle& k) {
    if (k.steps == 0) fail("one_cycle needs steps >= 1 (total_steps)");
    if (k.pct_start < 0 || k.pct_start > 1) fail("one_cycle needs pct_start in [0, 1]");
    if (k.div_factor <= 0 || k.final_div_factor <= 0) fail("one_cycle needs div_factor and final_div_factor > 0");
  }
  static void check_kind(const schedules::lambda& k) {
    if (!k.factor) fail("lambda needs a factor function (lr_lambda)");
  }
  static void check_kind(const schedules::sequence& k) {
    if (k.parts.empty() || k.milestones.size() + 1 != k.parts.size())
      fail("sequence needs one part more than milestones (SequentialLR's rule), got " +
           std::to_string(k.parts.size()) + " part(s) and " + std::to_string(k.milestones.size()) + " milestone(s)");
    for (std::size_t i = 1; i < k.milestones.size(); ++i)
      if (k.milestones[i] <= k.milestones[i - 1]) fail("sequence needs ascending milestones");
  }

  kind kind_;
};

}  // namespace ddp::optim
