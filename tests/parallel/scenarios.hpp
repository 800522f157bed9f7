#pragma once
// Test scenarios of data_parallel, written once for any communicator (run under TCP and MPI). They use
// REQUIRE only: under run_ranks a rank fails by throwing.
//
// Equivalence: N ranks, each on a disjoint (possibly uneven) shard of a global batch of B samples,
// scale their loss by N/B so the average of the ranks' gradients is the whole batch's mean gradient;
// after several steps their parameters must equal one process stepping the same optimizer on the whole
// batch. Tolerance, per element: |a − b| ≤ tol·max(|b|, 1e-2) with tol = 1e-5 for f32 gradients
// (reductions sum in a different order); with bf16/fp16 gradient compression (8 resp. 11 bits of
// mantissa) per tensor: |a − b| ≤ tol·max|b| over the tensor, tol = 1e-2.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/core/error.hpp>
#include <ddp/optim/adamw.hpp>
#include <ddp/optim/sgd.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "foreign_mlp.hpp"
#include "mlp.hpp"

namespace ddp_test {

inline constexpr std::size_t global_batch = 10;  // uneven over 3 and 4 ranks
inline constexpr int steps = 4;

/// Samples [begin, begin + count) of the global batch that `rank` of `n` trains on.
inline std::pair<std::size_t, std::size_t> shard_of(int rank, int n) {
  const std::size_t r = static_cast<std::size_t>(rank), size = static_cast<std::size_t>(n);
  const std::size_t begin = r * global_batch / size, end = (r + 1) * global_batch / size;
  return {begin, end - begin};
}

/// The grouped kinds: biases in a group without weight decay (by pattern or predicate), a layer with its own lr
/// scale and momentum or beta1, and a schedule over the steps (warmup + cosine, one-cycle).
enum class optimizer_kind { sgd_momentum, sgd_nesterov, adamw, sgd_grouped, adamw_grouped };

/// Runs `body(opt)` with the optimizer `k` names.
template <class F>
void with_optimizer(optimizer_kind k, F&& body) {
  switch (k) {
    case optimizer_kind::sgd_momentum: { ddp::optim::sgd o({.lr = 0.1, .momentum = 0.9, .dampening = 0.1}); body(o); break; }
    case optimizer_kind::sgd_nesterov: {
      ddp::optim::sgd o({.lr = 0.05, .momentum = 0.8, .nesterov = true, .weight_decay = 0.01});
      body(o);
      break;
    }
    case optimizer_kind::adamw: { ddp::optim::adamw o({.lr = 0.01, .weight_decay = 0.05}); body(o); break; }
    case optimizer_kind::sgd_grouped: {
      const auto bias = [](std::string_view name) { return name.ends_with(".bias"); };
      ddp::optim::sgd o({.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01,
                         .groups = {{.name = "no_decay", .match = {bias, "bias"}, .weight_decay = 0, .momentum = 0.5},
                                    {.name = "fc1", .match = {"fc1.weight"}, .lr_scale = 2}},
                         .lr_schedule = ddp::optim::schedules::one_cycle{.steps = steps}});
      body(o);
      break;
    }
    case optimizer_kind::adamw_grouped: {
      ddp::optim::adamw o({.lr = 0.01, .weight_decay = 0.05,
                           .groups = {{.name = "no_decay", .match = {"*.bias"}, .weight_decay = 0},
                                      {.name = "fc2", .match = {"fc2.w*"}, .lr_scale = 0.5, .beta1 = 0.8}},
                           .lr_schedule = ddp::optim::schedules::warmup_cosine{.warmup = 2, .steps = steps,
                                                                                .start_factor = 0.1}});
      body(o);
      break;
    }
  }
}

/// Splits `mine` into `micro` micro-batches: runs `pass` on each but the last inside dp.no_sync() (closed after it:
/// sharded policies complete the micro-batch's reduce-scatters), then on the last outside, where the step syncs.
template <class DP, class Pass>
void over_micro_batches(DP& dp, const batch& mine, int micro, Pass&& pass) {
  const auto cut = [&](int m) { return mine.n * static_cast<std::size_t>(m) / static_cast<std::size_t>(micro); };
  for (int m = 0; m + 1 < micro; ++m) {
    auto guard = dp.no_sync();
    pass(mine.slice(cut(m), cut(m + 1) - cut(m)));
    guard.close();
  }
  pass(mine.slice(cut(micro - 1), mine.n - cut(micro - 1)));
}

/// One process on the whole batch stepping `opt`: the ground truth.
template <class Opt>
mlp reference_training_with(Opt& opt) {
  mlp m = make_mlp(1);
  const auto buffers = per_parameter_buffers(m);
  for (int s = 0; s < steps; ++s) {
    zero_grad(m);
    forward_backward(m, make_batch(static_cast<std::uint64_t>(s), global_batch), 1.0F / global_batch, [](auto&) {});
    opt.step(buffers);
  }
  return m;
}

/// One process on the whole batch with the optimizer `k` names.
inline mlp reference_training(optimizer_kind k) {
  mlp m;
  with_optimizer(k, [&](auto& opt) { m = reference_training_with(opt); });
  return m;
}

/// How require_close scales the tolerance.
enum class closeness { per_element, per_tensor };

/// Every parameter of `got` within tolerance of `want`.
inline void require_close(mlp& got, mlp& want, double tol, closeness how) {
  std::vector<std::pair<std::string, std::vector<float>>> expected;
  ddp::visit_parameters(want, [&](std::string_view name, ddp::parameter<float>& p) {
    expected.emplace_back(std::string(name), std::vector<float>(p.value().begin(), p.value().end()));
  });
  std::size_t k = 0;
  ddp::visit_parameters(got, [&](std::string_view name, ddp::parameter<float>& p) {
    INFO("parameter " << name);
    REQUIRE(expected[k].first == name);
    double largest = 0;
    for (const float b : expected[k].second) largest = std::max(largest, double(std::abs(b)));
    double worst = 0;
    for (std::size_t i = 0; i < p.numel(); ++i) {
      const double a = p.value()[i], b = expected[k].second[i];
      worst = std::max(worst, std::abs(a - b) / (how == closeness::per_element ? std::max(std::abs(b), 1e-2) : largest));
    }
    REQUIRE(worst <= tol);
    ++k;
  });
}

/// N ranks with policies Ps (the sharding policy's value `sharding`) give the reference's parameters;
/// `micro` > 1 accumulates that many micro-batches per step, all but the last under no_sync. Model is mlp
/// (ddp::parameter leaves) or a foreign_mlp (ddp::trainable leaves over vectors or spans). Returns the trained
/// parameters (as an mlp).
template <class Model, class... Ps, class Comm>
mlp check_equivalence_of(Comm comm, optimizer_kind k, double tol, int micro = 1,
                          closeness how = closeness::per_element,
                          typename ddp::policies<Ps...>::sharding sharding = {},
                          ddp::data_parallel_options options = {}) {
  mlp base = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));  // rank 0's values are broadcast
  std::optional<Model> foreign;
  if constexpr (!std::is_same_v<Model, mlp>) foreign.emplace(make_foreign<typename Model::storage>(base));
  Model& model = [&]() -> Model& {
    if constexpr (std::is_same_v<Model, mlp>)
      return base;
    else
      return *foreign;
  }();
  {  // the model is compared after the wrapper is gone: it must hand the trained values back
    ddp::data_parallel<Model, Ps...> dp{model, comm, sharding, options};
    auto scope = [&](auto& l) { return dp.unshard(l); };
    const auto [begin, count] = shard_of(comm.rank(), comm.size());
    const float scale = static_cast<float>(comm.size()) / global_batch;
    auto report = [&](auto& p) { dp.gradient_ready(leaf_of(p)); };
    with_optimizer(k, [&](auto& opt) {
      for (int s = 0; s < steps; ++s) {
        dp.zero_grad();
        const batch mine = make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count);
        over_micro_batches(dp, mine, micro, [&](const batch& b) { forward_backward(model, b, scale, report, scope); });
        dp.step(opt);
      }
    });
    dp.unshard_model();  // full_shard: the model's own parameters take the trained values
  }
  if constexpr (!std::is_same_v<Model, mlp>) copy_back(*foreign, base);
  mlp want = reference_training(k);
  require_close(base, want, tol, how);
  return base;
}

