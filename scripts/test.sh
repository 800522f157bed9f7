#!/usr/bin/env bash
# Sets up a fresh Debian machine, builds everything and runs the test suite (GPU tests only where a GPU is),
# then the hardening passes CI runs too: the tcp and checkpoint suites under AddressSanitizer+UBSan
# (scripts/sanitize.sh, build-asan/), the tcp suite (the engine's threads) under ThreadSanitizer (build-tsan/)
# and every libFuzzer target for 60 s (scripts/fuzz.sh, build-fuzz/). DDP_TEST_SANITIZE=0 stops after the
# regular suite.
set -euo pipefail
cd "$(dirname "$0")/.."
sanitize=${DDP_TEST_SANITIZE:-1}
if [[ "$sanitize" != 0 && "$sanitize" != 1 ]]; then
  echo "test.sh: DDP_TEST_SANITIZE is '$sanitize'; use 1 (the default) or 0 to skip the sanitizer and fuzz passes" >&2
  exit 2
fi
bash scripts/setup.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export CUDACXX=/usr/local/cuda/bin/nvcc
build=${DDP_BUILD_DIR:-build}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$(nproc)"
labels=(-LE gpu)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then labels=(); fi
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "${labels[@]}"
if [[ "$sanitize" == 0 ]]; then
  echo "test.sh: DDP_TEST_SANITIZE=0: the ASan+UBSan, TSan and fuzz passes are skipped"
  exit 0
fi
DDP_SANITIZE_LABELS='tcp|checkpoint' bash scripts/sanitize.sh asan
DDP_SANITIZE_LABELS='tcp' bash scripts/sanitize.sh tsan
bash scripts/fuzz.sh 60
