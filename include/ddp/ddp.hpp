#pragma once
/// \file The one include users need. Backends that need a library (MPI, NCCL) are included when
/// their CMake target (ddp::mpi, ddp::nccl) defines DDP_WITH_MPI / DDP_WITH_NCCL.

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/parameter.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/visit.hpp>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/communicator.hpp>
#include <ddp/comm/env.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/work.hpp>

#include <ddp/parallel/policies.hpp>
