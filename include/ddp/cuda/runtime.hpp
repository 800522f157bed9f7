#pragma once
/// \file CUDA runtime handles as RAII types: the current-device guard, streams and events.

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include <ddp/cuda/error.hpp>

namespace ddp::cuda {

/// The calling thread's current CUDA device.
inline int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

/// Number of CUDA devices this process can see; throws ddp::cuda_error when there is no usable device.
inline int device_count() {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  return count;
}

/// Makes `device` current for one scope and restores the previous device after.
class device_guard {
 public:
  /// Switches to `device` (a no-op when it is already current).
  explicit device_guard(int device) : previous_(current_device()) {
    if (device != previous_) check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() { (void)cudaSetDevice(previous_); }

 private:
  int previous_;
};

/// An owned CUDA stream on one device; move-only.
class stream {
 public:
  /// Creates a stream on `device` (default: the current one); non-blocking w.r.t. the legacy default stream.
  explicit stream(int device = current_device(), unsigned flags = cudaStreamNonBlocking, int priority = 0)
      : device_(device) {
    const device_guard on(device);
    check(cudaStreamCreateWithPriority(&handle_, flags, priority), "cudaStreamCreateWithPriority");
  }
  stream(stream&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)), device_(other.device_) {}
  stream& operator=(stream&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
      device_ = other.device_;
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { reset(); }

  /// The raw handle.
  [[nodiscard]] cudaStream_t get() const noexcept { return handle_; }
  /// The device the stream belongs to.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// Blocks the host until all work queued on the stream is done.
  void synchronize() const { check(cudaStreamSynchronize(handle_), "cudaStreamSynchronize"); }

 private:
  void reset() noexcept {
    if (handle_ != nullptr) (void)cudaStreamDestroy(handle_);
    handle_ = nullptr;
  }
  cudaStream_t handle_ = nullptr;
  int device_ = 0;
};

/// An owned CUDA event; move-only. Timing is off unless asked for (it makes record and query slower).
class event {
 public:
  /// Creates an event on the current device.
  explicit event(unsigned flags = cudaEventDisableTiming) {
    check(cudaEventCreateWithFlags(&handle_, flags), "cudaEventCreateWithFlags");
  }
  event(event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  event& operator=(event&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() { reset(); }

  /// The raw handle.
  [[nodiscard]] cudaEvent_t get() const noexcept { return handle_; }
  /// Captures the work queued on `s` so far.
  void record(cudaStream_t s) { check(cudaEventRecord(handle_, s), "cudaEventRecord"); }
  /// Makes `s` wait (on the device) for the captured work.
  void make_wait(cudaStream_t s) const { check(cudaStreamWaitEvent(s, handle_, 0), "cudaStreamWaitEvent"); }
  /// True once the captured work is done; throws ddp::cuda_error if it failed.
  [[nodiscard]] bool query() const {
    const cudaError_t code = cudaEventQuery(handle_);
    if (code == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    check(code, "cudaEventQuery");
    return true;
  }
  /// Blocks the host until the captured work is done.
  void synchronize() const { check(cudaEventSynchronize(handle_), "cudaEventSynchronize"); }
  /// Milliseconds between two recorded events created with timing (flags = cudaEventDefault).
  [[nodiscard]] static float elapsed_ms(const event& start, const event& stop) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.handle_, stop.handle_), "cudaEventElapsedTime");
    return ms;
  }

 private:
  void reset() noexcept {
    if (handle_ != nullptr) (void)cudaEventDestroy(handle_);
    handle_ = nullptr;
  }
  cudaEvent_t handle_ = nullptr;
};

}  // namespace ddp::cuda
