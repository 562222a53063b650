"""Discrete-event simulation of ONE lane (one lock-step draft batch) at batch sizes past this machine.

Each step runs the serving planner (``specserve.policy.planner.SLPlanner``: SequenceDSDE per sequence or the
static depth, then SL_cap over the batch and max_sl, as the step loop calls it), replays each sequence's
acceptance and KLD outcomes from a recorded
sequence (``load.traces.SeqTrace``, one whole recorded sequence per simulated one), and advances the clock by a
device cost model: all rows draft in lock-step, so the draft takes one forward per level over the rows still
drafting; the verify is one forward over all tokens; plus host overhead.

    .venv/bin/python -m load.simulate --traces bench_out/straggler/traces.jsonl --validate \
        --batch-sizes 1 16 64 128 256 512 --out bench_out/sim
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from load.cost import CostModel, FitKind, RooflineName, fit_quality, measure_cost_model
from load.traces import (
    SIMULATED_POLICIES,
    RequestTrace,
    RunSettings,
    RunTrace,
    SeqTrace,
    TreeSeqTrace,
    WorkloadKind,
    cost_samples,
    mean_idle,
    read_traces,
    refuse_repeats,
    request_class,
    sequence_traces,
    tree_sequence_traces,
)
from specserve.arg_types import out_dir_arg, out_file_arg, positive_int, present_device_arg
from specserve.bench.policies import CAP_LABELS, PolicyName, policy_specs
from specserve.bench.stats import (
    SWEEP_COLS,
    TTFT_TPOT_COLS,
    add_vs_baseline,
    cap_gains,
    markdown_table,
    p50_p99,
    plot_sl,
    plot_workloads,
    tpot,
    workload_slugs,
    write_csv,
)
from specserve.config import Drafter, DType, SLPolicyKind, SpecConfig, SpecMethod
from specserve.console import console_safe
from specserve.errors import SpecServeError, settings_problems
from specserve.models.llama import LlamaModel
from specserve.policy import SequenceDSDE, verified_positions
from specserve.policy.planner import SLPlanner
from specserve.step_events import idle_fraction

T = TypeVar("T")
TINY_SOURCE = "tiny"  # --measure-target / --measure-draft: the random-weight tiny model

# ─────────────────────────── workload and settings ───────────────────────────


class ArrivalKind(str, Enum):
    closed = "closed"  # every request arrives at t = 0 (as the engine sweep submits them)
    poisson = "poisson"  # open loop at `rate_per_s`


class WorkloadSpec(BaseModel):
    """Simulated requests: classes assigned round robin (as the engine sweep interleaves them), a whole recorded
    sequence of that class drawn per request; output lengths from the trace unless min/max tokens are given."""

    model_config = ConfigDict(frozen=True)

    num_requests: int = Field(ge=1)
    classes: list[str] = Field(min_length=1)
    min_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    arrival: ArrivalKind = ArrivalKind.closed
    rate_per_s: float | None = Field(default=None, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if self.arrival == ArrivalKind.poisson and self.rate_per_s is None:
            raise ValueError("poisson arrivals need rate_per_s")
        if (self.min_tokens is None) != (self.max_tokens is None):
            raise ValueError("give both min_tokens and max_tokens, or neither")
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens > max_tokens")
        return self


class SimConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    batch_size: int = Field(ge=1)
    policy: PolicyName
    spec: SpecConfig  # speculation settings of the policy (static SL, DSDE parameters incl. cap_enabled)
    max_step_tokens: int | None = Field(default=None, ge=1)  # the planner's step budget, as the sweep ran it

    @field_validator("policy")
    @classmethod
    def _simulated(cls, p: PolicyName) -> PolicyName:
        if p not in SIMULATED_POLICIES:
            raise ValueError(f"the simulator covers {[x.value for x in SIMULATED_POLICIES]}, not {p.value!r}")
        return p

    @field_validator("spec")
    @classmethod
    def _model_drafts(cls, spec: SpecConfig) -> SpecConfig:
        if spec.drafter != Drafter.model:
            raise ValueError(f"the simulator replays draft-model steps; drafter {spec.drafter.value!r} is not covered")
        return spec


@dataclass(frozen=True)
class SimRequest:
    trace: SeqTrace | TreeSeqTrace  # a position stream (chains) or a step stream (trees)
    max_tokens: int
    prompt_len: int
    arrival: float = 0.0


Pool = dict[str, list[SeqTrace | TreeSeqTrace]]


Prompts = dict[str, list[RequestTrace]]  # by class: the recorded requests a simulated workload draws from


def recorded_prompts(runs: Iterable[RunTrace]) -> Prompts:
    """The runs' distinct requests by class, in a fixed order: every policy's workload is drawn from these with one
    seed, so each replays the same prompts and lengths (its own recording of each where its pool has one)."""
    seen: dict[str, dict[tuple[str | None, int, int], RequestTrace]] = {}
    for run in runs:
        for q in run.requests:
            seen.setdefault(request_class(q), {}).setdefault((q.prompt_key, q.prompt_len, q.max_tokens), q)
    return {c: [qs[k] for k in sorted(qs, key=lambda k: (k[0] or "", k[1], k[2]))] for c, qs in seen.items()}


def make_requests(
    pool: Pool, spec: WorkloadSpec, rng: random.Random, prompts: Prompts | None = None
) -> list[SimRequest]:
    """``prompts``: draw recorded requests (prompt and max_tokens) and replay each with the pool's recording of that
    prompt (the pool's i-th sequence of its class where it has none), so that draws with one seed give every policy
    the same workload however its pool differs; without, draw the pool's sequences themselves."""
    missing = [c for c in spec.classes if not pool.get(c) or (prompts is not None and not prompts.get(c))]
    if missing:
        raise ValueError(f"no recorded sequences of class {missing}; have {sorted(pool)}")
    out, t = [], 0.0
    for i in range(spec.num_requests):
        cls = spec.classes[i % len(spec.classes)]
        if prompts is None:
            trace = rng.choice(pool[cls])
            recorded_n, prompt_len = trace.max_tokens, trace.prompt_len
        else:
            q = rng.choice(prompts[cls])
            trace = _same_prompt(pool, q) or pool[cls][i % len(pool[cls])]  # (no draw: the next ones stay shared)
            recorded_n, prompt_len = q.max_tokens, q.prompt_len
        n = recorded_n if spec.min_tokens is None else rng.randint(spec.min_tokens, spec.max_tokens or 1)
        if spec.arrival == ArrivalKind.poisson:
            assert spec.rate_per_s is not None
            t += rng.expovariate(spec.rate_per_s)
        out.append(SimRequest(trace, n, prompt_len, t))
    return out


def trace_pool(runs: Iterable[RunTrace], policy: PolicyName = PolicyName.dsde_cap) -> Pool:
    """Recorded sequences by class for simulating ``policy``: chains and plain decoding replay the DSDE chain
    runs (they recorded KLD); DDD replays the DDD runs (depths DDD chose under its own depth limit); DSDE+DDD
    with or without the cap replays the DSDE+DDD runs without the cap where there are any (else those with it):
    they recorded KLD along the tree, and depths no cap cut short."""
    runs = list(runs)
    if not policy.is_tree:
        chains: Pool = {}
        for run in runs:
            if run.has_kld:
                for seq in sequence_traces(run):
                    chains.setdefault(seq.cls, []).append(seq)
        return chains
    sources = [PolicyName.ddd]
    if policy != PolicyName.ddd:  # prefer recordings without SL_cap: its depths are not cut by the cap
        uncut = any(r.policy == PolicyName.dsde_ddd_nocap for r in runs)
        sources = [PolicyName.dsde_ddd_nocap] if uncut else [PolicyName.dsde_ddd]
    trees: Pool = {}
    for run in runs:
        if run.policy in sources:
            for tseq in tree_sequence_traces(run):
                trees.setdefault(tseq.cls, []).append(tseq)
    return trees


def tree_nodes(depth: int, width: int, budget: int) -> int:
    """Nodes EAGLE-2 reranking keeps from a tree of ``depth`` levels: the root's w children, then w x w
    candidates per later level, at most budget - 1."""
    return min(budget - 1, width + (depth - 1) * width * width) if depth > 0 else 0


# ─────────────────────────── the event loop ───────────────────────────


@dataclass
class _Seq:
    req: SimRequest
    spec: SpecConfig
    sl_state: SequenceDSDE | None  # None: static SL
    cursor: int = 0
    emitted: int = 0
    fed: int = 0  # tokens the next step feeds the target (the prompt first)
    unseen: int = 0  # tokens before those its draft has not read (steps it did not draft in)
    first: float | None = None
    last: float | None = None

    def outcome(self, depth: int) -> tuple[int, list[float]]:
        """Accepted drafted tokens for a chain draft of ``depth`` and the KLDs of the verified positions."""
        trace = self.req.trace
        assert isinstance(trace, SeqTrace), "a chain policy replays chain traces"
        acc, klds = trace.accepts, trace.klds
        n = len(acc)
        a = 0
        while a < depth and acc[(self.cursor + a) % n]:
            a += 1
        verified = verified_positions(depth, a)
        kld = [klds[(self.cursor + i) % n] for i in range(verified)]
        self.cursor += verified
        return a, kld

    def tree_outcome(self, budget: int, spec: SpecConfig) -> tuple[int, int, int, int, list[float]]:
        """(depth, verified depth, nodes, accepted, KLDs) of a tree step with depth budget ``budget``: the next
        recorded step, cut to ``budget`` levels. A recorded depth that hit its own budget is a lower bound of what
        the tree would have grown; the replay never grows a tree deeper than recorded. The verified depth (what
        DSDE observes: the rerank may drop grown levels) is the recorded one, within the cut."""
        trace = self.req.trace
        assert isinstance(trace, TreeSeqTrace), "a tree policy replays tree traces"
        r = trace.steps[self.cursor % len(trace.steps)]
        self.cursor += 1
        depth = min(r.depth, budget)
        # (a cut tree: what the rerank keeps of its levels, within the drafter's own budget and the nodes recorded)
        cut = min(r.drafted, tree_nodes(depth, spec.beam_width, spec.max_tree_nodes + 1))
        nodes = r.drafted if depth == r.depth else cut
        accepted = min(r.accepted, depth)
        verified = depth if r.verified is None else max(accepted, min(r.verified, depth))
        # a KLD at each accepted node that was a beam (the root and levels 1..depth-1): a path accepted to the cut's
        # last level ends at a leaf with no q, whatever the recorded tree grew below it
        return depth, verified, nodes, accepted, r.kld[: min(accepted + 1, depth)]


@dataclass
class SimResult:
    tokens: int
    seconds: float
    steps: int
    idle_fraction: float  # mean over drafting steps
    mean_sl: float  # mean drafted depth over every row of the steps that drafted (as load.straggler's and the engine's)
    mean_cap: float
    ttft_s: list[float]
    tpot_s: list[float]
    latency_s: list[float]
    draft_s: float
    verify_s: float
    host_s: float
    sl_hist: Counter[int] = field(default_factory=Counter)  # drafted depth per row and step
    uncapped_hist: Counter[int] = field(default_factory=Counter)  # SL_i before the cap
    cap_hist: Counter[int] = field(default_factory=Counter)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "tok_s": self.tok_s,
            "seconds": self.seconds,
            "steps": self.steps,
            "idle_fraction": self.idle_fraction,
            "mean_sl": self.mean_sl,
            "mean_cap": self.mean_cap,
            **p50_p99("ttft_s", self.ttft_s),
            **p50_p99("tpot_s", self.tpot_s),
            "draft_frac": self.draft_s / self.seconds if self.seconds else 0.0,
            "verify_frac": self.verify_s / self.seconds if self.seconds else 0.0,
        }


