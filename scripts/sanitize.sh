#!/usr/bin/env bash
# Builds the multi-process suites (tcp, launch, parallel, checkpoint) with a sanitizer into their own
# build folder and runs them; exits non-zero on any failed test or sanitizer report (see docs/testing.md).
#
#   scripts/sanitize.sh [asan|tsan] [extra ctest arguments...]
#
#   asan   AddressSanitizer + UndefinedBehaviorSanitizer, -fno-sanitize-recover=all  -> build-asan/
#   tsan   ThreadSanitizer                                                           -> build-tsan/
#
# DDP_SANITIZE_LABELS (a ctest label regex, default "tcp|launch|parallel|checkpoint") picks the suites;
# DDP_SANITIZE_JOBS (default: nproc) the build and ctest parallelism; DDP_SANITIZE_TIMEOUT_SCALE (default 4 under
# asan, 5 under tsan) multiplies every test's ctest limit, as the instrumented code runs that much slower.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-asan}
shift || true
build=build-$kind
# While the tests run, every process (test, rank, launcher) writes its reports to reports/<tool>.<pid>:
# a report in a rank that a test expects to fail anyway still fails the run; each is printed at the end.
reports=$PWD/$build/reports
case "$kind" in
  asan)
    flags="-fsanitize=address,undefined -fno-sanitize-recover=all"
    scale=4
    run_env=(ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:check_initialization_order=1:log_path=$reports/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
             UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}")
    # Tests under mpirun: Open MPI keeps allocations until exit (scripts/sanitize/openmpi.lsan.supp says which);
    # its libraries lack frame pointers, so only the slow unwinder reaches the frames the suppressions name.
    mpi_env=(ASAN_OPTIONS="fast_unwind_on_malloc=0:halt_on_error=1:detect_leaks=1:log_path=$reports/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
             LSAN_OPTIONS="suppressions=$PWD/scripts/sanitize/openmpi.lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
             OMPI_MCA_mca_base_component_disable_dlclose=1
             "${run_env[1]}")
    ;;
  tsan)
    flags="-fsanitize=thread"
    scale=5
    # libstdc++'s exception_ptr counts its references where the sanitizer cannot see (libstdcxx.tsan.supp).
    run_env=(TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/sanitize/libstdcxx.tsan.supp:log_path=$reports/tsan${TSAN_OPTIONS:+:$TSAN_OPTIONS}")
    # Tests under mpirun: Open MPI's TCP transport orders two of its own locks both ways (openmpi.tsan.supp).
    mkdir -p "$build"
    cat scripts/sanitize/libstdcxx.tsan.supp scripts/sanitize/openmpi.tsan.supp >"$build/mpi.tsan.supp"
    mpi_env=(TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/$build/mpi.tsan.supp:log_path=$reports/tsan${TSAN_OPTIONS:+:$TSAN_OPTIONS}")
    ;;
  *)
    echo "sanitize.sh: unknown sanitizer '$kind'; use asan or tsan" >&2
    exit 2
    ;;
esac
labels=${DDP_SANITIZE_LABELS:-tcp|launch|parallel|checkpoint}
jobs=${DDP_SANITIZE_JOBS:-$(nproc)}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# -O1 -g keeps the run fast enough and the stacks readable; assertions stay on (no NDEBUG).
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE= "${launcher[@]}" \
  -DCMAKE_CXX_FLAGS="-O1 -g -fno-omit-frame-pointer $flags" \
  -DDDP_TEST_TIMEOUT_SCALE="${DDP_SANITIZE_TIMEOUT_SCALE:-$scale}" \
  -DDDP_WITH_CUDA=OFF -DDDP_WITH_NCCL=OFF -DDDP_BUILD_EXAMPLES=OFF
targets=()
[[ "tcp" =~ ^($labels)$ ]] && targets+=(ddp_tcp_tests)
[[ "launch" =~ ^($labels)$ ]] && targets+=(ddp_launch_tests ddp-launch)
[[ "parallel" =~ ^($labels)$ ]] && targets+=(ddp_parallel_tests ddp_parallel_mpi_tests)
[[ "checkpoint" =~ ^($labels)$ ]] && targets+=(ddp_checkpoint_tests)
if ((${#targets[@]} == 0)); then
  echo "sanitize.sh: DDP_SANITIZE_LABELS='$labels' names none of tcp, launch, parallel, checkpoint" >&2
  exit 2
fi
cmake --build "$build" -j "$jobs" --target "${targets[@]}"
# Every suite must have tests: a test discovery run that failed (a sanitizer report while listing the
# cases) leaves its executable with none.
found=0
for label in ${labels//|/ }; do
  count=$(ctest --test-dir "$build" -N -L "^$label\$" | sed -n 's/^Total Tests: //p')
  if [[ -z "$count" || "$count" == 0 ]]; then
    echo "sanitize.sh: ctest found no tests labelled '$label' in $build; did its test discovery fail? (see the build output above)" >&2
    exit 1
  fi
  found=$((found + count))
done
rm -rf "$reports" && mkdir -p "$reports"
# The tests the extra ctest arguments (-R ...) leave of those.
selected=$(ctest --test-dir "$build" -N -L "^($labels)\$" "$@" | sed -n 's/^Total Tests: //p')
echo "sanitize.sh: $kind: running $selected of the $found tests labelled '$labels'"
status=0
env "${run_env[@]}" ctest --test-dir "$build" --output-on-failure -j "$jobs" -L "^($labels)\$" -LE '^mpi$' "$@" || status=$?
if [[ -n "$(ctest --test-dir "$build" -N -L "^($labels)\$" -L '^mpi$' "$@" | sed -n 's/^Total Tests: [1-9].*/some/p')" ]]; then
  env "${mpi_env[@]}" ctest --test-dir "$build" --output-on-failure -j "$jobs" -L "^($labels)\$" -L '^mpi$' "$@" || status=$?
fi
shopt -s nullglob
logs=("$reports"/*)
for f in "${logs[@]}"; do
  echo "===== $f"
  cat "$f"
done
if ((${#logs[@]})); then
  echo "sanitize.sh: $kind: ${#logs[@]} process(es) wrote sanitizer reports (above, and in $reports)" >&2
  exit 1
fi
if ((status != 0)); then
  echo "sanitize.sh: $kind: ctest failed with status $status" >&2
  exit "$status"
fi
echo "sanitize.sh: $kind: all $selected tests run passed, no sanitizer reports"
