"""A lane: one target and one draft actor driven by one StepLoop on a background thread.

All StepLoop calls happen on the lane thread. The router's event loop talks to it through a command queue
(submit, abort) and receives outputs through per-request asyncio queues (``call_soon_threadsafe``). When a worker
actor dies, the lane recreates it in the same bundle, re-registers the running sequences (``StepLoop.recover``)
and retries the step: the router holds every sequence's tokens, so streams continue and nothing is lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import ray
from pydantic import BaseModel
from ray.exceptions import RayActorError

from deployments.actors import ACTOR_NAMESPACE, KVGeometry, RemoteDraft, RemoteTarget, RemoteWorker, WorkerFactory
from deployments.app_args import WorkerRole
from specserve.api.error_bodies import WorkerFailedError
from specserve.api.metrics import ServeMetrics
from specserve.sequence import Request, RequestOutput
from specserve.step_loop import StepLoop

logger = logging.getLogger(__name__)

STOP_JOIN_TIMEOUT_S = 10.0


class WorkerDebug(BaseModel):
    role: WorkerRole
    actor_name: str
    namespace: str
    node_id: str | None  # None: the actor is not reachable right now
    kv_slots_in_use: int | None
    restarts: int


class LaneDebug(BaseModel):
    index: int
    alive: bool
    in_flight: int
    running: int
    waiting: int
    workers: list[WorkerDebug]


@dataclasses.dataclass(frozen=True)
class _Submit:
    request: Request
    sink: _Sink
    admitted: concurrent.futures.Future[None]


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


_Command = _Submit | _Abort | _Stop
_Item = RequestOutput | WorkerFailedError


class _Sink:
    """Hands one request's outputs from the lane thread to the event loop that awaits them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()

    def put(self, item: _Item) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class LaneStream:
    """The outputs of one admitted request; ``aclose`` before the end aborts it (and frees its KV)."""

    def __init__(self, lane: Lane, request_id: str, sink: _Sink) -> None:
        self._lane = lane
        self._request_id = request_id
        self._sink = sink
        self._done = False
        self._closed = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        while not self._done:
            item = await self._sink.queue.get()
            if isinstance(item, WorkerFailedError):
                self._done = True
                raise item
            self._done = item.finished
            yield item

    async def aclose(self) -> None:
        if not (self._closed or self._done):
            self._lane.abort(self._request_id)
        self._closed = True


