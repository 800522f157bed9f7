#pragma once
/// \file The rendezvous of a TCP job: every rank joins rank 0's store, claims its rank, publishes its mesh
/// address, connects to every lower rank and accepts every higher one (all handshakes at once, strangers
/// refused), learns which peers' memory it can read, and hands the mesh to its progress engine.

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/accept.hpp>
#include <ddp/comm/tcp/config.hpp>
#include <ddp/comm/tcp/engine.hpp>
#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/same_host.hpp>
#include <ddp/comm/tcp/shm_copy.hpp>
#include <ddp/comm/tcp/shm_hosts.hpp>
#include <ddp/comm/tcp/shm_rings.hpp>
#include <ddp/comm/tcp/shm_world.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store_client.hpp>
#include <ddp/comm/tcp/store_file.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// The error of two processes started with the same rank.
inline config_error joined_twice(const std::string& rank, int me) {
  return config_error("rank " + rank + " joined twice: two processes of this job were started with RANK=" + rank +
                          "; check RANK and WORLD_SIZE: every process needs its own RANK in 0..WORLD_SIZE-1",
                      me);
}

/// Claims rank `me` in the store; a second process with the same rank fails and tells the others.
inline void claim_rank(store_client& store, int me) {
  if (store.add("ddp/rank/" + std::to_string(me), 1) == 1) return;
  const std::string text = std::to_string(me);
  store.set("ddp/twin", std::vector<std::uint8_t>(text.begin(), text.end()));
  store.add("ddp/twins", 1);
  throw joined_twice(text, me);
}

/// Records the job's world size when the first rank joins and checks every later rank's against it: a rank started
/// with another WORLD_SIZE aborts the rendezvous (store_abort_key), so every rank fails at once with the same
/// sentence instead of at the connect deadline.
inline void claim_world_size(store_client& store, int me, int size) {
  store.add("ddp/members", 1);
  if (store.add("ddp/size_claimed", 1) == 1) {
    const std::string text = std::to_string(size) + " " + std::to_string(me);
    store.set("ddp/size", std::vector<std::uint8_t>(text.begin(), text.end()));
    return;
  }
  const auto bytes = store.get("ddp/size");
  const std::string text(bytes.begin(), bytes.end());
  const auto space = text.find(' ');
  const std::string first = text.substr(0, space), who = space == std::string::npos ? "?" : text.substr(space + 1);
  if (first == std::to_string(size)) return;
  const std::string what = "WORLD_SIZE differs across the job's ranks: rank " + std::to_string(me) +
                           " was started with WORLD_SIZE=" + std::to_string(size) + " but rank " + who +
                           ", the first to join, with WORLD_SIZE=" + first + "; start every rank of a job with the "
                           "same WORLD_SIZE (under ddp-launch: the same --nnodes and --nproc-per-node on every node)";
  store.add("ddp/aborts", 1);
  store.set(store_abort_key, std::vector<std::uint8_t>(what.begin(), what.end()));
  throw config_error(what, me);
}

/// Throws when some process claimed a rank already taken (claim_rank) or aborted the rendezvous
/// (claim_world_size); the waits of the rendezvous call it.
inline void check_job(store_client& store, int me) {
  if (store.add("ddp/twins", 0) != 0) {
    const auto rank = store.get("ddp/twin");
    throw joined_twice(std::string(rank.begin(), rank.end()), me);
  }
  if (store.add("ddp/aborts", 0) != 0) {
    const auto what = store.get(store_abort_key);
    throw config_error(std::string(what.begin(), what.end()), me);
  }
}

/// After a configuration error in the rendezvous: where the job was aborted, this rank counts itself as told, and
/// rank 0, whose store tells the others, keeps it up until every rank that joined has been told (at most 2 s).
inline void settle_abort(store_client& store, int me) noexcept {
  try {
    if (store.add("ddp/aborts", 0) == 0) return;
    store.add("ddp/abort_seen", 1);
    const auto until = clock::now() + std::chrono::seconds(2);
    while (me == 0 && clock::now() < until && store.add("ddp/abort_seen", 0) < store.add("ddp/members", 0))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } catch (...) {  // NOLINT(bugprone-empty-catch): the store is gone; the error being raised says what happened
  }
}

