"""Straggler study: concurrency (batch size) x policy sweeps on a heterogeneous workload.

(a) in-process engine (default): per-step straggler metrics and per-step traces (``traces.jsonl``, replayed by
    ``load.simulate``), CSV, PNG plots and a markdown report;
(b) ``--url``: a running deployment over HTTP (streaming chat completions): request-level TTFT/TPOT and
    throughput, plus the lane metrics ``GET /metrics`` exposes (SL histogram, SL_cap, idle fraction);
(c) ``report``: merge saved sweeps (their ``traces.jsonl``) into one table, plots and report.

    .venv/bin/python -m load.straggler --pair tiny --batch-sizes 1 4 16 --out bench_out/straggler
    .venv/bin/python -m load.straggler report bench_out/a/traces.jsonl bench_out/b/traces.jsonl --out bench_out/ab

Workloads: ``real`` interleaves MT-bench categories with different acceptance (default coding + writing);
``synthetic`` is the SYNTHETIC acceptance mix (default 0.9 / 0.3), labelled SYNTHETIC everywhere.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from load.client import RemoteHostError, StreamStats, auth_headers, check_loopback, read_stream, sse_lines
from load.traces import (
    RunSettings,
    RunTrace,
    StepRecorder,
    WorkloadKind,
    append_trace,
    mean_idle,
    read_traces,
    refuse_repeats,
)
from specserve.api.http_guard import MAX_TIMEOUT_S
from specserve.arg_types import batch_size, finite_float, out_dir_arg, present_device_arg
from specserve.bench.batch_sweep import run_one
from specserve.bench.machine import device_summary
from specserve.bench.policies import CAP_LABELS, STUDY_POLICIES, PolicyName, check_steps_arg, policy_specs
from specserve.bench.prompt_sets import mt_bench_prompts
from specserve.bench.stats import (
    SWEEP_COLS,
    TTFT_TPOT_COLS,
    add_vs_baseline,
    cap_gains,
    markdown_table,
    median_interval,
    median_row,
    p50_p99,
    plot_sl,
    plot_workloads,
    workload_slugs,
    write_csv,
)
from specserve.config import MODEL_PAIRS, Drafter, DType, HeadQuant, HeadSpec, SpecConfig, SpecMethod
from specserve.console import console_safe
from specserve.engine import Engine
from specserve.errors import SettingsError, settings_problems
from specserve.guard import GuardConfig, ThroughputGuard
from specserve.heap import freeze_loaded_objects
from specserve.models.llama import LlamaModel
from specserve.policy.tree_floor import TreeFloor
from specserve.spec_decode.eagle_head import EagleHead
from specserve.timing import balanced_orders

T = TypeVar("T")
TINY_PAIR = "tiny"
TINY_BYTE_OFFSET = 3  # the tiny byte-level tokenizer's ids 3..258 are the 256 bytes (deployments/tiny_tokenizer.py)


SPEC_FLAGS = {  # the flag that sets each SpecConfig field here
    "sl": "--static-sl",
    "max_sl": "--max-sl",
    "model_max_sl": "--model-max-sl",
    "model_budget": "--model-budget",
    "budget": "--budget",
    "beam_width": "--beam-width",
    "ddd_check_steps": "--ddd-checks",
    "ddd_threshold": "--ddd-x",
    "tree_min_prob": "--tree-min-prob",
}


class StudyConfig(BaseModel):
    """Settings of one sweep (``python -m load.straggler``)."""

    model_config = ConfigDict(frozen=True)

    pair: str = TINY_PAIR  # "tiny" (random weights + noisy copy) or a name in specserve.config.MODEL_PAIRS
    tiny_noise: float = Field(default=0.01, ge=0.0, le=10.0, description="tiny draft = target + this relative noise")
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default=[1, 4, 16], min_length=1)
    policies: list[PolicyName] = Field(default=list(STUDY_POLICIES), min_length=1)
    workloads: list[WorkloadKind] = [WorkloadKind.real, WorkloadKind.synthetic]  # empty: the HTTP sweep only
    categories: list[str] = ["coding", "writing"]
    synthetic_mix: list[float] = [0.9, 0.3]
    requests_per_slot: int = Field(default=2, ge=1, description="requests per run = this x batch size")
    repeats: int = Field(default=1, ge=1, description="round-robin passes over the policies; medians reported")
    alternate: bool = Field(
        default=True,
        description="the repeats run the policies in balanced orders (A B, B A, ...; with three or more, every "
        "policy in every place and after every other as often over a cycle of n passes, 2n for an odd n): a run's "
        "position in its pass then favours no policy",
    )
    min_tokens: int = Field(default=32, ge=1)
    max_tokens: int = Field(default=96, ge=1)
    max_prompt_tokens: int | None = Field(default=None, ge=1, description="keep the last N prompt tokens")
    static_sl: int = Field(default=4, ge=1)
    max_sl: int | None = Field(default=None, ge=1, description="every speculative policy's ceiling on SL / depth")
    drafter: Drafter = Field(
        default=Drafter.model,
        description="who drafts for every speculative policy (lookup / suffix: the pair's "
        "draft where they find no match)",
    )
    model_max_sl: int | None = Field(default=None, ge=1, description="ceiling on the draft model's SL / depth")
    model_budget: int | None = Field(default=None, ge=2, description="ceiling on the draft model's tree budget T")
    budget: int = Field(default=16, ge=2)
    beam_width: int = Field(default=4, ge=1)
    ddd_check_steps: tuple[int, ...] | None = Field(default=None, description="DDD's check steps (None: the paper's)")
    ddd_threshold: float | None = Field(default=None, le=0.0, description="DDD's threshold x (None: the paper's)")
    tree_min_prob: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="trees: the least path draft probability verified (0: off)"
    )
    adaptive_floor: bool = Field(
        default=False, description="trees: the floor measured as the engine runs, from tree_min_prob (SpecConfig)"
    )
    max_step_tokens: int = Field(default=0, ge=0, description="cap on tokens verified per step (0 = off)")
    guard: bool = Field(default=False, description="the engine's throughput guard (speculate only where it pays)")
    warm_guard: bool = Field(
        default=False,
        description="each guarded policy keeps one guard (and, with adaptive_floor, one tree floor fit) across its "
        "runs, as a long-running server does, warmed by one untimed run per batch size first (default: a fresh guard "
        "per run, which pays its exploration each time)",
    )
    follow_drift: bool = Field(
        default=False, description="the guard follows the host's drift (GuardConfig.follow_drift; needs guard)"
    )
    freeze_gc: bool = Field(default=True, description="after loading, as serving does (specserve/heap.py)")
    seed: int = Field(default=0, ge=0, lt=1 << 63)
    threads: int | None = Field(default=None, ge=1, description="torch intra-op threads (None: torch's default)")
    device: str = Field(default="cpu", description="where the models run, e.g. cuda")
    dtype: DType | None = Field(default=None, description="every model's dtype (None: the pair's)")
    head_quant: HeadQuant | None = Field(default=None, description="the head's HeadSpec.quantize (None: the pair's)")
    head_products: Literal["float", "int8"] | None = Field(
        default=None, description="the head's quantised linears: HeadSpec.int8_products off or on (None: the pair's)"
    )
    int8_reads: bool = Field(
        default=False, description="the target's decoder products with int8 activations (ModelSpec.int8_reads)"
    )
    out: Path = Path("bench_out/straggler")
    http_max_prompt_chars: int | None = Field(default=None, ge=1, description="HTTP mode: truncate prompt text")
    http_timeout_s: float = Field(
        default=600.0,
        gt=0.0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="HTTP mode: a request's whole deadline, seconds",
    )
    url: str | None = None  # HTTP mode: a deployment's base URL (loopback only unless SPECSERVE_ALLOW_REMOTE=1)

    @model_validator(mode="after")
    def _check(self) -> StudyConfig:
        if self.pair != TINY_PAIR and self.pair not in MODEL_PAIRS:
            raise ValueError(f"unknown pair {self.pair!r}; choose {TINY_PAIR!r} or one of {sorted(MODEL_PAIRS)}")
        for name in ("head_quant", "head_products"):
            if getattr(self, name) is not None and not (
                self.pair in MODEL_PAIRS and isinstance(MODEL_PAIRS[self.pair][1], HeadSpec)
            ):
                raise ValueError(f"{name} applies to a pair that drafts with a head, not {self.pair!r}")
        if self.int8_reads and self.pair == TINY_PAIR:
            raise ValueError("int8_reads applies to a real target (its GGUF's Q4_1 blocks), not the tiny pair")
        if self.warm_guard and not self.guard:
            raise ValueError("warm_guard needs guard")
        if self.follow_drift and not self.guard:
            raise ValueError("follow_drift needs guard")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens > max_tokens")
        # runs are paired with plain's and merged by (workload, batch size, policy, repeat): a repeated value would
        # run twice under one key, and pair a policy with plain's runs of the other copy
        refuse_repeats("batch_sizes", self.batch_sizes)
        refuse_repeats("policies", [p.value for p in self.policies])
        refuse_repeats("workloads", [w.value for w in self.workloads])
        if not all(0.0 < a < 1.0 for a in self.synthetic_mix):
            raise ValueError("synthetic acceptance values must be in (0, 1)")
        known = {p.category for p in mt_bench_prompts()}
        if set(self.categories) - known:
            raise ValueError(f"unknown categories {sorted(set(self.categories) - known)}; known: {sorted(known)}")
        try:  # each policy's SpecConfig as the engine will check it (model_copy in specs() does not validate)
            for spec in self.specs().values():
                SpecConfig.model_validate(spec.model_dump())
        except ValidationError as e:
            raise ValueError(settings_problems(e, flags=SPEC_FLAGS)) from None
        return self

    @property
    def prompt_limit(self) -> int | None:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None or self.pair != TINY_PAIR else 96

    def run_settings(self) -> RunSettings:
        return RunSettings(
            **self.model_dump(include=set(RunSettings.model_fields) - {"dtype", "head_quant", "tiny_noise"}),
            dtype=None if self.dtype is None else self.dtype.value,
            head_quant=None if self.head_quant is None else self.head_quant.value,
            tiny_noise=self.tiny_noise if self.pair == TINY_PAIR else None,
        )

    def guard_config(self) -> GuardConfig:
        return GuardConfig(follow_drift=self.follow_drift)

    def specs(self) -> dict[PolicyName, SpecConfig]:
        table = policy_specs(
            static_sl=self.static_sl,
            beam_width=self.beam_width,
            budget=self.budget,
            ddd_check_steps=self.ddd_check_steps,
            ddd_threshold=self.ddd_threshold,
        )
        shared: dict[str, object] = {
            "drafter": self.drafter,
            "model_max_sl": self.model_max_sl,
            "model_budget": self.model_budget,
            "tree_min_prob": self.tree_min_prob,
            "adaptive_floor": self.adaptive_floor,
        }
        if self.max_sl is not None:
            shared["max_sl"] = self.max_sl
        return {p: table[p] if p == PolicyName.plain else table[p].model_copy(update=shared) for p in self.policies}


# ─────────────────────────── models and workload ───────────────────────────


@dataclass
class Models:
    target: LlamaModel
    draft: LlamaModel | EagleHead
    tokenizer: Any  # a PreTrainedTokenizerBase, or None for the tiny pair (prompts are byte ids)
    encode: Callable[[str], list[int]]


def load_models(cfg: StudyConfig) -> Models:
    if cfg.pair == TINY_PAIR:
        from specserve.models.tiny import noisy_copy, tiny_model

        dtype = None if cfg.dtype is None else cfg.dtype.torch
        target = tiny_model(seed=cfg.seed)
        copy = noisy_copy(target, cfg.tiny_noise, seed=cfg.seed + 1)
        vocab = target.cfg.vocab_size
        return Models(
            target.to(cfg.device, dtype),
            copy.to(cfg.device, dtype),
            None,
            lambda text: [TINY_BYTE_OFFSET + b % (vocab - TINY_BYTE_OFFSET) for b in text.encode()],
        )
    from specserve.models.loader import load_draft, load_model, load_tokenizer

    target_spec, draft_spec = MODEL_PAIRS[cfg.pair]
    if cfg.dtype is not None:
        target_spec = target_spec.model_copy(update={"dtype": cfg.dtype})
        draft_spec = draft_spec.model_copy(update={"dtype": cfg.dtype})
    if cfg.head_quant is not None and isinstance(draft_spec, HeadSpec):  # (StudyConfig refuses it for the others)
        draft_spec = draft_spec.model_copy(update={"quantize": cfg.head_quant})
    if cfg.head_products is not None and isinstance(draft_spec, HeadSpec):
        draft_spec = draft_spec.model_copy(update={"int8_products": cfg.head_products == "int8"})
    if cfg.int8_reads:
        target_spec = target_spec.model_copy(update={"int8_reads": True})
    target = load_model(target_spec, device=cfg.device)
    draft = load_draft(draft_spec, target, device=cfg.device)
    tok = load_tokenizer(target_spec)
    encoder = Engine(target, tok, max_batch_size=1)
    return Models(target, draft, tok, lambda text: encoder.encode(text, chat=True))


@dataclass(frozen=True)
class Workload:
    kind: WorkloadKind
    label: str
    prompts: list[list[int]]
    lengths: list[int]
    accepts: list[float | None]  # SYNTHETIC acceptance per request (None: from the models)
    categories: list[str]


def make_workload(cfg: StudyConfig, kind: WorkloadKind, n: int, encode: Callable[[str], list[int]]) -> Workload:
    """n requests interleaving the categories (real) or the SYNTHETIC acceptance values."""
    rng = random.Random(cfg.seed * 31 + n)
    by_cat = {c: mt_bench_prompts(categories=[c]) for c in cfg.categories}
    for pool in by_cat.values():
        rng.shuffle(pool)
    limit = cfg.prompt_limit
    prompts: list[list[int]] = []
    cats: list[str] = []
    accepts: list[float | None] = []
    for i in range(n):
        cat = cfg.categories[i % len(cfg.categories)]
        ids = encode(by_cat[cat][(i // len(cfg.categories)) % len(by_cat[cat])].text)
        prompts.append(ids[-limit:] if limit else ids)
        if kind == WorkloadKind.synthetic:
            a = cfg.synthetic_mix[i % len(cfg.synthetic_mix)]
            accepts.append(a)
            cats.append(f"synthetic a={a:g}")
        else:
            accepts.append(None)
            cats.append(cat)
    lengths = [rng.randint(cfg.min_tokens, cfg.max_tokens) for _ in range(n)]
    label = (
        "SYNTHETIC " + "/".join(f"{a:g}" for a in cfg.synthetic_mix)
        if kind == WorkloadKind.synthetic
        else "real " + "+".join(cfg.categories)
    )
    return Workload(kind, label, prompts, lengths, accepts, cats)


# ─────────────────────────── engine sweep ───────────────────────────


def check_fits(cfg: StudyConfig, models: Models, workloads: Sequence[Workload]) -> None:
    """Every request of every point gets all its output tokens (EOS ignored), checked before the first run: one the
    context limit cut short would make the report's output lengths, and the simulator's replay of them, wrong."""
    longest = max(len(p) + n for wl in workloads for p, n in zip(wl.prompts, wl.lengths, strict=True))
    for spec in cfg.specs().values():  # (the limit leaves each speculation its drafted tokens' room)
        limit = sweep_engine(cfg, models, 1, spec).loop.max_model_len
        if longest > limit:
            raise SettingsError(
                f"a request of {longest} tokens (prompt and output) does not fit the context limit of {limit}; "
                "lower --max-tokens or --max-prompt-tokens"
            )


def sweep_engine(cfg: StudyConfig, models: Models, batch: int, spec: SpecConfig) -> Engine:
    return Engine(
        models.target,
        models.tokenizer,
        draft=models.draft,
        speculation=spec,
        max_batch_size=batch,
        max_model_len=1024,
        max_step_tokens=cfg.max_step_tokens or None,
        throughput_guard=cfg.guard,
        guard=cfg.guard_config(),
    )


def run_engine_point(
    cfg: StudyConfig,
    models: Models,
    wl: Workload,
    batch: int,
    policy: PolicyName,
    spec: SpecConfig,
    repeat: int = 0,
    guard: ThroughputGuard | None = None,
    floor: TreeFloor | None = None,
) -> tuple[dict[str, Any], RunTrace]:
    """One run on a fresh engine; ``guard`` / ``floor``: a throughput guard / tree floor fit whose measurements
    carry over from earlier runs."""
    engine = sweep_engine(cfg, models, batch, spec)
    if guard is not None:
        engine.loop.planner.guard = guard
    if floor is not None:
        engine.loop.planner.floor = floor
    rec = StepRecorder.install(engine)
    res = run_one(engine, wl.prompts, wl.lengths, spec, wl.accepts)  # the batch benchmark's loop
    requests = rec.request_traces(wl.categories)
    trace = RunTrace(
        pair=cfg.pair,
        workload=wl.kind,
        label=wl.label,
        synthetic=wl.kind == WorkloadKind.synthetic,
        policy=policy,
        spec=spec,
        batch=batch,
        repeat=repeat,
        seconds=res["seconds"],
        tokens=sum(r.output_tokens for r in requests),
        requests=requests,
        steps=rec.steps,
        settings=cfg.run_settings(),
    )
    return row_from_trace(trace), trace


def row_from_trace(run: RunTrace) -> dict[str, Any]:
    """One run's figures, from its trace alone (so saved traces can be re-reported and merged)."""
    ttft = [r.ttft_s for r in run.requests if r.ttft_s is not None]
    tpot = [r.tpot_s for r in run.requests if r.tpot_s is not None]
    latency = [r.latency_s for r in run.requests if r.latency_s is not None]
    drafted = sum(s.drafted for st in run.steps for s in st.seqs)
    accepted = sum(s.accepted for st in run.steps for s in st.seqs)
    drafting = [st for st in run.steps if st.levels > 0]
    caps = [st.cap for st in run.steps if st.cap is not None]
    seconds = run.seconds or float("nan")
    return {
        "workload": run.label,
        "batch": run.batch,
        "policy": run.policy.label,
        "tok_s": run.tok_s,
        "idle_fraction": mean_idle(run.steps),
        # over the rows of the steps that drafted (none: NaN, which median_row leaves out: a pass that drafted on
        # no step gave 0.0, and the median of the passes read 0.05 where those that drafted went 0.09 deep)
        "mean_sl": statistics.mean(s.depth for st in drafting for s in st.seqs) if drafting else math.nan,
        "mean_cap": statistics.mean(caps) if caps else 0.0,
        "spec_steps": len(drafting) / len(run.steps) if run.steps else math.nan,  # how often the policy drafted
        "acceptance": accepted / drafted if drafted else math.nan,
        **p50_p99("ttft_s", ttft),
        **p50_p99("tpot_s", tpot),
        **p50_p99("latency_s", latency),
        "draft_frac": sum(st.draft_s for st in run.steps) / seconds,
        "verify_frac": sum(st.verify_s for st in run.steps) / seconds,
        "steps": len(run.steps),
        "seconds": run.seconds,
    }


