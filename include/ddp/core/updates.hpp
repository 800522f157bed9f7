#pragma once
/// \file The optimizers' element updates as values: the scalars of one torch.optim.SGD or torch.optim.AdamW step,
/// worked out by the optimizer (optim/sgd.hpp, optim/adamw.hpp) and run over flat f32 or f64 ranges by whichever
/// memory domain holds them: the host's loops (memory/updates.hpp) or a device's kernels
/// (cuda/element_kernels.cuh), each in the same order of operations, so a step gives the same bits wherever its
/// memory lives.

#include <string>

#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>

namespace ddp {

/// One torch.optim.SGD step: g = grad + weight_decay·p; with momentum, buf = g on the first step, else
/// buf = momentum·buf + (1 − dampening)·g, and g = g + momentum·buf (Nesterov) or buf; p −= lr·g.
struct sgd_update {
  double lr = 0;            ///< learning rate
  double momentum = 0;      ///< momentum factor (0: no momentum buffer)
  double dampening = 0;     ///< dampening of the momentum
  double weight_decay = 0;  ///< L2 penalty added to the gradient
  bool nesterov = false;    ///< Nesterov momentum
  bool first = false;       ///< the buffer's first step (it takes the gradient)
};

/// One torch.optim.AdamW step at step t: p ·= decay; m += (1 − β1)·(g − m); v = β2·v + (1 − β2)·g²;
/// p −= step_size · m / (√v / correction2_sqrt + eps), where decay = 1 − lr·weight_decay,
/// step_size = lr / (1 − β1ᵗ) and correction2_sqrt = √(1 − β2ᵗ).
struct adamw_update {
  double decay = 1;             ///< 1 − lr·weight_decay
  double beta1 = 0.9;           ///< decay of the first moment
  double beta2 = 0.999;         ///< decay of the second moment
  double step_size = 0;         ///< lr / (1 − β1ᵗ)
  double correction2_sqrt = 1;  ///< √(1 − β2ᵗ)
  double eps = 1e-8;            ///< added to the denominator
};

namespace detail {

/// Throws config_error unless `type` is one an optimizer steps (f32 or f64); `who` names the caller.
inline void steppable(dtype type, const char* who) {
  if (type != dtype::f32 && type != dtype::f64)
    throw config_error(std::string(who) + ": parameters of dtype " + std::string(to_string(type)) + " cannot be "
                       "stepped; keep f32 or f64 parameters (master weights) and compress gradients with a comm hook "
                       "instead");
}

}  // namespace detail
}  // namespace ddp
