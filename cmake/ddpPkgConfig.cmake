# pkg-config files for builds that do not use CMake (Make, Meson, a plain compiler command): ddp.pc (core, TCP
# backend, launcher API), and ddp-mpi.pc / ddp-nccl.pc when the install has those backends, carrying the flags
# CMake found for MPI, NCCL and the CUDA runtime. Relocatable (prefix from ${pcfiledir}); installed under
# <datadir>/pkgconfig since the library is header-only. Included by ddpInstall.cmake.
set(_ddp_pc_dir ${CMAKE_INSTALL_DATADIR}/pkgconfig)
string(REGEX REPLACE "[^/]+" ".." _ddp_pc_up "${_ddp_pc_dir}")

# Flags of an imported target's include directories, leaving out the compiler's own (/usr/include).
function(_ddp_pc_includes out)
  set(flags "")
  foreach(dir IN LISTS ARGN)
    if(dir AND NOT dir STREQUAL "/usr/include")
      string(APPEND flags " -I${dir}")
    endif()
  endforeach()
  set(${out} "${flags}" PARENT_SCOPE)
endfunction()

# Writes ddp<suffix>.pc with the given Requires, Cflags and Libs, and installs it.
function(_ddp_pc_file suffix description requires cflags libs)
  set(file ${PROJECT_BINARY_DIR}/pkgconfig/ddp${suffix}.pc)
  file(WRITE ${file} "prefix=\${pcfiledir}/${_ddp_pc_up}\nincludedir=\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}\n\n"
                     "Name: ddp${suffix}\nDescription: ${description}\nVersion: ${PROJECT_VERSION}\n"
                     "Requires: ${requires}\nCflags:${cflags}\nLibs:${libs}\n")
  install(FILES ${file} DESTINATION ${_ddp_pc_dir})
endfunction()

get_target_property(_ddp_json_dirs nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
_ddp_pc_includes(_ddp_json_flags ${_ddp_json_dirs})
_ddp_pc_file("" "${PROJECT_DESCRIPTION}: core, TCP backend, launcher API" ""
             " -std=c++20 -pthread -I\${includedir}${_ddp_json_flags}" " -pthread")

if(DDP_WITH_MPI)
  _ddp_pc_includes(_ddp_mpi_cflags ${MPI_C_INCLUDE_DIRS})
  foreach(option IN LISTS MPI_C_COMPILE_OPTIONS)
    string(APPEND _ddp_mpi_cflags " ${option}")
  endforeach()
  foreach(definition IN LISTS MPI_C_COMPILE_DEFINITIONS)
    string(APPEND _ddp_mpi_cflags " -D${definition}")
  endforeach()
  set(_ddp_mpi_libs "")
  foreach(item IN LISTS MPI_C_LINK_FLAGS MPI_C_LIBRARIES)
    string(APPEND _ddp_mpi_libs " ${item}")
  endforeach()
  _ddp_pc_file("-mpi" "ddp's MPI backend (ddp::mpi::communicator)" "ddp = ${PROJECT_VERSION}"
               " -DDDP_WITH_MPI=1${_ddp_mpi_cflags}" "${_ddp_mpi_libs}")
endif()

if(DDP_WITH_NCCL)
  _ddp_pc_includes(_ddp_nccl_cflags ${NCCL_INCLUDE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
  _ddp_pc_file("-nccl" "ddp's NCCL backend (ddp::nccl::communicator)" "ddp = ${PROJECT_VERSION}"
               " -DDDP_WITH_NCCL=1${_ddp_nccl_cflags}" " ${NCCL_LIBRARY} ${CUDA_cudart_LIBRARY}")
endif()
