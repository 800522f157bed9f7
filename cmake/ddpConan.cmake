# The Conan package's last build module (packaging/conan/conanfile.py lists it after the modules of the options
# that take a backend from the system): ddp_WITH_MPI and ddp_WITH_NCCL say which components the package has, as
# in ddp's own CMake package, then find_package(ddp COMPONENTS ...) is honoured.
set(ddp_WITH_MPI FALSE)
if(TARGET ddp::mpi)
  set(ddp_WITH_MPI TRUE)
endif()
set(ddp_WITH_NCCL FALSE)
if(TARGET ddp::nccl)
  set(ddp_WITH_NCCL TRUE)
endif()
if(DEFINED ddp_FOUND AND NOT ddp_FOUND)
  return()
endif()
include("${CMAKE_CURRENT_LIST_DIR}/ddpComponents.cmake")
