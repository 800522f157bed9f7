// ddp::local in one process: the conformance suite at 1-4 threads, mismatches, timeouts, threads that throw or
// return early (their peers fail within a second, run names the rank), send/recv matching, and buffers that alias.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/comm/local/run.hpp>

#include "conformance/conformance.hpp"

namespace {
using namespace std::chrono_literals;
using ddp::local::communicator;
using clock_type = std::chrono::steady_clock;

/// Settings with a short timeout, for the tests of failures.
ddp::local::config quick(std::chrono::milliseconds timeout) {
  ddp::local::config cfg;
  cfg.timeout = timeout;
  return cfg;
}

/// The message of the ddp::error `f` raises, or "" when it raises none.
template <class Error, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

static_assert(std::is_same_v<ddp::backend_of_t<communicator>, ddp::backend::local>);
}  // namespace

TEST_CASE("the conformance suite passes on 1 to 4 threads", "[local][conformance]") {
  const int n = GENERATE(1, 2, 3, 4);
  CAPTURE(n);
  REQUIRE_NOTHROW(ddp::local::run(n, quick(20s), [](communicator comm) { ddp::testing::run_conformance(comm); }));
}

TEST_CASE("the conformance suite passes with DDP_CHECK_COLLECTIVES=1, which exchanges every call", "[local][conformance]") {
  ::setenv("DDP_CHECK_COLLECTIVES", "1", 1);
  std::vector<std::uint64_t> checks(3);
  REQUIRE_NOTHROW(ddp::local::run(3, quick(20s), [&](communicator comm) {
    ddp::testing::run_conformance(comm);
    checks[static_cast<std::size_t>(comm.rank())] = comm.stats().call_checks;
  }));
  ::unsetenv("DDP_CHECK_COLLECTIVES");
  for (const auto c : checks) CHECK(c > 100);
}

TEST_CASE("mismatched collectives raise mismatch_error on every rank naming both calls", "[local][mismatch]") {
  struct variant {
    const char* name;
    const char* first;
    const char* second;
  };
  const auto v = GENERATE(variant{"op", "all_reduce(sum) of 1024 f32", "broadcast of 1024 f32 rooted at rank 0"},
                          variant{"dtype", "all_reduce(sum) of 1024 f32", "all_reduce(sum) of 1024 f64"},
                          variant{"count", "all_reduce(sum) of 1024 f32", "all_reduce(sum) of 8 f32"},
                          variant{"reduce op", "all_reduce(sum) of 1024 f32", "all_reduce(max) of 1024 f32"},
                          variant{"root", "broadcast of 1024 f32 rooted at rank 0", "broadcast of 1024 f32 rooted at rank 1"},
                          variant{"order", "all_reduce(sum) of 1024 f32", "all_gather of 1024 f32"});
  CAPTURE(v.name);
  const std::string kind = v.name;
  std::vector<std::string> messages(2);
  ddp::local::run(2, quick(5s), [&](communicator comm) {
    const int rank = comm.rank();
    std::vector<float> f(1024, 1.0F), gathered(2048), small(8, 1.0F);
    std::vector<double> d(1024, 1.0);
    messages[static_cast<std::size_t>(rank)] = message_of<ddp::mismatch_error>([&] {
      if (rank == 0 && kind == "root") comm.broadcast(f, 0).wait();
      else if (rank == 0) comm.all_reduce(f).wait();
      else if (kind == "op") comm.broadcast(f, 0).wait();
      else if (kind == "dtype") comm.all_reduce(d).wait();
      else if (kind == "count") comm.all_reduce(small).wait();
      else if (kind == "reduce op") comm.all_reduce(f, ddp::reduce_op::max).wait();
      else if (kind == "root") comm.broadcast(f, 1).wait();
      else comm.all_gather(std::span<const float>(f), std::span<float>(gathered)).wait();
    });
  });
  for (const auto& m : messages) {
    INFO(m);
    CHECK_THAT(m, Catch::Contains(v.first) && Catch::Contains(v.second) && Catch::Contains("in a local group of 2"));
  }
}

