#pragma once
/// \file ddp::data_parallel: wraps any model for data-parallel training (PyTorch DDP semantics).
/// Construction lays every leaf (ddp::parameter, ddp::trainable, an adapter's tensor: any storage_traits type) into
/// flat arenas (one per dtype), checks that all ranks hold the same model and broadcasts rank 0's values. In the
/// backward each finished gradient is reported (gradient_ready(p), or the leaf's framework's autograd); a bucket whose
/// parameters have all reported starts its reduction at once, in plan order, the same on every rank (under
/// replicate replanned once in the first step's ready order). finish_gradients() waits; step(opt) runs the optimizer.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/visit.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/backward_scopes.hpp>
#include <ddp/parallel/bucket_rebuild.hpp>
#include <ddp/parallel/comm_hooks.hpp>
#include <ddp/parallel/full_shard.hpp>
#include <ddp/parallel/grad_norm.hpp>
#include <ddp/parallel/hybrid.hpp>
#include <ddp/parallel/join.hpp>
#include <ddp/parallel/master_weights.hpp>
#include <ddp/parallel/model_state.hpp>
#include <ddp/parallel/no_sync.hpp>
#include <ddp/parallel/options.hpp>
#include <ddp/parallel/policies.hpp>
#include <ddp/parallel/replica_check.hpp>
#include <ddp/parallel/replicate.hpp>
#include <ddp/parallel/shard_grad_op.hpp>
#include <ddp/parallel/step_state.hpp>
#include <ddp/parallel/units.hpp>
#include <ddp/parallel/strategy.hpp>

namespace ddp {

/// Data-parallel wrapper of `Model` with policies `Ps...` in any order (backend, sharding, bucket_bytes, comm hook,
/// precision; defaults: backend::tcp, replicate, bucket_bytes<25 MiB, 1 MiB>, plain_hook, full_precision).
template <class Model, class... Ps>
class data_parallel {
  using policy = policies<Ps...>;
  using strategy_type = detail::strategy<typename policy::sharding, backend_communicator_t<typename policy::backend>>;
  using accumulation = typename strategy_type::accumulation;  // what a no_sync span means for the policy

 public:
  using model_type = Model;                                                        ///< the wrapped model
  using communicator_type = backend_communicator_t<typename policy::backend>;     ///< the backend's communicator
  using sharding = typename policy::sharding;                                      ///< the sharding policy
  using hook_type = typename policy::hook;                                         ///< the comm hook
  using precision = typename policy::precision;  ///< full_precision, or mixed_precision<Param, Reduce> (f32 masters)
  static_assert(communicator<communicator_type>);
  static_assert(comm_hook<hook_type, communicator_type>,
                "ddp::data_parallel: the comm hook must model ddp::comm_hook: default-constructible, with "
                "work start(const ddp::bucket_gradients<Comm>&) and complete(const ddp::bucket_gradients<Comm>&).");
  static_assert(detail::sharding_strategy<strategy_type, communicator_type, sharding>,
                "ddp::data_parallel: the sharding strategy does not model sharding_strategy over this backend's "
                "communicator; give the strategy every member the concept in <ddp/parallel/strategy.hpp> names.");

  // The constructors take std::type_identity_t<Model>& so that the deduction guides below, not the
  // constructors, deduce the backend and the policies of `ddp::data_parallel dp{model, comm, ...};`.

