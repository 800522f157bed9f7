// ddp::tcp in real processes: the conformance suite at 1-4 ranks (over shared memory, with same-host
// copies on, off and mixed), steady-state allocations, the rendezvous store, strangers, lost peers (with
// and without shared memory), mismatched calls, timeouts, destruction with operations in flight, and
// shared-memory segments left behind by no exit path.

#include <catch2/catch.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <span>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/comm/tcp/shm_algo_choice.hpp>
#include <ddp/comm/tcp/shm_rings.hpp>

#include "conformance/conformance.hpp"
#include "support/run_ranks.hpp"
#include "support/side_process.hpp"
#include "tcp/helpers.hpp"

using namespace std::chrono_literals;
using ddp::testing::all_output;
using ddp::testing::require_all_ok;
using ddp::testing::run_ranks;
using ddp::testing::side_process;
using ddp::testing::contains;
using ddp::testing::tcp::expect;
using ddp::testing::tcp::expect_at;
using ddp::testing::tcp::expect_mismatch;
using ddp::testing::free_port;
using ddp::testing::tcp::job;
using ddp::testing::tcp::shm_env;

namespace {

/// DDP_SHM and DDP_SAME_HOST_COPY per rank: "shm" (collectives through shared memory, large all_reduce by
/// single copies), "shm-nocopy" (shared memory only: large all_reduce pipelined through the segment), "on"
/// (sockets with same-host copies), "off" everywhere (every byte through the sockets, as between hosts), or
/// "mixed" (rank 0 alone off: every rank falls back to the sockets, and its peers must reach it without copies).
std::function<ddp::launch::env_list(int)> same_host_copy(const std::string& mode) {
  return [mode](int rank) {
    const bool on = mode == "on" || mode == "shm" || (mode == "mixed" && rank != 0);
    const bool shm = mode == "shm" || mode == "shm-nocopy" || (mode == "mixed" && rank != 0);
    return ddp::launch::env_list{{"DDP_SAME_HOST_COPY", on ? "1" : "0"}, {"DDP_SHM", shm ? "1" : "0"}};
  };
}

/// The names in /dev/shm that contain `part`.
std::vector<std::string> shm_entries(const std::string& part) {
  std::vector<std::string> found;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(dir))
      if (contains(e->d_name, part)) found.emplace_back(e->d_name);
    ::closedir(dir);
  }
  return found;
}

/// The pid a rank printed as "pid=<n>;" in its output, as the "-<n>-" segment names carry it.
std::string printed_pid(const std::string& output) {
  const auto at = output.find("pid=");
  return at == std::string::npos ? std::string("(no pid printed)")
                                 : "-" + output.substr(at + 4, output.find(';', at) - at - 4) + "-";
}

/// Allocations of at least 64 KiB this process made: buffers, as opposed to bookkeeping.
std::atomic<std::size_t> buffer_allocations{0};

}  // namespace

// Counts buffer allocations for the steady-state test (replaces the global operator new of this executable).
void* operator new(std::size_t bytes) {
  if (bytes >= (std::size_t{64} << 10)) buffer_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // g++ pairs the inlined new with free(): it is malloc's
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace {

/// The conformance suite at `n` ranks with same-host copies `copy` (same_host_copy's modes).
void conformance_at(int n, const std::string& copy) {
  CAPTURE(n, copy);
  const auto rs = run_ranks(
      n,
      [](int) {
        auto comm = ddp::tcp::communicator::from_env();
        ddp::testing::run_conformance(comm);
      },
      job(60s, 0, same_host_copy(copy)));
  require_all_ok(rs);
  if (n > 1) {  // rank 0 says how many peers it reads directly: all of them only when every rank allows it
    const int readable = copy == "on" || copy == "shm" ? n - 1 : 0;
    CHECK(contains(rs.ranks[0].output, "memory of " + std::to_string(readable) + " of its " + std::to_string(n - 1)));
    CHECK(contains(rs.ranks[0].output, copy.starts_with("shm") ? "through shared memory" : "through the sockets"));
  }
}

}  // namespace

TEST_CASE("conformance suite over real processes at 1 and 2 ranks", "[tcp][conformance][fast]") {
  const int n = GENERATE(1, 2);
  conformance_at(n, GENERATE(as<std::string>{}, "shm", "shm-nocopy", "on", "off", "mixed"));
}

TEST_CASE("conformance suite over real processes at 3 and 4 ranks", "[tcp][conformance]") {
  const int n = GENERATE(3, 4);
  conformance_at(n, GENERATE(as<std::string>{}, "shm", "shm-nocopy", "on", "off", "mixed"));
}

TEST_CASE("repeated collectives allocate no buffers: the engine's scratch is reused", "[tcp][memory]") {
  const int n = GENERATE(1, 2, 3);
  const std::string copy = GENERATE(as<std::string>{}, "on", "off");
  CAPTURE(n, copy);
  require_all_ok(run_ranks(
      n,
      [](int) {
        auto comm = ddp::tcp::communicator::from_env();
        const auto size = static_cast<std::size_t>(comm.size());
        const std::size_t k = (std::size_t{1} << 20) + 5;  // a block per rank beyond the segment size
        std::vector<float> whole(k * size, 1.0F), block(k, 1.0F), small(1000, 1.0F), small_block(1000 / size);
        const std::span<const float> small_in(small.data(), small_block.size() * size);
        const auto round = [&] {
          comm.all_reduce(whole, ddp::reduce_op::avg).wait();
          comm.all_reduce(small).wait();  // the direct exchange
          comm.reduce_scatter(whole, block).wait();
          comm.reduce_scatter(small_in, small_block).wait();
          comm.all_gather(block, whole).wait();
          comm.broadcast(whole, comm.size() - 1).wait();
          comm.reduce(whole, ddp::reduce_op::max, 0).wait();  // the chain, with its partial results
        };
        round();  // sizes the scratch
        const std::size_t before = buffer_allocations.load();
        for (int i = 0; i < 3; ++i) round();
        const std::size_t extra = buffer_allocations.load() - before;
        expect(extra == 0, std::to_string(extra) + " allocations of 64 KiB or more in the 3 rounds after the first");
      },
      job(60s, 0, same_host_copy(copy))));
}

TEST_CASE("a rank waiting 2 s in a shared-memory collective uses at most 8 ms of CPU a second, times the slowdown of "
          "an instrumented build (1 ms slices used 20)", "[tcp][shm]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  require_all_ok(run_ranks(
      n,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<float> v(1024, 1.0F);
        comm.all_reduce(v).wait();
        const auto cpu = [] {
          rusage u{};
          ::getrusage(RUSAGE_SELF, &u);  // every thread of the rank: the caller's and the engine's
          return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
                 1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
        };
        if (rank == 0) std::this_thread::sleep_for(2s);  // the others wait for it
        const double before = cpu();
        const auto start = std::chrono::steady_clock::now();
        comm.all_reduce(v).wait();
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const double ms_per_s = 1e3 * (cpu() - before) / waited;
        if (rank != 0)
          // Instrumented builds (ThreadSanitizer) spend several times the CPU on each wake-up: the budget scales as
          // their timeouts do, far below a spinning wait's 1000 ms a second.
          expect(waited > 1.5 && ms_per_s <= 8.0 * ddp::testing::timeout_scale, "rank " + std::to_string(rank) + " waited " + std::to_string(waited) +
                                                      " s using " + std::to_string(ms_per_s) + " ms of CPU a second");
      },
      job(60s, 0, shm_env("1"))));
}