TEST_CASE("an operation a peer never joins raises timeout_error at the deadline naming the missing rank",
          "[local][timeout]") {
  std::string message;
  clock_type::duration waited{};
  ddp::local::run(2, quick(500ms), [&](communicator comm) {
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(1500ms);
      return;
    }
    std::vector<float> v(100, 1.0F);
    auto w = comm.all_reduce(v);
    if (w.wait_for(100ms)) throw std::runtime_error("wait_for returned true while the peer was away");
    const auto t0 = clock_type::now();
    message = message_of<ddp::timeout_error>([&] { w.wait(); });
    waited = clock_type::now() - t0;
  });
  INFO(message);
  CHECK_THAT(message, Catch::Contains("all_reduce(sum) of 100 f32 in a local group of 2 (sequence 0) did not complete "
                                      "within 500 ms, waiting for rank 1 (not there yet)"));
  CHECK(waited < 1500ms);
}

TEST_CASE("a thread that throws fails its peers' collectives within a second and run names it", "[local][fault]") {
  std::vector<std::string> seen(4);
  const auto t0 = clock_type::now();
  try {
    ddp::local::run(4, quick(60s), [&](communicator comm) {
      std::vector<float> v(1 << 16, 1.0F);
      comm.all_reduce(v).wait();
      if (comm.rank() == 2) throw std::runtime_error("boom in the model");
      seen[static_cast<std::size_t>(comm.rank())] = message_of<ddp::peer_lost>([&] {
        comm.all_reduce(v).wait();
        comm.barrier().wait();
      });
      if (!seen[static_cast<std::size_t>(comm.rank())].empty()) throw ddp::peer_lost("rethrown", comm.rank(), 2);
    });
    FAIL("run returned although rank 2 threw");
  } catch (const ddp::error& e) {
    INFO(e.what());
    CHECK(e.rank() == 2);
    CHECK_THAT(e.what(), Catch::Contains("rank 2 of ddp::local::run(4) threw: boom in the model"));
    CHECK_THROWS_WITH(std::rethrow_if_nested(e), "boom in the model");
  }
  CHECK(clock_type::now() - t0 < 1s);
  for (const int r : {0, 1, 3}) {
    INFO(seen[static_cast<std::size_t>(r)]);
    CHECK_THAT(seen[static_cast<std::size_t>(r)], Catch::Contains("rank 2 left the function ddp::local::run runs for "
                                                                  "it (it threw: boom in the model)"));
  }
}

TEST_CASE("a thread that returns early fails its peers' next collective, and a ddp::error comes out of run as it is",
          "[local][fault]") {
  const auto t0 = clock_type::now();
  std::string what;
  int rank = -1;
  try {
    ddp::local::run(3, quick(60s), [&](communicator comm) {
      if (comm.rank() == 1) return;
      std::vector<std::int64_t> v(5, 1);
      comm.all_reduce(v).wait();
    });
  } catch (const ddp::peer_lost& e) {
    what = e.what();
    rank = e.rank();
    CHECK(e.peer() == 1);
  }
  INFO(what);
  CHECK((rank == 0 || rank == 2));
  CHECK_THAT(what, Catch::Contains("all_reduce(sum) of 5 i64 in a local group of 3") &&
                       Catch::Contains("rank 1 left the function ddp::local::run runs for it (it returned)"));
  CHECK(clock_type::now() - t0 < 1s);
  CHECK_THROWS_AS(ddp::local::run(2, [](communicator comm) {
                    if (comm.rank() == 1) throw ddp::config_error("bad flag", comm.rank());
                  }),
                  ddp::config_error);
  CHECK_THROWS_AS(ddp::local::run(0, [](communicator) {}), ddp::config_error);
}

TEST_CASE("ranks waiting on their operations in different orders do not block each other", "[local]") {
  REQUIRE_NOTHROW(ddp::local::run(3, quick(5s), [](communicator comm) {
    std::vector<float> a(1000, 1.0F), b(3000, 2.0F);
    auto wa = comm.all_reduce(a), wb = comm.all_reduce(b);
    if (comm.rank() % 2 == 0) {
      wa.wait();
      wb.wait();
    } else {
      wb.wait();
      wa.wait();
    }
    if (a[999] != 3.0F || b[2999] != 6.0F) throw std::runtime_error("wrong sums");
  }));
}

