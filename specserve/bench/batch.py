"""`specserve bench batch`: throughput, straggler idle fraction and per-request latency against batch size for
plain decoding, static SL, DSDE with and without SL_cap, DDD and DSDE+DDD; on real MT-bench prompts and on a
SYNTHETIC heterogeneous acceptance mix (labelled as such everywhere). Writes CSV and PNG plots.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from specserve.bench.prompts import mt_bench_prompts
from specserve.bench.report import markdown_table, plot_by_batch, write_csv
from specserve.config import MODEL_PAIRS, ChainDraft, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.models.loader import load_model, load_tokenizer
from specserve.policy import DSDEConfig
from specserve.sampling import SamplingParams

WORKLOADS = ("real", "synthetic")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="smollm2-bf16", choices=sorted(MODEL_PAIRS))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--policies", nargs="+", default=None, help="subset of the policy names (default: all)")
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests per run = this x batch size")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--static-sl", type=int, default=4, help="the best static SL (from bench spec)")
    p.add_argument("--budget", type=int, default=16, help="tree verify budget T")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--synthetic-mix", type=float, nargs="+", default=[0.9, 0.3])
    p.add_argument("--max-step-tokens", type=int, default=0, help="cap on tokens verified per step (0 = off)")
    p.add_argument("--guard", action="store_true", help="throughput guard: speculate only where it pays")
    p.add_argument("--repeats", type=int, default=2, help="round-robin repeats per batch size; medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out/batch"))


def policies(args: argparse.Namespace) -> dict[str, SpecConfig]:
    tree = {"beam_width": args.beam_width, "budget": args.budget}
    dsde = SLPolicyKind.dsde
    table = {
        "plain": SpecConfig(method=SpecMethod.none),
        f"static SL={args.static_sl}": SpecConfig(method=SpecMethod.chain, sl=args.static_sl),
        "DSDE no cap": SpecConfig(method=SpecMethod.chain, policy=dsde, dsde=DSDEConfig(cap_enabled=False)),
        "DSDE + SL_cap": SpecConfig(method=SpecMethod.chain, policy=dsde),
        "DDD": SpecConfig(method=SpecMethod.ddd, **tree),
        "DSDE+DDD": SpecConfig(method=SpecMethod.ddd, policy=dsde, **tree),
    }
    for spec in table.values():
        assert spec.chain_draft == ChainDraft.sampled  # greedy requests draft greedily anyway
    if args.policies:
        table = {k: v for k, v in table.items() if k in args.policies}
    return table


def run_one(
    engine: Engine, prompts: list[list[int]], lengths: list[int], spec: SpecConfig, accepts: list[float | None]
) -> dict[str, float]:
    engine.loop.metrics.clear()
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
    steps = list(engine.loop.metrics)
    drafting = [m for m in steps if m.levels > 0]
    caps = [m.cap for m in steps if m.cap is not None]
    lat = sorted(finish.values())
    return {
        "tok_s": tokens / seconds,
        "seconds": seconds,
        "steps": len(steps),
        "idle_fraction": statistics.mean(m.idle_fraction for m in drafting) if drafting else 0.0,
        "mean_sl": statistics.mean(d for m in drafting for d in m.depths) if drafting else 0.0,
        "mean_cap": statistics.mean(caps) if caps else 0.0,
        "p50_latency_s": lat[len(lat) // 2],
        "p99_latency_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        "draft_frac": sum(m.draft_s for m in steps) / seconds,
        "verify_frac": sum(m.verify_s for m in steps) / seconds,
    }


def run(args: argparse.Namespace) -> int:
    target_spec, draft_spec = MODEL_PAIRS[args.pair]
    target, draft = load_model(target_spec), load_model(draft_spec)
    tok = load_tokenizer(target_spec)
    rng = random.Random(args.seed)
    pool = mt_bench_prompts()
    rng.shuffle(pool)  # mixed categories
    table = policies(args)
    rows = []
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
            results: dict[str, list[dict[str, float]]] = {name: [] for name in table}
            for _ in range(args.repeats):  # round robin: load changes on a shared machine hit every policy alike
                for name, spec in table.items():
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
                    results[name].append(run_one(engine, prompts, lengths, spec, accepts))
            for name, runs in results.items():
                res = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows.append({"workload": label, "batch": bs, "policy": name, **res})
                print(
                    f"{label:22s} B={bs:3d} {name:14s} {res['tok_s']:7.1f} tok/s  idle {res['idle_fraction']:.3f}  "
                    f"p50 {res['p50_latency_s']:.2f}s p99 {res['p99_latency_s']:.2f}s",
                    flush=True,
                )
    for r in rows:
        base = (
            next(
                x
                for x in rows
                if x["workload"] == r["workload"] and x["batch"] == r["batch"] and x["policy"] == "plain"
            )
            if "plain" in table
            else None
        )
        r["vs_plain"] = r["tok_s"] / base["tok_s"] if base else float("nan")
    write_csv(args.out / "batch.csv", rows)
    plot(rows, args.out)
    print(
        markdown_table(
            [
                {
                    k: r[k]
                    for k in (
                        "workload",
                        "batch",
                        "policy",
                        "tok_s",
                        "vs_plain",
                        "idle_fraction",
                        "mean_sl",
                        "mean_cap",
                        "p50_latency_s",
                        "p99_latency_s",
                    )
                }
                for r in rows
            ]
        )
    )
    return 0


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for workload in sorted({r["workload"] for r in rows}):
        sub = [r for r in rows if r["workload"] == workload]
        fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
        for metric, ax in zip(("tok_s", "idle_fraction", "p50_latency_s", "p99_latency_s"), axes, strict=True):
            plot_by_batch(ax, sub, metric)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"specserve bench batch: {workload}")
        fig.tight_layout()
        name = "synthetic" if workload.startswith("SYNTHETIC") else "real"
        fig.savefig(out / f"batch_{name}.png", dpi=110)
        plt.close(fig)
