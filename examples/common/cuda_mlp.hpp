#pragma once
/// \file The examples' MLP (common/mlp.hpp: fc1 → ReLU → fc2 → ReLU → fc3, softmax cross-entropy) on a CUDA device,
/// or any depth of such layers (bench/gpu): parameters and gradients in device memory, forward and backward as cuBLAS
/// GEMMs and small kernels (common/cuda_mlp.cu) queued on one stream, each layer's gradients reported as soon as
/// their kernels are queued, which is where data_parallel's gradient_ready goes. Nothing waits for the device but
/// reading the batch's loss (last_result).

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/cuda/buffer.hpp>
#include <ddp/cuda/element.hpp>
#include <ddp/cuda/error.hpp>

#include "batch_result.hpp"
#include "cuda_mlp_kernels.hpp"
#include "mlp.hpp"

namespace example::gpu {

/// A parameter in device memory: its values and gradient on cuda:`device`.
struct device_param {
  float* values = nullptr;
  float* grads = nullptr;
  std::vector<std::size_t> shape;
  int device = 0;
  [[nodiscard]] std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (const auto d : shape) n *= d;
    return n;
  }
};

/// y = x·weightᵀ + bias on the device; weight is [out, in].
struct device_linear {
  device_param weight, bias;
  [[nodiscard]] int in() const noexcept { return static_cast<int>(weight.shape[1]); }
  [[nodiscard]] int out() const noexcept { return static_cast<int>(weight.shape[0]); }
};

/// common/mlp.hpp's model on a device.
struct device_mlp {
  device_linear fc1, fc2, fc3;
};

/// The layers of `m` in order, as the trainer takes them.
inline std::vector<device_linear*> layers_of(device_mlp& m) { return {&m.fc1, &m.fc2, &m.fc3}; }
/// The layers of a model that is a vector of them.
inline std::vector<device_linear*> layers_of(std::vector<device_linear>& m) {
  std::vector<device_linear*> out;
  for (auto& l : m) out.push_back(&l);
  return out;
}

/// Scope of a layer's use when nothing needs unsharding (replicate, shard_grad_op).
struct whole_layers {
  int operator()(const device_linear&) const { return 0; }
};

/// A host layer's values (and zero gradients) copied into device memory on the current device; `memory` owns it.
inline device_linear place(const linear& host, std::vector<ddp::cuda::device_buffer<float>>& memory) {
  const int device = ddp::cuda::current_device();
  const auto put = [&](const ddp::parameter<float>& p) {
    device_param d;
    memory.emplace_back(std::span<const float>(p.value().data(), p.numel()), device);
    d.values = memory.back().data();
    memory.emplace_back(p.numel(), device);
    d.grads = memory.back().data();
    ddp::cuda::check(cudaMemset(d.grads, 0, p.numel() * sizeof(float)), "cudaMemset of a gradient");
    d.shape = p.shape();
    d.device = device;
    return d;
  };
  return {put(host.weight), put(host.bias)};
}
/// `host` copied into device memory on the current device; `memory` owns it.
inline device_mlp place(const mlp& host, std::vector<ddp::cuda::device_buffer<float>>& memory) {
  return {place(host.fc1, memory), place(host.fc2, memory), place(host.fc3, memory)};
}

/// Forward and backward of a device_mlp on one stream, with reused device buffers.
class trainer {
 public:
  /// Works on `stream` (the model's stream: give the same one to the domain and to NCCL).
  explicit trainer(cudaStream_t stream) : stream_(stream) {
    check(cublasCreate(&blas_), "cublasCreate");
    check(cublasSetStream(blas_, stream), "cublasSetStream");
    ddp::cuda::check(cudaMallocHost(&sums_host_, 2 * sizeof(double)), "cudaMallocHost");
  }
  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;
  ~trainer() {
    cublasDestroy(blas_);
    cudaFreeHost(sums_host_);
  }

  /// Forward of the model `m` (a device_mlp, or a vector of layers: ReLU after each but the last) on
  /// `labels.size()` rows of `x` ([rows, in], host memory); keeps what backward() needs. Each layer is used inside
  /// `auto g = scope(layer)` (dp.unshard under full_shard). The loss sum and the correct count are read by
  /// last_result().
  template <class Model, class Scope = whole_layers>
  void forward(Model& m, std::span<const float> x, std::span<const std::uint8_t> labels, Scope&& scope = {}) {
    const auto layers = layers_of(m);
    rows_ = static_cast<int>(labels.size());
    if (ones_.memory.size() < labels.size()) {  // the bias gradients' GEMV sums dy's rows against ones
      grow(ones_, labels.size());
      ddp::cuda::fill(ones_.memory.raw(), 1.0, stream_);  // ddp's own element kernel
    }
    acts_.resize(layers.size() + 1);  // acts_[k]: layer k's input; the last: the logits
    grads_.resize(layers.size());
    grow(acts_[0], x.size());
    grow(labels_, labels.size());
    upload(acts_[0].data(), x.data(), x.size_bytes());
    upload(labels_.data(), labels.data(), labels.size_bytes());
    for (std::size_t k = 0; k < layers.size(); ++k) {
      [[maybe_unused]] auto g = scope(*layers[k]);
      layer_forward(*layers[k], acts_[k].data(), acts_[k + 1], k + 1 < layers.size());
    }
    const int classes = layers.back()->out();
    auto& dlogits = grads_.back();
    grow(dlogits, static_cast<std::size_t>(rows_) * static_cast<std::size_t>(classes));
    grow(sums_, 2);
    ddp::cuda::check(cudaMemsetAsync(sums_.data(), 0, 2 * sizeof(double), stream_), "cudaMemsetAsync");
    softmax_cross_entropy(acts_.back().data(), labels_.data(), dlogits.data(), sums_.data(), rows_, classes, stream_);
    ddp::cuda::check(cudaMemcpyAsync(sums_host_, sums_.data(), 2 * sizeof(double), cudaMemcpyDeviceToHost, stream_),
                     "cudaMemcpyAsync of the batch's loss");
  }

