#!/usr/bin/python3
"""Draws docs/img/step_flow.svg: the data flow of one data_parallel step under each sharding policy, as
docs/architecture.md describes it. One row per policy, one box per stage, coloured by what the stage does.
Deterministic (fixed SVG hash salt, no date), so regenerating an unchanged picture gives the same bytes.

    /usr/bin/python3 scripts/draw_step_flow.py
"""

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from matplotlib.patches import FancyBboxPatch  # noqa: E402

OUTPUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "img" / "step_flow.svg"

KINDS = {  # what a stage does: its colour and its legend entry
    "compute": ("#e8e8e8", "user code (forward, backward)"),
    "memory": ("#fde2b8", "memory: arenas, pooled unit buffers"),
    "comm": ("#bcd7f5", "communication (asynchronous work)"),
    "optim": ("#c8ecc4", "optimizer over flat spans"),
}

# Each policy: its stages in order (label, kind). "\n" breaks a label.
POLICIES = [
    ("replicate\n(DDP)", [
        ("forward\nparameters in\nthe value arena", "compute"),
        ("backward\ngradient_ready(p)\nfills buckets", "compute"),
        ("bucket full:\nall_reduce(avg)\nthrough the hook", "comm"),
        ("step: wait\nall buckets", "comm"),
        ("optimizer over\nthe whole arenas", "optim"),
    ]),
    ("shard_grad_op\n(ZeRO-2)", [
        ("forward\nfull parameters\nin the value arena", "compute"),
        ("unshard scope:\nunit gradients in\na pooled buffer", "memory"),
        ("bucket full:\nreduce_scatter(avg)\ninto owned block", "comm"),
        ("step: wait;\noptimizer over\nowned blocks", "optim"),
        ("all_gather each\nbucket back into\nthe full values", "comm"),
    ]),
    ("full_shard\n(ZeRO-3)", [
        ("unshard scope:\nall_gather unit\n(+ prefetch next)", "comm"),
        ("forward / backward\nof the unit;\nreshard after", "compute"),
        ("unit gradients in\na pooled buffer", "memory"),
        ("bucket full:\nreduce_scatter(avg)\ninto owned block", "comm"),
        ("step: wait;\noptimizer over\nowned blocks", "optim"),
    ]),
    ("hybrid<Inner>\n(HSDP)", [
        ("Inner inside a\ngroup of G ranks\n(LOCAL_WORLD_SIZE)", "compute"),
        ("bucket full:\nreduce_scatter(avg)\nin the group", "comm"),
        ("all_reduce(avg) of\nthe block across\ngroups (overlapped)", "comm"),
        ("step: wait;\noptimizer over\nowned blocks", "optim"),
        ("Inner's after-step\n(shard_grad_op:\nall_gather in group)", "comm"),
    ]),
]

BOX_W, BOX_H, GAP_X, ROW_H, LABEL_W = 2.3, 1.05, 0.45, 1.5, 1.9


def main():
    matplotlib.rcParams["svg.hashsalt"] = "ddp-step-flow"
    stages = max(len(s) for _, s in POLICIES)
    width = LABEL_W + stages * (BOX_W + GAP_X)
    height = len(POLICIES) * ROW_H + 1.4
    fig, ax = plt.subplots(figsize=(width * 0.95, height * 0.95))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.set_title("One data_parallel step per sharding policy (construction done: arenas laid out, buckets planned)",
                 fontsize=11)
    for row, (name, policy_stages) in enumerate(POLICIES):
        y = height - 0.6 - (row + 1) * ROW_H + (ROW_H - BOX_H) / 2
        ax.text(0.1, y + BOX_H / 2, name, ha="left", va="center", fontsize=10, fontweight="bold")
        for i, (label, kind) in enumerate(policy_stages):
            x = LABEL_W + i * (BOX_W + GAP_X)
            ax.add_patch(FancyBboxPatch((x, y), BOX_W, BOX_H, boxstyle="round,pad=0.02,rounding_size=0.12",
                                        facecolor=KINDS[kind][0], edgecolor="#555555", linewidth=0.8))
            ax.text(x + BOX_W / 2, y + BOX_H / 2, label, ha="center", va="center", fontsize=8)
            if i + 1 < len(policy_stages):
                ax.annotate("", xy=(x + BOX_W + GAP_X - 0.03, y + BOX_H / 2), xytext=(x + BOX_W + 0.03, y + BOX_H / 2),
                            arrowprops={"arrowstyle": "->", "color": "#333333"})
    for i, (colour, text) in enumerate(KINDS.values()):
        x = LABEL_W + i * (width - LABEL_W) / len(KINDS)
        ax.add_patch(FancyBboxPatch((x, 0.25), 0.35, 0.3, boxstyle="round,pad=0.02", facecolor=colour,
                                    edgecolor="#555555", linewidth=0.8))
        ax.text(x + 0.45, 0.4, text, ha="left", va="center", fontsize=8)
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUTPUT, format="svg", bbox_inches="tight", metadata={"Date": None})
    print(f"wrote {OUTPUT.relative_to(OUTPUT.parent.parent.parent)}")


if __name__ == "__main__":
    main()
