#pragma once
/// \file ddp::nccl::communicator::from_env(): the ncclUniqueId travels from rank 0 through ddp::tcp's rendezvous
/// store alone (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; DDP_TOKEN and DDP_CONNECT_TIMEOUT_MS as for ddp::tcp):
/// rank 0 serves the store on a thread of its own while the id is exchanged; no mesh and no progress engine.

#include <poll.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/comm/env.hpp>
#include <ddp/comm/nccl/communicator.hpp>
#include <ddp/comm/tcp/config.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store.hpp>
#include <ddp/comm/tcp/store_client.hpp>
#include <ddp/core/error.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::nccl::detail {

/// Rank 0's rendezvous store, served by a thread of its own until destroyed.
class served_store {
 public:
  /// Serves `server` at once.
  explicit served_store(tcp::detail::store_server server) : server_(std::move(server)), thread_([this] { serve(); }) {}
  served_store(const served_store&) = delete;
  served_store& operator=(const served_store&) = delete;
  ~served_store() {
    stop_ = true;
    thread_.join();
  }
  /// Throws what stopped the serving thread, if anything did.
  void check() const {
    if (stopped_) std::rethrow_exception(failure_);
  }

 private:
  void serve() noexcept {
    try {
      std::vector<pollfd> fds;
      while (!stop_) {
        fds.clear();
        std::size_t base = 0;
        server_.fill(fds, base);
        ::poll(fds.data(), fds.size(), 10);
        server_.on_events(fds, base);
      }
    } catch (...) {
      failure_ = std::current_exception();
      stopped_ = true;
    }
  }

  tcp::detail::store_server server_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> stopped_{false};
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts once the members it serves exist
};

/// Joins the job the environment describes, on config::device or else LOCAL_RANK modulo the visible devices.
struct env_rendezvous {
  static communicator join(config settings) {
    if (settings.device < 0) settings.device = read_env_config().local_rank % cuda::device_count();
    const tcp::config cfg = tcp::config_from_env();
    if (cfg.size == 1) return communicator(new_unique_id(), 0, 1, settings);
    tcp::require_store_address(cfg);
    return communicator(exchange_id(cfg), cfg.rank, cfg.size, settings);
  }

  /// Rank 0's new id, set in its store; every other rank gets it; rank 0 serves until every rank has it.
  static ncclUniqueId exchange_id(const tcp::config& cfg) {
    const tcp::detail::job_key key = tcp::detail::job_key_of(cfg.token);
    const auto deadline = tcp::detail::clock::now() + cfg.connect_timeout;
    std::optional<served_store> served;
    if (cfg.rank == 0)
      served.emplace(tcp::detail::store_server(
          tcp::detail::listen_on(cfg.master_addr, cfg.master_port, 0, "the rendezvous store"), key, 0,
          tcp::detail::limits_of(cfg)));
    tcp::detail::store_client store(cfg.master_addr, cfg.master_port, key, cfg.rank, deadline);
    ncclUniqueId id{};
    if (cfg.rank == 0) {
      id = new_unique_id();
      const auto* raw = reinterpret_cast<const std::uint8_t*>(&id);
      store.set("ddp/nccl/id", std::vector<std::uint8_t>(raw, raw + sizeof id));
    } else {
      const auto bytes = store.get("ddp/nccl/id");
      if (bytes.size() != sizeof id)
        throw error("rank 0 published a malformed ncclUniqueId; every rank must run the same ddp version", cfg.rank);
      std::memcpy(&id, bytes.data(), sizeof id);
    }
    tcp::detail::count_in(store, "ddp/nccl/joined", cfg.rank, cfg.size, deadline,
                          "not every rank fetched the ncclUniqueId from rank 0's store before the connect deadline; "
                          "start every rank with the same MASTER_ADDR and MASTER_PORT, or raise the connect timeout "
                          "(DDP_CONNECT_TIMEOUT_MS)",
                          [&] { served->check(); });
    return id;
  }
};

}  // namespace ddp::nccl::detail
