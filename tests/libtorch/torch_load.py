"""Loads a ddp checkpoint of tests/libtorch/models.hpp's MLP (fc1: 6 -> 9, fc2: 9 -> 3) into a PyTorch module with
strict names (no `safetensors` package: the format is parsed with json + torch.frombuffer) and prints the module's
output on a fixed input, space-separated.

usage: torch_load.py CHECKPOINT.safetensors
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


def read(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    data = blob[8 + n:]
    out = {}
    for name, info in header.items():
        assert info["dtype"] == "F32", name
        begin, end = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.float32).reshape(info["shape"])
    return out


def main():
    model = MLP()
    model.load_state_dict(read(sys.argv[1]), strict=True)
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    with torch.no_grad():
        print(" ".join(repr(v) for v in model(x).flatten().tolist()))


if __name__ == "__main__":
    main()
