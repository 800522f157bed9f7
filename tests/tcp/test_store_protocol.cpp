// The store's protocol (store_book) driven from memory: handshakes, requests, parked gets, malformed input,
// how much a session may buffer, and `add` at the ends of the 64-bit range (built with UBSan).

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <ddp/comm/tcp/store.hpp>

namespace d = ddp::tcp::detail;

namespace {

const d::job_key token = d::job_key_of("store-protocol");

/// A hello signed under `k` for a session's challenge `nonce` (a session's own is all zeros until a server sets it).
std::vector<std::uint8_t> hello(const d::job_key& k = token, const d::challenge& nonce = {}) {
  const d::store_hello h = d::signed_hello(d::store_hello{}, k, "store", nonce);
  std::vector<std::uint8_t> b(sizeof h);
  std::memcpy(b.data(), &h, sizeof h);
  return b;
}

std::vector<std::uint8_t> request(d::store_cmd cmd, const std::string& key, const void* value, std::size_t n) {
  const d::store_request r{cmd, {}, static_cast<std::uint32_t>(key.size()), n};
  std::vector<std::uint8_t> b(sizeof r);
  std::memcpy(b.data(), &r, sizeof r);
  b.insert(b.end(), key.begin(), key.end());
  const auto* v = static_cast<const std::uint8_t*>(value);
  b.insert(b.end(), v, v + n);
  return b;
}

void feed(d::store_book& book, d::store_session& s, const std::vector<std::uint8_t>& bytes) {
  book.feed(s, bytes.data(), bytes.size());
}

/// The session's answers, emptied.
std::vector<std::uint8_t> take(d::store_session& s) { return std::exchange(s.out, {}); }

std::int64_t add(d::store_book& book, d::store_session& s, const std::string& key, std::int64_t delta) {
  feed(book, s, request(d::store_cmd::add, key, &delta, 8));
  const auto out = take(s);
  REQUIRE(out.size() == 8);
  std::int64_t now = 0;
  std::memcpy(&now, out.data(), 8);
  return now;
}

}  // namespace

TEST_CASE("the store protocol authenticates, answers set get add, and parks a get until the set", "[tcp][store]") {
  d::store_book book(token);
  d::store_session a, b;
  feed(book, a, hello());
  feed(book, b, hello());
  CHECK(take(a) == std::vector<std::uint8_t>{1});
  CHECK(take(b) == std::vector<std::uint8_t>{1});
  feed(book, b, request(d::store_cmd::get, "late", nullptr, 0));
  CHECK(b.parked);
  CHECK(d::store_book::wanted(b) == 0);  // nothing is read from a parked session
  const char value[] = "here";
  feed(book, a, request(d::store_cmd::set, "late", value, 4));
  CHECK(take(a) == std::vector<std::uint8_t>{1});
  const auto got = take(b);
  REQUIRE(got.size() == 12);
  CHECK(std::string(got.begin() + 8, got.end()) == "here");
  CHECK_FALSE(b.parked);
  CHECK(add(book, a, "n", 5) == 5);
  CHECK(add(book, b, "n", -2) == 3);
}

TEST_CASE("an abort answers every waiting and later get of a missing key with its text", "[tcp][store]") {
  d::store_book book(token);
  d::store_session a, b, c;
  for (auto* s : {&a, &b, &c}) {
    feed(book, *s, hello());
    take(*s);
  }
  const char value[] = "v";
  feed(book, a, request(d::store_cmd::set, "present", value, 1));
  take(a);
  feed(book, b, request(d::store_cmd::get, "never", nullptr, 0));
  CHECK(b.parked);
  const std::string why = "WORLD_SIZE differs";
  feed(book, a, request(d::store_cmd::set, d::store_abort_key, why.data(), why.size()));
  CHECK(take(a) == std::vector<std::uint8_t>{1});
  const auto aborted = [&](const std::vector<std::uint8_t>& got) {
    REQUIRE(got.size() == 16 + why.size());
    std::uint64_t marker = 0, n = 0;
    std::memcpy(&marker, got.data(), 8);
    std::memcpy(&n, got.data() + 8, 8);
    CHECK(marker == d::store_abort_reply);
    CHECK(n == why.size());
    CHECK(std::string(got.begin() + 16, got.end()) == why);
  };
  CHECK_FALSE(b.parked);  // the waiting get was answered
  aborted(take(b));
  feed(book, c, request(d::store_cmd::get, "also_never", nullptr, 0));
  CHECK_FALSE(c.parked);  // a later one is answered at once
  aborted(take(c));
  feed(book, c, request(d::store_cmd::get, "present", nullptr, 0));  // a key that is set still reads
  const auto got = take(c);
  REQUIRE(got.size() == 9);
  CHECK(got[8] == 'v');
}

