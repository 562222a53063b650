"""StepLoop: continuous batching over a target worker (and, with speculation, a draft worker).

The scheduler owns the authoritative token state of every request; workers hold only caches.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from transformers import PreTrainedTokenizerBase

from specserve.detok import IncrementalText
from specserve.errors import InvalidRequestError
from specserve.protocol import VerifyItem, VerifyOutput
from specserve.sampling import SamplingParams
from specserve.workers import TargetWorker


class FinishReason(str, Enum):
    stop = "stop"  # EOS or a stop string
    length = "length"  # max_tokens or the context limit
    abort = "abort"  # cancelled


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class RequestStats:
    target_forwards: int = 0  # verification steps this request took part in
    drafted: int = 0
    accepted: int = 0

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Sequence:
    seq_id: int
    request: Request
    text: IncrementalText
    output: list[int] = field(default_factory=list)
    target_seen: int = 0  # committed tokens the target worker has been sent
    finish_reason: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output

    def unsent(self) -> list[int]:
        return self.tokens[self.target_seen :]


class StepLoop:
    def __init__(
        self,
        target: TargetWorker,
        *,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: set[int],
        max_batch_size: int,
        max_model_len: int,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}

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
        seq = Sequence(next(self._ids), request, IncrementalText(self.tokenizer, request.params.stop))
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
            self.target.release([seq.seq_id])
        return True

    def prompt_ids(self, request_id: str) -> list[int]:
        return self._by_request[request_id].request.prompt_ids

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._admit()
        if not self.running:
            return []
        batch = list(self.running)
        verified = self.target.verify([VerifyItem(s.seq_id, s.unsent()) for s in batch])
        outputs = [self._commit(seq, out) for seq, out in zip(batch, verified, strict=True)]
        self._retire()
        return outputs

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting.popleft()
            self.target.add(seq.seq_id, seq.request.params)
            self.running.append(seq)

    def _commit(self, seq: Sequence, out: VerifyOutput) -> RequestOutput:
        seq.target_seen = len(seq.tokens)
        seq.stats.target_forwards += 1
        seq.stats.accepted += len(out.accepted)
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
            self.target.release([s.seq_id for s in done])
            self.running = [s for s in self.running if s.finish_reason is None]
            for s in done:
                self._by_request.pop(s.request.request_id, None)
