#pragma once
// Multi-rank tests: run a body in N forked ranks (ddp::launch::spawn with captured output) and fail
// the Catch2 test with every failing rank's output.
//
//   auto result = ddp::testing::run_ranks(3, [](int rank) {
//     auto comm = ddp::tcp::communicator::from_env();
//     ...  // throw (or fail an expectation that throws) to fail this rank
//   });
//   ddp::testing::require_all_ok(result);
//
//   ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) { ... });  // N = 1, 2, 3, each its own job

#include <catch2/catch.hpp>

#include <dirent.h>

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/launch/spawn.hpp>

namespace ddp::testing {

#ifndef DDP_TEST_TIMEOUT_SCALE
#define DDP_TEST_TIMEOUT_SCALE 1
#endif

/// Multiplies run_ranks' whole-job limits (and so the DDP_TIMEOUT_MS it derives): the CMake variable of the same
/// name, which scripts/sanitize.sh raises because instrumented ranks run several times slower.
inline constexpr int timeout_scale = DDP_TEST_TIMEOUT_SCALE;
static_assert(timeout_scale >= 1, "DDP_TEST_TIMEOUT_SCALE must be a whole number from 1 up: configure with -DDDP_TEST_TIMEOUT_SCALE=4");

/// The threads of this process (entries of /proc/self/task); 0 when that cannot be read.
inline int thread_count() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return 0;
  int n = 0;
  while (const dirent* e = ::readdir(dir))
    if (e->d_name[0] != '.') ++n;
  ::closedir(dir);
  return n;
}

#if defined(__SANITIZE_THREAD__)
/// ThreadSanitizer's background thread, which it starts beside the first thread the program creates.
inline constexpr int sanitizer_threads = 1;
#else
/// No sanitizer thread (AddressSanitizer starts none).
inline constexpr int sanitizer_threads = 0;
#endif

/// The threads run_ranks may fork beside: the test's main thread (and those before main) and a sanitizer's own.
inline const int threads_at_start = thread_count() + sanitizer_threads;

/// Throws unless the test process runs no thread of its own (one that has just been joined may take a moment to
/// leave /proc): the ranks are forked without exec, and a lock such a thread holds at the fork stays locked in
/// every rank (AddressSanitizer's allocator's: the rank's progress engine hangs at its first allocation).
inline void require_no_thread_beside_fork() {
  using namespace std::chrono_literals;
  for (int tries = 0; thread_count() > threads_at_start; ++tries) {
    if (tries == 100)
      throw std::logic_error(std::to_string(thread_count() - threads_at_start) +
                             " thread(s) of the test run while run_ranks forks the ranks: a lock one holds would "
                             "stay locked in the ranks; run the helper in a side_process (support/side_process.hpp)");
    std::this_thread::sleep_for(10ms);
  }
}

/// Runs body(rank) in `n` forked ranks with torchrun's environment (no other thread of the test may run: it
/// throws std::logic_error if one does); output is captured; a failing
/// rank stops the others; `options.timeout` (default 60 s) times timeout_scale kills the whole job. Every rank
/// also gets DDP_TIMEOUT_MS at three quarters of the job's timeout, so a stuck collective raises
/// ddp::timeout_error (with its message in the output) before the job is killed; options.extra_env
/// may override it (a test of timeouts gives its own, unscaled).
inline ddp::launch::spawn_result run_ranks(int n, const std::function<void(int rank)>& body,
                                           ddp::launch::spawn_options options) {
  using namespace std::chrono_literals;
  require_no_thread_beside_fork();
  options.output = ddp::launch::output_mode::capture;
  if (options.timeout.count() <= 0) options.timeout = 60s;
  options.timeout *= timeout_scale;
  const auto op_timeout = std::to_string((options.timeout * 3 / 4).count());
  options.extra_env = [op_timeout, user = std::move(options.extra_env)](int rank) {
    ddp::launch::env_list env{{"DDP_TIMEOUT_MS", op_timeout}};
    if (user)
      for (auto& kv : user(rank)) env.push_back(std::move(kv));
    return env;
  };
  return ddp::launch::spawn(n, body, options);
}

/// run_ranks with the default options and a whole-job timeout.
inline ddp::launch::spawn_result run_ranks(int n, const std::function<void(int rank)>& body,
                                           std::chrono::seconds timeout = std::chrono::seconds(60)) {
  ddp::launch::spawn_options options;
  options.timeout = timeout;
  return run_ranks(n, body, std::move(options));
}

/// The job's summary and every rank's status and captured output, for failure messages.
inline std::string all_output(const ddp::launch::spawn_result& result) {
  std::string s = result.describe() + "\n";
  for (const auto& r : result.ranks)
    s += "--- rank " + std::to_string(r.rank) + " (" + r.describe() + (r.stopped_by_launcher ? ", stopped" : "") +
         ")\n" + r.output + (r.output.empty() || r.output.back() == '\n' ? "" : "\n");
  return s;
}

/// Fails the current test unless every rank exited 0, showing every rank's output.
inline void require_all_ok(const ddp::launch::spawn_result& result) {
  INFO(all_output(result));
  REQUIRE(result.ok());
}

/// Runs body(comm), comm the TCP communicator of torchrun's environment, in its own job at every world size from 1
/// to `max_ranks`, each rank calling `setup` (when given) first; fails the test at the first failing job.
template <class F>
void on_1_to_n_ranks(int max_ranks, F body, const std::function<void()>& setup = {}) {
  for (int n = 1; n <= max_ranks; ++n) {
    INFO("ranks: " << n);
    require_all_ok(run_ranks(n, [&](int) {
      if (setup) setup();
      body(ddp::tcp::communicator::from_env());
    }));
  }
}

}  // namespace ddp::testing
