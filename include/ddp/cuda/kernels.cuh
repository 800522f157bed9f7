#pragma once
/// \file Element-wise CUDA kernels over flat spans of device memory and their host API (compile with nvcc):
/// scale/average (gradient averaging), f32<->bf16/f16 casts (compression hooks), and the SGD and AdamW steps
/// with PyTorch's formulas (torch.optim.SGD, torch.optim.AdamW without amsgrad), as ddp::optim's CPU steps.
///
/// Every std::span argument views device memory on the current device; every call is asynchronous on
/// `stream`. Loops are grid-stride over 16-byte packs (float4-wide loads and stores) when every pointer is
/// 16-byte aligned, element by element otherwise. bf16/f16 values compute in float, f32 in float, f64 in double.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/optim/adamw.hpp>
#include <ddp/optim/sgd.hpp>

namespace ddp::cuda {

/// Hyperparameters of the SGD step: the CPU optimizer's, so both devices take the same settings.
using sgd_options = optim::sgd::options;
/// Hyperparameters of the AdamW step: the CPU optimizer's, so both devices take the same settings.
using adamw_options = optim::adamw::options;

namespace detail {

/// The CUDA type with the same bits as a ddp element type.
template <class T> struct native { using type = T; };
template <> struct native<bfloat16> { using type = __nv_bfloat16; };
template <> struct native<float16> { using type = __half; };
template <class T> using native_t = typename native<std::remove_const_t<T>>::type;

/// The type arithmetic runs in: double for double, float for everything else.
template <class T> using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
concept floating = std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16> ||
                   std::is_same_v<T, float16>;

__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }

template <class T> __device__ __forceinline__ T narrow(float x);
template <> __device__ __forceinline__ __nv_bfloat16 narrow(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half narrow(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ float narrow(float x) { return x; }
template <> __device__ __forceinline__ double narrow(float x) { return x; }
template <class T> __device__ __forceinline__ T narrow(double x) { return x; }

/// V consecutive elements, aligned so that one vector instruction moves them.
template <class T, int V>
struct alignas(sizeof(T) * V) pack {
  T v[V];
};

template <int V, class T>
__device__ __forceinline__ pack<T, V> load(const T* p) {
  return *reinterpret_cast<const pack<T, V>*>(p);
}
template <int V, class T>
__device__ __forceinline__ void store(T* p, const pack<T, V>& x) {
  *reinterpret_cast<pack<T, V>*>(p) = x;
}

/// Grid-stride loop: `f.template run<V>(i)` handles elements [i, i+V) for every full pack, then
/// `f.template run<1>(i)` handles the n % V tail.
template <int V, class F>
__device__ __forceinline__ void grid_stride(std::size_t n, const F& f) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t packs = n / V;
  for (std::size_t p = first; p < packs; p += stride) f.template run<V>(p * V);
  for (std::size_t i = packs * V + first; i < n; i += stride) f.template run<1>(i);
}

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

/// Elements per 16-byte pack of the widest type among Ts (measured on an H200: packs of the narrowest type, the
/// wider side in two 16-byte pieces, bring a bf16 -> f32 cast from 88 % of a copy's bandwidth down to 64 %).
template <class... Ts>
inline constexpr int pack_width = static_cast<int>(16 / std::max({sizeof(Ts)...}));

/// x / n rounded once, from r = 1/n rounded once (computed on the host): Markstein's correction by one FMA gives
/// the correctly rounded quotient wherever the operands are normal and finite (checked against the division for
/// every positive float at n = 3..4095); zeros keep their sign, and the division itself handles the rest (tiny,
/// infinite, NaN).
template <class C>
__device__ __forceinline__ C divide_by(C x, C n, C r) {
  constexpr C tiny = std::is_same_v<C, double> ? 0x1p-900 : 0x1p-100f;
  constexpr C huge = std::is_same_v<C, double> ? 0x1.fffffffffffffp+1023 : 0x1.fffffep+127f;  // the largest finite
  const C a = fabs(x);
  if (a >= tiny && a <= huge) {
    const C q = x * r;
    return fma(fma(-q, n, x), r, q);
  }
  if (a == C(0)) return x * r;  // ±0, the sign kept
  return x / n;
}

/// x = op(x), element for element in place, with `op` taking and giving the compute type.
template <class T, class Op>
struct in_place_fn {
  T* x;
  Op op;
  template <int V>
  __device__ void run(std::size_t i) const {
    auto a = load<V>(x + i);
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] = narrow<T>(op(widen(a.v[k])));
    store<V>(x + i, a);
  }
};

/// w × factor as ddp::detail::scale does on the host: in the element type where the factor is exact in it
/// (`in_type`, f32 and f64 only), else through double, rounded to the element type (bf16/f16 through float).
template <class T>
struct scale_op {
  double factor;
  compute_t<T> exact;
  bool in_type;
  __device__ compute_t<T> operator()(compute_t<T> w) const {
    return in_type ? w * exact : static_cast<compute_t<T>>(static_cast<double>(w) * factor);
  }
};
template <class T>
using scale_fn = in_place_fn<T, scale_op<T>>;

/// The scale_fn of `factor`.
template <class T>
scale_fn<T> scale_by(T* x, double factor) {
  using C = compute_t<T>;
  constexpr bool standard = std::is_same_v<T, float> || std::is_same_v<T, double>;
  return {x, {factor, static_cast<C>(factor), standard && static_cast<double>(static_cast<C>(factor)) == factor}};
}

/// w / count as ddp::detail::divide does on the host: a multiplication by the exact reciprocal of a power of two,
/// else the quotient rounded once in the compute type (bf16/f16 divide in float).
template <class T>
struct divide_op {
  compute_t<T> count, reciprocal;
  bool power_of_two;
  __device__ compute_t<T> operator()(compute_t<T> w) const {
    return power_of_two ? w * reciprocal : divide_by(w, count, reciprocal);
  }
};
template <class T>
using divide_fn = in_place_fn<T, divide_op<T>>;

/// The divide_fn of `count` (a positive group size).
template <class T>
divide_fn<T> divide_by_count(T* x, int count) {
  using C = compute_t<T>;
  return {x, {static_cast<C>(count), C(1) / static_cast<C>(count), (count & (count - 1)) == 0}};
}

/// The type a conversion from From to To passes through, as ddp::detail::convert: float where a side is 16-bit.
template <class From, class To>
using convert_t = std::conditional_t<sizeof(From) == 2 || sizeof(To) == 2, float, compute_t<From>>;

/// out = convert(in × factor) as the host domain converts: the product in From's type where `scaled`, then the
/// conversion through convert_t, rounding to nearest even.
template <class From, class To>
struct convert_fn {
  const From* in;
  To* out;
  compute_t<From> factor;
  bool scaled;
  template <int V>
  __device__ void run(std::size_t i) const {
    const auto a = load<V>(in + i);
    pack<To, V> b;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      auto w = widen(a.v[k]);
      if (scaled) w = static_cast<compute_t<From>>(w * factor);
      b.v[k] = narrow<To>(static_cast<convert_t<From, To>>(w));
    }
    store<V>(out + i, b);
  }
};

