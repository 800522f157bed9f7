#pragma once
/// \file ddp::tcp::communicator: the zero-dependency backend. Rendezvous through a key-value store on
/// rank 0, a full mesh of TCP connections authenticated by the job token, one progress thread, and
/// asynchronous collectives that check every frame against the call (see docs/tcp.md).

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/call.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/front_end.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/split.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/algorithms.hpp>
#include <ddp/comm/tcp/config.hpp>
#include <ddp/comm/tcp/engine.hpp>
#include <ddp/comm/tcp/hierarchical.hpp>
#include <ddp/comm/tcp/init_method.hpp>
#include <ddp/comm/tcp/rendezvous.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store.hpp>
#include <ddp/comm/tcp/store_file.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::tcp {

namespace detail {

/// The group's name in flight record files: its identifier in hex, the same on every member.
inline std::string group_label(std::uint32_t id) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", id);
  return buf;
}

}  // namespace detail

/// A group of ranks connected over TCP; copies share the group, split() makes subgroups over the same mesh.
class communicator : public ddp::detail::collective_front<communicator> {
 public:
  /// Joins the job `cfg` describes: rendezvous at master_addr:master_port (or through cfg.store_file), then
  /// the full mesh.
  explicit communicator(const config& cfg) {
    if (cfg.size < 1 || cfg.rank < 0 || cfg.rank >= cfg.size)
      throw config_error("rank " + std::to_string(cfg.rank) + " of " + std::to_string(cfg.size) +
                             " is not a place in a job; ranks run from 0 to size-1",
                         cfg.rank);
    if (cfg.size > detail::max_world)
      throw config_error("WORLD_SIZE=" + std::to_string(cfg.size) + " is more ranks than ddp::tcp's full mesh serves (" +
                             std::to_string(detail::max_world) + ": a socket to every peer, and rank 0's store and "
                             "engine visit every rank each turn; tested with 100 ranks on one host); use the MPI or "
                             "NCCL backend for larger jobs",
                         cfg.rank);
    require_store_address(cfg);
    const detail::job_key key = detail::job_key_of(cfg.token);
    const auto deadline = detail::clock::now() + cfg.connect_timeout;
    std::optional<detail::store_server> server;
    if (cfg.rank == 0 && cfg.size > 1 && cfg.store_file.empty())
      server.emplace(detail::listen_on(cfg.master_addr, cfg.master_port, 0, "the rendezvous store"), key, 0,
                     detail::limits_of(cfg));
    if (cfg.rank == 0 && cfg.size > 1 && !cfg.store_file.empty()) {
      const auto addresses = detail::store_addresses(cfg);
      auto listener = detail::listen_on(cfg.interface.empty() ? "0.0.0.0" : addresses.front(), 0, 0,
                                        "the rendezvous store");
      const auto port = detail::local_endpoint(listener.get()).port;
      server.emplace(std::move(listener), key, 0, detail::limits_of(cfg));
      detail::publish_store(cfg, key, port, addresses);
    }
    engine_ = std::make_shared<detail::engine>(cfg.rank, cfg.size, &detail::run_group_collective, std::move(server));
    group_ = std::make_shared<detail::group>();
    group_->me = cfg.rank;
    group_->id = detail::mix_id(0, 0, static_cast<std::uint64_t>(cfg.size));
    group_->timeout = cfg.timeout;
    group_->flight = ddp::detail::make_flight_recorder(detail::group_label(group_->id));
    group_->members.resize(static_cast<std::size_t>(cfg.size));
    for (int r = 0; r < cfg.size; ++r) group_->members[static_cast<std::size_t>(r)] = r;
    if (cfg.size == 1) return;
    detail::use_shared_memory(*group_, detail::join(cfg, *engine_, key, deadline));
  }

  /// Joins the job the environment describes (tcp::config_from_env() lists the variables).
  static communicator from_env() { return communicator(tcp::config_from_env()); }

  /// Joins the job of init method `url` as torch.distributed.init_process_group(init_method=url, rank=rank,
  /// world_size=size) does: "env://", "tcp://host:port" or "file:///shared/path" (tcp::config_from_url()).
  static communicator init(std::string_view url, int rank = -1, int size = -1) {
    return communicator(tcp::config_from_url(url, rank, size));
  }

  /// The config from_env() uses (tcp::config_from_env()).
  static config config_from_env() { return tcp::config_from_env(); }

  /// This process's rank in the group.
  [[nodiscard]] int rank() const { return group_->me; }
  /// Number of ranks in the group.
  [[nodiscard]] int size() const { return group_->size(); }
  /// The deadline every operation of this group gets.
  [[nodiscard]] std::chrono::milliseconds timeout() const { return group_->timeout; }
  /// Payload bytes sent and calls made by this group, by operation.
  [[nodiscard]] comm_stats stats() const { return group_->stats.snapshot(); }

