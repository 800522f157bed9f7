// The rendezvous under strangers and mistakes: floods before the handshake, descriptor exhaustion, idle
// connections on the mesh ports, a missing rank, a rank started twice. Every limit a stranger meets is
// measured here (memory from /proc/self/status, CPU time from getrusage, delays on the clock).

#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>

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
using ddp::testing::free_port;
using ddp::testing::tcp::job;
namespace d = ddp::tcp::detail;

namespace {

/// This process's resident set in bytes (VmRSS of /proc/self/status).
std::size_t resident_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;  // no /proc: the caller's check of the baseline fails
}

/// User plus system CPU time of this process, in seconds.
double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

/// Rank 0's store served by an engine in this process, as in a job.
struct served_store {
  explicit served_store(const d::job_key& token, d::handshake_limits limits = {})
      : port(static_cast<std::uint16_t>(free_port())),
        server(0, 1, &d::run_collective, d::store_server(d::listen_on("127.0.0.1", port, 0, "store"), token, 0, limits)) {}
  std::uint16_t port;
  d::engine server;
};

/// Runs `body` in a forked child (so its resource limits stay there) and returns what it wrote to `out`
/// and whether it exited 0; the child is killed after `limit`.
std::pair<std::string, bool> in_child(const std::function<std::string()>& body, std::chrono::seconds limit) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    int code = 0;
    std::string text;
    try {
      text = body();
    } catch (const std::exception& e) {
      text = std::string("child failed: ") + e.what();
      code = 1;
    }
    [[maybe_unused]] const auto n = ::write(fds[1], text.data(), text.size());
    ::_exit(code);
  }
  ::close(fds[1]);
  std::string text;
  const auto deadline = d::clock::now() + limit;
  for (char buf[4096];;) {
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, d::poll_ms(deadline)) <= 0) break;
    const ssize_t k = ::read(fds[0], buf, sizeof buf);
    if (k <= 0) break;
    text.append(buf, static_cast<std::size_t>(k));
  }
  ::close(fds[0]);
  if (d::clock::now() >= deadline) ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {text, WIFEXITED(status) && WEXITSTATUS(status) == 0};
}

/// In a rank: joining the job must fail with `Error` within `seconds` (printed to stderr with the time taken).
template <class Error>
void join_fails_within(double seconds, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  try {
    auto comm = ddp::tcp::communicator::from_env();
  } catch (const Error& e) {
    const auto took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "failed after %.3f s: %s\n", took, e.what());
    expect(took < seconds, what);
    return;
  }
  throw std::runtime_error("joined a job it should not have joined: " + what);
}

}  // namespace

TEST_CASE("four 256 MiB floods before the handshake grow rank 0 by at most 32 MiB", "[tcp][store][limits]") {
  const d::job_key token = d::job_key_of("flood-test");
  served_store store(token);
  constexpr std::size_t chunk = 1 << 20, flood = 256 * chunk;
  const std::vector<char> junk(chunk, 'x');  // the strangers' bytes: allocated before the baseline
  std::atomic<bool> flooding{true};
  std::atomic<std::size_t> peak{0};
  const std::size_t before = resident_bytes();
  REQUIRE(before > 0);
  std::thread sampler([&] {
    for (int i = 0; i < 12000 && flooding; ++i) {  // at most 60 s
      peak = std::max(peak.load(), resident_bytes());
      std::this_thread::sleep_for(5ms);
    }
  });
  std::vector<std::size_t> sent(4, 0);
  std::vector<std::thread> strangers;
  for (std::size_t s = 0; s < sent.size(); ++s)
    strangers.emplace_back([&, s] {
      auto fd = d::connect_with_retry("127.0.0.1", store.port, d::clock::now() + 5s, -1, "store", "");
      const auto until = d::clock::now() + 20s;
      while (sent[s] < flood && d::send_all(fd.get(), junk.data(), chunk, until) == d::io_status::ok) sent[s] += chunk;
    });
  for (auto& t : strangers) t.join();
  flooding = false;
  sampler.join();
  const double grown_mib = (static_cast<double>(peak.load()) - static_cast<double>(before)) / (1 << 20);
  WARN("rank 0's resident set grew by " << grown_mib << " MiB under four floods");
  CHECK(grown_mib <= 32.0);
  for (const std::size_t bytes : sent) CHECK(bytes < flood);  // each flood was cut off, not swallowed
  d::store_client client("127.0.0.1", store.port, token, 1, d::clock::now() + 5s);
  CHECK(client.add("after the floods", 7) == 7);
}

