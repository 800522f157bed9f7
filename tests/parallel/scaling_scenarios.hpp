#pragma once
// Dynamic loss scaling (data_parallel_options::loss_scaling), written once for any communicator. REQUIRE only: under
// run_ranks a rank fails by throwing.
//
// N ranks multiply their loss by dp.loss_scale(); at one step the last rank's owned gradients get a NaN after they
// are averaged, so only that rank sees the overflow. Every rank must skip that step (one all-reduce of the flag), the
// scale must follow GradScaler's rule exactly (written here on its own: ×backoff after an overflow, ×growth after
// growth_interval clean steps), and the parameters must equal one process that skips the same step. The scales are
// powers of two, so scaling and unscaling change no bit of an f32 gradient that neither overflows nor underflows.

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/core/error.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "mlp.hpp"
#include "scenarios.hpp"

namespace ddp_test {

inline constexpr int scaling_steps = 9;
inline constexpr int overflow_step = 4;
inline const ddp::loss_scaling test_scaling{.enabled = true, .init_scale = 1024.0, .growth_interval = 2};

/// GradScaler's rule, step by step: the scale each step uses, given which steps overflow.
inline std::vector<double> expected_scales(const ddp::loss_scaling& s, int n, int overflow) {
  std::vector<double> out;
  double scale = s.init_scale;
  std::uint64_t clean = 0;
  for (int k = 0; k < n; ++k) {
    out.push_back(scale);
    if (k == overflow) {
      scale *= s.backoff_factor;
      clean = 0;
    } else if (++clean == s.growth_interval) {
      scale *= s.growth_factor;
      clean = 0;
    }
  }
  return out;
}

/// One process on the whole batch, skipping the overflowing step (its gradients dropped).
inline mlp scaling_reference() {
  mlp m = make_mlp(1);
  ddp::optim::adamw opt({.lr = 0.01, .weight_decay = 0.05});
  const auto buffers = per_parameter_buffers(m);
  for (int s = 0; s < scaling_steps; ++s) {
    zero_grad(m);
    forward_backward(m, make_batch(static_cast<std::uint64_t>(s), global_batch), 1.0F / global_batch, [](auto&) {});
    if (s != overflow_step) opt.step(buffers);
  }
  return m;
}

/// N ranks with policies Ps and loss scaling: the same steps skipped on every rank, GradScaler's scales exactly,
/// the reference's parameters.
template <class... Ps, class Comm>
void check_loss_scaling(Comm comm, typename ddp::policies<Ps...>::sharding sharding = {}) {
  mlp model = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));
  const auto scales = expected_scales(test_scaling, scaling_steps, overflow_step);
  {
    ddp::data_parallel<mlp, Ps...> dp{model, comm, sharding, ddp::data_parallel_options{.loss_scaling = test_scaling}};
    auto scope = [&](auto& l) { return dp.unshard(l); };
    auto report = [&](auto& x) { dp.gradient_ready(x); };
    const auto [begin, count] = shard_of(comm.rank(), comm.size());
    ddp::optim::adamw opt({.lr = 0.01, .weight_decay = 0.05});
    for (int s = 0; s < scaling_steps; ++s) {
      INFO("step " << s);
      REQUIRE(dp.loss_scale() == scales[static_cast<std::size_t>(s)]);
      dp.zero_grad();
      const float scale = static_cast<float>(comm.size() * dp.loss_scale()) / global_batch;
      forward_backward(model, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count), scale,
                       report, scope);
      dp.finish_gradients();
      if (s == overflow_step && comm.rank() == comm.size() - 1)
        for (const auto& b : dp.owned_buffers())
          if (b.grads.size > 0) static_cast<float*>(b.grads.data)[0] = INFINITY;
      REQUIRE(dp.unscale_gradients() == (s == overflow_step));
      dp.step(opt);
    }
    REQUIRE(dp.loss_scale() == expected_scales(test_scaling, scaling_steps + 1, overflow_step).back());
    dp.verify_in_sync();
    dp.unshard_model();
  }
  mlp want = scaling_reference();
  require_close(model, want, 1e-5, closeness::per_element);
}

/// The scale and growth tracker travel in the checkpoints' metadata and come back with ddp::load; bad settings are
/// a config_error.
template <class... Ps, class Comm>
void check_loss_scaling_checkpoint(Comm comm, const std::filesystem::path& file) {
  ddp::loss_scaling bad = test_scaling;
  bad.backoff_factor = 2;
  mlp other = make_mlp(1);
  REQUIRE_THROWS_AS((ddp::data_parallel<mlp, Ps...>{other, comm, ddp::data_parallel_options{.loss_scaling = bad}}),
                    ddp::config_error);
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Ps...> dp{model, comm, ddp::data_parallel_options{.loss_scaling = test_scaling}};
  auto scope = [&](auto& l) { return dp.unshard(l); };
  auto report = [&](auto& x) { dp.gradient_ready(x); };
  ddp::optim::sgd opt({.lr = 0.1});
  for (int s = 0; s < 3; ++s) {
    dp.zero_grad();
    forward_backward(model, make_batch(static_cast<std::uint64_t>(s), 4), static_cast<float>(dp.loss_scale()) / 4,
                     report, scope);
    dp.step(opt);
  }
  const double scale = dp.loss_scale();
  REQUIRE(scale == 2048.0);  // grew once after two clean steps; one clean step since
  ddp::save(file, dp, opt);
  mlp fresh = make_mlp(1);
  ddp::data_parallel<mlp, Ps...> resumed{fresh, comm, ddp::data_parallel_options{.loss_scaling = test_scaling}};
  ddp::optim::sgd opt2({.lr = 0.1});
  ddp::load(file, resumed, opt2);
  REQUIRE(resumed.loss_scale() == scale);
  REQUIRE(resumed.loss_scale_growth_tracker() == 1);
}

}  // namespace ddp_test
