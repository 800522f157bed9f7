#pragma once
/// \file ddp::tcp::communicator: the zero-dependency backend. Rendezvous through a key-value store on
/// rank 0, a full mesh of TCP connections authenticated by the job token, one progress thread, and
/// asynchronous collectives that check every frame against the call (see docs/tcp.md).

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/checks.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/env.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/algorithms.hpp>
#include <ddp/comm/tcp/engine.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/same_host.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::tcp {

/// Everything a rank needs to join a job over TCP.
struct config {
  int rank = 0;                                   ///< this process's rank, 0..size-1
  int size = 1;                                   ///< number of ranks
  std::string master_addr = "127.0.0.1";          ///< where rank 0 serves the rendezvous store
  std::uint16_t master_port = 29500;              ///< the store's port (0 only for a single rank)
  std::string token;                              ///< job token; every rank must pass the same one
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};          ///< deadline of every operation
  std::chrono::milliseconds connect_timeout{std::chrono::minutes(2)};  ///< deadline of the rendezvous
  std::string interface;  ///< interface name or address for the mesh; empty: the one that reaches rank 0
  int socket_buffer_bytes = 0;  ///< SO_SNDBUF/SO_RCVBUF of the mesh sockets; 0 keeps the kernel's autotuning
  /// Ranks on one host (same user) copy large collective frames straight out of each other's memory
  /// (process_vm_readv); false sends every byte through the sockets.
  bool same_host_copy = true;
};

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

/// Builds the full mesh: connects to every lower rank, accepts every higher one; strangers are refused.
inline std::vector<socket_fd> build_mesh(const config& cfg, store_client& store, std::uint64_t token,
                                         const std::string& host, clock::time_point deadline) {
  const int me = cfg.rank;
  socket_fd listener = listen_on(host, 0, me, "the mesh");
  const endpoint mine{host, local_endpoint(listener.get()).port};
  const std::string text = mine.str();
  store.set("ddp/mesh/" + std::to_string(me), std::vector<std::uint8_t>(text.begin(), text.end()));

  std::vector<socket_fd> peers(static_cast<std::size_t>(cfg.size));
  const mesh_hello hello{mesh_magic, static_cast<std::uint32_t>(me), static_cast<std::uint32_t>(cfg.size), mesh_version, token};
  for (int j = 0; j < me; ++j) {
    const auto bytes = store.get("ddp/mesh/" + std::to_string(j));
    const std::string where(bytes.begin(), bytes.end());
    const auto colon = where.rfind(':');
    const std::string peer_host = where.substr(0, colon);
    const auto peer_port = static_cast<std::uint16_t>(std::stoi(where.substr(colon + 1)));
    socket_fd fd = connect_with_retry(peer_host, peer_port, deadline, me, "rank " + std::to_string(j),
                                      "check that the hosts can reach each other (firewall, DDP_INTERFACE)");
    std::uint8_t ok = 0;
    if (send_all(fd.get(), &hello, sizeof hello, deadline) != io_status::ok ||
        recv_all(fd.get(), &ok, 1, deadline) != io_status::ok || ok != 1)
      throw peer_lost("rank " + std::to_string(j) + " at " + where +
                          " refused the mesh handshake: give every rank the same DDP_TOKEN and WORLD_SIZE",
                      me, j);
    peers[static_cast<std::size_t>(j)] = std::move(fd);
  }
  for (int expected = cfg.size - 1 - me; expected > 0;) {
    pollfd pfd{listener.get(), POLLIN, 0};
    if (::poll(&pfd, 1, poll_ms(deadline)) == 0)
      throw timeout_error("ranks above " + std::to_string(me) + " did not all connect to this rank's mesh port " +
                              mine.str() + " before the connect deadline; start every rank, or raise the connect "
                              "timeout (DDP_CONNECT_TIMEOUT_MS)",
                          me);
    socket_fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd.valid()) continue;
    mesh_hello got{};
    const auto status = recv_all(fd.get(), &got, sizeof got, std::min(deadline, clock::now() + std::chrono::seconds(2)));
    std::string why;
    if (status != io_status::ok) why = "no complete handshake within 2 s";
    else if (got.magic != hello.magic || got.version != mesh_version) why = "its first bytes are not a ddp mesh handshake";
    else if (got.token != token) why = "wrong job token";
    else if (got.size != static_cast<std::uint32_t>(cfg.size)) why = "it belongs to a job of " + std::to_string(got.size) + " ranks";
    else if (got.rank <= static_cast<std::uint32_t>(me) || got.rank >= got.size || peers[got.rank].valid())
      why = "it claims rank " + std::to_string(got.rank) + ", which is not an expected peer";
    if (!why.empty()) {
      log_line(me, "refused a connection to the mesh port from " + remote_endpoint(fd.get()).str() + ": " + why +
                       " (a process outside this job, or a rank started with another DDP_TOKEN); the job goes on");
      continue;
    }
    const std::uint8_t ok = 1;
    if (send_all(fd.get(), &ok, 1, deadline) != io_status::ok) continue;
    peers[got.rank] = std::move(fd);
    --expected;
  }
  for (auto& p : peers)
    if (p.valid()) tune_data_socket(p.get(), cfg.socket_buffer_bytes);
  return peers;
}

