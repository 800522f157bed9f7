#pragma once
// Mixed precision (ddp::mixed_precision) scenarios, written once for any communicator (run under TCP and MPI).
// The MLP of mlp.hpp written over ddp::bfloat16, its compute dtype, trains with f32 master weights; each rank
// compares the master pieces it owns with two one-process trainings on the whole batch, both from the same
// bf16-representable start:
//  - the same mixed precision (bf16 parameters; each gradient summed in float and rounded to bf16 once; f32
//    masters and optimizer state; masters narrowed into the parameters after each step). N ranks differ from it
//    only where gradients are rounded: each rank rounds its partial sum instead of the total (2^-9 relative per
//    element; with a bf16 reduce dtype the sum is rounded again), so the masters agree within `tight`;
//  - f32 training: the masters track it within `track`, the difference bf16 compute makes (weights at 2^-9 in the
//    forward and backward, gradients at 2^-9), compounded over the steps.
// The same scenarios run a float16 model under mixed_precision<float16> (11 bits: smaller errors, same bounds).
// Tolerances are per tensor: |a − b| ≤ tol·max|b| over the tensor. The figures each run measured are printed
// (to the file DDP_MIXED_REPORT names) so that the stated tolerances can be checked against them.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include <catch2/catch.hpp>

#include <ddp/checkpoint.hpp>
#include <ddp/memory/average.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/core/error.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "join_scenarios.hpp"
#include "mlp.hpp"
#include "scenarios.hpp"

