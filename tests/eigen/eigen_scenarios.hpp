#pragma once
// Scenarios of the Eigen adapter, written once for any communicator (run over TCP and MPI; REQUIRE only, so a
// rank fails by throwing): the Eigen MLP at N ranks equals one process on the whole batch (tests/parallel's
// reference, 1e-5 per element as in tests/parallel/scenarios.hpp), Map members are never copied, owning
// matrices cannot be fully sharded, and a checkpoint of the Eigen model is PyTorch's nn.Linear layout.

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <ddp/checkpoint.hpp>

#include "eigen/eigen_mlp.hpp"
#include "parallel/scenarios.hpp"

namespace ddp_test {

/// N ranks with policies Ps train the Eigen model Model on disjoint (uneven at N = 3) shards of each batch with
/// optimizer k; afterwards the model holds the reference's parameters.
template <class Model, class... Ps, class Comm>
void check_eigen_equivalence(Comm comm, optimizer_kind k, double tol = 1e-5) {
  mlp base = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));  // rank 0's values are broadcast
  Model model = make_eigen<Model>(base);
  {  // compared after the wrapper is gone: it must hand the trained values back
    ddp::data_parallel<Model, Ps...> dp{model, comm};
    auto scope = [&](auto& layer) { return dp.unshard(layer); };
    auto report = [&](auto& leaf) { dp.gradient_ready(leaf); };
    const auto [begin, count] = shard_of(comm.rank(), comm.size());
    const float scale = static_cast<float>(comm.size()) / global_batch;
    with_optimizer(k, [&](auto& opt) {
      for (int s = 0; s < steps; ++s) {
        dp.zero_grad();
        const batch mine = make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count);
        eigen_forward_backward(model, mine, scale, report, scope);
        dp.step(opt);
      }
    });
    dp.unshard_model();  // full_shard: the maps' own memory takes the trained values
  }
  copy_back(model, base);
  mlp want = reference_training(k);
  require_close(base, want, tol, closeness::per_element);
}

/// Map members point into ddp's arenas while wrapped (no copies) and back at the model's memory afterwards,
/// holding the trained values; owning matrices keep their memory; full_shard refuses owning matrices by name.
template <class Backend, class Comm>
void check_eigen_binding(Comm comm) {
  mlp base = make_mlp(1);
  auto maps = make_eigen<mapped_rows>(base);
  auto owned = make_eigen<owning_rows>(base);
  const float* home = maps.fc2.weight.data();
  const float* own = owned.fc2.weight.data();
  std::vector<float> trained;
  {
    ddp::data_parallel<mapped_rows, Backend> dp{maps, comm};
    ddp::data_parallel<owning_rows, Backend> dv{owned, comm};
    const auto& arena = dp.layout().arenas()[0];
    const auto* values = reinterpret_cast<const float*>(arena.values.data());
    const auto* grads = reinterpret_cast<const float*>(arena.grads.data());
    std::size_t laid = 0;
    dp.for_each_parameter([&](std::string_view name, const auto& leaf) {
      INFO("leaf " << name);
      const float* v = leaf.values().data();
      const float* g = leaf.grads().data();
      REQUIRE(v >= values);
      REQUIRE(v + leaf.values().size() <= values + arena.numel);
      REQUIRE(g - grads == v - values);
      laid += static_cast<std::size_t>(leaf.values().size());
    });
    REQUIRE(laid == arena.numel);
    REQUIRE(maps.fc2.weight.data() != home);
    REQUIRE(owned.fc2.weight.data() == own);
    ddp::optim::sgd opt({.lr = 0.5});
    eigen_forward_backward(maps, make_batch(0, 4), 1.0F, [&](auto& leaf) { dp.gradient_ready(leaf); });
    dp.step(opt);
    eigen_forward_backward(owned, make_batch(0, 4), 1.0F, [&](auto& leaf) { dv.gradient_ready(leaf); });
    dv.step(opt);
    REQUIRE(maps.fc2.weight == owned.fc2.weight);
    trained.assign(maps.fc2.weight.data(), maps.fc2.weight.data() + maps.fc2.weight.size());
  }
  REQUIRE(maps.fc2.weight.data() == home);
  REQUIRE(std::equal(trained.begin(), trained.end(), home));
  REQUIRE_FALSE(std::equal(trained.begin(), trained.end(), base.fc2.weight.value().begin()));
  try {
    ddp::data_parallel<owning_rows, Backend, ddp::full_shard> dp{owned, comm};
    FAIL("full_shard accepted Eigen matrices that keep their own memory");
  } catch (const ddp::config_error& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("'fc1.weight'") && Catch::Contains("Eigen::Map") &&
                               Catch::Contains("shard_grad_op") && Catch::Contains("rank " + std::to_string(comm.rank())));
  }
}

