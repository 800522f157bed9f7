#pragma once
/// \file ddp::nccl::communicator: the ddp::communicator over NCCL, for buffers in CUDA device memory.
///
/// - Start-up: the ncclUniqueId travels from rank 0 through any other communicator (ddp::tcp, ddp::mpi) given to
///   the constructor, or through the TCP store with from_env(). The NCCL communicator is non-blocking, so
///   initialization, split and every enqueue are bounded by config::timeout.
/// - Streams: every operation runs on the communicator's own stream, ordered after the work queued so far on
///   config::compute_stream (default: the legacy default stream) through an event. ddp::work is backed by an
///   event recorded after the operation: done() is cudaEventQuery plus ncclCommGetAsyncError; wait() polls them.
///   An operation older than the timeout aborts the communicator (ncclCommAbort) and raises ddp::timeout_error;
///   an asynchronous NCCL error aborts it and raises ddp::nccl_error. An aborted communicator refuses new work.
/// - Buffers: device buffers (raw_tensor with device::cuda(N), device_buffer) must live on the communicator's
///   device and go to NCCL as they are. Host buffers (std::span, std::vector) are staged through pinned memory and
///   a stream-ordered device scratch, copied back when the work completes; this serves small host-side traffic
///   such as all_gather_object, not gradients.
/// - Reductions: bf16 and f16 natively; avg is ncclAvg (integers: the sum divided with truncation).
/// - gather, scatter and all_to_all are grouped ncclSend/ncclRecv. send and recv are queued and launched together
///   as one NCCL group when a send/recv work of this communicator is waited for or polled, so a rank may post its
///   recvs before its sends. Within one such group the messages between two ranks are matched by tag, then in
///   posting order: sender and receiver must post matching messages between the same two waits.
/// - stats() counts bytes as ddp::mpi does (algorithm-independent: all_reduce 2(N-1)/N·B, ...).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/checks.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/env.hpp>
#include <ddp/comm/nccl/error.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/core/dtype.hpp>
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
  std::vector<void*> pointers;   ///< the device pointer of each argument once launched
  std::vector<staging> staged;   ///< the host arguments
  cuda::event done;              ///< recorded on the communicator's stream after the operation
  std::atomic<bool> launched{false};
};

/// One argument of an operation: a buffer, read and/or written by it.
struct argument {
  raw_tensor buffer;
  bool read = false;
  bool written = false;
};

/// What an operation is, for messages: "all_reduce(sum) of 1024 f32 in an NCCL group of 4 on cuda:0 (sequence 17)".
struct op_info {
  collective kind = collective::barrier;
  const char* name = "barrier";
  std::optional<reduce_op> op;
  dtype type = dtype::u8;
  std::size_t count = 0;
  int peer = -1;  ///< root, or the other rank of a send/recv
  int tag = -1;
  std::uint64_t sequence = 0;
  int group_size = 1;
  int device = 0;

  [[nodiscard]] std::string describe() const {
    std::string s = name;
    if (op) s += "(" + std::string(to_string(*op)) + ")";
    if (kind != collective::barrier) s += " of " + std::to_string(count) + " " + std::string(to_string(type));
    if (kind == collective::send_recv)
      s += std::string(std::string_view(name) == "recv" ? " from rank " : " to rank ") + std::to_string(peer) +
           " tag " + std::to_string(tag);
    else if (peer >= 0)
      s += " rooted at rank " + std::to_string(peer);
    return s + " in an NCCL group of " + std::to_string(group_size) + " on cuda:" + std::to_string(device) +
           " (sequence " + std::to_string(sequence) + ")";
  }
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

/// A queued send or recv, launched with the others at the next flush.
struct p2p_entry {
  bool send = false;
  int peer = 0;
  int tag = 0;
  raw_tensor buffer;
  std::shared_ptr<record> rec;
  cuda::event ready;  ///< the compute stream's work at posting time
  std::string what;
};

/// The state every copy of a communicator shares: the ncclComm_t, its stream, settings, counters and p2p queue.
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
  ddp::detail::stats_counter stats;
  std::atomic<std::uint64_t> sequence{0};
};

