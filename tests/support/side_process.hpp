#pragma once
// A helper that must run beside a multi-rank job (a stranger on a port, a fake rank): a forked process, not a
// thread. run_ranks forks the ranks without exec, and a thread of the test process would be forked mid-call:
// a lock it held at that moment (AddressSanitizer's allocator's, for one: GCC 12's has no fork handler) stays
// locked in the rank forever, and the rank's first thread to need it hangs (its progress engine never starts).
// docs/launch.md: call spawn before starting threads of your own.
//
//   ddp::testing::side_process stranger([port] { ...; ddp::testing::tcp::expect(cond, "what"); });
//   const auto rs = run_ranks(...);
//   REQUIRE(stranger.join() == "");  // or stop(): end it now; only a failure before that counts

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>

namespace ddp::testing {

/// `body` run in a forked child of the (single-threaded) test process; it fails when body throws.
class side_process {
 public:
  /// Forks the child, which runs `body` and _exits (0 when body returns, 1 when it throws, what() on stderr).
  explicit side_process(const std::function<void()>& body) {
    std::fflush(nullptr);  // the child must not write the parent's buffered output again
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed for a side process");
    if (pid_ > 0) return;
    int code = 0;
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "side process failed: %s\n", e.what());
      code = 1;
    } catch (...) {
      std::fprintf(stderr, "side process failed with an exception that is not a std::exception\n");
      code = 1;
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  side_process(const side_process&) = delete;
  side_process& operator=(const side_process&) = delete;
  ~side_process() {
    if (pid_ > 0) stop();
  }

  /// Waits for the child to end; "" when body returned, else how it ended.
  std::string join() { return reap(); }
  /// Ends the child now (SIGKILL) unless it has ended; "" unless body had already failed.
  std::string stop() {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return describe(status);
    }
    ::kill(pid_, SIGKILL);
    reap();
    return "";
  }

 private:
  std::string reap() {
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return describe(status);
  }
  static std::string describe(int status) {
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
    if (WIFEXITED(status)) return "the side process exited with code " + std::to_string(WEXITSTATUS(status));
    return "the side process was killed by signal " + std::to_string(WTERMSIG(status));
  }

  pid_t pid_ = -1;
};

}  // namespace ddp::testing
