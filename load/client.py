"""Pure helpers shared by the Locust users and the HTTP sweep: OpenAI SSE parsing, per-request latency
statistics, the users' settings and the loopback guard. Nothing here imports Locust (it monkey-patches the
process with gevent on import)."""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.api.http_guard import API_KEY_ENV, MAX_TIMEOUT_S
from specserve.api.schemas import MAX_TEMPERATURE
from specserve.bench.prompt_sets import BenchPrompt, mt_bench_prompts
from specserve.bench.stats import tpot
from specserve.config import SLPolicyKind

ALLOW_REMOTE_ENV = "SPECSERVE_ALLOW_REMOTE"
DONE_SENTINEL = "[DONE]"
_SSE_BREAK = re.compile(rb"\r\n|\r|\n")


class EventKind(str, Enum):
    content = "content"  # a chunk with choices[0].delta.content (or .text for completions)
    usage = "usage"  # the last chunk with stream_options.include_usage
    done = "done"  # data: [DONE]
    error = "error"  # an error body sent in-stream after the status line
    other = "other"  # role-only first chunk, finish_reason-only chunk, comments, keep-alives


@dataclass(frozen=True)
class SSEEvent:
    kind: EventKind
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None


def sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of an SSE body arriving in ``chunks``: split at CR LF, LF or CR alone, as the SSE format says, and
    nowhere else (``str.splitlines`` and httpx's ``iter_lines`` also split at U+2028, U+2029 and U+0085, which
    JSON leaves unescaped in a chunk's text). A line ends as soon as its CR arrives (an LF opening the next read
    then belongs to it): held back until that read, a server's CR-ended event was timed at the next one."""
    held, after_cr = b"", False
    for chunk in chunks:
        if after_cr and chunk.startswith(b"\n"):
            chunk, after_cr = chunk[1:], False
        if not chunk:  # (an empty read leaves a CR's LF still to come)
            continue
        data = held + chunk
        after_cr = data.endswith(b"\r")
        *lines, held = _SSE_BREAK.split(data)
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if held:
        yield held.decode("utf-8", errors="replace")


class MalformedChunkError(ValueError):
    """A stream chunk that is JSON but not shaped as an OpenAI-style chunk."""


