// One rank of the multihost tests, started by ddp-launch --nnodes on each simulated host (test_multihost.cpp
// picks the case by name). The communicator comes from DDP_INIT_METHOD (default env://; tcp:// and file://
// take RANK and WORLD_SIZE as arguments, as torch.distributed's init_process_group does).

#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/env.hpp>
#include <ddp/comm/tcp/communicator.hpp>

#include "conformance/conformance.hpp"
#include "parallel/scenarios.hpp"

namespace {

using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;

int env_int(const char* name) {
  const char* v = std::getenv(name);
  REQUIRE(v != nullptr);
  return std::atoi(v);
}

ddp::tcp::communicator join() {
  const char* url = std::getenv("DDP_INIT_METHOD");
  if (url == nullptr || std::string(url) == "env://") return ddp::tcp::communicator::init("env://");
  return ddp::tcp::communicator::init(url, env_int("RANK"), env_int("WORLD_SIZE"));
}

/// Bytes interface `name` has sent so far.
std::uint64_t tx_bytes(const std::string& name) {
  std::ifstream in("/sys/class/net/" + name + "/statistics/tx_bytes");
  std::uint64_t n = 0;
  REQUIRE(in >> n);
  return n;
}

/// TCP segments this host (network namespace) has retransmitted so far (RetransSegs of /proc/net/snmp).
std::uint64_t retransmitted_segments() {
  std::ifstream in("/proc/net/snmp");
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Tcp:", 0) != 0) continue;
    std::istringstream fields(line.substr(4));
    if (names.empty()) {
      for (std::string f; fields >> f;) names.push_back(f);
      continue;
    }
    std::uint64_t v = 0;
    for (const auto& name : names)
      if (fields >> v && name == "RetransSegs") return v;
  }
  FAIL("/proc/net/snmp has no Tcp RetransSegs");
  return 0;
}

}  // namespace

TEST_CASE("an all_reduce sums every rank's value", "[.][sum]") {
  auto comm = join();
  REQUIRE(comm.rank() == env_int("RANK"));
  REQUIRE(comm.size() == env_int("WORLD_SIZE"));
  std::vector<double> v(1000, comm.rank() + 1.0);
  comm.all_reduce(v).wait();
  const int n = comm.size();
  REQUIRE(v.back() == n * (n + 1) / 2.0);
}

TEST_CASE("conformance suite", "[.][conformance]") {
  auto comm = join();
  ddp::testing::run_conformance(comm);
}

TEST_CASE("data_parallel: every policy, hybrid with a shard group per host, equals one process", "[.][equivalence]") {
  auto comm = join();
  check_equivalence<tcp>(comm, optimizer_kind::sgd_momentum, 1e-5);
  check_equivalence<tcp, tiny>(comm, optimizer_kind::adamw, 1e-5);
  check_equivalence<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, 1e-5);
  check_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_momentum, 1e-5);
  // hybrid's default groups are LOCAL_WORLD_SIZE ranks: the ranks of one host.
  check_equivalence<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw, 1e-5);
  check_equivalence<tcp, tiny, ddp::hybrid<ddp::shard_grad_op>>(comm, optimizer_kind::sgd_momentum, 1e-5);
}

TEST_CASE("the job as the environment describes it, and the bits replicate and hybrid train", "[.][digest]") {
  const ddp::env_config env = ddp::read_env_config();
  auto comm = ddp::tcp::communicator::from_env();
  std::printf("env: rank %d of %d, local %d of %d, store %s:%u\n", env.rank, env.world_size, env.local_rank,
              env.local_world_size, env.master_addr.c_str(), static_cast<unsigned>(env.master_port));
  // The parameters' bytes, FNV-1a: equal runs give equal digests, a last-bit difference another one.
  const auto digest = [](mlp trained) {
    std::uint64_t h = 1469598103934665603ULL;
    ddp::visit_parameters(trained, [&](std::string_view, ddp::parameter<float>& p) {
      for (const float v : p.value()) {
        std::uint32_t bits = 0;
        std::memcpy(&bits, &v, sizeof bits);
        for (int b = 0; b < 4; ++b) h = (h ^ ((bits >> (8 * b)) & 0xffU)) * 1099511628211ULL;
      }
    });
    return static_cast<unsigned long long>(h);
  };
  const auto replicate = digest(check_equivalence<tcp, tiny>(comm, optimizer_kind::adamw, 1e-5));
  // hybrid's default groups are LOCAL_WORLD_SIZE ranks: under srun, this node's count of tasks.
  const auto hybrid = digest(check_equivalence<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw, 1e-5));
  std::printf("digest: rank %d replicate %016llx hybrid %016llx\n", comm.rank(), replicate, hybrid);
}