TEST_CASE("a session never wants more than its next message", "[tcp][store][limits]") {
  d::store_book book(token);
  d::store_session s;
  CHECK(d::store_book::wanted(s) == sizeof(d::store_hello));
  const auto h = hello();
  book.feed(s, h.data(), 10);
  CHECK(d::store_book::wanted(s) == sizeof(d::store_hello) - 10);
  book.feed(s, h.data() + 10, h.size() - 10);
  CHECK(d::store_book::wanted(s) == sizeof(d::store_request));
  const auto r = request(d::store_cmd::set, "key", "value", 5);
  book.feed(s, r.data(), sizeof(d::store_request));
  CHECK(d::store_book::wanted(s) == 8);  // "key" and "value"
  book.feed(s, r.data() + sizeof(d::store_request), 8);
  CHECK(s.in.empty());
  CHECK(d::store_book::wanted(s) == sizeof(d::store_request));
}

TEST_CASE("strangers and malformed requests are refused, each with its reason", "[tcp][store]") {
  d::store_book book(token);
  SECTION("a wrong token") {
    d::store_session s;
    feed(book, s, hello(d::job_key_of("another job")));
    CHECK(s.refused == "wrong job token");
    CHECK_FALSE(s.authed);
    CHECK(s.out.empty());
  }
  SECTION("a hello signed for another connection's challenge: a recorded handshake replayed") {
    d::store_session s;
    s.nonce = d::random_challenge();
    feed(book, s, hello(token, d::random_challenge()));
    CHECK(s.refused == "wrong job token");
  }
  SECTION("the right key's hello for this challenge, but signed for the mesh or the launchers") {
    d::store_session s;
    s.nonce = d::random_challenge();
    for (const char* context : {"mesh", "launch"}) {
      const d::store_hello h = d::signed_hello(d::store_hello{}, token, context, s.nonce);
      CHECK_FALSE(d::is_signed(h, token, "store", s.nonce));
    }
    d::store_hello h = d::signed_hello(d::store_hello{}, token, "mesh", s.nonce);
    book.feed(s, reinterpret_cast<const std::uint8_t*>(&h), sizeof h);
    CHECK(s.refused == "wrong job token");
  }
  SECTION("a version-1 hello, which carried the token's hash") {
    d::store_session s;
    const d::store_hello h{d::store_magic, 1, 0x1234};
    book.feed(s, reinterpret_cast<const std::uint8_t*>(&h), sizeof h);
    CHECK(s.refused == "its handshake is version 1, this store's 2 (another ddp release)");
  }
  SECTION("garbage") {
    d::store_session s;
    const std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    book.feed(s, reinterpret_cast<const std::uint8_t*>(junk.data()), junk.size());
    CHECK(s.refused == "its first bytes are not a ddp handshake");
    CHECK(d::store_book::wanted(s) == 0);
  }
  SECTION("a malformed request from a session of this job names what is wrong") {
    d::store_session s;
    feed(book, s, hello());
    auto r = request(d::store_cmd::get, "k", nullptr, 0);
    r[0] = 9;
    feed(book, s, r);
    CHECK(s.authed);
    CHECK(s.refused == "a request with unknown command 9");
  }
  SECTION("a key over the limit is refused from its header, before any of it is buffered") {
    d::store_session s;
    feed(book, s, hello());
    const d::store_request r{d::store_cmd::set, {}, d::max_store_key + 1, 0};
    book.feed(s, reinterpret_cast<const std::uint8_t*>(&r), sizeof r);
    CHECK(s.refused == "a key of 4097 bytes (at most 4096)");
  }
}

TEST_CASE("add wraps around at the ends of the 64-bit range instead of overflowing", "[tcp][store]") {
  d::store_book book(token);
  d::store_session s;
  feed(book, s, hello());
  take(s);
  constexpr auto max = std::numeric_limits<std::int64_t>::max();
  constexpr auto min = std::numeric_limits<std::int64_t>::min();
  CHECK(add(book, s, "n", max) == max);
  CHECK(add(book, s, "n", 1) == min);
  CHECK(add(book, s, "n", -1) == max);
  CHECK(add(book, s, "m", min) == min);
  CHECK(add(book, s, "m", min) == 0);
}

TEST_CASE("the handshakes' MAC is SipHash-2-4: the reference vectors", "[tcp][store]") {
  std::uint8_t m[64];
  for (int i = 0; i < 64; ++i) m[i] = static_cast<std::uint8_t>(i);
  const std::uint64_t k0 = 0x0706050403020100ULL, k1 = 0x0f0e0d0c0b0a0908ULL;  // key bytes 00..0f
  CHECK(d::siphash24(k0, k1, m, 0) == 0x726fdb47dd0e0e31ULL);
  CHECK(d::siphash24(k0, k1, m, 15) == 0xa129ca6149be45e5ULL);
  CHECK(d::siphash24(k0, k1, m, 63) == 0x958a324ceb064572ULL);
  CHECK(d::job_key_of("a") != d::job_key_of("b"));
  CHECK(d::job_key_of("") != d::job_key_of("a"));
}
