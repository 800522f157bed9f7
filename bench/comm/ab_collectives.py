#!/usr/bin/python3
"""Compares two builds of ddp's collectives on one machine: `ddp-launch -n N ddp_bench_collectives --ddp-only` from
BUILD_A and from BUILD_B, one right after the other in each round, the order alternating round by round. Prints, per
N and message size, the median time of each and two ratios B / A: of the medians, and the median of the rounds' own
ratios (each round's pair ran seconds apart, so it shares the machine's slow or fast phase). A regression check for a
change that should not touch the collectives' speed (target: within ±3 %).

usage: bench/comm/ab_collectives.py BUILD_A BUILD_B [--ranks 2 4] [--rounds 16] [--max-bytes 67108864] [--save RAW.json]
                                    [--title TEXT] [--out PAGE.md]
"""
import argparse
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for machine.py
import machine  # noqa: E402
from run_collectives import run_launched  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--save", default="")
    ap.add_argument("--title", default="ddp's collectives: two builds side by side")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    load_before = os.getloadavg()[0]
    got = {}  # (n, size, side) -> seconds per round
    for n in a.ranks:
        for rnd in range(a.rounds):
            for side in (("a", "b") if rnd % 2 == 0 else ("b", "a")):
                for size, sec in run_launched(a.a if side == "a" else a.b, n, a.max_bytes)[1].items():
                    got.setdefault((n, size, side), []).append(sec)
            print("N %d round %d done" % (n, rnd + 1), file=sys.stderr, flush=True)
    lines = [
        "# " + a.title, "",
        "f32 all_reduce(sum) under `ddp-launch -n N ddp_bench_collectives --ddp-only` (the slowest rank's time, median "
        "over iterations), A and B one right after the other in each of %d rounds, the order alternating; the table "
        "gives each side's median over rounds and the median of the rounds' own B / A." % a.rounds, "",
        "- A: `%s`; B: `%s`" % (a.a, a.b),
        "- Machine: %s" % machine.describe(),
        "- Date: %s UTC; load average before/after: %.1f / %.1f" % (
            datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), load_before, os.getloadavg()[0]),
        "- Command: `/usr/bin/python3 bench/comm/ab_collectives.py A B --ranks %s --rounds %d`" % (
            " ".join(map(str, a.ranks)), a.rounds), "",
        "| N | size (bytes) | A (µs) | B (µs) | B / A of medians | median of the rounds' B / A |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for (n, size, side), sa in sorted(got.items()):
        if side != "a":
            continue
        sb = got[(n, size, "b")]
        paired = statistics.median(y / x for x, y in zip(sa, sb))
        ma, mb = statistics.median(sa), statistics.median(sb)
        lines.append("| %d | %d | %.1f | %.1f | %.3f | %.3f |" % (n, size, ma * 1e6, mb * 1e6, mb / ma, paired))
    machine.publish(lines, a.out)
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"%d,%d,%s" % k: v for k, v in got.items()}, f)


if __name__ == "__main__":
    main()
