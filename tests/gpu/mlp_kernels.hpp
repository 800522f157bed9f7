#pragma once
// The test MLP's layers (tests/parallel/mlp.hpp) as CUDA kernels, each on a stream: the forward and backward a GPU
// framework would queue. Every sum runs in the host code's order with products and sums rounded separately (no
// fused multiply-add), so only tanh's last bit can differ from the host's.

#include <cuda_runtime_api.h>

#include <cstddef>

namespace ddp_test::gpu {

/// out[s, o] = w[o, :]·in[s, :] + b[o] for n samples of `width` inputs and `outs` outputs, then tanh when `activate`.
void layer_forward(const float* w, const float* b, const float* in, float* out, std::size_t n, std::size_t width,
                   std::size_t outs, bool activate, cudaStream_t stream);

/// Adds δᵀ·in into dw and Σ_s δ into db (each once per element), and writes back = δ·w.
void layer_backward(const float* w, const float* in, const float* delta, float* dw, float* db, float* back,
                    std::size_t n, std::size_t width, std::size_t outs, cudaStream_t stream);

/// delta = scale · (out − y) over `count` elements.
void loss_delta(const float* out, const float* y, float* delta, float scale, std::size_t count, cudaStream_t stream);

/// back *= 1 − a² over `count` elements (tanh's derivative at the activation a).
void tanh_grad(float* back, const float* a, std::size_t count, cudaStream_t stream);

}  // namespace ddp_test::gpu
