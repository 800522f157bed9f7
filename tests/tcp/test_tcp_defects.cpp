// Regression tests of the TCP engine's defects (issue 13): an empty send taken for a recv, mismatches
// that only timed out, a timeout that did not name the rank waited for, an abort notice that spoke of a
// point-to-point transfer in a collective-only job, and survivors that blamed a live rank for a buffer it
// released after an abort while they were still copying it.

#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>

#include "support/run_ranks.hpp"

using namespace std::chrono_literals;
using ddp::testing::all_output;
using ddp::testing::require_all_ok;
using ddp::testing::run_ranks;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void check(bool cond, const std::string& what) {
  if (!cond) throw std::runtime_error("expectation failed: " + what);
}

/// A job of `limit` whose operations time out after `op_timeout`.
ddp::launch::spawn_options job_with_timeout(std::chrono::seconds limit, std::chrono::milliseconds op_timeout) {
  ddp::launch::spawn_options o;
  o.timeout = limit;
  o.token = "tcp-defects";
  o.extra_env = [op_timeout](int) {
    return ddp::launch::env_list{{"DDP_TIMEOUT_MS", std::to_string(op_timeout.count())}};
  };
  return o;
}

}  // namespace

TEST_CASE("an empty send is a send: it meets its empty recv", "[tcp][p2p]") {
  const auto rs = run_ranks(
      2,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<float> none;
        auto w = rank == 0 ? comm.send(none, 1, 3) : comm.recv(none, 0, 3);
        check(w.wait_for(5s), "the empty send and recv complete within 5 s");
        comm.barrier().wait();
      },
      job_with_timeout(40s, 30s));
  require_all_ok(rs);
}

TEST_CASE("mismatches where both ranks only receive raise mismatch_error within seconds", "[tcp][mismatch]") {
  struct variant {
    const char* name;
    const char* rank0;  // each rank's call, as every rank's message must name it
    const char* rank1;
  };
  const auto v = GENERATE(variant{"reduce roots", "reduce(sum) of 8 f32 from root 0", "reduce(sum) of 8 f32 from root 1"},
                          variant{"broadcast roots", "broadcast of 1048576 f32 from root 0",
                                  "broadcast of 1048576 f32 from root 1"},
                          variant{"gather vs scatter", "gather of 8 f32 from root 0", "scatter of 8 f32 from root 0"});
  const std::string copy = GENERATE(as<std::string>{}, "1", "0");
  CAPTURE(v.name, copy);
  const std::string kind = v.name;
  auto options = job_with_timeout(60s, 40s);  // far beyond the 5 s the mismatch must take
  options.extra_env = [copy](int) {
    return ddp::launch::env_list{{"DDP_TIMEOUT_MS", "40000"}, {"DDP_SAME_HOST_COPY", copy}};
  };
  const auto rs = run_ranks(
      2,
      [kind](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        comm.barrier().wait();
        std::vector<float> small(8, 1.0F), both(16, 0.0F), large(std::size_t{1} << 20, 1.0F);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          if (kind == "reduce roots") comm.reduce(small, ddp::reduce_op::sum, rank).wait();
          if (kind == "broadcast roots") comm.broadcast(large, rank).wait();
          if (kind == "gather vs scatter" && rank == 0) comm.gather(small, both, 0).wait();
          if (kind == "gather vs scatter" && rank == 1) comm.scatter(both, small, 0).wait();
          comm.barrier().wait();
        } catch (const ddp::mismatch_error& e) {
          std::fprintf(stderr, "mismatch: %s\n", e.what());
          check(std::chrono::steady_clock::now() - t0 < 5s, "the mismatch is raised within 5 s");
          return;
        }
        throw std::runtime_error("no mismatch_error");
      },
      options);
  require_all_ok(rs);
  for (const auto& r : rs.ranks) {
    INFO(r.output);
    CHECK(has(r.output, v.rank0));
    CHECK(has(r.output, v.rank1));
  }
}

TEST_CASE("wait() past its timeout names the rank the operation waits for", "[tcp][timeout]") {
  const auto rs = run_ranks(
      2,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        comm.barrier().wait();
        std::vector<float> a(64, 1.0F), b(64, 1.0F);
        if (rank == 1) {  // joins the first all_reduce late, never the second
          std::this_thread::sleep_for(500ms);
          comm.all_reduce(a).wait();
          std::this_thread::sleep_for(2500ms);
          return;
        }
        auto first = comm.all_reduce(a);
        auto second = comm.all_reduce(b);  // runs from ~500 ms; wait() gives up first, at 1500 ms
        try {
          second.wait();
        } catch (const ddp::timeout_error& e) {
          std::fprintf(stderr, "timeout: %s\n", e.what());
          first.wait();
          return;
        }
        throw std::runtime_error("no timeout_error");
      },
      job_with_timeout(30s, 1500ms));
  require_all_ok(rs);
  INFO(rs.ranks[0].output);
  CHECK(has(rs.ranks[0].output, "all_reduce(sum) of 64 f32 (seq 2) did not complete within 1500 ms, waiting for rank 1"));
}

