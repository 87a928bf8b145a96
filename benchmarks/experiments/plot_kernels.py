"""Plot a kernels.json (from benchmarks/kernels.py): decode time per KV format, and share of copy bandwidth.

    python benchmarks/experiments/plot_kernels.py results/kernels.json docs/results/kernels.png
"""

from __future__ import annotations

import json
import sys


def plot(src: str, dst: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    # the main table: each shape's FlashAttention baseline and our formats at their defaults
    rows = [r for r in data["rows"] if "=" not in r["kernel"] and not r["kernel"].startswith("write")
            and " b" not in r["shape"]]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sel = [r for r in rows if r["shape"] == shape]
        names = [r["kernel"].replace("vLLM FlashAttention bf16", "FA bf16") for r in sel]
        us = [r["ms"] * 1e3 for r in sel]
        colors = ["tab:gray" if "FA" in n else "tab:blue" for n in names]
        bars = ax.bar(names, us, color=colors)
        for bar, r in zip(bars, sel):
            ax.annotate(f"{100 * r['of_copy_bw']:.0f}% bw", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{shape}: batch {data['batch']}, context {data['ctx']}")
        ax.set_ylabel("decode attention, us (lower is better)")
        ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{data['device']} (copy {data['copy_GBps']:.0f} GB/s); ours: 128-token pages")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
