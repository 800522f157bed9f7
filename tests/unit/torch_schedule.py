"""Reference for test_schedule.cpp: torch.optim.lr_scheduler's learning rates over 300 steps.

usage: torch_schedule.py OUT
OUT: one line per case and parameter group, "<case> <group> lr_0 ... lr_299": the lr each optimizer step used,
for two groups with base lrs 0.1 and 0.02 (the schedulers are driven as in a training loop: opt.step(), then
scheduler.step()).
"""
import sys

import torch
from torch.optim import lr_scheduler as S

STEPS = 300


def cases():
    yield "constant", lambda o: None
    yield "linear", lambda o: S.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=37)
    yield "cosine", lambda o: S.CosineAnnealingLR(o, T_max=300, eta_min=0.001)
    yield "warmup_cosine", lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.01, end_factor=1.0, total_iters=20),
            S.CosineAnnealingLR(o, T_max=280, eta_min=0.001)], milestones=[20])
    yield "step_decay", lambda o: S.StepLR(o, step_size=30, gamma=0.5)
    yield "one_cycle", lambda o: S.OneCycleLR(o, max_lr=[0.1, 0.02], total_steps=300, cycle_momentum=False)
    yield "one_cycle_three_linear", lambda o: S.OneCycleLR(o, max_lr=[0.1, 0.02], total_steps=300, pct_start=0.25,
                                                           div_factor=10, final_div_factor=100, three_phase=True,
                                                           anneal_strategy="linear", cycle_momentum=False)
    yield "sequence", lambda o: S.SequentialLR(
        o, [S.StepLR(o, step_size=10, gamma=0.7), S.LinearLR(o, start_factor=0.5, end_factor=0.9, total_iters=40),
            S.CosineAnnealingLR(o, T_max=180, eta_min=0.0005)], milestones=[50, 120])
    yield "lambda", lambda o: S.LambdaLR(o, lambda t: 0.95 ** t * (1 + t % 7))


with open(sys.argv[1], "w") as out:
    for name, make in cases():
        a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.02}], lr=0.1)
        sched = make(opt)
        rows = [[], []]
        for _ in range(STEPS):
            for g, row in zip(opt.param_groups, rows):
                row.append(g["lr"])
            opt.step()
            if sched is not None:
                sched.step()
        for g, row in enumerate(rows):
            out.write(name + " " + str(g) + " " + " ".join(repr(float(x)) for x in row) + "\n")
