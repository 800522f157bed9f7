#pragma once
/// \file Element work on CUDA device memory for programs built by any C++ compiler: fill, accumulate, scale,
/// divide and convert over ddp::raw_tensor, each asynchronous on a stream. The kernels run element_kernels.cuh's
/// functors, compiled to PTX (detail/element_ptx.hpp, from src/cuda/element.cu) and loaded once per process with the
/// CUDA runtime's library API; the driver compiles them for the GPU at hand on first use and caches the result.
/// Every result has the host's bits (ddp::host_domain, ddp::detail::scale and divide).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/updates.hpp>
#include <ddp/cuda/detail/element_ptx.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::cuda {

namespace detail {

/// The loaded PTX and its kernels by name, for the process's lifetime.
class element_library {
 public:
  /// The kernel `name` of src/cuda/element.cu.
  static cudaKernel_t kernel(const std::string& name) {
    static element_library library;
    std::lock_guard lock(library.mutex_);
    auto [it, added] = library.kernels_.try_emplace(name, nullptr);
    if (added) {
      const cudaError_t code = cudaLibraryGetKernel(&it->second, library.handle_, name.c_str());
      if (code != cudaSuccess) library.kernels_.erase(it);
      check(code, "cudaLibraryGetKernel(" + name + ")");
    }
    return it->second;
  }

 private:
  element_library() {
    check(cudaLibraryLoadData(&handle_, element_ptx, nullptr, nullptr, 0, nullptr, nullptr, 0),
          "cudaLibraryLoadData of ddp's element kernels (PTX for compute_80 and newer)");
  }
  std::mutex mutex_;
  cudaLibrary_t handle_ = nullptr;
  std::unordered_map<std::string, cudaKernel_t> kernels_;
};

/// Starts kernel `name` over n elements in packs of V (where every pointer is 16-byte aligned) on `stream`; `args`
/// are the kernel's parameters after (pointers..., n) up to the trailing `vector` flag, with the kernel's types.
template <class... Args>
void start_element_kernel(const std::string& name, std::size_t n, int V, bool vector, cudaStream_t stream,
                          Args... args) {
  if (n == 0) return;
  void* argv[] = {static_cast<void*>(&args)..., static_cast<void*>(&vector)};
  const unsigned blocks = grid_blocks(launch_units(n, V, vector), threads_per_block);
  check(cudaLaunchKernel(reinterpret_cast<const void*>(element_library::kernel(name)), dim3(blocks),
                         dim3(threads_per_block), argv, 0, stream),
        "start of kernel " + name);
}

/// Elements of `type` in a 16-byte pack.
constexpr int pack_of(dtype type) noexcept { return static_cast<int>(16 / size_of(type)); }

/// The kernel name for `op` on `type`: "ddp_fill_f32".
inline std::string kernel_name(const char* op, dtype type) { return std::string("ddp_") + op + "_" + std::string(to_string(type)); }

inline bool is_floating(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::bf16 || t == dtype::f16;
}

inline void same_shape(const raw_tensor& a, const raw_tensor& b, const char* what) {
  if (a.type != b.type || a.size != b.size)
    throw error(std::string("ddp::cuda::") + what + ": " + std::to_string(a.size) + " " + std::string(to_string(a.type)) +
                " against " + std::to_string(b.size) + " " + std::string(to_string(b.type)) +
                "; give both sides the same dtype and length");
}

}  // namespace detail

/// Every element of `t` becomes `value` (bf16/f16 through float, integers truncated), on `stream`.
inline void fill(const raw_tensor& t, double value, cudaStream_t stream) {
  const bool vector = aligned16(t.data);
  visit_dtype(t.type, [&]<class T>(T) {
    T v{};
    if constexpr (std::is_arithmetic_v<T>)
      v = static_cast<T>(value);
    else
      v = T(static_cast<float>(value));
    detail::start_element_kernel(detail::kernel_name("fill", t.type), t.size, detail::pack_of(t.type), vector, stream,
                                 t.data, t.size, v);
  });
}

/// into += from, element for element (same dtype and size), on `stream`.
inline void accumulate(const raw_tensor& from, const raw_tensor& into, cudaStream_t stream) {
  detail::same_shape(from, into, "accumulate");
  detail::start_element_kernel(detail::kernel_name("accumulate", from.type), from.size, detail::pack_of(from.type),
                               aligned16(from.data) && aligned16(into.data), stream, from.data, into.data, from.size);
}

/// Every element of `t` times `factor`, rounded as ddp::detail::scale rounds on the host, on `stream`.
inline void scale(const raw_tensor& t, double factor, cudaStream_t stream) {
  const std::string name = detail::kernel_name("scale", t.type);
  const bool vector = aligned16(t.data);
  const int V = detail::pack_of(t.type);
  if (t.type == dtype::f32 || t.type == dtype::bf16 || t.type == dtype::f16) {
    const auto exact = static_cast<float>(factor);
    const bool in_type = t.type == dtype::f32 && static_cast<double>(exact) == factor;
    detail::start_element_kernel(name, t.size, V, vector, stream, t.data, t.size, factor, exact, in_type);
  } else if (t.type == dtype::f64) {
    detail::start_element_kernel(name, t.size, V, vector, stream, t.data, t.size, factor, factor, true);
  } else {
    detail::start_element_kernel(name, t.size, V, vector, stream, t.data, t.size, factor);
  }
}

