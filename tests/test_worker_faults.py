"""A lane's workers failing the ways Ray reports besides a dead actor: a replacement whose start() raised, a call
that never returns, an actor that cannot be placed. The lane replaces the worker and every request goes on; a
lane that cannot replace it answers its requests and stays up; a lane thread that stops answers the submits still
queued. In-process: the real ``RemoteTarget`` proxy over a fake actor handle whose calls run a local TargetWorker,
``ray.get`` resolving them (no Ray processes)."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from ray.exceptions import ActorDiedError, ActorUnschedulableError, GetTimeoutError, ObjectLostError, RayTaskError

from deployments import actors
from deployments import lane as lane_module
from deployments.actors import KVGeometry, RemoteDraft, RemoteTarget
from deployments.app_args import AppArgs, WorkerRole
from deployments.failover import FailoverStream, Moving
from deployments.lane import Lane
from deployments.wire import attach_features, strip_features
from specserve.api.error_bodies import (
    APIError,
    LaneHandoffError,
    LaneLostError,
    RequestFailedError,
    StepLostError,
    WorkerFailedError,
)
from specserve.api.metrics import ServeMetrics
from specserve.config import SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import SequenceError
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_config, tiny_model
from specserve.sampling import SamplingParams
from specserve.sequence import Request
from specserve.spec_decode.model_free import ModelFreeDrafter
from specserve.workers import DraftWorker, TargetWorker
from specserve.workers.self_check import WorkerBrokenError, self_check

PROMPTS = [[5, 9, 13], [100, 200, 300, 400, 7, 8, 9], [42, 43]]
HOSTILE = [42, 43]  # the start of the prompt a "hostile" actor fails on
POISONED = RuntimeError("CUDA error: an illegal memory access was encountered")
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
LATE_AFTER = 3  # verify calls a "late" actor serves before it cannot be placed any more
Result = list[int] | APIError


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def alone(target: LlamaModel) -> list[list[int]]:
    return [r.token_ids for r in _engine(target).generate(PROMPTS, GREEDY)]


def _engine(target: LlamaModel) -> Engine:
    return Engine(target, None, max_batch_size=4, max_model_len=64, eos_token_ids=set())


@dataclass
class Ref:
    """What a fake actor call returns: ``ray.get`` runs it (``timeout`` as Ray's)."""

    run: Callable[[float | None], Any]
    ready: bool = True  # what ``ray.wait`` says of it


def fake_get(ref: Ref, *, timeout: float | None = None) -> Any:
    return ref.run(timeout)


def fake_wait(refs: list[Ref], *, timeout: float | None = None) -> tuple[list[Ref], list[Ref]]:
    return [r for r in refs if r.ready], [r for r in refs if not r.ready]


def gone(_: float | None) -> Any:
    raise ActorDiedError()


def hung(timeout: float | None) -> Any:
    assert timeout is not None, "a call without a timeout would wait for ever on a hung actor"
    raise GetTimeoutError(f"Get timed out after {timeout} s")


@dataclass
class Method:
    call: Callable[..., Ref]

    def remote(self, *args: Any) -> Ref:
        return self.call(*args)


@dataclass
class Actor:
    """A target worker actor's handle: ``fault`` decides how its start or its verify fails (None: they work; "late":
    after LATE_AFTER verifies; "dies at N": its process is lost at its N-th verify; "nan after N": its weights go
    non-finite after N verifies). "loading, " before a fault: that fault, after a start that waits for ``loaded``."""

    model: LlamaModel
    fault: str | None
    worker: TargetWorker | None = None
    calls: list[str] = field(default_factory=list)
    died: bool = False  # its process is gone: every call raises ActorDiedError
    broken: bool = False  # a "poisoning" actor after a hostile request: it fails its self-check from then on
    loaded: threading.Event = field(default_factory=threading.Event)  # a "loading" actor's start is done once set
    waits_for_load: bool = False

    def __post_init__(self) -> None:
        if self.fault is not None and self.fault.startswith("loading, "):
            self.fault, self.waits_for_load = self.fault.removeprefix("loading, "), True
        self.start = Method(self._start)
        self.add = Method(lambda seq_id, params, position: self._fire(lambda w: w.add(seq_id, params, position)))
        self.release = Method(lambda ids: self._fire(lambda w: w.release(ids)))
        self.verify = Method(lambda items: Ref(gone) if self.died else self._verify(items))
        self.check = Method(self._check)
        self.state = Method(self._state)

    def _fire(self, fn: Callable[[TargetWorker], None]) -> None:  # Ray's fire-and-forget: errors are lost
        if self.worker is not None:
            fn(self.worker)

    def _start(self, geometry: KVGeometry) -> Ref:
        self.calls.append("start")
        if self.fault == "start":  # the actor's start() raised (its device out of memory): an error in its task
            cause = RuntimeError("CUDA out of memory")
            return Ref(lambda _: (_ for _ in ()).throw(RayTaskError("start", "Traceback ...", cause)))
        self.worker = TargetWorker(self.model, num_slots=geometry.num_slots, max_len=geometry.max_len)
        if self.fault in ("loading", "deadly") or self.waits_for_load:
            # its model still loading: the start is done once ``loaded`` is set

            def loading(timeout: float | None) -> None:
                self.calls.append("wait")
                if not self.loaded.wait(timeout):
                    hung(timeout)

            return Ref(loading, ready=False)
        return Ref(lambda _: None)

    def _state(self) -> Ref:
        self.calls.append("state")
        return Ref(gone if self.died else lambda _: None)

    def _check(self) -> Ref:
        self.calls.append("check")
        if self.fault in ("poisoned", "nan") or self.broken:
            return Ref(lambda _: (_ for _ in ()).throw(RayTaskError("check", "Traceback ...", POISONED)))
        return Ref(lambda _: self_check(self.model))  # the actor's own check, on the real model

    def _verify(self, items: Any) -> Ref:
        self.calls.append("verify")
        hostile = any(it.new_tokens[:2] == HOSTILE for it in items)
        if self.fault == "deadly" and hostile:  # one request's input kills the actor's process (a crashing kernel)
            self.died = True
        self.died |= self.fault == "doomed"  # its node fails: every call kills it, whatever the requests
        if self.died:
            return Ref(gone)
        if self.fault == "result lost":  # its node fails once the result is stored there: the result is lost with it
            self.died = True
            return Ref(lambda _: (_ for _ in ()).throw(ObjectLostError("ab" * 28, None, "verify")))
        self.broken |= self.fault == "poisoning" and hostile  # one request's input breaks the actor's state
        if self.fault == "poisoned" or (self.fault in ("hostile", "poisoning") and hostile):
            # an error inside the actor's task naming no sequence: the worker's state, or one request's input
            return Ref(lambda _: (_ for _ in ()).throw(RayTaskError("verify", "Traceback ...", POISONED)))
        count = self.calls.count("verify")
        # its process is lost at that verify, whatever the requests
        self.died |= self.fault == f"dies at {count}"
        if self.died:
            return Ref(gone)
        self.broken |= (self.fault or "").startswith("nan after ") and count > int((self.fault or "").split()[-1])
        if self.fault == "nan" or (self.broken and (self.fault or "").startswith("nan after ")):
            # its weights went non-finite: the first row's sampling finds no mass, and says so
            error = RayTaskError("verify", "Traceback ...", SequenceError(items[0].seq_id, "no mass to sample"))
            return Ref(lambda _: (_ for _ in ()).throw(error))
        if self.fault == "hang":
            return Ref(hung)
        if self.fault == "unschedulable" or (self.fault == "late" and self.calls.count("verify") > LATE_AFTER):
            error = ActorUnschedulableError("the actor's placement group bundle is gone")
            return Ref(lambda _: (_ for _ in ()).throw(error))
        if self.worker is None:  # what the worker raises when used before start: a RayTaskError
            cause = RuntimeError("the worker is not started")
            return Ref(lambda _: (_ for _ in ()).throw(RayTaskError("verify", "Traceback ...", cause)))
        worker = self.worker
        return Ref(lambda _: strip_features(worker.verify(items)))  # as TargetActor.verify


class Factory:
    """Creates target proxies over fake actors; ``faults[generation]`` is that generation's fault, and ``broken``
    generations cannot be created at all (a placement that fails)."""

    def __init__(self, model: LlamaModel, faults: dict[int, str], broken: set[int] | None = None) -> None:
        self.model, self.faults, self.broken = model, faults, broken or set()
        self.actors: list[Actor] = []

    def create(self, lane: int, role: WorkerRole, generation: int) -> RemoteTarget:
        if generation in self.broken:
            raise RuntimeError("placement group removed")
        actor = Actor(self.model, self.faults.get(generation))
        self.actors.append(actor)
        return RemoteTarget(actor, f"target:{generation}", role, start_timeout_s=60.0, call_timeout_s=30.0)  # type: ignore[arg-type]

    def kill(self) -> None:
        pass


def _lane(target: LlamaModel, factory: Factory, **options: Any) -> Lane:
    engine = _engine(target)
    loop = engine.loop
    geometry = KVGeometry(4, loop.max_model_len + loop.spec_headroom)
    worker = factory.create(0, WorkerRole.target, 0)
    worker.start(geometry)
    loop.target = worker
    options.setdefault("metrics", ServeMetrics())
    options.setdefault("max_worker_restarts", 2)
    return Lane(0, loop, {WorkerRole.target: worker}, factory, geometry, **options)  # type: ignore[arg-type]


def _release_and_stop(lanes: list[Lane], factories: list[Factory]) -> None:
    """Let every "loading" actor's start finish (a lane thread may be waiting on one), then stop the lanes."""
    for factory in factories:
        for actor in factory.actors:
            actor.loaded.set()
    for lane in lanes:
        lane.stop()


async def _one(lane: Lane, request: Request) -> Result:
    tokens: list[int] = []
    try:
        stream = await lane.submit(request)
        async for out in stream:
            tokens += out.token_ids
    except APIError as e:
        return e
    return tokens


def _run(lane: Lane, prompts: list[list[int]], tag: str = "r") -> list[Result]:
    requests = [Request(f"{tag}{i}", p, GREEDY) for i, p in enumerate(prompts)]

    async def run() -> list[Result]:
        return await asyncio.wait_for(asyncio.gather(*(_one(lane, r) for r in requests)), 60)

    return asyncio.run(run())


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(actors.ray, "get", fake_get)
    monkeypatch.setattr(actors.ray, "wait", fake_wait)
    monkeypatch.setattr(actors.ray, "kill", lambda handle, no_restart=True: None)


@pytest.mark.parametrize("fault", ["start", "hang", "unschedulable", "result lost"])
def test_a_worker_that_cannot_serve_is_replaced_and_every_request_goes_on(
    target: LlamaModel, alone: list[list[int]], fault: str
) -> None:
    factory = Factory(target, {0: fault})
    lane = _lane(target, factory)
    try:
        assert _run(lane, PROMPTS) == alone
        assert lane.generations[WorkerRole.target] == 1 and lane.alive
        assert len(factory.actors) == 2 and "verify" in factory.actors[1].calls
    finally:
        lane.stop()


def test_a_step_result_lost_with_its_node_is_a_lost_worker_not_a_request_to_search_for(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Ray's ObjectLostError (the step's result was lost with the actor's node) was taken for one request's error:
    the batch split, the first half's probe found the actor dead, and its lone request was marked as the target's
    killer; the next target's unrelated death while that request stepped alone then failed it as a repeat."""
    factory = Factory(target, {0: "result lost", 1: "dies at 2"})
    lane = _lane(target, factory)
    try:
        assert _run(lane, PROMPTS) == alone
        assert lane.generations[WorkerRole.target] == 2 and factory.actors[0].calls.count("verify") == 1
    finally:
        lane.stop()


def _load_once_all_are_queued(lane: Lane, actor: Actor, requests: int) -> None:
    """The first target finishes loading once the lane holds ``requests`` requests, so that its first step runs
    them all together (a schedule of losses by verify count assumes it; one submitted late shifted it)."""

    def release() -> None:
        _wait(lambda: len(lane._sinks) >= requests)
        actor.loaded.set()

    threading.Thread(target=release, daemon=True).start()


def test_a_lane_that_cannot_replace_its_worker_answers_and_stays_up(target: LlamaModel, alone: list[list[int]]) -> None:
    """The replacement cannot even be created (its placement is gone): the requests get a 503 body, the lane
    thread lives, and once a replacement can be made the next requests run."""
    factory = Factory(target, {0: "loading, unschedulable"}, broken={1})
    lane = _lane(target, factory)
    _load_once_all_are_queued(lane, factory.actors[0], 2)  # (both in the first step, which loses its worker)
    try:
        results = _run(lane, PROMPTS[:2])
        assert all(isinstance(r, WorkerFailedError) for r in results), results
        assert lane.alive and not lane.healthy  # the replica reports itself degraded meanwhile
        assert _run(lane, PROMPTS, tag="s") == alone  # generation 2 starts
        assert lane.generations[WorkerRole.target] == 2 and lane.healthy
    finally:
        lane.stop()


def test_a_hung_worker_is_not_called_again_once_found_hung(target: LlamaModel, alone: list[list[int]]) -> None:
    """The target hangs (a call times out) and its replacement cannot be made: the lane answers its requests. The
    next requests' step used to call the hung actor again, a whole ``call_timeout_s`` (600 s) queued behind its
    stuck call, before the lane made a new one; now the proxy fails at once and the new target serves them."""
    factory = Factory(target, {0: "hang"}, broken={1})
    lane = _lane(target, factory)
    try:
        assert all(isinstance(r, WorkerFailedError) for r in _run(lane, PROMPTS[:1]))
        assert _run(lane, PROMPTS, tag="s") == alone
        assert factory.actors[0].calls.count("verify") == 1 and lane.generations[WorkerRole.target] == 2
    finally:
        lane.stop()


def test_requests_of_a_lane_that_cannot_replace_its_worker_finish_on_another_lane(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Lane 0's worker dies after a few steps and no replacement can be made: its requests, some tokens in, move to
    lane 1 (the router's FailoverStream) and finish with the tokens they would have had alone."""
    lanes = [_lane(target, Factory(target, {0: "late"}, broken={1})), _lane(target, Factory(target, {}))]
    moved: list[int] = []

    async def one(request: Request) -> list[int]:
        stream = FailoverStream(lambda: lanes, request, max_failovers=2, backoff_s=0.0, on_failover=moved.append)
        await stream.open()
        return [t async for out in stream for t in out.token_ids]

    async def run() -> list[list[int]]:
        while any(lane.loading for lane in lanes):  # (a lane still starting its worker gets no request: on a busy
            await asyncio.sleep(0.01)  # machine request 1 went to lane 0 too, and three moved)
        requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        return await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), 60)

    try:
        assert asyncio.run(run()) == alone
        assert moved == [0, 0]  # requests 0 and 2 went to lane 0 (the least loaded when each came)
        first = lanes[0].factory.actors[0]  # type: ignore[attr-defined]
        assert first.calls.count("verify") == LATE_AFTER + 1  # they had tokens from lane 0 before it failed
        assert not lanes[0].healthy and lanes[1].healthy and lanes[0].alive
    finally:
        for lane in lanes:
            lane.stop()


def test_a_lane_waiting_for_a_new_target_lets_a_leaving_client_go_and_admits_new_requests(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """The replaced target takes long to load its model (a large model: minutes): meanwhile the lane applies its
    queued commands, so a client that leaves stops counting against the replica's capacity, and a new request is
    admitted, rather than each waiting for the whole load."""
    factory = Factory(target, {0: "unschedulable", 1: "loading"})
    lane = _lane(target, factory)
    lane.start_poll_s = 0.05

    async def run() -> tuple[int, bool, list[list[int]]]:
        leaving = await lane.submit(Request("r0", PROMPTS[0], GREEDY))
        staying = await lane.submit(Request("r2", PROMPTS[2], GREEDY))
        while len(factory.actors) < 2 or "wait" not in factory.actors[1].calls:  # the lane waits for the new one
            await asyncio.sleep(0.01)
        await leaving.aclose()
        deadline = time.monotonic() + 5  # the replacement's start timeout is 60 s
        while lane.in_flight > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        left = lane.in_flight
        try:
            coming = await asyncio.wait_for(lane.submit(Request("r1", PROMPTS[1], GREEDY)), 5)
        except TimeoutError:
            return left, False, []
        admitted_while_loading = not factory.actors[1].loaded.is_set()
        factory.actors[1].loaded.set()
        return left, admitted_while_loading, [[t async for out in s for t in out.token_ids] for s in (staying, coming)]

    try:
        assert asyncio.run(run()) == (1, True, [alone[2], alone[1]])
        assert lane.healthy and lane.generations[WorkerRole.target] == 1
    finally:
        _release_and_stop([lane], [factory])


def test_requests_go_on_on_a_loaded_lane_while_their_lanes_new_target_loads(
    target: LlamaModel, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lane 0's target is lost a few tokens in and its replacement takes long to load its model (minutes for a large
    one): with lane 1 running and loaded, lane 0's requests move there at once and finish with the tokens they
    would have had alone, rather than wait for the load; lane 0 is loaded again once its new target has started,
    with no request to step. Each output joins the replica's shared suffix cache once, whole: the tokens so far had
    joined at the hand-off too, and again within the whole output on the other lane (counted twice)."""
    remembered: list[list[int]] = []
    monkeypatch.setattr(ModelFreeDrafter, "remember", lambda self, output, salt=None: remembered.append(list(output)))
    factories = [Factory(target, {0: "late", 1: "loading"}), Factory(target, {})]
    lanes: list[Lane] = []
    lanes += [_lane(target, factories[0], spare=lambda: lanes[1].healthy and not lanes[1].loading)]
    lanes += [_lane(target, factories[1])]
    moved: list[int] = []

    async def one(request: Request) -> list[int]:
        stream = FailoverStream(lambda: lanes, request, max_failovers=2, backoff_s=0.0, on_failover=moved.append)
        await stream.open()
        return [t async for out in stream for t in out.token_ids]

    async def run() -> list[list[int]] | None:
        requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), 10)  # its start timeout: 60 s
        except TimeoutError:
            return None

    try:
        assert asyncio.run(run()) == alone
        assert sorted(remembered) == sorted(alone)
        assert moved == [0, 0] and lanes[0].loading and not factories[0].actors[1].loaded.is_set()
        assert factories[0].actors[0].calls.count("verify") == LATE_AFTER + 1  # they had tokens from lane 0 first
        factories[0].actors[1].loaded.set()
        _wait(lambda: not lanes[0].loading)
        assert lanes[0].healthy and lanes[0].generations[WorkerRole.target] == 1
    finally:
        _release_and_stop(lanes, factories)


def test_requests_on_a_lane_loading_its_target_move_once_another_lane_is_loaded(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Lane 0 loses its target while no other lane is loaded, so its request stays for the new target's load, and a
    request submitted during the load is admitted there too. Once lane 1 is up, both move at once (they waited for
    the whole load before) and finish with the tokens they would have had alone, lane 0's new target still loading."""
    factories = [Factory(target, {0: "late", 1: "loading"}), Factory(target, {})]
    other_up = threading.Event()
    lanes = [_lane(target, factories[0], spare=other_up.is_set), _lane(target, factories[1])]
    moved: list[int] = []

    def visible() -> list[Lane]:
        return lanes if other_up.is_set() else lanes[:1]

    counted: dict[str, int] = {}

    async def one(request: Request) -> list[int]:
        stream = FailoverStream(visible, request, max_failovers=2, backoff_s=0.0, on_failover=moved.append)
        await stream.open()
        tokens = [t async for out in stream for t in out.token_ids]
        counted[request.request_id] = stream._failovers
        return tokens

    async def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def run() -> list[list[int]] | None:
        first = asyncio.ensure_future(one(Request("r0", PROMPTS[0], GREEDY)))
        await until(lambda: len(factories[0].actors) == 2 and lanes[0].loading)  # lost, its replacement loading
        second = asyncio.ensure_future(one(Request("r1", PROMPTS[1], GREEDY)))
        await until(lambda: lanes[0].in_flight == 2)  # admitted on the loading lane
        other_up.set()
        try:
            return list(await asyncio.wait_for(asyncio.gather(first, second), 10))  # its start timeout: 60 s
        except TimeoutError:
            return None

    try:
        assert asyncio.run(run()) == alone[:2]
        assert moved == [0, 0] and lanes[0].loading and not factories[0].actors[1].loaded.is_set()
        # r0 ran on lane 0 when it lost its target: a failover; r1, admitted during the load, never ran there
        assert counted == {"r0": 1, "r1": 0}
        gauges = lanes[0].metrics.render().decode()  # the loading lane's own: it holds neither request now
        assert 'specserve_queue_depth{lane="0"} 0.0' in gauges and 'specserve_running_sequences{lane="0"} 0.0' in gauges
    finally:
        _release_and_stop(lanes, factories)


def test_a_request_its_lane_lost_counts_there_until_its_stream_hears_of_it(target: LlamaModel) -> None:
    """Between the lane dropping a request with LaneLostError and its stream reading that (at the client's pace),
    the request is still the replica's (Router.submit's capacity check): the lane counts it until then, after which
    the move's pause or another lane does; a stream closed without reading it stops the count too."""
    lane = _lane(target, Factory(target, {0: "late"}, broken={1}))

    async def run() -> tuple[int, int, int]:
        requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:2])]
        streams = await asyncio.gather(*(lane.submit(r) for r in requests))
        deadline = time.monotonic() + 60
        while lane.healthy or lane.loop.has_work:  # until the lane has dropped both (their streams unread)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        held = lane.in_flight
        with pytest.raises(LaneLostError):
            async for _ in streams[0]:
                pass
        after_one = lane.in_flight
        await streams[1].aclose()
        return held, after_one, lane.in_flight

    try:
        assert asyncio.run(run()) == (2, 1, 0)
    finally:
        lane.stop()