TEST_CASE("hybrid keeps its all-gathers inside a host: fewer bytes cross the link than under full_shard",
          "[.][crosslink]") {
  auto comm = join();
  // The bytes this host sent to the other one while `train` ran on every rank (a barrier fences each side).
  const auto crossing = [&](auto train) {
    comm.barrier().wait();
    const auto before = tx_bytes("eth0");
    train();
    comm.barrier().wait();
    return tx_bytes("eth0") - before;
  };
  const auto whole = crossing([&] { check_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5); });
  const auto hybrid = crossing(
      [&] { check_equivalence<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw, 1e-5); });
  std::printf("crosslink: rank %d's host sent %llu bytes under full_shard, %llu under hybrid<full_shard>\n",
              comm.rank(), static_cast<unsigned long long>(whole), static_cast<unsigned long long>(hybrid));
  // Over the sockets alone (DDP_SHM=0) 4.3x fewer here: the shard all-reduce alone crosses, not the gathers. With
  // shared memory full_shard's collectives are hierarchical, each host's share crossing once: 1.9x fewer.
  const char* shm = std::getenv("DDP_SHM");
  if (shm != nullptr && std::string(shm) == "0") CHECK(hybrid * 2 < whole);
  else CHECK(hybrid < whole);
}

TEST_CASE("all_reduce until rank DDP_VICTIM kills itself (in the first attempt, a restart ends after 20)",
          "[.][kill]") {
  auto comm = join();
  const int victim = env_int("DDP_VICTIM");
  const bool restarted = env_int("DDP_RESTART_COUNT") > 0;
  std::vector<float> v(1 << 18, 1.0F);
  for (int i = 0; i < 100000; ++i) {
    if (i == 20 && restarted) return;
    if (i == 20 && comm.rank() == victim) {
      const std::chrono::duration<double> now = std::chrono::system_clock::now().time_since_epoch();
      std::ofstream(std::getenv("DDP_VICTIM_STAMP")) << std::fixed << now.count() << std::endl;
      ::raise(SIGKILL);
    }
    comm.all_reduce(v).wait();
  }
  FAIL("the victim never died");
}

TEST_CASE("all_reduce of DDP_BYTES over the link: rank 0 prints its busbw", "[.][link]") {
  auto comm = join();
  std::vector<float> v(static_cast<std::size_t>(env_int("DDP_BYTES")) / sizeof(float), 1.0F);
  comm.all_reduce(v).wait();  // warm-up: the sockets' buffers grow
  constexpr int reps = 3;
  comm.barrier().wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) comm.all_reduce(v).wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  const int n = comm.size();
  const double busbw = static_cast<double>(v.size() * sizeof(float)) * 2.0 * (n - 1) / n / seconds;
  if (comm.rank() == 0) std::printf("link: all_reduce %.6f s busbw %.0f B/s\n", seconds, busbw);
}

TEST_CASE("the mesh runs on DDP_INTERFACE's network, the store on MASTER_ADDR's", "[.][interface]") {
  const std::string chosen = std::getenv("DDP_INTERFACE");
  const std::string other = chosen == "eth1" ? "eth0" : "eth1";
  const auto chosen_before = tx_bytes(chosen), other_before = tx_bytes(other);
  auto comm = join();
  std::vector<float> v(std::size_t{4} << 20, 1.0F);  // 16 MiB: each host must send the other a quarter at least
  comm.all_reduce(v).wait();
  comm.barrier().wait();
  REQUIRE(v.front() == static_cast<float>(comm.size()));
  const auto chosen_sent = tx_bytes(chosen) - chosen_before, other_sent = tx_bytes(other) - other_before;
  CAPTURE(chosen, chosen_sent, other_sent);
  CHECK(chosen_sent >= (std::uint64_t{4} << 20));  // this host's share of the all_reduce crossed the chosen link
  CHECK(other_sent < (std::uint64_t{1} << 20));    // the rendezvous only
}

