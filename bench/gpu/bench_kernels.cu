// Bandwidth of the ddp::cuda kernels against cudaMemcpyAsync device-to-device on the same bytes.
// Usage: ddp_bench_gpu_kernels [MiB of f32 per array, default 256] [repetitions, default 20]
// Prints a Markdown table: effective bandwidth (bytes read + written per call / time) and its share of the copy's.
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <ddp/cuda/buffer.hpp>
#include <ddp/cuda/element.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/kernels.cuh>
#include <ddp/cuda/runtime.hpp>
#include <ddp/optim/adamw.hpp>

namespace {

/// Median milliseconds of `reps` timed runs of `f` on `s`, after two warm-up runs.
float median_ms(const ddp::cuda::stream& s, int reps, const std::function<void()>& f) {
  f();
  f();
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    ddp::cuda::event start(cudaEventDefault), stop(cudaEventDefault);
    start.record(s.get());
    f();
    stop.record(s.get());
    stop.synchronize();
    times.push_back(ddp::cuda::event::elapsed_ms(start, stop));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  const std::size_t n = mib * 1024 * 1024 / sizeof(float);
  const ddp::cuda::stream s;
  ddp::cuda::device_buffer<float> a(n), b(n), c(n), d(n);
  ddp::cuda::device_buffer<ddp::bfloat16> h(n);
  ddp::cuda::device_buffer<ddp::float16> f16(n);
  // ordinary values (not zeros, which some kernels treat apart)
  for (auto* buf : {&a, &b, &c, &d}) ddp::cuda::fill(buf->raw(), 1.2345, s.get());
  ddp::cuda::fill(h.raw(), 1.2345, s.get());

  cudaDeviceProp prop{};
  ddp::cuda::check(cudaGetDeviceProperties(&prop, ddp::cuda::current_device()), "cudaGetDeviceProperties");
  std::printf("device: %s, %zu f32 elements per array (%zu MiB), median of %d runs\n\n", prop.name, n, mib, reps);

  const float copy_ms = median_ms(s, reps, [&] {
    ddp::cuda::check(cudaMemcpyAsync(b.data(), a.data(), n * sizeof(float), cudaMemcpyDeviceToDevice, s.get()), "copy");
  });
  const double copy_gbs = 2.0 * static_cast<double>(n * sizeof(float)) / (copy_ms * 1e6);

  struct row {
    std::string name;
    double bytes_per_element;  // read + written
    std::function<void()> run;
  };
  const std::span<const float> ca(a.span());
  const std::vector<row> rows{
      {"scale f32 (x *= c)", 8, [&] { ddp::cuda::scale(a.span(), 0.5, s.get()); }},
      {"average bf16 (x /= 4)", 4, [&] { ddp::cuda::average(h.span(), 4, s.get()); }},
      {"average bf16 (x /= 3)", 4, [&] { ddp::cuda::average(h.span(), 3, s.get()); }},
      {"average f32 (x /= 3)", 8, [&] { ddp::cuda::average(a.span(), 3, s.get()); }},
      {"element.hpp (PTX): divide f32 by 3", 8, [&] { ddp::cuda::divide(a.raw(), 3, s.get()); }},
      {"element.hpp (PTX): accumulate f32", 12, [&] { ddp::cuda::accumulate(a.raw(), b.raw(), s.get()); }},
      {"element.hpp (PTX): convert f32 -> bf16 x 0.5", 6, [&] { ddp::cuda::convert(a.raw(), h.raw(), 0.5, s.get()); }},
      {"element.hpp (PTX): fill f32", 4, [&] { ddp::cuda::fill(a.raw(), 1.0, s.get()); }},
      {"cast f32 -> bf16", 6, [&] { ddp::cuda::cast_to_bf16(ca, h.span(), s.get()); }},
      {"cast bf16 -> f32", 6, [&] { ddp::cuda::cast_from_bf16(std::span<const ddp::bfloat16>(h.span()), b.span(), s.get()); }},
      {"cast f32 -> f16", 6, [&] { ddp::cuda::cast_to_f16(ca, f16.span(), s.get()); }},
      {"sgd_step, momentum", 20,
       [&] { ddp::cuda::sgd_step(b.span(), ca, c.span(), {.lr = 0.1, .momentum = 0.9}, s.get()); }},
      {"adamw_step", 28,
       [&] { ddp::cuda::adamw_step(b.span(), ca, c.span(), d.span(), ddp::optim::adamw::update({}, 10), s.get()); }},
  };
  std::printf("| operation | bytes/element | time (ms) | GB/s | %% of D2D copy |\n|---|---:|---:|---:|---:|\n");
  std::printf("| cudaMemcpyAsync D2D | 8 | %.3f | %.0f | 100 |\n", copy_ms, copy_gbs);
  for (const auto& r : rows) {
    const float ms = median_ms(s, reps, r.run);
    const double gbs = r.bytes_per_element * static_cast<double>(n) / (ms * 1e6);
    std::printf("| %s | %.0f | %.3f | %.0f | %.0f |\n", r.name.c_str(), r.bytes_per_element, ms, gbs,
                100.0 * gbs / copy_gbs);
  }
  return 0;
}
