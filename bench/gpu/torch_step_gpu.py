"""Step time of an MLP on a GPU in PyTorch: nn.Linear layers with ReLU between, cross-entropy, SGD with momentum,
plain (--mode plain) or under DistributedDataParallel over NCCL (--mode ddp, one process alone or the ranks of
RANK/WORLD_SIZE). The anchor of run_step_gpu.py; each step is timed from the host and ends with a wait for the
device, as dp_step_gpu's. Prints one JSON line on rank 0.

usage: torch_step_gpu.py --mode plain|ddp [--dims 784,2048,2048,10] [--batch 64] [--steps 50] [--warmup 10]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["plain", "ddp"], required=True)
    ap.add_argument("--dims", default="784,2048,2048,10")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args()
    dims = [int(d) for d in a.dims.split(",")]
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    layers = []
    for k in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[k], dims[k + 1]))
        if k + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    torch.manual_seed(7)
    model = torch.nn.Sequential(*layers).to(device)
    world = 1
    if a.mode == "ddp":
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl")
        world = dist.get_world_size()
        model = DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank + 1)
    x = torch.rand(a.batch, dims[0], generator=g)
    y = torch.randint(0, dims[-1], (a.batch,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True)).backward()
        opt.step()
        torch.cuda.synchronize(device)
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        print(json.dumps({"mode": a.mode, "world": world, "dims": "-".join(map(str, dims)),
                          "parameters": sum(p.numel() for p in model.parameters()), "batch": a.batch,
                          "steps": a.steps, "step_ms": statistics.median(times), "min_ms": min(times),
                          "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}))
    if a.mode == "ddp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
