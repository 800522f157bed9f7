// ddp::tcp send/recv in real processes, through the shared-memory rings (DDP_SHM=1) and the sockets
// (DDP_SHM=0) alike: a peer lost while a recv waits, a send that does not fit its recv, a send larger than
// a ring that completes before its recv is posted. (The conformance suite and the timeout tests in
// test_tcp.cpp cover the rest in both modes.)

#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>

#include "support/run_ranks.hpp"
#include "tcp/helpers.hpp"

using namespace std::chrono_literals;
using ddp::testing::all_output;
using ddp::testing::require_all_ok;
using ddp::testing::run_ranks;
using ddp::testing::contains;
using ddp::testing::tcp::expect;
using ddp::testing::tcp::expect_mismatch;
using ddp::testing::tcp::job;
using ddp::testing::tcp::shm_env;

TEST_CASE("send/recv: a rank killed while its peer waits in recv raises peer_lost naming it within seconds",
          "[tcp][p2p][fault]") {
  const std::string shm = GENERATE(as<std::string>{}, "1", "0");
  CAPTURE(shm);
  const auto rs = run_ranks(
      2,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<float> v(1024, 1.0F);
        if (rank == 0) comm.send(std::span<const float>(v), 1, 1).wait();
        else comm.recv(std::span<float>(v), 0, 1).wait();
        if (rank == 1) {
          std::this_thread::sleep_for(200ms);  // rank 0 waits in its recv by now
          ::raise(SIGKILL);
        }
        const auto t0 = std::chrono::steady_clock::now();
        try {
          comm.recv(std::span<float>(v), 1, 2).wait();
        } catch (const ddp::peer_lost& e) {
          std::fprintf(stderr, "peer_lost: %s\n", e.what());
          expect(e.peer() == 1, "peer() names rank 1, got " + std::to_string(e.peer()));
          expect(contains(e.what(), "rank 1 was lost"), "the message names rank 1");
          expect(std::chrono::steady_clock::now() - t0 < 5s, "noticed within 5 s");
          return;
        }
        throw std::runtime_error("the recv completed without a send");
      },
      [shm] {
        auto o = job(30s, 0, shm_env(shm));
        o.stop_on_failure = false;  // rank 1's death is the test; rank 0 must see it
        return o;
      }());
  INFO(all_output(rs));
  CHECK(rs.ranks[1].signal == SIGKILL);
  CHECK(rs.ranks[0].ok());
}

TEST_CASE("send/recv: a send whose count or dtype differs from its recv raises mismatch_error naming both",
          "[tcp][p2p][mismatch]") {
  const std::string shm = GENERATE(as<std::string>{}, "1", "0");
  const std::string what = GENERATE(as<std::string>{}, "count", "dtype");
  CAPTURE(shm, what);
  const auto rs = run_ranks(
      2,
      [what](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        if (rank == 0) {
          std::vector<float> v(8, 1.0F);
          comm.send(std::span<const float>(v), 1, 4).wait();
          return;  // its send went out; the receiver finds the mismatch
        }
        std::vector<float> f(what == "count" ? 4 : 8);
        std::vector<std::int32_t> i(8);
        expect_mismatch([&] {
          if (what == "count") comm.recv(std::span<float>(f), 0, 4).wait();
          else comm.recv(std::span<std::int32_t>(i), 0, 4).wait();
        });
      },
      job(30s, 0, shm_env(shm)));
  require_all_ok(rs);
  CHECK(contains(rs.ranks[1].output, what == "count" ? "rank 1 called recv of 4 f32 with tag 4, rank 0 sent send of 8 f32"
                                                     : "rank 1 called recv of 8 i32 with tag 4, rank 0 sent send of 8 f32"));
  CHECK(contains(rs.ranks[1].output, "a send and its recv must have the same count and dtype"));
}

TEST_CASE("send/recv: a send larger than a ring completes before its recv is posted", "[tcp][p2p]") {
  const std::string shm = GENERATE(as<std::string>{}, "1", "0");
  CAPTURE(shm);
  const auto rs = run_ranks(
      2,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<std::int32_t> v(std::size_t{3} << 18);  // 3 MiB: three rings' worth
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = rank == 0 ? static_cast<std::int32_t>(i * 7) : -1;
        if (rank == 0) {
          comm.send(std::span<const std::int32_t>(v), 1, 3).wait();  // its receiver has posted no recv yet
          comm.barrier().wait();
          return;
        }
        comm.barrier().wait();
        comm.recv(std::span<std::int32_t>(v), 0, 3).wait();
        for (std::size_t i = 0; i < v.size(); ++i)
          if (v[i] != static_cast<std::int32_t>(i * 7)) throw std::runtime_error("wrong element " + std::to_string(i));
      },
      job(60s, 0, [shm](int) { return ddp::launch::env_list{{"DDP_SHM", shm}, {"DDP_TIMEOUT_MS", "20000"}}; }));
  require_all_ok(rs);
}