/// Finds the peers whose memory this rank can read and those that can read its own: every rank publishes
/// its pid and the address and value of its engine's live word (random until the engine aborts); a peer
/// that reads the word back with process_vm_readv runs on this host as this user, and reads it again after
/// every copy. Ranks with same_host_copy off publish no address and read nobody.
inline std::vector<peer_memory> probe_memory(const config& cfg, store_client& store,
                                             const std::atomic<std::uint64_t>& live) {
  struct probe {
    std::uint64_t pid = 0;
    std::uint64_t address = 0;
    std::uint64_t word = 0;
  };
  const auto n = static_cast<std::size_t>(cfg.size);
  const auto me = static_cast<std::size_t>(cfg.rank);
  const auto key = [](const char* what, std::size_t r) { return std::string("ddp/") + what + "/" + std::to_string(r); };
  const probe mine{static_cast<std::uint64_t>(::getpid()),
                   cfg.same_host_copy ? reinterpret_cast<std::uintptr_t>(&live) : 0, live.load()};
  const auto* raw = reinterpret_cast<const std::uint8_t*>(&mine);
  store.set(key("memory", me), std::vector<std::uint8_t>(raw, raw + sizeof mine));
  std::vector<peer_memory> peers(n);
  std::vector<std::uint8_t> readable(n, 0);
  for (std::size_t j = 0; j < n; ++j) {
    if (j == me) continue;
    const auto bytes = store.get(key("memory", j));
    probe theirs;
    if (bytes.size() != sizeof theirs)
      throw error("rank " + std::to_string(j) + " published a malformed memory probe; every rank must run the same "
                  "ddp version",
                  cfg.rank);
    std::memcpy(&theirs, bytes.data(), sizeof theirs);
    if (!cfg.same_host_copy || theirs.address == 0) continue;
    std::uint64_t seen = 0;
    iovec local{&seen, sizeof seen};
    iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(theirs.address)), sizeof seen};
    const auto pid = static_cast<::pid_t>(theirs.pid);
    if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(sizeof seen) || seen != theirs.word)
      continue;  // another host, another user, or a kernel that forbids it: the sockets carry everything
    peers[j] = {pid, true, false, theirs.address, theirs.word};
    readable[j] = 1;
  }
  store.set(key("memory_ok", me), readable);
  for (std::size_t j = 0; j < n; ++j)
    if (j != me) peers[j].reads_us = store.get(key("memory_ok", j)).at(me) == 1;
  return peers;
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
      server.emplace(detail::listen_on(cfg.master_addr, cfg.master_port, 0, "the rendezvous store"), token, 0);
    engine_ = std::make_shared<detail::engine>(cfg.rank, cfg.size, &detail::run_collective, std::move(server));
    group_ = std::make_shared<detail::group>();
    group_->me = cfg.rank;
    group_->id = detail::mix_id(0, 0, static_cast<std::uint64_t>(cfg.size));
    group_->timeout = cfg.timeout;
    group_->members.resize(static_cast<std::size_t>(cfg.size));
    for (int r = 0; r < cfg.size; ++r) group_->members[static_cast<std::size_t>(r)] = r;
    if (cfg.size == 1) return;
    detail::store_client store(cfg.master_addr, cfg.master_port, token, cfg.rank, deadline, cfg.timeout);
    const std::string host = cfg.interface.empty() ? store.local_host() : detail::interface_address(cfg.interface, cfg.rank);
    if (cfg.rank == 0) {
      const std::string name = detail::interface_of(host);
      detail::log_line(0, std::to_string(cfg.size) + " ranks; store at " + cfg.master_addr + ":" +
                              std::to_string(cfg.master_port) + "; rank 0's mesh on " + host +
                              (name.empty() ? "" : " (" + name + ")") +
                              (cfg.interface.empty() ? ", the interface that reaches MASTER_ADDR (set DDP_INTERFACE to choose)"
                                                     : ""));
    }
    auto sockets = detail::build_mesh(cfg, store, token, host, deadline);
    auto memory = detail::probe_memory(cfg, store, engine_->live_word());
    if (cfg.rank == 0) {
      const auto readable = std::count_if(memory.begin(), memory.end(), [](const auto& m) { return m.readable; });
      detail::log_line(0, "rank 0 copies large frames straight from the memory of " + std::to_string(readable) +
                              " of its " + std::to_string(cfg.size - 1) +
                              " peers (same host and user; DDP_SAME_HOST_COPY=0 turns this off); the sockets "
                              "carry the rest");
    }
    engine_->attach(std::move(sockets), std::move(memory));
    // Rank 0's store (served by its engine) must outlive every rank's last get: rank 0 waits for all.
    store.add("ddp/joined", 1);
    while (cfg.rank == 0 && store.add("ddp/joined", 0) < cfg.size) {
      if (detail::clock::now() > deadline)
        throw timeout_error("not every rank finished the rendezvous before the connect deadline; check every "
                            "rank's log, or raise the connect timeout (DDP_CONNECT_TIMEOUT_MS)",
                            0);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  /// Reads the job from the environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (or mpirun's
  /// OMPI_COMM_WORLD_*), DDP_TOKEN, DDP_TIMEOUT_MS, DDP_CONNECT_TIMEOUT_MS, DDP_INTERFACE,
  /// DDP_SOCKET_BUFFER_BYTES, DDP_SAME_HOST_COPY.
  static communicator from_env() { return communicator(config_from_env()); }

  /// The config from_env() uses.
  static config config_from_env() {
    const env_config env = read_env_config();
    config cfg;
    cfg.rank = env.rank;
    cfg.size = env.world_size;
    cfg.master_addr = env.master_addr;
    cfg.master_port = env.master_port;
    if (auto t = ddp::detail::env_string("DDP_TOKEN")) cfg.token = *t;
    constexpr long long max_ms = 1LL << 40;
    if (auto ms = ddp::detail::env_integer("DDP_TIMEOUT_MS", 1, max_ms, "the operation timeout in milliseconds"))
      cfg.timeout = std::chrono::milliseconds(*ms);
    if (auto ms = ddp::detail::env_integer("DDP_CONNECT_TIMEOUT_MS", 1, max_ms, "the rendezvous deadline in milliseconds"))
      cfg.connect_timeout = std::chrono::milliseconds(*ms);
    if (auto i = ddp::detail::env_string("DDP_INTERFACE")) cfg.interface = *i;
    if (auto b = ddp::detail::env_integer("DDP_SOCKET_BUFFER_BYTES", 0, 1LL << 30, "the mesh sockets' kernel buffer size in bytes (0: autotuning)"))
      cfg.socket_buffer_bytes = static_cast<int>(*b);
    if (auto c = ddp::detail::env_integer("DDP_SAME_HOST_COPY", 0, 1,
                                          "1 to copy large frames between ranks on one host directly, 0 to send "
                                          "them through the sockets"))
      cfg.same_host_copy = *c == 1;
    return cfg;
  }

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
    return start(collective::send_recv, i.type, reduce_op::sum, peer, i.size, i.data, nullptr, tag, detail::p2p::send);
  }
  /// Receives into `out` what rank `peer` sends with the same tag (same count and dtype).
  template <tensor Out>
  work recv(Out&& out, int peer, int tag = 0) {
    const raw_tensor o = host(as_raw(out), "recv");
    check_rank(peer, "recv peer");
    return start(collective::send_recv, o.type, reduce_op::sum, peer, o.size, nullptr, o.data, tag, detail::p2p::recv);
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
    {
      std::lock_guard lock(engine_->queue_mutex());
      if (kind != collective::send_recv) c.seq = group_->next_seq++;  // sends and recvs match by tag instead
      group_->stats.add_call(kind);
      std::string what = detail::describe(detail::header_of(c, 0));
      const bool sends = side == detail::p2p::send;
      if (side != detail::p2p::none)
        what = (sends ? "send of " : "recv of ") + std::to_string(count) + " " + std::string(to_string(type)) +
               " with tag " + std::to_string(tag) + (sends ? " to rank " : " from rank ") + std::to_string(root);
      c.done = std::make_shared<ddp::detail::completion>(world_rank(), group_->timeout, std::move(what), engine_->note());
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
