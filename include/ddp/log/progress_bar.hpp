#pragma once
/// \file A progress bar for training loops, drawn by rank 0 only: step/total, loss, samples/s and ETA.
/// On a terminal it redraws one line with '\r'; otherwise (logs, pipes) it prints a plain line every
/// tenth of the way and at the end, so log files stay readable.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdio>
#include <string>
#include <utility>

#include <unistd.h>

namespace ddp {

/// Progress of one loop of `total` steps (an epoch), shown on rank 0 and silent on the others.
class progress_bar {
 public:
  using clock = std::chrono::steady_clock;  ///< time source

  /// A bar titled `label` for `total` steps, drawn when `rank` is 0, on `out` (stderr by default).
  progress_bar(int rank, std::size_t total, std::string label, std::FILE* out = stderr)
      : enabled_(rank == 0), tty_(enabled_ && ::isatty(::fileno(out)) == 1), total_(total), label_(std::move(label)),
        out_(out), start_(clock::now()), last_draw_(start_) {}
  /// A bar for the rank of `comm`.
  template <class Comm>
    requires requires(const Comm& c) { { c.rank() } -> std::convertible_to<int>; }
  progress_bar(const Comm& comm, std::size_t total, std::string label, std::FILE* out = stderr)
      : progress_bar(comm.rank(), total, std::move(label), out) {}
  progress_bar(const progress_bar&) = delete;
  progress_bar& operator=(const progress_bar&) = delete;
  /// Ends the line on a terminal if finish() was not called.
  ~progress_bar() { if (tty_ && !finished_ && step_ > 0) std::fputc('\n', out_); }

  /// One more step done, which processed `samples` samples (all ranks together, or this rank's: say so in the
  /// label) with loss `loss` (shown as a running mean over the loop).
  void step(double loss, std::size_t samples) {
    ++step_;
    samples_ += samples;
    loss_sum_ += loss;
    if (!enabled_) return;
    const auto now = clock::now();
    if (tty_) {
      if (now - last_draw_ >= std::chrono::milliseconds(100) || step_ == total_) draw(now, '\r');
    } else if (total_ > 0 && (step_ * 10 / total_ != (step_ - 1) * 10 / total_) && step_ != total_) {
      draw(now, '\n');
    }
  }
  /// Draws the final state and ends the line.
  void finish() {
    if (!enabled_ || finished_) return;
    finished_ = true;
    draw(clock::now(), tty_ ? '\r' : '\n');
    if (tty_) std::fputc('\n', out_);
    std::fflush(out_);
  }

  /// Steps done so far.
  [[nodiscard]] std::size_t steps() const noexcept { return step_; }
  /// Mean of the losses passed to step().
  [[nodiscard]] double mean_loss() const noexcept { return step_ ? loss_sum_ / static_cast<double>(step_) : 0.0; }
  /// The line as drawn now ("label 120/469 [=====>    ] loss 0.4321 | 12345 samples/s | ETA 0:12").
  [[nodiscard]] std::string line() const { return render(clock::now()); }

 private:
  static std::string clock_text(double seconds) {
    const auto s = static_cast<long long>(seconds + 0.5);
    char buf[32];
    if (s >= 3600)
      std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
    else
      std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
    return buf;
  }
  std::string render(clock::time_point now) const {
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    constexpr std::size_t width = 24;
    const std::size_t filled = total_ ? std::min(width, step_ * width / total_) : width;
    std::string bar(filled, '=');
    if (filled < width) bar += '>' + std::string(width - filled - 1, ' ');
    const double rate = elapsed > 0 ? static_cast<double>(samples_) / elapsed : 0.0;
    const double eta = step_ > 0 && total_ > step_ ? elapsed / static_cast<double>(step_) * static_cast<double>(total_ - step_) : 0.0;
    char buf[160];
    std::snprintf(buf, sizeof buf, " %zu/%zu [%s] loss %.4f | %.0f samples/s | %s %s", step_, total_, bar.c_str(),
                  mean_loss(), rate, step_ >= total_ ? "took" : "ETA", clock_text(step_ >= total_ ? elapsed : eta).c_str());
    return label_ + buf;
  }
  void draw(clock::time_point now, char end) {
    last_draw_ = now;
    std::string text = render(now);
    if (end == '\r') {
      text = '\r' + text + "\x1b[K";  // clear what a longer previous line left
    } else {
      text += '\n';
    }
    std::fwrite(text.data(), 1, text.size(), out_);
    std::fflush(out_);
  }

  bool enabled_;
  bool tty_;
  std::size_t total_;
  std::string label_;
  std::FILE* out_;
  clock::time_point start_;
  clock::time_point last_draw_;
  std::size_t step_ = 0;
  std::size_t samples_ = 0;
  double loss_sum_ = 0;
  bool finished_ = false;
};

}  // namespace ddp
