"""Driver: step time of ddp::data_parallel (over TCP and over MPI) and of PyTorch DDP (gloo) on the same MLP
784-2048-2048-10, batch 64 per rank, one thread per rank, at N = 1, 2, 4 ranks, in one run; rounds interleave the
implementations so machine load drifts hit all of them alike. Writes docs/bench/data_parallel.md and the plot.

usage: /usr/bin/python3 bench/parallel/run_data_parallel.py --build build [--rounds 3] [--steps 20] [--worlds 1,2,4]
       [--python /usr/bin/python3] [--blas-core auto|as-is|NAME]
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for machine.py
import machine  # noqa: E402
from ranks import free_port, last_json, slowest_alone, spawn_env_ranks  # noqa: E402


def run_one(impl, n, a):
    """impl: "ddp tcp", "ddp mpi", "ddp solo" or "pytorch"; a ddp name may end in " b4" or " b1" for 4 or 1 MiB
    buckets instead of 25."""
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--batch", str(a.batch)]
    exe = os.path.join(a.build, "bench", "parallel", "dp_step_bench")
    if impl.startswith("ddp") and impl.split()[-1] in ("b4", "b1"):
        common += ["--bucket-mib", impl.split()[-1][1:]]
        impl = impl.rsplit(" ", 1)[0]
    if impl == "ddp tcp":
        return last_json(spawn_env_ranks([exe, "--backend", "tcp"] + common, n, a.timeout))
    if impl == "ddp solo":  # N independent single-rank jobs at once: the cost of sharing the cores, no communication
        return slowest_alone([exe, "--backend", "tcp"] + common, n, a.timeout, lambda _: dict(
            os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
            OPENBLAS_NUM_THREADS="1"))
    if impl == "ddp mpi":
        coretype = ["-x", "OPENBLAS_CORETYPE"] if "OPENBLAS_CORETYPE" in os.environ else []
        out = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n), "-x",
                              "OPENBLAS_NUM_THREADS=1"] + coretype + [exe, "--backend", "mpi"] + common,
                             capture_output=True, text=True, timeout=a.timeout, check=True).stdout
        return last_json(out)
    return last_json(spawn_env_ranks([a.python, os.path.join(HERE, "torch_ddp_step.py")] + common, n,
                                     a.timeout))


def choose_blas_kernel(a):
    """Runs dp_step_bench once at N = 1 to learn OpenBLAS's kernel; with --blas-core auto, where it is a fallback below
    this CPU (an SSE kernel on a CPU with AVX2 or AVX-512), every run of the round gets OPENBLAS_CORETYPE set to the
    kernel the CPU has. Returns the line the report gives the BLAS."""
    exe = os.path.join(a.build, "bench", "parallel", "dp_step_bench")
    probe = last_json(spawn_env_ranks([exe, "--steps", "1", "--warmup", "0", "--batch", "8"], 1, a.timeout))
    chosen, better = probe.get("blas_core", "?"), probe.get("blas_better_core", "")
    if a.blas_core == "as-is" or not better:
        return "OpenBLAS %s kernel, as OpenBLAS chose it%s" % (
            chosen, "" if not better else " (below this CPU: OPENBLAS_CORETYPE=%s would be faster)" % better)
    os.environ["OPENBLAS_CORETYPE"] = better if a.blas_core == "auto" else a.blas_core
    print("OpenBLAS chose its %s kernel on this CPU; the runs use OPENBLAS_CORETYPE=%s" % (
        chosen, os.environ["OPENBLAS_CORETYPE"]), flush=True)
    return "OpenBLAS %s kernel (OPENBLAS_CORETYPE; OpenBLAS itself chose %s)" % (os.environ["OPENBLAS_CORETYPE"], chosen)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--impls", default="ddp tcp,ddp mpi,pytorch,ddp solo")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--python", default="/usr/bin/python3", help="the Python with PyTorch, for the PyTorch DDP runs")
    ap.add_argument("--blas-core", default="auto",
                    help="auto: where OpenBLAS picks a kernel below the CPU, run with the one the CPU has; as-is: "
                         "OpenBLAS's choice; else an OPENBLAS_CORETYPE name for every ddp run")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "data_parallel.md"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "data_parallel.png"))
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    impls = a.impls.split(",")
    results = {(i, n): [] for i in impls for n in worlds}
    split = {(i, n): [] for i in impls for n in worlds}  # ddp's rank-0 phases, one tuple per run
    blas = choose_blas_kernel(a)
    load_before = os.getloadavg()
    for rnd in range(a.rounds):
        for n in worlds:
            for impl in impls:
                for attempt in range(3):  # a launch can fail on a busy machine (port race): say so, retry
                    try:
                        r = run_one(impl, n, a)
                        break
                    except (RuntimeError, subprocess.SubprocessError) as e:
                        print("round %d  %-8s N=%d  attempt %d failed: %s" % (rnd + 1, impl, n, attempt + 1, e),
                              file=sys.stderr, flush=True)
                else:
                    raise RuntimeError("%s at N=%d failed three times" % (impl, n))
                results[(impl, n)].append(r["median_ms"])
                if "tail_ms" in r and impl != "ddp solo":
                    split[(impl, n)].append((r["forward_backward_ms"], r["tail_ms"], r["tail_after_last_backward_ms"],
                                             r["optimizer_ms"], r["last_bucket_all_reduce_ms"],
                                             r["last_bucket_bytes"]))
                print("round %d  %-8s N=%d  %.1f ms" % (rnd + 1, impl, n, r["median_ms"]), flush=True)
    load_after = os.getloadavg()
    t = {k: statistics.median(v) for k, v in results.items()}
    overhead = {(i, n): t[(i, n)] / t[(i, worlds[0])] - 1 for i in impls for n in worlds}

    cores = os.cpu_count()
    cmd = "/usr/bin/python3 bench/parallel/run_data_parallel.py " + " ".join(sys.argv[1:])
    lines = [
        "# data_parallel step time beside PyTorch DDP",
        "",
        "Model: MLP 784-2048-2048-10 (5.8 M f32 parameters, 23 MB of gradients per step), batch %d per rank, "
        "SGD with momentum, one thread per rank (OpenBLAS / torch.set_num_threads(1)), gradients all-reduced "
        "in 25 MiB buckets (first bucket 1 MiB) by both. Step = zero_grad + forward + backward (reporting "
        "gradients as they finish, so buckets overlap the backward) + all-reduce wait + optimizer step. "
        "T_N is the median over %d rounds of each run's median step time (each step's time is the slowest "
        "rank's), %d timed steps after %d warm-up steps; rounds interleave the implementations. "
        "'ddp solo' runs N independent single-rank ddp jobs at once (no communication, the slowest one's step "
        "time): the part of T_N that is only the ranks sharing the CPU cores. Rank 0's phases (medians over its "
        "steps, then over rounds): forward+backward; the tail, dp.finish_gradients() after the backward, and how "
        "much of it follows the slowest rank's backward (the rest is waiting for a straggler, not communication); "
        "the optimizer; beside them a standalone all_reduce of the bucket that starts last." %
        (a.batch, a.rounds, a.steps, a.warmup),
        "",
        "- Machine: %s" % machine.describe(),
        "- BLAS of the ddp runs: %s; PyTorch: its own" % blas,
        "- Date: %s UTC; load average before/after: %.1f / %.1f" % (
            datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), load_before[0], load_after[0]),
        "- Command: `%s`" % cmd,
    ]
    if any(n > cores for n in worlds):
        lines.append("- N > %d is oversubscribed (more ranks than logical CPUs): ranks share cores, so T_N "
                     "there measures time-slicing as much as communication." % cores)
    solo = {n: t[("ddp solo", n)] for n in worlds} if "ddp solo" in impls else {}
    lines += ["", "| implementation | N | T_N (ms) | T_1 (ms) | overhead T_N/T_1 − 1 | T_N − T_1 (ms) | T_N / T_solo(N) | "
              "runs (ms) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for impl in impls:
        for n in worlds:
            lines.append("| %s | %d | %.1f | %.1f | %+.1f %% | %+.1f | %s | %s |" % (
                impl, n, t[(impl, n)], t[(impl, worlds[0])], 100 * overhead[(impl, n)],
                t[(impl, n)] - t[(impl, worlds[0])],
                "%.2f" % (t[(impl, n)] / solo[n]) if n in solo and impl != "ddp solo" else "",
                ", ".join("%.0f" % v for v in results[(impl, n)])))
    phases = [(impl, n) for impl in impls for n in worlds if split[(impl, n)]]
    if phases:
        lines += ["", "Rank 0's step in phases (ms; target: the tail after the last backward ≤ 1.5 × the standalone "
                  "all_reduce of the last bucket):", "",
                  "| implementation | N | forward+backward | tail | of it after the slowest rank's backward | "
                  "optimizer | last bucket (MB) | its all_reduce alone | tail after last backward / alone |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for impl, n in phases:
            m = [statistics.median(x[k] for x in split[(impl, n)]) for k in range(6)]
            lines.append("| %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %s |" % (
                impl, n, m[0], m[1], m[2], m[3], m[5] / 1e6, m[4],
                "%.2f" % (m[2] / m[4]) if n > 1 and m[4] > 0 else ""))
    if "pytorch" in impls:
        lines += ["", "ddp's added time per step against PyTorch DDP's, (T_N − T_1) / (T_N − T_1 of PyTorch DDP) "
                  "(target ≤ 1/3):", "", "| implementation | N | ddp's T_N − T_1 / PyTorch's |", "|---|---:|---:|"]
        for impl in impls:
            if impl == "pytorch" or impl.startswith("ddp solo"):
                continue
            for n in worlds[1:]:
                pa = t[("pytorch", n)] - t[("pytorch", worlds[0])]
                da = t[(impl, n)] - t[(impl, worlds[0])]
                ratio = "%.2f" % (da / pa) if pa > 0 else "n/a (PyTorch added none)"
                lines.append("| %s | %d | %s |" % (impl, n, ratio))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        width = 0.8 / len(impls)
        for k, impl in enumerate(impls):
            xs = [i + k * width for i in range(len(worlds))]
            ax1.bar(xs, [t[(impl, n)] for n in worlds], width, label=impl)
            ax2.bar(xs, [100 * overhead[(impl, n)] for n in worlds], width, label=impl)
        for ax, title in ((ax1, "step time T_N (ms)"), (ax2, "overhead T_N/T_1 - 1 (%)")):
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(worlds))])
            ax.set_xticklabels(["N=%d" % n for n in worlds])
            ax.set_title(title)
            ax.legend()
        fig.suptitle("MLP 784-2048-2048-10, batch %d/rank, 1 thread/rank" % a.batch)
        fig.tight_layout()
        os.makedirs(os.path.dirname(a.plot), exist_ok=True)
        fig.savefig(a.plot, dpi=100)
        lines += ["", "![step time and overhead](../img/%s)" % os.path.basename(a.plot)]
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
