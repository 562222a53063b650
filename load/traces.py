"""Per-step traces of engine runs (JSONL, one ``RunTrace`` per line) and what the simulator takes from them:
per-sequence acceptance/KLD streams and per-step cost samples.

Recording wraps an Engine's StepLoop and its target worker without changing them: ``StepRecorder`` delegates
every call, timestamps each step's outputs and reads the step's ``StepMetrics``; ``VerifyTap`` keeps the last
verify call's items and outputs (the KLD values per verified position are not in ``SeqStepRecord``).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Iterator, Sequence
from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specserve.bench.policies import PolicyName
from specserve.bench.stats import tpot
from specserve.config import SpecConfig
from specserve.engine import Engine
from specserve.errors import settings_problems
from specserve.policy import verified_positions
from specserve.sequence import Request
from specserve.sequence import Sequence as LoopSequence
from specserve.step_events import StepEvent, StepObserver, idle_fraction


class WorkloadKind(str, Enum):
    real = "real"  # MT-bench prompts, acceptance from the models
    synthetic = "synthetic"  # SYNTHETIC acceptance mix (SpecConfig.synthetic_accept): measures the system only


SIMULATED_POLICIES = tuple(PolicyName)


class SeqStep(BaseModel):
    """One sequence in one step."""

    model_config = ConfigDict(frozen=True)

    req: int  # index of the request in its run
    fed: int  # committed tokens the target was sent (the prompt on the first step, then 1)
    depth: int  # draft levels (0: not drafting)
    planned: int | None = None  # the depth planned for it (DDD may stop earlier); None in older traces
    uncapped: int | None = None  # the policy's SL before SL_cap; None in older traces
    verified: int | None = None  # depth of the tree verified (the rerank may drop grown levels); None: older traces
    drafted: int  # drafted tokens (tree nodes) verified
    accepted: int  # accepted drafted tokens (bonus excluded)
    kld: list[float] = Field(default_factory=list)  # per verified position, when the policy asked for KLD


class StepTrace(BaseModel):
    model_config = ConfigDict(frozen=True)

    t_end: float  # seconds since the run started
    batch: int
    levels: int
    cap: int | None
    draft_s: float
    verify_s: float
    overhead_s: float
    emitted: int
    seqs: list[SeqStep]

    @property
    def step_s(self) -> float:
        return self.draft_s + self.verify_s + self.overhead_s


class RequestTrace(BaseModel):
    model_config = ConfigDict(frozen=True)

    category: str  # MT-bench category, or "synthetic a=<p>"
    prompt_len: int
    prompt_key: str | None = None  # ``prompt_key`` of its token ids; None in older traces
    max_tokens: int
    synthetic_accept: float | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None


def prompt_key(ids: Sequence[int]) -> str:
    """Identifies a prompt across runs (prompts of one length are told apart): sha256 of its ids, 16 hex digits."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


class RunSettings(BaseModel):
    """What a sweep set beside the pair and the speculation that moves a run's throughput: runs are merged (and
    paired with plain decoding's) only under the same settings."""

    model_config = ConfigDict(frozen=True)

    guard: bool = False
    warm_guard: bool = False
    follow_drift: bool = False  # GuardConfig.follow_drift
    max_step_tokens: int = 0  # 0: no cap
    requests_per_slot: int = 2
    min_tokens: int = 32
    max_tokens: int = 96
    max_prompt_tokens: int | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: the pair's
    head_quant: str | None = None
    head_products: str | None = None
    int8_reads: bool = False
    tiny_noise: float | None = None  # the tiny pair only
    threads: int | None = None
    freeze_gc: bool = True
    seed: int = 0  # the workloads' prompts and lengths (and the tiny pair's weights)

    def describe(self, baseline: RunSettings) -> str:
        """What differs from ``baseline`` (the sweep's defaults for the pair)."""
        parts = [f"{name} {value}" for name, value in self if value != getattr(baseline, name)]
        return ", ".join(parts) or "the default settings"


def refuse_repeats(name: str, values: Sequence[object]) -> None:
    """Runs and rows are keyed by these values (batch sizes, policies, workloads): one given twice would run twice
    under one key."""
    if len(set(values)) < len(values):
        raise ValueError(f"{name} repeats a value: {list(values)}")


