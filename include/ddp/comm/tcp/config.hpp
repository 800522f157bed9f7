#pragma once
/// \file ddp::tcp::config: everything a rank needs to join a job over TCP, and how from_env() reads it.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include <ddp/comm/env.hpp>
#include <ddp/comm/tcp/accept.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp {

/// Which kind of store a process uses for copies into shared memory (DDP_SHM_STORES; shm_copy.hpp).
enum class shm_stores {
  automatic,  ///< timed: ordinary stores unless they cost several times what streaming ones do ("auto")
  ordinary,   ///< always ordinary stores: the peers read the lines from this core's cache ("ordinary")
  streaming,  ///< always streaming stores: the lines go to memory, no peer's copy is taken back ("streaming")
};

/// How a shared-memory all_reduce, reduce_scatter or all_gather of 4 MiB and more runs where every rank of the
/// host can read every other's memory (DDP_SHM_ALGO; shm_algo_choice.hpp). The group's rank 0 decides for all.
enum class shm_algo {
  automatic,    ///< timed: whichever of the two took less in the latest calls of the collective and size ("auto")
  single_copy,  ///< always single copies out of the peers' buffers: no barrier per piece ("single_copy")
  pipeline,     ///< always the pipeline through the segment, a barrier per piece ("pipeline")
};

/// Everything a rank needs to join a job over TCP.
struct config {
  int rank = 0;                                   ///< this process's rank, 0..size-1
  int size = 1;                                   ///< number of ranks
  std::string master_addr = "127.0.0.1";          ///< where rank 0 serves the rendezvous store
  std::uint16_t master_port = 29500;              ///< the store's port (0 only for a single rank)
  /// When set (init("file:///path")), the ranks find rank 0's store through this file on a filesystem they
  /// share instead of master_addr:master_port: rank 0 serves the store on a free port and writes its
  /// addresses there, and removes the file once every rank has joined.
  std::string store_file;
  std::string token;                              ///< job token; every rank must pass the same one
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};          ///< deadline of every operation
  std::chrono::milliseconds connect_timeout{std::chrono::minutes(2)};  ///< deadline of the rendezvous
  std::string interface;  ///< interface name or address for the mesh; empty: the one that reaches rank 0
  int socket_buffer_bytes = 0;  ///< SO_SNDBUF/SO_RCVBUF of the mesh sockets; 0 keeps the kernel's autotuning
  /// Ranks on one host (same user) copy large collective frames straight out of each other's memory
  /// (process_vm_readv); false sends every byte through the sockets.
  bool same_host_copy = true;
  /// When every rank runs on one host (same user), collectives go through a shared-memory segment instead of
  /// the sockets; false on any rank keeps every rank on the sockets (DDP_SHM=0).
  bool shared_memory = true;
  /// The kind of store for copies into shared memory, for the whole process (the last communicator made sets it).
  shm_stores stores = shm_stores::automatic;
  /// How a shared-memory all_reduce, reduce_scatter or all_gather from 4 MiB runs; the group's rank 0's setting
  /// holds for every member.
  shm_algo algo = shm_algo::automatic;
  /// A connection to the store or a mesh port must send its handshake within this, or it is closed.
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(10)};
  /// Connections still in their handshake that the store or a mesh port keeps at once (the oldest goes first).
  std::size_t max_pending_handshakes = 64;
};

/// `cfg` with the options the environment sets: DDP_TOKEN, DDP_TIMEOUT_MS, DDP_CONNECT_TIMEOUT_MS,
/// DDP_INTERFACE, DDP_SOCKET_BUFFER_BYTES, DDP_SAME_HOST_COPY, DDP_SHM, DDP_SHM_STORES,
/// DDP_SHM_ALGO, DDP_HANDSHAKE_TIMEOUT_MS, DDP_MAX_PENDING_HANDSHAKES (every init method reads them;
/// the rank and the store's address aside).
inline config options_from_env(config cfg = {}) {
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
  if (auto s = ddp::detail::env_integer("DDP_SHM", 0, 1,
                                        "1 to run the collectives of ranks on one host through shared memory, 0 to "
                                        "send them through the sockets"))
    cfg.shared_memory = *s == 1;
  constexpr std::pair<std::string_view, shm_stores> stores[] = {
      {"auto", shm_stores::automatic}, {"ordinary", shm_stores::ordinary}, {"streaming", shm_stores::streaming}};
  if (auto k = ddp::detail::env_choice("DDP_SHM_STORES", stores,
                                       "the kind of store copies into shared memory use (auto: chosen from timed "
                                       "copies)",
                                       cfg.rank))
    cfg.stores = *k;
  constexpr std::pair<std::string_view, shm_algo> algos[] = {
      {"auto", shm_algo::automatic}, {"single_copy", shm_algo::single_copy}, {"pipeline", shm_algo::pipeline}};
  if (auto a = ddp::detail::env_choice("DDP_SHM_ALGO", algos,
                                       "the algorithm shared-memory all_reduce, reduce_scatter and all_gather run "
                                       "from 4 MiB (auto: whichever took less in the latest calls)",
                                       cfg.rank))
    cfg.algo = *a;
  if (auto ms = ddp::detail::env_integer("DDP_HANDSHAKE_TIMEOUT_MS", 1, max_ms,
                                         "the time in milliseconds a new connection to the store or a mesh port "
                                         "gets to send its handshake"))
    cfg.handshake_timeout = std::chrono::milliseconds(*ms);
  if (auto n = ddp::detail::env_integer("DDP_MAX_PENDING_HANDSHAKES", 1, 1 << 16,
                                        "the number of connections still in their handshake that the store and "
                                        "each mesh port keep at once"))
    cfg.max_pending_handshakes = static_cast<std::size_t>(*n);
  return cfg;
}

/// The config of this process from the environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (or mpirun's
/// OMPI_COMM_WORLD_*) and the options options_from_env() reads.
inline config config_from_env() {
  const env_config env = read_env_config();
  config cfg;
  cfg.rank = env.rank;
  cfg.size = env.world_size;
  cfg.master_addr = env.master_addr;
  cfg.master_port = env.master_port;
  return options_from_env(std::move(cfg));
}

namespace detail {
/// The most ranks a ddp::tcp job may have: every rank holds a socket to every other (ulimit -n must exceed the
/// world size), and rank 0's store and each engine visit every peer each turn.
inline constexpr int max_world = 4096;

/// The handshake limits of `cfg`: every rank of the job may be in its handshake at once (a listener of the job
/// expects at most size − 1 honest connections), and DDP_MAX_PENDING_HANDSHAKES more, the strangers' bound.
inline handshake_limits limits_of(const config& cfg) {
  return {cfg.handshake_timeout, cfg.max_pending_handshakes + static_cast<std::size_t>(std::max(cfg.size, 1))};
}
}  // namespace detail

/// Refuses a job of more than one rank that does not say where rank 0's store listens (MASTER_PORT 0, no store file).
inline void require_store_address(const config& cfg) {
  if (cfg.size > 1 && cfg.master_port == 0 && cfg.store_file.empty())
    throw config_error("MASTER_PORT is 0: with more than one rank, every rank must know rank 0's store port; "
                       "set MASTER_PORT to a free port, or start the job with ddp-launch, which picks one",
                       cfg.rank);
}

}  // namespace ddp::tcp
