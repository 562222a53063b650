"""A request that outlives its lane: when the lane loses its workers for good (it could not replace them) or its
thread stops, the request is submitted again, unchanged and with the same seed, to another running lane, and its
stream goes on after what it had delivered. The replay is checked against the delivered tokens and text
(``specserve.api.resume.StreamCursor``): output is a function of the request alone (docs/algorithms.md §1.4),
so a replay that differs is reported (409) rather than spliced.

A healthy lane is chosen first; with none, after a pause that doubles with each failover, the least loaded running
lane (also the one that failed: its next step tries again to bring its workers back)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from specserve.api.error_bodies import LaneLostError, WorkerFailedError
from specserve.api.resume import StreamCursor, StreamMark
from specserve.api.server import OutputStream
from specserve.sequence import Request, RequestOutput

logger = logging.getLogger(__name__)


class LaneLike(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    async def submit(self, request: Request) -> OutputStream: ...


def pick_lane(lanes: Sequence[LaneLike], avoid: LaneLike | None = None) -> LaneLike | None:
    """The running lane to submit to: a healthy one before one whose workers are lost, another lane before
    ``avoid`` (the one that just lost the request), then the least loaded; None when no lane runs."""
    running = [lane for lane in lanes if lane.alive]
    return min(running, key=lambda lane: (not lane.healthy, lane is avoid, lane.in_flight), default=None)


class FailoverStream:
    """One request's outputs, from whichever lane runs it. ``open`` submits it (the caller's admission errors
    propagate); iterating yields its outputs once each, across up to ``max_failovers`` moves to another lane."""

    def __init__(
        self,
        lanes: Callable[[], Sequence[LaneLike]],
        request: Request,
        *,
        max_failovers: int,
        backoff_s: float,
        on_failover: Callable[[int], None] = lambda lane: None,
    ) -> None:
        self._lanes = lanes
        self._request = request
        self._max_failovers = max_failovers
        self._backoff_s = backoff_s
        self._on_failover = on_failover
        self._failovers = 0
        self._lane: LaneLike | None = None
        self._stream: OutputStream | None = None

    async def open(self) -> None:
        while True:
            lane = pick_lane(self._lanes(), avoid=self._lane)
            if lane is None:
                raise WorkerFailedError("no lane of this replica is running")
            if self._failovers and not lane.healthy:  # only lanes still bringing their workers back: give them time
                await asyncio.sleep(self._backoff_s * 2 ** (self._failovers - 1))
            try:
                self._stream = await lane.submit(self._request)
            except LaneLostError as e:  # it stopped between the pick and the submit
                self._lane = lane
                self._moved(lane, e)
                continue
            self._lane = lane
            return

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        delivered = StreamMark()
        replay: StreamCursor | None = None  # set after a move: skips (and checks) what was delivered
        while True:
            assert self._stream is not None, "open() first"
            try:
                async for out in self._stream:
                    part = out if replay is None else replay.advance(out)
                    if part is None:
                        continue
                    delivered = delivered.after(part.token_ids, part.text.encode())
                    yield part
                if replay is not None:
                    replay.check_reached()
                return
            except LaneLostError as e:
                assert self._lane is not None
                self._moved(self._lane, e)
                await self.open()
                replay = StreamCursor(delivered) if delivered.tokens or delivered.text_bytes else None

    def _moved(self, lane: LaneLike, error: LaneLostError) -> None:
        self._failovers += 1
        if self._failovers > self._max_failovers:
            raise error
        logger.warning(
            "request %s: lane %d lost it (%s); moving it to another lane (failover %d of %d)",
            self._request.request_id,
            lane.index,
            error,
            self._failovers,
            self._max_failovers,
        )
        self._on_failover(lane.index)

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