/// check_equivalence_of the mlp of ddp::parameter leaves.
template <class... Ps, class Comm>
mlp check_equivalence(Comm comm, optimizer_kind k, double tol, int micro = 1,
                      closeness how = closeness::per_element, typename ddp::policies<Ps...>::sharding sharding = {},
                      ddp::data_parallel_options options = {}) {
  return check_equivalence_of<mlp, Ps...>(comm, k, tol, micro, how, sharding, std::move(options));
}

/// A rank whose model differs makes every rank throw mismatch_error naming the entry on each rank.
template <class Backend, class Comm>
void check_mismatch(Comm comm) {
  mlp model = make_mlp(1, comm.rank() == 1 ? h2_dim + 1 : h2_dim);
  try {
    ddp::data_parallel<mlp, Backend> dp{model, comm};
    FAIL("no mismatch_error although rank 1's fc2 is wider");
  } catch (const ddp::mismatch_error& e) {
    const std::string what = e.what();
    INFO(what);
    REQUIRE(what.find("rank 0 has 'fc2.weight f32[11, 13]'") != std::string::npos);
    REQUIRE(what.find("rank 1 has 'fc2.weight f32[12, 13]'") != std::string::npos);
    REQUIRE(e.rank() == comm.rank());
  }
}

/// A parameter that never reports is named in finish_gradients' error; the wrapper stays usable.
template <class Backend, class Comm>
void check_missing_report(Comm comm) {
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Backend, ddp::bucket_bytes<64, 32>> dp{model, comm};
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  const batch b = make_batch(0, 4);
  forward_backward(model, b, 1.0F, report, no_scope{}, {"fc2.weight"});
  try {
    dp.finish_gradients();
    FAIL("finish_gradients did not notice that fc2.weight never reported");
  } catch (const ddp::error& e) {
    INFO(e.what());
    REQUIRE(std::string(e.what()).find("'fc2.weight' did not report") != std::string::npos);
  }
  dp.zero_grad();
  forward_backward(model, b, 1.0F, report);
  dp.finish_gradients();
  REQUIRE_THROWS_AS(dp.gradient_ready(make_mlp(1).fc1.bias), ddp::config_error);
}