TEST_CASE("the store serves set get add and a blocking wait and refuses strangers", "[tcp][store]") {
  namespace d = ddp::tcp::detail;
  const int port = free_port();
  const d::job_key token = d::job_key_of("store-test");
  // Rank 0's engine serves the store from its poll loop, as in a job.
  d::engine server(0, 1, &d::run_collective,
                   d::store_server(d::listen_on("127.0.0.1", static_cast<std::uint16_t>(port), 0, "store"), token, 0));
  const auto deadline = d::clock::now() + 5s;
  d::store_client a("127.0.0.1", static_cast<std::uint16_t>(port), token, 1, deadline);
  d::store_client b("127.0.0.1", static_cast<std::uint16_t>(port), token, 2, deadline);

  std::thread waiter([&] {
    const auto v = b.get("late");  // parks until a sets it
    CHECK(std::string(v.begin(), v.end()) == "here");
  });
  std::this_thread::sleep_for(50ms);
  a.set("late", {'h', 'e', 'r', 'e'});
  waiter.join();
  CHECK(a.add("counter", 5) == 5);
  CHECK(b.add("counter", -2) == 3);
  b.wait("late");

  const auto raw_connect = [&] {
    return d::connect_with_retry("127.0.0.1", static_cast<std::uint16_t>(port), d::clock::now() + 2s, -1, "store", "");
  };
  SECTION("a wrong token is refused, the store goes on") {
    auto fd = raw_connect();
    d::challenge nonce{};
    REQUIRE(d::recv_all(fd.get(), nonce.data(), nonce.size(), d::clock::now() + 2s) == d::io_status::ok);
    const auto hello = d::signed_hello(d::store_hello{}, d::job_key_of("another job"), "store", nonce);
    REQUIRE(d::send_all(fd.get(), &hello, sizeof hello, d::clock::now() + 2s) == d::io_status::ok);
    std::uint8_t byte = 0;
    CHECK(d::recv_all(fd.get(), &byte, 1, d::clock::now() + 2s) == d::io_status::closed);
    CHECK_THROWS_AS(d::store_client("127.0.0.1", static_cast<std::uint16_t>(port), d::job_key_of("x"), 3,
                                    d::clock::now() + 2s),
                    ddp::peer_lost);
  }
  SECTION("a handshake recorded on one connection is refused on the next: the store's challenge differs") {
    auto first = raw_connect();
    d::challenge nonce{};
    REQUIRE(d::recv_all(first.get(), nonce.data(), nonce.size(), d::clock::now() + 2s) == d::io_status::ok);
    const auto recorded = d::signed_hello(d::store_hello{}, token, "store", nonce);  // what a listener could capture
    auto fd = raw_connect();
    REQUIRE(d::send_all(fd.get(), &recorded, sizeof recorded, d::clock::now() + 2s) == d::io_status::ok);
    std::uint8_t byte = 0;
    d::challenge other{};
    REQUIRE(d::recv_all(fd.get(), other.data(), other.size(), d::clock::now() + 2s) == d::io_status::ok);
    CHECK(other != nonce);
    CHECK(d::recv_all(fd.get(), &byte, 1, d::clock::now() + 2s) == d::io_status::closed);
  }
  SECTION("garbage is refused, the store goes on") {
    auto fd = raw_connect();
    d::challenge nonce{};
    REQUIRE(d::recv_all(fd.get(), nonce.data(), nonce.size(), d::clock::now() + 2s) == d::io_status::ok);
    const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    REQUIRE(d::send_all(fd.get(), junk, sizeof junk, d::clock::now() + 2s) == d::io_status::ok);
    std::uint8_t byte = 0;
    CHECK(d::recv_all(fd.get(), &byte, 1, d::clock::now() + 2s) == d::io_status::closed);
  }
  CHECK(a.add("counter", 1) == 4);
}

