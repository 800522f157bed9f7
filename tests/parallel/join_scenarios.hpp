#pragma once
// Uneven inputs (dp.join()), written once for any communicator (run under TCP and MPI). REQUIRE only: under
// run_ranks a rank fails by throwing.
//
// Rank r of N holds uneven_batches(r, epoch) batches of `join_batch` samples in each of three epochs (5, 7, 3, 6
// in the first; 3, 1, 2, 4 in the second, where another rank runs out first; 0, 2, 1, 1 in the third, where rank 0
// only shadows, under full_shard replaying a step of the epoch before). 13 steps at most: over 18 steps of SGD with
// momentum, two one-process runs that only sum in different orders already differ by 8e-6. Each active rank scales its
// loss to the mean over its own batch. At step k the ranks with a k-th batch are the active ones; the gradient
// must be the mean over the union of their step-k batches, so N ranks must equal one process that steps on
// that union with the mean loss, step by step (tolerance as in scenarios.hpp).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/core/error.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "mlp.hpp"
#include "scenarios.hpp"

namespace ddp_test {

inline constexpr std::size_t join_batch = 3;  // samples per batch, the same on every rank
inline constexpr int join_epochs = 3;

/// Batches rank `rank` (of at most 4) trains on in epoch `epoch`.
inline int uneven_batches(int rank, int epoch) {
  constexpr std::array<std::array<int, 4>, join_epochs> counts{{{5, 7, 3, 6}, {3, 1, 2, 4}, {0, 2, 1, 1}}};
  return counts[static_cast<std::size_t>(epoch)][static_cast<std::size_t>(rank)];
}

/// Rank `rank`'s k-th batch of epoch `epoch`.
inline batch join_batch_of(int epoch, int rank, int k) {
  return make_batch(static_cast<std::uint64_t>(10000 * epoch + 100 * rank + k), join_batch);
}

/// The batches `parts` one after the other.
inline batch concatenate(const std::vector<batch>& parts) {
  batch all;
  for (const auto& p : parts) {
    all.x.insert(all.x.end(), p.x.begin(), p.x.end());
    all.y.insert(all.y.end(), p.y.begin(), p.y.end());
    all.n += p.n;
  }
  return all;
}

/// One process: at every step of every epoch, the union of the active ranks' batches with the mean loss.
inline mlp join_reference(optimizer_kind k, int n) {
  mlp m = make_mlp(1);
  with_optimizer(k, [&](auto& opt) {
    const auto buffers = per_parameter_buffers(m);
    for (int e = 0; e < join_epochs; ++e) {
      int longest = 0;
      for (int r = 0; r < n; ++r) longest = std::max(longest, uneven_batches(r, e));
      for (int s = 0; s < longest; ++s) {
        std::vector<batch> parts;
        for (int r = 0; r < n; ++r)
          if (s < uneven_batches(r, e)) parts.push_back(join_batch_of(e, r, s));
        const batch all = concatenate(parts);
        zero_grad(m);
        forward_backward(m, all, 1.0F / static_cast<float>(all.n), [](auto&) {});
        opt.step(buffers);
      }
    }
  });
  return m;
}

/// N ranks with policies Ps (the sharding policy's value `sharding`), each on its own number of batches inside
/// a join scope per epoch, end with the parameters of join_reference; the replicas agree (verify_in_sync).
/// `micro` > 1 (replicate) accumulates the first micro - 1 samples of each batch one by one under no_sync.
/// `weight_first` reports each layer's weight before its bias, which is not reverse visit order: replicate
/// rebuilds its buckets after the first step, and the shadow steps run on the rebuilt buckets.
template <class... Ps, class Comm>
void check_join(Comm comm, optimizer_kind k, double tol, closeness how = closeness::per_element,
                typename ddp::policies<Ps...>::sharding sharding = {}, std::size_t micro = 1,
                bool weight_first = false) {
  mlp model = make_mlp(1 + static_cast<std::uint64_t>(comm.rank()));  // rank 0's values are broadcast
  {
    ddp::data_parallel<mlp, Ps...> dp{model, comm, sharding};
    auto scope = [&](auto& l) { return dp.unshard(l); };
    ddp::parameter<float>* bias = nullptr;  // weight_first: the layer's bias, reported after its weight
    auto report = [&](ddp::parameter<float>& p) {
      if (weight_first && bias == nullptr) {
        bias = &p;
        return;
      }
      dp.gradient_ready(p);
      if (bias != nullptr) dp.gradient_ready(*std::exchange(bias, nullptr));
    };
    const auto planned = dp.bucket_count();
    with_optimizer(k, [&](auto& opt) {
      for (int e = 0; e < join_epochs; ++e) {
        auto j = dp.join();
        for (int s = 0; s < uneven_batches(comm.rank(), e); ++s) {
          dp.zero_grad();
          const batch mine = join_batch_of(e, comm.rank(), s);
          for (std::size_t m = 0; m + 1 < micro; ++m) {
            auto guard = dp.no_sync();
            forward_backward(model, mine.slice(m, 1), 1.0F / join_batch, report, scope);
            guard.close();
          }
          forward_backward(model, mine.slice(micro - 1, join_batch - (micro - 1)), 1.0F / join_batch, report, scope);
          dp.step(opt);
        }
        j.finish(opt);
      }
    });
    dp.verify_in_sync();
    dp.unshard_model();
    if (weight_first && std::is_same_v<typename ddp::policies<Ps...>::sharding, ddp::replicate>)
      REQUIRE(dp.bucket_count() != planned);  // rebuilt: buckets stop between each layer's weight and bias
  }
  mlp want = join_reference(k, comm.size());
  require_close(model, want, tol, how);
}

/// A join scope dropped without finish(opt) on every rank (an exception leaves the loop) makes each rank's next
/// call throw ddp::error naming finish, before any collective, so no rank waits for another; a sharded
/// policy's no_sync inside a join scope and a second scope are refused.
template <class Backend, class Comm>
void check_join_errors(Comm comm) {
  mlp model = make_mlp(1);
  ddp::data_parallel<mlp, Backend, ddp::full_shard> dp{model, comm};
  ddp::optim::sgd opt({.lr = 0.1});
  auto scope = [&](auto& l) { return dp.unshard(l); };
  auto report = [&](auto& p) { dp.gradient_ready(p); };
  {
    auto j = dp.join();
    REQUIRE_THROWS_WITH(dp.join(), Catch::Contains("already open"));
    REQUIRE_THROWS_WITH(dp.no_sync(), Catch::Contains("inside a join scope"));
    j.finish(opt);  // no rank took a batch: every rank counts 0 at once
  }
  try {
    auto j = dp.join();
    dp.zero_grad();
    forward_backward(model, make_batch(0, join_batch), 1.0F, report, scope);
    dp.step(opt);
    throw std::runtime_error("the data ran out badly");  // leaves the scope without finish(opt)
  } catch (const std::runtime_error& e) {
    REQUIRE(std::string(e.what()) == "the data ran out badly");
  }
  const auto refused = [&](auto call) {
    try {
      call();
      FAIL("a call after a join scope dropped without finish(opt) did not throw");
    } catch (const ddp::error& e) {
      INFO(e.what());
      REQUIRE(e.rank() == comm.rank());
      REQUIRE_THAT(e.what(), Catch::Contains("ended without j.finish(opt)"));
    }
  };
  refused([&] { dp.step(opt); });
  refused([&] { (void)dp.join(); });
  refused([&] { dp.gradient_ready(model.fc1.bias); });
  refused([&] { dp.finish_gradients(); });
  refused([&] { dp.verify_in_sync(); });
  refused([&] { dp.unshard_model(); });
}

}  // namespace ddp_test
