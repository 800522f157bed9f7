#pragma once
/// \file A rank's blocking client of the rendezvous store (set/get/wait/add); every call ends by the
/// rendezvous deadline.

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/auth.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// A blocking client of the store; connecting and every call end by the deadline given at construction.
class store_client {
 public:
  /// Connects to `host:port` (retrying with backoff) and signs the store's challenge with `key`, all before
  /// `connected_by`; every later call ends by `deadline`.
  store_client(const std::string& host, std::uint16_t port, const job_key& key, int rank, clock::time_point deadline,
               clock::time_point connected_by)
      : rank_(rank), deadline_(connected_by), where_(host + ":" + std::to_string(port)) {
    fd_ = connect_with_retry(host, port, connected_by, rank, "the rendezvous store (rank 0)",
                             "start rank 0, and give every rank the same MASTER_ADDR and MASTER_PORT (rank 0's "
                             "address and a free port), or raise the connect timeout (DDP_CONNECT_TIMEOUT_MS)");
    check(send_signed_hello(fd_.get(), store_hello{}, key, "store", deadline_), "handshake");
    std::uint8_t ok = 0;
    check(recv_all(fd_.get(), &ok, 1, deadline_), "handshake");
    deadline_ = deadline;
  }
  /// Connects to `host:port` (retrying with backoff) and signs the store's challenge with `key`, all before `deadline`.
  store_client(const std::string& host, std::uint16_t port, const job_key& key, int rank, clock::time_point deadline)
      : store_client(host, port, key, rank, deadline, deadline) {}

  /// Stores `value` under `key`.
  void set(const std::string& key, const std::vector<std::uint8_t>& value) {
    request(store_cmd::set, key, value.data(), value.size());
    std::uint8_t ok = 0;
    check(recv_all(fd_.get(), &ok, 1, deadline_), "set '" + key + "'");
  }
  /// The value under `key`, waiting until some rank sets it; throws ddp::config_error with the abort's text when a
  /// rank aborted the rendezvous first (store_abort_key).
  std::vector<std::uint8_t> get(const std::string& key) {
    request(store_cmd::get, key, nullptr, 0);
    std::uint64_t n = 0;
    check(recv_all(fd_.get(), &n, 8, deadline_), "get '" + key + "'");
    if (n == store_abort_reply) {
      check(recv_all(fd_.get(), &n, 8, deadline_), "get '" + key + "'");
      std::string why(n <= max_store_value ? n : 0, '\0');
      check(recv_all(fd_.get(), why.data(), why.size(), deadline_), "get '" + key + "'");
      throw config_error(why, rank_);
    }
    if (n > max_store_value) throw error("the store sent a malformed reply to get '" + key + "'", rank_);
    std::vector<std::uint8_t> value(n);
    check(recv_all(fd_.get(), value.data(), n, deadline_), "get '" + key + "'");
    return value;
  }
  /// Waits until `key` is set.
  void wait(const std::string& key) { (void)get(key); }
  /// Adds `delta` to the integer under `key` (0 when unset; wraps around) and returns the new value.
  std::int64_t add(const std::string& key, std::int64_t delta) {
    request(store_cmd::add, key, &delta, 8);
    std::int64_t now = 0;
    check(recv_all(fd_.get(), &now, 8, deadline_), "add '" + key + "'");
    return now;
  }
  /// The local address of the connection: the interface that reaches rank 0.
  [[nodiscard]] std::string local_host() const { return local_endpoint(fd_.get()).host; }

 private:
  void request(store_cmd cmd, const std::string& key, const void* value, std::size_t n) {
    store_request r{cmd, {}, static_cast<std::uint32_t>(key.size()), n};
    check(send_all(fd_.get(), &r, sizeof r, deadline_), "request");
    check(send_all(fd_.get(), key.data(), key.size(), deadline_), "request");
    if (n > 0) check(send_all(fd_.get(), value, n, deadline_), "request");
  }

  void check(io_status s, const std::string& what) const {
    if (s == io_status::ok) return;
    if (s == io_status::timed_out)
      throw timeout_error("the rendezvous store at " + where_ + " did not answer " + what +
                              " before the connect deadline: some rank has not started or is stuck; check every "
                              "rank's log, or raise the connect timeout (DDP_CONNECT_TIMEOUT_MS)",
                          rank_);
    throw peer_lost("the rendezvous store at " + where_ + " closed the connection during " + what +
                        ": rank 0 exited, or refused this rank's job token (every rank needs the same DDP_TOKEN)",
                    rank_, 0);
  }

  socket_fd fd_;
  int rank_;
  clock::time_point deadline_;
  std::string where_;
};

/// Counts this rank in `key` once it is done with rank 0's store; rank 0 then waits, calling `check()` between
/// looks, until all `size` ranks have counted, so its store outlives every rank's last get, and raises
/// timeout_error(`late`) past `deadline`.
template <class Check>
void count_in(store_client& store, const std::string& key, int rank, int size, clock::time_point deadline,
              const std::string& late, Check check) {
  store.add(key, 1);
  while (rank == 0 && store.add(key, 0) < size) {
    check();
    if (clock::now() > deadline) throw timeout_error(late, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace ddp::tcp::detail
