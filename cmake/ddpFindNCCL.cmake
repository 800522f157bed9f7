# Finds the CUDA Toolkit and NCCL for a ddp package built with the NCCL backend. Included by ddpConfig.cmake
# before its targets and by ddpConanNCCL.cmake; a missing library sets ddp_FOUND to FALSE with the reason.
include(CMakeFindDependencyMacro)
find_dependency(CUDAToolkit)
include("${CMAKE_CURRENT_LIST_DIR}/ddpLocateNCCL.cmake")
if(NOT ddp_NCCL_FOUND)
  set(ddp_FOUND FALSE)
  set(ddp_NOT_FOUND_MESSAGE "ddp's nccl component needs NCCL: no nccl.h and libnccl under NCCL_ROOT, the CUDA "
                            "Toolkit or /usr/local/cuda; install NCCL or set NCCL_ROOT to its prefix")
endif()
