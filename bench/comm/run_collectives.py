#!/usr/bin/python3
"""Runs ddp_bench_collectives at N = 2, 4, 8 twice: under `ddp-launch -n N --ddp-only` (ddp as users launch it,
with ddp-launch's default binding, no MPI) and then under mpirun (ddp::tcp, Gloo and MPI_Allreduce side by side,
mpirun's binding), and writes docs/bench/NAME.md and docs/img/NAME.png (busbw and time against message size; NAME
is collectives unless --name gives another, as for a lent machine's run kept beside this one's). The ratios compare
ddp under ddp-launch with Open MPI and Gloo under mpirun.

--rounds R repeats the pair R times, alternating the two launches, and every figure is the median over the rounds:
a shared host's slow and fast phases last seconds, and alternating gives each side the same share of them.

usage: bench/comm/run_collectives.py BUILD_DIR [--ranks 2 4 8] [--rounds 3] [--max-bytes 67108864] [--save RAW.json]
                                    [--name NAME]
       bench/comm/run_collectives.py --replay RAW.json [--name NAME]

--save writes the measurements (and the machine they ran on) to RAW.json and stops: for a machine without
matplotlib, such as a lent benchmark host; --replay writes the tables and the plot from such a file.
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys

import json

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


def run_launched(build, n, max_bytes):
    exe = os.path.join(build, "bench", "comm", "ddp_bench_collectives")
    cmd = [os.path.join(build, "tools", "ddp-launch"), "-n", str(n), exe, "--ddp-only", "--csv", "--max-bytes",
           str(max_bytes)]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    out = done.stdout
    rows = {}
    for line in out.splitlines():
        at = line.find("CSVDDP,")
        if at >= 0:
            f = line[at:].split(",")
            rows[int(f[2])] = float(f[3])
    binding = next((line for line in done.stderr.splitlines()
                    if line.startswith("ddp-launch:") and ("bound" in line or "bind" in line)), "")  # its own line
    return cmd, rows, binding


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


def measure(build, ranks, rounds, max_bytes):
    """Runs every N under ddp-launch, then under mpirun, `rounds` times; returns the per-size medians over the rounds
    and every round's figures, JSON-ready, for write_docs."""
    load = os.getloadavg()[0]
    launched = {n: [] for n in ranks}
    results = {n: [] for n in ranks}
    for r in range(rounds):
        print(f"round {r + 1} of {rounds}", flush=True)
        for n in ranks:
            launched[n].append(run_launched(build, n, max_bytes))
            results[n].append(run(build, n, max_bytes))
    merged_launched, merged_results = {}, {}
    for n in ranks:
        cmd, _, binding = launched[n][0]
        sizes = set.intersection(*(set(rows) for _, rows, _ in launched[n]))
        medians = {str(s): statistics.median([rows[s] for _, rows, _ in launched[n]]) for s in sorted(sizes)}
        merged_launched[str(n)] = [cmd, medians, binding]
        per_size = {}
        for _, rows in results[n]:
            for row in rows:
                per_size.setdefault(row[0], []).append(row[1:])
        merged_results[str(n)] = [results[n][0][0], [
            [size] + [statistics.median([fig[k] for fig in figs]) for k in range(len(figs[0]))]
            for size, figs in sorted(per_size.items()) if len(figs) == rounds]]
    return {"load": load, "cpu": cpu_model(), "cores": os.cpu_count(), "rounds": rounds,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "launched": merged_launched, "results": merged_results,
            "per_round": {str(n): [{"launched": {str(s): t for s, t in lr[1].items()}, "mpirun": rr[1]}
                                   for lr, rr in zip(launched[n], results[n])] for n in ranks}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build", nargs="?")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3, help="alternating ddp-launch / mpirun pairs; medians over them")
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--save", help="write the raw measurements here and stop")
    ap.add_argument("--replay", help="write the docs from raw measurements --save wrote, running nothing")
    ap.add_argument("--name", default="collectives", help="the stem of the table and plot written under docs/")
    args = ap.parse_args()
    if args.replay:
        with open(args.replay) as f:
            raw = json.load(f)
    elif args.build:
        if args.rounds < 1:
            ap.error("--rounds must be 1 or more")
        raw = measure(args.build, args.ranks, args.rounds, args.max_bytes)
    else:
        ap.error("give BUILD_DIR, or --replay RAW.json")
    if args.save:
        with open(args.save, "w") as f:
            json.dump(raw, f)
        print("wrote", args.save)
        return 0
    write_docs(raw, args.name)
    return 0


def busbw_ratios(mpirun_rows, own):
    """(busbw ddp-launch / MPI, size) for every size from 64 KiB to 64 MiB both runs measured; `own` maps a size to
    ddp-launch's time."""
    return [(r[4] / own[r[0]], r[0]) for r in mpirun_rows if 64 << 10 <= r[0] <= 64 << 20 and r[0] in own]


def lowest_busbw_ratio(one_round):
    """The lowest busbw ratio ddp-launch / MPI from 64 KiB to 64 MiB in one round, and its size (0 if none)."""
    own = {int(s): t for s, t in one_round["launched"].items()}
    return min(busbw_ratios(one_round["mpirun"], own), default=(0.0, 0))


def write_docs(raw, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load, date, cpu, cores = raw["load"], raw["date"], raw["cpu"], raw["cores"]
    launched = {int(n): (c, {int(s): t for s, t in rows.items()}, b) for n, (c, rows, b) in raw["launched"].items()}
    results = {int(n): (c, [tuple(r) for r in rows]) for n, (c, rows) in raw["results"].items()}
    md = ["# Collectives benchmark: ddp::tcp vs Gloo vs MPI_Allreduce", ""]
    md += ["Each N runs twice, one right after the other: `ddp-launch -n N ddp_bench_collectives --ddp-only` (ddp "
           "alone, as users launch it: ddp-launch's default binding, ddp's own barrier and max reduction for the "
           "timing; the \"ddp-launch\" columns), then `mpirun -np N ddp_bench_collectives` (ddp::tcp, Gloo and "
           "MPI_Allreduce in one job, mpirun's binding). Ratios: ddp under ddp-launch against Open MPI and the best "
           "Gloo path under mpirun.", ""]
    rounds = raw.get("rounds", 1)
    per_round = raw.get("per_round", {})
    if rounds > 1:
        md += [f"Every figure is the median over {rounds} rounds; a round is the ddp-launch run, then the mpirun run, "
               "and the rounds alternate the two. The last column gives each round's own lowest busbw ratio, so the "
               "spread between rounds shows.", ""]
    md += ["| N | 4 KiB: ddp-launch µs | MPI µs | best Gloo µs | ddp / MPI time | ddp / Gloo time | "
           "busbw ddp-launch / MPI, 64 KiB–64 MiB (min … max) | lowest busbw ratio in each round |",
           "|---:|---:|---:|---:|---:|---:|:---|:---|"]
    for n, (cmd, rows) in results.items():
        mine = launched[n][1]
        small = [r for r in rows if r[0] == 4096]
        big = [ratio for ratio, _ in busbw_ratios(rows, mine)]
        lows = [f"{ratio:.2f}× ({human(size)})" for ratio, size in map(lowest_busbw_ratio, per_round.get(str(n), []))
                if size]
        if small and 4096 in mine:
            _, _, tg, th, tm = small[0][:5]
            md.append(f"| {n} | {mine[4096] * 1e6:.1f} | {tm * 1e6:.1f} | {min(tg, th) * 1e6:.1f} | "
                      f"{mine[4096] / tm:.2f}× | 1/{min(tg, th) / mine[4096]:.0f} | "
                      + (f"{min(big):.2f} … {max(big):.2f}× | " if big else "– | ")
                      + (", ".join(lows) if lows else "–") + " |")
    md.append("")
    md += [f"f32 all_reduce(sum), median over iterations of the slowest rank's time; "
           f"busbw = bytes * 2(N-1)/N / time. Machine: {cpu}, {cores} cores "
           f"(load average {load:.1f} when started), {date}. "
           "Ranks beyond the core count are oversubscribed. Gloo is Debian's libgloo over "
           "gloo::transport::tcp on 127.0.0.1, measured two ways: `gloo::allreduce(AllreduceOptions)` (the call "
           "PyTorch's ProcessGroupGloo makes) and a cached `gloo::AllreduceHalvingDoubling` (Gloo's fastest small-"
           "message path); ratios are against the better of the two. MPI is Open MPI's MPI_Allreduce over its "
           "shared-memory transport: a reference, not a TCP peer. CPU ms per op is rank 0's process CPU time "
           "(all threads) per iteration.", ""]
    md += ["Reproduce: `cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DDDP_BUILD_BENCH=ON && "
           "cmake --build build --target ddp_bench_collectives && bench/comm/run_collectives.py build`", ""]
    md += [f"![busbw and time](../img/{name}.png)", ""]
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 8), squeeze=False)
    for col, (n, (cmd, rows)) in enumerate(results.items()):
        lcmd, mine, binding = launched[n]
        md += [f"## N = {n}", "", f"`build/tools/ddp-launch -n {n} build/bench/comm/ddp_bench_collectives --ddp-only` "
               f"({binding.strip() or 'binding not printed'}), then "
               f"`{' '.join(cmd[:-4] + ['build/bench/comm/ddp_bench_collectives'])}`", ""]
        md += ["| size | ddp-launch µs | ddp-launch GB/s | ddp-launch / MPI busbw | ddp-launch / best Gloo busbw "
               "| ddp (mpirun) µs | Gloo µs | Gloo HD µs | MPI µs | ddp (mpirun) GB/s | Gloo GB/s | Gloo HD GB/s "
               "| MPI GB/s | CPU ms per op (mpirun): ddp / Gloo / Gloo HD |",
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for size, td, tg, th, tm, cd, cg, ch, _cm in rows:
            best = min(tg, th)
            tl = mine.get(size)
            lcols = (f"{tl * 1e6:.1f} | {busbw(n, size, tl):.2f} | {tm / tl:.2f}× | {best / tl:.2f}×" if tl
                     else "– | – | – | –")
            md.append(f"| {human(size)} | {lcols} | {td * 1e6:.1f} | {tg * 1e6:.1f} | {th * 1e6:.1f} | "
                      f"{tm * 1e6:.1f} | {busbw(n, size, td):.2f} | {busbw(n, size, tg):.2f} | "
                      f"{busbw(n, size, th):.2f} | {busbw(n, size, tm):.2f} | "
                      f"{cd * 1e3:.2f} / {cg * 1e3:.2f} / {ch * 1e3:.2f} |")
        md.append("")
        sizes = [r[0] for r in rows]
        lsizes = sorted(mine)
        axes[0][col].plot(lsizes, [busbw(n, s, mine[s]) for s in lsizes], "*-", label="ddp::tcp (ddp-launch)")
        axes[1][col].plot(lsizes, [mine[s] * 1e6 for s in lsizes], "*-", label="ddp::tcp (ddp-launch)")
        for idx, (curve, style) in enumerate([("ddp::tcp (mpirun)", "o-"), ("Gloo allreduce()", "s-"),
                                              ("Gloo halving-doubling", "d-"), ("MPI_Allreduce", "^--")]):
            times = [r[1 + idx] for r in rows]
            axes[0][col].plot(sizes, [busbw(n, s, t) for s, t in zip(sizes, times)], style, label=curve)
            axes[1][col].plot(sizes, [t * 1e6 for t in times], style, label=curve)
        axes[0][col].set_title(f"N = {n}: busbw (GB/s)")
        axes[1][col].set_title(f"N = {n}: time (µs)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message bytes")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        axes[1][col].set_yscale("log")
    fig.tight_layout()
    img = os.path.join(ROOT, "docs", "img", f"{name}.png")
    os.makedirs(os.path.dirname(img), exist_ok=True)
    fig.savefig(img, dpi=90)
    out = os.path.join(ROOT, "docs", "bench", f"{name}.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(md))
    print("wrote", out, "and", img)


if __name__ == "__main__":
    sys.exit(main())
