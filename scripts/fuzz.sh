#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang 14 with ASan and UBSan) and runs each for a bounded time,
# starting from its committed seeds (tests/fuzz/corpus/<name>/); new inputs go to the build tree only.
#
#   scripts/fuzz.sh                 # every target, 60 s each
#   scripts/fuzz.sh 300 store       # 300 s, only fuzz_store
#   scripts/fuzz.sh --record        # re-record tests/fuzz/corpus/store/ from a real rendezvous
#
# Exits non-zero when a target finds a crash (the reproducer is named in its output and kept in the build
# tree as crash-*). DDP_FUZZ_BUILD_DIR overrides the build directory (default build-fuzz).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${DDP_FUZZ_BUILD_DIR:-$root/build-fuzz}
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang-14 \
  -DCMAKE_CXX_COMPILER=clang++-14 "${launcher[@]}" -DDDP_BUILD_FUZZ=ON -DDDP_WITH_CUDA=OFF -DDDP_WITH_NCCL=OFF \
  -DDDP_WITH_MPI=OFF -DDDP_BUILD_EXAMPLES=OFF >/dev/null

if [[ "${1:-}" == "--record" ]]; then
  cmake --build "$build" -j2 --target record_store_corpus
  rm -f "$root"/tests/fuzz/corpus/store/rendezvous-*
  exec "$build/tests/fuzz/record_store_corpus" "$root/tests/fuzz/corpus/store"
fi

seconds=${1:-60}
shift || true
cmake --build "$build" -j2 --target ddp_fuzz
status=0
while read -r name executable corpus; do
  if [[ $# -gt 0 && " $* " != *" $name "* ]]; then continue; fi
  found="$build/fuzz-corpus/$name"
  mkdir -p "$found" "$build/fuzz-artifacts/$name"
  echo "== fuzz_$name for ${seconds} s (seeds: ${corpus#"$root"/})"
  "$executable" -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$name/" \
    "$found" "$corpus" || status=1
done <"$build/fuzz_targets.txt"
exit $status
