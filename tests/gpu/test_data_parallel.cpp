// data_parallel over ddp::nccl with the model on a GPU, under mpirun at 1 to 4 ranks (sharing one GPU through
// NCCL_HOSTID where needed): the test MLP (tests/parallel/mlp.hpp) with its parameters in device memory, its
// forward and backward CUDA kernels (mlp_kernels.cu) queued on the model's stream, each layer's gradients reported
// right after its backward is queued, as a framework's autograd does. Every policy must give one process's
// parameters on the whole batch (scenarios.hpp's reference and tolerance): the buckets are all-reduced,
// reduce-scattered and all-gathered by NCCL on device memory, the element work and the optimizers run as kernels on
// the domain's stream, and nothing is ordered by luck: NCCL waits for the model's stream, the domain for NCCL's
// events.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <ddp/comm/mpi/communicator.hpp>
#include <ddp/comm/nccl/communicator.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/memory/cuda.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/parallel/data_parallel.hpp>
#include <gpu/gpu_ranks.hpp>
#include <gpu/mlp_kernels.hpp>
#include <parallel/device_mlp.hpp>
#include <parallel/scenarios.hpp>

namespace {

using namespace std::chrono_literals;
using namespace ddp_test;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters

/// Where a run computes: the model's stream, which the domain and NCCL are both told; null is the default stream,
/// which both use unless told otherwise.
struct gpu_run {
  bool own_stream = true;  ///< the model on a stream of its own (else the default stream)
  int micro = 1;           ///< micro-batches per step
};

/// This rank's GPU, its compute stream, the domain on it and an NCCL communicator over every rank.
struct gpu_rank {
  int device = ddp::testing::place_rank_on_gpu();
  std::optional<ddp::cuda::stream> own;
  cudaStream_t stream = nullptr;
  std::optional<ddp::cuda::domain> gpu;
  std::optional<ddp::device_registration> registered;
  std::optional<ddp::nccl::communicator> comm;

  explicit gpu_rank(bool own_stream) {
    if (own_stream) {
      own.emplace(device);
      stream = own->get();
    }
    gpu.emplace(device, ddp::cuda::domain_options{.stream = stream});
    registered.emplace(*gpu);
    auto boot = ddp::mpi::communicator::world({.timeout = 120s});
    comm.emplace(boot, ddp::nccl::config{.timeout = 120s, .device = device, .compute_stream = stream});
  }
};

/// The device memory of a forward and backward for up to the whole batch, allocated once: the kernels of every step
/// are queued on one stream, so reusing it is ordered, and nothing frees memory (cudaFree waits for the device)
/// inside a step to hide a missing wait.
struct gpu_scratch {
  static constexpr std::size_t widest = std::max({in_dim, h1_dim, h2_dim, out_dim});
  std::vector<ddp::domain_buffer> act;  // act[k]: layer k's input (act[0] the batch), act[3] the output
  ddp::domain_buffer y, delta, back;

