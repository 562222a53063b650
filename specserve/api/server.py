"""The OpenAI-compatible HTTP API over any generation backend (the Ray Serve router is one).

Every error a client can cause is a 4xx with OpenAI's error body; a full queue is a 429 with Retry-After, and
every 503 has one too (``RequestGuard`` adds it).
A stream (SSE) whose client goes away is closed, which aborts the request and frees its KV.
Before any route, ``RequestGuard`` checks the API key, the body size (413) and the body-read time (408).
/openapi.json is built from the same models the routes validate with, and documents the 400s they send.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from http import HTTPStatus
from typing import Annotated, Any, Protocol, Self, TypeVar, cast

from fastapi import FastAPI, Header
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from specserve.api import tools
from specserve.api.convert import sampling_params_for, speculation_for, usage_for
from specserve.api.error_bodies import (
    APIError,
    ContextLengthError,
    ModelNotFoundError,
    OverloadedError,
    ResumeMismatchError,
    error_body,
)
from specserve.api.http_guard import CHAT_PATH, COMPLETIONS_PATH, HTTPOptions, RequestGuard
from specserve.api.metrics import RequestStatus, ServeMetrics
from specserve.api.resume import RESUME_PARAM, StreamCursor, StreamMark, StreamPhase
from specserve.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorCode,
    ErrorResponse,
    ErrorType,
    FinishReasonOut,
    FunctionCallDelta,
    GenerationRequest,
    Health,
    HealthStatus,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDelta,
    ToolMode,
    TopLogprob,
    Usage,
    is_union_member,
)
from specserve.api.tools import offered_tools
from specserve.config import SpecConfig
from specserve.errors import InvalidRequestError, PromptTooLongError
from specserve.messages import TokenLogprob
from specserve.prompts import PromptEncoder
from specserve.sampling import SamplingParams
from specserve.sequence import FinishReason, Request, RequestOutput

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
# a comment line, which SSE clients skip: sent while a resumed stream replays what the client already has, so
# that its read timeout (no bytes for a while) does not cut it again before it reaches the resume point. A line
# alone, with no blank line after it: the OpenAI SDK's decoder dispatches an empty event at a blank line once any
# event had an id (and then fails on its empty data), where the SSE spec dispatches nothing
SSE_REPLAYING = ": replaying\n"
REPLAY_KEEPALIVE_S = 1.0
# and on any stream with nothing sent for this long (a queue, a target reloading, a failover's pause): proxies and
# clients cut a connection idle for a minute or so (nginx's and load balancers' read timeouts, load/'s client)
SSE_KEEPALIVE = ": keep-alive\n"
SSE_KEEPALIVE_S = 15.0
# JSON leaves these unescaped, yet str.splitlines and httpx's iter_lines end a line at each: escaped, a chunk whose
# text holds one stays one line for every client
_LINE_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})
SSE_MEDIA_TYPE = "text/event-stream"
# a proxy in front (nginx buffers what it proxies by default) passes each event on as it comes, and caches none
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PROMETHEUS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class OutputStream(Protocol):
    """One admitted request's outputs; closing it before the end aborts the request."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None: ...


class Backend(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def encoder(self) -> PromptEncoder: ...

    @property
    def default_speculation(self) -> SpecConfig: ...

    @property
    def metrics(self) -> ServeMetrics: ...

    @property
    def capacity(self) -> int:
        """Requests it runs or queues at once now (a request of n choices takes n)."""
        ...

    @property
    def most_capacity(self) -> int:
        """Requests it runs or queues at once at most, with all it has serving: a request of more choices is refused
        outright (a 400), one of more than ``capacity`` but no more waits (a 429) while some of it is down."""
        ...

    def check_capacity(self, *, pending: int = 0) -> None:
        """Raise OverloadedError where a request submitted now would be refused as over capacity, counting
        ``pending`` requests on their way in: asked before the prompt is tokenised, so that a full server spends
        nothing on it (``submit`` asks again)."""
        ...

    async def submit(self, request: Request) -> OutputStream:
        """Admit a request; raises OverloadedError when full, InvalidRequestError when the loop rejects it."""
        ...

    def health(self) -> Health: ...

    async def debug_state(self) -> BaseModel: ...


def build_api(backend: Backend, options: HTTPOptions | None = None) -> FastAPI:
    options = options or HTTPOptions()
    api = FastAPI(
        title="specserve",
        description="OpenAI-compatible LLM serving with speculative decoding",
        redirect_slashes=False,  # a path with a trailing slash is a 404 with an error body, not a bare 307
    )
    routes = _Routes(backend)
    generation = _error_responses(options, 400, 404, 408, 413, 429, 500, 503)
    api.add_api_route(
        COMPLETIONS_PATH,
        routes.completions,
        methods=["POST"],
        response_model=None,
        responses={200: _generation_response(CompletionResponse, CompletionChunk), **generation},
    )
    api.add_api_route(
        CHAT_PATH,
        routes.chat_completions,
        methods=["POST"],
        response_model=None,
        responses={200: _generation_response(ChatCompletionResponse, ChatCompletionChunk), **generation},
    )
    for path, route in (("/tokenize", routes.tokenize), ("/detokenize", routes.detokenize)):
        api.add_api_route(path, route, methods=["POST"], responses=_error_responses(options, 400, 404, 408, 413, 500))
    api.add_api_route("/v1/models", routes.models, methods=["GET"], responses=_error_responses(options))
    api.add_api_route(
        "/v1/models/{model:path}", routes.model, methods=["GET"], responses=_error_responses(options, 404)
    )
    api.add_api_route(
        "/health",
        routes.health,
        methods=["GET"],
        response_model=Health,
        responses={503: {"model": Health, "description": "a lane is down"}},
    )
    api.add_api_route(
        "/metrics",
        routes.metrics,
        methods=["GET"],
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format", "content": {PROMETHEUS_MEDIA_TYPE: {}}}},
        description="Prometheus metrics of this replica",
    )
    if options.debug_routes:
        api.add_api_route(
            "/debug/lanes", routes.debug, methods=["GET"], response_model=None, description="debug: lane and KV state"
        )
    _install_error_handlers(api, backend.metrics)
    api.add_middleware(RequestGuard, options=options, metrics=backend.metrics)
    api.openapi = lambda: _openapi(api, options)  # type: ignore[method-assign]
    return api


# -- routes ---------------------------------------------------------------------------------------------


@dataclass
class _Tracker:
    """Latency of one request, for TTFT / TPOT: of the tokens its client is sent (a resumed stream regenerates
    what it sent before its resume point and sends none of it)."""

    arrival: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    sent: int = 0  # tokens sent
    held: int = 0  # tokens to send, in no chunk yet (a character's first bytes: its text is not whole)
    latest: RequestOutput | None = None  # the request's totals so far

    def see(self, out: RequestOutput, sent: int | None = None, *, shown: bool = True) -> None:
        """An output; ``sent``: how many of its tokens the client is sent (None: all); ``shown``: whether they go
        now (else with the next chunk sent: its time is theirs)."""
        self.latest = out
        self.held += len(out.token_ids) if sent is None else sent
        if not shown:
            return
        n, self.held = self.held, 0
        if n:
            now = time.perf_counter()
            self.first = now if self.first is None else self.first
            self.last = now
            self.sent += n

    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.sent < 2:
            return None
        return (self.last - self.first) / (self.sent - 1)


_END = object()  # the end of a stream, in _Outcome's queue
_ENDED = (FinishReason.stop, FinishReason.length)  # (an answer that ended, not one aborted)


@dataclass
class _PromptScored:
    """A prompt-only request's stream (completions' ``max_tokens`` 0, with echo): its one generated token dropped,
    as vLLM's scoring drops it; the prompt's logprobs kept, and the answer ended by its length (of 0)."""

    stream: OutputStream

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for out in self.stream:
            yield replace(
                out,
                token_ids=[],
                text="",
                logprobs=None if out.logprobs is None else [],
                num_output_tokens=0,
                committed=0,
                finish_reason=FinishReason.length if out.finish_reason in _ENDED else out.finish_reason,
                stop_reason=None,
            )

    async def aclose(self) -> None:
        await self.stream.aclose()


@dataclass
class _Outcome:
    """Reads a request's stream, closes it exactly once (aborting it if unfinished) and counts how it ended."""

    stream: OutputStream
    metrics: ServeMetrics
    tracker: _Tracker
    status: RequestStatus = RequestStatus.aborted
    closed: bool = False
    # the stream's outputs, read by one task as they come (a task per awaited output cost ~10 us more an output:
    # docs/benchmarks.md, "Streams kept alive"), then its end: _END, or the exception it raised
    _read: asyncio.Queue[object] = field(default_factory=asyncio.Queue, init=False)
    _reader: asyncio.Task[None] | None = field(default=None, init=False)

    def start(self) -> None:
        """Reads the stream from now on (else from the first ``next_output``)."""
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_stream())

    async def next_output(self, within: float | None = None) -> RequestOutput | None:
        """The stream's next output; None when it has not come within ``within`` seconds (still awaited, by the
        next call: the stream is never interrupted). Raises RuntimeError where the stream ends unfinished."""
        self.start()
        try:
            async with asyncio.timeout(within):
                item = await self._read.get()
        except TimeoutError:
            return None
        if item is _END:  # (a 500, never a silent end)
            raise RuntimeError("the output stream ended before the request finished")
        if isinstance(item, BaseException):
            raise item
        return cast(RequestOutput, item)

    async def _read_stream(self) -> None:
        try:
            async for out in self.stream:
                self._read.put_nowait(out)
        except BaseException as e:  # raised to the reader, in order (a CancelledError of the stream's own too)
            self._read.put_nowait(e)
            if not isinstance(e, Exception):
                raise
        else:
            self._read.put_nowait(_END)

    def finished(self, out: RequestOutput) -> None:
        """Counted as finished now, with its work: whatever fails while the answer is sent is not counted again."""
        self.status = RequestStatus.ok
        self.metrics.request_finished(out, ttft_s=self.tracker.ttft(), tpot_s=self.tracker.tpot())

    def ended(self, status: RequestStatus) -> None:
        """How an unfinished request ended, counted at ``close``; a finished one is already counted."""
        if self.status != RequestStatus.ok:
            self.status = status

    async def close(self) -> None:
        """Shielded: a response cancelled as its client leaves (cancelled again at every turn of the loop) still
        aborts its stream and counts how it ended."""
        if self.closed:
            return
        self.closed = True
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        try:
            if self._reader is not None:  # cancelled and ended before the stream is closed under it
                self._reader.cancel()
                await asyncio.wait({self._reader})
        finally:
            await self.stream.aclose()
            if self.status != RequestStatus.ok:
                self.metrics.request_unfinished(self.status, self.tracker.latest, ttft_s=self.tracker.ttft())


