#pragma once
/// \file What the sharding strategies (shard_grad_op, full_shard, hybrid) share. Arenas are padded so that
/// every bucket holds a multiple of N elements (N = ranks in the shard group) and no bucket crosses a
/// unit; rank r owns block r of every bucket (contiguous, not aligned to parameters).
///
/// Gradients: a unit's full gradients exist only while an unshard scope holds the unit and until its buckets'
/// reduce-scatters have read them: the scope binds the unit's parameters to a zeroed buffer of a unit_pool,
/// which goes back to the pool afterwards (steady-state steps reuse the same buffers: nothing is allocated
/// and no page is faulted in). Outside, a parameter's gradient points at its place in the layout's gradient
/// arena, whose pages are released once at construction (zeros, not resident). Each bucket is
/// reduce-scattered (average) into the owned block: straight into the owned gradients after zero_grad() or a
/// step (a step consumes them, so a backward after it starts from zero however the user zeroed: dp.zero_grad(),
/// a framework's own zero_grad on the model, which cannot reach the owned blocks, or not at all), else into a
/// receive buffer that is then added (accumulation over backwards of one step, as under no_sync). hybrid averages each
/// block across the replica group too: that all-reduce is chained when the next bucket starts (after
/// waiting for the block's reduce-scatter), so it overlaps the rest of the backward. The point is the same on
/// every rank by construction: choosing it by polling completion would order the shard and replica groups'
/// collectives differently on different ranks, and a transport that runs a rank's collectives one at a time
/// (ddp::tcp's engine) then deadlocks across the overlapping groups. The phases of
/// buckets and units (waiting → started → chained → reduced; released → held → reported) are kept by
/// step_state.
///
/// Values: the optimizer steps the owned values against the owned gradients. shard_grad_op's owned values are
/// its blocks of the value arena, and after each step every bucket is all-gathered in place; full_shard keeps a
/// persistent copy of the owned blocks (its arena holds no values) and all-gathers units on demand into pooled
/// buffers.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/accumulation.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/comm_hooks.hpp>
#include <ddp/parallel/master_weights.hpp>
#include <ddp/parallel/ordered_reduction.hpp>
#include <ddp/parallel/policies.hpp>
#include <ddp/parallel/replica_check.hpp>
#include <ddp/parallel/step_state.hpp>
#include <ddp/parallel/unit_pool.hpp>

