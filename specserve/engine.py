"""In-process Engine: generate / stream over the same StepLoop and workers the server uses."""

from __future__ import annotations

import collections
import contextlib
import itertools
import numbers
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, cast, overload

from transformers import PreTrainedTokenizerBase

from specserve.build import build_step_loop, draft_geometry, eos_ids_of, local_draft_worker
from specserve.config import EngineConfig, LoopConfig, SpecConfig, SpecMethod
from specserve.errors import InvalidRequestError, PartialStepError, SettingsError, blamed_sequence
from specserve.guard import GuardConfig
from specserve.heap import freeze_loaded_objects
from specserve.limits import MemoryShare, context_limits, device_kv_slots
from specserve.messages import TokenLogprob
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_draft, load_model, load_tokenizer, warn_on_another_tokenizer
from specserve.prompts import PromptEncoder
from specserve.sampling import SamplingParams
from specserve.sequence import FinishReason, Request, RequestOutput, RequestStats
from specserve.spec_decode.eagle_head import EagleHead
from specserve.structured import GrammarDeadEnd
from specserve.workers import HeadDraftWorker, TargetWorker

Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS or a limit)
    logprobs: list[TokenLogprob] | None = None  # per token of ``token_ids``, where its params asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # per prompt token after the first, where they asked


class Engine:
    """Generation in the caller's threads: any thread may submit, generate, stream or collect, one step of the shared
    batch running at a time (a lock); each call's outputs reach it whichever thread stepped them."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        draft: LlamaModel | EagleHead | None = None,
        speculation: SpecConfig | None = None,
        max_batch_size: int = 16,
        max_model_len: int = 2048,
        spec_headroom: int = 64,
        max_step_tokens: int | None = None,
        throughput_guard: bool = False,
        guard: GuardConfig | None = None,
        suffix_cache_tokens: int = LoopConfig.model_fields["suffix_cache_tokens"].default,
        eos_token_ids: set[int] | None = None,
        gpu_memory_utilization: float | None = None,
    ) -> None:
        if not isinstance(model, LlamaModel):  # (an AttributeError deep in the build named neither)
            raise SettingsError(f"model is a loaded LlamaModel (load_model(...)), not a {type(model).__name__}")
        if draft is not None and not isinstance(draft, LlamaModel | EagleHead):
            raise SettingsError(
                f"draft is a loaded LlamaModel or EagleHead (load_draft(...)), not a {type(draft).__name__}"
            )
        if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise SettingsError(
                f"tokenizer is a transformers tokenizer (load_tokenizer(...)) or None, not a {type(tokenizer).__name__}"
            )
        self.model = model
        self.tokenizer = tokenizer
        cfg = LoopConfig(
            speculation=speculation or SpecConfig(method=SpecMethod.none),
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            spec_headroom=spec_headroom,
            max_step_tokens=max_step_tokens,
            throughput_guard=throughput_guard,
            guard=guard or GuardConfig(),
            suffix_cache_tokens=suffix_cache_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        if draft is None and cfg.speculation.needs_model:  # (EngineConfig refuses the same; a request may still
            # ask for it on a plain engine and gets an InvalidRequestError then)
            raise SettingsError(f"speculation {cfg.speculation.method.value!r} needs a draft model; none is given")
        draft_positions, draft_vocab = draft_geometry(draft)
        limits = context_limits(  # (cfg's values: the arguments as validated, "256" or 256.0 made 256)
            max_model_len=cfg.max_model_len,
            spec_headroom=cfg.spec_headroom,
            speculation=cfg.speculation,
            target_positions=model.max_positions,
            target_vocab=model.cfg.vocab_size,
            draft_positions=draft_positions,
            draft_vocab=draft_vocab,
        )
        self.encoder = PromptEncoder(tokenizer, model.cfg.vocab_size)
        eos = (
            eos_ids_of(sorted(model.eos_token_ids), tokenizer)
            if eos_token_ids is None
            else _token_set(eos_token_ids, model.cfg.vocab_size)
        )
        num_slots = device_kv_slots(
            [model] if draft is None else [model, draft],
            requested=cfg.max_batch_size,
            max_len=limits.kv_len,
            step_tokens=limits.spec_headroom,
            share=None if cfg.gpu_memory_utilization is None else MemoryShare(cfg.gpu_memory_utilization),
        )
        cfg = cfg.model_copy(update={"max_batch_size": num_slots})  # fewer slots fit: fewer sequences at once
        slots = {"num_slots": num_slots, "max_len": limits.kv_len}
        draft_worker = None if draft is None else local_draft_worker(draft, **slots)
        features = draft_worker.features if isinstance(draft_worker, HeadDraftWorker) else None
        self.loop = build_step_loop(TargetWorker(model, **slots), draft_worker, cfg, limits, tokenizer, eos, features)
        self._ids = itertools.count()
        # every submitted request's outputs (or the error that ended it) until a caller has consumed them
        self._outbox: dict[str, _Outbox] = {}
        self._loop_depth = 0  # calls into the loop this thread is inside (``_in_loop``)
        self._deferred_aborts: collections.deque[str] = collections.deque()
        self._failed: set[str] = set()  # requests whose error waits in their outbox
        # one thread at a time in the loop and the outboxes (re-entrant: a stream finalised inside a loop call aborts)
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, config: EngineConfig, *, tokenizer: PreTrainedTokenizerBase | None = None) -> Engine:
        """``tokenizer``: the target's, where the caller has loaded it already (else loaded here)."""
        model = load_model(config.target, device=config.device)
        draft = None if config.draft is None else load_draft(config.draft, model, device=config.device)
        tokenizer = load_tokenizer(config.target) if tokenizer is None else tokenizer
        warn_on_another_tokenizer(config.target, tokenizer, config.draft)
        engine = cls(
            model,
            tokenizer,
            draft=draft,
            speculation=config.speculation,
            max_batch_size=config.max_batch_size,
            max_model_len=config.max_model_len,
            spec_headroom=config.spec_headroom,
            max_step_tokens=config.max_step_tokens,
            throughput_guard=config.throughput_guard,
            guard=config.guard,
            suffix_cache_tokens=config.suffix_cache_tokens,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
        if config.freeze_gc:
            freeze_loaded_objects()
        return engine

    # -- prompts ---------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, *, chat: bool = False) -> list[int]:
        """A prompt's ids: text (through the chat template with ``chat``), chat messages (the template always) or
        token ids (as they are: ``chat`` applies to text)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # chat messages
            if (bad_at := next((i for i, m in enumerate(prompt) if not isinstance(m, dict)), None)) is not None:
                item = prompt[bad_at]
                raise InvalidRequestError(
                    f"chat messages are dicts; message {bad_at} is {type(item).__name__} {str(item)[:80]!r}"
                )
            return self.encoder.chat(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list):
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if bad:
                raise InvalidRequestError(
                    f"a list prompt is token ids (integers) or chat messages (dicts), not {type(bad[0]).__name__} "
                    f"{bad[0]!r}"
                )
            return self.encoder.token_ids([int(cast(numbers.Integral, t)) for t in prompt])
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"a prompt is text, token ids or chat messages, not {type(prompt).__name__}")
        if chat:
            return self.encoder.chat([{"role": "user", "content": prompt}])
        return self.encoder.text(prompt)

    # -- generation -------------------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        speculation: SpecConfig | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """``cache_salt``: the partition of the suffix drafter's cache of recent outputs the request drafts from and
        adds to (as the API's field; None: the unsalted one)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, not {type(params).__name__}")
        if speculation is not None and not isinstance(speculation, SpecConfig):
            raise InvalidRequestError(f"speculation must be a SpecConfig or None, not {type(speculation).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string or None, not {cache_salt!r}")
        ids = self.encode(prompt, chat=chat)
        if params is not None:
            self.encoder.check_token_ids(params)
        with self._lock, self._in_loop():
            request_id = f"req-{next(self._ids)}"
            self.loop.add_request(
                Request(request_id, ids, params or SamplingParams(), speculation, cache_salt=cache_salt)
            )
            self._outbox[request_id] = _Outbox(ids)
        return request_id

    @overload
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        speculation: SpecConfig | None = None,
        cache_salt: str | None = None,
        return_exceptions: Literal[False] = False,
    ) -> list[Completion]: ...
    @overload
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        speculation: SpecConfig | None = None,
        cache_salt: str | None = None,
        return_exceptions: Literal[True],
    ) -> list[Completion | Exception]: ...
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        speculation: SpecConfig | None = None,
        cache_salt: str | None = None,
        return_exceptions: bool = False,
    ) -> list[Completion] | list[Completion | Exception]:
        """Generate for several prompts batched together; returns completions in prompt order (see ``collect`` for
        ``return_exceptions``)."""
        if not isinstance(prompts, str | list | tuple):  # a dict's keys or a set's members are no prompts in order
            hint = " (a chat's messages go in a list)" if isinstance(prompts, dict) else ""
            what = type(prompts).__name__
            raise InvalidRequestError(f"prompts are a prompt or a list of prompts, not a {what}{hint}")
        if isinstance(prompts, Sequence) and not isinstance(prompts, str) and len(prompts) == 0:
            raise InvalidRequestError(
                "no prompts given: an empty list is neither a batch of prompts nor a prompt of tokens"
            )
        batch: list[Prompt] = [cast(Prompt, prompts)] if _is_single(prompts) else list(cast(Sequence[Prompt], prompts))
        if isinstance(params, str):  # (a Sequence: its characters were counted as parameter sets)
            raise InvalidRequestError("params are SamplingParams or a list of them, not a str")
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise InvalidRequestError(f"{len(batch)} prompts but {len(plist)} sampling parameter sets")
        ids: list[str] = []
        try:
            for p, sp in zip(batch, plist, strict=True):
                ids.append(self.submit(p, sp, chat=chat, speculation=speculation, cache_salt=cache_salt))
        except BaseException:  # a prompt that fails to encode or validate, or a Ctrl-C while encoding a long batch:
            self._drop(ids)  # the ones before it are not left running (their ids were never returned)
            raise
        return self.collect(ids, return_exceptions=True) if return_exceptions else self.collect(ids)

    @overload
    def collect(self, request_ids: Sequence[str], *, return_exceptions: Literal[False] = False) -> list[Completion]: ...
    @overload
    def collect(
        self, request_ids: Sequence[str], *, return_exceptions: Literal[True]
    ) -> list[Completion | Exception]: ...
    def collect(
        self, request_ids: Sequence[str], *, return_exceptions: bool = False
    ) -> list[Completion] | list[Completion | Exception]:
        """Run submitted requests to completion (batched with whatever else is queued); completions in the order
        given. A request that failed on its own (its sequence's error: the others keep running) raises its error as
        soon as the step that failed it ends, and the requests not yet consumed are aborted; with
        ``return_exceptions`` every request runs to its end and a failed one's error takes its place in the list, as
        ``asyncio.gather`` does. A failure of the whole step raises either way."""
        if isinstance(request_ids, str):  # (a Sequence: its characters were taken for ids)
            raise InvalidRequestError(f"request_ids are a list of ids, not a str: [{request_ids!r}]?")
        if not isinstance(request_ids, Sequence):
            raise InvalidRequestError(f"request_ids are a list of ids, not {type(request_ids).__name__}")
        ids = list(request_ids)
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"request ids given twice: {sorted({r for r in ids if ids.count(r) > 1})}")
        self._claim(ids)
        prompt_ids = {rid: self._outbox[rid].prompt_ids for rid in ids}
        completions: list[Completion | Exception] = []
        later = set(ids)  # the requests not yet read: one that fails raises at once (without return_exceptions)
        with self._consuming(ids):
            for rid in ids:  # the others' outputs wait in their outboxes meanwhile
                later.discard(rid)
                tokens, text, last = [], "", None
                logprobs: list[TokenLogprob] | None = None
                prompt_logprobs: list[TokenLogprob] | None = None
                for out in self._outputs(
                    rid, errors_as_values=return_exceptions, watch=None if return_exceptions else later
                ):
                    if isinstance(out, Exception):
                        completions.append(out)
                        break
                    tokens += out.token_ids
                    text += out.text
                    if out.logprobs is not None:
                        logprobs = [] if logprobs is None else logprobs
                        logprobs += out.logprobs
                    prompt_logprobs = out.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
                    last = out
                else:
                    assert last is not None and last.finish_reason is not None
                    completions.append(
                        Completion(
                            rid,
                            prompt_ids[rid],
                            tokens,
                            text,
                            last.finish_reason,
                            last.stats,
                            last.stop_reason,
                            logprobs,
                            prompt_logprobs,
                        )
                    )
        return completions  # only Completions unless return_exceptions

    def _step(self) -> None:
        """One loop step, its outputs put in their requests' outboxes. A request whose sequence failed is aborted
        (its KV freed) and its error waits in its outbox for its consumer, behind any tokens the step committed for
        it first; the others keep every token the step committed. A failure that names no sequence resets every
        running one (each re-prefills on its next step) and reaches the caller."""
        try:
            with self._in_loop():
                outputs = self.loop.step()
        except PartialStepError as e:
            self._deliver(e.outputs)
            for seq_id, error in e.failures.items():  # (a held answer at its grammar's dead end: that error itself)
                cause = error.__cause__
                failed = cause if isinstance(cause, GrammarDeadEnd) else PartialStepError([], {seq_id: error})
                self._fail(seq_id, failed)
            return
        except BaseException as e:  # KeyboardInterrupt too: the others must not keep the failed step's caches
            with self._in_loop():
                running = {s.seq_id for s in self.loop.running}
                self.loop.reset(running)  # part of the step may be in the workers' caches and the sequences' counters
            if not isinstance(e, Exception) or (blamed := blamed_sequence(e)) not in running:
                raise
            self._fail(blamed, e)
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if (waiting := self._outbox.get(out.request_id)) is not None:
                waiting.outputs.append(out)

    @contextlib.contextmanager
    def _in_loop(self) -> Iterator[None]:
        """Around every call into the loop. Aborts asked for inside one (a stream finalised by the garbage collector
        at any allocation on this thread) run as the outermost call ends: the call may be using the request's
        sequence, or hold a lock the abort takes (the suffix cache's: not re-entrant)."""
        self._loop_depth += 1
        try:
            yield
        finally:
            try:
                if self._loop_depth == 1:
                    while self._deferred_aborts:  # (still inside: an abort finalising a stream defers that one too)
                        self.loop.abort(self._deferred_aborts.popleft())
            finally:  # an abort that raised (an interrupt) leaves the depth as it found it: later ones still run
                self._loop_depth -= 1

    def _fail(self, seq_id: int, error: Exception) -> None:
        if (request_id := self.loop.request_id(seq_id)) is None:
            return
        with self._in_loop():
            self.loop.abort(request_id)
        if (box := self._outbox.get(request_id)) is not None:
            box.outputs.append(error)
            self._failed.add(request_id)

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        speculation: SpecConfig | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """One RequestOutput per step for this request (other queued requests keep running, and other streams and
        ``generate`` calls of this engine may be consumed in between). The request is submitted here: bad input
        raises at the call, not at the first ``next``."""
        rid = self.submit(prompt, params, chat=chat, speculation=speculation, cache_salt=cache_salt)
        self._claim([rid])
        return RequestStream(self._stream(rid), partial(self._drop, [rid]))

    def abort(self, request_id: str) -> None:
        """Stop a submitted request no stream or collect is reading, and forget its outputs (its KV is freed): one
        never collected had run to its end and kept its outputs for the engine's life. A read one stops when its
        reader closes the stream or leaves the collect."""
        with self._lock:
            if (box := self._outbox.get(request_id)) is None:
                raise InvalidRequestError(f"no submitted and unconsumed request with id {request_id!r}")
            if box.claimed:
                raise InvalidRequestError(f"request {request_id!r} is read by a stream or a collect: close that")
            self._drop([request_id])

    def _stream(self, rid: str) -> Generator[RequestOutput, None, None]:
        with self._consuming([rid]):
            yield from self._outputs(rid)

    def _claim(self, request_ids: list[str]) -> None:
        """Make these requests' outputs this caller's alone: one taken by a stream (or another collect) would reach
        each reader in part."""
        with self._lock:
            for rid in request_ids:
                if (box := self._outbox.get(rid)) is None:
                    raise InvalidRequestError(f"no submitted and unconsumed request with id {rid!r}")
                if box.claimed:
                    raise InvalidRequestError(f"request {rid!r} is already read by a stream or another collect")
            for rid in request_ids:
                self._outbox[rid].claimed = True

    @contextlib.contextmanager
    def _consuming(self, request_ids: list[str]) -> Iterator[None]:
        """While a caller consumes these requests' outputs; on leaving, their outboxes go and the unfinished ones
        are aborted (a consumer that stops early, or an error, frees their KV)."""
        try:
            yield
        finally:
            self._drop(request_ids)

    def _drop(self, request_ids: Sequence[str]) -> None:
        with self._lock, self._in_loop():  # aborted as the outermost loop call ends
            for rid in request_ids:
                self._outbox.pop(rid, None)
                self._failed.discard(rid)
                self._deferred_aborts.append(rid)

    @overload
    def _outputs(self, rid: str) -> Iterator[RequestOutput]: ...
    @overload
    def _outputs(
        self, rid: str, *, errors_as_values: bool, watch: set[str] | None = None
    ) -> Iterator[RequestOutput | Exception]: ...
    def _outputs(
        self, rid: str, *, errors_as_values: bool = False, watch: set[str] | None = None
    ) -> Iterator[RequestOutput | Exception]:
        """This request's outputs through its finished one, or the error that ended it (raised, or yielded last with
        ``errors_as_values``), stepping the loop while none waits; a step's outputs for other submitted requests go
        to their outboxes. ``watch``: requests whose error a step puts in their outbox is raised after that step."""
        box = self._outbox[rid].outputs
        while True:
            while box:
                out = box.popleft()
                if isinstance(out, Exception):
                    if errors_as_values:
                        yield out
                        return
                    raise out
                yield out
                if out.finished:
                    return
            with self._lock:
                if box:  # another thread's step brought them while this one waited for the lock
                    continue
                if not self.loop.has_work:
                    raise RuntimeError(f"request {rid} is no longer running and its outputs ended unfinished")
                self._step()
                if watch and (failed := self._failed & watch):
                    raise cast(Exception, self._outbox[min(failed)].outputs[-1])  # (its error: its last output)


