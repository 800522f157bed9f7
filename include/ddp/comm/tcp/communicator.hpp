#pragma once
/// \file ddp::tcp::communicator: the zero-dependency backend. Rendezvous through a key-value store on
/// rank 0, a full mesh of TCP connections authenticated by the job token, one progress thread, and
/// asynchronous collectives that check every frame against the call (see docs/tcp.md).

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/call.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/env.hpp>
#include <ddp/comm/front_end.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/tcp/algorithms.hpp>
#include <ddp/comm/tcp/engine.hpp>
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

/// First message on a mesh connection, from the connecting (higher) rank.
struct mesh_hello {
  std::uint32_t magic = 0x4d504444;  // "DDPM"
  std::uint32_t rank = 0;
  std::uint32_t size = 0;
  std::uint32_t version = 1;
  std::uint64_t token = 0;
};
static_assert(sizeof(mesh_hello) == 24);

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
  const mesh_hello hello{0x4d504444, static_cast<std::uint32_t>(me), static_cast<std::uint32_t>(cfg.size), 1, token};
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
    else if (got.magic != hello.magic || got.version != 1) why = "its first bytes are not a ddp mesh handshake";
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
/// its pid and the address of a random word; a peer that reads the word back with process_vm_readv runs
/// on this host as this user. Ranks with same_host_copy off publish no address and read nobody.
inline std::vector<peer_memory> probe_memory(const config& cfg, store_client& store) {
  struct probe {
    std::uint64_t pid = 0;
    std::uint64_t address = 0;
    std::uint64_t word = 0;
  };
  const auto n = static_cast<std::size_t>(cfg.size);
  const auto me = static_cast<std::size_t>(cfg.rank);
  const auto key = [](const char* what, std::size_t r) { return std::string("ddp/") + what + "/" + std::to_string(r); };
  std::random_device random;
  const auto word = std::make_unique<std::uint64_t>((std::uint64_t{random()} << 32) ^ random());
  const probe mine{static_cast<std::uint64_t>(::getpid()),
                   cfg.same_host_copy ? reinterpret_cast<std::uintptr_t>(word.get()) : 0, *word};
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
    peers[j] = {pid, true, false};
    readable[j] = 1;
  }
  store.set(key("memory_ok", me), readable);
  for (std::size_t j = 0; j < n; ++j)
    if (j != me) peers[j].reads_us = store.get(key("memory_ok", j)).at(me) == 1;
  return peers;
}

}  // namespace detail

/// A group of ranks connected over TCP; copies share the group, split() makes subgroups over the same mesh.
class communicator : public ddp::detail::collective_front<communicator> {
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
    engine_ = std::make_shared<detail::engine>(cfg.rank, cfg.size, &detail::execute, std::move(server));
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
    auto memory = detail::probe_memory(cfg, store);
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

  /// ddp::tcp moves host memory only.
  void host(const raw_tensor& t, const call& c) const {
    if (t.where.is_cuda())
      fail(c, "the buffer is on " + t.where.to_string() +
                  ": ddp::tcp moves host memory; copy it to the host first, or use ddp::nccl for device buffers");
  }

  work launch_all_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    host(b, c);
    return start(collective::all_reduce, b.type, op, -1, b.size, nullptr, b.data);
  }
  work launch_reduce_scatter(const call& c, const raw_tensor& in, const raw_tensor& out, reduce_op op) {
    host(in, c);
    host(out, c);
    return start(collective::reduce_scatter, out.type, op, -1, out.size, in.data, out.data);
  }
  work launch_all_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    host(in, c);
    host(out, c);
    return start(collective::all_gather, in.type, reduce_op::sum, -1, in.size, in.data, out.data);
  }
  work launch_broadcast(const call& c, const raw_tensor& b) {
    host(b, c);
    return start(collective::broadcast, b.type, reduce_op::sum, c.peer, b.size, nullptr, b.data);
  }
  work launch_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    host(b, c);
    return start(collective::reduce, b.type, op, c.peer, b.size, nullptr, b.data);
  }
  work launch_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    host(in, c);
    if (rank() == c.peer) host(out, c);
    return start(collective::gather, in.type, reduce_op::sum, c.peer, in.size, in.data, out.data);
  }
  work launch_scatter(const call& c, const raw_tensor& in, const raw_tensor& out) {
    host(out, c);
    if (rank() == c.peer) host(in, c);
    return start(collective::scatter, out.type, reduce_op::sum, c.peer, out.size, in.data, out.data);
  }
  work launch_all_to_all(const call& c, const raw_tensor& in, const raw_tensor& out) {
    host(in, c);
    host(out, c);
    return start(collective::all_to_all, in.type, reduce_op::sum, -1, in.size, in.data, out.data);
  }
  work launch_barrier(const call&) { return start(collective::barrier, dtype::u8, reduce_op::sum, -1, 0, nullptr, nullptr); }
  /// Completes once written to the socket.
  work launch_send(const call& c, const raw_tensor& b) {
    host(b, c);
    return start(collective::send_recv, b.type, reduce_op::sum, c.peer, b.size, b.data, nullptr, c.tag);
  }
  /// The send must have the same count and dtype.
  work launch_recv(const call& c, const raw_tensor& b) {
    host(b, c);
    return start(collective::send_recv, b.type, reduce_op::sum, c.peer, b.size, nullptr, b.data, c.tag);
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
