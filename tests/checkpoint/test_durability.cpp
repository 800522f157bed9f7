// What a checkpoint survives ([durability], one process and its forked children, each a world of one over TCP):
// saves killed with SIGKILL half-way (ddp::save and ddp::save_sharded) leave the previous checkpoint loadable,
// and the next save to the same path removes what they left; a temporary still in use by a live saver is never
// removed; kill trials at random moments; several processes saving to one path at once.
// Children report failure through their exit status; the parent only watches files and sends signals.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/optim/sgd.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "fixtures.hpp"
#include "world_of_one.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

/// A scratch directory of its own, removed with its contents at scope exit.
struct scratch_dir {
  fs::path path;
  explicit scratch_dir(const std::string& tag)
      : path(fs::temp_directory_path() / ("ddp_durability_" + std::to_string(::getpid()) + "_" + tag)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~scratch_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// The entries beside `target` named "<target's name>.tmp.<anything>": what saves to `target` leave while writing.
std::vector<fs::path> temps_of(const fs::path& target) {
  std::vector<fs::path> out;
  const std::string prefix = target.filename().string() + ".tmp.";
  std::error_code ec;
  for (fs::directory_iterator it(target.parent_path(), ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename().string().starts_with(prefix)) out.push_back(it->path());
  std::sort(out.begin(), out.end());
  return out;
}

/// Bytes of the largest regular file among the temporaries of `target` (inside temporary directories too).
std::uintmax_t largest_temp_file(const fs::path& target) {
  std::uintmax_t most = 0;
  const auto consider = [&](const fs::path& p) {  // files may vanish while we look: errors count as empty
    std::error_code ec;
    const auto size = fs::is_regular_file(p, ec) ? fs::file_size(p, ec) : 0;
    if (!ec) most = std::max(most, size);
  };
  for (const auto& t : temps_of(target)) {
    consider(t);
    std::error_code ec;
    for (fs::recursive_directory_iterator it(t, ec), end; !ec && it != end; it.increment(ec)) consider(it->path());
  }
  return most;
}

/// Runs `body` in a forked child, which exits 0 when it returns and 1 (printing why) when it throws.
pid_t fork_child(const std::function<void()>& body) {
  std::cout.flush();
  std::cerr.flush();
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d failed: %s\n", static_cast<int>(::getpid()), e.what());
      code = 1;
    } catch (...) {
      std::fprintf(stderr, "child %d failed with a non-standard exception\n", static_cast<int>(::getpid()));
      code = 1;
    }
    std::_Exit(code);  // no atexit handlers, no Catch2 teardown in the child
  }
  return pid;
}

/// Waits at most 60 s for `pid` to exit (or stop, with `stopped`); returns its status. Kills it and fails past that.
int wait_child(pid_t pid, bool stopped = false) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG | (stopped ? WUNTRACED : 0)) == pid) return status;
    std::this_thread::sleep_for(1ms);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  FAIL("child " << pid << " neither exited nor stopped within 60 s");
  return status;
}

/// Runs `body` in a child and requires that it succeeded.
void in_child(const std::string& what, const std::function<void()>& body) {
  const int status = wait_child(fork_child(body));
  INFO(what << ": child status " << status);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
}

/// Freezes `pid` (SIGSTOP) at a moment when a temporary of `target` exists and its largest file holds at least
/// `bytes` bytes: the save is under way. Polls for at most 60 s; fails when the child exits first.
void stop_mid_write(pid_t pid, const fs::path& target, std::uintmax_t bytes) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    REQUIRE(::waitpid(pid, &status, WNOHANG) == 0);  // the saver is still running
    if (!temps_of(target).empty() && largest_temp_file(target) >= bytes) {
      ::kill(pid, SIGSTOP);
      REQUIRE(::waitpid(pid, &status, WUNTRACED) == pid);
      if (!temps_of(target).empty() && largest_temp_file(target) >= bytes) return;  // frozen mid-save
      ::kill(pid, SIGCONT);
    }
    std::this_thread::sleep_for(100us);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  FAIL("no temporary of " << target << " reached " << bytes << " bytes within 60 s");
}

/// The model the kill tests save: about 9.4 MB of parameters (and as much momentum), so a save takes a while.
constexpr std::size_t big_hidden = std::size_t{1} << 18;
constexpr std::uintmax_t big_bytes = 2 * 4 * (big_hidden * 5 + big_hidden + 3 * big_hidden + 3);
using big_dp = ddp::data_parallel<net, ddp::backend::tcp>;

/// Saves the big model to `target` (a file, or a sharded directory when `sharded`) `rounds` times.
void save_big(const fs::path& target, bool sharded, int rounds) {
  auto comm = solo();
  net model = make_net(0.5F, big_hidden);
  big_dp dp(model, comm);
  ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
  for (int r = 0; r < rounds; ++r) {
    if (sharded)
      ddp::save_sharded(target, dp, opt, {{"round", std::to_string(r)}});
    else
      ddp::save(target, dp, opt, {{"round", std::to_string(r)}});
  }
}

