#pragma once
/// \file The precision policies of ddp::data_parallel (PyTorch FSDP's `MixedPrecision(param_dtype, reduce_dtype)`).
/// The model's own element type is its compute dtype: a model written over ddp::bfloat16 computes in bf16.
/// ddp::mixed_precision<Param, Reduce> makes the wrapper keep f32 master weights of the Param-typed parameters
/// (sharded where the strategy shards them), reduce their gradients in Reduce and step the optimizer on the
/// masters, narrowing them into the model's parameters after each step (parallel/master_weights.hpp).

#include <type_traits>

#include <ddp/core/dtype.hpp>

namespace ddp {

namespace detail {
struct precision_category {};
}  // namespace detail

/// Parameters, gradients and optimizer state in the model's own dtypes (the default): no master weights.
struct full_precision {
  using policy_category = detail::precision_category;
  static constexpr bool masters = false;  ///< no master weights are kept
};

/// Mixed precision: the model's parameters of type Param (bfloat16 or float16) are its compute copy; the wrapper
/// keeps f32 master weights of them (sharded with the owned blocks), reduces their gradients in Reduce (float, or
/// Param for half the bytes on the wire) into f32 master gradients, steps the optimizer (and its state) in f32,
/// then narrows the masters into the parameters; under full_shard the unshard all-gathers the Param copy.
/// Parameters already in f32 or f64 (such as norms kept wide) are stepped as they are. Checkpoints hold the masters.
template <class Param = bfloat16, class Reduce = float>
struct mixed_precision {
  static_assert(std::is_same_v<Param, bfloat16> || std::is_same_v<Param, float16>,
                "ddp::mixed_precision<Param, Reduce>: Param is the model's compute type, ddp::bfloat16 or "
                "ddp::float16; write the model over it (an f32 model needs no mixed_precision policy).");
  static_assert(std::is_same_v<Reduce, float> || std::is_same_v<Reduce, Param>,
                "ddp::mixed_precision<Param, Reduce>: gradients are reduced in float (exact sums of the compute "
                "dtype's gradients) or in Param itself (half the bytes); give one of those as Reduce.");
  using policy_category = detail::precision_category;
  using param_type = Param;    ///< the compute dtype (the model's parameters)
  using reduce_type = Reduce;  ///< the dtype gradients travel and are summed in
  static constexpr bool masters = true;  ///< f32 master weights are kept
};

}  // namespace ddp
