"""A request moves to another lane when its lane loses its workers for good (``deployments/failover.py``): the lane
it goes to, the pause before a lane still recovering, the replay skipped and checked against what was delivered.
Fake lanes replay a fixed token stream; the real lanes are in tests/test_worker_faults.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from deployments import failover
from deployments.failover import FailoverStream, pick_lane
from specserve.api.error_bodies import APIError, LaneLostError, ResumeMismatchError, WorkerFailedError
from specserve.sampling import SamplingParams
from specserve.sequence import FinishReason, Request, RequestOutput, RequestStats

TOKENS = [11, 12, 13, 14, 15, 16, 17]
WORDS = ["a", "b", "c", "é", "d", "e", "f"]  # one per token; "é" is two UTF-8 bytes
REQUEST = Request("r", [1, 2, 3], SamplingParams(max_tokens=len(TOKENS)))


def _output(i: int, tokens: list[int], words: list[str]) -> RequestOutput:
    last = i == len(tokens) - 1
    reason = FinishReason.length if last else None
    return RequestOutput("r", [tokens[i]], words[i], reason, 3, i + 1, RequestStats())


@dataclass
class Stream:
    outputs: list[RequestOutput]
    error: APIError | None  # raised after the outputs (None: the stream ends with them)
    closed: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._run()

    async def _run(self) -> AsyncIterator[RequestOutput]:
        for out in self.outputs:
            yield out
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class FakeLane:
    """Runs the request to ``lost_after`` outputs, then loses it (None: to the end); ``tokens`` its replay."""

    index: int
    healthy: bool = True
    alive: bool = True
    in_flight: int = 0
    lost_after: int | None = None
    refuse: bool = False  # its submit raises LaneLostError (the thread stopped after the pick)
    tokens: list[int] = field(default_factory=lambda: list(TOKENS))
    submitted: list[Request] = field(default_factory=list)

    async def submit(self, request: Request) -> Stream:
        self.submitted.append(request)
        if self.refuse:
            raise LaneLostError(f"lane {self.index} has stopped")
        n = len(self.tokens) if self.lost_after is None else self.lost_after
        outs = [_output(i, self.tokens, WORDS) for i in range(n)]
        lost = None if self.lost_after is None else LaneLostError("the lane could not replace a lost worker")
        return Stream(outs, lost)


def _collect(stream: FailoverStream) -> tuple[list[int], str, list[FinishReason | None]]:
    async def run() -> tuple[list[int], str, list[FinishReason | None]]:
        await stream.open()
        ids: list[int] = []
        text, reasons = "", []
        async for out in stream:
            ids += out.token_ids
            text += out.text
            reasons.append(out.finish_reason)
        return ids, text, reasons

    return asyncio.run(asyncio.wait_for(run(), 10))


def _stream(lanes: list[FakeLane], max_failovers: int = 2, moved: list[int] | None = None) -> FailoverStream:
    on_failover = (moved if moved is not None else []).append
    return FailoverStream(lambda: lanes, REQUEST, max_failovers=max_failovers, backoff_s=0.5, on_failover=on_failover)


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses the stream takes (recorded, not waited)."""
    taken: list[float] = []

    async def sleep(seconds: float) -> None:
        taken.append(seconds)

    monkeypatch.setattr(failover.asyncio, "sleep", sleep)
    return taken


def test_pick_lane_prefers_a_healthy_lane_to_an_idle_one_that_lost_its_workers() -> None:
    lost, busy, busier = FakeLane(0, healthy=False), FakeLane(1, in_flight=5), FakeLane(2, in_flight=7)
    assert pick_lane([lost, busy, busier]) is busy
    assert pick_lane([lost, busy, busier], avoid=busy) is busier  # another healthy lane before the one that failed
    assert pick_lane([busy], avoid=busy) is busy  # the only one
    assert pick_lane([lost, FakeLane(1, healthy=False, in_flight=3)]) is lost  # none healthy: the least loaded
    assert pick_lane([FakeLane(0, alive=False), lost]) is lost
    assert pick_lane([FakeLane(0, alive=False)]) is None


