#pragma once
/// \file Which BLAS kernel the examples and benches run. OpenBLAS built with DYNAMIC_ARCH (Debian's) picks a kernel
/// for the CPU at start; on some virtual machines it falls back to an SSE3 one (Prescott) on a CPU with AVX2 or
/// AVX-512, and every matrix product then runs several times slower (the MLP bench's step: 84-95 ms against 34 on
/// a 16-core Xeon). The programs print the kernel and, where it is such a fallback, the fix.

#include <cblas.h>

#include <array>
#include <string>
#include <string_view>

namespace example {

/// The OPENBLAS_CORETYPE to ask for where OpenBLAS chose `core` on a CPU with (or without) AVX2 and AVX-512:
/// SkylakeX or Haswell where `core` uses less of the CPU than that, empty where it is the right one already.
inline std::string better_openblas_core(std::string_view core, bool avx2, bool avx512) {
  // The kernels of CPUs without AVX2 (Sandybridge has AVX only).
  static constexpr std::array<std::string_view, 12> below_avx2 = {
      "Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Katmai", "Coppermine", "Northwood", "Banias",
      "Generic", "Sandybridge"};
  bool generic = false;
  for (const auto name : below_avx2) generic = generic || core == name;
  if (!generic) return {};
  if (avx512) return "SkylakeX";
  if (avx2) return "Haswell";
  return {};
}

/// OpenBLAS's own line: version, build options and the kernel chosen ("OpenBLAS 0.3.21 ... Prescott ...").
inline std::string blas_description() { return openblas_get_config(); }

/// The kernel OpenBLAS chose ("Prescott", "SkylakeX").
inline std::string blas_core() { return openblas_get_corename(); }

/// The OPENBLAS_CORETYPE this CPU should run with, empty where OpenBLAS chose well (better_openblas_core).
inline std::string blas_better_core() {
  return better_openblas_core(blas_core(), __builtin_cpu_supports("avx2") != 0, __builtin_cpu_supports("avx512f") != 0);
}

/// A warning naming the fix where OpenBLAS fell back to a kernel below this CPU's; empty otherwise.
inline std::string blas_warning() {
  const std::string better = blas_better_core();
  if (better.empty()) return {};
  return "OpenBLAS chose its " + blas_core() + " kernel on a CPU with " +
         (better == "SkylakeX" ? "AVX-512" : "AVX2") + ": matrix products run several times slower than they could; " +
         "run with OPENBLAS_CORETYPE=" + better + " in the environment (ddp-launch and mpirun -x pass it on)";
}

}  // namespace example