def test_a_request_dropped_as_lost_is_counted_once_while_it_moves(target: LlamaModel) -> None:
    """A request the lane drops as lost moves from its running count to its handing-on count in one go: the router's
    capacity check, reading ``in_flight`` from the event loop while the lane thread drops it (here: inside the
    loop's abort, between the two), counted it twice, so a full replica refused a request it had room for (and the
    test above, reading as the lane dropped its last request, saw one request too many)."""
    lane = _lane(target, Factory(target, {0: "late"}, broken={1}))
    seen: list[int] = []
    abort = lane.loop.abort

    def counting_abort(request_id: str, *, remember: bool = True) -> bool:
        seen.append(lane.in_flight)
        return abort(request_id, remember=remember)

    lane.loop.abort = counting_abort  # type: ignore[method-assign]

    async def run() -> None:
        requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:2])]
        streams = await asyncio.gather(*(lane.submit(r) for r in requests))
        deadline = time.monotonic() + 60
        while len(seen) < len(requests):  # both dropped before either stream reads its drop
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        for stream in streams:
            with pytest.raises(LaneLostError):
                async for _ in stream:
                    pass

    try:
        asyncio.run(run())
        assert seen == [2, 2]  # each drop, read as it happens: both requests, each once
        assert lane.in_flight == 0
    finally:
        lane.stop()


def test_a_finished_request_leaves_the_count_before_its_client_reads_the_end(target: LlamaModel) -> None:
    """The lane handed a request's last output to its stream, then forgot it: a client that read its answer and sent
    the next request at once met a capacity check still counting the finished one (a 429 at full capacity; 1 in 200
    here unaided). Here the lane thread is slow to forget (0.3 s): the count must be down by the time the stream
    ends."""
    lane = _lane(target, Factory(target, {}))
    forget = lane._forget

    def slow_forget(request_id: str) -> None:
        if threading.current_thread() is lane._thread:
            time.sleep(0.3)
        forget(request_id)

    lane._forget = slow_forget  # type: ignore[method-assign]

    async def run() -> list[int]:
        counts = []
        for i in range(2):
            stream = await lane.submit(Request(f"r{i}", PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True)))
            outs = [out async for out in stream]
            assert outs[-1].finished
            counts.append(lane.in_flight)  # what Router.check_capacity reads as the answer ends
        return counts

    try:
        assert asyncio.run(run()) == [0, 0]
    finally:
        lane.stop()


def test_a_request_closed_while_its_lane_loses_it_is_not_counted_for_ever(target: LlamaModel) -> None:
    """The client leaves (its stream closes) while the lane is in the step that loses its workers: the lane drops
    the request as lost after its stream stopped listening, and the abort the close queued then ends its count."""
    factory = Factory(target, {}, broken={1})  # no replacement can be made: the lane drops its requests as lost
    lane = _lane(target, factory)
    gate, entered = threading.Event(), threading.Event()

    def blocked_verify(items: Any) -> Ref:
        def run(timeout: float | None) -> Any:
            entered.set()
            gate.wait(30)
            raise ActorUnschedulableError("the actor's placement group bundle is gone")

        return Ref(run)

    factory.actors[0].verify = Method(blocked_verify)

    async def run() -> int:
        stream = await lane.submit(Request("r0", PROMPTS[0], GREEDY))
        while not entered.is_set():  # the lane is inside the step that will lose its worker
            await asyncio.sleep(0.01)
        await stream.aclose()  # queues the abort; the drop comes first
        gate.set()
        deadline = time.monotonic() + 10
        while lane.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return lane.in_flight

    try:
        assert asyncio.run(run()) == 0
        assert not lane.healthy and lane.alive
    finally:
        gate.set()
        lane.stop()


# -- a lane whose draft worker is lost: plain decoding until a fresh one has started ---------------------------


