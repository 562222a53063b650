"""`python -m load.guard_replay`: the throughput guard's cost and gain over recorded host noise, without models.

A straggler sweep (``python -m load.straggler``) records every step of every run in ``traces.jsonl``. Its plain
runs at one batch size give sequences of decode-step times: the host's own drift, page faults and neighbours,
step by step. This benchmark replays each such sequence through a ``ThroughputGuard`` (one guard across all the
runs, as the sweep keeps one per policy) with a modelled speculative mode: a speculative step at step i takes
``spec_time`` times the recorded plain step i (times a lognormal jitter of ``--spec-jitter``), plus ``--switch-s``
when the draft missed more than ``CATCH_UP`` tokens a sequence (its catch-up), and emits for each sequence 1 + the
draft tokens accepted, each taken with probability ``accept`` up to ``--depth``. A replayed run ends once it has
emitted the tokens the plain run did; its throughput over the plain run's is the row's figure, next to the ideal
(the faster mode throughout).

It measures guard variants (refresh off at margin 0, then refresh on at each of ``--margins``, per ``--drift``)
side by side on the same noise and draws (drawn per step index before the runs), so their difference is the
guard's, not the host's. Not modelled: admissions (the loop does not time them), the ``Outlook`` check of whether a
switch pays, and acceptance that changes within a run.

    .venv/bin/python -m load.guard_replay --traces bench_out/straggler/traces.jsonl --batch 16 --out bench_out/gr
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from load.traces import read_traces
from specserve.arg_types import batch_size, finite_float, non_negative_int, out_dir_arg, positive_float, positive_int
from specserve.bench.policies import PolicyName
from specserve.bench.stats import markdown_table, percentile, write_csv
from specserve.console import console_safe
from specserve.errors import SettingsError
from specserve.guard import GuardConfig, ThroughputGuard
from specserve.step_loop import CATCH_UP

CATCH_UP_CAP = 64  # tokens a sequence's switch step re-reads at most (an EAGLE head's catch-up window)


@dataclass(frozen=True)
class SpecModel:
    time: float  # a speculative step's time over the plain step's at the same point
    accept: float  # probability that each next draft token is accepted
    depth: int  # draft tokens a sequence may have accepted in one step
    jitter: float  # sigma of the lognormal factor on a speculative step's time
    switch_s: float  # seconds a switch step (the first speculative step after plain ones) adds

    @property
    def tokens(self) -> float:
        """Mean tokens a sequence emits in one speculative step."""
        return sum(self.accept**k for k in range(self.depth + 1))


@dataclass(frozen=True)
class Variant:
    margin: float
    refresh: bool
    drift: bool = False  # ``GuardConfig.follow_drift``

    def guard(self) -> ThroughputGuard:
        cfg = GuardConfig(margin=self.margin, refresh_on_flip=self.refresh, follow_drift=self.drift)
        return ThroughputGuard(cfg)

    @property
    def label(self) -> str:
        return f"margin {self.margin:g}, refresh {'on' if self.refresh else 'off'}" + (", drift" if self.drift else "")


@dataclass(frozen=True)
class Replay:
    ratio: float  # the replayed run's throughput over the plain run's
    spec_steps: int
    switches: int


def plain_profiles(paths: Sequence[Path], batch: int) -> list[list[float]]:
    """Per plain run at ``batch`` in the sweeps' traces, the times of its steps in which the whole batch decoded (no
    prompt fed, no sequence finished yet), in order."""
    runs = []
    for path in paths:
        if not path.is_file():
            raise SettingsError(f"no traces file at {path}")
        try:
            traces = read_traces(path)
        except ValueError as e:
            raise SettingsError(str(e)) from None
        for run in traces:
            if run.batch != batch or run.policy != PolicyName.plain:
                continue
            times, prev = [], 0.0
            for step in run.steps:
                if len(step.seqs) == batch and all(s.fed == 1 for s in step.seqs):
                    times.append(step.t_end - prev)
                prev = step.t_end
            if times:
                runs.append(times)
    if not runs:
        raise SettingsError(f"no plain runs at batch {batch} in {', '.join(map(str, paths))}")
    return runs


@dataclass(frozen=True)
class Draws:
    """What a speculative step at step i would take and emit, drawn per step index before the run, so that every
    guard variant replays the same draws whatever it decides."""

    jitter: list[float]  # factor on the step's time
    tokens: list[int]  # tokens the batch emits

    @classmethod
    def sample(cls, model: SpecModel, steps: int, batch: int, rng: random.Random) -> Draws:
        jitter = [rng.lognormvariate(0.0, model.jitter) for _ in range(steps)]
        return cls(jitter, [sum(_draft_tokens(model, rng) for _ in range(batch)) for _ in range(steps)])


def replay(guard: ThroughputGuard, plain: Sequence[float], model: SpecModel, batch: int, draws: Draws) -> Replay:
    """One run: the guard decodes until it has emitted the plain run's tokens, step i taking the time of the plain
    run's step i, as plain decoding or as modelled speculation. A speculative step after more than ``CATCH_UP``
    tokens a sequence the draft did not see (plain steps, and the last step's bonus token) is a switch: the draft
    catches up first (``switch_s``), and the loop reports the tokens it re-read."""
    goal, emitted, seconds, spec_steps, switches, behind = len(plain) * batch, 0, 0.0, 0, 0, 0
    for i, base in enumerate(plain):  # each step emits at least a token a sequence: len(plain) steps suffice
        if emitted >= goal:
            break
        if guard.speculate(batch):
            tokens, step = draws.tokens[i], base * model.time * draws.jitter[i]
            missed = batch * min(behind + 1, CATCH_UP_CAP) if behind + 1 > CATCH_UP else 0
            if missed:
                step += model.switch_s
                switches += 1
            guard.record(batch, True, tokens, step, caught_up_tokens=missed)
            spec_steps, behind = spec_steps + 1, 0
        else:
            tokens, step = batch, base
            guard.record(batch, False, tokens, step)
            behind += 1
        emitted, seconds = emitted + tokens, seconds + step
    return Replay(sum(plain) * emitted / goal / seconds, spec_steps, switches)


def _draft_tokens(model: SpecModel, rng: random.Random) -> int:
    tokens = 1
    while tokens <= model.depth and rng.random() < model.accept:
        tokens += 1
    return tokens


def rows_for(
    profiles: list[list[float]], models: Sequence[SpecModel], variants: Sequence[Variant], batch: int, seeds: int
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    drawn = {  # per model, seed and run: the same draws for every variant
        m: [[Draws.sample(m, len(p), batch, rng) for p in profiles] for rng in map(random.Random, range(seeds))]
        for m in models
    }
    for model in models:
        for variant in variants:
            runs = []
            for draws in drawn[model]:
                guard = variant.guard()  # one across the runs of a seed, as the sweep keeps one
                runs += [replay(guard, plain, model, batch, d) for plain, d in zip(profiles, draws, strict=True)]
            ratios = sorted(r.ratio for r in runs)
            rows.append(
                {
                    "batch": batch,
                    "spec_time": model.time,
                    "accept": model.accept,
                    "ideal": max(1.0, model.tokens / model.time),
                    "variant": variant.label,
                    "median": statistics.median(ratios),
                    "mean": statistics.fmean(ratios),
                    "p10": percentile(ratios, 10),  # nearest rank, as every table here
                    "spec_steps": statistics.fmean(r.spec_steps for r in runs),
                    "switches": statistics.fmean(r.switches for r in runs),
                }
            )
    return rows


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m load.guard_replay",
        description="the throughput guard over a straggler sweep's recorded plain step times, no models",
    )
    p.add_argument("--traces", type=Path, nargs="+", required=True, help="straggler sweeps' traces.jsonl")
    p.add_argument("--batch", type=batch_size, default=16, help="the batch size whose plain runs are replayed")
    p.add_argument("--spec-time", type=positive_float, nargs="+", default=[1.0, 1.1, 1.25, 1.5])
    p.add_argument("--accept", type=fraction, nargs="+", default=[0.107], help="per draft token (0.107: 1.12 tokens)")
    p.add_argument("--depth", type=non_negative_int, default=5)
    p.add_argument("--spec-jitter", type=fraction, default=0.1)
    p.add_argument("--switch-s", type=finite_float, default=0.025, help="seconds a switch step adds (the catch-up)")
    p.add_argument("--margins", type=fraction, nargs="+", default=[0.0, 0.05, 0.1])
    p.add_argument("--seeds", type=positive_int, default=30)
    p.add_argument(
        "--drift", choices=("off", "on"), nargs="+", default=["off"], help="the margin variants' follow_drift"
    )
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/guard_replay"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    with console_safe():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.switch_s < 0:
        p.error(f"--switch-s must be at least 0, got {args.switch_s}")
    try:
        profiles = plain_profiles(args.traces, args.batch)
    except SettingsError as e:
        p.error(str(e))
    models = [SpecModel(t, a, args.depth, args.spec_jitter, args.switch_s) for t in args.spec_time for a in args.accept]
    variants = [Variant(0.0, False)] + [
        Variant(m, True, d == "on") for d in dict.fromkeys(args.drift) for m in args.margins
    ]
    rows = rows_for(profiles, models, variants, args.batch, args.seeds)
    print(
        f"{len(profiles)} plain runs at batch {args.batch} ({sum(map(len, profiles))} decode steps), "
        f"{args.seeds} seeds; ratio = replayed throughput / the plain run's"
    )
    print(markdown_table(rows))
    write_csv(args.out / "guard_replay.csv", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
