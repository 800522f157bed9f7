#pragma once
/// \file The NCCL side of ddp::nccl::communicator: its settings, the records and staging of an operation, and the
/// group state every copy of a communicator shares (the ncclComm_t, its stream, abort on timeout or error).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <ddp/comm/front_end.hpp>
#include <ddp/comm/nccl/error.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/cuda/buffer.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::nccl {

/// Settings of an NCCL communicator, shared by the groups split from it.
struct config {
  /// How long initialization, an enqueue or an operation may take before the communicator is aborted.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// The CUDA device of this rank; -1 takes the current device (from_env(): LOCAL_RANK modulo the device count).
  int device = -1;
  /// The stream whose queued work each operation waits for (nullptr: the legacy default stream).
  cudaStream_t compute_stream = nullptr;
  /// How long a wait polls back to back (yielding the core) before it starts sleeping.
  std::chrono::microseconds spin{std::chrono::milliseconds(2)};
  /// The longest sleep between two polls once spinning is over.
  std::chrono::microseconds max_sleep{100};
};

namespace detail {

using clock = std::chrono::steady_clock;

/// A host buffer argument on its way through pinned memory and a device scratch.
struct staging {
  std::size_t index = 0;                      ///< which argument
  raw_tensor host;                            ///< the caller's host buffer
  cuda::pinned_buffer<std::uint8_t> pinned;   ///< page-locked copy
  bool copy_in = false;                       ///< an input: copied to the device before the operation
  bool copy_back = false;                     ///< an output: copied to `host` on completion
};

/// What an operation leaves behind until it completes: its argument pointers, staging and completion event.
struct record {
  explicit record(std::size_t arguments) : pointers(arguments, nullptr) {}
  std::vector<void*> pointers;   ///< the device pointer of each argument once started
  std::vector<staging> staged;   ///< the host arguments
  cuda::event done;              ///< recorded on the communicator's stream after the operation
  std::atomic<bool> started{false};
};

/// One argument of an operation: a buffer, read and/or written by it.
struct argument {
  raw_tensor buffer;
  bool read = false;
  bool written = false;
};

/// Polls `comm` until a non-blocking call that returned `r` has taken effect; on an error or past `timeout` the
/// communicator is aborted (`aborted` set) and ddp::nccl_error or ddp::timeout_error is thrown.
inline void await_ready(ncclComm_t comm, ncclResult_t r, std::string_view what, int rank,
                        std::chrono::milliseconds timeout, bool& aborted) {
  if (r == ncclSuccess) return;
  if (r != ncclInProgress) fail(r, what, rank, comm);
  const auto deadline = clock::now() + timeout;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t q = ncclCommGetAsyncError(comm, &state); q != ncclSuccess) fail(q, "ncclCommGetAsyncError", rank, comm);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      ncclCommAbort(comm);
      aborted = true;
      fail(state, std::string(what) + " (the communicator has been aborted)", rank, nullptr);
    }
    if (clock::now() >= deadline) {
      ncclCommAbort(comm);
      aborted = true;
      throw timeout_error(std::string(what) + " did not take effect within " + std::to_string(timeout.count()) +
                              " ms, so the NCCL communicator was aborted: a rank is missing, dead or stuck; check "
                              "every rank's log, or raise config::timeout",
                          rank);
    }
    std::this_thread::yield();
  }
}

/// A queued send or recv, started with the others at the next flush.
struct p2p_entry {
  bool send = false;
  int peer = 0;
  int tag = 0;
  raw_tensor buffer;
  std::shared_ptr<record> rec;
  cuda::event ready;  ///< the compute stream's work at posting time
  std::string what;
};

