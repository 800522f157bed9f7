#pragma once
/// \file The element arithmetic as device code: widening and rounding, 16-byte packs, the grid-stride loop, and the
/// per-element functors of scaling, averaging, conversion and the SGD and AdamW updates, each with the host's bits.
/// A leaf: it includes CUDA's half-precision headers and the standard library only, so the PTX generated from it
/// (scripts/cuda_ptx.py: src/cuda/element.cu and this file) changes only when the kernels do. kernels.cuh (for nvcc
/// users) and element.cu (the PTX that cuda/element.hpp loads) both run these functors.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <type_traits>

namespace ddp::cuda::detail {

/// The type arithmetic runs in: double for double, float for everything else.
template <class T> using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

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

/// Elements per 16-byte pack of the widest type among Ts (measured on an H200: packs of the narrowest type, the
/// wider side in two 16-byte pieces, bring a bf16 -> f32 cast from 88 % of a copy's bandwidth down to 64 %).
template <class... Ts>
inline constexpr int pack_width = [] {
  std::size_t widest = 0;
  ((widest = sizeof(Ts) > widest ? sizeof(Ts) : widest), ...);
  return static_cast<int>(16 / widest);
}();

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

}  // namespace ddp::cuda::detail