@dataclass
class _Choice:
    """One of a request's ``n`` answers: its stream's outcome, its format (its index, logprob offsets) and where
    its client's stream resumes (one choice only)."""

    outcome: _Outcome
    fmt: _Format
    cursor: StreamCursor
    # its prompt's logprobs (echo), from an output that sent nothing (its text held back): for the next chunk sent
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class _Answer:
    """A choice's outputs so far, joined (a non-streamed answer)."""

    logprobs: list[TokenLogprob] | None  # (None: not asked for)
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    prompt: list[TokenLogprob] | None = None
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.ids += out.token_ids
        if self.logprobs is not None and out.logprobs is not None:
            self.logprobs += out.logprobs
        self.prompt = out.prompt_logprobs if self.prompt is None else self.prompt
        self.last = out

    @property
    def finished(self) -> RequestOutput:
        """Its last output, once the choice has finished."""
        return cast(RequestOutput, self.last)


def _usage(lasts: list[RequestOutput], n: int) -> Usage:
    """The usage of a request's choices from their last outputs, in index order: each prompt counted once (choices
    p * n to p * n + n - 1 share prompt p)."""
    return usage_for(*lasts, prompt_tokens=sum(out.num_prompt_tokens for out in lasts[::n]))


async def _close_all(choices: Sequence[_Choice]) -> None:
    """Every choice closed, together: a cancel of the caller (a client that left) cuts none of them short."""
    await asyncio.shield(asyncio.gather(*(c.outcome.close() for c in choices)))