/// The state every copy of a communicator shares: the ncclComm_t, its stream, settings, front-end state, p2p queue.
class group {
 public:
  /// Joins the communicator `id` as `rank` of `size` (collective over the ranks holding `id`).
  group(const ncclUniqueId& id, int rank, int size, config settings)
      : cfg(settings), rank(rank), size(size), device(resolve(settings.device)), stream_(make_stream(device)),
        ready(make_event(device)) {
    const cuda::device_guard on(device);
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &c);
    if (r != ncclSuccess && r != ncclInProgress) fail(r, "ncclCommInitRankConfig", rank, nullptr);
    settle(r, "ncclCommInitRankConfig(rank " + std::to_string(rank) + " of " + std::to_string(size) + ")");
  }

  /// Adopts `c`, split from a parent on `parent_device` and ready (the caller awaited it).
  group(ncclComm_t c, config settings, int parent_device, int parent_rank)
      : cfg(settings), rank(parent_rank), device(parent_device), stream_(make_stream(device)), comm(c),
        ready(make_event(device)) {
    const cuda::device_guard on(device);
    call(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
    call(ncclCommCount(comm, &size), "ncclCommCount");
  }

  group(const group&) = delete;
  group& operator=(const group&) = delete;

  /// Flushes and destroys the communicator; one that cannot finalize within the timeout is aborted.
  ~group() {
    std::lock_guard lock(mutex);
    if (comm == nullptr || aborted) return;
    try {
      const cuda::device_guard on(device);
      settle(ncclCommFinalize(comm), "ncclCommFinalize");
      ncclCommDestroy(comm);
    } catch (const std::exception&) {  // a destructor reports nothing; abort frees what finalize could not
      if (!aborted) ncclCommAbort(comm);
    }
  }

  /// The stream operations run on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }

  /// Throws for an NCCL call that failed outright (ncclInProgress included: the caller settles those).
  void call(ncclResult_t r, std::string_view what) const {
    if (r != ncclSuccess && r != ncclInProgress) fail(r, what, rank, comm);
  }

  /// Waits (up to the timeout) until a non-blocking call that returned `r` has taken effect. Caller holds `mutex`.
  void settle(ncclResult_t r, std::string_view what) { await_ready(comm, r, what, rank, cfg.timeout, aborted); }

  /// ncclCommAbort once; later operations are refused. Caller holds `mutex`.
  void abort_locked() noexcept {
    if (aborted || comm == nullptr) return;
    ncclCommAbort(comm);
    aborted = true;
  }

  /// Throws when the communicator was aborted. Caller holds `mutex`.
  void alive_locked(std::string_view what) const {
    if (aborted)
      throw nccl_error(std::string(what) + ": this NCCL communicator was aborted after an earlier timeout or error; "
                           "create a new communicator (on every rank) to go on",
                       rank);
  }

  /// An asynchronous NCCL error (aborting the communicator), or nullptr. Takes `mutex`.
  std::exception_ptr health(const std::string& what) {
    std::lock_guard lock(mutex);
    if (aborted) {
      try {
        alive_locked(what);
      } catch (const nccl_error&) {
        return std::current_exception();
      }
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    const ncclResult_t bad = q != ncclSuccess ? q : state;
    if (bad == ncclSuccess || bad == ncclInProgress) return nullptr;
    abort_locked();
    try {
      fail(bad, what + " (the communicator has been aborted)", rank, nullptr);
    } catch (const nccl_error&) {
      return std::current_exception();
    }
  }

  config cfg;
  int rank = 0;
  int size = 1;
  int device = 0;

 private:
  static int resolve(int wanted) { return wanted >= 0 ? wanted : cuda::current_device(); }
  static cuda::stream make_stream(int device) {
    int least = 0, greatest = 0;  // communication gets the highest priority, so it overlaps compute promptly
    cuda::check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    return cuda::stream(device, cudaStreamNonBlocking, greatest);
  }
  static cuda::event make_event(int device) {
    const cuda::device_guard on(device);
    return cuda::event();
  }
  cuda::stream stream_;

 public:
  ncclComm_t comm = nullptr;
  std::mutex mutex;                     ///< serializes NCCL calls, the queue and abort
  bool aborted = false;
  cuda::event ready;                    ///< the compute stream's work before a collective (reused)
  std::vector<p2p_entry> queue;         ///< sends and recvs waiting for the next flush
  std::optional<cuda::device_buffer<std::int32_t>> barrier_word;
  ddp::detail::front_state front;       ///< statistics, sequence numbers and the call check of the front end
};

}  // namespace detail
}  // namespace ddp::nccl
