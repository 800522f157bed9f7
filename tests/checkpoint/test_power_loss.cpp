// What survives a power loss ([durability], one process, a world of one over TCP): the order of the system calls
// a save makes, recorded by wrappers of fsync, rename and renameat2 that this executable defines (they forward to
// the C library's and are linked before it, so ddp's header code calls them). A file save flushes the temporary
// before renaming it over the target and flushes the directory after; a sharded save does so for every part and
// the manifest inside the temporary directory, then renames that directory into place and flushes its parent.
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/optim/sgd.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "fixtures.hpp"
#include "world_of_one.hpp"

namespace {

std::mutex calls_mutex;
bool recording = false;
std::vector<std::string> calls;  // "fsync <path>", "rename <from> <to>"

void record(std::string call) {
  const std::lock_guard lock(calls_mutex);
  if (recording) calls.push_back(std::move(call));
}

template <class F>
F real(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

}  // namespace

extern "C" int fsync(int fd) {
  char target[4096];
  const ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof target - 1);
  record("fsync " + std::string(target, n > 0 ? static_cast<std::size_t>(n) : 0));
  return real<int (*)(int)>("fsync")(fd);
}

extern "C" int rename(const char* from, const char* to) noexcept {
  record(std::string("rename ") + from + " " + to);
  return real<int (*)(const char*, const char*)>("rename")(from, to);
}

extern "C" int renameat2(int from_dir, const char* from, int to_dir, const char* to, unsigned int flags) noexcept {
  record(std::string("rename ") + from + " " + to);
  return real<int (*)(int, const char*, int, const char*, unsigned int)>("renameat2")(from_dir, from, to_dir, to, flags);
}

namespace {

namespace fs = std::filesystem;

/// Runs `save` while recording the calls; returns them.
template <class F>
std::vector<std::string> calls_of(F&& save) {
  {
    const std::lock_guard lock(calls_mutex);
    calls.clear();
    recording = true;
  }
  save();
  const std::lock_guard lock(calls_mutex);
  recording = false;
  return calls;
}

/// Index of the first call from `from` on that starts with `prefix` (equals it, when `exact`); fails when none does.
std::size_t find_call(const std::vector<std::string>& recorded, const std::string& prefix, std::size_t from = 0,
                      bool exact = false) {
  for (std::size_t i = from; i < recorded.size(); ++i)
    if (exact ? recorded[i] == prefix : recorded[i].starts_with(prefix)) return i;
  std::string all;
  for (const auto& c : recorded) all += "\n  " + c;
  FAIL("no call '" << prefix << "...' from call " << from << " on among:" << all);
  return 0;
}

/// Requires: the temporary of `file` (named "<file>.tmp.<id>") is flushed, then renamed over `file`, then the
/// directory holding it is flushed. Returns the index of that last flush.
std::size_t require_durable_file(const std::vector<std::string>& recorded, const fs::path& file, std::size_t from = 0) {
  const std::size_t flush = find_call(recorded, "fsync " + file.string() + ".tmp.", from);
  const std::size_t move = find_call(recorded, "rename " + file.string() + ".tmp.", flush);
  REQUIRE(recorded[move].ends_with(" " + file.string()));
  return find_call(recorded, "fsync " + file.parent_path().string(), move, true);
}

}  // namespace

TEST_CASE("a save flushes the file, renames it into place, then flushes the directory", "[durability]") {
  auto comm = solo();
  shared_path file(comm, "power_file");
  net model = make_net(0.5F);
  dp_t<ddp::backend::tcp> dp(model, comm);
  ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
  const fs::path path = fs::weakly_canonical(file.path);
  const auto recorded = calls_of([&] { ddp::save(path, dp, opt); });
  CHECK(require_durable_file(recorded, path) > 0);
}

TEST_CASE("a sharded save flushes every part and the manifest, then moves the directory and flushes its parent",
          "[durability]") {
  auto comm = solo();
  shared_path dir(comm, "power_sharded", "");
  net model = make_net(0.5F);
  dp_t<ddp::backend::tcp, ddp::full_shard> dp(model, comm);
  ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
  const fs::path path = fs::weakly_canonical(dir.path);
  for (int round = 0; round < 2; ++round) {  // the second save replaces the first (an exchange of directories)
    const auto recorded = calls_of([&] { ddp::save_sharded(path, dp, opt); });
    const std::size_t first = find_call(recorded, "rename " + path.string() + ".tmp.");  // a part, inside the temporary
    const fs::path tmp_dir = fs::path(recorded[first].substr(7, recorded[first].find(' ', 7) - 7)).parent_path();
    REQUIRE(tmp_dir.parent_path() == path.parent_path());
    const std::size_t part = require_durable_file(recorded, tmp_dir / ddp::detail::part_name(0, 1));
    const std::size_t manifest = require_durable_file(recorded, tmp_dir / "manifest.json", part);
    const std::size_t install = find_call(recorded, "rename " + tmp_dir.string() + " " + path.string(), manifest, true);
    CHECK(find_call(recorded, "fsync " + path.parent_path().string(), install, true) > install);
  }
}
