#pragma once
/// \file What the sharding strategies (shard_grad_op, full_shard, hybrid) share. Arenas are padded so that
/// every bucket holds a multiple of N elements (N = ranks in the shard group) and no bucket crosses a
/// unit; rank r owns block r of every bucket (contiguous, not aligned to parameters).
///
/// Gradients: a unit's full gradients exist only while a gather scope holds the unit and until its buckets'
/// reduce-scatters have read them: the scope binds the unit's parameters to a zeroed buffer of a unit_pool,
/// which goes back to the pool afterwards (steady-state steps reuse the same buffers: nothing is allocated
/// and no page is faulted in). Outside, a parameter's gradient points at its place in the layout's gradient
/// arena, whose pages are released once at construction (zeros, not resident). Each bucket is
/// reduce-scattered (average) into the owned block: straight into the owned gradients after zero_grad(),
/// else into a receive buffer that is then added (accumulation, as under no_sync). hybrid averages each
/// block across the replica group too; that all-reduce starts when the next bucket is launched, so it
/// overlaps the rest of the backward.
///
/// Values: the optimizer steps the owned values against the owned gradients. shard_grad_op's owned values are
/// its blocks of the value arena, and after each step every bucket is all-gathered in place; full_shard keeps a
/// persistent copy of the owned blocks (its arena holds no values) and all-gathers units on demand into pooled
/// buffers.

#include <algorithm>
#include <cstddef>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/bucket_planner.hpp>
#include <ddp/parallel/comm_hooks.hpp>
#include <ddp/parallel/options.hpp>
#include <ddp/parallel/policies.hpp>
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