TEST_CASE("a stranger on the store port during a job is refused and the job goes on", "[tcp][store]") {
  namespace d = ddp::tcp::detail;
  const int port = free_port();
  side_process stranger([port] {
    // Wrong token, then garbage, while the ranks run collectives.
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto fd = d::connect_with_retry("127.0.0.1", static_cast<std::uint16_t>(port), d::clock::now() + 10s, -1,
                                      "store", "");
      if (attempt == 0) {
        d::challenge nonce{};
        d::recv_all(fd.get(), nonce.data(), nonce.size(), d::clock::now() + 2s);
        const auto hello = d::signed_hello(d::store_hello{}, d::job_key_of("intruder"), "store", nonce);
        d::send_all(fd.get(), &hello, sizeof hello, d::clock::now() + 2s);
      } else {
        d::challenge nonce{};
        d::recv_all(fd.get(), nonce.data(), nonce.size(), d::clock::now() + 2s);
        const char junk[64] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
        d::send_all(fd.get(), junk, sizeof junk, d::clock::now() + 2s);
      }
      std::uint8_t byte = 0;
      expect(d::recv_all(fd.get(), &byte, 1, d::clock::now() + 5s) == d::io_status::closed, "the stranger refused");
    }
  });
  const auto rs = run_ranks(
      2,
      [](int) {
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<float> v(1000);
        // Rank 0 decides when to stop (element 0 carries its vote) so both ranks make the same calls.
        const auto until = std::chrono::steady_clock::now() + 1500ms;
        for (bool more = true; more;) {
          std::fill(v.begin(), v.end(), 1.0F);
          v[0] = comm.rank() == 0 && std::chrono::steady_clock::now() > until ? 1.0F : 0.0F;
          comm.all_reduce(v).wait();
          expect(v[999] == 2.0F, "all_reduce result");
          more = v[0] == 0.0F;
        }
        comm.barrier().wait();
      },
      job(30s, port));
  CHECK(stranger.join() == "");
  require_all_ok(rs);
  INFO(rs.ranks[0].output);
  CHECK(contains(rs.ranks[0].output, "refused a connection to the store"));
  CHECK(contains(rs.ranks[0].output, "wrong job token"));
  CHECK(contains(rs.ranks[0].output, "not a ddp handshake"));
}

TEST_CASE("strangers on a mesh port during the rendezvous are refused and the job goes on", "[tcp][store]") {
  namespace d = ddp::tcp::detail;
  const int port = free_port();
  side_process stranger([port] {
    // Reads rank 0's mesh address as a rank would, then signs the mesh port's challenge with another job's key.
    d::store_client store("127.0.0.1", static_cast<std::uint16_t>(port), d::job_key_of("tcp-tests"), 99,
                          d::clock::now() + 10s);
    const auto bytes = store.get("ddp/mesh/0");
    const std::string where(bytes.begin(), bytes.end());
    const auto colon = where.rfind(':');
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto fd = d::connect_with_retry(where.substr(0, colon), static_cast<std::uint16_t>(std::stoi(where.substr(colon + 1))),
                                      d::clock::now() + 5s, -1, "mesh", "");
      if (attempt == 0) {
        d::challenge nonce{};
        d::recv_all(fd.get(), nonce.data(), nonce.size(), d::clock::now() + 2s);
        const auto hello =
            d::signed_hello(d::mesh_hello{d::mesh_magic, 1, 2, d::mesh_version, 0}, d::job_key_of("intruder"), "mesh", nonce);
        d::send_all(fd.get(), &hello, sizeof hello, d::clock::now() + 2s);
      } else {
        d::challenge nonce{};
        d::recv_all(fd.get(), nonce.data(), nonce.size(), d::clock::now() + 2s);
        const char junk[24] = "\x01garbage-garbage-junk";
        d::send_all(fd.get(), junk, sizeof junk, d::clock::now() + 2s);
      }
      std::uint8_t byte = 0;
      expect(d::recv_all(fd.get(), &byte, 1, d::clock::now() + 5s) == d::io_status::closed, "the stranger refused");
    }
  });
  const auto rs = run_ranks(
      2,
      [](int rank) {
        if (rank == 1) std::this_thread::sleep_for(1500ms);  // the strangers come first
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<float> v(10, 1.0F);
        comm.all_reduce(v).wait();
        expect(v[0] == 2.0F, "all_reduce after the strangers");
      },
      job(30s, port));
  CHECK(stranger.join() == "");
  require_all_ok(rs);
  INFO(rs.ranks[0].output);
  CHECK(contains(rs.ranks[0].output, "refused a connection to the mesh port"));
  CHECK(contains(rs.ranks[0].output, "wrong job token"));
  CHECK(contains(rs.ranks[0].output, "not a ddp mesh handshake"));
}

