// The TCP engine's rooms in one process: the peer stream (frame_writer into a socketpair, frame_reader out
// of it, or out of memory) with partial reads and writes, a frame split at every byte boundary, garbage,
// oversized lengths and end of stream mid-frame; and point-to-point matching (mailbox).

#include <catch2/catch.hpp>

#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include <ddp/comm/tcp/frame_reader.hpp>
#include <ddp/comm/tcp/frame_writer.hpp>
#include <ddp/comm/tcp/matching.hpp>
#include <ddp/comm/tcp/socket.hpp>

using namespace ddp::tcp::detail;

namespace {

/// A connected pair of non-blocking stream sockets.
struct socket_pair {
  socket_fd a, b;
  socket_pair() {
    int fds[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) == 0);
    a = socket_fd(fds[0]);
    b = socket_fd(fds[1]);
  }
};

/// Reads out of a byte string, at most `chunk` bytes per read, then EAGAIN (or end of stream once `eof`).
struct memory_source {
  const std::vector<char>& bytes;
  std::size_t chunk;
  bool eof = false;
  std::size_t pos = 0;
  std::size_t limit = 0;  ///< bytes made available so far
  ssize_t operator()(char* buf, std::size_t n) {
    if (pos == limit) {
      if (eof && pos == bytes.size()) return 0;
      errno = EAGAIN;
      return -1;
    }
    const std::size_t k = std::min({n, chunk, limit - pos});
    std::memcpy(buf, bytes.data() + pos, k);
    pos += k;
    return static_cast<ssize_t>(k);
  }
};

frame_header collective_header(std::uint64_t length, std::uint64_t seq) {
  frame_header h;
  h.op = static_cast<std::uint8_t>(ddp::collective::all_reduce);
  h.type = static_cast<std::uint8_t>(ddp::dtype::u8);
  h.group = 7;
  h.seq = seq;
  h.count = length;
  h.length = length;
  return h;
}

std::vector<char> bytes_of(const frame_header& h, const std::vector<char>& payload) {
  std::vector<char> out(sizeof h + payload.size());
  std::memcpy(out.data(), &h, sizeof h);
  std::copy(payload.begin(), payload.end(), out.begin() + static_cast<std::ptrdiff_t>(sizeof h));
  return out;
}

std::vector<char> pattern(std::size_t n, int seed) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 31 + static_cast<std::size_t>(seed)) & 0xff);
  return v;
}

}  // namespace

TEST_CASE("peer stream: frames written into a socketpair come out whole, through partial writes and reads",
          "[tcp][stream][fast]") {
  socket_pair s;
  int small_buffer = 4096;  // forces partial writes of the 1 MiB payload
  ::setsockopt(s.a.get(), SOL_SOCKET, SO_SNDBUF, &small_buffer, sizeof small_buffer);
  const std::vector<char> big = pattern(std::size_t{1} << 20, 1), tiny = pattern(3, 2);
  frame_writer w;
  w.push({collective_header(big.size(), 0), big.data(), 0, nullptr, {}});
  w.push({collective_header(0, 1), nullptr, 0, nullptr, {}});
  w.push({collective_header(tiny.size(), 2), tiny.data(), 0, nullptr, {}});
  frame_reader r;
  std::vector<std::vector<char>> got;
  std::vector<char> dest;
  const auto from_socket = [&](char* buf, std::size_t n) { return ::recv(s.b.get(), buf, std::min<std::size_t>(n, 1000), MSG_DONTWAIT); };
  int partial_writes = 0;
  for (int round = 0; round < 100000 && got.size() < 3; ++round) {
    int failure = 0;
    if (w.pending() && w.write_some(s.a.get(), failure) && w.pending()) ++partial_writes;
    REQUIRE(failure == 0);
    bool moved = false;
    for (read_event ev = r.advance(from_socket, moved); ev != read_event::blocked; ev = r.advance(from_socket, moved)) {
      REQUIRE(ev != read_event::ended);
      if (ev == read_event::header) {
        dest.assign(r.header().length, 0);
        r.accept(dest.data());
      } else {
        CHECK(r.header().seq == got.size());
        got.push_back(dest);
      }
    }
  }
  REQUIRE(got.size() == 3);
  CHECK(partial_writes > 0);
  CHECK(got[0] == big);
  CHECK(got[1].empty());
  CHECK(got[2] == tiny);
  CHECK_FALSE(w.pending());
  CHECK(r.state() == read_state::header);
}

TEST_CASE("peer stream: a frame split at every byte boundary is read the same", "[tcp][stream][fast]") {
  const std::vector<char> payload = pattern(57, 3);
  std::vector<char> wire = bytes_of(collective_header(payload.size(), 4), payload);
  for (std::size_t cut = 0; cut <= wire.size(); ++cut) {
    CAPTURE(cut);
    memory_source src{wire, wire.size()};
    src.limit = cut;
    frame_reader r;
    std::vector<char> dest(payload.size());
    bool moved = false;
    int headers = 0, payloads = 0;
    for (int phase = 0; phase < 2; ++phase) {
      for (read_event ev = r.advance(src, moved); ev != read_event::blocked; ev = r.advance(src, moved)) {
        if (ev == read_event::header) {
          ++headers;
          r.accept(dest.data());
        } else if (ev == read_event::payload) {
          ++payloads;
        }
      }
      CHECK(r.mid_frame() == (phase == 0 && cut > 0 && cut < wire.size()));
      src.limit = wire.size();  // the rest arrives
    }
    CHECK(headers == 1);
    CHECK(payloads == 1);
    CHECK(dest == payload);
  }
}

