#pragma once
/// \file Settings of ddp::local: how long an operation may wait, and how long a wait polls before it sleeps.

#include <chrono>

#include <ddp/comm/env.hpp>

namespace ddp::local {

/// Settings of the ranks of one ddp::local::run, shared by every group split from its world.
struct config {
  /// How long wait() waits before it raises ddp::timeout_error (DDP_TIMEOUT_MS overrides it in config_from_env).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// How long a wait polls for its peers before it sleeps on a condition variable (a short collective then costs
  /// no wake-up; a long one no core).
  std::chrono::microseconds spin{50};
  /// How long a polling wait keeps its core before it yields it between polls (at once where the ranks outnumber
  /// the cores): a peer's thread may need it. ddp::tcp's shared-memory barrier does the same.
  std::chrono::microseconds yield_after{5};
};

/// `cfg` with the environment's DDP_TIMEOUT_MS applied, as the other backends read it.
inline config config_from_env(config cfg = {}) {
  if (auto ms = ddp::detail::env_integer("DDP_TIMEOUT_MS", 1, 1LL << 40, "the operation timeout in milliseconds"))
    cfg.timeout = std::chrono::milliseconds(*ms);
  return cfg;
}

}  // namespace ddp::local
