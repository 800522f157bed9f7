// ddp::mpi::communicator under mpirun: the shared conformance suite on MPI_COMM_WORLD, then MPI-specific behaviour.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <conformance/conformance.hpp>
#include <ddp/comm/mpi/communicator.hpp>
#include <ddp/memory/devices.hpp>

#include "support/fake_device.hpp"

namespace {

using namespace std::chrono_literals;

/// MPI_COMM_WORLD with a timeout that fails a stuck collective well before ctest's limit.
ddp::mpi::communicator world() { return ddp::mpi::communicator::world({.timeout = 120s}); }

int next_rank(const ddp::mpi::communicator& c) { return (c.rank() + 1) % c.size(); }
int prev_rank(const ddp::mpi::communicator& c) { return (c.rank() + c.size() - 1) % c.size(); }

}  // namespace

TEST_CASE("mpi: the communicator conformance suite passes on MPI_COMM_WORLD", "[mpi][conformance]") {
  auto comm = world();
  try {
    ddp::testing::run_conformance(comm);
  } catch (const std::exception& e) {
    FAIL(e.what());
  }
}

TEST_CASE("mpi: the conformance suite passes with every collective non-blocking and with every one eager",
          "[mpi][conformance][eager]") {
  for (const std::size_t eager_bytes : {std::size_t{0}, std::numeric_limits<std::size_t>::max()}) {
    auto comm = ddp::mpi::communicator::world({.timeout = 120s, .eager_bytes = eager_bytes});
    try {
      ddp::testing::run_conformance(comm);
    } catch (const std::exception& e) {
      FAIL("eager_bytes = " << eager_bytes << ": " << e.what());
    }
  }
}

TEST_CASE("mpi: a collective on at most eager_bytes completes on start, counted and averaged like the others",
          "[mpi][eager]") {
  auto comm = world();
  const std::size_t limit = comm.settings().eager_bytes;
  CHECK(limit == std::size_t{256} << 10);
  CHECK(comm.eager(limit));
  CHECK_FALSE(comm.eager(limit + 1));
  CHECK_FALSE(ddp::mpi::communicator::world({.eager_bytes = 0}).eager(1));

  const auto n = static_cast<std::uint64_t>(comm.size());
  const auto before = comm.stats();
  std::vector<float> small(limit / sizeof(float), static_cast<float>(comm.rank()));
  ddp::work w = comm.all_reduce(std::span<float>(small), ddp::reduce_op::avg);
  CHECK(w.done());  // before any wait: the blocking call has run
  CHECK(w.wait_for(0ms));
  const float mean = static_cast<float>(n - 1) / 2;
  CHECK(small.front() == mean);
  CHECK(small.back() == mean);
  std::vector<std::int32_t> gathered(n, -1);
  const std::int32_t mine = comm.rank();
  CHECK(comm.all_gather(std::span<const std::int32_t>(&mine, 1), std::span<std::int32_t>(gathered)).done());
  for (std::uint64_t r = 0; r < n; ++r) CHECK(gathered[r] == static_cast<std::int32_t>(r));
  const auto after = comm.stats();
  using ddp::collective;
  CHECK(after.count(collective::all_reduce) - before.count(collective::all_reduce) == 1);
  CHECK(after.bytes(collective::all_reduce) - before.bytes(collective::all_reduce) == 2 * limit * (n - 1) / n);
  CHECK(after.count(collective::all_gather) - before.count(collective::all_gather) == 1);

  std::vector<float> large(limit / sizeof(float) + 1, static_cast<float>(comm.rank()));
  comm.all_reduce(std::span<float>(large), ddp::reduce_op::avg).wait();  // non-blocking, the same result
  CHECK(large.front() == mean);
  CHECK(large.back() == mean);
}

