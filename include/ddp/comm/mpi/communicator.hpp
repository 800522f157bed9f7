#pragma once
/// \file ddp::mpi::communicator: the ddp::communicator over MPI (Open MPI). Collectives larger than
/// config::eager_bytes run asynchronously through MPI's non-blocking calls (MPI_Iallreduce,
/// MPI_Ireduce_scatter_block, ...); smaller ones run MPI's blocking call (MPI_Allreduce, ...), which Open MPI
/// completes faster, and return a completed ddp::work. Barrier, send and recv are always non-blocking.
///
/// Conventions:
/// - The collective front end (comm/front_end.hpp) checks the arguments, numbers and counts each operation and,
///   with DDP_CHECK_COLLECTIVES=1, compares each collective across the ranks first; this file only starts them.
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

#include <ddp/comm/mpi/request.hpp>  // first: it keeps MPI's C++ bindings out of <mpi.h>

#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <ddp/memory/average.hpp>
#include <ddp/comm/backend.hpp>
#include <ddp/comm/call.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/front_end.hpp>
#include <ddp/comm/mpi/datatypes.hpp>
#include <ddp/comm/mpi/group.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::mpi {

/// A group of MPI processes modelling ddp::communicator. Copies share the group; the last copy frees an
/// MPI_Comm this library created (split); an MPI_Comm it was given returns errors while any communicator wraps it,
/// and gets its own error handler back after the last one.
class communicator : public ddp::detail::collective_front<communicator> {
 public:
  using backend_tag = ddp::backend::mpi;  ///< the backend tag data_parallel deduces from this communicator
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
  [[nodiscard]] comm_stats stats() const noexcept { return group_->front.stats.snapshot(); }

