// The opt-in cross-rank call check (DDP_CHECK_COLLECTIVES=1) of the collective front end, through ddp::mpi under
// mpirun: mismatched collectives raise ddp::mismatch_error naming both calls on every rank, matched ones run as
// before, and with the variable unset no check message is exchanged.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <conformance/conformance.hpp>
#include <ddp/comm/call_check.hpp>
#include <ddp/comm/mpi/communicator.hpp>

namespace {

using namespace std::chrono_literals;
using ddp::collective;

/// Every collective non-blocking, so that each one is bounded by the timeout (the check's exchange included).
constexpr ddp::mpi::config bounded{.timeout = 20s, .eager_bytes = 0};

/// MPI_COMM_WORLD as a group made while DDP_CHECK_COLLECTIVES=1 is set (the variable is read when a group is made).
ddp::mpi::communicator checked_world() {
  REQUIRE(::setenv("DDP_CHECK_COLLECTIVES", "1", 1) == 0);
  auto comm = ddp::mpi::communicator::world(bounded);
  REQUIRE(::unsetenv("DDP_CHECK_COLLECTIVES") == 0);
  return comm;
}

/// Collectives started in `s`, send/recv aside.
std::uint64_t collectives(const ddp::comm_stats& s) {
  std::uint64_t n = 0;
  for (std::size_t k = 0; k < ddp::collective_count; ++k)
    if (static_cast<collective>(k) != collective::send_recv) n += s.calls[k];
  return n;
}

/// Rank 1 runs `odd`, every other rank `usual`; each rank must raise ddp::mismatch_error within 5 s, naming the
/// call `mine` of this rank and the call `other` of the first rank that differs from it.
void expect_mismatch(ddp::mpi::communicator& comm, const std::function<ddp::work()>& usual,
                     const std::function<ddp::work()>& odd, const std::string& usual_text,
                     const std::string& odd_text) {
  const bool is_odd = comm.rank() == 1;
  const auto checks_before = comm.stats().call_checks;
  const auto start = std::chrono::steady_clock::now();
  try {
    (is_odd ? odd : usual)().wait();
    FAIL("rank " << comm.rank() << " ran a collective that another rank called differently");
  } catch (const ddp::mismatch_error& e) {
    const std::string text = e.what();
    INFO(text);
    CHECK(std::chrono::steady_clock::now() - start < 5s);
    CHECK(e.rank() == comm.rank());
    CHECK(text.find("called " + (is_odd ? usual_text : odd_text)) != std::string::npos);
    CHECK(text.find("rank " + std::string(is_odd ? "0" : "1") + " called") != std::string::npos);
    CHECK(text.find("this rank called " + (is_odd ? odd_text : usual_text)) != std::string::npos);
    CHECK(text.find("DDP_CHECK_COLLECTIVES") != std::string::npos);
  }
  CHECK(comm.stats().call_checks - checks_before == 1);
}

}  // namespace

TEST_CASE("call check: a mismatch of operation, count, dtype or root raises mismatch_error naming both calls",
          "[mpi][call_check]") {
  auto comm = checked_world();
  if (comm.size() == 1) {  // no second rank to differ from: the comparison itself, on a fabricated second rank
    const ddp::detail::call_info mine{.kind = collective::all_reduce, .name = "all_reduce", .op = ddp::reduce_op::sum,
                                      .type = ddp::dtype::f32, .count = 8};
    const ddp::detail::call_info theirs{
        .kind = collective::broadcast, .name = "broadcast", .type = ddp::dtype::f32, .count = 8, .peer = 0};
    const auto a = ddp::detail::fingerprint(mine), b = ddp::detail::fingerprint(theirs);
    std::vector<std::int64_t> all(a.begin(), a.end());
    all.insert(all.end(), b.begin(), b.end());
    CHECK_THROWS_WITH(ddp::detail::compare_calls(mine, all, 0),
                      Catch::Contains("rank 1 called broadcast of 8 f32 rooted at rank 0") &&
                          Catch::Contains("this rank called all_reduce(sum) of 8 f32"));
    CHECK_NOTHROW(ddp::detail::compare_calls(mine, std::span<const std::int64_t>(all).first(4), 0));
    return;
  }
  std::vector<float> f(8, 1.0F), f4(4, 1.0F);
  std::vector<std::int32_t> i(8, 1);
  SECTION("operation") {
    expect_mismatch(
        comm, [&] { return comm.all_reduce(std::span<float>(f)); }, [&] { return comm.broadcast(std::span<float>(f)); },
        "all_reduce(sum) of 8 f32", "broadcast of 8 f32 rooted at rank 0");
  }
  SECTION("operator") {
    expect_mismatch(
        comm, [&] { return comm.all_reduce(std::span<float>(f)); },
        [&] { return comm.all_reduce(std::span<float>(f), ddp::reduce_op::max); }, "all_reduce(sum) of 8 f32",
        "all_reduce(max) of 8 f32");
  }
  SECTION("count") {
    expect_mismatch(
        comm, [&] { return comm.all_reduce(std::span<float>(f)); },
        [&] { return comm.all_reduce(std::span<float>(f4)); },
        "all_reduce(sum) of 8 f32", "all_reduce(sum) of 4 f32");
  }
  SECTION("dtype") {
    expect_mismatch(
        comm, [&] { return comm.all_reduce(std::span<float>(f)); },
        [&] { return comm.all_reduce(std::span<std::int32_t>(i)); }, "all_reduce(sum) of 8 f32",
        "all_reduce(sum) of 8 i32");
  }
  SECTION("root") {
    expect_mismatch(
        comm, [&] { return comm.broadcast(std::span<float>(f), 0); },
        [&] { return comm.broadcast(std::span<float>(f), 1); }, "broadcast of 8 f32 rooted at rank 0",
        "broadcast of 8 f32 rooted at rank 1");
  }
  // No rank started the mismatched collective: the group goes on, matched.
  std::vector<std::int32_t> one{1};
  comm.all_reduce(std::span<std::int32_t>(one)).wait();
  CHECK(one[0] == comm.size());
}

TEST_CASE("call check: matched collectives pass the conformance suite, each checked once", "[mpi][call_check]") {
  auto comm = checked_world();
  const auto before = comm.stats();
  try {
    ddp::testing::run_conformance(comm);
  } catch (const std::exception& e) {
    FAIL(e.what());
  }
  const auto after = comm.stats();
  CHECK(collectives(after) > collectives(before));
  CHECK(after.call_checks - before.call_checks == collectives(after) - collectives(before));
}

TEST_CASE("call check: without DDP_CHECK_COLLECTIVES no check message is exchanged", "[mpi][call_check]") {
  REQUIRE(::unsetenv("DDP_CHECK_COLLECTIVES") == 0);
  auto comm = ddp::mpi::communicator::world(bounded);
  std::vector<float> f(8, 1.0F), all(8 * static_cast<std::size_t>(comm.size()));
  comm.all_reduce(std::span<float>(f)).wait();
  comm.all_gather(std::span<const float>(f), std::span<float>(all)).wait();
  comm.broadcast(std::span<float>(f), 0).wait();
  comm.barrier().wait();
  const auto s = comm.stats();
  CHECK(collectives(s) == 4);
  CHECK(s.call_checks == 0);
  CHECK(s.count(collective::all_gather) == 1);  // the only all_gather is the caller's
}
