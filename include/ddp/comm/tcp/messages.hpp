#pragma once
/// \file The sentences the socket path (engine_errors.hpp) and the shared-memory path (shm_channel.hpp) share,
/// so a peer lost, a mismatch, a timeout or an abort notice reads the same whichever path raised it.

#include <chrono>
#include <cstddef>
#include <string>

#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// How errors name a rank: its group rank, plus its world rank when the group is a subgroup.
inline std::string rank_label(std::size_t group_rank, int world_rank, bool subgroup) {
  return "rank " + std::to_string(group_rank) +
         (subgroup ? " (world rank " + std::to_string(world_rank) + ")" : std::string());
}

/// peer_lost on `rank`: `who` (world rank `peer`) was lost during `during`, `how` (e.g. "it closed its
/// communicator").
inline peer_lost lost_peer(const std::string& who, const std::string& during, const std::string& how, int rank,
                           int peer, int code = 0) {
  return peer_lost(who + " was lost during " + during + ": " + how +
                       ". Check that rank's log for the first error; the job cannot continue without it",
                   rank, peer, code);
}

/// mismatch_error on `rank`: `calls` names each rank's call ("rank 0 called ..., rank 1 sent ...").
inline mismatch_error different_calls(const std::string& calls, int rank) {
  return mismatch_error(calls + "; every rank must call the same collectives in the same order with the same "
                                "counts, dtypes, operators and roots",
                        rank);
}

/// timeout_error on `rank`: the call `what` did not complete within `timeout`, waiting for `waiting`.
inline timeout_error call_timeout(const std::string& what, std::chrono::milliseconds timeout,
                                  const std::string& waiting, int rank) {
  return timeout_error(what + " did not complete within " + std::to_string(timeout.count()) + " ms, waiting for " +
                           waiting +
                           ": a peer is stuck, dead or calling a different collective; check every rank's log, or "
                           "raise the timeout (config::timeout, DDP_TIMEOUT_MS)",
                       rank);
}

/// Raises on `rank` the error of the kind a peer's abort notice carries: `who` aborted `during` with `text`
/// (a peer_lost names `lost_rank`).
[[noreturn]] inline void raise_notice(abort_kind kind, const std::string& who, const std::string& during,
                                      const std::string& text, int rank, int lost_rank) {
  const std::string msg = who + " aborted " + during + ": " + text;
  switch (kind) {
    case abort_kind::peer_lost: throw peer_lost(msg, rank, lost_rank);
    case abort_kind::mismatch: throw mismatch_error(msg, rank);
    case abort_kind::timeout: throw timeout_error(msg, rank);
    case abort_kind::other: break;
  }
  throw error(msg, rank);
}

}  // namespace ddp::tcp::detail