TEST_CASE("a connection silent past the handshake deadline is closed, and the oldest goes past the cap",
          "[tcp][store][limits]") {
  const d::job_key token = d::job_key_of("deadline-test");
  served_store store(token, {.timeout = 300ms, .max_pending = 2});
  const auto connect = [&] {  // a connection that took the store's challenge and says nothing
    auto fd = d::connect_with_retry("127.0.0.1", store.port, d::clock::now() + 5s, -1, "store", "");
    d::challenge nonce{};
    REQUIRE(d::recv_all(fd.get(), nonce.data(), nonce.size(), d::clock::now() + 5s) == d::io_status::ok);
    return fd;
  };
  std::uint8_t byte = 0;
  SECTION("deadline") {
    auto silent = connect();
    const auto start = d::clock::now();
    CHECK(d::recv_all(silent.get(), &byte, 1, start + 5s) == d::io_status::closed);
    const double took = std::chrono::duration<double>(d::clock::now() - start).count();
    CHECK(took >= 0.25);
    CHECK(took < 2.0);
  }
  SECTION("cap") {
    auto oldest = connect();
    auto second = connect();
    std::this_thread::sleep_for(100ms);  // both are in their handshake
    auto third = connect();
    const auto start = d::clock::now();
    CHECK(d::recv_all(oldest.get(), &byte, 1, start + 5s) == d::io_status::closed);
    CHECK(d::clock::now() - start < 250ms);  // closed by the cap, before its handshake deadline
  }
  d::store_client client("127.0.0.1", store.port, token, 1, d::clock::now() + 5s);
  CHECK(client.add("still serving", 2) == 2);
}