/// IEEE operations rounded once each, never fused, so the optimizers' updates give the host's bits.
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float root(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double root(double a) { return __dsqrt_rn(a); }

/// One torch.optim.SGD step (ddp::sgd_update), in ddp::detail::host_sgd's order of operations.
template <class T>
struct sgd_fn {
  T* p;
  const T* g;
  T* buf;  // unused without momentum
  T lr, wd, mu, keep;
  bool decay, momentum, nesterov, first;
  template <int V>
  __device__ void run(std::size_t i) const {
    auto x = load<V>(p + i);
    const auto d0 = load<V>(g + i);
    pack<T, V> b{};
    if (momentum && !first) b = load<V>(buf + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      T d = d0.v[k];
      if (decay) d = add(d, mul(wd, x.v[k]));
      if (momentum) {
        b.v[k] = first ? d : add(mul(mu, b.v[k]), mul(keep, d));
        d = nesterov ? add(d, mul(mu, b.v[k])) : b.v[k];
      }
      x.v[k] = sub(x.v[k], mul(lr, d));
    }
    store<V>(p + i, x);
    if (momentum) store<V>(buf + i, b);
  }
};

/// One torch.optim.AdamW step (ddp::adamw_update), in ddp::detail::host_adamw's order of operations.
template <class T>
struct adamw_fn {
  T* p;
  const T* g;
  T* m;
  T* v;
  T decay, b1, b2, step_size, c2, eps;
  template <int V>
  __device__ void run(std::size_t i) const {
    auto x = load<V>(p + i);
    const auto d = load<V>(g + i);
    auto a = load<V>(m + i);
    auto s = load<V>(v + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      x.v[k] = mul(x.v[k], decay);
      a.v[k] = add(a.v[k], mul(sub(T(1), b1), sub(d.v[k], a.v[k])));
      s.v[k] = add(mul(b2, s.v[k]), mul(mul(sub(T(1), b2), d.v[k]), d.v[k]));
      x.v[k] = sub(x.v[k], div(mul(step_size, a.v[k]), add(div(root(s.v[k]), c2), eps)));
    }
    store<V>(p + i, x);
    store<V>(m + i, a);
    store<V>(v + i, s);
  }
};

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

/// One torch.optim.SGD step over a flat range: g = grad + weight_decay·param; with
/// momentum, buf = g on the first step, else momentum·buf + (1 − dampening)·g, and g = nesterov ? g + momentum·buf
/// : buf; then param −= lr·g. `momentum_buffer` is ignored (may be empty) when momentum is 0.
template <class T>
  requires std::is_same_v<T, float> || std::is_same_v<T, double>
void sgd_step(std::span<T> param, std::span<const T> grad, std::span<T> momentum_buffer, const sgd_options& o,
              bool first_step, cudaStream_t stream) {
  constexpr const char* name = "ddp::cuda::sgd_step";
  detail::same_size(param.size(), grad.size(), name, "param", "grad");
  const bool momentum = o.momentum != 0;
  if (momentum) detail::same_size(param.size(), momentum_buffer.size(), name, "param", "momentum_buffer");
  if (o.nesterov && (!momentum || o.dampening != 0))
    throw error("ddp::cuda::sgd_step: Nesterov momentum needs momentum > 0 and dampening 0 (as torch.optim.SGD)");
  T* buf = momentum ? momentum_buffer.data() : nullptr;
  const detail::sgd_fn<T> f{param.data(),
                            grad.data(),
                            buf,
                            static_cast<T>(o.lr),
                            static_cast<T>(o.weight_decay),
                            static_cast<T>(o.momentum),
                            static_cast<T>(1 - o.dampening),
                            o.weight_decay != 0,
                            momentum,
                            o.nesterov,
                            first_step};
  if (momentum)
    detail::run_kernel<detail::pack_width<T>>(name, param.size(), stream, f, param.data(), grad.data(), buf);
  else
    detail::run_kernel<detail::pack_width<T>>(name, param.size(), stream, f, param.data(), grad.data());
}

/// One torch.optim.AdamW step over a flat range; `step` counts steps including this one (1 on the first).
/// param ·= 1 − lr·weight_decay; m += (1 − β1)·(g − m); v = β2·v + (1 − β2)·g²;
/// param −= lr/(1 − β1^step) · m / (√v / √(1 − β2^step) + eps).
template <class T>
  requires std::is_same_v<T, float> || std::is_same_v<T, double>
void adamw_step(std::span<T> param, std::span<const T> grad, std::span<T> exp_avg, std::span<T> exp_avg_sq,
                const adamw_options& o, std::int64_t step, cudaStream_t stream) {
  constexpr const char* name = "ddp::cuda::adamw_step";
  detail::same_size(param.size(), grad.size(), name, "param", "grad");
  detail::same_size(param.size(), exp_avg.size(), name, "param", "exp_avg");
  detail::same_size(param.size(), exp_avg_sq.size(), name, "param", "exp_avg_sq");
  if (step < 1) throw error("ddp::cuda::adamw_step: step " + std::to_string(step) + " must count from 1");
  const double bias_correction1 = 1 - std::pow(o.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(o.beta2, static_cast<double>(step));
  const detail::adamw_fn<T> f{param.data(),
                              grad.data(),
                              exp_avg.data(),
                              exp_avg_sq.data(),
                              static_cast<T>(1 - o.lr * o.weight_decay),
                              static_cast<T>(o.beta1),
                              static_cast<T>(o.beta2),
                              static_cast<T>(o.lr / bias_correction1),
                              static_cast<T>(std::sqrt(bias_correction2)),
                              static_cast<T>(o.eps)};
  detail::run_kernel<detail::pack_width<T>>(name, param.size(), stream, f, param.data(), grad.data(), exp_avg.data(),
                                        exp_avg_sq.data());
}

}  // namespace ddp::cuda