TEST_CASE("a rank with another job token cannot join", "[tcp][store]") {
  const auto rs = run_ranks(
      2,
      [](int rank) {
        try {
          auto comm = ddp::tcp::communicator::from_env();
        } catch (const ddp::error& e) {
          std::fprintf(stderr, "refused: %s\n", e.what());
          return;
        }
        throw std::runtime_error("rank " + std::to_string(rank) + " joined a job with a different token");
      },
      job(30s, 0, [](int rank) {
        ddp::launch::env_list env{{"DDP_CONNECT_TIMEOUT_MS", "1500"}};
        if (rank == 1) env.emplace_back("DDP_TOKEN", "someone else's job");
        return env;
      }));
  require_all_ok(rs);
  CHECK(contains(rs.ranks[0].output, "wrong job token"));
  CHECK(contains(rs.ranks[1].output, "DDP_TOKEN"));
}

TEST_CASE("a rank killed mid-collective raises peer_lost naming it on every survivor within seconds", "[tcp][fault]") {
  // Over shared memory: the direct exchange, the pipeline, and (16 MiB, fixed) the single copies.
  const std::size_t count = GENERATE(std::size_t{256}, std::size_t{1} << 18, std::size_t{1} << 22);
  const std::string shm = GENERATE(as<std::string>{}, "1", "0");
  CAPTURE(count, shm);
  const auto rs = run_ranks(
      3,
      [count](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<float> v(count, 1.0F);
        for (int i = 0; i < 3; ++i) comm.all_reduce(v).wait();
        if (rank == 1) {
          std::this_thread::sleep_for(200ms);  // the others are inside the next all_reduce by now
          ::raise(SIGKILL);
        }
        const auto t0 = std::chrono::steady_clock::now();
        try {
          comm.all_reduce(v).wait();
        } catch (const ddp::peer_lost& e) {
          const auto took = std::chrono::steady_clock::now() - t0;
          std::fprintf(stderr, "peer_lost: %s\n", e.what());
          expect(e.peer() == 1, "peer() names rank 1, got " + std::to_string(e.peer()));
          expect(contains(e.what(), "rank 1"), "the message names rank 1");
          expect(took < 5s, "noticed within 5 s");
          return;
        }
        throw std::runtime_error("the all_reduce completed without its third rank");
      },
      [shm] {
        auto o = job(30s, 0, [shm](int) {
          return ddp::launch::env_list{{"DDP_SHM", shm}, {"DDP_SHM_ALGO", "single_copy"}};
        });
        o.stop_on_failure = false;  // rank 1's death is the test; the survivors must see it
        return o;
      }());
  INFO(all_output(rs));
  CHECK(rs.ranks[1].signal == SIGKILL);
  CHECK(rs.ranks[0].ok());
  CHECK(rs.ranks[2].ok());
}

TEST_CASE("mismatched calls raise mismatch_error naming both ranks' calls", "[tcp][mismatch]") {
  struct variant {
    const char* name;
    const char* first;   // a description every rank's message must contain
    const char* second;  // and another
  };
  const std::string shm = GENERATE(as<std::string>{}, "1", "0");
  const auto v = GENERATE(variant{"op", "all_reduce(sum) of 1024 f32", "broadcast of 1024 f32 from root 0"},
                          variant{"dtype", "all_reduce(sum) of 1024 f32", "all_reduce(sum) of 1024 f64"},
                          variant{"count", "all_reduce(sum) of 1024 f32", "all_reduce(sum) of 8 f32"},
                          variant{"reduce op", "all_reduce(sum) of 1024 f32", "all_reduce(max) of 1024 f32"},
                          // both ranks act as root and their broadcasts go through; the next call sees the other's frame
                          variant{"root", "sent broadcast of 1024 f32 from root", "called barrier (seq 1)"},
                          variant{"order", "all_reduce(sum) of 1024 f32 (seq 0)", "all_gather of 1024 f32 (seq 0)"});
  CAPTURE(v.name, shm);
  const std::string kind = v.name;
  const auto rs = run_ranks(
      2,
      [kind](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<float> f(1024, 1.0F), gathered(2048);
        std::vector<double> d(1024, 1.0);
        std::vector<float> small(8, 1.0F);
        expect_mismatch([&] {
          if (rank == 0 && kind == "root") {
            comm.broadcast(f, 0).wait();
          } else if (rank == 0) {
            comm.all_reduce(f).wait();
            if (kind == "order") comm.all_gather(std::span<const float>(f), std::span<float>(gathered)).wait();
          } else if (kind == "op") {
            comm.broadcast(f, 0).wait();
          } else if (kind == "dtype") {
            comm.all_reduce(d).wait();
          } else if (kind == "count") {
            comm.all_reduce(small).wait();
          } else if (kind == "reduce op") {
            comm.all_reduce(f, ddp::reduce_op::max).wait();
          } else if (kind == "root") {
            comm.broadcast(f, 1).wait();
          } else {
            comm.all_gather(std::span<const float>(f), std::span<float>(gathered)).wait();
            comm.all_reduce(f).wait();
          }
          comm.barrier().wait();  // a rank whose own call went through learns of the mismatch here
        });
      },
      job(30s, 0, shm_env(shm)));
  require_all_ok(rs);
  // Over shared memory both broadcasts meet in one phase, so each rank names both roots.
  const bool roots = shm == "1" && kind == "root";
  for (const auto& r : rs.ranks) {
    INFO(r.output);
    CHECK(contains(r.output, roots ? "broadcast of 1024 f32 from root 0 (seq 0)" : v.first));
    CHECK(contains(r.output, roots ? "broadcast of 1024 f32 from root 1 (seq 0)" : v.second));
  }
}