TEST_CASE("peer stream: garbage, oversized lengths and malformed control frames end the stream as corrupt",
          "[tcp][stream][fast]") {
  frame_header h = collective_header(16, 0);
  SECTION("wrong magic") { h.magic = 0x12345678; }
  SECTION("a length beyond the frame limit") { h.length = max_frame_bytes + 1; }
  SECTION("an abort notice beyond its limit") {
    h.op = op_abort;
    h.length = max_abort_text + 1;
  }
  SECTION("an acknowledgement with a payload") {
    h.op = op_ack;
    h.length = 8;
  }
  SECTION("an unknown op") { h.op = 150; }
  SECTION("a remote frame of the wrong length") {
    h.flags = frame_remote;
    h.length = 24;
  }
  const std::vector<char> wire = bytes_of(h, pattern(16, 5));
  memory_source src{wire, 7};
  src.limit = wire.size();
  frame_reader r;
  bool moved = false;
  read_event ev = read_event::blocked;
  for (int i = 0; i < 100 && (ev = r.advance(src, moved)) == read_event::blocked; ++i) {
  }
  CHECK(ev == read_event::ended);
  CHECK(r.state() == read_state::corrupt);
  CHECK(malformed(r.header()) != nullptr);
  CHECK(src.pos == sizeof(frame_header));  // not a payload byte was read
}

TEST_CASE("peer stream: end of stream mid-frame is told apart from an orderly end and a goodbye", "[tcp][stream][fast]") {
  const std::vector<char> payload = pattern(10, 6);
  std::vector<char> wire = bytes_of(collective_header(payload.size(), 0), payload);
  frame_header bye;
  bye.op = op_bye;
  const std::size_t cut = GENERATE(std::size_t{0}, std::size_t{5}, std::size_t{40}, std::size_t{45}, std::size_t{50});
  const bool goodbye = cut == 50;
  if (goodbye) wire = bytes_of(bye, {});
  CAPTURE(cut);
  const std::vector<char> prefix(wire.begin(), wire.begin() + static_cast<std::ptrdiff_t>(std::min(cut, wire.size())));
  memory_source src{prefix, 3, true};
  src.limit = prefix.size();
  frame_reader r;
  std::vector<char> dest(payload.size());
  bool moved = false;
  read_event ev = read_event::blocked;
  for (int i = 0; i < 100 && ev != read_event::ended; ++i) {
    ev = r.advance(src, moved);
    if (ev == read_event::header) r.accept(dest.data());
  }
  REQUIRE(ev == read_event::ended);
  CHECK(r.state() == (goodbye ? read_state::said_bye : read_state::closed));
  CHECK(r.mid_frame() == (cut > 0 && !goodbye));
}

TEST_CASE("matching: a send meets the oldest recv of its group and tag, early sends wait as strays", "[tcp][p2p][fast]") {
  const auto done = [] { return std::make_shared<ddp::detail::completion>(0, std::chrono::milliseconds(1000), "recv"); };
  frame_header send;
  send.op = static_cast<std::uint8_t>(ddp::collective::send_recv);
  send.type = static_cast<std::uint8_t>(ddp::dtype::i32);
  send.count = 4;
  send.group = 9;
  send.tag = 5;
  const auto now = clock::now();
  mailbox m;
  posted_recv first{9, 5, send, nullptr, done(), now + std::chrono::seconds(1), {}};
  posted_recv other_tag{9, 6, send, nullptr, done(), now + std::chrono::seconds(1), {}};
  posted_recv other_group{8, 5, send, nullptr, done(), now + std::chrono::seconds(1), {}};
  posted_recv second{9, 5, send, nullptr, done(), now + std::chrono::seconds(2), {}};
  const auto* first_done = first.done.get();
  const auto* second_done = second.done.get();
  m.post(first);
  m.post(other_tag);
  m.post(other_group);
  m.post(second);
  auto a = m.take_recv(send);
  REQUIRE(a.has_value());
  CHECK(a->done.get() == first_done);
  CHECK(fits(*a, send));
  auto b = m.take_recv(send);
  REQUIRE(b.has_value());
  CHECK(b->done.get() == second_done);
  CHECK_FALSE(m.take_recv(send).has_value());

  frame_header wrong = send;
  wrong.count = 5;
  CHECK_FALSE(fits(*a, wrong));

  m.keep({send, std::vector<char>{1, 2}});
  m.keep({send, std::vector<char>{3}});
  CHECK_FALSE(m.take_stray(9, 6).has_value());
  auto s1 = m.take_stray(9, 5);
  auto s2 = m.take_stray(9, 5);
  REQUIRE(s1.has_value());
  REQUIRE(s2.has_value());
  CHECK(s1->data == std::vector<char>{1, 2});  // in arrival order
  CHECK(s2->data == std::vector<char>{3});

  // The two recvs left (tags 6 and group 8) expire at their deadline, failing with the error made for each.
  CHECK(m.waiting());
  CHECK(m.next_deadline() == now + std::chrono::seconds(1));
  int expired = 0;
  m.expire(now, [&](const posted_recv&) { return std::exception_ptr(); });
  CHECK(m.waiting());
  m.expire(now + std::chrono::seconds(1), [&](const posted_recv&) {
    ++expired;
    return std::make_exception_ptr(std::runtime_error("expired"));
  });
  CHECK(expired == 2);
  CHECK_FALSE(m.waiting());
}
