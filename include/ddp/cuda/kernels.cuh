#pragma once
/// \file Element-wise CUDA kernels over flat spans of device memory and their host API (compile with nvcc):
/// scale/average (gradient averaging), f32<->bf16/f16 casts (compression hooks), and the SGD and AdamW steps
/// with PyTorch's formulas (torch.optim.SGD, torch.optim.AdamW without amsgrad), as ddp::optim's CPU steps.
///
/// Every std::span argument views device memory on the current device; every call is asynchronous on
/// `stream`. Loops are grid-stride over 16-byte packs (float4-wide loads and stores) when every pointer is
/// 16-byte aligned, element by element otherwise. bf16/f16 values compute in float, f32 in float, f64 in double.
/// The per-element arithmetic is element_kernels.cuh's, which the PTX of cuda/element.hpp runs too.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/updates.hpp>
#include <ddp/cuda/element_kernels.cuh>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::cuda {

namespace detail {

/// The CUDA type with the same bits as a ddp element type.
template <class T> struct native { using type = T; };
template <> struct native<bfloat16> { using type = __nv_bfloat16; };
template <> struct native<float16> { using type = __half; };
template <class T> using native_t = typename native<std::remove_const_t<T>>::type;

template <class T>
concept floating = std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16> ||
                   std::is_same_v<T, float16>;

/// The grid-stride loop as a kernel of its own.
template <int V, class F>
__global__ void for_each_pack(std::size_t n, F f) {
  grid_stride<V>(n, f);
}

/// Runs kernel `f` over n elements with packs of V when every pointer in `pointers` is 16-byte aligned.
template <int V, class F, class... P>
void run_kernel(const char* name, std::size_t n, cudaStream_t stream, F f, const P*... pointers) {
  if (n == 0) return;
  const bool vector = (aligned16(pointers) && ...);
  const unsigned blocks = grid_blocks(launch_units(n, V, vector), threads_per_block);
  if (vector)
    for_each_pack<V><<<blocks, threads_per_block, 0, stream>>>(n, f);
  else
    for_each_pack<1><<<blocks, threads_per_block, 0, stream>>>(n, f);
  check_kernel(name);
}

template <class T>
native_t<T>* device_ptr(std::span<T> s) noexcept {
  return reinterpret_cast<native_t<T>*>(const_cast<std::remove_const_t<T>*>(s.data()));
}

inline void same_size(std::size_t a, std::size_t b, const char* call, const char* a_name, const char* b_name) {
  if (a != b)
    throw error(std::string(call) + ": " + a_name + " has " + std::to_string(a) + " elements but " + b_name + " has " +
                std::to_string(b) + "; pass spans of one flat parameter range");
}

template <class From, class To>
void cast(std::span<const From> in, std::span<To> out, cudaStream_t stream, const char* name) {
  same_size(in.size(), out.size(), name, "input", "output");
  using F = native_t<From>;
  using O = native_t<To>;
  run_kernel<pack_width<F, O>>(name, in.size(), stream, convert_fn<F, O>{device_ptr(in), device_ptr(out), 1, false},
                               device_ptr(in), device_ptr(out));
}

}  // namespace detail

/// x[i] *= factor on the device (f32, f64, bf16, f16) with ddp::detail::scale's rounding, asynchronously on `stream`.
template <class T>
  requires detail::floating<T>
void scale(std::span<T> x, double factor, cudaStream_t stream) {
  using N = detail::native_t<T>;
  detail::run_kernel<detail::pack_width<N>>("ddp::cuda::scale", x.size(), stream,
                                            detail::scale_by(detail::device_ptr(x), factor), detail::device_ptr(x));
}

/// x[i] /= count on the device: the average of a sum over `count` ranks, with the host backends' bits
/// (ddp::detail::divide: PyTorch's div_, bf16/f16 in float).
template <class T>
  requires detail::floating<T>
void average(std::span<T> x, int count, cudaStream_t stream) {
  if (count <= 0) throw error("ddp::cuda::average: count " + std::to_string(count) + " must be positive");
  using N = detail::native_t<T>;
  detail::run_kernel<detail::pack_width<N>>("ddp::cuda::average", x.size(), stream,
                                            detail::divide_by_count(detail::device_ptr(x), count), detail::device_ptr(x));
}

