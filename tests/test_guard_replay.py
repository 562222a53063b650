"""`python -m load.guard_replay`: reading a sweep's plain runs, replaying them through the guard, the CLI."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest

from load.guard_replay import Draws, SpecModel, Variant, main, plain_profiles, replay
from load.traces import RunTrace, SeqStep, StepTrace, WorkloadKind
from specserve.bench.policies import PolicyName
from specserve.config import SpecConfig
from specserve.errors import SettingsError
from specserve.guard import ThroughputGuard


def _run(batch: int, policy: PolicyName, steps: list[tuple[float, list[int]]]) -> str:
    """A run trace's line: steps as (seconds, tokens fed per sequence)."""
    t, out = 0.0, []
    for seconds, fed in steps:
        t += seconds
        seqs = [SeqStep(req=i, fed=f, depth=0, drafted=0, accepted=0) for i, f in enumerate(fed)]
        out.append(
            StepTrace(
                t_end=t,
                batch=batch,
                levels=0,
                cap=None,
                draft_s=0.0,
                verify_s=seconds,
                overhead_s=0.0,
                emitted=len(fed),
                seqs=seqs,
            )
        )
    run = RunTrace(
        pair="tiny",
        workload=WorkloadKind.real,
        synthetic=False,
        policy=policy,
        spec=SpecConfig(),
        batch=batch,
        seconds=t,
        tokens=len(steps),
        requests=[],
        steps=out,
    )
    return run.model_dump_json()


