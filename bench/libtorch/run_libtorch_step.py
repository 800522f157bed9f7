"""Driver: the LibTorch adapter's cost at N = 1 as users run it. Plain LibTorch and the same model under ddp run as
separate processes (libtorch_step_bench --only plain / --only ddp), interleaved round by round (the order alternates),
at two step sizes (by default batches giving about 1 ms and 5 ms steps on a quiet core); each process reports the
median of its steps. Prints the medians over rounds, the ratio, page faults and context switches per step, the
load, and beside them the in-process figure (both variants alternating step by step in one process).

usage: /usr/bin/python3 bench/libtorch/run_libtorch_step.py --build build [--rounds 7] [--steps 300]
       [--batches 4,24] [--out docs/bench/libtorch_step.md]
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for machine.py
import machine  # noqa: E402


def run(exe, args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([exe] + args, capture_output=True, text=True, env=env, timeout=1800, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")][-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=300, help="timed steps per process")
    ap.add_argument("--batches", default="4,24", help="batch sizes: one near a 1 ms step, one near 5 ms")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    exe = os.path.join(a.build, "bench", "libtorch", "libtorch_step_bench")
    load_before = os.getloadavg()
    rows = []
    for batch in [int(b) for b in a.batches.split(",")]:
        got = {"plain": [], "ddp": []}
        counts = {"plain": [], "ddp": []}
        for rnd in range(a.rounds):
            order = ["plain", "ddp"] if rnd % 2 == 0 else ["ddp", "plain"]
            for variant in order:
                r = run(exe, ["--only", variant, "--rounds", str(a.steps), "--steps", "1", "--batch", str(batch)])
                got[variant].append(r["median_ms"])
                counts[variant].append((r["faults_per_step"], r["switches_per_step"]))
                print("batch %d round %d  %-5s %.3f ms" % (batch, rnd + 1, variant, r["median_ms"]), flush=True)
        inproc = run(exe, ["--rounds", str(a.steps), "--steps", "1", "--batch", str(batch)])
        p, d = statistics.median(got["plain"]), statistics.median(got["ddp"])
        bp, bd = min(got["plain"]), min(got["ddp"])
        rows.append((batch, p, d, d / p, "%.3f-%.3f" % (bp, max(got["plain"])), "%.3f-%.3f" % (bd, max(got["ddp"])),
                     bd / bp, statistics.median(c[0] for c in counts["plain"]),
                     statistics.median(c[0] for c in counts["ddp"]), statistics.median(c[1] for c in counts["plain"]),
                     statistics.median(c[1] for c in counts["ddp"]), inproc["ratio"]))
    load_after = os.getloadavg()
    lines = [
        "# LibTorch adapter at N = 1, as users run it",
        "",
        "The CNN of examples/libtorch_fashion_mnist, SGD with momentum, one LibTorch thread. Plain LibTorch and ddp "
        "(replicate over ddp::tcp, one process) run as separate programs, interleaved over %d rounds (the order "
        "alternates); each reports the median of %d steps; the table gives the medians over rounds. The last column "
        "is the same comparison inside one process (both variants alternating step by step). On a VM a whole "
        "process may run 30-60 %% slower than the next one of the same program (plain and ddp alike), so the "
        "range over rounds and the ratio of the fastest rounds stand beside the medians." % (a.rounds, a.steps),
        "",
        "- Machine: %s" % machine.describe(),
        "- Date: %s UTC; load average before/after: %.1f / %.1f" % (
            datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), load_before[0], load_after[0]),
        "- Command: `/usr/bin/python3 bench/libtorch/run_libtorch_step.py %s`" % " ".join(
            "--%s %s" % (k, v) for k, v in (("rounds", a.rounds), ("steps", a.steps), ("batches", a.batches))),
        "",
        "| batch | plain (ms) | ddp (ms) | ddp / plain | plain range | ddp range | fastest ddp / fastest plain | "
        "page faults per step plain / ddp | context switches per step plain / ddp | in one process: ddp / plain |",
        "|---:|---:|---:|---:|---|---|---:|---|---|---:|",
    ]
    for b, p, d, ratio, rp, rd, best, fp, fd, sp, sd, inproc in rows:
        lines.append("| %d | %.3f | %.3f | %.4f | %s | %s | %.4f | %.1f / %.1f | %.2f / %.2f | %.4f |" % (
            b, p, d, ratio, rp, rd, best, fp, fd, sp, sd, inproc))
    machine.publish(lines, a.out)


if __name__ == "__main__":
    main()