  /// Wraps `model` (kept by reference; it must outlive the wrapper) for the ranks of `comm`. Collective.
  data_parallel(std::type_identity_t<Model>& model, communicator_type comm, data_parallel_options options = {})
      : data_parallel(values_given{}, model, std::move(comm), sharding{}, [] { return hook_type{}; },
                      std::move(options)) {}
  /// The same with policy values, in any order, each of one of this wrapper's policy types (the sharding
  /// policy's settings and the comm hook's state are taken from them), then optionally data_parallel_options.
  template <detail::policy P, class... Rest>
  data_parallel(std::type_identity_t<Model>& model, communicator_type comm, P first, Rest... rest)
      : data_parallel(values_given{}, model, std::move(comm), detail::value_of<sharding>(first, rest...),
                      [&] { return detail::value_of<hook_type>(first, rest...); },
                      detail::value_of<data_parallel_options>(rest...)) {
    static_assert((detail::policy_of<P, Ps...> && ... &&
                   (detail::policy_of<Rest, Ps...> || std::is_same_v<Rest, data_parallel_options>)),
                  "ddp::data_parallel: a constructor argument is neither one of this wrapper's policies nor "
                  "ddp::data_parallel_options; pass values of the policy types the wrapper names, or let "
                  "`ddp::data_parallel dp{model, comm, policies...};` deduce the wrapper from them.");
    static_assert(detail::options_last<Rest...>(),
                  "ddp::data_parallel: ddp::data_parallel_options must be the last constructor argument, given once; "
                  "move it after the policy values.");
  }
  data_parallel(const data_parallel&) = delete;
  data_parallel& operator=(const data_parallel&) = delete;
  /// Issues no collective: waits for the operations in flight (their errors are dropped) and hands every
  /// parameter its values back. Under full_shard those are the full values only where unshard_model() put
  /// them (or an unshard scope holds the unit); call dp.unshard_model() after the last step to keep the trained
  /// model.
  ~data_parallel() { state_.settle(); }

 private:
  struct values_given {};
  /// `make_hook()` makes the hook in place (a hook need not be movable unless a value of it is given).
  template <class MakeHook>
  data_parallel(values_given, std::type_identity_t<Model>& model, communicator_type comm, sharding sharding_policy,
                MakeHook make_hook, data_parallel_options options)
      : model_(model), comm_(std::move(comm)), options_(std::move(options)), sharding_(std::move(sharding_policy)),
        multiple_(strategy_type::multiple(comm_, sharding_)),
        layout_(model, multiple_, layout_options(model, options_, comm_.rank())),
        plan_(detail::plan_buckets(layout_, policy::buckets::capacity, policy::buckets::first, multiple_,
                                  strategy_type::bucket_cut)),
        hook_(make_hook()), model_state_(detail::collect_model_state(model)),
        state_(plan_, layout_.slot_units(), layout_.units().size(), strategy_type::initial_units,
               strategy_type::join_replays_scopes, comm_.rank()) {
    std::vector<std::string> descriptions;
    for (const auto& s : layout_.slots()) descriptions.push_back(s.describe());
    for (const auto& s : model_state_) descriptions.push_back(detail::describe_state(s));
    detail::verify_same_model(comm_, descriptions);
    detail::apply_precision<precision>(layout_, rank());  // mixed precision: dtypes checked (alike on every rank)
    unused_ = detail::unused_mask(layout_, options_.unused_parameters, rank());
    strategy_type::check_leaves(layout_, rank());
    if (options_.broadcast_parameters) {
      for (const auto& a : layout_.arenas()) comm_.broadcast(a.value_view(0, a.numel), 0).wait();
      const state_kind frozen[] = {state_kind::frozen};
      state_sync_.broadcast(comm_, model_state_, 0, frozen);
    }
    if (options_.buffers != buffer_sync::never) {
      const state_kind buffers[] = {state_kind::buffer};
      state_sync_.broadcast(comm_, model_state_, 0, buffers);
    }
    strategy_.emplace(layout_, plan_, state_, comm_, sharding_);
    masters_.attach<precision>(strategy_->optimizer_buffers());  // mixed precision: f32 masters of the owned values
    layout_.values_out();
    for (std::size_t s = 0; s < layout_.slots().size(); ++s)
      if (auto w = layout_.slots()[s].leaf->watch([this, s] { report(s); finish_at_backward_end(s); }))
        held_.push_back(std::move(w));
    if (!held_.empty()) strategy_->leaves_report_themselves();
  }

 public:

  /// Reports that `p`'s gradient for this backward is complete; starts every bucket that became ready.
  /// `p` is a leaf of the model, or the values object a ddp::trainable of the model refers to.
  template <class Leaf>
  void gradient_ready(const Leaf& p) {
    const auto i = layout_.find(leaf_key(p));
    if (i < 0)
      throw config_error("gradient_ready: the parameter at this address is not part of the wrapped model; report "
                         "the model's own parameters (dp.module().fc1.weight)", rank());
    report(static_cast<std::size_t>(i));
  }