namespace ddp::detail {

/// The owned block of one bucket.
struct owned_block {
  std::size_t begin = 0;   ///< first element of the block in the full arena
  std::size_t length = 0;  ///< elements (bucket length / N)
  std::size_t shard = 0;   ///< first element of the block in the arena's shard buffers
};

/// Where a unit lies in one arena: elements [begin, end) (its buckets, padding included).
struct unit_extent {
  std::size_t begin = 0;  ///< first element
  std::size_t end = 0;    ///< one past the last
};

inline constexpr std::size_t no_buffer = std::numeric_limits<std::size_t>::max();

/// Where a sharded strategy keeps the values the optimizer steps.
enum class owned_value_home : std::uint8_t {
  value_arena,  ///< the rank's blocks of the value arena (shard_grad_op: the full parameters stay whole)
  own_copy,     ///< a persistent copy of the blocks (full_shard: the arena holds no values)
};

/// Bucket `b`'s sharded bookkeeping: its owned block and where its reduce-scatter writes.
struct shard_bucket {
  owned_block block;        ///< the owned block
  bool overwrite = true;    ///< the next reduce-scatter overwrites the owned gradients (zero_grad or a step since)
  bool direct = true;       ///< this step's reduce-scatter writes straight into the owned gradients
};
/// Unit `u`'s pooled buffers (unit_pool ids), or no_buffer.
struct unit_buffers {
  std::size_t values = no_buffer;  ///< full_shard: its unsharded values
  std::size_t grads = no_buffer;   ///< its full gradients
};

/// Reduce-scatter, sharded gradients and optimizer state, all-gather, and the units' pooled buffers: the
/// machinery of the sharded strategies. `shard` is the group parameters are sharded over; `replica`
/// (hybrid) the group the shards are replicated over; `policy` names the strategy in messages. The phases of
/// buckets and units live in the step_state it is given.
template <class Comm>
class sharded_core {
 public:
  using accumulation = reduced_accumulation;          ///< each micro-batch is reduce-scattered in its backward
  static constexpr detail::bucket_cut bucket_cut = detail::bucket_cut::within_units;  ///< a unit's buckets are its own
  static constexpr bool rebuilds_buckets = false;     ///< buckets stay inside units, in field order
  /// A framework's optimizer must hold the tensors over this rank's owned blocks (ddp::parameters(dp)), the only
  /// ones that receive the averaged gradients; optim::optimizer_traits<Opt>::prepare checks it and points their
  /// gradients at the owned ones again, where specialized. One over leaves that keep their own memory (dlib's
  /// solvers) would update them from gradients no rank holds whole: refused.
  template <class Opt>
  static void prepare_optimizer(Opt& opt, std::span<const optim::flat_buffer> buffers, const parameter_layout& layout,
                                int rank) {
    if (!layout.adopting())
      throw config_error("data_parallel: dp.step(opt) with an optimizer of the model's framework (opt.step()) over "
                         "parameters that keep their own memory, under a sharded policy: each rank holds only its "
                         "shard of the averaged gradients, so the framework's update would read gradients no rank "
                         "has; step with ddp::optim::sgd or ddp::optim::adamw (they update the owned shards), or "
                         "train under ddp::replicate, where the framework's optimizer steps as it is", rank);
    if constexpr (requires { optim::optimizer_traits<Opt>::prepare(opt, buffers, rank); })
      optim::optimizer_traits<Opt>::prepare(opt, buffers, rank);
  }

  sharded_core(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm shard,
               std::optional<Comm> replica, const char* policy, bool keep_unit_buffers, bool deterministic,
               owned_value_home values)
      : layout_(layout), plan_(plan), state_(state), shard_(std::move(shard)), replica_(std::move(replica)),
        values_pool_(widths(layout), domains(layout)), grads_pool_(widths(layout), domains(layout)), policy_(policy),
        trim_(keep_unit_buffers ? pool_trim::untaken : pool_trim::all_idle), values_(values),
        deterministic_(deterministic) {
    const auto n = static_cast<std::size_t>(shard_.size()), r = static_cast<std::size_t>(shard_.rank());
    for (const auto& a : layout_.arenas()) {
      own_values_.push_back(values_ == owned_value_home::value_arena ? domain_buffer{}
                                                                      : a.domain->allocate(a.numel / n * size_of(a.type)));
      own_grads_.push_back(a.domain->allocate(a.numel / n * size_of(a.reduce_type)));
      received_.emplace_back();
    }
    for (const auto& b : plan_.buckets) {
      const std::size_t length = (b.end - b.begin) / n;
      buckets_.push_back({.block = {.begin = b.begin + r * length, .length = length, .shard = b.begin / n}});
    }
    const auto names = parameter_names(layout_);  // a rank's blocks may hold no piece of some parameters
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      const auto& a = layout_.arenas()[plan_.buckets[b].arena];
      if (values_ == owned_value_home::own_copy)
        a.domain->copy(a.value_view(buckets_[b].block.begin, buckets_[b].block.length), owned_values(b));
      optimizer_.push_back(owned_buffer(b));
      optimizer_.back().parameters = names;
    }
    const std::size_t units = layout_.units().size();
    unit_slots_.resize(units);
    extents_.assign(units, std::vector<unit_extent>(layout_.arenas().size()));
    for (std::size_t s = 0; s < layout_.slots().size(); ++s) unit_slots_[layout_.slots()[s].unit].push_back(s);
    for (const auto& bk : plan_.buckets) {
      auto& e = extents_[bk.unit][bk.arena];
      e = e.end == e.begin ? unit_extent{bk.begin, bk.end} : unit_extent{std::min(e.begin, bk.begin), std::max(e.end, bk.end)};
    }
    pooled_.resize(units);
    for (auto& a : layout_.arenas()) a.give_up(a.grads);  // full gradients live in pooled buffers only
  }
  sharded_core(const sharded_core&) = delete;
  sharded_core& operator=(const sharded_core&) = delete;
  /// Points every parameter back at the arenas, copying the values of unsharded units there, so the layout can
  /// hand the model its values (the owner settled the operations in flight first). Local: no collective.
  ~sharded_core() {
    arena_values_ = true;  // the model keeps what the arenas hold (zeros where unshard_model() did not run)
    for (std::size_t u = 0; u < pooled_.size(); ++u) {
      if (pooled_[u].values != no_buffer) {
        for (std::size_t a = 0; a < layout_.arenas().size(); ++a) {
          const auto& e = extents_[u][a];
          const auto& arena = layout_.arenas()[a];
          if (arena.values.size() != 0) arena.domain->copy(unit_values(u, a), arena.value_view(e.begin, e.end - e.begin));
        }
      }
      pooled_[u] = unit_buffers{};
      bind_unit(u);
    }
  }

