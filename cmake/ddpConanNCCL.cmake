# Conan, with_nccl=True: the system's NCCL and CUDA runtime behind ddp::nccl (Conan Center has no NCCL), found
# when the consumer configures. The recipe's package_info lists this build module for that option only.
include("${CMAKE_CURRENT_LIST_DIR}/ddpFindNCCL.cmake")
if(TARGET NCCL::NCCL AND TARGET CUDA::cudart)
  target_link_libraries(ddp::nccl INTERFACE NCCL::NCCL CUDA::cudart)
endif()