  /// Waits for every bucket's reduction: afterwards all gradients are averaged across ranks. Throws
  /// ddp::error naming the parameters that did not report (unless declared unused or tolerated). After it,
  /// step(opt) steps these gradients; calling it again before the next backward does nothing.
  void finish_gradients() {
    state_.join().check("finish_gradients", rank());
    if (accumulation::defers(state_)) return;
    state_.no_sync().unclosed = false;
    if (const auto left = state_.close_all_backward(); !left.empty()) release_backward(left);
    if (state_.phase() == detail::step_phase::finished) return;
    if (state_.phase() == detail::step_phase::idle) begin_reporting();
    if (state_.started() < plan_.buckets.size()) {
      std::vector<std::string> missing;
      for (std::size_t s = 0; s < layout_.slots().size(); ++s)
        if (!state_.reported(s) && layout_.slots()[s].numel > 0) missing.push_back(layout_.slots()[s].name);
      if (options_.error_on_missing && !state_.join().shadowing()) {
        reduce_started();
        state_.abandon();
        std::string names;
        for (const auto& n : missing) names += (names.empty() ? "'" : ", '") + n + "'";
        throw error("finish_gradients: parameter(s) " + names + " did not report a gradient in this step; call "
                    "dp.gradient_ready(p) for each in the backward, or list them in "
                    "data_parallel_options::unused_parameters (or set error_on_missing = false)", rank());
      }
      for (std::size_t s = 0; s < layout_.slots().size(); ++s)
        if (!state_.reported(s)) {
          gradient_in(s);
          state_.report(s);
        }
      start_ready();
    }
    reduce_started();
    state_.join().rescale(strategy_->optimizer_buffers(), comm_.size());  // in a join scope: the mean over the active ranks
    state_.finish();
    masters_.gradients_changed();
    rebuild_.after_step(comm_, layout_, plan_, state_, policy::buckets::capacity, policy::buckets::first);
  }

  /// finish_gradients(), then the total norm of the averaged gradients (PyTorch's clip_grad_norm_ return value;
  /// under mixed precision of the f32 master gradients where they are reduced in f32). Collective under the sharded
  /// policies (one all_gather of one f64 over the shard group); the same bits on every rank.
  double grad_norm(const grad_norm_options& o = {}) {
    check_outside_join("grad_norm");
    finish_gradients();
    masters_.widen(strategy_->optimizer_buffers());  // mixed precision: the norm of the f32 master gradients
    return detail::grad_norm(owned_buffers(), strategy_->norm_group(), o, rank());
  }
  /// finish_gradients(), then scales the averaged gradients by max_norm / (norm + 1e-6) where that is below 1
  /// (torch.nn.utils.clip_grad_norm_); returns the norm before clipping. Call it between the backward and step(opt).
  /// Collective under the sharded policies; inside a join scope use data_parallel_options::clip instead.
  double clip_grad_norm(double max_norm, const grad_norm_options& o = {}) {
    const double total = grad_norm(o);
    detail::clip_to(owned_buffers(), max_norm, total);
    return total;
  }
  /// Whether data_parallel_options::loss_scaling is on.
  [[nodiscard]] bool scales_loss() const noexcept { return scaler_.enabled(); }
  /// What the loop multiplies its loss by under data_parallel_options::loss_scaling (1 without it).
  [[nodiscard]] double loss_scale() const noexcept { return scaler_.scale(); }
  /// Clean steps since the loss scale last changed (GradScaler's growth tracker).
  [[nodiscard]] std::uint64_t loss_scale_growth_tracker() const noexcept { return scaler_.growth_tracker(); }
  /// Sets the loss scale and its growth tracker (checkpoint loading calls it).
  void restore_loss_scale(double scale, std::uint64_t growth_tracker) noexcept { scaler_.restore(scale, growth_tracker); }
  /// Under loss scaling: finish_gradients(), then divides the averaged gradients by the loss scale (GradScaler's
  /// unscale_, before clipping) once per step, and returns whether any rank's hold a NaN or an infinity, in which
  /// case step() skips the update on every rank. Collective (one all-reduce of one flag); false without scaling.
  bool unscale_gradients() {
    check_outside_join("unscale_gradients");
    finish_gradients();
    masters_.widen(strategy_->optimizer_buffers());  // mixed precision: unscale the f32 master gradients
    return scaler_.unscale(comm_, owned_buffers());
  }
  /// The total gradient norm the last step() clipped by (data_parallel_options::clip), or 0.
  [[nodiscard]] double last_grad_norm() const noexcept { return last_grad_norm_; }

