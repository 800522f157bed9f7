#pragma once
/// \file ddp::tcp::communicator: the zero-dependency backend. Rendezvous through a key-value store on
/// rank 0, a full mesh of TCP connections authenticated by the job token, one progress thread, and
/// asynchronous collectives that check every frame against the call (see docs/tcp.md).

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/checks.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/algorithms.hpp>
#include <ddp/comm/tcp/config.hpp>
#include <ddp/comm/tcp/engine.hpp>
#include <ddp/comm/tcp/rendezvous.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::tcp {

namespace detail {

/// A group identifier all members compute alike from (parent id, split number, color).
inline std::uint32_t mix_id(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (const std::uint64_t v : {a, b, c}) {
    h = (h ^ v) * 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
  }
  return static_cast<std::uint32_t>(h) | 1U;  // 0 stays unused
}

}  // namespace detail

/// A group of ranks connected over TCP; copies share the group, split() makes subgroups over the same mesh.
class communicator : public ddp::detail::object_collectives<communicator> {
 public:
  /// Joins the job `cfg` describes: rendezvous at master_addr:master_port, then the full mesh.
  explicit communicator(const config& cfg) {
    if (cfg.size < 1 || cfg.rank < 0 || cfg.rank >= cfg.size)
      throw config_error("rank " + std::to_string(cfg.rank) + " of " + std::to_string(cfg.size) +
                             " is not a place in a job; ranks run from 0 to size-1",
                         cfg.rank);
    if (cfg.size > 1 && cfg.master_port == 0)
      throw config_error("MASTER_PORT is 0: with more than one rank, every rank must know rank 0's store port; "
                         "set MASTER_PORT to a free port, or start the job with ddp-launch, which picks one",
                         cfg.rank);
    const std::uint64_t token = detail::token_hash(cfg.token);
    const auto deadline = detail::clock::now() + cfg.connect_timeout;
    std::optional<detail::store_server> server;
    if (cfg.rank == 0 && cfg.size > 1)
      server.emplace(detail::listen_on(cfg.master_addr, cfg.master_port, 0, "the rendezvous store"), token, 0,
                     detail::limits_of(cfg));
    engine_ = std::make_shared<detail::engine>(cfg.rank, cfg.size, &detail::execute, std::move(server));
    group_ = std::make_shared<detail::group>();
    group_->me = cfg.rank;
    group_->id = detail::mix_id(0, 0, static_cast<std::uint64_t>(cfg.size));
    group_->timeout = cfg.timeout;
    group_->members.resize(static_cast<std::size_t>(cfg.size));
    for (int r = 0; r < cfg.size; ++r) group_->members[static_cast<std::size_t>(r)] = r;
    if (cfg.size == 1) return;
    detail::join(cfg, *engine_, token, deadline);
  }

