#pragma once
/// \file What one operation is: the description every backend's checks, messages and cross-rank call check use.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::detail {

/// One operation as the collective front end saw it: "all_reduce(sum) of 1024 f32 in an MPI group of 4 (sequence 17)".
struct call_info {
  collective kind = collective::barrier;
  const char* name = "barrier";         ///< "all_reduce", ..., "send", "recv"
  std::optional<reduce_op> op{};        ///< the caller's operator (avg stays avg here)
  dtype type = dtype::u8;
  std::size_t count = 0;                ///< elements per rank: the same on every rank of a matching call
  int peer = -1;                        ///< root, or the other rank of a send/recv; -1 where none
  int tag = -1;                         ///< send/recv tag; -1 for collectives
  std::optional<std::uint64_t> sequence{};  ///< the group's count of operations before this one, where kept
  int group_size = 1;
  std::string_view group = "a group";   ///< "an MPI group", "an NCCL group", "a TCP group"
  int device = -1;                      ///< the CUDA device of the group, -1 for host backends
  raw_tensor average{};                 ///< avg the backend finishes: divide this buffer by group_size when done

  /// True for a recv (cancelled when dropped incomplete).
  [[nodiscard]] bool receive() const noexcept { return std::string_view(name) == "recv"; }
};

/// The call alone, without its group: "broadcast of 8 f32 rooted at rank 1", "recv of 4 f32 from rank 0 tag 7".
inline std::string describe_call(const call_info& c) {
  std::string s = c.name;
  if (c.op) s += "(" + std::string(to_string(*c.op)) + ")";
  if (c.kind != collective::barrier) s += " of " + std::to_string(c.count) + " " + std::string(to_string(c.type));
  if (c.kind == collective::send_recv)
    s += (c.receive() ? " from rank " : " to rank ") + std::to_string(c.peer) + " tag " + std::to_string(c.tag);
  else if (c.peer >= 0)
    s += " rooted at rank " + std::to_string(c.peer);
  return s;
}

/// The phrase naming an operation in messages, with its group, device and sequence number.
inline std::string describe(const call_info& c) {
  std::string s = describe_call(c) + " in " + std::string(c.group) + " of " + std::to_string(c.group_size);
  if (c.device >= 0) s += " on cuda:" + std::to_string(c.device);
  if (c.sequence) s += " (sequence " + std::to_string(*c.sequence) + ")";
  return s;
}

}  // namespace ddp::detail
