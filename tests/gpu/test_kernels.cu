// The CUDA kernels of <ddp/cuda/kernels.cuh> against the CPU: ddp::bfloat16/float16 rounding, exact scaling, and
// ddp::optim's SGD and AdamW steps.
// Every case runs twice: on 16-byte aligned spans (vector path) and on spans offset by one element (scalar path),
// with a length that leaves a tail after the last full pack.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include <ddp/memory/average.hpp>
#include <ddp/cuda/buffer.hpp>
#include <ddp/cuda/kernels.cuh>
#include <ddp/cuda/runtime.hpp>
#include <ddp/optim/adamw.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/optim/sgd.hpp>

namespace {

constexpr std::size_t length = 4099;  // 1024 full packs of 4 floats, then a tail of 3

template <class T>
std::vector<T> random_values(std::size_t n, std::uint32_t seed, double lo = -2.0, double hi = 2.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = T(static_cast<float>(dist(gen)));
  return v;
}

/// A device copy of `host` placed `offset` elements into its allocation, so offset 1 breaks 16-byte alignment.
template <class T>
struct placed {
  ddp::cuda::device_buffer<T> storage;
  std::span<T> span;
  placed(const std::vector<T>& host, std::size_t offset) : storage(host.size() + offset) {
    span = storage.span().subspan(offset, host.size());
    ddp::cuda::check(cudaMemcpy(span.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> host() const {
    std::vector<T> out(span.size());
    ddp::cuda::check(cudaMemcpy(out.data(), span.data(), out.size() * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return out;
  }
};

/// Scale and average of one dtype: the bits of ddp::detail::scale and ddp::detail::divide on the host, for
/// factors exact and inexact in the type and for group sizes that are and are not powers of two.
template <class T>
void check_scale_and_average(std::size_t offset) {
  const ddp::cuda::stream s;
  const auto input = random_values<T>(length, 7);
  for (const double factor : {0.37, 0.5, 3.0}) {
    placed<T> scaled(input, offset);
    ddp::cuda::scale(scaled.span, factor, s.get());
    s.synchronize();
    auto want = input;
    ddp::detail::scale(ddp::raw_tensor::of(std::span<T>(want)), factor);
    const auto got = scaled.host();
    INFO("factor " << factor);
    for (std::size_t i = 0; i < length; ++i) REQUIRE(std::memcmp(&got[i], &want[i], sizeof(T)) == 0);
  }
  for (const int count : {2, 3, 4, 5, 7, 8}) {
    placed<T> averaged(input, offset);
    ddp::cuda::average(averaged.span, count, s.get());
    s.synchronize();
    auto want = input;
    ddp::detail::divide(ddp::raw_tensor::of(std::span<T>(want)), count);
    const auto got = averaged.host();
    INFO("count " << count);
    for (std::size_t i = 0; i < length; ++i) REQUIRE(std::memcmp(&got[i], &want[i], sizeof(T)) == 0);
  }
}

/// Inputs that exercise rounding: random values over many binades plus signed zeros, infinities, overflow and
/// subnormal results.
std::vector<float> cast_inputs() {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> mantissa(1.0F, 2.0F);
  std::uniform_int_distribution<int> exponent(-30, 20);
  std::vector<float> v(length);
  for (auto& x : v) x = std::ldexp(mantissa(gen), exponent(gen)) * (gen() % 2 != 0U ? -1.0F : 1.0F);
  const float specials[] = {0.0F, -0.0F, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            70000.0F, -65520.0F, 65519.0F, 1e-7F, 3e-8F, 1.00390625F, 1.01171875F, 3.4e38F};
  std::copy(std::begin(specials), std::end(specials), v.begin());
  return v;
}

/// f32 -> narrow -> f32 round trip: the device's rounding equals ddp::bfloat16/float16's bit for bit.
template <class Narrow, class To, class From>
void check_cast(To to_narrow, From from_narrow, std::size_t offset) {
  const ddp::cuda::stream s;
  const auto input = cast_inputs();
  placed<float> in(input, offset), back(std::vector<float>(length), offset);
  placed<Narrow> narrow(std::vector<Narrow>(length), offset);
  to_narrow(std::span<const float>(in.span), narrow.span, s.get());
  from_narrow(std::span<const Narrow>(narrow.span), back.span, s.get());
  s.synchronize();
  const auto got = narrow.host();
  const auto widened = back.host();
  for (std::size_t i = 0; i < length; ++i) {
    REQUIRE(got[i].bits == Narrow(input[i]).bits);
    REQUIRE(widened[i] == static_cast<float>(Narrow(input[i])));
  }
}

/// Closeness for optimizer results: the device contracts a·b + c into one FMA, the CPU rounds twice.
template <class T>
void require_close(const std::vector<T>& got, const std::vector<T>& want, double tolerance) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": device " << got[i] << ", CPU " << want[i]);
    const double w = static_cast<double>(want[i]);
    REQUIRE(std::abs(static_cast<double>(got[i]) - w) <= tolerance * std::max(1.0, std::abs(w)));
  }
}

/// Three steps of the device kernel `device_step(param, grad, step)` against the CPU optimizer `cpu` on the same
/// parameters and gradients (ddp::optim's flat-buffer step, torch.optim's formulas).
template <class T, class Optimizer, class DeviceStep>
void check_optimizer(Optimizer cpu, DeviceStep device_step, std::size_t offset, double tolerance) {
  const ddp::cuda::stream s;
  std::vector<T> cpu_param = random_values<T>(length, 1), cpu_grad(length);
  placed<T> param(cpu_param, offset);
  const ddp::optim::flat_buffer flat{ddp::raw_tensor::of(std::span<T>(cpu_param)),
                                     ddp::as_raw(std::span<const T>(cpu_grad)), {{"w", 0, length, 0}}};
  cpu.attach(std::span<const ddp::optim::flat_buffer>(&flat, 1));
  for (std::int64_t step = 1; step <= 3; ++step) {
    const auto fresh = random_values<T>(length, 100 + static_cast<std::uint32_t>(step));
    std::copy(fresh.begin(), fresh.end(), cpu_grad.begin());  // in place: `flat` points at cpu_grad's storage
    placed<T> grad(cpu_grad, offset);
    device_step(param.span, std::span<const T>(grad.span), step, s.get());
    cpu.step(std::span<const ddp::optim::flat_buffer>(&flat, 1));
    s.synchronize();
  }
  require_close(param.host(), cpu_param, tolerance);
}

template <class T>
void check_sgd(const ddp::optim::sgd::options& o, std::size_t offset, double tolerance) {
  placed<T> buf(std::vector<T>(length), offset);
  check_optimizer<T>(
      ddp::optim::sgd(o),
      [&](std::span<T> p, std::span<const T> g, std::int64_t step, cudaStream_t st) {
        ddp::cuda::sgd_step(p, g, buf.span, ddp::optim::sgd::update(o, step == 1), st);
      },
      offset, tolerance);
}

template <class T>
void check_adamw(const ddp::optim::adamw::options& o, std::size_t offset, double tolerance) {
  const std::vector<T> zeros(length);
  placed<T> m(zeros, offset), v(zeros, offset);
  check_optimizer<T>(
      ddp::optim::adamw(o),
      [&](std::span<T> p, std::span<const T> g, std::int64_t step, cudaStream_t st) {
        ddp::cuda::adamw_step(p, g, m.span, v.span, ddp::optim::adamw::update(o, static_cast<std::uint64_t>(step)), st);
      },
      offset, tolerance);
}

}  // namespace

TEST_CASE("gpu kernels: scale and average match the CPU in every floating dtype", "[gpu][kernels]") {
  for (std::size_t offset : {0, 1}) {
    INFO("offset " << offset);
    check_scale_and_average<float>(offset);
    check_scale_and_average<double>(offset);
    check_scale_and_average<ddp::bfloat16>(offset);
    check_scale_and_average<ddp::float16>(offset);
  }
}

TEST_CASE("gpu kernels: bf16 and f16 casts round like ddp::bfloat16 and ddp::float16", "[gpu][kernels]") {
  for (std::size_t offset : {0, 1}) {
    INFO("offset " << offset);
    check_cast<ddp::bfloat16>(
        [](auto in, auto out, cudaStream_t s) { ddp::cuda::cast_to_bf16(in, out, s); },
        [](auto in, auto out, cudaStream_t s) { ddp::cuda::cast_from_bf16(in, out, s); }, offset);
    check_cast<ddp::float16>(
        [](auto in, auto out, cudaStream_t s) { ddp::cuda::cast_to_f16(in, out, s); },
        [](auto in, auto out, cudaStream_t s) { ddp::cuda::cast_from_f16(in, out, s); }, offset);
  }
}

TEST_CASE("gpu kernels: a NaN stays a NaN through the casts", "[gpu][kernels]") {
  const ddp::cuda::stream s;
  const std::vector<float> nan(5, std::numeric_limits<float>::quiet_NaN());
  ddp::cuda::device_buffer<float> in{std::span<const float>(nan)}, back{nan.size()};
  ddp::cuda::device_buffer<ddp::bfloat16> b(nan.size());
  ddp::cuda::device_buffer<ddp::float16> h(nan.size());
  ddp::cuda::cast_to_bf16(std::span<const float>(in.span()), b.span(), s.get());
  ddp::cuda::cast_to_f16(std::span<const float>(in.span()), h.span(), s.get());
  s.synchronize();
  for (auto x : b.to_host()) REQUIRE(std::isnan(static_cast<float>(x)));
  for (auto x : h.to_host()) REQUIRE(std::isnan(static_cast<float>(x)));
  ddp::cuda::cast_from_bf16(std::span<const ddp::bfloat16>(b.span()), back.span(), s.get());
  s.synchronize();
  for (auto x : back.to_host()) REQUIRE(std::isnan(x));
}

TEST_CASE("gpu kernels: SGD steps like ddp::optim::sgd on the CPU", "[gpu][kernels][optim]") {
  for (std::size_t offset : {0, 1}) {
    INFO("offset " << offset);
    check_sgd<float>({.lr = 0.1}, offset, 1e-6);
    check_sgd<float>({.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-2}, offset, 1e-5);
    check_sgd<float>({.lr = 0.05, .momentum = 0.9, .nesterov = true}, offset, 1e-5);
    check_sgd<double>({.lr = 0.05, .momentum = 0.9, .nesterov = true, .weight_decay = 1e-3}, offset, 1e-12);
  }
}

TEST_CASE("gpu kernels: AdamW steps like ddp::optim::adamw on the CPU", "[gpu][kernels][optim]") {
  for (std::size_t offset : {0, 1}) {
    INFO("offset " << offset);
    check_adamw<float>({}, offset, 1e-5);
    check_adamw<float>({.lr = 1e-2, .weight_decay = 0.1}, offset, 1e-5);
    check_adamw<double>({.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.99}, offset, 1e-12);
  }
}

TEST_CASE("gpu kernels: mismatched spans and bad arguments are errors", "[gpu][kernels]") {
  const ddp::cuda::stream s;
  ddp::cuda::device_buffer<float> a(8), b(7);
  ddp::cuda::device_buffer<ddp::bfloat16> c(8);
  REQUIRE_THROWS_AS(ddp::cuda::cast_to_bf16(std::span<const float>(b.span()), c.span(), s.get()), ddp::error);
  REQUIRE_THROWS_AS(ddp::cuda::sgd_step(a.span(), std::span<const float>(b.span()), a.span(), {.first = true}, s.get()),
                    ddp::error);
  REQUIRE_THROWS_AS(ddp::cuda::sgd_step(a.span(), std::span<const float>(a.span()), a.span(),
                                        {.nesterov = true, .first = true}, s.get()),
                    ddp::error);
  REQUIRE_THROWS_AS(ddp::optim::adamw::update({}, 0), ddp::config_error);
  REQUIRE_THROWS_AS(ddp::cuda::average(a.span(), 0, s.get()), ddp::error);
}
