#pragma once
/// \file ddp::mpi::communicator: the ddp::communicator over MPI (Open MPI). Collectives larger than
/// config::eager_bytes run asynchronously through MPI's non-blocking calls (MPI_Iallreduce,
/// MPI_Ireduce_scatter_block, ...); smaller ones run MPI's blocking call (MPI_Allreduce, ...), which Open MPI
/// completes faster, and return a completed ddp::work. Barrier, send and recv are always non-blocking.
///
/// Conventions:
/// - avg is an MPI sum followed by a division by size() on this rank once the operation completes;
///   integer dtypes use integer division (truncation toward zero), bf16/f16 divide in float.
/// - bf16 and f16 travel as user-defined 2-byte MPI datatypes; their sum/min/max/prod operators compute in
///   float and round each partial result back to the 2-byte type.
/// - stats() counts the payload bytes this rank must send in the algorithm-independent accounting (B is the
///   byte size of this rank's buffer argument, N = size()): all_reduce 2(N-1)/N·B, reduce_scatter (N-1)/N·B_in,
///   all_gather (N-1)·B_in, all_to_all (N-1)/N·B_in, broadcast B on the root, reduce and gather B on every
///   non-root, scatter (N-1)/N·B_in on the root, send B, recv and barrier 0.
/// - Device (CUDA) buffers go straight to MPI when it is CUDA-aware (MPIX_Query_cuda_support(), checked at run
///   time) for every operation except avg and bf16/f16 reductions, which compute on the host; otherwise a device
///   buffer raises ddp::error (host staging comes with the CUDA backend).

#include <ddp/comm/mpi/datatypes.hpp>  // first: it keeps MPI's C++ bindings out of <mpi.h>

#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/checks.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::mpi {

/// Settings of an MPI communicator, shared by the groups split from it.
///
/// MPI moves a non-blocking operation forward only inside MPI calls, so a wait polls MPI_Test: back to back for
/// `spin` (as MPI_Wait does, so short operations see MPI's own latency; Open MPI's progress loop yields the core
/// by itself on a host running more ranks than cores), then sleeping between polls, the sleeps growing from
/// 1 µs to `max_sleep`, so that a long operation neither burns a core nor stalls for long.
///
/// Open MPI's non-blocking collectives (libnbc) are slower than its blocking ones (coll/tuned) on small
/// buffers: a collective of at most `eager_bytes` (see communicator::eager) therefore runs MPI's blocking call
/// inside the ddp call and returns a completed work. Such a call cannot time out (a stuck peer blocks it) and
/// overlaps nothing; 0 makes every collective non-blocking.
struct config {
  /// How long wait() waits before it raises ddp::timeout_error.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// How long a wait polls back to back before it starts sleeping between polls.
  std::chrono::microseconds spin{std::chrono::milliseconds(5)};
  /// The longest sleep between two polls after that.
  std::chrono::microseconds max_sleep{50};
  /// Collectives on at most this many bytes run blocking and complete on launch; must be equal on every rank.
  std::size_t eager_bytes{std::size_t{256} << 10};
};

namespace detail {

/// True once MPI_Finalize has run (handles must not be touched any more).
inline bool finalized() noexcept {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

/// Initializes MPI once (MPI_THREAD_MULTIPLE) and finalizes it at exit if this library initialized it.
/// Before MPI_Init it selects libnbc's Rabenseifner all-reduce (reduce-scatter then all-gather) unless
/// OMPI_MCA_coll_libnbc_iallreduce_algorithm is set: Open MPI 4.1 otherwise runs in-place MPI_Iallreduce as a
/// binomial reduce + broadcast, up to twice as slow as blocking MPI_Allreduce on large buffers.
class runtime {
 public:
  /// Makes sure MPI is initialized; argc/argv may be null.
  static void ensure(int* argc, char*** argv) { static const runtime instance(argc, argv); }
  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;
  ~runtime() {
    if (owned_ && !finalized()) MPI_Finalize();
  }

 private:
  runtime(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized != 0) return;  // the application owns MPI; it finalizes it too
    ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", /*overwrite=*/0);
    int provided = 0;
    check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread", -1);
    owned_ = true;
  }
  bool owned_ = false;
};

/// Keeps MPI_ERRORS_RETURN on a communicator ddp does not own while any wrapper of it lives, then restores the
/// handler it had before the first one; wrappers are counted, so the order they go away in does not matter.
class borrowed_error_handlers {
 public:
  static void acquire(MPI_Comm comm, int rank) {
    std::lock_guard lock(mutex());
    entry& e = entries()[comm];
    if (e.users == 0) {
      check(MPI_Comm_get_errhandler(comm, &e.previous), "MPI_Comm_get_errhandler", rank);
      check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
    }
    ++e.users;
  }
  static void release(MPI_Comm comm) {
    std::lock_guard lock(mutex());
    const auto it = entries().find(comm);
    if (it == entries().end() || --it->second.users > 0) return;
    MPI_Comm_set_errhandler(comm, it->second.previous);
    MPI_Errhandler_free(&it->second.previous);
    entries().erase(it);
  }