  /// Joins the job the environment describes (tcp::config_from_env() lists the variables).
  static communicator from_env() { return communicator(tcp::config_from_env()); }

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
    const std::array<std::int64_t, 2> mine{color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
    all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all)).wait();
    std::vector<int> ranks;
    for (int p = 0; p < size(); ++p)
      if (all[2 * static_cast<std::size_t>(p)] == color) ranks.push_back(p);
    std::stable_sort(ranks.begin(), ranks.end(),
                     [&](int a, int b) { return all[2 * static_cast<std::size_t>(a) + 1] < all[2 * static_cast<std::size_t>(b) + 1]; });
    auto child = std::make_shared<detail::group>();
    std::uint64_t nth = 0;
    {
      std::lock_guard lock(engine_->queue_mutex());
      nth = group_->splits++;
    }
    child->id = detail::mix_id(group_->id, nth, static_cast<std::uint64_t>(static_cast<std::uint32_t>(color)));
    child->timeout = group_->timeout;
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      child->members.push_back(group_->members[static_cast<std::size_t>(ranks[i])]);
      if (ranks[i] == rank()) child->me = static_cast<int>(i);
    }
    return communicator(engine_, std::move(child));
  }

  /// Reduces `buf` across the group in place.
  template <tensor T>
  work all_reduce(T&& buf, reduce_op op = reduce_op::sum) {
    const raw_tensor b = host(as_raw(buf), "all_reduce");
    return start(collective::all_reduce, b.type, op, -1, b.size, nullptr, b.data);
  }
  /// `in` holds size()*k elements; block r of the reduction lands in rank r's `out` (k elements).
  template <tensor In, tensor Out>
  work reduce_scatter(const In& in, Out&& out, reduce_op op = reduce_op::sum) {
    const raw_tensor i = host(as_raw(in), "reduce_scatter"), o = host(as_raw(out), "reduce_scatter");
    same_type(i, o, "reduce_scatter");
    if (i.size != o.size * static_cast<std::size_t>(size()))
      throw error("reduce_scatter needs an input of size() * output elements; got " + std::to_string(i.size) +
                      " in and " + std::to_string(o.size) + " out for " + std::to_string(size()) + " ranks",
                  world_rank());
    return start(collective::reduce_scatter, o.type, op, -1, o.size, i.data, o.data);
  }
  /// Each rank's `in` (k elements) lands in block r of every rank's `out` (size()*k elements).
  template <tensor In, tensor Out>
  work all_gather(const In& in, Out&& out) {
    const raw_tensor i = host(as_raw(in), "all_gather"), o = host(as_raw(out), "all_gather");
    same_type(i, o, "all_gather");
    if (o.size != i.size * static_cast<std::size_t>(size()))
      throw error("all_gather needs an output of size() * input elements; got " + std::to_string(i.size) + " in and " +
                      std::to_string(o.size) + " out for " + std::to_string(size()) + " ranks",
                  world_rank());
    return start(collective::all_gather, i.type, reduce_op::sum, -1, i.size, i.data, o.data);
  }
  /// Copies root's `buf` to every rank.
  template <tensor T>
  work broadcast(T&& buf, int root = 0) {
    const raw_tensor b = host(as_raw(buf), "broadcast");
    check_rank(root, "broadcast root");
    return start(collective::broadcast, b.type, reduce_op::sum, root, b.size, nullptr, b.data);
  }
  /// Reduces every rank's `buf` into root's `buf`; the other ranks' buffers are left unchanged.
  template <tensor T>
  work reduce(T&& buf, reduce_op op = reduce_op::sum, int root = 0) {
    const raw_tensor b = host(as_raw(buf), "reduce");
    check_rank(root, "reduce root");
    return start(collective::reduce, b.type, op, root, b.size, nullptr, b.data);
  }
  /// Each rank's `in` (k elements) lands in block r of root's `out` (size()*k elements; unused elsewhere).
  template <tensor In, tensor Out>
  work gather(const In& in, Out&& out, int root = 0) {
    const raw_tensor i = host(as_raw(in), "gather"), o = as_raw(out);
    check_rank(root, "gather root");
    if (rank() == root) {
      same_type(i, host(o, "gather"), "gather");
      if (o.size != i.size * static_cast<std::size_t>(size()))
        throw error("gather needs an output of size() * input elements on the root; got " + std::to_string(i.size) +
                        " in and " + std::to_string(o.size) + " out",
                    world_rank());
    }
    return start(collective::gather, i.type, reduce_op::sum, root, i.size, i.data, o.data);
  }
  /// Block r of root's `in` (size()*k elements; unused elsewhere) lands in rank r's `out` (k elements).
  template <tensor In, tensor Out>
  work scatter(const In& in, Out&& out, int root = 0) {
    const raw_tensor i = as_raw(in), o = host(as_raw(out), "scatter");
    check_rank(root, "scatter root");
    if (rank() == root) {
      same_type(host(i, "scatter"), o, "scatter");
      if (i.size != o.size * static_cast<std::size_t>(size()))
        throw error("scatter needs an input of size() * output elements on the root; got " + std::to_string(i.size) +
                        " in and " + std::to_string(o.size) + " out",
                    world_rank());
    }
    return start(collective::scatter, o.type, reduce_op::sum, root, o.size, i.data, o.data);
  }
  /// Block p of `in` goes to rank p; block p of `out` comes from rank p (both size()*k elements).
  template <tensor In, tensor Out>
  work all_to_all(const In& in, Out&& out) {
    const raw_tensor i = host(as_raw(in), "all_to_all"), o = host(as_raw(out), "all_to_all");
    same_type(i, o, "all_to_all");
    if (i.size != o.size || i.size % static_cast<std::size_t>(size()) != 0)
      throw error("all_to_all needs input and output of the same size, a multiple of size(); got " +
                      std::to_string(i.size) + " and " + std::to_string(o.size),
                  world_rank());
    return start(collective::all_to_all, i.type, reduce_op::sum, -1, i.size, i.data, o.data);
  }
  /// Completes once every rank of the group has called it.
  work barrier() { return start(collective::barrier, dtype::u8, reduce_op::sum, -1, 0, nullptr, nullptr); }
  /// Sends `in` to rank `peer`; completes once written to the socket. Matched by peer's recv with the same tag.
  template <tensor In>
  work send(const In& in, int peer, int tag = 0) {
    const raw_tensor i = host(as_raw(in), "send");
    check_rank(peer, "send peer");
    return start(collective::send_recv, i.type, reduce_op::sum, peer, i.size, i.data, nullptr, tag);
  }
  /// Receives into `out` what rank `peer` sends with the same tag (same count and dtype).
  template <tensor Out>
  work recv(Out&& out, int peer, int tag = 0) {
    const raw_tensor o = host(as_raw(out), "recv");
    check_rank(peer, "recv peer");
    return start(collective::send_recv, o.type, reduce_op::sum, peer, o.size, nullptr, o.data, tag);
  }

 private:
  communicator(std::shared_ptr<detail::engine> e, std::shared_ptr<detail::group> g)
      : engine_(std::move(e)), group_(std::move(g)) {}

  [[nodiscard]] int world_rank() const { return engine_->rank(); }

  raw_tensor host(raw_tensor t, const char* op) const {
    if (t.where.is_cuda())
      throw error(std::string(op) + " got a buffer on " + t.where.to_string() +
                      ": ddp::tcp moves host memory; copy it to the host first, or use ddp::nccl for device buffers",
                  world_rank());
    return t;
  }
  void same_type(const raw_tensor& a, const raw_tensor& b, const char* op) const {
    if (auto problem = ddp::detail::dtype_problem(a, b); !problem.empty())
      throw error(std::string(op) + ": " + problem, world_rank());
  }
  void check_rank(int r, const char* what) const {
    if (auto problem = ddp::detail::rank_problem(r, size(), what); !problem.empty()) throw error(problem, world_rank());
  }

  work start(collective kind, dtype type, reduce_op op, int root, std::size_t count, const void* in, void* out,
             int tag = 0) {
    detail::call c;
    c.kind = kind;
    c.type = type;
    c.op = op;
    c.root = root;
    c.tag = tag;
    c.count = count;
    c.in = in;
    c.out = out;
    c.grp = group_;
    {
      std::lock_guard lock(engine_->queue_mutex());
      if (kind != collective::send_recv) c.seq = group_->next_seq++;  // sends and recvs match by tag instead
      group_->stats.add_call(kind);
      std::string what = detail::describe(detail::header_of(c, 0));
      if (kind == collective::send_recv)
        what = (in != nullptr ? "send of " : "recv of ") + std::to_string(count) + " " + std::string(to_string(type)) +
               " with tag " + std::to_string(tag) + (in != nullptr ? " to rank " : " from rank ") + std::to_string(root);
      c.done = std::make_shared<ddp::detail::completion>(world_rank(), group_->timeout, std::move(what));
      work w(c.done);
      engine_->submit_locked(std::move(c));
      engine_->wake();
      return w;
    }
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
}  // namespace ddp