namespace ddp_test {

template <class T>
struct linear_of {
  ddp::parameter<T> weight;
  ddp::parameter<T> bias;
};
/// mlp.hpp's MLP with parameters of type T.
template <class T>
struct mlp_of {
  linear_of<T> fc1, fc2, fc3;
};
/// The compute type of the precision policy among Ps (bf16 or f16).
template <class... Ps>
using compute_of = typename ddp::policies<Ps...>::precision::param_type;

/// make_mlp(seed) rounded to bf16, held as T: the start every run of a comparison shares.
template <class T>
mlp_of<T> make_rounded_mlp(std::uint64_t seed) {
  mlp m = make_mlp(seed);
  auto cast = [](ddp::parameter<float>& p) {
    std::vector<T> v;
    for (const float x : p.value()) v.push_back(static_cast<T>(static_cast<float>(ddp::bfloat16(x))));
    return ddp::parameter<T>(p.shape(), std::move(v));
  };
  return {{cast(m.fc1.weight), cast(m.fc1.bias)}, {cast(m.fc2.weight), cast(m.fc2.bias)},
          {cast(m.fc3.weight), cast(m.fc3.bias)}};
}

/// Reduce dtype f32: N ranks' masters equal one_process<bfloat16>(k, N) (and join_alone) but for the order of the
/// f32 sums: the project's f32 tolerance (measured: 0, every policy at N = 1, 2, 3 over TCP).
inline constexpr double mixed_exact = 1e-5;
/// Gradients rounded to bf16 where the reference does not round them (a bf16 reduce dtype, whose sums are rounded
/// as the backend adds them; bf16_compress_hook; no_sync micro-batches): 2^-9 relative per rounding, compounded by
/// momentum over the steps. The project's tolerance for the bf16 compression hooks (measured: at most 6.8e-3).
inline constexpr double mixed_rounded = 1e-2;
/// Against f32 training, reduce dtype f32: weights at 2^-9 in the forward and backward and gradients at 2^-9, over
/// 4 steps (measured: at most 2.6e-3).
inline constexpr double mixed_track = 5e-3;
/// Against f32 training, gradients rounded again (bf16 reduce dtype, sgd momentum; measured: at most 1.07e-2).
inline constexpr double mixed_track_rounded = 2e-2;

using named_values = std::map<std::string, std::vector<double>>;

/// Adds to `grad` (f32, per parameter) the gradients of `m` on `b` with loss scale `scale`, computed alone and
/// rounded to T as the model's backward writes them.
template <class T>
void add_gradients(mlp_of<T>& m, const batch& b, float scale, std::vector<std::vector<float>>& grad) {
  ddp::visit_parameters(m, [](std::string_view, ddp::parameter<T>& p) { p.zero_grad(); });
  forward_backward(m, b, scale, [](auto&) {});
  std::size_t i = 0;
  ddp::visit_parameters(m, [&](std::string_view, ddp::parameter<T>& p) {
    for (std::size_t e = 0; e < p.numel(); ++e) grad[i][e] += static_cast<float>(p.grad()[e]);
    ++i;
  });
}

/// One process with T parameters and f32 masters the optimizer steps (for T = float that is plain f32 training:
/// widening and narrowing are exact), `count` steps; `gradient(m, s, grad)` adds step s's f32 gradients to `grad`
/// (zero). Returns the masters by parameter name.
template <class T, class F>
named_values train_alone(optimizer_kind k, int count, F&& gradient) {
  mlp_of<T> m = make_rounded_mlp<T>(1);
  std::vector<std::string> names;
  std::vector<std::vector<float>> master, grad;
  ddp::visit_parameters(m, [&](std::string_view name, ddp::parameter<T>& p) {
    names.emplace_back(name);
    master.emplace_back(p.value().begin(), p.value().end());
    grad.emplace_back(p.numel());
  });
  std::vector<ddp::optim::flat_buffer> buffers;
  for (std::size_t i = 0; i < names.size(); ++i)
    buffers.push_back({ddp::raw_tensor::of(std::span<float>(master[i])), ddp::raw_tensor::of(std::span<float>(grad[i])),
                       {{names[i], 0, master[i].size()}}});
  with_optimizer(k, [&](auto& opt) {
    for (int s = 0; s < count; ++s) {
      for (auto& g : grad) std::fill(g.begin(), g.end(), 0.0F);
      gradient(m, s, grad);
      opt.step(buffers);
      std::size_t i = 0;
      ddp::visit_parameters(m, [&](std::string_view, ddp::parameter<T>& p) {
        std::transform(master[i].begin(), master[i].end(), p.value().begin(),
                       [](float x) { return static_cast<T>(x); });
        ++i;
      });
    }
  });
  named_values out;
  for (std::size_t i = 0; i < names.size(); ++i) out[names[i]] = {master[i].begin(), master[i].end()};
  return out;
}

/// One process on the whole batch of each step: the mean of `shards` gradients, each of a rank's share of the batch
/// (shard_of) computed alone and rounded to T, summed in f32 in rank order (what N ranks reducing in f32 compute).
template <class T>
named_values one_process(optimizer_kind k, int shards = 1) {
  return train_alone<T>(k, steps, [&](mlp_of<T>& m, int s, std::vector<std::vector<float>>& grad) {
    for (int r = 0; r < shards; ++r) {
      const auto [begin, count] = shard_of(r, shards);
      add_gradients(m, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count),
                    static_cast<float>(shards) / global_batch, grad);
    }
    for (auto& g : grad) ddp::detail::divide(ddp::raw_tensor::of(std::span<float>(g)), shards);
  });
}

/// One process through the first epoch of join_scenarios.hpp at `n` ranks: at step s the gradients of the active
/// ranks' batches (each alone, rounded to T), summed in f32 in rank order, averaged over n and rescaled to the mean
/// over the active ranks as a join scope does.
template <class T>
named_values join_alone(optimizer_kind k, int n) {
  int longest = 0;
  for (int r = 0; r < n; ++r) longest = std::max(longest, uneven_batches(r, 0));
  return train_alone<T>(k, longest, [&](mlp_of<T>& m, int s, std::vector<std::vector<float>>& grad) {
    int active = 0;
    for (int r = 0; r < n; ++r)
      if (s < uneven_batches(r, 0)) {
        ++active;
        add_gradients(m, join_batch_of(0, r, s), 1.0F / join_batch, grad);
      }
    for (auto& g : grad) {
      ddp::detail::divide(ddp::raw_tensor::of(std::span<float>(g)), n);
      for (float& x : g) x = static_cast<float>(static_cast<double>(x) * (static_cast<double>(n) / active));
    }
  });
}

