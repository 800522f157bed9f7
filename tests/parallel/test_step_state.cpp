// The step in one process: the bucket planner, the unit pool, every phase transition of step_state (an illegal
// one raises ddp::error), and the exact sequence of collectives each policy issues, seen through a recording
// loopback communicator (replicate, shard_grad_op, full_shard with prefetch, hybrid, no_sync, several buckets).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/core/trainable.hpp>
#include <ddp/memory/average.hpp>
#include <ddp/optim/sgd.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/data_parallel.hpp>
#include <ddp/parallel/step_state.hpp>
#include <ddp/parallel/unit_pool.hpp>

#include "recording_comm.hpp"

namespace {
std::atomic<std::size_t> allocations{0};  // every plain operator new of this executable
}  // namespace

// Counts allocations for the join-recording test (replaces the global operator new of this executable).
void* operator new(std::size_t bytes) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // g++ pairs the inlined new with free(): it is malloc's
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t /*bytes*/) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace {

using strings = std::vector<std::string>;
using ddp_test::recording_backend;
using ddp_test::recording_comm;

struct layer {
  ddp::parameter<float> w, b;
};
/// Three units of 4 + 2, 4 + 2 and 2 + 2 floats: slots fc1.w 0, fc1.b 1, fc2.w 2, fc2.b 3, fc3.w 4, fc3.b 5.
struct net {
  layer fc1, fc2, fc3;
};
net make_net() {
  auto p = [](std::vector<std::size_t> shape) {
    ddp::parameter<float> out(shape);
    for (std::size_t i = 0; i < out.numel(); ++i) out.value()[i] = 0.25F * static_cast<float>(i + 1);
    return out;
  };
  return {{p({2, 2}), p({2})}, {p({2, 2}), p({2})}, {p({1, 2}), p({2})}};
}
using four_floats = ddp::bucket_bytes<16, 16>;
/// The recorded sequences below leave out the first step's gradient check (its collective has a case of its own).
const ddp::data_parallel_options sequence_only{.check_first_gradients = false};

/// A part that names two parameters of its choice (for the units-by-object errors).
struct two_parameters {
  ddp::parameter<float>& first;
  ddp::parameter<float>& second;
  template <class F>
  void visit_parameters(F&& f) {
    f("first", first);
    f("second", second);
  }
};

struct bucket_range {
  std::size_t begin, end, unit;
  bool operator==(const bucket_range&) const = default;
};
std::vector<bucket_range> ranges(const ddp::detail::bucket_plan& plan) {
  std::vector<bucket_range> out;
  for (const auto& b : plan.buckets) out.push_back({b.begin, b.end, b.unit});
  return out;
}

/// A backward over `layers` (indices into fc1, fc2, fc3), last layer first, each inside an unshard scope,
/// reporting bias then weight.
template <class DP>
void backward(DP& dp, net& m, std::vector<int> layers) {
  layer* all[] = {&m.fc1, &m.fc2, &m.fc3};
  for (const int l : layers) {
    auto g = dp.unshard(*all[l]);
    for (auto* p : {&all[l]->b, &all[l]->w}) {
      for (auto& x : p->grad()) x += 1.0F;
      dp.gradient_ready(*p);
    }
  }
}
/// Opens and closes an unshard scope on each layer in `layers` (a forward).
template <class DP>
void forward(DP& dp, net& m, std::vector<int> layers) {
  layer* all[] = {&m.fc1, &m.fc2, &m.fc3};
  for (const int l : layers) auto g = dp.unshard(*all[l]);
}

}  // namespace

TEST_CASE("bucket planner: reverse visit order, first bucket smaller, boundaries inside parameters", "[step]") {
  net m = make_net();
  ddp::detail::parameter_layout layout(m);
  const auto plan = ddp::detail::plan_buckets(layout, 16, 8);
  // 16 floats from the end: 2 first, then 4 each; [10, 14) spans fc2.b and fc3.w, [2, 6) starts inside fc1.w
  REQUIRE(ranges(plan) == std::vector<bucket_range>{{14, 16, 2}, {10, 14, 2}, {6, 10, 1}, {2, 6, 0}, {0, 2, 0}});
  REQUIRE(plan.of_param[0] == std::vector<std::size_t>{3, 4});  // fc1.w [0, 4) overlaps [2, 6) and [0, 2)
  REQUIRE(plan.of_param[4] == std::vector<std::size_t>{1});      // fc3.w [12, 14)
  REQUIRE(plan.buckets[1].params == std::vector<std::size_t>{3, 4});
}

