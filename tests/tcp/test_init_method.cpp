// torch.distributed's init methods on ddp::tcp: env://, tcp://host:port and file:///path in real processes on
// 127.0.0.1 and a temporary directory, stale files of an earlier job, and every mistake in a URL.

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>

#include "support/run_ranks.hpp"
#include "tcp/helpers.hpp"

using namespace std::chrono_literals;
using ddp::testing::require_all_ok;
using ddp::testing::run_ranks;
using ddp::testing::tcp::expect;
using ddp::testing::free_port;
using ddp::testing::tcp::job;

namespace {

/// Every rank contributes rank + 1; the sum must be n(n+1)/2 everywhere, and the group must be the one asked for.
void check_sum(ddp::tcp::communicator& comm, int rank, int n) {
  expect(comm.rank() == rank && comm.size() == n, "the communicator is rank " + std::to_string(comm.rank()) +
                                                      " of " + std::to_string(comm.size()));
  std::vector<double> v(1000, rank + 1.0);
  comm.all_reduce(v).wait();
  expect(v.front() == n * (n + 1) / 2.0 && v.back() == v.front(), "the sum is " + std::to_string(v.front()));
}

/// A directory of its own under the system's temporary directory, removed at the end.
struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    std::string templ = (std::filesystem::temp_directory_path() / "ddp-init-XXXXXX").string();
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    path = templ;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

TEST_CASE("init(\"env://\") reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT", "[tcp][init]") {
  require_all_ok(run_ranks(
      3,
      [](int rank) {
        auto comm = ddp::tcp::communicator::init("env://");
        check_sum(comm, rank, 3);
      },
      job(60s)));
}

TEST_CASE("init(\"tcp://host:port\", rank, size) finds rank 0's store at the URL, not at MASTER_*", "[tcp][init]") {
  const int port = free_port();
  require_all_ok(run_ranks(
      3,
      [port](int rank) {
        const std::string url = "tcp://127.0.0.1:" + std::to_string(port);
        auto comm = ddp::tcp::communicator::init(url, rank, 3);
        check_sum(comm, rank, 3);
      },
      // MASTER_PORT points elsewhere and RANK is withdrawn: only the URL and the arguments may be used.
      job(60s, 0, [](int) { return ddp::launch::env_list{{"MASTER_PORT", "1"}, {"RANK", ""}}; })));
}

TEST_CASE("init(\"file:///path\", rank, size) rendezvouses through the file and removes it once all joined",
          "[tcp][init]") {
  temp_dir dir;
  const auto file = dir.path / "rendezvous";
  const bool stale = GENERATE(false, true);
  CAPTURE(stale);
  if (stale) {  // an earlier job's file: its rank 0 (same token) is gone; the new rank 0 replaces it
    ddp::tcp::config earlier;
    earlier.store_file = file.string();
    ddp::tcp::detail::publish_store(earlier, ddp::tcp::detail::job_key_of("tcp-tests"),
                                    static_cast<std::uint16_t>(free_port()), {"127.0.0.1"});
  }
  require_all_ok(run_ranks(
      3,
      [&file](int rank) {
        if (rank == 0) std::this_thread::sleep_for(300ms);  // the others read the stale file first
        auto comm = ddp::tcp::communicator::init("file://" + file.string(), rank, 3);
        check_sum(comm, rank, 3);
        comm.barrier().wait();  // rank 0 removed the file before its rendezvous ended
        expect(!std::filesystem::exists(file), "the rendezvous file is still there after every rank joined");
      },
      job(60s)));
}

TEST_CASE("from_env() starts a job from srun's variables alone", "[tcp][init]") {
  // The port Slurm's job id gives (20000 + id % 20000) must be free here: take one in that range.
  int port = 0;
  for (int p = 20000 + ::getpid() % 19000, tries = 0; tries < 1000 && port == 0; ++tries, p = 20000 + (p - 19999) % 20000) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(p));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) port = p;
    ::close(fd);
  }
  REQUIRE(port != 0);
  require_all_ok(run_ranks(
      3,
      [port](int rank) {
        for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
          ::unsetenv(v);
        ::setenv("SLURM_PROCID", std::to_string(rank).c_str(), 1);
        ::setenv("SLURM_NTASKS", "3", 1);
        ::setenv("SLURM_LOCALID", std::to_string(rank).c_str(), 1);
        ::setenv("SLURM_NODEID", "0", 1);
        ::setenv("SLURM_STEP_TASKS_PER_NODE", "3", 1);
        ::setenv("SLURM_STEP_NODELIST", "localhost", 1);
        ::setenv("SLURM_JOB_ID", std::to_string(port - 20000 + 20000 * 7).c_str(), 1);
        auto comm = ddp::tcp::communicator::from_env();
        expect(comm.rank() == rank && comm.size() == 3, "srun's rank and size were not the communicator's");
        check_sum(comm, rank, 3);
      },
      job(60s)));
}

