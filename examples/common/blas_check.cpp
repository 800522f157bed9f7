// Checks example::better_openblas_core on the cases that matter, then prints what OpenBLAS chose here and the
// advice, if any (ctest shows it): exit 1 when a case is wrong.
#include <cstdio>

#include "blas.hpp"

int main() {
  struct {
    const char* core;
    bool avx2, avx512;
    const char* want;
  } const cases[] = {{"Prescott", true, true, "SkylakeX"}, {"Prescott", true, false, "Haswell"},
                     {"Prescott", false, false, ""},       {"Sandybridge", true, false, "Haswell"},
                     {"Haswell", true, false, ""},          {"Haswell", true, true, ""},
                     {"SkylakeX", true, true, ""},          {"Zen", true, false, ""},
                     {"Core2", true, true, "SkylakeX"}};
  int wrong = 0;
  for (const auto& c : cases) {
    const std::string got = example::better_openblas_core(c.core, c.avx2, c.avx512);
    if (got != c.want) {
      std::printf("better_openblas_core(%s, avx2 %d, avx512 %d) = '%s', want '%s'\n", c.core, c.avx2, c.avx512,
                  got.c_str(), c.want);
      ++wrong;
    }
  }
  const std::string warning = example::blas_warning();
  std::printf("BLAS here: %s (kernel %s)%s%s\n", example::blas_description().c_str(), example::blas_core().c_str(),
              warning.empty() ? "" : "; ", warning.c_str());
  return wrong == 0 ? 0 : 1;
}
