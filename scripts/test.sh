#!/usr/bin/env bash
# Sets up a fresh Debian machine, builds everything and runs the test suite (GPU tests only where a GPU is).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export CUDACXX=/usr/local/cuda/bin/nvcc
build=${DDP_BUILD_DIR:-build}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$(nproc)"
labels=(-LE gpu)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then labels=(); fi
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "${labels[@]}"