TEST_CASE("bucket planner: in ready order, contiguous runs that fit, a slot beyond the capacity cut in pieces",
          "[step][rebuild]") {
  net m = make_net();  // slots fc1.w [0, 4), fc1.b [4, 6), fc2.w [6, 10), fc2.b [10, 12), fc3.w [12, 14), fc3.b [14, 16)
  ddp::detail::parameter_layout layout(m);
  using order = std::vector<std::size_t>;
  const order weight_first{4, 5, 2, 3, 0, 1};  // first bucket 2 floats, then 4: no two slots fit together
  REQUIRE(ranges(ddp::detail::plan_in_ready_order(layout, weight_first, 16, 8)) ==
          std::vector<bucket_range>{{12, 14, 2}, {14, 16, 2}, {6, 10, 1}, {10, 12, 1}, {0, 4, 0}, {4, 6, 0}});
  // 3 then 6 floats: fc1.w and fc2.b would fit but are not contiguous; fc2.b and fc2.w are, and fit
  const auto forward_layers = ddp::detail::plan_in_ready_order(layout, order{1, 0, 3, 2, 5, 4}, 24, 12);
  REQUIRE(ranges(forward_layers) == std::vector<bucket_range>{{4, 6, 0}, {0, 4, 0}, {6, 12, 1}, {12, 16, 2}});
  REQUIRE(forward_layers.of_param[3] == std::vector<std::size_t>{2});
  // 1 then 3 floats: fc3.b, fc2.w and fc1.w exceed them and are cut from their ends
  REQUIRE(ranges(ddp::detail::plan_in_ready_order(layout, order{5, 4, 3, 2, 1, 0}, 12, 4)) ==
          std::vector<bucket_range>{{15, 16, 2}, {14, 15, 2}, {12, 14, 2}, {10, 12, 1}, {7, 10, 1}, {6, 7, 1},
                                    {4, 6, 0}, {1, 4, 0}, {0, 1, 0}});
  REQUIRE(ddp::detail::in_reverse_visit_order(layout, order{5, 4, 3, 2, 1, 0}));
  REQUIRE(!ddp::detail::in_reverse_visit_order(layout, weight_first));
}

TEST_CASE("bucket planner: the unit the backward reaches last gets buckets of its own", "[step][rebuild]") {
  net m = make_net();  // units fc1 [0, 6), fc2 [6, 12), fc3 [12, 16); the backward reaches fc1 last
  ddp::detail::parameter_layout layout(m);
  // room for everything after the first bucket: without the cut, fc1 would share [0, 14) with fc2 and fc3
  REQUIRE(ranges(ddp::detail::plan_buckets(layout, 256, 8)) ==
          std::vector<bucket_range>{{14, 16, 2}, {6, 14, 2}, {0, 6, 0}});
  using order = std::vector<std::size_t>;
  REQUIRE(ranges(ddp::detail::plan_in_ready_order(layout, order{5, 4, 3, 2, 1, 0}, 256, 8)) ==
          std::vector<bucket_range>{{14, 16, 2}, {6, 14, 2}, {0, 6, 0}});
  // the gradients before the last unit must fill a first bucket (here 64 floats): else nothing is gained
  REQUIRE(ranges(ddp::detail::plan_buckets(layout, 256, 256)) == std::vector<bucket_range>{{0, 16, 2}});
  REQUIRE(ranges(ddp::detail::plan_in_ready_order(layout, order{5, 4, 3, 2, 1, 0}, 256, 256)) ==
          std::vector<bucket_range>{{0, 16, 2}});
}

TEST_CASE("bucket planner: sharded buckets hold multiples of N and never cross a unit", "[step]") {
  net m = make_net();
  ddp::detail::parameter_layout layout(m, 4);  // N = 4: units start at 0, 8, 16; the arena is 20 long
  REQUIRE(layout.arenas()[0].numel == 20);
  const auto plan = ddp::detail::plan_buckets(layout, 32, 16, 4, ddp::detail::bucket_cut::within_units);
  REQUIRE(ranges(plan) == std::vector<bucket_range>{{16, 20, 2}, {8, 16, 1}, {0, 8, 0}});
  const auto cut = ddp::detail::plan_buckets(layout, 24, 24, 4, ddp::detail::bucket_cut::within_units);  // 6 floats: 4
  REQUIRE(ranges(cut) == std::vector<bucket_range>{{16, 20, 2}, {12, 16, 1}, {8, 12, 1}, {4, 8, 0}, {0, 4, 0}});
}

TEST_CASE("unit pool: the smallest idle buffer that fits, reuse, trim", "[step]") {
  ddp::detail::unit_pool pool({4, 8});  // f32 and f64 arenas
  const std::size_t small = pool.take(std::vector<std::size_t>{10, 1});
  REQUIRE(pool.bytes() == 48);
  const std::size_t large = pool.take(std::vector<std::size_t>{20, 2});
  REQUIRE(large != small);
  pool.give(large);
  pool.give(small);
  REQUIRE(pool.take(std::vector<std::size_t>{5, 1}) == small);  // fits both: the smaller
  REQUIRE(pool.take(std::vector<std::size_t>{5, 1}) == large);  // the smaller is busy
  pool.give(small);
  pool.give(large);
  REQUIRE(pool.take(std::vector<std::size_t>{10, 3}) != small);  // fits neither: a new buffer
  pool.trim(ddp::detail::pool_trim::untaken);  // every buffer was taken since the last trim: all stay
  REQUIRE(pool.bytes() == 48 + 96 + 64);
  pool.trim(ddp::detail::pool_trim::untaken);  // none taken since: the idle ones go, the busy one stays
  REQUIRE(pool.bytes() == 64);
  pool.trim(ddp::detail::pool_trim::all_idle);
  REQUIRE(pool.bytes() == 64);
}

