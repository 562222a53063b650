"""Statistics, tables and plots shared by the benchmarks (``specserve bench``), the straggler study
(``load/straggler.py``), the simulator (``load/simulate.py``) and the load client (``load/client.py``).

A result row is a dict; sweep rows carry ``workload``, ``batch`` and ``policy`` (a label) and the figures named
in ``SWEEP_COLS`` / ``TTFT_TPOT_COLS``. matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import csv
import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# ─────────────────────────── statistics ───────────────────────────


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it (rank
    ceil(q/100 n), from 1); NaN for none."""
    if not values:
        return math.nan
    v = sorted(values)
    return v[min(len(v), max(1, math.ceil(q / 100 * len(v)))) - 1]


def p50_p99(name: str, values: Sequence[float]) -> dict[str, float]:
    """{"p50_<name>": ..., "p99_<name>": ...} of ``values`` (NaN for none)."""
    return {f"p50_{name}": percentile(values, 50), f"p99_{name}": percentile(values, 99)}


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval for the median of what ``values`` sample: their k-th smallest and k-th largest,
    k the largest rank whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is at least ``confidence``, or 1 where even
    the whole range covers less (5 values: 93.75%). Returns (low, high, coverage); NaNs for no values."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    v = sorted(values)

    def coverage(k: int) -> float:  # P(x_(k) <= median <= x_(n-k+1)) for any continuous distribution
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while 2 * (k + 1) <= n + 1 and coverage(k + 1) >= confidence:
        k += 1
    return v[k - 1], v[n - k], coverage(k)


def tpot(first_s: float | None, last_s: float | None, tokens: int) -> float | None:
    """Time per output token after the first: (last - first) / (tokens - 1); None below two tokens."""
    if first_s is None or last_s is None or tokens < 2:
        return None
    return (last_s - first_s) / (tokens - 1)


def median_row(runs: Sequence[Mapping[str, Any]], keep: Iterable[str] = ("batch",)) -> dict[str, Any]:
    """One row from repeated runs of a point: the median of every numeric field (except those in ``keep``) over
    the runs where it is a number (NaN, e.g. a pass that speculated on no step has no mean SL, is left out: sorted
    among numbers it would put an order-dependent value in the median's place; NaN when every run has NaN); other
    fields from the first run."""
    keep = set(keep)
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, int | float) and not isinstance(v, bool) and k not in keep:
            values = [r[k] for r in runs if not math.isnan(r[k])]
            out[k] = statistics.median(values) if values else math.nan
    return out


def add_vs_baseline(rows: Sequence[dict[str, Any]], baseline: str, key: str = "vs_plain") -> None:
    """Set ``row[key]`` = tokens/s over that of the ``baseline`` policy at the same workload and batch (NaN
    without one)."""
    base = {(r["workload"], r["batch"]): r["tok_s"] for r in rows if r["policy"] == baseline}
    for r in rows:
        b = base.get((r["workload"], r["batch"]))
        r[key] = r["tok_s"] / b if b else math.nan


