"""Reads a safetensors file written by ddp with PyTorch (no `safetensors` package: the format is parsed here with
json + torch.frombuffer), checks ddp's checksum (format 2: the whole file, its own 16 digits counted as '0'), loads the parameters into a torch MLP with strict names, and writes
a second file the PyTorch way (no ddp metadata) holding each tensor transformed (floats: 2x+1, integers: x+1).

usage: torch_interop.py IN.safetensors OUT.safetensors
"""
import json
import struct
import sys

import torch

DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
          "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8}


def read(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[info["dtype"]]) if end > begin else \
            torch.empty(0, dtype=DTYPES[info["dtype"]])
        tensors[name] = t.reshape(info["shape"])
    return tensors, meta, blob


def fnv1a(data):
    h = 14695981039346656037
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def sealed(blob):
    """The file's bytes with the 16 digits of its ddp.checksum read as '0', as ddp takes the checksum."""
    marker = b'"ddp.checksum":"'
    at = blob.index(marker) + len(marker)
    assert blob.find(marker, at) < 0, "ddp.checksum appears twice"
    return blob[:at] + b"0" * 16 + blob[at + 16:]


def write(path, tensors, meta):
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": [k for k, v in DTYPES.items() if v == t.dtype][0], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    header["__metadata__"] = meta
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def main():
    tensors, meta, blob = read(sys.argv[1])
    assert meta["ddp.format"] == "2", "expected ddp's format 2, found " + meta["ddp.format"]
    assert meta["ddp.checksum"] == fnv1a(sealed(blob)), "ddp.checksum differs from FNV-1a of the file"
    params = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
    if "fc1.weight" in params:  # a checkpoint of the test MLP: PyTorch loads it by name, strictly
        fc1, fc2 = params["fc1.weight"].shape, params["fc2.weight"].shape
        model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(fc1[1], fc1[0]), "fc2": torch.nn.Linear(fc2[1], fc2[0])})
        model.load_state_dict(params, strict=True)
        assert torch.equal(model["fc2"].bias.data, params["fc2.bias"])
    out = {}
    for name, t in tensors.items():
        out[name] = (t * 2 + 1).to(t.dtype) if t.is_floating_point() else t + 1
    out["python.extra"] = torch.arange(5, dtype=torch.float32)
    write(sys.argv[2], out, {"written_by": "torch " + torch.__version__})
    print("torch_interop: %d tensors read, checksum ok, written back" % len(tensors))


if __name__ == "__main__":
    main()
