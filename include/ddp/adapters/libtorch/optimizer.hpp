#pragma once
/// \file ddp::parameters(dp): the tensors a torch::optim optimizer steps under a data_parallel wrapper.
///
/// Under replicate a torch::optim optimizer may step the model's own parameters (their values and gradients
/// are ddp's arenas). Under shard_grad_op and full_shard only this rank's owned blocks receive the averaged
/// gradients (and under full_shard the model's parameters are empty tensors outside a unit's forward and
/// backward), so the optimizer must step those: ddp::parameters(dp) gives one flat 1-D tensor per block (values
/// over ddp's owned values, `.grad` over the owned gradients), and dp.step(opt) all-gathers the updated blocks
/// into the model afterwards (full_shard: the next forward unshards them). Optimizer state is then sharded with
/// the blocks. Element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad) step flat blocks exactly as the
/// parameters; ddp::parameters(dp) is one group, ddp::parameters(dp, groups) cuts the blocks into parameter groups
/// by name (per-group options then as in torch::optim). opt.zero_grad() and dp.zero_grad()
/// both zero the gradients (dp.step(opt) points the tensors' `.grad` at the owned gradients again where
/// opt.zero_grad() dropped them). The tensors refer to the wrapper's memory: make the optimizer after the
/// wrapper and drop it first (a wrapper destroyed first gives the tensors still held copies and says so).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

#include <ddp/adapters/libtorch/tensor.hpp>
#include <ddp/core/error.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/optim/groups.hpp>