def cap_gains(rows: Sequence[Mapping[str, Any]], pairs: Mapping[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """Per workload, drafting and batch: DSDE with SL_cap against DSDE without (``pairs``: drafting -> (label
    with the cap, label without)): throughputs, the gain, idle fractions, and each one's scaling over batch 1."""
    by = {(r["workload"], r["batch"], r["policy"]): r for r in rows}
    out = []
    for drafting, (cap, nocap) in pairs.items():
        for w, b in dict.fromkeys((r["workload"], r["batch"]) for r in rows):
            if (w, b, cap) not in by or (w, b, nocap) not in by:
                continue
            with_cap, without = by[w, b, cap], by[w, b, nocap]
            row = {
                "workload": w,
                "drafting": drafting,
                "batch": b,
                "nocap_tok_s": without["tok_s"],
                "cap_tok_s": with_cap["tok_s"],
                "cap_gain": with_cap["tok_s"] / without["tok_s"] - 1.0,
                "nocap_idle": without["idle_fraction"],
                "cap_idle": with_cap["idle_fraction"],
            }
            for pol, key in ((nocap, "scaling_nocap"), (cap, "scaling_cap")):
                base = by.get((w, 1, pol))
                row[key] = by[w, b, pol]["tok_s"] / base["tok_s"] if base else math.nan
            out.append(row)
    return out


# ─────────────────────────── tables ───────────────────────────

SWEEP_COLS = ("workload", "batch", "policy", "tok_s", "vs_plain", "idle_fraction", "mean_sl", "mean_cap")
TTFT_TPOT_COLS = ("p50_ttft_s", "p99_ttft_s", "p50_tpot_s", "p99_tpot_s")


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """All fields of the rows (the first row's order); nothing is written for no rows."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str] | None = None) -> str:
    """A markdown table of ``cols`` (default: every field of the first row); floats with 3 decimals."""
    if not rows:
        return ""
    cols = list(rows[0]) if cols is None else list(cols)

    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# ─────────────────────────── plots ───────────────────────────


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def workload_slugs(workloads: Iterable[str]) -> dict[str, str]:
    """File-name part of each workload label: "synthetic" for SYNTHETIC mixes, else "real", where that kind has one
    label here; else the kind and the label's own words (two real workloads, or two mixes, wrote one file)."""
    labels = list(dict.fromkeys(workloads))
    kind = {w: "synthetic" if w.upper().startswith("SYNTHETIC") else "real" for w in labels}
    counts = Counter(kind.values())

    def words(label: str) -> str:
        return re.sub(r"[^A-Za-z0-9.+-]+", "_", label.split(" ", 1)[1] if " " in label else label).strip("_")

    return {w: kind[w] if counts[kind[w]] == 1 else f"{kind[w]}_{words(w)}" for w in labels}


def plot_by_batch(ax: Any, rows: Sequence[Mapping[str, Any]], metric: str, xlabel: str = "batch size") -> None:
    """On a matplotlib axis: one line per policy of ``metric`` against batch size (log2 x axis)."""
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = [(r["batch"], r[metric]) for r in rows if r["policy"] == pol]
        ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", ms=3, label=pol)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_title(metric, fontsize=9)


def plot_workloads(
    rows: Sequence[Mapping[str, Any]],
    metrics: Sequence[str],
    out: Path,
    *,
    prefix: str,
    title: str,
    grid: tuple[int, int] | None = None,
    panel_size: tuple[float, float] = (3.75, 3.4),
    xlabel: str = "batch size",
    dpi: int = 72,
) -> list[Path]:
    """One figure per workload: a panel per metric against batch size, one line per policy. Saved as
    ``out/<prefix>_<real|synthetic>.png`` (``workload_slugs``); ``title`` may use ``{workload}``. Returns the paths
    written."""
    plt = pyplot()
    nrows, ncols = grid or (1, len(metrics))
    paths = []
    slugs = workload_slugs(str(r["workload"]) for r in rows)
    for workload in dict.fromkeys(r["workload"] for r in rows):
        sub = [r for r in rows if r["workload"] == workload]
        fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows), squeeze=False)
        for metric, ax in zip(metrics, axes.flat, strict=False):
            plot_by_batch(ax, sub, metric, xlabel)
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(title.format(workload=workload), fontsize=10)
        fig.tight_layout()
        path = out / f"{prefix}_{slugs[str(workload)]}.png"
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_shares(ax: Any, counts: Counter[int], label: str, *, bar: bool = False, **style: Any) -> Any:
    """On a matplotlib axis: each value's share of ``counts`` (a line, or bars); returns the artists drawn."""
    xs = sorted(counts)
    total = sum(counts.values()) or 1
    ys = [counts[x] / total for x in xs]
    return ax.bar(xs, ys, alpha=0.6, label=label, **style) if bar else ax.plot(xs, ys, label=label, **style)


def plot_sl(
    series: Sequence[tuple[str, Counter[int], Counter[int] | None, Counter[int]]],
    path: Path,
    *,
    batch: int,
    title: str,
    sl_title: str = "drafted SL per row and step",
) -> Path:
    """Two panels at one batch size: the drafted SL's distribution per policy (with the SL the policy wanted
    before SL_cap, dashed, where given) and SL_cap's distribution per step. ``series``: (policy label, drafted SL
    counts, SL-before-the-cap counts or None, SL_cap counts)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    for label, drafted, wanted, caps in series:
        if drafted:
            line = plot_shares(axes[0], drafted, label, marker="o", ms=3)
            if wanted and caps:
                plot_shares(axes[0], wanted, f"{label}: SL before the cap", ls="--", lw=1, color=line[0].get_color())
        if caps:
            plot_shares(axes[1], caps, label, bar=True)
    axes[0].set_title(f"{sl_title} (B={batch})", fontsize=9)
    axes[1].set_title(f"SL_cap per step (B={batch})", fontsize=9)
    for ax in axes:
        ax.set_xlabel("SL")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path
