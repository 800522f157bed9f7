// ddp::cuda::domain against ddp::host_domain: every element operation in every dtype gives the host's bits, on
// 16-byte aligned memory (pack path) and memory offset by one element (element path), with a length that leaves a
// tail; allocation, release, copies both ways, refusals, and synchronize. Built by the C++ compiler alone: the
// kernels come from the PTX of <ddp/cuda/element.hpp>.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <ddp/memory/average.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/memory/cuda.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/memory/host.hpp>

namespace {

constexpr std::size_t length = 4099;
const ddp::dtype every_dtype[] = {ddp::dtype::f32, ddp::dtype::f64, ddp::dtype::bf16, ddp::dtype::f16,
                                  ddp::dtype::i32, ddp::dtype::i64, ddp::dtype::u8};
const ddp::dtype floating[] = {ddp::dtype::f32, ddp::dtype::f64, ddp::dtype::bf16, ddp::dtype::f16};

/// Host values of `type`: random over many binades, with signed zeros, infinities, NaN and tiny values first
/// (floating types); small random values for integers.
std::vector<std::byte> values(ddp::dtype type, std::uint32_t seed) {
  std::vector<std::byte> out(length * ddp::size_of(type));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> mantissa(-2.0, 2.0);
  std::uniform_int_distribution<int> exponent(-30, 30);
  const double special[] = {0.0, -0.0, std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                            std::numeric_limits<double>::quiet_NaN(), 1e-40, -3e-39, 1e-310, 65504.0, 3.0e38};
  ddp::visit_dtype(type, [&]<class T>(T) {
    T* p = reinterpret_cast<T*>(out.data());
    for (std::size_t i = 0; i < length; ++i) {
      if constexpr (std::is_integral_v<T>) {
        // small enough that scaling by 3 stays in range (out of range, the host's conversion is undefined)
        p[i] = static_cast<T>(gen() % 80);
      } else {
        const double v = i < std::size(special) ? special[i] : std::ldexp(mantissa(gen), exponent(gen));
        if constexpr (std::is_arithmetic_v<T>)
          p[i] = static_cast<T>(v);
        else
          p[i] = T(static_cast<float>(v));
      }
    }
  });
  return out;
}

/// Same bits element by element, any NaN matching any NaN (payloads differ between CPUs and GPUs).
void require_same(ddp::dtype type, const std::vector<std::byte>& got, const std::vector<std::byte>& want,
                  const std::string& what) {
  REQUIRE(got.size() == want.size());
  const std::size_t w = ddp::size_of(type);
  for (std::size_t i = 0; i < got.size() / w; ++i) {
    if (std::memcmp(got.data() + i * w, want.data() + i * w, w) == 0) continue;
    bool both_nan = false;
    ddp::visit_dtype(type, [&]<class T>(T) {
      if constexpr (!std::is_integral_v<T>) {
        T a, b;
        std::memcpy(&a, got.data() + i * w, w);
        std::memcpy(&b, want.data() + i * w, w);
        both_nan = std::isnan(static_cast<double>(a)) && std::isnan(static_cast<double>(b));
      }
    });
    if (both_nan) continue;
    INFO(what << ": element " << i << " of " << to_string(type) << " differs from the host's");
    FAIL_CHECK("bits differ");
    return;
  }
}

/// Device memory holding `host`, `offset` elements into its allocation.
struct on_device {
  ddp::domain_buffer storage;
  ddp::raw_tensor tensor;
  on_device(ddp::cuda::domain& d, ddp::dtype type, const std::vector<std::byte>& host, std::size_t offset)
      : storage(d.allocate(host.size() + offset * ddp::size_of(type))),
        tensor(storage.view(type, offset, host.size() / ddp::size_of(type))) {
    d.copy({const_cast<std::byte*>(host.data()), tensor.size, type, ddp::device::cpu()}, tensor);
  }
  std::vector<std::byte> host(ddp::cuda::domain& d) const {
    std::vector<std::byte> out(tensor.bytes());
    d.copy(tensor, {out.data(), tensor.size, tensor.type, ddp::device::cpu()});
    d.synchronize();
    return out;
  }
};

ddp::raw_tensor host_view(std::vector<std::byte>& v, ddp::dtype type) {
  return {v.data(), v.size() / ddp::size_of(type), type, ddp::device::cpu()};
}

}  // namespace

