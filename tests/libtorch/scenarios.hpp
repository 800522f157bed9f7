#pragma once
// The adapter's scenarios, written once for any communicator (run over TCP and MPI). REQUIRE only: under
// run_ranks a rank fails by throwing.
//
// Equivalence: N ranks, each on a disjoint (uneven where N does not divide it) shard of a global batch of B
// samples, scale their loss by N/B so the average of the ranks' gradients is the whole batch's mean gradient;
// after several steps their parameters must equal one plain LibTorch process stepping the same optimizer on the
// whole batch: |a − b| ≤ 1e-5·max(|b|, 1e-2) per element.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/adapters/libtorch.hpp>
#include <ddp/checkpoint.hpp>
#include <ddp/optim/adamw.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "models.hpp"

namespace ddp_torch_test {

inline constexpr std::int64_t global_batch = 10;  // uneven over 3 ranks
inline constexpr int steps = 4;

/// Samples [begin, begin + count) of the global batch that `rank` of `n` trains on.
inline std::pair<std::int64_t, std::int64_t> shard_of(int rank, int n) {
  const std::int64_t begin = rank * global_batch / n, end = (rank + 1) * global_batch / n;
  return {begin, end - begin};
}

enum class optimizer_kind { torch_sgd_momentum, torch_adam, ddp_adamw, torch_adamw_grouped };

/// The parameter groups of torch_adamw_grouped: biases without weight decay, fc2.weight at half the lr.
inline std::vector<ddp::optim::adamw::group> adamw_groups() {
  return {{.name = "no_decay", .match = {"*.bias"}}, {.name = "fc2", .match = {"fc2.weight"}}};
}

/// The module's parameters in adamw_groups()' groups (entry 0: the others), as ddp::parameters(dp, groups) cuts them.
template <class Net>
std::vector<torch::optim::OptimizerParamGroup> named_groups(Net& net) {
  const auto groups = adamw_groups();
  std::vector<std::vector<torch::Tensor>> members(groups.size() + 1);
  for (const auto& item : net->named_parameters()) {
    std::size_t g = 0;
    for (std::size_t k = 0; k < groups.size(); ++k)
      if (groups[k].match(item.key())) g = k + 1;
    members[g].push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (auto& m : members) out.emplace_back(std::move(m));
  return out;
}

/// The torch::optim optimizer `k` names over `groups` (one group but for torch_adamw_grouped, whose groups take
/// their options here; ddp_adamw: unused).
inline std::unique_ptr<torch::optim::Optimizer> make_torch_optimizer(optimizer_kind k,
                                                                     std::vector<torch::optim::OptimizerParamGroup> groups) {
  switch (k) {
    case optimizer_kind::torch_sgd_momentum:
      return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(0.1).momentum(0.9));
    case optimizer_kind::torch_adam:
      return std::make_unique<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(0.01));
    case optimizer_kind::ddp_adamw:
      return std::make_unique<torch::optim::AdamW>(std::move(groups),
                                                   torch::optim::AdamWOptions(0.01).weight_decay(0.05));
    case optimizer_kind::torch_adamw_grouped:
      groups.at(1).set_options(std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.01).weight_decay(0)));
      groups.at(2).set_options(std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.005).weight_decay(0.05)));
      return std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(0.01).weight_decay(0.05));
  }
  return nullptr;
}

/// The groups `k` steps of a plain module: its parameters in one group, or in adamw_groups()'.
template <class Net>
std::vector<torch::optim::OptimizerParamGroup> groups_of(optimizer_kind k, Net& net) {
  if (k == optimizer_kind::torch_adamw_grouped) return named_groups(net);
  return {torch::optim::OptimizerParamGroup(net->parameters())};
}

/// What the wrapper is given: the module itself for the MLP (`*net`), the TORCH_MODULE holder for the CNN.
template <class Net>
auto& wrapped(Net& net) {
  if constexpr (std::is_same_v<Net, mlp>)
    return *net;
  else
    return net;
}
template <class Net>
using wrapped_t = std::remove_reference_t<decltype(wrapped(std::declval<Net&>()))>;

