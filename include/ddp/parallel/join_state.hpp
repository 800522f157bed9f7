#pragma once
/// \file ddp::detail::join_state: where a data_parallel stands with respect to a join scope (parallel/join.hpp):
/// open or not, this rank still training or joined, whether this step was counted and by how many ranks, and
/// under full_shard the calls of the step in progress and of the last one taken, which a shadow step replays.
/// The step state (parallel/step_state.hpp) owns it.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/error.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/phases.hpp>

namespace ddp::detail {

/// One call of a full_shard step that a shadowing rank replays: a scope opens or closes on units, or a slot
/// reports its gradient.
struct step_event {
  enum class kind : std::uint8_t { acquire, release, report };
  kind what = kind::report;  ///< the call
  std::size_t first = 0;     ///< acquire, release: where the scope's units start in the step_record's units
  std::size_t count = 0;     ///< acquire, release: how many units
  std::size_t slot = 0;      ///< report: the parameter
};

/// The calls of one full_shard step, in order; the units of all its scopes in one list, so that recording a
/// step allocates nothing once the record has held a step as long.
struct step_record {
  std::vector<step_event> events;   ///< the calls
  std::vector<std::size_t> units;   ///< every acquire's and release's units, one after another

  /// Event `e`'s units.
  [[nodiscard]] std::span<const std::size_t> units_of(const step_event& e) const noexcept {
    return std::span<const std::size_t>(units).subspan(e.first, e.count);
  }
  /// Forgets the calls, keeping the memory.
  void clear() noexcept {
    events.clear();
    units.clear();
  }
};

/// Where a data_parallel stands with respect to a join scope: open or not, this rank still training or
/// joined, whether this step was counted and by how many ranks; under full_shard (`trace`) the calls of the
/// step in progress and of the last one taken, which a shadow step replays.
class join_state {
 public:
  explicit join_state(bool trace) noexcept : trace_(trace) {}

  /// Whether a join scope is open.
  [[nodiscard]] bool open() const noexcept { return open_; }
  /// Whether this rank still trains (outside a join scope: always).
  [[nodiscard]] bool active() const noexcept { return !open_ || active_; }
  /// Whether this rank is shadowing the others' step (its missing reports are zeros, not an error).
  [[nodiscard]] bool shadowing() const noexcept { return shadowing_; }

  /// Throws the error of a scope that was left without finish(opt); `where` names the call.
  void check(const char* where, int rank) const {
    if (dropped_)
      throw error(std::string(where) + ": a join scope (dp.join()) ended without j.finish(opt) completing, so the "
                  "other ranks may be waiting for this rank's collectives; call j.finish(opt) after the rank's last "
                  "batch on every rank (also when leaving the loop early), and make a new wrapper to train on after "
                  "this error", rank);
  }
  /// A join scope opens (local): none may be open, and no step may be in progress.
  void open_scope(step_phase phase, int rank) {
    check("join", rank);
    if (open_) throw error("join: a join scope is already open on this wrapper; finish it first", rank);
    if (phase == step_phase::reporting || counted_)
      throw error("join: a step is in progress; open the join scope before the epoch's first batch", rank);
    open_ = true;
    active_ = true;
  }
  /// A sharded policy's no_sync span reduce-scatters each micro-batch, which a shadowing rank cannot mirror.
  void refuse_no_sync(int rank) const {
    if (open_)
      throw config_error("no_sync: inside a join scope, gradient accumulation is supported under ddp::replicate "
                         "only (the sharded policies reduce every micro-batch, which a rank that ran out of batches "
                         "cannot shadow); accumulate outside the join scope, or use replicate", rank);
  }

  /// The step's first collective on a rank still training inside a join scope: counts the active ranks.
  template <class Comm>
  void begin_step(Comm& comm) {
    if (!open_ || !active_ || counted_) return;
    active_ranks_ = count(comm, 1);
    counted_ = true;
  }
  /// The number of ranks whose contribution is `mine` (1: training, 0: joined), summed over `comm`. Blocking.
  template <class Comm>
  static int count(Comm& comm, int mine) {
    std::array<std::int32_t, 1> sum{mine};
    comm.all_reduce(std::span<std::int32_t>(sum), reduce_op::sum).wait();
    return sum[0];
  }
  /// The reduced gradients in `buffers`, averaged over `world` ranks, become the average over the active ones.
  void rescale(std::span<const optim::flat_buffer> buffers, int world) const {
    if (!counted_ || active_ranks_ == world || active_ranks_ <= 0) return;
    for (const auto& b : buffers) b.memory().scale(b.grads, static_cast<double>(world) / active_ranks_);
  }
  /// The step ended (the optimizer stepped): the next one is counted again; under full_shard the calls of the
  /// step this rank took inside a join scope become the ones a shadow step replays (kept across scopes).
  void end_step() noexcept {
    counted_ = false;
    if (shadowing_) {
      shadowing_ = false;
    } else if (trace_ && open_) {
      std::swap(replay_, recording_);
      recording_.clear();
    }
  }
  /// Notes a call of the step in progress (full_shard, while this rank trains inside a join scope): a scope on
  /// `units` opens or closes, or `slot` reports.
  void note(step_event::kind what, std::span<const std::size_t> units, std::size_t slot = 0) {
    if (!trace_ || !open_ || !active_) return;
    recording_.events.push_back({.what = what, .first = recording_.units.size(), .count = units.size(), .slot = slot});
    recording_.units.insert(recording_.units.end(), units.begin(), units.end());
  }

  /// This rank ran out of batches (finish begins); a step must not be in progress.
  void leave(step_phase phase, int rank) {
    check("join_scope::finish", rank);
    if (phase == step_phase::reporting || counted_)
      throw error("join_scope::finish: a step is in progress on this rank; call j.finish(opt) after the rank's last "
                  "dp.step(opt)", rank);
    active_ = false;
  }
  /// A shadow step of `active` ranks begins: returns the calls to replay (full_shard), else nothing.
  [[nodiscard]] const step_record& shadow(int active, int rank) {
    if (trace_ && replay_.events.empty())
      throw error("join_scope::finish: under full_shard a rank that ran out shadows the others' step by replaying "
                  "its own last step's unshard scopes and reports, and this rank has taken no step inside a join scope "
                  "yet; give every rank at least one batch in its first joined epoch, or use ddp::shard_grad_op", rank);
    active_ranks_ = active;
    counted_ = true;
    shadowing_ = true;
    return replay_;
  }
  /// Every rank finished: the scope closes.
  void close() noexcept { open_ = false; }
  /// The scope ended without finish(opt): the wrapper's next call throws.
  void drop() noexcept {
    open_ = false;
    dropped_ = true;
  }

 private:
  bool trace_;                         // full_shard: record the steps' calls for shadow steps
  bool open_ = false;                  // a join scope is open
  bool active_ = false;                // this rank still trains (has not called finish)
  bool counted_ = false;               // this step's active ranks are counted
  bool shadowing_ = false;             // this step is a shadow of the others'
  bool dropped_ = false;               // a scope ended without finish(opt)
  int active_ranks_ = 0;               // ranks training in this step
  step_record recording_;              // full_shard: the calls of the step in progress
  step_record replay_;                 // full_shard: the calls of the last step taken
};

}  // namespace ddp::detail