def engine_sweep(cfg: StudyConfig) -> tuple[list[dict[str, Any]], list[RunTrace]]:
    """Per (workload, batch size), ``repeats`` round-robin passes over the policies (load changes on a shared
    machine then hit every policy alike); rows hold the medians, ``traces.jsonl`` every run."""
    models = load_models(cfg)
    if cfg.freeze_gc:
        freeze_loaded_objects()
    specs = cfg.specs()
    traces_path = cfg.out / "traces.jsonl"
    traces_path.unlink(missing_ok=True)
    total = len(cfg.workloads) * len(cfg.batch_sizes) * cfg.repeats * len(specs)
    guarded = [p for p, s in specs.items() if s.method != SpecMethod.none] if cfg.warm_guard else []
    guards = {p: ThroughputGuard(cfg.guard_config()) for p in guarded}
    floors = {p: TreeFloor() for p, s in specs.items() if s.adaptive_floor and s.is_tree} if cfg.warm_guard else {}
    traces: list[RunTrace] = []
    start = time.perf_counter()
    done = 0
    cold = True  # the process's first forwards (allocator, thread pool, kernels) would be timed in the first run
    points = [
        (batch, make_workload(cfg, kind, batch * cfg.requests_per_slot, models.encode))
        for kind in cfg.workloads
        for batch in cfg.batch_sizes
    ]
    check_fits(cfg, models, [wl for _, wl in points])
    for batch, wl in points:
        # untimed, every policy alike: with --warm-guard at every point (what a server that has served this
        # batch size knows), else once, at the first point (not plain's first run alone paying for the start)
        if cfg.warm_guard or cold:
            cold = False
            for policy, spec in specs.items():
                run_engine_point(
                    cfg, models, wl, batch, policy, spec, guard=guards.get(policy), floor=floors.get(policy)
                )
        for repeat in range(cfg.repeats):
            for policy, spec in pass_order(specs, repeat, cfg.alternate):
                row, trace = run_engine_point(
                    cfg, models, wl, batch, policy, spec, repeat, guards.get(policy), floors.get(policy)
                )
                traces.append(trace)
                append_trace(traces_path, trace)  # a long sweep keeps what it measured if it is stopped
                done += 1
                _progress(done, total, wl, batch, policy, row, time.perf_counter() - start)
    return summarize(traces), traces


