#pragma once
/// \file The rendezvous key-value store: rank 0 serves it at MASTER_ADDR:MASTER_PORT (driven by the
/// progress engine's poll loop, no thread of its own); every rank is a client (set/get/wait/add).
/// The protocol (store_book) runs without sockets, so it can be tested and fuzzed from memory; the server
/// reads at most what the next message needs, and nothing past the 16-byte handshake before it is checked.

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ddp/comm/tcp/accept.hpp>
#include <ddp/comm/tcp/auth.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

inline constexpr std::uint32_t store_magic = 0x53504444;  // "DDPS"
inline constexpr std::uint32_t max_store_key = 4096;
inline constexpr std::uint64_t max_store_value = 64ULL << 20;
/// The key whose value, once set, ends the job's rendezvous: every get of a key not set, waiting or later, is
/// answered with it (store_abort_reply), so a job-wide configuration error reaches every rank at once.
inline constexpr const char* store_abort_key = "ddp/abort";
/// The length word of a get's reply that says "aborted": the abort's text follows (its length, then its bytes).
inline constexpr std::uint64_t store_abort_reply = ~std::uint64_t{0};

/// The store handshake's version: 2 signs the acceptor's challenge (auth.hpp) instead of sending the token's hash.
inline constexpr std::uint32_t store_version = 2;

/// First message on a store connection, after the store's challenge.
struct store_hello {
  std::uint32_t magic = store_magic;
  std::uint32_t version = store_version;
  std::uint64_t mac = 0;  ///< signed_hello's MAC under the job's key, context "store"
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

/// One client of the store as the protocol sees it: bytes received and not yet parsed, answers not yet sent.
struct store_session {
  std::vector<std::uint8_t> in;   ///< received, not yet parsed: at most one message
  std::vector<std::uint8_t> out;  ///< answers not yet sent
  challenge nonce{};              ///< what the store sent it to sign
  bool authed = false;            ///< its handshake was signed with this job's key
  bool parked = false;            ///< a get waits for `parked_key`
  std::string parked_key;         ///< the key a parked get waits for
  std::string refused;            ///< why the store closes it; empty while it behaves
};

/// The store's data and protocol, without sockets: sessions feed received bytes in and take answers out.
class store_book {
 public:
  /// A book for the job whose key is `key`.
  explicit store_book(const job_key& key) : key_(key) {}

  /// Bytes `s` must receive before its next message is complete; 0 while it waits for a key or is refused.
  [[nodiscard]] static std::size_t wanted(const store_session& s) {
    if (!s.refused.empty() || s.parked) return 0;
    if (s.in.size() < sizeof(store_request)) return sizeof(store_request) - s.in.size();  // hello or header
    store_request r;
    std::memcpy(&r, s.in.data(), sizeof r);
    return sizeof r + r.key_len + r.value_len - s.in.size();  // the header was checked when it arrived
  }

  /// Appends `n` received bytes to `s` and answers its complete messages (and any parked get they satisfy).
  void feed(store_session& s, const std::uint8_t* data, std::size_t n) {
    if (!s.refused.empty()) return;
    s.in.insert(s.in.end(), data, data + n);
    parse(s);
  }

  /// Forgets `s`, which is closing: it no longer waits for a key.
  void close(store_session& s) {
    std::erase(parked_, &s);
    s.parked = false;
  }

  /// The number of keys stored.
  [[nodiscard]] std::size_t keys() const { return data_.size(); }

 private:
  /// What is wrong with request header `r`, or "" when it is well-formed.
  static std::string malformed(const store_request& r) {
    if (r.cmd < store_cmd::set || r.cmd > store_cmd::add)
      return "a request with unknown command " + std::to_string(static_cast<int>(r.cmd));
    if (r.key_len > max_store_key)
      return "a key of " + std::to_string(r.key_len) + " bytes (at most " + std::to_string(max_store_key) + ")";
    if (r.value_len > max_store_value)
      return "a value of " + std::to_string(r.value_len) + " bytes (at most " + std::to_string(max_store_value) + ")";
    if (r.cmd == store_cmd::add && r.value_len != 8)
      return "an add with a value of " + std::to_string(r.value_len) + " bytes (8 expected)";
    if (r.cmd == store_cmd::get && r.value_len != 0)
      return "a get with a value of " + std::to_string(r.value_len) + " bytes (none expected)";
    return {};
  }