  /// Collective: ranks with the same `color` form a new group, ordered by (key, rank); uses the existing mesh.
  communicator split(int color, int key) {
    const std::vector<int> ranks = ddp::detail::split_members(*this, color, key);
    auto child = std::make_shared<detail::group>();
    std::uint64_t nth = 0;
    {
      std::lock_guard lock(engine_->queue().mutex());
      nth = group_->splits++;
    }
    child->id = detail::mix_id(group_->id, nth, static_cast<std::uint64_t>(static_cast<std::uint32_t>(color)));
    child->timeout = group_->timeout;
    child->flight = ddp::detail::make_flight_recorder(detail::group_label(child->id));
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      child->members.push_back(group_->members[static_cast<std::size_t>(ranks[i])]);
      if (ranks[i] == rank()) child->me = static_cast<int>(i);
    }
    detail::use_shared_memory(*child, group_->hosts);
    return communicator(engine_, std::move(child));
  }

 private:
  communicator(std::shared_ptr<detail::engine> e, std::shared_ptr<detail::group> g)
      : engine_(std::move(e)), group_(std::move(g)) {}

  [[nodiscard]] int world_rank() const { return engine_->rank(); }

  friend class ddp::detail::collective_front<communicator>;
  using call = ddp::detail::call_info;

  /// The front end checks the arguments; the engine numbers, counts and averages the operations and checks every
  /// frame's header (operation, dtype, count, root, sequence) against the call, so no call check is exchanged.
  static constexpr ddp::detail::front_duties duties{
      .group = "a TCP group", .sequence = false, .stats = false, .average = false, .call_check = false};
  [[nodiscard]] static constexpr int max_tag() noexcept { return INT_MAX; }
  [[nodiscard]] const std::shared_ptr<ddp::detail::flight_recorder>& flight() const noexcept { return group_->flight; }

  // The front end hands every start host memory (device tensors staged through it: comm/staging.hpp).
  work start_all_reduce(const call& /*c*/, const raw_tensor& b, reduce_op op) {
    return submit(collective::all_reduce, b.type, op, -1, b.size, nullptr, b.data);
  }
  work start_reduce_scatter(const call& /*c*/, const raw_tensor& in, const raw_tensor& out, reduce_op op) {
    return submit(collective::reduce_scatter, out.type, op, -1, out.size, in.data, out.data);
  }
  work start_all_gather(const call& /*c*/, const raw_tensor& in, const raw_tensor& out) {
    return submit(collective::all_gather, in.type, reduce_op::sum, -1, in.size, in.data, out.data);
  }
  work start_broadcast(const call& c, const raw_tensor& b) {
    return submit(collective::broadcast, b.type, reduce_op::sum, c.peer, b.size, nullptr, b.data);
  }
  work start_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    return submit(collective::reduce, b.type, op, c.peer, b.size, nullptr, b.data);
  }
  work start_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    return submit(collective::gather, in.type, reduce_op::sum, c.peer, in.size, in.data, out.data);
  }
  work start_scatter(const call& c, const raw_tensor& in, const raw_tensor& out) {
    return submit(collective::scatter, out.type, reduce_op::sum, c.peer, out.size, in.data, out.data);
  }
  work start_all_to_all(const call& /*c*/, const raw_tensor& in, const raw_tensor& out) {
    return submit(collective::all_to_all, in.type, reduce_op::sum, -1, in.size, in.data, out.data);
  }
  work start_barrier(const call&) { return submit(collective::barrier, dtype::u8, reduce_op::sum, -1, 0, nullptr, nullptr); }
  /// Completes once written to the socket.
  work start_send(const call& c, const raw_tensor& b) {
    return submit(collective::send_recv, b.type, reduce_op::sum, c.peer, b.size, b.data, nullptr, c.tag,
                 detail::p2p::send);
  }
  /// The send must have the same count and dtype.
  work start_recv(const call& c, const raw_tensor& b) {
    return submit(collective::send_recv, b.type, reduce_op::sum, c.peer, b.size, nullptr, b.data, c.tag,
                 detail::p2p::recv);
  }

  /// Submits the call to the engine (docs/tcp.md, "A call's life"): numbered and counted under the queue mutex,
  /// then run on this thread where call_queue::claim_locked allows it, else queued for the engine thread.
  work submit(collective kind, dtype type, reduce_op op, int root, std::size_t count, const void* in, void* out,
              int tag = 0, detail::p2p side = detail::p2p::none) {
    detail::call c;
    c.kind = kind;
    c.side = side;
    c.type = type;
    c.op = op;
    c.root = root;
    c.tag = tag;
    c.count = count;
    c.in = in;
    c.out = out;
    c.grp = group_;
    work w;
    {
      std::lock_guard lock(engine_->queue().mutex());
      if (kind != collective::send_recv) c.seq = group_->next_seq++;  // sends and recvs match by tag instead
      group_->stats.add_call(kind);
      c.done = std::make_shared<detail::call_completion>(c, world_rank(), engine_->note());
      w = work(c.done);
      if (!engine_->queue().claim_locked(c)) {
        engine_->queue().push_locked(std::move(c));
        engine_->wake();
        return w;
      }
    }
    engine_->run_on_caller(std::move(c));  // shared memory with the engine idle: no hop between threads
    return w;
  }

  std::shared_ptr<detail::engine> engine_;
  std::shared_ptr<detail::group> group_;
};

static_assert(ddp::communicator<communicator>,
              "ddp::tcp::communicator must model ddp::communicator; add the missing member it names.");

}  // namespace ddp::tcp

namespace ddp {
/// backend::tcp selects ddp::tcp::communicator.
template <>
struct backend_traits<backend::tcp> {
  using communicator = tcp::communicator;
};
/// ddp::tcp::communicator deduces backend::tcp.
template <>
struct backend_of<tcp::communicator> {
  using type = backend::tcp;
};
}  // namespace ddp