def pass_order(
    specs: dict[PolicyName, SpecConfig], repeat: int, alternate: bool
) -> list[tuple[PolicyName, SpecConfig]]:
    return alternating(list(specs.items()), repeat, alternate)


def alternating(items: Sequence[T], repeat: int, alternate: bool) -> list[T]:
    """The policies of one round-robin pass: with ``alternate`` the passes take ``balanced_orders`` in turn (two
    policies: as given, then reversed), so that on a host whose speed drifts within a pass, or where the run after
    another is slower, every policy runs in every place and after every other as often (over a whole cycle of
    ``balanced_orders``: n passes, 2n for an odd n); else always as given.
    (Reversing alone never put a middle one of three or more first.)"""
    if not alternate:
        return list(items)
    orders = balanced_orders(len(items))
    return [items[i] for i in orders[repeat % len(orders)]]


PAIRED_COLS = ("paired_vs_plain", "paired_lo", "paired_hi", "paired_coverage")


def sweep_defaults(pair: str) -> RunSettings:
    """What a sweep of ``pair`` runs under unless told otherwise (a report names only the settings that differ)."""
    defaults = StudyConfig().run_settings()  # (of the tiny pair)
    return defaults if pair == TINY_PAIR else defaults.model_copy(update={"tiny_noise": None})