def _traces(tmp_path: Path) -> Path:
    path = tmp_path / "traces.jsonl"
    lines = [
        _run(2, PolicyName.plain, [(0.5, [30, 40]), (0.01, [1, 1]), (0.02, [1, 1]), (0.03, [1]), (0.04, [1, 1])]),
        _run(2, PolicyName.dsde_ddd, [(0.5, [30, 40]), (0.05, [1, 1])]),
        _run(4, PolicyName.plain, [(0.07, [1, 1, 1, 1])]),
        _run(2, PolicyName.plain, [(0.06, [1, 1]), (0.5, [1, 25])]),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_plain_runs_whole_batch_decode_steps_are_read_in_order(tmp_path: Path) -> None:
    """Only plain runs at the batch size; a step that feeds a prompt or runs fewer sequences is left out."""
    profiles = plain_profiles([_traces(tmp_path)], 2)
    assert profiles == [pytest.approx([0.01, 0.02, 0.04]), pytest.approx([0.06])]
    assert plain_profiles([_traces(tmp_path)], 4) == [pytest.approx([0.07])]


def test_bad_traces_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no traces file"):
        plain_profiles([tmp_path / "absent.jsonl"], 2)
    with pytest.raises(SettingsError, match="no plain runs at batch 8"):
        plain_profiles([_traces(tmp_path)], 8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_run(2, PolicyName.plain, [(0.01, [1, 1])]) + '\n{"batch": 2, "policy": "plain"}\n')
    with pytest.raises(SettingsError, match=r"bad.jsonl:2 is not a run trace"):
        plain_profiles([bad], 2)


def test_a_replay_follows_the_faster_mode() -> None:
    """Speculation at half a plain step's time taking every draft token (4 tokens a step, 8x plain decoding): the
    guard, after its warm-up, speculates and the run goes over 6x faster. Speculation at 3x a plain step
    emitting 1 token: the guard keeps plain decoding but for its warm-up and spaced tries."""
    plain = [0.01] * 400
    model = SpecModel(0.5, 1.0, 3, 0.0, 0.0)
    fast = replay(ThroughputGuard(), plain, model, 4, Draws.sample(model, 400, 4, random.Random(0)))
    assert fast.ratio > 6 and fast.switches == 1  # the warm-up's (a one-step try of plain leaves the draft 2 behind)
    model = SpecModel(3.0, 0.0, 3, 0.0, 0.005)
    slow = replay(ThroughputGuard(), plain, model, 4, Draws.sample(model, 400, 4, random.Random(0)))
    assert 0.9 < slow.ratio < 1.0 and slow.spec_steps < 20


def test_the_replay_counts_the_tokens_it_emitted() -> None:
    """A guard that always speculates, 2 tokens a sequence a step at the plain step's time: the plain run's tokens
    in half its steps, so exactly 2x; no step is a switch (none follows plain steps), so ``switch_s`` is never paid."""

    class Always(ThroughputGuard):
        def speculate(self, batch_size: int, **_: object) -> bool:
            return True

    model = SpecModel(1.0, 1.0, 1, 0.0, 0.05)
    run = replay(Always(), [0.01] * 10, model, 3, Draws.sample(model, 10, 3, random.Random(0)))
    assert run.ratio == pytest.approx(2.0) and run.spec_steps == 5 and run.switches == 0


def test_a_switch_is_a_catch_up_of_more_than_catch_up_tokens() -> None:
    """Scripted modes: speculation after one plain step leaves the draft 2 tokens behind a sequence (the plain
    token and the last bonus token): measured as a step; after two plain steps, 3 behind: a catch-up, reported to
    the guard with the tokens re-read and charged ``switch_s``."""
    from specserve.step_loop import CATCH_UP

    class Scripted(ThroughputGuard):
        def __init__(self, script: list[bool]) -> None:
            super().__init__()
            self.script, self.seen = script, list[tuple[bool, float, object]]()

        def speculate(self, batch_size: int, **_: object) -> bool:
            return self.script.pop(0)

        def record(self, batch_size: int, speculative: bool, tokens: int, seconds: float, **kw: object) -> None:
            self.seen.append((speculative, round(seconds, 6), kw.get("caught_up_tokens", 0)))

    model = SpecModel(1.0, 0.0, 1, 0.0, 0.05)
    guard = Scripted([False, True, False, False, True, True])
    replay(guard, [0.01] * 6, model, 2, Draws.sample(model, 6, 2, random.Random(0)))
    assert CATCH_UP == 2
    assert guard.seen[:5] == [(False, 0.01, 0), (True, 0.01, 0), (False, 0.01, 0), (False, 0.01, 0), (True, 0.06, 6)]
    assert guard.seen[4][2] == 2 * (2 + 1) and guard.seen[5] == (True, 0.01, 0)  # two sequences 3 behind; then none


def test_the_command_writes_a_row_per_model_and_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces, out = str(_traces(tmp_path)), str(tmp_path / "out")
    argv = ["--traces", traces, "--batch", "2", "--spec-time", "1.0", "2.0", "--margins", "0.05", "--seeds", "2"]
    assert main([*argv, "--out", out]) == 0
    rows = list(csv.DictReader((tmp_path / "out" / "guard_replay.csv").open()))
    assert [(r["spec_time"], r["variant"]) for r in rows] == [
        (t, v) for t in ("1.0", "2.0") for v in ("margin 0, refresh off", "margin 0.05, refresh on")
    ]
    assert "2 plain runs at batch 2" in capsys.readouterr().out
    assert main([*argv, "--drift", "off", "on", "--out", out]) == 0  # follow_drift's variants beside the others
    rows = list(csv.DictReader((tmp_path / "out" / "guard_replay.csv").open()))
    assert [r["variant"] for r in rows if r["spec_time"] == "1.0"] == [
        "margin 0, refresh off", "margin 0.05, refresh on", "margin 0.05, refresh on, drift"
    ]  # fmt: skip
    assert [Variant(0.05, True, d).guard().cfg.follow_drift for d in (False, True)] == [False, True]
    assert main([*argv, "--drift", "on", "on", "--out", out]) == 0  # a value given twice is one variant
    rows = list(csv.DictReader((tmp_path / "out" / "guard_replay.csv").open()))
    assert [r["variant"] for r in rows if r["spec_time"] == "1.0"] == [
        "margin 0, refresh off", "margin 0.05, refresh on, drift"
    ]  # fmt: skip
    for bad, message in (
        (["--drift", "yes"], "argument --drift: invalid choice"),
        (["--margins", "1.5"], "must be in"),
        (["--switch-s", "-1"], "switch-s must be at least 0"),
        (["--switch-s", "nan"], "argument --switch-s: must be a finite number"),
        (["--batch", "8"], "no plain runs at batch 8"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["--traces", traces, *bad, "--out", out])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_tenth_percentile_is_the_nearest_rank_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Of 10 runs the 10th percentile is the lowest ratio (nearest rank 1, as specserve.bench.stats.percentile);
    it read the second lowest whenever the run count was a multiple of 10 (the default 30 seeds)."""
    from load import guard_replay
    from load.guard_replay import Replay, Variant, rows_for

    ratios = iter([1.05, 0.91, 1.2, 0.99, 0.93, 1.0, 1.1, 0.97, 1.02, 1.01])
    monkeypatch.setattr(guard_replay, "replay", lambda guard, plain, model, batch, draws: Replay(next(ratios), 0, 0))
    model = SpecModel(time=1.5, accept=0.6, depth=3, jitter=0.0, switch_s=0.0)
    [row] = rows_for([[0.01] * 5], [model], [Variant(0.0, False)], batch=2, seeds=10)
    assert row["p10"] == 0.91 and row["median"] == pytest.approx(1.005)