  /// Scope returned by no_sync() (parallel/no_sync.hpp): while open, gradients accumulate without a step.
  using no_sync_guard = ddp::no_sync_guard<data_parallel>;
  /// Starts a gradient-accumulation span (see no_sync_guard); the next synchronized backward reduces the
  /// accumulated gradients (the user's backward adds into the gradients, as PyTorch's does).
  no_sync_guard no_sync() {
    check_no_sync_closed("no_sync");
    accumulation::opening(state_, rank());
    if (state_.phase() == detail::step_phase::reporting && state_.no_sync().open == 0)
      throw error("no_sync: a synchronized backward is in progress (some gradients already reported); enter "
                  "no_sync before the backward starts", rank());
    return no_sync_guard(*this);
  }

  /// finish_gradients() (unless it ran already for this backward), then one optimizer step over the flat
  /// arenas (or the owned shards).
  template <optim::flat_optimizer Opt>
  void step(Opt& opt) {
    run_step([&] { opt.step(owned_buffers()); });
  }
  /// finish_gradients(), then `opt.step()` for an optimizer that holds its own tensors (torch::optim), then the
  /// policy's work after a step (shard_grad_op all-gathers the updated blocks). Under replicate it may hold
  /// the model's parameters; under the sharded policies it must hold the tensors over this rank's owned
  /// blocks (ddp::parameters(dp) of <ddp/adapters/libtorch.hpp>), since only those receive the averaged
  /// gradients (optim::optimizer_traits<Opt>::prepare, where specialized, says so before the step). A framework's
  /// own optimizer over owning leaves (dlib's solvers) steps under replicate: the averaged gradients are copied into
  /// the leaves' gradients before it and their updated values read back after it; the sharded policies refuse it.
  template <class Opt>
    requires(!optim::flat_optimizer<Opt> && requires(Opt& o) { o.step(); })
  void step(Opt& opt) {
    strategy_type::prepare_optimizer(opt, owned_buffers(), layout_, rank());
    run_step([&] { layout_.update_leaves([&] { opt.step(); }); });
  }
  /// Collective: checks that the ranks holding the same parameter values hold them bit for bit (a hash per
  /// parameter; one all_gather of two words per rank when they agree). Under replicate and shard_grad_op every
  /// rank holds the full values, and all are compared. Under full_shard a rank holds only its owned blocks,
  /// which are hashed and compared with the ranks owning the same blocks: the other groups under hybrid
  /// (without replicas there is nothing to compare, since every value has one owner). On a difference every
  /// rank throws ddp::mismatch_error naming the first differing parameter and the ranks that disagree.
  /// The model state (frozen parameters; buffers under buffer_sync::broadcast and mean, as the last sync left
  /// them) is compared across all ranks the same way.
  void verify_in_sync() {
    state_.join().check("verify_in_sync", rank());
    detail::verify_replicas(comm_, strategy_->digest(),
                            [&](std::size_t s) -> const std::string& { return layout_.slots()[s].name; });
    if (model_state_.empty()) return;
    const bool buffers_alike = options_.buffers == buffer_sync::broadcast || options_.buffers == buffer_sync::mean;
    detail::verify_replicas(comm_, detail::digest_state(model_state_, buffers_alike),
                            [&](std::size_t s) -> const std::string& { return model_state_[s].name; });
  }
  /// Collective: makes the buffers alike on every rank now — their mean under buffer_sync::mean, else rank 0's
  /// (inside a join scope: the lowest rank still training). Steps do it themselves under broadcast and mean.
  void sync_buffers() {
    state_.join().check("sync_buffers", rank());
    detail::sync_buffers(comm_, state_.join(), model_state_, state_sync_,
                         options_.buffers == buffer_sync::mean ? buffer_sync::mean : buffer_sync::broadcast);
  }
  /// Opens a join scope (PyTorch's `with model.join():`) for an epoch whose ranks hold different numbers of
  /// batches: open it on every rank, step as usual, call finish(opt) after the rank's last step (parallel/join.hpp).
  join_scope<data_parallel> join() { return join_scope<data_parallel>(*this); }
  /// Allocates the optimizer's state for this wrapper's layout without stepping (before loading a checkpoint).
  template <optim::flat_optimizer Opt>
  void attach(Opt& opt) {
    opt.attach(owned_buffers());
  }

