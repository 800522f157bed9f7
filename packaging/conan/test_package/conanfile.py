"""Builds and runs a consumer of the package: find_package(ddp CONFIG REQUIRED COMPONENTS launch [mpi] [nccl])."""

import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, cmake_layout


class DdpTestConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"
    generators = "CMakeDeps", "CMakeToolchain"

    def layout(self):
        cmake_layout(self)

    def requirements(self):
        self.requires(self.tested_reference_str)

    def build(self):
        options = self.dependencies[self.tested_reference_str.split("/")[0]].options
        components = ["launch"]
        if str(options.with_mpi) != "False":
            components.append("mpi")
        if str(options.with_nccl) == "True":
            components.append("nccl")
        cmake = CMake(self)
        cmake.configure(variables={"DDP_COMPONENTS": ";".join(components)})
        cmake.build()

    def test(self):
        if can_run(self):
            self.run(os.path.join(self.cpp.build.bindir, "test_package"), env="conanrun")
