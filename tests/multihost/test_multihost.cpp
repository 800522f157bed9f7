// ddp across simulated hosts (tests/support/multihost.hpp): ddp-launch --nnodes 2 on each of two hosts runs
// ddp_multihost_rank; the conformance suite, data_parallel's equivalence, the init methods, a rank killed on
// one host (without and with --max-restarts), and the interface choice on hosts with two networks. Each case has its own tag; ctest runs one
// case per test (label multihost) and reports them as not run, with the reason, where hosts cannot be made.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/comm/tcp/hierarchical.hpp>

#include "support/multihost.hpp"
#include "support/text.hpp"

using ddp::testing::host_options;
using ddp::testing::run_on_hosts;

using ddp::testing::contains;

namespace {

/// The command each host runs: its ddp-launch of 2 ranks of ddp_multihost_rank's case `tag`, with `env` before it.
std::string launch(const std::string& tag, const std::string& env = "", const std::string& options = "") {
  return env + " DDP_TIMEOUT_MS=30000 DDP_CONNECT_TIMEOUT_MS=30000 " DDP_LAUNCH_EXE
               " --nnodes 2 --node-rank $MH_HOST -n 2 --master-addr $MH_MASTER --master-port 29400 --bind none "
               "--join-timeout 30 " + options + " -- " DDP_MULTIHOST_RANK_EXE " '" + tag + "'";
}

/// Ranks per host: layout[h] lists the world ranks host h runs.
using layout = std::vector<std::vector<int>>;

/// `hosts` hosts, every other option as by default.
host_options on(std::size_t hosts) {
  host_options o;
  o.hosts = static_cast<int>(hosts);
  return o;
}

int world_size(const layout& l) {
  std::size_t n = 0;
  for (const auto& h : l) n += h.size();
  return static_cast<int>(n);
}

/// The command each host runs without a launcher: its ranks of `l` (any number per host, in any order) each run
/// ddp_multihost_rank's case `tag` with `env` before it. Each rank's exit status is printed ("rank R exited S"),
/// then what the host's /dev/shm holds afterwards ("shm left: [...]"); the host's status is 0 where every rank's is.
std::string ranks(const layout& l, const std::string& tag, const std::string& env = "") {
  std::string cmd = "case $MH_HOST in ";
  for (std::size_t h = 0; h < l.size(); ++h) {
    cmd += std::to_string(h) + ") R='";
    for (const int r : l[h]) cmd += std::to_string(r) + " ";
    cmd += "';; ";
  }
  return cmd + "esac; s=0; p=''; for r in $R; do RANK=$r WORLD_SIZE=" + std::to_string(world_size(l)) +
         " MASTER_ADDR=$MH_MASTER MASTER_PORT=29400 DDP_TIMEOUT_MS=30000 DDP_CONNECT_TIMEOUT_MS=30000 " + env +
         " " DDP_MULTIHOST_RANK_EXE " '" + tag + "' & p=\"$p $r:$!\"; done; "
         "for x in $p; do wait ${x#*:}; e=$?; echo \"rank ${x%:*} exited $e\"; [ $e = 0 ] || s=$e; done; "
         "echo \"shm left: [$(ls /dev/shm)]\"; exit $s";
}

/// The command each host runs to start 2 ranks of ddp_multihost_rank's case `tag` as `srun -N 2
/// --ntasks-per-node 2` would: Slurm's variables alone (no RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT); rank 0's
/// host is the first of the compressed node list, its port 20000 + the job id % 20000 = 29400.
std::string slurm_ranks(const std::string& tag) {
  return "s=0; p=''; for l in 0 1; do r=$((MH_HOST * 2 + l)); SLURM_PROCID=$r SLURM_LOCALID=$l SLURM_NODEID=$MH_HOST "
         "SLURM_NTASKS=4 SLURM_STEP_TASKS_PER_NODE='2(x2)' SLURM_STEP_NODELIST='10.200.0.[1-2]' "
         "SLURM_JOB_NODELIST='10.200.0.[1-2]' SLURM_JOB_ID=129400 DDP_TIMEOUT_MS=30000 DDP_CONNECT_TIMEOUT_MS=30000 "
         DDP_MULTIHOST_RANK_EXE " '" + tag + "' & p=\"$p $!\"; done; "
         "for x in $p; do wait $x || s=$?; done; exit $s";
}

/// Every hexadecimal word that follows `key` in `text`, in order.
std::vector<std::string> words_after(const std::string& text, const std::string& key) {
  std::vector<std::string> found;
  for (auto at = text.find(key); at != std::string::npos; at = text.find(key, at + 1))
    found.push_back(text.substr(at + key.size(), text.find_first_of(" \n", at + key.size()) - at - key.size()));
  return found;
}

/// Every number that follows `key` in `text`.
std::vector<double> numbers_after(const std::string& text, const std::string& key) {
  std::vector<double> found;
  for (auto at = text.find(key); at != std::string::npos; at = text.find(key, at + 1))
    found.push_back(std::atof(text.c_str() + at + key.size()));
  return found;
}

/// The payload bytes host `h` of `l` sends to the other hosts in collective `op` (all_reduce, all_gather,
/// reduce_scatter or broadcast from rank 0) whose whole buffer is `bytes` (each rank's block: bytes / N). Flat,
/// the sockets' rings and chain over the world ranks in order: each rank whose successor is on another host sends
/// it 2 (N-1)/N of the buffer (all_reduce), (N-1)/N (all_gather, reduce_scatter) or all of it (broadcast, but
/// the last). Hierarchical, one lead per host speaks over the sockets: all_reduce 2 (H-1)/H of the buffer among H
/// leads, all_gather its host's blocks to each other lead, reduce_scatter the other hosts' blocks, broadcast the
/// whole buffer along the leads' chain (all but the last).
double predicted_crossing(const layout& l, std::size_t h, const std::string& op, double bytes, bool hierarchical) {
  const auto hosts = static_cast<double>(l.size());
  const int n = world_size(l);
  const double here = static_cast<double>(l[h].size()), block = bytes / n;
  if (hierarchical) {
    if (op == "all_reduce") return 2 * (hosts - 1) / hosts * bytes;
    if (op == "all_gather") return (hosts - 1) * here * block;
    if (op == "reduce_scatter") return (n - here) * block;
    return h + 1 < l.size() ? bytes : 0;  // rank 0 leads host 0
  }
  std::vector<std::size_t> host_of(static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < l.size(); ++k)
    for (const int r : l[k]) host_of[static_cast<std::size_t>(r)] = k;
  const double per_rank = op == "all_reduce" ? 2.0 * (n - 1) * block : (n - 1) * block;
  double sent = 0;
  for (const int r : l[h])
    if (host_of[static_cast<std::size_t>((r + 1) % n)] != h && (op != "broadcast" || r + 1 < n))
      sent += op == "broadcast" ? bytes : per_rank;
  return sent;
}

/// Runs the conformance suite on `l`, every rank with `env`; nothing is left in any host's /dev/shm.
void conformance_on(const layout& l, const std::string& env = "") {
  const auto hosts = run_on_hosts(on(l.size()), ranks(l, "[conformance]", env));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  for (const auto& h : hosts.hosts) CHECK(contains(h.output, "shm left: []"));
}

/// Checks what each host of `l` sent on its link in each collective of about 4 MiB against the prediction.
void crossing_on(const layout& l, bool hierarchical) {
  const auto hosts = run_on_hosts(on(l.size()), ranks(l, "[hier_bytes]", hierarchical ? "" : "DDP_SHM=0"));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  for (std::size_t h = 0; h < l.size(); ++h) {
    std::istringstream lines(hosts.hosts[h].output);
    int measured = 0;
    for (std::string line; std::getline(lines, line);) {
      char op[32] = {};
      unsigned long long bytes = 0, sent = 0, resent = 0;
      const auto at = line.find("hier_bytes: ");
      if (at == std::string::npos ||
          std::sscanf(line.c_str() + at, "hier_bytes: rank %*d: %31s of %llu bytes: its host sent %llu bytes, %llu segments again",
                      op, &bytes, &sent, &resent) != 4)
        continue;
      ++measured;
      const double want = predicted_crossing(l, h, op, static_cast<double>(bytes), hierarchical);
      std::printf("%s, %s, host %zu of %d ranks: %llu bytes on the link (%llu TCP segments sent again), %.0f of payload "
                  "predicted (%.3fx)\n",
                  hierarchical ? "hierarchical" : "flat (DDP_SHM=0)", op, h, world_size(l), sent, resent, want,
                  want > 0 ? static_cast<double>(sent) / want : 0.0);
      CAPTURE(op, h, sent, resent, want);
      CHECK(static_cast<double>(sent) >= want);  // the payload at least
      // plus the headers of frames, TCP and Ethernet (0.3% here), the barriers' frames and acknowledgements, and
      // the segments TCP sent again (a full Ethernet frame each at most): a loaded machine drops some on the veth
      CHECK(static_cast<double>(sent) <= 1.1 * want + 20000 + 1514.0 * static_cast<double>(resent));
    }
    CHECK(measured == 4 * static_cast<int>(l[h].size()));
    CHECK(contains(hosts.hosts[h].output, "shm left: []"));
  }
}

/// A rank of `l` kills itself in a loop of all_reduces: every other rank raises peer_lost (printing when), and no
/// host's /dev/shm holds anything afterwards.
void survivors_on(const layout& l, int victim) {
  const auto stamp = std::filesystem::path(DDP_MULTIHOST_SHARED_DIR) / ("survive." + std::to_string(::getpid()));
  const auto hosts = run_on_hosts(on(l.size()),
                                  ranks(l, "[survive]", "DDP_VICTIM=" + std::to_string(victim) + " DDP_VICTIM_STAMP=" + stamp.string()));
  INFO(hosts.describe());
  double killed = 0;
  REQUIRE((std::ifstream(stamp) >> killed));
  std::filesystem::remove(stamp);
  for (std::size_t h = 0; h < l.size(); ++h) {
    const auto& out = hosts.hosts[h].output;
    for (const int r : l[h]) CHECK(contains(out, "rank " + std::to_string(r) + " exited " + (r == victim ? "137" : "0")));
    const auto raised = numbers_after(out, "raised peer_lost at ");
    CHECK(raised.size() == l[h].size() - (contains(out, "rank " + std::to_string(victim) + " exited") ? 1 : 0));
    for (const double t : raised) {
      std::printf("victim rank %d: a survivor on host %zu raised peer_lost %.3f s after the kill\n", victim, h, t - killed);
      CHECK(t - killed < 3.0);  // 1 s is the promise; slack for a loaded machine
    }
    CHECK(contains(out, "shm left: []"));
  }
}

/// Per rank, the error it raised in case [fault] of `l` with `env` ("rank R raised TYPE").
std::vector<std::string> faults_on(const layout& l, const std::string& env) {
  const auto hosts = run_on_hosts(on(l.size()), ranks(l, "[fault]", env));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  std::vector<std::string> raised(static_cast<std::size_t>(world_size(l)));
  for (const auto& h : hosts.hosts) {
    std::istringstream lines(h.output);
    for (std::string line; std::getline(lines, line);) {
      int rank = -1;
      char type[32] = {};
      const auto at = line.find("fault: rank ");
      if (at != std::string::npos && std::sscanf(line.c_str() + at, "fault: rank %d raised %31s", &rank, type) == 2)
        raised.at(static_cast<std::size_t>(rank)) = type;
    }
    CHECK(contains(h.output, "shm left: []"));
  }
  return raised;
}

}  // namespace

