"""Reference for test_optim.cpp: runs torch.optim on the parameters and gradients the test wrote.

usage: torch_optim.py IN OUT KIND key=value...
IN: first line the initial parameter values, then one line of gradients per step (space separated).
OUT: the final values, then one line per state slot (momentum_buffer, or exp_avg and exp_avg_sq).
"""
import sys

import torch

src, dst, kind = sys.argv[1], sys.argv[2], sys.argv[3]
args = {k: float(v) for k, v in (a.split("=") for a in sys.argv[4:])}
rows = [[float(x) for x in line.split()] for line in open(src) if line.strip()]
p = torch.nn.Parameter(torch.tensor(rows[0], dtype=torch.float32))
if kind == "sgd":
    opt = torch.optim.SGD([p], lr=args["lr"], momentum=args["momentum"], dampening=args["dampening"],
                          nesterov=bool(args["nesterov"]), weight_decay=args["weight_decay"], foreach=False)
    slots = ["momentum_buffer"] if args["momentum"] != 0 else []
else:
    opt = torch.optim.AdamW([p], lr=args["lr"], betas=(args["beta1"], args["beta2"]), eps=args["eps"],
                            weight_decay=args["weight_decay"], foreach=False)
    slots = ["exp_avg", "exp_avg_sq"]
for g in rows[1:]:
    p.grad = torch.tensor(g, dtype=torch.float32)
    opt.step()
with open(dst, "w") as out:
    out.write(" ".join(repr(float(x)) for x in p.detach()) + "\n")
    for s in slots:
        out.write(" ".join(repr(float(x)) for x in opt.state[p][s]) + "\n")
