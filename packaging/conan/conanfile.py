"""Conan 2 recipe for ddp, a C++20 header-only library (run from the repository root):

    conan create packaging/conan -o "ddp/*:with_mpi=True"

The package carries the headers; the targets ddp::ddp, ddp::mpi and ddp::nccl come from Conan's
CMakeDeps (find_package(ddp CONFIG REQUIRED)). NCCL and the CUDA runtime are taken from the system
(CUDA Toolkit with NCCL, e.g. under /usr/local/cuda), as Conan Center has no NCCL package.
"""

import os

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy
from conan.tools.layout import basic_layout

required_conan_version = ">=2.0"


class DdpConan(ConanFile):
    name = "ddp"
    version = "0.1.0"
    license = "MIT"
    description = "Data-parallel training (DDP/FSDP) for any C++ model: TCP, MPI and NCCL backends"
    topics = ("distributed", "data-parallel", "deep-learning", "mpi", "nccl", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {"with_mpi": [True, False], "with_nccl": [True, False]}
    default_options = {"with_mpi": False, "with_nccl": False}
    no_copy_source = True

    def export_sources(self):
        root = os.path.join(self.recipe_folder, "..", "..")
        copy(self, "include/*", src=root, dst=self.export_sources_folder)
        copy(self, "LICENSE", src=root, dst=self.export_sources_folder)

    def layout(self):
        basic_layout(self, src_folder=".")

    def requirements(self):
        self.requires("nlohmann_json/3.11.3")
        if self.options.with_mpi:
            self.requires("openmpi/4.1.6")

    def package_id(self):
        self.info.settings.clear()  # headers only; the options stay in the id (they change package_info)

    def validate(self):
        check_min_cppstd(self, 20)
        if self.settings.os != "Linux":
            raise ConanInvalidConfiguration("ddp needs POSIX sockets, fork and poll; it supports Linux")

    def package(self):
        copy(self, "*", src=os.path.join(self.source_folder, "include"),
             dst=os.path.join(self.package_folder, "include"))
        copy(self, "LICENSE", src=self.source_folder, dst=os.path.join(self.package_folder, "licenses"))

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "ddp")
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []

        core = self.cpp_info.components["core"]
        core.set_property("cmake_target_name", "ddp::ddp")
        core.requires = ["nlohmann_json::nlohmann_json"]
        core.system_libs = ["pthread"]
        core.bindirs = []
        core.libdirs = []

        if self.options.with_mpi:
            mpi = self.cpp_info.components["mpi"]
            mpi.set_property("cmake_target_name", "ddp::mpi")
            mpi.requires = ["core", "openmpi::openmpi"]
            mpi.defines = ["DDP_WITH_MPI=1"]
            mpi.bindirs = []
            mpi.libdirs = []

        if self.options.with_nccl:
            nccl = self.cpp_info.components["nccl"]
            nccl.set_property("cmake_target_name", "ddp::nccl")
            nccl.requires = ["core"]
            nccl.defines = ["DDP_WITH_NCCL=1"]
            cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
            nccl.includedirs = [os.path.join(cuda, "include")]
            nccl.libdirs = [os.path.join(cuda, "lib64")]
            nccl.system_libs = ["nccl", "cudart"]
            nccl.bindirs = []
