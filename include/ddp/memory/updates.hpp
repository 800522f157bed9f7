#pragma once
/// \file The host's loops of the optimizers' element updates (ddp::sgd_update, ddp::adamw_update of
/// core/updates.hpp) over flat f32 or f64 ranges: what ddp::host_domain runs. A device domain runs the same
/// arithmetic as kernels (cuda/element_kernels.cuh), so a step gives the same bits wherever its memory lives.

#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#endif

#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/updates.hpp>

namespace ddp {

namespace detail {

/// One SGD update of `n` elements with the options fixed at compile time, so the loop carries no branch and the
/// compiler vectorizes it (the three arrays never overlap); each element's arithmetic is host_sgd's.
template <class T, bool Decay, bool Momentum, bool First, bool Nesterov>
void sgd_elements(T* __restrict p, const T* __restrict g, T* __restrict buf, std::size_t n, T lr, T wd, T mu,
                  T keep) {
  for (std::size_t i = 0; i < n; ++i) {
    T d = g[i];
    if constexpr (Decay) d += wd * p[i];
    if constexpr (Momentum) {
      if constexpr (First) buf[i] = d;
      else buf[i] = mu * buf[i] + keep * d;
      if constexpr (Nesterov) d = d + mu * buf[i];
      else d = buf[i];
    }
    p[i] -= lr * d;
  }
}

/// sgd_update over host memory: `momentum` is empty when u.momentum is 0.
inline void host_sgd(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& momentum, const sgd_update& u) {
  steppable(values.type, "optim::sgd");
  visit_dtype(values.type, [&]<class T>(T) {
    if constexpr (std::is_floating_point_v<T>) {
      T* p = static_cast<T*>(values.data);
      const T* g = static_cast<const T*>(grads.data);
      T* buf = static_cast<T*>(momentum.data);
      const T lr = static_cast<T>(u.lr), wd = static_cast<T>(u.weight_decay);
      const T mu = static_cast<T>(u.momentum), keep = static_cast<T>(1 - u.dampening);
      const auto run = [&]<bool Decay>(std::bool_constant<Decay>) {
        if (u.momentum == 0) return sgd_elements<T, Decay, false, false, false>(p, g, buf, values.size, lr, wd, mu, keep);
        if (u.first && u.nesterov) return sgd_elements<T, Decay, true, true, true>(p, g, buf, values.size, lr, wd, mu, keep);
        if (u.first) return sgd_elements<T, Decay, true, true, false>(p, g, buf, values.size, lr, wd, mu, keep);
        if (u.nesterov) return sgd_elements<T, Decay, true, false, true>(p, g, buf, values.size, lr, wd, mu, keep);
        return sgd_elements<T, Decay, true, false, false>(p, g, buf, values.size, lr, wd, mu, keep);
      };
      if (u.weight_decay != 0) run(std::true_type{});
      else run(std::false_type{});
    }
  });
}

/// One AdamW update of `n` elements: whole SSE2 registers where the CPU has them (the compiler does not vectorize
/// the square root and division itself, which may set errno), then one element at a time, each in the same order
/// of operations.
template <class T>
void adamw_elements(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, std::size_t n,
                    const adamw_update& u) {
  const T decay = static_cast<T>(u.decay), b1 = static_cast<T>(u.beta1), b2 = static_cast<T>(u.beta2);
  const T step_size = static_cast<T>(u.step_size), c2 = static_cast<T>(u.correction2_sqrt);
  const T eps = static_cast<T>(u.eps);
  std::size_t i = 0;
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
  // An SSE2 register of T (four f32 or two f64 lanes): its + − × ÷ (with a scalar: in every lane) round each lane
  // as the scalar operation does.
  typedef T reg __attribute__((vector_size(16)));
  const auto load = [](const T* from) {
    reg r;
    std::memcpy(&r, from, sizeof r);
    return r;
  };
  const auto store = [](T* to, reg r) { std::memcpy(to, &r, sizeof r); };
  const auto root = [](reg r) {
    if constexpr (std::is_same_v<T, float>) return _mm_sqrt_ps(r);
    else return _mm_sqrt_pd(r);
  };
  for (; i + sizeof(reg) / sizeof(T) <= n; i += sizeof(reg) / sizeof(T)) {
    const reg gi = load(g + i), m0 = load(m + i);
    const reg pi = load(p + i) * decay;
    const reg mi = m0 + (T{1} - b1) * (gi - m0);
    const reg vi = b2 * load(v + i) + (T{1} - b2) * gi * gi;
    store(m + i, mi);
    store(v + i, vi);
    store(p + i, pi - step_size * mi / (root(vi) / c2 + eps));
  }
#endif
  for (; i < n; ++i) {
    p[i] *= decay;
    m[i] += (T{1} - b1) * (g[i] - m[i]);  // torch's lerp_ for weights below 0.5
    v[i] = b2 * v[i] + (T{1} - b2) * g[i] * g[i];
    p[i] -= step_size * m[i] / (std::sqrt(v[i]) / c2 + eps);
  }
}

/// adamw_update over host memory.
inline void host_adamw(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& exp_avg,
                       const raw_tensor& exp_avg_sq, const adamw_update& u) {
  steppable(values.type, "optim::adamw");
  visit_dtype(values.type, [&]<class T>(T) {
    if constexpr (std::is_floating_point_v<T>)
      adamw_elements(static_cast<T*>(values.data), static_cast<const T*>(grads.data), static_cast<T*>(exp_avg.data),
                     static_cast<T*>(exp_avg_sq.data), values.size, u);
  });
}

}  // namespace detail
}  // namespace ddp
