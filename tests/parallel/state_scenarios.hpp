#pragma once
// Model state (buffers and frozen parameters) under data_parallel, written once for any communicator. REQUIRE
// only: under run_ranks a rank fails by throwing.
//
// The model is scenarios.hpp's MLP with running statistics: a buffer `running_mean` of fc1's activations
// (momentum 0.1, updated by each rank's forward on its own batch, as BatchNorm's running mean), an i64 buffer
// `batches` counting forwards (BatchNorm's num_batches_tracked), and a frozen parameter `shift` added to the output.
// Every rank builds them from its own seed, so only the wrapper's synchronization makes them agree. The ground truth
// simulates N replicas in one process: the parameters step on the union of the batches (as scenarios.hpp), each
// replica's statistics follow its own batches, and after every step they are synchronized as the mode says —
// rank 0's (PyTorch DDP's broadcast_buffers), the mean, or not at all.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/state.hpp>
#include <ddp/optim/sgd.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "mlp.hpp"
#include "scenarios.hpp"
#include "support/fake_device.hpp"

namespace ddp_test {

/// scenarios.hpp's MLP with model state: two buffers and a frozen parameter.
struct stat_mlp {
  linear fc1, fc2, fc3;
  ddp::buffer<float> running_mean{{h1_dim}};     // of fc1's activations
  ddp::buffer<std::int64_t> batches{{}};         // forwards seen (a 0-dimensional tensor)
  std::vector<float> shift = std::vector<float>(out_dim);  // frozen: added to the output