/// Accepts every higher rank on `acceptor`, all handshakes at once; strangers are refused and the job goes on.
inline void accept_peers(const config& cfg, store_client& store, const job_key& key, handshake_acceptor& acceptor,
                         const std::string& where, std::vector<socket_fd>& peers, clock::time_point deadline) {
  const int me = cfg.rank;
  constexpr auto job_check_every = std::chrono::milliseconds(100);
  auto next_job_check = clock::now();
  std::vector<pollfd> fds;
  for (int expected = cfg.size - 1 - me; expected > 0;) {
    if (clock::now() >= deadline)
      throw timeout_error("ranks above " + std::to_string(me) + " did not all connect to this rank's mesh port " +
                              where + " before the connect deadline; start every rank, or raise the connect "
                              "timeout (DDP_CONNECT_TIMEOUT_MS)",
                          me);
    if (clock::now() >= next_job_check) {
      check_job(store, me);
      next_job_check = clock::now() + job_check_every;
    }
    fds.clear();
    acceptor.fill(fds);
    ::poll(fds.data(), fds.size(), poll_ms(std::min(deadline, next_job_check)));
    for (auto& a : acceptor.on_events(fds, 0)) {
      mesh_hello got{};
      std::memcpy(&got, a.hello.data(), sizeof got);
      std::string why;
      if (got.magic != mesh_magic) why = "its first bytes are not a ddp mesh handshake";
      else if (got.version != mesh_version)
        why = "its mesh handshake is version " + std::to_string(got.version) + ", this rank's " +
              std::to_string(mesh_version) + " (another ddp release)";
      else if (!is_signed(got, key, "mesh", a.nonce)) why = "wrong job token";
      else if (got.size != static_cast<std::uint32_t>(cfg.size)) why = "it belongs to a job of " + std::to_string(got.size) + " ranks";
      else if (got.rank <= static_cast<std::uint32_t>(me) || got.rank >= got.size)
        why = "it claims rank " + std::to_string(got.rank) + ", which is not an expected peer";
      else if (peers[got.rank].valid()) throw joined_twice(std::to_string(got.rank), me);
      if (!why.empty()) {
        acceptor.refuse(a.fd, a.from, why);
        continue;
      }
      const std::uint8_t ok = 1;
      if (send_all(a.fd.get(), &ok, 1, deadline) != io_status::ok) continue;
      peers[got.rank] = std::move(a.fd);
      --expected;
    }
  }
}