def summarize(traces: Sequence[RunTrace]) -> list[dict[str, Any]]:
    """Per (workload, batch size, policy) the medians over its runs and the throughput ratio to plain: of the
    medians (``vs_plain``) and paired by pass (``PAIRED_COLS``: the median of ``paired_ratios``, an interval for it
    and the interval's coverage)."""
    points: dict[tuple[str, int, PolicyName], list[dict[str, Any]]] = {}
    specs: dict[tuple[str, int, PolicyName], tuple[str, SpecConfig]] = {}
    settings: dict[tuple[str, int], RunSettings] = {}  # per workload and batch size: plain's runs pair with all
    pairs: dict[tuple[str, int], str] = {}  # (and so must be of the same model pair)
    for t in traces:
        key = (t.label, t.batch, t.policy)
        # sweeps of other pairs or settings merged by `report`: their medians would pool unlike runs
        if specs.setdefault(key, (t.pair, t.spec)) != (t.pair, t.spec):
            raise ValueError(
                f"runs of {t.policy.value} at batch {t.batch} ({t.label}) with different settings or model pairs "
                f"({specs[key][0]}, {t.pair})"
            )
        if pairs.setdefault(key[:2], t.pair) != t.pair:
            raise ValueError(
                f"runs at batch {t.batch} ({t.label}) of different model pairs ({pairs[key[:2]]}, {t.pair}): "
                "a policy's ratio to plain decoding would be to another pair's"
            )
        if t.settings is not None and settings.setdefault(key[:2], t.settings) != t.settings:
            defaults = sweep_defaults(t.pair)
            raise ValueError(
                f"runs at batch {t.batch} ({t.label}) under different settings: "
                f"{settings[key[:2]].describe(defaults)}; and {t.settings.describe(defaults)}"
            )
        points.setdefault(key, []).append(row_from_trace(t))
    order = {p: i for i, p in enumerate(PolicyName)}
    keys = sorted(points, key=lambda k: (k[0], k[1], order[k[2]]))
    rows = [{**median_row(points[k]), "repeats": len(points[k])} for k in keys]
    add_vs_baseline(rows, PolicyName.plain.label)
    ratios = paired_ratios(traces)
    for row, key in zip(rows, keys, strict=True):
        paired = ratios.get(key, [])
        median = statistics.median(paired) if paired else math.nan
        row |= dict(zip(PAIRED_COLS, (median, *median_interval(paired)), strict=True))
    return rows


