#pragma once
// A world of one over TCP for the checkpoint tests that need no other rank.
#include <chrono>

#include <ddp/comm/tcp/communicator.hpp>

namespace {

/// A world of one whose every operation times out after 30 s.
[[maybe_unused]] ddp::tcp::communicator solo() {
  ddp::tcp::config cfg;
  cfg.timeout = std::chrono::seconds(30);
  return ddp::tcp::communicator(cfg);
}

}  // namespace
