"""`specserve bench batch`: throughput, straggler idle fraction and per-request latency against batch size for
plain decoding, static SL, DSDE with and without SL_cap, DDD and DSDE+DDD; on real MT-bench prompts and on a
SYNTHETIC heterogeneous acceptance mix (labelled as such everywhere). Writes CSV and PNG plots.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

from specserve.arg_types import batch_size, finite_float, non_negative_int, out_dir_arg, positive_int
from specserve.bench.machine import cpu_summary
from specserve.bench.policies import STUDY_POLICIES, PolicyName, policy_specs
from specserve.bench.prompt_sets import mt_bench_prompts
from specserve.bench.stats import (
    SWEEP_COLS,
    add_vs_baseline,
    markdown_table,
    median_row,
    p50_p99,
    plot_workloads,
    write_csv,
)
from specserve.config import MODEL_PAIRS, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import SettingsError
from specserve.models.loader import load_draft, load_model, load_tokenizer
from specserve.sampling import SamplingParams
from specserve.timing import balanced_orders

WORKLOADS = ("real", "synthetic")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="smollm2-bf16", choices=sorted(MODEL_PAIRS))
    p.add_argument("--batch-sizes", type=batch_size, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument(
        "--policies",
        nargs="+",
        default=[x.value for x in STUDY_POLICIES],
        choices=[x.value for x in PolicyName],
        help="policies to compare (default: all but dsde_ddd_nocap)",
    )
    p.add_argument("--requests-per-slot", type=positive_int, default=2, help="requests per run = this x batch size")
    p.add_argument("--min-tokens", type=positive_int, default=16)
    p.add_argument("--max-tokens", type=positive_int, default=48)
    p.add_argument("--static-sl", type=positive_int, default=4, help="the best static SL (from bench spec)")
    p.add_argument("--budget", type=positive_int, default=16, help="tree verify budget T")
    p.add_argument("--beam-width", type=positive_int, default=4)
    p.add_argument("--synthetic-mix", type=finite_float, nargs="+", default=[0.9, 0.3])
    p.add_argument(
        "--max-step-tokens", type=non_negative_int, default=0, help="cap on tokens verified per step (0 = off)"
    )
    p.add_argument("--guard", action="store_true", help="throughput guard: speculate only where it pays")
    p.add_argument(
        "--repeats", type=positive_int, default=2, help="round-robin repeats per batch size; medians reported"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/batch"))


def policies(args: argparse.Namespace) -> dict[PolicyName, SpecConfig]:
    """The policies selected on the command line, with their speculation settings."""
    table = policy_specs(static_sl=args.static_sl, beam_width=args.beam_width, budget=args.budget)
    return {PolicyName(p): table[PolicyName(p)] for p in args.policies}


def run_one(
    engine: Engine, prompts: list[list[int]], lengths: list[int], spec: SpecConfig, accepts: list[float | None]
) -> dict[str, float]:
    engine.loop.stats.metrics.clear()
    start = time.perf_counter()
    finish: dict[str, float] = {}
    tokens = 0
    for p, n, a in zip(prompts, lengths, accepts, strict=True):
        per_req = (
            spec if a is None or spec.method == SpecMethod.none else spec.model_copy(update={"synthetic_accept": a})
        )
        engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), speculation=per_req)
    while engine.loop.has_work:
        for out in engine.loop.step():
            tokens += len(out.token_ids)
            if out.finished:
                finish[out.request_id] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    steps = list(engine.loop.stats.metrics)
    drafting = [m for m in steps if m.levels > 0]
    caps = [m.cap for m in steps if m.cap is not None]
    return {
        "tok_s": tokens / seconds,
        "seconds": seconds,
        "steps": len(steps),
        "idle_fraction": statistics.mean(m.idle_fraction for m in drafting) if drafting else 0.0,
        "mean_sl": statistics.mean(d for m in drafting for d in m.depths) if drafting else math.nan,  # (none drafted)
        "spec_steps": len(drafting) / len(steps) if steps else math.nan,  # the fraction of steps that drafted
        "mean_cap": statistics.mean(caps) if caps else 0.0,
        **p50_p99("latency_s", list(finish.values())),
        "draft_frac": sum(m.draft_s for m in steps) / seconds,
        "verify_frac": sum(m.verify_s for m in steps) / seconds,
    }


def run(args: argparse.Namespace) -> int:
    if args.min_tokens > args.max_tokens:
        raise SettingsError(f"--min-tokens {args.min_tokens} exceeds --max-tokens {args.max_tokens}")
    if "synthetic" in args.workloads and not all(0.0 < a < 1.0 for a in args.synthetic_mix):
        raise SettingsError(f"--synthetic-mix: acceptance rates lie in (0, 1), got {args.synthetic_mix}")
    table = policies(args)  # the settings' checks, before minutes of loading
    target_spec, draft_spec = MODEL_PAIRS[args.pair]
    target = load_model(target_spec)
    draft = load_draft(draft_spec, target)
    tok = load_tokenizer(target_spec)
    rng = random.Random(args.seed)
    pool = mt_bench_prompts()
    rng.shuffle(pool)  # mixed categories

    def timed(
        spec: SpecConfig, bs: int, prompts: list[list[int]], lengths: list[int], accepts: list[float | None]
    ) -> dict[str, float]:
        engine = Engine(
            target,
            tok,
            draft=draft,
            speculation=spec,
            max_batch_size=bs,
            max_model_len=1024,
            max_step_tokens=args.max_step_tokens or None,
            throughput_guard=args.guard,
        )
        return run_one(engine, prompts, lengths, spec, accepts)

    rows = []
    cold = True  # the process's first forwards (allocator, thread pool, kernels) would be timed in the first run
    for workload in args.workloads:
        for bs in args.batch_sizes:
            n_req = bs * args.requests_per_slot
            enc = Engine(target, tok, max_batch_size=1)
            prompts = [enc.encode(pool[i % len(pool)].text, chat=True) for i in range(n_req)]
            lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(n_req)]
            mix = args.synthetic_mix
            accepts: list[float | None] = (
                [mix[i % len(mix)] for i in range(n_req)] if workload == "synthetic" else [None] * n_req
            )
            label = "SYNTHETIC " + "/".join(map(str, mix)) if workload == "synthetic" else "real"
            results: dict[PolicyName, list[dict[str, float]]] = {name: [] for name in table}
            in_table = list(table.items())
            orders = balanced_orders(len(in_table))  # each policy in every place, after every other, in turn
            point = (bs, prompts, lengths, accepts)
            if cold:  # one untimed run of every policy first, not the first policy's first run alone paying the start
                cold = False
                for _, spec in in_table:
                    timed(spec, *point)
            for repeat in range(args.repeats):  # round robin: load changes on a shared machine hit every policy alike
                for name, spec in (in_table[i] for i in orders[repeat % len(orders)]):
                    results[name].append(timed(spec, *point))
            for name, runs in results.items():
                res = median_row(runs)
                rows.append({"workload": label, "batch": bs, "policy": name.label, **res})
                print(
                    f"{label:22s} B={bs:3d} {name.label:14s} {res['tok_s']:7.1f} tok/s  "
                    f"idle {res['idle_fraction']:.3f}  "
                    f"p50 {res['p50_latency_s']:.2f}s p99 {res['p99_latency_s']:.2f}s",
                    flush=True,
                )
    add_vs_baseline(rows, PolicyName.plain.label)
    cpu = cpu_summary()
    write_csv(args.out / "batch.csv", [row | {"cpu": cpu} for row in rows])
    plot_workloads(
        rows,
        ("tok_s", "idle_fraction", "p50_latency_s", "p99_latency_s"),
        args.out,
        prefix="batch",
        title="specserve bench batch: {workload}",
        panel_size=(5.0, 4.5),
        dpi=110,
    )
    print(f"static SL = {args.static_sl}; trees: beam width {args.beam_width}, budget {args.budget}")
    print(markdown_table(rows, (*SWEEP_COLS, "spec_steps", "p50_latency_s", "p99_latency_s")))
    print(cpu)
    return 0