def paired_ratios(traces: Sequence[RunTrace]) -> dict[tuple[str, int, PolicyName], list[float]]:
    """Per (workload, batch size, policy) its throughput over plain decoding's in each round-robin pass that ran
    both (the runs of a pass are minutes apart, so a host that drifts over a sweep moves both alike)."""
    plain = {(t.label, t.batch, t.repeat): t.tok_s for t in traces if t.policy == PolicyName.plain}
    out: dict[tuple[str, int, PolicyName], list[float]] = {}
    for t in traces:
        if (base := plain.get((t.label, t.batch, t.repeat))) is not None and base > 0:
            out.setdefault((t.label, t.batch, t.policy), []).append(t.tok_s / base)
    return out


def _progress(
    done: int, total: int, wl: Workload, batch: int, policy: PolicyName, row: dict[str, Any], elapsed: float
) -> None:
    print(
        f"[{done}/{total}] {wl.label:24s} B={batch:3d} {policy.label:14s} {row['tok_s']:8.1f} tok/s  "
        f"idle {row['idle_fraction']:.3f}  SL {row['mean_sl']:.2f}  p99 TTFT {row['p99_ttft_s']:.2f}s  "
        f"TPOT {row['p50_tpot_s'] * 1e3:.1f}ms  [{elapsed:.0f}s, ~{elapsed / done * (total - done):.0f}s left]",
        flush=True,
    )


# ─────────────────────────── HTTP sweep ───────────────────────────


class HttpPolicy(BaseModel):
    """A request-level policy over HTTP: the ``speculation`` extension (None = the deployment's default)."""

    model_config = ConfigDict(frozen=True)

    name: str
    speculation: dict[str, Any] | None


HTTP_POLICIES = (
    HttpPolicy(name="server default", speculation=None),
    HttpPolicy(name="plain", speculation={"enabled": False}),
    HttpPolicy(name="static SL", speculation={"policy": "static"}),
    HttpPolicy(name="DSDE", speculation={"policy": "dsde"}),
    HttpPolicy(name="max_sl=2", speculation={"max_sl": 2}),
)
# SL_cap is a deployment setting (speculation.dsde.cap_enabled in app.yaml): compare cap on/off with two deployments.


def scrape(client: Any, url: str) -> dict[str, float]:
    """Prometheus samples of /metrics: name -> value. Counters and histograms (as _sum / _count) are summed over
    their labels (the lanes); a gauge, a per-lane state such as the SL cap, gives its largest value."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = client.get(f"{url}/metrics")
    resp.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            value = float(sample.value)
            if family.type == "gauge":
                out[sample.name] = max(out.get(sample.name, value), value)
            elif sample.name.endswith(("_sum", "_count")) or family.type == "counter":
                out[sample.name] = out.get(sample.name, 0.0) + value
    return out


def _scrape_or_none(client: Any, url: str) -> dict[str, float] | None:
    import httpx

    try:
        return scrape(client, url)
    except (httpx.HTTPError, ValueError) as e:  # (ValueError: a body that is not Prometheus text)
        print(f"warning: {url}/metrics could not be read ({e}); this point's server metrics are NaN", file=sys.stderr)
        return None


def _stream_one(client: Any, url: str, body: dict[str, Any], deadline_s: float) -> StreamStats:
    """One streamed request's statistics; a connection refused, cut or timed out, or a stream still open
    ``deadline_s`` after it was sent, is this request's failure (the sweep goes on and counts it)."""
    import httpx

    t0 = time.perf_counter()
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=deadline_s) as resp:
            if resp.status_code != 200:
                return StreamStats(error=f"HTTP {resp.status_code}")
            return read_stream(sse_lines(resp.iter_bytes()), t0, deadline_s)
    except httpx.HTTPError as e:
        return StreamStats(error=f"{type(e).__name__}: {e}")


class ServerError(RuntimeError):
    """The --url server cannot be reached or does not answer as an OpenAI-style server."""


def served_model(client: Any, url: str) -> str:  # client: httpx.Client (imported where used)
    """The first model id of ``GET {url}/v1/models``, or ServerError saying why there is none."""
    import httpx

    try:
        r = client.get(f"{url}/v1/models", timeout=30.0)
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {url}: {e}") from None
    if r.status_code != 200:
        raise ServerError(f"GET {url}/v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"GET {url}/v1/models did not answer with an OpenAI model list: {r.text[:200]!r}") from None


def http_sweep(cfg: StudyConfig, client: Any = None) -> list[dict[str, Any]]:
    """Per concurrency, one set of requests (prompts and lengths) that every policy runs, ``repeats`` round-robin
    passes over the policies (in balanced orders with ``alternate``), after one untimed request per policy;
    the medians per (concurrency, policy), with ``vs_plain`` within the sweep. Each pass's row is appended to
    ``http_passes.jsonl`` in ``cfg.out`` as it ends (a sweep stopped part way keeps what it measured). ``client``:
    an httpx.Client (a test's transport; default one of its own)."""
    import httpx

    assert cfg.url is not None
    url = check_loopback(cfg.url).rstrip("/")
    prompts = [p.text for c in cfg.categories for p in mt_bench_prompts(categories=[c])]
    rng = random.Random(cfg.seed)
    with contextlib.ExitStack() as stack:
        if client is None:
            limits = httpx.Limits(max_connections=max(cfg.batch_sizes) + 4)
            client = stack.enter_context(httpx.Client(timeout=600.0, limits=limits))
        client.headers.update(auth_headers())  # a keyed deployment answered every request 401
        model = served_model(client, url)
        for pol in HTTP_POLICIES:  # untimed: the server's first forwards, and each policy's first drafts
            _stream_one(client, url, _http_body(model, prompts[0], cfg.min_tokens, cfg, pol), cfg.http_timeout_s)
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
        total, done = len(cfg.batch_sizes) * cfg.repeats * len(HTTP_POLICIES), 0
        passes_path = cfg.out / HTTP_PASSES
        passes_path.unlink(missing_ok=True)
        for conc in cfg.batch_sizes:
            asks = [  # the same requests for every policy: side by side, not different prompts
                (rng.choice(prompts), rng.randint(cfg.min_tokens, cfg.max_tokens))
                for _ in range(conc * cfg.requests_per_slot)
            ]
            for repeat in range(cfg.repeats):
                for pol in alternating(HTTP_POLICIES, repeat, cfg.alternate):
                    bodies = [_http_body(model, prompt, n, cfg, pol) for prompt, n in asks]
                    row = _http_point(client, url, conc, pol, bodies, cfg.http_timeout_s)
                    runs.setdefault((conc, pol.name), []).append(row)
                    with passes_path.open("a") as f:
                        f.write(json.dumps({**row, "repeat": repeat}) + "\n")
                    done += 1
                    print(
                        f"[{done}/{total}] HTTP C={conc:3d} {pol.name:28s} {row['tok_s']:8.1f} tok/s  "
                        f"failures {row['failures']}  p99 TTFT {row['p99_ttft_s']:.2f}s  "
                        f"mean SL of the drafting rows {row['mean_sl_drafting']:.2f}",
                        flush=True,
                    )
    rows = [
        {**median_row(r, keep=("concurrency",)), "repeats": len(r), **{k: sum(x[k] for x in r) for k in COUNTS}}
        for r in runs.values()
    ]  # counts over every pass: a failure in one pass of three is no median's 0
    plain = {r["concurrency"]: r["tok_s"] for r in rows if r["policy"] == "plain"}
    for r in rows:
        base = plain.get(r["concurrency"])
        r["vs_plain"] = r["tok_s"] / base if base else math.nan
    return rows


COUNTS = ("requests", "failures")  # an HTTP point's counts: summed over its passes, not their median
HTTP_PASSES = "http_passes.jsonl"  # in --out: every HTTP pass's row, written as the sweep goes
# what the HTTP sweep reads of the settings (it runs HTTP_POLICIES against the deployment's own models and settings)
HTTP_FIELDS = frozenset({
    "url", "batch_sizes", "categories", "requests_per_slot", "repeats", "alternate", "min_tokens", "max_tokens",
    "seed", "out", "http_max_prompt_chars", "http_timeout_s",
})  # fmt: skip


def _http_body(model: str, prompt: str, max_tokens: int, cfg: StudyConfig, pol: HttpPolicy) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt[: cfg.http_max_prompt_chars]}],
        "max_tokens": max_tokens,
        "temperature": 0.0,  # greedy, as the engine sweep: every policy writes the same text
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if pol.speculation is not None:
        body["speculation"] = pol.speculation
    return body