TEST_CASE("a hierarchical group fails as a flat one: mismatch_error on every rank when one calls another collective, "
          "timeout_error (or peer_lost from a rank that timed out first) when one comes too late", "[mh_hier_fault]") {
  for (const layout& l : {layout{{0, 1}, {2, 3}}, layout{{0, 2}, {1, 3, 4}}}) {
    for (const std::string fault : {"DDP_FAULT=mismatch", "DDP_FAULT=timeout DDP_TIMEOUT_MS=2000"}) {
      const auto hierarchical = faults_on(l, fault);
      const auto flat = faults_on(l, fault + " DDP_SHM=0");
      CAPTURE(fault, world_size(l));
      if (fault == "DDP_FAULT=mismatch") {
        for (std::size_t r = 0; r < flat.size(); ++r) {
          CAPTURE(r);
          CHECK(flat[r] == "mismatch_error");
          CHECK(hierarchical[r] == "mismatch_error");
        }
        continue;
      }
      // A rank that times out first aborts; the others, as timing has it on both paths, time out themselves or
      // find it gone (the late rank finds every peer gone or aborted).
      for (const auto& path : {flat, hierarchical}) {
        CHECK(std::count(path.begin(), path.end(), "timeout_error") > 0);
        for (const auto& type : path) CHECK((type == "timeout_error" || type == "peer_lost"));
      }
    }
  }
}

