// Checkpoints of sharded models, over TCP (forked ranks via run_ranks) and MPI ([mpi], np 1..3 under mpirun):
// sharded and full checkpoints saved by N−1 ranks (a split of the world) and loaded by N ranks continue training
// to the parameters of uninterrupted training; a full checkpoint of a sharded model equals replicate's; a missing,
// corrupt or truncated part fails on every rank naming the file.
//
// Tolerance: training at N−1 then N ranks and the uninterrupted reference (one rank) differ only in the order the
// ranks' gradients are summed, so the parameters agree to |a − b| ≤ 1e-5·max(|b|, 1e-2) per element.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#if defined(DDP_WITH_MPI)
#include <ddp/comm/mpi/communicator.hpp>
#endif
#include <ddp/optim/adamw.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "fixtures.hpp"
#include "support/run_ranks.hpp"

namespace {

constexpr double tolerance = 1e-5;

ddp::optim::adamw make_adamw() { return ddp::optim::adamw({.lr = 0.01, .weight_decay = 0.1}); }

/// The sharding policy's value; under hybrid with shard groups of `group_size` ranks.
template <class Sharding>
Sharding grouped(int group_size) {
  Sharding policy{};
  if constexpr (requires { policy.group_size; }) policy.group_size = group_size;
  return policy;
}

/// Saves (sharded and full) after 3 steps of `Saved` at N−1 ranks; loads both into `Loaded` at N ranks (another
/// initialization); both equal the reference after 3 steps and, after 2 more, after 5 (one uninterrupted rank).
template <class Backend, class Saved, class Loaded, class Comm>
void check_resize(Comm world) {
  const int n = world.size(), saving = std::max(1, n - 1);
  shared_path dir(world, "resize", "");
  shared_path file(world, "resize_full");

  auto solo = world.split(world.rank(), 0);  // the uninterrupted reference, on every rank alone
  net ref_model = make_net(0.5F);
  dp_t<Backend> ref(ref_model, solo);
  auto ref_opt = make_adamw();
  train_steps(ref, ref_opt, 3);
  const auto ref3 = parameters_of(ref);
  train_steps(ref, ref_opt, 2);
  const auto ref5 = parameters_of(ref);

  auto savers = world.split(world.rank() < saving ? 0 : 1, world.rank());
  if (world.rank() < saving) {
    net model = make_net(0.5F);
    dp_t<Backend, Saved> dp(model, savers, grouped<Saved>(1));  // hybrid: every rank a replica
    auto opt = make_adamw();
    train_steps(dp, opt, 3);
    ddp::save_sharded(dir.path, dp, opt, {{"epoch", "3"}});
    ddp::save(file.path, dp, opt);
  }
  world.barrier().wait();

  const auto resume = [&](auto load) {
    net model = make_net(7.0F);
    dp_t<Backend, Loaded> dp(model, world, grouped<Loaded>(n));  // hybrid: one shard group
    auto opt = make_adamw();
    load(dp, opt);
    REQUIRE(opt.step_count() == 3);
    REQUIRE(relative_difference(parameters_of(dp), ref3) <= tolerance);
    train_steps(dp, opt, 2);
    REQUIRE(relative_difference(parameters_of(dp), ref5) <= tolerance);
  };
  resume([&](auto& dp, auto& opt) {
    const auto meta = ddp::load_sharded(dir.path, dp, opt);
    REQUIRE(meta.at("epoch") == "3");
    REQUIRE(meta.at("ddp.world_size") == std::to_string(saving));
  });
  resume([&](auto& dp, auto& opt) { ddp::load(file.path, dp, opt); });
}

/// The full checkpoint of a sharded model holds what replicate's holds: the same tensors, shapes and dtypes in
/// the same order, values within the tolerance; the sharded model's file loads into replicate.
template <class Backend, class Sharding, class Comm>
void check_full_equals_replicate(Comm world) {
  shared_path ours(world, "full_sharded"), theirs(world, "full_replicate");
  net a_model = make_net(0.5F), b_model = make_net(0.5F);
  dp_t<Backend> a(a_model, world);
  dp_t<Backend, Sharding> b(b_model, world, grouped<Sharding>(1));
  auto a_opt = make_adamw(), b_opt = make_adamw();
  train_steps(a, a_opt, 3);
  train_steps(b, b_opt, 3);
  ddp::save(theirs.path, a, a_opt);
  ddp::save(ours.path, b, b_opt);
  if (world.rank() == 0) {
    const auto x = ddp::safetensors::file::read(ours.path), y = ddp::safetensors::file::read(theirs.path);
    REQUIRE(x.entries().size() == y.entries().size());
    for (std::size_t i = 0; i < x.entries().size(); ++i) {
      const auto &e = x.entries()[i], &f = y.entries()[i];
      INFO(e.name);
      REQUIRE(e.name == f.name);
      REQUIRE(e.type == f.type);
      REQUIRE(e.shape == f.shape);
      const auto* p = reinterpret_cast<const float*>(e.bytes.data());
      const auto* q = reinterpret_cast<const float*>(f.bytes.data());
      REQUIRE(relative_difference(std::vector<float>(p, p + e.numel()), std::vector<float>(q, q + f.numel())) <= tolerance);
    }
    REQUIRE(x.metadata().at("optim.step") == "3");
  }
  net c_model = make_net(3.0F);
  dp_t<Backend> c(c_model, world);
  auto c_opt = make_adamw();
  ddp::load(ours.path, c, c_opt);
  REQUIRE(relative_difference(snapshot(c, c_opt), snapshot(a, a_opt)) <= tolerance);
}

/// A missing manifest, a flipped byte, a truncated part, a deleted part, another model: every rank throws,
/// naming the file; the checkpoint saved again over the damaged one loads.
template <class Backend, class Comm>
void check_sharded_corrupt(Comm world) {
  namespace fs = std::filesystem;
  const int n = world.size();
  shared_path dir(world, "corrupt", "");
  net model = make_net(0.5F);
  dp_t<Backend, ddp::full_shard> dp(model, world);
  auto opt = make_adamw();
  train_steps(dp, opt, 1);
  REQUIRE_THROWS_WITH(ddp::load_sharded(dir.path, dp, opt), Catch::Contains("manifest.json") && Catch::Contains("cannot be opened"));

  const auto last = dir.path / ddp::detail::part_name(n - 1, n);
  const auto damage = [&](auto how, const std::string& expected) {
    ddp::save_sharded(dir.path, dp, opt);  // replaces the damaged checkpoint of the previous round
    if (world.rank() == 0) how();
    world.barrier().wait();
    REQUIRE_THROWS_AS(ddp::load_sharded(dir.path, dp, opt), ddp::io_error);
    REQUIRE_THROWS_WITH(ddp::load_sharded(dir.path, dp, opt),
                        Catch::Contains(last.string()) && Catch::Contains(expected) &&
                            Catch::Contains("rank " + std::to_string(n - 1) + ":"));
  };
  damage([&] {
    std::fstream f(last, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }, "checksum");
  damage([&] { fs::resize_file(last, fs::file_size(last) - 5); }, "truncated");
  damage([&] { fs::remove(last); }, "cannot be opened");

  ddp::save_sharded(dir.path, dp, opt);
  for (const auto& e : fs::directory_iterator(dir.path)) {  // the manifest and the parts, nothing left behind
    const std::string name = e.path().filename().string();
    INFO(name);
    REQUIRE((name == "manifest.json" || name.ends_with(".safetensors")));
  }
  const auto before = parameters_of(dp);
  REQUIRE(ddp::load_sharded(dir.path, dp, opt).at("optim.step") == "1");
  REQUIRE(parameters_of(dp) == before);
  net wide_model = make_net(0.5F, 8);
  dp_t<Backend, ddp::full_shard> wide(wide_model, world);
  REQUIRE_THROWS_AS(ddp::load_sharded(dir.path, wide), ddp::mismatch_error);
  REQUIRE_THROWS_WITH(ddp::load_sharded(dir.path, wide), Catch::Contains("'fc1.weight' is f32 [7, 5] in the file but f32 [8, 5] in the model"));
}

}  // namespace

#define DDP_SHARDED_SCENARIOS(X)                                                                                      \
  X((check_resize<B, ddp::full_shard, ddp::full_shard>), "full_shard saved at N-1, loaded at N, resumes")            \
  X((check_resize<B, ddp::shard_grad_op, ddp::shard_grad_op>), "shard_grad_op saved at N-1, loaded at N, resumes")   \
  X((check_resize<B, ddp::hybrid<ddp::full_shard>, ddp::hybrid<ddp::shard_grad_op>>),                                 \
    "hybrid saved at N-1, loaded at N, resumes")                                                                      \
  X((check_resize<B, ddp::replicate, ddp::full_shard>), "replicate saved at N-1, loaded into full_shard at N")       \
  X((check_full_equals_replicate<B, ddp::full_shard>), "full checkpoint of full_shard equals replicate's")          \
  X((check_full_equals_replicate<B, ddp::hybrid<ddp::shard_grad_op>>), "full checkpoint of hybrid equals replicate's") \
  X((check_sharded_corrupt<B>), "a missing, corrupt or truncated part fails on every rank naming the file")

#define DDP_SHARDED_TCP_CASE(fn, title)                                                                   \
  TEST_CASE("tcp: sharded: " title, "[tcp]") {                                                            \
    for (const int n : {2, 3})                                                                            \
      ddp::testing::require_all_ok(ddp::testing::run_ranks(n, [](int) {                                   \
        using B = ddp::backend::tcp;                                                                      \
        fn(ddp::tcp::communicator::from_env());                                                           \
      }));                                                                                                \
  }
DDP_SHARDED_SCENARIOS(DDP_SHARDED_TCP_CASE)

#if defined(DDP_WITH_MPI)
#define DDP_SHARDED_MPI_CASE(fn, title)              \
  TEST_CASE("mpi: sharded: " title, "[mpi]") {       \
    using B = ddp::backend::mpi;                     \
    fn(ddp::mpi::communicator::world({.timeout = std::chrono::seconds(30)})); \
  }
DDP_SHARDED_SCENARIOS(DDP_SHARDED_MPI_CASE)
#endif
