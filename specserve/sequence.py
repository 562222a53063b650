"""A request, the step loop's record of it while it runs (``Sequence``), and what each step reports back."""

from __future__ import annotations

import copy
import time
from dataclasses import astuple, dataclass, field, replace
from enum import Enum

import torch

from specserve.config import SpecConfig, SpecMethod
from specserve.detok import IncrementalText
from specserve.messages import TokenLogprob
from specserve.policy import SequenceDSDE
from specserve.sampling import SamplingParams
from specserve.structured import AnswerGrammar


class FinishReason(str, Enum):
    stop = "stop"  # EOS or a stop string
    length = "length"  # max_tokens or the context limit
    abort = "abort"  # cancelled


@dataclass(frozen=True)
class Delivered:
    """What a request had produced and delivered when its lane lost it: another lane continues after it."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculation: SpecConfig | None = None  # None: the loop's default
    delivered: Delivered | None = None  # continue after this output (a request moved between lanes)
    cache_salt: str | None = None  # the partition of the cross-request suffix cache it drafts from and adds to
    # it was in a step that took its lane's target down, the culprit not yet found: its next lane steps it alone
    # before it joins a batch (a request whose input kills the target would take that batch down too)
    suspect: bool = False


@dataclass
class RequestStats:
    target_forwards: int = 0  # verification steps this request took part in
    drafted: int = 0  # drafted tokens (tree nodes) sent for verification
    accepted: int = 0
    draft_steps: int = 0  # steps in which this request drafted
    depth_sum: int = 0  # draft levels over those steps

    def __add__(self, other: RequestStats) -> RequestStats:
        """The counts of two runs of one request (before and after a move to another lane)."""
        return RequestStats(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

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
class RequestOutput:
    """One step's news for one request: the new tokens and text, and whether it finished."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: RequestStats
    committed: int = 0  # tokens this step added to the output (``token_ids`` may hand some out a step later)
    # what ended a finish_reason ``stop`` other than EOS (vLLM's ``stop_reason``): the stop string, or the stop token id
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None  # per token of ``token_ids``, where the request asked for them
    # per prompt token after the first, on the request's first output, where it asked for them
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the same request's next one as one (their news joined; the later one's totals)."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot join outputs of requests {self.request_id!r} and {later.request_id!r}")
        if self.finished:
            raise ValueError(f"request {self.request_id!r} has finished: no output follows its last")
        return replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=None if self.logprobs is None or later.logprobs is None else self.logprobs + later.logprobs,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            committed=self.committed + later.committed,
        )


@dataclass(frozen=True)
class Checkpoint:
    """A sequence's token state before a step committed its row (``Sequence.checkpoint``), to put back should the
    commit not finish."""

    delivered: int
    pending: list[int]  # the output after its delivered tokens (a commit never changes a delivered token)
    pending_logprobs: list[TokenLogprob]
    prompt_logprobs_sent: bool
    finish_reason: FinishReason | None
    text: IncrementalText
    stats: RequestStats
    features: tuple[list[torch.Tensor], int, int]  # the draft head's feature queue: (its tensors, from, queued)