TEST_CASE("an operation a peer never joins raises timeout_error at the deadline", "[tcp][timeout]") {
  const auto rs = run_ranks(
      2,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        if (rank == 1) {
          std::this_thread::sleep_for(2s);
          return;
        }
        std::vector<float> v(100, 1.0F);
        auto w = comm.all_reduce(v);
        expect(!w.wait_for(100ms), "wait_for returns false while the peer is away");
        const auto t0 = std::chrono::steady_clock::now();
        try {
          w.wait();
        } catch (const ddp::timeout_error& e) {
          std::fprintf(stderr, "timeout: %s\n", e.what());
          expect(std::chrono::steady_clock::now() - t0 < 1500ms, "the timeout fires near its deadline");
          return;
        }
        throw std::runtime_error("no timeout_error");
      },
      job(30s, 0, [](int) { return ddp::launch::env_list{{"DDP_TIMEOUT_MS", "500"}}; }));
  require_all_ok(rs);
  CHECK(contains(rs.ranks[0].output, "all_reduce(sum) of 100 f32 (seq 0) did not complete within 500 ms"));
}

TEST_CASE("a recv that no send matches in time fails and its buffer stays untouched", "[tcp][timeout]") {
  const std::string shm = GENERATE(as<std::string>{}, "1", "0");  // through the shared-memory rings, the sockets
  CAPTURE(shm);
  const auto rs = run_ranks(
      2,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<std::int32_t> v(16, -7);
        if (rank == 1) {
          std::this_thread::sleep_for(1300ms);  // the send comes after rank 0's recv gave up
          std::fill(v.begin(), v.end(), 42);
          comm.send(std::span<const std::int32_t>(v), 0, 5).wait();
        } else {
          try {
            comm.recv(v, 1, 5).wait();
            throw std::runtime_error("the recv completed without a send");
          } catch (const ddp::timeout_error& e) {
            std::fprintf(stderr, "timeout: %s\n", e.what());
          }
        }
        comm.barrier().wait();  // by now rank 1's late frame has reached rank 0
        if (rank == 0) expect(v[0] == -7 && v[15] == -7, "the late send did not write the abandoned buffer");
      },
      job(30s, 0, [shm](int) { return ddp::launch::env_list{{"DDP_TIMEOUT_MS", "1000"}, {"DDP_SHM", shm}}; }));
  require_all_ok(rs);
  // The engine expires the recv, or wait() gives up first: either way a timeout naming the recv.
  CHECK(contains(rs.ranks[0].output, "recv of 16 i32 with tag 5 from rank 1"));
  CHECK(contains(rs.ranks[0].output, "1000 ms"));
}

TEST_CASE("destroying a communicator with operations in flight does not hang", "[tcp][fault]") {
  const auto rs = run_ranks(
      2,
      [](int rank) {
        std::vector<float> v(1 << 20, 1.0F);
        ddp::work pending;
        {
          auto comm = ddp::tcp::communicator::from_env();
          comm.barrier().wait();
          if (rank == 1) return;  // leaves without joining the all_reduce
          std::this_thread::sleep_for(100ms);
          pending = comm.all_reduce(v);
          auto queued = comm.all_reduce(v);
        }
        try {
          pending.wait();
        } catch (const ddp::error& e) {
          std::fprintf(stderr, "in flight: %s\n", e.what());
          return;
        }
        throw std::runtime_error("the all_reduce completed without its peer");
      },
      30s);
  require_all_ok(rs);
}

