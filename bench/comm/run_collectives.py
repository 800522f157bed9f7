#!/usr/bin/python3
"""Runs ddp_bench_collectives under mpirun at N = 2, 4, 8 and writes docs/bench/collectives.md
and docs/img/collectives.png (busbw and time against message size, ddp::tcp vs Gloo vs MPI_Allreduce).

usage: bench/comm/run_collectives.py BUILD_DIR [--ranks 2 4 8] [--max-bytes 67108864]
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(build, n, max_bytes):
    exe = os.path.join(build, "bench", "comm", "ddp_bench_collectives")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n), exe, "--csv", "--max-bytes", str(max_bytes)]
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("CSV,"):
            f = line.split(",")
            rows.append((int(f[2]),) + tuple(float(x) for x in f[3:11]))
    return cmd, rows


def busbw(n, size, t):
    return 2.0 * (n - 1) / n * size / t / 1e9


def human(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    args = ap.parse_args()

    load = os.getloadavg()[0]
    results = {n: run(args.build, n, args.max_bytes) for n in args.ranks}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = ["# Collectives benchmark: ddp::tcp vs Gloo vs MPI_Allreduce", ""]
    md += [f"f32 all_reduce(sum), median over iterations of the slowest rank's time; "
           f"busbw = bytes * 2(N-1)/N / time. Machine: {cpu_model()}, {os.cpu_count()} cores "
           f"(load average {load:.1f} when started: other jobs shared the cores), {date}. "
           "Ranks beyond the core count are oversubscribed. Gloo is Debian's libgloo over "
           "gloo::transport::tcp on 127.0.0.1, measured two ways: `gloo::allreduce(AllreduceOptions)` (the call "
           "PyTorch's ProcessGroupGloo makes) and a cached `gloo::AllreduceHalvingDoubling` (Gloo's fastest small-"
           "message path); ratios are against the better of the two. MPI is Open MPI's MPI_Allreduce over its "
           "shared-memory transport: a reference, not a TCP peer. CPU ms per op is rank 0's process CPU time "
           "(all threads) per iteration.", ""]
    md += ["Reproduce: `cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_BENCH=ON && "
           "cmake --build build --target ddp_bench_collectives && bench/comm/run_collectives.py build`", ""]
    md += ["![busbw and time](../img/collectives.png)", ""]
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 8), squeeze=False)
    for col, (n, (cmd, rows)) in enumerate(results.items()):
        md += [f"## N = {n}", "", f"`{' '.join(cmd[:-4] + ['build/bench/comm/ddp_bench_collectives'])}`", ""]
        md += ["| size | ddp µs | Gloo µs | Gloo HD µs | MPI µs | ddp GB/s | Gloo GB/s | Gloo HD GB/s | MPI GB/s "
               "| ddp / best Gloo busbw | ddp / best Gloo time | CPU ms per op: ddp / Gloo / Gloo HD |",
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for size, td, tg, th, tm, cd, cg, ch, _cm in rows:
            best = min(tg, th)
            md.append(f"| {human(size)} | {td * 1e6:.1f} | {tg * 1e6:.1f} | {th * 1e6:.1f} | {tm * 1e6:.1f} | "
                      f"{busbw(n, size, td):.2f} | {busbw(n, size, tg):.2f} | {busbw(n, size, th):.2f} | "
                      f"{busbw(n, size, tm):.2f} | {best / td:.2f}× | {td / best:.3f} | "
                      f"{cd * 1e3:.2f} / {cg * 1e3:.2f} / {ch * 1e3:.2f} |")
        md.append("")
        sizes = [r[0] for r in rows]
        for idx, (name, style) in enumerate([("ddp::tcp", "o-"), ("Gloo allreduce()", "s-"),
                                             ("Gloo halving-doubling", "d-"), ("MPI_Allreduce", "^--")]):
            times = [r[1 + idx] for r in rows]
            axes[0][col].plot(sizes, [busbw(n, s, t) for s, t in zip(sizes, times)], style, label=name)
            axes[1][col].plot(sizes, [t * 1e6 for t in times], style, label=name)
        axes[0][col].set_title(f"N = {n}: busbw (GB/s)")
        axes[1][col].set_title(f"N = {n}: time (µs)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message bytes")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        axes[1][col].set_yscale("log")
    fig.tight_layout()
    img = os.path.join(ROOT, "docs", "img", "collectives.png")
    os.makedirs(os.path.dirname(img), exist_ok=True)
    fig.savefig(img, dpi=90)
    out = os.path.join(ROOT, "docs", "bench", "collectives.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(md))
    print("wrote", out, "and", img)


if __name__ == "__main__":
    sys.exit(main())
