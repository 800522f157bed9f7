#pragma once
/// \file ddp::detail::step_state: the one record of where a training step stands. Per bucket a phase
/// (waiting → started → [chained] → reduced), the parameters it still waits for and the handles of its
/// reduction; per unit the phase of its values (sharded → unsharding → unsharded → sharded again on reshard),
/// of its full-gradient storage (released → held → reported) and its open unshard scopes; per slot whether it
/// reported in this step, and the order of the reports; the step itself (idle → reporting → finished → idle);
/// and what lasts across calls: the join scope (join_state), the open no_sync spans and the units a
/// framework's backward holds open (backward_scopes). data_parallel owns it and the strategies move buckets and
/// units through it; a transition the phases do not allow raises ddp::error.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/parallel/backward_scopes.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/join_state.hpp>
#include <ddp/parallel/phases.hpp>

namespace ddp::detail {

/// One bucket in the step.
struct bucket_record {
  bucket_phase phase = bucket_phase::waiting;  ///< where its reduction stands
  std::size_t pending = 0;                     ///< parameters still to report in this step
  work reduction;                              ///< started: its all-reduce or reduce-scatter
  work average;                                ///< chained: hybrid's cross-group all-reduce
};
/// One unit in the step.
struct unit_record {
  unit_phase values = unit_phase::unsharded;     ///< its parameter values
  grad_phase grads = grad_phase::released;       ///< its full-gradient storage
  int scopes = 0;                                ///< open unshard scopes on it
  std::vector<work> all_gathers;                 ///< unsharding: its buckets' all-gathers
};

/// The gradient-accumulation spans (dp.no_sync()) open on a wrapper.
struct no_sync_spans {
  int open = 0;           ///< spans open now
  bool unclosed = false;  ///< a span of a policy that reduces every micro-batch ended without completing it
};

/// The state of the step: every phase of every bucket, unit and slot, and the legal moves between them.
class step_state {
 public:
  /// Buckets of `plan`, a parameter per entry of `slot_units` (its unit), `units` units starting in phase
  /// `values`; `join_replays`: a join shadow step replays the last step's scopes and reports (full_shard); `rank`
  /// for messages.
  step_state(const bucket_plan& plan, std::span<const std::size_t> slot_units, std::size_t units, unit_phase values,
             bool join_replays, int rank)
      : plan_(plan), buckets_(plan.buckets.size()), units_(units), reported_(slot_units.size(), 0),
        join_(join_replays), backward_(slot_units, units), rank_(rank) {
    for (auto& u : units_) u.values = values;
    index_units();
    order_.reserve(slot_units.size());
  }
  step_state(const step_state&) = delete;
  step_state& operator=(const step_state&) = delete;
  ~step_state() { settle(); }

  /// Waits for every operation still in flight and drops their handles and errors (for destructors, which
  /// report nothing); the phases stay as they are.
  void settle() noexcept {
    const auto quietly = [](work& w) {
      try { w.wait(); } catch (...) {}  // NOLINT: a destructor reports nothing
      w = work{};
    };
    for (auto& b : buckets_) {
      quietly(b.reduction);
      quietly(b.average);
    }
    for (auto& u : units_)
      for (auto& w : u.all_gathers) quietly(w);
  }

  // ---- the step ----
  /// Where the step stands.
  [[nodiscard]] step_phase phase() const noexcept { return phase_; }
  /// idle or finished → reporting: every bucket waits for its parameters again; `unused` slots count as reported.
  void begin(std::span<const char> unused) {
    expect_step(phase_ != step_phase::reporting, "begin a step", "idle or finished");
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& r = buckets_[b];
      if (r.phase == bucket_phase::started || r.phase == bucket_phase::chained) bad_move(b, bucket_phase::waiting);
      r.phase = bucket_phase::waiting;
      r.pending = plan_.buckets[b].params.size();
    }
    std::fill(reported_.begin(), reported_.end(), 0);
    order_.clear();
    next_ = 0;
    phase_ = step_phase::reporting;
    for (std::size_t s = 0; s < unused.size(); ++s)
      if (unused[s]) report(s);
  }
  /// Notes slot `s`'s report; false when it already reported in this step.
  bool report(std::size_t s) {
    expect_step(phase_ == step_phase::reporting, "report a gradient", "reporting");
    if (reported_[s]) return false;
    reported_[s] = 1;
    order_.push_back(s);
    for (const std::size_t b : plan_.of_param[s]) --buckets_[b].pending;
    return true;
  }
  /// The slots that reported in this step, in the order they reported.
  [[nodiscard]] std::span<const std::size_t> report_order() const noexcept { return order_; }
  /// Whether slot `s` reported in this step.
  [[nodiscard]] bool reported(std::size_t s) const noexcept { return reported_[s] != 0; }
  /// The next bucket to start if all its parameters reported (buckets start strictly in plan order).
  [[nodiscard]] std::optional<std::size_t> next_ready() const noexcept {
    if (phase_ != step_phase::reporting || next_ == buckets_.size() || buckets_[next_].pending > 0) return std::nullopt;
    return next_;
  }
  /// Buckets started in this step (a prefix of the plan).
  [[nodiscard]] std::size_t started() const noexcept { return next_; }
  /// reporting → finished: every bucket must be reduced.
  void finish() {
    expect_step(phase_ == step_phase::reporting, "finish the gradients", "reporting");
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (buckets_[b].phase != bucket_phase::reduced) bad_move(b, bucket_phase::reduced);
    phase_ = step_phase::finished;
  }
  /// The plan was rebuilt (parallel/bucket_rebuild.hpp) in a finished step: one reduced record per new bucket.
  void replan() {
    expect_step(phase_ == step_phase::finished, "rebuild the buckets", "finished");
    buckets_.clear();
    buckets_.resize(plan_.buckets.size());
    for (auto& r : buckets_) r.phase = bucket_phase::reduced;
    next_ = buckets_.size();
    index_units();
  }
  /// reporting → idle when the step is given up (a missing report) after its started buckets were reduced.
  void abandon() {
    for (std::size_t b = 0; b < next_; ++b)
      if (buckets_[b].phase != bucket_phase::reduced) bad_move(b, bucket_phase::waiting);
    phase_ = step_phase::idle;
  }
  /// finished → idle (the optimizer stepped, or the gradients were zeroed).
  void end() noexcept {
    if (phase_ == step_phase::finished) phase_ = step_phase::idle;
  }