TEST_CASE("step state: every legal transition, and each illegal one raises a ddp::error naming it", "[step]") {
  using namespace ddp::detail;
  net m = make_net();
  parameter_layout layout(m);
  const auto plan = plan_buckets(layout, 16, 8);  // 5 buckets
  const std::vector<std::size_t> slot_units{0, 0, 1, 1, 2, 2};
  step_state st(plan, slot_units, 3, unit_phase::sharded, false, 3);
  const auto raises = [](auto&& f, const std::string& text) {
    try {
      f();
      FAIL("no error for: " << text);
    } catch (const ddp::error& e) {
      INFO(e.what());
      REQUIRE(e.rank() == 3);
      REQUIRE_THAT(e.what(), Catch::Contains(text));
    }
  };
  REQUIRE(st.phase() == step_phase::idle);
  raises([&] { st.report(5); }, "cannot report a gradient while the step is idle");
  raises([&] { st.finish(); }, "cannot finish the gradients while the step is idle");

  const std::vector<char> unused{0, 0, 0, 0, 0, 0};
  st.begin(unused);
  REQUIRE(st.phase() == step_phase::reporting);
  raises([&] { st.begin(unused); }, "cannot begin a step while the step is reporting");
  REQUIRE(!st.next_ready());
  REQUIRE(st.report(5));
  REQUIRE(!st.report(5));  // twice: the caller names the parameter
  REQUIRE(st.next_ready() == std::size_t{0});
  raises([&] { st.start(1, ddp::work{}); }, "bucket 1 cannot go from waiting to started out of plan order (bucket 0 is next)");
  raises([&] { st.complete(0); }, "bucket 0 cannot go from waiting to reduced");
  raises([&] { st.chain(0, ddp::work{}); }, "bucket 0 cannot go from waiting to chained");
  st.start(0, ddp::work{});
  REQUIRE(st.bucket(0).phase == bucket_phase::started);
  REQUIRE(st.started() == 1);
  REQUIRE(st.scattered(0));  // a default work is complete
  REQUIRE(!st.unit_settled(2));
  st.chain(0, ddp::work{});
  REQUIRE(st.bucket(0).phase == bucket_phase::chained);
  raises([&] { st.chain(0, ddp::work{}); }, "bucket 0 cannot go from chained to chained");
  raises([&] { st.finish(); }, "bucket 0 cannot go from chained to reduced");
  st.wait(0);
  st.complete(0);
  REQUIRE(st.bucket(0).phase == bucket_phase::reduced);
  raises([&] { st.complete(0); }, "bucket 0 cannot go from reduced to reduced");
  for (std::size_t s = 0; s < 5; ++s) REQUIRE(st.report(s));
  for (std::size_t b = 1; b < 5; ++b) {
    REQUIRE(st.next_ready() == b);
    st.start(b, ddp::work{});
  }
  REQUIRE(!st.next_ready());
  raises([&] { st.finish(); }, "bucket 1 cannot go from started to reduced");
  raises([&] { st.abandon(); }, "bucket 1 cannot go from started to waiting");
  for (std::size_t b = 1; b < 5; ++b) st.complete(b);
  REQUIRE(st.unit_settled(2));
  raises([&] { st.replan(); }, "cannot rebuild the buckets while the step is reporting (it must be finished)");
  st.finish();
  REQUIRE(st.phase() == step_phase::finished);
  REQUIRE(st.report_order().size() == 6);  // every slot, once, in the order reported
  st.replan();  // the plan's buckets again, each reduced: the finished step stays finished
  REQUIRE(st.started() == 5);
  REQUIRE(st.bucket(4).phase == bucket_phase::reduced);
  REQUIRE(st.unit_buckets(2).size() == 2);
  st.end();
  REQUIRE(st.phase() == step_phase::idle);
  st.begin(unused);  // every bucket waits again
  REQUIRE(st.bucket(3).phase == bucket_phase::waiting);
  REQUIRE(!st.reported(0));

  // units: sharded → unsharding → unsharded → sharded
  REQUIRE(st.unit(1).values == unit_phase::sharded);
  const auto wait = [](std::size_t, ddp::work& w) { w.wait(); };
  raises([&] { st.unsharded(1, wait); }, "unit 1 cannot go from sharded to unsharded");
  raises([&] { st.reshard(1); }, "unit 1 cannot go from sharded to sharded");
  st.unshard(1, {});
  REQUIRE(st.unit(1).values == unit_phase::unsharding);
  raises([&] { st.unshard(1, {}); }, "unit 1 cannot go from unsharding to unsharding");
  st.unsharded(1, wait);
  REQUIRE(st.unit(1).values == unit_phase::unsharded);
  st.reshard(1);
  REQUIRE(st.unit(1).values == unit_phase::sharded);
  // gradient storage: released → held → reported → held → released
  raises([&] { st.move_grads(1, grad_phase::reported, {grad_phase::held}); },
         "gradient storage of unit 1 cannot go from released to reported");
  st.move_grads(1, grad_phase::held, {grad_phase::released});
  st.move_grads(1, grad_phase::reported, {grad_phase::held});
  st.move_grads(1, grad_phase::held, {grad_phase::reported});
  st.move_grads(1, grad_phase::released, {grad_phase::held, grad_phase::reported});
  REQUIRE(st.unit(1).grads == grad_phase::released);
  // scopes
  raises([&] { st.close_scope(2); }, "unit 2 has no open unshard scope to close");
  st.open_scope(2);
  st.open_scope(2);
  REQUIRE(!st.close_scope(2));
  REQUIRE(st.close_scope(2));
}