/// Copies each staged host argument into a device scratch (stream-ordered) and fills `rec.pointers`.
inline void stage_in(group& g, record& rec) {
  for (auto& s : rec.staged) {
    const std::size_t bytes = s.host.bytes();
    if (bytes == 0) continue;
    void* scratch = nullptr;
    cuda::check(cudaMallocAsync(&scratch, bytes, g.stream()), "cudaMallocAsync of a staging buffer", g.rank);
    rec.pointers[s.index] = scratch;
    if (s.copy_in)
      cuda::check(cudaMemcpyAsync(scratch, s.pinned.data(), bytes, cudaMemcpyHostToDevice, g.stream()),
                  "cudaMemcpyAsync of a host buffer to its staging buffer", g.rank);
  }
}

/// Copies staged outputs back to pinned memory, frees the scratch and records completion.
inline void stage_out(group& g, record& rec) {
  for (auto& s : rec.staged) {
    const std::size_t bytes = s.host.bytes();
    if (bytes == 0) continue;
    void* scratch = rec.pointers[s.index];
    if (s.copy_back)
      cuda::check(cudaMemcpyAsync(s.pinned.data(), scratch, bytes, cudaMemcpyDeviceToHost, g.stream()),
                  "cudaMemcpyAsync of a staging buffer to the host", g.rank);
    cuda::check(cudaFreeAsync(scratch, g.stream()), "cudaFreeAsync of a staging buffer", g.rank);
  }
  rec.done.record(g.stream());
  rec.launched.store(true, std::memory_order_release);
}