  /// Sets every gradient to zero (finished gradients not yet stepped are dropped).
  void zero_grad() {
    finish_queued_ = finished_by_backward_ = false;
    scaler_.forget();
    strategy_->zero_grad();
    masters_.gradients_changed();
    if (!layout_.adopting())
      for (const auto& s : layout_.slots()) s.leaf->zero_own_gradient();
    state_.end();
  }

  /// Collective under full_shard: all-gathers every unit into the model's own parameters, so they hold the
  /// full values, also after the wrapper is destroyed (FSDP's unshard of the whole model). Call it after the
  /// last step, outside every unshard scope; later steps do not update those values (call it again). Under
  /// replicate and shard_grad_op the parameters are whole already and it does nothing.
  void unshard_model() {
    state_.join().check("unshard_model", rank());
    strategy_->unshard_model();
  }
  /// RAII scope returned by unshard(): the units it names hold their full parameters while it lives; when the
  /// last scope on a unit closes, the unit is resharded (full_shard, unless it keeps the forward's units).
  class [[nodiscard]] unshard_guard {
   public:
    unshard_guard(data_parallel& dp, std::vector<std::size_t> units) : dp_(&dp), units_(std::move(units)) {
      dp_->state_.join().begin_step(dp_->comm_);
      dp_->state_.join().note(detail::step_event::kind::acquire, units_);
      dp_->strategy_->acquire(units_);
    }
    unshard_guard(const unshard_guard&) = delete;
    unshard_guard& operator=(const unshard_guard&) = delete;
    ~unshard_guard() {
      dp_->state_.join().note(detail::step_event::kind::release, units_);
      dp_->strategy_->release(units_);
    }
    /// What reopens this scope's units for their part of the backward (see ddp::backward_opener).
    [[nodiscard]] backward_opener<data_parallel> for_backward() const { return {*dp_, units_}; }

   private:
    data_parallel* dp_;
    std::vector<std::size_t> units_;
  };
  /// Opens a scope on the units (by default top-level fields) that `part` of the model holds; wrap each
  /// unit's forward and backward in one. Under full_shard it all-gathers the units and prefetches the next
  /// one; under full_shard and shard_grad_op it gives them gradient storage (report their gradients inside
  /// the scope). Under replicate it does nothing. Collective under full_shard.
  template <class Part>
  unshard_guard unshard(Part& part) {
    state_.join().check("unshard", rank());
    std::vector<std::size_t> units;
    visit_parameters(part, [&](std::string_view, auto& p) {
      const auto i = layout_.find(leaf_key(p));
      if (i < 0)
        throw config_error("unshard: this object holds parameters that are not the wrapped model's; pass a part "
                           "of dp.module() (such as dp.module().fc2)", rank());
      const std::size_t u = layout_.slots()[static_cast<std::size_t>(i)].unit;
      if (units.empty() || units.back() != u) units.push_back(u);
    });
    return unshard_guard(*this, std::move(units));
  }