TEST_CASE("mpi: an eager collective that fails hands its ddp::mpi_error to the work, on the failing rank",
          "[mpi][eager][errors]") {
  auto comm = world();
  // A broadcast whose receiver passes fewer elements than the root sends: MPI_ERR_TRUNCATE at the receiver.
  // It runs in a group of ranks 0 and 1 (a larger tree would forward the truncated message on).
  const auto pair = comm.split(comm.rank() < 2 ? 0 : 1, comm.rank());
  if (comm.size() >= 2 && comm.rank() < 2) {
    auto group = pair;
    std::vector<float> b(group.rank() == 0 ? 8 : 4, 1.0F);
    ddp::work w = group.broadcast(std::span<float>(b), 0);
    if (group.rank() == 0) {
      CHECK(w.done());
    } else {
      CHECK_THROWS_AS(w.done(), ddp::mpi_error);
      try {
        w.wait();
        FAIL("a broadcast of 8 floats into 4 did not fail");
      } catch (const ddp::mpi_error& e) {
        int error_class = 0;
        MPI_Error_class(e.native_code(), &error_class);
        CHECK(error_class == MPI_ERR_TRUNCATE);
        CHECK(e.rank() == 1);
        CHECK(std::string(e.what()).find("broadcast of 4 f32 rooted at rank 0") != std::string::npos);
      }
    }
  }
  comm.barrier().wait();
}

TEST_CASE("mpi: world initializes MPI once with MPI_THREAD_MULTIPLE", "[mpi]") {
  auto a = world();
  auto b = ddp::mpi::communicator::world();
  int provided = 0;
  MPI_Query_thread(&provided);
  CHECK(provided == MPI_THREAD_MULTIPLE);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CHECK(a.size() == size);
  CHECK(b.rank() == a.rank());
  CHECK(a.native_handle() == MPI_COMM_WORLD);
}

TEST_CASE("mpi: an MPI failure surfaces as ddp::mpi_error with MPI's text, code and rank", "[mpi][errors]") {
  auto comm = world();  // MPI_COMM_WORLD now returns errors, including those about invalid communicators
  try {
    ddp::mpi::communicator invalid(MPI_COMM_NULL);
    FAIL("a communicator over MPI_COMM_NULL was accepted");
  } catch (const ddp::mpi_error& e) {
    int error_class = 0;
    MPI_Error_class(e.native_code(), &error_class);
    CHECK(error_class == MPI_ERR_COMM);
    CHECK(std::string(e.what()).find("MPI_Comm_rank failed: MPI_ERR_COMM") != std::string::npos);
  }
}

TEST_CASE("mpi: a truncated recv fails its work with MPI_ERR_TRUNCATE, on the receiving rank", "[mpi][errors]") {
  auto comm = world();
  // Open MPI's self transport (a rank sending to itself) truncates without an error, so the message crosses
  // ranks; with one rank there is no other rank to cross to and the check is the invalid-communicator one above.
  if (comm.size() == 1) return;
  std::vector<float> eight(8, 1.0F), four(4, 0.0F);
  ddp::work received = comm.recv(std::span<float>(four), prev_rank(comm), 77);
  ddp::work sent = comm.send(std::span<const float>(eight), next_rank(comm), 77);
  try {
    received.wait();
    FAIL("a recv of 4 floats matched with a send of 8 did not fail");
  } catch (const ddp::mpi_error& e) {
    const std::string text = e.what();
    int error_class = 0;
    MPI_Error_class(e.native_code(), &error_class);
    CHECK(error_class == MPI_ERR_TRUNCATE);
    CHECK(e.rank() == comm.rank());
    CHECK(text.find("MPI_ERR_TRUNCATE") != std::string::npos);
    CHECK(text.find("recv of 4 f32 from rank " + std::to_string(prev_rank(comm)) + " tag 77") != std::string::npos);
    CHECK(text.find("[rank " + std::to_string(comm.rank()) + "]") != std::string::npos);
  }
  CHECK_THROWS_AS(received.wait(), ddp::mpi_error);  // the error stays with the handle
  sent.wait();
  comm.barrier().wait();
}

TEST_CASE("mpi: wrong arguments raise ddp::error naming the call and the fix", "[mpi][errors]") {
  auto comm = world();
  std::vector<float> in(3), out(3 * static_cast<std::size_t>(comm.size()) + 1);
  try {
    (void)comm.all_gather(std::span<const float>(in), std::span<float>(out));
    FAIL("all_gather accepted an output of the wrong size");
  } catch (const ddp::error& e) {
    CHECK(std::string(e.what()).find("all_gather of 3 f32") != std::string::npos);
    CHECK(std::string(e.what()).find("size()=" + std::to_string(comm.size())) != std::string::npos);
  }
  std::vector<double> d(3);
  CHECK_THROWS_AS(comm.broadcast(std::span<double>(d), comm.size()), ddp::error);
  CHECK_THROWS_AS(comm.send(std::span<const double>(d), 0, -1), ddp::error);
  CHECK_THROWS_AS(comm.split(-1, 0), ddp::error);
  std::vector<std::int32_t> i32(3);
  CHECK_THROWS_AS(comm.all_gather(std::span<const float>(in), std::span<std::int32_t>(i32)), ddp::error);
  comm.barrier().wait();
}

