"""`specserve bench catch-up` on the tiny model with a random head: its scripted guard, and tables whose rows agree
where the window binds nothing (greedy runs are deterministic)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specserve.bench.catch_up import ScriptedGuard, acceptance, check_switch_fits, methods, switch_cost
from specserve.config import Drafter
from specserve.errors import SettingsError
from specserve.models.tiny import tiny_model
from specserve.workers.head_draft import HeadDraftWorker
from tests.conftest import forbid_model_loads
from tests.test_head_drafter import random_head


def test_the_scripted_guard_runs_plain_steps_first_then_alternating_stretches() -> None:
    guard = ScriptedGuard(period=2, plain_first=1)
    assert [guard.speculate(1) for _ in range(8)] == [False, True, True, False, False, True, True, False]
    always = ScriptedGuard()
    assert all(always.speculate(4) for _ in range(5))


def test_acceptance_rows_agree_where_the_window_binds_nothing() -> None:
    target = tiny_model(seed=0)
    head = random_head(target)
    prompts = [[5, 9, 33, 71, 2 + i] * 3 for i in range(2)]  # 15 tokens; contexts stay below 15 + 20 < 64
    rows = acceptance(target, head, prompts, methods(0.0), [512, 64, 4], [0, 4], 20, eos_token_ids=set())
    assert len(rows) == 2 * 2 * 3
    key = {(r["method"], r["period"], r["window"]): r for r in rows}
    for method in ("DDD", "chain 1"):
        for period in (0, 4):
            wide, w64 = key[(method, period, 512)], key[(method, period, 64)]
            assert {k: v for k, v in wide.items() if k != "window"} == {k: v for k, v in w64.items() if k != "window"}
            assert wide["tokens"] == 2 * 20 and wide["greedy_equal"] == 1.0
        # stretches of 4 plain steps: about half the steps speculate (the prefill step drafts nothing)
        always, half = key[(method, 0, 512)]["draft_steps"], key[(method, 4, 512)]["draft_steps"]
        assert isinstance(always, int) and isinstance(half, int) and 0 < half < always


def test_acceptance_rows_compare_each_output_with_plain_decodings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table counted tokens only, and equal counts were read as greedy equality: each output is now compared
    with plain decoding's (here a plain reference that differs on the second prompt)."""
    from specserve.bench import catch_up

    plain_outputs = catch_up.plain_outputs

    def second_differs(*args: Any, **kwargs: Any) -> list[list[int]]:
        outs = plain_outputs(*args, **kwargs)
        return [outs[0], [t + 1 for t in outs[1]]]

    monkeypatch.setattr(catch_up, "plain_outputs", second_differs)
    target = tiny_model(seed=0)
    prompts = [[5, 9, 33, 71, 2 + i] * 3 for i in range(2)]
    rows = acceptance(target, random_head(target), prompts, methods(0.0), [64], [0], 12, eos_token_ids=set())
    assert [r["greedy_equal"] for r in rows] == [0.5, 0.5]


def test_switch_cost_reports_each_window() -> None:
    target = tiny_model(seed=0)
    head = random_head(target)
    prompts = [[5, 9, 33, 71, 2 + i] * 3 for i in range(3)]
    rows = switch_cost(target, head, prompts, methods(0.0)["DDD"], [64, 4], after=6, repeats=1, max_model_len=128)
    assert [r["window"] for r in rows] == [64, 4]
    assert all(r["batch"] == 3 and r["context"] == 21 for r in rows)
    assert all(isinstance(r[k], float) and r[k] > 0 for r in rows for k in ("switch_ms", "plain_ms", "spec_ms"))


def test_switch_cost_times_the_catch_up_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's catch-up made to cost 5 ms a fed row on the bench's clock, which only it advances: the switch
    step carries the catch-up of the whole context (prompt + plain steps) up to the window, a speculative step
    after it only its last step's rows, plain steps none; so the columns must be apart by those rows' times. (Real
    sleeps on a real clock failed 1 run in 10 on a loaded 2-core host: a step stalled by another process.)"""
    from specserve.bench import catch_up as bench

    per_row, now = 0.005, [0.0]
    catch_up = HeadDraftWorker._catch_up

    def slow_catch_up(self: HeadDraftWorker, ready: list[Any]) -> list[torch.Tensor]:
        now[0] += per_row * sum(len(r[1]) for r in ready)
        return catch_up(self, ready)

    monkeypatch.setattr(HeadDraftWorker, "_catch_up", slow_catch_up)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    target = tiny_model(seed=0)
    head = random_head(target)
    prompts = [[5, 9, 33, 71, 2 + i] * 3 for i in range(3)]  # 15 tokens each; 6 plain steps: a context of 21
    spec = methods(0.0)["chain 1"]
    rows = switch_cost(target, head, prompts, spec, [64, 4], after=6, repeats=1, max_model_len=128)
    wide, narrow = rows
    assert wide["switch_ms"] - narrow["switch_ms"] > 1e3 * per_row * 3 * (21 - 4) * 0.8  # 3 x 17 more rows caught up
    assert narrow["switch_ms"] - narrow["spec_ms"] > 1e3 * per_row * 3 * (4 - 2) * 0.8  # 4 rows vs at most 2 a step
    assert all(r["plain_ms"] == 0.0 < r["spec_ms"] for r in rows)  # no catch-up in plain steps


def test_a_switch_past_the_context_is_refused_before_any_run() -> None:
    """--switch-after beyond the context ended in an IndexError after the whole acceptance phase; the check now
    runs first (run) and in switch_cost itself, naming the flag."""
    target = tiny_model(seed=0)
    head = random_head(target)
    prompts = [[5, 9, 33, 71, 2 + i] * 3 for i in range(2)]  # 15 tokens
    with pytest.raises(SettingsError, match="--switch-after 100"):
        switch_cost(target, head, prompts, methods(0.0)["DDD"], [64], after=100, repeats=1, max_model_len=128)
    with pytest.raises(SettingsError, match="--switch-after"):
        check_switch_fits(prompts, 100, methods(0.0)["DDD"], 128)
    check_switch_fits(prompts, 80, methods(0.0)["DDD"], 128)  # 15 + 80 + 24 steps + a tree of 6 fit in 128
    head = methods(0.0)["DDD"]  # the head's own trees, not the pair's lookup in front
    assert (head.drafter, head.budget, head.model_budget) == (Drafter.model, 6, None)


@pytest.mark.parametrize("flag", ["--windows", "--switch-windows"])
def test_a_window_out_of_range_is_a_usage_error_before_the_model_loads(
    flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from specserve.bench import catch_up
    from specserve.cli import main

    forbid_model_loads(monkeypatch, catch_up)
    assert main(["bench", "catch-up", flag, str(1 << 21), "--out", "/tmp"]) == 2
    err = capsys.readouterr().err
    assert "catch_up_window" in err and "Traceback" not in err, err