/// Parameters declared unused need not report; their gradients stay as the user left them (zero).
template <class Backend, class Comm>
void check_declared_unused(Comm comm) {
  mlp model = make_mlp(1);
  const std::vector<float> bias_before(model.fc1.bias.value().begin(), model.fc1.bias.value().end());
  const std::vector<float> weight_before(model.fc1.weight.value().begin(), model.fc1.weight.value().end());
  ddp::data_parallel<mlp, Backend, ddp::bucket_bytes<64, 32>> dp{model, comm, {.unused_parameters = {"fc1.bias"}}};
  ddp::optim::sgd opt({.lr = 0.1});
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  for (int s = 0; s < 2; ++s) {
    dp.zero_grad();
    forward_backward(model, make_batch(static_cast<std::uint64_t>(s), 4), 1.0F, report, no_scope{}, {"fc1.bias"});
    dp.step(opt);
  }
  REQUIRE(std::vector<float>(model.fc1.bias.value().begin(), model.fc1.bias.value().end()) == bias_before);
  REQUIRE(std::vector<float>(model.fc1.weight.value().begin(), model.fc1.weight.value().end()) != weight_before);
  mlp other = make_mlp(1);
  REQUIRE_THROWS_AS((ddp::data_parallel<mlp, Backend>{other, comm, {.unused_parameters = {"fc9.bias"}}}),
                  ddp::config_error);
}