TEST_CASE("cuda domain: fill, accumulate, scale and divide give the host's bits in every dtype", "[gpu][domain]") {
  ddp::cuda::domain gpu(0);
  auto& cpu = ddp::host_memory();
  for (std::size_t offset : {0, 1}) {
    for (const ddp::dtype type : every_dtype) {
      INFO("offset " << offset << ", " << to_string(type));
      const auto a = values(type, 1), b = values(type, 2);
      {
        on_device x(gpu, type, a, offset);
        auto want = a;
        gpu.fill(x.tensor, 2.71828);
        cpu.fill(host_view(want, type), 2.71828);
        require_same(type, x.host(gpu), want, "fill");
      }
      {
        on_device x(gpu, type, a, offset), y(gpu, type, b, offset);
        auto want = b;
        gpu.accumulate(x.tensor, y.tensor);
        cpu.accumulate(host_view(const_cast<std::vector<std::byte>&>(a), type), host_view(want, type));
        require_same(type, y.host(gpu), want, "accumulate");
      }
      for (const double factor : {0.5, 0.37, 3.0, 1e-3}) {
        on_device x(gpu, type, a, offset);
        auto want = a;
        gpu.scale(x.tensor, factor);
        cpu.scale(host_view(want, type), factor);
        require_same(type, x.host(gpu), want, "scale by " + std::to_string(factor));
      }
      for (int count = 1; count <= 8; ++count) {
        on_device x(gpu, type, a, offset);
        auto want = a;
        ddp::cuda::divide(x.tensor, count, gpu.work_stream());
        ddp::detail::divide(host_view(want, type), count);
        require_same(type, x.host(gpu), want, "divide by " + std::to_string(count));
      }
    }
  }
}

TEST_CASE("cuda domain: the optimizers' sgd and adamw updates give the host's bits, and when_done runs after them",
          "[gpu][domain]") {
  ddp::cuda::domain gpu(0);
  auto& cpu = ddp::host_memory();
  // finite, moderate values: parameters, gradients, momenta and second moments (kept non-negative)
  auto moderate = [](ddp::dtype type, std::uint32_t seed, bool positive) {
    std::vector<std::byte> out(length * ddp::size_of(type));
    std::mt19937 gen(seed);
    std::uniform_real_distribution<double> u(positive ? 0.0 : -2.0, 2.0);
    ddp::visit_dtype(type, [&]<class T>(T) {
      if constexpr (std::is_floating_point_v<T>)
        for (std::size_t i = 0; i < length; ++i) reinterpret_cast<T*>(out.data())[i] = static_cast<T>(u(gen));
    });
    return out;
  };
  for (std::size_t offset : {0, 1}) {
    for (const ddp::dtype type : {ddp::dtype::f32, ddp::dtype::f64}) {
      INFO("offset " << offset << ", " << to_string(type));
      const auto p = moderate(type, 1, false), g = moderate(type, 2, false), m = moderate(type, 3, false),
                 v = moderate(type, 4, true);
      for (const bool first : {true, false})
        for (const bool nesterov : {false, true}) {
          const ddp::sgd_update u{.lr = 0.05, .momentum = 0.9, .dampening = nesterov ? 0.0 : 0.1,
                                  .weight_decay = 0.01, .nesterov = nesterov, .first = first};
          on_device x(gpu, type, p, offset), dx(gpu, type, g, offset), buf(gpu, type, m, offset);
          auto want = p, want_buf = m;
          gpu.sgd(x.tensor, dx.tensor, buf.tensor, u);
          cpu.sgd(host_view(want, type), host_view(const_cast<std::vector<std::byte>&>(g), type),
                  host_view(want_buf, type), u);
          require_same(type, x.host(gpu), want, "sgd values");
          require_same(type, buf.host(gpu), want_buf, "sgd momentum");
        }
      {
        const ddp::sgd_update plain{.lr = 0.1};
        on_device x(gpu, type, p, offset), dx(gpu, type, g, offset);
        auto want = p;
        gpu.sgd(x.tensor, dx.tensor, {}, plain);
        cpu.sgd(host_view(want, type), host_view(const_cast<std::vector<std::byte>&>(g), type), {}, plain);
        require_same(type, x.host(gpu), want, "sgd without momentum");
      }
      const ddp::adamw_update u{.decay = 1 - 1e-3 * 1e-2, .beta1 = 0.9, .beta2 = 0.999, .step_size = 1e-3 / (1 - 0.9 * 0.9),
                                .correction2_sqrt = std::sqrt(1 - 0.999 * 0.999), .eps = 1e-8};
      on_device x(gpu, type, p, offset), dx(gpu, type, g, offset), mm(gpu, type, m, offset), vv(gpu, type, v, offset);
      auto want = p, want_m = m, want_v = v;
      gpu.adamw(x.tensor, dx.tensor, mm.tensor, vv.tensor, u);
      std::atomic<bool> ran{false};
      gpu.when_done([&ran] { ran = true; });
      cpu.adamw(host_view(want, type), host_view(const_cast<std::vector<std::byte>&>(g), type), host_view(want_m, type),
                host_view(want_v, type), u);
      require_same(type, x.host(gpu), want, "adamw values");
      REQUIRE(ran);
      require_same(type, mm.host(gpu), want_m, "adamw exp_avg");
      require_same(type, vv.host(gpu), want_v, "adamw exp_avg_sq");
    }
  }
}

