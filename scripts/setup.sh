#!/usr/bin/env bash
# Installs every Debian package ddp's build, tests, examples and benchmarks need. Idempotent; run as root.
set -euo pipefail
packages=(
  build-essential cmake python3 pkg-config
  catch2 nlohmann-json3-dev zlib1g-dev           # tests, checkpoints, reading gzip'd IDX files
  libopenmpi-dev openmpi-bin                     # the MPI backend
  dataset-fashion-mnist libopenblas-dev          # the examples: data, and BLAS for the MLP GEMMs
  libeigen3-dev                                  # the Eigen adapter's tests, example and bench
  libgloo-dev python3-torch python3-numpy python3-matplotlib  # benchmarks' anchors, checkpoint interop, plots
  libtorch-dev                                   # the LibTorch adapter: its tests, example and bench
  clang-14 libclang-rt-14-dev                    # scripts/fuzz.sh: libFuzzer with ASan and UBSan
)
export DEBIAN_FRONTEND=noninteractive
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"
fi
echo "setup: all ${#packages[@]} packages present"
