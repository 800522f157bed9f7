#!/usr/bin/python3
"""Plots persistent memory per rank against N for each policy from the tables ddp_bench_sharding printed into
docs/bench/parallel_sharding.md (both models), with the ZeRO formula dashed, into docs/img/parallel_sharding.png.

usage: bench/parallel_sharding/plot_sharding.py [MARKDOWN] [PNG]
"""

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tables(path):
    """{model title: [(policy, n, persistent, formula), ...]} from the markdown's result tables."""
    out, title = {}, None
    for line in open(path, encoding="utf-8"):
        if line.startswith("## "):  # a model's section, or another (the sockets' repeat, the readings)
            title = line[3:].strip() if "MLP" in line else None
            if title:
                out[title] = []
        elif title and line.startswith("| ") and not line.startswith("| policy") and "hybrid" not in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            out[title].append((cells[0], int(cells[1]), float(cells[5]), float(cells[6])))
    return {k: v for k, v in out.items() if v}


def main():
    md = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "bench", "parallel_sharding.md")
    png = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "docs", "img", "parallel_sharding.png")
    data = tables(md)
    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 4.5), squeeze=False)
    for ax, (title, rows) in zip(axes[0], data.items()):
        colors = {"replicate": "C0", "shard_grad_op": "C1", "full_shard": "C3"}
        for policy in dict.fromkeys(r[0] for r in rows):
            pts = sorted((n, p, f) for name, n, p, f in rows if name == policy)
            base, lean = policy.split()[0], policy.endswith("lean")
            color = colors.get(base, "C2")
            ax.plot([n for n, _, _ in pts], [p for _, p, _ in pts], "s-." if lean else "o-", color=color,
                    label=f"{policy} (measured)" if lean or base == "replicate" else f"{policy}, kept buffers (measured)")
            if not lean:
                ax.plot([n for n, _, _ in pts], [f for _, _, f in pts], ":", color=color, linewidth=2.5, alpha=0.6,
                        label=f"{base} (ZeRO formula)")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ranks N")
        ax.set_ylabel("persistent MiB per rank")
        ax.set_xticks(sorted({r[1] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print("wrote", png)


if __name__ == "__main__":
    main()
