#pragma once
/// \file ddp::optim::adamw: Adam with decoupled weight decay over flat buffers, with torch.optim.AdamW's
/// exact update.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/core/updates.hpp>
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

  /// The element update of step `step` (counted from 1) with settings `o`.
  [[nodiscard]] static adamw_update update(const options& o, std::uint64_t step) {
    if (step < 1) throw config_error("optim::adamw::update: step " + std::to_string(step) + " must count from 1");
    const auto t = static_cast<double>(step);
    return {.decay = 1 - o.lr * o.weight_decay, .beta1 = o.beta1, .beta2 = o.beta2,
            .step_size = o.lr / (1 - std::pow(o.beta1, t)), .correction2_sqrt = std::sqrt(1 - std::pow(o.beta2, t)),
            .eps = o.eps};
  }
  /// One update of every flat buffer.
  void step(std::span<const flat_buffer> buffers) {
    const adamw_update u = update(opt_, steps_ + 1);
    for_each_buffer(buffers, "optim::adamw", [&](const flat_buffer& b, memory_domain& on, std::span<const raw_tensor> arrays) {
      on.adamw(b.values, b.grads, arrays[0], arrays[1], u);
    });
    ++steps_;
  }

 private:
  options opt_;
};

static_assert(flat_optimizer<adamw>);

}  // namespace ddp::optim