class RequestStream(Iterator[RequestOutput]):
    """A request's outputs (``Engine.stream``). Closed, or dropped, before its end, read from or not, it aborts the
    request (a generator's own exit runs only once it was entered: one closed before its first ``next`` left the
    request running to its end)."""

    def __init__(self, outputs: Generator[RequestOutput, None, None], abort: Callable[[], None]) -> None:
        self._outputs = outputs
        self._abort = weakref.finalize(self, abort)
        self._abort.atexit = False

    def __next__(self) -> RequestOutput:
        return next(self._outputs)

    def close(self) -> None:
        self._outputs.close()
        self._abort()


@dataclass
class _Outbox:
    prompt_ids: list[int]
    claimed: bool = False  # a stream or a collect reads it: no other caller may
    outputs: collections.deque[RequestOutput | Exception] = field(default_factory=collections.deque)


def _token_set(ids: Iterable[int], vocab_size: int) -> set[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise SettingsError(f"eos_token_ids must be a collection of token ids, not {ids!r}")
    ids = list(ids)
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise SettingsError(f"eos_token_ids must be token ids (integers), not {ids!r}")
    if outside := sorted(int(t) for t in ids if not 0 <= t < vocab_size):  # never sampled: requests would not stop
        raise SettingsError(f"eos_token_ids {outside} are outside the model's vocabulary [0, {vocab_size})")
    return {int(t) for t in ids}


def _is_single(prompts: object) -> bool:
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, list) and (not prompts or isinstance(prompts[0], numbers.Integral | dict))
