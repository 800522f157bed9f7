#pragma once
/// \file The small kernels of common/cuda_mlp.hpp's MLP (common/cuda_mlp.cu; the GEMMs are cuBLAS's), each queued on
/// `stream`.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace example::gpu {

/// y[r, c] += bias[c] over `rows` rows of `cols`.
void add_bias_rows(float* y, const float* bias, int rows, int cols, cudaStream_t stream);
/// y = max(y, 0).
void relu(float* y, std::size_t count, cudaStream_t stream);
/// grad = 0 where activation ≤ 0.
void relu_backward(float* grad, const float* activation, std::size_t count, cudaStream_t stream);
/// Per sample of `rows` logits rows of `classes`: adds the cross-entropy to sums[0] and a correct arg-max to sums[1],
/// and writes d(mean loss)/d logit = (softmax − one-hot) / rows.
void softmax_cross_entropy(const float* logits, const std::uint8_t* labels, float* dlogits, double* sums, int rows,
                           int classes, cudaStream_t stream);

}  // namespace example::gpu