/// Trains the Eigen model Model for two steps under replicate, saves `path` (collective) and, on rank 0, writes
/// `path`.json: a batch `x`, the model's logits on it, and every tensor read index by index as PyTorch's
/// nn.Linear holds it (weight[o][i] = W(o, i) for RowMajor out×in, W(i, o) for ColMajor in×out).
template <class Model, class Backend, class Comm>
void save_for_torch(Comm comm, const std::filesystem::path& path) {
  mlp base = make_mlp(3);
  Model model = make_eigen<Model>(base);
  ddp::data_parallel<Model, Backend> dp{model, comm};
  ddp::optim::adamw opt({.lr = 0.01});
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  for (int s = 0; s < 2; ++s) {
    dp.zero_grad();
    eigen_forward_backward(model, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count),
                           static_cast<float>(comm.size()) / global_batch, [&](auto& leaf) { dp.gradient_ready(leaf); });
    dp.step(opt);
  }
  ddp::save(path, dp, opt);
  if (comm.rank() != 0) return;
  nlohmann::json expected;
  const batch probe = make_batch(7, 6);
  expected["x"] = probe.x;
  expected["n"] = probe.n;
  const row_matrix logits = eigen_forward(model, probe.x, probe.n);
  expected["logits"] = std::vector<float>(logits.data(), logits.data() + logits.size());
  auto linear_layout = [&](const std::string& name, const auto& layer) {
    const auto& w = layer.weight;
    constexpr bool rows = std::remove_cvref_t<decltype(w)>::IsRowMajor;
    const Eigen::Index out = rows ? w.rows() : w.cols(), in = rows ? w.cols() : w.rows();
    std::vector<std::vector<float>> weight(static_cast<std::size_t>(out));
    for (Eigen::Index o = 0; o < out; ++o)
      for (Eigen::Index i = 0; i < in; ++i) weight[static_cast<std::size_t>(o)].push_back(rows ? w(o, i) : w(i, o));
    expected[name + ".weight"] = weight;
    expected[name + ".bias"] = std::vector<float>(layer.bias.data(), layer.bias.data() + layer.bias.size());
  };
  linear_layout("fc1", model.fc1);
  linear_layout("fc2", model.fc2);
  linear_layout("fc3", model.fc3);
  std::ofstream(path.string() + ".json") << expected.dump();
}

/// Loads `path` (written from any of the Eigen models) into a fresh Model under Policy: every tensor equals the
/// nn.Linear layout `json` holds, also for owning matrices (they take the loaded values at once, not at the next step).
template <class Model, class Backend, class Policy, class Comm>
void load_into(Comm comm, const std::filesystem::path& path, const std::filesystem::path& json) {
  mlp base = make_mlp(11);
  Model model = make_eigen<Model>(base);
  {
    ddp::data_parallel<Model, Backend, Policy> dp{model, comm};
    ddp::load(path, dp);
    dp.unshard_model();  // full_shard: the maps' own memory takes the loaded values
  }
  nlohmann::json want;
  std::ifstream(json) >> want;
  copy_back(model, base);
  ddp::visit_parameters(base, [&](std::string_view name, ddp::parameter<float>& p) {
    INFO("parameter " << name);
    std::vector<float> flat;
    const auto& entry = want.at(std::string(name));
    if (p.shape().size() == 2)
      for (const auto& row : entry)
        for (const float v : row) flat.push_back(v);
    else
      flat = entry.get<std::vector<float>>();
    REQUIRE(std::equal(flat.begin(), flat.end(), p.value().begin(), p.value().end()));
  });
}

}  // namespace ddp_test