@dataclass(frozen=True)
class Chunk:
    """The fields of one OpenAI-style stream chunk that the clients read, each of its expected type."""

    text: str = ""
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()
    has_choice: bool = False
    usage: dict[str, Any] | None = None
    seed: int | None = None
    error: dict[str, Any] | None = None  # an in-stream error, as an object (a bare string becomes its message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_chunk(obj: object) -> Chunk:
    """The fields of a parsed stream chunk; MalformedChunkError when one has another shape than OpenAI's."""
    if not isinstance(obj, dict):
        raise MalformedChunkError("a chunk is not a JSON object")
    if "error" in obj:
        error = obj["error"]
        return Chunk(error=error if isinstance(error, dict) else {"message": str(error)})
    usage, seed, choices = obj.get("usage"), obj.get("seed"), obj.get("choices") or []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (an extension, speculation's, holds more)
    if usage is not None and not (
        isinstance(usage, dict) and all(usage.get(k) is None or _is_int(usage[k]) for k in counts)
    ):
        raise MalformedChunkError("usage is not an object of token counts")
    if seed is not None and not _is_int(seed):
        raise MalformedChunkError("seed is not an integer")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise MalformedChunkError("choices is not a list of objects")
    if not choices:
        return Chunk(usage=usage, seed=seed)
    choice = choices[0]
    holder = choice.get("delta") or {} if "delta" in choice else choice  # chat deltas, or completions' choice
    if not isinstance(holder, dict):
        raise MalformedChunkError("delta is not an object")
    text = holder.get("content" if "delta" in choice else "text")
    finish, token_ids = choice.get("finish_reason"), choice.get("token_ids") or []
    if not (text is None or isinstance(text, str)) or not (finish is None or isinstance(finish, str)):
        raise MalformedChunkError("a choice's text or finish_reason is not a string")
    if not (isinstance(token_ids, list) and all(_is_int(t) for t in token_ids)):
        raise MalformedChunkError("token_ids is not a list of integers")
    return Chunk(text or "", finish, tuple(token_ids), True, usage, seed)


@dataclass
class SSEDecoder:
    """Events from an SSE stream's lines, assembled as the format says: a field's value is what follows its colon
    (one space after it dropped), ``data`` lines join with a newline, a blank line dispatches the event, comments
    and other fields are skipped, and an event the stream's end cuts off (no blank line after it) is not
    dispatched. Each line read alone, an event whose JSON spans two ``data`` lines was a malformed payload."""

    last_event_id: str | None = None  # the ``id`` field's last value (it holds for later events without one)
    _data: list[str] = field(default_factory=list)
    _started: bool = False

    def feed(self, line: str | bytes) -> str | None:
        """The data of the event this line dispatches, or None."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.rstrip("\r\n")  # (a client's line iterator may leave the break on)
        if not self._started:  # one byte order mark before the stream's first line is no part of it
            line, self._started = line.removeprefix("\ufeff"), True
        if not line:
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self.last_event_id = value
        return None


def parse_sse_data(data: str) -> SSEEvent:
    """One event's data from an OpenAI-style stream: a chunk, its usage, an error or ``[DONE]``."""
    payload = data.strip()
    if payload == DONE_SENTINEL:
        return SSEEvent(EventKind.done)
    try:
        chunk = read_chunk(json.loads(payload))
    except MalformedChunkError as e:
        return SSEEvent(EventKind.error, error=f"unexpected SSE payload ({e}): {payload[:120]!r}")
    except (ValueError, RecursionError):  # JSONDecodeError, an integer past int()'s digit limit, deep nesting
        return SSEEvent(EventKind.error, error=f"malformed SSE payload: {payload[:120]!r}")
    if chunk.error is not None:
        return SSEEvent(EventKind.error, error=str(chunk.error.get("message", chunk.error)))
    # (usage may also come on a chunk with choices: a server that sends it with the last one, or in every chunk as
    # vLLM's continuous_usage_stats)
    usage = {} if chunk.usage is None else chunk.usage
    kind = EventKind.content if chunk.text else EventKind.other
    if chunk.usage is not None and not chunk.has_choice:
        kind = EventKind.usage
    return SSEEvent(
        kind,
        text=chunk.text if kind == EventKind.content else "",
        completion_tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
        finish_reason=None if kind == EventKind.usage else chunk.finish_reason,
    )


@dataclass
class StreamStats:
    """Latency of one streamed request. Times are seconds relative to when the request was sent."""

    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    text: str = ""
    completion_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    end_s: float | None = None  # arrival of [DONE] (or of the last event seen)
    finish_s: float | None = None  # arrival of the chunk with the finish reason: the last token's, text or none

    def add(self, event: SSEEvent, t: float) -> None:
        self.end_s = t
        if event.completion_tokens is not None:  # (the last usage seen: a server may send it with every chunk)
            self.completion_tokens, self.prompt_tokens = event.completion_tokens, event.prompt_tokens
        if event.kind == EventKind.content:
            self.chunk_times.append(t)
            self.text += event.text
        elif event.kind == EventKind.done:
            self.done = True
        elif event.kind == EventKind.error and self.error is None:
            self.error = event.error
        if event.finish_reason is not None:
            self.finish_reason, self.finish_s = event.finish_reason, t

    @property
    def output_tokens(self) -> int:
        """Tokens from the usage chunk; without one, the number of content chunks (a lower bound)."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def token_times(self) -> list[float]:
        """Arrivals of the chunks that carry tokens: those with text, and the one with the finish reason after them
        (a last step whose tokens have no text, an EOS run under ignore_eos, sends its chunk without content: the
        tokens usage counts then ended there, not at the last text)."""
        times = self.chunk_times
        if times and self.finish_s is not None and self.finish_s > times[-1]:
            return [*times, self.finish_s]
        return times

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (the server's definition)."""
        times = self.token_times
        if len(times) < 2:
            return None
        return tpot(times[0], times[-1], self.output_tokens)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between chunks that carry tokens (one chunk may carry several under speculation)."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    def failure(self) -> str | None:
        """Why this stream counts as failed, or None."""
        if self.error is not None:
            return self.error
        if not self.done:
            return "the stream ended without data: [DONE]"
        if not self.chunk_times and self.output_tokens > 0:
            return "no content chunk arrived"
        return None


def read_stream(lines: Iterable[str | bytes], t0: float, deadline_s: float) -> StreamStats:
    """Read one live stream's lines (``t0``: ``time.perf_counter()`` when the request was sent) until it ends or
    ``deadline_s`` has passed since ``t0``: a stream that is still open then is this request's failure. An HTTP
    client's timeout restarts at every byte, and a server's keep-alive comments (specserve's: every 15 s) arrive
    while a request waits, so only a deadline over the whole request ends one that makes no progress. An event
    counts when the blank line that ends it arrives."""
    stats, decoder = StreamStats(), SSEDecoder()
    for line in lines:
        now = time.perf_counter() - t0
        if now > deadline_s:  # even where this line ends the [DONE] event: it came late
            stats.error = f"no end of stream within {deadline_s:g} s"
            break
        if (data := decoder.feed(line)) is not None:
            stats.add(parse_sse_data(data), now)
    return stats


def parse_sse(lines: Iterable[tuple[float, str | bytes]]) -> StreamStats:
    """Fold (arrival time, line) pairs of one stream into its statistics (an event at its ending blank line's)."""
    stats, decoder = StreamStats(), SSEDecoder()
    for t, line in lines:
        if (data := decoder.feed(line)) is not None:
            stats.add(parse_sse_data(data), t)
    return stats


def parse_sse_text(text: str, *, dt: float = 0.0) -> StreamStats:
    """Parse a whole stream body; the n-th line is stamped n * dt (for tests and offline parsing)."""
    lines = sse_lines([text.encode()])
    return parse_sse((i * dt, line) for i, line in enumerate(lines))


class RemoteHostError(ValueError):
    pass


def is_loopback_host(host: str) -> bool:
    """Loopback by address (127.0.0.0/8, ::1) or the name ``localhost``; other names are not resolved."""
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_headers(env: dict[str, str] | None = None) -> dict[str, str]:
    """``Authorization: Bearer`` with the key in SPECSERVE_API_KEY (the variable a keyed deployment reads its own
    key from); none where it is unset or blank."""
    key = (os.environ if env is None else env).get(API_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def check_loopback(url: str | None, *, allow_remote: bool | None = None) -> str:
    """Return the URL (with ``http://`` in front of a bare host:port) if it targets this machine; raise
    RemoteHostError otherwise (unless overridden by ``allow_remote`` or the SPECSERVE_ALLOW_REMOTE=1 environment
    variable)."""
    if not url:
        raise RemoteHostError("no target host given: pass --host http://127.0.0.1:8000")
    full = url if "://" in url else f"http://{url}"  # a bare host:port means plain HTTP
    if odd := sorted({c for c in full if c == "\\" or c.isspace() or not c.isprintable()}):
        # clients read such URLs differently: urlsplit took 'http://evil.example\\@127.0.0.1' for loopback, and
        # urllib3 (Locust's client) connects to evil.example
        raise RemoteHostError(f"cannot read a host from {url!r}: it holds {', '.join(map(repr, odd))}")
    try:
        parts = urlsplit(full)
        parts.port  # noqa: B018 (parsing it is the check: 'localhost:abc' raises here)
    except ValueError as e:
        raise RemoteHostError(f"cannot read a host from {url!r} ({e}); expected e.g. http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteHostError(f"cannot read a host from {url!r}; expected e.g. http://127.0.0.1:8000")
    if allow_remote is None:
        allow_remote = os.environ.get(ALLOW_REMOTE_ENV, "") == "1"
    if not allow_remote and not is_loopback_host(parts.hostname):
        raise RemoteHostError(
            f"refusing to send load to {parts.hostname!r}: only loopback targets (127.0.0.1, ::1, localhost) are "
            f"allowed. Set {ALLOW_REMOTE_ENV}=1 to load a host you own."
        )
    return full


class LoadSettings(BaseModel):
    """What each simulated user sends. ``from_env`` reads SPECSERVE_<FIELD> (upper case) variables."""

    model_config = ConfigDict(frozen=True)

    categories: dict[str, float] = Field(default_factory=dict, description="category -> weight; empty: all")
    max_tokens: int = Field(default=64, ge=1)
    max_prompt_chars: int | None = Field(default=None, ge=1, description="truncate prompts (tiny deployments)")
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE)  # the API's own bound
    ignore_eos: bool = True  # fixed output lengths make runs comparable
    model: str | None = None  # None: the first id of GET /v1/models
    speculate: bool = True  # False: ask for plain decoding
    policy: SLPolicyKind | None = None  # None: the deployment's default SL policy
    record_itl: bool = True
    seed: int = 0
    timeout_s: float = Field(default=300.0, gt=0.0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    wait_min_s: float = Field(default=0.0, ge=0.0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    wait_max_s: float = Field(default=0.5, ge=0.0, le=MAX_TIMEOUT_S, allow_inf_nan=False)

    @staticmethod
    def parse_categories(spec: str) -> dict[str, float]:
        """``coding,math`` (equal weights) or ``coding:3,writing:1``."""
        out: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, weight = part.partition(":")
            try:
                out[name.strip()] = float(weight) if weight else 1.0
            except ValueError:
                raise ValueError(f"category weight {weight!r} of {name.strip()!r} is not a number") from None
        return out

    @field_validator("categories")
    @classmethod
    def _positive_weights(cls, categories: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in categories.items() if not (math.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"category weights are positive numbers, got {bad}")
        return categories

    @model_validator(mode="after")
    def _wait_range(self) -> LoadSettings:
        if self.wait_min_s > self.wait_max_s:
            raise ValueError(f"wait_min_s {self.wait_min_s} exceeds wait_max_s {self.wait_max_s}")
        return self

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> LoadSettings:
        """SPECSERVE_POLICY takes ``static`` / ``dsde``, ``none`` (plain decoding) or ``server`` (the default)."""
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(f"SPECSERVE_{name.upper()}")
            if raw is None or raw == "":
                continue
            values[name] = cls.parse_categories(raw) if name == "categories" else raw
        if values.get("policy") == "none":
            values["policy"], values["speculate"] = None, False
        elif values.get("policy") == "server":
            values["policy"] = None
        return cls.model_validate(values)

    def prompt_pool(self) -> dict[str, list[BenchPrompt]]:
        prompts = mt_bench_prompts(categories=list(self.categories) or None)
        pool: dict[str, list[BenchPrompt]] = {}
        for p in prompts:
            pool.setdefault(p.category, []).append(p)
        unknown = set(self.categories) - set(pool)
        if unknown:
            known = sorted({p.category for p in mt_bench_prompts()})
            raise ValueError(f"unknown MT-bench categories {sorted(unknown)}; known: {known}")
        return pool

    def body(self, prompt: BenchPrompt, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": prompt.text[: self.max_prompt_chars]}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not self.speculate:
            body["speculation"] = {"enabled": False}
        elif self.policy is not None:
            body["speculation"] = {"policy": self.policy.value}
        return body