/// Copies of every parameter's values, in named_parameters() order.
template <class Net>
std::vector<std::pair<std::string, torch::Tensor>> values_of(Net& net) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : net->named_parameters()) out.emplace_back(item.key(), item.value().detach().clone());
  return out;
}

/// ddp::optim::adamw's settings in these tests.
inline ddp::optim::adamw make_ddp_adamw() { return ddp::optim::adamw({.lr = 0.01, .weight_decay = 0.05}); }

/// One plain LibTorch process on the whole batch: the ground truth (ddp_adamw: ddp's optimizer stepping each
/// parameter of the plain module, over its own memory).
template <class Net>
std::vector<std::pair<std::string, torch::Tensor>> reference_training(optimizer_kind k) {
  Net net = make_model<Net>(1);
  auto opt = make_torch_optimizer(k, groups_of(k, net));
  ddp::optim::adamw ours = make_ddp_adamw();
  for (int s = 0; s < steps; ++s) {
    net->zero_grad();
    const auto [x, y] = make_batch<Net>(static_cast<std::uint64_t>(s), global_batch);
    scaled_loss(net->forward(x), y, 1.0 / global_batch).backward();
    if (k != optimizer_kind::ddp_adamw) {
      opt->step();
      continue;
    }
    std::vector<ddp::optim::flat_buffer> buffers;
    for (auto& item : net->named_parameters()) {
      const auto n = static_cast<std::size_t>(item.value().numel());
      buffers.push_back({{item.value().data_ptr(), n, ddp::dtype::f32, ddp::device::cpu()},
                         {item.value().grad().data_ptr(), n, ddp::dtype::f32, ddp::device::cpu()},
                         {{item.key(), 0, n}}});
    }
    ours.step(std::span<const ddp::optim::flat_buffer>(buffers));
  }
  return values_of(net);
}

/// Every parameter within 1e-5 (relative, floored at 1e-2) of the reference's.
inline void require_close(const std::vector<std::pair<std::string, torch::Tensor>>& got,
                          const std::vector<std::pair<std::string, torch::Tensor>>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("parameter " << got[i].first);
    REQUIRE(got[i].first == want[i].first);
    const double worst =
        ((got[i].second - want[i].second).abs() / want[i].second.abs().clamp_min(1e-2)).max().item<double>();
    INFO("got " << got[i].second.flatten().slice(0, 0, 4) << " want " << want[i].second.flatten().slice(0, 0, 4));
    REQUIRE(worst <= 1e-5);
  }
}

/// How a training loop zeroes the gradients before a step's backward.
enum class zero_with {
  wrapper,         ///< dp.zero_grad()
  model,           ///< net->zero_grad(): LibTorch drops every .grad (set_to_none)
  model_in_place,  ///< net->zero_grad(false): zeroes every .grad in place
  optimizer,       ///< opt.zero_grad() of a torch::optim optimizer (set_to_none)
};

