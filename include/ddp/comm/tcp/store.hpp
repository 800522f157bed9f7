#pragma once
/// \file The rendezvous key-value store: rank 0 serves it at MASTER_ADDR:MASTER_PORT (driven by the
/// progress engine's poll loop, no thread of its own); every rank is a client (set/get/wait/add).
/// Connections must open with the job token's hash; strangers and garbage are refused with one log line.

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

inline constexpr std::uint32_t store_magic = 0x53504444;  // "DDPS"
inline constexpr std::uint32_t max_store_key = 4096;
inline constexpr std::uint64_t max_store_value = 64ULL << 20;

/// First message on a store connection.
struct store_hello {
  std::uint32_t magic = store_magic;
  std::uint32_t version = 1;
  std::uint64_t token = 0;
};

enum class store_cmd : std::uint8_t { set = 1, get = 2, add = 3 };

/// Every request: the command, then `key_len` key bytes and `value_len` value bytes.
struct store_request {
  store_cmd cmd{};
  std::uint8_t pad[3]{};
  std::uint32_t key_len = 0;
  std::uint64_t value_len = 0;
};
static_assert(sizeof(store_hello) == 16 && sizeof(store_request) == 16);

/// The server side; rank 0's progress engine polls its descriptors and calls on_event().
class store_server {
 public:
  store_server(socket_fd listener, std::uint64_t token, int rank)
      : listener_(std::move(listener)), token_(token), rank_(rank) {}

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const { return local_endpoint(listener_.get()).port; }

  /// Appends the descriptors to poll; `base` receives the index of the first one.
  void fill(std::vector<pollfd>& fds, std::size_t& base) const {
    base = fds.size();
    fds.push_back({listener_.get(), POLLIN, 0});
    for (const auto& c : conns_)
      fds.push_back({c.fd.get(), static_cast<short>(POLLIN | (c.out.size() > c.out_off ? POLLOUT : 0)), 0});
  }

  /// Handles the poll results of the descriptors fill() added at `base`.
  void on_events(const std::vector<pollfd>& fds, std::size_t base) {
    const std::size_t known = conns_.size();
    for (std::size_t i = 0; i < known; ++i) {
      const short ev = fds[base + 1 + i].revents;
      if (ev == 0) continue;
      conn& c = conns_[i];
      if (ev & POLLIN) read_from(c);
      if (!c.dead && (ev & (POLLERR | POLLHUP)) && !(ev & POLLIN)) c.dead = true;
      if (!c.dead) flush(c);
    }
    std::erase_if(conns_, [](const conn& c) { return c.dead; });
    if (fds[base].revents & POLLIN) accept_all();
  }

 private:
  struct conn {
    socket_fd fd;
    std::string from;
    bool authed = false;
    bool dead = false;
    std::vector<std::uint8_t> in;
    std::vector<std::uint8_t> out;
    std::size_t out_off = 0;
    std::string parked;  ///< key a get waits for, empty when none
    bool is_parked = false;
  };

  void accept_all() {
    while (true) {
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      conn c;
      c.fd = socket_fd(fd);
      c.from = remote_endpoint(fd).str();
      conns_.push_back(std::move(c));
    }
  }

  void refuse(conn& c, const std::string& why) {
    log_line(rank_, "refused a connection to the store from " + c.from + ": " + why +
                        " (a process outside this job, or a rank started with another DDP_TOKEN); the job goes on");
    c.dead = true;
  }

  void read_from(conn& c) {
    std::uint8_t buf[65536];
    while (true) {
      const ssize_t k = ::recv(c.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
      if (k > 0) { c.in.insert(c.in.end(), buf, buf + k); continue; }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (k < 0 && errno == EINTR) continue;
      if (!c.authed && !c.in.empty()) refuse(c, "it closed after a partial handshake");
      c.dead = true;
      return;
    }
    parse(c);
  }

  void parse(conn& c) {
    std::size_t pos = 0;
    if (!c.authed) {
      if (c.in.size() < sizeof(store_hello)) return;
      store_hello h;
      std::memcpy(&h, c.in.data(), sizeof h);
      if (h.magic != store_magic || h.version != 1) return refuse(c, "its first bytes are not a ddp handshake");
      if (h.token != token_) return refuse(c, "wrong job token");
      c.authed = true;
      pos = sizeof h;
      c.out.push_back(1);
    }
    while (!c.is_parked && c.in.size() - pos >= sizeof(store_request)) {
      store_request r;
      std::memcpy(&r, c.in.data() + pos, sizeof r);
      if (r.key_len > max_store_key || r.value_len > max_store_value || r.cmd < store_cmd::set ||
          r.cmd > store_cmd::add || (r.cmd == store_cmd::add && r.value_len != 8))
        return refuse(c, "malformed store request");
      const std::size_t total = sizeof r + r.key_len + r.value_len;
      if (c.in.size() - pos < total) break;
      std::string key(reinterpret_cast<const char*>(c.in.data() + pos + sizeof r), r.key_len);
      const std::uint8_t* value = c.in.data() + pos + sizeof r + r.key_len;
      pos += total;
      if (r.cmd == store_cmd::set) {
        data_[key].assign(value, value + r.value_len);
        c.out.push_back(1);
        wake_parked(key);
      } else if (r.cmd == store_cmd::add) {
        std::int64_t delta = 0;
        std::memcpy(&delta, value, 8);
        auto& slot = data_[key];
        std::int64_t now = 0;
        if (slot.size() == 8) std::memcpy(&now, slot.data(), 8);
        now += delta;
        slot.resize(8);
        std::memcpy(slot.data(), &now, 8);
        append(c, &now, 8);
        wake_parked(key);
      } else if (!answer_get(c, key)) {
        c.parked = std::move(key);
        c.is_parked = true;
      }
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(pos));
  }

  static void append(conn& c, const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    c.out.insert(c.out.end(), b, b + n);
  }

  bool answer_get(conn& c, const std::string& key) {
    const auto it = data_.find(key);
    if (it == data_.end()) return false;
    const std::uint64_t n = it->second.size();
    append(c, &n, 8);
    append(c, it->second.data(), it->second.size());
    return true;
  }

  void wake_parked(const std::string& key) {
    for (auto& other : conns_)
      if (other.is_parked && other.parked == key && answer_get(other, key)) {
        other.is_parked = false;
        other.parked.clear();
        parse(other);
        flush(other);
      }
  }

  static void flush(conn& c) {
    while (c.out_off < c.out.size()) {
      const ssize_t k = ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) { c.out_off += static_cast<std::size_t>(k); continue; }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      c.dead = true;
      return;
    }
    c.out.clear();
    c.out_off = 0;
  }

