"""Driver: the step-time cost of replicate{.deterministic = true} over replicate on the data_parallel bench (MLP
784-2048-2048-10, batch 64 per rank, TCP), for one or two builds of dp_step_bench (e.g. before and after a change),
in one run: rounds interleave every (build, deterministic) pair so machine load drifts hit all of them alike, and
each ratio is the median over rounds of deterministic / plain step time (each a median over steps).

usage: /usr/bin/python3 bench/parallel/run_deterministic.py --bench build/bench/parallel/dp_step_bench
           [--bench other/dp_step_bench] [--world 2] [--rounds 7] [--steps 30] [--bucket-mib 25]
"""
import argparse
import statistics
import sys

from run_data_parallel import last_json, spawn_env_ranks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", action="append", required=True, help="a dp_step_bench executable (repeatable)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-mib", default="25")
    p.add_argument("--timeout", type=int, default=300)
    a = p.parse_args()
    times = {(b, d): [] for b in a.bench for d in (False, True)}
    ratios = {b: [] for b in a.bench}
    for r in range(a.rounds):
        for b in a.bench:
            for d in (False, True):
                cmd = [b, "--backend", "tcp", "--steps", str(a.steps), "--warmup", str(a.warmup),
                       "--bucket-mib", a.bucket_mib] + (["--deterministic"] if d else [])
                times[(b, d)].append(last_json(spawn_env_ranks(cmd, a.world, a.timeout))["median_ms"])
            ratios[b].append(times[(b, True)][-1] / times[(b, False)][-1])
        print("round %d: %s" % (r + 1, "  ".join("%s %.3f" % (b, ratios[b][-1]) for b in a.bench)), file=sys.stderr)
    print("| build | plain ms (median) | deterministic ms (median) | deterministic / plain (median of rounds) |")
    print("|---|---|---|---|")
    for b in a.bench:
        print("| %s | %.2f | %.2f | %.3f |" % (b, statistics.median(times[(b, False)]),
                                              statistics.median(times[(b, True)]), statistics.median(ratios[b])))


if __name__ == "__main__":
    main()
