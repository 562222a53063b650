"""The statistics every benchmark and study reports through (``specserve.bench.stats``), against values worked
out by hand."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from specserve.bench.stats import add_vs_baseline, median_interval, median_row, p50_p99, percentile


def test_percentile_is_the_nearest_rank() -> None:
    values = list(range(1, 152))  # 1..151, shuffled below: p99 is the value at rank ceil(0.99 * 151) = 150
    shuffled = values[::2] + values[1::2]
    assert percentile(shuffled, 99) == 150
    assert percentile([4, 1, 3, 2], 50) == 2  # rank ceil(2) = 2: the lower middle, for any even count
    assert percentile([6, 1, 5, 2, 4, 3], 50) == 3
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert percentile([7.5], 99) == 7.5
    assert math.isnan(percentile([], 50))
    assert p50_p99("ttft_s", [0.1, 0.4, 0.2, 0.3]) == {"p50_ttft_s": 0.2, "p99_ttft_s": 0.4}


def test_median_row_takes_each_numeric_field_s_median_and_keeps_the_rest() -> None:
    runs = [
        {"batch": 4, "policy": "plain", "tok_s": 10.0, "steps": 5, "ok": True},
        {"batch": 4, "policy": "plain", "tok_s": 30.0, "steps": 9, "ok": False},
        {"batch": 4, "policy": "plain", "tok_s": 20.0, "steps": 1, "ok": False},
    ]
    assert median_row(runs) == {"batch": 4, "policy": "plain", "tok_s": 20.0, "steps": 5, "ok": True}


def test_median_row_leaves_out_nan_whatever_the_order_of_the_runs() -> None:
    # a pass that speculated on no step has no mean SL: NaN, which sorts nowhere among numbers
    values = [1.0, math.nan, 2.0, 3.0, math.nan]
    for order in itertools.permutations(values):
        row = median_row([{"batch": 1, "mean_sl": v} for v in order])
        assert row["mean_sl"] == 2.0, order
    assert math.isnan(median_row([{"batch": 1, "mean_sl": math.nan}] * 3)["mean_sl"])


def test_vs_baseline_divides_by_the_baseline_at_the_same_workload_and_batch() -> None:
    rows = [
        {"workload": "real", "batch": 1, "policy": "plain", "tok_s": 50.0},
        {"workload": "real", "batch": 1, "policy": "ddd", "tok_s": 60.0},
        {"workload": "real", "batch": 4, "policy": "plain", "tok_s": 100.0},
        {"workload": "real", "batch": 4, "policy": "ddd", "tok_s": 90.0},
        {"workload": "synthetic", "batch": 1, "policy": "ddd", "tok_s": 70.0},  # no plain row beside it
    ]
    add_vs_baseline(rows, "plain")
    assert [r["vs_plain"] for r in rows[:4]] == [1.0, 1.2, 1.0, 0.9]
    assert math.isnan(rows[4]["vs_plain"])


def test_median_interval_takes_the_order_statistics_the_binomial_coverage_allows() -> None:
    # six values: the range covers the median with 1 - 2 / 2^6; the next ranks in would cover only 1 - 2 * 7 / 64
    assert median_interval([5.0, 1.0, 4.0, 2.0, 6.0, 3.0]) == (1.0, 6.0, 0.96875)
    ten = [7.0, 2.0, 9.0, 4.0, 1.0, 10.0, 3.0, 8.0, 5.0, 6.0]
    assert median_interval(ten) == (2.0, 9.0, 1 - 2 * (1 + 10) / 1024)  # ranks 2 and 9: 97.85%
    assert median_interval(ten, 0.75) == (3.0, 8.0, 1 - 2 * (1 + 10 + 45) / 1024)  # ranks 3 and 8: 89.06%
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, 0.9375)  # five values: the range, below 95%
    twelve = [float(x) for x in range(12, 0, -1)]  # twelve passes, as the docs' sweeps: ranks 3 and 10, 96.1%
    assert median_interval(twelve) == (3.0, 10.0, 1 - 2 * (1 + 12 + 66) / 4096)
    assert median_interval([0.9]) == (0.9, 0.9, 0.0)
    assert all(math.isnan(x) for x in median_interval([]))
    with pytest.raises(ValueError, match="confidence must be in"):
        median_interval([1.0, 2.0], 1.0)


def test_each_workload_plots_to_its_own_file(tmp_path: Path) -> None:
    """A report merging sweeps of two real workloads (other --categories) or two SYNTHETIC mixes wrote both to one
    file: the second plot replaced the first. One workload of a kind keeps its short name."""
    pytest.importorskip("matplotlib")
    from specserve.bench.stats import plot_workloads

    labels = ["real coding+writing", "real math", "SYNTHETIC 0.9/0.3", "SYNTHETIC 0.5"]
    rows = [{"workload": w, "batch": b, "policy": "plain", "tok_s": 1.0 + b} for w in labels for b in (1, 2)]
    paths = plot_workloads(rows, ["tok_s"], tmp_path, prefix="straggler", title="{workload}")
    assert [p.name for p in paths] == [
        "straggler_real_coding+writing.png",
        "straggler_real_math.png",
        "straggler_synthetic_0.9_0.3.png",
        "straggler_synthetic_0.5.png",
    ]
    assert all(p.is_file() for p in paths)
    one = plot_workloads(rows[:2] + rows[4:6], ["tok_s"], tmp_path, prefix="sim", title="{workload}")
    assert [p.name for p in one] == ["sim_real.png", "sim_synthetic.png"]