/// Rank 0's values reach every rank; with broadcast off, each rank keeps its own.
template <class Backend, class Comm>
void check_broadcast(Comm comm) {
  const mlp rank0 = make_mlp(1);
  mlp model = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));
  {
    ddp::data_parallel<mlp, Backend> dp{model, comm};
    REQUIRE(std::equal(model.fc2.weight.value().begin(), model.fc2.weight.value().end(),
                     rank0.fc2.weight.value().begin()));
  }
  mlp own = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));
  const mlp copy = own;
  ddp::data_parallel_options keep_own;
  keep_own.broadcast_parameters = false;
  ddp::data_parallel<mlp, Backend> dp{own, comm, keep_own};
  REQUIRE(std::equal(own.fc3.bias.value().begin(), own.fc3.bias.value().end(), copy.fc3.bias.value().begin()));
}

}  // namespace ddp_test

namespace ddp_test {

/// hybrid groups: 2 ranks a group where the world is even (2×2 at N = 4), else 1 (pure replication of shards).
template <class Inner>
ddp::hybrid<Inner> hybrid_groups(int world) {
  return {.group_size = world % 2 == 0 ? 2 : 1};
}

/// Sharding units finer than the top-level fields: one per parameter (unit_depth 2), or fc2 as one unit and
/// the rest per parameter; a listed unit that covers no parameter is a config_error naming it.
inline ddp::data_parallel_options per_parameter_units(std::vector<std::string> units = {}) {
  ddp::data_parallel_options o;
  o.units = std::move(units);
  o.unit_depth = 2;
  return o;
}

template <class Backend, class Comm>
void check_unit_errors(Comm comm) {
  mlp model = make_mlp(1);
  ddp::data_parallel_options o;
  o.units = {"fc2", "fc4"};
  try {
    ddp::data_parallel<mlp, Backend, ddp::full_shard> dp{model, comm, o};
    FAIL("a unit that covers no parameter was accepted");
  } catch (const ddp::config_error& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("'fc4'") && Catch::Contains("covers no parameter"));
  }
}

/// verify_in_sync: replicas that trained together pass; a parameter changed on one rank makes every rank throw
/// mismatch_error naming it and the ranks that disagree. Under full_shard the owned blocks are compared with
/// the ranks owning the same ones: across the groups under hybrid (2 groups of 2 at N = 4), none without.
template <class Backend, class Sharding, class Comm>
void check_verify_in_sync(Comm comm, Sharding sharding = {}) {
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Backend, Sharding> dp{model, comm, sharding};
  ddp::optim::adamw opt({.lr = 0.01});
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  auto scope = [&](linear& l) { return dp.unshard(l); };
  dp.verify_in_sync();
  for (int s = 0; s < 2; ++s) {
    dp.zero_grad();
    const auto [begin, count] = shard_of(comm.rank(), comm.size());
    forward_backward(model, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count), 1.0F, report,
                     scope);
    dp.step(opt);
  }
  dp.verify_in_sync();
  if (comm.size() < 2) return;
  constexpr bool owned = !std::is_same_v<Sharding, ddp::replicate> && !std::is_same_v<Sharding, ddp::shard_grad_op>;
  if (comm.rank() == 1) {
    if constexpr (owned) {  // rank 1's first owned value (under hybrid rank 3 owns the same block)
      static_cast<float*>(dp.owned_buffers()[0].values.data)[0] += 1.0F;
    } else {
      model.fc2.bias.value()[3] += 1.0F;
    }
  }
  if constexpr (std::is_same_v<Sharding, ddp::full_shard>) {  // every value has one owner: nothing to compare
    dp.verify_in_sync();
    return;
  }
  try {
    dp.verify_in_sync();
    FAIL("verify_in_sync passed although rank 1 changed a parameter");
  } catch (const ddp::mismatch_error& e) {
    const std::string what = e.what();
    INFO(what);
    REQUIRE(e.rank() == comm.rank());
    REQUIRE_THAT(what, Catch::Contains("verify_in_sync: the replicas differ at parameter '") &&
                           Catch::Contains("reported before it was final"));
    if constexpr (owned) {
      REQUIRE_THAT(what, Catch::Contains("rank 1 holds one value; rank 3 holds another"));
    } else {
      REQUIRE_THAT(what, Catch::Contains("'fc2.bias'") && Catch::Contains("rank 1 holds another"));
    }
  }
}