/// Every element of `t` divided by `count` (> 0) with ddp::detail::divide's bits: the finish of an average over
/// `count` ranks, on `stream`; nothing to do for count 1.
inline void divide(const raw_tensor& t, int count, cudaStream_t stream) {
  if (count <= 0) throw error("ddp::cuda::divide: count " + std::to_string(count) + " must be positive");
  if (count == 1) return;
  const std::string name = detail::kernel_name("divide", t.type);
  const bool vector = aligned16(t.data);
  const int V = detail::pack_of(t.type);
  const bool power_of_two = (count & (count - 1)) == 0;
  if (t.type == dtype::f64) {
    detail::start_element_kernel(name, t.size, V, vector, stream, t.data, t.size, static_cast<double>(count),
                                 1.0 / count, power_of_two);
  } else if (detail::is_floating(t.type)) {
    detail::start_element_kernel(name, t.size, V, vector, stream, t.data, t.size, static_cast<float>(count),
                                 1.0F / static_cast<float>(count), power_of_two);
  } else {
    visit_dtype(t.type, [&]<class T>(T) {
      if constexpr (std::is_integral_v<T>)
        detail::start_element_kernel(name, t.size, V, vector, stream, t.data, t.size, static_cast<T>(count));
    });
  }
}

/// to = from × factor converted to `to`'s dtype, as ddp::host_domain::convert: floating types, a factor other
/// than 1 only from f32 or f64; on `stream`.
inline void convert(const raw_tensor& from, const raw_tensor& to, double factor, cudaStream_t stream) {
  if (from.size != to.size)
    throw error("ddp::cuda::convert: " + std::to_string(from.size) + " elements into " + std::to_string(to.size) +
                "; give both sides the same length");
  if (!detail::is_floating(from.type) || !detail::is_floating(to.type))
    throw error("ddp::cuda::convert: " + std::string(to_string(from.type)) + " to " + std::string(to_string(to.type)) +
                " on a device; convert between f32, f64, bf16 and f16");
  const bool scaled = factor != 1.0;
  if (scaled && from.type != dtype::f32 && from.type != dtype::f64)
    throw error("ddp::cuda::convert: a factor applies to f32 and f64 sources, not " + std::string(to_string(from.type)));
  const std::string name = "ddp_convert_" + std::string(to_string(from.type)) + "_" + std::string(to_string(to.type));
  const int V = static_cast<int>(16 / std::max(size_of(from.type), size_of(to.type)));
  const bool vector = aligned16(from.data) && aligned16(to.data);
  if (from.type == dtype::f64)
    detail::start_element_kernel(name, from.size, V, vector, stream, from.data, to.data, from.size, factor, scaled);
  else
    detail::start_element_kernel(name, from.size, V, vector, stream, from.data, to.data, from.size,
                                 static_cast<float>(factor), scaled);
}

/// One torch.optim.SGD step over `values` (f32 or f64) with the host's bits (ddp::detail::host_sgd); `momentum` is
/// empty when u.momentum is 0; on `stream`.
inline void sgd(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& momentum, const sgd_update& u,
                cudaStream_t stream) {
  ddp::detail::steppable(values.type, "ddp::cuda::sgd");
  detail::same_shape(values, grads, "sgd");
  const bool with_momentum = u.momentum != 0;
  if (with_momentum) detail::same_shape(values, momentum, "sgd");
  const bool vector = aligned16(values.data) && aligned16(grads.data) && (!with_momentum || aligned16(momentum.data));
  visit_dtype(values.type, [&]<class T>(T) {
    if constexpr (std::is_floating_point_v<T>)
      detail::start_element_kernel(detail::kernel_name("sgd", values.type), values.size, detail::pack_of(values.type),
                                   vector, stream, values.data, grads.data, momentum.data, values.size,
                                   static_cast<T>(u.lr), static_cast<T>(u.weight_decay), static_cast<T>(u.momentum),
                                   static_cast<T>(1 - u.dampening), u.weight_decay != 0, with_momentum, u.nesterov,
                                   u.first);
  });
}

/// One torch.optim.AdamW step over `values` (f32 or f64) with the host's bits (ddp::detail::host_adamw), on `stream`.
inline void adamw(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& exp_avg,
                  const raw_tensor& exp_avg_sq, const adamw_update& u, cudaStream_t stream) {
  ddp::detail::steppable(values.type, "ddp::cuda::adamw");
  detail::same_shape(values, grads, "adamw");
  detail::same_shape(values, exp_avg, "adamw");
  detail::same_shape(values, exp_avg_sq, "adamw");
  const bool vector = aligned16(values.data) && aligned16(grads.data) && aligned16(exp_avg.data) &&
                      aligned16(exp_avg_sq.data);
  visit_dtype(values.type, [&]<class T>(T) {
    if constexpr (std::is_floating_point_v<T>)
      detail::start_element_kernel(detail::kernel_name("adamw", values.type), values.size, detail::pack_of(values.type),
                                   vector, stream, values.data, grads.data, exp_avg.data, exp_avg_sq.data, values.size,
                                   static_cast<T>(u.decay), static_cast<T>(u.beta1), static_cast<T>(u.beta2),
                                   static_cast<T>(u.step_size), static_cast<T>(u.correction2_sqrt),
                                   static_cast<T>(u.eps));
  });
}

}  // namespace ddp::cuda