TEST_CASE("recorded: replicate all-reduces each bucket as it completes, no_sync sends nothing, step after "
          "finish_gradients", "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  auto& log = comm.log();
  ddp::optim::sgd opt({.lr = 0.1});
  {
    ddp::data_parallel<net, recording_backend, four_floats> dp{m, comm};
    REQUIRE(log.calls() == strings{"world all_gather 1>2 i64 #0", "wait #0", "world broadcast 16 f32 #1", "wait #1"});
    log.clear();
    dp.zero_grad();
    {
      auto guard = dp.no_sync();
      backward(dp, m, {2, 1, 0});
      guard.close();
    }
    REQUIRE(log.calls().empty());
    // fc3 completes [12, 16); fc2 [8, 12) and [6, 8) (fc1, the last unit, has buckets of its own); fc1 [2, 6), [0, 2)
    backward(dp, m, {2, 1, 0});
    REQUIRE(log.calls() == strings{"world all_reduce 4 f32 #0", "world all_reduce 4 f32 #1",
                                   "world all_reduce 2 f32 #2", "world all_reduce 4 f32 #3",
                                   "world all_reduce 2 f32 #4"});
    dp.finish_gradients();
    dp.step(opt);  // legal after finish_gradients: steps the same gradients, no second reduction
    REQUIRE(log.calls() == strings{"world all_reduce 4 f32 #0", "world all_reduce 4 f32 #1",
                                   "world all_reduce 2 f32 #2", "world all_reduce 4 f32 #3",
                                   "world all_reduce 2 f32 #4", "wait #0", "wait #1", "wait #2", "wait #3",
                                   "wait #4", "world broadcast 6 i64 #5", "wait #5"});  // rank 0's order
    REQUIRE(m.fc1.w.value()[0] == Approx(0.25 - 0.1 * 2.0));  // two accumulated backwards, averaged over equal ranks
    log.clear();
    dp.unshard_model();
  }
  REQUIRE(log.calls().empty());  // neither unshard_model nor the destructor communicates under replicate
}

namespace {

/// net visited fc3, fc2, fc1: the backward {2, 1, 0} reports slots 1, 0, 3, 2, 5, 4, not reverse visit order.
struct reversed_net {
  net& m;
  template <class F>
  void visit_parameters(F&& f) {
    for (const auto& [name, l] : {std::pair<std::string, layer*>{"fc3", &m.fc3}, {"fc2", &m.fc2}, {"fc1", &m.fc1}}) {
      f(name + ".w", l->w);
      f(name + ".b", l->b);
    }
  }
};

}  // namespace

TEST_CASE("recorded: rebuilt buckets start in the backward's order, the first one before the backward ends",
          "[step][rebuild]") {
  net m = make_net();
  reversed_net view{m};
  recording_comm comm(0, 2);
  auto& log = comm.log();
  ddp::optim::sgd opt({.lr = 0.1});
  ddp::data_parallel<reversed_net, recording_backend, four_floats> dp{view, comm};
  log.clear();
  dp.zero_grad();
  backward(dp, m, {2});  // fc3 is in; the planned first bucket [12, 16) waits for fc1, the backward's last layer
  REQUIRE(log.calls().empty());
  backward(dp, m, {1, 0});
  REQUIRE(log.calls().size() == 4);
  dp.step(opt);  // the step's waits, then rank 0's ready order, broadcast once
  REQUIRE(strings(log.calls().end() - 2, log.calls().end()) == strings{"world broadcast 6 i64 #4", "wait #4"});
  REQUIRE(dp.bucket_count() == 5);  // [0, 4) fc3, [8, 10) fc2.b, [4, 8) fc2.w, [14, 16) fc1.b, [10, 14) fc1.w
  log.clear();
  dp.zero_grad();
  backward(dp, m, {2});
  REQUIRE(log.calls() == strings{"world all_reduce 4 f32 #0"});  // fc3's bucket, before the backward ends
  backward(dp, m, {1});
  REQUIRE(log.calls() == strings{"world all_reduce 4 f32 #0", "world all_reduce 2 f32 #1", "world all_reduce 4 f32 #2"});
  backward(dp, m, {0});
  dp.step(opt);
  REQUIRE(log.calls().size() == 10);  // five all-reduces and their waits: no second rebuild
  REQUIRE(m.fc1.w.value()[0] == Approx(0.25 - 0.1 * 1.0 - 0.1 * 1.0));
}

TEST_CASE("recorded: shard_grad_op reduce-scatters each bucket, then all-gathers every bucket after the step",
          "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  auto& log = comm.log();
  ddp::optim::sgd opt({.lr = 0.1});
  ddp::data_parallel<net, recording_backend, four_floats, ddp::shard_grad_op> dp{m, comm, sequence_only};
  REQUIRE(dp.bucket_count() == 5);  // [12, 16) | [8, 12) [6, 8) | [2, 6) [0, 2): no bucket crosses a unit
  log.clear();
  forward(dp, m, {0, 1, 2});
  REQUIRE(log.calls().empty());
  backward(dp, m, {2, 1, 0});
  REQUIRE(log.calls() == strings{"world reduce_scatter 4>2 f32 #0", "world reduce_scatter 4>2 f32 #1",
                                 "world reduce_scatter 2>1 f32 #2", "world reduce_scatter 4>2 f32 #3",
                                 "world reduce_scatter 2>1 f32 #4"});
  log.clear();
  dp.step(opt);
  REQUIRE(log.calls() == strings{"wait #0", "wait #1", "wait #2", "wait #3", "wait #4",
                                 "world all_gather 2>4 f32 #0", "world all_gather 2>4 f32 #1",
                                 "world all_gather 1>2 f32 #2", "world all_gather 2>4 f32 #3",
                                 "world all_gather 1>2 f32 #4", "wait #0", "wait #1", "wait #2", "wait #3", "wait #4"});
}

