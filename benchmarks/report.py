"""Where a benchmark run writes: a dated folder with results.json, table.md, plots and logs."""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path


def results_dir(bench: str, root: Path) -> Path:
    """``root/YYYY-MM-DD-HHMM-<bench>/``, suffixed ``-2``, ``-3``... when that minute is taken."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    out = Path(root) / f"{stamp}-{bench}"
    n = 1
    while out.exists():
        n += 1
        out = Path(root) / f"{stamp}-{bench}-{n}"
    (out / "logs").mkdir(parents=True)
    return out


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2e}"
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "/").replace("\n", " ")


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """``columns``: (key in each row, header)."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def write(out_dir: Path, data: dict, table: str) -> None:
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    (out_dir / "table.md").write_text(table + "\n")


def error_line(log: str) -> str:
    """The most telling line of a failed run's log: the last exception or error message."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "error:" in ln) and not ln.startswith("File "):
            return ln[-400:]
    return lines[-1][-400:] if lines else "no output"


def device() -> str:
    """The machine in words, for result files and docs."""
    import platform

    import torch
    import vllm

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, vLLM {vllm.__version__}"
    return f"{os.cpu_count()}-core {platform.machine()} CPU, vLLM {vllm.__version__}"


def figure(ncols: int, figsize: tuple[float, float]):
    """A headless matplotlib figure with ``ncols`` axes side by side: (fig, axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize)


def save_figure(fig, path: Path, title: str | None = None) -> None:
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
