#pragma once
/// \file CUDA runtime handles as RAII types (the current-device guard, streams, events) and the launch shape of the
/// element kernels.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
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

/// Streaming multiprocessors of the current device (looked up once per device).
inline int multiprocessors() {
  constexpr int max_devices = 64;
  static int cached[max_devices] = {};
  const int device = current_device();
  int& sms = cached[device % max_devices];
  if (sms == 0) check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return sms;
}

/// Threads of every block the element kernels start.
constexpr unsigned threads_per_block = 256;

/// Work items of a grid-stride loop in packs of V: the full packs and the tail, or every element alone.
constexpr std::size_t launch_units(std::size_t n, int V, bool vector) noexcept { return vector ? n / V + n % V : n; }

/// Blocks of `threads` for a grid-stride loop over `units` pieces of work: enough to cover them, at most eight
/// per multiprocessor (a full device at 256 threads a block).
inline unsigned grid_blocks(std::size_t units, unsigned threads) {
  const std::size_t wanted = (units + threads - 1) / threads;
  return static_cast<unsigned>(std::min<std::size_t>(wanted, static_cast<std::size_t>(multiprocessors()) * 8));
}

/// True where `p` is 16-byte aligned, so kernels may move it in 16-byte packs.
inline bool aligned16(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

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
