"""StepLoop: continuous batching over a target worker (and, with speculation, a draft worker).

The scheduler owns the authoritative token state of every request; workers hold only caches.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum

from transformers import PreTrainedTokenizerBase

from specserve.config import SLPolicyKind, SpecConfig, SpecMethod
from specserve.detok import IncrementalText
from specserve.errors import InvalidRequestError
from specserve.guard import ThroughputGuard
from specserve.policy import SequenceDSDE, apply_cap, sl_cap
from specserve.protocol import Proposal, ProposeItem, VerifyItem, VerifyOutput
from specserve.sampling import SamplingParams
from specserve.workers import DraftWorker, TargetWorker


class FinishReason(str, Enum):
    stop = "stop"  # EOS or a stop string
    length = "length"  # max_tokens or the context limit
    abort = "abort"  # cancelled


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculation: SpecConfig | None = None  # None: the loop's default


@dataclass
class RequestStats:
    target_forwards: int = 0  # verification steps this request took part in
    drafted: int = 0  # drafted tokens (tree nodes) sent for verification
    accepted: int = 0
    draft_steps: int = 0  # steps in which this request drafted
    depth_sum: int = 0  # draft levels over those steps

    @property
    def mean_depth(self) -> float:
        return 0.0 if self.draft_steps == 0 else self.depth_sum / self.draft_steps

    @property
    def tokens_per_forward(self) -> float:  # tau, incl. the bonus token
        return 0.0 if self.target_forwards == 0 else (self.accepted + self.target_forwards) / self.target_forwards

    @property
    def acceptance_rate(self) -> float:
        return 0.0 if self.drafted == 0 else self.accepted / self.drafted


@dataclass(frozen=True)
class SeqStepRecord:
    """What one sequence did in one step (kept when ``StepLoop.record_steps`` is on)."""

    seq_id: int
    depth: int  # draft levels (0: not drafting)
    drafted: int
    accepted: int
    path_ranks: list[int]  # trees: score rank of each accepted node


@dataclass(frozen=True)
class StepPlan:
    depths: list[int]  # draft depth per sequence this step (0 = not drafting)
    uncapped: list[int]  # the policy's SL_i before SL_cap, the per-request max_sl and the guard
    cap: int | None  # SL_cap over the lock-step batch (None: no DSDE sequence past warm-up, or cap off)


@dataclass(frozen=True)
class StepMetrics:
    """Straggler metrics of one step of a lock-step batch."""

    batch_size: int
    depths: list[int]  # levels each sequence actually drafted (DDD may stop before its budget)
    planned: list[int]  # planned depth per sequence
    uncapped: list[int]  # the policy's SL_i before SL_cap, max_sl and the guard (static: its depth)
    cap: int | None
    levels: int  # draft levels the batch ran (the deepest sequence)
    idle_fraction: float  # 1 - sum(depth_i) / (B * max depth_i): draft slots spent waiting for the deepest
    draft_s: float
    verify_s: float
    overhead_s: float
    emitted: int  # tokens committed this step (all sequences)
    synthetic: bool  # any sequence used SYNTHETIC acceptance


def idle_fraction(depths: Seq[int]) -> float:
    deepest = max(depths, default=0)
    return 0.0 if deepest == 0 else 1.0 - sum(depths) / (len(depths) * deepest)


@dataclass
class StepTiming:
    steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.draft_s - self.verify_s


@dataclass(frozen=True)
class RequestOutput:
    """One step's news for one request: the new tokens and text, and whether it finished."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: RequestStats

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Sequence:
    seq_id: int
    request: Request
    text: IncrementalText
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(method=SpecMethod.none))
    sl_state: SequenceDSDE | None = None  # DSDE history and calibration (None under the static policy)
    output: list[int] = field(default_factory=list)
    target_seen: int = 0  # committed tokens the target worker has been sent
    draft_seen: int = 0  # ... and the draft worker
    last_accepted: list[int] = field(default_factory=list)  # accepted nodes of the last proposal
    finish_reason: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output

    def unsent(self, seen: int) -> list[int]:
        return self.tokens[seen:]