def test_a_request_its_lane_loses_continues_on_another_lane_where_it_stopped(sleeps: list[float]) -> None:
    first, second = FakeLane(0, lost_after=4), FakeLane(1, in_flight=3)
    moved: list[int] = []
    ids, text, reasons = _collect(_stream([first, second], moved=moved))
    assert ids == TOKENS and text == "".join(WORDS)  # each token once, in order
    assert reasons == [None] * (len(TOKENS) - 1) + [FinishReason.length]
    assert first.submitted == [REQUEST] and second.submitted == [REQUEST] and moved == [0]
    assert sleeps == []  # a healthy lane took it at once


def test_a_request_lost_before_its_first_token_replays_from_the_start(sleeps: list[float]) -> None:
    first, second = FakeLane(0, lost_after=0), FakeLane(1, in_flight=3)
    assert _collect(_stream([first, second]))[0] == TOKENS


def test_with_no_healthy_lane_the_request_waits_longer_before_each_retry(sleeps: list[float]) -> None:
    """One lane, whose workers come back at the third try: the request pauses 0.5 s, then 1 s, and completes."""
    lane = FakeLane(0, lost_after=2)
    tries = iter([3, None])

    async def submit(request: Request) -> Stream:
        stream = await FakeLane.submit(lane, request)
        lane.healthy = False  # it lost its workers
        lane.lost_after = next(tries, None)
        return stream

    lane.submit = submit  # type: ignore[method-assign]
    ids, _, _ = _collect(_stream([lane]))
    assert ids == TOKENS and sleeps == [0.5, 1.0] and len(lane.submitted) == 3


def test_past_max_failovers_the_request_gets_the_lane_lost_error(sleeps: list[float]) -> None:
    lanes = [FakeLane(0, lost_after=2), FakeLane(1, lost_after=3)]
    delivered: list[int] = []

    async def run() -> None:
        stream = _stream(lanes, max_failovers=1)
        await stream.open()
        async for out in stream:
            delivered.extend(out.token_ids)

    with pytest.raises(LaneLostError):
        asyncio.run(run())
    assert delivered == TOKENS[:3]  # what each lane reached, once


def test_a_replay_that_differs_from_what_was_delivered_is_reported(sleeps: list[float]) -> None:
    other = [*TOKENS[:2], 99, *TOKENS[3:]]  # the second lane would draw another third token
    lanes = [FakeLane(0, lost_after=4), FakeLane(1, tokens=other)]
    with pytest.raises(ResumeMismatchError):
        _collect(_stream(lanes))


def test_other_failures_are_not_moved(sleeps: list[float]) -> None:
    """A batch dropped after steps failed that no worker fault explains may be one request's doing: not retried."""

    class Dropping(FakeLane):
        async def submit(self, request: Request) -> Stream:
            self.submitted.append(request)
            return Stream([_output(0, TOKENS, WORDS)], WorkerFailedError("4 steps failed in a row"))

    lanes = [Dropping(0), FakeLane(1)]
    with pytest.raises(WorkerFailedError, match="in a row"):
        _collect(_stream(lanes))
    assert lanes[1].submitted == []


def test_a_lane_that_stops_between_the_pick_and_the_submit_is_skipped(sleeps: list[float]) -> None:
    stopping, other = FakeLane(0, refuse=True), FakeLane(1, in_flight=2)
    moved: list[int] = []
    assert _collect(_stream([stopping, other], moved=moved))[0] == TOKENS
    assert moved == [0] and len(other.submitted) == 1


def test_no_running_lane_is_a_503() -> None:
    with pytest.raises(WorkerFailedError, match="no lane"):
        asyncio.run(_stream([FakeLane(0, alive=False)]).open())


def test_closing_the_stream_closes_the_lanes_stream(sleeps: list[float]) -> None:
    lane = FakeLane(0)
    streams: list[Stream] = []
    submit = lane.submit

    async def recording(request: Request) -> Stream:
        streams.append(await submit(request))
        return streams[-1]

    lane.submit = recording  # type: ignore[method-assign]

    async def run() -> None:
        stream = _stream([lane])
        await stream.open()
        await stream.aclose()

    asyncio.run(run())
    assert streams[0].closed