/// N ranks with policies Ps (the sharding policy's settings `sharding`) train Net from different initial values
/// (rank 0's are broadcast) on their shards and end where one process on the whole batch ends. torch::optim
/// optimizers step the model's parameters under replicate and ddp::parameters(dp) under the sharded policies.
/// `micro` > 1 accumulates that many micro-batches per step, all but the last under dp.no_sync(). The deep model
/// runs each unit through ddp::forward. `z` is how each step zeroes the gradients.
template <class Net, class... Ps, class Comm>
void check_equivalence(Comm comm, optimizer_kind k, int micro = 1, typename ddp::policies<Ps...>::sharding sharding = {},
                       zero_with z = zero_with::wrapper) {
  INFO("model " << (std::is_same_v<Net, mlp> ? "mlp" : std::is_same_v<Net, cnn> ? "cnn" : "deep") << ", optimizer "
                << static_cast<int>(k) << ", " << micro << " micro-batch(es), zeroing " << static_cast<int>(z));
  Net net = make_model<Net>(1 + static_cast<std::uint64_t>(comm.rank()));
  {
    ddp::data_parallel<wrapped_t<Net>, Ps...> dp{wrapped(net), comm, sharding};
    const auto forward = [&](const torch::Tensor& in) {
      if constexpr (std::is_same_v<Net, deep>)
        return net->forward(in, [&](auto& unit, const torch::Tensor& x) { return ddp::forward(dp, unit, x); });
      else
        return net->forward(in);
    };
    const auto [begin, count] = shard_of(comm.rank(), comm.size());
    const double scale = static_cast<double>(comm.size()) / global_batch;
    auto train = [&](auto& opt) {
      for (int s = 0; s < steps; ++s) {
        switch (z) {
          case zero_with::wrapper: dp.zero_grad(); break;
          case zero_with::model: net->zero_grad(); break;
          case zero_with::model_in_place: net->zero_grad(false); break;
          case zero_with::optimizer:
            if constexpr (requires { opt.zero_grad(); }) opt.zero_grad();
            break;
        }
        const auto [x, y] = make_batch<Net>(static_cast<std::uint64_t>(s), global_batch);
        const auto mx = x.narrow(0, begin, count), my = y.narrow(0, begin, count);
        for (int m = 0; m < micro; ++m) {  // micro-batch m: rows [count·m/micro, count·(m+1)/micro)
          const std::int64_t a = count * m / micro, b = count * (m + 1) / micro;
          if (m + 1 < micro) {
            auto guard = dp.no_sync();
            scaled_loss(forward(mx.narrow(0, a, b - a)), my.narrow(0, a, b - a), scale).backward();
            guard.close();  // sharded: completes this micro-batch's reduce-scatters
          } else {
            auto loss = scaled_loss(forward(mx.narrow(0, a, b - a)), my.narrow(0, a, b - a), scale);
            loss.backward();
          }
        }
        dp.step(opt);
      }
    };
    if (k == optimizer_kind::ddp_adamw) {
      ddp::optim::adamw opt = make_ddp_adamw();
      train(opt);
    } else {
      using dp_type = decltype(dp);
      const bool grouped = k == optimizer_kind::torch_adamw_grouped;
      auto opt = make_torch_optimizer(
          k, std::is_same_v<typename dp_type::sharding, ddp::replicate> ? groups_of(k, net)
             : grouped ? ddp::parameters(dp, adamw_groups())
                       : std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(ddp::parameters(dp))});
      train(*opt);
    }
    dp.unshard_model();  // full_shard: the model's own parameters take the full values
  }
  require_close(values_of(net), reference_training<Net>(k));
}

/// Where parameter `name`'s gradient lies in the wrapper's arenas.
template <class DP>
const void* gradient_slot(const DP& dp, std::string_view name) {
  const auto i = dp.layout().find(name);
  REQUIRE(i >= 0);
  const auto& s = dp.layout().slots()[static_cast<std::size_t>(i)];
  return dp.layout().arenas()[s.arena].grad_view(s.offset, s.numel).data;
}

/// `.grad` stays ddp's memory across net->zero_grad() (zeroes in place) and net->zero_grad(true) (LibTorch drops it:
/// the hook points it back, holding the new gradient); values are ddp's too; the wrapper gives them back.
template <class Backend, class Comm>
void check_gradient_link(Comm comm) {
  mlp net = make_model<mlp>(1);
  const auto [x, y] = make_batch<mlp>(0, 4);
  torch::Tensor once;
  {
    ddp::data_parallel<mlp_impl, Backend> dp{*net, comm};
    const void* slot = gradient_slot(dp, "fc2.weight");
    REQUIRE(net->fc2->weight.grad().data_ptr() == slot);
    scaled_loss(net->forward(x), y, 1.0).backward();
    dp.finish_gradients();
    once = net->fc2->weight.grad().clone();
    REQUIRE(net->fc2->weight.grad().data_ptr() == slot);
    for (const bool set_to_none : {false, true}) {
      INFO("zero_grad(" << set_to_none << ")");
      net->zero_grad(set_to_none);
      REQUIRE(net->fc2->weight.grad().defined() == !set_to_none);
      dp.zero_grad();
      scaled_loss(net->forward(x), y, 1.0).backward();
      dp.finish_gradients();
      REQUIRE(net->fc2->weight.grad().data_ptr() == slot);
      REQUIRE(torch::allclose(net->fc2->weight.grad(), once));
    }
  }
  REQUIRE(net->fc2->weight.grad().defined());
  REQUIRE(torch::allclose(net->fc2->weight.grad(), once));
  scaled_loss(net->forward(x), y, 1.0).backward();  // after the wrapper: plain LibTorch again
  REQUIRE(torch::allclose(net->fc2->weight.grad(), 2 * once));
}

