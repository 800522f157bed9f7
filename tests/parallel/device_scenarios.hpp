#pragma once
// data_parallel with the model on fake devices (device_mlp.hpp), written once for any communicator: N ranks
// training the device model under a policy give one process's parameters on the whole batch (scenarios.hpp's
// reference and tolerance), with the model on one device or split over two (DDP with model parallelism: one arena
// per device). The fake device keeps its memory PROT_NONE outside its own operations, so any host access ddp makes
// to a device arena kills the rank, and its stream sleeps a random time before each operation, so a missing
// ordering shows as a wrong value.

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/checkpoint.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "device_mlp.hpp"
#include "join_scenarios.hpp"
#include "mixed_scenarios.hpp"
#include "scenarios.hpp"
#include "support/fake_device.hpp"

namespace ddp_test {

/// Every parameter of `a` equals `b`'s bit for bit.
inline void require_same_bits(mlp& a, mlp& b) {
  std::vector<std::vector<float>> want;
  ddp::visit_parameters(b, [&](std::string_view, ddp::parameter<float>& p) {
    want.emplace_back(p.value().begin(), p.value().end());
  });
  std::size_t k = 0;
  ddp::visit_parameters(a, [&](std::string_view name, ddp::parameter<float>& p) {
    INFO("parameter " << name);
    REQUIRE(std::equal(p.value().begin(), p.value().end(), want[k].begin(), want[k].end(),
                       [](float x, float y) { return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y); }));
    ++k;
  });
}

/// A communicator whose operations follow a device's stream binds to `d` while the returned value lives
/// (stream_comm.hpp); any other runs as it is.
template <class Comm>
int bind_stream(Comm&, ddp::testing::fake_device&) {
  return 0;
}

/// The first of the two fake devices a rank trains on: cuda:0, or a pair of its own where the ranks share a process
/// (ddp::local's threads: rank r on cuda:2r and cuda:2r+1).
template <class Comm>
int first_device(const Comm& comm) {
  if constexpr (requires { comm.world_rank(); }) return 2 * comm.world_rank();
  else return 0;
}

/// How train_on_devices runs.
struct device_run {
  bool split = false;      ///< fc3 on a second device
  int micro = 1;           ///< micro-batches per step
  bool forgetful = false;  ///< the devices drop every order_after (a missing ordering wait)
  std::string checkpoint = {};  ///< non-empty: after half the steps, save there (ddp::save, or save_sharded under
                                ///< `sharded_checkpoint`), and go on in a new wrapper, optimizer and model loaded from it
  bool sharded_checkpoint = false;
};

/// Trains the device model as check_equivalence_of trains the host one and returns the trained values.
template <class... Ps, class Comm>
mlp train_on_devices(Comm comm, optimizer_kind k, const device_run& run,
                     typename ddp::policies<Ps...>::sharding sharding = {}, ddp::data_parallel_options options = {}) {
  using namespace std::chrono_literals;
  const auto seed = static_cast<unsigned>(comm.rank()) * 7 + 3;
  const int first = first_device(comm);
  ddp::testing::fake_device dev(first, 0us, 40us, seed), other(first + 1, 0us, 40us, seed);
  if (run.forgetful) {
    dev.forget_ordering();
    other.forget_ordering();
  }
  const ddp::device_registration on_dev(dev), on_other(other);
  ddp::testing::fake_device& last = run.split ? other : dev;
  [[maybe_unused]] const auto ordered = bind_stream(comm, dev);
  mlp base = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));  // rank 0's values are broadcast
  std::optional<device_model> placed(std::in_place, base, dev, last);
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  const float scale = static_cast<float>(comm.size()) / global_batch;
  // Steps [from, to) on a new wrapper over `placed`, which loads the checkpoint first when `resume`.
  auto train = [&](int from, int to, bool resume, bool save) {
    ddp::data_parallel<device_mlp, Ps...> dp{placed->model, comm, sharding, options};
    REQUIRE(dp.layout().arenas().size() == (run.split ? 2U : 1U));
    auto scope = [&](auto& l) { return dp.unshard(l); };
    auto report = [&](auto& p) { dp.gradient_ready(p); };
    with_optimizer(k, [&](auto& opt) {
      if (resume) {
        if (run.sharded_checkpoint) ddp::load_sharded(run.checkpoint, dp, opt);
        else ddp::load(run.checkpoint, dp, opt);
      }
      for (int s = from; s < to; ++s) {
        dp.zero_grad();
        const batch mine = make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count);
        over_micro_batches(dp, mine, run.micro, [&](const batch& b) {
          device_forward_backward(placed->model, b, scale, report, scope, dev, last);
        });
        dp.step(opt);
      }
      if (save) {
        if (run.sharded_checkpoint) ddp::save_sharded(run.checkpoint, dp, opt);
        else ddp::save(run.checkpoint, dp, opt);
      }
    });
    if (!run.forgetful) dp.verify_in_sync();
    dp.unshard_model();  // full_shard: the model's own parameters take the trained values
  };
  if (run.checkpoint.empty()) {
    train(0, steps, false, false);
  } else {
    train(0, steps / 2, false, true);
    mlp other_start = make_mlp(50 + static_cast<std::uint64_t>(comm.rank()));  // the checkpoint must overwrite it
    placed.emplace(other_start, dev, last);
    train(steps / 2, steps, true, false);
  }
  return read_back(placed->model, dev, last);
}

