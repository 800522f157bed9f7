#pragma once
/// \file Rank-0-only logging: `ddp::logger log{comm}; log.info("epoch ", e, " loss ", loss);` prints on rank 0
/// and is silent elsewhere, unless DDP_LOG_ALL_RANKS=1, where every rank prints with a "[rank r]" prefix.
/// Arguments are streamed with operator<<; each message is written as one line in one call, so lines of
/// different ranks sharing a terminal do not interleave mid-line.

#include <concepts>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

namespace ddp {

/// A logger that knows its rank: info() on rank 0 only (or on every rank with DDP_LOG_ALL_RANKS=1), warn() always.
class logger {
 public:
  /// A logger for `rank`; `out` receives info lines (stdout by default), warnings go to stderr.
  explicit logger(int rank, std::FILE* out = stdout) : rank_(rank), out_(out) {
    const char* all = std::getenv("DDP_LOG_ALL_RANKS");  // NOLINT(concurrency-mt-unsafe): read once
    all_ranks_ = all != nullptr && std::string_view(all) == "1";
  }
  /// A logger for the rank of `comm` (any ddp::communicator, or anything with rank()).
  template <class Comm>
    requires requires(const Comm& c) { { c.rank() } -> std::convertible_to<int>; }
  explicit logger(const Comm& comm, std::FILE* out = stdout) : logger(comm.rank(), out) {}

  /// True when info() prints on this rank.
  [[nodiscard]] bool enabled() const noexcept { return rank_ == 0 || all_ranks_; }
  /// This logger's rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// Prints the streamed `args` as one line, on rank 0 only (every rank with DDP_LOG_ALL_RANKS=1).
  template <class... Args>
  void info(Args&&... args) const {
    if (enabled()) write(out_, compose(std::forward<Args>(args)...));
  }
  /// Prints the streamed `args` as one line on stderr, on every rank, prefixed with the rank.
  template <class... Args>
  void warn(Args&&... args) const {
    write(stderr, "[rank " + std::to_string(rank_) + "] warning: " + compose_raw(std::forward<Args>(args)...));
  }

 private:
  template <class... Args>
  static std::string compose_raw(Args&&... args) {
    std::ostringstream s;
    (s << ... << std::forward<Args>(args));
    return s.str();
  }
  template <class... Args>
  std::string compose(Args&&... args) const {
    return (all_ranks_ ? "[rank " + std::to_string(rank_) + "] " : std::string()) + compose_raw(std::forward<Args>(args)...);
  }
  static void write(std::FILE* to, std::string line) {
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), to);
    std::fflush(to);
  }

  int rank_;
  std::FILE* out_;
  bool all_ranks_ = false;
};

}  // namespace ddp
