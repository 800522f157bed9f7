#pragma once
/// \file Whether a launcher (ddp-launch, torchrun, mpirun, srun) started this process or it runs alone, and the job
/// it then describes.

#include <cstdlib>

#include <ddp/comm/env.hpp>

namespace example {

/// True when a launcher's WORLD_SIZE (or Open MPI's OMPI_COMM_WORLD_SIZE) is set.
inline bool launched() {
  return std::getenv("WORLD_SIZE") != nullptr || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
}

/// The launcher's description of this rank (ddp::read_env_config), or a job of one when none started it.
inline ddp::env_config job_env() { return launched() ? ddp::read_env_config() : ddp::env_config{}; }

}  // namespace example
