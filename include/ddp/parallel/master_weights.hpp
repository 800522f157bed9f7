#pragma once
/// \file The rooms of ddp::mixed_precision inside data_parallel. apply_precision gives every arena of the compute
/// dtype its reduce dtype before the strategy is built; a strategy widens each bucket's gradients into a
/// reduce_staging before its collective (replicate: the staging is where the averaged gradients stay; the sharded
/// strategies reduce-scatter it into owned gradients of the reduce dtype and release its pages once read);
/// master_weights keeps the f32 copy of the owned values the optimizer steps and narrows it into them afterwards.
///
/// A step under mixed_precision<bf16, f32>: the backward writes bf16 gradients; each bucket is widened to f32 and
/// reduced in f32 into the f32 owned gradients, which are the master gradients; the optimizer steps the f32
/// master values (its state is f32); the masters are narrowed into the bf16 owned values, which the strategy
/// then all-gathers as it does without mixed precision. Under mixed_precision<bf16, bf16> the reduction runs on the
/// bf16 gradients themselves and the reduced owned gradients are widened into f32 master gradients.

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/arena.hpp>
#include <ddp/parallel/mixed_precision.hpp>

namespace ddp::detail {

/// Gives the arenas of Precision's compute dtype its reduce dtype; throws ddp::config_error when the model has no
/// parameter of the compute dtype or has parameters of another 16-bit dtype. Local.
template <class Precision>
void apply_precision(parameter_layout& layout, int rank) {
  if constexpr (Precision::masters) {
    const dtype compute = dtype_v<typename Precision::param_type>;
    const std::string name(to_string(compute));
    bool found = false;
    for (auto& a : layout.arenas()) {
      const auto& first = layout.slots()[a.params.front()];
      if (a.type == compute) {
        a.reduce_type = dtype_v<typename Precision::reduce_type>;
        found = true;
      } else if (size_of(a.type) == 2) {
        throw config_error("data_parallel: ddp::mixed_precision computes in " + name + " but parameter '" + first.name +
                           "' is " + std::string(to_string(a.type)) + "; keep one 16-bit compute dtype in the model "
                           "and name it as the policy's Param", rank);
      }
    }
    if (!found)
      throw config_error("data_parallel: ddp::mixed_precision computes in " + name + " but the model has no " + name +
                         " parameter" + (layout.slots().empty() ? std::string() : " (parameter '" +
                         layout.slots().front().name + "' is " + std::string(to_string(layout.slots().front().type)) +
                         ")") + "; ddp does not cast a model: its "
                         "element type is its compute dtype, so write the model over ddp::" +
                         (compute == dtype::bf16 ? "bfloat16" : "float16") + " (the wrapper keeps f32 masters), or "
                         "drop the mixed_precision policy to train in the model's own dtype", rank);
  }
}

/// Per arena whose reduce dtype differs from its dtype: room for its gradients in the reduce dtype, laid as the
/// arena (element i of the arena at element i of the staging). Pages are released once a collective read them.
class reduce_staging {
 public:
  explicit reduce_staging(const parameter_layout& layout) {
    for (const auto& a : layout.arenas()) {
      types_.push_back(a.reduce_type);
      store_.push_back(a.reduce_type == a.type ? domain_buffer{} : a.domain->allocate(a.numel * size_of(a.reduce_type)));
    }
  }
  /// Where the gradients `own` (elements [begin, begin + own.size) of arena `a`, in the arena's dtype, wherever
  /// they lie) are reduced: `own` itself when the arena reduces in its own dtype, else the staging's elements.
  [[nodiscard]] raw_tensor at(raw_tensor own, std::size_t a, std::size_t begin) const {
    if (store_[a].size() == 0) return own;
    return store_[a].view(types_[a], begin, own.size);
  }
  /// at(), with `own` widened into the staging first (a bucket about to be reduced).
  raw_tensor stage(raw_tensor own, std::size_t a, std::size_t begin) {
    const raw_tensor to = at(own, a, begin);
    if (to.data != own.data) store_[a].domain()->convert(own, to);
    return to;
  }
  /// Gives back the pages of the staging's elements [begin, begin + count) of arena `a` (their collective is done).
  void release(std::size_t a, std::size_t begin, std::size_t count) const {
    store_[a].release(begin * size_of(types_[a]), (begin + count) * size_of(types_[a]));
  }