  /// A gradient may only be reported while its unit has gradient storage (inside an unshard scope): held or
  /// reported → reported.
  void on_report(std::size_t slot) {
    const auto& s = layout_.slots()[slot];
    if (state_.unit(s.unit).grads == grad_phase::released)
      throw error(std::string(policy_) + ": parameter '" + s.name + "' reported a gradient outside an unshard "
                      "scope of its unit '" + layout_.units()[s.unit] + "' (the sharded strategies give a unit its "
                      "gradient storage, and under full_shard its values, only while a scope holds it); wrap the "
                      "unit's forward and backward in auto g = dp.unshard(model." + layout_.units()[s.unit] + "), or, "
                      "where autograd runs the backward (LibTorch), run the unit's forward as ddp::forward(dp, "
                      "model." + layout_.units()[s.unit] + ", input), which reopens the unit for its backward",
                  shard_.rank());
    state_.move_grads(s.unit, grad_phase::reported, {grad_phase::held, grad_phase::reported});
  }

  /// Bucket `b` waiting → started: its reduce-scatter (average) starts. Under hybrid, every earlier bucket
  /// then chains its cross-group average, in plan order, once its reduce-scatter is done (waited for here:
  /// the order of collectives must not depend on timing, see the file comment).
  template <class Hook>
  void reduce(Hook& /*hook*/, std::size_t b) {
    static_assert(std::is_same_v<Hook, plain_hook>,
                  "ddp::data_parallel: the compression hooks and user comm hooks work with ddp::replicate only; "
                  "drop the hook or use replicate.");
    const std::size_t u = plan_.buckets[b].unit;
    if (state_.unit(u).grads == grad_phase::released) hold_gradients(u);  // no report reached it: zero gradients
    state_.move_grads(u, grad_phase::reported, {grad_phase::held, grad_phase::reported});  // read until reduced
    auto& sb = buckets_[b];
    sb.direct = sb.overwrite;
    sb.overwrite = false;
    if (b == 0) chained_ = 0;  // a new step
    const auto& bk = plan_.buckets[b];
    const raw_tensor in = staging_.stage(gradient_view(b), bk.arena, bk.begin);  // mixed precision: widened
    state_.start(b, deterministic_ ? scattered_.exchange(shard_, b, in)
                                    : shard_.reduce_scatter(in, output(b), reduce_op::avg));
    if (replica_)
      for (; chained_ < b; ++chained_) {
        state_.wait(chained_);
        chain(chained_);
      }
  }
  /// Waits for bucket `b` (under hybrid: its reduce-scatter, then its cross-group average, chained now if
  /// polling did not) → reduced; adds the receive buffer into the owned gradients unless the reduce-scatter
  /// wrote there directly. Once all of its unit's buckets are reduced the unit's gradient storage is zeroed
  /// (a scope still holds it) or released.
  template <class Hook>
  void reduced(Hook& /*hook*/, std::size_t b) {
    if (replica_)
      for (; chained_ <= b; ++chained_) {
        state_.wait(chained_);
        chain(chained_);
      }
    if (deterministic_)
      state_.wait(b);  // the rank-order sum runs on the host
    else
      state_.order(b, domain_of_bucket(b));
    staging_.release(plan_.buckets[b].arena, plan_.buckets[b].begin, plan_.buckets[b].end - plan_.buckets[b].begin);
    if (deterministic_) (replica_ ? replicated_ : scattered_).average_into(b, output(b), (replica_ ? *replica_ : shard_).size());
    if (!buckets_[b].direct) domain_of_bucket(b).accumulate(received(b), owned_grads(b));
    state_.complete(b);
    const std::size_t u = plan_.buckets[b].unit;
    if (state_.unit_settled(u) && state_.unit(u).grads == grad_phase::reported) {
      if (state_.unit(u).scopes > 0) {  // a scope still holds the unit: its next backward starts from zero
        zero_gradients(u);
        state_.move_grads(u, grad_phase::held, {grad_phase::reported});
      } else {
        release_gradients(u);
      }
    }
  }
  /// Zeroes the owned gradients and the full gradients of the units holding storage.
  void zero_grad() noexcept {
    for (std::size_t a = 0; a < own_grads_.size(); ++a)
      layout_.arenas()[a].domain->zero(own_grads_[a].view(layout_.arenas()[a].reduce_type, 0,
                                                         own_grads_[a].size() / size_of(layout_.arenas()[a].reduce_type)));
    consume_owned_gradients();  // zero now: the next reduce-scatters may write them directly
    for (std::size_t u = 0; u < pooled_.size(); ++u)
      if (pooled_[u].grads != no_buffer) zero_gradients(u);
  }
  /// The owned gradients were consumed by a step (or zeroed): each bucket's next reduce-scatter overwrites them
  /// (after a step they keep their values until then, for whoever reads them).
  void consume_owned_gradients() noexcept {
    for (auto& sb : buckets_) sb.overwrite = true;
  }
  /// One flat buffer per bucket: the owned values and gradients with the parameter pieces in them.
  [[nodiscard]] const std::vector<optim::flat_buffer>& optimizer_buffers() const noexcept { return optimizer_; }
  /// The group parameters are sharded over.
  [[nodiscard]] const Comm& shard_group() const noexcept { return shard_; }
  /// hybrid: the group shards are replicated over.
  [[nodiscard]] const std::optional<Comm>& replica_group() const noexcept { return replica_; }
  /// The owned blocks of the shard group's ranks make up the gradients: a norm sums over them (not the replicas).
  [[nodiscard]] std::optional<Comm> norm_group() const { return shard_; }