  /// The wrapped model.
  [[nodiscard]] Model& module() noexcept { return model_; }
  /// The communicator of the group.
  [[nodiscard]] communicator_type& comm() noexcept { return comm_; }
  /// Number of ranks.
  [[nodiscard]] int world_size() const noexcept { return comm_.size(); }
  /// This process's rank.
  [[nodiscard]] int rank() const noexcept { return comm_.rank(); }
  /// Calls `f(name, leaf&)` for every leaf of the model, in visit order.
  template <class F>
  void for_each_parameter(F&& f) {
    visit_parameters(model_, f);
  }
  /// The model's buffers and frozen parameters (model state) in visit order, as found at construction: the
  /// wrapper refers to their memory, which must stay where it is (checkpoints read and fill it).
  [[nodiscard]] std::span<const detail::named_state> model_state() const noexcept { return model_state_; }
  /// Every parameter (name, shape, dtype, unit) and where its full values lie in the arenas (checkpoints read it).
  [[nodiscard]] const detail::parameter_layout& layout() const noexcept { return layout_; }
  /// After the values changed outside a step (checkpoint loading calls it): mixed precision narrows the f32 masters
  /// into the owned values; owning leaves (copied at the step's edges) take the arenas' values.
  void values_changed() const { masters_.narrow(strategy_->optimizer_buffers()); layout_.values_out(); }
  /// The flat buffers the optimizer steps (mixed_precision: f32 masters): this rank's owned values and gradients
  /// (the whole arenas under replicate) with the parameter pieces in them; checkpoints read and fill them.
  [[nodiscard]] std::span<const optim::flat_buffer> owned_buffers() const noexcept {
    return masters_.buffers(strategy_->optimizer_buffers());
  }
  /// Ties `token` to the wrapper: its deleter runs when the wrapper goes, while the wrapper's memory is still there
  /// (ddp::parameters(dp) takes the tensors it handed out off that memory).
  void hold_until_destroyed(std::shared_ptr<void> token) { held_.push_back(std::move(token)); }
  /// Number of gradient buckets (start units).
  [[nodiscard]] std::size_t bucket_count() const noexcept { return plan_.buckets.size(); }
  /// The gradient buckets in start order (rebuilt in the first step's ready order; bucket_rebuild.hpp).
  [[nodiscard]] const detail::bucket_plan& buckets() const noexcept { return plan_; }
  /// The comm hook this wrapper reduces buckets through (hooks may keep state).
  [[nodiscard]] hook_type& comm_hook() noexcept { return hook_; }
  /// The sharding policy's value: the settings the strategy uses.
  [[nodiscard]] const sharding& sharding_policy() const noexcept { return sharding_; }
  /// The sharding units' names, in visit order (data_parallel_options::units and unit_depth name them).
  [[nodiscard]] std::span<const std::string> units() const noexcept { return layout_.units(); }
  /// The group parameters are sharded over: comm() under replicate, shard_grad_op and full_shard; under
  /// hybrid the G ranks of this rank's shard group. Its stats() count the bytes moved inside the group.
  [[nodiscard]] communicator_type shard_group() const { return strategy_->shard_group(); }
  /// hybrid: the ranks holding the same shard in every group (their stats() count the bytes moved across
  /// groups); empty under the other policies.
  [[nodiscard]] std::optional<communicator_type> replica_group() const { return strategy_->replica_group(); }