def _sl_state(cfg: SimConfig) -> SequenceDSDE | None:
    return SequenceDSDE(cfg.spec.dsde) if cfg.spec.policy == SLPolicyKind.dsde else None


def simulate(requests: Sequence[SimRequest], cfg: SimConfig, cost: CostModel) -> SimResult:
    planner = None if cfg.policy == PolicyName.plain else SLPlanner(max_step_tokens=cfg.max_step_tokens)
    tree = cfg.policy.is_tree
    width = cfg.spec.beam_width if tree else 1
    arrivals = [(r.arrival, i, r) for i, r in enumerate(requests)]
    heapq.heapify(arrivals)
    waiting: list[_Seq] = []
    running: list[_Seq] = []
    done: list[_Seq] = []
    t = 0.0
    steps = tokens = 0
    draft_total = verify_total = host_total = 0.0
    idles: list[float] = []
    caps: list[int] = []
    sl_rows = sl_sum = 0  # rows of the steps that drafted (rows planned 0 in them too) and their depths
    res = SimResult(0, 0.0, 0, 0.0, 0.0, 0.0, [], [], [], 0.0, 0.0, 0.0)
    while arrivals or waiting or running:
        while arrivals and arrivals[0][0] <= t:
            _, _, r = heapq.heappop(arrivals)
            waiting.append(_Seq(r, cfg.spec, _sl_state(cfg), fed=r.prompt_len))
        while waiting and len(running) < cfg.batch_size:
            running.append(waiting.pop(0))
        if not running:
            t = arrivals[0][0]
            continue
        # plan: the serving planner (SL_i per sequence, SL_cap over the lock-step batch, max_sl)
        if planner is None:
            planned, uncapped, cap, cuts = [0] * len(running), [], None, [False] * len(running)
        else:
            plan = planner.plan(running, room=[s.req.max_tokens - s.emitted for s in running])
            planned, uncapped, cap = plan.depths, plan.uncapped, plan.cap
            cuts = [plan.was_cut(i, by_model=True) for i in range(len(running))]  # (draft-model steps only)
        # a drafting row's draft reads every token it has not seen: the prompt, and what it missed while not drafting
        extra_fed = sum(s.unseen + s.fed - 1 for s, d in zip(running, planned, strict=True) if d > 0)
        verify_tokens = emitted_step = 0
        emits: list[int] = []
        depths: list[int] = []  # levels each row drafted (a DDD tree may stop before its planned depth)
        for s, d, cut in zip(running, planned, cuts, strict=True):
            kld: list[float] = []
            if d == 0:
                depth = verified = nodes = a = 0
            elif tree:
                depth, verified, nodes, a, kld = s.tree_outcome(d, cfg.spec)
            else:  # the draft model's share of the planned depth, as the step loop drafts (model_max_sl)
                depth = verified = nodes = cfg.spec.model_depth(d)
                a, kld = s.outcome(depth)
            if depth > 0 and s.sl_state is not None:
                s.sl_state.observe(kld, verified, a, cut=cut)  # as the step loop: a tree's verified depth
            n = min(a + 1, s.req.max_tokens - s.emitted)
            emits.append(n)
            depths.append(depth)
            emitted_step += n
            verify_tokens += s.fed + nodes
            s.unseen = 0 if d > 0 else s.unseen + s.fed
            s.fed = 1
        drafting_rows = sum(d > 0 for d in depths)
        dr = cost.draft_s(depths, extra_fed, [width] * len(depths))
        vr = cost.verify_s(len(running), verify_tokens, drafting_rows, drafting_rows if tree else 0)
        ho = cost.overhead_s(len(running), emitted_step, drafting_rows)
        t += dr + vr + ho
        draft_total, verify_total, host_total = draft_total + dr, verify_total + vr, host_total + ho
        steps += 1
        tokens += emitted_step
        if any(depths):
            idles.append(idle_fraction(depths))
            sl_rows, sl_sum = sl_rows + len(depths), sl_sum + sum(depths)
            res.sl_hist.update(d for d in depths if d > 0)
            res.uncapped_hist.update(uncapped)
        if cap is not None:
            caps.append(cap)
            res.cap_hist[cap] += 1
        for s, n in zip(running, emits, strict=True):
            if n > 0:
                s.first = t if s.first is None else s.first
                s.last = t
                s.emitted += n
        finished = [s for s in running if s.emitted >= s.req.max_tokens]
        if finished:
            done += finished
            running = [s for s in running if s.emitted < s.req.max_tokens]
    res.tokens, res.seconds, res.steps = tokens, t, steps
    res.idle_fraction = statistics.mean(idles) if idles else 0.0
    res.mean_sl = sl_sum / sl_rows if sl_rows else 0.0
    res.mean_cap = statistics.mean(caps) if caps else 0.0
    res.draft_s, res.verify_s, res.host_s = draft_total, verify_total, host_total
    for s in done:
        assert s.first is not None and s.last is not None
        res.ttft_s.append(s.first - s.req.arrival)
        res.latency_s.append(s.last - s.req.arrival)
        per_token = tpot(s.first, s.last, s.emitted)
        if per_token is not None:
            res.tpot_s.append(per_token)
    return res


