#pragma once
/// \file ddp::nccl::communicator: the ddp::communicator over NCCL, for buffers in CUDA device memory.
///
/// - Start-up: the ncclUniqueId travels from rank 0 through any other communicator (ddp::tcp, ddp::mpi) given to
///   the constructor, or through ddp::tcp's rendezvous store with from_env() (<ddp/comm/nccl/from_env.hpp>). The NCCL
///   communicator is non-blocking, so
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
/// - Reductions: bf16 and f16 natively; avg is the sum divided by the group size on the communicator's stream
///   (ddp::cuda::divide), so it has the host backends' bits (integers truncate).
/// - gather, scatter and all_to_all are grouped ncclSend/ncclRecv. send and recv are queued and started together
///   as one NCCL group when a send/recv work of this communicator is waited for or polled, so a rank may post its
///   recvs before its sends. Within one such group the messages between two ranks are matched by tag, then in
///   posting order: sender and receiver must post matching messages between the same two waits.
/// - The collective front end (comm/front_end.hpp) checks the arguments, numbers and counts each operation (bytes
///   as ddp::mpi counts them: algorithm-independent, all_reduce 2(N-1)/N·B, ...) and, with DDP_CHECK_COLLECTIVES=1,
///   compares each collective across the ranks first; this file only starts them.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/call.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/front_end.hpp>
#include <ddp/comm/nccl/error.hpp>
#include <ddp/comm/nccl/group.hpp>
#include <ddp/comm/nccl/operation.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/cuda/buffer.hpp>
#include <ddp/cuda/element.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::nccl {

namespace detail {
/// from_env()'s way in: defined by <ddp/comm/nccl/from_env.hpp>, so only its users include ddp::tcp's store.
struct env_rendezvous;

/// A new ncclUniqueId: rank 0 makes it, the other ranks join with it.
inline ncclUniqueId new_unique_id() {
  ncclUniqueId id{};
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) fail(r, "ncclGetUniqueId", 0);
  return id;
}
}  // namespace detail

/// A group of CUDA devices (one per rank) modelling ddp::communicator over NCCL. Copies share the group; the last
/// copy finalizes and destroys the NCCL communicator.
class communicator : public ddp::detail::collective_front<communicator> {
 public:
  using backend_tag = ddp::backend::nccl;  ///< the backend tag data_parallel deduces from this communicator
  /// Collective over `bootstrap`'s ranks: rank 0 creates the ncclUniqueId, `bootstrap` broadcasts it, and each rank
  /// joins with its bootstrap rank on config::device. `bootstrap` may be dropped afterwards.
  template <class Bootstrap>
    requires(!std::same_as<std::remove_cvref_t<Bootstrap>, communicator>) && ddp::communicator<std::remove_cvref_t<Bootstrap>>
  explicit communicator(Bootstrap& bootstrap, config settings = {})
      : communicator(broadcast_id(bootstrap), bootstrap.rank(), bootstrap.size(), settings) {}

  /// Collective over `size` ranks that hold the same `id` (rank 0's ncclGetUniqueId, carried by the caller's own
  /// means): joins as `rank` on config::device (ncclCommInitRankConfig).
  communicator(const ncclUniqueId& id, int rank, int size, config settings = {})
      : group_(std::make_shared<detail::group>(id, rank, size, settings)) {}

  /// Joins the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun and
  /// ddp-launch set them): the id travels through ddp::tcp's rendezvous store alone (no mesh, no engine); the device
  /// is config::device, else LOCAL_RANK modulo the number of visible devices. Defined in
  /// <ddp/comm/nccl/from_env.hpp>, which brings the store's client and server along.
  template <class Rendezvous = detail::env_rendezvous>
  static communicator from_env(config settings = {}) {
    static_assert(requires { sizeof(Rendezvous); },
                  "ddp::nccl::communicator::from_env joins through ddp::tcp's rendezvous store: include "
                  "<ddp/comm/nccl/from_env.hpp> (or <ddp/ddp.hpp>), or pass a bootstrap communicator to the "
                  "constructor.");
    return Rendezvous::join(settings);
  }

  /// This rank in the group.
  [[nodiscard]] int rank() const noexcept { return group_->rank; }
  /// Number of ranks in the group.
  [[nodiscard]] int size() const noexcept { return group_->size; }
  /// NCCL moves device memory itself: the front end hands it device tensors as they are.
  [[nodiscard]] static constexpr bool moves_device_memory() noexcept { return true; }
  /// The CUDA device this rank's buffers must live on.
  [[nodiscard]] int device() const noexcept { return group_->device; }
  /// The NCCL communicator.
  [[nodiscard]] ncclComm_t native_handle() const noexcept { return group_->comm; }
  /// The stream operations run on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return group_->stream(); }
  /// The settings this group runs with.
  [[nodiscard]] const config& settings() const noexcept { return group_->cfg; }
  /// Bytes sent and operations started so far.
  [[nodiscard]] comm_stats stats() const noexcept { return group_->front.stats.snapshot(); }

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

