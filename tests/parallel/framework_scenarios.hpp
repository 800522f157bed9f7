#pragma once
// Scenarios of models whose framework keeps its own memory (dlib's kind, foreign_mlp<framework_vector>): a backward
// that overwrites its gradients instead of adding, the framework's own optimizer stepping the leaves, and the
// framework moving or freeing a leaf's memory. Each equals one process on the union batch or ends with a named error.

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/core/error.hpp>
#include <ddp/optim/sgd.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "foreign_mlp.hpp"
#include "scenarios.hpp"

namespace ddp_test {

/// A framework's own optimizer over a foreign model's leaves (dlib's solvers' place): plain SGD on each tensor's own
/// values from its own gradient, knowing nothing of ddp.
template <class Storage>
struct framework_sgd {
  foreign_mlp<Storage>& model;
  float lr;
  void step() {
    for (auto* t : model.tensors())
      for (std::size_t i = 0; i < t->numel(); ++i) t->v[i] -= lr * t->g[i];
  }
};

/// One tensor of a framework that computes on its own vectors, handed to ddp as spans over them: ddp adopts the spans
/// (points them at its arenas) while the framework goes on writing its vectors.
struct bypassed_model {
  std::vector<float> w = std::vector<float>(6, 0.5F), dw = std::vector<float>(6, 0.0F);
  std::span<float> w_view{w}, dw_view{dw};
  template <class F>
  void visit_parameters(F&& f) {
    f("w", ddp::trainable(w_view, dw_view));
  }
};

/// One process on the whole batch with ddp::optim::sgd at `lr` (no momentum): framework_sgd's ground truth.
inline mlp reference_plain_sgd(float lr) {
  ddp::optim::sgd opt({.lr = lr});
  return reference_training_with(opt);
}

/// N ranks train foreign_mlp<Storage> over `micro` micro-batches per step, each but the last in no_sync; a framework
/// that overwrites (framework_vector) clears every gradient before each backward, as dlib's does. `make_optimizer(model)`
/// gives the optimizer dp.step(opt) steps. The trained values are compared with `want` after the wrapper is gone.
template <class Storage, class Backend, class Sharding, class Comm, class MakeOptimizer>
void check_foreign_training(Comm comm, int micro, MakeOptimizer make_optimizer, mlp want) {
  mlp base = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));
  auto model = make_foreign<Storage>(base);
  {
    ddp::data_parallel<foreign_mlp<Storage>, Backend, Sharding> dp{model, comm};
    auto opt = make_optimizer(model);
    const auto [begin, count] = shard_of(comm.rank(), comm.size());
    const float scale = static_cast<float>(comm.size()) / global_batch;
    auto report = [&](auto& p) { dp.gradient_ready(leaf_of(p)); };
    auto scope = [&](auto& l) { return dp.unshard(l); };
    for (int s = 0; s < steps; ++s) {
      dp.zero_grad();
      const batch mine = make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count);
      over_micro_batches(dp, mine, micro, [&](const batch& b) {
        if constexpr (std::is_same_v<Storage, framework_vector>)
          for (auto* t : model.tensors()) std::fill(t->g.begin(), t->g.end(), 0.0F);  // the backward overwrites
        forward_backward(model, b, scale, report, scope);
      });
      dp.step(opt);
    }
  }
  copy_back(model, base);
  require_close(base, want, 1e-5, closeness::per_element);
}

/// A framework whose backward overwrites its gradients: no_sync over 2 and 3 micro-batches sums them under replicate
/// and shard_grad_op alike, as one process on the union batch. The framework's own optimizer steps the leaves under
/// replicate (over leaves that overwrite and over leaves that add) and equals one process; a sharded policy refuses
/// it with the fix, before any collective. Spans the framework does not compute through fail the first step.
template <class Backend, class Comm>
void check_framework_leaves(Comm comm) {
  using framework = foreign_mlp<framework_vector>;
  using vectors = foreign_mlp<std::vector<float>>;
  auto adamw = [](auto&) { return ddp::optim::adamw({.lr = 0.01, .weight_decay = 0.05}); };
  for (const int micro : {2, 3}) {
    INFO("micro-batches: " << micro);
    check_foreign_training<framework_vector, Backend, ddp::replicate>(comm, micro, adamw,
                                                                      reference_training(optimizer_kind::adamw));
    check_foreign_training<framework_vector, Backend, ddp::shard_grad_op>(comm, micro, adamw,
                                                                          reference_training(optimizer_kind::adamw));
  }
  constexpr float lr = 0.1F;
  auto own_sgd = [](auto& model) { return framework_sgd<typename std::remove_reference_t<decltype(model)>::storage>{model, lr}; };
  check_foreign_training<framework_vector, Backend, ddp::replicate>(comm, 1, own_sgd, reference_plain_sgd(lr));
  check_foreign_training<framework_vector, Backend, ddp::replicate>(comm, 2, own_sgd, reference_plain_sgd(lr));
  check_foreign_training<std::vector<float>, Backend, ddp::replicate>(comm, 2, own_sgd, reference_plain_sgd(lr));
  mlp base = make_mlp(1);
  framework model = make_foreign<framework_vector>(base);
  ddp::data_parallel<framework, Backend, ddp::shard_grad_op> dp{model, comm};
  framework_sgd<framework_vector> opt{model, lr};
  REQUIRE_THROWS_WITH(dp.step(opt), Catch::Contains("each rank holds only its shard of the averaged gradients") &&
                                        Catch::Contains("train under ddp::replicate"));
  for (const bool check : {true, false}) {  // the framework's backward writes its own vector, never ddp's memory
    bypassed_model bypassed;
    ddp::data_parallel<bypassed_model, Backend> dp3{bypassed, comm, {.check_first_gradients = check}};
    ddp::optim::sgd sgd({.lr = lr});
    std::fill(bypassed.dw.begin(), bypassed.dw.end(), 1.0F);
    dp3.gradient_ready(bypassed.w_view);
    if (check)
      REQUIRE_THROWS_WITH(dp3.step(sgd), Catch::Contains("every averaged gradient of the first step is zero on every "
                                                         "rank") && Catch::Contains("check_first_gradients = false"));
    else
      dp3.step(sgd);
  }
  vectors other = make_foreign<std::vector<float>>(base);
  ddp::data_parallel<vectors, Backend, ddp::shard_grad_op> dp2{other, comm};
  framework_sgd<std::vector<float>> opt2{other, lr};
  REQUIRE_THROWS_AS(dp2.step(opt2), ddp::config_error);
}

}  // namespace ddp_test
