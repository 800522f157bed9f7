#pragma once
// Gradient norm and clipping (dp.grad_norm, dp.clip_grad_norm, data_parallel_options::clip), written once for any
// communicator. REQUIRE only: under run_ranks a rank fails by throwing.
//
// N ranks, each on its shard of scenarios.hpp's global batch, clip the averaged gradient to a max_norm well below
// its norm and step; one process on the whole batch computes the total norm of its gradient in f64, scales it by
// max_norm / (norm + 1e-6) (torch.nn.utils.clip_grad_norm_'s coefficient) and steps. Parameters within 1e-5 per
// element (the reductions sum in another order), the returned norm within 1e-6 relative.

#include <cmath>
#include <cstddef>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/core/error.hpp>
#include <ddp/parallel/data_parallel.hpp>
#include <ddp/parallel/grad_norm.hpp>

#include "mlp.hpp"
#include "scenarios.hpp"

namespace ddp_test {

inline constexpr double clip_max_norm = 0.05;

/// The p-norm of every gradient of `m` in f64 (p = ddp::inf_norm: the largest magnitude).
inline double norm_of_gradients(mlp& m, double p) {
  double acc = 0;
  ddp::visit_parameters(m, [&](std::string_view, ddp::parameter<float>& x) {
    for (const float g : x.grad()) acc = p == ddp::inf_norm ? std::max(acc, double(std::abs(g))) : acc + std::pow(std::abs(double(g)), p);
  });
  return p == ddp::inf_norm ? acc : std::pow(acc, 1 / p);
}

/// One process on the whole batch, clipping every step; the norms before clipping.
inline mlp clip_reference(optimizer_kind k, double p, std::vector<double>& norms) {
  mlp m = make_mlp(1);
  with_optimizer(k, [&](auto& opt) {
    const auto buffers = per_parameter_buffers(m);
    for (int s = 0; s < steps; ++s) {
      zero_grad(m);
      forward_backward(m, make_batch(static_cast<std::uint64_t>(s), global_batch), 1.0F / global_batch, [](auto&) {});
      const double total = norm_of_gradients(m, p);
      norms.push_back(total);
      const double coefficient = clip_max_norm / (total + 1e-6);
      if (coefficient < 1)
        ddp::visit_parameters(m, [&](std::string_view, ddp::parameter<float>& x) {
          for (auto& g : x.grad()) g = static_cast<float>(double(g) * coefficient);
        });
      opt.step(buffers);
    }
  });
  return m;
}

/// How a scenario clips: by dp.clip_grad_norm between the backward and the step, or inside step() by the option.
enum class clip_by { call, option };

/// N ranks with policies Ps clip as `how` says to clip_max_norm in the p-norm and equal clip_reference.
template <class... Ps, class Comm>
void check_clip(Comm comm, optimizer_kind k, clip_by how, double p = 2.0,
                typename ddp::policies<Ps...>::sharding sharding = {}) {
  INFO("clip by " << (how == clip_by::call ? "call" : "option") << ", norm type " << p);
  std::vector<double> want_norms;
  mlp want = clip_reference(k, p, want_norms);
  REQUIRE(want_norms.front() > 4 * clip_max_norm);  // the clip is active
  mlp model = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));
  ddp::data_parallel_options options;
  if (how == clip_by::option) options.clip = {.max_norm = clip_max_norm, .norm = {.norm_type = p}};
  {
    ddp::data_parallel<mlp, Ps...> dp{model, comm, sharding, options};
    auto scope = [&](auto& l) { return dp.unshard(l); };
    auto report = [&](auto& x) { dp.gradient_ready(x); };
    const auto [begin, count] = shard_of(comm.rank(), comm.size());
    const float scale = static_cast<float>(comm.size()) / global_batch;
    with_optimizer(k, [&](auto& opt) {
      for (int s = 0; s < steps; ++s) {
        dp.zero_grad();
        forward_backward(model, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count), scale,
                         report, scope);
        double norm = 0;
        if (how == clip_by::call) {
          REQUIRE(std::abs(dp.grad_norm({.norm_type = p}) - want_norms[s]) <= 1e-6 * want_norms[s]);
          norm = dp.clip_grad_norm(clip_max_norm, {.norm_type = p});
          REQUIRE(dp.grad_norm({.norm_type = p}) <= clip_max_norm * (1 + 1e-5));  // clipped
        }
        dp.step(opt);
        if (how == clip_by::option) norm = dp.last_grad_norm();
        INFO("step " << s);
        REQUIRE(std::abs(norm - want_norms[static_cast<std::size_t>(s)]) <= 1e-6 * want_norms[static_cast<std::size_t>(s)]);
      }
    });
    dp.verify_in_sync();
    dp.unshard_model();
  }
  require_close(model, want, 1e-5, closeness::per_element);
}

/// A non-finite gradient with error_if_nonfinite names the parameter holding it on every rank; a bad norm type is a
/// config_error; inside a join scope the call is refused (the option clips there), and the option's shadow steps keep
/// the ranks alike.
template <class... Ps, class Comm>
void check_clip_errors(Comm comm) {
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Ps...> dp{model, comm};
  auto scope = [&](auto& l) { return dp.unshard(l); };
  auto report = [&](auto& x) { dp.gradient_ready(x); };
  forward_backward(model, make_batch(0, 4), 0.25F, report, scope);
  dp.finish_gradients();
  REQUIRE_THROWS_AS(dp.grad_norm({.norm_type = 0}), ddp::config_error);
  for (const auto& b : dp.owned_buffers())  // a NaN in fc2.bias's gradient, in every piece of it a rank holds
    for (const auto& seg : b.segments)
      if (seg.name == "fc2.bias" && seg.numel > 0) static_cast<float*>(b.grads.data)[seg.offset] = std::nanf("");
  REQUIRE_THROWS_WITH(dp.clip_grad_norm(1.0, {.error_if_nonfinite = true}), Catch::Contains("'fc2.bias'"));
  dp.zero_grad();
  ddp::optim::sgd opt({.lr = 0.1});
  auto j = dp.join();
  REQUIRE_THROWS_AS(dp.clip_grad_norm(1.0), ddp::config_error);
  j.finish(opt);
}

/// Inside a join scope (rank r trains r + 1 batches) the option clips the active ranks' steps and the shadow steps
/// alike: the replicas stay bit for bit the same.
template <class... Ps, class Comm>
void check_clip_join(Comm comm, typename ddp::policies<Ps...>::sharding sharding = {}) {
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Ps...> dp{model, comm, sharding, ddp::data_parallel_options{.clip = {.max_norm = clip_max_norm}}};
  auto scope = [&](auto& l) { return dp.unshard(l); };
  auto report = [&](auto& x) { dp.gradient_ready(x); };
  ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
  {
    auto j = dp.join();
    for (int s = 0; s <= comm.rank(); ++s) {
      dp.zero_grad();
      forward_backward(model, make_batch(static_cast<std::uint64_t>(s), 4), 0.25F, report, scope);
      dp.step(opt);
      REQUIRE(dp.last_grad_norm() > clip_max_norm);
    }
    j.finish(opt);
  }
  dp.verify_in_sync();
}

}  // namespace ddp_test
