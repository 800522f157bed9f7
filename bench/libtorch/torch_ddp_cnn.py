"""Step time of PyTorch DDP (gloo, one thread per rank) on the CNN of examples/libtorch_fashion_mnist (the same layers
as examples/common/cnn.hpp), SGD with momentum: the anchor of run_libtorch_ddp.py. Reads torchrun's RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. --plain trains without DDP (each rank alone; the process group only gathers the times): N
such ranks at once are the compute floor that DDP's own cost adds to. Each rank trains on its own batch; a round is
`--steps` steps; rank 0 prints one JSON line with the median over rounds of the slowest rank's round.

usage: torchrun --nproc_per_node N torch_ddp_cnn.py [--rounds R] [--steps S] [--batch B] [--plain]
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class Cnn(torch.nn.Module):
    """conv(1→8) → pool → conv(8→16) → pool → fc(784→64) → fc(64→10), as example::cnn_impl."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = torch.nn.Linear(16 * 7 * 7, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--plain", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1 + rank)  # each rank its own batch
    x = torch.randn(a.batch, 1, 28, 28)
    y = torch.randint(0, 10, (a.batch,))
    torch.manual_seed(2)
    model = Cnn() if a.plain else DistributedDataParallel(Cnn())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(10):  # warm-up, as libtorch_step_bench
        step()
    ms = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        ms.append((time.perf_counter() - t0) * 1e3 / a.steps)
    t = torch.tensor(ms, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a round of the job lasts as long as its slowest rank's
    ms = sorted(t.tolist())
    if rank == 0:
        print(json.dumps({"bench": "torch_ddp_cnn", "plain": a.plain, "world": world, "batch": a.batch,
                          "median_ms": round(ms[len(ms) // 2], 4)}), flush=True)
    # As torch_ddp_step.py: leave without the process group's teardown, which can hang once the others have gone.
    os._exit(0)


if __name__ == "__main__":
    main()
