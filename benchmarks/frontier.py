"""Quality per byte as a picture: KV tokens against 16 bits (x), perplexity increase (y).

    python -m benchmarks.frontier RESULTS.json [LATER.json ...] [--beside KVPRESS.json ...]
        [--without SETTING ...] --out PNG

redraws the frontier of a ``python -m benchmarks quality`` run (its results.json). A later run on
the same windows (its 16-bit perplexity the same) replaces the rows of the settings it ran again.
Rows measured on the same windows elsewhere go beside them: ``benchmarks.kvpress_rows``' output,
whose 16-bit row equals the engine's (each row is taken against its own run's 16-bit row).
``--without`` leaves settings out (a preset deleted since the run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import report

GOALS = ((3.5, 1.0), (5.0, 3.0), (6.5, 10.0))  # the targets: (KV tokens vs 16-bit, perplexity increase %)
# what a row measured elsewhere must share with the engine's run: (its key, the run's sizes key)
MARKERS = {"o": "the engine's pages", "s": "KIVI as published (transformers model)",
           "^": "kvpress (transformers model)"}
SAME_WINDOWS = (("ppl_windows", "ppl_windows"), ("chunk", "chunk"), ("contexts", "contexts"))


def frontier(result: dict, path, beside: list[dict] = ()) -> None:
    """A point per setting at the longest context: the engine's rows (circles), the KIVI reference
    rows on the transformers model (squares) and ``beside``'s rows (triangles, kvpress)."""
    from .quality import reference_spec  # quality draws this plot at the end of a run

    ctx = max(result["sizes"]["contexts"])
    points = [(r["setting"], r["kv_vs_16bit"], _increase(r, result["rows"][0], ctx),
               "s" if reference_spec(r["setting"]) else "o") for r in _plotted(result["rows"], ctx)]
    for other in beside:
        _check_same_windows(result, other)
        if other["rows"][0]["setting"] != "16-bit":
            raise SystemExit(f"--beside: the first row is {other['rows'][0]['setting']!r}, not the 16-bit one")
        points += [(_kvpress_name(r["setting"]), r["kv_vs_16bit"], _increase(r, other["rows"][0], ctx), "^")
                   for r in _plotted(other["rows"][1:], ctx)]
    if not points:
        return
    fig, ax = report.figure(1, (6.5, 5.2))
    widest = max(x for _, x, _, _ in points)
    for i, (name, x, y, marker) in enumerate(points):
        ax.scatter(x, y, marker=marker)
        # settings of one capacity lie close: alternate above and below; a second one's label, those
        # at the right edge and kvpress's (drawn among the engine's points) go left
        left = any(abs(o[1] - x) < 0.15 for o in points[:i]) or x > 0.85 * widest or marker == "^"
        ax.annotate(name, (x, y), fontsize=7, xytext=(-4 if left else 4, 3 if i % 2 else -9),
                    textcoords="offset points", ha="right" if left else "left")
    for marker in dict.fromkeys(m for *_, m in points):  # one legend entry a kind of row
        ax.scatter([], [], marker=marker, color="gray", label=MARKERS[marker])
    ax.set(xlabel="KV tokens vs 16-bit (same memory)", ylabel=f"perplexity increase @{ctx} (%)", yscale="symlog",
           title="quality per byte")
    ax.axhline(0, color="gray", lw=0.5)
    (left, right), (bottom, top) = ax.get_xlim(), ax.get_ylim()
    top = max(top, 1.5 * max(y for _, y in GOALS))
    label = "goals: " + ", ".join(f"{x:g}x within +{y:g}%" for x, y in GOALS)
    for x, y in GOALS:  # a point right of and below a corner meets that goal; one legend entry for all
        ax.plot([x, x, right], [bottom, y, y], ls=":", lw=0.8, color="gray", label=label)
        label = None
    ax.set(xlim=(left, right), ylim=(bottom, top))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=7)
    fig.subplots_adjust(bottom=0.27)
    report.save_figure(fig, path, f"{result['model']} ({result['dtype']}), {result['text']}, {result['device']}")


def merged_runs(runs: list[dict]) -> dict:
    """The first run with each later run's rows in place of its rows of the same setting (new
    settings after them); the runs must share model, text, windows and 16-bit perplexities."""
    merged = dict(runs[0], rows=list(runs[0]["rows"]))
    for later in runs[1:]:
        _check_same_windows(merged, later)
        base, again = merged["rows"][0], later["rows"][0]
        ctx = max(merged["sizes"]["contexts"])
        if abs(again[f"ppl_{ctx}"] / base[f"ppl_{ctx}"] - 1) > 1e-6:
            raise SystemExit(f"a later run's 16-bit perplexity @{ctx} is {again[f'ppl_{ctx}']:.6g}, the first's "
                             f"{base[f'ppl_{ctx}']:.6g}: not the same windows")
        index = {r["setting"]: i for i, r in enumerate(merged["rows"])}
        for row in later["rows"][1:]:
            if row["setting"] in index:
                merged["rows"][index[row["setting"]]] = row
            else:
                merged["rows"].append(row)
    return merged


def _kvpress_name(setting: str) -> str:
    """``expected_attention-0.8`` -> ``kvpress ExpAttn 0.8``: short enough to label a point."""
    for long, short in (("expected_attention-", "ExpAttn "), ("snapkv-", "SnapKV "), ("quanto-", "quanto ")):
        setting = setting.replace(long, short)
    return f"kvpress {setting}"


def _plotted(rows: list[dict], ctx: int) -> list[dict]:
    return [r for r in rows if "error" not in r and r.get("kv_vs_16bit") and f"ppl_{ctx}" in r]


def _increase(row: dict, base: dict, ctx: int) -> float:
    return 100 * (row[f"ppl_{ctx}"] / base[f"ppl_{ctx}"] - 1)


def _check_same_windows(result: dict, other: dict) -> None:
    """``other`` (a later quality run, or kvpress rows) measured the same model, text and windows."""
    for key, sizes_key in (("model", None), ("text", None), *SAME_WINDOWS):
        ours = result[key] if sizes_key is None else result["sizes"][sizes_key]
        theirs = other.get(key) if "sizes" not in other or sizes_key is None else other["sizes"][sizes_key]
        if theirs != ours:
            raise SystemExit(f"{key} is {theirs!r} in a run to add, {ours!r} in the first quality run: "
                             "only runs of the same model, text and windows go in one plot")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+", help="a quality run's results.json, then later runs' (if any)")
    p.add_argument("--beside", type=Path, nargs="*", default=[], help="benchmarks.kvpress_rows output (JSON)")
    p.add_argument("--without", nargs="*", default=[], metavar="SETTING", help="settings left out of the plot")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    merged = merged_runs([json.loads(r.read_text()) for r in args.results])
    unknown = set(args.without) - {r["setting"] for r in merged["rows"]}
    if unknown:
        raise SystemExit(f"--without {' '.join(sorted(unknown))}: no such setting in the runs")
    merged["rows"] = [r for r in merged["rows"] if r["setting"] not in args.without]
    frontier(merged, args.out, [json.loads(b.read_text()) for b in args.beside])
    print(args.out)


if __name__ == "__main__":
    main()