TEST_CASE("mpi: device tensors on an MPI without CUDA support go through their device's domain", "[mpi]") {
  auto comm = world();
  if (ddp::mpi::communicator::cuda_aware()) {
    WARN("this MPI is CUDA-aware: device buffers go to MPI directly and are tested by the gpu-labelled tests");
    return;
  }
  ddp::testing::fake_device dev(0), stranger(1);  // stranger: no domain registered for cuda:1
  const ddp::device_registration registered(dev);
  const std::size_t n = 1000;
  std::vector<float> mine(n), host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = mine[i] = static_cast<float>(comm.rank() + 1) * 0.25F + static_cast<float>(i % 7);
  const ddp::domain_buffer memory = dev.allocate(n * sizeof(float));
  const ddp::raw_tensor on_device = memory.view(ddp::dtype::f32, 0, n);
  dev.copy(ddp::raw_tensor::of(std::span<float>(mine)), on_device);
  ddp::work w = comm.all_reduce(on_device, ddp::reduce_op::avg);
  dev.scale(on_device, 2.0);  // queued on the device after the result's copy back, with no host wait between
  comm.all_reduce(std::span<float>(host), ddp::reduce_op::avg).wait();
  w.wait();
  const auto got = dev.read<float>(on_device);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == 2.0F * host[i]);
  const ddp::domain_buffer elsewhere = stranger.allocate(16);
  try {
    (void)comm.all_reduce(elsewhere.view(ddp::dtype::f32, 0, 4), ddp::reduce_op::sum);
    FAIL("a cuda:1 tensor without a memory domain was accepted");
  } catch (const ddp::config_error& e) {
    CHECK(std::string(e.what()).find("cuda:1 has no memory domain") != std::string::npos);
    CHECK(std::string(e.what()).find("device_registration") != std::string::npos);
  }
}

TEST_CASE("mpi: a communicator over a foreign MPI_Comm neither frees it nor keeps its error handler", "[mpi]") {
  auto comm = world();
  MPI_Comm foreign = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &foreign) == MPI_SUCCESS);
  REQUIRE(MPI_Comm_set_errhandler(foreign, MPI_ERRORS_ARE_FATAL) == MPI_SUCCESS);
  {
    ddp::mpi::communicator wrapped(foreign, {.timeout = 60s});
    ddp::mpi::communicator copy = wrapped;
    {
      ddp::mpi::communicator second(foreign);  // a second wrapper going away first leaves the handler alone
    }
    CHECK(copy.native_handle() == foreign);
    CHECK(copy.rank() == comm.rank());
    std::vector<std::int64_t> v{comm.rank() + 1};
    copy.all_reduce(std::span<std::int64_t>(v), ddp::reduce_op::sum).wait();
    CHECK(v[0] == static_cast<std::int64_t>(comm.size()) * (comm.size() + 1) / 2);
    MPI_Errhandler during = MPI_ERRHANDLER_NULL;
    MPI_Comm_get_errhandler(foreign, &during);
    CHECK(during == MPI_ERRORS_RETURN);
    MPI_Errhandler_free(&during);
  }
  MPI_Errhandler after = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(foreign, &after);
  CHECK(after == MPI_ERRORS_ARE_FATAL);
  MPI_Errhandler_free(&after);
  CHECK(MPI_Barrier(foreign) == MPI_SUCCESS);  // still a live communicator
  CHECK(MPI_Comm_free(&foreign) == MPI_SUCCESS);
}

TEST_CASE("mpi: split groups are shared by their copies and run their own collectives", "[mpi]") {
  auto comm = world();
  const auto sub = comm.split(comm.rank() % 2, -comm.rank());
  auto copy = sub;
  CHECK(copy.native_handle() == sub.native_handle());
  CHECK(copy.native_handle() != comm.native_handle());
  std::vector<std::int32_t> v{1};
  copy.all_reduce(std::span<std::int32_t>(v), ddp::reduce_op::sum).wait();
  CHECK(v[0] == sub.size());
  CHECK(copy.stats().count(ddp::collective::all_reduce) == 1);
  CHECK(copy.settings().timeout == comm.settings().timeout);
}

