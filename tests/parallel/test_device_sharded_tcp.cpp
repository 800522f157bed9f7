// data_parallel with the model on fake devices over the TCP backend (device_scenarios.hpp), at N = 1..4 forked
// ranks: buckets staged through host memory by the collective front end, element work and the optimizer on the
// devices' streams. shard_grad_op and full_shard, checkpoints, device memory and mixed precision here (the
// other cases in test_device_tcp.cpp: the two files compile in parallel).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include <ddp/optim/adamw.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "device_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters
}  // namespace
TEST_CASE("tcp device shard_grad_op and full_shard: one device or two, sgd and adamw, no_sync", "[device]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_device_equivalence<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_momentum, false);
    check_device_equivalence<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, true, 2);
    check_device_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, false);
    check_device_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_nesterov, true, 3);
  });
}
TEST_CASE("tcp device checkpoints: full and sharded, every policy, resume bit for bit", "[device]") {
  const std::string dir = "/tmp/ddp_device_ckpt_" + std::to_string(::getpid());
  ddp::testing::on_1_to_n_ranks(3, [&](ddp::tcp::communicator comm) {
    const std::string at = dir + "_n" + std::to_string(comm.size());
    check_device_checkpoint<tcp, tiny>(comm, optimizer_kind::adamw, true, false, at + "_replicate.safetensors");
    check_device_checkpoint<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_momentum, false, true,
                                                           at + "_shard_grad_op");
    check_device_checkpoint<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, true, false,
                                                        at + "_full_shard.safetensors");
    check_device_checkpoint<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, false, true, at + "_full_shard");
  });
  std::error_code ignored;
  for (int n = 1; n <= 3; ++n)
    for (const char* name : {"_replicate.safetensors", "_shard_grad_op", "_full_shard.safetensors", "_full_shard"})
      std::filesystem::remove_all(dir + "_n" + std::to_string(n) + name, ignored);
}

namespace {
/// Eight 256×256 layers on a fake device: a model with enough units that sharding's saving shows.
struct deep_device_mlp {
  device_linear l0, l1, l2, l3, l4, l5, l6, l7;
};
constexpr std::size_t deep_width = 256;

/// The device memory (bytes the fake device holds beyond the model's own) of a rank training deep_device_mlp under
/// sharding policy S with adamw for two steps (forward scopes in order, backward scopes and reports in reverse).
template <class S>
std::size_t sharded_device_bytes(ddp::tcp::communicator comm, std::size_t& arena_elements) {
  using namespace std::chrono_literals;
  ddp::testing::fake_device dev(0, 0us, 5us, static_cast<unsigned>(comm.rank()) + 1);
  const ddp::device_registration on_dev(dev);
  deep_device_mlp model;
  std::vector<ddp::domain_buffer> memory;
  device_linear* layers[] = {&model.l0, &model.l1, &model.l2, &model.l3, &model.l4, &model.l5, &model.l6, &model.l7};
  for (device_linear* l : layers)
    for (device_param* p : {&l->weight, &l->bias}) {
      p->shape = p == &l->weight ? std::vector<std::size_t>{deep_width, deep_width} : std::vector<std::size_t>{deep_width};
      memory.push_back(dev.allocate(p->numel() * sizeof(float)));
      memory.push_back(dev.allocate(p->numel() * sizeof(float)));
      p->values = reinterpret_cast<float*>(memory[memory.size() - 2].data());
      p->grads = reinterpret_cast<float*>(memory.back().data());
      dev.fill({p->values, p->numel(), ddp::dtype::f32, p->where}, 0.01);
    }
  dev.synchronize();
  const std::size_t model_bytes = dev.allocated_bytes();
  std::size_t used = 0;
  {
    // The steps report gradients nobody wrote (zeros): only the memory is measured here.
    ddp::data_parallel<deep_device_mlp, ddp::backend::tcp, S> dp{model, comm, ddp::data_parallel_options{.check_first_gradients = false}};
    arena_elements = dp.layout().arenas()[0].numel;
    ddp::optim::adamw opt({.lr = 1e-3});
    for (int s = 0; s < 2; ++s) {
      dp.zero_grad();
      for (device_linear* l : layers) auto g = dp.unshard(*l);  // the forward
      for (int k = 7; k >= 0; --k) {                             // the backward
        auto g = dp.unshard(*layers[k]);
        dp.gradient_ready(layers[k]->bias);
        dp.gradient_ready(layers[k]->weight);
      }
      dp.step(opt);
    }
    dev.synchronize();
    used = dev.allocated_bytes() - model_bytes;
    dp.unshard_model();
  }
  return used;
}
}  // namespace

TEST_CASE("tcp device memory: full_shard and shard_grad_op hold ZeRO's share plus a few unit buffers", "[device]") {
  for (const int n : {2, 4}) {
    INFO("ranks: " << n);
    ddp::testing::require_all_ok(ddp::testing::run_ranks(n, [](int) {
      ddp::tcp::communicator comm = ddp::tcp::communicator::from_env();
      const auto ranks = static_cast<std::size_t>(comm.size());
      const std::size_t unit = (deep_width * deep_width + deep_width) * sizeof(float);  // one layer's values
      std::size_t elements = 0;
      // ZeRO-3: owned values, owned gradients and adamw's two moments, each a 1/N share of the (padded) arena;
      // the unit pool holds at most two layers' values (the one in use and the prefetched) and two layers' gradients
      const std::size_t full = sharded_device_bytes<ddp::full_shard>(comm, elements);
      const std::size_t zero3 = 4 * elements / ranks * sizeof(float);
      INFO("full_shard: " << full << " bytes against ZeRO-3's " << zero3 << " and 4 unit buffers of " << unit);
      REQUIRE(full <= static_cast<std::size_t>(1.05 * static_cast<double>(zero3 + 4 * unit)));
      REQUIRE(full >= zero3);
      // ZeRO-2: full values, then gradients and moments sharded; the unit pool holds gradients only
      const std::size_t grad_op = sharded_device_bytes<ddp::shard_grad_op>(comm, elements);
      const std::size_t zero2 = (elements + 3 * elements / ranks) * sizeof(float);
      INFO("shard_grad_op: " << grad_op << " bytes against ZeRO-2's " << zero2);
      REQUIRE(grad_op <= static_cast<std::size_t>(1.05 * static_cast<double>(zero2 + 2 * unit)));
      REQUIRE(grad_op >= zero2);
    }));
  }
}
TEST_CASE("tcp device mixed precision: bf16 models on the devices with f32 masters, the host's bits", "[device]") {
  using bf16_f32 = ddp::mixed_precision<ddp::bfloat16, float>;
  using bf16_bf16 = ddp::mixed_precision<ddp::bfloat16, ddp::bfloat16>;
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_device_mixed<tcp, tiny, bf16_f32>(comm, optimizer_kind::adamw, true);
    check_device_mixed<tcp, tiny, ddp::shard_grad_op, bf16_f32>(comm, optimizer_kind::sgd_momentum, false);
    check_device_mixed<tcp, tiny, ddp::full_shard, bf16_f32>(comm, optimizer_kind::adamw, true);
    check_device_mixed<tcp, tiny, ddp::full_shard, bf16_bf16>(comm, optimizer_kind::sgd_nesterov, false);
  });
}