/// Reduce-scatter, sharded gradients and optimizer state, all-gather, and the units' pooled buffers: the
/// machinery of the sharded strategies. `shard` is the group parameters are sharded over; `replica`
/// (hybrid) the group the shards are replicated over; `policy` names the strategy in messages.
template <class Comm>
class sharded_core {
 public:
  sharded_core(parameter_layout& layout, const bucket_plan& plan, Comm shard, std::optional<Comm> replica,
               const char* policy, const data_parallel_options& options, bool values_in_arena)
      : layout_(layout), plan_(plan), shard_(std::move(shard)), replica_(std::move(replica)),
        values_pool_(widths(layout)), grads_pool_(widths(layout)), policy_(policy),
        keep_buffers_(options.keep_unit_buffers), values_in_arena_(values_in_arena) {
    const auto n = static_cast<std::size_t>(shard_.size()), r = static_cast<std::size_t>(shard_.rank());
    for (const auto& a : layout_.arenas()) {
      own_values_.emplace_back(values_in_arena_ ? 0 : a.numel / n * size_of(a.type));
      own_grads_.emplace_back(a.numel / n * size_of(a.type));
      received_.emplace_back();
    }
    for (const auto& b : plan_.buckets) {
      const std::size_t length = (b.end - b.begin) / n;
      blocks_.push_back({.begin = b.begin + r * length, .length = length, .shard = b.begin / n});
    }
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      const auto& a = layout_.arenas()[plan_.buckets[b].arena];
      const std::size_t w = size_of(a.type);
      if (!values_in_arena_)
        std::copy_n(a.values.data() + blocks_[b].begin * w, blocks_[b].length * w,
                    own_values_[plan_.buckets[b].arena].data() + blocks_[b].shard * w);
      buffers_.push_back(owned_buffer(b));
    }
    const std::size_t units = layout_.units().size();
    unit_buckets_.resize(units);
    unit_slots_.resize(units);
    extents_.assign(units, std::vector<unit_extent>(layout_.arenas().size()));
    for (std::size_t s = 0; s < layout_.slots().size(); ++s) unit_slots_[layout_.slots()[s].unit].push_back(s);
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      const auto& bk = plan_.buckets[b];
      unit_buckets_[bk.unit].push_back(b);
      auto& e = extents_[bk.unit][bk.arena];
      e = e.end == e.begin ? unit_extent{bk.begin, bk.end} : unit_extent{std::min(e.begin, bk.begin), std::max(e.end, bk.end)};
    }
    value_buffer_.assign(units, no_buffer);
    grad_buffer_.assign(units, no_buffer);
    holders_.assign(units, 0);
    reported_.assign(units, 0);
    direct_.assign(plan_.buckets.size(), 1);
    fresh_.assign(plan_.buckets.size(), 1);
    launched_.assign(plan_.buckets.size(), 0);
    averaging_.assign(plan_.buckets.size(), 0);
    scattered_.resize(plan_.buckets.size());
    averaged_.resize(plan_.buckets.size());
    for (auto& a : layout_.arenas()) a.grads.release(0, a.grads.size());  // parked gradients: zero pages
  }
  sharded_core(const sharded_core&) = delete;
  sharded_core& operator=(const sharded_core&) = delete;
  /// Waits for the operations in flight and points every parameter back at the arenas (copying the values
  /// of gathered units there), so the layout can hand the model its values.
  ~sharded_core() {
    for (auto* works : {&scattered_, &averaged_})
      for (auto& w : *works) try { w.wait(); } catch (...) {}  // NOLINT: no throw from a destructor
    for (std::size_t u = 0; u < holders_.size(); ++u) {
      if (value_buffer_[u] != no_buffer) {
        for (std::size_t a = 0; a < layout_.arenas().size(); ++a) {
          const auto& e = extents_[u][a];
          const std::size_t w = size_of(layout_.arenas()[a].type);
          std::copy_n(values_pool_.data(value_buffer_[u], a), (e.end - e.begin) * w,
                      layout_.arenas()[a].values.data() + e.begin * w);
        }
      }
      value_buffer_[u] = grad_buffer_[u] = no_buffer;
      bind_unit(u);
    }
  }

  static constexpr bool sharded = true;

  /// A gradient may only be reported while its unit has gradient storage (inside a gather scope); notes it.
  void on_report(std::size_t slot) {
    const auto& s = layout_.slots()[slot];
    if (grad_buffer_[s.unit] == no_buffer)
      throw error(std::string(policy_) + ": parameter '" + s.name + "' reported a gradient outside a gather "
                      "scope of its unit '" + layout_.units()[s.unit] + "' (the sharded strategies give a unit its "
                      "gradient storage, and under full_shard its values, only while a scope holds it); wrap the "
                      "unit's forward and backward in auto g = dp.gather(model." + layout_.units()[s.unit] + ")",
                  shard_.rank());
    reported_[s.unit] = 1;
  }

  /// Starts the reduce-scatter (average) of bucket `b`; under hybrid, also the cross-group average of the
  /// bucket launched before it (whose reduce-scatter is then waited for: every rank issues the same sequence).
  template <class Hook>
  work reduce(Hook& /*hook*/, std::size_t b) {
    static_assert(std::is_same_v<Hook, hook_impl<plain_hook>>,
                  "ddp::data_parallel: the compression hooks work with ddp::replicate only; drop the hook or "
                  "use replicate.");
    const auto& bk = plan_.buckets[b];
    if (grad_buffer_[bk.unit] == no_buffer) {  // no report reached this unit: its gradients are zero
      hold_gradients(bk.unit);
      reported_[bk.unit] = 1;
    }
    direct_[b] = fresh_[b];
    fresh_[b] = 0;
    launched_[b] = 1;
    scattered_[b] = shard_.reduce_scatter(gradient_view(b), output(b), reduce_op::avg);
    if (replica_ && b > 0 && launched_[b - 1] && !averaging_[b - 1]) start_average(b - 1);
    return scattered_[b];
  }
  /// Bucket `b`'s reduce-scatter is done: finish its cross-group average (hybrid), add the receive buffer
  /// into the owned gradients unless it went there directly; the unit's gradient buffer goes back to the
  /// pool once all of its buckets are done and no scope holds it.
  template <class Hook>
  void reduced(Hook& /*hook*/, std::size_t b) {
    if (replica_) {
      if (!averaging_[b]) start_average(b);
      averaged_[b].wait();
      averaged_[b] = work{};
      averaging_[b] = 0;
    }
    if (!direct_[b]) {
      const raw_tensor in = received(b), acc = owned_grads(b);
      visit_dtype(in.type, [&]<class T>(T) {
        const T* src = static_cast<const T*>(in.data);
        T* dst = static_cast<T*>(acc.data);
        for (std::size_t i = 0; i < in.size; ++i) dst[i] = static_cast<T>(dst[i] + src[i]);
      });
    }
    scattered_[b] = work{};
    launched_[b] = 0;
    const std::size_t u = plan_.buckets[b].unit;
    if (std::none_of(unit_buckets_[u].begin(), unit_buckets_[u].end(), [&](std::size_t k) { return launched_[k]; })) {
      reported_[u] = 0;
      if (holders_[u] > 0)
        zero_gradients(u);  // a scope still holds the unit: its next backward starts from zero
      else if (grad_buffer_[u] != no_buffer)
        let_go_gradients(u);
    }
  }
  /// Zeroes the owned gradients and the full gradients of the units in use.
  void zero_grad() noexcept {
    for (auto& g : own_grads_) std::fill_n(g.data(), g.size(), std::byte{0});
    std::fill(fresh_.begin(), fresh_.end(), 1);
    for (std::size_t u = 0; u < grad_buffer_.size(); ++u)
      if (grad_buffer_[u] != no_buffer) zero_gradients(u);
  }
  /// One flat buffer per bucket: the owned values and gradients with the parameter pieces in them.
  [[nodiscard]] const std::vector<optim::flat_buffer>& optimizer_buffers() const noexcept { return buffers_; }
  /// The group parameters are sharded over.
  [[nodiscard]] const Comm& shard_group() const noexcept { return shard_; }
  /// hybrid: the group shards are replicated over.
  [[nodiscard]] const std::optional<Comm>& replica_group() const noexcept { return replica_; }

 protected:
  [[nodiscard]] const bucket_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const parameter_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::span<const std::size_t> unit_buckets(std::size_t u) const noexcept { return unit_buckets_[u]; }
  [[nodiscard]] std::size_t units() const noexcept { return holders_.size(); }
  [[nodiscard]] int holders(std::size_t u) const noexcept { return holders_[u]; }
  [[nodiscard]] bool has_gradients(std::size_t u) const noexcept { return grad_buffer_[u] != no_buffer; }

  /// A gather scope begins on unit `u`: it gets gradient storage (zeroed, unless it still holds gradients
  /// of this backward).
  void hold(std::size_t u) {
    if (holders_[u]++ == 0 && grad_buffer_[u] == no_buffer) hold_gradients(u);
  }
  /// A gather scope on unit `u` ends: with no scope left, its gradient storage goes back to the pool now
  /// (nothing reported) or when its reduce-scatters have read it.
  void let_go(std::size_t u) {
    if (--holders_[u] == 0 && !reported_[u]) let_go_gradients(u);
  }

  /// Unit `u`'s values live in a pooled buffer from now on (its contents are unspecified until gathered).
  void take_values(std::size_t u) {
    if (value_buffer_[u] != no_buffer) return;
    value_buffer_[u] = values_pool_.take(sizes(u));
    bind_unit(u);
  }
  /// Unit `u`'s values buffer goes back to the pool; its parameters point at their (zero) arena place.
  void give_values(std::size_t u) {
    if (value_buffer_[u] == no_buffer) return;
    values_pool_.give(value_buffer_[u]);
    value_buffer_[u] = no_buffer;
    bind_unit(u);
  }
  /// Starts refilling bucket `b`'s full values (in the unit's pooled buffer, else in the arena) from every
  /// rank's owned block.
  work gather_bucket(std::size_t b) {
    return shard_.all_gather(owned_values(b), value_view(b));
  }
  /// Frees the pooled buffers the last step did not need (every idle one unless keep_unit_buffers).
  void trim_pools() noexcept {
    values_pool_.trim(!keep_buffers_);
    grads_pool_.trim(!keep_buffers_);
  }
  /// Releases the pages of every arena's values (full_shard keeps values only in pooled buffers and owned blocks).
  void park_values() noexcept {
    for (auto& a : layout_.arenas()) a.values.release(0, a.values.size());
  }

 private:
  static std::vector<std::size_t> widths(const parameter_layout& layout) {
    std::vector<std::size_t> out;
    for (const auto& a : layout.arenas()) out.push_back(size_of(a.type));
    return out;
  }
  [[nodiscard]] std::vector<std::size_t> sizes(std::size_t u) const {
    std::vector<std::size_t> out;
    for (const auto& e : extents_[u]) out.push_back(e.end - e.begin);
    return out;
  }
  /// Points unit `u`'s parameters at its pooled buffers, or at their arena places where it has none.
  void bind_unit(std::size_t u) {
    for (const std::size_t s : unit_slots_[u]) {
      const auto& p = layout_.slots()[s];
      const auto& a = layout_.arenas()[p.arena];
      const std::size_t w = size_of(p.type), at = p.offset - extents_[u][p.arena].begin;
      std::byte* values = value_buffer_[u] == no_buffer ? a.values.data() + p.offset * w
                                                        : values_pool_.data(value_buffer_[u], p.arena) + at * w;
      std::byte* grads = grad_buffer_[u] == no_buffer ? a.grads.data() + p.offset * w
                                                      : grads_pool_.data(grad_buffer_[u], p.arena) + at * w;
      p.rebind(p.object, values, grads);
    }
  }
  void hold_gradients(std::size_t u) {
    reclaim();
    grad_buffer_[u] = grads_pool_.take(sizes(u));
    zero_gradients(u);
    bind_unit(u);
  }
  void let_go_gradients(std::size_t u) {
    grads_pool_.give(grad_buffer_[u]);
    grad_buffer_[u] = no_buffer;
    bind_unit(u);
  }
  /// Gives back the gradient buffers of units no scope holds whose reduce-scatters have all completed.
  void reclaim() {
    for (std::size_t u = 0; u < holders_.size(); ++u) {
      if (grad_buffer_[u] == no_buffer || holders_[u] > 0 || !reported_[u]) continue;
      const bool read = std::all_of(unit_buckets_[u].begin(), unit_buckets_[u].end(),
                                    [&](std::size_t k) { return launched_[k] && scattered_[k].done(); });
      if (read) let_go_gradients(u);
    }
  }
  void zero_gradients(std::size_t u) {
    for (std::size_t a = 0; a < layout_.arenas().size(); ++a) {
      const raw_tensor g = unit_gradients(u, a);
      std::fill_n(static_cast<std::byte*>(g.data), g.bytes(), std::byte{0});
    }
  }
  void start_average(std::size_t b) {
    scattered_[b].wait();
    averaged_[b] = replica_->all_reduce(output(b), reduce_op::avg);
    averaging_[b] = 1;
  }

  [[nodiscard]] raw_tensor unit_gradients(std::size_t u, std::size_t a) const {
    const auto& e = extents_[u][a];
    return {grads_pool_.data(grad_buffer_[u], a), e.end - e.begin, layout_.arenas()[a].type, device::cpu()};
  }
  /// Bucket `b`'s full gradients inside its unit's gradient buffer.
  [[nodiscard]] raw_tensor gradient_view(std::size_t b) const {
    const auto& bk = plan_.buckets[b];
    const std::size_t w = size_of(layout_.arenas()[bk.arena].type);
    return {grads_pool_.data(grad_buffer_[bk.unit], bk.arena) + (bk.begin - extents_[bk.unit][bk.arena].begin) * w,
            bk.end - bk.begin, layout_.arenas()[bk.arena].type, device::cpu()};
  }
  /// Bucket `b`'s full values: in its unit's pooled buffer when it has one, else in the arena.
  [[nodiscard]] raw_tensor value_view(std::size_t b) const {
    const auto& bk = plan_.buckets[b];
    const auto& a = layout_.arenas()[bk.arena];
    if (value_buffer_[bk.unit] == no_buffer) return a.value_view(bk.begin, bk.end - bk.begin);
    const std::size_t w = size_of(a.type);
    return {values_pool_.data(value_buffer_[bk.unit], bk.arena) + (bk.begin - extents_[bk.unit][bk.arena].begin) * w,
            bk.end - bk.begin, a.type, device::cpu()};
  }
  [[nodiscard]] raw_tensor shard_view(const std::vector<aligned_bytes>& store, std::size_t b) const {
    const auto& a = layout_.arenas()[plan_.buckets[b].arena];
    const std::size_t w = size_of(a.type);
    return {store[plan_.buckets[b].arena].data() + blocks_[b].shard * w, blocks_[b].length, a.type, device::cpu()};
  }
  /// Where bucket `b`'s reduce-scatter writes: the owned gradients when they are zero, else the receive buffer.
  [[nodiscard]] raw_tensor output(std::size_t b) { return direct_[b] ? owned_grads(b) : received(b); }
  [[nodiscard]] raw_tensor received(std::size_t b) {
    const std::size_t a = plan_.buckets[b].arena;
    if (received_[a].size() == 0) received_[a] = aligned_bytes(own_grads_[a].size());  // first accumulation
    return shard_view(received_, b);
  }
  [[nodiscard]] raw_tensor owned_grads(std::size_t b) const { return shard_view(own_grads_, b); }
  /// Bucket `b`'s owned values: its block of the value arena (shard_grad_op, whose gather is then in place),
  /// else the persistent copy (full_shard, whose arena holds no values).
  [[nodiscard]] raw_tensor owned_values(std::size_t b) const {
    if (!values_in_arena_) return shard_view(own_values_, b);
    const auto& a = layout_.arenas()[plan_.buckets[b].arena];
    return a.value_view(blocks_[b].begin, blocks_[b].length);
  }

  optim::flat_buffer owned_buffer(std::size_t b) const {
    optim::flat_buffer out{.values = owned_values(b), .grads = owned_grads(b), .segments = {}};
    const std::size_t lo = blocks_[b].begin, hi = lo + blocks_[b].length;
    for (const std::size_t s : plan_.buckets[b].params) {
      const auto& p = layout_.slots()[s];
      const std::size_t from = std::max(lo, p.offset), to = std::min(hi, p.offset + p.numel);
      if (from < to) out.segments.push_back({.name = p.name, .offset = from - lo, .numel = to - from, .start = from - p.offset});
    }
    return out;
  }

  parameter_layout& layout_;
  const bucket_plan& plan_;
  Comm shard_;
  std::optional<Comm> replica_;
  std::vector<owned_block> blocks_;                     // per bucket
  std::vector<aligned_bytes> own_values_;               // per arena: the owned blocks of every bucket, in bucket-begin order
  std::vector<aligned_bytes> own_grads_;                // per arena: the accumulated owned gradients
  std::vector<aligned_bytes> received_;                 // per arena: reduce-scatter outputs to add (made on first need)
  std::vector<optim::flat_buffer> buffers_;             // per bucket, for the optimizer
  std::vector<std::vector<std::size_t>> unit_buckets_;  // per unit: its buckets
  std::vector<std::vector<std::size_t>> unit_slots_;    // per unit: its parameters
  std::vector<std::vector<unit_extent>> extents_;       // per unit, per arena
  unit_pool values_pool_;                               // full_shard's gathered units
  unit_pool grads_pool_;                                // the units' full gradients
  std::vector<std::size_t> value_buffer_;               // per unit: its values buffer, or no_buffer
  std::vector<std::size_t> grad_buffer_;                // per unit: its gradient buffer, or no_buffer
  std::vector<int> holders_;                            // per unit: open gather scopes
  std::vector<char> reported_;                          // per unit: gradients reported, buckets not all reduced
  std::vector<char> direct_;                            // per bucket: reduce-scattered straight into the owned gradients
  std::vector<char> fresh_;                             // per bucket: the owned gradients are zero
  std::vector<char> launched_;                          // per bucket: reduce-scatter started, not yet reduced()
  std::vector<work> scattered_;                         // per bucket: its reduce-scatter
  std::vector<work> averaged_;                          // per bucket: hybrid's cross-group average
  std::vector<char> averaging_;                         // per bucket: that average has started
  const char* policy_;                                  // the strategy's name, for messages
  bool keep_buffers_;                                   // data_parallel_options::keep_unit_buffers
  bool values_in_arena_;                                // owned values are blocks of the value arena
};

}  // namespace ddp::detail