class _Merged:
    """The outputs of a request's choices as they come, each choice's in order (one choice: its own wait, without
    a task per output)."""

    def __init__(self, choices: Sequence[_Choice]) -> None:
        self.choices = choices
        self.open = set(range(len(choices)))  # choices not finished yet
        self._waits: dict[int, asyncio.Future[RequestOutput | None]] = {}

    async def next_output(self, within: float | None) -> tuple[int, RequestOutput] | None:
        """(choice, its next output); None when none came within ``within`` seconds."""
        if len(self.choices) == 1:
            i, out = 0, await self.choices[0].outcome.next_output(within)
        else:
            for j in self.open - self._waits.keys():
                self._waits[j] = asyncio.ensure_future(self.choices[j].outcome.next_output())
            done, _ = await asyncio.wait(self._waits.values(), timeout=within, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                return None
            i = min(j for j, wait in self._waits.items() if wait in done)
            out = self._waits.pop(i).result()
        if out is None:
            return None
        if out.finished:
            self.open.discard(i)
        return i, out

    def close(self) -> None:
        for wait in self._waits.values():
            wait.cancel()


class _ClosingStreamingResponse(StreamingResponse):
    """Runs ``on_close`` however the response ends: also when the client left before the body was iterated."""

    def __init__(
        self, content: AsyncIterator[str], *, on_close: Callable[[], Awaitable[None]], media_type: str
    ) -> None:
        super().__init__(content, media_type=media_type, headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


_T = TypeVar("_T")
MAX_TOKENIZING = 2  # /tokenize and /detokenize calls on threads at once (more wait on the event loop)


class _Routes:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._encoding = 0  # requests past the capacity check whose prompts are being tokenised
        self._tokenizing = asyncio.Semaphore(MAX_TOKENIZING)  # (a flood of them leaves the executor to generation)

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """A prompt's token ids as a completion request's are made, or a chat's as a chat request's, and the
        context length: a client counts its tokens before it sends a request (vLLM's)."""
        self._check_model(body.model)
        encoder = self.backend.encoder
        if encoder.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer", param="messages" if body.messages else "prompt")

        def encode() -> TokenizeResponse:
            if body.messages is not None:
                ids = encoder.chat(
                    [m.for_template() for m in body.messages],
                    generation_prompt=body.add_generation_prompt,
                    continue_final=body.continue_final_message,
                    tools=offered_tools(body.tools),
                )
            else:
                ids = encoder.text(cast(str, body.prompt), special=body.add_special_tokens is not False)
            return TokenizeResponse(
                count=len(ids),
                max_model_len=self.backend.max_model_len,
                tokens=ids,
                token_strs=encoder.pieces(ids) if body.return_token_strs else None,
            )

        return await self._on_thread(encode)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        return await self._on_thread(lambda: DetokenizeResponse(prompt=self.backend.encoder.decode(body.tokens)))

    async def _on_thread(self, work: Callable[[], _T]) -> _T:
        """``work`` on the executor, at most MAX_TOKENIZING at once, each holding its place until its thread ends
        (not until a caller that left stops waiting)."""
        await self._tokenizing.acquire()
        try:
            future = asyncio.get_running_loop().run_in_executor(None, work)
        except BaseException:
            self._tokenizing.release()
            raise

        def done(f: asyncio.Future[_T]) -> None:
            self._tokenizing.release()
            if not f.cancelled():
                f.exception()  # retrieved, where the caller left: not logged as never retrieved

        future.add_done_callback(done)
        return await asyncio.shield(future)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_name:
            raise ModelNotFoundError(
                f"the model {model[:40]!r} does not exist; this server serves {self.backend.model_name!r}",
                param="model",
            )

    async def completions(
        self, body: CompletionRequest, http: HTTPRequest, last_event_id: LastEventID = None
    ) -> Response:
        tracker = _Tracker()
        encoder = self.backend.encoder

        def encode(room: int | None) -> list[list[int]]:
            return _each_prompt(
                body.prompts, lambda p: encoder.text(p, room=room) if isinstance(p, str) else encoder.token_ids(p)
            )

        limit = _TokenLimit(body.max_tokens, "max_tokens", "prompt")
        fmt = _CompletionFormat(self._model(), encoder)
        return await self._generate(body, encode, limit, fmt, tracker, http.receive, last_event_id)

    async def chat_completions(
        self, body: ChatCompletionRequest, http: HTTPRequest, last_event_id: LastEventID = None
    ) -> Response:
        tracker = _Tracker()
        encoder = self.backend.encoder

        def encode(room: int | None) -> list[list[int]]:
            messages = [m.for_template() for m in body.messages]
            options = {"generation_prompt": body.add_generation_prompt, "continue_final": body.continue_final_message}
            return [encoder.chat(messages, room=room, tools=offered_tools(body.tools), **options)]

        limit = _TokenLimit(body.token_limit, body.token_limit_param, "messages")
        named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        fmt = _ChatFormat(self._model(), encoder, body.tool_mode, named)
        # a stream of tool_choice 'required' sends its calls whole in its last event, read from all its text
        resumable = body.tool_mode != ToolMode.required
        return await self._generate(body, encode, limit, fmt, tracker, http.receive, last_event_id, resumable)

    async def models(self) -> ModelList:
        return ModelList(data=[self._card()])

    async def model(self, model: str) -> ModelCard:
        if model != self.backend.model_name:
            raise ModelNotFoundError(
                f"the model {model[:40]!r} does not exist; this server serves {self.backend.model_name!r}",
                param="model",
            )
        return self._card()

    def _card(self) -> ModelCard:
        return ModelCard(id=self.backend.model_name, max_model_len=self.backend.max_model_len)

    async def health(self) -> JSONResponse:
        health = self.backend.health()
        status = HTTPStatus.SERVICE_UNAVAILABLE if health.status == HealthStatus.failing else HTTPStatus.OK
        return JSONResponse(health.model_dump(mode="json"), status_code=status)

    async def metrics(self) -> Response:
        return PlainTextResponse(self.backend.metrics.render(), media_type=PROMETHEUS_MEDIA_TYPE)

    async def debug(self) -> JSONResponse:
        return JSONResponse((await self.backend.debug_state()).model_dump(mode="json"))

    def _model(self) -> str:
        return self.backend.model_name

    async def _generate(
        self,
        body: GenerationRequest,
        encode: Callable[
            [int | None], list[list[int]]
        ],  # each prompt's ids, given the most tokens one may have (None: any)
        limit: _TokenLimit,
        fmt: _Format,
        tracker: _Tracker,
        receive: Receive,
        last_event_id: str | None = None,
        resumable: bool = True,
    ) -> Response:
        metrics = self.backend.metrics
        try:
            resume = _resume_mark(body, last_event_id)
            if resume is not None and not resumable:
                raise InvalidRequestError(
                    "a stream of tool_choice 'required' sends its calls whole in its last event: it cannot be "
                    "resumed (send the request again, or without stream)",
                    param=RESUME_PARAM,
                )
            if resume == StreamMark() and not fmt.opens:
                raise ResumeMismatchError(
                    f"{RESUME_PARAM} {resume.render()} is no event of this stream: it has no opening event",
                    param=RESUME_PARAM,
                )
            self._check_model(body.model)
            if body.scores_prompt and not body.echoes:
                raise APIError("max_tokens 0 generates nothing: it only scores a prompt, with echo", param="max_tokens")
            context = self.backend.max_model_len
            places = body.n * body.prompt_count  # each prompt's n choices
            if places > 1 and places > self.backend.most_capacity:  # (a 429 would never clear)
                raise APIError(
                    f"{places} choices (n x prompts) are more than this server runs or queues at once "
                    f"({self.backend.most_capacity} requests; each choice is one)",
                    param="n" if body.prompt_count == 1 else "prompt",
                )
            keep = _kept_prompt_tokens(body.truncate_prompt_tokens, context)
            # a 429 before the prompts' tokenisation is paid for (each choice takes a place)
            self.backend.check_capacity(pending=self._encoding + places - 1)
            room = limit.room(context)
            try:  # (no text is refused before it is tokenised where truncation leaves what fits)
                refuse_past = room if keep is None or keep > room else None
                prompts = await asyncio.shield(self._tokenise(encode, refuse_past, places))
            except PromptTooLongError as e:  # refused before it was tokenised: named as a tokenised one would be
                limit.check(e.fewest if keep is None else min(e.fewest, keep), context, at_least=True, item=e.item)
                raise
            cut = [keep is not None and len(ids) > keep for ids in prompts]
            prompts = [ids[-keep:] if keep is not None else ids for ids in prompts]
            batch = len(prompts) > 1
            limits = [limit.check(len(ids), context, item=p if batch else None) for p, ids in enumerate(prompts)]
            limit.check_min(body.min_tokens, min(limits))
            max_tokens = limits[0]
            if resume is not None and resume.tokens > max_tokens:  # known now: no need to regenerate to find out
                raise ResumeMismatchError(
                    f"{RESUME_PARAM} is after output token {resume.tokens}, past this request's limit of "
                    f"{max_tokens} tokens: not an event of its stream",
                    param=RESUME_PARAM,
                )
            if body.scores_prompt:  # (one token is generated, and dropped: the prompt's logprobs come with it)
                limits, max_tokens = [1] * len(limits), 1
            params = sampling_params_for(body, max_tokens=max_tokens)
            self.backend.encoder.check_token_ids(params)
            fmt.seed = params.seed
            spec = speculation_for(body.speculation, self.backend.default_speculation)
            if resume is not None and not params.greedy:
                _check_resumable(spec or self.backend.default_speculation)
            requests = [  # choice p * n + i: prompt p's i-th
                Request(
                    fmt.request_id if places == 1 else f"{fmt.request_id}-{p * body.n + i}",
                    ids,
                    _choice_params(params, p * body.n + i, limits[p]),
                    spec,
                    cache_salt=body.cache_salt,
                )
                for p, ids in enumerate(prompts)
                for i in range(body.n)
            ]
            streams = await self._submit(requests)
            if body.scores_prompt:
                streams = [_PromptScored(s) for s in streams]
        except InvalidRequestError:
            metrics.request_done(RequestStatus.invalid)
            raise
        except APIError as e:
            metrics.request_done(_status_of(e))
            raise
        except asyncio.CancelledError:  # the client went away before the request was admitted
            metrics.request_done(RequestStatus.aborted)
            raise
        except Exception:  # a 500 (internal_error): counted here, where it is known to be a generation request
            metrics.request_done(RequestStatus.failed)
            raise
        choices = [
            _Choice(_Outcome(s, metrics, replace(tracker)), fmt.for_choice(k), StreamCursor(resume))
            for k, s in enumerate(streams)
        ]
        if body.return_token_ids:
            for k, c in enumerate(choices):
                c.fmt.prompt_ids = prompts[k // body.n]
        if body.echoes:  # each choice starts with its prompt: the text as sent, a prompt of ids (or cut) decoded
            sent = cast(CompletionRequest, body).prompts
            for k, c in enumerate(choices):
                text, ids = sent[k // body.n], prompts[k // body.n]
                whole = isinstance(text, str) and not cut[k // body.n]
                c.fmt.echo(cast(str, text) if whole else self.backend.encoder.text_of(ids), ids)
        if body.stream:
            events = self._events(choices, body)
            return _ClosingStreamingResponse(events, on_close=partial(_close_all, choices), media_type=SSE_MEDIA_TYPE)
        return await self._collect(choices, body, receive)

    async def _submit(self, requests: list[Request]) -> list[OutputStream]:
        """Every choice's stream, or none: one the backend refuses aborts those submitted before it."""
        streams: list[OutputStream] = []
        try:
            for request in requests:
                streams.append(await self.backend.submit(request))
        except BaseException:
            await asyncio.shield(asyncio.gather(*(stream.aclose() for stream in streams)))
            raise
        return streams

    def _tokenise(
        self, encode: Callable[[int | None], list[list[int]]], room: int | None, places: int
    ) -> asyncio.Future[list[list[int]]]:
        """``encode(room)`` on a thread, off the event loop. Until it ends it holds ``places`` (its request's
        choices) against the capacity (a flood of prompts being tokenised would fill it): given back when the
        thread's work ends, not when a caller that left stops waiting (the thread works on)."""
        work = asyncio.get_running_loop().run_in_executor(None, encode, room)
        self._encoding += places

        def done(f: asyncio.Future[list[list[int]]]) -> None:
            self._encoding -= places
            if not f.cancelled():
                f.exception()  # retrieved, where the caller left: not logged as never retrieved

        work.add_done_callback(done)
        return work

    async def _collect(self, choices: list[_Choice], body: GenerationRequest, receive: Receive) -> Response:
        """The whole answer, or, where the client leaves first, the request aborted (a streaming response listens
        for the disconnect itself; this one would otherwise generate to the end for nobody)."""
        answer = asyncio.ensure_future(self._answer(choices, body))
        left = asyncio.ensure_future(_client_left(receive))
        try:
            await asyncio.wait({answer, left}, return_when=asyncio.FIRST_COMPLETED)
            if answer.done():
                return answer.result()
            answer.cancel()
            await asyncio.wait({answer})  # (not ``await answer``: its CancelledError would hide one of this task's own)
            if not answer.cancelled():
                answer.exception()  # an error it ended with meanwhile, retrieved: nobody reads it
            return Response(status_code=HTTPStatus.NO_CONTENT)  # nobody reads it
        finally:
            for task in (answer, left):
                task.cancel()
            await _close_all(choices)

    async def _answer(self, choices: list[_Choice], body: GenerationRequest) -> Response:
        merged = _Merged(choices)  # (every choice read as its outputs come: its latency and errors seen then)
        answers = [_Answer(None if body.logprob_count is None else []) for _ in choices]
        try:
            while merged.open:
                i, out = cast(tuple[int, RequestOutput], await merged.next_output(within=None))
                choices[i].outcome.tracker.see(out)
                answers[i].add(out)
                if out.finished:
                    choices[i].outcome.finished(out)
            responses = [
                c.fmt.response(a, with_ids=body.return_token_ids) for c, a in zip(choices, answers, strict=True)
            ]
            response = responses[0]
            if len(responses) > 1:
                every = [choice for r in responses for choice in cast(Any, r).choices]
                usage = _usage([a.finished for a in answers], body.n)
                response = response.model_copy(update={"choices": every, "usage": usage})
            return JSONResponse(response.model_dump(mode="json"))
        except APIError as e:  # its status, counted as a stream's is
            for c in choices:
                c.outcome.ended(_status_of(e))
            raise
        except Exception as e:  # a 500, answered here: raised, the ASGI server would log it again, without the id
            log.exception("request %s failed", choices[0].fmt.request_id)  # (the id the lanes' lines carry)
            for c in choices:
                c.outcome.ended(RequestStatus.failed)
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, internal_error_body(e))
        finally:
            merged.close()

    async def _events(self, choices: list[_Choice], body: GenerationRequest) -> AsyncIterator[str]:
        """SSE events; those of a request with one choice each with an id a client can resume after
        (``specserve.api.resume``): a resumed stream regenerates the request and sends only what follows the
        client's last id. Several choices' events come as their outputs do, and carry no ids."""
        marked = len(choices) == 1
        # OpenAI's chunks carry "usage": null only with stream_options.include_usage (the last one then has it)
        without = frozenset() if body.include_usage_in_stream else frozenset({"usage"})
        per_token = body.return_token_ids or body.logprob_count is not None  # (tokens without text yet too)
        every_usage = body.usage_in_every_chunk
        merged = _Merged(choices)
        last: dict[int, RequestOutput] = {}  # each choice's last output
        try:
            for c in choices:
                c.outcome.start()
                first = c.fmt.first_chunk()
                if first is not None and not c.cursor.resuming:
                    yield _sse(first, c.cursor.mark if marked else None, without=without)
                if c.cursor.resuming:  # (its first event sent the prompt, and its ids)
                    c.fmt.skip_echo()
                    c.fmt.prompt_ids = None
            sent_at = time.monotonic()
            while merged.open:
                # nothing may be sent for long: while it replays, never more than a second
                checked = all(c.cursor.checked for c in choices)
                every = SSE_KEEPALIVE_S if checked else REPLAY_KEEPALIVE_S
                got = await merged.next_output(within=max(0.0, sent_at + every - time.monotonic()))
                if got is None:
                    yield SSE_KEEPALIVE if checked else SSE_REPLAYING
                    sent_at = time.monotonic()
                    continue
                c, out = choices[got[0]], got[1]
                part = c.cursor.advance(out)  # None: delivered before the resume point
                c.prompt_logprobs = out.prompt_logprobs or c.prompt_logprobs
                c.fmt.skip(c.cursor.passed_over(out, part))  # (text offsets count them too)
                if out.finished:
                    c.cursor.check_reached()  # before the finish event: a resume point past the end gets the error only
                shown = part is not None and bool(part.text or (per_token and part.token_ids) or part.finished)
                c.outcome.tracker.see(out, 0 if part is None else len(part.token_ids), shown=shown)
                event = None
                if shown and part is not None:
                    if c.prompt_logprobs is not None:
                        part, c.prompt_logprobs = replace(part, prompt_logprobs=c.prompt_logprobs), None
                    mark = c.cursor.mark.at(StreamPhase.finished) if part.finished else c.cursor.mark
                    chunk = c.fmt.chunk(part, with_ids=body.return_token_ids)
                    if every_usage:  # (its choice's so far: vLLM's continuous_usage_stats)
                        chunk = chunk.model_copy(update={"usage": usage_for(out)})
                    event = _sse(chunk, mark if marked else None, without=without)
                if out.finished:  # counted before its last chunk is sent: a client leaving during that send left a
                    c.outcome.finished(out)  # finished answer (it was counted aborted)
                    last[got[0]] = out
                if event is not None:
                    yield event
                    sent_at = time.monotonic()
            cursor = choices[0].cursor
            if body.include_usage_in_stream and not cursor.sent(StreamPhase.usage):
                usage = choices[0].fmt.usage_chunk(_usage([last[k] for k in sorted(last)], body.n))
                yield _sse(usage, cursor.mark.at(StreamPhase.usage) if marked else None)
            yield SSE_DONE
        except APIError as e:  # the status line is gone: report in the stream, as OpenAI does
            for c in choices:
                c.outcome.ended(_status_of(e))
            yield _sse(e.body())
        except Exception as e:  # a 500's body, in the stream: raised, it would only cut the connection
            log.exception("request %s failed mid-stream", choices[0].fmt.request_id)
            for c in choices:
                c.outcome.ended(RequestStatus.failed)
            yield _sse(internal_error_body(e))
        finally:
            merged.close()
            await _close_all(choices)


@dataclass(frozen=True)
class _TokenLimit:
    """A request's max_tokens (None: up to the context) and the parameters that name it and its prompt."""

    max_tokens: int | None
    max_tokens_param: str
    prompt_param: str

    def room(self, context: int) -> int:
        """The most tokens the prompt may have (at least one: a max_tokens with no room is refused by ``check``)."""
        return max(1, context - (1 if self.max_tokens is None else self.max_tokens))

    def check(self, prompt_tokens: int, context: int, *, at_least: bool = False, item: int | None = None) -> int:
        """The max_tokens to generate; a 400 context_length_exceeded when the prompt or prompt + max_tokens does
        not fit (OpenAI's behaviour: never silently clamped). ``at_least``: the prompt was not tokenised, and has at
        least ``prompt_tokens``; ``item``: its index in a batch of prompts, which the message names."""
        some = "at least " if at_least else ""
        prompt = self.prompt_param if item is None else f"{self.prompt_param} at index {item} of the batch"
        if prompt_tokens >= context:
            raise ContextLengthError(
                f"This model's maximum context length is {context} tokens. However, your {prompt} "
                f"resulted in {some}{prompt_tokens} tokens, which leaves no room to generate. Please reduce the length "
                f"of the {prompt}.",
                param=self.prompt_param,
            )
        if self.max_tokens is None:
            return context - prompt_tokens
        if prompt_tokens + self.max_tokens > context:
            raise ContextLengthError(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{some}{prompt_tokens + self.max_tokens} tokens ({some}{prompt_tokens} in the {prompt}, "
                f"{self.max_tokens} in the completion). Please reduce the length of the {prompt} "
                f"or {self.max_tokens_param}.",
                param=self.max_tokens_param,
            )
        return self.max_tokens

    def check_min(self, min_tokens: int, max_tokens: int) -> None:
        """A 400 where min_tokens is more than may be generated, named as the client set that limit."""
        if min_tokens > max_tokens:
            most = self.max_tokens_param if self.max_tokens is not None else "the room the context leaves the answer"
            raise APIError(f"min_tokens ({min_tokens}) must be at most {most} ({max_tokens})", param="min_tokens")


def _kept_prompt_tokens(truncate: int | None, context: int) -> int | None:
    """How many of a prompt's last tokens it keeps (vLLM's truncate_prompt_tokens; at most the context; None: all,
    and one past the context is refused)."""
    if truncate is None:
        return None
    if truncate == -1:
        return context
    if truncate > context:
        raise APIError(
            f"truncate_prompt_tokens ({truncate}) is more than this model's context length ({context})",
            param="truncate_prompt_tokens",
        )
    return truncate


def _each_prompt(prompts: Sequence[str | list[int]], encode: Callable[[str | list[int]], list[int]]) -> list[list[int]]:
    """Each prompt's ids; in a batch, an error names the prompt it is about by its index."""
    if len(prompts) == 1:
        return [encode(prompts[0])]
    ids = []
    for k, prompt in enumerate(prompts):
        try:
            ids.append(encode(prompt))
        except PromptTooLongError as e:  # (named by _TokenLimit.check, from its fewest tokens)
            raise PromptTooLongError(str(e), param="prompt", fewest=e.fewest, item=k) from e
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{e} (the prompt at index {k} of the batch)", param=e.param) from e
    return ids


def _status_of(error: APIError) -> RequestStatus:
    if isinstance(error, OverloadedError):
        return RequestStatus.rejected
    return RequestStatus.failed if error.status >= HTTPStatus.INTERNAL_SERVER_ERROR else RequestStatus.invalid


def _sse(obj: BaseModel, mark: StreamMark | None = None, *, without: frozenset[str] = frozenset()) -> str:
    event_id = "" if mark is None else f"id: {mark.render()}\n"
    return f"{event_id}data: {obj.model_dump_json(exclude=set(without)).translate(_LINE_SEPARATORS)}\n\n"


LastEventID = Annotated[
    str | None,
    Header(alias="Last-Event-ID", description="resume a stream after this event id (as the resume_from field)"),
]


def _resume_mark(body: GenerationRequest, last_event_id: str | None) -> StreamMark | None:
    """Where a resumed stream continues (None: a new stream). The request must be the one that was cut: for a
    sampled request that includes the seed the server returned. A ``Last-Event-ID`` header means a resume only on
    a stream, and a blank one none (a client or proxy that forwards what it remembered onto another request);
    ``resume_from`` in the body always does."""
    header = last_event_id.strip() if last_event_id is not None and body.stream else ""
    value = body.resume_from if body.resume_from is not None else header or None
    if value is None:
        return None
    if not body.stream:
        raise APIError(f"{RESUME_PARAM} is only allowed when stream is true", param=RESUME_PARAM)
    if body.temperature > 0 and body.seed is None:
        raise APIError(
            "resuming a sampled stream needs the seed it drew with (the `seed` field of its chunks)", param="seed"
        )
    if body.n * body.prompt_count > 1:
        raise APIError(
            f"{RESUME_PARAM} needs one choice (n=1, one prompt): the events of several choices carry no ids",
            param=RESUME_PARAM,
        )
    return StreamMark.parse(value)


def _choice_params(params: SamplingParams, index: int, max_tokens: int) -> SamplingParams:
    """The response's choice ``index`` (prompt p's i-th is p * n + i): a sampled request's seed plus the index,
    within the 64-bit signed range (a batch's prompts drew with one seed, so a prompt sent k times for k samples got
    one answer k times); ``max_tokens``, its prompt's (where the request left it to the context, each prompt has its
    own)."""
    update: dict[str, object] = {}
    if params.seed is not None and index:
        update["seed"] = (params.seed + index + 2**63) % 2**64 - 2**63
    if max_tokens != params.max_tokens:
        update["max_tokens"] = max_tokens
    return params.model_copy(update=update) if update else params


def _check_resumable(spec: SpecConfig) -> None:
    if spec.batch_dependent_draws:
        raise APIError(
            "this server drafts sampled chains (speculation.chain_draft: sampled), whose sampled output depends on "
            "the requests beside it, so it cannot regenerate a sampled stream to resume it; resend without "
            f"{RESUME_PARAM} (a request sent with speculation {{enabled: false}} can be resumed)",
            param=RESUME_PARAM,
        )


def _finish(reason: FinishReason | None) -> FinishReasonOut | None:
    if reason is None or reason == FinishReason.abort:
        return None
    return FinishReasonOut(reason.value)


# -- response shapes ----------------------------------------------------------------------------------


class _Format(Protocol):
    request_id: str
    seed: int | None
    prompt_ids: list[int] | None
    opens: bool  # its streams start with an event of no output (whose id is 0-0-00000000)

    def first_chunk(self) -> BaseModel | None: ...

    def chunk(self, out: RequestOutput, *, with_ids: bool) -> BaseModel: ...

    def skip(self, token_ids: list[int]) -> None: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, answer: _Answer, *, with_ids: bool) -> BaseModel: ...

    def echo(self, text: str, token_ids: list[int]) -> None: ...

    def skip_echo(self) -> None: ...

    def for_choice(self, index: int) -> Self: ...


_Entries = list[tuple[int, TokenLogprob | None]]  # (token id, its logprobs; None: the prompt's first token)


def _id_text(token_id: int) -> str:
    return f"token_id:{token_id}"  # (vLLM's form for a token shown by its id)


class _Stamped:
    """What every chunk and response of one request carries: its id, one created time (as OpenAI's, the same on
    every chunk of a stream), the model and the seed drawn with; ``encoder``: a token's text and bytes in logprobs
    (without one: ``token_id:N``)."""

    prefix = ""

    def __init__(self, model: str, encoder: PromptEncoder | None = None) -> None:
        self.request_id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.seed: int | None = None
        self.created = int(time.time())
        self.token_text: Callable[[int], str] = _id_text if encoder is None else encoder.token_text
        self.token_bytes: Callable[[int], bytes] = (
            (lambda t: _id_text(t).encode()) if encoder is None else encoder.token_bytes
        )

        self.index = 0  # the choice its chunks and response are of
        self.prompt_ids: list[int] | None = None  # with return_token_ids: its prompt's, in its first chunk

    def stamp(self) -> dict[str, Any]:
        return {"id": self.request_id, "created": self.created, "model": self.model, "seed": self.seed}

    def for_choice(self, index: int) -> Self:
        """This request's format for its choice ``index``: its own offsets and echo, the same id, time and seed."""
        other = copy.copy(self)
        other.index = index
        return other

    def skip(self, token_ids: list[int]) -> None:
        """Tokens a resumed stream does not send again (their texts still count in the offsets after them)."""

    def echo(self, text: str, token_ids: list[int]) -> None:
        raise AssertionError(f"{type(self).__name__} has no echo")  # (completions' alone: the schema says so)

    def skip_echo(self) -> None:
        """A resumed stream: the prompt went out with its first event."""


class _CompletionFormat(_Stamped):
    prefix = "cmpl"
    opens = False

    def __init__(self, model: str, encoder: PromptEncoder | None = None) -> None:
        super().__init__(model, encoder)
        self.text_offset = 0  # where the next token's text starts, over the tokens' own texts (as vLLM counts)
        self.echoed: tuple[str, list[int]] | None = None  # the prompt's text and ids, with echo

    def echo(self, text: str, token_ids: list[int]) -> None:
        self.echoed = text, token_ids

    def skip_echo(self) -> None:
        if self.echoed is not None:
            self.skip(self.echoed[1])  # (their texts count in the offsets after them)
            self.echoed = None

    def _with_echo(
        self, text: str, entries: _Entries | None, prompt: list[TokenLogprob] | None
    ) -> tuple[str, _Entries | None]:
        """The prompt first, once: its text, and its tokens' logprobs (the first has none)."""
        if self.echoed is None:
            return text, entries
        (prompt_text, prompt_ids), self.echoed = self.echoed, None
        if entries is not None and prompt_ids:
            entries = [(prompt_ids[0], None), *((lp.token, lp) for lp in prompt or []), *entries]
        return prompt_text + text, entries

    def first_chunk(self) -> BaseModel | None:
        return None

    def skip(self, token_ids: list[int]) -> None:
        self.text_offset += sum(len(self.token_text(t)) for t in token_ids)

    def _logprobs(self, entries: Sequence[tuple[int, TokenLogprob | None]] | None) -> CompletionLogprobs | None:
        """OpenAI's legacy shape from (token id, its logprobs) pairs: the likeliest tokens' (as many as asked for)
        and the token's own, as vLLM's (None: a token without them, the prompt's first)."""
        if entries is None:
            return None
        tokens = [self.token_text(t) for t, _ in entries]
        offsets: list[int] = []
        top: list[dict[str, float] | None] = []
        for token, (_, lp) in zip(tokens, entries, strict=True):
            offsets.append(self.text_offset)
            self.text_offset += len(token)
            top.append(None if lp is None else {self.token_text(t): v for t, v in lp.top} | {token: lp.logprob})
        token_logprobs = [None if lp is None else lp.logprob for _, lp in entries]
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)

    def chunk(self, out: RequestOutput, *, with_ids: bool) -> BaseModel:
        entries: _Entries | None = None if out.logprobs is None else [(lp.token, lp) for lp in out.logprobs]
        text, entries = self._with_echo(out.text, entries, out.prompt_logprobs)  # (the first chunk, with echo)
        choice = CompletionChoice(
            index=self.index,
            text=text,
            finish_reason=_finish(out.finish_reason),
            stop_reason=out.stop_reason,
            logprobs=self._logprobs(entries),
            token_ids=out.token_ids if with_ids else None,
            prompt_token_ids=self.prompt_ids,
        )
        self.prompt_ids = None  # (the first chunk's alone)
        return CompletionChunk(**self.stamp(), choices=[choice])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionChunk(**self.stamp(), choices=[], usage=usage)

    def response(self, answer: _Answer, *, with_ids: bool) -> BaseModel:
        lps = answer.logprobs
        entries: _Entries | None = None if lps is None else [(lp.token, lp) for lp in lps]
        text, entries = self._with_echo("".join(answer.text), entries, answer.prompt)
        last = answer.finished
        choice = CompletionChoice(
            index=self.index,
            text=text,
            finish_reason=_finish(last.finish_reason),
            stop_reason=last.stop_reason,
            logprobs=self._logprobs(entries),
            token_ids=answer.ids if with_ids else None,
            prompt_token_ids=self.prompt_ids,
        )
        return CompletionResponse(**self.stamp(), choices=[choice], usage=usage_for(last))


class _ChatFormat(_Stamped):
    """``calling``: how the answer calls tools (None: it is text); ``named``, the function tool_choice names: its
    call's id, type and name go in the first chunk, its arguments' text in the next ones; 'required''s calls
    come whole in the last chunk (their list is read once it is complete)."""

    prefix = "chatcmpl"
    opens = True

    def __init__(
        self,
        model: str,
        encoder: PromptEncoder | None = None,
        calling: ToolMode | None = None,
        named: str | None = None,
    ) -> None:
        super().__init__(model, encoder)
        self.calling = calling
        self.named = named
        self.answer: list[str] = []  # a 'required' stream's texts so far

    def for_choice(self, index: int) -> Self:
        other = super().for_choice(index)
        other.answer = []  # (its own: a copy would share the list)
        return other

    def first_chunk(self) -> BaseModel | None:
        if self.calling == ToolMode.named:
            call = tools.call_deltas([tools.named_call(cast(str, self.named), "")])
            delta = ChatDelta(role="assistant", tool_calls=call)
        elif self.calling == ToolMode.required:  # calls, or (cut) text, come whole at the end
            delta = ChatDelta(role="assistant")
        else:
            delta = ChatDelta(role="assistant", content="")
        choice = ChatChunkChoice(index=self.index, delta=delta)
        return ChatCompletionChunk(**self.stamp(), choices=[choice], prompt_token_ids=self.prompt_ids)

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=self.token_text(token_id), logprob=logprob, bytes=list(self.token_bytes(token_id)))

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None
        content = [
            ChatTokenLogprob(
                **self._entry(lp.token, lp.logprob).model_dump(), top_logprobs=[self._entry(i, v) for i, v in lp.top]
            )
            for lp in logprobs
        ]
        return ChatLogprobs(content=content)

    def chunk(self, out: RequestOutput, *, with_ids: bool) -> BaseModel:
        delta, finish = ChatDelta(content=out.text or None), _finish(out.finish_reason)
        if self.calling == ToolMode.named and out.text:
            delta = ChatDelta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=out.text))])
        elif self.calling == ToolMode.required:
            self.answer.append(out.text)
            delta = ChatDelta()
            if out.finished:
                answer = "".join(self.answer)
                calls = tools.required_calls(answer)
                if calls is None:  # (cut before its list closed: the text)
                    delta = ChatDelta(content=answer)
                else:
                    delta, finish = ChatDelta(tool_calls=tools.call_deltas(calls)), FinishReasonOut.tool_calls
        choice = ChatChunkChoice(
            index=self.index,
            delta=delta,
            finish_reason=finish,
            stop_reason=out.stop_reason,
            logprobs=self._logprobs(out.logprobs),
            token_ids=out.token_ids if with_ids else None,
        )
        return ChatCompletionChunk(**self.stamp(), choices=[choice])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(**self.stamp(), choices=[], usage=usage)

    def response(self, answer: _Answer, *, with_ids: bool) -> BaseModel:
        last = answer.finished
        text, finish = "".join(answer.text), _finish(last.finish_reason)
        message = AssistantMessage(content=text)
        if self.calling == ToolMode.named:
            message = AssistantMessage(content=None, tool_calls=[tools.named_call(cast(str, self.named), text)])
        elif self.calling == ToolMode.required and (calls := tools.required_calls(text)) is not None:
            message, finish = AssistantMessage(content=None, tool_calls=calls), FinishReasonOut.tool_calls
        choice = ChatChoice(
            index=self.index,
            message=message,
            finish_reason=finish,
            stop_reason=last.stop_reason,
            logprobs=self._logprobs(answer.logprobs),
            token_ids=answer.ids if with_ids else None,
        )
        usage = usage_for(last)
        return ChatCompletionResponse(**self.stamp(), choices=[choice], usage=usage, prompt_token_ids=self.prompt_ids)


