#pragma once
/// \file The receiving half of a peer stream: a state machine that cuts a byte stream into frames. It reads
/// a header, stops while its owner decides where the payload goes (a collective frame waits there for its
/// call), reads the payload straight into that place, and starts over. It never blocks and never allocates:
/// the bytes come from a read function (a non-blocking socket, or memory in tests and the fuzz target).
///
///   header --40 bytes, well formed--> holding --accept(dest)--> payload --length bytes--> header
///   header --a goodbye--> said_bye;   any --end of stream or read error--> closed
///   header --malformed header--> corrupt   (holding with a zero length: accept() goes straight to header)

#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

#include <ddp/comm/tcp/protocol.hpp>

namespace ddp::tcp::detail {

/// Where a peer stream's reader stands.
enum class read_state : std::uint8_t {
  header,    ///< reading a frame header (header_bytes() of 40 so far)
  holding,   ///< a whole, well-formed header is here; its payload waits for accept()
  payload,   ///< reading the accepted frame's payload into its destination
  said_bye,  ///< the peer said goodbye (op_bye): it closed its communicator; nothing more is read
  closed,    ///< end of stream or a read error: nothing more is read
  corrupt,   ///< a malformed header arrived (malformed() says why): the stream cannot be trusted
};

/// What one call of frame_reader::advance() ended with.
enum class read_event : std::uint8_t {
  blocked,  ///< no more bytes now (or the reader is holding a header): poll and come back
  header,   ///< a whole header: inspect header(), then accept() it or keep holding
  payload,  ///< the accepted frame's payload is complete (header() still describes it)
  ended,    ///< the stream ended: said_bye, closed or corrupt
};

class frame_reader {
 public:
  [[nodiscard]] read_state state() const { return state_; }
  /// The header being read, held or whose payload is being read.
  [[nodiscard]] const frame_header& header() const { return header_; }
  /// Bytes of the current header read so far (state header).
  [[nodiscard]] std::size_t header_bytes() const { return header_got_; }
  /// True when part of a frame has arrived and the rest has not: an end of stream now loses data.
  [[nodiscard]] bool mid_frame() const {
    if (ended()) return cut_;
    return (state_ == read_state::header && header_got_ > 0) || state_ == read_state::holding ||
           state_ == read_state::payload;
  }
  /// True once nothing more will be read.
  [[nodiscard]] bool ended() const {
    return state_ == read_state::said_bye || state_ == read_state::closed || state_ == read_state::corrupt;
  }
  /// The errno of the read that closed the stream (0: an orderly end of stream).
  [[nodiscard]] int error_code() const { return error_; }

  /// holding -> payload: the payload (header().length bytes) goes to `dest`. A zero-length frame completes
  /// at once (the next advance() reports its payload event).
  void accept(char* dest) {
    dest_ = dest;
    payload_got_ = 0;
    state_ = read_state::payload;
  }

  /// Marks the stream ended from outside (the owner read an abort notice itself, or gave up on the peer).
  void close() { state_ = read_state::closed; }

  /// Reads until an event: `read(buf, n)` returns bytes read (> 0), 0 at end of stream, or -1 with errno
  /// (EAGAIN: no bytes now). `moved` is set when any byte arrived.
  template <class Read>
  read_event advance(Read&& read, bool& moved) {
    while (true) {
      switch (state_) {
        case read_state::holding: return read_event::blocked;
        case read_state::said_bye:
        case read_state::closed:
        case read_state::corrupt: return read_event::ended;
        case read_state::header:
          if (!take(read, reinterpret_cast<char*>(&header_) + header_got_, sizeof(frame_header) - header_got_,
                    header_got_, moved))
            return ended() ? read_event::ended : read_event::blocked;
          if (header_got_ < sizeof(frame_header)) continue;
          header_got_ = 0;
          if (malformed(header_) != nullptr) {
            state_ = read_state::corrupt;
            return read_event::ended;
          }
          if (header_.op == op_bye) {
            state_ = read_state::said_bye;
            return read_event::ended;
          }
          state_ = read_state::holding;
          return read_event::header;
        case read_state::payload:
          if (payload_got_ == header_.length) {
            state_ = read_state::header;
            return read_event::payload;
          }
          if (!take(read, dest_ + payload_got_, static_cast<std::size_t>(header_.length - payload_got_), payload_got_,
                    moved))
            return ended() ? read_event::ended : read_event::blocked;
          continue;
      }
    }
  }

 private:
  /// One read of at most `want` bytes into `where`; false when none arrived (blocked or ended).
  template <class Read>
  bool take(Read& read, char* where, std::size_t want, auto& got, bool& moved) {
    while (true) {
      const ssize_t k = read(where, want);
      if (k > 0) {
        got += static_cast<std::size_t>(k);
        moved = true;
        return true;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
      error_ = k < 0 ? errno : 0;
      cut_ = state_ == read_state::payload || header_got_ > 0;
      state_ = read_state::closed;
      return false;
    }
  }

  read_state state_ = read_state::header;
  frame_header header_;
  std::size_t header_got_ = 0;
  char* dest_ = nullptr;
  std::uint64_t payload_got_ = 0;
  int error_ = 0;
  bool cut_ = false;  ///< the stream ended inside a frame
};

}  // namespace ddp::tcp::detail