/// This rank's master pieces: (name, first element, values).
struct master_piece {
  std::string name;
  std::size_t start = 0;
  std::vector<double> values;
};

/// Checks what the wrapper holds after a step: the owned buffers (what the optimizer steps) are f32 values and
/// gradients, and the model's T parameters hold the masters rounded to T, bit for bit (under full_shard after
/// dp.unshard_model()). Returns the master pieces.
template <class T, class DP>
std::vector<master_piece> check_masters(DP& dp) {
  std::map<std::string, std::span<T>> params;
  dp.for_each_parameter([&](std::string_view name, ddp::parameter<T>& p) { params[std::string(name)] = p.value(); });
  std::vector<master_piece> pieces;
  for (const auto& b : dp.owned_buffers()) {
    REQUIRE(b.values.type == ddp::dtype::f32);
    REQUIRE(b.grads.type == ddp::dtype::f32);
    const float* v = static_cast<const float*>(b.values.data);
    for (const auto& seg : b.segments) {
      master_piece piece{seg.name, seg.start, {}};
      for (std::size_t i = 0; i < seg.numel; ++i) {
        const float m = v[seg.offset + i];
        INFO(seg.name << "[" << seg.start + i << "]: master " << m);
        REQUIRE(params.at(seg.name)[seg.start + i].bits == T(m).bits);
        piece.values.push_back(m);
      }
      pieces.push_back(std::move(piece));
    }
  }
  return pieces;
}

/// The worst per-tensor error of `pieces` against `want`: max |a − b| / max|b| over the tensor.
inline double worst_error(const std::vector<master_piece>& pieces, const named_values& want) {
  double worst = 0;
  for (const auto& p : pieces) {
    const auto& w = want.at(p.name);
    double largest = 0;
    for (const double x : w) largest = std::max(largest, std::abs(x));
    for (std::size_t i = 0; i < p.values.size(); ++i)
      worst = std::max(worst, std::abs(p.values[i] - w[p.start + i]) / largest);
  }
  return worst;
}

/// Appends a measured figure to the file DDP_MIXED_REPORT names, when set (to state the tolerances against).
inline void report_figure(const char* what, int rank, int n, double tight, double track) {
  if (const char* path = std::getenv("DDP_MIXED_REPORT"))
    if (std::FILE* f = std::fopen(path, "a")) {
      std::fprintf(f, "%s, rank %d of %d: against one-process mixed %.3g, against f32 %.3g\n", what, rank, n, tight,
                   track);  // track < 0: not compared
      std::fclose(f);
    }
}

/// N ranks with policies Ps (mixed_precision among them) train the MLP over the policy's compute type; `micro` > 1
/// accumulates micro-batches under no_sync. The masters must be within `tight` of one process with the same mixed
/// precision and within `track` of f32 training.
template <class... Ps, class Comm>
void check_mixed(Comm comm, const char* what, optimizer_kind k, double tight, double track, int micro = 1,
                 typename ddp::policies<Ps...>::sharding sharding = {}) {
  using T = compute_of<Ps...>;
  mlp_of<T> model = make_rounded_mlp<T>(1 + static_cast<std::uint64_t>(comm.rank()));  // rank 0's is broadcast
  ddp::data_parallel<mlp_of<T>, Ps...> dp{model, comm, sharding};
  auto scope = [&](auto& l) { return dp.unshard(l); };
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  const float scale = static_cast<float>(comm.size()) / global_batch;
  with_optimizer(k, [&](auto& opt) {
    for (int s = 0; s < steps; ++s) {
      dp.zero_grad();
      const batch mine = make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count);
      over_micro_batches(dp, mine, micro, [&](const batch& b) { forward_backward(model, b, scale, report, scope); });
      dp.step(opt);
    }
  });
  dp.unshard_model();  // full_shard: the parameters hold the full (bf16) values
  const auto pieces = check_masters<T>(dp);
  const double against_mixed = worst_error(pieces, one_process<T>(k, comm.size()));
  const double against_f32 = worst_error(pieces, one_process<float>(k));
  report_figure(what, comm.rank(), comm.size(), against_mixed, against_f32);
  INFO(what << ": worst per-tensor error against one process with the same mixed precision " << against_mixed
            << ", against f32 training " << against_f32);
  REQUIRE(against_mixed <= tight);
  REQUIRE(against_f32 <= track);
}

