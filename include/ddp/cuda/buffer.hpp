#pragma once
/// \file Owned memory for device code: device_buffer (cudaMalloc) and pinned_buffer (page-locked host memory
/// for fast, asynchronous host<->device staging). Both are ddp::tensors, so they go straight into collectives.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::cuda {

/// `count` elements of T in the memory of one CUDA device; move-only, contents uninitialized.
template <element T>
class device_buffer {
 public:
  /// An empty buffer.
  device_buffer() = default;
  /// Allocates `count` elements on `device` (default: the current device).
  explicit device_buffer(std::size_t count, int device = current_device()) : size_(count), device_(device) {
    if (count == 0) return;
    const device_guard on(device);
    void* p = nullptr;
    check(cudaMalloc(&p, count * sizeof(T)),
          "cudaMalloc of " + std::to_string(count * sizeof(T)) + " bytes on cuda:" + std::to_string(device));
    data_ = static_cast<T*>(p);
  }
  /// Allocates on `device` and copies `host` into it (synchronously).
  explicit device_buffer(std::span<const T> host, int device = current_device()) : device_buffer(host.size(), device) {
    upload(host);
  }
  device_buffer(device_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), device_(other.device_) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      device_ = other.device_;
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  /// First element (a device pointer).
  [[nodiscard]] T* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The CUDA ordinal the memory lives on.
  [[nodiscard]] int device_index() const noexcept { return device_; }
  /// A span over the device memory (for the kernels' host API; never dereference it on the host).
  [[nodiscard]] std::span<T> span() const noexcept { return {data_, size_}; }
  /// An untyped view tagged with device::cuda(device_index()).
  [[nodiscard]] raw_tensor raw() const noexcept { return {data_, size_, dtype_v<T>, device::cuda(device_)}; }

  /// Copies `host` (exactly size() elements) into the buffer; blocks until done.
  void upload(std::span<const T> host) {
    same_size(host.size(), "upload");
    check(cudaMemcpy(data_, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "cudaMemcpy host to device");
  }
  /// Copies the buffer into `host` (exactly size() elements) after the device is idle; blocks until done.
  void download(std::span<T> host) const {
    same_size(host.size(), "download");
    check(cudaMemcpy(host.data(), data_, host.size_bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
  }
  /// The contents as a host vector (synchronous).
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(size_);
    download(out);
    return out;
  }

 private:
  void same_size(std::size_t n, const char* what) const {
    if (n != size_)
      throw error(std::string("device_buffer::") + what + ": the host span has " + std::to_string(n) +
                  " elements but the buffer " + std::to_string(size_) + "; pass a span of the buffer's size");
  }
  void reset() noexcept {
    if (data_ != nullptr) {
      const int previous = [] { int d = 0; (void)cudaGetDevice(&d); return d; }();
      (void)cudaSetDevice(device_);
      (void)cudaFree(data_);
      (void)cudaSetDevice(previous);
    }
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
  int device_ = 0;
};

/// `count` elements of T in page-locked host memory (cudaMallocHost); move-only, contents uninitialized.
/// Copies between it and a device run asynchronously on a stream and at full PCIe/NVLink speed.
template <element T>
class pinned_buffer {
 public:
  /// An empty buffer.
  pinned_buffer() = default;
  /// Allocates `count` page-locked elements.
  explicit pinned_buffer(std::size_t count) : size_(count) {
    if (count == 0) return;
    void* p = nullptr;
    check(cudaMallocHost(&p, count * sizeof(T)), "cudaMallocHost of " + std::to_string(count * sizeof(T)) + " bytes");
    data_ = static_cast<T*>(p);
  }
  pinned_buffer(pinned_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  ~pinned_buffer() { reset(); }

  /// First element (a host pointer).
  [[nodiscard]] T* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// A span over the host memory.
  [[nodiscard]] std::span<T> span() const noexcept { return {data_, size_}; }

 private:
  void reset() noexcept {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace ddp::cuda

namespace ddp {

/// A device_buffer is a tensor on device::cuda(device_index()).
template <element T>
struct tensor_traits<cuda::device_buffer<T>> {
  static T* data(const cuda::device_buffer<T>& t) noexcept { return t.data(); }
  static std::size_t size(const cuda::device_buffer<T>& t) noexcept { return t.size(); }
  static constexpr ddp::dtype dtype(const cuda::device_buffer<T>&) noexcept { return dtype_v<T>; }
  static ddp::device device(const cuda::device_buffer<T>& t) noexcept { return device::cuda(t.device_index()); }
};

/// A pinned_buffer is a host tensor.
template <element T>
struct tensor_traits<cuda::pinned_buffer<T>> {
  static T* data(const cuda::pinned_buffer<T>& t) noexcept { return t.data(); }
  static std::size_t size(const cuda::pinned_buffer<T>& t) noexcept { return t.size(); }
  static constexpr ddp::dtype dtype(const cuda::pinned_buffer<T>&) noexcept { return dtype_v<T>; }
  static constexpr ddp::device device(const cuda::pinned_buffer<T>&) noexcept { return device::cpu(); }
};

static_assert(tensor<cuda::device_buffer<float>> && tensor<cuda::pinned_buffer<bfloat16>>,
              "ddp::cuda buffers must model ddp::tensor; fix their tensor_traits.");

}  // namespace ddp