 private:
  struct entry {
    int users = 0;
    MPI_Errhandler previous = MPI_ERRHANDLER_NULL;
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<MPI_Comm, entry>& entries() {
    static std::map<MPI_Comm, entry> e;
    return e;
  }
};

/// The state every copy of a communicator shares: the MPI_Comm, its settings and its counters.
struct group {
  group(MPI_Comm c, bool own, config settings) : comm(c), owned(own), cfg(settings) {
    check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", -1);
    check(MPI_Comm_size(comm, &size), "MPI_Comm_size", rank);
    void* value = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(comm, MPI_TAG_UB, &value, &found), "MPI_Comm_get_attr(MPI_TAG_UB)", rank);
    if (found != 0) max_tag = *static_cast<int*>(value);
    if (owned) check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
    else borrowed_error_handlers::acquire(comm, rank);
  }
  group(const group&) = delete;
  group& operator=(const group&) = delete;
  ~group() {
    if (finalized()) return;
    if (owned) MPI_Comm_free(&comm);
    else borrowed_error_handlers::release(comm);
  }

  MPI_Comm comm;
  bool owned;
  config cfg;
  int rank = 0;
  int size = 1;
  int max_tag = 32767;  // the MPI standard's guaranteed minimum of MPI_TAG_UB
  ddp::detail::stats_counter stats;
  std::atomic<std::uint64_t> sequence{0};
};

/// What an operation is, for messages: "all_reduce(sum) of 1024 f32 in an MPI group of 4 (sequence 17)".
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
  bool receive = false;  ///< a recv (cancelled when dropped incomplete)
};

/// The phrase naming an operation in messages.
inline std::string describe(const op_info& info) {
  std::string s = info.name;
  if (info.op) s += "(" + std::string(to_string(*info.op)) + ")";
  if (info.kind != collective::barrier)
    s += " of " + std::to_string(info.count) + " " + std::string(to_string(info.type));
  if (info.kind == collective::send_recv)
    s += (info.receive ? " from rank " : " to rank ") + std::to_string(info.peer) + " tag " + std::to_string(info.tag);
  else if (info.peer >= 0)
    s += " rooted at rank " + std::to_string(info.peer);
  return s + " in an MPI group of " + std::to_string(info.group_size) + " (sequence " + std::to_string(info.sequence) +
         ")";
}

/// One operation from its call to its completion: what it is, and what must happen or stay alive until then.
struct operation {
  op_info info;
  raw_tensor average;              ///< avg: divided by the group size on completion (empty otherwise)
  std::vector<std::byte> scratch;  ///< a copy of an input that overlaps the output, alive until done
};

/// Divides every element of `t` by `n`: integers truncate toward zero, bf16/f16 divide in float.
inline void divide(const raw_tensor& t, int n) {
  visit_dtype(t.type, [&](auto zero) {
    using T = decltype(zero);
    auto* p = static_cast<T*>(t.data);
    if constexpr (std::is_integral_v<T>) {
      for (std::size_t i = 0; i < t.size; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(n));
    } else if constexpr (std::is_floating_point_v<T>) {
      for (std::size_t i = 0; i < t.size; ++i) p[i] /= static_cast<T>(n);
    } else {
      for (std::size_t i = 0; i < t.size; ++i) p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
    }
  });
}