@dataclass
class Sequence:
    """The authoritative token state of one request (the step loop owns it; workers hold only caches)."""

    seq_id: int
    request: Request
    text: IncrementalText
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(method=SpecMethod.none))
    sl_state: SequenceDSDE | None = None  # DSDE history and calibration (None under the static policy)
    output: list[int] = field(default_factory=list)
    delivered: int = 0  # output tokens handed out (RequestOutput.token_ids so far)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # of output[delivered:], if asked for
    prompt_logprobs_sent: bool = False  # its prompt's logprobs (if asked for) went with an output
    registered: bool = False  # added to the workers (False: on its next step, after admission or a reset)
    target_seen: int = 0  # committed tokens the target worker has been sent
    draft_seen: int = 0  # ... and the draft worker
    last_accepted: list[int] = field(default_factory=list)  # accepted nodes of the draft model's last proposal
    model_proposed: bool = False  # this step's proposal came from the draft model (not a model-free drafter)
    draft_caught_up: int = 0  # ... and the draft model first re-read this many tokens it had missed (plain steps)
    draft_prefilled: bool = False  # ... or a draft head first read the features of its prompt (the step after its
    # admission, in which the head had none yet; a new or reset worker's window likewise): the head's prefill
    finish_reason: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    arrived: float = field(default_factory=time.perf_counter)  # when the loop accepted the request
    features: list[torch.Tensor] = field(default_factory=list)  # target hidden states for a draft head: the newest
    # ``spec.catch_up_window`` and any not sent yet
    features_from: int = 0  # position of the first of them
    features_queued: int = 0  # rows in ``features`` (counted as they come: a plain step adds one, every step)
    features_sent: int = 0  # positions below this went to the draft worker (0: a new worker, or one that was reset)
    grammar: AnswerGrammar | None = None  # a structured answer's: follows ``output`` (its own record of what it fed)
    suspect: bool = False  # ``Request.suspect``: admitted only to step alone, until a step of it commits

    def checkpoint(self) -> Checkpoint:
        """Its token state now: the output, what of it was handed out, the text, the counts and the draft head's
        feature queue (shallow copies: an update of the text rebinds its attributes and mutates none; the queue's
        tensors are never written in place)."""
        pending = self.output[self.delivered :]
        features = (list(self.features), self.features_from, self.features_queued)
        return Checkpoint(
            self.delivered,
            pending,
            list(self.pending_logprobs),
            self.prompt_logprobs_sent,
            self.finish_reason,
            copy.copy(self.text),
            replace(self.stats),
            features,
        )

    def rollback(self, saved: Checkpoint) -> None:
        """Back to a checkpoint's token state. The workers' caches and the loop's counters of what they were sent
        are not in it: the caller of a failed step resets them (``StepLoop.reset``), and they re-prefill."""
        self.output[saved.delivered :] = saved.pending
        self.pending_logprobs, self.prompt_logprobs_sent = saved.pending_logprobs, saved.prompt_logprobs_sent
        self.delivered, self.finish_reason = saved.delivered, saved.finish_reason
        self.text, self.stats = saved.text, saved.stats
        self.features, self.features_from, self.features_queued = saved.features  # (rows past the kept tokens
        # would reach the draft head as the context of tokens it never had)

    def add_features(self, rows: torch.Tensor, start: int) -> None:
        """Queue the hidden states [n, F] of positions start..start+n-1; a non-contiguous start (the target
        re-prefilled after a restart) drops the queue first. Rows older than the newest ``spec.catch_up_window``
        leave it a whole tensor at a time (no copy a step; ``queued_features`` cuts the rest), and an oldest tensor
        reaching past them is cut once sent; the newest window stays, sent or not, for a draft worker that starts
        afresh."""
        if self.features and self.features_from + self.features_queued != start:
            self.drop_features()
        if not self.features:
            self.features_from = start
        self.features.append(rows)
        self.features_queued += rows.shape[0]
        window = self.spec.catch_up_window
        while self.features_queued - (n := self.features[0].shape[0]) >= window:
            del self.features[0]
            self.features_from += n
            self.features_queued -= n
        # an oldest tensor longer than the window (a prompt's) keeps only its rows within it, once they were sent or
        # when the head's next read takes only the window anyway (it did not draft this step: a plain step, a prompt
        # the head had no features for), so a long prompt does not stay whole through the plain steps that follow
        # (a step's few rows past it stay: cutting them would copy rows every step)
        cut = self.features_queued - window
        if self.reads_every_unsent:
            cut = min(cut, self.features_sent - self.features_from)
        if cut > 0 and self.features[0].shape[0] > window:
            self.features[0] = self.features[0][cut:].clone()  # (a view would keep the whole tensor's memory)
            self.features_from += cut
            self.features_queued -= cut

    def queued_features(self, in_step: bool) -> tuple[int, torch.Tensor] | None:
        """(the position of the first, the rows [n, F]) of what a draft head reads before drafting (None: nothing):
        the features it was not sent, of them at most the newest ``spec.catch_up_window``; ``in_step``: it drafted
        the last step, so all of them (one step's rows: a step that commits more than the window is no gap to
        restart its context at)."""
        end = self.features_from + self.features_queued
        newest = 0 if in_step else end - self.spec.catch_up_window
        first = max(self.features_from, self.features_sent, newest)
        if first >= end:
            return None
        parts, start = [], end  # the newest tensors that cover first..end (in step: the last step's alone, no copy)
        for rows in reversed(self.features):
            if start <= first:
                break
            parts.append(rows)
            start -= rows.shape[0]
        joined = parts[0] if len(parts) == 1 else torch.cat(parts[::-1])
        return first, joined[first - start :]

    @property
    def reads_every_unsent(self) -> bool:
        """The head's next read of the queue takes every row it was not sent (it drafted this step from features it
        was sent), not only the newest ``spec.catch_up_window``."""
        return self.model_proposed and self.features_sent > 0

    def features_went(self) -> None:
        """The queued features went to the draft worker (those it was not sent before)."""
        self.features_sent = self.features_from + self.features_queued

    def drop_features(self) -> None:
        """Empty the queue (its features are of no use: the target re-prefilled)."""
        self.features, self.features_queued = [], 0

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.output)

    def unsent(self, seen: int) -> list[int]:
        """The tokens from index ``seen`` on, without building the whole context (its output's, past the prompt)."""
        prompt = self.request.prompt_ids
        return self.output[seen - len(prompt) :] if seen >= len(prompt) else prompt[seen:] + self.output

    def draft_behind(self) -> int:
        """Tokens the draft model has not read: all of them before its first step, after plain steps those steps'
        (its last proposal's accepted nodes are in its cache already)."""
        return self.length - self.draft_seen - len(self.last_accepted)

    def remaining(self, max_model_len: int) -> int:
        """Tokens it may still emit: its max_tokens, or the context limit if that comes first."""
        room = max_model_len - self.length
        return max(0, min(self.request.params.max_tokens - len(self.output), room))

    @property
    def prefills(self) -> bool:
        """Its next step feeds the target more than its root (an admitted prompt, or a re-prefill after a recovery);
        counted without building ``tokens``."""
        return self.length - self.target_seen > 1