class RunTrace(BaseModel):
    """One engine run: a policy at one batch size on one workload (all requests submitted at t = 0)."""

    pair: str
    workload: WorkloadKind
    label: str = ""  # e.g. "real coding+writing", "SYNTHETIC 0.9/0.3"
    synthetic: bool  # SYNTHETIC acceptance: never read as model quality
    policy: PolicyName
    spec: SpecConfig  # the run's speculation (per-request SYNTHETIC acceptance is in `requests`)
    batch: int
    repeat: int = 0  # round-robin pass of the sweep
    seconds: float
    tokens: int
    requests: list[RequestTrace]
    steps: list[StepTrace]
    settings: RunSettings | None = None  # None: recorded before runs kept their settings

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def has_kld(self) -> bool:
        return any(s.kld for st in self.steps for s in st.seqs)


def mean_idle(steps: Sequence[StepTrace]) -> float:
    """Mean straggler idle fraction over the drafting steps (as ``specserve.bench.batch_sweep`` reports it)."""
    drafting = [st for st in steps if st.levels > 0]
    return statistics.mean(idle_fraction([s.depth for s in st.seqs]) for st in drafting) if drafting else 0.0


def write_traces(path: Path, runs: Iterable[RunTrace]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for run in runs:
            f.write(run.model_dump_json() + "\n")


def append_trace(path: Path, run: RunTrace) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(run.model_dump_json() + "\n")


def read_traces(path: Path) -> list[RunTrace]:
    """The runs of a traces.jsonl; a line that is not a run trace is a ValueError naming the file, line and fields."""
    runs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                runs.append(RunTrace.model_validate_json(line))
            except ValidationError as e:
                raise ValueError(f"{path}:{number} is not a run trace ({settings_problems(e)})") from e
    return runs


# ─────────────────────────── recording ───────────────────────────


class _ReqClock:
    __slots__ = ("first", "index", "last", "submitted", "tokens")

    def __init__(self, index: int, submitted: float) -> None:
        self.index = index
        self.submitted = submitted
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    @property
    def tpot(self) -> float | None:
        return tpot(self.first, self.last, self.tokens)


class StepRecorder(StepObserver):
    """A step-loop observer: records every step (``StepTrace``) and per-request TTFT/TPOT.

    Subscribe with ``StepRecorder.install(engine)`` (it joins ``engine.loop.observers``).
    """

    def __init__(self) -> None:
        self.t0: float | None = None
        self.steps: list[StepTrace] = []
        self.clocks: dict[int, _ReqClock] = {}  # seq_id -> clock
        self.order: list[Request] = []

    @classmethod
    def install(cls, engine: Engine) -> StepRecorder:
        rec = cls()
        engine.loop.observers.append(rec)
        return rec

    def on_request(self, seq: LoopSequence) -> None:
        self.t0 = seq.arrived if self.t0 is None else self.t0
        self.clocks[seq.seq_id] = _ReqClock(len(self.order), seq.arrived)
        self.order.append(seq.request)

    def on_step(self, event: StepEvent) -> None:
        now = event.ended
        for seq, out in zip(event.batch, event.outputs, strict=True):
            clock = self.clocks[seq.seq_id]
            if out.token_ids:
                clock.first = now if clock.first is None else clock.first
                clock.last = now
                clock.tokens += len(out.token_ids)
        plan, depths = event.plan, event.depths
        seqs = [
            SeqStep(
                req=self.clocks[seq.seq_id].index,
                fed=len(item.new_tokens),
                depth=depths[i],
                planned=plan.limit(i, by_model=seq.model_proposed),
                uncapped=plan.uncapped[i],
                verified=None if event.proposals[i] is None else event.proposals[i].verified_depth,  # type: ignore[union-attr]
                drafted=len(item.draft_tokens),
                accepted=len(out.accepted),
                kld=[float(v) for v in out.kld],
            )
            for i, (seq, item, out) in enumerate(zip(event.batch, event.items, event.verified, strict=True))
        ]
        self.steps.append(
            StepTrace(
                t_end=now - (self.t0 or now),
                batch=len(event.batch),
                levels=max(depths, default=0),
                cap=plan.cap,
                draft_s=event.draft_s,
                verify_s=event.verify_s,
                overhead_s=event.total_s - event.draft_s - event.verify_s,
                emitted=event.emitted,
                seqs=seqs,
            )
        )

    def request_traces(self, categories: Sequence[str]) -> list[RequestTrace]:
        out = []
        for req, c, category in zip(self.order, self.clocks.values(), categories, strict=True):
            spec = req.speculation
            out.append(
                RequestTrace(
                    category=category,
                    prompt_len=len(req.prompt_ids),
                    prompt_key=prompt_key(req.prompt_ids),
                    max_tokens=req.params.max_tokens,
                    synthetic_accept=None if spec is None else spec.synthetic_accept,
                    output_tokens=c.tokens,
                    ttft_s=None if c.first is None else c.first - c.submitted,
                    tpot_s=c.tpot,
                    latency_s=None if c.last is None else c.last - c.submitted,
                )
            )
        return out


# ─────────────────────────── what the simulator replays ───────────────────────────


class SeqTrace(BaseModel):
    """One recorded sequence as a stream of drafted-position outcomes: ``accepts[j]`` whether the j-th verified
    drafted position was accepted and ``klds[j]`` its KLD (NaN where none was recorded). A step that drafts SL
    tokens consumes the leading accepts up to SL plus the first rejection, independent of the SL it was recorded
    at: per-sequence heterogeneity and its time order are kept."""

    model_config = ConfigDict(frozen=True)

    cls: str  # the workload class: MT-bench category or "synthetic a=<p>"
    prompt_len: int
    prompt_key: str | None = None
    max_tokens: int
    accepts: list[bool]
    klds: list[float]

    @property
    def acceptance(self) -> float:
        return sum(self.accepts) / len(self.accepts) if self.accepts else 0.0


def request_class(req: RequestTrace) -> str:
    return req.category if req.synthetic_accept is None else f"synthetic a={req.synthetic_accept:g}"


def sequence_traces(run: RunTrace) -> list[SeqTrace]:
    """Acceptance/KLD streams of a chain run's sequences (trees and plain runs give none)."""
    if not run.policy.is_chain:
        return []
    accepts: list[list[bool]] = [[] for _ in run.requests]
    klds: list[list[float]] = [[] for _ in run.requests]
    for step in run.steps:
        for s in step.seqs:
            if s.drafted == 0:
                continue
            verified = verified_positions(s.drafted, s.accepted)
            accepts[s.req] += [True] * s.accepted + ([False] if s.accepted < s.drafted else [])
            vals = list(s.kld[:verified]) + [math.nan] * max(0, verified - len(s.kld))
            klds[s.req] += vals
    return [
        SeqTrace(
            cls=request_class(r),
            prompt_len=r.prompt_len,
            prompt_key=r.prompt_key,
            max_tokens=r.max_tokens,
            accepts=a,
            klds=k,
        )
        for r, a, k in zip(run.requests, accepts, klds, strict=True)
        if a
    ]


class TreeStep(BaseModel):
    """One recorded draft-tree step of a sequence (DDD or DSDE+DDD runs)."""

    model_config = ConfigDict(frozen=True)

    depth: int  # levels drafted
    stopped: bool  # DDD stopped before the planned depth: ``depth`` is the tree's own depth (else a lower bound)
    verified: int | None = None  # depth of the tree verified, what DSDE observes (None: older traces, ``depth``)
    drafted: int  # tree nodes verified
    accepted: int  # accepted nodes (a path from the root; bonus excluded)
    kld: list[float] = Field(default_factory=list)  # at the root and each accepted node, when DSDE asked for KLD


class TreeSeqTrace(BaseModel):
    """One recorded sequence of a tree run as its stream of steps. A simulated step with depth budget b replays
    the next recorded step truncated to b levels: depth min(recorded, b), accepted min(recorded, depth)."""

    model_config = ConfigDict(frozen=True)

    cls: str
    prompt_len: int
    prompt_key: str | None = None
    max_tokens: int
    steps: list[TreeStep]

    @property
    def mean_accepted(self) -> float:
        return sum(s.accepted for s in self.steps) / len(self.steps) if self.steps else 0.0


def tree_sequence_traces(run: RunTrace) -> list[TreeSeqTrace]:
    """Per-step tree outcomes of a tree run's sequences (chain and plain runs give none)."""
    if not run.policy.is_tree:
        return []
    steps: list[list[TreeStep]] = [[] for _ in run.requests]
    for st in run.steps:
        for s in st.seqs:
            if s.depth == 0:
                continue
            planned = run.spec.static_depth if s.planned is None and not run.policy.is_dsde else s.planned
            stopped = planned is not None and s.depth < planned
            steps[s.req].append(TreeStep(depth=s.depth, stopped=stopped, verified=s.verified, drafted=s.drafted,
                                         accepted=s.accepted, kld=list(s.kld)))  # fmt: skip
    return [
        TreeSeqTrace(
            cls=request_class(r), prompt_len=r.prompt_len, prompt_key=r.prompt_key, max_tokens=r.max_tokens, steps=st
        )
        for r, st in zip(run.requests, steps, strict=True)
        if st
    ]


def level_tokens(depths: Sequence[int], widths: Sequence[int]) -> list[int]:
    """Tokens in each lock-step draft forward (levels 1..max depth): one per row still drafting at level 1 (the
    fed forward) and for chains; a tree row feeds its beam (``width`` nodes) at every later level."""
    levels = max(depths, default=0)
    return [
        sum(1 if k == 1 else w for d, w in zip(depths, widths, strict=True) if d >= k) for k in range(1, levels + 1)
    ]


class CostSample(BaseModel):
    """Features and measured times of one recorded step (chain or plain runs)."""

    model_config = ConfigDict(frozen=True)

    batch: int  # rows verified
    levels: int  # draft levels the batch ran
    depth_sum: int  # sum over rows of draft levels = sum over levels of rows still drafting
    level_rows: list[int]  # rows still drafting at each level 1..levels (the batch drafts in lock-step)
    level_tokens: list[int] | None = None  # tokens in each level's forward (None: = level_rows, chains)
    tree_rows: int = 0  # drafting rows that grow trees
    tree_row_levels: int = 0  # sum over tree rows of their levels after the first (beam forwards)
    drafting_rows: int
    # tokens drafting rows' drafts read beyond one at level 0: a newly admitted row's prompt, and what a row skipped
    # by the step budget missed meanwhile (its draft reads every token it has not seen)
    draft_extra_fed: int
    verify_tokens: int  # all tokens in the verify forward (fed + drafted)
    emitted: int
    draft_s: float
    verify_s: float
    overhead_s: float
    run_s: float | None = None  # the recorded run's seconds: fits weight each run's relative time error alike


def cost_samples(runs: Iterable[RunTrace]) -> Iterator[CostSample]:
    for run in runs:
        if run.policy not in SIMULATED_POLICIES:
            continue
        width = run.spec.beam_width if run.spec.is_tree else 1
        unseen: dict[int, int] = {}  # per request: tokens its draft has not read, before this step's new ones
        for st in run.steps:
            drafting = [s for s in st.seqs if s.depth > 0]
            extra = sum(unseen.get(s.req, 0) + s.fed - 1 for s in drafting)
            for s in st.seqs:  # (a row that drafted read all it had not: the accepted drafts are its own)
                unseen[s.req] = 0 if s.depth > 0 else unseen.get(s.req, 0) + s.fed
            depths = [s.depth for s in drafting]
            yield CostSample(
                batch=st.batch,
                levels=st.levels,
                depth_sum=sum(depths),
                level_rows=[sum(d >= k for d in depths) for k in range(1, st.levels + 1)],
                level_tokens=level_tokens(depths, [width] * len(depths)) if width > 1 else None,
                tree_rows=len(drafting) if width > 1 else 0,
                tree_row_levels=sum(d - 1 for d in depths) if width > 1 else 0,
                drafting_rows=len(drafting),
                draft_extra_fed=extra,
                verify_tokens=sum(s.fed + s.drafted for s in st.seqs),
                emitted=st.emitted,
                draft_s=st.draft_s,
                verify_s=st.verify_s,
                overhead_s=st.overhead_s,
                run_s=run.seconds,
            )