  explicit gpu_scratch(gpu_rank& r) {
    for (const std::size_t width : {in_dim, h1_dim, h2_dim, out_dim}) act.push_back(floats(r, global_batch * width));
    y = floats(r, global_batch * out_dim);
    delta = floats(r, global_batch * widest);  // δ of any layer's output or input
    back = floats(r, global_batch * widest);
  }
  static ddp::domain_buffer floats(gpu_rank& r, std::size_t n) { return r.gpu->allocate(n * sizeof(float)); }
};

float* as_floats(const ddp::domain_buffer& b) { return reinterpret_cast<float*>(b.data()); }

/// mlp.hpp's forward_backward as kernels on the model's stream: the batch is copied in, each layer's forward and
/// backward queued inside scope(layer) (dp.unshard under full_shard) on the views as they are then, each layer's
/// gradients reported from the host right after its backward is queued.
template <class Report, class Scope>
void gpu_forward_backward(device_mlp& m, const batch& b, float scale, Report&& report, Scope&& scope, gpu_rank& r,
                          gpu_scratch& at) {
  const std::size_t n = b.n;
  const auto host = [](const std::vector<float>& v) {  // a source the copy only reads
    return ddp::raw_tensor{const_cast<float*>(v.data()), v.size(), ddp::dtype::f32, ddp::device::cpu()};
  };
  r.gpu->copy(host(b.x), at.act[0].view(ddp::dtype::f32, 0, b.x.size()));
  r.gpu->copy(host(b.y), at.y.view(ddp::dtype::f32, 0, b.y.size()));
  device_linear* layers[] = {&m.fc1, &m.fc2, &m.fc3};
  const std::size_t widths[] = {in_dim, h1_dim, h2_dim}, outs[] = {h1_dim, h2_dim, out_dim};
  for (int k = 0; k < 3; ++k) {
    [[maybe_unused]] auto g = scope(*layers[k]);
    gpu::layer_forward(layers[k]->weight.values, layers[k]->bias.values, as_floats(at.act[k]),
                       as_floats(at.act[k + 1]), n, widths[k], outs[k], k < 2, r.stream);
  }
  gpu::loss_delta(as_floats(at.act[3]), as_floats(at.y), as_floats(at.delta), scale, n * out_dim, r.stream);
  for (int k = 2; k >= 0; --k) {
    [[maybe_unused]] auto g = scope(*layers[k]);
    gpu::layer_backward(layers[k]->weight.values, as_floats(at.act[k]), as_floats(at.delta), layers[k]->weight.grads,
                        layers[k]->bias.grads, as_floats(at.back), n, widths[k], outs[k], r.stream);
    report(layers[k]->bias);
    report(layers[k]->weight);
    if (k > 0) gpu::tanh_grad(as_floats(at.back), as_floats(at.act[k]), n * widths[k], r.stream);
    std::swap(at.delta, at.back);
  }
}

/// N ranks train the GPU model under Ps as scenarios.hpp trains the host one; returns the trained values.
template <class... Ps>
mlp train_on_gpu(optimizer_kind k, const gpu_run& run, typename ddp::policies<Ps...>::sharding sharding = {}) {
  gpu_rank r(run.own_stream);
  auto& comm = *r.comm;
  if constexpr (requires { sharding.group_size; }) sharding = hybrid_groups<typename decltype(sharding)::inner_type>(comm.size());
  mlp base = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));  // rank 0's values are broadcast
  device_model placed(base, *r.gpu, *r.gpu);  // device_mlp.hpp's placement, on the GPU's domain
  gpu_scratch scratch(r);
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  const float scale = static_cast<float>(comm.size()) / global_batch;
  {
    ddp::data_parallel<device_mlp, Ps...> dp{placed.model, comm, sharding};
    REQUIRE(dp.layout().arenas().size() == 1U);
    auto scope = [&](auto& l) { return dp.unshard(l); };
    auto report = [&](auto& p) { dp.gradient_ready(p); };
    with_optimizer(k, [&](auto& opt) {
      for (int s = 0; s < steps; ++s) {
        dp.zero_grad();
        const batch mine = make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count);
        over_micro_batches(dp, mine, run.micro, [&](const batch& b) {
          gpu_forward_backward(placed.model, b, scale, report, scope, r, scratch);
        });
        dp.step(opt);
      }
    });
    dp.verify_in_sync();
    dp.unshard_model();  // full_shard: the model's own parameters take the trained values
  }
  return read_back(placed.model, *r.gpu, *r.gpu);
}

/// train_on_gpu within `tol` of one process on the whole batch on the host.
template <class... Ps>
void check_gpu_equivalence(optimizer_kind k, const gpu_run& run, double tol = 1e-5,
                           closeness how = closeness::per_element,
                           typename ddp::policies<Ps...>::sharding sharding = {}) {
  mlp got = train_on_gpu<ddp::backend::nccl, Ps...>(k, run, sharding);
  mlp want = reference_training(k);
  require_close(got, want, tol, how);
}

}  // namespace

TEST_CASE("gpu data_parallel replicate over nccl: one bucket or many, sgd and adamw, no_sync, the default stream",
          "[gpu][data_parallel]") {
  check_gpu_equivalence(optimizer_kind::sgd_momentum, {});
  check_gpu_equivalence<tiny>(optimizer_kind::adamw, {});
  check_gpu_equivalence<tiny>(optimizer_kind::sgd_nesterov, {.micro = 2});
  check_gpu_equivalence<tiny>(optimizer_kind::adamw, {.own_stream = false});
}

TEST_CASE("gpu data_parallel replicate over nccl: the bf16 and fp16 compression hooks, deterministic reduction",
          "[gpu][data_parallel]") {
  check_gpu_equivalence<tiny, ddp::bf16_compress_hook>(optimizer_kind::sgd_momentum, {}, 1e-2, closeness::per_tensor);
  check_gpu_equivalence<tiny, ddp::fp16_compress_hook>(optimizer_kind::adamw, {}, 1e-2, closeness::per_tensor);
  check_gpu_equivalence<tiny>(optimizer_kind::sgd_momentum, {}, 1e-5, closeness::per_element,
                              ddp::replicate{.deterministic = true});
}

TEST_CASE("gpu data_parallel shard_grad_op and full_shard over nccl", "[gpu][data_parallel]") {
  check_gpu_equivalence<tiny, ddp::shard_grad_op>(optimizer_kind::adamw, {});
  check_gpu_equivalence<tiny, ddp::shard_grad_op>(optimizer_kind::sgd_momentum, {.micro = 3});
  check_gpu_equivalence<tiny, ddp::full_shard>(optimizer_kind::sgd_nesterov, {});
  check_gpu_equivalence<tiny, ddp::full_shard>(optimizer_kind::adamw, {.own_stream = false, .micro = 3});
  check_gpu_equivalence<ddp::full_shard>(optimizer_kind::sgd_momentum, {});
}

TEST_CASE("gpu data_parallel hybrid over nccl (groups split with ncclCommSplit)", "[gpu][data_parallel]") {
  check_gpu_equivalence<tiny, ddp::hybrid<ddp::full_shard>>(optimizer_kind::adamw, {});
  check_gpu_equivalence<tiny, ddp::hybrid<ddp::shard_grad_op>>(optimizer_kind::sgd_momentum, {});
}
