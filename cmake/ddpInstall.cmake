# Install rules and the CMake package: headers, the ddp::ddp (+ ddp::mpi, ddp::nccl) targets, the
# ddp-launch program (exported as ddp::launch), ddpConfig.cmake and ddpConfigVersion.cmake.
# Consumers: find_package(ddp 0.1 CONFIG REQUIRED [COMPONENTS mpi nccl]) (see docs/install.md).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DDP_INSTALL_CMAKEDIR ${CMAKE_INSTALL_DATADIR}/cmake/ddp
    CACHE STRING "Where ddpConfig.cmake is installed, relative to the prefix")

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ddp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

set(_ddp_exported ddp)
if(DDP_WITH_MPI)
  list(APPEND _ddp_exported ddp_mpi)
endif()
if(DDP_WITH_NCCL)
  list(APPEND _ddp_exported ddp_nccl)
endif()
if(TARGET ddp-launch)
  set_target_properties(ddp-launch PROPERTIES EXPORT_NAME launch)
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
set(_ddp_config_files ${PROJECT_BINARY_DIR}/ddpConfig.cmake ${PROJECT_BINARY_DIR}/ddpConfigVersion.cmake)
if(DDP_WITH_NCCL)
  list(APPEND _ddp_config_files ${CMAKE_CURRENT_LIST_DIR}/FindNCCL.cmake)
endif()
install(FILES ${_ddp_config_files} DESTINATION ${DDP_INSTALL_CMAKEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})
