// The host memory domain: zeroed page-aligned buffers, released pages reading zero, each element operation against
// the loop it replaces, for every dtype it serves, and the optimizers' updates bit for bit against their formulas.

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include <ddp/memory/average.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/memory/host.hpp>
#include <ddp/memory/updates.hpp>

namespace {

template <class T>
std::vector<T> iota_of(std::size_t n, float start) {
  std::vector<T> v;
  for (std::size_t i = 0; i < n; ++i) v.push_back(T(start + static_cast<float>(i % 13) * 0.25F));
  return v;
}

}  // namespace

TEST_CASE("host domain: buffers are zeroed, page-aligned, viewed on the CPU, and released pages read zero", "[memory]") {
  ddp::host_domain& host = ddp::host_memory();
  CHECK(host.where() == ddp::device::cpu());
  const std::size_t bytes = 5 * ddp::host_domain::page_bytes + 123;
  const ddp::domain_buffer b = host.allocate(bytes);
  REQUIRE(b.size() == bytes);
  CHECK(b.domain() == &host);
  CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % ddp::host_domain::page_bytes == 0);
  for (std::size_t i = 0; i < bytes; ++i) REQUIRE(b.data()[i] == std::byte{0});
  for (std::size_t i = 0; i < bytes; ++i) b.data()[i] = std::byte{7};
  b.release(100, 4 * ddp::host_domain::page_bytes + 50);  // partial pages at both ends are zeroed by hand
  for (std::size_t i = 0; i < bytes; ++i) {
    const bool inside = i >= 100 && i < 4 * ddp::host_domain::page_bytes + 50;
    REQUIRE(b.data()[i] == (inside ? std::byte{0} : std::byte{7}));
  }
  const ddp::raw_tensor v = b.view(ddp::dtype::f32, 3, 10);
  CHECK(v.data == b.data() + 12);
  CHECK(v.size == 10);
  CHECK(v.where == ddp::device::cpu());
  CHECK(host.allocate(0).data() == nullptr);
}

TEMPLATE_TEST_CASE("host domain: zero, copy, accumulate, scale and fill act on every element", "[memory]", float,
                   double, ddp::bfloat16, ddp::float16, std::int32_t, std::int64_t) {
  ddp::host_domain& host = ddp::host_memory();
  const std::size_t n = 1031;
  auto a = iota_of<TestType>(n, 1.0F), b = iota_of<TestType>(n, 2.0F);
  const auto a0 = a, b0 = b;
  const auto raw = [](std::vector<TestType>& v) { return ddp::raw_tensor::of(std::span<TestType>(v)); };
  host.accumulate(raw(b), raw(a));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(a[i] == static_cast<TestType>(a0[i] + b0[i]));
  host.copy(raw(b), raw(a));
  CHECK(a == b0);
  host.scale(raw(a), 0.5);
  for (std::size_t i = 0; i < n; ++i) {
    auto want = b0;
    ddp::detail::scale(raw(want), 0.5);
    REQUIRE(a[i] == want[i]);
  }
  host.fill(raw(a), 3.0);
  for (const auto& x : a) REQUIRE(x == TestType(3.0F));
  host.zero(raw(a));
  for (const auto& x : a) REQUIRE(x == TestType(0.0F));
  CHECK_THROWS_AS(host.copy(raw(b), ddp::raw_tensor::of(std::span<TestType>(a.data(), n - 1))), ddp::error);
}

TEST_CASE("host domain: convert narrows through float, and a factor multiplies in the source dtype first", "[memory]") {
  ddp::host_domain& host = ddp::host_memory();
  auto f = iota_of<float>(777, -3.0F);
  std::vector<ddp::bfloat16> h(f.size());
  std::vector<float> back(f.size());
  host.convert(ddp::raw_tensor::of(std::span<float>(f)), ddp::raw_tensor::of(std::span<ddp::bfloat16>(h)));
  for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(h[i] == ddp::bfloat16(f[i]));
  // What the compression hooks send: each gradient times 1/3 in float, then rounded to bf16.
  host.convert(ddp::raw_tensor::of(std::span<float>(f)), ddp::raw_tensor::of(std::span<ddp::bfloat16>(h)), 1.0 / 3);
  const float third = static_cast<float>(1.0 / 3);
  for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(h[i] == ddp::bfloat16(f[i] * third));
  host.convert(ddp::raw_tensor::of(std::span<ddp::bfloat16>(h)), ddp::raw_tensor::of(std::span<float>(back)));
  for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(back[i] == static_cast<float>(h[i]));
  std::vector<std::int32_t> ints(4);
  CHECK_THROWS_AS(host.convert(ddp::raw_tensor::of(std::span<std::int32_t>(ints)),
                               ddp::raw_tensor::of(std::span<float>(back.data(), 4)), 0.5),
                  ddp::error);
}