  template <class F>
  void visit_parameters(F&& f) {
    f("fc1", fc1);
    f("fc2", fc2);
    f("fc3", fc3);
    f("running_mean", running_mean);
    f("batches", batches);
    f("shift", ddp::frozen(shift));
  }
};

/// Parameters from `param_seed` (as make_mlp), state from `state_seed`.
inline stat_mlp make_stat_mlp(std::uint64_t param_seed, std::uint64_t state_seed) {
  const mlp m = make_mlp(param_seed);
  stat_mlp s{m.fc1, m.fc2, m.fc3};
  lcg g(state_seed + 500);
  for (auto& v : s.running_mean.values()) v = g.next();
  s.batches.values()[0] = static_cast<std::int64_t>(state_seed);
  for (auto& v : s.shift) v = g.next();
  return s;
}

/// The forward's statistics: running_mean ← 0.9·running_mean + 0.1·(fc1's activations averaged over the batch).
template <class Linear>
void update_statistics(const Linear& fc1, std::span<float> running_mean, std::int64_t& batches, const batch& b) {
  const auto a = detail::layer_forward(fc1, b.x, b.n, true);
  for (std::size_t j = 0; j < h1_dim; ++j) {
    float sum = 0;
    for (std::size_t s = 0; s < b.n; ++s) sum += a[s * h1_dim + j];
    running_mean[j] = 0.9F * running_mean[j] + 0.1F * (sum / static_cast<float>(b.n));
  }
  ++batches;
}

/// The batch with the frozen shift taken off its targets (loss ½‖f(x) + shift − y‖²).
inline batch shifted(batch b, const std::vector<float>& shift) {
  for (std::size_t i = 0; i < b.y.size(); ++i) b.y[i] -= shift[i % out_dim];
  return b;
}

/// What each of `n` replicas holds after `steps` steps with buffers synchronized as `how` says.
struct state_truth {
  mlp parameters;
  std::vector<std::vector<float>> running_mean;  // per rank
  std::vector<std::int64_t> batches;             // per rank
  std::vector<float> shift;
};

inline state_truth state_reference(int n, ddp::buffer_sync how) {
  const stat_mlp zero = make_stat_mlp(1, 0);  // rank 0's state
  state_truth t{make_mlp(1), {}, {}, zero.shift};
  for (int r = 0; r < n; ++r) {
    const stat_mlp own = make_stat_mlp(1, static_cast<std::uint64_t>(r));
    const bool synced = how != ddp::buffer_sync::never;
    t.running_mean.emplace_back(synced ? zero.running_mean.values().begin() : own.running_mean.values().begin(),
                                synced ? zero.running_mean.values().end() : own.running_mean.values().end());
    t.batches.push_back(synced ? zero.batches.values()[0] : own.batches.values()[0]);
  }
  ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
  const auto buffers = per_parameter_buffers(t.parameters);
  for (int s = 0; s < steps; ++s) {
    const batch all = make_batch(static_cast<std::uint64_t>(s), global_batch);
    for (int r = 0; r < n; ++r) {
      const auto [begin, count] = shard_of(r, n);
      update_statistics(t.parameters.fc1, std::span<float>(t.running_mean[r]), t.batches[r], all.slice(begin, count));
    }
    zero_grad(t.parameters);
    forward_backward(t.parameters, shifted(all, t.shift), 1.0F / global_batch, [](auto&) {});
    opt.step(buffers);
    if (how == ddp::buffer_sync::broadcast) {
      for (int r = 1; r < n; ++r) t.running_mean[r] = t.running_mean[0];
      for (int r = 1; r < n; ++r) t.batches[r] = t.batches[0];
    } else if (how == ddp::buffer_sync::mean) {
      for (std::size_t j = 0; j < h1_dim; ++j) {
        double sum = 0;
        for (int r = 0; r < n; ++r) sum += t.running_mean[r][j];
        for (int r = 0; r < n; ++r) t.running_mean[r][j] = static_cast<float>(sum / n);
      }
      for (int r = 1; r < n; ++r) t.batches[r] = t.batches[0];  // integers take rank 0's
    }
  }
  return t;
}

/// N ranks with policies Ps train stat_mlp with buffers synchronized as `how` says: the parameters equal one process
/// on the union batch, every rank's buffers the simulated replica's, the frozen parameter rank 0's bit for bit, and
/// verify_in_sync passes (it compares the buffers under broadcast and mean, the frozen parameter always).
template <class... Ps, class Comm>
void check_model_state(Comm comm, ddp::buffer_sync how, typename ddp::policies<Ps...>::sharding sharding = {}) {
  INFO("buffer_sync " << static_cast<int>(how));
  const int me = comm.rank();
  stat_mlp model = make_stat_mlp(1 + static_cast<std::uint64_t>(me), static_cast<std::uint64_t>(me));
  {
    ddp::data_parallel<stat_mlp, Ps...> dp{model, comm, sharding, ddp::data_parallel_options{.buffers = how}};
    REQUIRE(dp.model_state().size() == 3);
    auto scope = [&](auto& l) { return dp.unshard(l); };
    auto report = [&](auto& p) { dp.gradient_ready(p); };
    const auto [begin, count] = shard_of(me, comm.size());
    const float scale = static_cast<float>(comm.size()) / global_batch;
    ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
    for (int s = 0; s < steps; ++s) {
      dp.zero_grad();
      const batch mine = make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count);
      {
        auto g = dp.unshard(model.fc1);
        update_statistics(model.fc1, model.running_mean.values(), model.batches.values()[0], mine);
      }
      forward_backward(model, shifted(mine, model.shift), scale, report, scope);
      dp.step(opt);
    }
    dp.verify_in_sync();
    dp.unshard_model();
  }
  const state_truth want = state_reference(comm.size(), how);
  mlp got{model.fc1, model.fc2, model.fc3};
  mlp expected = want.parameters;
  require_close(got, expected, 1e-5, closeness::per_element);
  const auto& mean = want.running_mean[static_cast<std::size_t>(me)];
  for (std::size_t j = 0; j < h1_dim; ++j) REQUIRE(std::abs(model.running_mean.values()[j] - mean[j]) <= 1e-5);
  REQUIRE(model.batches.values()[0] == want.batches[static_cast<std::size_t>(me)]);
  REQUIRE(model.shift == want.shift);
}

/// verify_in_sync names a frozen parameter one rank changed, and a buffer under broadcast; under construction
/// buffers may differ (they are not compared).
template <class Comm>
void check_state_verify(Comm comm) {
  if (comm.size() < 2) return;
  for (const auto how : {ddp::buffer_sync::broadcast, ddp::buffer_sync::construction}) {
    stat_mlp model = make_stat_mlp(1, 0);
    ddp::data_parallel dp{model, comm, ddp::data_parallel_options{.buffers = how}};
    if (comm.rank() == 1) model.running_mean.values()[3] += 1;
    if (how == ddp::buffer_sync::broadcast) {
      REQUIRE_THROWS_WITH(dp.verify_in_sync(), Catch::Contains("'running_mean'"));
      dp.sync_buffers();  // rank 0's again
    }
    dp.verify_in_sync();
    if (comm.rank() == 1) model.shift[2] += 1;
    REQUIRE_THROWS_AS(dp.verify_in_sync(), ddp::mismatch_error);
    if (comm.rank() == 1) model.shift[2] -= 1;
  }
}

