"""`specserve bench host`: host-side work a step does before any forward, where it grows with the batch or the
context: the SL planner's token guard (``max_step_tokens``) and the model-free drafters over a diffuse match.

Planner: B chain rows at SL ``--sl`` planned under ``--max-step-tokens`` (the serving default 64), so the guard
shrinks every batch above a few rows. Drafters: a context of ``k`` records ``a b <unique>`` ending in ``a b``, so
the match is followed by k different tokens once each and nothing is worth drafting; each drafter and method is
asked for a proposal, first untimed (it builds its tries), then ``--repeats`` times. Medians in ms.

    .venv/bin/specserve bench host --out bench_out/host
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.arg_types import batch_size, out_dir_arg, positive_int
from specserve.bench.machine import cpu_summary
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import Drafter, ModelFreeConfig, SpecConfig, SpecMethod
from specserve.policy.dsde import SLState
from specserve.policy.planner import SLPlanner
from specserve.spec_decode.model_free import ModelFreeDrafter

FIRST_UNIQUE = 1000  # the records' unique tokens start here (the repeated pair is 7 8)


@dataclass(frozen=True)
class _Row:  # what the planner reads of a sequence (specserve.policy.planner.PlanRow)
    spec: SpecConfig
    sl_state: SLState | None = None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", type=batch_size, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--sl", type=positive_int, default=12, help="each chain row's SL in the planner table")
    p.add_argument("--max-step-tokens", type=positive_int, default=64)
    p.add_argument("--continuations", type=positive_int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/host"))


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def planner_rows(batch_sizes: list[int], sl: int, max_step_tokens: int, repeats: int) -> list[dict[str, Any]]:
    out = []
    for b in batch_sizes:
        rows = [_Row(SpecConfig(method=SpecMethod.chain, sl=sl))] * b
        planner = SLPlanner(max_step_tokens=max_step_tokens)
        drafted = sum(planner.plan(rows).depths)
        ms = _median_ms(functools.partial(planner.plan, rows), repeats)
        out.append({"batch": b, "sl": sl, "max_step_tokens": max_step_tokens, "drafted": drafted, "plan_ms": ms})
    return out


def diffuse_context(k: int) -> list[int]:
    return [t for i in range(k) for t in (7, 8, FIRST_UNIQUE + i)] + [7, 8]


def drafter_rows(continuations: list[int], repeats: int) -> list[dict[str, Any]]:
    out = []
    for k in continuations:
        context = diffuse_context(k)
        for drafter in (Drafter.lookup, Drafter.suffix):
            for method in (SpecMethod.chain, SpecMethod.eagle2):
                for calibrated in (True, False):
                    cfg = ModelFreeConfig(calibrated=calibrated)
                    spec = SpecConfig(method=method, drafter=drafter, model_free=cfg)
                    mf = ModelFreeDrafter()  # the request's own tokens (the suffix drafter's trie over them)
                    proposal = mf.propose(0, context, spec, 6, want_q=True)
                    ms = _median_ms(functools.partial(mf.propose, 0, context, spec, 6, want_q=True), repeats)
                    out.append(
                        {
                            "continuations": k,
                            "context": len(context),
                            "drafter": drafter.value,
                            "method": method.value,
                            "calibrated": calibrated,
                            "drafted": 0 if proposal is None else len(proposal.tokens),
                            "propose_ms": ms,
                        }
                    )
    return out


def run(args: argparse.Namespace) -> int:
    cpu = cpu_summary()
    print(cpu)
    planned = planner_rows(args.batch_sizes, args.sl, args.max_step_tokens, args.repeats)
    print(markdown_table(planned))
    drafted = drafter_rows(args.continuations, args.repeats)
    print(markdown_table(drafted))
    write_csv(args.out / "planner.csv", [row | {"cpu": cpu} for row in planned])
    write_csv(args.out / "drafters.csv", [row | {"cpu": cpu} for row in drafted])
    print(f"wrote {args.out / 'planner.csv'} and {args.out / 'drafters.csv'}")
    return 0