namespace ddp {

namespace detail::libtorch {

/// The tensors ddp::parameters gave out, per wrapper (by address), until the wrapper goes.
class handed_out {
 public:
  /// The wrapper's tensors, or none yet.
  std::optional<std::vector<torch::Tensor>> find(const void* dp) {
    const std::lock_guard lock(mutex_);
    const auto it = tensors_.find(dp);
    return it == tensors_.end() ? std::nullopt : std::optional(it->second);
  }
  /// Records the wrapper's tensors.
  void set(const void* dp, std::vector<torch::Tensor> tensors) {
    const std::lock_guard lock(mutex_);
    tensors_[dp] = std::move(tensors);
  }
  /// True when `t` is one of the parameter groups' pieces handed out (add).
  bool is_piece(const torch::Tensor& t) {
    const std::lock_guard lock(mutex_);
    for (const auto& [dp, pieces] : more_)
      for (const auto& piece : pieces)
        if (piece.is_same(t)) return true;
    return false;
  }
  /// Records more tensors over the wrapper's memory (parameter groups' pieces), which find() does not return.
  void add(const void* dp, const std::vector<torch::Tensor>& tensors) {
    const std::lock_guard lock(mutex_);
    auto& more = more_[dp];
    more.insert(more.end(), tensors.begin(), tensors.end());
  }
  /// The wrapper at `dp` goes: the tensors something still holds (an optimizer) get memory of their own, so stepping
  /// them no longer touches freed memory, and the user is told; `rank` names the process.
  void wrapper_gone(const void* dp, int rank) {
    std::vector<torch::Tensor> tensors;
    {
      const std::lock_guard lock(mutex_);
      const auto it = tensors_.find(dp);
      if (it == tensors_.end()) return;
      tensors = std::move(it->second);
      tensors_.erase(it);
      if (const auto more = more_.find(dp); more != more_.end()) {
        tensors.insert(tensors.end(), more->second.begin(), more->second.end());
        more_.erase(more);
      }
    }
    std::size_t held = 0;
    torch::NoGradGuard no_grad;
    for (auto& t : tensors) {
      if (t.use_count() <= 1) continue;  // only this list held it
      ++held;
      t.set_data(t.detach().clone());
      if (t.grad().defined()) t.mutable_grad() = t.grad().clone();
    }
    if (held > 0)
      std::fprintf(stderr, "ddp: rank %d: the data_parallel wrapper was destroyed while %zu tensor(s) of "
                   "ddp::parameters(dp) were still held (a torch::optim optimizer?); they now hold copies, and stepping "
                   "them no longer changes the model: destroy the optimizer before the wrapper (make it after)\n",
                   rank, held);
  }
  /// The process's list.
  static handed_out& instance() {
    static handed_out h;
    return h;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const void*, std::vector<torch::Tensor>> tensors_;
  std::unordered_map<const void*, std::vector<torch::Tensor>> more_;  // parameters(dp, groups)'s
};

}  // namespace detail::libtorch

/// One flat tensor per buffer this rank's optimizer steps (see this header's description), in step order; the
/// same tensors on every call for one wrapper.
template <class DP>
std::vector<torch::Tensor> parameters(DP& dp) {
  auto& handed = detail::libtorch::handed_out::instance();
  if (auto given = handed.find(&dp)) return *given;
  std::vector<torch::Tensor> out;
  for (const optim::flat_buffer& b : dp.owned_buffers()) {
    const auto options = torch::TensorOptions().dtype(detail::libtorch::scalar_type_of(b.values.type));
    const auto n = static_cast<std::int64_t>(b.values.size);
    torch::Tensor p = torch::from_blob(b.values.data, {n}, options).requires_grad_(true);
    p.mutable_grad() = torch::from_blob(b.grads.data, {n}, options);
    out.push_back(std::move(p));
  }
  handed.set(&dp, out);
  const int rank = dp.rank();
  dp.hold_until_destroyed(std::shared_ptr<void>(&dp, [rank](void* at) { detail::libtorch::handed_out::instance().wrapper_gone(at, rank); }));
  return out;
}

/// ddp::parameters(dp) cut into torch::optim parameter groups by `groups` (ddp::optim::sgd::group or
/// adamw::group: their names and matches; their settings are ddp's optimizers' and are not carried over). Entry 0
/// holds the pieces of the parameters no group takes, entry g the pieces of those groups[g − 1] takes: one flat
/// tensor per run of a group's elements in an owned block, so a group follows a parameter cut across ranks. The
/// entries have no options (the optimizer's defaults) until given some: `out[1].set_options(...)`. A group
/// matching no parameter of the model, or a parameter in two groups, is a ddp::config_error naming them.
template <class DP, class Group>
std::vector<torch::optim::OptimizerParamGroup> parameters(DP& dp, const std::vector<Group>& groups) {
  (void)parameters(dp);  // the wrapper copies the tensors still held when it goes
  const auto owned = dp.owned_buffers();
  const auto plan = optim::detail::plan_groups(owned, groups, "ddp::parameters");
  std::vector<std::vector<torch::Tensor>> members(groups.size() + 1);
  std::vector<torch::Tensor> all;
  for (std::size_t i = 0; i < owned.size(); ++i) {
    const auto options = torch::TensorOptions().dtype(detail::libtorch::scalar_type_of(owned[i].values.type));
    for (const auto& run : plan[i]) {
      if (run.numel == 0) continue;
      const auto n = static_cast<std::int64_t>(run.numel);
      const raw_tensor values = optim::detail::part(owned[i].values, run.offset, run.numel);
      const raw_tensor grads = optim::detail::part(owned[i].grads, run.offset, run.numel);
      torch::Tensor p = torch::from_blob(values.data, {n}, options).requires_grad_(true);
      p.mutable_grad() = torch::from_blob(grads.data, {n}, options);
      members[run.group].push_back(p);
      all.push_back(std::move(p));
    }
  }
  detail::libtorch::handed_out::instance().add(&dp, all);
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (auto& m : members) out.emplace_back(std::move(m));
  return out;
}

/// torch::optim optimizers: under the sharded policies every tensor they step must be one of ddp::parameters(dp).
template <class O>
  requires std::derived_from<O, torch::optim::Optimizer>
struct optim::optimizer_traits<O> {
  /// Throws ddp::config_error unless every tensor `opt` steps starts one of the `owned` buffers, or is a piece of
  /// one that ddp::parameters(dp, groups) gave; points each one's `.grad` at the same place of its buffer's gradients
  /// again where `opt.zero_grad()` dropped it (set_to_none, LibTorch's default) or replaced it (the replacement's
  /// values are kept).
  static void prepare(const O& opt, std::span<const optim::flat_buffer> owned, int rank) {
    for (const auto& group : opt.param_groups())
      for (const auto& p : group.params()) {
        const auto* at = static_cast<const std::byte*>(p.data_ptr());
        const bool piece = ddp::detail::libtorch::handed_out::instance().is_piece(p);
        const auto b = std::find_if(owned.begin(), owned.end(), [&](const optim::flat_buffer& f) {
          const auto* lo = static_cast<const std::byte*>(f.values.data);
          return lo == at || (piece && lo <= at && at + p.nbytes() <= lo + f.values.bytes());
        });
        if (b == owned.end())
          throw config_error("dp.step: under a sharded policy the torch::optim optimizer must step this rank's owned "
                             "blocks, the only memory that receives the averaged gradients, but it holds another "
                             "tensor (the model's parameters? those cannot be stepped: under full_shard they are "
                             "empty outside a unit's forward and backward); make it over ddp::parameters(dp)", rank);
        auto& g = p.mutable_grad();
        void* grads = static_cast<std::byte*>(b->grads.data) + (at - static_cast<const std::byte*>(b->values.data));
        if (g.defined() && g.data_ptr() == grads) continue;
        torch::NoGradGuard no_grad;
        torch::Tensor owned_grads = torch::from_blob(grads, p.sizes(), p.options().requires_grad(false));
        if (g.defined()) owned_grads.copy_(g);
        g = owned_grads;
      }
  }
};

}  // namespace ddp