TEST_CASE("cuda domain: convert gives the host's bits between every pair of floating dtypes", "[gpu][domain]") {
  ddp::cuda::domain gpu(0);
  auto& cpu = ddp::host_memory();
  for (std::size_t offset : {0, 1}) {
    for (const ddp::dtype from : floating) {
      for (const ddp::dtype to : floating) {
        for (const double factor : {1.0, 0.37, 0.25}) {
          if (factor != 1.0 && from != ddp::dtype::f32 && from != ddp::dtype::f64) continue;
          INFO("offset " << offset << ", " << to_string(from) << " -> " << to_string(to) << " x " << factor);
          auto a = values(from, 3);
          on_device x(gpu, from, a, offset);
          std::vector<std::byte> zeros(length * ddp::size_of(to));
          on_device y(gpu, to, zeros, offset);
          gpu.convert(x.tensor, y.tensor, factor);
          auto want = zeros;
          cpu.convert(host_view(a, from), host_view(want, to), factor);
          require_same(to, y.host(gpu), want, "convert");
        }
      }
    }
  }
}

TEST_CASE("cuda domain: memory comes zeroed, release zeroes, and copies go both ways", "[gpu][domain]") {
  ddp::cuda::domain gpu(0);
  auto buffer = gpu.allocate(1 << 20);
  REQUIRE(buffer.domain() == &gpu);
  const ddp::raw_tensor all = buffer.view(ddp::dtype::u8, 0, 1 << 20);
  std::vector<std::byte> host(1 << 20, std::byte{7});
  gpu.copy(all, {host.data(), host.size(), ddp::dtype::u8, ddp::device::cpu()});
  gpu.synchronize();
  for (std::size_t i = 0; i < host.size(); i += 997) REQUIRE(host[i] == std::byte{0});
  gpu.fill(all, 5);
  buffer.release(100, 9000);
  gpu.copy(all, {host.data(), host.size(), ddp::dtype::u8, ddp::device::cpu()});
  gpu.synchronize();
  CHECK(host[99] == std::byte{5});
  CHECK(host[100] == std::byte{0});
  CHECK(host[8999] == std::byte{0});
  CHECK(host[9000] == std::byte{5});
}

TEST_CASE("cuda domain: memory elsewhere and conversions it cannot do are refused with the fix", "[gpu][domain]") {
  ddp::cuda::domain gpu(0);
  std::vector<float> host(8);
  const ddp::raw_tensor on_cpu = ddp::raw_tensor::of(std::span<float>(host));
  try {
    gpu.scale(on_cpu, 2.0);
    FAIL("scaled host memory");
  } catch (const ddp::error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("ddp::domain_of"));
  }
  auto ints = gpu.allocate(64);
  REQUIRE_THROWS_AS(gpu.convert(ints.view(ddp::dtype::i32, 0, 8), ints.view(ddp::dtype::f32, 8, 8)), ddp::error);
  REQUIRE_THROWS_AS(ddp::cuda::divide(ints.view(ddp::dtype::f32, 0, 8), 0, gpu.work_stream()), ddp::error);
}

TEST_CASE("cuda domain: registered, it is the domain of its device", "[gpu][domain]") {
  ddp::cuda::domain gpu(0);
  REQUIRE(ddp::domain_of(ddp::device::cuda(0)) == nullptr);
  {
    ddp::device_registration registered(gpu);
    CHECK(ddp::domain_of(ddp::device::cuda(0)) == &gpu);
  }
  CHECK(ddp::domain_of(ddp::device::cuda(0)) == nullptr);
}
