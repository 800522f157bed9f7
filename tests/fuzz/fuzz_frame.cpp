// libFuzzer target: the mesh frame parser. The input is a peer's byte stream, delivered in reads whose
// sizes the first input byte chooses; the harness owns the stream as the engine does: it accepts every
// well-formed header's payload into a buffer of its own (up to 1 MiB; a longer frame ends the run, as a
// stray that large would be refused memory), describes the header, and stops where the reader ends.
//
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude tests/fuzz/fuzz_frame.cpp -o fuzz_frame
//   ./fuzz_frame tests/fuzz/corpus/frame

#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/comm/tcp/frame_reader.hpp>
#include <ddp/comm/tcp/protocol.hpp>

namespace {

constexpr std::uint64_t max_payload = 1 << 20;

/// Hands out the input in reads of `chunk` bytes, then end of stream.
struct stream {
  const std::uint8_t* data;
  std::size_t size;
  std::size_t chunk;
  std::size_t pos = 0;
  bool blocked = false;  ///< every other read would block, as a non-blocking socket does
  ssize_t operator()(char* buf, std::size_t n) {
    blocked = !blocked;
    if (blocked) {
      errno = EAGAIN;
      return -1;
    }
    const std::size_t k = std::min({n, chunk, size - pos});
    std::memcpy(buf, data + pos, k);
    pos += k;
    return static_cast<ssize_t>(k);
  }
};

void check(bool cond) {
  if (!cond) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  stream in{data + 1, size - 1, static_cast<std::size_t>(data[0] % 64) + 1};
  ddp::tcp::detail::frame_reader reader;
  std::vector<char> payload;
  bool moved = false;
  // Each round reads at least one byte or ends: the loop is bounded by the input's length.
  for (std::size_t round = 0; round <= 4 * size + 8; ++round) {
    const auto ev = reader.advance(in, moved);
    if (ev == ddp::tcp::detail::read_event::ended) {
      check(reader.ended());
      if (reader.state() == ddp::tcp::detail::read_state::corrupt) check(ddp::tcp::detail::malformed(reader.header()) != nullptr);
      return 0;
    }
    if (ev == ddp::tcp::detail::read_event::header) {
      const auto& h = reader.header();
      check(ddp::tcp::detail::malformed(h) == nullptr);
      const std::string what = ddp::tcp::detail::describe(h);
      check(!what.empty());
      if (h.length > max_payload) return 0;
      payload.assign(static_cast<std::size_t>(h.length), 0);
      reader.accept(payload.data());
    }
    if (ev == ddp::tcp::detail::read_event::payload) check(reader.state() == ddp::tcp::detail::read_state::header);
  }
  check(false);  // the reader made no progress
  return 0;
}
