"""Loads a checkpoint of the Eigen test MLP (7-13-11-5, tanh) into torch.nn.Linear layers by name, strictly, and
checks it against what the C++ side wrote beside it (CHECKPOINT.json): every weight and bias equal to the Eigen
model's, read index by index in nn.Linear's [out, in] layout, and the logits of a batch within 1e-5.

usage: torch_linear.py CHECKPOINT.safetensors
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoint"))
from torch_interop import read  # noqa: E402  (the safetensors reader without the safetensors package)


def main():
    path = sys.argv[1]
    tensors, _, _ = read(path)
    expected = json.load(open(path + ".json"))
    params = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
    layers = {}
    for name in ("fc1", "fc2", "fc3"):
        out_features, in_features = params[name + ".weight"].shape
        layers[name] = torch.nn.Linear(in_features, out_features)
    model = torch.nn.ModuleDict(layers)
    model.load_state_dict(params, strict=True)
    for name, p in model.named_parameters():
        want = torch.tensor(expected[name], dtype=torch.float32)
        assert p.shape == want.shape, f"{name}: shape {list(p.shape)} in the checkpoint, {list(want.shape)} in Eigen"
        assert torch.equal(p.data, want), f"{name}: values differ from the Eigen model's, read as nn.Linear's [out, in]"
    x = torch.tensor(expected["x"], dtype=torch.float32).reshape(expected["n"], -1)
    with torch.no_grad():
        logits = model["fc3"](torch.tanh(model["fc2"](torch.tanh(model["fc1"](x)))))
    want = torch.tensor(expected["logits"], dtype=torch.float32).reshape(logits.shape)
    assert torch.allclose(logits, want, rtol=1e-5, atol=1e-6), f"logits differ: {logits} vs {want}"
    print(f"torch_linear: {path}: {len(params)} tensors load into nn.Linear, logits agree")


if __name__ == "__main__":
    main()
