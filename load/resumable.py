"""A streaming client that survives a lost connection: it remembers the last SSE event id and the seed the server
returned, and on a cut (connection error, a 5xx or 429 while the server heals, a stream that ends without
``[DONE]``) resends the same request with ``resume_from`` set, until the stream completes. A stream without event
ids (several choices) is resent only while nothing has been delivered: past that, a cut fails it.

    for delta in ResumableStream(url, "/v1/chat/completions", body).deltas():
        print(delta.text, end="")
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from load.client import DONE_SENTINEL, MalformedChunkError, SSEDecoder, read_chunk, sse_lines

RETRYABLE_STATUS = {429, 500, 502, 503, 504}  # a restarting replica answers these while it heals


class StreamFailedError(RuntimeError):
    """The stream cannot go on: a 4xx, an in-stream error other than a lost worker, or an outage past the timeout."""


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class ResumableStream:
    base_url: str
    route: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    api_key: str | None = None
    timeout_s: float = 60.0
    heal_timeout_s: float = 90.0  # how long to keep resending while the server is down
    retry_interval_s: float = 0.5
    client: httpx.Client | None = None
    last_event_id: str | None = None
    seed: int | None = None
    resumes: int = 0
    delivered: bool = False  # content was yielded (once it has, only a resume point lets a cut go on)
    usage: dict[str, Any] | None = field(default=None, repr=False)

    def deltas(self) -> Iterator[Delta]:
        """The stream's content, exactly once, however often the connection is lost on the way."""
        client = self.client or httpx.Client(timeout=self.timeout_s)
        deadline: float | None = None
        try:
            while True:
                seen = self.last_event_id
                try:
                    yield from self._one_connection(client)
                    return
                except (httpx.TransportError, _Retryable) as e:
                    if self.delivered and not self.last_event_id:  # a resend starts over: all again, not the rest
                        raise StreamFailedError(
                            f"the stream was cut ({e}) after content was delivered with no event id to resume from "
                            "(a stream of several choices carries none; an empty id resets it)"
                        ) from e
                    now = time.monotonic()
                    if self.last_event_id != seen:  # that connection made progress: a new outage starts now
                        deadline = None
                    deadline = deadline or now + self.heal_timeout_s
                    wait = max(self.retry_interval_s, e.retry_after_s if isinstance(e, _Retryable) else 0.0)
                    if now + wait > deadline:
                        raise StreamFailedError(f"the stream could not be resumed: {e}") from e
                    self.resumes += 1
                    time.sleep(wait)
        finally:
            if self.client is None:
                client.close()

    def text(self) -> str:
        return "".join(d.text for d in self.deltas())

    def _request_body(self) -> dict[str, Any]:
        body = {**self.body, "stream": True}
        if self.last_event_id:  # (an empty ``id`` resets it: the stream starts over)
            body["resume_from"] = self.last_event_id
            if self.seed is not None:
                body["seed"] = self.seed
        return body

    def _one_connection(self, client: httpx.Client) -> Iterator[Delta]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with client.stream("POST", self.base_url + self.route, json=self._request_body(), headers=headers) as r:
            if r.status_code in RETRYABLE_STATUS:
                raise _Retryable(f"HTTP {r.status_code}", retry_after(r.headers.get("Retry-After")))
            if r.status_code != 200:
                raise StreamFailedError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
            decoder = SSEDecoder()
            for line in sse_lines(r.iter_bytes()):
                if (data := decoder.feed(line)) is None:
                    if not line and decoder.last_event_id is not None:  # an event without data still moves the
                        self.last_event_id = decoder.last_event_id  # point a reconnect resumes from
                    continue
                if data.strip() == DONE_SENTINEL:
                    return
                try:
                    chunk = json.loads(data)
                except (ValueError, RecursionError) as e:  # also an integer past int()'s limit, deep nesting
                    raise StreamFailedError(f"malformed event in stream: {data[:200]!r}") from e
                delta = self._parse(chunk)
                if decoder.last_event_id is not None:
                    self.last_event_id = decoder.last_event_id
                if delta is not None:
                    self.delivered = self.delivered or bool(delta.text or delta.token_ids or delta.finish_reason)
                    yield delta
        raise _Retryable("the stream ended without [DONE]")

    def _parse(self, obj: object) -> Delta | None:
        try:
            chunk = read_chunk(obj)
        except MalformedChunkError as e:
            raise StreamFailedError(f"unexpected chunk in stream ({e}): {json.dumps(obj)[:200]}") from e
        if chunk.error is not None:
            if chunk.error.get("code") == "worker_failed":  # the lane is healing: resume
                raise _Retryable(str(chunk.error.get("message", "worker failed")))
            raise StreamFailedError(f"error in stream: {chunk.error}")
        if chunk.seed is not None:
            self.seed = chunk.seed
        if chunk.usage:
            self.usage = chunk.usage
        return Delta(chunk.text, list(chunk.token_ids), chunk.finish_reason) if chunk.has_choice else None


class _Retryable(Exception):
    """A cut the server heals from (a 5xx / 429 while it restarts, a stream without [DONE]): resend and resume,
    not before the server's Retry-After."""

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after(header: str | None) -> float:
    """Seconds a Retry-After header asks for (its delta-seconds form; 0 when absent or a date)."""
    try:
        return max(0.0, float(header)) if header is not None else 0.0
    except ValueError:
        return 0.0
