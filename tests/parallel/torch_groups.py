"""Reference for test_optim.cpp's grouped AdamW: torch.optim.AdamW with parameter groups and a warmup + cosine
SequentialLR, in float64.

usage: torch_groups.py IN OUT
IN: one line of initial values per parameter (fc1.weight, fc1.bias, fc2.weight, fc2.bias), then per step one line
of gradients per parameter, in that order.
OUT: per parameter, its final values, exp_avg and exp_avg_sq (three lines).
"""
import sys

import torch
from torch.optim import lr_scheduler as S

rows = [[float(x) for x in line.split()] for line in open(sys.argv[1]) if line.strip()]
names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
params = [torch.nn.Parameter(torch.tensor(r, dtype=torch.float64)) for r in rows[:4]]
p = dict(zip(names, params))
lr = 0.01
opt = torch.optim.AdamW([
    {"params": [p["fc1.weight"]]},                                                 # the defaults
    {"params": [p["fc1.bias"], p["fc2.bias"]], "weight_decay": 0.0},               # no_decay: *.bias
    {"params": [p["fc2.weight"]], "lr": lr * 0.5, "betas": (0.8, 0.999)},          # fc2: fc2.w*
], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, foreach=False)
sched = S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=2),
                             S.CosineAnnealingLR(opt, T_max=4, eta_min=0.0)], milestones=[2])
grads = rows[4:]
for s in range(len(grads) // 4):
    for k, q in enumerate(params):
        q.grad = torch.tensor(grads[4 * s + k], dtype=torch.float64)
    opt.step()
    sched.step()
with open(sys.argv[2], "w") as out:
    for q in params:
        for row in (q.detach(), opt.state[q]["exp_avg"], opt.state[q]["exp_avg_sq"]):
            out.write(" ".join(repr(float(x)) for x in row) + "\n")