def _http_point(
    client: Any, url: str, conc: int, pol: HttpPolicy, bodies: list[dict[str, Any]], deadline_s: float
) -> dict[str, Any]:
    """One timed run of ``bodies`` at concurrency ``conc``, with the server's metrics over it (NaN where a scrape
    failed: a replica restarting answers 503, and the point's requests still count)."""
    before = _scrape_or_none(client, url)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(conc) as pool:
        results = list(pool.map(lambda b: _stream_one(client, url, b, deadline_s), bodies))
    seconds = time.perf_counter() - t0
    after = _scrape_or_none(client, url)
    ok = [r for r in results if r.failure() is None]

    def delta(name: str) -> float:
        if before is None or after is None:
            return float("nan")
        return after.get(name, 0.0) - before.get(name, 0.0)

    sl_n = delta("specserve_speculation_length_count")
    steps = delta("specserve_step_seconds_count")
    return {
        "concurrency": conc,
        "policy": pol.name,
        "requests": len(results),
        "failures": len(results) - len(ok),
        "tok_s": sum(r.output_tokens for r in ok) / seconds,
        **p50_p99("ttft_s", [r.ttft_s for r in ok if r.ttft_s is not None]),
        **p50_p99("tpot_s", [r.tpot_s for r in ok if r.tpot_s is not None]),
        "steps": steps,
        "mean_step_s": delta("specserve_step_seconds_sum") / steps if steps else float("nan"),
        "mean_batch": delta("specserve_batch_size_sum") / steps if steps else float("nan"),
        # the lane histogram records the rows that drafted: not the engine sweep's mean_sl over every row of a step
        "mean_sl_drafting": delta("specserve_speculation_length_sum") / sl_n if sl_n else float("nan"),
        "sl_cap_last": (after or {}).get("specserve_sl_cap", float("nan")),
        "idle_fraction_last": (after or {}).get("specserve_straggler_idle_fraction", float("nan")),
    }


# ─────────────────────────── plots and report ───────────────────────────

PANELS = ("tok_s", "idle_fraction", "p50_ttft_s", "p99_ttft_s", "p50_tpot_s", "p99_tpot_s")
REPORT_COLS = (*SWEEP_COLS, *PAIRED_COLS, "spec_steps", "acceptance", *TTFT_TPOT_COLS)


def plot_sweep(rows: Sequence[dict[str, Any]], out: Path, prefix: str = "straggler") -> list[Path]:
    return plot_workloads(
        rows,
        PANELS,
        out,
        prefix=prefix,
        title="engine sweep: {workload}",
        grid=(2, 3),
        panel_size=(13 / 3, 3.0),
        xlabel="batch size (concurrency)",
    )


def plot_sl_traces(traces: Sequence[RunTrace], out: Path, prefix: str = "straggler") -> list[Path]:
    """Drafted SL (tree depth) per row and step, the policy's SL before SL_cap where recorded, and SL_cap per step,
    for the DSDE policies at the largest batch."""
    paths = []
    slugs = workload_slugs(t.label for t in traces)
    for label in dict.fromkeys(t.label for t in traces):
        runs = [t for t in traces if t.label == label and t.repeat == 0 and t.policy.is_dsde]
        if not runs:
            continue
        big = max(t.batch for t in runs)
        series = [
            (
                t.policy.label,
                Counter(s.depth for st in t.steps for s in st.seqs if s.depth > 0),
                Counter(s.uncapped for st in t.steps for s in st.seqs if s.depth > 0 and s.uncapped),
                Counter(st.cap for st in t.steps if st.cap is not None),
            )
            for t in runs
            if t.batch == big
        ]
        path = out / f"{prefix}_sl_{slugs[label]}.png"
        title = f"SL distributions: {label}"
        paths.append(plot_sl(series, path, batch=big, title=title, sl_title="drafted SL / tree depth per row and step"))
    return paths


def _guard_state(cfg: StudyConfig) -> str:
    drift = ", following the host's drift" if cfg.follow_drift else ""
    if cfg.warm_guard:
        return f"one per policy across its runs (warmed by an untimed run per batch size){drift}"
    return f"fresh per run{drift}"