/// verify_every = 1: rank 1 steps another optimizer at step 2; that step throws on every rank, the earlier ones
/// do not.
template <class Backend, class Comm>
void check_verify_every(Comm comm) {
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Backend> dp{model, comm, {.verify_every = 1}};
  ddp::optim::sgd same({.lr = 0.1}), other({.lr = 0.2});
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  for (int s = 0; s < 4; ++s) {
    dp.zero_grad();
    forward_backward(model, make_batch(static_cast<std::uint64_t>(s), 4), 1.0F, report);
    try {
      dp.step(s == 2 && comm.rank() == 1 ? other : same);
      REQUIRE((s != 2 || comm.size() == 1));
    } catch (const ddp::mismatch_error& e) {
      INFO(e.what());
      REQUIRE(s == 2);
      REQUIRE_THAT(e.what(), Catch::Contains("at parameter 'fc1.weight'"));
      return;
    }
  }
}

/// The register_hook mistake (a gradient reported before it is final: Tensor::register_hook fires before
/// autograd stores the gradient): each rank reports fc3.bias first, alone in its bucket (5 floats), and writes
/// its local gradient into it only after the bucket's all-reduce is done (a barrier after it completes after it
/// on ddp::tcp, whose engine runs a group's operations in order), so every rank steps its own gradient.
/// verify_every = 1 throws on every rank at the first step, naming fc3.bias (on one rank nothing differs).
template <class Backend, class Comm>
void check_early_report_caught(Comm comm) {
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Backend, ddp::bucket_bytes<20, 20>> dp{model, comm, {.verify_every = 1}};
  ddp::optim::sgd opt({.lr = 0.1});
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  dp.zero_grad();
  dp.gradient_ready(model.fc3.bias);  // too early: its gradient is still zero
  dp.comm().barrier().wait();         // its all-reduce has read the zeros
  forward_backward(model, make_batch(0, global_batch).slice(begin, count), 1.0F, [&](auto& p) {
    if (&p != &model.fc3.bias) dp.gradient_ready(p);
  });
  try {
    dp.step(opt);
    REQUIRE(comm.size() == 1);
  } catch (const ddp::mismatch_error& e) {
    INFO(e.what());
    REQUIRE(comm.size() > 1);
    REQUIRE_THAT(e.what(), Catch::Contains("'fc3.bias'"));
  }
}