# -- errors -------------------------------------------------------------------------------------------


def internal_error_body(exc: Exception) -> ErrorResponse:
    return error_body(f"internal error: {type(exc).__name__}", ErrorType.server, code=ErrorCode.internal_error)


def _install_error_handlers(api: FastAPI, metrics: ServeMetrics) -> None:
    """Bad input of any kind becomes a 4xx with OpenAI's error body; anything else a 500 with the same shape."""

    def counted(request: HTTPRequest) -> None:
        """A generation request refused before its route ran, counted as one (not a /tokenize call)."""
        if getattr(request.scope.get("route"), "path", None) in (COMPLETIONS_PATH, CHAT_PATH):
            metrics.request_done(RequestStatus.invalid)

    async def request_validation(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        counted(request)
        errors = [dict(e) for e in exc.errors()]
        problem = _body_problem(errors, request.headers.get("content-type"))
        if problem is not None:
            body = error_body(problem, ErrorType.invalid_request, code=ErrorCode.invalid_json)
            return _error(HTTPStatus.BAD_REQUEST, body)
        return _error(HTTPStatus.BAD_REQUEST, _validation_body(errors, exc.body))

    async def api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, OverloadedError) else {}
        if exc.retryable is not None:  # the header OpenAI's SDKs follow over their status rule
            headers[SHOULD_RETRY_HEADER] = str(exc.retryable).lower()
        return _error(exc.status, exc.body(), headers)

    async def invalid_request(_: HTTPRequest, exc: InvalidRequestError) -> JSONResponse:
        body = error_body(str(exc), ErrorType.invalid_request, code=ErrorCode.invalid_value, param=exc.param)
        return _error(HTTPStatus.BAD_REQUEST, body)

    async def http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        if status == HTTPStatus.BAD_REQUEST and exc.detail == _FASTAPI_BODY_PARSE_ERROR:  # bytes that are not UTF-8
            counted(request)
            body = error_body(_NOT_JSON, ErrorType.invalid_request, code=ErrorCode.invalid_json)
            return _error(status, body)
        codes = {HTTPStatus.NOT_FOUND: ErrorCode.not_found, HTTPStatus.METHOD_NOT_ALLOWED: ErrorCode.method_not_allowed}
        type_ = ErrorType.not_found if status == HTTPStatus.NOT_FOUND else ErrorType.invalid_request
        if status >= HTTPStatus.INTERNAL_SERVER_ERROR:
            type_ = ErrorType.server
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return _error(status, error_body(message, type_, code=codes.get(status)), dict(exc.headers or {}))

    async def internal_error(_: HTTPRequest, exc: Exception) -> JSONResponse:
        """A 500 on any route; a generation request's has been counted where it failed (``_generate``)."""
        return _error(HTTPStatus.INTERNAL_SERVER_ERROR, internal_error_body(exc))

    api.add_exception_handler(RequestValidationError, request_validation)  # type: ignore[arg-type]
    api.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    api.add_exception_handler(InvalidRequestError, invalid_request)  # type: ignore[arg-type]
    api.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    api.add_exception_handler(Exception, internal_error)