  void parse(store_session& s) {
    std::size_t pos = 0;
    while (s.refused.empty() && !s.parked && s.in.size() - pos >= sizeof(store_request)) {
      if (!s.authed) {
        store_hello h;
        std::memcpy(&h, s.in.data() + pos, sizeof h);
        pos += sizeof h;
        if (h.magic != store_magic) s.refused = "its first bytes are not a ddp handshake";
        else if (h.version != store_version)
          s.refused = "its handshake is version " + std::to_string(h.version) + ", this store's " +
                      std::to_string(store_version) + " (another ddp release)";
        else if (!is_signed(h, key_, "store", s.nonce)) s.refused = "wrong job token";
        s.authed = s.refused.empty();
        if (s.authed) s.out.push_back(1);
        continue;
      }
      store_request r;
      std::memcpy(&r, s.in.data() + pos, sizeof r);
      if (s.refused = malformed(r); !s.refused.empty()) break;
      const std::size_t total = sizeof r + r.key_len + r.value_len;
      if (s.in.size() - pos < total) break;
      std::string key(reinterpret_cast<const char*>(s.in.data() + pos + sizeof r), r.key_len);
      const std::uint8_t* value = s.in.data() + pos + sizeof r + r.key_len;
      if (r.cmd == store_cmd::set) {
        data_[key].assign(value, value + r.value_len);
        s.out.push_back(1);
        if (key == store_abort_key) wake_all_parked();
      } else if (r.cmd == store_cmd::add) {
        add(s, key, value);
      } else if (!answer_get(s, key)) {
        s.parked = true;
        s.parked_key = key;
        parked_.push_back(&s);
      }
      pos += total;
      if (r.cmd != store_cmd::get) wake_parked(key);
    }
    s.in.erase(s.in.begin(), s.in.begin() + static_cast<std::ptrdiff_t>(pos));
  }

  void add(store_session& s, const std::string& key, const std::uint8_t* value) {
    std::uint64_t delta = 0, now = 0;
    std::memcpy(&delta, value, 8);
    auto& stored = data_[key];
    if (stored.size() == 8) std::memcpy(&now, stored.data(), 8);
    now += delta;  // unsigned: wraps like two's complement instead of overflowing a signed integer
    stored.resize(8);
    std::memcpy(stored.data(), &now, 8);
    append(s, &now, 8);
  }

  static void append(store_session& s, const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    s.out.insert(s.out.end(), b, b + n);
  }

  bool answer_get(store_session& s, const std::string& key) {
    auto it = data_.find(key);
    if (it == data_.end()) {
      it = data_.find(store_abort_key);
      if (it == data_.end()) return false;
      append(s, &store_abort_reply, 8);  // the job is aborted: the key will never come
    }
    const std::uint64_t n = it->second.size();
    append(s, &n, 8);
    append(s, it->second.data(), it->second.size());
    return true;
  }

  void wake_parked(const std::string& key) { wake(key.c_str()); }
  /// The abort was set: every parked get is answered with it.
  void wake_all_parked() { wake(nullptr); }
  /// Answers the parked gets of `key` (every parked get when null).
  void wake(const char* key) {
    std::vector<store_session*> woken;
    std::erase_if(parked_, [&](store_session* other) {
      if (key != nullptr && other->parked_key != key) return false;
      woken.push_back(other);
      return true;
    });
    for (store_session* other : woken) {
      answer_get(*other, other->parked_key);
      other->parked = false;
      other->parked_key.clear();
      parse(*other);
    }
  }

