"""A request that outlives its lane: when the lane loses its workers for good (it could not replace them), hands
it on while it loads a new target (with another lane loaded), or its thread stops, the request goes to another
running lane with the output it had delivered (``Request.delivered``,
the router's copy of its token state), and that lane prefills prompt and output and continues after them: the
same tokens a lane that never failed would go on with (docs/algorithms.md §1.3, §1.4; up to rounding, as after
any worker restart). Nothing is generated twice and nothing is sent twice.

A healthy lane is chosen first, a loaded one before one loading its target, another lane before the one that
lost the request; with none healthy, after a pause that doubles with each move (up to MAX_PAUSE_S), the least
loaded running lane (the one that lost it last: it keeps trying to bring its workers back)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import replace
from typing import Protocol

from specserve.api.error_bodies import LaneFullError, LaneHandoffError, LaneLostError, StepLostError, WorkerFailedError
from specserve.api.server import OutputStream
from specserve.errors import InvalidRequestError
from specserve.sequence import Delivered, Request, RequestOutput, RequestStats

logger = logging.getLogger(__name__)

MAX_PAUSE_S = 60.0  # the longest pause before a moved request tries a lane that is bringing its workers back
# the pause after a lane refused a submit at once: a lane told to stop refuses until its thread ends (up to the stop's
# deadline, after a long step), and, the only lane left, it would be picked again and again on the event loop
REFUSED_PAUSE_S = 0.05


class LaneLike(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def loading(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def draft_lost(self) -> bool: ...

    async def submit(self, request: Request) -> OutputStream: ...


def pick_lane(lanes: Sequence[LaneLike], avoid: LaneLike | None = None) -> LaneLike | None:
    """The running lane to submit to: a healthy one before one whose workers are lost, one whose target has its
    model before one still loading it, another lane before ``avoid`` (the one that just lost the request), then
    the least loaded, and of those one with its draft before one decoding plainly while its draft comes back (a
    lane's whole capacity is still used: only ties go to the draft); None when no lane runs."""

    def rank(lane: LaneLike) -> tuple[bool, bool, bool, int, bool]:
        return not lane.healthy, lane.loading, lane is avoid, lane.in_flight, lane.draft_lost

    return min((lane for lane in lanes if lane.alive), key=rank, default=None)


class Moving:
    """How many of a replica's requests are pausing before a move: in no lane's count, yet held by the replica
    (its admission counts them)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def pausing(self) -> Iterator[None]:
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1


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
        on_rebalance: Callable[[int], None] = lambda lane: None,
        moving: Moving | None = None,
    ) -> None:
        self._lanes = lanes
        self._moving = Moving() if moving is None else moving
        self._request = request
        self._max_failovers = max_failovers
        self._backoff_s = backoff_s
        self._on_failover = on_failover
        self._on_rebalance = on_rebalance
        self._failovers = 0
        self._lane: LaneLike | None = None
        self._stream: OutputStream | None = None

    async def open(self) -> None:
        while True:
            lane = self._pick()
            if self._failovers and not lane.healthy:  # only lanes still bringing their workers back: give them time
                with self._moving.pausing():
                    await asyncio.sleep(min(self._backoff_s * 2.0 ** min(self._failovers - 1, 30), MAX_PAUSE_S))
                lane = self._pick()  # one may have come back meanwhile, or stopped
            try:
                self._stream = await lane.submit(self._request)
            except LaneLostError as e:  # it stopped between the pick and the submit
                self._lane = lane
                self._moved(lane, e)
                with self._moving.pausing():
                    await asyncio.sleep(REFUSED_PAUSE_S)
                continue
            self._lane = lane
            return

    def _pick(self) -> LaneLike:
        lane = pick_lane(self._lanes(), avoid=self._lane)
        if lane is None:
            raise WorkerFailedError("no lane of this replica is running")
        return lane

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        ids: list[int] = []
        text: list[str] = []
        before = last = RequestStats()  # the counts of the lanes it left; the current lane's so far
        while True:
            assert self._stream is not None, "open() first"
            try:
                async for out in self._stream:
                    if self._request.suspect:  # its step alone there went through: no longer a suspect
                        self._request = replace(self._request, suspect=False)
                    ids += out.token_ids
                    text.append(out.text)
                    last = out.stats
                    yield out if before == RequestStats() else replace(out, stats=before + out.stats)
                return
            except LaneLostError as e:
                assert self._lane is not None
                self._moved(self._lane, e)
                before, last = before + last, RequestStats()
                if ids:  # the next lane prefills the prompt and this output, and continues after it
                    self._request = replace(self._request, delivered=Delivered(tuple(ids), "".join(text)))
                try:
                    await self.open()
                except InvalidRequestError as refused:  # valid when it came: not the client's to hear as a 400
                    raise WorkerFailedError(f"the request could not go on on another lane: {refused}") from refused

    def _moved(self, lane: LaneLike, error: LaneLostError) -> None:
        if isinstance(error, LaneFullError):  # waiting on a full lane, moved to one with room: no fault at all
            logger.debug("request %s: moved from full lane %d (%s)", self._request.request_id, lane.index, error)
            self._on_rebalance(lane.index)
            return
        if not isinstance(error, LaneHandoffError):  # (a handoff moves a request that never ran on the lane since
            # its loss, to a lane that has its model; one that was running there is dropped as lost, and counts)
            self._failovers += 1
        if isinstance(error, StepLostError):  # in a step that took the target down: alone first on the next lane
            self._request = replace(self._request, suspect=True)
        if self._failovers > self._max_failovers:
            logger.warning(
                "request %s: lane %d lost it (%s) after %d failovers, the most allowed: it fails",
                self._request.request_id,
                lane.index,
                error,
                self._max_failovers,
            )
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