TEST_CASE("send and recv: counts must match, a recv that times out is withdrawn and its buffer left alone",
          "[local][p2p]") {
  std::vector<std::string> messages(2);
  ddp::local::run(2, quick(5s), [&](communicator comm) {
    std::vector<float> four(4, 1.0F), five(5, 1.0F);
    messages[static_cast<std::size_t>(comm.rank())] = message_of<ddp::mismatch_error>([&] {
      if (comm.rank() == 0) comm.send(std::span<const float>(four), 1, 3).wait();
      else comm.recv(std::span<float>(five), 0, 3).wait();
    });
  });
  for (const auto& m : messages)
    CHECK_THAT(m, Catch::Contains("rank 0 sends 4 f32 with tag 3 where rank 1 receives 5 f32"));

  std::vector<std::int32_t> kept;
  std::string timed_out;
  ddp::local::run(2, quick(1s), [&](communicator comm) {
    std::vector<std::int32_t> v(16, -7);
    if (comm.rank() == 0) {
      timed_out = message_of<ddp::timeout_error>([&] { comm.recv(v, 1, 5).wait(); });
      kept = v;
    } else {
      std::this_thread::sleep_for(1500ms);  // past the recv's deadline
    }
    comm.barrier().wait();
    if (comm.rank() == 1) {
      std::fill(v.begin(), v.end(), 42);
      comm.send(std::span<const std::int32_t>(v), 0, 5).wait();
    } else {
      std::vector<std::int32_t> fresh(16, 0);
      comm.recv(fresh, 1, 5).wait();
      if (fresh[15] != 42) throw std::runtime_error("the late send did not reach the new recv");
    }
  });
  CHECK_THAT(timed_out, Catch::Contains("recv of 16 i32 from rank 1 tag 5 in a local group of 2"));
  CHECK(kept == std::vector<std::int32_t>(16, -7));
}

TEST_CASE("buffers that alias: in-place all_gather and reduce_scatter, an overlapping reduce_scatter, all_to_all over one buffer",
          "[local][alias]") {
  REQUIRE_NOTHROW(ddp::local::run(3, quick(5s), [](communicator comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    constexpr std::size_t k = 1000;
    std::vector<float> all(3 * k, -1.0F);
    std::fill_n(all.begin() + static_cast<std::ptrdiff_t>(r * k), k, static_cast<float>(r));
    comm.all_gather(std::span<const float>(all.data() + r * k, k), std::span<float>(all)).wait();
    for (std::size_t j = 0; j < all.size(); ++j)
      if (all[j] != static_cast<float>(j / k)) throw std::runtime_error("in-place all_gather");
    std::vector<float> sums(3 * k, static_cast<float>(r + 1));
    comm.reduce_scatter(std::span<const float>(sums), std::span<float>(sums.data() + r * k, k)).wait();
    if (sums[r * k] != 6.0F || sums[r * k + k - 1] != 6.0F) throw std::runtime_error("in-place reduce_scatter");
    std::vector<float> shifted(3 * k, static_cast<float>(r + 1));  // the output is the input's first block
    comm.reduce_scatter(std::span<const float>(shifted), std::span<float>(shifted.data(), k)).wait();
    if (shifted[0] != 6.0F || shifted[k - 1] != 6.0F) throw std::runtime_error("overlapping reduce_scatter");
    std::vector<std::int64_t> swap(3 * 2);
    for (std::size_t j = 0; j < swap.size(); ++j) swap[j] = static_cast<std::int64_t>(10 * r + j / 2);
    comm.all_to_all(std::span<const std::int64_t>(swap), std::span<std::int64_t>(swap)).wait();
    for (std::size_t j = 0; j < swap.size(); ++j)
      if (swap[j] != static_cast<std::int64_t>(10 * (j / 2) + r)) throw std::runtime_error("all_to_all in place");
  }));
}