 private:
  friend class ddp::detail::collective_front<communicator>;
  using call = ddp::detail::call_info;

  /// The front end numbers, counts and checks calls for NCCL, and runs avg as a sum that start() divides.
  static constexpr ddp::detail::front_duties duties{.group = "an NCCL group"};

  explicit communicator(std::shared_ptr<detail::group> g) : group_(std::move(g)) {}

  [[nodiscard]] ddp::detail::front_state& front() const noexcept { return group_->front; }
  [[nodiscard]] const std::shared_ptr<ddp::detail::flight_recorder>& flight() const noexcept { return group_->front.flight; }
  [[nodiscard]] static constexpr int max_tag() noexcept { return INT_MAX; }

  work start_all_reduce(const call& info, const raw_tensor& b, reduce_op op) {
    return start(info, {{b, true, true}}, [&](const std::vector<void*>& p) {
      return ncclAllReduce(p[0], p[0], b.size, detail::datatype(b.type), detail::reduction(op), group_->comm,
                           group_->stream());
    });
  }

  work start_reduce_scatter(const call& info, const raw_tensor& in, const raw_tensor& out, reduce_op op) {
    in_place_only(info, in, out, out, static_cast<std::size_t>(rank()) * out.bytes());
    return start(info, {{in, true, false}, {out, false, true}}, [&](const std::vector<void*>& p) {
      return ncclReduceScatter(p[0], p[1], out.size, detail::datatype(out.type), detail::reduction(op), group_->comm,
                               group_->stream());
    });
  }

  work start_all_gather(const call& info, const raw_tensor& in, const raw_tensor& out) {
    in_place_only(info, out, in, in, static_cast<std::size_t>(rank()) * in.bytes());
    return start(info, {{in, true, false}, {out, false, true}},
                  [&](const std::vector<void*>& p) {
                    return ncclAllGather(p[0], p[1], in.size, detail::datatype(in.type), group_->comm,
                                         group_->stream());
                  });
  }

  work start_broadcast(const call& info, const raw_tensor& b) {
    const int root = info.peer;
    const bool at_root = rank() == root;
    return start(info, {{b, at_root, !at_root}},
                  [&](const std::vector<void*>& p) {
                    return ncclBroadcast(p[0], p[0], b.size, detail::datatype(b.type), root, group_->comm,
                                         group_->stream());
                  });
  }

  work start_reduce(const call& info, const raw_tensor& b, reduce_op op) {
    const int root = info.peer;
    const bool at_root = rank() == root;
    return start(info, {{b, true, at_root}}, [&](const std::vector<void*>& p) {
      return ncclReduce(p[0], p[0], b.size, detail::datatype(b.type), detail::reduction(op), root, group_->comm,
                        group_->stream());
    });
  }

  work start_gather(const call& info, const raw_tensor& in, const raw_tensor& out) {
    return rooted_blocks(info, in, out, true);
  }

  work start_scatter(const call& info, const raw_tensor& in, const raw_tensor& out) {
    return rooted_blocks(info, out, in, false);
  }

  /// gather (`to_root`: each rank's `mine` into its block of the root's `whole`) or scatter (each rank's block of
  /// the root's `whole` into its `mine`): a send or receive per rank, grouped at the root with its own.
  work rooted_blocks(const call& info, const raw_tensor& mine, const raw_tensor& whole, bool to_root) {
    const int root = info.peer;
    const auto type = detail::datatype(mine.type);
    const auto transfer = [&](bool send, void* p, int peer) {
      return send ? ncclSend(p, mine.size, type, peer, group_->comm, group_->stream())
                  : ncclRecv(p, mine.size, type, peer, group_->comm, group_->stream());
    };
    const detail::argument own{mine, to_root, !to_root};
    if (rank() != root)
      return start(info, {own}, [&](const std::vector<void*>& p) { return transfer(to_root, p[0], root); });
    disjoint(info, mine, whole);
    return start(info, {own, {whole, !to_root, to_root}}, [&](const std::vector<void*>& p) {
      return grouped([&] {
        for (int r = 0; r < size(); ++r)
          if (const ncclResult_t e = transfer(!to_root, block(p[1], whole, r, mine.size), r);
              e != ncclSuccess && e != ncclInProgress)
            return e;
        return transfer(to_root, p[0], root);
      });
    });
  }