/// A module with a parameter of its own kind, for the error cases.
struct odd_impl : torch::nn::Module {
  explicit odd_impl(torch::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  torch::Tensor weight;
};

/// Buckets reduce while the backward goes on: when autograd reaches the first layer's weight (the last gradient
/// of the backward), the all-reduces of buckets holding only later layers have started already.
template <class... Ps, class Comm>
void check_overlap(Comm comm) {
  cnn net = make_model<cnn>(1);
  ddp::data_parallel<cnn, Ps...> dp{net, comm};
  REQUIRE(dp.bucket_count() > 2);
  const auto started = [&] { return dp.comm().stats().count(ddp::collective::all_reduce); };
  const auto before = started();
  std::uint64_t at_first_layer = 0;
  net->conv->weight.register_hook([&](const torch::Tensor& g) {
    at_first_layer = started() - before;
    return g;
  });
  const auto [x, y] = make_batch<cnn>(0, 4);
  scaled_loss(net->forward(x), y, 1.0).backward();
  dp.finish_gradients();
  INFO("all-reduces started before the first layer's gradient: " << at_first_layer << " of " << dp.bucket_count());
  REQUIRE(at_first_layer >= 1);
  REQUIRE(started() - before == dp.bucket_count());
}

/// A module with BatchNorm (buffers: running statistics, an i64 counter) and a frozen parameter.
struct stateful_impl : torch::nn::Module {
  stateful_impl()
      : fc(register_module("fc", torch::nn::Linear(4, 4))), bn(register_module("bn", torch::nn::BatchNorm1d(4))),
        frozen(register_parameter("frozen", torch::zeros({3}), /*requires_grad=*/false)) {}
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
  torch::Tensor frozen;
};

/// Buffers and frozen parameters are not trained but broadcast from rank 0 with the parameters.
template <class Backend, class Comm>
void check_buffers(Comm comm) {
  torch::manual_seed(1 + static_cast<std::uint64_t>(comm.rank()));
  stateful_impl m;
  {
    torch::NoGradGuard no_grad;
    m.bn->running_mean.fill_(comm.rank() + 1);
    m.bn->num_batches_tracked.fill_(comm.rank() + 7);
    m.frozen.fill_(comm.rank() + 1);
  }
  ddp::data_parallel<stateful_impl, Backend> dp{m, comm};
  REQUIRE(dp.layout().slots().size() == 4);  // fc.weight, fc.bias, bn.weight, bn.bias
  REQUIRE(m.bn->running_mean.eq(1).all().item<bool>());
  REQUIRE(m.bn->num_batches_tracked.item<std::int64_t>() == 7);
  REQUIRE(m.frozen.eq(1).all().item<bool>());
}

/// Leaves ddp cannot lay out, tensors of another model and full_shard are config_errors saying what to do.
template <class Backend, class Comm>
void check_errors(Comm comm) {
  auto refused = [&](torch::Tensor w, const char* says) {
    odd_impl m(std::move(w));
    try {
      ddp::data_parallel<odd_impl, Backend> dp{m, comm};
      FAIL("a parameter that ddp cannot lay out was accepted");
    } catch (const ddp::config_error& e) {
      INFO(e.what());
      REQUIRE_THAT(e.what(), Catch::Contains("'weight'") && Catch::Contains(says));
    }
  };
  refused(torch::randn({4, 3}).t(), "non-contiguous");
  {
    odd_impl shared(torch::randn({2, 2}));
    shared.register_parameter("again", shared.weight);
    REQUIRE_THROWS_AS((ddp::data_parallel<odd_impl, Backend>{shared, comm}), ddp::config_error);
  }
  if (torch::cuda::is_available()) refused(torch::randn({4, 3}, torch::kCUDA), "cuda:0");
  else WARN("this LibTorch has no CUDA: the CUDA parameter case is checked where one is available");

  mlp net = make_model<mlp>(1), other = make_model<mlp>(2);
  ddp::data_parallel<mlp_impl, Backend> dp{*net, comm};
  REQUIRE_THROWS_AS(dp.gradient_ready(other->fc1->weight), ddp::config_error);
  {
    ddp::data_parallel<mlp_impl, Backend, ddp::shard_grad_op> sharded{*other, comm};
    torch::optim::SGD opt(other->parameters(), 0.1);
    scaled_loss(other->forward(torch::ones({2, 6})), torch::zeros({2, 3}), 1.0).backward();
    try {
      sharded.step(opt);
      FAIL("shard_grad_op stepped a torch::optim optimizer over the model's own parameters");
    } catch (const ddp::config_error& e) {
      REQUIRE_THAT(e.what(), Catch::Contains("ddp::parameters(dp)"));
    }
  }
}

/// What `body()` writes to the process's standard error (fd 2) while it runs.
template <class F>
std::string captured_stderr(F&& body) {
  std::fflush(stderr);
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(::fileno(file), STDERR_FILENO);
  body();
  std::fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::rewind(file);
  std::string text;
  for (int c; (c = std::fgetc(file)) != EOF;) text += static_cast<char>(c);
  std::fclose(file);
  return text;
}

/// A LibTorch loop's mistakes are named or harmless: opt.step() in place of dp.step(opt) fails at the next backward
/// with a ddp::error naming dp.step(opt); ddp::parameters(dp) gives the same tensors on every call; a wrapper
/// destroyed while an optimizer over them lives gives them memory of their own (stepping them then is safe) and
/// says so on stderr, naming the optimizer's lifetime.
template <class Backend, class Comm>
void check_loop_mistakes(Comm comm) {
  mlp net = make_model<mlp>(1);
  const auto [x, y] = make_batch<mlp>(0, 4);
  {
    ddp::data_parallel<wrapped_t<mlp>, Backend> dp{wrapped(net), comm};
    torch::optim::SGD opt(net->parameters(), 0.1);
    dp.zero_grad();
    scaled_loss(net->forward(x), y, 1.0).backward();
    opt.step();  // the buckets' all-reduces may still run: what the user steps is not yet averaged
    opt.zero_grad();
    try {
      scaled_loss(net->forward(x), y, 1.0).backward();
      FAIL("a second backward without dp.step(opt) was accepted");
    } catch (const ddp::error& e) {
      REQUIRE_THAT(e.what(), Catch::Contains("step with dp.step(opt), not opt.step() alone"));
    }
  }
  std::unique_ptr<torch::optim::Adam> opt;
  const void* owned = nullptr;
  const std::string said = captured_stderr([&] {
    ddp::data_parallel<wrapped_t<mlp>, Backend, ddp::shard_grad_op> dp{wrapped(net), comm};
    opt = std::make_unique<torch::optim::Adam>(ddp::parameters(dp));
    REQUIRE(ddp::parameters(dp)[0].unsafeGetTensorImpl() == opt->param_groups()[0].params()[0].unsafeGetTensorImpl());
    owned = opt->param_groups()[0].params()[0].data_ptr();
    dp.zero_grad();
    scaled_loss(net->forward(x), y, 1.0).backward();
    dp.step(*opt);
  });
  REQUIRE_THAT(said, Catch::Contains("the data_parallel wrapper was destroyed while") &&
                         Catch::Contains("destroy the optimizer before the wrapper"));
  REQUIRE(opt->param_groups()[0].params()[0].data_ptr() != owned);
  opt->step();  // copies: no access to the wrapper's freed memory (ASan would report one)
}

/// full_shard outside ddp::forward: a sharded unit's parameters are empty, so a plain forward fails in LibTorch
/// instead of computing with zeros; a unit's backward without its ddp::forward is a ddp::error naming the fix; a
/// torch::optim optimizer over the model's (sharded) parameters is refused; inside dp.unshard(dp.module()) the
/// plain forward and backward work. ddp::save writes the full values (read into a plain module, they equal what
/// unshard_model() gives the model) and ddp::load reads them back.
template <class Backend, class Comm>
void check_full_shard_rules(Comm comm, const std::filesystem::path& path) {
  deep net = make_model<deep>(1);
  const auto [x, y] = make_batch<deep>(0, 4);
  const auto through_ddp = [](auto& dp) {
    return [&dp](auto& unit, const torch::Tensor& in) { return ddp::forward(dp, unit, in); };
  };
  {
    ddp::data_parallel<deep, Backend, ddp::full_shard> dp{net, comm};
    REQUIRE(net->fc1->weight.numel() == 0);
    REQUIRE_THROWS_AS(net->forward(x), c10::Error);  // never a result computed with zero weights
    try {
      const auto out = net->forward(x, [&](auto& unit, const torch::Tensor& in) {  // fc1 outside ddp::forward
        return static_cast<void*>(&unit) == static_cast<void*>(&net->fc1) ? unit(in) : ddp::forward(dp, unit, in);
      });
      FAIL("a unit's forward outside ddp::forward computed " << out);
    } catch (const c10::Error&) {
    }
    {
      torch::Tensor out;
      {
        auto all = dp.unshard(dp.module());  // forward in a scope, backward after it closed: no reopening hook
        out = net->forward(x);
      }
      try {
        scaled_loss(out, y, 1.0).backward();
        FAIL("a backward of units no scope held ran");
      } catch (const ddp::error& e) {
        REQUIRE_THAT(e.what(), Catch::Contains("ddp::forward(dp, model.fc2"));
      }
    }
    dp.zero_grad();
    {
      auto all = dp.unshard(dp.module());  // one scope around the plain forward and backward: legal
      REQUIRE(net->fc1->weight.numel() == 16 * 144);
      scaled_loss(net->forward(x), y, 1.0).backward();
    }
    ddp::optim::adamw opt = make_ddp_adamw();
    dp.step(opt);
    scaled_loss(net->forward(x, through_ddp(dp)), y, 1.0).backward();
    torch::optim::SGD plain(net->parameters(), 0.1);
    try {
      dp.step(plain);
      FAIL("full_shard stepped a torch::optim optimizer over the model's sharded parameters");
    } catch (const ddp::config_error& e) {
      REQUIRE_THAT(e.what(), Catch::Contains("ddp::parameters(dp)"));
    }
    dp.step(opt);
    ddp::save(path, dp);
    dp.unshard_model();
    REQUIRE(net->fc1->weight.numel() == 16 * 144);
  }
  if (comm.rank() == 0) {
    deep plain = make_model<deep>(7);
    ddp::load_module(path, *plain);
    const auto got = values_of(plain), want = values_of(net);
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(torch::equal(got[i].second, want[i].second));
  }
  deep fresh = make_model<deep>(8);
  {
    ddp::data_parallel<deep, Backend, ddp::full_shard> dp{fresh, comm};
    ddp::load(path, dp);
    dp.unshard_model();
  }
  const auto got = values_of(fresh), want = values_of(net);
  for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(torch::equal(got[i].second, want[i].second));
}

/// The fixed input torch_load.py feeds the MLP.
inline torch::Tensor probe_input() { return torch::linspace(-1, 1, 24).reshape({4, 6}); }

/// ddp::save(path, dp) (no optimizer: torch::optim keeps its own state) after two steps of SGD; rank 0 loads the file
/// into a plain module with ddp::load_module and finds the trained values.
template <class Backend, class Comm>
void check_checkpoint(Comm comm, const std::filesystem::path& path) {
  mlp net = make_model<mlp>(1 + static_cast<std::uint64_t>(comm.rank()));
  ddp::data_parallel<mlp_impl, Backend> dp{*net, comm};
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  for (int s = 0; s < 2; ++s) {
    dp.zero_grad();
    const auto [x, y] = make_batch<mlp>(static_cast<std::uint64_t>(s), global_batch);
    scaled_loss(net->forward(x.narrow(0, begin, count)), y.narrow(0, begin, count), 1.0).backward();
    dp.step(opt);
  }
  ddp::save(path, dp, {{"written_by", "check_checkpoint"}});
  if (comm.rank() != 0) return;
  mlp plain = make_model<mlp>(99);
  const auto meta = ddp::load_module(path, *plain);
  REQUIRE(meta.at("written_by") == "check_checkpoint");
  const auto got = values_of(plain), want = values_of(net);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(torch::equal(got[i].second, want[i].second));
  cnn other;
  REQUIRE_THROWS_AS(ddp::load_module(path, *other), ddp::mismatch_error);
}

/// PyTorch's own loop with a clip between backward() and the step — `loss.backward();
/// torch::nn::utils::clip_grad_norm_(net->parameters(), max); dp.step(opt);` under replicate, and
/// ddp::clip_grad_norm_(dp, max) over ddp::parameters(dp) under shard_grad_op — repeated `runs` times: the gradients
/// are averaged when backward() returns, so every run's ranks hold the same bits (verify_in_sync), and each run equals
/// one process clipping its whole batch's gradient.
template <class Backend, class Sharding, class Comm>
void check_clip_loop(Comm comm, int runs) {
  constexpr double max_norm = 0.1;
  auto reference = [&] {
    cnn net = make_model<cnn>(1);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < steps; ++s) {
      net->zero_grad();
      const auto [x, y] = make_batch<cnn>(static_cast<std::uint64_t>(s), global_batch);
      scaled_loss(net->forward(x), y, 1.0 / global_batch).backward();
      REQUIRE(torch::nn::utils::clip_grad_norm_(net->parameters(), max_norm) > 2 * max_norm);  // the clip is active
      opt.step();
    }
    return values_of(net);
  }();
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  const double scale = static_cast<double>(comm.size()) / global_batch;
  for (int run = 0; run < runs; ++run) {
    INFO("run " << run);
    cnn net = make_model<cnn>(1 + static_cast<std::uint64_t>(comm.rank()));
    {
      ddp::data_parallel<cnn, Backend, Sharding> dp{net, comm};
      constexpr bool replicated = std::is_same_v<Sharding, ddp::replicate>;
      torch::optim::SGD opt(replicated ? net->parameters() : ddp::parameters(dp),
                            torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        const auto [x, y] = make_batch<cnn>(static_cast<std::uint64_t>(s), global_batch);
        scaled_loss(net->forward(x.narrow(0, begin, count)), y.narrow(0, begin, count), scale).backward();
        if constexpr (replicated)
          torch::nn::utils::clip_grad_norm_(net->parameters(), max_norm);
        else
          ddp::clip_grad_norm_(dp, max_norm);
        dp.step(opt);
      }
      dp.verify_in_sync();
    }
    require_close(values_of(net), reference);
  }
}