TEST_CASE("recorded: full_shard unshards each unit in its scope, prefetches the next in the direction of travel, "
          "and communicates only when asked", "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  auto& log = comm.log();
  ddp::optim::sgd opt({.lr = 0.1});
  {
    ddp::data_parallel<net, recording_backend, four_floats, ddp::full_shard> dp{m, comm, sequence_only};
    log.clear();
    forward(dp, m, {0, 1, 2});
    REQUIRE(log.calls() == strings{"world all_gather 2>4 f32 #0", "world all_gather 1>2 f32 #1", "wait #0", "wait #1",
                                   "world all_gather 2>4 f32 #2", "world all_gather 1>2 f32 #3", "wait #2", "wait #3",
                                   "world all_gather 2>4 f32 #4",  // fc3 prefetched while fc2 is in use
                                   "wait #4"});
    log.clear();
    backward(dp, m, {2, 1, 0});
    REQUIRE(log.calls() == strings{"world all_gather 2>4 f32 #0", "wait #0", "world reduce_scatter 4>2 f32 #1",
                                   "world all_gather 2>4 f32 #2", "world all_gather 1>2 f32 #3", "wait #2", "wait #3",
                                   "world all_gather 2>4 f32 #4", "world all_gather 1>2 f32 #5",  // fc1 prefetched
                                   "world reduce_scatter 4>2 f32 #6", "world reduce_scatter 2>1 f32 #7", "wait #4",
                                   "wait #5", "world reduce_scatter 4>2 f32 #8", "world reduce_scatter 2>1 f32 #9"});
    log.clear();
    dp.step(opt);
    REQUIRE(log.calls() == strings{"wait #1", "wait #6", "wait #7", "wait #8", "wait #9"});
    log.clear();
    dp.unshard_model();
    REQUIRE(log.calls() == strings{"world all_gather 2>4 f32 #0", "world all_gather 2>4 f32 #1",
                                   "world all_gather 1>2 f32 #2", "world all_gather 2>4 f32 #3",
                                   "world all_gather 1>2 f32 #4", "wait #0", "wait #1", "wait #2", "wait #3", "wait #4"});
    log.clear();
  }
  REQUIRE(log.calls().empty());  // the destructor issues no collective
}

TEST_CASE("recorded: hybrid chains each cross-group all-reduce when the next bucket starts, at the same point "
          "of the call sequence on every rank", "[step]") {
  net m = make_net();
  recording_comm comm(0, 4);
  auto& log = comm.log();
  log.plan_split("shard", 2, 0);
  log.plan_split("replica", 2, 0);
  ddp::optim::sgd opt({.lr = 0.1});
  ddp::data_parallel dp{m, comm, four_floats{}, ddp::hybrid<ddp::shard_grad_op>{.group_size = 2}, sequence_only};
  log.clear();
  backward(dp, m, {2});
  log.complete_all();  // the network delivers fc3's reduce-scatter during fc2's backward
  backward(dp, m, {1, 0});
  // Each start chains the previous bucket, waiting for its reduce-scatter where the network has not delivered
  // it: never a choice by timing, which would order the two groups' collectives differently on different ranks.
  REQUIRE(log.calls() == strings{"shard reduce_scatter 4>2 f32 #0", "shard reduce_scatter 4>2 f32 #1",
                                 "replica all_reduce 2 f32 #2",  // #0 delivered already: no wait
                                 "shard reduce_scatter 2>1 f32 #3", "wait #1", "replica all_reduce 2 f32 #4",
                                 "shard reduce_scatter 4>2 f32 #5", "wait #3", "replica all_reduce 1 f32 #6",
                                 "shard reduce_scatter 2>1 f32 #7", "wait #5", "replica all_reduce 2 f32 #8"});
  log.clear();
  dp.finish_gradients();  // waits for the chained averages in plan order, then chains the last bucket
  REQUIRE(log.calls() == strings{"wait #2", "wait #4", "wait #6", "wait #8", "wait #7", "replica all_reduce 1 f32 #0",
                                 "wait #0"});
  log.clear();
  dp.step(opt);
  REQUIRE(log.calls().size() == 10);  // after the step: every bucket all-gathered in the shard group, waited for
  REQUIRE(log.calls()[0] == "shard all_gather 2>4 f32 #0");
}

TEST_CASE("recorded: sharded no_sync reduce-scatters each micro-batch, completed by close(), an unclosed span is "
          "named", "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  auto& log = comm.log();
  ddp::optim::sgd opt({.lr = 0.1});
  ddp::data_parallel<net, recording_backend, four_floats, ddp::shard_grad_op> dp{m, comm, sequence_only};
  log.clear();
  {
    auto guard = dp.no_sync();
    backward(dp, m, {2});
    REQUIRE(log.calls() == strings{"world reduce_scatter 4>2 f32 #0"});
    backward(dp, m, {1, 0});
    guard.close();
  }
  REQUIRE(log.calls().size() == 10);  // 5 reduce-scatters, then close() waits for each
  REQUIRE(log.calls()[5] == "wait #0");
  {
    auto guard = dp.no_sync();
    backward(dp, m, {2, 1, 0});
  }  // no close(): the destructor sends nothing and waits for nothing
  REQUIRE(log.calls().size() == 15);
  try {
    backward(dp, m, {1});
    FAIL("a gradient after an unclosed no_sync span was accepted");
  } catch (const ddp::error& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("ended without close()") && Catch::Contains("guard.close()"));
  }
  REQUIRE(log.calls().size() == 15);
  dp.finish_gradients();  // the way out: completes the span's micro-batch
  REQUIRE(log.calls().size() == 20);
  backward(dp, m, {2, 1, 0});
  dp.step(opt);  // 5 reduce-scatters, their waits, then 5 all-gathers and their waits
  REQUIRE(log.calls().size() == 40);
}