TEST_CASE("init(\"file://...\"): the rendezvous file is its owner's alone and holds no credential", "[tcp][init][fast]") {
  namespace d = ddp::tcp::detail;
  temp_dir dir;
  ddp::tcp::config cfg;
  cfg.store_file = (dir.path / "rendezvous").string();
  const d::job_key key = d::job_key_of("tcp-tests");
  d::publish_store(cfg, key, 29500, {"127.0.0.1"});
  struct stat st {};
  REQUIRE(::stat(cfg.store_file.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  // Its words are a format, a random job nonce, a tag, the port and addresses: none is the key or a hash a
  // handshake would accept (the version-1 file held the token's hash, which was all the store checked).
  std::ifstream in(cfg.store_file);
  std::string magic, version, nonce, tag;
  in >> magic >> version >> nonce >> tag;
  CHECK(magic == "ddp-store");
  CHECK(version == "2");
  CHECK(nonce.size() == 32);
  for (const auto& word : {nonce.substr(0, 16), nonce.substr(16), tag}) {
    const std::uint64_t v = std::stoull(word, nullptr, 16);
    CHECK(v != key.k0);
    CHECK(v != key.k1);
  }
  std::string why;
  CHECK(d::read_store_file(cfg, key, why).has_value());
  CHECK_FALSE(d::read_store_file(cfg, d::job_key_of("another job"), why).has_value());
  CHECK_THAT(why, Catch::Contains("another job"));
  d::publish_store(cfg, key, 29500, {"127.0.0.1"});  // a new job nonce each time
  std::ifstream again(cfg.store_file);
  std::string nonce2;
  again >> magic >> version >> nonce2;
  CHECK(nonce2 != nonce);
}

TEST_CASE("init(\"file://...\") ignores another job's file and says so at the connect deadline", "[tcp][init]") {
  temp_dir dir;
  const auto file = dir.path / "rendezvous";
  ddp::tcp::config other;
  other.store_file = file.string();
  ddp::tcp::detail::publish_store(other, ddp::tcp::detail::job_key_of("another job"), 1, {"127.0.0.1"});
  const auto rs = run_ranks(
      1,
      [&file](int) {
        ::setenv("DDP_CONNECT_TIMEOUT_MS", "500", 1);
        try {
          ddp::tcp::communicator::init("file://" + file.string(), 1, 2);
        } catch (const ddp::timeout_error& e) {
          expect(std::string(e.what()).find("another job") != std::string::npos, e.what());
          return;
        }
        expect(false, "rank 1 joined through another job's file");
      },
      job(30s));
  require_all_ok(rs);
}

TEST_CASE("init methods: every malformed URL is a config_error telling the fix", "[tcp][init][fast]") {
  using ddp::tcp::config_from_url;
  CHECK_THROWS_WITH(config_from_url("nccl://x"), Catch::Contains("env://, tcp://host:port or file:///path"));
  CHECK_THROWS_WITH(config_from_url("tcp://127.0.0.1:29500"), Catch::Contains("rank and the world size"));
  CHECK_THROWS_WITH(config_from_url("tcp://127.0.0.1:29500", 2, 2), Catch::Contains("not below the world size"));
  CHECK_THROWS_WITH(config_from_url("tcp://127.0.0.1", 0, 2), Catch::Contains("tcp://host:port"));
  CHECK_THROWS_WITH(config_from_url("tcp://127.0.0.1:0", 0, 2), Catch::Contains("1..65535"));
  CHECK_THROWS_WITH(config_from_url("tcp://:29500", 0, 2), Catch::Contains("tcp://host:port"));
  CHECK_THROWS_WITH(config_from_url("file://relative/path", 0, 2), Catch::Contains("absolute path"));
  const auto tcp = config_from_url("tcp://10.0.0.7:1234", 1, 4);
  CHECK(tcp.master_addr == "10.0.0.7");
  CHECK(tcp.master_port == 1234);
  CHECK(tcp.rank == 1);
  CHECK(tcp.size == 4);
  // file:// without a token: two jobs sharing the path would merge, so it is refused unless allowed.
  const char* token = std::getenv("DDP_TOKEN");
  const std::string saved = token != nullptr ? token : "";
  ::unsetenv("DDP_TOKEN");
  ::unsetenv("DDP_ALLOW_NO_TOKEN");
  CHECK_THROWS_WITH(config_from_url("file:///shared/job", 3, 4),
                    Catch::Contains("without a job token") && Catch::Contains("DDP_ALLOW_NO_TOKEN=1"));
  ::setenv("DDP_ALLOW_NO_TOKEN", "1", 1);
  CHECK(config_from_url("file:///shared/job", 3, 4).token.empty());
  ::unsetenv("DDP_ALLOW_NO_TOKEN");
  ::setenv("DDP_TOKEN", "a job's token", 1);
  const auto file = config_from_url("file:///shared/job", 3, 4);
  CHECK(file.store_file == "/shared/job");
  CHECK(file.rank == 3);
  if (token != nullptr)
    ::setenv("DDP_TOKEN", saved.c_str(), 1);
  else
    ::unsetenv("DDP_TOKEN");
}