  // ---- buckets ----
  /// Bucket `b`'s record.
  [[nodiscard]] const bucket_record& bucket(std::size_t b) const noexcept { return buckets_[b]; }
  /// waiting → started with its reduction `w`; `b` must be the next bucket in plan order.
  void start(std::size_t b, work w) {
    if (b != next_ || phase_ != step_phase::reporting) bad_move(b, bucket_phase::started);
    move_bucket(b, bucket_phase::started, bucket_phase::waiting);
    buckets_[b].reduction = std::move(w);
    ++next_;
  }
  /// started → chained: the reduce-scatter completed, the cross-group all-reduce `w` is in flight.
  void chain(std::size_t b, work w) {
    move_bucket(b, bucket_phase::chained, bucket_phase::started);
    buckets_[b].reduction = work{};
    buckets_[b].average = std::move(w);
  }
  /// Waits for bucket `b`'s reduction (started) or cross-group average (chained).
  void wait(std::size_t b) { in_flight(b).wait(); }
  /// Orders the work given to `domain` from now on after bucket `b`'s reduction or cross-group average (the host
  /// waits for it; a device enqueues the wait on its stream).
  void order(std::size_t b, memory_domain& domain) { domain.order_after(in_flight(b)); }
  /// Whether bucket `b`'s reduce-scatter has completed, without blocking.
  [[nodiscard]] bool scattered(std::size_t b) {
    const auto p = buckets_[b].phase;
    return p == bucket_phase::chained || p == bucket_phase::reduced || (p == bucket_phase::started && buckets_[b].reduction.done());
  }
  /// started or chained → reduced, once waited for.
  void complete(std::size_t b) {
    const auto p = buckets_[b].phase;
    move_bucket(b, bucket_phase::reduced, p == bucket_phase::chained ? bucket_phase::chained : bucket_phase::started);
    buckets_[b].reduction = work{};
    buckets_[b].average = work{};
  }

  // ---- units ----
  /// Unit `u`'s record.
  [[nodiscard]] const unit_record& unit(std::size_t u) const noexcept { return units_[u]; }
  /// Number of units.
  [[nodiscard]] std::size_t units() const noexcept { return units_.size(); }
  /// Unit `u`'s buckets, in start order.
  [[nodiscard]] std::span<const std::size_t> unit_buckets(std::size_t u) const noexcept { return unit_buckets_[u]; }
  /// Whether every bucket of unit `u` is out of flight (reduced, or not started in this step).
  [[nodiscard]] bool unit_settled(std::size_t u) const noexcept {
    for (const std::size_t b : unit_buckets_[u])
      if (buckets_[b].phase == bucket_phase::started || buckets_[b].phase == bucket_phase::chained) return false;
    return true;
  }
  /// An unshard scope opens on unit `u`.
  void open_scope(std::size_t u) noexcept { ++units_[u].scopes; }
  /// An unshard scope on unit `u` closes; true when it was the last one.
  bool close_scope(std::size_t u) {
    if (units_[u].scopes == 0)
      fail("unit " + std::to_string(u) + " has no open unshard scope to close");
    return --units_[u].scopes == 0;
  }
  /// sharded → unsharding with its all-gathers `gathers` in flight.
  void unshard(std::size_t u, std::vector<work> all_gathers) {
    move_unit(u, unit_phase::unsharding, unit_phase::sharded);
    units_[u].all_gathers = std::move(all_gathers);
  }
  /// unsharding → unsharded, its all-gathers ordered before later work by `order(i, w)` (w: the all-gather of the
  /// unit's i-th bucket in unit_buckets order).
  template <class Order>
  void unsharded(std::size_t u, Order&& order) {
    move_unit(u, unit_phase::unsharded, unit_phase::unsharding);
    for (std::size_t i = 0; i < units_[u].all_gathers.size(); ++i) order(i, units_[u].all_gathers[i]);
    units_[u].all_gathers.clear();
  }
  /// unsharded → sharded: the full values are freed.
  void reshard(std::size_t u) { move_unit(u, unit_phase::sharded, unit_phase::unsharded); }
  /// Moves unit `u`'s gradient storage to `to` from `from` (one of the phases named), else raises.
  void move_grads(std::size_t u, grad_phase to, std::initializer_list<grad_phase> from) {
    const grad_phase now = units_[u].grads;
    if (std::find(from.begin(), from.end(), now) == from.end())
      fail("the gradient storage of unit " + std::to_string(u) + " cannot go from " + to_string(now) + " to " +
           to_string(to));
    units_[u].grads = to;
  }


