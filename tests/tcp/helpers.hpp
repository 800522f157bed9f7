#pragma once
// Helpers shared by the ddp::tcp tests: expectations inside forked ranks, job options (free ports:
// support/free_port.hpp).

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

#include <ddp/core/error.hpp>
#include <ddp/launch/spawn.hpp>

#include "support/free_port.hpp"
#include "support/text.hpp"

namespace ddp::testing::tcp {

/// Fails the rank (exit 1 via the exception) unless `cond`.
inline void expect(bool cond, const std::string& what) {
  if (!cond) throw std::runtime_error("expectation failed: " + what);
}

/// expect() inside a loop over many elements: the message ("<what> at <at>") is made only when `cond` fails, so
/// the loop allocates nothing (under the sanitizers a string per element made one test run past its limit).
inline void expect_at(bool cond, const char* what, std::size_t at) {
  if (!cond) expect(false, std::string(what) + " at " + std::to_string(at));
}

/// Runs `body` in a rank, which must end in ddp::mismatch_error: printed to stderr (the test reads it there);
/// anything else fails the rank.
inline void expect_mismatch(const std::function<void()>& body) {
  try {
    body();
  } catch (const ddp::mismatch_error& e) {
    std::fprintf(stderr, "mismatch: %s\n", e.what());
    return;
  }
  throw std::runtime_error("no mismatch_error");
}

/// DDP_SHM on every rank: "1" (collectives and sends through shared memory) or "0" (through the sockets).
inline std::function<ddp::launch::env_list(int)> shm_env(const std::string& on) {
  return [on](int) { return ddp::launch::env_list{{"DDP_SHM", on}}; };
}

/// Options of a job: whole-job limit, known port and token, extra variables.
inline ddp::launch::spawn_options job(std::chrono::seconds limit, int port = 0,
                                      std::function<ddp::launch::env_list(int)> extra = {}) {
  ddp::launch::spawn_options o;
  o.timeout = limit;
  o.port = static_cast<std::uint16_t>(port);
  o.token = "tcp-tests";
  o.extra_env = std::move(extra);
  return o;
}

}  // namespace ddp::testing::tcp