/// Units by object train exactly as the same units by name: {unit_of(model.fc2), unit_of(model.fc3.bias)} per
/// parameter otherwise is {"fc2", "fc3.bias"} at unit_depth 2, the same units, layout and parameters.
template <class Backend, class Comm>
void check_units_by_object(Comm comm) {
  const auto train = [&](auto units_of) {
    mlp model = make_mlp(1);
    {
      ddp::data_parallel_options o;
      o.units = units_of(model);
      o.unit_depth = 2;
      ddp::data_parallel<mlp, Backend, ddp::bucket_bytes<200, 60>, ddp::full_shard> dp{model, comm, o};
      REQUIRE((std::vector<std::string>(dp.units().begin(), dp.units().end()) ==
               std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2", "fc3.weight", "fc3.bias"}));
      ddp::optim::adamw opt({.lr = 0.01});
      auto report = [&](auto& p) { dp.gradient_ready(p); };
      auto scope = [&](linear& l) { return dp.unshard(l); };
      const auto [begin, count] = shard_of(comm.rank(), comm.size());
      for (int s = 0; s < 2; ++s) {
        dp.zero_grad();
        forward_backward(model, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count), 1.0F,
                         report, scope);
        dp.step(opt);
      }
      dp.unshard_model();
    }
    return model;
  };
  mlp by_object = train([](mlp& m) { return ddp::unit_list{ddp::unit_of(m.fc2), ddp::unit_of(m.fc3.bias)}; });
  mlp by_name = train([](mlp&) { return ddp::unit_list{"fc2", "fc3.bias"}; });
  require_close(by_object, by_name, 0.0, closeness::per_element);
}

/// full_shard: a gradient reported outside an unshard scope is named as misuse.
template <class Backend, class Comm>
void check_full_shard_misuse(Comm comm) {
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Backend, ddp::full_shard> dp{model, comm};
  try {
    dp.gradient_ready(model.fc2.weight);
    FAIL("full_shard accepted a gradient of a unit outside its unshard scope");
  } catch (const ddp::error& e) {
    INFO(e.what());
    REQUIRE(std::string(e.what()).find("dp.unshard(model.fc2)") != std::string::npos);
  }
  auto g = dp.unshard(model.fc2);
  REQUIRE(std::any_of(model.fc2.weight.value().begin(), model.fc2.weight.value().end(), [](float v) { return v != 0; }));
}

}  // namespace ddp_test

namespace ddp_test {

/// Spans are pointed at the arenas while wrapped and back at the model's memory afterwards, with the trained
/// values; vectors keep their memory; an owning leaf cannot be sharded by full_shard (config_error naming it).
template <class Backend, class Comm>
void check_leaf_binding(Comm comm) {
  mlp base = make_mlp(1);
  auto spans = make_foreign<std::span<float>>(base);
  auto vectors = make_foreign<std::vector<float>>(base);
  const float* home = spans.memory[0].data();
  const float* own = vectors.fc1.weight.v.data();
  {
    ddp::data_parallel<foreign_mlp<std::span<float>>, Backend> dp{spans, comm};
    ddp::data_parallel<foreign_mlp<std::vector<float>>, Backend> dv{vectors, comm};
    REQUIRE(spans.fc1.weight.v.data() != home);
    REQUIRE(vectors.fc1.weight.v.data() == own);
    ddp::optim::sgd opt({.lr = 0.5});
    forward_backward(spans, make_batch(0, 4), 1.0F, [&](auto& t) { dp.gradient_ready(t.v); });
    dp.step(opt);
    forward_backward(vectors, make_batch(0, 4), 1.0F, [&](auto& t) { dv.gradient_ready(t.v); });
    dv.step(opt);
    REQUIRE(std::equal(spans.fc1.weight.v.begin(), spans.fc1.weight.v.end(), vectors.fc1.weight.v.begin()));
    REQUIRE_FALSE(std::equal(spans.fc1.weight.v.begin(), spans.fc1.weight.v.end(), base.fc1.weight.value().begin()));
  }
  REQUIRE(spans.fc1.weight.v.data() == home);
  REQUIRE(std::equal(spans.fc1.weight.v.begin(), spans.fc1.weight.v.end(), vectors.fc1.weight.v.begin()));
  try {
    ddp::data_parallel<foreign_mlp<std::vector<float>>, Backend, ddp::full_shard> dp{vectors, comm};
    FAIL("full_shard accepted leaves that keep their own memory");
  } catch (const ddp::config_error& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("'fc1.weight'") && Catch::Contains("shard_grad_op"));
  }
}

}  // namespace ddp_test