# ─────────────────────────── validation against engine runs ───────────────────────────


class ValidationMode(str, Enum):
    in_sample = "in_sample"  # cost model and sequence pool from all runs
    leave_batch_out = "leave_batch_out"  # ... from runs at other batch sizes only (extrapolation test)


def validate(
    runs: Sequence[RunTrace],
    mode: ValidationMode,
    *,
    fit: FitKind = FitKind.linear,
    seed: int = 0,
    repeats: int = 3,
) -> list[dict[str, Any]]:
    """Simulate every measured point with its own requests (class, prompt and output lengths) and
    compare throughput and idle fraction with the median over the sweep's repeats of that point. Sequence
    outcomes come from the pool of the same workload."""
    groups: dict[tuple[str, PolicyName, int], list[RunTrace]] = {}
    for run in runs:
        if run.policy in SIMULATED_POLICIES:
            groups.setdefault((_workload_label(run), run.policy, run.batch), []).append(run)
    rows = []
    costs: dict[int | None, CostModel] = {}  # by the batch size left out of the fit (None: in-sample)
    for (label, policy, batch), measured in groups.items():
        run = measured[0]
        left_out = batch if mode == ValidationMode.leave_batch_out else None
        train = [r for r in runs if r.batch != left_out]
        if not train:  # traces of this batch size alone: nothing to fit outside it, and in-sample is not this mode
            print(
                f"  no runs outside batch {batch} to fit on; {policy.label} on {label} not validated", file=sys.stderr
            )
            continue
        if left_out not in costs:  # one fit per training set, not per point
            costs[left_out] = CostModel.fit(cost_samples(train), fit)
        # only the training runs: taken from every run, a point left out would replay its own sequences
        pool = trace_pool((r for r in train if r.workload == run.workload), policy)
        if not pool:  # (plain decoding replays chain runs' sequences: a sweep of plain and DDD has none)
            where = "" if left_out is None else f" outside batch {left_out}"
            print(f"  no recorded sequences{where} to replay {policy.label} on {label}; not validated", file=sys.stderr)
            continue
        own = [_same_prompt(pool, q) for q in run.requests]
        sims = []
        for k in range(repeats):
            rng = random.Random(seed * 7919 + k)
            reqs = []
            for q, same in zip(run.requests, own, strict=True):
                cands = pool.get(request_class(q)) or [s for v in pool.values() for s in v]
                reqs.append(SimRequest(same or rng.choice(cands), q.max_tokens, q.prompt_len))
            cfg = SimConfig(batch_size=batch, policy=policy, spec=run.spec, max_step_tokens=step_budget(measured))
            sims.append(simulate(reqs, cfg, costs[left_out]))
        matched = sum(t is not None for t in own) / len(own)
        sim_tok_s = statistics.mean(s.tok_s for s in sims)
        measured_tok_s = statistics.median(r.tok_s for r in measured)
        rows.append(
            {
                "mode": mode.value,
                "fit": fit.value,
                "workload": label,
                "policy": policy.label,
                "batch": batch,
                "runs": len(measured),
                "measured_tok_s": measured_tok_s,
                "sim_tok_s": sim_tok_s,
                "error": sim_tok_s / measured_tok_s - 1.0,
                "measured_idle": statistics.median(mean_idle(r.steps) for r in measured),
                "sim_idle": statistics.mean(s.idle_fraction for s in sims),
                "same_prompt": matched,
            }
        )
    return rows