/// Inside a join scope rank r trains r + 1 batches: the buffers come from the lowest rank still training, so
/// every rank ends with the counter of the rank that trained longest.
template <class Comm>
void check_state_join(Comm comm) {
  stat_mlp model = make_stat_mlp(1, static_cast<std::uint64_t>(comm.rank()));
  ddp::data_parallel dp{model, comm};
  ddp::optim::sgd opt({.lr = 0.1});
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  {
    auto j = dp.join();
    for (int s = 0; s <= comm.rank(); ++s) {
      dp.zero_grad();
      const batch mine = make_batch(static_cast<std::uint64_t>(s), 3);
      update_statistics(model.fc1, model.running_mean.values(), model.batches.values()[0], mine);
      forward_backward(model, shifted(mine, model.shift), 1.0F / 3, report);
      dp.step(opt);
    }
    j.finish(opt);
  }
  REQUIRE(model.batches.values()[0] == comm.size());  // rank 0's initial 0, plus one forward per step
  dp.verify_in_sync();
}

/// A rank whose buffer has another shape makes every rank throw mismatch_error naming it.
template <class Comm>
void check_state_mismatch(Comm comm) {
  stat_mlp model = make_stat_mlp(1, 0);
  if (comm.rank() == comm.size() - 1) model.running_mean = ddp::buffer<float>({h1_dim + 1});
  if (comm.size() == 1) return;
  REQUIRE_THROWS_WITH((ddp::data_parallel{model, comm}), Catch::Contains("buffer running_mean f32"));
}

/// The model state of `m` as bytes (running_mean, batches, shift), to compare bit for bit.
inline std::vector<std::byte> state_bytes(const stat_mlp& m) {
  std::vector<std::byte> out;
  auto add = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
  };
  add(m.running_mean.values().data(), m.running_mean.values().size_bytes());
  add(m.batches.values().data(), m.batches.values().size_bytes());
  add(m.shift.data(), m.shift.size() * sizeof(float));
  return out;
}