  /// The loss sum and the correct count of the last forward, once the stream has run everything queued so far (call
  /// it after queueing the backward and the step, as a framework's loss.item(), so the device never idles for it).
  batch_result last_result() {
    ddp::cuda::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize for the batch's loss");
    return {sums_host_[0], static_cast<std::size_t>(sums_host_[1])};
  }

  /// Backward of the mean loss of the last forward of `m`: adds into the gradients and calls `ready(param)` for each
  /// parameter once its gradient's kernels are queued (the last layer first); each layer inside `auto g = scope(layer)`.
  template <class Model, class Ready, class Scope = whole_layers>
  void backward(Model& m, Ready&& ready, Scope&& scope = {}) {
    const auto layers = layers_of(m);
    for (std::size_t k = layers.size(); k-- > 0;) {  // grads_[k]: d loss / d layer k's output
      {
        [[maybe_unused]] auto g = scope(*layers[k]);
        layer_backward(*layers[k], acts_[k].data(), grads_[k].data(), k > 0 ? &grads_[k - 1] : nullptr, ready);
      }
      if (k > 0) relu_backward(grads_[k - 1].data(), acts_[k].data(), grads_[k - 1].size(), stream_);
    }
  }

 private:
  /// A device array sized to the current batch (it grows, never shrinks, so a step allocates nothing).
  template <class T>
  struct scratch {
    ddp::cuda::device_buffer<T> memory;
    std::size_t used = 0;
    [[nodiscard]] T* data() const noexcept { return memory.data(); }
    [[nodiscard]] std::size_t size() const noexcept { return used; }
  };
  template <class T>
  void grow(scratch<T>& s, std::size_t n) {
    if (s.memory.size() < n) s.memory = ddp::cuda::device_buffer<T>(n);
    s.used = n;
  }
  void upload(void* to, const void* from, std::size_t bytes) {
    ddp::cuda::check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync of a batch");
  }
  static void check(cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS)
      throw ddp::error(std::string("cuBLAS: ") + what + " failed with status " + std::to_string(static_cast<int>(s)));
  }

  // Row-major y[rows, out] = x[rows, in]·Wᵀ + b, as column-major yᵀ = Wᵀ'·xᵀ (cuBLAS is column-major).
  void layer_forward(const device_linear& l, const float* x, scratch<float>& y, bool activate) {
    const int o = l.out(), i = l.in();
    grow(y, static_cast<std::size_t>(rows_) * static_cast<std::size_t>(o));
    const float one = 1.0F, zero = 0.0F;
    check(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, o, rows_, i, &one, l.weight.values, i, x, i, &zero, y.data(), o),
          "the forward GEMM");
    add_bias_rows(y.data(), l.bias.values, rows_, o, stream_);
    if (activate) relu(y.data(), y.size(), stream_);
  }
  // dW[out, in] += dyᵀ·x, db += Σ_rows dy, dx[rows, in] = dy·W.
  template <class Ready>
  void layer_backward(device_linear& l, const float* x, const float* dy, scratch<float>* dx, Ready& ready) {
    const int o = l.out(), i = l.in();
    const float one = 1.0F, zero = 0.0F;
    check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, i, o, rows_, &one, x, i, dy, o, &one, l.weight.grads, i),
          "the weight gradient's GEMM");
    ready(l.weight);
    check(cublasSgemv(blas_, CUBLAS_OP_N, o, rows_, &one, dy, o, ones_.data(), 1, &one, l.bias.grads, 1),
          "the bias gradient's GEMV");
    ready(l.bias);
    if (dx == nullptr) return;
    grow(*dx, static_cast<std::size_t>(rows_) * static_cast<std::size_t>(i));
    check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, i, rows_, o, &one, l.weight.values, i, dy, o, &zero, dx->data(),
                      i),
          "the input gradient's GEMM");
  }

  cudaStream_t stream_;
  cublasHandle_t blas_ = nullptr;
  int rows_ = 0;
  std::vector<scratch<float>> acts_, grads_;
  scratch<float> ones_;
  scratch<std::uint8_t> labels_;
  scratch<double> sums_;
  double* sums_host_ = nullptr;
};

}  // namespace example::gpu

/// data_parallel adopts a device_param's storage into its device arenas, as it does a host parameter's.
template <>
struct ddp::storage_traits<example::gpu::device_param> {
  using param = example::gpu::device_param;
  static ddp::dtype dtype(const param&) { return ddp::dtype::f32; }
  static std::vector<std::size_t> shape(const param& p) { return p.shape; }
  static void* values(param& p) { return p.values; }
  static void* grads(param& p) { return p.grads; }
  static ddp::device device(const param& p) { return ddp::device::cuda(p.device); }
  static void adopt(param& p, void* values, void* grads) {
    p.values = static_cast<float*>(values);
    p.grads = static_cast<float*>(grads);
  }
};