/// Launches every queued send/recv as one NCCL group, tags ascending (stable). Caller holds g.mutex.
inline void flush_locked(group& g) {
  if (g.queue.empty()) return;
  std::vector<p2p_entry> entries = std::move(g.queue);
  g.queue.clear();
  std::stable_sort(entries.begin(), entries.end(), [](const p2p_entry& a, const p2p_entry& b) { return a.tag < b.tag; });
  g.alive_locked(entries.front().what);
  const cuda::device_guard on(g.device);
  for (auto& e : entries) {
    e.ready.make_wait(g.stream());
    stage_in(g, *e.rec);
  }
  g.call(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t first_error = ncclSuccess;
  std::string failed;
  for (auto& e : entries) {
    void* p = e.rec->pointers[0];
    const auto type = datatype(e.buffer.type);
    const ncclResult_t r = e.send ? ncclSend(p, e.buffer.size, type, e.peer, g.comm, g.stream())
                                  : ncclRecv(p, e.buffer.size, type, e.peer, g.comm, g.stream());
    if (r != ncclSuccess && r != ncclInProgress && first_error == ncclSuccess) {
      first_error = r;
      failed = e.what;
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  if (first_error != ncclSuccess) fail(first_error, failed, g.rank, g.comm);
  g.settle(end, "the NCCL group of " + std::to_string(entries.size()) + " queued send/recv (first: " +
                    entries.front().what + ")");
  for (auto& e : entries) stage_out(g, *e.rec);
}

/// One operation's completion: its event, its host copy-back, the communicator's health and the timeout.
class op_state final : public ddp::detail::work_state {
 public:
  op_state(std::shared_ptr<group> g, op_info info, std::shared_ptr<record> rec)
      : group_(std::move(g)), info_(info), rec_(std::move(rec)), started_(clock::now()) {}

  bool test() override {
    std::lock_guard lock(mutex_);
    return poll();
  }

  bool wait_until(clock::time_point deadline) override {
    const auto start = clock::now();
    std::chrono::microseconds pause{1};
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (poll()) return true;
      }
      const auto now = clock::now();
      if (now >= deadline) return false;
      if (now - start < group_->cfg.spin) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::min<clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, group_->cfg.max_sleep);
    }
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const override { return group_->cfg.timeout; }
  [[nodiscard]] int rank() const override { return group_->rank; }
  [[nodiscard]] std::string describe() const override { return info_.describe(); }

 private:
  /// One look at the operation; the caller holds mutex_.
  bool poll() {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    try {
      if (!rec_->launched.load(std::memory_order_acquire)) {
        std::lock_guard lock(group_->mutex);
        flush_locked(*group_);
      }
      if (rec_->done.query()) {
        for (auto& s : rec_->staged)
          if (s.copy_back && s.host.bytes() != 0) std::memcpy(s.host.data, s.pinned.data(), s.host.bytes());
        rec_.reset();
        done_ = true;
        return true;
      }
      if (auto e = group_->health(describe())) std::rethrow_exception(e);
      if (clock::now() - started_ >= group_->cfg.timeout) {
        {
          std::lock_guard lock(group_->mutex);
          group_->abort_locked();
        }
        throw timeout_error(describe() + " did not complete within " + std::to_string(group_->cfg.timeout.count()) +
                                " ms, so the NCCL communicator was aborted: a peer is stuck, dead or calling a "
                                "different collective; check every rank's log, or raise config::timeout",
                            group_->rank);
      }
    } catch (const error&) {
      error_ = std::current_exception();
      throw;
    }
    return false;
  }

  std::shared_ptr<group> group_;
  op_info info_;
  std::shared_ptr<record> rec_;
  clock::time_point started_;
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace detail

/// A group of CUDA devices (one per rank) modelling ddp::communicator over NCCL. Copies share the group; the last
/// copy finalizes and destroys the NCCL communicator.
class communicator : public ddp::detail::object_collectives<communicator> {
 public:
  /// Collective over `bootstrap`'s ranks: rank 0 creates the ncclUniqueId, `bootstrap` broadcasts it, and each rank
  /// joins with its bootstrap rank on config::device. `bootstrap` may be dropped afterwards.
  template <class Bootstrap>
    requires(!std::same_as<std::remove_cvref_t<Bootstrap>, communicator>) && ddp::communicator<std::remove_cvref_t<Bootstrap>>
  explicit communicator(Bootstrap& bootstrap, config settings = {}) {
    ncclUniqueId id{};
    if (bootstrap.rank() == 0)
      if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) detail::fail(r, "ncclGetUniqueId", 0);
    std::array<std::uint8_t, sizeof(ncclUniqueId)> bytes{};
    std::memcpy(bytes.data(), &id, sizeof id);
    bootstrap.broadcast(std::span<std::uint8_t>(bytes), 0).wait();
    std::memcpy(&id, bytes.data(), sizeof id);
    group_ = std::make_shared<detail::group>(id, bootstrap.rank(), bootstrap.size(), settings);
  }

  /// Joins the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun and
  /// ddp-launch set them): the id travels over ddp::tcp's store; the device is config::device, else LOCAL_RANK
  /// modulo the number of visible devices.
  static communicator from_env(config settings = {}) {
    if (settings.device < 0) settings.device = read_env_config().local_rank % cuda::device_count();
    auto bootstrap = tcp::communicator::from_env();
    return communicator(bootstrap, settings);
  }

  /// This rank in the group.
  [[nodiscard]] int rank() const noexcept { return group_->rank; }
  /// Number of ranks in the group.
  [[nodiscard]] int size() const noexcept { return group_->size; }
  /// The CUDA device this rank's buffers must live on.
  [[nodiscard]] int device() const noexcept { return group_->device; }
  /// The NCCL communicator.
  [[nodiscard]] ncclComm_t native_handle() const noexcept { return group_->comm; }
  /// The stream operations run on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return group_->stream(); }
  /// The settings this group runs with.
  [[nodiscard]] const config& settings() const noexcept { return group_->cfg; }
  /// Bytes sent and operations started so far.
  [[nodiscard]] comm_stats stats() const noexcept { return group_->stats.snapshot(); }

  /// Orders later operations (of every copy of this group) after the work queued on `s`.
  void set_compute_stream(cudaStream_t s) {
    std::lock_guard lock(group_->mutex);
    group_->cfg.compute_stream = s;
  }

  /// Collective: ranks with the same color (≥ 0) form a new group (ncclCommSplit), ordered by key, then by rank.
  [[nodiscard]] communicator split(int color, int key) const {
    if (color < 0)
      throw error("split: color " + std::to_string(color) + " is negative; pass a color >= 0 on every rank", rank());
    const std::string what = "ncclCommSplit(color " + std::to_string(color) + ", key " + std::to_string(key) + ")";
    std::lock_guard lock(group_->mutex);
    group_->alive_locked(what);
    const cuda::device_guard on(group_->device);
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = 0;
    ncclComm_t out = nullptr;
    const ncclResult_t r = ncclCommSplit(group_->comm, color, key, &out, &c);
    group_->call(r, what);
    group_->settle(ncclInProgress, what);  // the parent finishes its part, then the new communicator its own
    if (out == nullptr)
      throw nccl_error(what + " returned no communicator; call split the same number of times on every rank", rank());
    bool child_aborted = false;
    detail::await_ready(out, ncclInProgress, what, rank(), group_->cfg.timeout, child_aborted);
    return communicator(std::make_shared<detail::group>(out, group_->cfg, group_->device, group_->rank));
  }

  /// Reduces `buffer` in place across the group.
  template <tensor T>
  work all_reduce(T&& buffer, reduce_op op = reduce_op::sum) {
    const raw_tensor b = as_raw(buffer);
    const auto info = start(collective::all_reduce, "all_reduce", op, b, -1);
    return launch(info, share(b.bytes(), 2), {{b, true, true}}, [&](const std::vector<void*>& p) {
      return ncclAllReduce(p[0], p[0], b.size, detail::datatype(b.type), detail::reduction(op), group_->comm,
                           group_->stream());
    });
  }

  /// Reduces N·k input elements and leaves block rank() (k elements) in `output`.
  template <tensor In, tensor Out>
  work reduce_scatter(In&& input, Out&& output, reduce_op op = reduce_op::sum) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    const auto info = start(collective::reduce_scatter, "reduce_scatter", op, out, -1);
    same_type(info, in, out);
    blocks(info, in.size, out.size, "input", "output");
    in_place_only(info, in, out, out, static_cast<std::size_t>(rank()) * out.bytes());
    return launch(info, share(in.bytes(), 1), {{in, true, false}, {out, false, true}}, [&](const std::vector<void*>& p) {
      return ncclReduceScatter(p[0], p[1], out.size, detail::datatype(out.type), detail::reduction(op), group_->comm,
                               group_->stream());
    });
  }

  /// Gathers k elements from every rank into N·k elements, rank r's at block r.
  template <tensor In, tensor Out>
  work all_gather(In&& input, Out&& output) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    const auto info = start(collective::all_gather, "all_gather", std::nullopt, in, -1);
    same_type(info, in, out);
    blocks(info, out.size, in.size, "output", "input");
    in_place_only(info, out, in, in, static_cast<std::size_t>(rank()) * in.bytes());
    return launch(info, static_cast<std::uint64_t>(size() - 1) * in.bytes(), {{in, true, false}, {out, false, true}},
                  [&](const std::vector<void*>& p) {
                    return ncclAllGather(p[0], p[1], in.size, detail::datatype(in.type), group_->comm,
                                         group_->stream());
                  });
  }

  /// Copies root's `buffer` to every rank.
  template <tensor T>
  work broadcast(T&& buffer, int root = 0) {
    const raw_tensor b = as_raw(buffer);
    const auto info = start(collective::broadcast, "broadcast", std::nullopt, b, root);
    check_rank(info, root, "root");
    const bool at_root = rank() == root;
    return launch(info, at_root && size() > 1 ? b.bytes() : 0, {{b, at_root, !at_root}},
                  [&](const std::vector<void*>& p) {
                    return ncclBroadcast(p[0], p[0], b.size, detail::datatype(b.type), root, group_->comm,
                                         group_->stream());
                  });
  }

  /// Reduces `buffer` onto root, in place there; other ranks' buffers are left as they were.
  template <tensor T>
  work reduce(T&& buffer, reduce_op op = reduce_op::sum, int root = 0) {
    const raw_tensor b = as_raw(buffer);
    const auto info = start(collective::reduce, "reduce", op, b, root);
    check_rank(info, root, "root");
    const bool at_root = rank() == root;
    return launch(info, at_root ? 0 : b.bytes(), {{b, true, at_root}}, [&](const std::vector<void*>& p) {
      return ncclReduce(p[0], p[0], b.size, detail::datatype(b.type), detail::reduction(op), root, group_->comm,
                        group_->stream());
    });
  }

  /// Gathers k elements from every rank into root's N·k-element `output` (unused on other ranks).
  template <tensor In, tensor Out>
  work gather(In&& input, Out&& output, int root = 0) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    const auto info = start(collective::gather, "gather", std::nullopt, in, root);
    check_rank(info, root, "root");
    const bool at_root = rank() == root;
    if (!at_root) {
      return launch(info, in.bytes(), {{in, true, false}}, [&](const std::vector<void*>& p) {
        return ncclSend(p[0], in.size, detail::datatype(in.type), root, group_->comm, group_->stream());
      });
    }
    same_type(info, in, out);
    blocks(info, out.size, in.size, "output", "input");
    disjoint(info, in, out);
    return launch(info, 0, {{in, true, false}, {out, false, true}}, [&](const std::vector<void*>& p) {
      return grouped([&] {
        const auto type = detail::datatype(in.type);
        for (int r = 0; r < size(); ++r)
          if (const ncclResult_t e = ncclRecv(block(p[1], out, r, in.size), in.size, type, r, group_->comm,
                                              group_->stream());
              e != ncclSuccess && e != ncclInProgress)
            return e;
        return ncclSend(p[0], in.size, type, root, group_->comm, group_->stream());
      });
    });
  }

  /// Sends block r of root's N·k-element `input` (unused on other ranks) to rank r's k-element `output`.
  template <tensor In, tensor Out>
  work scatter(In&& input, Out&& output, int root = 0) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    const auto info = start(collective::scatter, "scatter", std::nullopt, out, root);
    check_rank(info, root, "root");
    const bool at_root = rank() == root;
    if (!at_root) {
      return launch(info, 0, {{out, false, true}}, [&](const std::vector<void*>& p) {
        return ncclRecv(p[0], out.size, detail::datatype(out.type), root, group_->comm, group_->stream());
      });
    }
    same_type(info, in, out);
    blocks(info, in.size, out.size, "input", "output");
    disjoint(info, in, out);
    return launch(info, share(in.bytes(), 1), {{in, true, false}, {out, false, true}}, [&](const std::vector<void*>& p) {
      return grouped([&] {
        const auto type = detail::datatype(out.type);
        for (int r = 0; r < size(); ++r)
          if (const ncclResult_t e = ncclSend(block(p[0], in, r, out.size), out.size, type, r, group_->comm,
                                              group_->stream());
              e != ncclSuccess && e != ncclInProgress)
            return e;
        return ncclRecv(p[1], out.size, type, root, group_->comm, group_->stream());
      });
    });
  }

  /// Sends block i of the N·k-element `input` to rank i; block j of `output` comes from rank j.
  template <tensor In, tensor Out>
  work all_to_all(In&& input, Out&& output) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    const auto info = start(collective::all_to_all, "all_to_all", std::nullopt, in, -1);
    same_type(info, in, out);
    if (in.size != out.size || in.size % static_cast<std::size_t>(size()) != 0)
      fail(info, "input has " + std::to_string(in.size) + " elements and output " + std::to_string(out.size) +
                     "; both must hold the same multiple of size()=" + std::to_string(size()));
    disjoint(info, in, out);
    const std::size_t k = in.size / static_cast<std::size_t>(size());
    return launch(info, share(in.bytes(), 1), {{in, true, false}, {out, false, true}}, [&](const std::vector<void*>& p) {
      return grouped([&] {
        const auto type = detail::datatype(in.type);
        for (int r = 0; r < size(); ++r) {
          if (const ncclResult_t e = ncclSend(block(p[0], in, r, k), k, type, r, group_->comm, group_->stream());
              e != ncclSuccess && e != ncclInProgress)
            return e;
          if (const ncclResult_t e = ncclRecv(block(p[1], out, r, k), k, type, r, group_->comm, group_->stream());
              e != ncclSuccess && e != ncclInProgress)
            return e;
        }
        return ncclSuccess;
      });
    });
  }

  /// Completes once every rank of the group has entered the barrier (an all_reduce of one device word).
  work barrier() {
    const auto info = start(collective::barrier, "barrier", std::nullopt, raw_tensor{}, -1);
    {
      std::lock_guard lock(group_->mutex);
      if (!group_->barrier_word) group_->barrier_word.emplace(1, group_->device);
    }
    const raw_tensor word = group_->barrier_word->raw();
    return launch(info, 0, {{word, false, false}}, [&](const std::vector<void*>& p) {
      return ncclAllReduce(p[0], p[0], 1, ncclInt32, ncclSum, group_->comm, group_->stream());
    });
  }

  /// Queues `buffer` for rank `peer`; launched with the other queued send/recv when one of them is waited for.
  template <tensor T>
  work send(T&& buffer, int peer, int tag = 0) {
    return post_p2p(true, as_raw(buffer), peer, tag);
  }

  /// Queues a receive of what rank `peer` sends with `tag`; the sizes must match the send's.
  template <tensor T>
  work recv(T&& buffer, int peer, int tag = 0) {
    return post_p2p(false, as_raw(buffer), peer, tag);
  }

 private:
  explicit communicator(std::shared_ptr<detail::group> g) : group_(std::move(g)) {}

  detail::op_info start(collective kind, const char* name, std::optional<reduce_op> op, const raw_tensor& b, int peer,
                        int tag = -1) const {
    return {kind,           name, op, b.type, b.size, peer, tag, group_->sequence.fetch_add(1, std::memory_order_relaxed),
            group_->size, group_->device};
  }

  [[noreturn]] void fail(const detail::op_info& info, const std::string& what) const {
    throw error(info.describe() + ": " + what, rank());
  }

  /// Runs `calls` between ncclGroupStart and ncclGroupEnd; the first failure wins.
  template <class Calls>
  static ncclResult_t grouped(Calls&& calls) {
    if (const ncclResult_t s = ncclGroupStart(); s != ncclSuccess) return s;
    const ncclResult_t body = calls();
    const ncclResult_t end = ncclGroupEnd();
    return body != ncclSuccess && body != ncclInProgress ? body : end;
  }

  /// Element `block·k` of the device pointer `base` holding `t`'s dtype.
  static void* block(void* base, const raw_tensor& t, int index, std::size_t k) {
    return static_cast<std::byte*>(base) + static_cast<std::size_t>(index) * k * size_of(t.type);
  }

  /// Prepares the arguments, orders the operation after the compute stream, issues `body` and records completion.
  template <class Body>
  work launch(const detail::op_info& info, std::uint64_t bytes_sent, std::initializer_list<detail::argument> args,
              Body&& body) {
    auto rec = prepare(info, args);
    detail::group& g = *group_;
    {
      std::lock_guard lock(g.mutex);
      g.alive_locked(info.describe());
      const cuda::device_guard on(g.device);
      g.ready.record(g.cfg.compute_stream);
      g.ready.make_wait(g.stream());
      detail::stage_in(g, *rec);
      g.settle(body(rec->pointers), info.describe());
      detail::stage_out(g, *rec);
    }
    g.stats.add_call(info.kind);
    g.stats.add_bytes(info.kind, bytes_sent);
    return work(std::make_shared<detail::op_state>(group_, info, std::move(rec)));
  }

  /// The record of an operation: device arguments checked and passed through, host arguments copied to pinned memory.
  std::shared_ptr<detail::record> prepare(const detail::op_info& info, std::initializer_list<detail::argument> args) {
    const cuda::device_guard on(group_->device);  // the completion event belongs to the communicator's device
    auto rec = std::make_shared<detail::record>(args.size());
    std::size_t index = 0;
    for (const auto& a : args) {
      if (a.buffer.where.is_cuda()) {
        if (a.buffer.where.index != group_->device)
          fail(info, "a buffer is on " + a.buffer.where.to_string() + " but this communicator works on cuda:" +
                         std::to_string(group_->device) + "; allocate it there or create the communicator with "
                         "config::device = " + std::to_string(a.buffer.where.index));
        rec->pointers[index] = a.buffer.data;
      } else if (a.read || a.written) {
        detail::staging s{index, a.buffer, cuda::pinned_buffer<std::uint8_t>(a.buffer.bytes()), a.read, a.written};
        if (a.read && a.buffer.bytes() != 0) std::memcpy(s.pinned.data(), a.buffer.data, a.buffer.bytes());
        rec->staged.push_back(std::move(s));
      }
      ++index;
    }
    return rec;
  }

  work post_p2p(bool is_send, const raw_tensor& b, int peer, int tag) {
    const auto info = start(collective::send_recv, is_send ? "send" : "recv", std::nullopt, b, peer, tag);
    check_rank(info, peer, "peer");
    if (tag < 0) fail(info, "tag " + std::to_string(tag) + " is negative; pass a tag >= 0");
    auto rec = prepare(info, {{b, is_send, !is_send}});
    detail::group& g = *group_;
    {
      std::lock_guard lock(g.mutex);
      g.alive_locked(info.describe());
      const cuda::device_guard on(g.device);
      cuda::event ready;
      ready.record(g.cfg.compute_stream);
      g.queue.push_back({is_send, peer, tag, b, rec, std::move(ready), info.describe()});
    }
    g.stats.add_call(collective::send_recv);
    g.stats.add_bytes(collective::send_recv, is_send ? b.bytes() : 0);
    return work(std::make_shared<detail::op_state>(group_, info, std::move(rec)));
  }

  /// (N-1)/N of `bytes`, times `factor`: what leaves a rank in a reduce-scatter (1) or all-reduce (2).
  [[nodiscard]] std::uint64_t share(std::size_t bytes, std::uint64_t factor) const noexcept {
    const auto n = static_cast<std::uint64_t>(size());
    return factor * static_cast<std::uint64_t>(bytes) * (n - 1) / n;
  }

  void same_type(const detail::op_info& info, const raw_tensor& a, const raw_tensor& b) const {
    if (auto problem = ddp::detail::dtype_problem(a, b); !problem.empty()) fail(info, problem);
  }

  void blocks(const detail::op_info& info, std::size_t whole, std::size_t part, const char* whole_name,
              const char* part_name) const {
    if (auto problem = ddp::detail::blocks_problem(whole, part, size(), whole_name, part_name); !problem.empty())
      fail(info, problem);
  }

  void check_rank(const detail::op_info& info, int r, const char* what) const {
    if (auto problem = ddp::detail::rank_problem(r, size(), what); !problem.empty()) fail(info, problem);
  }

  static bool overlap(const raw_tensor& a, const raw_tensor& b) noexcept {
    if (!a.where.is_cuda() || !b.where.is_cuda() || a.bytes() == 0 || b.bytes() == 0) return false;
    const auto* x = static_cast<const std::byte*>(a.data);
    const auto* y = static_cast<const std::byte*>(b.data);
    return x < y + b.bytes() && y < x + a.bytes();
  }

  void disjoint(const detail::op_info& info, const raw_tensor& in, const raw_tensor& out) const {
    if (overlap(in, out)) fail(info, "input and output overlap in device memory; pass separate buffers");
  }

  /// Device buffers `whole` and `part` may overlap only as NCCL's in-place form: `part` at byte `offset` of `whole`.
  void in_place_only(const detail::op_info& info, const raw_tensor& whole, const raw_tensor& part,
                     const raw_tensor& block_of, std::size_t offset) const {
    if (!overlap(whole, part)) return;
    if (static_cast<const std::byte*>(part.data) == static_cast<const std::byte*>(whole.data) + offset) return;
    fail(info, "input and output overlap in device memory other than in place (the " +
                   std::to_string(block_of.size) + "-element block of rank " + std::to_string(rank()) +
                   " inside the whole buffer); pass separate buffers or that exact block");
  }

  std::shared_ptr<detail::group> group_;
};

static_assert(ddp::communicator<communicator>,
              "ddp::nccl::communicator must model ddp::communicator; add the missing member the concept names.");

}  // namespace ddp::nccl

namespace ddp {
/// backend::nccl selects ddp::nccl::communicator.
template <>
struct backend_traits<backend::nccl> {
  using communicator = ddp::nccl::communicator;
};
}  // namespace ddp
