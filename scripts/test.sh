#!/usr/bin/env bash
# The test suite in two tiers (docs/testing.md). Both set up a fresh Debian machine first (scripts/setup.sh).
#
#   scripts/test.sh          the fast tier: builds only the executables it needs (target ddp_fast_tests) and runs
#                            the tests labelled fast: unit tests, the step's state machine, one-process engine
#                            cases, conformance at N <= 2, compile-fail sentences, the lints. LibTorch is optional.
#   scripts/test.sh --full   what CI runs (.ci/run): the fast tier, then everything built and the tests labelled
#                            slow (LibTorch required), then the tcp and checkpoint suites under AddressSanitizer+UBSan
#                            (scripts/sanitize.sh, build-asan/), the tcp suite under ThreadSanitizer (build-tsan/) and
#                            every libFuzzer target for 60 s (scripts/fuzz.sh, build-fuzz/). DDP_TEST_SANITIZE=0
#                            stops after the slow tier.
#
# GPU tests run only where nvidia-smi sees a GPU. DDP_BUILD_DIR picks the build folder (default build/).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=fast
case "${1:-}" in
  "") ;;
  --full) tier=full ;;
  *)
    echo "test.sh: unknown argument '$1'; run 'scripts/test.sh' (the fast tier) or 'scripts/test.sh --full'" >&2
    exit 2
    ;;
esac
sanitize=${DDP_TEST_SANITIZE:-1}
if [[ "$sanitize" != 0 && "$sanitize" != 1 ]]; then
  echo "test.sh: DDP_TEST_SANITIZE is '$sanitize'; use 1 (the default) or 0 to skip the sanitizer and fuzz passes" >&2
  exit 2
fi
started=$SECONDS
bash scripts/setup.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export CUDACXX=/usr/local/cuda/bin/nvcc
build=${DDP_BUILD_DIR:-build}
require_torch=OFF
[[ "$tier" == full ]] && require_torch=ON
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDP_TESTS_REQUIRE_LIBTORCH="$require_torch"
gpu=(-LE gpu)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=(); fi

# ctest_tier LABEL: runs the tests of one tier; fails when it has none (a discovery that went wrong).
ctest_tier() {
  local count
  count=$(ctest --test-dir "$build" -N -L "^$1\$" "${gpu[@]}" | sed -n 's/^Total Tests: //p')
  if [[ -z "$count" || "$count" == 0 ]]; then
    echo "test.sh: ctest found no tests labelled '$1' in $build; did a test discovery fail? (see the build above)" >&2
    exit 1
  fi
  ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -L "^$1\$" "${gpu[@]}"
}

# check_tiers: every test carries the label fast or slow (an executable not built yet shows as one _NOT_BUILT entry).
check_tiers() {
  local untiered
  untiered=$(ctest --test-dir "$build" -N -LE '^(fast|slow)$' | sed -n 's/^ *Test *#[0-9]*: //p' | grep -v '_NOT_BUILT-' || true)
  if [[ -n "$untiered" ]]; then
    echo "test.sh: these tests carry neither the label fast nor slow; give them one (docs/testing.md):" >&2
    echo "$untiered" >&2
    exit 1
  fi
}

cmake --build "$build" -j "$(nproc)" --target ddp_fast_tests
check_tiers
ctest_tier fast
echo "test.sh: the fast tier passed in $((SECONDS - started)) s"
[[ "$tier" == fast ]] && exit 0

cmake --build "$build" -j "$(nproc)"
check_tiers
ctest_tier slow
echo "test.sh: both tiers passed, $((SECONDS - started)) s so far"
if [[ "$sanitize" == 0 ]]; then
  echo "test.sh: DDP_TEST_SANITIZE=0: the ASan+UBSan, TSan and fuzz passes are skipped"
  exit 0
fi
DDP_SANITIZE_LABELS='tcp|checkpoint' bash scripts/sanitize.sh asan
DDP_SANITIZE_LABELS='tcp' bash scripts/sanitize.sh tsan
bash scripts/fuzz.sh 60
echo "test.sh: the full run passed in $((SECONDS - started)) s"