SHOULD_RETRY_HEADER = "x-should-retry"
_NOT_JSON = "the request body is not valid JSON (UTF-8 text)"
_FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"
_NOT_AN_OBJECT = {"model_attributes_type", "dict_type", "model_type"}


def _body_problem(errors: list[dict[str, Any]], content_type: str | None) -> str | None:
    """A message for a body that is not a JSON object at all (rather than an object with bad fields), or None."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return _NOT_JSON
    whole = [e for e in errors if tuple(e.get("loc", ())) == ("body",)]
    if not whole:
        return None
    if whole[0].get("type") == "missing":
        return "the request body is empty: send a JSON object"
    if whole[0].get("type") in _NOT_AN_OBJECT:
        media = (content_type or "").split(";")[0].strip().lower()
        if not (media == "application/json" or media.endswith("+json")):
            sent = media or "none"
            return f"the request body must be a JSON object sent as Content-Type: application/json (got {sent})"
        return "the request body must be a JSON object"
    return None


def _error(status: HTTPStatus, body: BaseModel, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


def _at(body: object, loc: tuple[object, ...]) -> object:
    """The value at an error's location in the request body (union tags skipped), or None where it leads nowhere."""
    node = body
    for part in loc[1:] if loc[:1] == ("body",) else loc:  # (FastAPI's prefix; a metadata key may be "body" too)
        if is_union_member(part) and not (isinstance(node, dict) and part in node):
            continue
        found = (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        )
        if not found:
            return None
        node = node[part]  # type: ignore[index]
    return node


