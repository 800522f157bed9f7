#!/usr/bin/env python3
"""A training step on one GPU: ddp::data_parallel over NCCL against the same model without the wrapper
(bench/gpu/dp_step_gpu), beside PyTorch DDP against plain PyTorch (torch_step_gpu.py), on the issue's two MLPs:
784-2048-2048-10 at batch 64 (5.8 M parameters) and 8 layers of 4096 at batch 256 (134 M). The four programs run
interleaved, --rounds times each; the report gives each one's median step and each wrapper's added time over its
own plain model, with the GPU and the machine named.

usage: run_step_gpu.py [--build build-bench] [--rounds 5] [--steps 50] [--python python3] [--out FILE]
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import machine  # noqa: E402
from ranks import last_json  # noqa: E402

MODELS = [("784-2048-2048-10", "784,2048,2048,10", 64), ("8 x 4096", ",".join(["4096"] * 9), 256)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--python", default="python3")
    ap.add_argument("--out")
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    ddp = os.path.join(a.build, "bench", "gpu", "dp_step_gpu")
    torch = [a.python, os.path.join(here, "torch_step_gpu.py")]
    programs = {"ddp plain": [ddp, "--mode", "plain"], "ddp": [ddp, "--mode", "ddp"],
                "PyTorch plain": torch + ["--mode", "plain"], "PyTorch DDP": torch + ["--mode", "ddp"]}
    times = {(m, p): [] for m, _, _ in MODELS for p in programs}
    gpu = ""
    for r in range(a.rounds):
        for name, dims, batch in MODELS:
            order = list(programs) if r % 2 == 0 else list(reversed(programs))
            for p in order:
                cmd = programs[p] + ["--dims", dims, "--batch", str(batch), "--steps", str(a.steps)]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    raise RuntimeError("%s failed (rc %d): %s" % (" ".join(cmd), out.returncode, out.stderr[-2000:]))
                j = last_json(out.stdout)
                gpu = j.get("gpu", gpu)
                times[(name, p)].append(j["step_ms"])
                print("round %d %s %s: %.3f ms" % (r + 1, name, p, j["step_ms"]), flush=True)
    lines = ["# A training step on one GPU: ddp over NCCL and PyTorch DDP, each against its plain model", "",
             "%s; %s; %s; %d interleaved rounds of %d steps (after 10 warm-up steps), median step of each run, "
             "median over the rounds. Produced by `bench/gpu/run_step_gpu.py`." %
             (gpu, machine.describe(), datetime.date.today().isoformat(), a.rounds, a.steps), "",
             "| model | ddp plain (ms) | ddp (ms) | ddp adds | PyTorch plain (ms) | PyTorch DDP (ms) | PyTorch DDP adds "
             "| ddp / PyTorch DDP |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, _, batch in MODELS:
        m = {p: statistics.median(times[(name, p)]) for p in programs}
        lines.append("| %s, batch %d | %.3f | %.3f | %+.1f %% | %.3f | %.3f | %+.1f %% | %.2f |" % (
            name, batch, m["ddp plain"], m["ddp"], 100 * (m["ddp"] / m["ddp plain"] - 1), m["PyTorch plain"],
            m["PyTorch DDP"], 100 * (m["PyTorch DDP"] / m["PyTorch plain"] - 1), m["ddp"] / m["PyTorch DDP"]))
    lines += ["", "Each round's figures (ms):", ""]
    for (name, p), v in times.items():
        lines.append("- %s, %s: %s" % (name, p, ", ".join("%.3f" % t for t in v)))
    machine.publish(lines, a.out)


if __name__ == "__main__":
    main()