TEST_CASE("all_reduce, reduce_scatter and all_gather over shared memory give the same bits by single copies and through the segment", "[tcp][shm]") {
  const int n = GENERATE(2, 3);
  // From 4 MiB: the algorithm rank 0 runs, timed or fixed (every rank follows it, whatever its own setting says),
  // or no single copies at all (the pipeline).
  const std::string algo = GENERATE(as<std::string>{}, "auto", "single_copy", "pipeline", "mixed", "no copies");
  CAPTURE(n, algo);
  const auto env = [algo](int rank) {
    const std::string mine = algo != "mixed" ? algo : rank == 0 ? "pipeline" : "single_copy";
    return ddp::launch::env_list{{"DDP_SHM", "1"},
                                 {"DDP_SAME_HOST_COPY", algo == "no copies" ? "0" : "1"},
                                 {"DDP_SHM_ALGO", algo == "no copies" ? "auto" : mine}};
  };
  require_all_ok(run_ranks(
      n,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        const std::size_t count = (std::size_t{1} << 22) + 3;
        const auto value = [](int r, std::size_t i) { return static_cast<float>(r + 1) * 0.1F + static_cast<float>(i % 7); };
        std::vector<float> sum(count), avg(count), top(count);
        // Timed (auto), the first call takes single copies, the second the pipeline, the later ones either.
        for (int round = 0; round < 2; ++round) {
          for (std::size_t i = 0; i < count; ++i) sum[i] = avg[i] = top[i] = value(rank, i);
          comm.all_reduce(sum).wait();
          comm.all_reduce(avg, ddp::reduce_op::avg).wait();
          comm.all_reduce(top, ddp::reduce_op::max).wait();
          for (std::size_t i = 0; i < count; ++i) {
            float want = value(0, i);
            for (int r = 1; r < comm.size(); ++r) want += value(r, i);  // in rank order, as the transport sums
            expect_at(sum[i] == want, "sum", i);
            expect_at(avg[i] == want / static_cast<float>(comm.size()), "avg", i);
            expect_at(top[i] == value(comm.size() - 1, i), "max", i);
          }
        }
        // reduce_scatter (output apart from the input) and all_gather (in place, and apart): 4 MiB and more in all.
        const int n = comm.size();
        const std::size_t block = (std::size_t{1} << 20) / static_cast<std::size_t>(n) + 5;
        std::vector<float> in(block * static_cast<std::size_t>(n)), mine(block), all(in.size());
        for (int round = 0; round < 2; ++round) {
          for (std::size_t i = 0; i < in.size(); ++i) in[i] = value(rank, i);
          comm.reduce_scatter(in, mine, ddp::reduce_op::avg).wait();
          for (std::size_t i = 0; i < block; ++i) {
            const std::size_t at = static_cast<std::size_t>(rank) * block + i;
            float want = value(0, at);
            for (int r = 1; r < n; ++r) want += value(r, at);
            expect_at(mine[i] == want / static_cast<float>(n), "reduce_scatter", i);
          }
          for (std::size_t i = 0; i < block; ++i) mine[i] = value(rank, i);
          comm.all_gather(mine, all).wait();
          std::copy(mine.begin(), mine.end(), in.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rank) * block));
          comm.all_gather(std::span<const float>(in.data() + static_cast<std::size_t>(rank) * block, block), in).wait();
          for (int r = 0; r < n; ++r)
            for (std::size_t i = 0; i < block; ++i) {
              const std::size_t at = static_cast<std::size_t>(r) * block + i;
              expect_at(all[at] == value(r, i), "all_gather", at);
              expect_at(in[at] == value(r, i), "all_gather in place", at);
            }
        }
      },
      job(60s, 0, env)));
}

TEST_CASE("large collectives of a subgroup whose ranks are the world's reversed run either algorithm", "[tcp][shm]") {
  const std::string algo = GENERATE(as<std::string>{}, "single_copy", "pipeline", "auto");
  CAPTURE(algo);
  require_all_ok(run_ranks(
      3,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        // World ranks 0 and 2 in one group, ranked 2 then 0 (keys n - rank); world rank 1 alone.
        auto sub = comm.split(rank % 2, comm.size() - rank);
        const int n = sub.size(), me = sub.rank();
        const auto value = [](int r, std::size_t i) { return static_cast<float>(r + 1) * 0.5F + static_cast<float>(i % 11); };
        const std::size_t block = (std::size_t{1} << 20) + 7;  // 4 MiB and more in every collective below
        std::vector<float> in(block * static_cast<std::size_t>(n)), mine(block), all(in.size());
        for (int round = 0; round < 3; ++round) {
          for (std::size_t i = 0; i < in.size(); ++i) in[i] = value(me, i);
          sub.all_reduce(in).wait();
          for (std::size_t i = 0; i < in.size(); ++i) {
            float want = value(0, i);
            for (int r = 1; r < n; ++r) want += value(r, i);
            expect_at(in[i] == want, "subgroup all_reduce", i);
          }
          for (std::size_t i = 0; i < in.size(); ++i) in[i] = value(me, i);
          sub.reduce_scatter(in, mine).wait();
          for (std::size_t i = 0; i < block; ++i) {
            const std::size_t at = static_cast<std::size_t>(me) * block + i;
            float want = value(0, at);
            for (int r = 1; r < n; ++r) want += value(r, at);
            expect_at(mine[i] == want, "subgroup reduce_scatter", i);
          }
          for (std::size_t i = 0; i < block; ++i) mine[i] = value(me, i);
          sub.all_gather(mine, all).wait();
          for (std::size_t i = 0; i < all.size(); ++i)
            expect_at(all[i] == value(static_cast<int>(i / block), i % block), "subgroup all_gather", i);
        }
        std::vector<float> world(block, static_cast<float>(rank));
        comm.all_reduce(world).wait();
        expect(world[0] == 3.0F && world[block - 1] == 3.0F, "the world's all_reduce after the subgroup's");
      },
      job(60s, 0, [algo](int) { return ddp::launch::env_list{{"DDP_SHM", "1"}, {"DDP_SHM_ALGO", algo}}; })));
}