 protected:
  [[nodiscard]] const parameter_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] const bucket_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] step_state& state() noexcept { return state_; }
  [[nodiscard]] const std::string& unit_name(std::size_t u) const noexcept { return layout_.units()[u]; }

  /// An unshard scope opens on unit `u`: it gets gradient storage (zeroed, unless it still holds gradients
  /// of this backward).
  void open_scope(std::size_t u) {
    state_.open_scope(u);
    if (state_.unit(u).grads == grad_phase::released) hold_gradients(u);
  }
  /// An unshard scope on unit `u` closes: with no scope left, its gradient storage is released now (nothing
  /// reported) or once its reduce-scatters have read it.
  void close_scope(std::size_t u) {
    if (state_.close_scope(u) && state_.unit(u).grads == grad_phase::held) release_gradients(u);
  }

  /// Unit `u`'s values live in a pooled buffer from now on (its contents are unspecified until unsharded).
  void take_values(std::size_t u) {
    if (pooled_[u].values != no_buffer) return;
    pooled_[u].values = values_pool_.take(sizes(u));
    bind_unit(u);
  }
  /// unsharding → unsharded: unit `u`'s all-gathers are ordered before later work on their domains; its
  /// parameters hold their values from now on.
  void unsharded(std::size_t u) {
    settle_unsharding(u);
    bind_unit(u);
  }
  /// unsharding → unsharded without rebinding: unit `u`'s all-gathers ordered before later work on their domains.
  void settle_unsharding(std::size_t u) {
    const auto buckets = state_.unit_buckets(u);
    state_.unsharded(u, [&](std::size_t i, work& w) { domain_of_bucket(buckets[i]).order_after(w); });
  }
  /// Orders `works` (one per bucket, in plan order) before later work on each bucket's domain.
  void order_buckets(std::vector<work>& works) {
    for (std::size_t b = 0; b < works.size(); ++b) domain_of_bucket(b).order_after(works[b]);
  }
  /// The memory domain of bucket `b`'s arena.
  [[nodiscard]] memory_domain& domain_of_bucket(std::size_t b) const {
    return *layout_.arenas()[plan_.buckets[b].arena].domain;
  }
  /// Unit `u`'s values buffer goes back to the pool; its parameters point at their arena place.
  void give_values(std::size_t u) {
    if (pooled_[u].values == no_buffer) return;
    values_pool_.give(pooled_[u].values);
    pooled_[u].values = no_buffer;
    bind_unit(u);
  }
  /// Starts refilling bucket `b`'s full values (in the unit's pooled buffer, else in the arena) from every
  /// rank's owned block.
  work all_gather_bucket(std::size_t b) {
    return shard_.all_gather(owned_values(b), value_view(b));
  }
  /// Frees the pooled buffers the last step did not need (every idle one unless keep_unit_buffers).
  void trim_pools() noexcept {
    values_pool_.trim(trim_);
    grads_pool_.trim(trim_);
  }
  /// Releases the pages of every arena's values (full_shard keeps values only in pooled buffers and owned
  /// blocks), or frees the arena where its domain cannot hand pages back, and vacates every parameter there.
  void release_arena_values() {
    for (auto& a : layout_.arenas()) a.give_up(a.values);
    for (std::size_t u = 0; u < pooled_.size(); ++u) bind_unit(u);
  }
  /// Gives every arena freed by release_arena_values() its full-size values buffer again (full_shard's
  /// unshard_model all-gathers the whole model into it).
  void restore_arena_values() {
    for (auto& a : layout_.arenas())
      if (a.values.size() == 0 && a.numel != 0) a.values = a.domain->allocate(a.numel * size_of(a.type));
  }
  /// The arenas hold the parameters' full values from now on (full_shard's unshard_model): the parameters of
  /// units without a pooled buffer are bound there as values, no longer vacated.
  void arena_holds_values() {
    arena_values_ = true;
    for (std::size_t u = 0; u < pooled_.size(); ++u) bind_unit(u);
  }

 private:
  static std::vector<std::size_t> widths(const parameter_layout& layout) {
    std::vector<std::size_t> out;
    for (const auto& a : layout.arenas()) out.push_back(size_of(a.type));
    return out;
  }
  static std::vector<memory_domain*> domains(const parameter_layout& layout) {
    std::vector<memory_domain*> out;
    for (const auto& a : layout.arenas()) out.push_back(a.domain);
    return out;
  }
  [[nodiscard]] std::vector<std::size_t> sizes(std::size_t u) const {
    std::vector<std::size_t> out;
    for (const auto& e : extents_[u]) out.push_back(e.end - e.begin);
    return out;
  }
  /// Points unit `u`'s parameters at its pooled buffers, or at their arena places where it has none; under
  /// full_shard they are vacated (leaf_binding::rebind) until the unit is unsharded.
  void bind_unit(std::size_t u) {
    const bool present = arena_values_ || (pooled_[u].values != no_buffer && state_.unit(u).values == unit_phase::unsharded);
    for (const std::size_t s : unit_slots_[u]) {
      const auto& p = layout_.slots()[s];
      const auto& a = layout_.arenas()[p.arena];
      const std::size_t w = size_of(p.type), at = p.offset - extents_[u][p.arena].begin;
      // without a pooled buffer: the arena place, or nothing where the arena was freed (a device's)
      std::byte* values = pooled_[u].values != no_buffer ? values_pool_.data(pooled_[u].values, p.arena) + at * w
                          : a.values.size() != 0         ? a.values.data() + p.offset * w
                                                         : nullptr;
      std::byte* grads = pooled_[u].grads != no_buffer ? grads_pool_.data(pooled_[u].grads, p.arena) + at * w
                         : a.grads.size() != 0         ? a.grads.data() + p.offset * w
                                                       : nullptr;
      p.leaf->rebind(values, grads, present);
    }
  }
  /// released → held: a zeroed pooled buffer (after releasing the buffers whose reduce-scatters are done).
  void hold_gradients(std::size_t u) {
    release_read_gradients();
    state_.move_grads(u, grad_phase::held, {grad_phase::released});
    pooled_[u].grads = grads_pool_.take(sizes(u));
    zero_gradients(u);
    bind_unit(u);
  }
  /// held or reported → released: the buffer goes back to the pool.
  void release_gradients(std::size_t u) {
    state_.move_grads(u, grad_phase::released, {grad_phase::held, grad_phase::reported});
    grads_pool_.give(pooled_[u].grads);
    pooled_[u].grads = no_buffer;
    bind_unit(u);
  }
  /// Releases the gradient storage of units no scope holds whose reduce-scatters have all read it.
  void release_read_gradients() {
    for (std::size_t u = 0; u < pooled_.size(); ++u) {
      const auto& rec = state_.unit(u);
      if (rec.grads != grad_phase::reported || rec.scopes > 0) continue;
      const auto bs = state_.unit_buckets(u);
      if (std::all_of(bs.begin(), bs.end(), [&](std::size_t k) { return state_.scattered(k); })) release_gradients(u);
    }
  }
  void zero_gradients(std::size_t u) {
    for (std::size_t a = 0; a < layout_.arenas().size(); ++a) layout_.arenas()[a].domain->zero(unit_gradients(u, a));
  }
  /// Bucket `b` started → chained: its reduce-scatter is done, its cross-group average starts.
  void chain(std::size_t b) {
    if (deterministic_) {
      scattered_.average_into(b, output(b), shard_.size());
      state_.chain(b, replicated_.all_gather_part(*replica_, b, output(b)));
    } else {
      state_.chain(b, replica_->all_reduce(output(b), reduce_op::avg));
    }
  }

  [[nodiscard]] raw_tensor unit_gradients(std::size_t u, std::size_t a) const {
    const auto& e = extents_[u][a];
    const auto& arena = layout_.arenas()[a];
    return {grads_pool_.data(pooled_[u].grads, a), e.end - e.begin, arena.type, arena.domain->where()};
  }
  /// Unit `u`'s values in its pooled buffer, for arena `a`.
  [[nodiscard]] raw_tensor unit_values(std::size_t u, std::size_t a) const {
    const auto& e = extents_[u][a];
    const auto& arena = layout_.arenas()[a];
    return {values_pool_.data(pooled_[u].values, a), e.end - e.begin, arena.type, arena.domain->where()};
  }
  /// Bucket `b`'s full gradients inside its unit's gradient buffer.
  [[nodiscard]] raw_tensor gradient_view(std::size_t b) const {
    const auto& bk = plan_.buckets[b];
    const std::size_t w = size_of(layout_.arenas()[bk.arena].type);
    return {grads_pool_.data(pooled_[bk.unit].grads, bk.arena) + (bk.begin - extents_[bk.unit][bk.arena].begin) * w,
            bk.end - bk.begin, layout_.arenas()[bk.arena].type, layout_.arenas()[bk.arena].domain->where()};
  }
  /// Bucket `b`'s full values: in its unit's pooled buffer when it has one, else in the arena.
  [[nodiscard]] raw_tensor value_view(std::size_t b) const {
    const auto& bk = plan_.buckets[b];
    const auto& a = layout_.arenas()[bk.arena];
    if (pooled_[bk.unit].values == no_buffer) return a.value_view(bk.begin, bk.end - bk.begin);
    const std::size_t w = size_of(a.type);
    return {values_pool_.data(pooled_[bk.unit].values, bk.arena) + (bk.begin - extents_[bk.unit][bk.arena].begin) * w,
            bk.end - bk.begin, a.type, a.domain->where()};
  }
  /// Bucket `b`'s owned block in `store`, of elements of `type` (an arena's dtype, or its reduce dtype).
  [[nodiscard]] raw_tensor shard_view(const std::vector<domain_buffer>& store, std::size_t b, dtype type) const {
    const auto& block = buckets_[b].block;
    return store[plan_.buckets[b].arena].view(type, block.shard, block.length);
  }
  /// Where bucket `b`'s reduce-scatter writes: the owned gradients when they are zero, else the receive buffer.
  [[nodiscard]] raw_tensor output(std::size_t b) { return buckets_[b].direct ? owned_grads(b) : received(b); }
  [[nodiscard]] raw_tensor received(std::size_t b) {
    const std::size_t a = plan_.buckets[b].arena;
    if (received_[a].size() == 0) received_[a] = layout_.arenas()[a].domain->allocate(own_grads_[a].size());  // 1st use
    return shard_view(received_, b, layout_.arenas()[a].reduce_type);
  }
  [[nodiscard]] raw_tensor owned_grads(std::size_t b) const {
    return shard_view(own_grads_, b, layout_.arenas()[plan_.buckets[b].arena].reduce_type);
  }
  /// Bucket `b`'s owned values: its block of the value arena (shard_grad_op, whose all-gather is then in place),
  /// else the persistent copy (full_shard, whose arena holds no values).
  [[nodiscard]] raw_tensor owned_values(std::size_t b) const {
    const auto& a = layout_.arenas()[plan_.buckets[b].arena];
    if (values_ == owned_value_home::own_copy) return shard_view(own_values_, b, a.type);
    return a.value_view(buckets_[b].block.begin, buckets_[b].block.length);
  }

  optim::flat_buffer owned_buffer(std::size_t b) const {
    optim::flat_buffer out{.values = owned_values(b), .grads = owned_grads(b), .segments = {},
                           .domain = &domain_of_bucket(b)};
    const std::size_t lo = buckets_[b].block.begin, hi = lo + buckets_[b].block.length;
    for (const std::size_t s : plan_.buckets[b].params) {
      const auto& p = layout_.slots()[s];
      const std::size_t from = std::max(lo, p.offset), to = std::min(hi, p.offset + p.numel);
      if (from < to) out.segments.push_back({.name = p.name, .offset = from - lo, .numel = to - from, .start = from - p.offset});
    }
    return out;
  }

  parameter_layout& layout_;
  const bucket_plan& plan_;
  step_state& state_;                                   // the phases of buckets and units
  Comm shard_;
  std::optional<Comm> replica_;
  std::vector<shard_bucket> buckets_;                   // per bucket
  std::vector<domain_buffer> own_values_;               // per arena: the owned blocks of every bucket, in bucket-begin order
  std::vector<domain_buffer> own_grads_;                // per arena: the accumulated owned gradients
  std::vector<domain_buffer> received_;                 // per arena: reduce-scatter outputs to add (made on first need)
  std::vector<optim::flat_buffer> optimizer_;           // per bucket, for the optimizer
  std::vector<std::vector<std::size_t>> unit_slots_;    // per unit: its parameters
  std::vector<std::vector<unit_extent>> extents_;       // per unit, per arena
  std::vector<unit_buffers> pooled_;                    // per unit: its pooled buffers
  unit_pool values_pool_;                               // full_shard's unsharded units
  unit_pool grads_pool_;                                // the units' full gradients
  std::size_t chained_ = 0;                             // hybrid: buckets chained in this step (a prefix)
  const char* policy_;                                  // the strategy's name, for messages
  pool_trim trim_;                                      // by the policy's keep_unit_buffers
  owned_value_home values_;                             // where the owned values live
  bool arena_values_ = values_ == owned_value_home::value_arena;  // the arenas hold the parameters' values
  bool deterministic_;                                  // sum in rank order (the policy's deterministic knob)
  ordered_reduction scattered_;                         // deterministic: each bucket's exchanged blocks
  ordered_reduction replicated_;                        // deterministic hybrid: each owned block from every group
  reduce_staging staging_{layout_};                     // mixed precision: buckets widened to the reduce dtype
};

}  // namespace ddp::detail
