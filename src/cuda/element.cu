// The element kernels of ddp::cuda::element (<ddp/cuda/element.hpp>) as extern "C" entry points, one per dtype
// (and dtype pair for conversions). scripts/cuda_ptx.py compiles this file to PTX into
// include/ddp/cuda/detail/element_ptx.hpp, which element.hpp loads at run time, so programs built with a plain C++
// compiler run them. The arithmetic is element_kernels.cuh's (kernels.cuh runs it too, for nvcc users): one
// definition for both. This file and that leaf are the PTX's only inputs.
#include <cstddef>
#include <cstdint>

#include <ddp/cuda/element_kernels.cuh>

namespace {

using namespace ddp::cuda::detail;

/// x = value.
template <class T>
struct fill_fn {
  T* x;
  T value;
  template <int V>
  __device__ void run(std::size_t i) const {
    pack<T, V> a;
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] = value;
    store<V>(x + i, a);
  }
};

/// into = into + from, as the host domain adds: in the compute type for floats, with wrap-around for integers.
template <class T>
struct accumulate_fn {
  const T* from;
  T* into;
  template <int V>
  __device__ void run(std::size_t i) const {
    auto a = load<V>(into + i);
    const auto b = load<V>(from + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if constexpr (std::is_integral_v<T>)
        a.v[k] = static_cast<T>(a.v[k] + b.v[k]);
      else
        a.v[k] = narrow<T>(widen(a.v[k]) + widen(b.v[k]));
    }
    store<V>(into + i, a);
  }
};

/// Integers: x = x × factor through double, truncated (ddp::detail::scale), or x = x / count, truncated.
template <class T>
struct integer_fn {
  T* x;
  double factor;
  T count;
  bool divide;
  template <int V>
  __device__ void run(std::size_t i) const {
    auto a = load<V>(x + i);
#pragma unroll
    for (int k = 0; k < V; ++k)
      a.v[k] = divide ? static_cast<T>(a.v[k] / count) : static_cast<T>(static_cast<double>(a.v[k]) * factor);
    store<V>(x + i, a);
  }
};

/// The grid-stride loop in packs of V where the host found every pointer aligned, else element by element.
template <int V, class F>
__device__ __forceinline__ void loop(bool vector, std::size_t n, const F& f) {
  if (vector)
    grid_stride<V>(n, f);
  else
    grid_stride<1>(n, f);
}

}  // namespace

#define DDP_ALL_TYPES(X) \
  X(f32, float) X(f64, double) X(bf16, __nv_bfloat16) X(f16, __half) X(i32, std::int32_t) X(i64, std::int64_t) \
  X(u8, std::uint8_t)
#define DDP_FLOAT_TYPES(X) X(f32, float) X(f64, double) X(bf16, __nv_bfloat16) X(f16, __half)

#define DDP_EVERY_TYPE(name, T)                                                                                  \
  extern "C" __global__ void ddp_fill_##name(T* x, std::size_t n, T value, bool vector) {                       \
    loop<pack_width<T>>(vector, n, fill_fn<T>{x, value});                                                         \
  }                                                                                                              \
  extern "C" __global__ void ddp_accumulate_##name(const T* from, T* into, std::size_t n, bool vector) {        \
    loop<pack_width<T>>(vector, n, accumulate_fn<T>{from, into});                                                 \
  }
DDP_ALL_TYPES(DDP_EVERY_TYPE)

#define DDP_FLOAT_TYPE(name, T)                                                                                  \
  extern "C" __global__ void ddp_scale_##name(T* x, std::size_t n, double factor, compute_t<T> exact,          \
                                              bool in_type, bool vector) {                                       \
    loop<pack_width<T>>(vector, n, scale_fn<T>{x, {factor, exact, in_type}});                                     \
  }                                                                                                              \
  extern "C" __global__ void ddp_divide_##name(T* x, std::size_t n, compute_t<T> count, compute_t<T> reciprocal, \
                                               bool power_of_two, bool vector) {                                 \
    loop<pack_width<T>>(vector, n, divide_fn<T>{x, {count, reciprocal, power_of_two}});                           \
  }
DDP_FLOAT_TYPES(DDP_FLOAT_TYPE)

#define DDP_OPTIMIZER_TYPE(name, T)                                                                              \
  extern "C" __global__ void ddp_sgd_##name(T* p, const T* g, T* buf, std::size_t n, T lr, T wd, T mu, T keep,    \
                                            bool decay, bool momentum, bool nesterov, bool first, bool vector) {  \
    loop<pack_width<T>>(vector, n, sgd_fn<T>{p, g, buf, lr, wd, mu, keep, decay, momentum, nesterov, first}); \
  }                                                                                                              \
  extern "C" __global__ void ddp_adamw_##name(T* p, const T* g, T* m, T* v, std::size_t n, T decay, T b1, T b2,   \
                                              T step_size, T c2, T eps, bool vector) {                           \
    loop<pack_width<T>>(vector, n, adamw_fn<T>{p, g, m, v, decay, b1, b2, step_size, c2, eps});            \
  }
DDP_OPTIMIZER_TYPE(f32, float)
DDP_OPTIMIZER_TYPE(f64, double)

#define DDP_INTEGER_TYPE(name, T)                                                                                \
  extern "C" __global__ void ddp_scale_##name(T* x, std::size_t n, double factor, bool vector) {               \
    loop<pack_width<T>>(vector, n, integer_fn<T>{x, factor, T(1), false});                                        \
  }                                                                                                              \
  extern "C" __global__ void ddp_divide_##name(T* x, std::size_t n, T count, bool vector) {                    \
    loop<pack_width<T>>(vector, n, integer_fn<T>{x, 1.0, count, true});                                           \
  }
DDP_INTEGER_TYPE(i32, std::int32_t)
DDP_INTEGER_TYPE(i64, std::int64_t)
DDP_INTEGER_TYPE(u8, std::uint8_t)

#define DDP_CONVERT(from_name, From, to_name, To)                                                               \
  extern "C" __global__ void ddp_convert_##from_name##_##to_name(const From* in, To* out, std::size_t n,        \
                                                                 compute_t<From> factor, bool scaled,           \
                                                                 bool vector) {                                  \
    loop<pack_width<From, To>>(vector, n, convert_fn<From, To>{in, out, factor, scaled});                        \
  }
#define DDP_CONVERT_FROM(from_name, From)                                                                        \
  DDP_CONVERT(from_name, From, f32, float)                                                                       \
  DDP_CONVERT(from_name, From, f64, double)                                                                      \
  DDP_CONVERT(from_name, From, bf16, __nv_bfloat16) DDP_CONVERT(from_name, From, f16, __half)
DDP_FLOAT_TYPES(DDP_CONVERT_FROM)