def _validation_body(errors: list[dict[str, Any]], body: object) -> BaseModel:
    """All messages name their full location; ``param`` is the top-level request field of the first error."""

    def where(error: dict[str, Any]) -> list[str]:
        """The location's parts, each quoted up to 40 characters (an unknown or metadata key is one: a 1 MB key came
        back twice, in the message and as ``param``)."""
        loc = tuple(error.get("loc", ()))
        parts = [str(p) for p in (loc[1:] if loc[:1] == ("body",) else loc) if not is_union_member(p)]
        return [part if len(part) <= 40 else f"{part[:40]}..." for part in parts]

    def describe(error: dict[str, Any]) -> str:
        loc, msg = ".".join(where(error)), str(error.get("msg", "invalid value"))
        if error.get("type") == "string_unicode":  # a lone surrogate (\ud800) in a key or in a text pydantic checks
            parts = where(error)  # before _utf8 (stop, a role): a dict's key is at the dict's loc mangled, then
            mangled = parts[-1:] == ["[key]"]  # "[key]"; an unknown key of an object is at the object's loc
            key = mangled or isinstance(_at(body, tuple(error.get("loc", ()))), dict)
            loc = ".".join(parts[:-2] if mangled else parts)
            what = "a key" if key else "the text"
            msg = f"{what} {ascii(error.get('input', ''))[:40]} is not valid Unicode (a lone surrogate)"
        return f"{loc}: {msg}" if loc else msg

    param = where(errors[0])[0] if errors and where(errors[0]) else None
    message = "; ".join(describe(e) for e in errors[:5]) or "invalid request"
    return error_body(message, ErrorType.invalid_request, code=ErrorCode.invalid_value, param=param)


