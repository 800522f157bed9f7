#!/bin/bash
# Packs what the lent GPU machine runs but cannot build (it has no Catch2, no OpenBLAS, no nlohmann-json): the GPU
# tests, the GPU example and step bench, the 16-core CPU benches and their drivers, and every shared library they
# need beyond glibc, libstdc++, zlib, NCCL and cuBLAS (that machine has PyTorch's), with Debian's Open MPI tree as a
# fallback, into OUT/device.tar.xz (about 45 MB with Fashion-MNIST). checks.sh beside this file runs it there.
#
#   scripts/device/pack.sh BUILD OUT        BUILD: a Release build with -DDDP_BUILD_BENCH=ON of the targets below
set -euo pipefail
B=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); SRC=$(cd "$(dirname "$0")/../.." && pwd)
K=$(mktemp -d); trap 'rm -rf "$K"' EXIT
binaries=(tools/ddp-launch tests/gpu/ddp_gpu_kernel_tests tests/gpu/ddp_gpu_domain_tests tests/gpu/ddp_gpu_nccl_tests
          tests/gpu/ddp_gpu_data_parallel_tests examples/cuda_fashion_mnist examples/fashion_mnist
          bench/gpu/ddp_bench_gpu_kernels bench/gpu/dp_step_gpu bench/parallel/dp_step_bench
          bench/comm/ddp_bench_collectives)
for b in "${binaries[@]}"; do
  [ -x "$B/$b" ] || { echo "pack.sh: $B/$b is missing; build it first (cmake --build $B --target $(basename "$b"))" >&2; exit 1; }
  mkdir -p "$K/build/$(dirname "$b")"; cp "$B/$b" "$K/build/$b"; strip "$K/build/$b" 2>/dev/null || true
done
mkdir -p "$K/bench" "$K/lib" "$K/ompi"
(cd "$SRC/bench" && cp --parents ./*.py gpu/*.py parallel/*.py comm/run_collectives.py fashion_mnist/*.py "$K/bench/")
L=/usr/lib/x86_64-linux-gnu; O="$K/ompi"
mkdir -p "$O$L/pmix2/lib" "$O/usr/share" "$O/etc" "$O/usr/bin"
cp -a $L/openmpi "$O$L/"; rm -rf "$O$L/openmpi/include"
cp -a $L/pmix2/lib/libpmix.so* $L/pmix2/lib/pmix "$O$L/pmix2/lib/"
cp -a /usr/share/openmpi "$O/usr/share/"; cp -a /etc/openmpi "$O/etc/"; cp -a /usr/bin/orterun /usr/bin/orted "$O/usr/bin/"
(cd "$O$L/openmpi/lib/openmpi3" && rm -f ./*ucx* ./*ofi* ./*psm* ./*usnic* mca_btl_openib.so)
{ for f in $(find "$K/build" -type f) "$O$L"/openmpi/lib/openmpi3/*.so "$O"/usr/bin/*; do ldd "$f" 2>/dev/null; done; } |
  awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -v -E "/(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s|libz|libudev|libnccl|libresolv|libutil|libfabric|libuc[mpst]|liboshmem|libpsm|libinfinipath|libefa|librdmacm|libcuda|libcublas|libcublasLt)[.-]" |
  while read -r l; do cp -L "$l" "$K/lib/"; done
cp -r /usr/share/datasets/fashion-mnist "$K/data"  # the examples' data (30 MB, gzipped already)
cp "$SRC/scripts/device/checks.sh" "$K/"
(cd "$K" && tar cf - . | xz -T2 -6 > "$OUT/device.tar.xz"); ls -la "$OUT/device.tar.xz"
