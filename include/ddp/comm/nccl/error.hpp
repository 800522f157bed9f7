#pragma once
/// \file NCCL error checking and the dtype/operator mapping of the NCCL backend.

#include <nccl.h>

#include <string>
#include <string_view>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>

namespace ddp::nccl::detail {

/// What to do about `code`, as a sentence fragment appended to the message.
inline std::string_view advice(ncclResult_t code) noexcept {
  switch (code) {
    case ncclSystemError:
    case ncclRemoteError:
      return "a peer died or the network failed; check every rank's log, and rerun with NCCL_DEBUG=INFO to see which "
             "connection broke";
    case ncclInvalidUsage:
      return "NCCL was used wrongly: ranks sharing one GPU need distinct NCCL_HOSTID values (see docs/gpu.md), every "
             "rank must call the same collectives in the same order, and buffers must live on the communicator's "
             "device; NCCL_DEBUG=WARN prints the detail";
    case ncclUnhandledCudaError:
      return "a CUDA call inside NCCL failed; check the device with nvidia-smi and rerun with NCCL_DEBUG=WARN";
    default:
      return "rerun with NCCL_DEBUG=WARN for NCCL's own explanation";
  }
}

/// Throws ddp::nccl_error (native_code() = the ncclResult_t) naming `what`, NCCL's text and the fix.
[[noreturn]] inline void fail(ncclResult_t code, std::string_view what, int rank, ncclComm_t comm = nullptr) {
  std::string text = std::string(what) + " failed: " + ncclGetErrorString(code);
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
  throw nccl_error(text + "; " + std::string(advice(code)), rank, static_cast<int>(code));
}

/// The NCCL type of `t`; every ddp dtype has one.
constexpr ncclDataType_t datatype(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::bf16: return ncclBfloat16;
    case dtype::f16: return ncclFloat16;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
  }
  return ncclUint8;
}

/// The NCCL operator of `op`; avg is a sum, which the communicator divides by the group size after (ncclAvg
/// pre-multiplies each rank's value, which rounds differently from the host backends' sum / N).
constexpr ncclRedOp_t reduction(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ncclSum;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::prod: return ncclProd;
  }
  return ncclSum;
}

}  // namespace ddp::nccl::detail
