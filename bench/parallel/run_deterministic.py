"""Driver: the step-time cost of replicate{.deterministic = true} over replicate on the data_parallel bench (MLP
784-2048-2048-10, batch 64 per rank, TCP), for one or two builds of dp_step_bench (e.g. before and after a change),
in one run: rounds interleave every (build, deterministic) pair so machine load drifts hit all of them alike, and
each ratio is the median over rounds of deterministic / plain: of the step time (each run's median over steps),
and of the CPU time the run's ranks used (user + system, startup included), which a shared machine's load
disturbs less than wall time.

usage: /usr/bin/python3 bench/parallel/run_deterministic.py --bench build/bench/parallel/dp_step_bench
           [--bench other/dp_step_bench] [--world 2] [--rounds 7] [--steps 30] [--bucket-mib 25]
"""
import argparse
import os
import resource
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for ranks.py
from ranks import last_json, spawn_env_ranks  # noqa: E402


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
    cpu = {(b, d): [] for b in a.bench for d in (False, True)}
    ratios = {b: [] for b in a.bench}
    cpu_ratios = {b: [] for b in a.bench}

    def children_cpu():
        u = resource.getrusage(resource.RUSAGE_CHILDREN)
        return u.ru_utime + u.ru_stime

    for r in range(a.rounds):
        for b in a.bench:
            for d in (False, True):
                cmd = [b, "--backend", "tcp", "--steps", str(a.steps), "--warmup", str(a.warmup),
                       "--bucket-mib", a.bucket_mib] + (["--deterministic"] if d else [])
                before = children_cpu()
                times[(b, d)].append(last_json(spawn_env_ranks(cmd, a.world, a.timeout))["median_ms"])
                cpu[(b, d)].append(children_cpu() - before)
            ratios[b].append(times[(b, True)][-1] / times[(b, False)][-1])
            cpu_ratios[b].append(cpu[(b, True)][-1] / cpu[(b, False)][-1])
        print("round %d: %s" % (r + 1, "  ".join("%s step %.3f cpu %.3f" % (b, ratios[b][-1], cpu_ratios[b][-1])
                                                 for b in a.bench)), file=sys.stderr)
    print("| build | plain step ms | deterministic step ms | step ratio | plain CPU s | deterministic CPU s | CPU ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = statistics.median
    for b in a.bench:
        print("| %s | %.2f | %.2f | %.3f | %.2f | %.2f | %.3f |" % (
            b, med(times[(b, False)]), med(times[(b, True)]), med(ratios[b]), med(cpu[(b, False)]),
            med(cpu[(b, True)]), med(cpu_ratios[b])))


if __name__ == "__main__":
    main()
