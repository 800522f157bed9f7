// The fake device (tests/support/fake_device.hpp) that the device paths are proved on: it must catch what a real
// device would punish. A host access to its memory faults; a result read without waiting for the stream is
// stale; the stream waits for a collective's work without blocking the host; its operations run in order.

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include <ddp/core/work.hpp>

#include "support/fake_device.hpp"

using namespace std::chrono_literals;

TEST_CASE("fake device: operations run in order on its stream and read back through it", "[fake_device]") {
  ddp::testing::fake_device dev(0, 0us, 200us);
  const std::size_t n = 3000;
  const ddp::domain_buffer a = dev.allocate(n * sizeof(float)), b = dev.allocate(n * sizeof(float));
  const ddp::raw_tensor va = a.view(ddp::dtype::f32, 0, n), vb = b.view(ddp::dtype::f32, 0, n);
  CHECK(va.where == ddp::device::cuda(0));
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 17);
  dev.copy(ddp::raw_tensor::of(std::span<float>(host)), va);  // host -> device
  dev.fill(vb, 2.0);
  dev.accumulate(va, vb);  // b = a + 2
  dev.scale(vb, 0.5);      // b = (a + 2) / 2
  const ddp::domain_buffer h = dev.allocate(n * sizeof(ddp::bfloat16));
  dev.convert(vb, h.view(ddp::dtype::bf16, 0, n), 2.0);  // bf16(a + 2)
  const auto got = dev.read<float>(vb);
  const auto half = dev.read<ddp::bfloat16>(h.view(ddp::dtype::bf16, 0, n));
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(got[i] == (host[i] + 2.0F) / 2.0F);
    REQUIRE(half[i] == ddp::bfloat16(host[i] + 2.0F));
  }
  dev.zero(vb);
  for (const float x : dev.read<float>(vb)) REQUIRE(x == 0.0F);
  CHECK(dev.operations() >= 8);
  CHECK(dev.allocated_bytes() >= 2 * n * sizeof(float));
}

TEST_CASE("fake device: the host touching its memory faults", "[fake_device]") {
  ddp::testing::fake_device dev(0);
  const ddp::domain_buffer a = dev.allocate(64);
  const pid_t child = ::fork();
  if (child == 0) {
    const volatile std::byte x = *static_cast<volatile std::byte*>(a.data());
    static_cast<void>(x);
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGSEGV);
}

TEST_CASE("fake device: a result read without waiting for the stream is stale", "[fake_device]") {
  ddp::testing::fake_device dev(0, 2ms, 3ms);  // every operation starts at least 2 ms after it was enqueued
  const ddp::domain_buffer a = dev.allocate(16 * sizeof(float));
  std::vector<float> host(16, 0.0F);
  dev.fill(a.view(ddp::dtype::f32, 0, 16), 7.0);
  dev.copy(a.view(ddp::dtype::f32, 0, 16), ddp::raw_tensor::of(std::span<float>(host)));
  CHECK(host[0] == 0.0F);  // no wait: the copy has not run
  dev.synchronize();
  CHECK(host[0] == 7.0F);
}

TEST_CASE("fake device: order_after makes the stream, not the host, wait for a collective's work", "[fake_device]") {
  ddp::testing::fake_device dev(0);
  const ddp::domain_buffer a = dev.allocate(4 * sizeof(float));
  auto state = std::make_shared<ddp::detail::completion>(0, std::chrono::milliseconds(5000), "a collective");
  ddp::work w(state);
  std::vector<float> host(4, 0.0F);
  const auto start = std::chrono::steady_clock::now();
  dev.order_after(w);
  dev.fill(a.view(ddp::dtype::f32, 0, 4), 3.0);
  dev.copy(a.view(ddp::dtype::f32, 0, 4), ddp::raw_tensor::of(std::span<float>(host)));
  CHECK(std::chrono::steady_clock::now() - start < 20ms);  // the host went on
  std::this_thread::sleep_for(30ms);
  CHECK(host[0] == 0.0F);  // the stream still waits for the work
  state->finish();
  dev.synchronize();
  CHECK(host[0] == 3.0F);
}

TEST_CASE("fake device: an operation on another device's memory is refused, a failure surfaces at synchronize",
          "[fake_device]") {
  ddp::testing::fake_device zero(0), one(1);
  const ddp::domain_buffer a = one.allocate(8 * sizeof(float));
  CHECK_THROWS_WITH(zero.fill(a.view(ddp::dtype::f32, 0, 8), 1.0), Catch::Contains("memory of cuda:1"));
  const ddp::domain_buffer b = zero.allocate(8 * sizeof(float));
  zero.copy(b.view(ddp::dtype::f32, 0, 8), b.view(ddp::dtype::f32, 0, 4));  // lengths differ: fails on the stream
  CHECK_THROWS_AS(zero.synchronize(), ddp::error);
  zero.synchronize();  // the failure was reported once
}
