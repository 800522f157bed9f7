# Overlay port building the ddp checkout it lives in (see docs/install.md):
#   vcpkg install "ddp[mpi]" --overlay-ports=<checkout>/packaging/vcpkg/ports --binarysource=clear
# For a registry, replace SOURCE_PATH with vcpkg_from_github(OUT_SOURCE_PATH SOURCE_PATH REPO ... REF v${VERSION} ...).
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../../../.." ABSOLUTE)

set(VCPKG_BUILD_TYPE release)  # header-only library plus one program: no debug variant is needed

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    mpi  DDP_WITH_MPI
    nccl DDP_WITH_NCCL
    nccl DDP_WITH_CUDA
)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${FEATURE_OPTIONS}
    -DDDP_INSTALL=ON
    -DDDP_BUILD_LAUNCHER=ON
    -DDDP_BUILD_TESTS=OFF
    -DDDP_BUILD_EXAMPLES=OFF
    -DDDP_BUILD_BENCH=OFF
)
vcpkg_cmake_install()
# share/cmake/ddp -> share/ddp; the exported ddp::ddp-launch is pointed at tools/ddp/ddp-launch.
vcpkg_cmake_config_fixup(CONFIG_PATH share/cmake/ddp)
vcpkg_copy_tools(TOOL_NAMES ddp-launch AUTO_CLEAN)
vcpkg_fixup_pkgconfig()  # share/pkgconfig/ddp*.pc (header-only: not under lib)

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/share/doc")  # the LICENSE copy of ddp's install rules: copyright below
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
