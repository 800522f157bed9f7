// libFuzzer target: the rendezvous store's protocol (store_book) from memory, driven the way store_server
// drives it: four client sessions, each read at most as far as its next message (store_book::wanted).
//
// Input: chunks of [control byte][length, 2 bytes little-endian][that many bytes] (a short last chunk takes
// what is left). Control bits 0-1 pick the session; bit 7 closes it first (a fresh one takes its place); bit 6
// makes the session's client hold the job's key: the MAC of its hello is set to what its challenge (all zeros
// here) asks, as a rank's would be, so the fuzzer reaches the requests; without it the hello goes as the input
// has it, as a stranger's. The bytes join what that session's client has sent. Seeds: corpus/store/, recorded
// from a real rendezvous by record_store_corpus (job token "fuzz-corpus"; every chunk with bit 6).

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ddp/comm/tcp/store.hpp>

namespace d = ddp::tcp::detail;

namespace {

/// A client as the server sees it: bytes it sent that the server has not read yet, and its session.
struct client {
  std::vector<std::uint8_t> unread;
  d::store_session session;
  bool holds_key = false;  ///< signs its hello (control bit 6)
};

const d::job_key fuzz_key = d::job_key_of("fuzz-corpus");

/// Stops the run (libFuzzer reports it as a crash) when an invariant of the store does not hold.
void require(bool cond) {
  if (!cond) std::abort();
}

/// Reads like store_server: at most what the next message needs, until the session waits or is refused.
void pump(d::store_book& book, client& c) {
  if (c.holds_key && !c.session.authed && c.session.in.empty() && c.unread.size() >= sizeof(d::store_hello)) {
    d::store_hello h;
    std::memcpy(&h, c.unread.data(), sizeof h);
    h = d::signed_hello(h, fuzz_key, "store", c.session.nonce);
    std::memcpy(c.unread.data(), &h, sizeof h);
  }
  for (std::size_t want = d::store_book::wanted(c.session); want > 0 && !c.unread.empty();
       want = d::store_book::wanted(c.session)) {
    const std::size_t n = std::min(want, c.unread.size());
    book.feed(c.session, c.unread.data(), n);
    c.unread.erase(c.unread.begin(), c.unread.begin() + static_cast<std::ptrdiff_t>(n));
    const auto& s = c.session;
    // Before its handshake is accepted a stranger gets no answer and buffers at most the handshake;
    // afterwards a session buffers at most one message.
    require(s.authed || (s.out.empty() && s.in.size() <= sizeof(d::store_hello)));
    require(s.in.size() <= sizeof(d::store_request) + d::max_store_key + d::max_store_value);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  d::store_book book(fuzz_key);
  std::array<client, 4> clients;
  for (std::size_t pos = 0; pos < size;) {
    const std::uint8_t control = data[pos++];
    std::size_t n = 0;
    if (pos < size) n = data[pos++];
    if (pos < size) n |= static_cast<std::size_t>(data[pos++]) << 8;
    n = std::min(n, size - pos);
    client& c = clients[control & 3];
    if (control & 0x80) {
      book.close(c.session);
      c = client{};
    }
    c.holds_key = c.holds_key || (control & 0x40) != 0;
    c.unread.insert(c.unread.end(), data + pos, data + pos + n);
    pos += n;
    for (auto& each : clients) pump(book, each);  // a set or add may have answered a parked get
    for (auto& each : clients) each.session.out.clear();  // sent
  }
  for (auto& c : clients) book.close(c.session);
  return 0;
}
