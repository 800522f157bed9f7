#pragma once
/// \file ddp::optim::sgd: stochastic gradient descent with momentum, dampening, Nesterov and weight
/// decay over flat buffers, with torch.optim.SGD's exact update.

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/core/updates.hpp>
#include <ddp/optim/flat.hpp>

namespace ddp::optim {

/// SGD as torch.optim.SGD: g = grad + wd·p; with momentum, buf = g on the first step, else
/// buf = momentum·buf + (1 − dampening)·g, and g = g + momentum·buf (Nesterov) or buf; p −= lr·g.
/// State array: "momentum_buffer" (only when momentum ≠ 0).
class sgd : public detail::flat_state {
 public:
  /// Hyper-parameters, named as in PyTorch.
  struct options {
    double lr = 1e-3;            ///< learning rate
    double momentum = 0;         ///< momentum factor
    double dampening = 0;        ///< dampening of the momentum
    bool nesterov = false;       ///< Nesterov momentum (needs momentum > 0 and dampening 0)
    double weight_decay = 0;     ///< L2 penalty added to the gradient
  };

  /// Builds the optimizer; throws ddp::config_error for settings PyTorch also rejects.
  explicit sgd(options o) : flat_state(o.momentum != 0 ? std::vector<std::string_view>{"momentum_buffer"}
                                                         : std::vector<std::string_view>{}),
                            opt_(o) {
    if (o.lr < 0 || o.momentum < 0 || o.weight_decay < 0)
      throw config_error("optim::sgd: lr, momentum and weight_decay must be >= 0");
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      throw config_error("optim::sgd: Nesterov momentum needs momentum > 0 and dampening 0");
  }

  /// The hyper-parameters (lr may be changed between steps, e.g. by a schedule).
  [[nodiscard]] options& settings() noexcept { return opt_; }

  /// The element update of a step with settings `o`; `first`: the momentum buffer's first step.
  [[nodiscard]] static sgd_update update(const options& o, bool first) noexcept {
    return {.lr = o.lr, .momentum = o.momentum, .dampening = o.dampening, .weight_decay = o.weight_decay,
            .nesterov = o.nesterov, .first = first};
  }
  /// One update of every flat buffer.
  void step(std::span<const flat_buffer> buffers) {
    const sgd_update u = update(opt_, steps_ == 0);
    for_each_buffer(buffers, "optim::sgd", [&](const flat_buffer& b, memory_domain& on, std::span<const raw_tensor> arrays) {
      on.sgd(b.values, b.grads, arrays.empty() ? raw_tensor{} : arrays[0], u);
    });
    ++steps_;
  }

 private:
  options opt_;
};

static_assert(flat_optimizer<sgd>);

}  // namespace ddp::optim