  // ---- what lasts across calls ----
  /// The join scope's state (parallel/join_state.hpp).
  [[nodiscard]] join_state& join() noexcept { return join_; }
  /// The join scope's state.
  [[nodiscard]] const join_state& join() const noexcept { return join_; }
  /// The open no_sync spans.
  [[nodiscard]] no_sync_spans& no_sync() noexcept { return no_sync_; }
  /// The open no_sync spans.
  [[nodiscard]] const no_sync_spans& no_sync() const noexcept { return no_sync_; }
  /// Of `units`, those the running backward has not opened yet, now open (backward_scopes).
  std::vector<std::size_t> open_backward(std::span<const std::size_t> units) { return backward_.open(units); }
  /// Slot `s` of unit `u` reported: the unit, now closed, when the backward held it open and every parameter of
  /// it has reported in this step.
  std::optional<std::size_t> close_backward(std::size_t s, std::size_t u) { return backward_.reported(s, u, reported_); }
  /// Every unit the backward still holds open, now closed (the backward is over).
  std::vector<std::size_t> close_all_backward() { return backward_.close_all(); }
 private:
  void index_units() {
    unit_buckets_.assign(units_.size(), {});
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) unit_buckets_[plan_.buckets[b].unit].push_back(b);
  }
  /// Bucket `b`'s operation in flight: its cross-group average when chained, else its reduction.
  work& in_flight(std::size_t b) {
    auto& r = buckets_[b];
    return r.phase == bucket_phase::chained ? r.average : r.reduction;
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw error("data_parallel step state: " + what + "; the step's calls came in an order the wrapper does not "
                "support (report with the sequence of gradient_ready, unshard, no_sync, finish_gradients and step "
                "calls that led here)", rank_);
  }
  void expect_step(bool ok, const char* action, const char* expected) const {
    if (!ok)
      throw error(std::string("data_parallel: cannot ") + action + " while the step is " + to_string(phase_) +
                  " (it must be " + expected + "); call zero_grad(), the backward's gradient_ready(p), "
                  "finish_gradients() and step(opt) in this order", rank_);
  }
  /// Bucket `b` goes to `to`; it must be in `from`.
  void move_bucket(std::size_t b, bucket_phase to, bucket_phase from) {
    if (buckets_[b].phase != from) bad_move(b, to);
    buckets_[b].phase = to;
  }
  [[noreturn]] void bad_move(std::size_t b, bucket_phase to) const {
    std::string why;
    if (to == bucket_phase::started && phase_ != step_phase::reporting) why = " while the step is " + std::string(to_string(phase_));
    else if (to == bucket_phase::started && b != next_) why = " out of plan order (bucket " + std::to_string(next_) + " is next)";
    fail("bucket " + std::to_string(b) + " cannot go from " + to_string(buckets_[b].phase) + " to " + to_string(to) + why);
  }
  void move_unit(std::size_t u, unit_phase to, unit_phase from) {
    if (units_[u].values != from)
      fail("unit " + std::to_string(u) + " cannot go from " + to_string(units_[u].values) + " to " + to_string(to));
    units_[u].values = to;
  }

  const bucket_plan& plan_;
  std::vector<bucket_record> buckets_;
  std::vector<unit_record> units_;
  std::vector<std::vector<std::size_t>> unit_buckets_;
  std::vector<char> reported_;  // per slot
  std::vector<std::size_t> order_;  // the slots that reported in this step, in order
  std::size_t next_ = 0;        // the next bucket to start
  step_phase phase_ = step_phase::idle;
  join_state join_;             // the join scope
  no_sync_spans no_sync_;       // gradient-accumulation spans
  backward_scopes backward_;    // units a framework's backward holds open
  int rank_;
};

}  // namespace ddp::detail