/// N ranks with policies Ps (mixed_precision among them) train the MLP over the compute type through the uneven
/// first epoch of join_scenarios.hpp inside a join scope; the masters must be within `tight` of join_alone.
template <class... Ps, class Comm>
void check_mixed_join(Comm comm, const char* what, optimizer_kind k, double tight,
                      typename ddp::policies<Ps...>::sharding sharding = {}) {
  using T = compute_of<Ps...>;
  mlp_of<T> model = make_rounded_mlp<T>(1 + static_cast<std::uint64_t>(comm.rank()));
  ddp::data_parallel<mlp_of<T>, Ps...> dp{model, comm, sharding};
  auto scope = [&](auto& l) { return dp.unshard(l); };
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  with_optimizer(k, [&](auto& opt) {
    auto j = dp.join();
    for (int s = 0; s < uneven_batches(comm.rank(), 0); ++s) {
      dp.zero_grad();
      forward_backward(model, join_batch_of(0, comm.rank(), s), 1.0F / join_batch, report, scope);
      dp.step(opt);
    }
    j.finish(opt);
  });
  dp.verify_in_sync();
  dp.unshard_model();
  const double against_mixed = worst_error(check_masters<T>(dp), join_alone<T>(k, comm.size()));
  report_figure(what, comm.rank(), comm.size(), against_mixed, -1);
  INFO(what << ": worst per-tensor error against one process with the same mixed precision " << against_mixed);
  REQUIRE(against_mixed <= tight);
}

