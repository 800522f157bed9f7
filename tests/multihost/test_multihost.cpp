// ddp across simulated hosts (tests/support/multihost.hpp): ddp-launch --nnodes 2 on each of two hosts runs
// ddp_multihost_rank; the conformance suite, data_parallel's equivalence, the init methods, a rank killed on
// one host (without and with --max-restarts), and the interface choice on hosts with two networks. Each case has its own tag; ctest runs one
// case per test (label multihost) and reports them as not run, with the reason, where hosts cannot be made.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/multihost.hpp"

using ddp::testing::host_options;
using ddp::testing::run_on_hosts;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// The command each host runs: its ddp-launch of 2 ranks of ddp_multihost_rank's case `tag`, with `env` before it.
std::string launch(const std::string& tag, const std::string& env = "", const std::string& options = "") {
  return env + " DDP_TIMEOUT_MS=30000 DDP_CONNECT_TIMEOUT_MS=30000 " DDP_LAUNCH_EXE
               " --nnodes 2 --node-rank $MH_HOST -n 2 --master-addr $MH_MASTER --master-port 29400 --bind none "
               "--join-timeout 30 " + options + " -- " DDP_MULTIHOST_RANK_EXE " '" + tag + "'";
}

}  // namespace

TEST_CASE("2 hosts x 2 ranks pass the conformance suite, ranks copy memory only within a host", "[mh_conformance]") {
  const auto hosts = run_on_hosts({}, launch("[conformance]"));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  // rank 0 reads the memory of rank 1 (its host) and of neither rank of the other host.
  CHECK(contains(hosts.hosts[0].output, "memory of 1 of its 3 peers"));
}

TEST_CASE("2 hosts x 2 ranks: replicate, shard_grad_op, full_shard and hybrid (a shard group per host) equal one "
          "process", "[mh_equivalence]") {
  const auto hosts = run_on_hosts({}, launch("[equivalence]"));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
}

TEST_CASE("hybrid's shard groups stay inside a host: less than half of full_shard's bytes cross between hosts",
          "[mh_crosslink]") {
  const auto hosts = run_on_hosts({}, launch("[crosslink]"));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  CHECK(contains(hosts.hosts[0].output, "under hybrid<full_shard>"));
}

TEST_CASE("2 hosts x 2 ranks join through tcp://host:port and file:///shared/path", "[mh_init]") {
  const auto tcp = run_on_hosts({}, launch("[sum]", "DDP_INIT_METHOD=tcp://10.200.0.1:29400"));
  INFO(tcp.describe());
  REQUIRE(tcp.ok());
  CHECK(contains(tcp.hosts[0].output, "store at 10.200.0.1:29400"));
  // /tmp is private to each host; the build tree is the filesystem they share.
  const auto file = std::filesystem::path(DDP_MULTIHOST_SHARED_DIR) / ("rendezvous." + std::to_string(::getpid()));
  const auto shared = run_on_hosts({}, launch("[sum]", "DDP_INIT_METHOD=file://" + file.string()));
  INFO(shared.describe());
  REQUIRE(shared.ok());
  CHECK(contains(shared.hosts[0].output, "store found through file://" + file.string()));
  CHECK(!std::filesystem::exists(file));
}

TEST_CASE("a rank killed on host 1 stops both launchers within 5 s, each naming node 1 and rank 3", "[mh_kill]") {
  const auto stamp = std::filesystem::path(DDP_MULTIHOST_SHARED_DIR) / ("victim." + std::to_string(::getpid()));
  const auto hosts = run_on_hosts({}, launch("[kill]", "DDP_VICTIM=3 DDP_VICTIM_STAMP=" + stamp.string()));
  INFO(hosts.describe());
  double killed = 0;
  REQUIRE((std::ifstream(stamp) >> killed));
  std::filesystem::remove(stamp);
  for (const auto& h : hosts.hosts) {
    CHECK(h.status == 128 + 9);  // every launcher exits with the victim's status
    CHECK(contains(h.output, "the job failed: rank 3 on node 1 failed with status 137"));
    CHECK(h.ended - killed < 5.0);
  }
}

TEST_CASE("with --max-restarts 1, a rank killed on host 1 restarts every rank on both hosts and the job ends well",
          "[mh_restart]") {
  const auto stamp = std::filesystem::path(DDP_MULTIHOST_SHARED_DIR) / ("victim." + std::to_string(::getpid()));
  const auto hosts =
      run_on_hosts({}, launch("[kill]", "DDP_VICTIM=3 DDP_VICTIM_STAMP=" + stamp.string(), "--max-restarts 1"));
  std::filesystem::remove(stamp);
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  for (int node = 0; node < 2; ++node) {
    const auto& out = hosts.hosts[static_cast<std::size_t>(node)].output;
    CHECK(contains(out, "the job failed: rank 3 on node 1 failed with status 137"));
    CHECK(contains(out, "node " + std::to_string(node) + ": restarting ranks"));
  }
}

TEST_CASE("over a rate-limited link, all_reduce's bytes between hosts cross the link: busbw stays near its rate",
          "[mh_link]") {
  constexpr double rate = 400e6 / 8;  // 400 Mbit/s, in bytes per second
  host_options limited;
  limited.rate = "400mbit";
  const auto hosts = run_on_hosts(limited, launch("[link]", "DDP_BYTES=16777216"));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  const auto& out = hosts.hosts[0].output;
  const auto at = out.find("busbw ");
  REQUIRE(at != std::string::npos);
  const double busbw = std::atof(out.c_str() + at + 6);
  std::printf("2 hosts x 2 ranks, 16 MiB all_reduce over a 400 Mbit/s link: busbw %.1f MB/s = %.2f x the link rate\n",
              busbw / 1e6, busbw / rate);
  // Same-host copies between hosts would be many times faster than the link; a ring sends 1.5x the buffer across
  // it each way (busbw = the rate), a two-level exchange 1x (1.5x the rate): never more.
  CHECK(busbw < 1.6 * rate);
  CHECK(busbw > 0.2 * rate);  // and the link is used, not some slower path
}

TEST_CASE("with two interfaces per host, DDP_INTERFACE=eth1 carries the mesh and MASTER_ADDR's the store",
          "[mh_interface]") {
  host_options two_networks;
  two_networks.nets = 2;
  const auto hosts = run_on_hosts(two_networks, launch("[interface]", "DDP_INTERFACE=eth1"));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  CHECK(contains(hosts.hosts[0].output, "rank 0's mesh on 10.200.1.1 (eth1)"));
}
