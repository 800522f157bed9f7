#pragma once
/// \file The wire protocol of the mesh, in one place: the handshake a connecting rank sends, and the frames
/// every message travels in (a fixed header, then a bounded payload). A receiver checks each header against
/// the call it is executing, so ranks that call different collectives fail with ddp::mismatch_error instead
/// of corrupting each other's buffers. The store's own messages are defined in store.hpp.

#include <cstdint>
#include <string>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/dtype.hpp>

namespace ddp::tcp::detail {

// ---- the mesh handshake -----------------------------------------------------------------------------

inline constexpr std::uint32_t mesh_magic = 0x4d504444;  ///< "DDPM": first bytes on a mesh connection
inline constexpr std::uint32_t mesh_version = 2;         ///< bumped whenever the frames change incompatibly

/// First message on a mesh connection, from the connecting (higher) rank, after the acceptor's challenge;
/// answered by one byte, 1 if accepted.
struct mesh_hello {
  std::uint32_t magic = mesh_magic;
  std::uint32_t rank = 0;
  std::uint32_t size = 0;
  std::uint32_t version = mesh_version;
  std::uint64_t mac = 0;  ///< signed_hello's MAC under the job's key, context "mesh"
};
static_assert(sizeof(mesh_hello) == 24, "ddp: the mesh handshake must stay 24 bytes; it is the wire format.");

// ---- frames ----------------------------------------------------------------------------------------

inline constexpr std::uint32_t frame_magic = 0x46504444;  ///< "DDPF": first bytes of every frame

/// Control frames, numbered outside ddp::collective.
inline constexpr std::uint8_t op_abort = 200;  ///< the sender failed; payload: its message; flags: abort_kind
inline constexpr std::uint8_t op_bye = 201;    ///< the sender closed its communicator
inline constexpr std::uint8_t op_ack = 202;    ///< the sender has copied one of the receiver's remote frames
/// The sender has waited a while in the call this header describes (its op in `flags`), so a receiver in
/// another call at the same step raises mismatch_error instead of waiting for the timeout.
inline constexpr std::uint8_t op_waiting = 203;
/// Data, or room, waits for the receiver in a shared-memory ring (shm_rings.hpp): its engine sleeps in poll.
inline constexpr std::uint8_t op_ring = 204;

inline constexpr std::uint64_t max_abort_text = 4096;           ///< longest abort message carried
inline constexpr std::uint64_t max_frame_bytes = std::uint64_t{1} << 40;  ///< longer payloads mean a corrupt stream

/// Kinds of error an abort frame carries, so the receiver raises the same type.
enum class abort_kind : std::uint8_t { other, peer_lost, mismatch, timeout };

/// Flag of a collective frame whose payload is a remote_block: the receiver, on the same host, copies
/// the data straight out of the sender's memory (process_vm_readv) and answers with an op_ack frame.
inline constexpr std::uint8_t frame_remote = 1;

/// The header of every frame (40 bytes, host byte order: the mesh connects ranks of one architecture).
struct frame_header {
  std::uint32_t magic = frame_magic;
  std::uint8_t op = 0;        ///< ddp::collective, or a control op (op_abort, op_bye, op_ack, op_waiting, op_ring)
  std::uint8_t type = 0;      ///< ddp::dtype
  std::uint8_t reduce = 0;    ///< ddp::reduce_op (0 where none applies)
  std::uint8_t flags = 0;     ///< abort_kind (op_abort), frame_remote (collectives), the call's op (op_waiting)
  union {                     // one word, named by the frame's kind; -1 where none applies
    std::int32_t root = -1;   ///< broadcast, reduce, gather, scatter: the root's group rank
    std::int32_t tag;         ///< send/recv: the tag both sides matched on
    std::int32_t lost_rank;   ///< op_abort of kind peer_lost: the world rank that was lost
  };
  std::uint32_t group = 0;    ///< the group's identifier (split gives each subgroup its own)
  std::uint64_t seq = 0;      ///< the call's sequence number in its group (0 for send/recv, matched by tag)
  std::uint64_t count = 0;    ///< the call's element count
  std::uint64_t length = 0;   ///< payload bytes following this header
};
static_assert(sizeof(frame_header) == 40, "ddp: the frame header must stay 40 bytes; it is the wire format.");

/// An abort frame's header and its message (header.length bytes), ready to send.
struct abort_notice {
  frame_header header;
  std::string text;
};

/// Where a remote frame's data lies in the sender's address space.
struct remote_block {
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
};

/// True for ops whose description names a reduce operator.
constexpr bool has_reduce(std::uint8_t op) {
  return op == static_cast<std::uint8_t>(collective::all_reduce) ||
         op == static_cast<std::uint8_t>(collective::reduce_scatter) ||
         op == static_cast<std::uint8_t>(collective::reduce);
}

/// True for ops whose description names a root.
constexpr bool has_root(std::uint8_t op) {
  return op == static_cast<std::uint8_t>(collective::broadcast) || op == static_cast<std::uint8_t>(collective::reduce) ||
         op == static_cast<std::uint8_t>(collective::gather) || op == static_cast<std::uint8_t>(collective::scatter);
}

/// Why a header cannot start a well-formed frame, or nullptr: wrong magic, unknown op, or a payload length
/// its kind cannot have. The receiver checks this before it reads a payload byte.
inline const char* malformed(const frame_header& h) {
  if (h.magic != frame_magic) return "bytes that are not a ddp frame";
  if (h.op == op_abort) return h.length > max_abort_text ? "an abort notice longer than its limit" : nullptr;
  if (h.op == op_bye || h.op == op_ack || h.op == op_waiting || h.op == op_ring)
    return h.length != 0 ? "a control frame with a payload" : nullptr;
  if (h.op >= collective_count) return "a frame of unknown kind";
  if ((h.flags & frame_remote) != 0 && h.length != sizeof(remote_block)) return "a remote frame of the wrong length";
  return h.length > max_frame_bytes ? "a frame longer than the frame limit" : nullptr;
}

/// "all_reduce(sum) of 1024 f32 (seq 17)", "broadcast of 8 f32 from root 1 (seq 3)", "send of 4 i32 with tag 7 (seq 0)".
inline std::string describe(const frame_header& h) {
  if (h.op == op_abort) return "an abort notice";
  if (h.op == op_bye) return "a goodbye (it closed its communicator)";
  if (h.op == op_ack) return "an acknowledgement of a same-host copy";
  if (h.op == op_waiting) return "a notice that it waits";
  if (h.op == op_ring) return "a notice that a shared-memory ring waits";
  if (h.op >= collective_count) return "a frame of unknown kind " + std::to_string(h.op);
  const auto c = static_cast<collective>(h.op);
  std::string s = c == collective::send_recv ? "send" : std::string(to_string(c));
  if (has_reduce(h.op)) s += "(" + std::string(to_string(static_cast<reduce_op>(h.reduce))) + ")";
  if (c != collective::barrier)
    s += " of " + std::to_string(h.count) + " " + std::string(to_string(static_cast<dtype>(h.type)));
  if (has_root(h.op)) s += " from root " + std::to_string(h.root);
  if (c == collective::send_recv) s += " with tag " + std::to_string(h.tag);
  return s + " (seq " + std::to_string(h.seq) + ")";
}

/// True when `got` belongs to the call `want` describes (the payload length is checked separately).
inline bool same_call(const frame_header& want, const frame_header& got) {
  return got.op == want.op && got.type == want.type && got.reduce == want.reduce && got.root == want.root &&
         got.group == want.group && got.seq == want.seq && got.count == want.count;
}

}  // namespace ddp::tcp::detail