/// train_on_devices within `tol` of one process on the whole batch, and bit for bit what the same policies give on
/// the host (the fake device runs the host's arithmetic, so any difference is an operation lost, repeated or run
/// out of order).
template <class... Ps, class Comm>
mlp check_device_equivalence(Comm comm, optimizer_kind k, bool split, int micro = 1, double tol = 1e-5,
                             closeness how = closeness::per_element,
                             typename ddp::policies<Ps...>::sharding sharding = {},
                             ddp::data_parallel_options options = {}) {
  mlp got = train_on_devices<Ps...>(comm, k, {.split = split, .micro = micro}, sharding, options);
  mlp want = reference_training(k);
  require_close(got, want, tol, how);
  mlp host = check_equivalence_of<mlp, Ps...>(comm, k, tol, micro, how, sharding, options);
  require_same_bits(got, host);
  return got;
}

/// Half the steps on the devices, a checkpoint (full or sharded) of the device arenas, the other half in a new
/// wrapper and optimizer over a model loaded from it: bit for bit the uninterrupted training on the host.
template <class... Ps, class Comm>
void check_device_checkpoint(Comm comm, optimizer_kind k, bool split, bool sharded, const std::string& path,
                             typename ddp::policies<Ps...>::sharding sharding = {}) {
  mlp got = train_on_devices<Ps...>(comm, k, {.split = split, .checkpoint = path, .sharded_checkpoint = sharded},
                                    sharding);
  mlp host = check_equivalence_of<mlp, Ps...>(comm, k, 1e-5, 1, closeness::per_element, sharding);
  require_same_bits(got, host);
}

/// The largest relative difference between `a` and `b` over every parameter element (scenarios.hpp's measure).
inline double worst_difference(mlp& a, mlp& b) {
  std::vector<std::vector<float>> want;
  ddp::visit_parameters(b, [&](std::string_view, ddp::parameter<float>& p) {
    want.emplace_back(p.value().begin(), p.value().end());
  });
  double worst = 0;
  std::size_t k = 0;
  ddp::visit_parameters(a, [&](std::string_view, ddp::parameter<float>& p) {
    for (std::size_t i = 0; i < p.numel(); ++i)
      worst = std::max(worst, std::abs(double(p.value()[i]) - want[k][i]) / std::max(std::abs(double(want[k][i])), 1e-2));
    ++k;
  });
  return worst;
}

/// join_scenarios.hpp's uneven epochs with the model on the devices: each rank steps its own number of batches
/// inside a join scope per epoch; the result equals join_reference (the mean over the active ranks' batches at
/// every step) and the replicas agree.
template <class... Ps, class Comm>
void check_device_join(Comm comm, optimizer_kind k, bool split, typename ddp::policies<Ps...>::sharding sharding = {}) {
  using namespace std::chrono_literals;
  const auto seed = static_cast<unsigned>(comm.rank()) * 5 + 1;
  const int first = first_device(comm);
  ddp::testing::fake_device dev(first, 0us, 40us, seed), other(first + 1, 0us, 40us, seed);
  const ddp::device_registration on_dev(dev), on_other(other);
  ddp::testing::fake_device& last = split ? other : dev;
  mlp base = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));
  device_model placed(base, dev, last);
  {
    ddp::data_parallel<device_mlp, Ps...> dp{placed.model, comm, sharding};
    auto scope = [&](auto& l) { return dp.unshard(l); };
    auto report = [&](auto& p) { dp.gradient_ready(p); };
    with_optimizer(k, [&](auto& opt) {
      for (int e = 0; e < join_epochs; ++e) {
        auto j = dp.join();
        for (int s = 0; s < uneven_batches(comm.rank(), e); ++s) {
          dp.zero_grad();
          device_forward_backward(placed.model, join_batch_of(e, comm.rank(), s), 1.0F / join_batch, report, scope,
                                  dev, last);
          dp.step(opt);
        }
        j.finish(opt);
      }
    });
    dp.verify_in_sync();
    dp.unshard_model();
  }
  mlp got = read_back(placed.model, dev, last);
  mlp want = join_reference(k, comm.size());
  require_close(got, want, 1e-5, closeness::per_element);
}

/// Every parameter of `a` has `b`'s bits (any element type with a bit-exact ==, such as bf16's `bits`).
template <class Model>
void require_same_bits_of(Model& a, Model& b) {
  using T = std::remove_cvref_t<decltype(a.fc1.weight.value()[0])>;
  std::vector<std::vector<T>> want;
  ddp::visit_parameters(b, [&](std::string_view, ddp::parameter<T>& p) { want.emplace_back(p.value().begin(), p.value().end()); });
  std::size_t k = 0;
  ddp::visit_parameters(a, [&](std::string_view name, ddp::parameter<T>& p) {
    INFO("parameter " << name);
    for (std::size_t i = 0; i < p.numel(); ++i) REQUIRE(std::memcmp(&p.value()[i], &want[k][i], sizeof(T)) == 0);
    ++k;
  });
}