/// One in-flight MPI request; polled with MPI_Test.
class request_state final : public ddp::detail::work_state {
 public:
  request_state(std::shared_ptr<group> g, operation op) : group_(std::move(g)), op_(std::move(op)) {}
  request_state(const request_state&) = delete;
  request_state& operator=(const request_state&) = delete;

  /// Drops an incomplete operation: a recv is cancelled; anything else is waited for up to the timeout, since
  /// MPI cannot cancel collectives (past the timeout a send's request is freed and a collective's abandoned).
  ~request_state() override {
    if (done_ || request == MPI_REQUEST_NULL || finalized()) return;
    if (op_.info.receive) {
      MPI_Cancel(&request);
      MPI_Wait(&request, MPI_STATUS_IGNORE);
      return;
    }
    try {
      if (wait_until(clock::now() + group_->cfg.timeout)) return;
    } catch (const std::exception&) {  // a destructor reports nothing; the error was the caller's to wait for
      return;
    }
    if (op_.info.kind == collective::send_recv) MPI_Request_free(&request);
  }

  bool test() override {
    std::lock_guard lock(mutex_);
    return poll();
  }

  bool wait_until(clock::time_point deadline) override {
    if (test()) return true;  // the common case for short operations, before any clock reading
    const auto start = clock::now();
    std::chrono::microseconds pause{0};
    for (unsigned polls = 1;; ++polls) {
      if (test()) return true;
      if (pause.count() == 0 && polls % 64 != 0) continue;  // while spinning, read the clock every 64 polls
      const auto now = clock::now();
      if (now >= deadline) return false;
      if (now - start < group_->cfg.spin) continue;
      pause = std::clamp(pause * 2, std::chrono::microseconds(1), group_->cfg.max_sleep);
      std::this_thread::sleep_for(std::min<clock::duration>(pause, deadline - now));
    }
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const override { return group_->cfg.timeout; }
  [[nodiscard]] int rank() const override { return group_->rank; }
  [[nodiscard]] std::string describe() const override { return detail::describe(op_.info); }

  MPI_Request request = MPI_REQUEST_NULL;  ///< the MPI request to poll

 private:
  /// One MPI_Test; finishes avg on completion. The caller holds mutex_.
  bool poll() {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    int flag = 0;
    const int code = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      done_ = true;
      try {
        check(code, describe(), group_->rank);
      } catch (const mpi_error&) {
        error_ = std::current_exception();
      }
      std::rethrow_exception(error_);
    }
    if (flag == 0) return false;
    if (op_.average.size != 0) divide(op_.average, op_.info.group_size);
    op_.scratch = {};
    done_ = true;
    return true;
  }

  std::shared_ptr<group> group_;
  operation op_;
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace detail

/// A group of MPI processes modelling ddp::communicator. Copies share the group; the last copy frees an
/// MPI_Comm this library created (split); an MPI_Comm it was given returns errors while any communicator wraps it,
/// and gets its own error handler back after the last one.
class communicator : public ddp::detail::object_collectives<communicator> {
 public:
  /// MPI_COMM_WORLD, initializing MPI (MPI_THREAD_MULTIPLE) on first use and finalizing it at exit.
  static communicator world(int& argc, char**& argv, config settings = {}) {
    detail::runtime::ensure(&argc, &argv);
    return communicator(MPI_COMM_WORLD, settings);
  }
  /// MPI_COMM_WORLD, initializing MPI without the program's arguments.
  static communicator world(config settings = {}) {
    detail::runtime::ensure(nullptr, nullptr);
    return communicator(MPI_COMM_WORLD, settings);
  }
  /// Wraps an existing communicator without taking ownership: MPI must be initialized and `comm` must outlive
  /// every copy. Its error handler is MPI_ERRORS_RETURN while a copy lives, then restored.
  explicit communicator(MPI_Comm comm, config settings = {})
      : group_(std::make_shared<detail::group>(comm, false, settings)) {}

