#pragma once
/// \file ddp::clip_grad_norm_(dp, max_norm): torch::nn::utils::clip_grad_norm_ for a LibTorch model wrapped by
/// data_parallel, right under every policy. Under replicate PyTorch's own clip_grad_norm_(net->parameters(), ...)
/// is right too (the gradients are averaged when backward() returns); under the sharded policies the model's
/// parameters hold no gradient of their own and ddp::parameters(dp) holds only this rank's blocks, so a clip over
/// them takes a shard-local norm: this one takes the norm over the shard group.

#include <ddp/ddp.hpp>

namespace ddp {

/// dp.clip_grad_norm(max_norm, {norm_type, error_if_nonfinite}): clips the averaged gradients to max_norm in the
/// norm_type-norm (ddp::inf_norm for the maximum) and returns the total norm before clipping. Collective under
/// the sharded policies; call it between the backward and dp.step(opt).
template <class DP>
double clip_grad_norm_(DP& dp, double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false) {
  return dp.clip_grad_norm(max_norm, {.norm_type = norm_type, .error_if_nonfinite = error_if_nonfinite});
}

}  // namespace ddp
