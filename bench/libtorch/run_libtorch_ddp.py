"""Driver: a LibTorch program under ddp against the same model in PyTorch DDP, at N ranks, each launched as its users
launch it: `ddp-launch -n N libtorch_step_bench --only ddp` (the CNN of examples/libtorch_fashion_mnist, replicate
over ddp::tcp) and torch_ddp_cnn.py with torchrun's variables (the same layers, DDP over gloo; bench/ranks.py starts
the ranks as torchrun would), one thread per rank, each rank on its own batch, SGD with momentum. Beside them, the
compute floor of each: N plain LibTorch programs at once (libtorch_step_bench --only plain) and N plain PyTorch ranks
(torch_ddp_cnn.py --plain), which share the cores as the job's ranks do but never communicate. The four alternate
round by round (the order rotates); each run reports the median over its steps of the slowest rank's step; the tables
give the medians over rounds, the range, ddp's time over PyTorch's, and each one's added time over its own floor.

usage: /usr/bin/python3 bench/libtorch/run_libtorch_ddp.py --build build [--ranks 2] [--rounds 9] [--steps 300]
       [--batch 64] [--out docs/bench/libtorch_ddp.md]
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for machine.py
import machine  # noqa: E402
from ranks import last_json, slowest_alone, spawn_env_ranks  # noqa: E402


def run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError("%s failed (rc %d): %s" % (" ".join(cmd), done.returncode, done.stderr[-2000:]))
    return last_json(done.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=300, help="timed steps per run")
    ap.add_argument("--batch", type=int, default=64, help="batch per rank")
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    bench = os.path.join(a.build, "bench", "libtorch", "libtorch_step_bench")
    launcher = os.path.join(a.build, "tools", "ddp-launch")
    load_before = os.getloadavg()
    rows = []
    for n in a.ranks:
        ddp_cmd = [launcher, "-n", str(n), bench, "--only", "ddp", "--rounds", str(a.steps), "--steps", "1",
                   "--batch", str(a.batch)]
        torch_cmd = [a.python, os.path.join(HERE, "torch_ddp_cnn.py"), "--rounds", str(a.steps), "--steps", "1",
                     "--batch", str(a.batch)]
        sides = {
            "ddp": lambda: run(ddp_cmd),
            "libtorch plain": lambda: slowest_alone(
                [bench, "--only", "plain", "--rounds", str(a.steps), "--steps", "1", "--batch", str(a.batch)], n, 1800,
                lambda _: dict(os.environ, OMP_NUM_THREADS="1")),
            "pytorch": lambda: last_json(spawn_env_ranks(torch_cmd, n, 1800)),
            "pytorch plain": lambda: last_json(spawn_env_ranks(torch_cmd + ["--plain"], n, 1800)),
        }
        names = list(sides)
        got = {s: [] for s in names}
        for rnd in range(a.rounds):
            for side in names[rnd % len(names):] + names[:rnd % len(names)]:
                r = sides[side]()
                if r["world"] != n:
                    raise RuntimeError("%s ran at %d ranks, not %d" % (side, r["world"], n))
                got[side].append(r["median_ms"])
                print("N %d round %d  %-14s %.3f ms" % (n, rnd + 1, side, r["median_ms"]), flush=True)
        m = {s: statistics.median(v) for s, v in got.items()}
        rng = {s: "%.3f-%.3f" % (min(v), max(v)) for s, v in got.items()}
        rows.append((n, m, rng, min(got["ddp"]) / min(got["pytorch"])))
    load_after = os.getloadavg()
    lines = [
        "# A LibTorch program under ddp against PyTorch DDP",
        "",
        "The CNN of examples/libtorch_fashion_mnist (52 k parameters), batch %d per rank, SGD with momentum, one "
        "thread per rank. ddp: `ddp-launch -n N libtorch_step_bench --only ddp` (LibTorch in C++, replicate over "
        "ddp::tcp); PyTorch: bench/libtorch/torch_ddp_cnn.py, its ranks started with torchrun's variables (the "
        "same layers, DistributedDataParallel over gloo). Each run times %d steps and reports the median of the "
        "slowest rank's step; the runs alternate over %d rounds and the table gives the medians over rounds." % (
            a.batch, a.steps, a.rounds),
        "",
        "- Machine: %s" % machine.describe(),
        "- PyTorch %s; date: %s UTC; load average before/after: %.1f / %.1f" % (
            subprocess.run([a.python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True).stdout.strip(),
            datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), load_before[0], load_after[0]),
        "- Command: `/usr/bin/python3 bench/libtorch/run_libtorch_ddp.py --build BUILD %s`" % " ".join(
            "--%s %s" % (k, v) for k, v in (("ranks", " ".join(map(str, a.ranks))), ("rounds", a.rounds),
                                             ("steps", a.steps), ("batch", a.batch))),
        "",
        "| N | ddp (ms) | PyTorch DDP (ms) | ddp / PyTorch | fastest ddp / fastest PyTorch | N plain LibTorch at once "
        "(ms) | N plain PyTorch at once (ms) | ddp's added time (ms) | PyTorch DDP's added time (ms) | ddp's added / "
        "PyTorch's |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, m, rng, best in rows:
        da, pa = m["ddp"] - m["libtorch plain"], m["pytorch"] - m["pytorch plain"]
        lines.append("| %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %+.3f | %+.3f | %s |" % (
            n, m["ddp"], m["pytorch"], m["ddp"] / m["pytorch"], best, m["libtorch plain"], m["pytorch plain"], da, pa,
            "%.2f" % (da / pa) if pa > 0 else "n/a"))
    lines += ["", "Ranges over rounds (ms):", "", "| N | " + " | ".join(rows[0][2]) + " |",
              "|---:|" + "---|" * len(rows[0][2])]
    for n, m, rng, best in rows:
        lines.append("| %d | %s |" % (n, " | ".join(rng.values())))
    machine.publish(lines, a.out)


if __name__ == "__main__":
    main()