/// Loads the big model's checkpoint at `target` into another initialization; throws unless it holds the saved values.
void load_big(const fs::path& target, bool sharded) {
  auto comm = solo();
  net expected = make_net(0.5F, big_hidden), model = make_net(9.0F, big_hidden);
  big_dp dp(model, comm);
  ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
  const auto meta = sharded ? ddp::load_sharded(target, dp, opt) : ddp::load(target, dp, opt);
  if (!meta.contains("round")) throw std::runtime_error("the loaded checkpoint lacks its 'round' metadata");
  for (auto [x, y] : {std::pair{&expected.fc1.weight, &model.fc1.weight}, std::pair{&expected.fc2.weight, &model.fc2.weight}})
    if (!std::equal(x->value().begin(), x->value().end(), y->value().begin(), y->value().end()))
      throw std::runtime_error("the loaded parameters differ from the saved ones");
}

/// A save killed half-way leaves its temporaries and the previous checkpoint; the next save removes them.
void check_killed_save(bool sharded) {
  scratch_dir d(sharded ? "killed_sharded" : "killed_file");
  const auto target = d.path / (sharded ? "model.ckpt" : "model.safetensors");
  in_child("first save", [&] { save_big(target, sharded, 1); });
  REQUIRE(temps_of(target).empty());

  const pid_t saver = fork_child([&] { save_big(target, sharded, 1000); });
  stop_mid_write(saver, target, big_bytes / 4);
  const auto left = temps_of(target);
  ::kill(saver, SIGKILL);
  const int status = wait_child(saver);
  REQUIRE(WIFSIGNALED(status));
  INFO("left by the killed save: " << left.size() << " entries, first " << left.front());
  REQUIRE(temps_of(target) == left);  // the kill left them behind

  in_child("load after the kill", [&] { load_big(target, sharded); });
  in_child("the next save", [&] { save_big(target, sharded, 1); });
  CHECK(temps_of(target).empty());
  for (const auto& p : left) CHECK_FALSE(fs::exists(p));
  in_child("load after the next save", [&] { load_big(target, sharded); });
}

}  // namespace

TEST_CASE("a file save killed half-way leaves the old checkpoint, and the next save removes its temporary", "[durability]") {
  check_killed_save(false);
}

TEST_CASE("a sharded save killed half-way leaves the old checkpoint, and the next save removes its temporary directory",
          "[durability]") {
  check_killed_save(true);
}

TEST_CASE("a temporary in use by a live saver is not removed by another save to the same path", "[durability]") {
  namespace st = ddp::safetensors;
  scratch_dir d("live");
  const auto target = d.path / "model.safetensors";
  const std::vector<float> values(std::size_t{1} << 20, 1.5F);
  const auto bytes = std::as_bytes(std::span(values));
  const std::vector<st::tensor_header> headers{{"w", ddp::dtype::f32, {values.size()}}};
  // The live saver writes half its data, stops itself (holding its temporary), and finishes when continued.
  const pid_t live = fork_child([&] {
    st::writer w(target, headers, {{"by", "live"}});
    w.append(bytes.first(bytes.size() / 2));
    ::raise(SIGSTOP);
    w.append(bytes.subspan(bytes.size() / 2));
    w.commit();
  });
  REQUIRE(WIFSTOPPED(wait_child(live, true)));
  const auto in_use = temps_of(target);
  REQUIRE_FALSE(in_use.empty());

  const std::vector<float> other{2.0F};
  st::write(target, std::vector<st::tensor_view>{{"w", ddp::dtype::f32, {1}, std::as_bytes(std::span(other))}},
            {{"by", "other"}});
  REQUIRE(st::file::read(target).metadata().at("by") == "other");
  CHECK(temps_of(target) == in_use);  // still there, untouched

  ::kill(live, SIGCONT);
  const int status = wait_child(live);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);  // its temporary was still there to be renamed into place
  const auto f = st::file::read(target);
  REQUIRE(f.metadata().at("by") == "live");
  REQUIRE(f.find("w")->numel() == values.size());
  CHECK(temps_of(target).empty());
}

