"""Tables and CSV for benchmark results."""

from __future__ import annotations

import csv
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    cols = list(rows[0])

    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def plot_by_batch(ax: Any, rows: Sequence[dict[str, Any]], metric: str, xlabel: str = "batch size") -> None:
    """On a matplotlib axis: one line per policy of ``metric`` against batch size (log2 x axis)."""
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = [(r["batch"], r[metric]) for r in rows if r["policy"] == pol]
        ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", ms=3, label=pol)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_title(metric, fontsize=9)


def plot_shares(ax: Any, counts: Counter[int], label: str, *, bar: bool = False, **style: Any) -> Any:
    """On a matplotlib axis: each value's share of ``counts`` (a line, or bars); returns the artists drawn."""
    xs = sorted(counts)
    total = sum(counts.values()) or 1
    ys = [counts[x] / total for x in xs]
    return ax.bar(xs, ys, alpha=0.6, label=label, **style) if bar else ax.plot(xs, ys, label=label, **style)