def _same_prompt(pool: Pool, q: RequestTrace) -> SeqTrace | TreeSeqTrace | None:
    """The longest recorded sequence of the same prompt (its ``prompt_key``; class and prompt length in traces
    without one), if the pool has one. Greedy decoding is lossless, so a prompt's outputs, and the draft's agreement
    with them, are the same under every policy: replaying its own recording isolates the simulator's mechanics and
    costs from prompt-to-prompt acceptance variance (a batch-1 run is a single prompt)."""
    same = [
        t
        for t in pool.get(request_class(q), [])
        if t.prompt_len == q.prompt_len and (q.prompt_key is None or t.prompt_key in (None, q.prompt_key))
    ]
    return max(same, key=_recorded_length, default=None)


def _recorded_length(t: SeqTrace | TreeSeqTrace) -> int:
    return len(t.accepts) if isinstance(t, SeqTrace) else len(t.steps)


def _workload_label(run: RunTrace) -> str:
    if run.label:
        return run.label
    if run.workload == WorkloadKind.synthetic:
        mix = sorted({q.synthetic_accept for q in run.requests if q.synthetic_accept is not None}, reverse=True)
        return "SYNTHETIC " + "/".join(f"{a:g}" for a in mix)
    return "real " + "+".join(dict.fromkeys(q.category for q in run.requests))