/// Builds the full mesh: connects to every lower rank, accepts every higher one; strangers are refused.
inline std::vector<socket_fd> build_mesh(const config& cfg, store_client& store, const job_key& key,
                                         const std::string& host, clock::time_point deadline) {
  const int me = cfg.rank;
  handshake_acceptor acceptor(listen_on(host, 0, me, "the mesh"), sizeof(mesh_hello), limits_of(cfg), me,
                              "the mesh port");
  const endpoint mine{host, acceptor.port()};
  const std::string text = mine.str();
  store.set("ddp/mesh/" + std::to_string(me), std::vector<std::uint8_t>(text.begin(), text.end()));

  std::vector<socket_fd> peers(static_cast<std::size_t>(cfg.size));
  const mesh_hello hello{mesh_magic, static_cast<std::uint32_t>(me), static_cast<std::uint32_t>(cfg.size), mesh_version,
                         0};
  for (int j = 0; j < me; ++j) {
    const auto bytes = store.get("ddp/mesh/" + std::to_string(j));
    const std::string where(bytes.begin(), bytes.end());
    const auto colon = where.rfind(':');
    const std::string peer_host = where.substr(0, colon);
    const auto peer_port = static_cast<std::uint16_t>(std::stoi(where.substr(colon + 1)));
    socket_fd fd = connect_with_retry(peer_host, peer_port, deadline, me, "rank " + std::to_string(j),
                                      "check that the hosts can reach each other (firewall, DDP_INTERFACE)");
    std::uint8_t ok = 0;
    if (send_signed_hello(fd.get(), hello, key, "mesh", deadline) != io_status::ok ||
        recv_all(fd.get(), &ok, 1, deadline) != io_status::ok || ok != 1) {
      check_job(store, me);  // a twin of this rank, or another world size, is why rank j refused, if so
      throw peer_lost("rank " + std::to_string(j) + " at " + where +
                          " refused the mesh handshake: give every rank the same DDP_TOKEN and WORLD_SIZE",
                      me, j);
    }
    peers[static_cast<std::size_t>(j)] = std::move(fd);
  }
  accept_peers(cfg, store, key, acceptor, text, peers, deadline);
  for (auto& p : peers)
    if (p.valid()) tune_data_socket(p.get(), cfg.socket_buffer_bytes);
  return peers;
}
/// Finds the peers whose memory this rank can read and those that can read its own: every rank publishes
/// its host identity (boot id, PID namespace), its pid and the address and value of its engine's live word
/// (random until the engine aborts); a peer with the same identity that reads the word back with
/// process_vm_readv runs on this host as this user, and reads it again after every copy. A peer on another
/// machine or in another PID namespace (a container, a simulated host) is never probed: its pid would name
/// an unrelated process here. Ranks with same_host_copy off publish no address and read nobody. `hosts` gets
/// every rank's host identity.
inline std::vector<peer_memory> probe_memory(const config& cfg, store_client& store,
                                             const std::atomic<std::uint64_t>& live, std::vector<host_identity>& hosts) {
  struct probe {
    std::uint64_t pid = 0;
    std::uint64_t address = 0;
    std::uint64_t word = 0;
    host_identity host;
  };
  const auto n = static_cast<std::size_t>(cfg.size);
  const auto me = static_cast<std::size_t>(cfg.rank);
  const auto key = [](const char* what, std::size_t r) { return std::string("ddp/") + what + "/" + std::to_string(r); };
  const probe mine{static_cast<std::uint64_t>(::getpid()),
                   cfg.same_host_copy ? reinterpret_cast<std::uintptr_t>(&live) : 0, live.load(), this_host()};
  const auto* raw = reinterpret_cast<const std::uint8_t*>(&mine);
  store.set(key("memory", me), std::vector<std::uint8_t>(raw, raw + sizeof mine));
  std::vector<peer_memory> peers(n);
  std::vector<std::uint8_t> readable(n, 0);
  hosts.assign(n, mine.host);
  for (std::size_t j = 0; j < n; ++j) {
    if (j == me) continue;
    const auto bytes = store.get(key("memory", j));
    probe theirs;
    if (bytes.size() != sizeof theirs)
      throw error("rank " + std::to_string(j) + " published a malformed memory probe; every rank must run the same "
                  "ddp version",
                  cfg.rank);
    std::memcpy(&theirs, bytes.data(), sizeof theirs);
    hosts[j] = theirs.host;
    if (!cfg.same_host_copy || theirs.address == 0 || !mine.host.shares_pids_with(theirs.host)) continue;
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

/// Per rank, its host: the lowest rank whose host identity is its own. Ranks whose identity cannot be read count
/// as one host: mapping its segment (map_shared_memory) then tells whether they share one, as on one host.
inline std::vector<int> hosts_of(const std::vector<host_identity>& hosts) {
  const auto same = [](const host_identity& a, const host_identity& b) {
    return a.boot == b.boot && a.pid_ns == b.pid_ns && a.pid_ns_dev == b.pid_ns_dev;
  };
  std::vector<int> host_of(hosts.size());
  for (std::size_t r = 0; r < hosts.size(); ++r) {
    std::size_t j = 0;
    while (j < r && !same(hosts[j], hosts[r])) ++j;
    host_of[r] = static_cast<int>(j);
  }
  return host_of;
}

/// True when every rank of `ranks` can copy straight out of every other one's memory (the rows probe_memory
/// published). One answer for every rank, so all of them choose the same algorithm for a collective; a probe that
/// succeeded one way only (ptrace rules, one rank with CAP_SYS_PTRACE) counts as none.
inline bool every_rank_reads_every_rank(store_client& store, const std::vector<int>& ranks) {
  for (const int j : ranks) {
    const auto row = store.get("ddp/memory_ok/" + std::to_string(j));
    for (const int k : ranks)
      if (k != j && (static_cast<std::size_t>(k) >= row.size() || row[static_cast<std::size_t>(k)] != 1)) return false;
  }
  return true;
}

/// Maps this host's shared-memory segment where every rank can: on each host with two ranks or more the lowest
/// (rank 0 where every rank is on one host) removes what killed jobs left, creates the segment and publishes its
/// name; the host's other ranks map it; every rank says whether it could (same host and user, DDP_SHM not 0) and
/// the creator unlinks the name once all have answered. Null where any rank cannot: the sockets carry everything.
inline std::shared_ptr<shm_hosts> map_shared_memory(const config& cfg, store_client& store, std::vector<int> host_of) {
  const int lead = host_of[static_cast<std::size_t>(cfg.rank)];
  const bool one_host = std::all_of(host_of.begin(), host_of.end(), [](int h) { return h == 0; });
  const int local = static_cast<int>(std::count(host_of.begin(), host_of.end(), lead));
  const std::string where = one_host ? "ddp/shm" : "ddp/shm/" + std::to_string(lead);
  std::shared_ptr<shm_world> world;
  std::string name;
  if (local > 1 && cfg.rank == lead) {
    if (cfg.shared_memory) {
      reap_stale_segments();
      std::random_device random;
      char nonce[24];
      std::snprintf(nonce, sizeof nonce, "%08x%08x", random(), random());
      name = shm_user_prefix() + std::to_string(::getpid()) + "-" + nonce;
      try {
        world = std::make_shared<shm_world>(name, cfg.size, cfg.rank, true, local);
      } catch (const error& e) {
        log_line(cfg.rank, std::string(e.what()) + "; the sockets carry everything");
      }
    }
    const std::string published = world ? name : std::string();
    store.set(where, std::vector<std::uint8_t>(published.begin(), published.end()));
  } else if (local > 1) {
    const auto bytes = store.get(where);
    name.assign(bytes.begin(), bytes.end());
    if (cfg.shared_memory && !name.empty()) {
      try {
        world = std::make_shared<shm_world>(name, cfg.size, cfg.rank, false, local);
        if (!world->genuine()) world.reset();
      } catch (const error&) {  // another host, or another user: the sockets carry everything
        world.reset();
      }
    }
  }
  const auto key = [](int r) { return "ddp/shm_ok/" + std::to_string(r); };
  store.set(key(cfg.rank), {static_cast<std::uint8_t>((local > 1 ? world != nullptr : cfg.shared_memory) ? 1 : 0)});
  bool all = true;
  for (int r = 0; r < cfg.size; ++r) all = store.get(key(r)).at(0) == 1 && all;
  if (cfg.rank == lead && !name.empty()) ::shm_unlink(name.c_str());
  if (!all) return nullptr;
  auto hosts = std::make_shared<shm_hosts>();
  hosts->segment = std::move(world);
  hosts->host_of = std::move(host_of);
  return hosts;
}

/// The rest of join() once the rank and the world size are claimed.
inline std::shared_ptr<shm_hosts> join_mesh(const config& cfg, engine& eng, store_client& store, const job_key& key,
                                            bool by_file, clock::time_point deadline) {
  const std::string host = cfg.interface.empty() ? store.local_host() : interface_address(cfg.interface, cfg.rank);
  if (cfg.rank == 0) {
    const std::string name = interface_of(host);
    log_line(0, std::to_string(cfg.size) + " ranks; store " +
                    (by_file ? "found through file://" + cfg.store_file
                             : "at " + cfg.master_addr + ":" + std::to_string(cfg.master_port)) +
                    "; rank 0's mesh on " + host +
                    (name.empty() ? "" : " (" + name + ")") +
                    (cfg.interface.empty() ? ", the interface that reaches MASTER_ADDR (set DDP_INTERFACE to choose)"
                                           : ""));
  }
  auto sockets = build_mesh(cfg, store, key, host, deadline);
  std::vector<host_identity> identities;
  auto memory = probe_memory(cfg, store, eng.live().word(), identities);
  if (cfg.rank == 0) {
    const auto readable = std::count_if(memory.begin(), memory.end(), [](const auto& m) { return m.readable; });
    log_line(0, "rank 0 copies large frames straight from the memory of " + std::to_string(readable) + " of its " +
                    std::to_string(cfg.size - 1) +
                    " peers (same host and user; DDP_SAME_HOST_COPY=0 turns this off); the sockets carry the rest");
  }
  auto hosts = map_shared_memory(cfg, store, hosts_of(identities));
  shared_stores().fix(cfg.stores);
  const bool one_host = hosts && hosts->segment && hosts->segment->local_size() == cfg.size;
  if (hosts && hosts->segment) {
    std::vector<int> local;
    for (int r = 0; r < cfg.size; ++r)
      if (hosts->host_of[static_cast<std::size_t>(r)] == hosts->host_of[static_cast<std::size_t>(cfg.rank)]) local.push_back(r);
    hosts->segment->memory = memory;
    hosts->segment->single_copy = every_rank_reads_every_rank(store, local);
    hosts->segment->algo = cfg.algo;
  }
  if (cfg.rank == 0)
    log_line(0, one_host ? "collectives and sends run through shared memory: every rank is on this host (DDP_SHM=0 "
                           "turns this off)"
                : hosts  ? "collectives run through shared memory inside each host and the sockets across them "
                           "(hierarchical; DDP_SHM=0 turns this off); sends run through the sockets"
                         : "collectives and sends run through the sockets: not every rank can map shared memory with "
                           "the ranks of its host (another user, or DDP_SHM=0)");
  auto rings = one_host ? std::make_unique<shm_rings>(hosts->segment->name(), cfg.size, cfg.rank) : nullptr;
  eng.attach(std::move(sockets), std::move(memory), hosts ? hosts->segment : nullptr, std::move(rings));
  // Rank 0's store (served by its engine) must outlive every rank's last get: rank 0 waits for all.
  count_in(store, "ddp/joined", cfg.rank, cfg.size, deadline,
           "not every rank finished the rendezvous before the connect deadline; check every rank's log, or raise "
           "the connect timeout (DDP_CONNECT_TIMEOUT_MS)",
           [&] { check_job(store, 0); });
  if (cfg.rank == 0) eng.retire_store();  // a later job on this port must not reach this finished one
  if (cfg.rank == 0 && by_file) retire_store_file(cfg);
  return hosts;
}

/// Joins the job `cfg` describes through rank 0's store (at master_addr:master_port, or named in cfg.store_file)
/// and hands the mesh to `eng`; all by `deadline`. Returns the job's shared memory (every host's segment, where
/// every rank can map its host's), else null.
inline std::shared_ptr<shm_hosts> join(const config& cfg, engine& eng, const job_key& key,
                                       clock::time_point deadline) {
  const bool by_file = !cfg.store_file.empty();
  store_client store = by_file ? find_store(cfg, key, deadline)
                               : store_client(cfg.master_addr, cfg.master_port, key, cfg.rank, deadline);
  claim_rank(store, cfg.rank);
  try {
    claim_world_size(store, cfg.rank, cfg.size);
    return join_mesh(cfg, eng, store, key, by_file, deadline);
  } catch (const config_error&) {
    settle_abort(store, cfg.rank);
    throw;
  }
}

}  // namespace ddp::tcp::detail
