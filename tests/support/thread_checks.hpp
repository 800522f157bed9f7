#pragma once
// Catch2's assertion macros for code that runs on several threads at once (ddp::local's ranks): Catch2 records
// assertions in one unsynchronized context, so here REQUIRE, REQUIRE_FALSE, REQUIRE_THAT, REQUIRE_THROWS_AS,
// REQUIRE_THROWS_WITH and INFO are redefined to check without it: a failed check throws thread_check_failure
// ("file:line: the check: the INFO messages in scope"), which fails the rank, so ddp::local::run rethrows it
// and the test's own CHECK/REQUIRE_NOTHROW on the main thread reports it. Include it before the scenarios.

#include <catch2/catch.hpp>

#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::testing {

/// A check that failed on some thread.
struct thread_check_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// This thread's INFO messages in scope.
inline std::vector<std::string>& thread_info() {
  thread_local std::vector<std::string> messages;
  return messages;
}

/// INFO's message while its scope lasts.
class scoped_thread_info {
 public:
  explicit scoped_thread_info(std::string m) { thread_info().push_back(std::move(m)); }
  scoped_thread_info(const scoped_thread_info&) = delete;
  scoped_thread_info& operator=(const scoped_thread_info&) = delete;
  ~scoped_thread_info() { thread_info().pop_back(); }
};

/// Throws thread_check_failure for the check `text` at file:line, with the INFO messages in scope.
[[noreturn]] inline void thread_check_failed(const char* file, int line, const std::string& text) {
  std::string s = std::string(file) + ":" + std::to_string(line) + ": " + text;
  for (const auto& m : thread_info()) s += "\n  with " + m;
  throw thread_check_failure(s);
}

}  // namespace ddp::testing

#undef REQUIRE
#undef REQUIRE_FALSE
#undef REQUIRE_THAT
#undef REQUIRE_THROWS_AS
#undef REQUIRE_THROWS_WITH
#undef INFO

#define REQUIRE(...) \
  ((__VA_ARGS__) ? void() : ::ddp::testing::thread_check_failed(__FILE__, __LINE__, "REQUIRE(" #__VA_ARGS__ ")"))
#define REQUIRE_FALSE(...) \
  (!(__VA_ARGS__) ? void() : ::ddp::testing::thread_check_failed(__FILE__, __LINE__, "REQUIRE_FALSE(" #__VA_ARGS__ ")"))
#define REQUIRE_THAT(arg, matcher)                                                                             \
  do {                                                                                                         \
    const std::string ddp_checked_(arg);                                                                       \
    if (!(matcher).match(ddp_checked_))                                                                        \
      ::ddp::testing::thread_check_failed(__FILE__, __LINE__, "REQUIRE_THAT(" #arg ", " #matcher ") on '" + ddp_checked_ + "'"); \
  } while (false)
#define REQUIRE_THROWS_AS(expr, type)                                                                          \
  do {                                                                                                         \
    bool ddp_thrown_ = false;                                                                                  \
    try {                                                                                                      \
      static_cast<void>(expr);                                                                                 \
    } catch (const type&) {                                                                                    \
      ddp_thrown_ = true;                                                                                      \
    }                                                                                                          \
    if (!ddp_thrown_) ::ddp::testing::thread_check_failed(__FILE__, __LINE__, "REQUIRE_THROWS_AS(" #expr ", " #type ")"); \
  } while (false)
#define REQUIRE_THROWS_WITH(expr, matcher)                                                                     \
  do {                                                                                                         \
    std::string ddp_what_ = "nothing thrown";                                                                  \
    bool ddp_matched_ = false;                                                                                 \
    try {                                                                                                      \
      static_cast<void>(expr);                                                                                 \
    } catch (const std::exception& ddp_e_) {                                                                   \
      ddp_what_ = ddp_e_.what();                                                                               \
      ddp_matched_ = (matcher).match(ddp_what_);                                                               \
    }                                                                                                          \
    if (!ddp_matched_)                                                                                         \
      ::ddp::testing::thread_check_failed(__FILE__, __LINE__, "REQUIRE_THROWS_WITH(" #expr ", " #matcher "): " + ddp_what_); \
  } while (false)
#define DDP_THREAD_INFO_NAME2(a, b) a##b
#define DDP_THREAD_INFO_NAME(a, b) DDP_THREAD_INFO_NAME2(a, b)
#define INFO(msg)                                                            \
  const ::ddp::testing::scoped_thread_info DDP_THREAD_INFO_NAME(ddp_info_, __LINE__)( \
      (std::ostringstream() << msg).str())
