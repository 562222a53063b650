"""A request moves to another lane when its lane loses its workers for good (``deployments/failover.py``): the lane
it goes to, the pause before a lane still recovering, the output it delivered carried along, and a step loop
continuing after that output. Fake lanes play a fixed token stream; the real lanes are in
tests/test_worker_faults.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import pytest

from deployments import failover
from deployments.failover import FailoverStream, Moving, pick_lane
from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.error_bodies import APIError, LaneHandoffError, LaneLostError, StepLostError, WorkerFailedError
from specserve.config import SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from specserve.sampling import SamplingParams
from specserve.sequence import Delivered, FinishReason, Request, RequestOutput, RequestStats

TOKENS = [11, 12, 13, 14, 15, 16, 17]
WORDS = ["a", "b", "c", "é", "d", "e", "f"]  # one per token; "é" is two UTF-8 bytes
REQUEST = Request("r", [1, 2, 3], SamplingParams(max_tokens=len(TOKENS)))


def _output(i: int, tokens: list[int], words: list[str], start: int = 0) -> RequestOutput:
    """Output i of a run that began after ``start`` delivered tokens (its stats count that run's forwards)."""
    last = i == len(tokens) - 1
    reason = FinishReason.length if last else None
    return RequestOutput("r", [tokens[i]], words[i], reason, 3, i + 1, RequestStats(target_forwards=i + 1 - start))


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
    """Runs the request from what it delivered before to ``lost_after`` outputs, then loses it (None: to the end)."""

    index: int
    healthy: bool = True
    loading: bool = False
    alive: bool = True
    in_flight: int = 0
    draft_lost: bool = False
    lost_after: int | None = None
    refuse: bool = False  # its submit raises LaneHandoffError, as a lane's does (its thread stopped after the pick)
    lost_as: type[LaneLostError] = LaneLostError  # how it loses the request
    tokens: list[int] = field(default_factory=lambda: list(TOKENS))
    submitted: list[Request] = field(default_factory=list)

    async def submit(self, request: Request) -> Stream:
        self.submitted.append(request)
        if self.refuse:
            raise LaneHandoffError(f"lane {self.index} has stopped")
        n = len(self.tokens) if self.lost_after is None else self.lost_after
        start = 0 if request.delivered is None else len(request.delivered.token_ids)
        outs = [_output(i, self.tokens, WORDS, start) for i in range(start, n)]
        lost = None if self.lost_after is None else self.lost_as("the lane could not replace a lost worker")
        return Stream(outs, lost)


def _collect(
    stream: FailoverStream, forwards: list[int] | None = None
) -> tuple[list[int], str, list[FinishReason | None]]:
    async def run() -> tuple[list[int], str, list[FinishReason | None]]:
        await stream.open()
        ids: list[int] = []
        text, reasons = "", []
        async for out in stream:
            ids += out.token_ids
            text += out.text
            reasons.append(out.finish_reason)
            if forwards is not None:
                forwards.append(out.stats.target_forwards)
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
    assert pick_lane([lost, busy], avoid=busy) is busy  # healthy first, even the one to avoid
    assert pick_lane([lost, FakeLane(1, healthy=False, in_flight=3)]) is lost  # none healthy: the least loaded
    assert pick_lane([FakeLane(0, alive=False), lost]) is lost
    assert pick_lane([FakeLane(0, alive=False)]) is None
    loading = FakeLane(0, loading=True)  # its target still loading its model (after a loss, or at first)
    assert pick_lane([loading, busy]) is busy  # a loaded lane first, however busy
    assert pick_lane([loading, lost]) is loading  # a healthy lane first, loaded or not
    plain, drafting = FakeLane(0, draft_lost=True), FakeLane(1)  # lane 0's draft is coming back
    assert pick_lane([plain, drafting]) is drafting  # as loaded: the lane that speculates (it was the first)
    assert pick_lane([plain, FakeLane(1, in_flight=1)]) is plain  # less loaded: capacity first


def test_a_request_its_lane_loses_continues_on_another_lane_where_it_stopped(sleeps: list[float]) -> None:
    first, second = FakeLane(0, lost_after=4), FakeLane(1, in_flight=3)
    moved: list[int] = []
    forwards: list[int] = []
    ids, text, reasons = _collect(_stream([first, second], moved=moved), forwards)
    assert ids == TOKENS and text == "".join(WORDS)  # each token once, in order
    assert forwards == list(range(1, len(TOKENS) + 1))  # the usage counts both lanes' forwards
    assert reasons == [None] * (len(TOKENS) - 1) + [FinishReason.length]
    assert first.submitted == [REQUEST] and moved == [0]
    assert second.submitted == [replace(REQUEST, delivered=Delivered(tuple(TOKENS[:4]), "abcé"))]
    assert sleeps == []  # a healthy lane took it at once


@pytest.mark.parametrize("ran_on_second", [True, False])
def test_a_request_lost_in_a_step_is_a_suspect_until_a_lane_delivers_for_it(
    sleeps: list[float], ran_on_second: bool
) -> None:
    """Lost in a step (StepLostError) it moves as a suspect; once a lane delivered output for it (its step alone
    there went through) it is none: handed on later for another reason, it went on as one, stepped alone again
    and, were that lane's target to die then, failed for it."""
    first = FakeLane(0, lost_after=2, lost_as=StepLostError)
    second = FakeLane(1, in_flight=1, lost_after=4 if ran_on_second else 2, lost_as=LaneHandoffError)
    last = FakeLane(2, in_flight=2)
    lanes = [first, second, last]
    stream = FailoverStream(
        lambda: [lane for lane in lanes if not lane.submitted], REQUEST, max_failovers=2, backoff_s=0
    )
    assert _collect(stream)[0] == TOKENS
    assert [lane.submitted[0].suspect for lane in lanes] == [False, True, not ran_on_second]


def test_usage_counts_every_lanes_forwards_across_two_moves(sleeps: list[float]) -> None:
    """Lost after 2 outputs on the first lane and after 1 more on the second: the usage the client sees keeps
    counting the forwards of every lane the request ran on."""
    lanes = [FakeLane(0, lost_after=2), FakeLane(1, lost_after=3, in_flight=1), FakeLane(2, in_flight=2)]
    for lane in lanes[:2]:

        async def submit(request: Request, lane: FakeLane = lane) -> Stream:
            stream = await FakeLane.submit(lane, request)
            lane.alive = False  # it stops with the workers it loses: the request does not come back to it
            return stream

        lane.submit = submit  # type: ignore[method-assign]
    moved: list[int] = []
    forwards: list[int] = []
    ids, _, _ = _collect(_stream(lanes, moved=moved), forwards)
    assert ids == TOKENS and moved == [0, 1]
    assert forwards == list(range(1, len(TOKENS) + 1))  # 2 on the first lane, 1 on the second, 4 on the third


def test_a_request_lost_before_its_first_token_replays_from_the_start(sleeps: list[float]) -> None:
    first, second = FakeLane(0, lost_after=0), FakeLane(1, in_flight=3)
    assert _collect(_stream([first, second]))[0] == TOKENS
    assert second.submitted == [REQUEST]  # nothing delivered: the request as it came


def test_with_no_healthy_lane_the_request_waits_longer_before_each_retry(
    sleeps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One lane, whose workers come back at the third try: the request pauses 0.5 s, then 1 s, and completes;
    while it pauses the replica counts it (``Moving``), as it counts requests in its lanes."""
    lane = FakeLane(0, lost_after=2)
    tries = iter([3, None])

    async def submit(request: Request) -> Stream:
        stream = await FakeLane.submit(lane, request)
        lane.healthy = False  # it lost its workers
        lane.lost_after = next(tries, None)
        return stream

    lane.submit = submit  # type: ignore[method-assign]
    moving, counted = Moving(), []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        counted.append(moving.count)

    monkeypatch.setattr(failover.asyncio, "sleep", sleep)
    stream = FailoverStream(lambda: [lane], REQUEST, max_failovers=2, backoff_s=0.5, moving=moving)
    ids, _, _ = _collect(stream)
    assert ids == TOKENS and sleeps == [0.5, 1.0] and len(lane.submitted) == 3
    assert counted == [1, 1] and moving.count == 0  # held by the replica while it pauses, and only then


def test_the_pause_before_a_retry_stops_doubling_at_its_cap(sleeps: list[float]) -> None:
    """The pause doubled without end: 12 failovers from a 60 s backoff (both accepted settings) paused for 68 hours
    in all, the request counted against capacity and its client sent nothing."""
    lane = FakeLane(0, healthy=False, lost_after=0)  # it never gets its workers back
    stream = FailoverStream(lambda: [lane], REQUEST, max_failovers=12, backoff_s=60.0)
    with pytest.raises(LaneLostError):
        _collect(stream)
    assert len(sleeps) == 12 and max(sleeps) == failover.MAX_PAUSE_S and sum(sleeps) == 12 * 60.0
    sleeps.clear()  # past 1024 moves, 2 ** moves overflowed a float (an OverflowError, not the lane's error)
    with pytest.raises(LaneLostError):
        _collect(FailoverStream(lambda: [lane], REQUEST, max_failovers=1100, backoff_s=1.0))
    assert len(sleeps) == 1100 and max(sleeps) == failover.MAX_PAUSE_S


def test_past_max_failovers_the_request_gets_the_lane_lost_error(
    sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    lanes = [FakeLane(0, lost_after=2), FakeLane(1, lost_after=3)]
    delivered: list[int] = []

    async def run() -> None:
        stream = _stream(lanes, max_failovers=1)
        await stream.open()
        async for out in stream:
            delivered.extend(out.token_ids)

    with pytest.raises(LaneLostError), caplog.at_level(logging.WARNING, logger=failover.__name__):
        asyncio.run(run())
    assert delivered == TOKENS[:3]  # what each lane reached, once
    # the end is logged under the request's id, as each move was (it used to end on "moving it to another lane")
    assert caplog.records[-1].getMessage().startswith(f"request {REQUEST.request_id}: lane 1 lost it")
    assert caplog.records[-1].getMessage().endswith("after 1 failovers, the most allowed: it fails")


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


def test_a_continuation_another_lane_refuses_is_a_503_not_the_clients_fault(sleeps: list[float]) -> None:
    class Refusing(FakeLane):
        async def submit(self, request: Request) -> Stream:
            raise InvalidRequestError("the delivered text is not what the delivered tokens decode to")

    lanes = [FakeLane(0, lost_after=3), Refusing(1)]
    with pytest.raises(WorkerFailedError, match="could not go on"):
        _collect(_stream(lanes))


def test_a_lane_that_stops_between_the_pick_and_the_submit_is_skipped(sleeps: list[float]) -> None:
    """The request never ran there: it moves on even with no failover to spend."""
    stopping, other = FakeLane(0, refuse=True), FakeLane(1, in_flight=2)
    moved: list[int] = []
    assert _collect(_stream([stopping, other], max_failovers=0, moved=moved))[0] == TOKENS
    assert moved == [0] and len(other.submitted) == 1


def test_a_lane_that_refuses_submits_until_its_thread_ends_is_retried_after_a_pause(sleeps: list[float]) -> None:
    """A lane told to stop, its thread still in a long step, refuses each submit at once; the only lane left, it
    was picked again and again without the event loop ever running anything else until the thread ended."""

    class Stopping(FakeLane):
        async def submit(self, request: Request) -> Stream:
            if len(self.submitted) < 3:
                self.submitted.append(request)
                raise LaneHandoffError(f"lane {self.index} has stopped")
            return await super().submit(request)

    lane = Stopping(0)
    assert _collect(_stream([lane], max_failovers=0))[0] == TOKENS
    assert sleeps == [failover.REFUSED_PAUSE_S] * 3


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


# -- a step loop continuing after a delivered output (what the next lane does) --------------------------------


def _outputs(engine: Engine, request: Request) -> list[RequestOutput]:
    engine.loop.add_request(request)
    outs: list[RequestOutput] = []
    while engine.loop.has_work:
        outs += engine.loop.step()
    return outs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_loop_continues_a_request_after_its_delivered_output_as_if_it_had_never_stopped(temperature: float) -> None:
    """Cut the plain run's stream after each of its outputs: a loop handed the request with what was delivered up
    to there sends exactly the rest, tokens and text, plainly or speculating, greedy or sampled (a stop string
    ends the run)."""
    target, tok = tiny_model(tiny_config(), seed=0), tiny_tokenizer()
    plain = Engine(target, tok, eos_token_ids=set())
    spec = SpecConfig(method=SpecMethod.chain, sl=3)
    drafting = Engine(target, tok, draft=noisy_copy(target, 0.02, seed=1), speculation=spec, eos_token_ids=set())
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=7)
    whole = "".join(o.text for o in _outputs(plain, Request("w", prompt, params)))
    params = params.model_copy(update={"stop": (whole[24:26],)})  # the run ends at a stop string
    full = _outputs(plain, Request("full", prompt, params))
    assert full[-1].finish_reason == FinishReason.stop and len(full) > 10
    drafted_any = False
    for cut in range(1, len(full) - 1):
        ids = [t for o in full[:cut] for t in o.token_ids]
        done = Delivered(tuple(ids), "".join(o.text for o in full[:cut]))
        for engine in (plain, drafting):
            rest = _outputs(engine, Request(f"c{cut}", prompt, params, delivered=done))
            assert [t for o in rest for t in o.token_ids] == [t for o in full[cut:] for t in o.token_ids]
            assert "".join(o.text for o in rest) == "".join(o.text for o in full[cut:])
            assert (
                rest[-1].finish_reason == FinishReason.stop and rest[-1].num_output_tokens == full[-1].num_output_tokens
            )
            drafted_any |= engine is drafting and sum(o.stats.accepted for o in rest[-1:]) > 0
    assert drafted_any


def test_a_continuation_that_does_not_fit_the_request_is_refused() -> None:
    target, tok = tiny_model(tiny_config(), seed=0), tiny_tokenizer()
    engine = Engine(target, tok, eos_token_ids=set(), max_model_len=64)
    prompt = tok.encode("hello", add_special_tokens=False)
    params = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.loop.add_request(Request("a", prompt, params, delivered=Delivered((5, 6, 7, 8), "")))
    with pytest.raises(InvalidRequestError, match="decode"):
        engine.loop.add_request(Request("b", prompt, params, delivered=Delivered((5,), "not its text")))
    assert not engine.loop.has_work