  /// True when the MPI library reports CUDA support at run time (MPIX_Query_cuda_support).
  [[nodiscard]] static bool cuda_aware() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    return MPIX_Query_cuda_support() == 1;
#else
    return false;
#endif
  }
  /// A CUDA-aware MPI takes device memory itself; otherwise the front end stages device tensors through the host.
  [[nodiscard]] static bool moves_device_memory() noexcept { return cuda_aware(); }

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

  /// True when a collective on `bytes` runs MPI's blocking call and completes on start (config::eager_bytes).
  /// `bytes` is the buffer of all_reduce, broadcast and reduce, and the N·k-element side of reduce_scatter,
  /// all_gather, gather, scatter and all_to_all: the same on every rank, so every rank makes the same choice.
  [[nodiscard]] bool eager(std::size_t bytes) const noexcept { return bytes <= group_->cfg.eager_bytes; }

  /// The largest tag send and recv accept (MPI_TAG_UB of this MPI).
  [[nodiscard]] int max_tag() const noexcept { return group_->max_tag; }

 private:
  friend class ddp::detail::collective_front<communicator>;
  using call = ddp::detail::call_info;

  /// The front end does every duty for MPI: sequence, statistics, avg (divided here on completion), call check.
  static constexpr ddp::detail::front_duties duties{.group = "an MPI group"};

  explicit communicator(std::shared_ptr<detail::group> g) : group_(std::move(g)) {}

  [[nodiscard]] ddp::detail::front_state& front() const noexcept { return group_->front; }
  [[nodiscard]] const std::shared_ptr<ddp::detail::flight_recorder>& flight() const noexcept { return group_->front.flight; }

  work start_all_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    device_check(c, b);
    const int n = count_of(c, b.size);
    return start({c, {}}, b.bytes(), MPI_Allreduce, MPI_Iallreduce, MPI_IN_PLACE, b.data, n, detail::datatype(b.type),
                  detail::reduction(op, b.type), group_->comm);
  }

  work start_reduce_scatter(const call& c, const raw_tensor& in, const raw_tensor& out, reduce_op op) {
    device_check(c, in);
    device_check(c, out);
    detail::operation o{c, {}};
    const void* src = unaliased(o, in, out);
    const int n = count_of(c, out.size);
    return start(std::move(o), in.bytes(), MPI_Reduce_scatter_block, MPI_Ireduce_scatter_block, src, out.data, n,
                  detail::datatype(out.type), detail::reduction(op, out.type), group_->comm);
  }

  work start_all_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    device_check(c, in);
    device_check(c, out);
    detail::operation o{c, {}};
    const void* src = unaliased(o, in, out);
    const int n = count_of(c, in.size);
    const MPI_Datatype t = detail::datatype(in.type);
    return start(std::move(o), out.bytes(), MPI_Allgather, MPI_Iallgather, src, n, t, out.data, n, t, group_->comm);
  }

  work start_broadcast(const call& c, const raw_tensor& b) {
    device_check(c, b);
    const int n = count_of(c, b.size);
    return start({c, {}}, b.bytes(), MPI_Bcast, MPI_Ibcast, b.data, n, detail::datatype(b.type), c.peer, group_->comm);
  }

  work start_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    device_check(c, b);
    const bool at_root = rank() == c.peer;
    const int n = count_of(c, b.size);
    return start({c, {}}, b.bytes(), MPI_Reduce, MPI_Ireduce, at_root ? MPI_IN_PLACE : b.data,
                  at_root ? b.data : nullptr, n, detail::datatype(b.type), detail::reduction(op, b.type), c.peer,
                  group_->comm);
  }

  work start_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    const bool at_root = rank() == c.peer;
    device_check(c, in);
    detail::operation o{c, {}};
    const void* src = in.data;
    if (at_root) {
      device_check(c, out);
      src = unaliased(o, in, out);
    }
    const int n = count_of(c, in.size);
    const MPI_Datatype t = detail::datatype(in.type);
    return start(std::move(o), group_bytes(in), MPI_Gather, MPI_Igather, src, n, t, at_root ? out.data : nullptr, n,
                  t, c.peer, group_->comm);
  }

  work start_scatter(const call& c, const raw_tensor& in, const raw_tensor& out) {
    const bool at_root = rank() == c.peer;
    device_check(c, out);
    detail::operation o{c, {}};
    const void* src = nullptr;
    if (at_root) {
      device_check(c, in);
      src = unaliased(o, in, out);
    }
    const int n = count_of(c, out.size);
    const MPI_Datatype t = detail::datatype(out.type);
    return start(std::move(o), group_bytes(out), MPI_Scatter, MPI_Iscatter, src, n, t, out.data, n, t, c.peer,
                  group_->comm);
  }

  work start_all_to_all(const call& c, const raw_tensor& in, const raw_tensor& out) {
    device_check(c, in);
    device_check(c, out);
    detail::operation o{c, {}};
    const void* src = unaliased(o, in, out);
    const int n = count_of(c, in.size / static_cast<std::size_t>(size()));
    const MPI_Datatype t = detail::datatype(in.type);
    return start(std::move(o), in.bytes(), MPI_Alltoall, MPI_Ialltoall, src, n, t, out.data, n, t, group_->comm);
  }

  /// Always non-blocking, so it can time out.
  work start_barrier(const call& c) { return post({c, {}}, MPI_Ibarrier, group_->comm); }

  work start_send(const call& c, const raw_tensor& b) {
    device_check(c, b);
    const int n = count_of(c, b.size);
    return post({c, {}}, MPI_Isend, b.data, n, detail::datatype(b.type), c.peer, c.tag, group_->comm);
  }

  /// A bigger message than `b` is an error (MPI_ERR_TRUNCATE).
  work start_recv(const call& c, const raw_tensor& b) {
    device_check(c, b);
    const int n = count_of(c, b.size);
    return post({c, {}}, MPI_Irecv, b.data, n, detail::datatype(b.type), c.peer, c.tag, group_->comm);
  }

  /// Runs a collective on `bytes` (see eager()): eagerly as `blocking(args...)`, returning a completed work that
  /// carries its error if it failed, or as `nonblocking(args..., &request)` through post().
  template <class Blocking, class Nonblocking, class... Args>
  work start(detail::operation&& o, std::size_t bytes, Blocking blocking, Nonblocking nonblocking,
              const Args&... args) {
    if (!eager(bytes)) return post(std::move(o), nonblocking, args...);
    if (const int code = blocking(args...); code != MPI_SUCCESS) return failed(o.info, code);
    if (o.info.average.size != 0) ddp::detail::divide(o.info.average, size());
    return work();
  }

  /// Posts the non-blocking MPI call `nonblocking(args..., &request)` and wraps the request into a work.
  template <class Nonblocking, class... Args>
  work post(detail::operation&& o, Nonblocking nonblocking, const Args&... args) {
    auto s = std::make_shared<detail::request_state>(group_, std::move(o));
    if (const int code = nonblocking(args..., &s->request); code != MPI_SUCCESS)
      detail::check(code, s->describe(), rank());
    s->keep_progress(detail::progress_of(*group_));
    return work(std::move(s));
  }

  /// A completed work that raises the ddp::mpi_error of an eager call that returned `code`.
  [[nodiscard]] work failed(const call& info, int code) const {
    const std::string what = ddp::detail::describe(info);
    auto state = std::make_shared<ddp::detail::completion>(rank(), group_->cfg.timeout, what);
    try {
      detail::check(code, what, rank());
    } catch (const mpi_error&) {
      state->fail(std::current_exception());
    }
    return work(std::move(state));
  }

  /// N times the bytes of the k-element `block`: the size of a gather or scatter, known on every rank.
  [[nodiscard]] std::size_t group_bytes(const raw_tensor& block) const noexcept {
    return block.bytes() * static_cast<std::size_t>(size());
  }

  int count_of(const call& c, std::size_t n) const {
    if (n > static_cast<std::size_t>(INT_MAX))
      fail(c, "MPI counts elements in an int; split the buffer into pieces of at most " + std::to_string(INT_MAX) +
                  " elements");
    return static_cast<int>(n);
  }

  /// Device memory reaches here only on a CUDA-aware MPI, and avg and bf16/f16 reductions compute on the host.
  void device_check(const call& c, const raw_tensor& b) const {
    if (!b.where.is_cuda()) return;
    if (c.op && (*c.op == reduce_op::avg || b.type == dtype::bf16 || b.type == dtype::f16))
      fail(c, "avg and bf16/f16 reductions are computed on the host and the buffer is on " + b.where.to_string() +
                  "; reduce with sum in f32/f64 and scale on the device, or use ddp::nccl");
  }

  /// The input pointer to hand MPI: `in` itself, or a copy kept in the operation when it overlaps `out`.
  const void* unaliased(detail::operation& o, const raw_tensor& in, const raw_tensor& out) const {
    const auto* a = static_cast<const std::byte*>(in.data);
    const auto* b = static_cast<const std::byte*>(out.data);
    if (in.bytes() == 0 || out.bytes() == 0 || a + in.bytes() <= b || b + out.bytes() <= a) return in.data;
    if (in.where.is_cuda())
      fail(o.info, "input and output overlap in device memory; pass separate buffers");
    o.scratch.assign(a, a + in.bytes());
    return o.scratch.data();
  }

  std::shared_ptr<detail::group> group_;
};

}  // namespace ddp::mpi

/// backend::mpi selects ddp::mpi::communicator (checked against the ddp::communicator concept there).
template <>
struct ddp::backend_traits<ddp::backend::mpi> : ddp::detail::backend_binding<ddp::mpi::communicator> {};