  /// This process's rank in the group.
  [[nodiscard]] int rank() const noexcept { return group_->rank; }
  /// Number of processes in the group.
  [[nodiscard]] int size() const noexcept { return group_->size; }
  /// The underlying MPI communicator.
  [[nodiscard]] MPI_Comm native_handle() const noexcept { return group_->comm; }
  /// The settings this group runs with.
  [[nodiscard]] const config& settings() const noexcept { return group_->cfg; }
  /// Bytes sent and operations started so far (see the file comment for the byte accounting).
  [[nodiscard]] comm_stats stats() const noexcept { return group_->stats.snapshot(); }

  /// True when the MPI library reports CUDA support at run time (MPIX_Query_cuda_support).
  [[nodiscard]] static bool cuda_aware() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    return MPIX_Query_cuda_support() == 1;
#else
    return false;
#endif
  }

  /// Collective: ranks with the same color (≥ 0) form a new group, ordered by key, then by rank here.
  [[nodiscard]] communicator split(int color, int key) const {
    if (color < 0)
      throw error("split: color " + std::to_string(color) + " is negative; pass a color >= 0 on every rank",
                  rank());
    MPI_Comm out = MPI_COMM_NULL;
    detail::check(MPI_Comm_split(group_->comm, color, key, &out),
                  "split(color " + std::to_string(color) + ", key " + std::to_string(key) + ")", rank());
    return communicator(std::make_shared<detail::group>(out, true, group_->cfg));
  }

  /// Reduces `buffer` in place across the group.
  template <tensor T>
  work all_reduce(T&& buffer, reduce_op op = reduce_op::sum) {
    const raw_tensor b = as_raw(buffer);
    auto o = start(collective::all_reduce, "all_reduce", op, b, -1);
    device_check(o, b, op);
    if (op == reduce_op::avg) o.average = b;
    const int n = count_of(o, b.size);
    return launch(std::move(o), share(b.bytes(), 2), b.bytes(), MPI_Allreduce, MPI_Iallreduce, MPI_IN_PLACE, b.data,
                  n, detail::datatype(b.type), detail::reduction(op, b.type), group_->comm);
  }

