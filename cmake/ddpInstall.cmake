# Install rules and the CMake package: headers, the ddp::ddp and ddp::launch (+ ddp::mpi, ddp::nccl) targets,
# the ddp-launch program (exported as ddp::ddp-launch), ddpConfig.cmake, ddpConfigVersion.cmake and the
# modules they include. Consumers: find_package(ddp 0.1 CONFIG REQUIRED [COMPONENTS launch mpi nccl])
# (see docs/install.md); pkg-config files for other build systems: ddpPkgConfig.cmake.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DDP_INSTALL_CMAKEDIR ${CMAKE_INSTALL_DATADIR}/cmake/ddp
    CACHE STRING "Where ddpConfig.cmake is installed, relative to the prefix")

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ddp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

set(_ddp_exported ddp ddp_launch)
if(DDP_WITH_MPI)
  list(APPEND _ddp_exported ddp_mpi)
endif()
if(DDP_WITH_NCCL)
  list(APPEND _ddp_exported ddp_nccl)
endif()
if(TARGET ddp-launch)
  list(APPEND _ddp_exported ddp-launch)
endif()
install(TARGETS ${_ddp_exported} EXPORT ddpTargets
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT ddpTargets NAMESPACE ddp:: DESTINATION ${DDP_INSTALL_CMAKEDIR})

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/ddpConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/ddpConfig.cmake
                              INSTALL_DESTINATION ${DDP_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ddpConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/ddpConfig.cmake ${PROJECT_BINARY_DIR}/ddpConfigVersion.cmake
              ${CMAKE_CURRENT_LIST_DIR}/ddpFindMPI.cmake ${CMAKE_CURRENT_LIST_DIR}/ddpFindNCCL.cmake
              ${CMAKE_CURRENT_LIST_DIR}/ddpLocateNCCL.cmake ${CMAKE_CURRENT_LIST_DIR}/ddpComponents.cmake
        DESTINATION ${DDP_INSTALL_CMAKEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})
include(ddpPkgConfig)
