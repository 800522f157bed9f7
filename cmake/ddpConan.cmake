# The Conan package's CMake glue: Conan's CMakeDeps includes it (a cmake_build_modules entry of
# packaging/conan/conanfile.py) after it has made the ddp:: targets. It links what comes from the system
# rather than from Conan (with_mpi=system: the system's MPI, found by CMake's FindMPI; with_nccl: the CUDA Toolkit
# and NCCL), then honours find_package(ddp COMPONENTS ...).
set(ddp_WITH_MPI FALSE)
if(TARGET ddp::mpi AND NOT TARGET MPI::MPI_C)  # with_mpi=openmpi made MPI::MPI_C already
  set(ddp_WITH_MPI TRUE)
endif()
set(ddp_WITH_NCCL FALSE)
if(TARGET ddp::nccl)
  set(ddp_WITH_NCCL TRUE)
endif()
include("${CMAKE_CURRENT_LIST_DIR}/ddpFindBackends.cmake")
if(DEFINED ddp_FOUND AND NOT ddp_FOUND)
  return()
endif()
if(ddp_WITH_MPI)
  target_link_libraries(ddp::mpi INTERFACE MPI::MPI_C)
endif()
if(ddp_WITH_NCCL)
  target_link_libraries(ddp::nccl INTERFACE NCCL::NCCL CUDA::cudart)
endif()
include("${CMAKE_CURRENT_LIST_DIR}/ddpComponents.cmake")
