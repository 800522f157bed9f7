"""Conan 2 recipe for ddp, a C++20 header-only library (from the repository root; see docs/install.md):

    conan create packaging/conan -s compiler.cppstd=gnu20 -o "ddp/*:with_mpi=system"

One package serves every option combination (header-only: package_id clears settings and options). The
options only shape package_info: the targets ddp::ddp (core + TCP backend), ddp::launch (the launcher API)
and, when asked for, ddp::mpi and ddp::nccl, as components of find_package(ddp CONFIG REQUIRED). MPI comes
from Conan (with_mpi=openmpi) or from the system (with_mpi=system); NCCL and the CUDA runtime come from the
system's CUDA Toolkit (Conan Center has no NCCL). What comes from the system is found twice over: for CMake
consumers by build modules listed for that option only (CMake's FindMPI, CUDAToolkit and ddp's NCCL lookup when
the consumer configures), for PkgConfigDeps and other generators by the component's flags, read from the
system's pkg-config files (MPI) or the NCCL prefix when the consumer installs.
"""

import os

from conan import ConanFile
from conan.errors import ConanException, ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy
from conan.tools.gnu import PkgConfig
from conan.tools.layout import basic_layout
from conan.tools.scm import Version

required_conan_version = ">=2.0.9"


class DdpConan(ConanFile):
    name = "ddp"
    version = "0.1.0"
    license = "MIT"
    description = "Data-parallel training (DDP/FSDP) for any C++ model: TCP, MPI and NCCL backends"
    topics = ("distributed", "data-parallel", "deep-learning", "mpi", "nccl", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {"with_mpi": [False, "openmpi", "system"], "with_nccl": [True, False]}
    default_options = {"with_mpi": False, "with_nccl": False}
    no_copy_source = True

    _cmake_modules = ("ddpConan.cmake", "ddpConanSystemMPI.cmake", "ddpConanNCCL.cmake", "ddpFindMPI.cmake",
                      "ddpFindNCCL.cmake", "ddpLocateNCCL.cmake", "ddpComponents.cmake")

    def export_sources(self):
        root = os.path.join(self.recipe_folder, "..", "..")
        copy(self, "include/*", src=root, dst=self.export_sources_folder)
        copy(self, "LICENSE", src=root, dst=self.export_sources_folder)
        for module in self._cmake_modules:
            copy(self, module, src=os.path.join(root, "cmake"), dst=os.path.join(self.export_sources_folder, "cmake"))

    def layout(self):
        basic_layout(self, src_folder=".")

    def requirements(self):
        self.requires("nlohmann_json/3.11.3", transitive_headers=True)
        if self.options.with_mpi == "openmpi":
            self.requires("openmpi/4.1.6", transitive_headers=True, transitive_libs=True)

    def package_id(self):
        self.info.clear()

    def validate(self):
        if self.settings.os != "Linux":
            raise ConanInvalidConfiguration(f"{self.ref} needs POSIX sockets, fork and poll; it supports Linux")
        if self.settings.compiler.get_safe("cppstd"):
            try:
                check_min_cppstd(self, 20)
            except ConanInvalidConfiguration as e:
                raise ConanInvalidConfiguration(
                    f"{e} Add -s compiler.cppstd=gnu20 to the command, or set compiler.cppstd=gnu20 in the "
                    "profile (conan profile detect writes gnu17).") from e
        if self.settings.compiler == "gcc" and Version(self.settings.compiler.version) < "12":
            raise ConanInvalidConfiguration(f"{self.ref} needs g++ 12 or newer")
        if self.options.with_nccl and self._nccl_header() is None:
            raise ConanInvalidConfiguration(
                "with_nccl takes NCCL from the system, and no nccl.h was found under NCCL_ROOT, CUDA_HOME, "
                "CUDA_PATH, /usr/local/cuda or /usr; install NCCL or set NCCL_ROOT to its prefix")

    @staticmethod
    def _nccl_header():
        """The system's nccl.h, where ddpLocateNCCL.cmake looks for it (and /usr, a distribution's package), or None."""
        roots = [os.environ.get(v) for v in ("NCCL_ROOT", "CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda", "/usr"]
        headers = (os.path.join(root, "include", "nccl.h") for root in roots if root)
        return next((header for header in headers if os.path.isfile(header)), None)

    def package(self):
        copy(self, "*", src=os.path.join(self.source_folder, "include"),
             dst=os.path.join(self.package_folder, "include"))
        copy(self, "*.cmake", src=os.path.join(self.source_folder, "cmake"),
             dst=os.path.join(self.package_folder, "lib", "cmake", "ddp"))
        copy(self, "LICENSE", src=self.source_folder, dst=os.path.join(self.package_folder, "licenses"))

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "ddp")
        # The aggregate of all components; ddp::ddp is the core component alone, as in ddp's own CMake package.
        self.cpp_info.set_property("cmake_target_name", "ddp::all")
        # The options that take a backend from the system add their build module; ddpConan.cmake comes last.
        modules = (["ddpConanSystemMPI.cmake"] if self.options.with_mpi == "system" else []) + \
                  (["ddpConanNCCL.cmake"] if self.options.with_nccl else []) + ["ddpConan.cmake"]
        self.cpp_info.set_property("cmake_build_modules", [os.path.join("lib", "cmake", "ddp", m) for m in modules])
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []

        def component(name, target, requires, defines=()):
            c = self.cpp_info.components[name]
            c.set_property("cmake_target_name", target)
            c.requires = list(requires)
            c.defines = list(defines)
            c.bindirs = []
            c.libdirs = []
            return c

        core = component("core", "ddp::ddp", ["nlohmann_json::nlohmann_json"])
        core.system_libs = ["pthread"]
        component("launch", "ddp::launch", ["core"])
        if self.options.with_mpi == "openmpi":
            component("mpi", "ddp::mpi", ["core", "openmpi::openmpi"], ["DDP_WITH_MPI=1"])
        elif self.options.with_mpi == "system":
            mpi = component("mpi", "ddp::mpi", ["core"], ["DDP_WITH_MPI=1"])  # CMake: ddpConanSystemMPI.cmake
            self._system_mpi_flags(mpi)
        if self.options.with_nccl:
            nccl = component("nccl", "ddp::nccl", ["core"], ["DDP_WITH_NCCL=1"])  # CMake: ddpConanNCCL.cmake
            self._system_nccl_flags(nccl)

    def _system_mpi_flags(self, component):
        """The system MPI's compile and link flags from its pkg-config file (Open MPI's mpi-c.pc, MPICH's
        mpich.pc), for generators other than CMakeDeps; says so where neither is there."""
        for name in ("mpi-c", "ompi-c", "mpich"):
            try:
                PkgConfig(self, name).fill_cpp_info(component, is_system=True)
                return
            except ConanException:
                continue
        self.output.warning("with_mpi=system: no pkg-config file of the system's MPI (mpi-c, ompi-c, mpich) was "
                            "found, so ddp-mpi.pc carries no MPI flags; CMake consumers are not affected "
                            "(FindMPI runs when they configure)")

    def _system_nccl_flags(self, component):
        """NCCL's and the CUDA runtime's flags from the prefix validate() found, for generators other than
        CMakeDeps (the system's default directories are left out)."""
        root = os.path.dirname(os.path.dirname(self._nccl_header()))
        if root != "/usr":
            component.includedirs = [os.path.join(root, "include")]
            component.libdirs = [d for d in (os.path.join(root, "lib64"), os.path.join(root, "lib")) if os.path.isdir(d)]
        component.system_libs = ["nccl", "cudart"]