TEST_CASE("hierarchical collectives pass the conformance suite on 2 hosts x 2 ranks with shared memory off, on 1 + 2, "
          "on 2 + 3 ranks placed alternately and on 2 + 1 + 2", "[mh_hier_conformance]") {
  conformance_on({{0, 1}, {2, 3}}, "DDP_SHM=0");
  conformance_on({{0}, {1, 2}});
  conformance_on({{0, 2}, {1, 3, 4}});
  conformance_on({{0, 3}, {1}, {2, 4}});  // 3 hosts: the leads' steps have two peers each
}

TEST_CASE("all_reduce, all_gather, reduce_scatter and broadcast of 4 MiB send each host's bytes across the link once: "
          "what the hierarchy predicts, not the flat rings and chain", "[mh_hier_bytes]") {
  crossing_on({{0, 1}, {2, 3}}, true);
  crossing_on({{0, 1}, {2, 3}}, false);
  crossing_on({{0}, {1, 2}}, true);
  crossing_on({{0, 2}, {1, 3, 4}}, true);
  crossing_on({{0, 3}, {1}, {2, 4}}, true);
}

TEST_CASE("a rank SIGKILLed in a hierarchical all_reduce: every survivor raises peer_lost, /dev/shm is empty",
          "[mh_hier_kill]") {
  survivors_on({{0, 1}, {2, 3}}, 3);  // a member of host 1 that is not its lead
  survivors_on({{0, 1}, {2, 3}}, 2);  // host 1's lead, in the all_reduce across hosts
  survivors_on({{0, 2}, {1, 3, 4}}, 1);
}

