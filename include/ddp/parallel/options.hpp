#pragma once
/// \file ddp::data_parallel_options: the run-time settings of data_parallel.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ddp/parallel/grad_norm.hpp>
#include <ddp/parallel/loss_scaling.hpp>
#include <ddp/parallel/units.hpp>

namespace ddp {

/// How data_parallel keeps the model's buffers (model state of kind buffer: running statistics) alike on the ranks.
enum class buffer_sync : std::uint8_t {
  broadcast,     ///< rank 0's after construction and after every step (PyTorch DDP's broadcast_buffers=True)
  mean,          ///< rank 0's after construction; after every step the mean over the ranks (integers: rank 0's)
  construction,  ///< rank 0's after construction only (PyTorch DDP's broadcast_buffers=False)
  never,         ///< each rank keeps its own, also at construction
};

/// Run-time settings of data_parallel (the sharding policies carry their own: ddp::full_shard{...}).
struct data_parallel_options {
  /// Parameters that never receive a gradient (frozen or unused branches): they need not report; their
  /// gradients are left as the user keeps them (zero after zero_grad()) and are averaged like the others.
  std::vector<std::string> unused_parameters{};
  /// true: finish_gradients() throws ddp::error naming parameters that did not report; false: their
  /// gradients are reduced as they stand.
  bool error_on_missing = true;
  /// Copy rank 0's parameter values (trainable and frozen) to every rank at construction.
  bool broadcast_parameters = true;
  /// How buffers stay alike on the ranks (dp.sync_buffers() on demand); verify_in_sync compares them under
  /// broadcast and mean. Under a join scope the lowest rank still training is the source.
  buffer_sync buffers = buffer_sync::broadcast;
  /// replicate: after the first synchronized step, plan the buckets again in the order its gradients became
  /// ready (rank 0's, broadcast once), so later steps start them as early as the backward allows (PyTorch DDP
  /// rebuilds its buckets so by default); false keeps the buckets planned in reverse visit order.
  bool rebuild_buckets = true;
  /// Clip the gradients to clip.max_norm inside every step(), after they are averaged and before the optimizer
  /// (also in a join scope's shadow steps); 0: no clipping. dp.last_grad_norm() gives the step's norm.
  grad_clip clip{};
  /// Dynamic loss scaling for float16 (PyTorch's GradScaler), inside every step: multiply the loss by
  /// dp.loss_scale(); a step whose averaged gradients hold a NaN or an infinity on any rank is skipped on every rank.
  ddp::loss_scaling loss_scaling{};
  /// Run dp.verify_in_sync() (a collective) inside every verify_every-th step(), after the optimizer; 0: never.
  std::size_t verify_every = 0;
  /// The first step throws ddp::error when every averaged gradient is zero on every rank: the backward wrote no
  /// gradient ddp holds (a framework computing on memory ddp did not adopt, a loss detached from the model), so
  /// nothing would train while every check passed. false where a zero first step is meant.
  bool check_first_gradients = true;
  /// Sharding units, by dotted name prefix ("encoder.layers.0", "head") or by part of the model
  /// (ddp::unit_of(model.encoder), resolved to the prefix its parameters share): a parameter belongs to the
  /// longest listed prefix it starts with (the whole name or a leading run of its components); parameters no
  /// entry covers are grouped by unit_depth. An entry that covers no parameter is a ddp::config_error.
  unit_list units{};
  /// Sharding units of the parameters `units` does not cover: the first unit_depth components of the dotted
  /// name (1: the model's top-level fields, "fc1"; 2: "encoder.layer0", ...). Must be at least 1.
  std::size_t unit_depth = 1;
};

}  // namespace ddp