 private:
  std::vector<dtype> types_;          // per arena: its reduce dtype
  std::vector<domain_buffer> store_;  // per arena, in its domain: empty where it reduces in its own dtype
};

/// The f32 master copy of the owned buffers of the compute dtype, which the optimizer steps: master values, and
/// master gradients (the owned gradients themselves where they are reduced in f32, else an f32 copy widened before
/// each step). Owned buffers of another dtype (f32, f64 parameters) are stepped as they are. Local.
class master_weights {
 public:
  /// Under mixed_precision (Precision::masters), makes the masters of `owned` (the strategy's buffers, whose values
  /// are final: after the broadcast); afterwards buffers() hands them out. Nothing under full_precision.
  template <class Precision>
  void attach(std::span<const optim::flat_buffer> owned) {
    if constexpr (Precision::masters) attach(owned, dtype_v<typename Precision::param_type>);
  }

 private:
  void attach(std::span<const optim::flat_buffer> owned, dtype compute) {
    for (const auto& b : owned) {
      optim::flat_buffer m = b;
      auto& values = values_.emplace_back();
      auto& grads = grads_.emplace_back();
      if (b.values.type == compute) {
        memory_domain& d = b.memory();
        values = d.allocate(b.values.size * sizeof(float));
        m.values = values.view(dtype::f32, 0, b.values.size);
        d.convert(b.values, m.values);
        if (b.grads.type != dtype::f32) {
          grads = d.allocate(b.grads.size * sizeof(float));
          m.grads = grads.view(dtype::f32, 0, b.grads.size);
        }
      }
      masters_.push_back(std::move(m));
    }
    on_ = true;
  }

 public:
  /// What the optimizer steps and checkpoints hold: the masters once attached, else `owned`.
  [[nodiscard]] std::span<const optim::flat_buffer> buffers(std::span<const optim::flat_buffer> owned) const noexcept {
    return on_ ? std::span<const optim::flat_buffer>(masters_) : owned;
  }
  /// The reduced gradients of `owned` widened into the master gradients, once per reduction (a gradient norm
  /// taken before the step reads and clips the masters, which the step then keeps).
  void widen(std::span<const optim::flat_buffer> owned) {
    for (std::size_t i = 0; on_ && !widened_ && i < masters_.size(); ++i)
      if (masters_[i].grads.data != owned[i].grads.data) owned[i].memory().convert(owned[i].grads, masters_[i].grads);
    widened_ = true;
  }
  /// The reduced gradients changed (a new reduction finished, or they were zeroed): widen() copies them again.
  void gradients_changed() noexcept { widened_ = false; }
  /// Runs `optimizer()` on the masters: the reduced gradients of `owned` are widened into the master gradients
  /// first (unless widen() did so for this reduction), and the master values narrowed into `owned`'s values afterwards.
  template <class F>
  void step(std::span<const optim::flat_buffer> owned, F&& optimizer) {
    widen(owned);
    optimizer();
    narrow(owned);
    widened_ = false;
  }
  /// The master values narrowed into `owned`'s values (after a step, or after a checkpoint filled the masters).
  void narrow(std::span<const optim::flat_buffer> owned) const {
    for (std::size_t i = 0; on_ && i < masters_.size(); ++i)
      if (masters_[i].values.data != owned[i].values.data) owned[i].memory().convert(masters_[i].values, owned[i].values);
  }

 private:
  bool on_ = false;
  bool widened_ = false;                      // the master gradients hold this reduction's gradients
  std::vector<domain_buffer> values_;         // per owned buffer: f32 master values (empty where stepped as it is)
  std::vector<domain_buffer> grads_;          // per owned buffer: f32 master gradients widened before each step
  std::vector<optim::flat_buffer> masters_;   // per owned buffer: what the optimizer steps
};

}  // namespace ddp::detail
