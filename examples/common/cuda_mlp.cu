// The small kernels of common/cuda_mlp.hpp's MLP (the GEMMs are cuBLAS's): grid-stride loops on the given stream.
#include "cuda_mlp_kernels.hpp"

#include <ddp/cuda/error.hpp>

#include <cmath>

namespace example::gpu {
namespace {

constexpr int threads = 256;

unsigned blocks(std::size_t count) {
  const std::size_t b = (count + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

__global__ void add_bias_rows_kernel(float* y, const float* bias, std::size_t rows, std::size_t cols) {
  for (std::size_t k = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; k < rows * cols;
       k += std::size_t{gridDim.x} * blockDim.x)
    y[k] += bias[k % cols];
}

__global__ void relu_kernel(float* y, std::size_t count) {
  for (std::size_t k = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; k < count;
       k += std::size_t{gridDim.x} * blockDim.x)
    y[k] = fmaxf(y[k], 0.0F);
}

__global__ void relu_backward_kernel(float* grad, const float* activation, std::size_t count) {
  for (std::size_t k = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; k < count;
       k += std::size_t{gridDim.x} * blockDim.x)
    if (activation[k] <= 0.0F) grad[k] = 0.0F;
}

// One thread per sample (a batch has tens to thousands; classes are few).
__global__ void softmax_cross_entropy_kernel(const float* logits, const std::uint8_t* labels, float* dlogits,
                                             double* sums, int rows, int classes) {
  const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (r >= rows) return;
  const float* z = logits + static_cast<std::size_t>(r) * classes;
  float* d = dlogits + static_cast<std::size_t>(r) * classes;
  int best = 0;
  for (int j = 1; j < classes; ++j)
    if (z[j] > z[best]) best = j;
  double sum = 0;
  for (int j = 0; j < classes; ++j) sum += exp(static_cast<double>(z[j] - z[best]));
  const double log_sum = log(sum) + z[best];
  const int label = labels[r];
  atomicAdd(&sums[0], log_sum - z[label]);
  if (best == label) atomicAdd(&sums[1], 1.0);
  for (int j = 0; j < classes; ++j)
    d[j] = static_cast<float>((exp(static_cast<double>(z[j]) - log_sum) - (j == label ? 1.0 : 0.0)) / rows);
}

}  // namespace

void add_bias_rows(float* y, const float* bias, int rows, int cols, cudaStream_t stream) {
  const auto n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  add_bias_rows_kernel<<<blocks(n), threads, 0, stream>>>(y, bias, static_cast<std::size_t>(rows),
                                                          static_cast<std::size_t>(cols));
  ddp::cuda::check(cudaGetLastError(), "the bias kernel");
}

void relu(float* y, std::size_t count, cudaStream_t stream) {
  relu_kernel<<<blocks(count), threads, 0, stream>>>(y, count);
  ddp::cuda::check(cudaGetLastError(), "the ReLU kernel");
}

void relu_backward(float* grad, const float* activation, std::size_t count, cudaStream_t stream) {
  relu_backward_kernel<<<blocks(count), threads, 0, stream>>>(grad, activation, count);
  ddp::cuda::check(cudaGetLastError(), "the ReLU backward kernel");
}

void softmax_cross_entropy(const float* logits, const std::uint8_t* labels, float* dlogits, double* sums, int rows,
                           int classes, cudaStream_t stream) {
  softmax_cross_entropy_kernel<<<blocks(static_cast<std::size_t>(rows)), threads, 0, stream>>>(logits, labels, dlogits,
                                                                                               sums, rows, classes);
  ddp::cuda::check(cudaGetLastError(), "the softmax cross-entropy kernel");
}

}  // namespace example::gpu
