# Locates NCCL (header nccl.h, library libnccl) under NCCL_ROOT, the CUDA Toolkit's root, /usr/local/cuda or
# the system's default paths, and makes the imported target NCCL::NCCL. Not a find module (Conan Center refuses
# packaged ones): ddp's own CMakeLists.txt and its packages include it. Sets ddp_NCCL_FOUND, and ddp_NCCL_VERSION
# when it is found.
set(_ddp_nccl_hints $ENV{NCCL_ROOT} ${NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} /usr/local/cuda)
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_ddp_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY nccl HINTS ${_ddp_nccl_hints} PATH_SUFFIXES lib64 lib)
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
unset(_ddp_nccl_hints)
set(ddp_NCCL_FOUND FALSE)
if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
  set(ddp_NCCL_FOUND TRUE)
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _ddp_nccl_version REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3"
         ddp_NCCL_VERSION "${_ddp_nccl_version}")
  unset(_ddp_nccl_version)
  if(NOT TARGET NCCL::NCCL)
    add_library(NCCL::NCCL UNKNOWN IMPORTED)
    set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                                INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
endif()
