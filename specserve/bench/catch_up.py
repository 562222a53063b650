"""`specserve bench catch-up`: what ``SpecConfig.catch_up_window`` trades for an EAGLE head (docs/algorithms.md §8.3).

Two tables. Acceptance: greedy runs over MT-bench first turns at batch 1, per window, once speculating on every
step (the window bounds only the prompt's read) and once with stretches of ``--period`` plain steps between
speculative ones (each switch a catch-up from the newest W features), for DDD with the pair's default tree shape
(its floor fixed at ``--tree-min-prob``: the measured floor would follow the host's speed) and for chains of one.
Switch cost: at ``--switch-batch`` sequences, ``--switch-after`` plain steps, then speculation: the switch step's
time (the head's catch-up and a speculative step) next to a plain step's and the speculative steps' after it.

    .venv/bin/specserve bench catch-up --per-category 2 --max-tokens 96 --out bench_out/catch_up
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from specserve.arg_types import batch_size, finite_float, non_negative_int, out_dir_arg, positive_int
from specserve.bench.machine import cpu_summary
from specserve.bench.prompt_sets import mt_bench_prompts, per_category
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import MODEL_PAIRS, PAIR_SPECULATION, Drafter, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import SettingsError
from specserve.guard import Outlook, ThroughputGuard
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_draft, load_model, load_tokenizer
from specserve.sampling import SamplingParams
from specserve.spec_decode.eagle_head import EagleHead

PAIR = "smollm2-eagle"
MAX_MODEL_LEN = 1024
SWITCH_TAIL = 24  # steps timed after the switch


class ScriptedGuard(ThroughputGuard):
    """Plain decoding on the first ``plain_first`` steps asked, then stretches of ``period`` speculative and
    ``period`` plain steps (period 0: speculation throughout)."""

    def __init__(self, *, period: int = 0, plain_first: int = 0) -> None:
        super().__init__()
        self.period, self.plain_first, self.asked = period, plain_first, 0

    def speculate(self, batch_size: int, *, measured: bool = True, outlook: Outlook | None = None) -> bool:
        n, self.asked = self.asked, self.asked + 1
        if n < self.plain_first:
            return False
        return self.period == 0 or ((n - self.plain_first) // self.period) % 2 == 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--windows", type=positive_int, nargs="+", default=[2048, 128, 64, 32, 16])
    p.add_argument("--per-category", type=positive_int, default=2, help="MT-bench first turns per category")
    p.add_argument("--max-tokens", type=positive_int, default=96)
    p.add_argument(
        "--period", type=non_negative_int, default=16, help="plain / speculative stretch length (0: no stretches)"
    )
    p.add_argument("--tree-min-prob", type=finite_float, default=0.06, help="DDD's fixed floor")
    p.add_argument(
        "--switch-windows", type=positive_int, nargs="+", default=[2048, 64], help="windows of the switch table"
    )
    p.add_argument("--switch-batch", type=batch_size, default=16)
    p.add_argument("--switch-after", type=positive_int, default=200, help="plain steps before the switch")
    p.add_argument("--repeats", type=positive_int, default=3, help="switch-cost runs per window (medians)")
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/catch_up"))


def methods(tree_min_prob: float) -> dict[str, SpecConfig]:
    # the head's own trees (the pair's default drafts with prompt lookup first: its steps would not be the head's)
    fields = {"adaptive_floor": False, "tree_min_prob": tree_min_prob, "drafter": Drafter.model, "budget": 6}
    ddd = PAIR_SPECULATION[PAIR].model_copy(update=fields | {"model_budget": None})
    return {"DDD": ddd, "chain 1": SpecConfig(method=SpecMethod.chain, sl=1)}


def acceptance(
    target: LlamaModel,
    head: EagleHead,
    prompts: Sequence[list[int]],
    specs: dict[str, SpecConfig],
    windows: Sequence[int],
    periods: Sequence[int],
    max_tokens: int,
    *,
    eos_token_ids: set[int],
    max_model_len: int = MAX_MODEL_LEN,
) -> list[dict[str, object]]:
    """Per (method, period, window): drafted tokens accepted per speculative step, summed over the prompts, one
    at a time (greedy: deterministic), and the share of prompts whose output equals plain decoding's."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    plain = plain_outputs(target, prompts, params, eos_token_ids=eos_token_ids, max_model_len=max_model_len)
    rows: list[dict[str, object]] = []
    for name, spec in specs.items():
        for period in periods:
            for w in windows:
                run = spec.model_copy(update={"catch_up_window": w})
                accepted = steps = tokens = equal = 0
                for p, reference in zip(prompts, plain, strict=True):
                    engine = Engine(
                        target,
                        None,
                        draft=head,
                        speculation=run,
                        eos_token_ids=eos_token_ids,
                        max_model_len=max_model_len,
                    )
                    engine.loop.planner.guard = ScriptedGuard(period=period)
                    c = engine.generate([p], params)[0]
                    accepted, steps = accepted + c.stats.accepted, steps + c.stats.draft_steps
                    tokens, equal = tokens + len(c.token_ids), equal + (c.token_ids == reference)
                row = {"method": name, "period": period, "window": w, "draft_steps": steps, "accepted": accepted}
                row |= {"tokens": tokens, "accepted_per_step": accepted / steps if steps else 0.0}
                rows.append(row | {"greedy_equal": equal / len(prompts)})
    return rows


