"""Observation of the step loop: one channel. The loop publishes every accepted request and every finished step
to its observers; ``StepStats`` (always subscribed) keeps the timing totals, the straggler metrics of recent
steps and, when asked, per-sequence records. Benchmarks and load tools subscribe their own observers."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields

from specserve.messages import Proposal, VerifyItem, VerifyOutput
from specserve.policy.planner import StepPlan
from specserve.sequence import RequestOutput, Sequence


@dataclass(frozen=True)
class StepEvent:
    """Everything one step did, row i of each list being sequence ``batch[i]``."""

    batch: list[Sequence]
    plan: StepPlan
    proposals: list[Proposal | None]  # None: the sequence did not draft
    items: list[VerifyItem]
    verified: list[VerifyOutput]
    outputs: list[RequestOutput]
    started: float  # perf_counter at the step's start, after drafting, after verification, at the end
    drafted: float
    verified_at: float
    ended: float
    # rows the step dropped (failed in its commit, or at a grammar's dead end): its time holds their work (perhaps
    # a prompt's prefill), the lists above only the rows that committed
    rows_cut: int = 0
    cut_prefilled: bool = False  # one of them fed the target more than its root (its prompt's forward is in the time)

    @property
    def draft_s(self) -> float:
        """The time to the verify where something drafted: a proposal, or a draft model whose trees kept no node
        (a floor above every path still paid for the forwards); 0 for a plain step."""
        drafted = any(p is not None for p in self.proposals) or any(s.model_proposed for s in self.batch)
        return self.drafted - self.started if drafted else 0.0

    @property
    def verify_s(self) -> float:
        return self.verified_at - self.drafted

    @property
    def total_s(self) -> float:
        return self.ended - self.started

    @property
    def depths(self) -> list[int]:
        """Levels each sequence actually drafted (DDD may stop before its budget)."""
        return [0 if p is None else p.depth for p in self.proposals]

    @property
    def emitted(self) -> int:
        """Tokens the step added to the outputs (handed out now or, held back at a stop string's edge, later)."""
        return sum(o.committed for o in self.outputs)

    @property
    def only_prefill(self) -> bool:
        """Every sequence of the step fed more than its root (nothing in it was a decoding step)."""
        return all(len(it.new_tokens) > 1 for it in self.items)

    @property
    def prefills(self) -> bool:
        """Some sequence of the step fed more than its root (an admission, or a re-prefill after a recovery), a row
        the step cut too (its prefill was booked as a decode step's time)."""
        return self.cut_prefilled or any(len(it.new_tokens) > 1 for it in self.items)


class StepObserver:
    """Subscribe to a loop with ``loop.observers.append(obs)``; override what you need."""

    def on_request(self, seq: Sequence) -> None:
        """Called when the loop accepts a request (default: nothing)."""

    def on_step(self, event: StepEvent) -> None:
        """Called after every step that ran a batch (default: nothing)."""


@dataclass(frozen=True)
class SeqStepRecord:
    """What one sequence did in one step (kept when ``StepStats.record_steps`` is on)."""

    seq_id: int
    depth: int  # draft levels (0: not drafting)
    drafted: int
    accepted: int
    path_ranks: list[int]  # trees: score rank of each accepted node


@dataclass(frozen=True)
class StepMetrics:
    """Straggler metrics of one step of a lock-step batch."""

    batch_size: int
    depths: list[int]  # levels each sequence actually drafted (DDD may stop before its budget)
    planned: list[int]  # planned depth per sequence
    uncapped: list[int]  # the policy's SL_i before SL_cap, max_sl and the guard (static: its depth)
    cap: int | None
    post_warmup: list[bool]  # DSDE sequences past warm-up when the step was planned
    levels: int  # draft levels the batch ran (the deepest sequence)
    idle_fraction: float  # 1 - sum(depth_i) / (B * max depth_i): draft slots spent waiting for the deepest
    draft_s: float
    verify_s: float
    overhead_s: float
    emitted: int  # tokens committed this step (all sequences)
    synthetic: bool  # any sequence used SYNTHETIC acceptance
    model_drafted: bool = False  # the draft model proposed for some sequence (not only a model-free drafter)


def idle_fraction(depths: Seq[int]) -> float:
    deepest = max(depths, default=0)
    return 0.0 if deepest == 0 else 1.0 - sum(depths) / (len(depths) * deepest)


@dataclass
class StepTiming:
    steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    prefill_s: float = 0.0  # of total_s: steps in which some sequence prefilled (every mode pays them alike)
    decode_steps: int = 0  # steps without a prefill, and their draft and verify time: a step's own cost, with no
    decode_draft_s: float = 0.0  # prompt forward spread over fewer steps where more tokens are accepted a step
    decode_verify_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.draft_s - self.verify_s

    def __add__(self, other: StepTiming) -> StepTiming:
        return StepTiming(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: StepTiming) -> StepTiming:
        """The steps between two snapshots of one running total: ``after - before``."""
        return StepTiming(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


class StepStats(StepObserver):
    def __init__(self, window: int = 10_000) -> None:
        self.timing = StepTiming()
        self.metrics: deque[StepMetrics] = deque(maxlen=window)
        self.record_steps = False
        self.records: list[list[SeqStepRecord]] = []

    def on_step(self, event: StepEvent) -> None:
        depths = event.depths
        draft_s, verify_s, total_s = event.draft_s, event.verify_s, event.total_s
        self.metrics.append(
            StepMetrics(
                batch_size=len(event.batch),
                depths=depths,
                planned=[event.plan.limit(i, by_model=s.model_proposed) for i, s in enumerate(event.batch)],
                uncapped=event.plan.uncapped,
                cap=event.plan.cap,
                post_warmup=event.plan.post_warmup,
                levels=max(depths, default=0),
                idle_fraction=idle_fraction(depths),
                draft_s=draft_s,
                verify_s=verify_s,
                overhead_s=total_s - draft_s - verify_s,
                emitted=event.emitted,
                synthetic=any(s.spec.synthetic_accept is not None for s in event.batch),
                model_drafted=any(s.model_proposed for s in event.batch),
            )
        )
        t = self.timing
        t.steps += 1
        t.draft_s += draft_s
        t.verify_s += verify_s
        t.total_s += total_s
        if event.prefills:
            t.prefill_s += total_s
        else:
            t.decode_steps += 1
            t.decode_draft_s += draft_s
            t.decode_verify_s += verify_s
        if self.record_steps:
            rows = zip(event.batch, event.proposals, event.verified, strict=True)
            self.records.append([_record(s, p, o) for s, p, o in rows])


def _record(seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> SeqStepRecord:
    if proposal is None:
        return SeqStepRecord(seq.seq_id, 0, 0, 0, [])
    ranks = [proposal.ranks[a - 1] for a in out.accepted] if proposal.ranks is not None else []
    return SeqStepRecord(seq.seq_id, proposal.depth, len(proposal.tokens), len(out.accepted), ranks)
