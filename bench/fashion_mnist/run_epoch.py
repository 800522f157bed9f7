"""Driver: the Fashion-MNIST example's epoch time against the same training in PyTorch, at N ranks, each launched as
its users launch it: `ddp-launch -n N fashion_mnist --backend tcp` (examples/fashion_mnist: the MLP 784-256-128-10
with OpenBLAS, SGD with momentum, cosine lr, batch 64 per rank) and torch_fashion_mnist.py (the same network,
optimizer, schedule and data in PyTorch, DistributedDataParallel over gloo; bench/ranks.py starts its ranks with
torchrun's variables). One thread per rank on both sides. The two alternate round by round (the order alternates);
each run trains `--epochs` epochs and reports the training seconds of its last (the first pays for warm-up); the
table gives the medians over rounds and ddp's time over PyTorch's (target on 16 cores: within 10 %).

usage: /usr/bin/python3 bench/fashion_mnist/run_epoch.py --build build [--ranks 1 2] [--rounds 3] [--epochs 2]
       [--data /usr/share/datasets/fashion-mnist] [--python PYTHON] [--out docs/bench/fashion_mnist_epoch.md]
"""
import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for machine.py and ranks.py
import machine  # noqa: E402
from ranks import spawn_env_ranks  # noqa: E402

EPOCH_LINE = re.compile(r"epoch (\d+)/\d+: .* accuracy ([0-9.]+) .*\| ([0-9.]+) s training")


def ddp_epoch(a, n):
    """The example's last epoch under ddp-launch: (training seconds, test accuracy)."""
    with tempfile.TemporaryDirectory() as scratch:  # the checkpoint it saves after each epoch (not timed)
        cmd = [os.path.join(a.build, "tools", "ddp-launch"), "-n", str(n),
               os.path.join(a.build, "examples", "fashion_mnist"), "--backend", "tcp", "--epochs", str(a.epochs),
               "--no-progress", "--checkpoint", os.path.join(scratch, "fashion_mnist.safetensors"), "--data", a.data]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError("%s failed (rc %d): %s" % (" ".join(cmd), done.returncode,
                                                      (done.stdout + done.stderr)[-2000:]))
    epochs = [m for m in (EPOCH_LINE.search(line) for line in (done.stdout + done.stderr).splitlines()) if m]
    if not epochs:
        raise RuntimeError("%s printed no epoch line:\n%s" % (" ".join(cmd), (done.stdout + done.stderr)[-2000:]))
    return float(epochs[-1].group(3)), float(epochs[-1].group(2))


def torch_epoch(a, n):
    """The PyTorch twin's last epoch: (training seconds, test accuracy)."""
    out = spawn_env_ranks([a.python, os.path.join(HERE, "torch_fashion_mnist.py"), "--epochs", str(a.epochs), "--data",
                           a.data], n, 3600)
    last = [json.loads(line) for line in out.splitlines() if line.startswith("{")][-1]
    return last["train_seconds"], last["test_accuracy"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist", help="the four IDX files (gzip'd)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    load_before = os.getloadavg()
    rows = []
    for n in a.ranks:
        got = {"ddp": [], "pytorch": []}
        acc = {"ddp": [], "pytorch": []}
        for rnd in range(a.rounds):
            for side in (["ddp", "pytorch"] if rnd % 2 == 0 else ["pytorch", "ddp"]):
                sec, accuracy = ddp_epoch(a, n) if side == "ddp" else torch_epoch(a, n)
                got[side].append(sec)
                acc[side].append(accuracy)
                print("N %d round %d  %-7s %.2f s (test accuracy %.4f)" % (n, rnd + 1, side, sec, accuracy), flush=True)
        d, p = statistics.median(got["ddp"]), statistics.median(got["pytorch"])
        rows.append((n, d, p, d / p, ", ".join("%.2f" % v for v in got["ddp"]),
                     ", ".join("%.2f" % v for v in got["pytorch"]), statistics.median(acc["ddp"]),
                     statistics.median(acc["pytorch"])))
    load_after = os.getloadavg()
    blas = os.environ.get("OPENBLAS_CORETYPE", "")
    lines = [
        "# The Fashion-MNIST example's epoch against the same training in PyTorch",
        "",
        "examples/fashion_mnist under `ddp-launch -n N` (ddp::tcp, OpenBLAS) against bench/fashion_mnist/"
        "torch_fashion_mnist.py (PyTorch DDP over gloo, its ranks started with torchrun's variables): the MLP "
        "784-256-128-10, SGD with momentum 0.9, lr 0.05 on a cosine, batch 64 per rank, one thread per rank. Each run "
        "trains %d epoch(s); the figure is the last epoch's training time (the slowest rank's for PyTorch, rank 0's "
        "line for ddp, whose ranks end each step together), the median over %d interleaved rounds." % (
            a.epochs, a.rounds),
        "",
        "- Machine: %s" % machine.describe(),
        "- BLAS of the ddp runs: OpenBLAS%s; PyTorch: its own" % (
            " with OPENBLAS_CORETYPE=%s" % blas if blas else ", its own kernel choice"),
        "- PyTorch %s; date: %s UTC; load average before/after: %.1f / %.1f" % (
            subprocess.run([a.python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True).stdout.strip(),
            datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), load_before[0], load_after[0]),
        "- Command: `/usr/bin/python3 bench/fashion_mnist/run_epoch.py --build BUILD --ranks %s --rounds %d "
        "--epochs %d`" % (" ".join(map(str, a.ranks)), a.rounds, a.epochs),
        "",
        "| N | ddp epoch (s) | PyTorch epoch (s) | ddp / PyTorch | ddp runs | PyTorch runs | test accuracy ddp / "
        "PyTorch |",
        "|---:|---:|---:|---:|---|---|---|",
    ]
    for n, d, p, ratio, rd, rp, ad, ap_ in rows:
        lines.append("| %d | %.2f | %.2f | %.3f | %s | %s | %.4f / %.4f |" % (n, d, p, ratio, rd, rp, ad, ap_))
    machine.publish(lines, a.out)


if __name__ == "__main__":
    main()
