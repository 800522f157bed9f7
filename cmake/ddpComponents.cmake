# Honours find_package(ddp COMPONENTS ...): component X is found when the target ddp::X exists (launch:
# always; mpi and nccl: when the package was built with that backend). Included last by ddpConfig.cmake
# and, in the Conan package, by ddpConan.cmake.
foreach(_ddp_component IN LISTS ddp_FIND_COMPONENTS)
  if(TARGET ddp::${_ddp_component})
    set(ddp_${_ddp_component}_FOUND TRUE)
    continue()
  endif()
  set(ddp_${_ddp_component}_FOUND FALSE)
  if(NOT ddp_FIND_REQUIRED_${_ddp_component})
    continue()
  endif()
  set(ddp_FOUND FALSE)
  set(ddp_NOT_FOUND_MESSAGE "ddp at ${CMAKE_CURRENT_LIST_DIR} was built without the '${_ddp_component}' component; ")
  if(_ddp_component STREQUAL "mpi")
    string(APPEND ddp_NOT_FOUND_MESSAGE "rebuild it with -DDDP_WITH_MPI=ON (Conan: -o \"ddp/*:with_mpi=system\" or openmpi; vcpkg: ddp[mpi])")
  elseif(_ddp_component STREQUAL "nccl")
    string(APPEND ddp_NOT_FOUND_MESSAGE "rebuild it with -DDDP_WITH_CUDA=ON -DDDP_WITH_NCCL=ON "
                                        "(Conan: -o \"ddp/*:with_nccl=True\"; vcpkg: ddp[nccl])")
  else()
    set(ddp_NOT_FOUND_MESSAGE "ddp has no component '${_ddp_component}'; its components are launch, mpi and nccl")
  endif()
endforeach()
unset(_ddp_component)