TEST_CASE("a save removes stale temporaries of its path whatever pid they name, and nothing else", "[durability]") {
  namespace st = ddp::safetensors;
  scratch_dir d("stale");
  const auto target = d.path / "model.safetensors";
  const std::string me = std::to_string(::getpid());  // a live pid: pids are reused, so a name proves nothing
  const auto touch = [](const fs::path& p) { std::ofstream(p) << "partial"; };
  const std::vector<fs::path> stale{d.path / ("model.safetensors.tmp." + me),  // as earlier ddp versions named them
                                    d.path / ("model.safetensors.tmp." + me + ".00c0ffee"),
                                    d.path / ("model.safetensors.tmp." + me + ".00c0ffee.lock")};
  for (const auto& p : stale) touch(p);
  fs::create_directories(d.path / "model.safetensors.tmp.1.abc" / "inner");  // a killed saver's directory
  touch(d.path / "model.safetensors.tmp.1.abc" / "inner" / "part");
  const std::vector<fs::path> kept{d.path / "model.safetensors.tmp.notes", d.path / "model.safetensors.tmp.12x",
                                   d.path / "model.safetensors.bak", d.path / ("other.safetensors.tmp." + me),
                                   d.path / "model.safetensors.tmp."};
  for (const auto& p : kept) touch(p);

  const std::vector<float> w{1.0F, 2.0F};
  st::write(target, std::vector<st::tensor_view>{{"w", ddp::dtype::f32, {2}, std::as_bytes(std::span(w))}});
  for (const auto& p : stale) CHECK_FALSE(fs::exists(p));
  CHECK_FALSE(fs::exists(d.path / "model.safetensors.tmp.1.abc"));
  for (const auto& p : kept) CHECK(fs::exists(p));
  REQUIRE(st::file::read(target).find("w") != nullptr);
}

TEST_CASE("several processes saving to one path at once all succeed and leave no temporary", "[durability]") {
  for (const bool sharded : {false, true}) {
    scratch_dir d(sharded ? "crowd_sharded" : "crowd_file");
    const auto target = d.path / (sharded ? "model.ckpt" : "model.safetensors");
    std::vector<pid_t> savers;
    for (int p = 0; p < 3; ++p)
      savers.push_back(fork_child([&, p] {
        auto comm = solo();
        net model = make_net(0.5F, 4096);
        big_dp dp(model, comm);
        ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
        for (int r = 0; r < 6; ++r) {
          const ddp::checkpoint_metadata meta{{"round", std::to_string(r)}, {"saver", std::to_string(p)}};
          if (sharded)
            ddp::save_sharded(target, dp, opt, meta);
          else
            ddp::save(target, dp, opt, meta);
        }
      }));
    for (const pid_t s : savers) {
      const int status = wait_child(s);
      INFO((sharded ? "sharded" : "file") << " saver " << s << " status " << status);
      CHECK(WIFEXITED(status));
      CHECK(WEXITSTATUS(status) == 0);
    }
    CHECK(temps_of(target).empty());
    in_child("load what the last saver left", [&] {
      auto comm = solo();
      net model = make_net(3.0F, 4096);
      big_dp dp(model, comm);
      ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
      const auto meta = sharded ? ddp::load_sharded(target, dp, opt) : ddp::load(target, dp, opt);
      if (meta.at("round") != "5") throw std::runtime_error("the last save was round " + meta.at("round") + ", not 5");
    });
  }
}

TEST_CASE("kill trials: saves killed at random moments leave a loadable checkpoint and no temporary after the next save",
          "[durability]") {
  // DDP_KILL_TRIALS overrides the number of trials (the measure runs 60).
  const char* env = std::getenv("DDP_KILL_TRIALS");
  const int trials = env != nullptr ? std::clamp(std::atoi(env), 1, 1000) : 8;
  scratch_dir d("trials");
  std::mt19937 rng(20261123);
  int loadable = 0, left_temporaries = 0, temporaries_after_next_save = 0;
  for (int t = 0; t < trials; ++t) {
    const bool sharded = t % 2 == 1;
    const auto target = d.path / (sharded ? "model.ckpt" : "model.safetensors");
    if (t < 2) in_child("first save", [&] { save_big(target, sharded, 1); });
    const pid_t saver = fork_child([&] { save_big(target, sharded, 1000); });
    stop_mid_write(saver, target, 0);  // saving has begun (a temporary exists); then a random moment of the loop
    ::kill(saver, SIGCONT);
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 300'000)(rng)));
    ::kill(saver, SIGKILL);
    REQUIRE(WIFSIGNALED(wait_child(saver)));
    left_temporaries += temps_of(target).empty() ? 0 : 1;
    const int load_status = wait_child(fork_child([&] { load_big(target, sharded); }));
    loadable += WIFEXITED(load_status) && WEXITSTATUS(load_status) == 0 ? 1 : 0;
    in_child("the next save", [&] { save_big(target, sharded, 1); });
    temporaries_after_next_save += static_cast<int>(temps_of(target).size());
  }
  std::cout << "kill trials: " << loadable << "/" << trials << " kills left a loadable checkpoint; " << left_temporaries
            << " left temporaries; " << temporaries_after_next_save << " temporaries remained after the next saves\n";
  CHECK(left_temporaries > 0);  // the kills did land inside saves
  CHECK(loadable == trials);
  CHECK(temporaries_after_next_save == 0);
}
