#pragma once
/// \file CUDA runtime error checking: every failed call becomes a ddp::cuda_error.

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include <ddp/core/error.hpp>

namespace ddp::cuda {

namespace detail {
/// What to do about `code`, as a sentence fragment appended to the message.
inline std::string_view advice(cudaError_t code) noexcept {
  switch (code) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return "this process sees no usable CUDA device; run GPU code (ctest -L gpu) on a machine with a GPU and a "
             "driver at least as new as the CUDA runtime, and check CUDA_VISIBLE_DEVICES";
    case cudaErrorInvalidDevice:
      return "the device ordinal is not below cudaGetDeviceCount(); pick a device this process can see";
    case cudaErrorMemoryAllocation:
      return "the device is out of memory; free buffers, lower the batch size or the bucket size";
    default:
      return "check the call's arguments; rerun with CUDA_LAUNCH_BLOCKING=1 under compute-sanitizer to find the "
             "failing kernel";
  }
}
}  // namespace detail

/// Throws ddp::cuda_error (native_code() = the cudaError_t) naming `what` and the fix when `code` is not cudaSuccess.
inline void check(cudaError_t code, std::string_view what, int rank = -1) {
  if (code == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  throw cuda_error(std::string(what) + " failed with " + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) +
                       "); " + std::string(detail::advice(code)),
                   rank, static_cast<int>(code));
}

/// Throws ddp::cuda_error when the last kernel start failed (call right after a <<<...>>> start).
inline void check_kernel(std::string_view kernel, int rank = -1) {
  check(cudaGetLastError(), std::string("start of kernel ") + std::string(kernel), rank);
}

}  // namespace ddp::cuda