/// Two steps of adamw, a checkpoint, two more steps; a fresh wrapper loading the checkpoint and taking the same two
/// steps ends with the same masters, bit for bit. The file holds f32 tensors only (the masters and the f32
/// optimizer state), and rank 0 reads their dtypes back from it. A checkpoint of the model saved without the policy
/// (bf16 parameters) is refused with a mismatch_error. `sharded`: save_sharded / load_sharded (a directory of
/// parts, each read back), else save / load (one file).
template <class... Ps, class Comm>
void check_mixed_checkpoint(Comm comm, bool sharded, typename ddp::policies<Ps...>::sharding sharding = {}) {
  using T = compute_of<Ps...>;
  using P = ddp::policies<Ps...>;
  std::string path = (std::filesystem::temp_directory_path() /
                      ("ddp_mixed_" + std::to_string(::getpid()) + (sharded ? "" : ".safetensors"))).string();
  ddp::broadcast_object(comm, path, 0);  // rank 0's name
  auto save = [&](auto& dp, auto&... opt) {
    sharded ? ddp::save_sharded(path, dp, opt...) : ddp::save(path, dp, opt...);
  };
  auto load = [&](auto& dp, auto&... opt) {
    sharded ? ddp::load_sharded(path, dp, opt...) : ddp::load(path, dp, opt...);
  };
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  const float scale = static_cast<float>(comm.size()) / global_batch;
  auto train = [&](auto& dp, auto& opt, int from, int to) {
    auto scope = [&](auto& l) { return dp.unshard(l); };
    for (int s = from; s < to; ++s) {
      dp.zero_grad();
      forward_backward(dp.module(), make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count), scale,
                       [&](auto& p) { dp.gradient_ready(p); }, scope);
      dp.step(opt);
    }
    dp.unshard_model();
    return check_masters<T>(dp);
  };
  mlp_of<T> first = make_rounded_mlp<T>(1);
  ddp::data_parallel<mlp_of<T>, Ps...> dp{first, comm, sharding};
  ddp::optim::adamw opt({.lr = 0.01, .weight_decay = 0.05});
  train(dp, opt, 0, 2);
  save(dp, opt);
  if (comm.rank() == 0) {
    std::vector<std::filesystem::path> files{path};
    if (sharded) {
      files.clear();
      for (const auto& f : std::filesystem::directory_iterator(path))
        if (f.path().extension() == ".safetensors") files.push_back(f.path());
      REQUIRE(files.size() == static_cast<std::size_t>(comm.size()));
    }
    std::size_t tensors = 0;
    for (const auto& f : files) {
      const auto file = ddp::safetensors::reader::open(f);
      for (const auto& e : file.entries()) {
        INFO(f << ": tensor " << e.name);
        REQUIRE(e.type == ddp::dtype::f32);
        ++tensors;
      }
    }
    REQUIRE(tensors >= 6 * 3);  // 6 parameters and their exp_avg, exp_avg_sq (in pieces when sharded)
  }
  const auto want = train(dp, opt, 2, 4);

  mlp_of<T> second = make_rounded_mlp<T>(7);  // other values: the checkpoint must replace them
  ddp::data_parallel<mlp_of<T>, Ps...> resumed{second, comm, sharding};
  ddp::optim::adamw opt2({.lr = 0.01, .weight_decay = 0.05});
  load(resumed, opt2);
  const auto got = train(resumed, opt2, 2, 4);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("piece of " << got[i].name << " from " << got[i].start);
    REQUIRE(got[i].name == want[i].name);
    REQUIRE(got[i].values == want[i].values);
  }

  // The same model saved without the policy holds 16-bit parameters: loading it under mixed precision is refused.
  mlp_of<T> third = make_rounded_mlp<T>(1);
  ddp::data_parallel<mlp_of<T>, typename P::backend, typename P::sharding> plain{third, comm, sharding};
  ddp::optim::sgd plain_opt({.lr = 0.1});
  save(plain, plain_opt);
  try {
    load(resumed);
    FAIL("a checkpoint of bf16 parameters loaded into f32 masters");
  } catch (const ddp::mismatch_error& e) {
    INFO(e.what());
    REQUIRE(std::string(e.what()).find(std::string(ddp::to_string(ddp::dtype_v<T>))) != std::string::npos);
  }
  comm.barrier().wait();
  if (comm.rank() == 0) std::filesystem::remove_all(path);
}

/// A model whose parameters are not in the policy's compute dtype is refused with a config_error saying what to
/// change, on every rank.
template <class Backend, class Comm>
void check_mixed_misuse(Comm comm) {
  mlp f32_model = make_mlp(1);
  try {
    ddp::data_parallel<mlp, Backend, ddp::mixed_precision<ddp::bfloat16>> dp{f32_model, comm};
    FAIL("an f32 model was accepted under mixed_precision<bfloat16>");
  } catch (const ddp::config_error& e) {
    INFO(e.what());
    REQUIRE(std::string(e.what()).find("write the model over ddp::bfloat16") != std::string::npos);
    REQUIRE(e.rank() == comm.rank());
  }
  auto f16_model = make_rounded_mlp<ddp::float16>(1);
  try {
    ddp::data_parallel<mlp_of<ddp::float16>, Backend, ddp::mixed_precision<ddp::bfloat16>> dp{f16_model, comm};
    FAIL("an f16 model was accepted under mixed_precision<bfloat16>");
  } catch (const ddp::config_error& e) {
    INFO(e.what());
    REQUIRE(std::string(e.what()).find("parameter 'fc1.weight' is f16") != std::string::npos);
  }
}

}  // namespace ddp_test