/// ddp::SyncBatchNorm at N ranks on uneven parts (3/3/4 at N = 3) of a [10, 4, 3, 3] batch equals torch::nn::BatchNorm2d
/// on the whole batch in one process, over three training steps: each rank's outputs and input gradients, the weight's
/// and bias's gradients summed over the ranks, the running statistics on every rank (1e-5), and eval-mode outputs.
template <class Comm>
void check_sync_batch_norm(Comm comm) {
  const std::int64_t n = comm.size(), me = comm.rank(), rows = 10, c = 4;
  const std::int64_t begin = me * rows / n, end = (me + 1) * rows / n;
  torch::manual_seed(3);
  torch::nn::BatchNorm2d plain(c);
  ddp::SyncBatchNorm sync(ddp::sync_batch_norm_options(c, comm));
  {
    torch::NoGradGuard no_grad;
    plain->weight.uniform_(0.5, 1.5);
    plain->bias.uniform_(-0.5, 0.5);
    sync->weight.copy_(plain->weight);
    sync->bias.copy_(plain->bias);
  }
  auto close = [](const torch::Tensor& a, const torch::Tensor& b, const char* what) {
    INFO(what << ": largest difference " << (a - b).abs().max().item<double>());
    REQUIRE(((a - b).abs() <= 1e-5 * b.abs().clamp_min(1e-2)).all().item<bool>());
  };
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    torch::manual_seed(100 + step);
    const torch::Tensor x = torch::randn({rows, c, 3, 3}) * 2 + step, dy = torch::randn({rows, c, 3, 3});
    const torch::Tensor xa = x.clone().requires_grad_(true), xs = x.narrow(0, begin, end - begin).clone().requires_grad_(true);
    plain->zero_grad();
    sync->zero_grad();
    const torch::Tensor ya = plain->forward(xa), ys = sync->forward(xs);
    ya.backward(dy);
    ys.backward(dy.narrow(0, begin, end - begin));
    close(ys, ya.narrow(0, begin, end - begin), "output");
    close(xs.grad(), xa.grad().narrow(0, begin, end - begin), "input gradient");
    torch::Tensor g = torch::cat({sync->weight.grad(), sync->bias.grad()}).contiguous();
    comm.all_reduce(std::span<float>(g.data_ptr<float>(), static_cast<std::size_t>(g.numel())), ddp::reduce_op::sum).wait();
    close(g, torch::cat({plain->weight.grad(), plain->bias.grad()}), "weight and bias gradients");
    close(sync->running_mean, plain->running_mean, "running mean");
    close(sync->running_var, plain->running_var, "running variance");
    REQUIRE(sync->num_batches_tracked.item<std::int64_t>() == step + 1);
  }
  plain->eval();
  sync->eval();
  const torch::Tensor probe = torch::randn({2, c, 3, 3});
  close(sync->forward(probe), plain->forward(probe), "eval output");
}