def write_report(cfg: StudyConfig, rows: Sequence[dict[str, Any]], images: Sequence[Path], setup: str = "") -> Path:
    setup = setup or (
        f"Pair `{cfg.pair}`, batch sizes {cfg.batch_sizes}, {cfg.requests_per_slot} requests per batch slot, "
        f"{cfg.min_tokens}-{cfg.max_tokens} output tokens (EOS ignored), all requests submitted at t = 0."
        + (f" Throughput guard on, {_guard_state(cfg)}." if cfg.guard else "")
        + ("" if cfg.freeze_gc else " Garbage collector not frozen after loading.")
        + f" {device_summary(cfg.device)}."
    )
    lines = [
        "# Straggler study (in-process engine)",
        "",
        f"{setup} Medians over the runs of each point; `paired_vs_plain` is the median over the sweep's "
        "round-robin passes of a policy's throughput over plain decoding's in the same pass, `paired_lo` to "
        "`paired_hi` a distribution-free interval for that median that covers it with probability "
        "`paired_coverage`. `mean_sl` is the mean drafted depth over the rows of the steps that drafted (nan: "
        "none did), `spec_steps` the fraction of steps that drafted. Rows labelled SYNTHETIC use forced acceptance "
        "probabilities: they measure the system, never quality.",
        "",
        markdown_table(rows, REPORT_COLS),
        "",
    ]
    gains = cap_gains(rows, CAP_LABELS)
    if gains:
        lines += ["## SL_cap: DSDE with SL_cap vs DSDE without", "", markdown_table(gains), ""]
    lines += [f"![{p.stem}]({p.name})" for p in images]
    path = cfg.out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ─────────────────────────── CLI ───────────────────────────


def parse_args(argv: Sequence[str] | None = None) -> StudyConfig:
    d = StudyConfig()
    p = argparse.ArgumentParser(prog="python -m load.straggler", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default=d.pair, help=f"{TINY_PAIR!r} or one of {sorted(MODEL_PAIRS)}")
    p.add_argument("--tiny-noise", type=finite_float, default=d.tiny_noise)
    p.add_argument("--batch-sizes", type=batch_size, nargs="+", default=d.batch_sizes)
    p.add_argument(
        "--policies", nargs="+", default=[x.value for x in d.policies], choices=[x.value for x in PolicyName]
    )
    p.add_argument(
        "--workloads", nargs="+", default=[w.value for w in d.workloads], choices=[w.value for w in WorkloadKind]
    )
    p.add_argument("--categories", nargs="+", default=d.categories)
    p.add_argument("--synthetic-mix", type=finite_float, nargs="+", default=d.synthetic_mix)
    p.add_argument("--requests-per-slot", type=int, default=d.requests_per_slot)
    p.add_argument("--repeats", type=int, default=d.repeats, help="round-robin passes; medians reported")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: 96 for tiny, unlimited otherwise")
    p.add_argument("--static-sl", type=int, default=d.static_sl)
    p.add_argument("--max-sl", type=int, default=None, help="ceiling on every speculative policy's SL / depth")
    p.add_argument("--drafter", default=d.drafter.value, choices=[x.value for x in Drafter], help="who drafts")
    p.add_argument("--model-max-sl", type=int, default=None, help="ceiling on the draft model's SL / depth")
    p.add_argument("--model-budget", type=int, default=None, help="ceiling on the draft model's tree budget T")
    p.add_argument("--budget", type=int, default=d.budget)
    p.add_argument("--beam-width", type=int, default=d.beam_width)
    p.add_argument(
        "--ddd-checks",
        dest="ddd_check_steps",
        type=check_steps_arg,
        default=None,
        help="DDD's check steps, comma-separated (default: the paper's 5,7,9)",
    )
    paper_x = SpecConfig.model_fields["ddd_threshold"].default
    p.add_argument(
        "--ddd-x", dest="ddd_threshold", type=finite_float, default=None, help=f"DDD's threshold x (default {paper_x})"
    )
    p.add_argument(
        "--tree-min-prob",
        type=finite_float,
        default=d.tree_min_prob,
        help="trees: the least path draft probability kept",
    )
    p.add_argument(
        "--adaptive-floor", action="store_true", help="trees: measure the floor as they run, from --tree-min-prob"
    )
    p.add_argument("--max-step-tokens", type=int, default=d.max_step_tokens)
    p.add_argument("--guard", action="store_true", help="the engine's throughput guard")
    p.add_argument(
        "--same-order", dest="alternate", action="store_false", help="every repeat runs the policies in one order"
    )
    p.add_argument(
        "--warm-guard", action="store_true", help="with --guard: one guard (and floor fit) per policy across its runs"
    )
    p.add_argument(
        "--follow-drift", action="store_true", help="with --guard: the guard follows the host's drift (off: default)"
    )
    p.add_argument(
        "--no-freeze-gc", dest="freeze_gc", action="store_false", help="leave the collector alone (serving freezes)"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="torch threads (1 on a shared machine)")
    p.add_argument("--device", default=d.device, type=present_device_arg, help="where the models run, e.g. cuda")
    p.add_argument("--dtype", default=None, choices=[x.value for x in DType], help="every model's dtype")
    p.add_argument(
        "--head-quant", default=None, choices=[x.value for x in HeadQuant], help="a draft head's weights at load"
    )
    p.add_argument(
        "--head-products",
        default=None,
        choices=["float", "int8"],
        help="a draft head's quantised linears with float or int8 activations (HeadSpec.int8_products)",
    )
    p.add_argument(
        "--int8-reads",
        action="store_true",
        help="the target's decoder products with int8 activations, on the AMX tiles, VNNI or AVX2 "
        "(ModelSpec.int8_reads)",
    )
    p.add_argument("--out", type=out_dir_arg, default=d.out)
    p.add_argument(
        "--url",
        default=None,
        help="also sweep a deployment over HTTP, e.g. http://127.0.0.1:8000 (its own policies, on the deployment's "
        "models and settings: --pair, --policies and the speculation flags set the engine sweep only)",
    )
    p.add_argument("--http-only", action="store_true", help="skip the in-process engine sweep")
    p.add_argument("--http-max-prompt-chars", type=int, default=None, help="truncate prompts (tiny deployments)")
    p.add_argument(
        "--http-timeout-s", type=float, default=d.http_timeout_s, help="a request's deadline from send to [DONE]"
    )
    args = vars(p.parse_args(argv))
    http_only = args.pop("http_only")
    if http_only and (engine_only := [k for k, v in args.items() if k not in HTTP_FIELDS and v != p.get_default(k)]):
        flags = SPEC_FLAGS | {"freeze_gc": "--no-freeze-gc"}
        names = ", ".join(flags.get(k, "--" + k.replace("_", "-")) for k in engine_only)
        p.error(
            f"{names} set the in-process engine sweep, which --http-only skips (the HTTP sweep runs its own policies "
            "against the deployment's models and settings)"
        )
    try:
        cfg = StudyConfig.model_validate(args)
    except ValidationError as e:
        p.error(settings_problems(e, as_flags=True, flags=SPEC_FLAGS))
    if http_only and cfg.url is None:
        p.error("--http-only needs --url")
    return cfg.model_copy(update={"workloads": [] if http_only else cfg.workloads})


