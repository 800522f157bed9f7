#pragma once
/// \file ddp::parameters(dp): the tensors a torch::optim optimizer steps under a data_parallel wrapper.
///
/// Under replicate a torch::optim optimizer may step the model's own parameters (their values and gradients
/// are ddp's arenas). Under shard_grad_op and full_shard only this rank's owned blocks receive the averaged
/// gradients (and under full_shard the model's parameters are empty tensors outside a unit's forward and
/// backward), so the optimizer must step those: ddp::parameters(dp) gives one flat 1-D tensor per block (values over ddp's
/// owned values, `.grad` over the owned gradients), and dp.step(opt) all-gathers the updated blocks into the
/// model afterwards (full_shard: the next forward unshards them). Optimizer state is then sharded with the blocks. Element-wise optimizers (SGD, Adam,
/// AdamW, RMSprop, Adagrad) step flat blocks exactly as the parameters; per-parameter groups and options are
/// not kept (one group). The tensors refer to the wrapper's memory: make the optimizer after the wrapper and
/// drop it first; zero gradients with dp.zero_grad(), not opt.zero_grad().

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

#include <torch/torch.h>

#include <ddp/adapters/libtorch/tensor.hpp>
#include <ddp/core/error.hpp>
#include <ddp/optim/flat.hpp>

namespace ddp {

/// One flat tensor per buffer this rank's optimizer steps (see this header's description), in step order.
template <class DP>
std::vector<torch::Tensor> parameters(DP& dp) {
  std::vector<torch::Tensor> out;
  for (const optim::flat_buffer& b : dp.owned_buffers()) {
    const auto options = torch::TensorOptions().dtype(detail::libtorch::scalar_type_of(b.values.type));
    const auto n = static_cast<std::int64_t>(b.values.size);
    torch::Tensor p = torch::from_blob(b.values.data, {n}, options).requires_grad_(true);
    p.mutable_grad() = torch::from_blob(b.grads.data, {n}, options);
    out.push_back(std::move(p));
  }
  return out;
}

/// torch::optim optimizers: under the sharded policies every tensor they step must be one of ddp::parameters(dp).
template <class O>
  requires std::derived_from<O, torch::optim::Optimizer>
struct optim::optimizer_traits<O> {
  /// Throws ddp::config_error unless every tensor `opt` steps starts one of the `owned` buffers.
  static void check(const O& opt, std::span<const optim::flat_buffer> owned, int rank) {
    for (const auto& group : opt.param_groups())
      for (const auto& p : group.params()) {
        const void* at = p.data_ptr();
        if (std::none_of(owned.begin(), owned.end(), [&](const optim::flat_buffer& b) { return b.values.data == at; }))
          throw config_error("dp.step: under a sharded policy the torch::optim optimizer must step this rank's owned "
                             "blocks, the only memory that receives the averaged gradients, but it holds another "
                             "tensor (the model's parameters? those cannot be stepped: under full_shard they are "
                             "empty outside a unit's forward and backward); make it over ddp::parameters(dp)", rank);
      }
  }
};

}  // namespace ddp