/// A module with BatchNorm (running statistics, an i64 counter) and a frozen head.weight: PyTorch's usual CNN tail.
struct bn_net_impl : torch::nn::Module {
  bn_net_impl()
      : fc(register_module("fc", torch::nn::Linear(6, 5))), bn(register_module("bn", torch::nn::BatchNorm1d(5))),
        head(register_module("head", torch::nn::Linear(5, 3))) {
    head->weight.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(bn(fc(x)))); }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear head;
};
TORCH_MODULE_IMPL(bn_net, bn_net_impl);

/// Every named parameter and buffer of `m` (trainable or not), in order.
inline std::vector<std::pair<std::string, torch::Tensor>> state_of(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value().detach().clone());
  for (const auto& item : m.named_buffers()) out.emplace_back(item.key(), item.value().clone());
  return out;
}

/// bn_net trained three steps at N ranks (each its own batch, train mode): after every step each rank holds rank
/// 0's running statistics, so verify_in_sync (which compares buffers and the frozen weight) passes; ddp::save writes
/// them and the frozen weight, and ddp::load_module reads everything back into a fresh module bit for bit.
template <class Backend, class Comm>
void check_bn_checkpoint(Comm comm, const std::filesystem::path& path) {
  torch::manual_seed(1 + static_cast<std::uint64_t>(comm.rank()));
  bn_net net;
  ddp::data_parallel<bn_net_impl, Backend> dp{*net, comm};
  REQUIRE(dp.model_state().size() == 4);  // head.weight (frozen), bn.running_mean, bn.running_var, bn.num_batches_tracked
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < 3; ++s) {
    dp.zero_grad();
    torch::manual_seed(100 * static_cast<std::uint64_t>(s) + static_cast<std::uint64_t>(comm.rank()));
    const auto x = torch::randn({4, 6}), y = torch::randn({4, 3});
    scaled_loss(net->forward(x), y, 1.0).backward();
    dp.step(opt);
    dp.verify_in_sync();
  }
  REQUIRE(net->bn->num_batches_tracked.item<std::int64_t>() == 3);
  ddp::save(path, dp);
  if (comm.rank() != 0) return;
  torch::manual_seed(99);
  bn_net plain;
  ddp::load_module(path, *plain);
  const auto got = state_of(*plain), want = state_of(*net);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO(got[i].first);
    REQUIRE(got[i].first == want[i].first);
    REQUIRE(torch::equal(got[i].second, want[i].second));
  }
}

}  // namespace ddp_torch_test