# ─────────────────────────── CLI ───────────────────────────


class SimStudy(BaseModel):
    """Settings of ``python -m load.simulate``."""

    model_config = ConfigDict(frozen=True)

    traces: Path
    out: Path = Path("bench_out/sim")
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default=[1, 16, 64, 128, 256, 512], min_length=1)
    policies: list[PolicyName] = Field(default=list(SIMULATED_POLICIES), min_length=1)
    workloads: list[WorkloadKind] = Field(default=[WorkloadKind.real, WorkloadKind.synthetic], min_length=1)
    requests_per_slot: int = Field(default=2, ge=1)
    min_tokens: int | None = None
    max_tokens: int | None = None
    cost: Path | None = None  # a CostModel JSON (e.g. a GPU profile); None: fit on the traces' steps
    roofline: RooflineName | None = None  # a named roofline estimate instead (overrides `cost`)
    measure_target: str | None = None  # time batched forwards of this target (a ModelSpec source, or "tiny") ...
    measure_draft: str | None = None  # ... and this draft on `device` to build the cost model
    measure_dtype: DType = DType.float32
    device: str = "cpu"
    profile_rows: list[Annotated[int, Field(ge=1)]] = Field(default=[1, 2, 4, 8, 16, 32, 64], min_length=1)
    fit: FitKind = FitKind.piecewise
    validate_runs: bool = False
    repeats: int = Field(default=3, ge=1)
    seed: int = 0

    @field_validator("profile_rows")
    @classmethod
    def _ascending(cls, rows: list[int]) -> list[int]:
        return sorted(rows)  # a cost curve's x values ascend

    @field_validator("policies")
    @classmethod
    def _simulated(cls, ps: list[PolicyName]) -> list[PolicyName]:
        bad = [p.value for p in ps if p not in SIMULATED_POLICIES]
        if bad:
            raise ValueError(f"the simulator covers {[p.value for p in SIMULATED_POLICIES]}; not {bad}")
        return ps

    @model_validator(mode="after")
    def _check(self) -> SimStudy:
        if (self.min_tokens is None) != (self.max_tokens is None):
            raise ValueError("give both --min-tokens and --max-tokens, or neither")
        if self.min_tokens is not None and self.max_tokens is not None and not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 1 <= --min-tokens <= --max-tokens")
        if self.measure_draft is not None and self.measure_target is None:
            raise ValueError("--measure-draft needs --measure-target (the draft is timed beside it)")
        given = [flag for flag, v in (("--cost", self.cost), ("--roofline", self.roofline)) if v is not None]
        if self.measure_target is not None and given:  # (the timed models were ignored, or the file)
            raise ValueError(f"--measure-target and {given[0]}: give one cost source")
        if self.measure_target not in (None, TINY_SOURCE) and self.measure_draft is None:
            raise ValueError("--measure-target needs --measure-draft beside a real model (the draft timed with it)")
        refuse_repeats("--profile-rows", self.profile_rows)
        refuse_repeats("--batch-sizes", self.batch_sizes)  # rows are keyed by batch size, policy and workload
        refuse_repeats("--policies", [p.value for p in self.policies])
        refuse_repeats("--workloads", [w.value for w in self.workloads])
        return self


