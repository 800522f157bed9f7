#pragma once
/// \file Error hierarchy: every failure the library reports derives from ddp::error.

#include <stdexcept>
#include <string>
#include <utility>

namespace ddp {

/// Base of every exception the library throws; carries the reporting rank and the backend's native code.
class error : public std::runtime_error {
 public:
  /// Builds "ddp [rank R]: message"; rank < 0 means "not known yet".
  explicit error(std::string message, int rank = -1, int native_code = 0)
      : std::runtime_error(format(message, rank)), message_(std::move(message)), rank_(rank), code_(native_code) {}

  /// The rank that raised the error, or -1 when it is not known.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The backend's own error code (errno, MPI error class, ncclResult_t, cudaError_t), 0 when none.
  [[nodiscard]] int native_code() const noexcept { return code_; }
  /// The message without the rank prefix.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }

 private:
  static std::string format(const std::string& message, int rank) {
    return rank < 0 ? "ddp: " + message : "ddp [rank " + std::to_string(rank) + "]: " + message;
  }
  std::string message_;
  int rank_;
  int code_;
};

/// An operation did not complete within its deadline.
class timeout_error : public error {
 public:
  using error::error;
};

/// A peer closed its connection or died; peer() names it.
class peer_lost : public error {
 public:
  /// `peer` is the rank that went away, as seen from `rank`.
  peer_lost(std::string message, int rank, int peer, int native_code = 0)
      : error(std::move(message), rank, native_code), peer_(peer) {}
  /// The rank that was lost.
  [[nodiscard]] int peer() const noexcept { return peer_; }

 private:
  int peer_;
};

/// Ranks disagree: different collectives, models, shapes or dtypes.
class mismatch_error : public error {
 public:
  using error::error;
};

/// An MPI call failed; native_code() is the MPI error code.
class mpi_error : public error {
 public:
  using error::error;
};

/// An NCCL call failed; native_code() is the ncclResult_t.
class nccl_error : public error {
 public:
  using error::error;
};

/// A CUDA runtime call failed; native_code() is the cudaError_t.
class cuda_error : public error {
 public:
  using error::error;
};

/// The configuration (environment variables, arguments, files) is wrong.
class config_error : public error {
 public:
  using error::error;
};

/// A file (checkpoint, dataset) is missing, truncated or corrupt.
class io_error : public error {
 public:
  using error::error;
};

}  // namespace ddp