TEST_CASE("a store out of file descriptors backs off instead of spinning, then recovers", "[tcp][store][limits]") {
  const auto [text, ok] = in_child(
      [] {
        const d::job_key token = d::job_key_of("emfile-test");
        served_store store(token);
        std::vector<d::socket_fd> callers;
        for (int i = 0; i < 4; ++i) callers.emplace_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        rlimit old{};
        ::getrlimit(RLIMIT_NOFILE, &old);
        rlimit low = old;
        low.rlim_cur = 128;
        expect(::setrlimit(RLIMIT_NOFILE, &low) == 0, "lowering RLIMIT_NOFILE");
        std::vector<d::socket_fd> hogs;
        for (int i = 0; i < 128; ++i) {
          const int fd = ::dup(0);
          if (fd < 0) break;
          hogs.emplace_back(fd);
        }
        expect(::dup(0) < 0 && errno == EMFILE, "every descriptor is taken");
        const sockaddr_in addr = d::resolve("127.0.0.1", store.port, -1, "store");
        for (auto& c : callers)
          expect(::connect(c.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0, "connect");
        std::this_thread::sleep_for(300ms);  // the store meets EMFILE
        const double start = cpu_seconds();
        std::this_thread::sleep_for(2s);
        const double spent = cpu_seconds() - start;
        hogs.clear();
        ::setrlimit(RLIMIT_NOFILE, &old);
        d::store_client client("127.0.0.1", store.port, token, 1, d::clock::now() + 5s);
        const bool recovered = client.add("recovered", 1) == 1;
        return "cpu " + std::to_string(spent) + " recovered " + std::to_string(recovered ? 1 : 0);
      },
      30s);
  INFO(text);
  REQUIRE(ok);
  double cpu = 1e9;
  int recovered = 0;
  REQUIRE(std::sscanf(text.c_str(), "cpu %lf recovered %d", &cpu, &recovered) == 2);
  WARN("CPU time over 2 s with every descriptor taken: " << cpu << " s");
  CHECK(cpu < 0.1);
  CHECK(recovered == 1);
}

namespace {

/// Runs a 3-rank job whose ranks start 1.5 s apart (with the 15 s connect deadline of the issue) and returns
/// the last rank's rendezvous time; with `strangers`, ten idle connections wait on every mesh port first.
double last_rank_rendezvous(bool strangers) {
  const int port = free_port();
  side_process stranger([port, strangers] {
    if (!strangers) return;
    // Knows the job token (it reads the mesh addresses from the store) and opens idle connections.
    d::store_client store("127.0.0.1", static_cast<std::uint16_t>(port), d::job_key_of("tcp-tests"), 99,
                          d::clock::now() + 20s);
    std::vector<d::socket_fd> idle;
    for (int r = 0; r < 3; ++r) {
      const auto bytes = store.get("ddp/mesh/" + std::to_string(r));
      const std::string where(bytes.begin(), bytes.end());
      const auto colon = where.rfind(':');
      for (int i = 0; i < 10; ++i)
        idle.push_back(d::connect_with_retry(where.substr(0, colon),
                                             static_cast<std::uint16_t>(std::stoi(where.substr(colon + 1))),
                                             d::clock::now() + 5s, -1, "mesh", ""));
    }
    std::this_thread::sleep_for(30s);  // held until the job ends (stop())
  });
  const auto rs = run_ranks(
      3,
      [](int rank) {
        std::this_thread::sleep_for(rank * 1500ms);  // each rank's mesh port has its idle strangers first
        const auto start = std::chrono::steady_clock::now();
        auto comm = ddp::tcp::communicator::from_env();
        const auto took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::fprintf(stderr, "rendezvous took %.3f s\n", took);
        std::vector<float> v(10, 1.0F);
        comm.all_reduce(v).wait();
        expect(v[0] == 3.0F, "all_reduce after the idle strangers");
      },
      job(40s, port, [](int) { return ddp::launch::env_list{{"DDP_CONNECT_TIMEOUT_MS", "15000"}}; }));
  CHECK(stranger.stop() == "");
  require_all_ok(rs);
  double took = 1e9;
  const auto at = rs.ranks[2].output.find("rendezvous took ");
  REQUIRE(at != std::string::npos);
  REQUIRE(std::sscanf(rs.ranks[2].output.c_str() + at, "rendezvous took %lf s", &took) == 1);
  return took;
}

}  // namespace

TEST_CASE("ten idle connections on every mesh port neither fail nor delay the rendezvous", "[tcp][store][limits]") {
  const double quiet = last_rank_rendezvous(false);
  const double crowded = last_rank_rendezvous(true);
  WARN("the last rank's rendezvous took " << quiet << " s alone and " << crowded
                                          << " s with ten idle connections on every mesh port");
  CHECK(crowded - quiet < 1.0);
}

TEST_CASE("run_ranks refuses to fork the ranks beside a thread of the test, and forks beside a side process",
          "[tcp][store]") {
  // A thread forked mid-allocation left AddressSanitizer's allocator locked in a rank, whose engine then hung.
  std::atomic<bool> release{false};
  std::thread beside([&] {
    while (!release) std::this_thread::sleep_for(1ms);
  });
  CHECK_THROWS_AS(run_ranks(1, [](int) {}, 10s), std::logic_error);
  release = true;
  beside.join();
  side_process helper([] { std::this_thread::sleep_for(30s); });
  require_all_ok(run_ranks(1, [](int) {}, 10s));
  CHECK(helper.stop() == "");
}

TEST_CASE("a rank that never publishes fails rank 0's store reads at the connect deadline", "[tcp][store][timeout]") {
  const int port = free_port();
  side_process fake_rank1([port] {
    // Passes rank 0's mesh handshake as rank 1 of 2, then never publishes its memory probe.
    const d::job_key token = d::job_key_of("tcp-tests");
    d::store_client store("127.0.0.1", static_cast<std::uint16_t>(port), token, 1, d::clock::now() + 10s);
    const auto bytes = store.get("ddp/mesh/0");
    const std::string where(bytes.begin(), bytes.end());
    const auto colon = where.rfind(':');
    auto fd = d::connect_with_retry(where.substr(0, colon), static_cast<std::uint16_t>(std::stoi(where.substr(colon + 1))),
                                    d::clock::now() + 5s, 1, "rank 0", "");
    d::challenge nonce{};
    expect(d::recv_all(fd.get(), nonce.data(), nonce.size(), d::clock::now() + 5s) == d::io_status::ok, "challenged");
    const auto hello = d::signed_hello(d::mesh_hello{d::mesh_magic, 1, 2, d::mesh_version, 0}, token, "mesh", nonce);
    std::uint8_t ok = 0;
    expect(d::send_all(fd.get(), &hello, sizeof hello, d::clock::now() + 5s) == d::io_status::ok, "hello sent");
    expect(d::recv_all(fd.get(), &ok, 1, d::clock::now() + 5s) == d::io_status::ok, "hello accepted");
    expect(d::recv_all(fd.get(), &ok, 1, d::clock::now() + 15s) == d::io_status::closed, "rank 0 gave up");
  });
  const auto rs = run_ranks(
      1,
      [](int) { join_fails_within<ddp::timeout_error>(5.0, "the store read ended near the 1.5 s connect deadline"); },
      job(60s, port, [](int) {
        return ddp::launch::env_list{{"WORLD_SIZE", "2"}, {"DDP_CONNECT_TIMEOUT_MS", "1500"}, {"DDP_TIMEOUT_MS", "40000"}};
      }));
  CHECK(fake_rank1.join() == "");
  require_all_ok(rs);
  CHECK(contains(rs.ranks[0].output, "connect deadline"));
}

TEST_CASE("a rank that joins a new job while rank 0 still holds the last one waits for rank 0's new store, not the "
          "finished one", "[tcp][store]") {
  require_all_ok(run_ranks(3, [](int rank) {
    std::vector<float> x{static_cast<float>(rank + 1)};
    {
      auto first = ddp::tcp::communicator::from_env();
      first.all_reduce(std::span<float>(x), ddp::reduce_op::sum).wait();
      REQUIRE(x[0] == 6.0F);
      if (rank == 0) std::this_thread::sleep_for(500ms);  // ranks 1 and 2 join the next job meanwhile
    }
    auto second = ddp::tcp::communicator::from_env();
    std::vector<float> y{static_cast<float>(10 * (rank + 1))};
    second.all_reduce(std::span<float>(y), ddp::reduce_op::sum).wait();
    REQUIRE(y[0] == 60.0F);
  }));
}

TEST_CASE("a rank started twice is reported as such within seconds", "[tcp][store]") {
  const auto rs = run_ranks(
      3,
      [](int) { join_fails_within<ddp::error>(5.0, "the failure came within 5 s"); },
      job(40s, 0, [](int rank) {
        ddp::launch::env_list env{{"DDP_CONNECT_TIMEOUT_MS", "15000"}};
        if (rank == 2) env.emplace_back("RANK", "1");
        return env;
      }));
  require_all_ok(rs);
  INFO(all_output(rs));
  CHECK(contains(rs.ranks[0].output, "rank 1 joined twice"));
  CHECK(contains(rs.ranks[0].output, "check RANK and WORLD_SIZE"));
  CHECK((contains(rs.ranks[1].output, "rank 1 joined twice") || contains(rs.ranks[2].output, "rank 1 joined twice")));
}

TEST_CASE("ranks started with different WORLD_SIZE all fail within seconds naming both sizes", "[tcp][store]") {
  const auto rs = run_ranks(
      3,
      [](int) { join_fails_within<ddp::config_error>(5.0, "the failure came within 5 s, not at the 15 s deadline"); },
      job(40s, 0, [](int rank) {
        ddp::launch::env_list env{{"DDP_CONNECT_TIMEOUT_MS", "15000"}};
        if (rank == 2) env.emplace_back("WORLD_SIZE", "4");
        return env;
      }));
  require_all_ok(rs);
  INFO(all_output(rs));
  for (const auto& r : rs.ranks) {
    CHECK(contains(r.output, "WORLD_SIZE differs across the job's ranks"));
    CHECK(contains(r.output, "WORLD_SIZE=4"));
    CHECK(contains(r.output, "WORLD_SIZE=3"));
  }
}

TEST_CASE("the memory probe trusts a peer's pid only within one boot and one PID namespace", "[tcp][same_host]") {
  namespace d = ddp::tcp::detail;
  const auto here = d::this_host();
  REQUIRE(here.boot != 0);    // /proc/sys/kernel/random/boot_id
  REQUIRE(here.pid_ns != 0);  // /proc/self/ns/pid
  CHECK(here.shares_pids_with(here));
  auto other_machine = here;
  other_machine.boot ^= 1;  // another boot id: another machine (or a simulated host)
  CHECK_FALSE(here.shares_pids_with(other_machine));
  auto container = here;
  container.pid_ns += 1;  // the same kernel, another PID namespace: its pids name other processes here
  CHECK_FALSE(here.shares_pids_with(container));
  CHECK_FALSE(d::host_identity{}.shares_pids_with(d::host_identity{}));  // unknown is never the same
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t child = ::fork();
  if (child == 0) {  // a process of this host: the same identity
    const auto theirs = d::this_host();
    const char same = theirs.shares_pids_with(here) ? 1 : 0;
    [[maybe_unused]] const auto n = ::write(fds[1], &same, 1);
    ::_exit(0);
  }
  char same = 0;
  CHECK(::read(fds[0], &same, 1) == 1);
  ::waitpid(child, nullptr, 0);
  ::close(fds[0]);
  ::close(fds[1]);
  CHECK(same == 1);
}
