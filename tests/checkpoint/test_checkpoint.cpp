// ddp::save / ddp::load over real ranks: the same scenarios over TCP (forked ranks via run_ranks, N = 1..3) and over
// MPI ([mpi], registered at np 1..3 under mpirun); and the PyTorch interop check ([interop], one process).
// Scenarios assert with REQUIRE so that a failure in a forked rank throws and fails that rank.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <catch2/catch.hpp>

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/checkpoint/sharded.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/core/trainable.hpp>
#if defined(DDP_WITH_MPI)
#include <ddp/comm/mpi/communicator.hpp>
#endif
#include <ddp/optim/adamw.hpp>
#include <ddp/optim/sgd.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "fixtures.hpp"
#include "support/run_ranks.hpp"

namespace {

/// Save after AdamW steps, load into a differently initialized model: bit-identical state, then bit-identical training.
template <class Backend, class Comm>
void check_resume(Comm comm) {
  shared_path file(comm, "resume");
  net a_model = make_net(0.5F);
  dp_t<Backend> a(a_model, comm);
  ddp::optim::adamw a_opt({.lr = 0.01, .weight_decay = 0.1});
  train_steps(a, a_opt, 3);
  const auto saved = snapshot(a, a_opt);
  ddp::save(file.path, a, a_opt, {{"epoch", "2"}});
  REQUIRE(std::filesystem::exists(file.path));

  net b_model = make_net(9.0F);
  dp_t<Backend> b(b_model, comm);
  ddp::optim::adamw b_opt({.lr = 0.01, .weight_decay = 0.1});
  const auto meta = ddp::load(file.path, b, b_opt);
  REQUIRE(meta.at("epoch") == "2");
  REQUIRE(meta.at("optim.step") == "3");
  REQUIRE(b_opt.step_count() == 3);
  REQUIRE(snapshot(b, b_opt) == saved);

  train_steps(a, a_opt, 2);
  train_steps(b, b_opt, 2);
  REQUIRE(snapshot(b, b_opt) == snapshot(a, a_opt));  // bit-identical continuation
}

/// load(path, dp) takes the parameters and ignores the optimizer entries.
template <class Backend, class Comm>
void check_parameters_only(Comm comm) {
  shared_path file(comm, "params");
  net a_model = make_net(1.5F);
  dp_t<Backend> a(a_model, comm);
  ddp::optim::sgd a_opt({.lr = 0.1, .momentum = 0.9});
  train_steps(a, a_opt, 2);
  ddp::save(file.path, a, a_opt);
  net b_model = make_net(3.0F);
  dp_t<Backend> b(b_model, comm);
  ddp::load(file.path, b);
  for (auto [x, y] : {std::pair{&a_model.fc1.weight, &b_model.fc1.weight}, std::pair{&a_model.fc2.bias, &b_model.fc2.bias}})
    REQUIRE(std::equal(x->value().begin(), x->value().end(), y->value().begin(), y->value().end()));
}

/// The net's tensors kept in std::vectors (owning leaves, handed out as ddp::trainable): ddp copies values out to them.
struct owned_net {
  struct tensor {
    std::vector<float> v, g;
    std::vector<std::size_t> shape;
  };
  tensor w1, b1, w2, b2;
  template <class F>
  void visit_parameters(F&& f) {
    f("fc1.weight", ddp::trainable(w1.v, w1.g, w1.shape));
    f("fc1.bias", ddp::trainable(b1.v, b1.g, b1.shape));
    f("fc2.weight", ddp::trainable(w2.v, w2.g, w2.shape));
    f("fc2.bias", ddp::trainable(b2.v, b2.g, b2.shape));
  }
};

/// Loading into owning leaves hands them the loaded values at once, before any step.
template <class Backend, class Comm>
void check_owning_leaves(Comm comm) {
  shared_path file(comm, "owning");
  net a_model = make_net(0.5F);
  dp_t<Backend> a(a_model, comm);
  ddp::optim::sgd a_opt({.lr = 0.1});
  train_steps(a, a_opt, 2);
  ddp::save(file.path, a, a_opt);
  const net other = make_net(4.0F);
  auto own = [](const ddp::parameter<float>& p) {
    return owned_net::tensor{{p.value().begin(), p.value().end()}, std::vector<float>(p.numel()), p.shape()};
  };
  owned_net b_model{own(other.fc1.weight), own(other.fc1.bias), own(other.fc2.weight), own(other.fc2.bias)};
  ddp::data_parallel<owned_net, Backend> b(b_model, comm);
  ddp::load(file.path, b);
  REQUIRE(std::equal(b_model.w1.v.begin(), b_model.w1.v.end(), a_model.fc1.weight.value().begin()));
  REQUIRE(std::equal(b_model.b2.v.begin(), b_model.b2.v.end(), a_model.fc2.bias.value().begin()));
}

/// Another model shape or optimizer type: every rank throws, naming the first differing tensors.
template <class Backend, class Comm>
void check_mismatch(Comm comm) {
  shared_path file(comm, "mismatch");
  net a_model = make_net(0.5F);
  dp_t<Backend> a(a_model, comm);
  ddp::optim::adamw a_opt({});
  ddp::save(file.path, a, a_opt);
  net wide_model = make_net(0.5F, 8);
  dp_t<Backend> wide(wide_model, comm);
  ddp::optim::adamw wide_opt({});
  REQUIRE_THROWS_WITH(ddp::load(file.path, wide, wide_opt),
                    Catch::Contains("'fc1.weight' is f32 [7, 5] in the file but f32 [8, 5] in the model"));
  ddp::optim::sgd other_opt({.lr = 0.1, .momentum = 0.5});  // another optimizer type: state names differ
  REQUIRE_THROWS_WITH(ddp::load(file.path, a, other_opt),
                    Catch::Contains("missing from the file, first 'optim.fc1.weight.momentum_buffer'") &&
                        Catch::Contains("that the model lacks, first 'optim.fc1.weight.exp_avg'"));
}

/// Grouped AdamW with a warmup + cosine schedule, saved after 3 steps (full file under replicate, sharded under
/// full_shard): loaded into the same settings it resumes bit-identically on the curve; other groups or another
/// schedule are a mismatch_error on every rank naming what differs.
template <class Backend, class Comm>
void check_groups_and_schedule(Comm comm) {
  shared_path file(comm, "groups");
  shared_path dir(comm, "groups_sharded", "");
  const auto make = [](std::vector<ddp::optim::adamw::group> groups, ddp::optim::schedule s) {
    return ddp::optim::adamw({.lr = 0.01, .weight_decay = 0.1, .groups = std::move(groups), .lr_schedule = std::move(s)});
  };
  const std::vector<ddp::optim::adamw::group> groups{{.name = "no_decay", .match = {"*.bias"}, .weight_decay = 0},
                                                     {.name = "fc2", .match = {"fc2.weight"}, .lr_scale = 0.5}};
  const ddp::optim::schedule curve = ddp::optim::schedules::warmup_cosine{.warmup = 2, .steps = 5};
  net a_model = make_net(0.5F);
  dp_t<Backend> a(a_model, comm);
  auto a_opt = make(groups, curve);
  train_steps(a, a_opt, 3);
  ddp::save(file.path, a, a_opt);
  net s_model = make_net(0.5F);
  dp_t<Backend, ddp::full_shard> s(s_model, comm);
  auto s_opt = make(groups, curve);
  train_steps(s, s_opt, 3);
  ddp::save_sharded(dir.path, s, s_opt);

  net b_model = make_net(9.0F);
  dp_t<Backend> b(b_model, comm);
  auto b_opt = make(groups, curve);
  REQUIRE(ddp::load(file.path, b, b_opt).at("optim.schedule") == curve.describe());
  train_steps(a, a_opt, 2);
  train_steps(b, b_opt, 2);
  REQUIRE(snapshot(b, b_opt) == snapshot(a, a_opt));  // the rest of the curve, bit-identical

  auto other_groups = make({groups[0]}, curve);
  REQUIRE_THROWS_AS(ddp::load(file.path, b, other_groups), ddp::mismatch_error);
  REQUIRE_THROWS_WITH(ddp::load(file.path, b, other_groups),
                      Catch::Contains("optim.groups is 'group 1 ('no_decay')") && Catch::Contains("group 2 ('fc2')") &&
                          !Catch::Contains("optim.schedule"));
  auto other_schedule = make(groups, ddp::optim::schedules::cosine{.steps = 5});
  REQUIRE_THROWS_WITH(ddp::load(file.path, b, other_schedule),
                      Catch::Contains("optim.schedule is 'warmup_cosine(warmup=2, steps=5") &&
                          Catch::Contains("but 'cosine(steps=5, eta_min=0)' here"));
  auto plain = ddp::optim::adamw({.lr = 0.01, .weight_decay = 0.1});
  REQUIRE_THROWS_WITH(ddp::load_sharded(dir.path, s, plain),
                      Catch::Contains("manifest.json") && Catch::Contains("but 'no groups' here") &&
                          Catch::Contains("but 'constant' here"));
  auto same = make(groups, curve);
  REQUIRE(ddp::load_sharded(dir.path, s, same).at("optim.step") == "3");
}

/// A missing file and a flipped byte: io_error on every rank with the path.
template <class Backend, class Comm>
void check_corrupt(Comm comm) {
  shared_path file(comm, "corrupt");
  net a_model = make_net(0.5F);
  dp_t<Backend> a(a_model, comm);
  ddp::optim::adamw a_opt({});
  REQUIRE_THROWS_AS(ddp::load(file.path, a, a_opt), ddp::io_error);  // not written yet
  ddp::save(file.path, a, a_opt);
  if (comm.rank() == 0) {
    std::fstream f(file.path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  comm.barrier().wait();
  REQUIRE_THROWS_WITH(ddp::load(file.path, a, a_opt), Catch::Contains("checksum") && Catch::Contains(file.path.string()));
}

}  // namespace

#define DDP_CHECKPOINT_SCENARIOS(X)                                                                        \
  X(check_resume, "save then load restores parameters, optimizer state and step count, and training resumes") \
  X(check_parameters_only, "load without an optimizer takes only the parameters")                         \
  X(check_owning_leaves, "owning leaves (std::vector via ddp::trainable) take the loaded values at once")   \
  X(check_mismatch, "loading into a different model names the first differing tensor on every rank")      \
  X(check_corrupt, "a corrupt or missing checkpoint fails on every rank with the path")                   \
  X(check_groups_and_schedule, "parameter groups and the lr schedule resume on the curve and are checked on load")

#define DDP_TCP_CASE(fn, title)                                                                          \
  TEST_CASE("tcp: " title, "[tcp]") {                                                                     \
    for (const int n : {1, 2, 3})                                                                         \
      ddp::testing::require_all_ok(                                                                       \
          ddp::testing::run_ranks(n, [](int) { fn<ddp::backend::tcp>(ddp::tcp::communicator::from_env()); })); \
  }
DDP_CHECKPOINT_SCENARIOS(DDP_TCP_CASE)

#if defined(DDP_WITH_MPI)
namespace {
ddp::mpi::communicator world() { return ddp::mpi::communicator::world({.timeout = std::chrono::seconds(30)}); }
}  // namespace

#define DDP_MPI_CASE(fn, title) \
  TEST_CASE("mpi: " title, "[mpi]") { fn<ddp::backend::mpi>(world()); }
DDP_CHECKPOINT_SCENARIOS(DDP_MPI_CASE)
#endif

TEST_CASE("PyTorch reads ddp's checkpoint and ddp reads PyTorch's file", "[interop]") {
  ddp::tcp::communicator comm(ddp::tcp::config{});  // a world of one: no launcher needed
  shared_path file(comm, "to_torch");
  const auto back = std::filesystem::path(file.path.string() + ".back");
  net model = make_net(2.0F);
  dp_t<ddp::backend::tcp> dp(model, comm);
  ddp::optim::adamw opt({.lr = 0.01});
  train_steps(dp, opt, 1);
  ddp::save(file.path, dp, opt);
  if (comm.rank() != 0) return;
  const std::string cmd = "/usr/bin/python3 " DDP_CHECKPOINT_TEST_DIR "/torch_interop.py '" + file.path.string() +
                          "' '" + back.string() + "'";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const auto ours = ddp::safetensors::file::read(file.path);
  const auto theirs = ddp::safetensors::file::read(back);  // no ddp.checksum there: structure checks only
  std::filesystem::remove(back);
  REQUIRE(theirs.metadata().count("written_by") == 1);
  REQUIRE(theirs.entries().size() == ours.entries().size() + 1);
  for (const auto& e : ours.entries()) {
    const auto* t = theirs.find(e.name);
    REQUIRE(t != nullptr);
    REQUIRE(t->shape == e.shape);
    REQUIRE(t->type == ddp::dtype::f32);
    const auto* x = reinterpret_cast<const float*>(e.bytes.data());
    const auto* y = reinterpret_cast<const float*>(t->bytes.data());
    for (std::size_t i = 0; i < e.numel(); ++i) CHECK(y[i] == 2 * x[i] + 1);
  }
  const auto* extra = theirs.find("python.extra");
  REQUIRE(extra != nullptr);
  REQUIRE(reinterpret_cast<const float*>(extra->bytes.data())[4] == 4.0F);
}