@dataclass
class DraftActor:
    """A draft worker actor's handle: ``fault`` "late" loses it after one proposal, "hostile" at a proposal for the
    HOSTILE prompt, "start" fails its start, "loading" never finishes it."""

    model: LlamaModel
    fault: str | None
    worker: DraftWorker | None = None
    calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = Method(self._start)
        self.add = Method(lambda seq_id, params, position: self._fire(lambda w: w.add(seq_id, params, position)))
        self.release = Method(lambda ids: self._fire(lambda w: w.release(ids)))
        self.propose = Method(lambda items, features: self._propose(attach_features(items, features)))
        self.state = Method(lambda: Ref(lambda _: None))

    def _fire(self, fn: Callable[[DraftWorker], None]) -> None:
        if self.worker is not None:
            fn(self.worker)

    def _start(self, geometry: KVGeometry) -> Ref:
        self.calls.append("start")
        if self.fault == "start":
            cause = RuntimeError("CUDA out of memory")
            return Ref(lambda _: (_ for _ in ()).throw(RayTaskError("start", "Traceback ...", cause)))
        if self.fault == "loading":  # still loading its model: each wait for its start takes its whole timeout

            def still_loading(timeout: float | None) -> None:
                assert timeout is not None
                time.sleep(timeout)
                hung(timeout)

            return Ref(still_loading, ready=False)
        self.worker = DraftWorker(self.model, num_slots=geometry.num_slots, max_len=geometry.max_len)
        return Ref(lambda _: None)

    def _propose(self, items: Any) -> Ref:
        self.calls.append("propose")
        if self.fault == "hostile" and any(it.new_tokens[:2] == HOSTILE for it in items):
            return Ref(gone)  # one request's input kills the draft's process (a crashing kernel)
        if self.fault == "late" and self.calls.count("propose") > 1:
            error = ActorUnschedulableError("the actor's node is gone")
            return Ref(lambda _: (_ for _ in ()).throw(error))
        assert self.worker is not None
        worker = self.worker
        return Ref(lambda _: worker.propose(items))


class DraftFactory:
    """Draft proxies over fake actors: generation g has fault ``faults.get(g)``; ``broken`` ones cannot be made."""

    def __init__(self, model: LlamaModel, faults: dict[int, str], broken: set[int]) -> None:
        self.model, self.faults, self.broken = model, faults, broken
        self.actors: list[DraftActor] = []

    def create(self, lane: int, role: WorkerRole, generation: int) -> RemoteDraft:
        assert role == WorkerRole.draft  # the target is never lost in these tests
        if generation in self.broken:
            raise RuntimeError("placement group removed")
        actor = DraftActor(self.model, self.faults.get(generation))
        self.actors.append(actor)
        return RemoteDraft(actor, f"draft:{generation}", role, start_timeout_s=60.0, call_timeout_s=30.0)  # type: ignore[arg-type]


@dataclass
class BothFactory:
    """A lane's one factory for both roles: its targets from ``targets``, its drafts from ``drafts``."""

    targets: Factory
    drafts: DraftFactory

    def create(self, lane: int, role: WorkerRole, generation: int) -> RemoteTarget | RemoteDraft:
        return (self.targets if role == WorkerRole.target else self.drafts).create(lane, role, generation)

    def kill(self) -> None:
        """Nothing of its own to end (as a factory's)."""


def _drafting_lane(
    target: LlamaModel,
    drafts: DraftFactory,
    *,
    max_worker_restarts: int = 2,
    targets: Factory | None = None,
    **options: Any,
) -> Lane:
    """A lane drafting with ``drafts``' workers; its targets from ``targets`` (by default one that never fails,
    never replaced)."""
    engine = Engine(
        target,
        None,
        draft=target,  # its own weights as the draft: most drafts are accepted
        speculation=SpecConfig(method=SpecMethod.chain, sl=3),
        max_batch_size=4,
        max_model_len=64,
        eos_token_ids=set(),
    )
    loop = engine.loop
    geometry = KVGeometry(4, loop.max_model_len + loop.spec_headroom)
    target_worker = (targets or Factory(target, {})).create(0, WorkerRole.target, 0)
    draft_worker = drafts.create(0, WorkerRole.draft, 0)
    for worker in (target_worker, draft_worker):
        worker.start(geometry)
    loop.target, loop.draft = target_worker, draft_worker
    options = {"max_worker_restarts": max_worker_restarts, "worker_retry_s": 0.01} | options
    workers = {WorkerRole.target: target_worker, WorkerRole.draft: draft_worker}
    factory = drafts if targets is None else BothFactory(targets, drafts)
    return Lane(0, loop, workers, factory, geometry, metrics=ServeMetrics(), **options)  # type: ignore[arg-type]