# -- OpenAPI ------------------------------------------------------------------------------------------

_ERROR_DESCRIPTIONS = {
    400: "invalid request: a field's type or value, a prompt beyond the context (context_length_exceeded), or, "
    "without an API key, a Host that is neither an address nor one of allowed_hosts (invalid_host)",
    401: "missing or wrong API key (`Authorization: Bearer <key>`)",
    404: "the model does not exist",
    408: "the request body was not received in time",
    413: "the request body is larger than the server's limit",
    429: "the server is at capacity; retry after the Retry-After header's seconds",
    500: "internal error",
    503: "the lane serving the request lost its workers; retry after the Retry-After header's seconds",
}
_CHUNK_MODELS: tuple[type[BaseModel], ...] = (CompletionChunk, ChatCompletionChunk)
_SCHEMA_REF = "#/components/schemas/{model}"


def _error_responses(options: HTTPOptions, *statuses: int) -> dict[int | str, dict[str, Any]]:
    codes = {401, *statuses} if options.api_key is not None else {400, *statuses}  # (400: a Host not served)
    return {code: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[code]} for code in sorted(codes)}


def _generation_response(response: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    stream = {"schema": {"$ref": _SCHEMA_REF.format(model=chunk.__name__)}}
    return {
        "model": response,
        "description": f"a {response.__name__}, or with `stream: true` server-sent events: one {chunk.__name__} "
        "per `data:` line, then `data: [DONE]`",
        "content": {SSE_MEDIA_TYPE: stream},
    }


def _openapi(api: FastAPI, options: HTTPOptions) -> dict[str, Any]:
    """FastAPI's document from the request models, without the 422 it assumes: validation errors here are 400s
    with OpenAI's error body, documented on each route."""
    if api.openapi_schema is not None:
        return api.openapi_schema
    doc = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
    for item in doc["paths"].values():
        for operation in item.values():
            operation.get("responses", {}).pop("422", None)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _, extra = models_json_schema([(m, "serialization") for m in _CHUNK_MODELS], ref_template=_SCHEMA_REF)
    for name, schema in extra.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    if options.api_key is not None:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        for path in ("/health",):
            for operation in doc["paths"].get(path, {}).values():
                operation["security"] = []
    api.openapi_schema = doc
    return doc


async def _client_left(receive: Receive) -> None:
    """Returns once the client disconnects (the body was read before the route ran: ``receive`` waits for that)."""
    message = await receive()
    while message["type"] != "http.disconnect":
        message = await receive()