class StepLoop:
    def __init__(
        self,
        target: TargetWorker,
        draft: DraftWorker | None = None,
        *,
        speculation: SpecConfig | None = None,
        spec_headroom: int = 0,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: set[int],
        max_batch_size: int,
        max_model_len: int,
        max_step_tokens: int | None = None,
        guard: ThroughputGuard | None = None,
        metrics_window: int = 10_000,
    ) -> None:
        self.target = target
        self.draft = draft
        self.speculation = speculation or SpecConfig(method=SpecMethod.none)
        self.spec_headroom = spec_headroom  # KV room beyond max_model_len for one step's drafted tokens
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.max_step_tokens = max_step_tokens  # guard: drafted tokens + batch size verified per step
        self.guard = guard  # None: always speculate as planned
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}
        self.timing = StepTiming()
        self.record_steps = False
        self.step_records: list[list[SeqStepRecord]] = []
        self.metrics: deque[StepMetrics] = deque(maxlen=metrics_window)

    # -- requests in and out --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._by_request:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(request.prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(request.prompt_ids)} tokens; the context limit is {self.max_model_len} "
                "and leaves no room to generate"
            )
        spec = request.speculation or self.speculation
        if spec.method != SpecMethod.none:
            if self.draft is None:
                raise InvalidRequestError(f"speculation {spec.method.value!r} needs a draft model; none is loaded")
            if spec.max_verify_tokens > self.spec_headroom:
                raise InvalidRequestError(
                    f"speculation verifies up to {spec.max_verify_tokens} tokens per step; "
                    f"this engine reserves room for {self.spec_headroom}"
                )
        text = IncrementalText(self.tokenizer, request.params.stop)
        seq = Sequence(next(self._ids), request, text, spec=spec)
        if spec.policy == SLPolicyKind.dsde and spec.method != SpecMethod.none:
            seq.sl_state = SequenceDSDE(spec.dsde)
        self._by_request[request.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._by_request.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._release([seq])
        return True

    def recover(self, *, target: bool, draft: bool) -> None:
        """After a worker was replaced by a fresh one: re-register every running sequence with it and resend
        its whole token state on the next step (the new worker re-prefills from the router's tokens)."""
        for seq in self.running:
            if target:
                self.target.add(seq.seq_id, seq.request.params)
                seq.target_seen = 0
            if draft and self.draft is not None and seq.spec.method != SpecMethod.none:
                self.draft.add(seq.seq_id, seq.request.params)
                seq.draft_seen = 0
                seq.last_accepted = []

    def prompt_ids(self, request_id: str) -> list[int]:
        return self._by_request[request_id].request.prompt_ids

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """plan SL -> propose -> verify -> commit/stream -> retire."""
        t0 = time.perf_counter()
        self._admit()
        if not self.running:
            return []
        batch = list(self.running)
        plan = self._plan(batch)
        proposals = self._propose(batch, plan.depths)
        t1 = time.perf_counter()
        items = [self._verify_item(s, p) for s, p in zip(batch, proposals, strict=True)]
        verified = self.target.verify(items)
        t2 = time.perf_counter()
        outputs = [self._commit(*args) for args in zip(batch, proposals, verified, strict=True)]
        for seq, prop, out in zip(batch, proposals, verified, strict=True):
            self._observe(seq, prop, out)
        if self.record_steps:
            self.step_records.append([self._record(*args) for args in zip(batch, proposals, verified, strict=True)])
        self._retire()
        # a (re-)prefill step's rate says nothing of decoding: the guard skips it (checked only with a guard)
        prefill = self.guard is not None and any(len(it.new_tokens) > 1 for it in items)
        self._account(batch, plan, proposals, outputs, t0, t1, t2, prefill=prefill)
        return outputs

    def _account(
        self,
        batch: list[Sequence],
        plan: StepPlan,
        proposals: list[Proposal | None],
        outputs: list[RequestOutput],
        t0: float,
        t1: float,
        t2: float,
        *,
        prefill: bool = False,
    ) -> None:
        total = time.perf_counter() - t0
        drafted = any(p is not None for p in proposals)
        draft_s = t1 - t0 if drafted else 0.0
        depths = [0 if p is None else p.depth for p in proposals]
        self.metrics.append(
            StepMetrics(
                batch_size=len(batch),
                depths=depths,
                planned=plan.depths,
                uncapped=plan.uncapped,
                cap=plan.cap,
                levels=max(depths, default=0),
                idle_fraction=idle_fraction(depths),
                draft_s=draft_s,
                verify_s=t2 - t1,
                overhead_s=total - draft_s - (t2 - t1),
                emitted=sum(len(o.token_ids) for o in outputs),
                synthetic=any(s.spec.synthetic_accept is not None for s in batch),
            )
        )
        if self.guard is not None and not prefill and any(s.spec.method != SpecMethod.none for s in batch):
            self.guard.record(len(batch), drafted, sum(len(o.token_ids) for o in outputs), total)
        timing = self.timing
        timing.steps += 1
        timing.draft_s += draft_s
        timing.verify_s += t2 - t1
        timing.total_s += total

    @staticmethod
    def _record(seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> SeqStepRecord:
        if proposal is None:
            return SeqStepRecord(seq.seq_id, 0, 0, 0, [])
        ranks = [proposal.ranks[a - 1] for a in out.accepted] if proposal.ranks is not None else []
        return SeqStepRecord(seq.seq_id, proposal.depth, len(proposal.tokens), len(out.accepted), ranks)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting.popleft()
            self.target.add(seq.seq_id, seq.request.params)
            if self.draft is not None and seq.spec.method != SpecMethod.none:
                self.draft.add(seq.seq_id, seq.request.params)
            self.running.append(seq)

    def _plan(self, batch: list[Sequence]) -> StepPlan:
        """Per-sequence SL (static or DSDE), SL_cap over the lock-step batch, max_sl, then the token guard."""
        uncapped = [s.sl_state.next_sl() if s.sl_state is not None else s.spec.static_depth for s in batch]
        sls = list(uncapped)
        dsde = [i for i, s in enumerate(batch) if s.sl_state is not None]
        cap = None
        if dsde:
            cfg = self.speculation.dsde
            warm = [batch[i].sl_state.in_warmup for i in dsde]  # type: ignore[union-attr]
            own = [uncapped[i] for i in dsde]
            cap = sl_cap(own, [not w for w in warm]) if cfg.cap_enabled else None
            for i, sl in zip(dsde, apply_cap(own, cap, warm, cfg.cap_warmup), strict=True):
                sls[i] = sl
        depths = [
            0 if s.spec.method == SpecMethod.none else s.spec.depth_for(sl) for s, sl in zip(batch, sls, strict=True)
        ]
        return StepPlan(self._guard(batch, depths), uncapped, cap)

    def _guard(self, batch: list[Sequence], depths: list[int]) -> list[int]:
        """The throughput guard first: plain decoding where it measured faster at this batch size. Then shrink
        speculation until drafted tokens + one per sequence fit ``max_step_tokens``: at large batch a CPU
        forward is compute-bound, and verifying tokens that are likely rejected slows everyone."""
        if self.guard is not None and any(depths) and not self.guard.speculate(len(batch)):
            return [0] * len(depths)
        if self.max_step_tokens is None:
            return depths
        depths = list(depths)

        def cost(i: int) -> int:
            spec = batch[i].spec
            return 0 if depths[i] == 0 else (spec.budget - 1 if spec.is_tree else depths[i])

        allowance = self.max_step_tokens - len(batch)
        while sum(cost(i) for i in range(len(batch))) > max(0, allowance):
            i = max(range(len(batch)), key=cost)
            depths[i] = depths[i] - 1 if not batch[i].spec.is_tree else 0
        return depths

    def _propose(self, batch: list[Sequence], depths: list[int]) -> list[Proposal | None]:
        drafting = [(s, d) for s, d in zip(batch, depths, strict=True) if d > 0]
        if not drafting:
            return [None] * len(batch)
        assert self.draft is not None
        items = [
            ProposeItem(
                s.seq_id,
                s.unsent(s.draft_seen),
                s.last_accepted,
                d,
                s.spec,
                kld_mode=None if s.sl_state is None else s.spec.kld_mode,
            )
            for s, d in drafting
        ]
        by_seq = {p.seq_id: p for p in self.draft.propose(items)}
        for s, _ in drafting:
            s.draft_seen = len(s.tokens)
        return [by_seq.get(s.seq_id) for s in batch]

    @staticmethod
    def _verify_item(seq: Sequence, proposal: Proposal | None) -> VerifyItem:
        if proposal is None:
            return VerifyItem(seq.seq_id, seq.unsent(seq.target_seen))
        spec = seq.spec
        return VerifyItem(
            seq.seq_id,
            seq.unsent(seq.target_seen),
            proposal.tokens,
            proposal.parents,
            proposal.q_idx,
            proposal.q_prob,
            kld=proposal.kld,
            kld_past_rejection=spec.dsde.record_past_rejection and not spec.is_tree,
            kld_tail=spec.kld_tail,
            synthetic_accept=spec.synthetic_accept,
        )

    @staticmethod
    def _observe(seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> None:
        """Policy update: this step's KLD values set the sequence's next SL (docs/algorithms.md §4.6)."""
        if seq.sl_state is None or proposal is None:
            return
        drafted = proposal.depth if seq.spec.is_tree else len(proposal.tokens)
        seq.sl_state.observe(out.kld, drafted, min(len(out.accepted), drafted))

    def _commit(self, seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> RequestOutput:
        seq.target_seen = len(seq.tokens) + len(out.accepted)  # the target cached the accepted path
        seq.last_accepted = out.accepted
        seq.stats.target_forwards += 1
        seq.stats.accepted += len(out.accepted)
        if proposal is not None:
            seq.stats.drafted += len(proposal.tokens)
            seq.stats.draft_steps += 1
            seq.stats.depth_sum += proposal.depth
        params = seq.request.params
        new: list[int] = []
        for tok in out.tokens:
            if tok in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = FinishReason.stop
                break
            new.append(tok)
            if len(seq.output) + len(new) >= params.max_tokens or len(seq.tokens) + len(new) >= self.max_model_len:
                seq.finish_reason = FinishReason.length
                break
        seq.output += new
        text = seq.text.update(seq.output, final=seq.finish_reason is not None)
        if seq.text.stopped:
            seq.finish_reason = FinishReason.stop
        return RequestOutput(
            request_id=seq.request.request_id,
            token_ids=new,
            text=text,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.request.prompt_ids),
            num_output_tokens=len(seq.output),
            stats=seq.stats,
        )

    def _retire(self) -> None:
        done = [s for s in self.running if s.finish_reason is not None]
        if done:
            self._release(done)
            self.running = [s for s in self.running if s.finish_reason is None]
            for s in done:
                self._by_request.pop(s.request.request_id, None)

    def _release(self, seqs: list[Sequence]) -> None:
        ids = [s.seq_id for s in seqs]
        self.target.release(ids)
        if self.draft is not None:
            self.draft.release(ids)