/// The model state as a checkpoint file at `path` holds it (read directly, not through ddp::load).
inline std::vector<std::byte> state_bytes_in(const std::filesystem::path& path) {
  const auto in = ddp::safetensors::reader::open(path);
  std::vector<std::byte> out;
  for (const char* name : {"running_mean", "batches", "shift"}) {
    const auto* e = in.find(name);
    REQUIRE(e != nullptr);
    std::vector<std::byte> part(e->bytes());
    in.read(*e, 0, part);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

/// Trains stat_mlp under Ps for two steps and saves it to `dir`/full.safetensors (ddp::save) and `dir`/sharded
/// (ddp::save_sharded): the file holds the buffers and the frozen parameter under their names and shapes, and
/// ddp::load and ddp::load_sharded give a differently made model (its buffers never synchronized) the same model
/// state and parameters bit for bit.
template <class... Ps, class Comm>
void check_state_checkpoint(Comm comm, const std::filesystem::path& dir,
                            typename ddp::policies<Ps...>::sharding sharding = {}) {
  const int me = comm.rank();
  stat_mlp a = make_stat_mlp(1, static_cast<std::uint64_t>(me));
  ddp::data_parallel<stat_mlp, Ps...> dp{a, comm, sharding};
  ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  auto scope = [&](auto& l) { return dp.unshard(l); };
  for (int s = 0; s < 2; ++s) {
    dp.zero_grad();
    const batch mine = make_batch(static_cast<std::uint64_t>(s), 4);
    {
      auto g = dp.unshard(a.fc1);
      update_statistics(a.fc1, a.running_mean.values(), a.batches.values()[0], mine);
    }
    forward_backward(a, shifted(mine, a.shift), 0.25F, report, scope);
    dp.step(opt);
  }
  ddp::save(dir / "full.safetensors", dp, opt);
  ddp::save_sharded(dir / "sharded", dp, opt);
  if (me == 0) {
    const auto in = ddp::safetensors::reader::open(dir / "full.safetensors");
    REQUIRE(in.find("running_mean")->shape == std::vector<std::size_t>{h1_dim});
    REQUIRE(in.find("batches")->shape.empty());
    REQUIRE(in.find("batches")->type == ddp::dtype::i64);
    REQUIRE(in.find("shift")->shape == std::vector<std::size_t>{out_dim});
  }
  REQUIRE(state_bytes(a) == state_bytes_in(dir / "full.safetensors"));
  dp.unshard_model();
  const mlp trained{a.fc1, a.fc2, a.fc3};
  for (const bool sharded : {false, true}) {
    INFO("sharded " << sharded);
    stat_mlp b = make_stat_mlp(7, 40 + static_cast<std::uint64_t>(me));
    ddp::data_parallel<stat_mlp, Ps...> dp_b{b, comm, sharding, ddp::data_parallel_options{.buffers = ddp::buffer_sync::never}};
    ddp::optim::sgd opt_b({.lr = 0.1, .momentum = 0.9});
    if (sharded)
      ddp::load_sharded(dir / "sharded", dp_b, opt_b);
    else
      ddp::load(dir / "full.safetensors", dp_b, opt_b);
    REQUIRE(state_bytes(b) == state_bytes(a));
    dp_b.unshard_model();
    mlp got{b.fc1, b.fc2, b.fc3}, want = trained;
    require_close(got, want, 0, closeness::per_element);
  }
}

/// At another world size and policy than the save's: load_sharded brings the model state back bit for bit (as the
/// full file of the same save holds it).
template <class... Ps, class Comm>
void check_state_resharded(Comm comm, const std::filesystem::path& dir) {
  stat_mlp b = make_stat_mlp(7, 40 + static_cast<std::uint64_t>(comm.rank()));
  ddp::data_parallel<stat_mlp, Ps...> dp{b, comm, ddp::data_parallel_options{.buffers = ddp::buffer_sync::never}};
  ddp::optim::sgd opt({.lr = 0.1, .momentum = 0.9});
  ddp::load_sharded(dir / "sharded", dp, opt);
  REQUIRE(state_bytes(b) == state_bytes_in(dir / "full.safetensors"));
}

/// The MLP with a buffer in a fake device's memory (the host cannot touch it): handed as ddp::state of a raw_tensor.
struct device_state_mlp {
  linear fc1, fc2, fc3;
  ddp::raw_tensor running;  // f32 [h1_dim] on the device

  template <class F>
  void visit_parameters(F&& f) {
    f("fc1", fc1);
    f("fc2", fc2);
    f("fc3", fc3);
    f("running", ddp::state(running));
  }
};

/// A buffer in device memory: broadcast at construction, averaged by sync_buffers under buffer_sync::mean (through
/// the device's domain, one collective in its memory), compared by verify_in_sync, and saved and loaded by ddp::save
/// and ddp::load (copied through the host) — every read here through the device's own stream.
template <class Comm>
void check_device_state(Comm comm, const std::filesystem::path& file) {
  const int me = comm.rank(), n = comm.size();
  ddp::testing::fake_device dev(me);
  const ddp::device_registration on_dev(dev);
  const ddp::domain_buffer memory = dev.allocate(h1_dim * sizeof(float));
  const mlp base = make_mlp(1);
  device_state_mlp model{base.fc1, base.fc2, base.fc3, memory.view(ddp::dtype::f32, 0, h1_dim)};
  dev.fill(model.running, me + 1.0);
  ddp::data_parallel dp{model, comm, ddp::data_parallel_options{.buffers = ddp::buffer_sync::mean}};
  for (const float v : dev.read<float>(model.running)) REQUIRE(v == 1.0F);  // rank 0's at construction
  dev.fill(model.running, me + 1.0);
  dp.sync_buffers();
  const float mean = static_cast<float>(n + 1) / 2;
  for (const float v : dev.read<float>(model.running)) REQUIRE(std::abs(v - mean) <= 1e-6F * mean);
  dp.verify_in_sync();
  if (n > 1) {
    if (me == 1) dev.fill(model.running, 9.0);
    REQUIRE_THROWS_WITH(dp.verify_in_sync(), Catch::Contains("'running'"));
  }
  dp.sync_buffers();
  const auto before = dev.read<float>(model.running);
  ddp::save(file, dp);
  dev.fill(model.running, -3.0);
  ddp::load(file, dp);
  REQUIRE(dev.read<float>(model.running) == before);
}

}  // namespace ddp_test
