"""The Fashion-MNIST example's training in PyTorch: the same MLP (784-256-128-10, ReLU, softmax cross-entropy), SGD with
momentum 0.9, lr 0.05 falling on a cosine to 0 over every step, batch 64 per rank, the same standardized pixels,
DistributedDataParallel over gloo with a DistributedSampler (shuffled, seed 42), one thread per rank. The anchor of
run_epoch.py. Reads torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 prints one JSON line per epoch with
its training seconds (the slowest rank's) and the test accuracy.

usage: torchrun --nproc_per_node N torch_fashion_mnist.py [--epochs E] [--batch B] [--data DIR]
"""
import argparse
import gzip
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def read_idx(path):
    """An IDX file's array (gzip'd), as examples/common/idx.hpp reads it."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(data_dir):
    """Training and test images standardized with the training set's mean and deviation, and their labels."""
    train = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz")).reshape(-1, 784).astype(np.float32) / 255
    test = read_idx(os.path.join(data_dir, "t10k-images-idx3-ubyte.gz")).reshape(-1, 784).astype(np.float32) / 255
    mean, std = train.mean(), train.std()
    train_y = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz")).astype(np.int64)
    test_y = read_idx(os.path.join(data_dir, "t10k-labels-idx1-ubyte.gz")).astype(np.int64)
    return (torch.from_numpy((train - mean) / std), torch.from_numpy(train_y),
            torch.from_numpy((test - mean) / std), torch.from_numpy(test_y))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_x, train_y, test_x, test_y = load(a.data)
    torch.manual_seed(1234)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(
        256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    sampler = torch.utils.data.distributed.DistributedSampler(range(len(train_x)), shuffle=True, seed=42)
    total = math.ceil(len(sampler) / a.batch) * a.epochs
    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(sampler)))
        dist.barrier()
        t0 = time.perf_counter()
        for b in range(0, len(order), a.batch):
            idx = order[b:b + a.batch]
            for g in opt.param_groups:
                g["lr"] = 0.5 * a.lr * (1 + math.cos(math.pi * min(step, total) / total))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx]).backward()
            opt.step()
            step += 1
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        with torch.no_grad():
            correct = (model.module(test_x).argmax(1) == test_y).sum().item()
        if rank == 0:
            print(json.dumps({"bench": "torch_fashion_mnist", "world": world, "epoch": epoch + 1,
                              "train_seconds": round(seconds.item(), 3), "test_accuracy": correct / len(test_y)}),
                  flush=True)
    os._exit(0)  # as the other PyTorch anchors: no process-group teardown


if __name__ == "__main__":
    main()
