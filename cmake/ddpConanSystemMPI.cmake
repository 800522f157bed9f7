# Conan, with_mpi=system: the system's MPI behind ddp::mpi, found by CMake's FindMPI when the consumer configures.
# The recipe's package_info lists this build module for that option only, so nothing here guesses where MPI came
# from: a consumer that called find_package(MPI) first (the usual order in MPI codes) gets the same link.
include("${CMAKE_CURRENT_LIST_DIR}/ddpFindMPI.cmake")
if(TARGET MPI::MPI_C)
  target_link_libraries(ddp::mpi INTERFACE MPI::MPI_C)
endif()