/// Mixed precision (Ps hold a ddp::mixed_precision) with the model of the compute dtype on the devices: bit for bit
/// what the same policies give the model in host memory (mixed_scenarios.hpp checks that one against one process).
template <class... Ps, class Comm>
void check_device_mixed(Comm comm, optimizer_kind k, bool split, typename ddp::policies<Ps...>::sharding sharding = {}) {
  using namespace std::chrono_literals;
  using T = compute_of<Ps...>;
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  const float scale = static_cast<float>(comm.size()) / global_batch;
  mlp_of<T> host = make_rounded_mlp<T>(1 + static_cast<std::uint64_t>(comm.rank()));
  {
    ddp::data_parallel<mlp_of<T>, Ps...> dp{host, comm, sharding};
    auto scope = [&](auto& l) { return dp.unshard(l); };
    auto report = [&](auto& p) { dp.gradient_ready(p); };
    with_optimizer(k, [&](auto& opt) {
      for (int s = 0; s < steps; ++s) {
        dp.zero_grad();
        forward_backward(host, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count), scale,
                         report, scope);
        dp.step(opt);
      }
    });
    dp.unshard_model();
  }
  const auto seed = static_cast<unsigned>(comm.rank()) * 3 + 2;
  const int first = first_device(comm);
  ddp::testing::fake_device dev(first, 0us, 40us, seed), other(first + 1, 0us, 40us, seed);
  const ddp::device_registration on_dev(dev), on_other(other);
  ddp::testing::fake_device& last = split ? other : dev;
  mlp_of<T> start = make_rounded_mlp<T>(1 + static_cast<std::uint64_t>(comm.rank()));
  device_model_of<T> placed(start, dev, last);
  {
    ddp::data_parallel<device_mlp_of<T>, Ps...> dp{placed.model, comm, sharding};
    auto scope = [&](auto& l) { return dp.unshard(l); };
    auto report = [&](auto& p) { dp.gradient_ready(p); };
    with_optimizer(k, [&](auto& opt) {
      for (int s = 0; s < steps; ++s) {
        dp.zero_grad();
        device_forward_backward(placed.model, make_batch(static_cast<std::uint64_t>(s), global_batch).slice(begin, count),
                                scale, report, scope, dev, last);
        dp.step(opt);
      }
    });
    dp.verify_in_sync();
    dp.unshard_model();
  }
  mlp_of<T> got = make_rounded_mlp<T>(1);
  read_back_into(got, placed.model, dev, last);
  require_same_bits_of(got, host);
}

/// A model of one ddp::parameter, bound by its owner to a device's memory.
struct device_bound_model {
  ddp::parameter<float> w;
};

/// A ddp::parameter bound to a fake device's memory keeps its device through the wrapper: one sgd step from a
/// gradient of ones, and once the wrapper is gone the parameter points at the memory it was bound to, which holds
/// the trained values (read through the device; the host cannot read the fake device's memory).
template <class Backend, class Comm>
void check_device_parameter_survives(Comm comm) {
  using namespace std::chrono_literals;
  ddp::testing::fake_device dev(first_device(comm), 0us, 40us);
  const ddp::device_registration on_dev(dev);
  std::vector<float> start{1, 2, 3, 4}, ones(4, 1.0F);
  const ddp::domain_buffer values = dev.allocate(4 * sizeof(float)), grads = dev.allocate(4 * sizeof(float));
  auto on_device = [&](const ddp::domain_buffer& b) { return ddp::raw_tensor{b.data(), 4, ddp::dtype::f32, dev.where()}; };
  dev.copy(ddp::raw_tensor::of(std::span<float>(start)), on_device(values));
  dev.synchronize();
  device_bound_model m{ddp::parameter<float>({4})};
  m.w.bind(reinterpret_cast<float*>(values.data()), reinterpret_cast<float*>(grads.data()), dev.where(), false);
  {
    ddp::data_parallel<device_bound_model, Backend> dp{m, comm};
    REQUIRE(m.w.device() == dev.where());  // adopted into ddp's arena on the same device
    ddp::optim::sgd opt({.lr = 0.5});
    dp.zero_grad();
    dev.copy(ddp::raw_tensor::of(std::span<float>(ones)),
             ddp::raw_tensor{m.w.grad().data(), 4, ddp::dtype::f32, dev.where()});
    dp.gradient_ready(m.w);
    dp.step(opt);
  }
  REQUIRE(m.w.device() == dev.where());
  REQUIRE(m.w.value().data() == reinterpret_cast<float*>(values.data()));
  std::vector<float> got(4);
  dev.copy(on_device(values), ddp::raw_tensor::of(std::span<float>(got)));
  dev.synchronize();
  REQUIRE(got == std::vector<float>{0.5F, 1.5F, 2.5F, 3.5F});
}

}  // namespace ddp_test