 private:
  /// The options the layout reads: every ddp::unit_of entry of `options.units` resolved to its prefix.
  static data_parallel_options layout_options(Model& model, data_parallel_options options, int rank) {
    options.units = detail::resolve_units(model, options.units, rank);
    return options;
  }
  /// Opens backward scopes on those of `units` not open yet in this backward (backward_opener).
  void open_backward(std::span<const std::size_t> units) {
    if (const auto opened = state_.open_backward(units); !opened.empty()) {
      state_.join().note(detail::step_event::kind::acquire, opened);
      strategy_->acquire(opened);
    }
  }
  /// Closes the backward scopes of `units` (recorded for a join shadow step to replay).
  void release_backward(const std::vector<std::size_t>& units) {
    state_.join().note(detail::step_event::kind::release, units);
    strategy_->release(units);
  }
  /// The gradient of `slot` is final: starts every bucket that became ready.
  void report(std::size_t slot) {
    check_no_sync_closed("gradient_ready");
    strategy_->on_report(slot);
    state_.join().note(detail::step_event::kind::report, {}, slot);
    if (accumulation::defers(state_)) {
      layout_.slots()[slot].leaf->hold_gradient();
      return;
    }
    // After the gradients were finished at the end of a framework's backward, only dp.step(opt) or dp.zero_grad()
    // starts the next step's reports (a sharded no_sync span's micro-batches, finished by close(), go on).
    if (finished_by_backward_ && state_.phase() == detail::step_phase::finished) throw reported_twice(slot);
    if (state_.phase() != detail::step_phase::reporting) begin_reporting();
    gradient_in(slot);
    if (!state_.report(slot)) throw reported_twice(slot);
    start_ready();
    if (const auto u = state_.close_backward(slot, layout_.slots()[slot].unit)) release_backward({*u});
  }
  /// The error of a second report of `slot` before the step.
  [[nodiscard]] error reported_twice(std::size_t slot) const {
    return error("gradient_ready: parameter '" + layout_.slots()[slot].name + "' reported twice before a step: "
                 "a second backward ran before dp.step(opt) ended the first (step with dp.step(opt), not "
                 "opt.step() alone; accumulate micro-batches inside dp.no_sync()), or the backward reported it "
                 "twice (report each parameter once, after its gradient is final)", rank());
  }
  /// A leaf's framework reported `slot` from inside its backward: where it can, the gradients are finished when that
  /// backward ends (PyTorch's reducer does so), so code between backward() and step() — a clip, a gradient log —
  /// reads averaged gradients, never a bucket whose reduction is in flight.
  void finish_at_backward_end(std::size_t slot) {
    if (finish_queued_ || state_.no_sync().open > 0 || state_.phase() != detail::step_phase::reporting) return;
    finish_queued_ = layout_.slots()[slot].leaf->at_backward_end([this] {
      finish_queued_ = false;
      finish_gradients();
      finished_by_backward_ = true;
    });
  }
  /// A step around `run_optimizer`: gradients finished before it, the policy's after-step work after it.
  template <class F>
  void run_step(F&& run_optimizer) {
    state_.join().check("step", rank());
    if (state_.no_sync().open > 0)
      throw error("step: called inside no_sync(), where gradients are local and ranks would diverge; leave the "
                  "no_sync scope for the last micro-batch of the accumulation", rank());
    finish_gradients();
    masters_.widen(strategy_->optimizer_buffers());  // mixed precision: the f32 master gradients
    if (scaler_.unscale(comm_, owned_buffers())) {   // loss scaling: an overflow on some rank skips the update
      strategy_->after_skipped_step();
    } else {
      masters_.step(strategy_->optimizer_buffers(), [&] {
        if (steps_ == 0 && options_.check_first_gradients && !state_.join().open()) check_first_gradients();
        if (options_.clip.max_norm > 0) {
          last_grad_norm_ = detail::grad_norm(owned_buffers(), strategy_->norm_group(), options_.clip.norm, rank());
          detail::clip_to(owned_buffers(), options_.clip.max_norm, last_grad_norm_);
        }
        run_optimizer();
      });
      strategy_->after_step();
      layout_.values_out();
    }
    scaler_.update();
    detail::sync_buffers(comm_, state_.join(), model_state_, state_sync_, options_.buffers);
    state_.end();
    state_.join().end_step();
    ++steps_;
    finish_queued_ = finished_by_backward_ = false;
    if (options_.verify_every > 0 && steps_ % options_.verify_every == 0) verify_in_sync();
  }
  /// Throws when every averaged gradient of the first step is zero on every rank (data_parallel_options::
  /// check_first_gradients): the largest |g| over the norm group, one f64 per rank travelling where it is sharded.
  void check_first_gradients() const {
    if (detail::grad_norm(owned_buffers(), strategy_->norm_group(), {.norm_type = inf_norm}, rank()) != 0) return;
    throw error("step: every averaged gradient of the first step is zero on every rank, so nothing would train: the "
                "backward wrote no gradient ddp holds. A framework that computes on memory of its own needs leaves it "
                "computes through (an adopted std::span over a copy of its pointers is not), or owning leaves, which "
                "ddp copies; and the loss must reach the parameters. Set data_parallel_options::check_first_gradients "
                "= false where a zero first step is meant", rank());
  }
  /// The step's first report: the declared-unused parameters count as reported.
  void begin_reporting() {
    state_.join().begin_step(comm_);  // in a join scope: the step's first collective counts the ranks still training
    state_.begin(unused_);
    if (!layout_.adopting())
      for (std::size_t s = 0; s < unused_.size(); ++s)
        if (unused_[s]) gradient_in(s);
  }
  /// Owning leaves: the gradient moves into ddp's memory (the accumulation trait says what becomes of the leaf's).
  void gradient_in(std::size_t slot) {
    auto& leaf = *layout_.slots()[slot].leaf;
    if (leaf.adopts()) return;
    leaf.gradient_in();
    accumulation::moved_in(leaf);
  }
  void start_ready() {
    while (const auto b = state_.next_ready()) strategy_->reduce(hook_, *b);
  }
  /// Waits for the started buckets in plan order; each becomes reduced.
  void reduce_started() {
    for (std::size_t b = 0; b < state_.started(); ++b)
      if (state_.bucket(b).phase != detail::bucket_phase::reduced) strategy_->reduced(hook_, b);
  }
  /// A call that takes a collective only ranks still training would make (shadow steps cannot mirror it).
  void check_outside_join(const char* where) const {
    state_.join().check(where, rank());
    if (state_.join().open())
      throw config_error(std::string(where) + ": inside a join scope a rank that ran out of batches cannot mirror "
                         "this call; clip inside every step with data_parallel_options::clip (shadow steps clip "
                         "alike) and read dp.last_grad_norm()", rank());
  }
  void check_no_sync_closed(const char* where) const {
    state_.join().check(where, rank());
    if (state_.no_sync().unclosed)
      throw error(std::string(where) + ": a no_sync() span of a sharded policy ended without close(), so its micro-batch's reduce-scatters were never completed; call guard.close() "
                  "at the end of the span (or dp.finish_gradients() now)", rank());
  }