TEST_CASE("2 hosts x 2 ranks pass the conformance suite, ranks copy memory only within a host", "[mh_conformance]") {
  const auto hosts = run_on_hosts({}, launch("[conformance]"));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
  // rank 0 reads the memory of rank 1 (its host) and of neither rank of the other host.
  CHECK(contains(hosts.hosts[0].output, "memory of 1 of its 3 peers"));
  CHECK(contains(hosts.hosts[0].output, "shared memory inside each host and the sockets across them"));
}

TEST_CASE("2 hosts x 2 ranks: replicate, shard_grad_op, full_shard and hybrid (a shard group per host) equal one "
          "process", "[mh_equivalence]") {
  const auto hosts = run_on_hosts({}, launch("[equivalence]"));
  INFO(hosts.describe());
  REQUIRE(hosts.ok());
}

TEST_CASE("hybrid's shard groups stay inside a host: fewer of its bytes cross between hosts than full_shard's (less "
          "than half over the sockets alone)",
          "[mh_crosslink]") {
  for (const std::string env : {"", "DDP_SHM=0"}) {
    const auto hosts = run_on_hosts({}, launch("[crosslink]", env));
    INFO(hosts.describe());
    REQUIRE(hosts.ok());
    CHECK(contains(hosts.hosts[0].output, "under hybrid<full_shard>"));
  }
}