  socket_fd listener_;
  std::uint64_t token_;
  int rank_;
  std::vector<conn> conns_;
  std::map<std::string, std::vector<std::uint8_t>> data_;
};

/// A blocking client of the store; every call waits at most until the deadline given at construction.
class store_client {
 public:
  /// Connects to `host:port` (retrying with backoff until `connect_deadline`) and authenticates with `token`.
  store_client(const std::string& host, std::uint16_t port, std::uint64_t token, int rank,
               clock::time_point connect_deadline, std::chrono::milliseconds timeout)
      : rank_(rank), timeout_(timeout), where_(host + ":" + std::to_string(port)) {
    fd_ = connect_with_retry(host, port, connect_deadline, rank, "the rendezvous store (rank 0)",
                             "start rank 0, and give every rank the same MASTER_ADDR and MASTER_PORT (rank 0's "
                             "address and a free port), or raise the connect timeout (DDP_CONNECT_TIMEOUT_MS)");
    const store_hello hello{store_magic, 1, token};
    check(send_all(fd_.get(), &hello, sizeof hello, deadline()), "handshake");
    std::uint8_t ok = 0;
    check(recv_all(fd_.get(), &ok, 1, deadline()), "handshake");
  }

  /// Stores `value` under `key`.
  void set(const std::string& key, const std::vector<std::uint8_t>& value) {
    request(store_cmd::set, key, value.data(), value.size());
    std::uint8_t ok = 0;
    check(recv_all(fd_.get(), &ok, 1, deadline()), "set '" + key + "'");
  }
  /// The value under `key`, waiting until some rank sets it.
  std::vector<std::uint8_t> get(const std::string& key) {
    request(store_cmd::get, key, nullptr, 0);
    std::uint64_t n = 0;
    check(recv_all(fd_.get(), &n, 8, deadline()), "get '" + key + "'");
    if (n > max_store_value) throw error("the store sent a malformed reply to get '" + key + "'", rank_);
    std::vector<std::uint8_t> value(n);
    check(recv_all(fd_.get(), value.data(), n, deadline()), "get '" + key + "'");
    return value;
  }
  /// Waits until `key` is set.
  void wait(const std::string& key) { (void)get(key); }
  /// Adds `delta` to the integer under `key` (0 when unset) and returns the new value.
  std::int64_t add(const std::string& key, std::int64_t delta) {
    request(store_cmd::add, key, &delta, 8);
    std::int64_t now = 0;
    check(recv_all(fd_.get(), &now, 8, deadline()), "add '" + key + "'");
    return now;
  }
  /// The local address of the connection: the interface that reaches rank 0.
  [[nodiscard]] std::string local_host() const { return local_endpoint(fd_.get()).host; }

 private:
  [[nodiscard]] clock::time_point deadline() const { return clock::now() + timeout_; }

  void request(store_cmd cmd, const std::string& key, const void* value, std::size_t n) {
    store_request r{cmd, {}, static_cast<std::uint32_t>(key.size()), n};
    check(send_all(fd_.get(), &r, sizeof r, deadline()), "request");
    check(send_all(fd_.get(), key.data(), key.size(), deadline()), "request");
    if (n > 0) check(send_all(fd_.get(), value, n, deadline()), "request");
  }

  void check(io_status s, const std::string& what) const {
    if (s == io_status::ok) return;
    if (s == io_status::timed_out)
      throw timeout_error("the rendezvous store at " + where_ + " did not answer " + what + " within " +
                              std::to_string(timeout_.count()) +
                              " ms: some rank has not started or is stuck; check every rank's log, or raise the "
                              "timeout (DDP_TIMEOUT_MS)",
                          rank_);
    throw peer_lost("the rendezvous store at " + where_ + " closed the connection during " + what +
                        ": rank 0 exited, or refused this rank's job token (every rank needs the same DDP_TOKEN)",
                    rank_, 0);
  }

  socket_fd fd_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::string where_;
};

}  // namespace ddp::tcp::detail
