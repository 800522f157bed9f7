# Finds the system libraries of the backends a ddp package was built with: MPI (C component) when
# ddp_WITH_MPI, the CUDA Toolkit and NCCL when ddp_WITH_NCCL. Included by ddpConfig.cmake before its targets
# and, in the Conan package, by ddpConan.cmake; a missing library sets ddp_FOUND to FALSE with the reason.
include(CMakeFindDependencyMacro)
if(ddp_WITH_MPI)
  get_property(_ddp_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
  if(NOT "C" IN_LIST _ddp_languages)
    enable_language(C)  # FindMPI's C component (the API ddp::mpi calls) needs it; call find_package(ddp) at file scope
  endif()
  unset(_ddp_languages)
  find_dependency(MPI COMPONENTS C)
endif()
if(ddp_WITH_NCCL)
  find_dependency(CUDAToolkit)
  set(_ddp_saved_module_path "${CMAKE_MODULE_PATH}")
  list(PREPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")  # the FindNCCL.cmake shipped with ddp
  find_dependency(NCCL)
  set(CMAKE_MODULE_PATH "${_ddp_saved_module_path}")
  unset(_ddp_saved_module_path)
endif()