namespace ddp_test {

/// Deterministic reduction in one process: each of `n` ranks' gradients computed alone, summed in rank order
/// ((g0 + g1) + g2 ...) and averaged as ddp's host code averages, then the optimizer; the bits N ranks with
/// the policies' deterministic knob must reproduce under every policy, backend and bucket size.
inline mlp deterministic_reference(optimizer_kind k, int n, std::size_t h2 = h2_dim) {
  mlp m = make_mlp(1, h2);
  with_optimizer(k, [&](auto& opt) {
    const auto buffers = per_parameter_buffers(m);
    for (int s = 0; s < steps; ++s) {
      const batch whole = make_batch(static_cast<std::uint64_t>(s), global_batch);
      std::vector<std::vector<float>> sum;
      for (int r = 0; r < n; ++r) {
        zero_grad(m);
        const auto [begin, count] = shard_of(r, n);
        forward_backward(m, whole.slice(begin, count), static_cast<float>(n) / global_batch, [](auto&) {});
        std::size_t i = 0;
        ddp::visit_parameters(m, [&](std::string_view, ddp::parameter<float>& p) {
          if (r == 0) sum.emplace_back(p.grad().begin(), p.grad().end());
          else
            for (std::size_t e = 0; e < p.numel(); ++e) sum[i][e] = sum[i][e] + p.grad()[e];
          ++i;
        });
      }
      std::size_t i = 0;
      ddp::visit_parameters(m, [&](std::string_view, ddp::parameter<float>& p) {
        std::copy(sum[i].begin(), sum[i].end(), p.grad().begin());
        ddp::detail::divide(ddp::raw_tensor::of(p.grad()), n);
        ++i;
      });
      opt.step(buffers);
    }
  });
  return m;
}

/// N ranks whose sharding policy (among Ps) has its deterministic knob on end with exactly the bits of
/// deterministic_reference (hybrid: the same bits with one bucket and with many, as its sums nest by group).
/// A wide `h2` makes buckets beyond 64 KiB, where ddp::tcp's all-reduce runs a ring that sums in another order.
template <class... Ps, class Comm>
void check_deterministic(Comm comm, optimizer_kind k, typename ddp::policies<Ps...>::sharding sharding = {},
                         std::size_t h2 = h2_dim) {
  int group_size = 0;
  if constexpr (requires { sharding.inner; }) {
    sharding.inner.deterministic = true;
    group_size = sharding.group_size;
  } else {
    sharding.deterministic = true;
  }
  const auto train = [&]<class... Qs>() {
    mlp model = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()), h2);
    {
      ddp::data_parallel<mlp, Qs...> dp{model, comm, sharding};
      auto scope = [&](auto& l) { return dp.unshard(l); };
      const auto [begin, count] = shard_of(comm.rank(), comm.size());
      const float scale = static_cast<float>(comm.size()) / global_batch;
      with_optimizer(k, [&](auto& opt) {
        for (int s = 0; s < steps; ++s) {
          dp.zero_grad();
          forward_backward(model, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count), scale,
                           [&](auto& p) { dp.gradient_ready(p); }, scope);
          dp.step(opt);
        }
      });
      dp.unshard_model();
    }
    std::vector<float> bits;
    ddp::visit_parameters(model, [&](std::string_view, ddp::parameter<float>& p) {
      bits.insert(bits.end(), p.value().begin(), p.value().end());
    });
    return bits;
  };
  const auto many = train.template operator()<Ps..., ddp::bucket_bytes<200, 60>>();
  const auto one = train.template operator()<Ps...>();
  REQUIRE(many == one);  // bucket size changes no bit
  if (group_size == 0 || group_size == comm.size() || group_size == 1) {
    mlp want = deterministic_reference(k, comm.size(), h2);
    std::vector<float> expected;
    ddp::visit_parameters(want, [&](std::string_view, ddp::parameter<float>& p) {
      expected.insert(expected.end(), p.value().begin(), p.value().end());
    });
    REQUIRE(many == expected);  // the bits of one process summing in rank order
  }
}

}  // namespace ddp_test