def sweep(study: SimStudy, runs: Sequence[RunTrace], cost: CostModel) -> list[dict[str, Any]]:
    specs, budget = _specs_from_runs(runs), step_budget(runs)
    rows = []
    todo = [(w, b, p) for w in study.workloads for b in study.batch_sizes for p in study.policies]
    start = time.perf_counter()
    for i, (workload, bs, pol) in enumerate(todo, 1):
        wruns = [r for r in runs if r.workload == workload]
        pool = trace_pool(wruns, pol)
        prompts = recorded_prompts(wruns)  # one workload for every policy: chains' and trees' pools differ
        if not pool:
            print(f"  no recorded sequences to replay {pol.label} on {workload.value}; skipped", file=sys.stderr)
            continue
        classes = list(dict.fromkeys(request_class(q) for r in wruns for q in r.requests if request_class(q) in pool))
        wl = WorkloadSpec(
            num_requests=bs * study.requests_per_slot,
            classes=classes,
            min_tokens=study.min_tokens,
            max_tokens=study.max_tokens,
        )
        sims = []
        for k in range(study.repeats):
            rng = random.Random(study.seed * 7919 + k)
            cfg = SimConfig(batch_size=bs, policy=pol, spec=specs[pol], max_step_tokens=budget)
            sims.append(simulate(make_requests(pool, wl, rng, prompts), cfg, cost))
        summary = {k: statistics.mean(s.summary()[k] for s in sims) for k in sims[0].summary()}
        label = _workload_label(wruns[0])
        rows.append({"workload": label, "batch": bs, "policy": pol.label, **summary, "_sims": sims})
        print(
            f"[{i}/{len(todo)}] {label:24s} B={bs:4d} {pol.label:14s} {summary['tok_s']:9.1f} tok/s  "
            f"idle {summary['idle_fraction']:.3f}  ({time.perf_counter() - start:.0f}s)",
            flush=True,
        )
    return rows


def step_budget(runs: Iterable[RunTrace]) -> int | None:
    """The step budget (``--max-step-tokens``) the runs were swept with, to replay them under it (None: none)."""
    budgets = {r.settings.max_step_tokens for r in runs if r.settings is not None}
    if len(budgets) > 1:
        raise ValueError(f"runs swept with different step budgets (--max-step-tokens {sorted(budgets)})")
    return (budgets.pop() or None) if budgets else None


def replay_problem(runs: Sequence[RunTrace]) -> str | None:
    """Why these runs cannot be replayed as one sweep (None: they can)."""
    if any(r.settings is not None and r.settings.guard for r in runs):
        return (
            "holds runs under the throughput guard (--guard): the simulator replays the planner's depths, not the "
            "guard's choice of plain steps; simulate a sweep recorded without it"
        )
    try:
        step_budget(runs)
    except ValueError as e:
        return f"holds {e}: simulate one sweep's traces"
    if len(pairs := sorted({r.pair for r in runs})) > 1:
        return (
            f"holds runs of different model pairs ({', '.join(pairs)}): one cost model and one acceptance pool would "
            "mix their steps; simulate one pair's traces"
        )
    # what prices a step (a seed or answer lengths only draw other requests, which the pool may mix)
    unpriced = {name: getattr(RunSettings(), name) for name in UNPRICED}
    costs = {r.settings.model_copy(update=unpriced) for r in runs if r.settings is not None}
    if len(costs) > 1:
        first, *rest = costs
        return (
            f"holds runs whose steps cost differently ({first.describe(RunSettings())}; and "
            f"{rest[0].describe(RunSettings())}): one cost model would be fitted on both; simulate one sweep's traces"
        )
    return None


# RunSettings fields that do not change what a step costs (the prompts and lengths drawn, the guard's own checks)
UNPRICED = (
    "guard",
    "warm_guard",
    "follow_drift",
    "requests_per_slot",
    "min_tokens",
    "max_tokens",
    "max_prompt_tokens",
    "seed",
)