def _wait(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_lost_draft_leaves_its_lane_decoding_plainly_until_a_new_one_starts(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """The draft actor is lost mid-stream; the first new one cannot be made and the second does not start: the
    requests go on without a draft and finish with their tokens alone; the third draft starts, is attached and
    drafts for the next requests."""
    drafts = DraftFactory(target, {0: "late", 2: "start"}, broken={1})
    lane = _drafting_lane(target, drafts)
    try:
        assert _run(lane, PROMPTS) == alone  # every request finishes, whatever became of the draft
        assert drafts.actors[0].calls.count("propose") == 2  # it drafted, then was lost mid-stream
        assert lane.healthy and lane.generations[WorkerRole.target] == 0  # the target was never touched
        _wait(lambda: not lane.draft_lost)
        assert lane.generations[WorkerRole.draft] == 3 and [a.fault for a in drafts.actors] == ["late", "start", None]
        # the two replacements made count, as a target's do: the one that never started as well (it counted
        # only once attached, so a draft failing to start again and again showed no restart at all)
        restarts = 'specserve_worker_restarts_total{lane="0",role="draft"} '
        assert restarts + "2.0" in lane.metrics.render().decode().splitlines()
        assert _run(lane, PROMPTS, tag="s") == alone
        assert "propose" in drafts.actors[2].calls  # the new draft drafts
    finally:
        lane.stop()


def test_a_lost_draft_never_counts_against_its_lanes_target(target: LlamaModel, alone: list[list[int]]) -> None:
    """A draft's death costs speculation only: it used to count as one of the lane's consecutive worker losses, so
    with no restarts left (here none allowed) the lane gave up every request and was reported degraded, and its
    healthy target was killed and made again."""
    drafts = DraftFactory(target, {0: "late"}, broken=set())
    lane = _drafting_lane(target, drafts, max_worker_restarts=0)
    try:
        assert _run(lane, PROMPTS) == alone
        assert drafts.actors[0].calls.count("propose") == 2  # it drafted, then was lost mid-stream
        assert lane.healthy and lane.generations[WorkerRole.target] == 0
    finally:
        lane.stop()


def test_a_suspect_whose_step_alone_loses_the_draft_is_not_failed(target: LlamaModel) -> None:
    """A suspect (lost in a batch on another lane) whose first step here loses the draft, not the target: a lost
    draft costs only speculation, so it steps alone again and finishes with its tokens. It was failed (a 500) as
    a request whose step alone had taken a target down."""
    drafts = DraftFactory(target, {0: "hostile"}, broken=set())
    lane = _drafting_lane(target, drafts)
    prompt = [*HOSTILE, 7]
    try:
        outcome = asyncio.run(asyncio.wait_for(_one(lane, Request("s", prompt, GREEDY, suspect=True)), 30))
        assert outcome == _engine(target).generate([prompt], GREEDY)[0].token_ids, outcome
        assert drafts.actors[0].calls.count("propose") == 1 and lane.generations[WorkerRole.target] == 0
    finally:
        lane.stop()


def test_a_dead_draft_is_detached_even_where_its_dead_targets_replacement_cannot_be_made(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Both workers die while the lane is idle and the target's first replacement cannot be made: the dead draft is
    detached and a new one made at once. It stayed attached until the next request's step found it dead (a step
    wasted, and no draft for the requests meanwhile), as the detach came after the target's replacement."""
    targets = Factory(target, {}, broken={1})
    drafts = DraftFactory(target, {}, broken=set())
    lane = _drafting_lane(target, drafts, targets=targets, idle_check_s=0.05)
    asked: list[str] = []

    def state() -> Ref:
        asked.append("state")
        return Ref(lambda _: None)

    drafts.actors[0].state = Method(state)
    try:
        assert _run(lane, PROMPTS[:1]) == alone[:1]
        _wait(lambda: bool(asked))  # an idle check asked both workers (the draft last); one more check is due
        lane.idle_check_s = None  # ... and that one is the last: no later check finds the dead draft instead
        drafts.actors[0].state = Method(lambda: Ref(gone))
        targets.actors[0].died = True
        _wait(lambda: lane.healthy and lane.generations[WorkerRole.target] == 2)  # the second try is made
        _wait(lambda: len(drafts.actors) == 2)  # with no request to step: the dead draft was detached
        _wait(lambda: not lane.draft_lost)
        assert _run(lane, PROMPTS, "s") == alone
        assert "propose" in drafts.actors[1].calls
    finally:
        lane.stop()


class _RecordedWaits(threading.Event):
    """The lane's stop event, recording the pauses the draft's restorer waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(timeout)


def test_while_no_draft_can_be_made_the_lane_serves_plainly_and_keeps_trying(
    target: LlamaModel, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lane_module, "MAX_RETRY_S", 0.05)
    drafts = DraftFactory(target, {0: "late"}, broken=set(range(1, 10_000)))
    lane = _drafting_lane(target, drafts)
    lane._stopping = stopping = _RecordedWaits()
    try:
        assert _run(lane, PROMPTS) == alone
        assert _run(lane, PROMPTS, tag="s") == alone  # new requests that ask for the draft are admitted, plainly
        assert lane.draft_lost and lane.healthy
        _wait(lambda: lane.generations[WorkerRole.draft] > 6)  # still trying
        assert len(drafts.actors) == 1
    finally:
        lane.stop()
    # at once, then after worker_retry_s, doubling up to MAX_RETRY_S
    assert stopping.waits[:7] == [0.0, 0.01, 0.02, 0.04, 0.05, 0.05, 0.05]


def test_a_request_that_kills_each_new_draft_brings_them_back_ever_more_slowly(
    target: LlamaModel, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request's input kills the draft's process at its first proposal for it. Each fresh draft was made at
    once and taken down at once: a draft model made and loaded per step for as long as that request ran. The
    requests still finish with their tokens alone (plainly while no draft is attached), and each draft after one
    that drafted no step is made after worker_retry_s, doubling up to MAX_RETRY_S."""
    monkeypatch.setattr(lane_module, "MAX_RETRY_S", 0.04)
    drafts = DraftFactory(target, dict.fromkeys(range(10_000), "hostile"), broken=set())
    lane = _drafting_lane(target, drafts)
    lane.step_delay_s = 0.02  # 12 steps of ~20 ms: time for a few drafts to come back and go down
    lane._stopping = stopping = _RecordedWaits()
    try:
        assert _run(lane, PROMPTS) == alone
        assert lane.healthy and lane.generations[WorkerRole.target] == 0
    finally:
        lane.stop()
    first = stopping.waits[: len(drafts.actors) - 1]  # each draft lost: its successor's first wait
    assert len(first) >= 3, stopping.waits
    assert first == [0.0, 0.01, 0.02, 0.04, 0.04, 0.04, 0.04, 0.04][: len(first)], stopping.waits


def test_a_draft_that_drafted_a_step_is_replaced_at_once_however_many_were_lost_before(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Each draft proposes once, and that step goes through, then its node is lost: the draft model did its work, so
    the loss is no sign of a hostile request, and each successor is made at once (no pause grows)."""
    drafts = DraftFactory(target, dict.fromkeys(range(10_000), "late"), broken=set())
    lane = _drafting_lane(target, drafts)
    lane.step_delay_s = 0.02  # time for a few drafts to come back and go down
    lane._stopping = stopping = _RecordedWaits()
    try:
        for tag in ("a", "b", "c"):  # most drafts are accepted: a run of requests is a few steps
            assert _run(lane, PROMPTS, tag=tag) == alone
        assert lane.healthy and lane.generations[WorkerRole.target] == 0
    finally:
        lane.stop()
    first = stopping.waits[: len(drafts.actors) - 1]  # each draft lost: its successor's first wait
    assert len(first) >= 3, stopping.waits
    assert first == [0.0] * len(first), stopping.waits


def test_the_pause_before_a_new_draft_doubles_to_its_cap_and_never_overflows() -> None:
    delays = [lane_module.draft_restore_delay(n, 5.0) for n in (1, 2, 3, 4, 8, 1026, 10**6)]
    assert delays == [0.0, 5.0, 10.0, 20.0, 300.0, 300.0, 300.0] and lane_module.MAX_RETRY_S == 300.0


def test_a_wait_for_a_start_that_never_finishes_times_out_or_is_cancelled(
    target: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actors, "START_POLL_S", 0.05)
    for cancel in (None, threading.Event()):  # one never set: the wait goes on in slices up to the timeout
        worker = RemoteDraft(DraftActor(target, "loading"), "draft:0", WorkerRole.draft, start_timeout_s=0.3)  # type: ignore[arg-type]
        t = time.monotonic()
        worker.start(KVGeometry(1, 16))
        with pytest.raises(actors.WorkerLostError, match=r"did not start within 0\.3 s"):
            worker.wait_started(cancel)
        assert 0.3 <= time.monotonic() - t < 5 and worker.dead
    cancel = threading.Event()
    worker = RemoteDraft(DraftActor(target, "loading"), "draft:1", WorkerRole.draft, start_timeout_s=60.0)  # type: ignore[arg-type]
    worker.start(KVGeometry(1, 16))
    threading.Timer(0.2, cancel.set).start()
    t = time.monotonic()
    assert worker.wait_started(cancel) is False
    assert time.monotonic() - t < 5 and not worker.dead  # left to the caller, who no longer wants it
    monkeypatch.setattr(actors, "START_POLL_S", 30.0)  # set before the wait begins: not even one slice is waited
    worker = RemoteDraft(DraftActor(target, "loading"), "draft:2", WorkerRole.draft, start_timeout_s=60.0)  # type: ignore[arg-type]
    worker.start(KVGeometry(1, 16))
    t = time.monotonic()
    assert worker.wait_started(cancel) is False
    assert time.monotonic() - t < 5 and not worker.dead


def test_a_lane_stopped_while_its_new_draft_loads_ends_that_draft_and_its_restorer(
    target: LlamaModel, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new draft is still loading its model when the lane stops: the restorer stops waiting for it within
    START_POLL_S (not after the worker's start timeout) and ends it, since it holds its resources (a GPU)."""
    killed: list[Any] = []
    monkeypatch.setattr(actors.ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    monkeypatch.setattr(actors, "START_POLL_S", 0.05)
    drafts = DraftFactory(target, {0: "late", 1: "loading"}, broken=set())
    before = set(threading.enumerate())
    lane = _drafting_lane(target, drafts)
    try:
        assert _run(lane, PROMPTS) == alone
        _wait(lambda: len(drafts.actors) == 2 and "start" in drafts.actors[1].calls)
        (restorer,) = [t for t in threading.enumerate() if t.name == "lane-0-draft" and t not in before]
    finally:
        lane.stop()
    restorer.join(actors.START_POLL_S + 5)  # the worker's start timeout is 60 s
    assert not restorer.is_alive()
    assert any(handle is drafts.actors[1] for handle in killed) and lane.draft_lost


def test_a_worker_that_dies_while_its_lane_is_idle_is_replaced_before_a_request_finds_it(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Found only by the next request before: that request waited for the replacement to load (minutes for a large
    model), and the lane, first choice for new traffic as the least loaded, was reported healthy meanwhile."""
    factory = Factory(target, {})
    lane = _lane(target, factory, idle_check_s=0.05)
    try:
        assert _run(lane, PROMPTS[:1]) == alone[:1]
        _wait(lambda: "state" in factory.actors[0].calls)  # an idle lane asks its workers to answer
        factory.actors[0].died = True
        _wait(lambda: lane.generations[WorkerRole.target] == 1)  # replaced with no request to step
        assert len(factory.actors) == 2 and lane.healthy
        verifies = factory.actors[0].calls.count("verify")
        assert _run(lane, PROMPTS, "s") == alone
        assert factory.actors[0].calls.count("verify") == verifies and "verify" in factory.actors[1].calls
    finally:
        lane.stop()
    quiet = _lane(target, Factory(target, {}), idle_check_s=None)  # no checks: nothing is called while idle
    try:
        assert _run(quiet, PROMPTS[:1]) == alone[:1]
        time.sleep(0.2)
        assert "state" not in quiet.workers[WorkerRole.target].handle.calls  # type: ignore[attr-defined]
    finally:
        quiet.stop()


def test_a_lane_whose_target_could_not_be_replaced_tries_again_with_no_request_to_step(
    target: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its requests went to other lanes and new ones go to healthy lanes first: the lane tries on its own, after a
    pause that doubles up to MAX_RETRY_S, and is healthy again once a replacement is made (the replica is not
    reported degraded for ever)."""
    monkeypatch.setattr(lane_module, "MAX_RETRY_S", 0.03)
    factory = Factory(target, {0: "unschedulable"}, broken={1, 2, 3})
    lane = _lane(target, factory, worker_retry_s=0.01)
    pauses: list[float] = []  # the pause each try waited for (the first, on the worker's failure: none)
    replace_target = lane._replace_target

    def recorded() -> None:
        pauses.append(lane._retry_pause)
        replace_target()

    lane._replace_target = recorded  # type: ignore[method-assign]
    try:
        assert all(isinstance(r, LaneLostError) for r in _run(lane, PROMPTS[:1]))
        _wait(lambda: lane.healthy)  # generations 1-3 cannot be made, the fourth can
        assert lane.generations[WorkerRole.target] == 4 and not lane.loop.has_work
    finally:
        lane.stop()
    assert pauses == [0.01, 0.01, 0.02, 0.03]


def test_a_lost_lanes_new_target_seen_started_by_a_step_is_kept_when_that_step_fails_on_its_request(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """A lost lane's replacement finished loading while a request's step waited for it, and that step then failed on
    the request's own input (the worker passing its self-check): the lane, still lost, killed that loaded target and
    made another (a whole model load more), as it replaced any target not starting."""
    factory = Factory(target, {0: "unschedulable", 2: "loading, hostile"}, broken={1})
    lane = _lane(target, factory, worker_retry_s=0.2)
    lane.start_poll_s = 0.05
    try:
        assert all(isinstance(r, LaneLostError) for r in _run(lane, PROMPTS[:1]))  # generation 1 cannot be made
        assert lane.lost_workers

        async def hostile() -> Result:
            task = asyncio.ensure_future(_one(lane, Request("h", [*HOSTILE, 1], GREEDY)))
            _wait(lambda: len(factory.actors) == 2)  # the lane's retry made generation 2, still loading
            await asyncio.sleep(0.2)  # the request's step waits for it
            factory.actors[1].loaded.set()
            return await asyncio.wait_for(task, 30)

        assert isinstance(asyncio.run(hostile()), RequestFailedError)  # its own input: failed alone
        time.sleep(0.5)  # (the lane's next retries, 0.2 s apart)
        assert lane.generations[WorkerRole.target] == 2 and len(factory.actors) == 2
        assert _wait(lambda: lane.healthy) is None and "check" in factory.actors[1].calls
        assert _run(lane, PROMPTS[:2], "s") == alone[:2]  # (the third is the hostile prompt)
    finally:
        _release_and_stop([lane], [factory])


def test_a_lane_whose_replacements_never_start_stays_degraded_until_one_does(
    target: LlamaModel, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacements that can be made but whose start fails (a model that does not load, a device out of memory):
    once the restarts ran out, the lane counted as healthy again as soon as the next replacement was made. It was
    then the first choice for new requests, each of which went through the restarts again, and the replica was never
    reported degraded. Now it stays degraded, tries again with no request to step, and is healthy only once a
    replacement has started."""
    monkeypatch.setattr(lane_module, "MAX_RETRY_S", 0.2)
    factory = Factory(target, {0: "unschedulable", 1: "start", 2: "start", 3: "start", 4: "start", 5: "start"})
    lane = _lane(target, factory, worker_retry_s=0.05)
    try:
        assert all(isinstance(r, LaneLostError) for r in _run(lane, PROMPTS[:1]))  # generations 1 and 2 never start
        assert lane.alive and not lane.healthy
        _wait(lambda: lane.healthy)  # generations 3-5 never start either; the sixth does
        assert lane.generations[WorkerRole.target] == 6
        assert [a.calls[:1] for a in factory.actors[3:]] == [["start"]] * 4
        assert _run(lane, PROMPTS, tag="s") == alone
    finally:
        lane.stop()


def test_a_lost_lane_admits_requests_while_its_new_target_loads(target: LlamaModel, alone: list[list[int]]) -> None:
    """Its restarts ran out and it tries again with no request to step: the try used to hold the lane thread for
    the new target's whole load (up to its start timeout), so a request sent to it (the replica's only lane, say)
    waited unadmitted all that time, and so did the aborts of those that left."""
    factory = Factory(target, {0: "unschedulable", 1: "unschedulable", 2: "unschedulable", 3: "loading"})
    lane = _lane(target, factory, worker_retry_s=0.01)
    lane.start_poll_s = 0.05

    async def run() -> tuple[bool, list[int]]:
        assert isinstance(await _one(lane, Request("r0", PROMPTS[0], GREEDY)), LaneLostError)  # generations 0-2
        while len(factory.actors) < 4 or "wait" not in factory.actors[3].calls:  # the retry waits for the fourth
            await asyncio.sleep(0.01)
        try:
            coming = await asyncio.wait_for(lane.submit(Request("r1", PROMPTS[1], GREEDY)), 5)  # its timeout: 60 s
        except TimeoutError:
            return False, []
        admitted_while_loading = not factory.actors[3].loaded.is_set()
        assert lane.loading and not lane.starting_up  # a replacement, not a first start: /health says degraded
        factory.actors[3].loaded.set()
        return admitted_while_loading, [t async for out in coming for t in out.token_ids]

    try:
        assert asyncio.run(run()) == (True, alone[1])
        assert lane.healthy and lane.generations[WorkerRole.target] == 3
    finally:
        _release_and_stop([lane], [factory])


def test_worker_losses_found_while_idle_count_in_a_row_only_until_every_worker_answers(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Two deaths hours apart, each found by the idle check and replaced, with the lane answering in between: the
    second used to count as the second loss in a row, so with one restart allowed the lane gave up and was reported
    degraded."""
    factory = Factory(target, {})
    lane = _lane(target, factory, idle_check_s=0.05, max_worker_restarts=1)
    health: list[bool] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.005):
            health.append(lane.healthy)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for generation in (0, 1):
            actor = factory.actors[generation]
            _wait(lambda a=actor: a.calls.count("state") >= 2)  # type: ignore[misc]  # answering (its replacement too)
            actor.died = True
            _wait(lambda g=generation: lane.generations[WorkerRole.target] == g + 1)  # type: ignore[misc]
        _wait(lambda: len(factory.actors) == 3 and factory.actors[2].calls.count("state") >= 2)
        done.set()
        watcher.join()
        assert len(health) > 10 and all(health)  # never reported degraded
        assert _run(lane, PROMPTS) == alone
    finally:
        done.set()
        lane.stop()


def test_an_idle_worker_whose_start_outlives_its_timeout_does_not_answer(
    target: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a timeout of seconds: a collector pause or a loaded host's stall could outlast a shorter one before the check)
    worker = RemoteTarget(Actor(target, "loading"), "target:0", WorkerRole.target, start_timeout_s=2.0)  # type: ignore[arg-type]
    worker.start(KVGeometry(1, 16))
    assert worker.answers() and worker.starting and not worker.dead  # still within its start timeout
    time.sleep(2.1)
    assert not worker.answers() and worker.dead and not worker.starting


def test_an_idle_workers_hang_is_found_within_the_answer_timeout_not_a_steps(target: LlamaModel) -> None:
    """The idle check's call is a cheap one to a worker with nothing to do: it waited up to the step's 600 s on a
    hung actor, the lane's thread held and the lane reported healthy all that time."""
    actor = Actor(target, None)
    waited: list[float | None] = []

    def hangs(timeout: float | None) -> Any:
        waited.append(timeout)
        return hung(timeout)

    actor.state = Method(lambda: Ref(hangs))
    worker = RemoteTarget(actor, "target:0", WorkerRole.target, call_timeout_s=600.0)  # type: ignore[arg-type]
    assert not worker.answers() and worker.dead
    assert waited == [actors.ANSWER_TIMEOUT_S] and actors.ANSWER_TIMEOUT_S <= 30


def test_a_lane_decodes_plainly_without_its_draft_and_drafts_again_once_one_is_attached(target: LlamaModel) -> None:
    """StepLoop.detach_draft / attach_draft mid-generation: no step is planned to draft while detached (nor timed
    as speculation), the output is plain decoding's, and a fresh draft worker drafts from its catch-up on."""
    engine = Engine(
        target,
        None,
        draft=target,
        speculation=SpecConfig(method=SpecMethod.chain, sl=3),
        max_batch_size=4,
        max_model_len=64,
        eos_token_ids=set(),
    )
    loop = engine.loop
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = _engine(target).generate(PROMPTS, params)
    for i, p in enumerate(PROMPTS):
        loop.add_request(Request(f"r{i}", p, params))
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}

    def steps(n: int | None) -> list[tuple[int, int]]:
        """(planned depth, levels drafted) of each step, ``n`` of them or to the end."""
        done = []
        while loop.has_work and (n is None or len(done) < n):
            for out in loop.step():
                outs[out.request_id] += out.token_ids
            m = loop.stats.metrics[-1]
            done.append((max(m.planned), m.levels))
        return done

    assert max(levels for _, levels in steps(3)) > 0  # drafting
    loop.detach_draft()
    assert steps(3) == [(0, 0)] * 3  # planned plain, so neither the guard nor the tree floor times it as a try
    loop.attach_draft(DraftWorker(target, num_slots=4, max_len=loop.max_model_len + loop.spec_headroom))
    assert max(levels for _, levels in steps(None)) > 0  # drafts again
    assert [outs[f"r{i}"] for i in range(len(PROMPTS))] == [c.token_ids for c in plain]


def test_a_worker_that_fails_everything_and_its_self_check_is_replaced_and_every_request_goes_on(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """An actor alive but broken (a poisoned device context): every verify fails with an error naming no sequence.
    Bisection narrows it to a lone request, whose failure would be pinned on the request; the worker's self-check
    fails, so the worker is replaced instead and no request is lost."""
    factory = Factory(target, {0: "poisoned"})
    lane = _lane(target, factory)
    try:
        assert _run(lane, PROMPTS) == alone
        assert lane.generations[WorkerRole.target] == 1 and lane.healthy
        assert "check" in factory.actors[0].calls and "check" not in factory.actors[1].calls
    finally:
        lane.stop()


def test_a_broken_worker_whose_error_names_a_sequence_is_replaced_and_no_request_is_failed(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Non-finite weights fail every step naming its first row (no mass to sample): the lane failed one request a
    step and never checked or replaced the worker, so every request it took failed."""
    factory = Factory(target, {0: "nan"})
    lane = _lane(target, factory)
    try:
        assert _run(lane, PROMPTS) == alone
        assert lane.generations[WorkerRole.target] == 1 and lane.healthy
        assert "check" in factory.actors[0].calls
    finally:
        lane.stop()


def test_a_request_first_in_the_batch_when_two_workers_break_in_turn_is_not_failed(
    target: LlamaModel, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers in turn go non-finite, each failure naming the batch's first row. That request had been marked
    as the one that broke the first worker, and the mark outlived the steps it then ran on the fresh one: the
    second, unrelated failure failed it as having broken a fresh worker twice. A suspect that has run
    SUSPECT_CLEAR_STEPS steps without harm is no longer one; every request finishes with its tokens."""
    monkeypatch.setattr(lane_module, "SUSPECT_CLEAR_STEPS", 2)
    factory = Factory(target, {0: "nan after 1", 1: "nan after 3"})  # the second breaks 3 clean steps later
    lane = _lane(target, factory, max_worker_restarts=5)
    try:
        assert _run(lane, PROMPTS) == alone
        assert lane.generations[WorkerRole.target] == 2 and lane.healthy
    finally:
        lane.stop()


def test_a_request_that_breaks_the_fresh_worker_again_within_the_clean_steps_is_still_failed(
    target: LlamaModel, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the rule above: a request whose damage shows a step late (each worker breaks one clean
    step after it is named) is still failed the second time, the workers no longer replaced for it."""
    monkeypatch.setattr(lane_module, "SUSPECT_CLEAR_STEPS", 2)
    factory = Factory(target, {0: "loading, nan after 1", 1: "nan after 1"})  # each names the first row, request 0
    lane = _lane(target, factory, max_worker_restarts=5)
    _load_once_all_are_queued(lane, factory.actors[0], len(PROMPTS))
    try:
        results = _run(lane, PROMPTS)
        assert isinstance(results[0], RequestFailedError) and results[1:] == alone[1:], results
        assert lane.generations[WorkerRole.target] == 2 and lane.healthy
    finally:
        lane.stop()


def test_a_suspect_that_ran_clean_since_is_not_failed_for_a_later_loss_of_its_own_step(
    target: LlamaModel, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random target losses: request 1's step alone is lost once in a first search (it is marked), then runs clean
    for a while; a later, unrelated search loses its step alone once more. Both losses were counted as its own
    twice, and it was failed; a suspect that has run SUSPECT_CLEAR_STEPS clean steps is no longer one."""
    monkeypatch.setattr(lane_module, "SUSPECT_CLEAR_STEPS", 2)
    # targets lost at given verifies, whatever they run: 0 in the full step of the 3 prompts, 1 in the half [1, 2]
    # (after [0]), 2 in [1] alone; 3 runs [1], [2] and a full step, and is lost in the next; 4 and 5 as 1 and 2
    faults = {0: "loading, dies at 1", 1: "dies at 2", 2: "dies at 1", 3: "dies at 4", 4: "dies at 2", 5: "dies at 1"}
    factory = Factory(target, faults)
    lane = _lane(target, factory, max_worker_restarts=5)
    _load_once_all_are_queued(lane, factory.actors[0], len(PROMPTS))
    try:
        assert _run(lane, PROMPTS) == alone
        assert lane.generations[WorkerRole.target] == 6 and lane.healthy
    finally:
        lane.stop()


def test_a_target_that_fails_to_start_is_not_blamed_on_the_request_stepped_next(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Random target losses, and a replacement that fails to start just as the lane is about to step request 1
    alone: that request never ran, but was marked as the one that took a target down, and the first real loss of
    its own step then failed it as a second."""
    factory = Factory(target, {0: "loading, dies at 1", 1: "dies at 2", 2: "start", 3: "dies at 1"})
    lane = _lane(target, factory, max_worker_restarts=5)
    _load_once_all_are_queued(lane, factory.actors[0], len(PROMPTS))
    try:
        assert _run(lane, PROMPTS) == alone
        assert lane.generations[WorkerRole.target] == 4 and lane.healthy
    finally:
        lane.stop()


def test_a_request_that_fails_alone_on_a_worker_that_passes_its_self_check_is_failed_alone(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    factory = Factory(target, {0: "hostile"})
    lane = _lane(target, factory)
    try:
        results = _run(lane, PROMPTS)
        assert results[:2] == alone[:2] and isinstance(results[2], RequestFailedError), results
        assert lane.generations[WorkerRole.target] == 0 and "check" in factory.actors[0].calls
    finally:
        lane.stop()


def test_a_request_that_breaks_a_fresh_worker_alone_twice_is_failed_not_the_worker_replaced_for_ever(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """The request breaks every worker it runs on (its self-check fails after): the lane replaced the worker and let
    every request go on, the culprit too; the innocent half's steps reset the loss count, so it reloaded its target
    over and over and the culprit got no tokens, until it moved to break other lanes."""
    factory = Factory(target, dict.fromkeys(range(10), "poisoning"))
    lane = _lane(target, factory, max_worker_restarts=5)
    try:
        results = _run(lane, PROMPTS)
        assert results[:2] == alone[:2] and isinstance(results[2], RequestFailedError), results
        assert lane.generations[WorkerRole.target] == 2 and lane.healthy  # replaced after each of its two tries
    finally:
        lane.stop()


def test_the_self_check_runs_one_token_and_refuses_non_finite_logits(target: LlamaModel) -> None:
    from specserve.models.tiny import tiny_head

    self_check(target)
    head = tiny_head(target, seed=1)
    self_check(head)
    broken = tiny_model(tiny_config(), seed=0)
    with torch.no_grad():
        broken.norm.fill_(float("nan"))
    with pytest.raises(WorkerBrokenError, match="not finite"):
        self_check(broken)
    with torch.no_grad():
        head.layer.o_proj.weight.fill_(float("inf"))
    with pytest.raises(WorkerBrokenError, match="not finite"):
        self_check(head)


@pytest.mark.parametrize("draft_head", [False, True])
def test_every_worker_actor_runs_its_self_check(draft_head: bool) -> None:
    from deployments.app_args import AppArgs, TinyModels

    args = AppArgs(tiny=TinyModels(draft_head=draft_head))
    for role, cls in actors.ACTOR_CLASSES.items():
        host = cls(args.recipe(role), "cpu", None, False)  # the actor's class, called in this process
        host.check()
        for p in host.model.parameters():
            with torch.no_grad():
                p.fill_(float("nan"))
        with pytest.raises(WorkerBrokenError):
            host.check()


def test_an_actors_model_builds_where_ray_is_missing() -> None:
    """The GPU image has no Ray: the CUDA test of a GPU actor's tiny head failed there on the build's import."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from deployments.app_args import AppArgs, TinyModels, WorkerRole\n"
        "from deployments.recipe_models import build_model\n"
        "args = AppArgs(tiny=TinyModels(draft_head=True))\n"
        "print(*(type(build_model(args.recipe(r), 'cpu')).__name__ for r in (WorkerRole.target, WorkerRole.draft)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["LlamaModel", "EagleHead"]


def test_submits_queued_when_the_lane_thread_stops_are_answered(target: LlamaModel) -> None:
    """The lane thread dies inside a step (here its metrics raise) while a second request waits in its queue: that
    request gets a 503 at once instead of waiting for ever, and a submit after it is refused."""
    stepping, queued = threading.Event(), threading.Event()

    class Metrics(ServeMetrics):
        def lane_step(self, *args: Any, **kwargs: Any) -> None:
            stepping.set()
            queued.wait(10)
            raise RuntimeError("a bug after the commit")

    lane = _lane(target, Factory(target, {}), metrics=Metrics())

    async def run() -> tuple[Result, Result]:
        first = asyncio.ensure_future(_one(lane, Request("a", PROMPTS[0], GREEDY)))
        while not stepping.is_set():
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(_one(lane, Request("b", PROMPTS[1], GREEDY)))
        await asyncio.sleep(0.2)  # its submit is in the lane's queue
        queued.set()
        return await asyncio.wait_for(first, 20), await asyncio.wait_for(second, 20)

    try:
        first, second = asyncio.run(run())
        assert isinstance(first, WorkerFailedError) and isinstance(second, WorkerFailedError)
        # the request that was on the lane when its thread broke is not moved (it may have broken it); the one
        # still waiting to be admitted never ran there and may go to another lane
        # (a move that spends no failover: LaneHandoffError)
        assert not isinstance(first, LaneLostError) and isinstance(second, LaneHandoffError)
        deadline = time.monotonic() + 5
        while lane.alive:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert lane.in_flight == 0
        with pytest.raises(LaneHandoffError, match="stopped"):
            asyncio.run(lane.submit(Request("c", PROMPTS[2], GREEDY)))
    finally:
        queued.set()
        lane.stop()


def test_a_lane_told_to_stop_tells_its_running_requests_so_they_can_move(target: LlamaModel) -> None:
    """Stopped mid-generation (the replica going away), the lane drops its running request with LaneLostError,
    which the router answers by moving it; its stream used to wait for ever."""
    stepping = threading.Event()

    class Metrics(ServeMetrics):
        def lane_step(self, *args: Any, **kwargs: Any) -> None:
            stepping.set()
            super().lane_step(*args, **kwargs)

    lane = _lane(target, Factory(target, {}), metrics=Metrics(), step_delay_s=0.05)

    async def run() -> Result:
        first = asyncio.ensure_future(_one(lane, Request("a", PROMPTS[0], GREEDY)))
        while not stepping.is_set():
            await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, lane.stop)
        return await asyncio.wait_for(first, 20)

    try:
        result = asyncio.run(run())
    finally:
        lane.stop()
    assert isinstance(result, LaneLostError) and "stopped" in str(result)
    assert not lane.alive


def test_lanes_stopped_together_share_one_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica told every lane to stop, then waited STOP_JOIN_TIMEOUT_S for each stuck one in turn: 10 s a
    lane, so at three lanes Serve's 30 s graceful shutdown killed it before the last lanes' workers were ended."""
    from types import SimpleNamespace

    from deployments.lane import stop_lanes

    monkeypatch.setattr(lane_module, "STOP_JOIN_TIMEOUT_S", 0.3)
    waited: list[float] = []
    killed: list[int] = []

    def stuck_lane(i: int) -> Any:  # its thread never ends (a step stuck in a call to a hung worker)
        thread = SimpleNamespace(join=lambda timeout: (waited.append(timeout), time.sleep(timeout)))
        fake = SimpleNamespace(_thread=thread, request_stop=lambda: None, _kill_workers=lambda: killed.append(i))
        fake._grammar_thread = SimpleNamespace(shutdown=lambda wait: None)
        fake.finish_stop = lambda by: Lane.finish_stop(fake, by)  # type: ignore[arg-type]
        return fake

    stop_lanes([stuck_lane(i) for i in range(3)])
    assert killed == [0, 1, 2] and sum(waited) < 0.45, waited  # one wait of 0.3 s in all, not 0.3 s a lane


def test_a_lane_stopped_during_a_long_step_makes_no_new_worker_after_it(
    target: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() waits STOP_JOIN_TIMEOUT_S, then kills the workers under a step still in flight: that step failed, and
    the lane thread took the kill for a loss and made a new target actor, which nothing would ever end."""
    monkeypatch.setattr(lane_module, "STOP_JOIN_TIMEOUT_S", 0.2)
    factory = Factory(target, {})
    lane = _lane(target, factory)
    entered, release = threading.Event(), threading.Event()

    def slow_verify(items: Any) -> Ref:
        entered.set()
        release.wait(20)
        return Ref(gone)  # killed under the step

    factory.actors[0].verify = Method(slow_verify)

    async def run() -> Result:
        first = asyncio.ensure_future(_one(lane, Request("a", PROMPTS[0], GREEDY)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, lane.stop)  # back after 0.2 s, the step in flight
        release.set()
        return await asyncio.wait_for(first, 20)

    try:
        result = asyncio.run(run())
        lane._thread.join(20)
    finally:
        release.set()
        lane.stop()
    assert isinstance(result, LaneLostError) and not lane.alive
    assert len(factory.actors) == 1  # no replacement made once told to stop


def test_a_request_the_loop_fails_to_admit_gets_an_error_body_and_never_runs(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    class Refusing:
        def on_request(self, seq: Any) -> None:
            raise ValueError("an observer's bug")

    lane = _lane(target, Factory(target, {}))
    observers = lane.loop.observers
    observers.append(Refusing())  # type: ignore[arg-type]
    try:
        with pytest.raises(RequestFailedError):
            asyncio.run(lane.submit(Request("x", PROMPTS[0], GREEDY)))
        assert not lane.loop.has_work and lane.loop.request_id(0) is None and lane.in_flight == 0
        observers.pop()
        assert _run(lane, PROMPTS) == alone
    finally:
        lane.stop()


def test_capacity_counts_the_kv_slots_that_fit_not_the_configured_batch() -> None:
    from types import SimpleNamespace

    from deployments.router import Router

    cls = Router.func_or_class
    router = cls.__new__(cls)
    router.args = SimpleNamespace(max_queued_requests=5, retry_after_s=1, num_lanes=2, max_batch_size=16)
    router._lane_slots = 3  # 3 slots fit per lane, not 16
    router.lanes = [SimpleNamespace(healthy=True, loading=False), SimpleNamespace(healthy=True, loading=False)]
    router._metrics = ServeMetrics()
    assert router.capacity == 6 + 5
    # a lane that lost its workers runs nothing until its replacement has started: its slots are not counted,
    # else the other lane queued more than max_queued_requests and Retry-After came out too short
    router.lanes[1].healthy = False
    assert router.capacity == 3 + 5 and router.running_slots == 3
    assert router.most_capacity == 6 + 5  # (a request of more choices than 8 and at most 11 waits: a 429)
    # ... nor one loading a replacement while the other serves (it hands its requests on): it was counted
    router.lanes[1].healthy, router.lanes[1].loading = True, True
    assert router.capacity == 3 + 5 and router.running_slots == 3
    router.lanes[0].loading = True  # every lane loading (a replica starting): each keeps its requests
    assert router.capacity == 6 + 5
    router.lanes[0].healthy = router.lanes[1].healthy = False  # none: the requests wait for one lane's slots
    assert router.capacity == 3 + 5
    router.lanes = []


def test_a_replica_whose_lane_lost_its_workers_is_degraded_and_kept_while_another_lane_serves() -> None:
    """One lane giving up moved its requests to the other, and then failed Serve's health check while its new
    target loaded: Serve killed the replica, and every stream of the lane that served them with it."""
    from types import SimpleNamespace

    from deployments.router import Router

    cls = Router.func_or_class
    router = cls.__new__(cls)
    router.lanes = [SimpleNamespace(alive=True, healthy=True, loading=True, starting_up=True) for _ in range(2)]
    assert router.health().status.value == "ok"  # a replica starting: every lane loading its models
    router.lanes[0].loading = router.lanes[0].starting_up = False
    assert router.health().status.value == "degraded"  # one serves, the other hands its requests to it
    router.lanes[1].loading = router.lanes[1].starting_up = False
    assert router.health().status.value == "ok"
    router.check_health()
    router.lanes[1].loading = True  # loading a replacement target: it was reported ok
    assert router.health().model_dump(mode="json") == {"status": "degraded", "lanes": 2, "lanes_alive": 2}
    router.check_health()
    router.lanes[0].loading = True  # both reloading lost targets: nothing serves, and it was reported ok
    assert router.health().model_dump(mode="json") == {"status": "degraded", "lanes": 2, "lanes_alive": 2}
    router.check_health()  # (still kept: each lane has its workers coming)
    router.lanes[0].loading = False
    router.lanes[1].healthy = False  # lost its workers: the replica says so, and is kept
    assert router.health().model_dump(mode="json") == {"status": "degraded", "lanes": 2, "lanes_alive": 1}
    router.check_health()
    router.lanes[0].healthy = False  # no lane has its workers
    assert router.health().status.value == "failing" and router.health().lanes_alive == 0
    with pytest.raises(RuntimeError, match="no lane has its workers"):
        router.check_health()
    router.lanes[0] = SimpleNamespace(alive=False, healthy=False, loading=False, starting_up=False)  # thread stopped
    router.lanes[1].healthy = True
    assert router.health().status.value == "failing" and router.health().lanes_alive == 1
    with pytest.raises(RuntimeError, match="thread has stopped"):
        router.check_health()
    router.lanes = []  # (the replica's __del__ stops its lanes)


def test_the_deployment_bounds_the_proxy_queue_in_front_of_the_router() -> None:
    from deployments.app import CONTROL_REQUEST_HEADROOM, app_builder
    from deployments.app_args import AppArgs, TinyModels

    config = app_builder({"tiny": {}})._bound_deployment._deployment_config
    limit = AppArgs(tiny=TinyModels()).capacity + CONTROL_REQUEST_HEADROOM
    assert config.max_ongoing_requests == limit and config.max_queued_requests == limit


def test_the_deployment_places_its_bundles_with_the_configured_strategy() -> None:
    from deployments.app import app_builder

    replica = app_builder({"tiny": {}, "placement_strategy": "STRICT_SPREAD"})._bound_deployment._replica_config
    assert replica.placement_group_strategy == "STRICT_SPREAD"
    # bundle 0 the router, then the lane's target and draft actors (bundle_index's order)
    assert replica.placement_group_bundles == [{"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 0.5}]


def test_the_router_moves_requests_with_the_configured_failover_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from deployments import router as router_module
    from deployments.failover import Moving

    made: list[dict[str, Any]] = []

    class Opened:
        def __init__(self, lanes: object, request: Request, **kwargs: Any) -> None:
            made.append(kwargs)

        async def open(self) -> None:
            pass

    monkeypatch.setattr(router_module, "FailoverStream", Opened)
    cls = router_module.Router.func_or_class
    router = cls.__new__(cls)
    router.args = SimpleNamespace(
        max_failovers=5, failover_backoff_s=0.25, max_queued_requests=4, num_lanes=1, max_batch_size=2
    )
    router._lane_slots = 2
    router.lanes = [SimpleNamespace(healthy=True, loading=False, in_flight=0)]
    router._metrics = ServeMetrics()
    router._moving = Moving()
    asyncio.run(router.submit(Request("r", [1, 2], SamplingParams(max_tokens=4))))
    assert len(made) == 1 and made[0]["backoff_s"] == 0.25 and made[0]["max_failovers"] == 5
    assert made[0]["moving"] is router._moving  # the requests pausing before a move, which capacity counts
    made[0]["on_failover"](1)
    made[0]["on_rebalance"](0)
    made[0]["on_rebalance"](0)
    metrics = router._metrics.render().decode()  # each kind of move on its own counter, by the lane it left
    assert 'specserve_request_failovers_total{lane="1"} 1.0' in metrics
    assert 'specserve_requests_rebalanced_total{lane="0"} 2.0' in metrics
    assert 'specserve_request_failovers_total{lane="0"}' not in metrics
    router.lanes = []


def test_a_router_hands_its_lanes_the_room_and_spare_of_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each lane the router makes asks it for the free slots of the other serving lanes (less the requests on their
    way) and whether another could take its requests. A lane made without them reads no room and no spare: full
    lanes stop handing waiting requests on, and a lane loading its target keeps them, and every test of the lanes
    (which pass their own) still passes."""
    from types import SimpleNamespace

    from deployments import router as router_module

    made: list[SimpleNamespace] = []

    class Made(SimpleNamespace):
        def __init__(self, index: int, *rest: object, **options: Any) -> None:
            super().__init__(index=index, options=options, alive=True, healthy=True, loading=False)
            self.in_flight = self.handing_on = 0
            made.append(self)

    async def on_a_gpu(*args: object) -> None:  # (the host check: nothing of the host's to count)
        return None

    class Unstarted:  # (no actor)
        def __init__(self) -> None:
            self.handle = SimpleNamespace(host_need=SimpleNamespace(remote=on_a_gpu))

        def start(self, geometry: KVGeometry) -> None:
            pass

    class Target(Unstarted, RemoteTarget):
        pass

    class Draft(Unstarted, RemoteDraft):
        pass

    class Workers:
        def __init__(self, *args: object) -> None:
            pass

        def create(self, i: int, role: WorkerRole, attempt: int) -> RemoteTarget | RemoteDraft:
            return Target() if role == WorkerRole.target else Draft()

    async def infos(workers: object, timeout_s: float) -> tuple[object, object]:
        info = SimpleNamespace(max_positions=512, vocab_size=64, eos_token_ids=[1], features=None)
        return info, info

    monkeypatch.setattr(router_module, "Lane", Made)
    monkeypatch.setattr(router_module, "WorkerFactory", Workers)
    monkeypatch.setattr(router_module, "get_current_placement_group", lambda: None)
    replica = SimpleNamespace(app_name="a", replica_tag="r")
    monkeypatch.setattr(router_module.serve, "get_replica_context", lambda: replica)
    monkeypatch.setattr(router_module, "build_step_loop", lambda *args: object())
    monkeypatch.setattr(router_module, "PromptEncoder", lambda *args: object())
    monkeypatch.setattr(router_module, "eos_ids_of", lambda eos, tokenizer: eos)
    cls = router_module.Router.func_or_class
    monkeypatch.setattr(cls, "_model_infos", staticmethod(infos))
    args = AppArgs.model_validate({"tiny": {}, "num_lanes": 3, "max_batch_size": 4, "freeze_gc": False})
    router = cls.__new__(cls)
    asyncio.run(router.__init__(args))
    try:
        assert router.lanes == made and [lane.index for lane in made] == [0, 1, 2]
        made[1].in_flight, made[2].in_flight = 1, 4
        assert [lane.options["room"]() for lane in made] == [3, 4, 7]  # free slots: 4, 3 and 0, the others' summed
        made[0].loading = True  # loading: its slots are no room for the others
        assert [lane.options["room"]() for lane in made] == [3, 0, 3]
        made[2].handing_on = 1  # dropped by lane 2, not yet resubmitted: on its way to another lane
        with router._moving.pausing():  # ... and one more pausing before its move
            assert [lane.options["room"]() for lane in made] == [1, 0, 2]
        assert [lane.options["spare"]() for lane in made] == [True, True, True]
        made[1].healthy = made[2].alive = False
        assert [lane.options["spare"]() for lane in made] == [False, False, False]  # lane 0 is loading
        made[0].loading = False
        assert [lane.options["spare"]() for lane in made] == [False, True, True]
    finally:
        router.lanes = []


def test_a_replica_whose_workers_never_load_fails_its_start_with_a_message() -> None:
    """Its start awaited the actors' models (and KV sizes) with no bound: a load that stalls held the replica in
    its constructor for ever, the deployment never failing nor saying why."""
    from types import SimpleNamespace

    from deployments.router import Router

    async def run(answers: bool) -> object:
        loop = asyncio.get_running_loop()

        def info() -> asyncio.Future[str]:
            answer: asyncio.Future[str] = loop.create_future()
            if answers:
                answer.set_result("info")
            return answer

        handle = SimpleNamespace(info=SimpleNamespace(remote=info))
        workers = {WorkerRole.target: SimpleNamespace(handle=handle)}
        return await Router.func_or_class._model_infos(workers, 0.2)

    assert asyncio.run(run(answers=True)) == ("info", None)
    with pytest.raises(RuntimeError, match=r"have not loaded their models within worker_start_timeout_s \(0\.2 s\)"):
        asyncio.run(asyncio.wait_for(run(answers=False), 10))


# -- lanes still starting their workers ------------------------------------------------------------------------


def _spare_lanes(target: LlamaModel, factories: list[Factory], **options: Any) -> list[Lane]:
    """A lane per factory, each asking the others to take its requests as Router._spare_for does, and polling a
    starting worker every 20 ms."""
    lanes: list[Lane] = []
    for i, factory in enumerate(factories):
        spare = lambda i=i: any(o.index != i and o.alive and o.healthy and not o.loading for o in lanes)  # noqa: E731
        lanes.append(_lane(target, factory, spare=spare, **options))
        lanes[-1].index = i
        lanes[-1].start_poll_s = 0.02
    return lanes


def test_a_lane_whose_draft_is_still_starting_gets_no_requests_while_another_lane_is_loaded(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """At a replica's start a lane may have its target up and its draft still loading: it steps nothing until the
    draft has started, so it counts as loading. It was taken for loaded (only its target was looked at): being the
    least loaded it was picked for each new request, then handed each on, a failover charged every time."""
    drafting = _drafting_lane(target, DraftFactory(target, {0: "loading"}, set()))
    drafting.index = 1
    lanes = [_lane(target, Factory(target, {})), drafting]
    moved: list[int] = []

    async def one(request: Request) -> tuple[list[int], int]:
        stream = FailoverStream(lambda: lanes, request, max_failovers=2, backoff_s=0.0, on_failover=moved.append)
        await stream.open()
        tokens = [t async for out in stream for t in out.token_ids]
        return tokens, lanes.index(stream._lane)  # type: ignore[arg-type]

    async def run() -> list[tuple[list[int], int]]:
        return [await asyncio.wait_for(one(Request(f"r{i}", p, GREEDY)), 30) for i, p in enumerate(PROMPTS)]

    try:
        assert drafting.loading and drafting.starting_up and not lanes[0].loading
        assert asyncio.run(run()) == [(tokens, 0) for tokens in alone]
        assert moved == [] and drafting.in_flight == 0
    finally:
        for lane in lanes:
            lane.stop()


def test_two_lanes_losing_their_targets_together_hand_requests_over_without_spending_their_failovers(
    target: LlamaModel,
) -> None:
    """Both targets die at once (one node under both). The lane that notices first hands its requests to the other
    (its loss not yet noticed), which notices a step later, reloads and keeps them; the first lane's reload done,
    they are handed back there and finish with the tokens they would have had alone. Each request is charged for
    the lanes that lost it while it ran there (at most two each here), within ``max_failovers``."""
    from tests.conftest import greedy_reference

    long = SamplingParams(max_tokens=50, ignore_eos=True)
    prompts = {"r0": [5, 9, 13], "r1": [100, 200, 300]}
    factories = [Factory(target, {1: "loading"}), Factory(target, {1: "loading"})]
    lanes = _spare_lanes(target, factories, step_delay_s=0.02)
    moved: list[tuple[str, int]] = []
    tokens: dict[str, list[int]] = {name: [] for name in prompts}

    async def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.005)

    async def read(stream: FailoverStream, name: str) -> Result:
        try:
            async for out in stream:
                tokens[name] += out.token_ids
        except APIError as e:
            return e
        return tokens[name]

    async def run() -> list[Result]:
        streams = {}
        for name, prompt in prompts.items():
            streams[name] = FailoverStream(
                lambda: lanes,
                Request(name, prompt, long),
                max_failovers=2,
                backoff_s=0.0,
                on_failover=lambda lane, name=name: moved.append((name, lane)),
            )
            await streams[name].open()
        readers = [asyncio.ensure_future(read(stream, name)) for name, stream in streams.items()]
        await until(lambda: all(len(t) >= 3 for t in tokens.values()))
        for lane in lanes:
            lane.workers[WorkerRole.target].handle.died = True  # type: ignore[attr-defined]
        await until(lambda: all(len(f.actors) == 2 for f in factories) and all(lane.loading for lane in lanes))
        await until(lambda: any(lane.in_flight == 2 for lane in lanes))
        holder = next(i for i, lane in enumerate(lanes) if lane.in_flight == 2)
        factories[1 - holder].actors[1].loaded.set()  # the other lane's reload finishes first
        await until(lambda: lanes[1 - holder].in_flight == 2)  # handed back
        factories[holder].actors[1].loaded.set()
        results = list(await asyncio.wait_for(asyncio.gather(*readers), 30))
        assert all(stream._failovers <= 2 for stream in streams.values())
        return results

    try:
        results = asyncio.run(run())
        assert results == [greedy_reference(target, p, 50) for p in prompts.values()], moved
        assert len(moved) >= 3  # the first loss, and both handed back
    finally:
        _release_and_stop(lanes, factories)


def test_a_lost_lane_hands_on_its_queued_requests_without_spending_their_failovers(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Lane 0 (one running slot) loses its target while lane 1 is loaded: the running request moves as lost (a
    failover), the queued one, which never ran there, as handed on (none; it was charged one before)."""
    factories = [Factory(target, {0: "late"}), Factory(target, {})]
    lanes = _spare_lanes(target, factories, step_delay_s=0.05)
    lanes[0].loop.max_batch_size = 1
    counted: dict[str, int] = {}
    opened = threading.Event()

    def visible() -> list[Lane]:  # both requests go to lane 0; then any lane may take them
        return lanes if opened.is_set() else lanes[:1]

    async def one(stream: FailoverStream, name: str) -> list[int]:
        tokens = [t async for out in stream for t in out.token_ids]
        counted[name] = stream._failovers
        return tokens

    async def run() -> list[list[int]]:
        streams = {}
        for i in range(2):
            streams[f"r{i}"] = FailoverStream(
                visible, Request(f"r{i}", PROMPTS[i], GREEDY), max_failovers=2, backoff_s=0.0
            )
            await streams[f"r{i}"].open()
        deadline = time.monotonic() + 10  # both admitted; the lane thread's next step runs the first
        while not lanes[0].loop.running:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        assert lanes[0].in_flight == 2 and len(lanes[0].loop.running) == 1
        opened.set()
        return list(await asyncio.wait_for(asyncio.gather(*(one(st, n) for n, st in streams.items())), 30))

    try:
        assert asyncio.run(run()) == alone[:2]
        assert counted == {"r0": 1, "r1": 0} and lanes[0].generations[WorkerRole.target] == 1
    finally:
        _release_and_stop(lanes, factories)


def test_a_lane_that_dropped_its_requests_starts_its_count_of_failed_steps_afresh(target: LlamaModel) -> None:
    """Failed steps counted before the lane's requests moved away (its target lost, another lane free) are not the
    next requests': their first failed step is bisected, not taken for the fourth in a row and dropped."""
    lane = _lane(target, Factory(target, {}))
    try:
        lane._failed_steps, lane._splits, lane._probes = 3, 2, deque([frozenset({0})])
        lane._drop_all("lane 0 is bringing its target back", LaneLostError)
        assert (lane._failed_steps, lane._splits, list(lane._probes)) == (0, 0, [])
    finally:
        lane.stop()


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)], ids=["killer-last", "killer-first"])
def test_a_request_that_kills_its_target_is_found_and_failed_and_its_batch_goes_on(
    target: LlamaModel, alone: list[list[int]], order: tuple[int, ...]
) -> None:
    """One request's input kills the target's process whenever its prompt is prefilled. The lane re-ran the whole
    batch on each new target, so after ``max_worker_restarts`` every request lost its lane (and, batched with it
    again, its failovers). Now the batch steps in halves after a loss: the others finish with the tokens they have
    alone, and the request that took a fresh target down twice on its own is failed. Killer first (the lower
    half): its lone retry had gone back to the front of the probes, the other half never ran, and with no other
    step since its first loss it was never failed; the lane was lost with every request."""
    factory = Factory(target, dict.fromkeys(range(20), "deadly"))
    stop_loading = threading.Event()

    def load_soon() -> None:  # each new target finishes loading at once
        while not stop_loading.wait(0.01):
            for actor in factory.actors:
                actor.loaded.set()

    loader = threading.Thread(target=load_soon, daemon=True)
    loader.start()
    lane = _lane(target, factory, max_worker_restarts=3)
    try:
        results = _run(lane, [PROMPTS[i] for i in order])  # PROMPTS[2] is the deadly one
        by_prompt = dict(zip(order, results, strict=True))
        assert [by_prompt[0], by_prompt[1]] == alone[:2] and isinstance(by_prompt[2], RequestFailedError), results
        # killer last: down twice with others, twice alone; first: with the others once, twice alone
        assert lane.healthy and lane.generations[WorkerRole.target] == {(0, 1, 2): 4, (2, 0, 1): 3}[order]
    finally:
        stop_loading.set()
        _release_and_stop([lane], [factory])


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (2, 0, 3, 1)])
def test_two_requests_that_kill_their_target_are_both_found_and_failed(
    target: LlamaModel, alone: list[list[int]], order: tuple[int, ...]
) -> None:
    """Two copies of a crashing prompt in one batch (a client's retries): one suspect slot let the second killer's
    lone loss overwrite the first's, each retry then found itself new, neither was ever failed, and the lane was
    lost with every request. Each lone suspect is kept now. At the default max_worker_restarts (3), killers last
    lost four targets in a row, the fourth a convicting one: counted, it lost the lane before its killer was
    failed; a convicting loss is explained, and not counted."""
    prompts = [*PROMPTS, [*HOSTILE, 44]]  # PROMPTS[2] and this one are deadly
    factory = Factory(target, dict.fromkeys(range(40), "deadly"))
    stop_loading = threading.Event()

    def load_soon() -> None:
        while not stop_loading.wait(0.01):
            for actor in factory.actors:
                actor.loaded.set()

    loader = threading.Thread(target=load_soon, daemon=True)
    loader.start()
    lane = _lane(target, factory, max_worker_restarts=AppArgs().max_worker_restarts)
    try:
        by_prompt = dict(zip(order, _run(lane, [prompts[i] for i in order]), strict=True))
        assert [by_prompt[0], by_prompt[1]] == alone[:2], by_prompt
        assert all(isinstance(by_prompt[i], RequestFailedError) for i in (2, 3)), by_prompt
        assert lane.healthy
    finally:
        stop_loading.set()
        _release_and_stop([lane], [factory])


def test_a_lone_request_on_a_node_that_loses_two_targets_a_few_steps_apart_goes_on(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """A batch of one is retried as it was after a loss, not probed: a second, unrelated loss a step after its step
    ran clean on the new target must not convict it (a count of losses that convict had checked for a repeat before
    the full step cleared the lane's record of steps run since)."""
    factory = Factory(target, {0: "dies at 3", 1: "dies at 2"})
    lane = _lane(target, factory)
    try:
        assert _run(lane, PROMPTS[:1]) == alone[:1]
        assert lane.generations[WorkerRole.target] == 2
    finally:
        lane.stop()


def test_a_node_that_kills_every_target_fails_no_request_for_it(target: LlamaModel) -> None:
    """Every target dies at its first step whatever it runs: the halves and lone steps die too, no step runs, so no
    request is taken for the culprit; the lane's requests go on elsewhere as lost (LaneLostError), none failed."""
    factory = Factory(target, dict.fromkeys(range(20), "doomed"))
    lane = _lane(target, factory, max_worker_restarts=3)
    try:
        results = _run(lane, PROMPTS[:2])
        assert all(isinstance(r, LaneLostError) for r in results), results
    finally:
        lane.stop()


def _loading_after(factories: list[Factory], seconds: float) -> threading.Event:
    """Each new target of ``factories`` finishes loading ``seconds`` after it was made, until the event is set."""
    stop = threading.Event()

    def load() -> None:
        made: dict[int, float] = {}
        while not stop.wait(0.02):
            for actor in (a for f in factories for a in f.actors):
                made.setdefault(id(actor), time.monotonic())
                if time.monotonic() - made[id(actor)] > seconds:
                    actor.loaded.set()

    threading.Thread(target=load, daemon=True).start()
    return stop


def test_a_request_that_kills_every_target_it_runs_on_is_failed_on_the_next_lane(target: LlamaModel) -> None:
    """A request whose input kills the target's process, on two lanes whose new targets take a while to load: each
    lane it kills keeps it until the other has loaded, then hands it there, where it kills that target too. Those
    handoffs were not counted as failovers (only requests that never ran on the loading lane should be), so it
    went round the lanes for ever, taking every new target down. Moved as a suspect, it steps alone on the next
    lane, and the second target it takes down there convicts it: a 500 (RequestFailedError), not one more lap."""
    factories = [Factory(target, dict.fromkeys(range(20), "deadly")) for _ in range(2)]
    stop_loading = _loading_after(factories, 0.2)
    lanes = _spare_lanes(target, factories, max_worker_restarts=50)

    async def run() -> Result:
        deadline = time.monotonic() + 30
        while any(lane.loading for lane in lanes):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        stream = FailoverStream(lambda: lanes, Request("p", [*HOSTILE, 7], GREEDY), max_failovers=2, backoff_s=0.0)
        await stream.open()
        try:
            async for _ in stream:
                pass
        except APIError as e:
            return e
        return []

    try:
        outcome = asyncio.run(asyncio.wait_for(run(), 30))
        assert isinstance(outcome, RequestFailedError), outcome
        # two targets taken down, not the 40 deadly ones the lanes have (the old counting went through them;
        # counted, through max_failovers + 1 of them)
        assert sum(a.died for f in factories for a in f.actors) == 2, [[a.died for a in f.actors] for f in factories]
    finally:
        stop_loading.set()
        _release_and_stop(lanes, factories)


def test_a_request_that_kills_its_target_among_others_is_failed_and_they_go_on_across_lanes(
    target: LlamaModel,
) -> None:
    """Two lanes, each new target loading a while. A request whose input kills the target is batched with others:
    with the other lane loaded, the whole batch moved there and took that lane's batch down too, both lanes handed
    their batches to each other as they reloaded, and the innocent requests spent their failovers with the killer
    (here charged two or more losses each, the killer ending with a 503). Now the requests of a step that lost its
    target go on as suspects, each stepped alone first on the next lane: the killer, alone, takes one more target
    down and is failed; every other request finishes with its greedy tokens, charged at most the one loss it was
    in."""
    from tests.conftest import greedy_reference

    factories = [Factory(target, dict.fromkeys(range(20), "deadly")) for _ in range(2)]
    stop_loading = _loading_after(factories, 0.2)
    lanes = _spare_lanes(target, factories, max_worker_restarts=50)
    innocent = [[5, 9, 13], [100, 200, 300, 400, 7], [7, 8, 9, 10], [11, 12], [60, 61, 62]]
    prompts = [innocent[0], [*HOSTILE, 7], *innocent[1:]]  # three to a lane: the killer with two others
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    streams: list[FailoverStream] = []

    async def one(i: int, prompt: list[int]) -> Result:
        stream = FailoverStream(lambda: lanes, Request(f"r{i}", prompt, long), max_failovers=2, backoff_s=0.0)
        streams.append(stream)
        try:
            await stream.open()
            return [t async for out in stream for t in out.token_ids]
        except APIError as e:
            return e

    async def run() -> list[Result]:
        deadline = time.monotonic() + 30
        while any(lane.loading for lane in lanes):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return list(await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 60))

    try:
        results = asyncio.run(run())
        assert isinstance(results[1], RequestFailedError), results[1]
        others = [r for i, r in enumerate(results) if i != 1]
        assert others == [greedy_reference(target, p, 24) for p in innocent], others
        assert all(s._failovers <= 1 for s in streams if s._request.prompt_ids != prompts[1])
    finally:
        stop_loading.set()
        _release_and_stop(lanes, factories)


def test_a_suspect_that_kills_a_target_alone_is_failed_and_the_lanes_others_move_on_uncharged(
    target: LlamaModel,
) -> None:
    """A request moved here as a suspect steps alone and takes this lane's target down: it is failed (lost in a
    batch before, now alone), and the lane's running request, which was not in that step, goes on on the loaded
    lane with its greedy tokens, handed on (no failover spent: the loss was not its doing)."""
    from tests.conftest import greedy_reference

    factories = [Factory(target, dict.fromkeys(range(20), "deadly")), Factory(target, {})]
    lanes = _spare_lanes(target, [factories[0]], step_delay_s=0.02)
    factories[0].actors[0].loaded.set()  # (its replacement never finishes loading)
    lanes += [_lane(target, factories[1])]
    lanes[1].index = 1
    offered = [lanes[0]]  # the lanes the router offers: the first alone until the bystander runs there
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    tokens: list[int] = []

    async def run() -> tuple[FailoverStream, Result, Result]:
        bystander = FailoverStream(lambda: offered, Request("b", [5, 9, 13], long), max_failovers=2, backoff_s=0.0)
        await bystander.open()

        async def read() -> Result:
            try:
                async for out in bystander:
                    tokens.extend(out.token_ids)
            except APIError as e:
                return e
            return tokens

        reader = asyncio.ensure_future(read())
        deadline = time.monotonic() + 30
        while len(tokens) < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        offered.append(lanes[1])
        killer = FailoverStream(
            lambda: offered[:1], Request("k", [*HOSTILE, 7], long, suspect=True), max_failovers=2, backoff_s=0.0
        )
        await killer.open()
        try:
            async for _ in killer:
                pass
            outcome: Result = []
        except APIError as e:
            outcome = e
        return bystander, outcome, await asyncio.wait_for(reader, 30)

    try:
        bystander, killed, read = asyncio.run(asyncio.wait_for(run(), 60))
        assert isinstance(killed, RequestFailedError), killed
        assert read == greedy_reference(target, [5, 9, 13], 40)
        assert bystander._failovers == 0 and bystander._lane is lanes[1]
    finally:
        _release_and_stop(lanes, factories)


def test_a_suspect_steps_alone_until_a_step_of_it_commits(target: LlamaModel, alone: list[list[int]]) -> None:
    """A suspect joins no batch before a step of it alone has committed: one whose step alone did not (a lost
    draft, a worker replaced) was left running, out of the lane's probes, and joined the next full step. With
    nothing running beside it, a loop stepped without probes (the Engine's) steps it alone (it never ran)."""
    loop = _engine(target).loop
    loop.add_request(Request("s", PROMPTS[0], GREEDY, suspect=True))
    loop.add_request(Request("o", PROMPTS[1], GREEDY))
    (suspect,) = [seq.seq_id for seq in loop.waiting if seq.suspect]
    assert loop.next_suspect() == suspect
    verify = loop.target.verify
    loop.target.verify = lambda items: (_ for _ in ()).throw(actors.WorkerLostError("lost"))  # type: ignore[method-assign]
    with pytest.raises(actors.WorkerLostError):
        loop.step(only={suspect})
    loop.target.verify = verify  # type: ignore[method-assign]
    loop.reset({suspect})
    assert loop.is_suspect(suspect) and loop.next_suspect() == suspect  # running, still to step alone
    assert [out.request_id for out in loop.step(only={suspect})] == ["s"]
    assert loop.next_suspect() is None and not loop.is_suspect(suspect)

    engine_loop = _engine(target).loop  # the Engine's way: full steps only
    engine_loop.add_request(Request("s", PROMPTS[0], GREEDY, suspect=True))
    engine_loop.add_request(Request("o", PROMPTS[1], GREEDY))
    first = engine_loop.step()
    assert [out.request_id for out in first] == ["s"]  # alone first
    tokens: dict[str, list[int]] = {"s": list(first[0].token_ids), "o": []}
    for _ in range(40):
        for out in engine_loop.step():
            tokens[out.request_id] += out.token_ids
    assert not engine_loop.has_work and [tokens["s"], tokens["o"]] == alone[:2]


def test_a_suspect_whose_first_step_alone_fails_steps_alone_once_more_before_it_is_failed(
    target: LlamaModel,
) -> None:
    """A suspect (lost in a batch on another lane, maybe not its doing) whose first step here fails naming no one:
    failed at once, as a request that had failed in a batch here and again alone. It steps alone once more."""
    factory = Factory(target, {0: "hostile"})
    lane = _lane(target, factory)
    try:
        outcome = asyncio.run(asyncio.wait_for(_one(lane, Request("s", [*HOSTILE, 7], GREEDY, suspect=True)), 30))
        assert isinstance(outcome, RequestFailedError), outcome
        assert factory.actors[0].calls.count("verify") == 2
        assert _run(lane, PROMPTS[:1]) == [_engine(target).generate(PROMPTS[:1], GREEDY)[0].token_ids]
    finally:
        lane.stop()


def test_groups_still_to_step_alone_stay_suspects_when_a_probe_loses_the_target(target: LlamaModel) -> None:
    """A batch with a killer loses the target; no other lane is loaded, so its halves are to step alone here. The
    first half's step loses the new target too (its node), now with a loaded lane to go to: the half still to step
    alone went on as not in that step, blameless, and the killer with it into the other lane's batch."""
    factory = Factory(target, {0: "deadly", 1: "dies at 1"})
    lane = _lane(target, factory, spare=lambda: len(factory.actors) > 1 and factory.actors[1].died)
    factory.actors[0].loaded.set()
    try:
        results = _run(lane, [PROMPTS[0], PROMPTS[1], [*HOSTILE, 7]])
        assert [type(r) for r in results] == [StepLostError] * 3, results
    finally:
        lane.stop()


def test_a_batch_that_lost_its_target_moves_as_suspects_where_no_replacement_can_be_made(target: LlamaModel) -> None:
    """The lane cannot make a new target (its placement is gone): the batch that lost the old one went on as lost
    alone, not as suspects, and the killer among them took the next lane's batch down too."""
    factory = Factory(target, {0: "deadly"}, broken={1})
    lane = _lane(target, factory)
    factory.actors[0].loaded.set()
    try:
        results = _run(lane, [PROMPTS[0], PROMPTS[1], [*HOSTILE, 7]])
        assert [type(r) for r in results] == [StepLostError] * 3, results
        assert lane.lost_workers
    finally:
        lane.stop()


def test_a_request_sent_to_a_lane_whose_target_is_gone_waits_for_its_replacement_unblamed(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """The lane is out of replacements (max_worker_restarts 0) and keeps its dead target until the next try. A
    request that came meanwhile was stepped on it: the proxy refused the call, and the request was taken for the
    target's killer (StepLostError, a failover spent, alone first on the next lane). It waits for the replacement
    and finishes as it would alone."""
    factory = Factory(target, {0: "dies at 1"})
    lane = _lane(target, factory, max_worker_restarts=0, worker_retry_s=1.0)
    lane.start_poll_s = 0.02
    try:
        (first,) = _run(lane, [PROMPTS[0]])
        assert isinstance(first, StepLostError) and lane.lost_workers  # in the step that lost the target
        assert lane.workers[WorkerRole.target].dead
        assert _run(lane, [PROMPTS[1]], tag="s") == [alone[1]]
        assert lane.generations[WorkerRole.target] == 1 and factory.actors[0].calls.count("verify") == 1
    finally:
        lane.stop()


def test_a_request_that_leaves_a_lane_is_no_longer_counted_as_kept_there(target: LlamaModel) -> None:
    """A request kept across a loss counts that loss when handed on; once it leaves the lane (finished, aborted,
    moved) its id is forgotten, or the same request moved back later would be charged for a loss it never saw."""
    lane = _lane(target, Factory(target, {}))
    try:
        lane._kept = {"r", "s"}
        lane._forget("r")
        assert lane._kept == {"s"}
    finally:
        lane.stop()


def test_requests_waiting_on_a_full_lane_go_to_a_lane_that_comes_up_with_room(
    target: LlamaModel, alone: list[list[int]]
) -> None:
    """Lane 1 is still loading its model: every request goes to lane 0, whose 4 slots run 4 while the rest wait.
    Lane 1 comes up idle: the waiting requests stayed behind lane 0's batch (only new ones went to lane 1). Now the
    oldest waiting ones are handed on to lane 1 (no failover spent) and finish there with the tokens they would
    have had alone."""
    from deployments.router import free_slots

    factories = [Factory(target, {}), Factory(target, {0: "loading"})]
    lanes: list[Lane] = []
    moving = Moving()
    for i, factory in enumerate(factories):
        room = functools.partial(free_slots, lanes, i, 4, moving)
        lanes.append(_lane(target, factory, room=room, step_delay_s=0.1 if i == 0 else 0.0))
        lanes[-1].index = i
        lanes[-1].start_poll_s = 0.02
    requests = [Request(f"r{i}", PROMPTS[i % len(PROMPTS)], GREEDY) for i in range(7)]
    failed: list[int] = []
    rebalanced: list[int] = []
    streams = [
        FailoverStream(
            lambda: lanes,
            r,
            max_failovers=0,
            backoff_s=0.0,
            moving=moving,
            on_failover=failed.append,
            on_rebalance=rebalanced.append,
        )
        for r in requests
    ]

    async def read(stream: FailoverStream) -> list[int]:
        return [t async for out in stream for t in out.token_ids]

    async def run() -> list[list[int]]:
        for stream in streams:
            await stream.open()
        assert [s._lane for s in streams] == [lanes[0]] * 7 and lanes[1].loading
        factories[1].actors[0].loaded.set()  # lane 1 comes up
        return await asyncio.wait_for(asyncio.gather(*(read(s) for s in streams)), 60)

    try:
        assert asyncio.run(run()) == [alone[i % len(PROMPTS)] for i in range(7)]
        on_lane_1 = [r.request_id for r, s in zip(requests, streams, strict=True) if s._lane is lanes[1]]
        assert on_lane_1 and set(on_lane_1) <= {"r4", "r5", "r6"}, on_lane_1  # waiting ones, not running ones
        assert all(s._failovers == 0 for s in streams)
        assert failed == [] and rebalanced == [0] * len(on_lane_1)  # counted apart from failovers
        _wait(lambda: lanes[0].in_flight == lanes[1].in_flight == 0)  # (the lane thread forgets a finished one)
    finally:
        _release_and_stop(lanes, factories)


def test_a_full_lane_hands_on_only_the_waiting_requests_its_next_step_would_not_admit(target: LlamaModel) -> None:
    """Requests its own next step admits (slots freed by requests that just finished) stay; of the rest, the oldest
    go, as many as the other lanes have room for."""
    factory = Factory(target, {0: "loading"})  # its thread waits for the target: the test drives the loop alone
    room = [5]
    lane = _lane(target, factory, room=lambda: room[0])
    try:
        for i in range(3):
            lane.loop.add_request(Request(f"r{i}", PROMPTS[0], GREEDY))
        lane._hand_on_waiting()  # 4 free slots here: the next step admits all three
        assert [s.request.request_id for s in lane.loop.waiting] == ["r0", "r1", "r2"]
        for i in range(3, 8):
            lane.loop.add_request(Request(f"r{i}", PROMPTS[0], GREEDY))
        room[0] = 2
        lane._hand_on_waiting()  # r0-r3 are admitted here next; r4, r5 go where there is room; r6, r7 wait
        assert [s.request.request_id for s in lane.loop.waiting] == ["r0", "r1", "r2", "r3", "r6", "r7"]
    finally:
        _release_and_stop([lane], [factory])


def test_the_room_a_lane_sees_leaves_out_the_requests_on_their_way_to_a_lane() -> None:
    """Two full lanes each read a third's free slots before either's moves reached it, and both handed it that many:
    the requests dropped by another lane and not yet resubmitted now take their place first."""
    from types import SimpleNamespace

    from deployments.router import free_slots

    def lane(index: int, in_flight: int, handing_on: int = 0, **state: bool) -> SimpleNamespace:
        up = {"alive": True, "healthy": True, "loading": False} | state
        return SimpleNamespace(index=index, in_flight=in_flight, handing_on=handing_on, **up)

    moving = Moving()
    lanes = [lane(0, 7), lane(1, 1), lane(2, 6)]  # 4 slots each: lane 1 has 3 free
    assert free_slots(lanes, 0, 4, moving) == free_slots(lanes, 2, 4, moving) == 3
    lanes[0].handing_on = 3  # lane 0 handed on three: lane 2 sees no room left
    assert free_slots(lanes, 2, 4, moving) == 0 and free_slots(lanes, 0, 4, moving) == 3
    lanes[0].handing_on = 1
    with moving.pausing():  # and one pausing before its move
        assert free_slots(lanes, 2, 4, moving) == 1
    lanes[1].loading = True  # a lane loading a worker has no room to give
    assert free_slots(lanes, 2, 4, moving) == 0
