"""Loads a ddp checkpoint of tests/libtorch/models.hpp's MLP (fc1: 6 -> 9, fc2: 9 -> 3), or with `bn` of
scenarios.hpp's bn_net (fc: 6 -> 5, BatchNorm1d(5) with its buffers, a frozen head.weight: 5 -> 3), into a PyTorch
module with strict names (no `safetensors` package: the format is parsed with json + torch.frombuffer) and prints the
module's output in eval mode on a fixed input, space-separated.

usage: torch_load.py CHECKPOINT.safetensors [mlp|bn]
"""
import json
import struct
import sys

import torch


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 9)
        self.fc2 = torch.nn.Linear(9, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 5)
        self.bn = torch.nn.BatchNorm1d(5)
        self.head = torch.nn.Linear(5, 3)
        self.head.weight.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


DTYPES = {"F32": torch.float32, "I64": torch.int64}


def read(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    data = blob[8 + n:]
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def main():
    model = BNNet() if sys.argv[2:] == ["bn"] else MLP()
    model.load_state_dict(read(sys.argv[1]), strict=True)
    model.eval()
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    with torch.no_grad():
        print(" ".join(repr(v) for v in model(x).flatten().tolist()))


if __name__ == "__main__":
    main()