def plain_outputs(
    target: LlamaModel,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    *,
    eos_token_ids: set[int],
    max_model_len: int,
) -> list[list[int]]:
    engine = Engine(target, None, eos_token_ids=eos_token_ids, max_model_len=max_model_len)
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def check_switch_fits(prompts: Sequence[list[int]], after: int, spec: SpecConfig, max_model_len: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest + after + SWITCH_TAIL + spec.budget > max_model_len:
        raise SettingsError(
            f"--switch-after {after}: the longest prompt ({longest} tokens) would run past the {max_model_len}-token "
            f"context before the {SWITCH_TAIL} steps timed after the switch"
        )


def switch_cost(
    target: LlamaModel,
    head: EagleHead,
    prompts: Sequence[list[int]],
    spec: SpecConfig,
    windows: Sequence[int],
    after: int,
    repeats: int,
    *,
    max_model_len: int = MAX_MODEL_LEN,
) -> list[dict[str, object]]:
    """Per window, medians over ``repeats`` runs (windows interleaved): the switch step's seconds after ``after``
    plain steps of the whole batch, a plain step's and a speculative step's after the switch."""
    check_switch_fits(prompts, after, spec, max_model_len)
    params = SamplingParams(max_tokens=after + SWITCH_TAIL, temperature=0.0, ignore_eos=True)
    times: dict[int, list[tuple[float, float, float]]] = {w: [] for w in windows}
    for _ in range(repeats):
        for w in windows:
            engine = Engine(
                target,
                None,
                draft=head,
                speculation=spec.model_copy(update={"catch_up_window": w}),
                eos_token_ids=set(),
                max_batch_size=len(prompts),
                max_model_len=max_model_len,
            )
            engine.loop.planner.guard = ScriptedGuard(plain_first=after + 1)  # + the prefill step
            for p in prompts:
                engine.submit(p, params)
            steps = []
            while engine.loop.has_work:
                t = time.perf_counter()
                engine.loop.step()
                steps.append(time.perf_counter() - t)
            switch = after + 1
            times[w].append((steps[switch], statistics.median(steps[1:switch]), statistics.median(steps[switch + 1 :])))
    context = statistics.mean(len(p) for p in prompts) + after
    return [
        {
            "batch": len(prompts),
            "context": round(context),
            "window": w,
            "switch_ms": 1e3 * statistics.median(t[0] for t in ts),
            "plain_ms": 1e3 * statistics.median(t[1] for t in ts),
            "spec_ms": 1e3 * statistics.median(t[2] for t in ts),
        }
        for w, ts in times.items()
    ]


def run(args: argparse.Namespace) -> int:
    specs = methods(args.tree_min_prob)
    for w in {*args.windows, *args.switch_windows}:  # (model_copy does not validate: checked before any run)
        SpecConfig.model_validate({**specs["DDD"].model_dump(), "catch_up_window": w})
    target_spec, head_spec = MODEL_PAIRS[PAIR]
    target = load_model(target_spec)
    head = load_draft(head_spec, target)
    assert isinstance(head, EagleHead)
    tokenizer = load_tokenizer(target_spec)
    encoder = Engine(target, tokenizer, max_batch_size=1)
    prompts = [encoder.encode(p.text, chat=True) for p in per_category(mt_bench_prompts(), args.per_category)]
    batch = (prompts * args.switch_batch)[: args.switch_batch]
    check_switch_fits(batch, args.switch_after, specs["DDD"], MAX_MODEL_LEN)  # before the acceptance runs
    periods = sorted({0, args.period})
    eos = encoder.loop.eos_token_ids
    rows = acceptance(target, head, prompts, specs, args.windows, periods, args.max_tokens, eos_token_ids=eos)
    print(markdown_table(rows))
    cost = switch_cost(target, head, batch, specs["DDD"], args.switch_windows, args.switch_after, args.repeats)
    print(markdown_table(cost))
    cpu = cpu_summary()  # (the switch's costs are this CPU's)
    print(cpu)
    write_csv(args.out / "acceptance.csv", rows)
    write_csv(args.out / "switch.csv", [row | {"cpu": cpu} for row in cost])
    print(f"wrote {args.out / 'acceptance.csv'} and {args.out / 'switch.csv'}")
    return 0