class Lane:
    def __init__(
        self,
        index: int,
        loop: StepLoop,
        workers: dict[WorkerRole, RemoteWorker],
        factory: WorkerFactory,
        geometry: KVGeometry,
        *,
        metrics: ServeMetrics,
        max_worker_restarts: int,
        step_delay_s: float = 0.0,
    ) -> None:
        self.index = index
        self.loop = loop
        self.factory = factory
        self.geometry = geometry
        self.metrics = metrics
        self.max_worker_restarts = max_worker_restarts
        self.step_delay_s = step_delay_s
        self.workers = dict(workers)  # the proxies the loop drives (replaced in both on a restart)
        self.generations = dict.fromkeys(self.workers, 0)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._active: set[str] = set()  # submitted and not yet finished or aborted (added on submit, else lane thread)
        self._sinks: dict[str, _Sink] = {}  # lane thread only
        self._failures = 0  # consecutive failed steps
        self._thread = threading.Thread(target=self._run, name=f"lane-{index}", daemon=True)
        self._thread.start()

    # -- event-loop side --------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        return len(self._active)

    async def submit(self, request: Request) -> LaneStream:
        """Queue the request on the lane; returns once the StepLoop accepted it (raises what add_request raises)."""
        sink = _Sink(asyncio.get_running_loop())
        admitted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._active.add(request.request_id)
        self._commands.put(_Submit(request, sink, admitted))
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            self.abort(request.request_id)  # it may be admitted after all
            raise
        return LaneStream(self, request.request_id, sink)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stop(self) -> None:
        self._commands.put(_Stop())
        self._thread.join(STOP_JOIN_TIMEOUT_S)
        for worker in self.workers.values():
            ray.kill(worker.handle, no_restart=True)

    async def debug(self) -> LaneDebug:
        workers = []
        for role, worker in list(self.workers.items()):
            try:
                state = await worker.handle.state.remote()
                node_id, slots = state.node_id, state.kv_slots_in_use
            except RayActorError:
                node_id, slots = None, None
            workers.append(
                WorkerDebug(
                    role=role,
                    actor_name=worker.name,
                    namespace=ACTOR_NAMESPACE,
                    node_id=node_id,
                    kv_slots_in_use=slots,
                    restarts=self.generations[role],
                )
            )
        return LaneDebug(
            index=self.index,
            alive=self.alive,
            in_flight=self.in_flight,
            running=len(self.loop.running),
            waiting=len(self.loop.waiting),
            workers=workers,
        )

    # -- lane thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self.loop.has_work):
                if self.loop.has_work:
                    self._step()
        except Exception:
            logger.exception("lane %d failed", self.index)
            self._fail_all("the lane failed")
            raise

    def _drain(self, *, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._report_queue()
                return True

    def _report_queue(self) -> None:
        self.metrics.lane_queue(self.index, running=len(self.loop.running), waiting=len(self.loop.waiting))

    def _apply(self, command: _Submit | _Abort) -> None:
        if isinstance(command, _Abort):
            self._forget(command.request_id)
            self.loop.abort(command.request_id)
            return
        try:
            self.loop.add_request(command.request)
        except Exception as e:
            self._forget(command.request.request_id)
            command.admitted.set_exception(e)
            return
        self._sinks[command.request.request_id] = command.sink
        command.admitted.set_result(None)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.loop.step()
        except RayActorError as e:
            self._recover(e)
            self._report_queue()
            return
        except Exception:  # a bug, not a lost worker: drop the batch rather than the lane
            logger.exception("lane %d: step failed", self.index)
            self._fail_all("the step failed")
            self._report_queue()  # the dropped requests left the queue and the batch
            return
        self._failures = 0
        step_s = time.perf_counter() - t0
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:  # a snapshot of the stats: the loop keeps mutating its own
                sink.put(dataclasses.replace(out, stats=dataclasses.replace(out.stats)))
            if out.finished:
                self._forget(out.request_id)
        if outputs:  # the loop recorded this step
            self.metrics.lane_step(
                self.index,
                self.loop.stats.metrics[-1],
                running=len(self.loop.running),
                waiting=len(self.loop.waiting),
                step_s=step_s,
            )
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def _recover(self, error: RayActorError) -> None:
        """Replace dead workers, reset any worker whose state ran ahead of the failed step, and let the loop
        re-prefill its running sequences on the next step."""
        self._failures += 1
        dead = {role for role, w in self.workers.items() if w.dead} or set(self.workers)
        logger.warning("lane %d: %s worker died (%s); recreating", self.index, sorted(r.value for r in dead), error)
        if self._failures > self.max_worker_restarts:
            self._fail_all(f"lane {self.index} lost its workers {self._failures} times in a row")
        for role in dead:
            self._replace(role)
        target_reset = WorkerRole.target in dead
        # the draft proposed before the target failed: its cache holds an unverified proposal, so reset it too
        draft_reset = WorkerRole.draft in self.workers and (target_reset or WorkerRole.draft in dead)
        if draft_reset and WorkerRole.draft not in dead:
            self.workers[WorkerRole.draft].release([seq.seq_id for seq in self.loop.running])
        self.loop.recover(target=target_reset, draft=draft_reset)

    def _replace(self, role: WorkerRole) -> None:
        self.generations[role] += 1
        worker = self.factory.create(self.index, role, self.generations[role])
        worker.start(self.geometry)
        self.workers[role] = worker
        if isinstance(worker, RemoteTarget):
            self.loop.target = worker
        elif isinstance(worker, RemoteDraft):
            self.loop.draft = worker
        self.metrics.worker_restarted(self.index, role.value)

    def _fail_all(self, reason: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            sink.put(WorkerFailedError(f"{reason}; the request was dropped"))
            try:
                self.loop.abort(request_id)
            except Exception:
                logger.exception("lane %d: abort of %s failed", self.index, request_id)
            self._forget(request_id)
        self._failures = 0

    def _forget(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._active.discard(request_id)