TEST_CASE("host domain: order_after waits for the work, synchronize has nothing left to wait for", "[memory]") {
  auto state = std::make_shared<ddp::detail::completion>(0, std::chrono::milliseconds(5000), "test", nullptr);
  ddp::work w(state);
  std::thread finisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    state->finish();
  });
  ddp::host_memory().order_after(w);
  CHECK(w.done());
  finisher.join();
  ddp::host_memory().synchronize();
}

namespace {

/// A raw_tensor over `v`.
template <class T>
ddp::raw_tensor raw_of(std::vector<T>& v) {
  return ddp::raw_tensor::of(std::span<T>(v));
}

}  // namespace

TEMPLATE_TEST_CASE("host domain: sgd gives the bits of torch.optim.SGD's formula under every option, in every lane",
                   "[memory]", float, double) {
  using T = TestType;
  const std::size_t n = 1000 + 3;  // vector lanes and a scalar tail
  for (const bool decay : {false, true})
    for (const double momentum : {0.0, 0.9})
      for (const bool first : {false, true})
        for (const bool nesterov : {false, true}) {
          if (nesterov && momentum == 0) continue;
          const ddp::sgd_update u{.lr = 0.05, .momentum = momentum, .dampening = nesterov ? 0.0 : 0.1,
                                  .weight_decay = decay ? 0.01 : 0.0, .nesterov = nesterov, .first = first};
          std::vector<T> p = iota_of<T>(n, -1.5F), g = iota_of<T>(n, 0.3F), buf = iota_of<T>(n, -0.2F);
          std::vector<T> want_p = p, want_buf = buf;
          const T lr = T(u.lr), wd = T(u.weight_decay), mu = T(u.momentum), keep = T(1 - u.dampening);
          for (std::size_t i = 0; i < n; ++i) {  // torch.optim.SGD, one element at a time
            T d = g[i];
            if (decay) d += wd * want_p[i];
            if (momentum != 0) {
              want_buf[i] = first ? d : mu * want_buf[i] + keep * d;
              d = nesterov ? d + mu * want_buf[i] : want_buf[i];
            }
            want_p[i] -= lr * d;
          }
          ddp::detail::host_sgd(raw_of(p), raw_of(g), momentum != 0 ? raw_of(buf) : ddp::raw_tensor{}, u);
          INFO("weight decay " << decay << ", momentum " << momentum << ", first " << first << ", nesterov " << nesterov);
          std::size_t same = 0;
          while (same < n && p[same] == want_p[same] && buf[same] == want_buf[same]) ++same;
          INFO("the first differing element, if any: " << same);
          REQUIRE(same == n);
        }
}

TEMPLATE_TEST_CASE("host domain: adamw gives the bits of torch.optim.AdamW's formula in every lane", "[memory]", float,
                   double) {
  using T = TestType;
  const std::size_t n = 1000 + 3;
  const ddp::adamw_update u{.decay = 0.9995, .beta1 = 0.9, .beta2 = 0.999, .step_size = 0.0019,
                            .correction2_sqrt = 0.0447, .eps = 1e-8};
  std::vector<T> p = iota_of<T>(n, -1.5F), g = iota_of<T>(n, 0.3F), m = iota_of<T>(n, -0.2F), v = iota_of<T>(n, 0.1F);
  std::vector<T> want_p = p, want_m = m, want_v = v;
  const T decay = T(u.decay), b1 = T(u.beta1), b2 = T(u.beta2), step = T(u.step_size), c2 = T(u.correction2_sqrt);
  for (std::size_t i = 0; i < n; ++i) {
    want_p[i] *= decay;
    want_m[i] += (T{1} - b1) * (g[i] - want_m[i]);
    want_v[i] = b2 * want_v[i] + (T{1} - b2) * g[i] * g[i];
    want_p[i] -= step * want_m[i] / (std::sqrt(want_v[i]) / c2 + T(u.eps));
  }
  ddp::detail::host_adamw(raw_of(p), raw_of(g), raw_of(m), raw_of(v), u);
  std::size_t same = 0;
  while (same < n && p[same] == want_p[same] && m[same] == want_m[same] && v[same] == want_v[same]) ++same;
  INFO("the first differing element, if any: " << same);
  REQUIRE(same == n);
}
