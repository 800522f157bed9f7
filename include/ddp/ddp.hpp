#pragma once
/// \file Training: models and parameters (core), communicators (comm), memory domains and staging device tensors
/// through the host (memory), the data_parallel wrapper and its policies (parallel), optimizers (optim), the
/// sampler and metric reduction (data); the TCP backend and ddp::local (ranks as threads of one process). Backends that need a
/// library (MPI, NCCL) are included when their CMake target (ddp::mpi, ddp::nccl) defines DDP_WITH_MPI /
/// DDP_WITH_NCCL. Checkpoints, logging and the launcher have their own umbrella headers:
/// <ddp/checkpoint.hpp>, <ddp/log.hpp>, <ddp/launch.hpp>.

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/parameter.hpp>
#include <ddp/core/state.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/trainable.hpp>
#include <ddp/core/visit.hpp>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/env.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/comm/local/run.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>

#include <ddp/parallel/policies.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include <ddp/optim/adamw.hpp>
#include <ddp/optim/sgd.hpp>

#include <ddp/nn/sync_batch_norm.hpp>

#include <ddp/data/distributed_sampler.hpp>
#include <ddp/data/metrics.hpp>

#if defined(DDP_WITH_MPI)
#include <ddp/comm/mpi/communicator.hpp>
#endif

#if defined(DDP_WITH_NCCL)
#include <ddp/comm/nccl/from_env.hpp>
#endif
