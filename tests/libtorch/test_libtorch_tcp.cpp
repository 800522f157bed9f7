// The LibTorch adapter over the TCP backend: torch::nn models at N = 1..3 forked ranks equal one plain LibTorch
// process (run_ranks: a 60 s job timeout), .grad stays ddp's memory, the errors say what to do.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "scenarios.hpp"
#include "steady_state.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_torch_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters

/// Runs `body(comm)` on n = 1..3 ranks, each in its own job.
template <class F>
void on_1_to_3_ranks(F body) {
  ddp::testing::on_1_to_n_ranks(3, body, [] { torch::set_num_threads(1); });
}
}  // namespace

/// The eval-mode output of `module` on probe_input(), and what PyTorch's strict load_state_dict of `path` into the same
/// architecture (torch_load.py `arch`) gives: equal within `tolerance`.
template <class Module>
void require_pytorch_agrees(Module& module, const std::filesystem::path& path, const char* arch, double tolerance) {
  module->eval();
  const torch::Tensor ours = module->forward(probe_input()).detach().flatten();
  const std::string command = "/usr/bin/python3 " DDP_TORCH_LOAD_SCRIPT " " + path.string() + " " + arch;
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string printed;
  char chunk[512];
  while (const std::size_t n = std::fread(chunk, 1, sizeof chunk, pipe)) printed.append(chunk, n);
  REQUIRE(::pclose(pipe) == 0);
  std::istringstream in(printed);
  std::vector<double> theirs;
  for (double v = 0; in >> v;) theirs.push_back(v);
  INFO("PyTorch printed: " << printed);
  REQUIRE(theirs.size() == static_cast<std::size_t>(ours.numel()));
  for (std::size_t i = 0; i < theirs.size(); ++i)
    REQUIRE(std::abs(theirs[i] - ours[static_cast<std::int64_t>(i)].item<double>()) <= tolerance * std::max(1.0, std::abs(theirs[i])));
}
TEST_CASE("tcp replicate: MLP and CNN with torch SGD momentum, Adam and ddp adamw equal one process",
          "[equivalence]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) {
    check_equivalence<mlp, tcp>(comm, optimizer_kind::torch_sgd_momentum);
    check_equivalence<mlp, tcp, tiny>(comm, optimizer_kind::torch_adam);
    check_equivalence<mlp, tcp, tiny>(comm, optimizer_kind::ddp_adamw);
    check_equivalence<cnn, tcp, tiny>(comm, optimizer_kind::torch_sgd_momentum);
    check_equivalence<cnn, tcp>(comm, optimizer_kind::torch_adam);
  });
}
TEST_CASE("tcp shard_grad_op: torch optimizers over ddp::parameters(dp) and ddp adamw equal one process",
          "[equivalence]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) {
    check_equivalence<mlp, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::torch_sgd_momentum);
    check_equivalence<mlp, tcp, ddp::shard_grad_op>(comm, optimizer_kind::torch_adam);
    check_equivalence<cnn, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::ddp_adamw);
    check_equivalence<cnn, tcp, ddp::shard_grad_op>(comm, optimizer_kind::torch_adam);
  });
}
TEST_CASE("tcp: torch AdamW over ddp::parameters(dp, groups) under every policy equals one process with the same "
          "param groups", "[equivalence][groups]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) {
    check_equivalence<mlp, tcp>(comm, optimizer_kind::torch_adamw_grouped);  // replicate: the model's own parameters
    check_equivalence<mlp, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::torch_adamw_grouped);
    check_equivalence<deep, tcp, tiny, ddp::full_shard>(comm, optimizer_kind::torch_adamw_grouped);
    check_equivalence<deep, tcp, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::torch_adamw_grouped, 1,
                                                                {.group_size = 1});
  });
}
TEST_CASE("tcp: net->zero_grad(), net->zero_grad(false) and opt.zero_grad() in place of dp.zero_grad() train as one "
          "process under every policy (a step consumes the owned gradients)",
          "[equivalence][zero_grad]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) {
    for (const auto z : {zero_with::model, zero_with::model_in_place, zero_with::optimizer}) {
      check_equivalence<mlp, tcp, tiny>(comm, optimizer_kind::torch_adam, 1, {}, z);
      check_equivalence<mlp, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::torch_sgd_momentum, 1, {}, z);
      check_equivalence<mlp, tcp, ddp::shard_grad_op>(comm, optimizer_kind::torch_adam, 2, {}, z);
      check_equivalence<deep, tcp, tiny, ddp::full_shard>(comm, optimizer_kind::torch_sgd_momentum, 1, {}, z);
      check_equivalence<deep, tcp, ddp::full_shard>(comm, optimizer_kind::torch_adam, 2,
                                                    {.reshard_after_forward = false}, z);
      check_equivalence<deep, tcp, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::torch_adam, 1, {.group_size = 1}, z);
    }
    check_equivalence<deep, tcp, ddp::full_shard>(comm, optimizer_kind::ddp_adamw, 1, {}, zero_with::model);
  });
}
TEST_CASE("tcp: opt.step() in place of dp.step(opt) is named at the next backward, a wrapper destroyed before its "
          "optimizer leaves it stepping copies and says so",
          "[errors][zero_grad]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) { check_loop_mistakes<tcp>(comm); });
}
TEST_CASE("torch::Tensor leaves: a rebinding moves the parameter's storage, so a view autograd saved reads the new "
          "memory, a vacated parameter is empty", "[full_shard]") {
  using traits = ddp::storage_traits<torch::Tensor>;
  const torch::Tensor w = torch::zeros({2, 3}, torch::requires_grad());
  std::vector<float> first(6, 1.0F), second(6, 2.0F), grads(6, 0.0F);
  traits::adopt(w, first.data(), grads.data());
  const torch::Tensor x = torch::ones({1, 3}, torch::requires_grad());
  const torch::Tensor y = torch::nn::functional::linear(x, w);  // saves w.t(), a view of w's storage
  traits::vacate(w, second.data(), grads.data());                // the unit is resharded after its forward
  REQUIRE(w.numel() == 0);
  REQUIRE_THROWS_AS(torch::nn::functional::linear(x, w), c10::Error);
  std::fill(first.begin(), first.end(), -7.0F);  // the forward's buffer now holds another unit
  traits::adopt(w, second.data(), grads.data());  // unsharded again for the backward, elsewhere
  REQUIRE(w.numel() == 6);
  REQUIRE(w._version() == 0);  // no version bump: autograd raises no "modified by an inplace operation"
  y.sum().backward();
  REQUIRE(torch::allclose(x.grad(), torch::full({1, 3}, 4.0F)));  // w = 2 (second), not -7 (first)
  REQUIRE(grads[0] == 1.0F);                                      // accumulated into ddp's gradient memory
  traits::release(w);
  REQUIRE(torch::equal(w, torch::full({2, 3}, 2.0F)));
}
TEST_CASE("tcp full_shard and hybrid<full_shard>: a 3-unit CNN run through ddp::forward equals one process, resharding "
          "after forward or not",
          "[equivalence]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) {
    check_equivalence<deep, tcp, ddp::full_shard>(comm, optimizer_kind::torch_adam);
    check_equivalence<deep, tcp, tiny, ddp::full_shard>(comm, optimizer_kind::ddp_adamw);
    check_equivalence<deep, tcp, tiny, ddp::full_shard>(comm, optimizer_kind::torch_sgd_momentum, 1,
                                                       {.reshard_after_forward = false});
    check_equivalence<deep, tcp, ddp::full_shard>(comm, optimizer_kind::ddp_adamw, 2, {.reshard_after_forward = false});
    check_equivalence<deep, tcp, tiny, ddp::full_shard>(comm, optimizer_kind::torch_adam, 3);
    check_equivalence<deep, tcp, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::ddp_adamw, 1, {.group_size = 1});
  });
}
TEST_CASE("tcp full_shard: a plain forward of a sharded unit fails, a backward without ddp::forward is named, "
          "torch::optim over the model refused, checkpoints hold the full values", "[errors][checkpoint]") {
  const auto path = std::filesystem::temp_directory_path() / ("ddp_libtorch_fs_" + std::to_string(::getpid()) + ".safetensors");
  on_1_to_3_ranks([&](ddp::tcp::communicator comm) { check_full_shard_rules<tcp>(comm, path); });
  std::filesystem::remove(path);
}
TEST_CASE("tcp replicate and shard_grad_op: no_sync accumulation over 2 and 3 micro-batches equals one process",
          "[equivalence]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) {
    check_equivalence<mlp, tcp, tiny>(comm, optimizer_kind::torch_sgd_momentum, 2);
    check_equivalence<cnn, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::torch_adam, 3);
  });
}
TEST_CASE("tcp: buckets reduce during the backward, .grad stays linked across zero_grad, buffers broadcast, unusable leaves named", "[errors]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) {
    check_gradient_link<tcp>(comm);
    check_errors<tcp>(comm);
    check_buffers<tcp>(comm);
    check_overlap<tcp, tiny>(comm);
  });
}
TEST_CASE("tcp: a steady-state step under every policy allocates no tensor and no byte more than plain LibTorch's",
          "[steady]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) {
    check_steady_state_allocations<cnn, tcp>(comm);
    check_steady_state_allocations<cnn, tcp, ddp::shard_grad_op>(comm);
    check_steady_state_allocations<deep, tcp, ddp::full_shard>(comm);
  });
}
TEST_CASE("tcp checkpoint: ddp::save(path, dp) at 2 ranks loads into a plain module in C++ and in PyTorch",
          "[checkpoint]") {
  const auto path = std::filesystem::temp_directory_path() / ("ddp_libtorch_" + std::to_string(::getpid()) + ".safetensors");
  ddp::testing::require_all_ok(ddp::testing::run_ranks(2, [&](int) {
    torch::set_num_threads(1);
    check_checkpoint<tcp>(ddp::tcp::communicator::from_env(), path);
  }));
  mlp plain = make_model<mlp>(5);
  ddp::load_module(path, *plain);
  require_pytorch_agrees(plain, path, "mlp", 1e-5);
  std::filesystem::remove(path);
}
TEST_CASE("tcp checkpoint: a BatchNorm module with a frozen weight saved at 2 ranks holds its running statistics and "
          "frozen weight, C++ and PyTorch's strict load_state_dict read it and evaluate alike", "[checkpoint]") {
  const auto path = std::filesystem::temp_directory_path() / ("ddp_libtorch_bn_" + std::to_string(::getpid()) + ".safetensors");
  ddp::testing::require_all_ok(ddp::testing::run_ranks(2, [&](int) {
    torch::set_num_threads(1);
    check_bn_checkpoint<tcp>(ddp::tcp::communicator::from_env(), path);
  }));
  torch::manual_seed(7);
  bn_net plain;
  ddp::load_module(path, *plain);
  require_pytorch_agrees(plain, path, "bn", 1e-6);
  std::filesystem::remove(path);
}
TEST_CASE("tcp: PyTorch's loop with clip_grad_norm_ between backward() and the step keeps the ranks bitwise equal "
          "in 50 runs and equals one process, under replicate and shard_grad_op", "[clip]") {
  ddp::testing::require_all_ok(ddp::testing::run_ranks(2, [&](int) {
    torch::set_num_threads(1);
    // One communicator for both: a rank that joined a second one while another still held the first could reach
    // the first job's rendezvous store.
    const auto comm = ddp::tcp::communicator::from_env();
    check_clip_loop<tcp, ddp::replicate>(comm, 50);
    check_clip_loop<tcp, ddp::shard_grad_op>(comm, 3);
  }));
}
TEST_CASE("tcp: ddp::SyncBatchNorm at 1-3 ranks on uneven parts of a batch equals BatchNorm2d on the whole batch "
          "in one process", "[sync_bn]") {
  on_1_to_3_ranks([](ddp::tcp::communicator comm) { check_sync_batch_norm(comm); });
}
