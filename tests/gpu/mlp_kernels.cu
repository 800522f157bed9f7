// The test MLP's layers as CUDA kernels (see mlp_kernels.hpp). One thread per output element; the sums are short.
#include "mlp_kernels.hpp"

#include <ddp/cuda/error.hpp>

namespace ddp_test::gpu {
namespace {

constexpr int threads = 128;

unsigned blocks(std::size_t count) { return static_cast<unsigned>((count + threads - 1) / threads); }

__global__ void forward_kernel(const float* w, const float* b, const float* in, float* out, std::size_t n,
                               std::size_t width, std::size_t outs, bool activate) {
  const std::size_t k = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (k >= n * outs) return;
  const std::size_t s = k / outs, o = k % outs;
  float acc = b[o];
  for (std::size_t i = 0; i < width; ++i) acc = __fadd_rn(acc, __fmul_rn(w[o * width + i], in[s * width + i]));
  out[k] = activate ? tanhf(acc) : acc;
}

// dw[o, i] += Σ_s δ[s, o]·in[s, i] for k < outs·width; db[o] += Σ_s δ[s, o] for the next `outs` threads.
__global__ void weight_grad_kernel(const float* in, const float* delta, float* dw, float* db, std::size_t n,
                                   std::size_t width, std::size_t outs) {
  const std::size_t k = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (k < outs * width) {
    const std::size_t o = k / width, i = k % width;
    float acc = 0.0F;
    for (std::size_t s = 0; s < n; ++s) acc = __fadd_rn(acc, __fmul_rn(delta[s * outs + o], in[s * width + i]));
    dw[k] = __fadd_rn(dw[k], acc);
  } else if (k < outs * width + outs) {
    const std::size_t o = k - outs * width;
    float acc = 0.0F;
    for (std::size_t s = 0; s < n; ++s) acc = __fadd_rn(acc, delta[s * outs + o]);
    db[o] = __fadd_rn(db[o], acc);
  }
}

// back[s, i] = Σ_o δ[s, o]·w[o, i].
__global__ void input_grad_kernel(const float* w, const float* delta, float* back, std::size_t n, std::size_t width,
                                  std::size_t outs) {
  const std::size_t k = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (k >= n * width) return;
  const std::size_t s = k / width, i = k % width;
  float acc = 0.0F;
  for (std::size_t o = 0; o < outs; ++o) acc = __fadd_rn(acc, __fmul_rn(delta[s * outs + o], w[o * width + i]));
  back[k] = acc;
}

__global__ void loss_delta_kernel(const float* out, const float* y, float* delta, float scale, std::size_t count) {
  const std::size_t k = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (k < count) delta[k] = __fmul_rn(scale, __fsub_rn(out[k], y[k]));
}

__global__ void tanh_grad_kernel(float* back, const float* a, std::size_t count) {
  const std::size_t k = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (k < count) back[k] = __fmul_rn(back[k], __fsub_rn(1.0F, __fmul_rn(a[k], a[k])));
}

}  // namespace

void layer_forward(const float* w, const float* b, const float* in, float* out, std::size_t n, std::size_t width,
                   std::size_t outs, bool activate, cudaStream_t stream) {
  forward_kernel<<<blocks(n * outs), threads, 0, stream>>>(w, b, in, out, n, width, outs, activate);
  ddp::cuda::check(cudaGetLastError(), "the test MLP's forward kernel");
}

void layer_backward(const float* w, const float* in, const float* delta, float* dw, float* db, float* back,
                    std::size_t n, std::size_t width, std::size_t outs, cudaStream_t stream) {
  weight_grad_kernel<<<blocks(outs * width + outs), threads, 0, stream>>>(in, delta, dw, db, n, width, outs);
  ddp::cuda::check(cudaGetLastError(), "the test MLP's weight gradient kernel");
  input_grad_kernel<<<blocks(n * width), threads, 0, stream>>>(w, delta, back, n, width, outs);
  ddp::cuda::check(cudaGetLastError(), "the test MLP's input gradient kernel");
}

void loss_delta(const float* out, const float* y, float* delta, float scale, std::size_t count, cudaStream_t stream) {
  loss_delta_kernel<<<blocks(count), threads, 0, stream>>>(out, y, delta, scale, count);
  ddp::cuda::check(cudaGetLastError(), "the test MLP's loss kernel");
}

void tanh_grad(float* back, const float* a, std::size_t count, cudaStream_t stream) {
  tanh_grad_kernel<<<blocks(count), threads, 0, stream>>>(back, a, count);
  ddp::cuda::check(cudaGetLastError(), "the test MLP's tanh gradient kernel");
}

}  // namespace ddp_test::gpu