  job_key key_;
  std::vector<store_session*> parked_;
  std::map<std::string, std::vector<std::uint8_t>> data_;
};

/// The server side; rank 0's progress engine polls its descriptors and calls on_events().
class store_server {
 public:
  /// Serves the store on `listener` for the job whose key is `key`.
  store_server(socket_fd listener, const job_key& key, int rank, handshake_limits limits = {})
      : acceptor_(std::move(listener), sizeof(store_hello), limits, rank, "the store"), book_(key), rank_(rank) {}

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const { return acceptor_.port(); }

  /// Accepts no more connections (those it has are served until they close): the job's rendezvous is over, and the
  /// port is free for the next job on it, which a rank joining it would otherwise reach here.
  void retire() noexcept { acceptor_.close_listener(); }

  /// Appends the descriptors to poll; `base` receives the index of the first one.
  void fill(std::vector<pollfd>& fds, std::size_t& base) const {
    base = fds.size();
    acceptor_.fill(fds);
    for (const auto& c : conns_) {
      short ev = c->s.out.empty() ? POLLRDHUP : POLLRDHUP | POLLOUT;
      if (store_book::wanted(c->s) > 0) ev = static_cast<short>(ev | POLLIN);
      fds.push_back({c->fd.get(), ev, 0});
    }
  }

  /// Handles the poll results of the descriptors fill() added at `base`.
  void on_events(const std::vector<pollfd>& fds, std::size_t base) {
    const std::size_t first = base + acceptor_.descriptors();
    for (std::size_t i = 0; i < conns_.size() && first + i < fds.size(); ++i) {
      const short ev = fds[first + i].revents;
      if (ev & POLLIN) read_from(*conns_[i]);
      else if (ev & (POLLERR | POLLHUP | POLLRDHUP)) conns_[i]->dead = true;  // gone while its get waits
    }
    for (auto& a : acceptor_.on_events(fds, base)) {
      auto c = std::make_unique<conn>(conn{std::move(a.fd), std::move(a.from), {}});
      c->s.nonce = a.nonce;
      book_.feed(c->s, a.hello.data(), a.hello.size());
      check(*c);
      conns_.push_back(std::move(c));
    }
    for (auto& c : conns_)
      if (!c->dead) flush(*c);  // also the answers a set or add gave to parked gets
    std::erase_if(conns_, [this](const std::unique_ptr<conn>& c) {
      if (c->dead) book_.close(c->s);
      return c->dead;
    });
  }

 private:
  struct conn {
    socket_fd fd;
    std::string from;
    store_session s;
    bool dead = false;
  };

  void read_from(conn& c) {
    std::uint8_t buf[65536];
    for (int reads = 0; reads < 64 && !c.dead; ++reads) {  // bounded, so one client cannot starve the loop
      const std::size_t want = std::min(store_book::wanted(c.s), sizeof buf);
      if (want == 0) return;
      const ssize_t k = ::recv(c.fd.get(), buf, want, MSG_DONTWAIT);
      if (k > 0) {
        book_.feed(c.s, buf, static_cast<std::size_t>(k));
        check(c);
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (k < 0 && errno == EINTR) continue;
      c.dead = true;
    }
  }

  /// Closes `c` with one log line when the protocol refused it.
  void check(conn& c) {
    if (c.s.refused.empty()) return;
    if (!c.s.authed) acceptor_.refuse(c.fd, c.from, c.s.refused);
    else
      log_line(rank_, "closed a store connection from " + c.from + " of this job: it sent " + c.s.refused +
                          "; every rank must run the same ddp version; the job goes on");
    c.dead = true;
  }

  static void flush(conn& c) {
    std::size_t sent = 0;
    while (sent < c.s.out.size()) {
      const ssize_t k = ::send(c.fd.get(), c.s.out.data() + sent, c.s.out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) { sent += static_cast<std::size_t>(k); continue; }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      c.dead = true;
      break;
    }
    c.s.out.erase(c.s.out.begin(), c.s.out.begin() + static_cast<std::ptrdiff_t>(sent));
  }

  handshake_acceptor acceptor_;
  store_book book_;
  int rank_;
  std::vector<std::unique_ptr<conn>> conns_;
};

}  // namespace ddp::tcp::detail