  /// Reduces N·k input elements and leaves block rank() (k elements) in `output`.
  template <tensor In, tensor Out>
  work reduce_scatter(In&& input, Out&& output, reduce_op op = reduce_op::sum) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    auto o = start(collective::reduce_scatter, "reduce_scatter", op, out, -1);
    same_type(o, in, out);
    blocks(o, in.size, out.size, "input", "output");
    device_check(o, in, op);
    device_check(o, out, op);
    if (op == reduce_op::avg) o.average = out;
    const void* src = unaliased(o, in, out);
    const int n = count_of(o, out.size);
    return launch(std::move(o), share(in.bytes(), 1), in.bytes(), MPI_Reduce_scatter_block, MPI_Ireduce_scatter_block,
                  src, out.data, n, detail::datatype(out.type), detail::reduction(op, out.type), group_->comm);
  }

  /// Gathers k elements from every rank into N·k elements, rank r's at block r.
  template <tensor In, tensor Out>
  work all_gather(In&& input, Out&& output) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    auto o = start(collective::all_gather, "all_gather", std::nullopt, in, -1);
    same_type(o, in, out);
    blocks(o, out.size, in.size, "output", "input");
    device_check(o, in, std::nullopt);
    device_check(o, out, std::nullopt);
    const void* src = unaliased(o, in, out);
    const int n = count_of(o, in.size);
    const MPI_Datatype t = detail::datatype(in.type);
    return launch(std::move(o), static_cast<std::uint64_t>(size() - 1) * in.bytes(), out.bytes(), MPI_Allgather,
                  MPI_Iallgather, src, n, t, out.data, n, t, group_->comm);
  }

  /// Copies root's `buffer` to every rank.
  template <tensor T>
  work broadcast(T&& buffer, int root = 0) {
    const raw_tensor b = as_raw(buffer);
    auto o = start(collective::broadcast, "broadcast", std::nullopt, b, root);
    check_rank(o, root, "root");
    device_check(o, b, std::nullopt);
    const int n = count_of(o, b.size);
    const std::uint64_t sent = rank() == root && size() > 1 ? b.bytes() : 0;
    return launch(std::move(o), sent, b.bytes(), MPI_Bcast, MPI_Ibcast, b.data, n, detail::datatype(b.type), root,
                  group_->comm);
  }

  /// Reduces `buffer` onto root, in place there; other ranks' buffers are left as they were.
  template <tensor T>
  work reduce(T&& buffer, reduce_op op = reduce_op::sum, int root = 0) {
    const raw_tensor b = as_raw(buffer);
    auto o = start(collective::reduce, "reduce", op, b, root);
    check_rank(o, root, "root");
    device_check(o, b, op);
    const bool at_root = rank() == root;
    if (op == reduce_op::avg && at_root) o.average = b;
    const int n = count_of(o, b.size);
    return launch(std::move(o), at_root ? 0 : b.bytes(), b.bytes(), MPI_Reduce, MPI_Ireduce,
                  at_root ? MPI_IN_PLACE : b.data, at_root ? b.data : nullptr, n, detail::datatype(b.type),
                  detail::reduction(op, b.type), root, group_->comm);
  }

  /// Gathers k elements from every rank into root's N·k-element `output` (unused on other ranks).
  template <tensor In, tensor Out>
  work gather(In&& input, Out&& output, int root = 0) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    auto o = start(collective::gather, "gather", std::nullopt, in, root);
    check_rank(o, root, "root");
    const bool at_root = rank() == root;
    device_check(o, in, std::nullopt);
    const void* src = in.data;
    if (at_root) {
      same_type(o, in, out);
      blocks(o, out.size, in.size, "output", "input");
      device_check(o, out, std::nullopt);
      src = unaliased(o, in, out);
    }
    const int n = count_of(o, in.size);
    const MPI_Datatype t = detail::datatype(in.type);
    return launch(std::move(o), at_root ? 0 : in.bytes(), group_bytes(in), MPI_Gather, MPI_Igather, src, n, t,
                  at_root ? out.data : nullptr, n, t, root, group_->comm);
  }

  /// Sends block r of root's N·k-element `input` (unused on other ranks) to rank r's k-element `output`.
  template <tensor In, tensor Out>
  work scatter(In&& input, Out&& output, int root = 0) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    auto o = start(collective::scatter, "scatter", std::nullopt, out, root);
    check_rank(o, root, "root");
    const bool at_root = rank() == root;
    device_check(o, out, std::nullopt);
    const void* src = nullptr;
    if (at_root) {
      same_type(o, in, out);
      blocks(o, in.size, out.size, "input", "output");
      device_check(o, in, std::nullopt);
      src = unaliased(o, in, out);
    }
    const int n = count_of(o, out.size);
    const MPI_Datatype t = detail::datatype(out.type);
    return launch(std::move(o), at_root ? share(in.bytes(), 1) : 0, group_bytes(out), MPI_Scatter, MPI_Iscatter, src,
                  n, t, out.data, n, t, root, group_->comm);
  }

  /// Sends block i of the N·k-element `input` to rank i; block j of `output` comes from rank j.
  template <tensor In, tensor Out>
  work all_to_all(In&& input, Out&& output) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    auto o = start(collective::all_to_all, "all_to_all", std::nullopt, in, -1);
    same_type(o, in, out);
    if (in.size != out.size || in.size % static_cast<std::size_t>(size()) != 0)
      fail(o, "input has " + std::to_string(in.size) + " elements and output " + std::to_string(out.size) +
                  "; both must hold the same multiple of size()=" + std::to_string(size()));
    device_check(o, in, std::nullopt);
    device_check(o, out, std::nullopt);
    const void* src = unaliased(o, in, out);
    const int n = count_of(o, in.size / static_cast<std::size_t>(size()));
    const MPI_Datatype t = detail::datatype(in.type);
    return launch(std::move(o), share(in.bytes(), 1), in.bytes(), MPI_Alltoall, MPI_Ialltoall, src, n, t, out.data, n,
                  t, group_->comm);
  }

  /// Completes once every rank of the group has entered the barrier; always non-blocking, so it can time out.
  work barrier() {
    auto o = start(collective::barrier, "barrier", std::nullopt, raw_tensor{}, -1);
    return post(std::move(o), 0, MPI_Ibarrier, group_->comm);
  }

  /// Sends `buffer` to rank `peer`; matched by the recv on `peer` with the same tag (0 ≤ tag ≤ MPI_TAG_UB).
  template <tensor T>
  work send(T&& buffer, int peer, int tag = 0) {
    const raw_tensor b = as_raw(buffer);
    auto o = start(collective::send_recv, "send", std::nullopt, b, peer, tag);
    point_to_point_check(o, b, peer, tag);
    const int n = count_of(o, b.size);
    return post(std::move(o), b.bytes(), MPI_Isend, b.data, n, detail::datatype(b.type), peer, tag, group_->comm);
  }

  /// Receives into `buffer` what rank `peer` sends with `tag`; a bigger message is an error (MPI_ERR_TRUNCATE).
  template <tensor T>
  work recv(T&& buffer, int peer, int tag = 0) {
    const raw_tensor b = as_raw(buffer);
    auto o = start(collective::send_recv, "recv", std::nullopt, b, peer, tag);
    o.info.receive = true;
    point_to_point_check(o, b, peer, tag);
    const int n = count_of(o, b.size);
    return post(std::move(o), 0, MPI_Irecv, b.data, n, detail::datatype(b.type), peer, tag, group_->comm);
  }

  /// True when a collective on `bytes` runs MPI's blocking call and completes on launch (config::eager_bytes).
  /// `bytes` is the buffer of all_reduce, broadcast and reduce, and the N·k-element side of reduce_scatter,
  /// all_gather, gather, scatter and all_to_all: the same on every rank, so every rank makes the same choice.
  [[nodiscard]] bool eager(std::size_t bytes) const noexcept { return bytes <= group_->cfg.eager_bytes; }

 private:
  explicit communicator(std::shared_ptr<detail::group> g) : group_(std::move(g)) {}

  detail::operation start(collective kind, const char* name, std::optional<reduce_op> op, const raw_tensor& b,
                          int peer, int tag = -1) {
    return {detail::op_info{kind, name, op, b.type, b.size, peer, tag,
                            group_->sequence.fetch_add(1, std::memory_order_relaxed), group_->size},
            {}, {}};
  }

  /// Runs a collective on `bytes` (see eager()): eagerly as `blocking(args...)`, returning a completed work that
  /// carries its error if it failed, or as `nonblocking(args..., &request)` through post().
  template <class Blocking, class Nonblocking, class... Args>
  work launch(detail::operation&& o, std::uint64_t bytes_sent, std::size_t bytes, Blocking blocking,
              Nonblocking nonblocking, const Args&... args) {
    if (!eager(bytes)) return post(std::move(o), bytes_sent, nonblocking, args...);
    count(o.info.kind, bytes_sent);
    if (const int code = blocking(args...); code != MPI_SUCCESS) return failed(o.info, code);
    if (o.average.size != 0) detail::divide(o.average, size());
    return work();
  }

  /// Posts the non-blocking MPI call `nonblocking(args..., &request)`, counts it and wraps the request into a work.
  template <class Nonblocking, class... Args>
  work post(detail::operation&& o, std::uint64_t bytes_sent, Nonblocking nonblocking, const Args&... args) {
    const collective kind = o.info.kind;
    auto s = std::make_shared<detail::request_state>(group_, std::move(o));
    if (const int code = nonblocking(args..., &s->request); code != MPI_SUCCESS)
      detail::check(code, s->describe(), rank());
    count(kind, bytes_sent);
    return work(std::move(s));
  }

  void count(collective kind, std::uint64_t bytes_sent) noexcept {
    group_->stats.add_call(kind);
    group_->stats.add_bytes(kind, bytes_sent);
  }

  /// A completed work that raises the ddp::mpi_error of an eager call that returned `code`.
  [[nodiscard]] work failed(const detail::op_info& info, int code) const {
    const std::string what = detail::describe(info);
    auto state = std::make_shared<ddp::detail::completion>(rank(), group_->cfg.timeout, what);
    try {
      detail::check(code, what, rank());
    } catch (const mpi_error&) {
      state->fail(std::current_exception());
    }
    return work(std::move(state));
  }

  /// (N-1)/N of `bytes`, times `factor`: what leaves a rank in a reduce-scatter (1) or all-reduce (2).
  [[nodiscard]] std::uint64_t share(std::size_t bytes, std::uint64_t factor) const noexcept {
    const auto n = static_cast<std::uint64_t>(size());
    return factor * static_cast<std::uint64_t>(bytes) * (n - 1) / n;
  }

  /// N times the bytes of the k-element `block`: the size of a gather or scatter, known on every rank.
  [[nodiscard]] std::size_t group_bytes(const raw_tensor& block) const noexcept {
    return block.bytes() * static_cast<std::size_t>(size());
  }

  [[noreturn]] void fail(const detail::operation& o, const std::string& what) const {
    throw error(detail::describe(o.info) + ": " + what, rank());
  }

  int count_of(const detail::operation& o, std::size_t n) const {
    if (n > static_cast<std::size_t>(INT_MAX))
      fail(o, "MPI counts elements in an int; split the buffer into pieces of at most " + std::to_string(INT_MAX) +
                  " elements");
    return static_cast<int>(n);
  }

  void same_type(const detail::operation& o, const raw_tensor& a, const raw_tensor& b) const {
    if (auto problem = ddp::detail::dtype_problem(a, b); !problem.empty()) fail(o, problem);
  }

  /// `whole` must hold size() blocks of `block` elements.
  void blocks(const detail::operation& o, std::size_t whole, std::size_t block, const char* whole_name,
              const char* block_name) const {
    if (auto problem = ddp::detail::blocks_problem(whole, block, size(), whole_name, block_name); !problem.empty())
      fail(o, problem);
  }

  void check_rank(const detail::operation& o, int r, const char* what) const {
    if (auto problem = ddp::detail::rank_problem(r, size(), what); !problem.empty()) fail(o, problem);
  }

  void point_to_point_check(const detail::operation& o, const raw_tensor& b, int peer, int tag) const {
    check_rank(o, peer, "peer");
    if (tag < 0 || tag > group_->max_tag)
      fail(o, "tag " + std::to_string(tag) + " is outside 0.." + std::to_string(group_->max_tag) +
                  " (MPI_TAG_UB of this MPI)");
    device_check(o, b, std::nullopt);
  }

  /// Device memory needs a CUDA-aware MPI, and avg and bf16/f16 reductions compute on the host.
  void device_check(const detail::operation& o, const raw_tensor& b, std::optional<reduce_op> op) const {
    if (!b.where.is_cuda()) return;
    if (!cuda_aware())
      fail(o, "the buffer is on " + b.where.to_string() +
                  " but this MPI is not CUDA-aware (MPIX_Query_cuda_support() is 0); use a CUDA-aware Open MPI, "
                  "copy the buffer to host memory, or use ddp::nccl for device buffers");
    if (op && (*op == reduce_op::avg || b.type == dtype::bf16 || b.type == dtype::f16))
      fail(o, "avg and bf16/f16 reductions are computed on the host and the buffer is on " + b.where.to_string() +
                  "; reduce with sum in f32/f64 and scale on the device, or use ddp::nccl");
  }

  /// The input pointer to hand MPI: `in` itself, or a copy kept in the operation when it overlaps `out`.
  const void* unaliased(detail::operation& o, const raw_tensor& in, const raw_tensor& out) const {
    const auto* a = static_cast<const std::byte*>(in.data);
    const auto* b = static_cast<const std::byte*>(out.data);
    if (in.bytes() == 0 || out.bytes() == 0 || a + in.bytes() <= b || b + out.bytes() <= a) return in.data;
    if (in.where.is_cuda())
      fail(o, "input and output overlap in device memory; pass separate buffers");
    o.scratch.assign(a, a + in.bytes());
    return o.scratch.data();
  }

  std::shared_ptr<detail::group> group_;
};

static_assert(ddp::communicator<communicator>,
              "ddp::mpi::communicator must model ddp::communicator; add the missing member the concept names.");

}  // namespace ddp::mpi

namespace ddp {
/// backend::mpi selects ddp::mpi::communicator.
template <>
struct backend_traits<backend::mpi> {
  using communicator = ddp::mpi::communicator;
};
}  // namespace ddp
