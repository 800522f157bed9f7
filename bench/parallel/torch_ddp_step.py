"""Step time of PyTorch DDP (gloo, one thread per rank) on the MLP 784-2048-2048-10 at batch 64 per rank, SGD with
momentum: the anchor of run_data_parallel.py. Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 prints one
JSON line.

usage: torch_ddp_step.py [--steps S] [--warmup W] [--batch B]
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank + 1)
    x = torch.rand(a.batch, 784, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=False)
        loss_fn(ddp(x), y).backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    dist.barrier()
    ms = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    t = torch.tensor(ms, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the job's step time is the slowest rank's
    ms = sorted(t.tolist())
    if rank == 0:
        print(json.dumps({"impl": "pytorch", "backend": "gloo", "world": world, "batch": a.batch, "steps": a.steps,
                          "median_ms": round(ms[len(ms) // 2], 3), "mean_ms": round(sum(ms) / len(ms), 3)}),
              flush=True)
    # Leave without the process group's teardown: it intermittently hangs on rank 0 once the others have gone
    # (seen here with torch 1.13 + gloo), and nothing is left to clean up.
    os._exit(0)


if __name__ == "__main__":
    main()