TEST_CASE("2 hosts x 2 ranks started with Slurm's variables alone (as srun sets them) train the bits ddp-launch's job "
          "trains, hybrid with a shard group per node",
          "[mh_slurm]") {
  const auto slurm = run_on_hosts({}, slurm_ranks("[digest]"));
  INFO(slurm.describe());
  REQUIRE(slurm.ok());
  const auto launched = run_on_hosts({}, launch("[digest]"));
  INFO(launched.describe());
  REQUIRE(launched.ok());
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 2; ++l)
      CHECK(contains(slurm.hosts[h].output, "env: rank " + std::to_string(2 * h + l) + " of 4, local " +
                                                std::to_string(l) + " of 2, store 10.200.0.1:29400"));
  }
  std::vector<std::string> got, want;
  for (int h = 0; h < 2; ++h) {
    for (const auto& d : words_after(slurm.hosts[h].output, "replicate ")) got.push_back(d);
    for (const auto& d : words_after(slurm.hosts[h].output, "hybrid ")) got.push_back(d);
    for (const auto& d : words_after(launched.hosts[h].output, "replicate ")) want.push_back(d);
    for (const auto& d : words_after(launched.hosts[h].output, "hybrid ")) want.push_back(d);
  }
  REQUIRE(got.size() == 8);
  CHECK(got == want);
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

TEST_CASE("a group's share of the hosts: hierarchical where it spans hosts with two members on one, its leads, its "
          "ranks by host and this rank's place (needs no simulated hosts)", "[mh_plan]") {
  namespace d = ddp::tcp::detail;
  auto hosts = std::make_shared<d::shm_hosts>();
  hosts->host_of = {0, 1, 0, 1, 1, 5};  // world ranks 0 and 2 on one host, 1, 3 and 4 on another, 5 alone
  const auto group_of = [&](std::vector<int> members, int me, std::shared_ptr<const d::shm_hosts> of) {
    auto g = std::make_shared<d::group>();
    g->members = std::move(members);
    g->me = me;
    g->id = 7;
    d::use_shared_memory(*g, std::move(of));
    return g;
  };
  using v = std::vector<int>;
  const auto world = group_of({0, 1, 2, 3, 4, 5}, 5, hosts);  // this rank is alone on its host: no segment
  REQUIRE(world->hier);
  CHECK(!world->shm);
  CHECK(!world->hier->shm);
  CHECK(world->hier->leads == v{0, 1, 5});
  CHECK(world->hier->lead_world == v{0, 1, 5});
  CHECK(world->hier->host_of == v{0, 1, 0, 1, 1, 2});
  CHECK(world->hier->by_host == v{0, 2, 1, 3, 4, 5});
  CHECK(world->hier->host_start == v{0, 2, 5, 6});
  CHECK(world->hier->local == v{5});
  CHECK(world->hier->host() == 2);
  // Group ranks 0, 1, 2 are world ranks 5, 4, 3: hosts go in the order of their lowest group rank.
  const auto split = group_of({5, 4, 3}, 0, hosts);
  REQUIRE(split->hier);
  CHECK(split->hier->leads == v{0, 1});
  CHECK(split->hier->lead_world == v{5, 4});
  CHECK(split->hier->host_of == v{0, 1, 1});
  CHECK(split->hier->ranks_on(1) == 2);
  CHECK(split->hier->local == v{0});
  const auto one_per_host = group_of({0, 1, 5}, 2, hosts);
  CHECK(!one_per_host->hier);
  CHECK(!one_per_host->shm);
  const auto without = group_of({0, 1, 2, 3, 4, 5}, 5, nullptr);  // DDP_SHM=0, or a rank that cannot map
  CHECK(!without->hier);
  CHECK(!without->shm);
}