TEST_CASE("an abort heard between collectives does not speak of a point-to-point transfer", "[tcp][fault]") {
  const auto rs = run_ranks(
      2,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        comm.barrier().wait();
        std::vector<float> v(8, 1.0F);
        try {
          if (rank == 1) comm.broadcast(v, 0).wait();  // times out: rank 0 does not join in time
          std::this_thread::sleep_for(2s);                // rank 0 hears rank 1's abort while idle
          comm.barrier().wait();
        } catch (const ddp::error& e) {  // rank 1's timeout; on rank 0, rank 1's abort notice
          std::fprintf(stderr, "error: %s\n", e.what());
          return;
        }
        throw std::runtime_error("no error");
      },
      job_with_timeout(30s, 800ms));
  require_all_ok(rs);
  INFO(rs.ranks[0].output);
  CHECK(has(rs.ranks[0].output, "rank 1 aborted"));
  CHECK_FALSE(has(rs.ranks[0].output, "point-to-point"));
}

TEST_CASE("a rank that aborts with its data offered for copying never has it read after release", "[tcp][fault]") {
  // Rank 0 offers a large broadcast (remote frames), times out before rank 1 joins, and reuses the memory;
  // rank 1 then meets the offers before the abort notice behind them.
  const auto rs = run_ranks(
      2,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        comm.barrier().wait();
        auto v = std::make_unique<std::vector<float>>(std::size_t{1} << 20, 1.0F);
        try {
          if (rank == 0) {
            comm.broadcast(*v, 0).wait_for(5s);  // rank 1 is away: the engine's timeout fails it
            throw std::runtime_error("the broadcast did not fail although rank 1 did not join in time");
          } else {
            std::this_thread::sleep_for(1500ms);  // past rank 0's 800 ms timeout
            comm.broadcast(*v, 0).wait();
            check(std::all_of(v->begin(), v->end(), [](float x) { return x == 1.0F; }),
                  "a broadcast that completes delivers the root's values, not reused memory");
            throw std::runtime_error("the broadcast completed although its root had aborted");
          }
        } catch (const ddp::error& e) {
          std::fprintf(stderr, "error: %s\n", e.what());
          if (rank == 0) {  // release and reuse the buffer at once, then stay alive
            v.reset();
            std::vector<float> reuse(std::size_t{1} << 20, 7.0F);
            std::this_thread::sleep_for(3s);
            check(reuse[0] == 7.0F, "the reused memory keeps its values");
            return;
          }
          const auto* lost = dynamic_cast<const ddp::peer_lost*>(&e);
          check(!has(e.what(), "Bad address"), "rank 1 reports no bad address");
          check(lost == nullptr, "rank 1 does not call the live rank 0 lost");
          check(has(e.what(), "rank 0 aborted"), "rank 1 raises rank 0's abort notice");
          return;
        }
      },
      job_with_timeout(30s, 800ms));
  require_all_ok(rs);
}

TEST_CASE("survivors of a rank killed mid-collective never blame a live rank for its released buffer",
          "[tcp][fault][stress]") {
  constexpr int n = 4;
  constexpr int trials = 4;
  for (int trial = 0; trial < trials; ++trial) {
    const int victim = 1 + trial % (n - 1);
    CAPTURE(trial, victim);
    auto options = job_with_timeout(60s, 20s);
    options.stop_on_failure = false;  // the victim's death is the test
    options.extra_env = [](int) { return ddp::launch::env_list{{"DDP_TIMEOUT_MS", "20000"}, {"DDP_SAME_HOST_COPY", "1"}}; };
    const auto rs = run_ranks(
        n,
        [victim, trial](int rank) {
          auto comm = ddp::tcp::communicator::from_env();
          std::vector<float> v(std::size_t{4} << 20, 1.0F);  // 16 MiB: remote frames on every ring step
          try {
            comm.all_reduce(v).wait();
            if (rank == victim) {
              std::this_thread::sleep_for(std::chrono::milliseconds(5 + 7 * trial));
              ::raise(SIGKILL);
            }
            for (int i = 0; i < 50; ++i) comm.all_reduce(v).wait();
          } catch (const ddp::error& e) {
            std::fprintf(stderr, "error: %s\n", e.what());
            // Release the buffer at once, as a program that exits or reuses its memory would.
            std::vector<float>().swap(v);
            std::vector<char> reuse(std::size_t{64} << 20, 'x');
            check(reuse.back() == 'x', "the reused memory is written");
            const auto* lost = dynamic_cast<const ddp::peer_lost*>(&e);
            check(!has(e.what(), "Bad address"), "no survivor reports a bad address");
            check(lost == nullptr || lost->peer() == victim,
                  "peer_lost names the killed rank " + std::to_string(victim) + ", not a live one");
            std::this_thread::sleep_for(300ms);  // the others finish their own copies meanwhile
            return;
          }
          throw std::runtime_error("the all_reduces completed without rank " + std::to_string(victim));
        },
        options);
    INFO(all_output(rs));
    for (const auto& r : rs.ranks)
      if (r.rank != victim) REQUIRE(r.ok());
  }
}