TEST_CASE("a large collective runs each algorithm once, then the faster, and tries the other less often while it loses",
          "[tcp][shm]") {
  using ddp::collective;
  using ddp::tcp::shm_algo;
  using namespace std::chrono;
  constexpr std::size_t mib = std::size_t{1} << 20;
  ddp::tcp::detail::algo_choice choice;
  // Runs `calls` all_reduce calls of `bytes`, each taking `single` or `pipeline` by the algorithm chosen; returns
  // the pipeline's count.
  const auto run = [&](std::size_t bytes, int calls, nanoseconds single, nanoseconds pipeline) {
    int piped = 0;
    for (int i = 0; i < calls; ++i) {
      const auto algo = choice.choose(collective::all_reduce, bytes);
      piped += algo == shm_algo::pipeline ? 1 : 0;
      choice.record(collective::all_reduce, bytes, algo, algo == shm_algo::pipeline ? pipeline : single);
    }
    return piped;
  };
  CHECK(choice.choose(collective::all_reduce, 16 * mib) == shm_algo::single_copy);
  choice.record(collective::all_reduce, 16 * mib, shm_algo::single_copy, 4ms);
  CHECK(choice.choose(collective::all_reduce, 16 * mib) == shm_algo::pipeline);
  choice.record(collective::all_reduce, 16 * mib, shm_algo::pipeline, 2ms);
  // The pipeline is faster: it runs, and single copies are tried after 4, 8, 16, ... calls, at most every 256th.
  const int piped = run(16 * mib, 1000, 4ms, 2ms);
  CHECK(piped >= 1000 - 10);
  CHECK(piped < 1000);
  // Each size class and each collective keeps its own timings: 64 MiB, and all_gather of 16 MiB, start over.
  CHECK(choice.choose(collective::all_reduce, 64 * mib) == shm_algo::single_copy);
  CHECK(choice.choose(collective::all_gather, 16 * mib) == shm_algo::single_copy);
  // The host gets busy: the pipeline slows down five-fold. Two slow calls move its median; then single copies
  // run, and the pipeline is tried after 4, 8, 16, ... calls again.
  CHECK(run(16 * mib, 3, 14ms, 70ms) == 2);
  CHECK(choice.choose(collective::all_reduce, 16 * mib) == shm_algo::single_copy);
  CHECK(run(16 * mib, 300, 14ms, 70ms) <= 7);
  // One slow call of the chosen algorithm does not swing the choice: the median of the latest three counts.
  choice.record(collective::all_reduce, 16 * mib, shm_algo::single_copy, 500ms);
  CHECK(choice.choose(collective::all_reduce, 16 * mib) == shm_algo::single_copy);
}

TEST_CASE("copies into shared memory give the same bits with either kind of store (DDP_SHM_STORES)", "[tcp][shm]") {
  const int n = GENERATE(2, 3);
  const std::string stores = GENERATE(as<std::string>{}, "ordinary", "streaming", "auto");
  CAPTURE(n, stores);
  require_all_ok(run_ranks(
      n,
      [](int rank) {
        auto comm = ddp::tcp::communicator::from_env();
        const auto value = [](int r, std::size_t i) { return static_cast<float>(r + 1) * 0.25F + static_cast<float>(i % 5); };
        // Up to 4 KiB (ordinary stores whatever the kind), the single-barrier path, the pipeline; odd counts
        // leave a tail past the streaming stores' 64-byte blocks.
        for (const std::size_t count : {std::size_t{1000}, std::size_t{5003}, std::size_t{(1 << 18) + 7}}) {
          std::vector<float> sum(count);
          for (std::size_t i = 0; i < count; ++i) sum[i] = value(rank, i);
          comm.all_reduce(sum).wait();
          const std::string what = "sum of " + std::to_string(count);
          for (std::size_t i = 0; i < count; ++i) {
            float want = value(0, i);
            for (int r = 1; r < comm.size(); ++r) want += value(r, i);
            expect_at(sum[i] == want, what.c_str(), i);
          }
        }
        // A send through the ring (rank 0 to the last rank), longer than the ring, from an odd address.
        const std::size_t bytes = (std::size_t{3} << 20) + 5;
        const int last = comm.size() - 1;
        std::vector<std::uint8_t> buf(bytes + 1);
        if (rank == 0) {
          for (std::size_t i = 0; i < bytes; ++i) buf[i + 1] = static_cast<std::uint8_t>(i * 7 + 3);
          comm.send(std::span<const std::uint8_t>(buf.data() + 1, bytes), last).wait();
        } else if (rank == last) {
          comm.recv(std::span<std::uint8_t>(buf.data() + 1, bytes), 0).wait();
          for (std::size_t i = 0; i < bytes; ++i)
            expect_at(buf[i + 1] == static_cast<std::uint8_t>(i * 7 + 3), "received byte", i);
        }
      },
      job(60s, 0, [stores](int) { return ddp::launch::env_list{{"DDP_SHM", "1"}, {"DDP_SHM_STORES", stores}}; })));
}

TEST_CASE("DDP_SHM_STORES or DDP_SHM_ALGO naming no choice is a config_error naming it", "[tcp][config][fast]") {
  struct variant {
    const char* name;
    const char* value;
    const char* choices;  // as the message lists them
  };
  const auto v = GENERATE(variant{"DDP_SHM_STORES", "fast", "auto, ordinary or streaming"},
                          variant{"DDP_SHM_ALGO", "copy", "auto, single_copy or pipeline"});
  CAPTURE(v.name);
  require_all_ok(run_ranks(
      1,
      [v](int) {
        try {
          (void)ddp::tcp::communicator::from_env();
        } catch (const ddp::config_error& e) {
          expect(contains(e.what(), std::string(v.name) + "='" + v.value + "'") && contains(e.what(), v.choices),
                 std::string("names the variable, its value and the choices: ") + e.what());
          return;
        }
        throw std::runtime_error("no config_error");
      },
      job(10s, 0, [v](int) { return ddp::launch::env_list{{v.name, v.value}}; })));
}