TEST_CASE("deduction: the backend from the communicator's type, the policies from values in any order, options "
          "last, the explicit spelling still works", "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  {
    ddp::data_parallel dp{m, comm};
    STATIC_REQUIRE(std::is_same_v<decltype(dp), ddp::data_parallel<net, recording_backend>>);
  }
  {
    ddp::data_parallel dp{m, comm, ddp::full_shard{}, four_floats{}};
    STATIC_REQUIRE(std::is_same_v<decltype(dp), ddp::data_parallel<net, recording_backend, ddp::full_shard, four_floats>>);
    REQUIRE(dp.bucket_count() == 5);
  }
  {
    ddp::data_parallel dp{m, comm, four_floats{}, ddp::shard_grad_op{}, ddp::data_parallel_options{.unit_depth = 2}};
    STATIC_REQUIRE(std::is_same_v<decltype(dp), ddp::data_parallel<net, recording_backend, four_floats, ddp::shard_grad_op>>);
    REQUIRE(dp.units().size() == 6);
  }
  {
    ddp::data_parallel dp{m, comm, {.unit_depth = 2}};
    STATIC_REQUIRE(std::is_same_v<decltype(dp), ddp::data_parallel<net, recording_backend>>);
    REQUIRE(dp.units().size() == 6);
  }
  {  // explicit policies, values given for some of them in another order
    ddp::data_parallel<net, ddp::full_shard, recording_backend, four_floats> dp{m, comm, four_floats{}, ddp::full_shard{}};
    REQUIRE(dp.bucket_count() == 5);
  }
}

TEST_CASE("recorded: the sharding policy's value is what the strategy uses: full_shard{.reshard_after_forward = "
          "false} keeps the units of the forward for the backward, also as hybrid's inner policy", "[step]") {
  net m = make_net();
  {
    recording_comm comm(0, 2);
    auto& log = comm.log();
    ddp::data_parallel dp{m, comm, four_floats{}, ddp::full_shard{.reshard_after_forward = false}};
    REQUIRE_FALSE(dp.sharding_policy().reshard_after_forward);
    forward(dp, m, {0, 1, 2});
    log.clear();
    backward(dp, m, {2, 1, 0});
    for (const auto& call : log.calls()) REQUIRE_THAT(call, !Catch::Contains("all_gather"));
  }
  {
    recording_comm comm(0, 4);
    auto& log = comm.log();
    log.plan_split("shard", 2, 0);
    log.plan_split("replica", 2, 0);
    ddp::data_parallel dp{m, comm, four_floats{}, ddp::hybrid<>{.group_size = 2, .inner = {.reshard_after_forward = false}}};
    forward(dp, m, {0, 1, 2});
    log.clear();
    backward(dp, m, {2, 1, 0});
    REQUIRE(!log.calls().empty());
    for (const auto& call : log.calls()) REQUIRE_THAT(call, !Catch::Contains("all_gather"));
  }
}

TEST_CASE("units by object: ddp::unit_of(part) is the unit of the prefix its parameters share, beside name "
          "prefixes, a part holding no parameter of the model is a config_error naming it", "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  {
    ddp::data_parallel dp{m, comm, ddp::full_shard{},
                          ddp::data_parallel_options{.units = {ddp::unit_of(m.fc2), "fc3.w", ddp::unit_of(m.fc1.b)},
                                                     .unit_depth = 2}};
    REQUIRE(std::vector<std::string>(dp.units().begin(), dp.units().end()) ==
            strings{"fc1.w", "fc1.b", "fc2", "fc3.w", "fc3.b"});
  }
  const auto raises = [&](ddp::data_parallel_options o, const std::string& text) {
    try {
      ddp::data_parallel dp{m, comm, ddp::full_shard{}, std::move(o)};
      FAIL("no config_error for: " << text);
    } catch (const ddp::config_error& e) {
      INFO(e.what());
      REQUIRE_THAT(e.what(), Catch::Contains(text));
    }
  };
  net other = make_net();
  raises({.units = {"fc1", ddp::unit_of(other.fc2)}}, "data_parallel_options::units entry #1, ddp::unit_of(");
  raises({.units = {"fc1", ddp::unit_of(other.fc2)}}, "layer), holds no parameter of the wrapped model");
  two_parameters foreign{m.fc1.w, other.fc1.b};
  raises({.units = {ddp::unit_of(foreign)}}, "entry #0, ddp::unit_of(");
  raises({.units = {ddp::unit_of(foreign)}}, "two_parameters), holds parameters that are not the wrapped model's");
  two_parameters apart{m.fc1.w, m.fc2.b};
  raises({.units = {ddp::unit_of(apart)}}, "holds parameters ('fc1.w', ...) that share no dotted name prefix");
}