/// out[i] = bf16(in[i]), rounded to nearest even (the bf16 compression hook's encoder).
inline void cast_to_bf16(std::span<const float> in, std::span<bfloat16> out, cudaStream_t stream) {
  detail::cast(in, out, stream, "ddp::cuda::cast_to_bf16");
}
/// out[i] = float(in[i]), exact (the bf16 compression hook's decoder).
inline void cast_from_bf16(std::span<const bfloat16> in, std::span<float> out, cudaStream_t stream) {
  detail::cast(in, out, stream, "ddp::cuda::cast_from_bf16");
}
/// out[i] = f16(in[i]), rounded to nearest even, overflowing to ±inf (the fp16 compression hook's encoder).
inline void cast_to_f16(std::span<const float> in, std::span<float16> out, cudaStream_t stream) {
  detail::cast(in, out, stream, "ddp::cuda::cast_to_f16");
}
/// out[i] = float(in[i]), exact (the fp16 compression hook's decoder).
inline void cast_from_f16(std::span<const float16> in, std::span<float> out, cudaStream_t stream) {
  detail::cast(in, out, stream, "ddp::cuda::cast_from_f16");
}

/// One torch.optim.SGD step over a flat range (ddp::sgd_update: the optimizer's scalars, as
/// ddp::optim::sgd::update gives them); `momentum_buffer` is ignored (may be empty) when u.momentum is 0.
template <class T>
  requires std::is_same_v<T, float> || std::is_same_v<T, double>
void sgd_step(std::span<T> param, std::span<const T> grad, std::span<T> momentum_buffer, const sgd_update& u,
              cudaStream_t stream) {
  constexpr const char* name = "ddp::cuda::sgd_step";
  detail::same_size(param.size(), grad.size(), name, "param", "grad");
  const bool momentum = u.momentum != 0;
  if (momentum) detail::same_size(param.size(), momentum_buffer.size(), name, "param", "momentum_buffer");
  if (u.nesterov && (!momentum || u.dampening != 0))
    throw error("ddp::cuda::sgd_step: Nesterov momentum needs momentum > 0 and dampening 0 (as torch.optim.SGD)");
  T* buf = momentum ? momentum_buffer.data() : nullptr;
  const detail::sgd_fn<T> f{param.data(),
                            grad.data(),
                            buf,
                            static_cast<T>(u.lr),
                            static_cast<T>(u.weight_decay),
                            static_cast<T>(u.momentum),
                            static_cast<T>(1 - u.dampening),
                            u.weight_decay != 0,
                            momentum,
                            u.nesterov,
                            u.first};
  if (momentum)
    detail::run_kernel<detail::pack_width<T>>(name, param.size(), stream, f, param.data(), grad.data(), buf);
  else
    detail::run_kernel<detail::pack_width<T>>(name, param.size(), stream, f, param.data(), grad.data());
}

/// One torch.optim.AdamW step over a flat range (ddp::adamw_update: the step's scalars, as
/// ddp::optim::adamw::update gives them for a step count).
template <class T>
  requires std::is_same_v<T, float> || std::is_same_v<T, double>
void adamw_step(std::span<T> param, std::span<const T> grad, std::span<T> exp_avg, std::span<T> exp_avg_sq,
                const adamw_update& u, cudaStream_t stream) {
  constexpr const char* name = "ddp::cuda::adamw_step";
  detail::same_size(param.size(), grad.size(), name, "param", "grad");
  detail::same_size(param.size(), exp_avg.size(), name, "param", "exp_avg");
  detail::same_size(param.size(), exp_avg_sq.size(), name, "param", "exp_avg_sq");
  const detail::adamw_fn<T> f{param.data(),
                              grad.data(),
                              exp_avg.data(),
                              exp_avg_sq.data(),
                              static_cast<T>(u.decay),
                              static_cast<T>(u.beta1),
                              static_cast<T>(u.beta2),
                              static_cast<T>(u.step_size),
                              static_cast<T>(u.correction2_sqrt),
                              static_cast<T>(u.eps)};
  detail::run_kernel<detail::pack_width<T>>(name, param.size(), stream, f, param.data(), grad.data(), exp_avg.data(),
                                            exp_avg_sq.data());
}

}  // namespace ddp::cuda
