#include <ddp/log/logger.hpp>
#include <ddp/log/progress_bar.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

namespace {

/// Everything written to `f` so far.
std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  for (int c = std::fgetc(f); c != EOF; c = std::fgetc(f)) s += static_cast<char>(c);
  return s;
}

struct fake_comm {
  int r;
  int rank() const { return r; }
};

}  // namespace

TEST_CASE("logger prints on rank 0 only unless DDP_LOG_ALL_RANKS=1", "[log]") {
  ::unsetenv("DDP_LOG_ALL_RANKS");
  std::FILE* f0 = std::tmpfile();
  std::FILE* f1 = std::tmpfile();
  ddp::logger(fake_comm{0}, f0).info("epoch ", 3, " loss ", 0.5);
  ddp::logger(fake_comm{1}, f1).info("epoch ", 3);
  CHECK(contents(f0) == "epoch 3 loss 0.5\n");
  CHECK(contents(f1).empty());
  ::setenv("DDP_LOG_ALL_RANKS", "1", 1);
  ddp::logger(2, f1).info("hello");
  CHECK(contents(f1) == "[rank 2] hello\n");
  ::unsetenv("DDP_LOG_ALL_RANKS");
  std::fclose(f0);
  std::fclose(f1);
}

TEST_CASE("progress bar prints plain lines every tenth off a terminal, and nothing on other ranks", "[progress]") {
  std::FILE* f = std::tmpfile();
  {
    ddp::progress_bar bar(0, 20, "epoch 1", f);
    for (int i = 0; i < 20; ++i) bar.step(1.0 + i, 64);
    CHECK(bar.mean_loss() == Approx(10.5));
    bar.finish();
  }
  const auto text = contents(f);
  std::size_t lines = 0;
  for (const char c : text) lines += c == '\n';
  CHECK(lines == 10);  // 2/20, 4/20, ..., 18/20 and the final line
  CHECK(text.find('\r') == std::string::npos);
  CHECK_THAT(text, Catch::Contains("epoch 1 2/20 [==") && Catch::Contains("20/20 [========================] loss 10.5000") &&
                       Catch::Contains("samples/s | took"));
  std::fclose(f);

  std::FILE* g = std::tmpfile();
  {
    ddp::progress_bar bar(fake_comm{1}, 5, "x", g);
    for (int i = 0; i < 5; ++i) bar.step(1, 1);
    bar.finish();
  }
  CHECK(contents(g).empty());
  std::fclose(g);
}