  Model& model_;
  communicator_type comm_;
  data_parallel_options options_;
  sharding sharding_;                       // the sharding policy's value (its settings)
  std::size_t multiple_;                    // arena padding and bucket granularity (the shard group's size)
  detail::parameter_layout layout_;
  detail::bucket_plan plan_;
  hook_type hook_;
  std::vector<detail::named_state> model_state_;  // buffers and frozen parameters, in visit order
  detail::state_sync state_sync_;                 // their packing memory
  detail::step_state state_;                // the step, its buckets and units, join, no_sync, backward scopes
  detail::bucket_rebuild rebuild_{options_.rebuild_buckets && strategy_type::rebuilds_buckets};  // after step 1
  std::optional<strategy_type> strategy_;   // made after the broadcast (the sharded ones copy owned values)
  detail::master_weights masters_;          // mixed precision: the f32 masters of the owned values
  std::vector<char> unused_;                // per slot: declared unused
  std::vector<std::shared_ptr<void>> held_;  // goes with the wrapper: autograd hooks, adapters' tokens (hold_until_destroyed)
  std::size_t steps_ = 0;                   // optimizer steps taken (for options_.verify_every)
  double last_grad_norm_ = 0;               // the norm the last step clipped by (options_.clip)
  detail::loss_scaler scaler_{options_.loss_scaling, comm_.rank()};  // loss scaling: the scale and this step's overflow
  bool finish_queued_ = false;              // finish_gradients() waits for the end of the framework's backward
  bool finished_by_backward_ = false;       // it ran there: the next report needs dp.step(opt) or dp.zero_grad() first
  friend class join_scope<data_parallel>;
  friend class backward_opener<data_parallel>;
  friend class ddp::no_sync_guard<data_parallel>;
};

/// `ddp::data_parallel dp{model, comm, policies...};` deduces the backend from the communicator's type
/// (ddp::backend_of) and the other policies from the values given, in any order.
template <class Model, class Comm, detail::policy... Ps>
data_parallel(Model&, Comm, Ps...) -> data_parallel<Model, backend_of_t<Comm>, Ps...>;
/// The same, with data_parallel_options last (at most one policy of each of the four other categories).
template <class Model, class Comm>
data_parallel(Model&, Comm, data_parallel_options) -> data_parallel<Model, backend_of_t<Comm>>;
template <class Model, class Comm, detail::policy P1>
data_parallel(Model&, Comm, P1, data_parallel_options) -> data_parallel<Model, backend_of_t<Comm>, P1>;
template <class Model, class Comm, detail::policy P1, detail::policy P2>
data_parallel(Model&, Comm, P1, P2, data_parallel_options) -> data_parallel<Model, backend_of_t<Comm>, P1, P2>;
template <class Model, class Comm, detail::policy P1, detail::policy P2, detail::policy P3>
data_parallel(Model&, Comm, P1, P2, P3, data_parallel_options)
    -> data_parallel<Model, backend_of_t<Comm>, P1, P2, P3>;
template <class Model, class Comm, detail::policy P1, detail::policy P2, detail::policy P3, detail::policy P4>
data_parallel(Model&, Comm, P1, P2, P3, P4, data_parallel_options)
    -> data_parallel<Model, backend_of_t<Comm>, P1, P2, P3, P4>;

}  // namespace ddp
