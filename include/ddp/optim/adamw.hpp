#pragma once
/// \file ddp::optim::adamw: Adam with decoupled weight decay over flat buffers, with torch.optim.AdamW's
/// exact update.

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/optim/flat.hpp>

namespace ddp::optim {

/// AdamW as torch.optim.AdamW (amsgrad off): p ·= 1 − lr·wd; m += (1 − β1)·(g − m);
/// v = β2·v + (1 − β2)·g²; p −= lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε).
/// State arrays: "exp_avg" and "exp_avg_sq"; the step counter is step_count().
class adamw : public detail::flat_state {
 public:
  /// Hyper-parameters, named as in PyTorch.
  struct options {
    double lr = 1e-3;            ///< learning rate
    double beta1 = 0.9;          ///< decay of the first moment
    double beta2 = 0.999;        ///< decay of the second moment
    double eps = 1e-8;           ///< added to the denominator
    double weight_decay = 1e-2;  ///< decoupled weight decay
  };

  /// Builds the optimizer; throws ddp::config_error for settings PyTorch also rejects.
  explicit adamw(options o) : flat_state({"exp_avg", "exp_avg_sq"}), opt_(o) {
    if (o.lr < 0 || o.eps < 0 || o.weight_decay < 0 || o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1)
      throw config_error("optim::adamw: need lr, eps, weight_decay >= 0 and betas in [0, 1)");
  }

  /// The hyper-parameters (lr may be changed between steps, e.g. by a schedule).
  [[nodiscard]] options& settings() noexcept { return opt_; }

  /// One update of every flat buffer.
  void step(std::span<const flat_buffer> buffers) {
    const auto t = static_cast<double>(steps_ + 1);
    const double correction1 = 1 - std::pow(opt_.beta1, t);
    const double correction2_sqrt = std::sqrt(1 - std::pow(opt_.beta2, t));
    for_each_buffer(buffers, "optim::adamw", [&]<class T>(std::span<T> p, std::span<const T> g, auto arrays) {
      const T decay = static_cast<T>(1 - opt_.lr * opt_.weight_decay);
      const T b1 = static_cast<T>(opt_.beta1), b2 = static_cast<T>(opt_.beta2);
      const T step_size = static_cast<T>(opt_.lr / correction1);
      const T c2 = static_cast<T>(correction2_sqrt), eps = static_cast<T>(opt_.eps);
      std::span<T> m = arrays[0], v = arrays[1];
      for (std::size_t i = 0; i < p.size(); ++i) {
        p[i] *= decay;
        m[i] += (T{1} - b1) * (g[i] - m[i]);  // torch's lerp_ for weights below 0.5
        v[i] = b2 * v[i] + (T{1} - b2) * g[i] * g[i];
        p[i] -= step_size * m[i] / (std::sqrt(v[i]) / c2 + eps);
      }
    });
    ++steps_;
  }

 private:
  options opt_;
};

static_assert(flat_optimizer<adamw>);

}  // namespace ddp::optim