  work start_all_to_all(const call& info, const raw_tensor& in, const raw_tensor& out) {
    disjoint(info, in, out);
    const std::size_t k = in.size / static_cast<std::size_t>(size());
    return start(info, {{in, true, false}, {out, false, true}}, [&](const std::vector<void*>& p) {
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

  /// The barrier is an all_reduce of one device word.
  work start_barrier(const call& info) {
    {
      std::lock_guard lock(group_->mutex);
      if (!group_->barrier_word) group_->barrier_word.emplace(1, group_->device);
    }
    const raw_tensor word = group_->barrier_word->raw();
    return start(info, {{word, false, false}}, [&](const std::vector<void*>& p) {
      return ncclAllReduce(p[0], p[0], 1, ncclInt32, ncclSum, group_->comm, group_->stream());
    });
  }

  /// Queues `b` for rank c.peer; started with the other queued send/recv when one of them is waited for.
  work start_send(const call& info, const raw_tensor& b) { return post_p2p(info, true, b); }

  /// Queues a receive of what rank c.peer sends with c.tag; the sizes must match the send's.
  work start_recv(const call& info, const raw_tensor& b) { return post_p2p(info, false, b); }


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
  work start(const call& info, std::initializer_list<detail::argument> args, Body&& body) {
    auto rec = prepare(info, args);
    detail::group& g = *group_;
    {
      std::lock_guard lock(g.mutex);
      g.alive_locked(ddp::detail::describe(info));
      const cuda::device_guard on(g.device);
      g.ready.record(g.cfg.compute_stream);
      g.ready.make_wait(g.stream());
      detail::stage_in(g, *rec);
      g.settle(body(rec->pointers), ddp::detail::describe(info));
      divide_average(info, args, *rec);
      detail::stage_out(g, *rec);
    }
    return work(std::make_shared<detail::op_state>(group_, info, std::move(rec)));
  }

  /// Divides the sum an avg asked for (info.average, or its staging copy) by the group size on the stream.
  void divide_average(const call& info, std::initializer_list<detail::argument> args, const detail::record& rec) {
    if (info.average.size == 0) return;
    std::size_t index = 0;
    for (const auto& a : args) {
      if (a.written && a.buffer.data == info.average.data) {
        raw_tensor sum = info.average;
        sum.data = rec.pointers[index];
        cuda::divide(sum, size(), group_->stream());
        return;
      }
      ++index;
    }
  }

  /// The record of an operation: device arguments checked and passed through, host arguments copied to pinned memory.
  std::shared_ptr<detail::record> prepare(const call& info, std::initializer_list<detail::argument> args) {
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

  work post_p2p(const call& info, bool is_send, const raw_tensor& b) {
    auto rec = prepare(info, {{b, is_send, !is_send}});
    detail::group& g = *group_;
    const std::string what = ddp::detail::describe(info);
    {
      std::lock_guard lock(g.mutex);
      g.alive_locked(what);
      const cuda::device_guard on(g.device);
      cuda::event ready;
      ready.record(g.cfg.compute_stream);
      g.queue.push_back({is_send, info.peer, info.tag, b, rec, std::move(ready), what});
    }
    return work(std::make_shared<detail::op_state>(group_, info, std::move(rec)));
  }

  static bool overlap(const raw_tensor& a, const raw_tensor& b) noexcept {
    if (!a.where.is_cuda() || !b.where.is_cuda() || a.bytes() == 0 || b.bytes() == 0) return false;
    const auto* x = static_cast<const std::byte*>(a.data);
    const auto* y = static_cast<const std::byte*>(b.data);
    return x < y + b.bytes() && y < x + a.bytes();
  }

  void disjoint(const call& info, const raw_tensor& in, const raw_tensor& out) const {
    if (overlap(in, out)) fail(info, "input and output overlap in device memory; pass separate buffers");
  }

  /// Device buffers `whole` and `part` may overlap only as NCCL's in-place form: `part` at byte `offset` of `whole`.
  void in_place_only(const call& info, const raw_tensor& whole, const raw_tensor& part,
                     const raw_tensor& block_of, std::size_t offset) const {
    if (!overlap(whole, part)) return;
    if (static_cast<const std::byte*>(part.data) == static_cast<const std::byte*>(whole.data) + offset) return;
    fail(info, "input and output overlap in device memory other than in place (the " +
                   std::to_string(block_of.size) + "-element block of rank " + std::to_string(rank()) +
                   " inside the whole buffer); pass separate buffers or that exact block");
  }

  /// Rank 0's new ncclUniqueId, broadcast over `bootstrap`.
  template <class Bootstrap>
  static ncclUniqueId broadcast_id(Bootstrap& bootstrap) {
    ncclUniqueId id = bootstrap.rank() == 0 ? detail::new_unique_id() : ncclUniqueId{};
    std::array<std::uint8_t, sizeof(ncclUniqueId)> bytes{};
    std::memcpy(bytes.data(), &id, sizeof id);
    bootstrap.broadcast(std::span<std::uint8_t>(bytes), 0).wait();
    std::memcpy(&id, bytes.data(), sizeof id);
    return id;
  }

  std::shared_ptr<detail::group> group_;
};

}  // namespace ddp::nccl

/// backend::nccl selects ddp::nccl::communicator (checked against the ddp::communicator concept there).
template <>
struct ddp::backend_traits<ddp::backend::nccl> : ddp::detail::backend_binding<ddp::nccl::communicator> {};