TEST_CASE("mpi: wait_for times out on a recv without a send, which completes once sent or cancels when dropped",
          "[mpi][timeout]") {
  auto comm = world();
  std::vector<std::int32_t> in(2, -1), never(1, -1);
  const std::vector<std::int32_t> out{comm.rank(), 7};
  ddp::work late = comm.recv(std::span<std::int32_t>(in), prev_rank(comm), 123);
  CHECK_FALSE(late.wait_for(50ms));
  CHECK_FALSE(late.done());
  {
    ddp::work dropped = comm.recv(std::span<std::int32_t>(never), prev_rank(comm), 124);
    CHECK_FALSE(dropped.wait_for(10ms));
  }  // never sent: cancelled here
  comm.barrier().wait();
  ddp::work sent = comm.send(std::span<const std::int32_t>(out), next_rank(comm), 123);
  late.wait();
  sent.wait();
  CHECK(in[0] == prev_rank(comm));
  CHECK(in[1] == 7);
  CHECK(never[0] == -1);

  auto hasty = ddp::mpi::communicator(MPI_COMM_WORLD, {.timeout = 100ms});
  ddp::work stuck = hasty.recv(std::span<std::int32_t>(never), prev_rank(comm), 125);
  try {
    stuck.wait();
    FAIL("a recv without a send completed");
  } catch (const ddp::timeout_error& e) {
    CHECK(std::string(e.what()).find("recv of 1 i32") != std::string::npos);
    CHECK(std::string(e.what()).find("100 ms") != std::string::npos);
    CHECK(e.rank() == comm.rank());
  }
  comm.barrier().wait();
}

TEST_CASE("mpi: avg on integers divides with truncation toward zero", "[mpi]") {
  auto comm = world();
  const std::int64_t n = comm.size();
  std::vector<std::int32_t> up{comm.rank()}, down{-comm.rank()};
  comm.all_reduce(std::span<std::int32_t>(up), ddp::reduce_op::avg).wait();
  comm.all_reduce(std::span<std::int32_t>(down), ddp::reduce_op::avg).wait();
  CHECK(up[0] == n * (n - 1) / 2 / n);
  CHECK(down[0] == -(n * (n - 1) / 2) / n);
}

TEST_CASE("mpi: stats count the algorithm-independent payload bytes", "[mpi]") {
  auto comm = world();
  const auto n = static_cast<std::uint64_t>(comm.size());
  const auto before = comm.stats();
  std::vector<float> buf(1024, 1.0F), all(1024 * n);
  comm.all_reduce(std::span<float>(buf)).wait();
  comm.all_gather(std::span<const float>(buf), std::span<float>(all)).wait();
  comm.barrier().wait();
  const auto after = comm.stats();
  using ddp::collective;
  CHECK(after.bytes(collective::all_reduce) - before.bytes(collective::all_reduce) == 2 * 4096 * (n - 1) / n);
  CHECK(after.bytes(collective::all_gather) - before.bytes(collective::all_gather) == 4096 * (n - 1));
  CHECK(after.count(collective::barrier) - before.count(collective::barrier) == 1);
}

TEST_CASE("mpi: with the progress thread a non-blocking all_reduce completes while every rank computes without "
          "calling MPI, and without it it does not",
          "[mpi][progress]") {
  // Each rank sleeps instead of computing: no MPI call of its own between the start and one MPI_Test. The
  // reduction spans several libnbc rounds, each needing every rank inside MPI, so one MPI_Test cannot finish it.
  const auto sleeping_start = [](ddp::mpi::progress_mode mode) {
    auto comm = ddp::mpi::communicator::world({.timeout = 120s, .eager_bytes = 0, .progress = mode});
    std::vector<float> v(std::size_t{1} << 20, 1.0F);  // 4 MiB
    comm.barrier().wait();
    ddp::work w = comm.all_reduce(v);
    std::this_thread::sleep_for(1500ms);
    const bool done = w.done();
    w.wait();
    REQUIRE(v[12345] == static_cast<float>(comm.size()));
    comm.barrier().wait();
    return done;
  };
  const bool alone = sleeping_start(ddp::mpi::progress_mode::off);
  CHECK(sleeping_start(ddp::mpi::progress_mode::on));
  if (world().size() > 1) CHECK_FALSE(alone);  // the control: the thread is what moved it
}
