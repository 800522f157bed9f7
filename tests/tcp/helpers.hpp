#pragma once
// Helpers shared by the ddp::tcp tests: expectations inside forked ranks, job options (free ports:
// support/free_port.hpp).

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

#include <ddp/launch/spawn.hpp>

#include "support/free_port.hpp"

namespace ddp::testing::tcp {

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Fails the rank (exit 1 via the exception) unless `cond`.
inline void expect(bool cond, const std::string& what) {
  if (!cond) throw std::runtime_error("expectation failed: " + what);
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
