#pragma once
/// \file Dynamic loss scaling for float16 training (PyTorch's GradScaler), inside the step so that every rank — a
/// join scope's shadowing ones too — skips the same steps. The loop multiplies its loss by dp.loss_scale(); each
/// step() then unscales the averaged gradients the optimizer steps (the f32 masters under mixed precision, so small
/// gradients do not flush to zero again), finds whether any rank holds a NaN or an infinity (one all-reduce of one
/// flag over the whole group), skips the optimizer, the all-gather after it and the masters' narrowing when one
/// does, and updates the scale with GradScaler's rules: ×backoff after an overflow, ×growth after growth_interval
/// clean steps in a row.

#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/error.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host_copy.hpp>
#include <ddp/optim/flat.hpp>

namespace ddp {

/// GradScaler's settings (data_parallel_options::loss_scaling); scaling is off unless `enabled`.
struct loss_scaling {
  bool enabled = false;                  ///< scale the loss and skip steps whose gradients overflow
  double init_scale = 65536.0;           ///< the first scale (2^16)
  double growth_factor = 2.0;            ///< the scale grows by it after growth_interval clean steps
  double backoff_factor = 0.5;           ///< and shrinks by it after an overflow
  std::uint64_t growth_interval = 2000;  ///< clean steps in a row before growing
};

namespace detail {

/// The scale, the clean steps since the last change, and whether this step's gradients are unscaled already.
class loss_scaler {
 public:
  /// Checks the settings (a config_error names the bad one).
  explicit loss_scaler(const loss_scaling& s, int rank) : settings_(s), scale_(s.init_scale) {
    if (!s.enabled) return;
    if (!(s.init_scale > 0) || !std::isfinite(s.init_scale) || !(s.growth_factor > 1) || !(s.backoff_factor > 0) ||
        !(s.backoff_factor < 1) || s.growth_interval == 0)
      throw config_error("loss_scaling: init_scale must be positive and finite, growth_factor above 1, backoff_factor "
                         "in (0, 1) and growth_interval at least 1 (GradScaler's defaults: 65536, 2, 0.5, 2000)", rank);
  }
  /// Whether scaling is on.
  [[nodiscard]] bool enabled() const noexcept { return settings_.enabled; }
  /// What the loss is multiplied by (1 when scaling is off).
  [[nodiscard]] double scale() const noexcept { return settings_.enabled ? scale_ : 1.0; }
  /// Clean steps since the scale last changed (GradScaler's growth tracker).
  [[nodiscard]] std::uint64_t growth_tracker() const noexcept { return tracker_; }
  /// Sets the scale and growth tracker (a checkpoint load).
  void restore(double scale, std::uint64_t tracker) noexcept {
    scale_ = scale;
    tracker_ = tracker;
  }

  /// Once per step: multiplies the gradients of `owned` by 1/scale (as float, as GradScaler's inv_scale) and
  /// returns whether any rank of `comm` holds a non-finite one (one all-reduce). Later calls in the same step
  /// return the first answer. Collective the first time.
  template <class Comm>
  bool unscale(Comm& comm, std::span<const optim::flat_buffer> owned) {
    if (!settings_.enabled) return false;
    if (unscaled_) return found_inf_;
    const double inv = static_cast<double>(static_cast<float>(1.0 / scale_));
    std::int32_t found = 0;
    domain_buffer scratch;
    for (const auto& b : owned) {
      b.memory().scale(b.grads, inv);
      const raw_tensor g = readable_on_host(b.grads, scratch);
      visit_dtype(g.type, [&]<class T>(T) {
        const T* x = static_cast<const T*>(g.data);
        for (const auto& seg : b.segments)
          for (std::size_t i = seg.offset; i < seg.offset + seg.numel && !found; ++i)
            if (!std::isfinite(static_cast<double>(x[i]))) found = 1;
      });
    }
    comm.all_reduce(std::span<std::int32_t>(&found, 1), reduce_op::max).wait();
    unscaled_ = true;
    found_inf_ = found != 0;
    return found_inf_;
  }
  /// The step ended: the scale follows GradScaler's rules, and the next step unscales again.
  void update() noexcept {
    if (!settings_.enabled || !unscaled_) return;
    if (found_inf_) {
      scale_ *= settings_.backoff_factor;
      tracker_ = 0;
    } else if (++tracker_ == settings_.growth_interval) {
      scale_ *= settings_.growth_factor;
      tracker_ = 0;
    }
    unscaled_ = found_inf_ = false;
  }
  /// The gradients were dropped (zero_grad): the next step unscales its own.
  void forget() noexcept { unscaled_ = found_inf_ = false; }

 private:
  loss_scaling settings_;
  double scale_;
  std::uint64_t tracker_ = 0;
  bool unscaled_ = false;   // this step's gradients are unscaled
  bool found_inf_ = false;  // and some rank's held a NaN or an infinity
};

}  // namespace detail
}  // namespace ddp