TEST_CASE("a segment /dev/shm has no room for is an error naming /dev/shm and DDP_SHM=0, and leaves nothing",
          "[tcp][shm][fast]") {
  struct statvfs fs {};
  REQUIRE(::statvfs("/dev/shm", &fs) == 0);
  const std::size_t too_much = static_cast<std::size_t>(fs.f_bavail) * fs.f_frsize + (std::size_t{1} << 30);
  const std::string name = ddp::tcp::detail::shm_user_prefix() + std::to_string(::getpid()) + "-too-big";
  try {
    (void)ddp::tcp::detail::shm_mapping::open(name, too_much, true, true, 3);
    FAIL("a segment larger than /dev/shm's free space was made");
  } catch (const ddp::error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(e.rank() == 3);
    CHECK(what.find("cannot reserve") != std::string::npos);
    CHECK(what.find(" free of ") != std::string::npos);
    CHECK(what.find("DDP_SHM=0") != std::string::npos);
  }
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  CHECK(fd < 0);  // unlinked
  if (fd >= 0) {
    ::close(fd);
    ::shm_unlink(name.c_str());
  }
}

TEST_CASE("a point-to-point ring /dev/shm has no room for is an error naming /dev/shm and DDP_SHM=0 at the first send, "
          "not a SIGBUS", "[tcp][shm]") {
  // In a child with a mount namespace of its own whose /dev/shm is a 512 KiB tmpfs: the rings' segment of 4 ranks
  // (4 MiB, sparse) maps, the heads of the incoming rings are taken, and the first send's ring (1 MiB) is refused.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (::unshare(CLONE_NEWNS) != 0 && ::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) std::_Exit(3);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=512k") != 0)
      std::_Exit(4);
    try {
      ddp::tcp::detail::shm_rings rings("/ddp-test-rings-" + std::to_string(::getpid()), 4, 0);
      rings.before_sending(1);
    } catch (const ddp::error& e) {
      const std::string what = e.what();
      const bool named = what.find("/dev/shm: ") != std::string::npos && what.find("DDP_SHM=0") != std::string::npos &&
                         what.find("the ring to rank 1") != std::string::npos;
      std::_Exit(named ? 0 : 5);
    }
    std::_Exit(6);  // the send was allowed
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO("child status " << status << " (3: no mount namespace, 4: no tmpfs mount, 5: the message, 6: no error)");
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("shared-memory segments are gone after a normal exit, a SIGKILLed rank, and a killed job", "[tcp][shm]") {
  // A segment a killed job left behind: named after a process that no longer exists.
  const ::pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string stale = ddp::tcp::detail::shm_user_prefix() + std::to_string(dead) + "-stale";
  // The same pid in another PID namespace (a container sharing /dev/shm): not this host's to judge, so kept.
  const std::string foreign = "/ddp-" + std::to_string(::getuid()) + "-1-" + std::to_string(dead) + "-foreign";
  for (const auto& name : {stale, foreign}) {
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    ::close(fd);
  }
  const bool kill_one = GENERATE(false, true);
  CAPTURE(kill_one);
  const auto rs = run_ranks(
      3,
      [kill_one](int rank) {
        std::fprintf(stderr, "pid=%d;\n", static_cast<int>(::getpid()));
        auto comm = ddp::tcp::communicator::from_env();
        std::vector<float> v(1 << 18, 1.0F);
        comm.all_reduce(v).wait();
        // Rank 1 dies once its part of the split and of its subgroup's call is done, which may be before a
        // survivor has seen the last phase of either: the notice of its death then fails that call instead of
        // the next one (the engine is shared, and unusable after the first error).
        try {
          auto sub = comm.split(rank % 2, rank);  // a subgroup's segment too
          sub.all_reduce(v).wait();
          if (kill_one && rank == 1) ::raise(SIGKILL);
          comm.all_reduce(v).wait();
        } catch (const ddp::peer_lost& e) {
          expect(kill_one, std::string("peer_lost without a killed rank: ") + e.what());
          expect(e.peer() == 1, std::string("peer_lost names rank 1: ") + e.what());
        }
      },
      [] {
        auto o = job(30s, 0, shm_env("1"));
        o.stop_on_failure = false;
        return o;
      }());
  INFO(all_output(rs));
  CHECK(rs.ranks[0].ok());
  CHECK(rs.ranks[2].ok());
  CHECK(contains(rs.ranks[0].output, "through shared memory"));
  CHECK(shm_entries(stale.substr(1)).empty());
  CHECK(shm_entries(foreign.substr(1)).size() == 1);
  ::shm_unlink(foreign.c_str());
  CHECK(shm_entries(printed_pid(rs.ranks[0].output)).empty());
}

TEST_CASE("a world larger than ddp::tcp's stated maximum is a config_error naming it and the other backends, before any "
          "socket", "[tcp][config][fast]") {
  ddp::tcp::config cfg;
  cfg.size = ddp::tcp::detail::max_world + 1;
  cfg.rank = cfg.size - 1;
  cfg.master_port = 29500;
  CHECK_THROWS_AS(ddp::tcp::communicator(cfg), ddp::config_error);
  CHECK_THROWS_WITH(ddp::tcp::communicator(cfg), Catch::Contains("WORLD_SIZE=4097") && Catch::Contains("4096") &&
                                                     Catch::Contains("MPI or NCCL"));
}

TEST_CASE("from_env reports a missing variable as config_error", "[tcp][config][fast]") {
  const auto rs = run_ranks(
      1,
      [](int) {
        ::unsetenv("RANK");
        try {
          (void)ddp::tcp::communicator::from_env();
        } catch (const ddp::config_error& e) {
          expect(contains(e.what(), "RANK"), "names RANK");
          return;
        }
        throw std::runtime_error("no config_error");
      },
      10s);
  require_all_ok(rs);
}
