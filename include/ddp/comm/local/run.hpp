#pragma once
/// \file ddp::local::run: the front door of ddp::local. Starts n threads, hands each its rank's communicator, joins
/// them, and rethrows the first failure naming its rank. A rank that throws or returns while its peers still wait
/// for it fails their rendezvous at once (ddp::peer_lost naming it and its cause), so a failure ends run promptly.

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/comm/local/communicator.hpp>
#include <ddp/comm/local/config.hpp>
#include <ddp/comm/local/group.hpp>
#include <ddp/comm/local/world.hpp>
#include <ddp/core/error.hpp>

namespace ddp::local {

namespace detail {

/// What a rank's exception says: its what(), or that it is no std::exception.
inline std::string explain(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

/// How one rank ended: its exception (null when it returned), whether that only reports another rank's departure,
/// and its place in the order the failures happened.
struct outcome {
  std::exception_ptr error;   ///< null when the rank returned
  bool consequence = false;   ///< a ddp::peer_lost reporting another rank
  std::uint64_t order = 0;    ///< its place among the failures
};

/// Rethrows the failure that came first, preferring one that is not another rank's departure seen by a peer: a
/// ddp::error as it is (it names its rank), anything else as a ddp::error naming the rank, with the original nested.
inline void rethrow_first(const std::vector<outcome>& outcomes, int n) {
  const outcome* first = nullptr;
  int rank = -1;
  for (int r = 0; r < n; ++r) {
    const outcome& o = outcomes[static_cast<std::size_t>(r)];
    if (!o.error) continue;
    const bool better = first == nullptr || (first->consequence && !o.consequence) ||
                        (first->consequence == o.consequence && o.order < first->order);
    if (better) {
      first = &o;
      rank = r;
    }
  }
  if (first == nullptr) return;
  try {
    std::rethrow_exception(first->error);
  } catch (const ddp::error&) {
    throw;
  } catch (...) {
    std::throw_with_nested(ddp::error("rank " + std::to_string(rank) + " of ddp::local::run(" + std::to_string(n) +
                                          ") threw: " + explain(first->error),
                                      rank));
  }
}

}  // namespace detail

/// Runs `f(comm)` on `n` threads, comm being rank r's ddp::local::communicator on thread r, with settings `cfg`;
/// returns once every thread has finished, or rethrows the first failure (see detail::rethrow_first). Ranks may keep
/// their communicators only while `f` runs.
template <class F>
  requires std::invocable<F&, communicator>
void run(int n, const config& cfg, F&& f) {
  if (n < 1)
    throw config_error("ddp::local::run(" + std::to_string(n) + "): give 1 thread or more, one per rank");
  auto home = std::make_shared<detail::world>(n, cfg);
  const auto everyone = detail::world_group(home);
  std::vector<detail::outcome> outcomes(static_cast<std::size_t>(n));
  std::atomic<std::uint64_t> order{0};
  const auto body = [&](int r) {
    std::string cause = "returned";
    try {
      f(detail::access::make(everyone, r));
    } catch (...) {
      auto& o = outcomes[static_cast<std::size_t>(r)];
      o.error = std::current_exception();
      o.order = order.fetch_add(1);
      try {
        throw;
      } catch (const peer_lost& e) {
        o.consequence = e.peer() != e.rank();
      } catch (...) {
      }
      cause = "threw: " + detail::explain(o.error);
    }
    detail::depart(*home, r, std::move(cause));
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  try {
    for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  } catch (const std::exception& e) {  // no thread: the ranks that could not start fail those that did
    for (int r = static_cast<int>(threads.size()); r < n; ++r)
      detail::depart(*home, r, std::string("could not be started: ") + e.what());
    for (auto& t : threads) t.join();
    throw ddp::error("ddp::local::run(" + std::to_string(n) + ") could not start thread " +
                     std::to_string(threads.size()) + ": " + e.what() + "; run fewer ranks");
  }
  for (auto& t : threads) t.join();
  detail::rethrow_first(outcomes, n);
}

/// run(n, config_from_env(), f): the settings of the environment (DDP_TIMEOUT_MS).
template <class F>
  requires std::invocable<F&, communicator>
void run(int n, F&& f) {
  run(n, config_from_env(), std::forward<F>(f));
}

}  // namespace ddp::local