TEST_CASE("recorded: full_shard prefetches in the execution order the first step recorded, not in field order",
          "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  auto& log = comm.log();
  ddp::optim::sgd opt({.lr = 0.1});
  ddp::data_parallel dp{m, comm, four_floats{}, ddp::full_shard{}, sequence_only};
  layer* all[] = {&m.fc1, &m.fc2, &m.fc3};
  // What opening a scope on layer l issues (numbers dropped); with `report`, a backward inside the scope.
  const auto opened = [&](int l, bool report) {
    const std::size_t before = log.calls().size();
    auto g = dp.unshard(*all[l]);
    strings out;
    for (std::size_t i = before; i < log.calls().size(); ++i)
      out.push_back(log.calls()[i].substr(0, log.calls()[i].rfind(" #")));
    for (auto* p : {&all[l]->b, &all[l]->w})
      if (report) dp.gradient_ready(*p);
    return out;
  };
  const strings gather_fc1_fc2 = {"world all_gather 2>4 f32", "world all_gather 1>2 f32", "wait", "wait"};
  const strings gather_fc3 = {"world all_gather 2>4 f32", "wait"};
  const auto with = [](strings a, const strings& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  // The forward runs fc3, fc1, fc2 (fields fc1, fc2, fc3), the backward fc2, fc1, fc3. Step 1 prefetches in field
  // order: nothing after fc1 (below fc3), fc3 after fc2 (needed no more in this forward).
  REQUIRE(opened(2, false) == gather_fc3);
  REQUIRE(opened(0, false) == gather_fc1_fc2);
  REQUIRE(opened(1, false) == with(gather_fc1_fc2, {"world all_gather 2>4 f32"}));
  for (const int l : {1, 0, 2}) opened(l, true);
  dp.step(opt);
  // Step 2 follows the recorded order fc3, fc1, fc2: fc2 is gathered while fc1 is in use and its scope only waits;
  // in the backward fc3 is gathered while fc1 is in use. Reopening an end of the order turns the travel around:
  // fc3 (where the backward ended) prefetches fc1 for the forward, fc2 (where the forward ended) fc1 for the
  // backward.
  const strings gather_fc1 = {"world all_gather 2>4 f32", "world all_gather 1>2 f32"};
  for (int step = 2; step <= 3; ++step) {
    INFO("step " << step);
    REQUIRE(opened(2, false) == with(gather_fc3, gather_fc1));
    REQUIRE(opened(0, false) == with({"wait", "wait"}, {"world all_gather 2>4 f32", "world all_gather 1>2 f32"}));
    REQUIRE(opened(1, false) == strings{"wait", "wait"});
    REQUIRE(opened(1, true) == with(gather_fc1_fc2, gather_fc1));
    REQUIRE(opened(0, true) == strings{"wait", "wait", "world all_gather 2>4 f32"});
    REQUIRE(opened(2, true) == strings{"wait"});
    dp.step(opt);
  }
}

namespace {
/// A comm hook that can be neither copied nor moved: the wrapper makes it in place.
struct pinned_hook : ddp::plain_hook {
  pinned_hook() = default;
  pinned_hook(const pinned_hook&) = delete;
  pinned_hook& operator=(const pinned_hook&) = delete;
};
}  // namespace

TEST_CASE("a comm hook that cannot move is made in place", "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  net other = make_net();
  ddp::data_parallel<net, recording_backend, pinned_hook> dp{m, comm};
  ddp::data_parallel<net, recording_backend, pinned_hook, four_floats> given{other, comm, four_floats{}};
  REQUIRE(given.bucket_count() == 5);  // 16 floats in buckets of 4, fc1's [0, 6) apart
}

TEST_CASE("recorded: inside a join scope a step's first collective counts the active ranks, finish counts 0, and a "
          "dropped scope sends nothing and makes the next call throw", "[step][join]") {
  net m = make_net();
  recording_comm comm(0, 2);
  auto& log = comm.log();
  ddp::optim::sgd opt({.lr = 0.1});
  ddp::data_parallel<net, recording_backend, four_floats, ddp::full_shard> dp{m, comm};
  {
    auto j = dp.join();
    log.clear();
    forward(dp, m, {0});
    REQUIRE(log.calls() == strings{"world all_reduce 1 i32 #0", "wait #0", "world all_gather 2>4 f32 #1",
                                   "world all_gather 1>2 f32 #2", "wait #1", "wait #2"});
    forward(dp, m, {1, 2});
    backward(dp, m, {2, 1, 0});
    dp.step(opt);
    log.clear();
    forward(dp, m, {0});  // the next step is counted again
    REQUIRE(log.calls().front() == "world all_reduce 1 i32 #0");
    forward(dp, m, {1, 2});
    backward(dp, m, {2, 1, 0});
    dp.step(opt);
    log.clear();
    j.finish(opt);  // the loopback's sum is this rank's 0: no rank trains any more
    REQUIRE(log.calls() == strings{"world all_reduce 1 i32 #0", "wait #0"});
  }
  log.clear();
  { auto dropped = dp.join(); }
  REQUIRE(log.calls().empty());
  REQUIRE_THROWS_WITH(dp.step(opt), Catch::Contains("ended without j.finish(opt)"));
  REQUIRE_THROWS_WITH(forward(dp, m, {0}), Catch::Contains("ended without j.finish(opt)"));
}

TEST_CASE("join state: recording full_shard steps allocates nothing once the records have held a step as long",
          "[step][join]") {
  using kind = ddp::detail::step_event::kind;
  ddp::detail::join_state j(true);
  j.open_scope(ddp::detail::step_phase::idle, 0);
  const std::vector<std::size_t> units{0, 1, 2};
  const auto one_step = [&] {
    for (std::size_t k = 0; k < 8; ++k) {
      j.note(kind::acquire, units);
      j.note(kind::report, {}, k);
      j.note(kind::release, std::span<const std::size_t>(units).first(k % 3 + 1));
    }
    j.end_step();
  };
  one_step();
  one_step();
  const std::size_t before = allocations.load();
  for (int s = 0; s < 3; ++s) one_step();
  REQUIRE(allocations.load() == before);
  const auto& replay = j.shadow(1, 0);  // the last step taken, as a shadow step replays it
  REQUIRE(replay.events.size() == 24);
  REQUIRE(replay.events[4].slot == 1);
  REQUIRE(std::vector<std::size_t>(replay.units_of(replay.events[5]).begin(), replay.units_of(replay.events[5]).end()) ==
          std::vector<std::size_t>{0, 1});
}

TEST_CASE("scale: exact factors multiply in the element type, others round once from double, divide uses it",
          "[step][join]") {
  std::vector<float> f{1.0F, 3.0F, 0.1F};
  ddp::detail::scale(ddp::raw_tensor::of(std::span<float>(f)), 4.0 / 3.0);
  REQUIRE(f == std::vector<float>{static_cast<float>(4.0 / 3.0), 4.0F, static_cast<float>(0.1F * (4.0 / 3.0))});
  std::vector<double> d{3.0, -0.5};
  ddp::detail::divide(ddp::raw_tensor::of(std::span<double>(d)), 4);
  REQUIRE(d == std::vector<double>{0.75, -0.125});
  std::vector<std::int32_t> i{7, -7};
  ddp::detail::scale(ddp::raw_tensor::of(std::span<std::int32_t>(i)), 0.5);
  ddp::detail::divide(ddp::raw_tensor::of(std::span<std::int32_t>(i)), 2);  // truncates toward zero
  REQUIRE(i == std::vector<std::int32_t>{1, -1});
  std::vector<ddp::bfloat16> h{ddp::bfloat16(3.0F)};
  ddp::detail::scale(ddp::raw_tensor::of(std::span<ddp::bfloat16>(h)), 0.5);
  REQUIRE(static_cast<float>(h[0]) == 1.5F);
}

namespace {

/// One leaf a framework keeps in two std::vector<float> it may reallocate or free between steps (dlib's net.clean()).
struct framework_net {
  std::vector<float> v, g;
  template <class F>
  void visit_parameters(F&& f) {
    f("fc.weight", ddp::trainable(v, g));
  }
};

}  // namespace

TEST_CASE("owning leaves: memory the framework moved between steps is followed, memory it freed is named, a model "
          "with no element is refused", "[step]") {
  recording_comm comm(0, 2);
  ddp::optim::sgd opt({.lr = 0.5});
  framework_net m{{1, 2, 3, 4}, {0, 0, 0, 0}};
  {
    ddp::data_parallel<framework_net, recording_backend> dp{m, comm};
    for (int step = 1; step <= 2; ++step) {
      m.v = std::vector<float>(m.v);           // the values move: the old buffer is freed
      m.g = std::vector<float>(4, 1.0F);       // so does the gradient, holding this step's
      dp.gradient_ready(m.v);
      dp.step(opt);
      INFO("step " << step);
      REQUIRE(m.v == std::vector<float>{1 - 0.5F * step, 2 - 0.5F * step, 3 - 0.5F * step, 4 - 0.5F * step});
    }
    m.g.clear();
    m.g.shrink_to_fit();  // freed, as dlib's clean() does
    REQUIRE_THROWS_WITH(dp.zero_grad(), Catch::Contains("parameter 'fc.weight' has no gradient memory now"));
    REQUIRE_THROWS_WITH(dp.gradient_ready(m.v), Catch::Contains("free a leaf's memory only after the data_parallel "
                                                               "wrapper is destroyed"));
  }
  framework_net lazy;  // a framework that allocates at its first forward, wrapped before it
  REQUIRE_THROWS_WITH((ddp::data_parallel<framework_net, recording_backend>{lazy, comm}),
                      Catch::Contains("the model has no element to train (1 parameter(s), all empty)"));
}

TEST_CASE("recorded: the first step checks that some averaged gradient is not zero: one all_gather of one f64 where "
          "gradients are sharded, none under replicate, none after the first step, and all zero throws", "[step]") {
  net m = make_net();
  recording_comm comm(0, 2);
  auto& log = comm.log();
  {
    ddp::optim::sgd opt({.lr = 0.1});
    ddp::data_parallel<net, recording_backend, four_floats, ddp::shard_grad_op> dp{m, comm};
    for (int step = 0; step < 2; ++step) {
      dp.zero_grad();
      backward(dp, m, {2, 1, 0});
      log.clear();
      dp.step(opt);
      const auto checks = std::count_if(log.calls().begin(), log.calls().end(),
                                        [](const std::string& c) { return c.starts_with("world all_gather 1>2 f64"); });
      REQUIRE(checks == (step == 0 ? 1 : 0));
    }
  }
  {
    ddp::optim::sgd opt({.lr = 0.1});
    ddp::data_parallel<net, recording_backend, four_floats> dp{m, comm};
    dp.zero_grad();
    backward(dp, m, {2, 1, 0});
    dp.finish_gradients();
    log.clear();
    dp.step(opt);
    REQUIRE(std::none_of(log.calls().begin(), log.calls().end(), [](const std::string& c) { return c.find("f64") != std::string::npos; }));
  }
  ddp::optim::sgd opt({.lr = 0.1});
  ddp::data_parallel<net, recording_backend, four_floats> idle{m, comm};
  idle.zero_grad();
  for (auto* p : {&m.fc3.b, &m.fc3.w, &m.fc2.b, &m.fc2.w, &m.fc1.b, &m.fc1.w}) idle.gradient_ready(*p);  // zeros
  REQUIRE_THROWS_WITH(idle.step(opt), Catch::Contains("every averaged gradient of the first step is zero"));
}
