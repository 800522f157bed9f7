#!/bin/bash
# Runs, on the lent GPU machine, what scripts/device/pack.sh packed: the steps named (default: all, in this order),
# each bounded, with an inventory first. Results and log.txt go to RESULTS.
#
#   checks.sh device.tar.xz RESULTS [inventory] [gpu-tests] [gpu-dp] [example] [gpu-step] [cpu-step] [cpu-epoch]
#
# gpu-tests: kernels, CUDA domain, NCCL conformance at np 2 and 3; gpu-dp: data_parallel over NCCL at np 1-3;
# example: cuda_fashion_mnist alone and at 2 ranks sharing the GPU; gpu-step: bench/gpu/run_step_gpu.py; cpu-step:
# bench/parallel/run_data_parallel.py at N = 1, 2, 4, 8 with OpenBLAS's SkylakeX kernel; cpu-epoch: the
# Fashion-MNIST epoch against PyTorch. Ranks sharing the GPU get NCCL_HOSTID=rank$R.
OUT=$(mkdir -p "$2" && cd "$2" && pwd); exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
K=$(mktemp -d) && tar xJf "$1" -C "$K" && B=$K/build
shift 2; steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(inventory gpu-tests gpu-dp example gpu-step cpu-step cpu-epoch)
NCCL=$(dirname "$(find / -name 'libnccl.so.2' -not -path '/proc/*' 2>/dev/null | head -1)")
CUBLAS=$(dirname "$(find / -name 'libcublas.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
if ! command -v mpirun >/dev/null; then  # Debian's Open MPI from the pack, at its own paths (nothing overwritten)
  cp -rn "$K"/ompi/usr/lib/x86_64-linux-gnu/. /usr/lib/x86_64-linux-gnu/
  cp -rn "$K"/ompi/usr/share/openmpi /usr/share/; cp -rn "$K"/ompi/etc/openmpi /etc/
  mkdir -p "$K/mpibin"; cp "$K"/ompi/usr/bin/* "$K/mpibin/"; ln -sf orterun "$K/mpibin/mpirun"; export PATH=$K/mpibin:$PATH
  export LD_LIBRARY_PATH=$K/lib:$NCCL:$CUBLAS:/usr/lib/x86_64-linux-gnu/pmix2/lib
else  # the machine's own Open MPI (same ABI): drop the packed copies of its libraries
  rm -f "$K"/lib/libmpi* "$K"/lib/libopen-* "$K"/lib/libpmix* "$K"/lib/libmca_common* "$K"/lib/libhwloc* "$K"/lib/libevent*
  export LD_LIBRARY_PATH=$K/lib:$NCCL:$CUBLAS
fi
export OMPI_MCA_mca_base_component_show_load_errors=0 OMPI_MCA_btl=self,vader OPENBLAS_CORETYPE=SkylakeX
MPI=(mpirun --allow-run-as-root --oversubscribe -x LD_LIBRARY_PATH -x NCCL_DEBUG)
SHARED=(sh -c 'NCCL_HOSTID=rank$RANK$OMPI_COMM_WORLD_RANK exec "$0" "$@"')  # a rank of several on one GPU
for step in "${steps[@]}"; do
  stamp "$step"
  case $step in
    inventory)
      nvidia-smi -L; nproc; grep -m1 "model name" /proc/cpuinfo; head -2 /etc/os-release; uptime
      echo "nccl: $NCCL cublas: $CUBLAS"; mpirun --version | head -1
      python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" ;;
    gpu-tests)
      timeout 60 "$B"/tests/gpu/ddp_gpu_kernel_tests 2>&1 | tail -3
      timeout 60 "$B"/tests/gpu/ddp_gpu_domain_tests 2>&1 | tail -3
      for np in 2 3; do timeout 90 "${MPI[@]}" -np $np "${SHARED[@]}" "$B"/tests/gpu/ddp_gpu_nccl_tests 2>&1 | grep -v "^$" | tail -6; done ;;
    gpu-dp)
      for np in 1 2 3; do timeout 150 "${MPI[@]}" -np $np "${SHARED[@]}" "$B"/tests/gpu/ddp_gpu_data_parallel_tests 2>&1 | grep -v "^$" | tail -12; done ;;
    example)
      cd "$K" && timeout 60 "$B"/examples/cuda_fashion_mnist --epochs 1 --no-progress --data "$K/data" --checkpoint "$K/c1.st" 2>&1 | tail -4
      cd "$K" && timeout 90 "$B"/tools/ddp-launch -n 2 "${SHARED[@]}" "$B"/examples/cuda_fashion_mnist --epochs 3 --min-accuracy 0.85 \
        --no-progress --policy full_shard --data "$K/data" --checkpoint "$K/c2.st" 2>&1 | tail -6 ;;
    gpu-step)
      cd "$K" && timeout 240 python3 bench/gpu/run_step_gpu.py --build "$B" --rounds 3 --out "$OUT/gpu_step.md" 2>&1 | tail -20 ;;
    cpu-step)
      cd "$K" && PYTHONUNBUFFERED=1 timeout 240 python3 bench/parallel/run_data_parallel.py --build "$B" --rounds 2 \
        --worlds 1,2,4,8 --impls "ddp tcp,ddp mpi,pytorch,ddp solo" --python python3 \
        --out "$OUT/data_parallel.md" --plot "$OUT/data_parallel.png" 2>&1 | tail -40 ;;
    cpu-epoch)
      cd "$K" && timeout 200 python3 bench/fashion_mnist/run_epoch.py --build "$B" --ranks 1 2 4 8 --rounds 1 \
        --python python3 --data "$K/data" --out "$OUT/fashion_mnist_epoch.md" 2>&1 | tail -20 ;;
    *) echo "checks.sh: unknown step '$step'" ;;
  esac
done
stamp done