def _specs_from_runs(runs: Sequence[RunTrace]) -> dict[PolicyName, SpecConfig]:
    """The settings the engine actually ran each recorded policy with (static SL, DSDE parameters, budgets); a
    policy the sweep did not record (``dsde_ddd_nocap`` beside ``dsde_ddd``, say) takes a recorded one of its kind
    (tree or chain) with only what names the policy changed: with the defaults' budget, beam and limits instead, its
    gap to the recorded one mixed other settings into what it compares (the SL_cap gain)."""
    specs = policy_specs()
    recorded = {r.policy: r.spec for r in runs}
    for name, default in specs.items():
        if name in recorded:
            specs[name] = recorded[name]
            continue
        kin = next((k for k in recorded.values() if k.method != SpecMethod.none and k.is_tree == default.is_tree), None)
        if kin is not None and default.method != SpecMethod.none:
            specs[name] = kin.model_copy(
                update={
                    "method": default.method,
                    "policy": default.policy,
                    "sl": kin.sl if kin.policy == default.policy else default.sl,
                    "dsde": kin.dsde.model_copy(update={"cap_enabled": default.dsde.cap_enabled}),
                }
            )
    return specs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m load.simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, required=True, help="traces.jsonl written by load.straggler")
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/sim"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    p.add_argument("--policies", nargs="+", default=[x.value for x in SIMULATED_POLICIES])
    p.add_argument("--workloads", nargs="+", default=[w.value for w in WorkloadKind])
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--min-tokens", type=int, default=None, help="output lengths (default: the recorded ones)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--cost", type=Path, default=None, help="CostModel JSON (a GPU profile); default: fit here")
    p.add_argument("--write-cost", type=out_file_arg, default=None, help="write the cost model used as JSON")
    p.add_argument("--roofline", choices=[r.value for r in RooflineName], default=None, help="a roofline estimate")
    p.add_argument("--measure-target", default=None, help="time batched forwards: target source (or 'tiny')")
    p.add_argument(
        "--measure-draft",
        default=None,
        help="... and draft source (or 'tiny'); needed beside a real target (a tiny target's default: a noisy copy)",
    )
    p.add_argument(
        "--measure-dtype",
        default="float32",
        choices=[d.value for d in DType],
        help="dtype of the timed models, e.g. bfloat16",
    )
    p.add_argument("--device", default="cpu", type=present_device_arg, help="device of the timed models, e.g. cuda")
    p.add_argument("--profile-rows", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--fit", choices=[f.value for f in FitKind], default=FitKind.piecewise.value)
    p.add_argument("--validate", action="store_true", help="compare with the measured runs in the traces")
    p.add_argument("--validate-only", action="store_true", help="skip the sweep")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    with console_safe():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        study = SimStudy(
            traces=args.traces,
            out=args.out,
            batch_sizes=args.batch_sizes,
            policies=args.policies,
            workloads=args.workloads,
            requests_per_slot=args.requests_per_slot,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            cost=args.cost,
            roofline=args.roofline,
            measure_target=args.measure_target,
            measure_draft=args.measure_draft,
            measure_dtype=args.measure_dtype,
            device=args.device,
            profile_rows=args.profile_rows,
            fit=args.fit,
            validate_runs=args.validate or args.validate_only,
            repeats=args.repeats,
            seed=args.seed,
        )
    except ValidationError as e:
        p.error(settings_problems(e, as_flags=True))
    try:  # the files named on the command line: a usage error, not a traceback
        runs = read_traces(study.traces)
        given_cost = None if study.cost is None else CostModel.model_validate_json(study.cost.read_text())
    except ValidationError as e:  # the cost model's JSON (read_traces names its own bad lines)
        p.error(f"{study.cost} is not a cost model ({settings_problems(e)})")
    except OSError as e:
        p.error(f"cannot read {e.filename}: {e.strerror}")
    except ValueError as e:  # a line that is not a run trace, a file that is not UTF-8
        p.error(str(e))
    if not runs:
        p.error(f"{study.traces} holds no runs")
    if problem := replay_problem(runs):
        p.error(f"{study.traces} {problem}")
    if model_free := sorted({r.spec.drafter.value for r in runs if r.spec.drafter != Drafter.model}):
        p.error(f"{study.traces} holds runs drafted by {model_free}: the simulator replays draft-model steps only")
    if given_cost is not None and given_cost.verify_s(1, 1) + given_cost.overhead_s(1, 1) <= 0:
        p.error(f"{study.cost}: a plain step of one row costs 0 s in this cost model (every rate would be infinite)")
    study.out.mkdir(parents=True, exist_ok=True)
    report: list[str] = [f"# Simulated lane: {study.traces}", ""]

    def or_usage_error(fitting: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        try:
            return fitting(*args, **kwargs)
        except ValueError as e:  # runs without recorded steps: no cost model to fit on them
            p.error(f"{study.traces}: {e}")

    if study.validate_runs:
        val = []
        for mode in ValidationMode:
            for fit in FitKind:
                val += or_usage_error(validate, runs, mode, fit=fit, seed=study.seed, repeats=study.repeats)
        write_csv(study.out / "validation.csv", val)
        table = markdown_table(
            val,
            (
                "mode",
                "fit",
                "workload",
                "policy",
                "batch",
                "measured_tok_s",
                "sim_tok_s",
                "error",
                "measured_idle",
                "sim_idle",
            ),
        )
        print(table)
        errs = {
            f"{m.value}/{f.value}": [abs(r["error"]) for r in val if r["mode"] == m.value and r["fit"] == f.value]
            for m in ValidationMode
            for f in FitKind
        }
        summary = "; ".join(
            f"{m}: mean |error| {statistics.mean(e):.1%}, max {max(e):.1%}, within 15%: "
            f"{sum(x <= 0.15 for x in e)}/{len(e)}"
            for m, e in errs.items()
            if e
        )
        print(summary)
        report += ["## Validation against the engine runs", "", summary, "", table, ""]
    if study.roofline is not None:
        cost = study.roofline.cost_model()
    elif study.measure_target is not None:
        fitted = or_usage_error(CostModel.fit, cost_samples(runs), study.fit)
        try:
            cost = _measured(study, fitted)
        except SpecServeError as e:  # a model that cannot be found or loaded
            p.error(f"--measure-target / --measure-draft: {e}")
    elif given_cost is not None:
        cost = given_cost
    else:
        samples = list(cost_samples(runs))
        cost = or_usage_error(CostModel.fit, samples, study.fit, source=f"fit on {study.traces}")
        q = fit_quality(cost, samples)
        report += [
            "Cost model fit, summed-time error per component: " + ", ".join(f"{k} {v:+.1%}" for k, v in q.items()),
            "",
        ]
    if args.write_cost:
        args.write_cost.parent.mkdir(parents=True, exist_ok=True)
        args.write_cost.write_text(cost.model_dump_json(indent=2))
    report += [f"Cost model: `{cost.source}`", "", "```json", cost.model_dump_json(indent=1), "```", ""]
    if args.validate_only:
        (study.out / "report.md").write_text("\n".join(report))
        return 0
    rows = sweep(study, runs, cost)
    if not rows:
        p.error(f"{study.traces} holds no recorded runs of {[w.value for w in study.workloads]} to replay")
    plain_rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    add_vs_baseline(plain_rows, PolicyName.plain.label)
    write_csv(study.out / "sim.csv", plain_rows)
    gains = cap_gains(plain_rows, CAP_LABELS)
    if gains:
        write_csv(study.out / "cap_gain.csv", gains)
        report += [
            "## SL_cap gain (DSDE + SL_cap vs DSDE no cap) and scaling over batch 1",
            "",
            markdown_table(gains),
            "",
        ]
    report += [
        "## Simulated throughput and latency",
        "",
        markdown_table(plain_rows, (*SWEEP_COLS, *TTFT_TPOT_COLS)),
        "",
    ]
    plot_sim(rows, study.out, cost.source)
    (study.out / "report.md").write_text("\n".join(report))
    print(f"wrote {study.out}/report.md, sim.csv, sim_*.png")
    return 0


def _measured(study: SimStudy, fitted: CostModel) -> CostModel:
    """Batched-forward timings of the given models; the host terms (per row, per step, per emitted token; plain
    steps' their own) from the fit."""
    from specserve.config import ModelSpec
    from specserve.models.loader import load_model
    from specserve.models.tiny import noisy_copy, tiny_model

    def load(source: str) -> LlamaModel:
        if source == TINY_SOURCE:
            return tiny_model().to(study.device, study.measure_dtype.torch)
        return load_model(ModelSpec(source=source, dtype=study.measure_dtype), device=study.device)

    target = load(study.measure_target or TINY_SOURCE)
    # the tiny pair's draft (a noisy copy) beside the tiny target; "tiny" beside a real target: the tiny model
    draft = (
        load(study.measure_draft)
        if study.measure_draft is not None
        else noisy_copy(target, 0.1).to(study.device, study.measure_dtype.torch)
    )
    drafted_by = study.measure_draft or "a noisy copy"
    source = f"measured on {study.device}: {study.measure_target} + {drafted_by} ({study.measure_dtype.value})"
    measured = measure_cost_model(target, draft, study.profile_rows, source=source)
    return measured.with_host_of(fitted)


def plot_sim(rows: Sequence[dict[str, Any]], out: Path, cost_source: str = "") -> None:
    plot_workloads(
        rows,
        ("tok_s", "idle_fraction", "p99_ttft_s", "p99_tpot_s"),
        out,
        prefix="sim",
        title=f"simulated lane: {{workload}}; cost model: {cost_source}",
    )
    slugs = workload_slugs(str(r["workload"]) for r in rows)
    for workload in dict.fromkeys(r["workload"] for r in rows):
        sub = [r for r in rows if r["workload"] == workload and "_sims" in r]
        if not sub:
            continue
        big = max(r["batch"] for r in sub)
        series: list[tuple[str, Counter[int], Counter[int] | None, Counter[int]]] = [
            (
                r["policy"],
                sum((s.sl_hist for s in r["_sims"]), Counter()),
                None,
                sum((s.cap_hist for s in r["_sims"]), Counter()),
            )
            for r in sub
            if r["batch"] == big
        ]
        path = out / f"sim_sl_{slugs[str(workload)]}.png"
        plot_sl(series, path, batch=big, title=f"simulated: {workload}")


if __name__ == "__main__":
    raise SystemExit(main())