TEST_CASE("all_reduce, all_gather, reduce_scatter and broadcast (from rank 0) of about 4 MiB: rank prints what its "
          "host sent on eth0 during each", "[.][hier_bytes]") {
  auto comm = join();
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t k = (std::size_t{1} << 20) / n;  // each rank's block of all_gather and reduce_scatter
  const auto value = static_cast<float>(comm.rank() + 1);
  std::vector<float> whole(n * k, value), block(k, value);
  const float sum = static_cast<float>(n * (n + 1) / 2);
  // The bytes this host sent during `run`: read before the first barrier, which no rank passes before every rank
  // entered it, and after the second, which none passes before every rank's collective ended.
  const auto measure = [&](const char* name, std::size_t bytes, auto run) {
    const auto before = tx_bytes("eth0");
    const auto resent_before = retransmitted_segments();
    comm.barrier().wait();
    run();
    comm.barrier().wait();
    std::printf("hier_bytes: rank %d: %s of %zu bytes: its host sent %llu bytes, %llu segments again\n", comm.rank(),
                name, bytes, static_cast<unsigned long long>(tx_bytes("eth0") - before),
                static_cast<unsigned long long>(retransmitted_segments() - resent_before));
  };
  measure("all_reduce", n * k * sizeof(float), [&] { comm.all_reduce(whole).wait(); });
  REQUIRE(whole.front() == sum);
  REQUIRE(whole.back() == sum);
  measure("all_gather", n * k * sizeof(float), [&] { comm.all_gather(block, whole).wait(); });
  for (std::size_t r = 0; r < n; ++r) REQUIRE(whole[r * k + k - 1] == static_cast<float>(r + 1));
  std::fill(whole.begin(), whole.end(), value);
  measure("reduce_scatter", n * k * sizeof(float), [&] { comm.reduce_scatter(whole, block).wait(); });
  REQUIRE(block.front() == sum);
  REQUIRE(block.back() == sum);
  measure("broadcast", n * k * sizeof(float), [&] { comm.broadcast(whole, 0).wait(); });
  REQUIRE(whole.back() == 1.0F);
}

TEST_CASE("all_reduce until rank DDP_VICTIM kills itself: every other rank raises peer_lost", "[.][survive]") {
  auto comm = join();
  const int victim = env_int("DDP_VICTIM");
  std::vector<float> v(1 << 18, 1.0F);
  const auto now = [] { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); };
  try {
    for (int i = 0; i < 100000; ++i) {
      if (i == 20 && comm.rank() == victim) {
        std::ofstream(std::getenv("DDP_VICTIM_STAMP")) << std::fixed << now() << std::endl;
        ::raise(SIGKILL);
      }
      comm.all_reduce(v).wait();
    }
  } catch (const ddp::peer_lost& e) {
    std::printf("survivor %d raised peer_lost at %.6f: %s\n", comm.rank(), now(), e.what());
    return;
  }
  FAIL("the victim never died");
}

TEST_CASE("after a good all_reduce, the last rank calls broadcast (DDP_FAULT=mismatch) or its all_reduce 4 s late "
          "(timeout): every rank prints the error it raised", "[.][fault]") {
  auto comm = join();
  const std::string fault = std::getenv("DDP_FAULT");
  const bool odd = comm.rank() == comm.size() - 1;
  std::vector<float> v(1 << 18, 1.0F);
  const auto raised = [&](const char* type) { std::printf("fault: rank %d raised %s\n", comm.rank(), type); };
  try {
    // A rank still finishing this one when a peer's abort notice for the next arrives fails it with that error.
    comm.all_reduce(v).wait();
    if (odd && fault == "mismatch") {
      comm.broadcast(v, 0).wait();
    } else {
      if (odd) std::this_thread::sleep_for(std::chrono::seconds(4));
      comm.all_reduce(v).wait();
    }
  } catch (const ddp::mismatch_error&) {
    return raised("mismatch_error");
  } catch (const ddp::timeout_error&) {
    return raised("timeout_error");
  } catch (const ddp::peer_lost&) {
    return raised("peer_lost");
  }
  FAIL("no rank noticed the fault");
}
