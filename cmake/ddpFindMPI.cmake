# Finds the system's MPI (C component, the API ddp::mpi calls) for a ddp package built with the MPI backend.
# Included by ddpConfig.cmake before its targets and by ddpConanSystemMPI.cmake; a missing MPI sets ddp_FOUND to
# FALSE with the reason (find_dependency).
include(CMakeFindDependencyMacro)
get_property(_ddp_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
if(NOT "C" IN_LIST _ddp_languages)
  enable_language(C)  # FindMPI's C component needs it; call find_package(ddp) at file scope
endif()
unset(_ddp_languages)
find_dependency(MPI COMPONENTS C)