def merged_traces(paths: Sequence[Path]) -> list[RunTrace]:
    """The runs of saved sweeps. Each sweep numbers its passes from 0: where a point (workload, batch size) was in an
    earlier file, a later file's passes of it are numbered on from there, so that a pass pairs a policy's run with
    plain decoding's from the same sweep; a point first seen keeps its numbers (its pass 0 is the one plotted)."""
    traces: list[RunTrace] = []
    next_pass: dict[tuple[str, int], int] = {}
    if len({p.resolve() for p in paths}) != len(paths):  # (counted its passes twice: a narrower interval)
        raise ValueError(f"a traces file is given twice: {[str(p) for p in paths]}")
    seen: dict[str, Path] = {}  # a run's content (its pass number left out) -> the file it came from
    for path in paths:
        runs = read_traces(path)
        keys = Counter((t.label, t.batch, t.policy, t.repeat) for t in runs)
        if twice := [k for k, n in keys.items() if n > 1]:  # a sweep runs each once: several sweeps in one file
            label, batch, policy, repeat = twice[0]
            raise ValueError(
                f"{path} holds {keys[twice[0]]} runs of {policy.value} at batch {batch}, {label}, pass {repeat}: "
                "several sweeps in one file (a cat of them?) pair with each other's plain runs; give each sweep's "
                "traces.jsonl on its own"
            )
        for t in runs:  # ... or a copy of one (a backup directory a glob matched)
            content = hashlib.sha256(t.model_copy(update={"repeat": 0}).model_dump_json().encode()).hexdigest()
            if (earlier := seen.setdefault(content, path)) != path:
                raise ValueError(
                    f"{path} and {earlier} hold the same run ({t.policy.value} at batch {t.batch}, {t.label}): a "
                    "sweep merged twice would count its passes twice"
                )
        first = {(t.label, t.batch): next_pass.get((t.label, t.batch), 0) for t in runs}
        runs = [t.model_copy(update={"repeat": first[t.label, t.batch] + t.repeat}) for t in runs]
        for t in runs:
            next_pass[t.label, t.batch] = max(next_pass.get((t.label, t.batch), 0), t.repeat + 1)
        traces += runs
    return traces


def report_from_traces(paths: Sequence[Path], out: Path) -> Path:
    """Merge saved sweeps (their traces.jsonl) into one table, plots and report, without running anything."""
    traces = merged_traces(paths)
    if not traces:
        raise ValueError(f"no runs in {[str(p) for p in paths]}")
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(traces)
    write_csv(out / "straggler.csv", rows)
    images = plot_sweep(rows, out) + plot_sl_traces(traces, out)
    pairs = sorted({t.pair for t in traces})
    kept = sorted({t.settings.describe(sweep_defaults(t.pair)) for t in traces if t.settings is not None})
    unkept = sum(t.settings is None for t in traces)
    setup = (
        f"Merged from {', '.join(f'`{p}`' for p in paths)}: pair {', '.join(pairs)}, batch sizes "
        f"{sorted({t.batch for t in traces})}, {len(traces)} runs. Settings: {'; '.join(kept) or 'not recorded'}"
        + (f" ({unkept} runs recorded without theirs)." if unkept and kept else ".")
    )
    return write_report(StudyConfig(out=out), rows, images, setup)


def main(argv: Sequence[str] | None = None) -> int:
    with console_safe():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "report":
        p = argparse.ArgumentParser(prog="python -m load.straggler report", description=report_from_traces.__doc__)
        p.add_argument("traces", type=Path, nargs="+", help="traces.jsonl files of earlier sweeps")
        p.add_argument("--out", type=out_dir_arg, required=True)
        args = p.parse_args(argv[1:])
        try:
            print(f"wrote {report_from_traces(args.traces, args.out)}")
        except OSError as e:
            p.error(f"cannot read {e.filename}: {e.strerror}")
        except ValueError as e:  # a line that is not a run trace, or no runs at all
            p.error(str(e))
        return 0
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if cfg.url is not None:  # fail before the engine sweep, not after it
        import httpx

        try:
            with httpx.Client(headers=auth_headers()) as client:
                served_model(client, check_loopback(cfg.url).rstrip("/"))
        except (RemoteHostError, ServerError) as e:
            print(f"python -m load.straggler: error: --url: {e}", file=sys.stderr)
            return 2
    if cfg.workloads:
        try:
            rows, traces = engine_sweep(cfg)
        except SettingsError as e:
            print(f"python -m load.straggler: error: {e}", file=sys.stderr)
            return 2
        write_csv(cfg.out / "straggler.csv", rows)
        images = plot_sweep(rows, cfg.out) + plot_sl_traces(traces, cfg.out)
        print(markdown_table(rows, REPORT_COLS))
        gains = cap_gains(rows, CAP_LABELS)
        if gains:
            print(markdown_table(gains))
        print(f"wrote {write_report(cfg, rows, images)}, straggler.csv, traces.jsonl and {len(images)} plots")
    if cfg.url is not None:
        try:
            http_rows = http_sweep(cfg)
        except (RemoteHostError, ServerError) as e:  # (gone since the check above: the engine sweep took hours)
            print(f"python -m load.straggler: error: --url: {e}", file=sys.stderr)
            return 2
        write_csv(cfg.out / "http.csv", http_rows)
        print(markdown_table(http_rows))
        if any(r["failures"] for r in http_rows):
            print("some HTTP requests failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
