"""A lane: one target and one draft actor driven by one StepLoop on a background thread.

All StepLoop calls happen on the lane thread. The router's event loop talks to it through a command queue
(submit, abort) and receives outputs through per-request asyncio queues (``call_soon_threadsafe``). When a worker
actor dies, the lane recreates it in the same bundle, re-registers the running sequences (``StepLoop.recover``)
and retries the step (in halves, each alone: a request whose input kills the target is found, and failed once
its step alone took a fresh target down twice): the router holds every sequence's tokens, so streams continue and
nothing is lost. A lane that cannot recreate it (or whose thread stops) drops its requests with LaneLostError,
which the router answers by moving them to another lane (``deployments/failover.py``); it tries again to recreate
its workers on its next step.

Any other failed step is isolated: its sequences' worker caches are reset (they re-prefill from the router's tokens);
a failure that names its sequence (``SequenceError``, also as the cause of Ray's RayTaskError) fails that request
alone; one that names none is retried with the step's sequences split in halves, each half stepped alone (the rest
wait), until the failing sequence is found and failed. The others continue with the tokens they would have had.
Before a sequence (or a batch) is failed for an error that names none, the workers run their self-check (one token
of their own, apart from every sequence): a worker that fails it is broken, not the request, and is replaced like a
dead one.
A half steps without the throughput guard (``StepLoop.step(only)``): re-prefilling, it would otherwise decode plainly
and never reach a drafting failure. What runs after a step committed (the SL update, the guard's records, observers)
cannot lose its outputs: a sequence whose SL update fails fails alone, the rest is logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection

from pydantic import BaseModel
from ray.exceptions import RayActorError, RayError

from deployments.actors import (
    ACTOR_NAMESPACE,
    START_POLL_S,
    KVGeometry,
    RemoteDraft,
    RemoteTarget,
    RemoteWorker,
    WorkerFactory,
    WorkerLostError,
    WorkerState,
)
from deployments.app_args import AppArgs, WorkerRole
from specserve.api.error_bodies import (
    APIError,
    LaneFullError,
    LaneHandoffError,
    LaneLostError,
    RequestFailedError,
    StepLostError,
    WorkerFailedError,
)
from specserve.api.metrics import ServeMetrics
from specserve.coalesce import OutputCoalescer
from specserve.errors import InvalidRequestError, PartialStepError, SequenceError, blamed_sequence
from specserve.sequence import Request, RequestOutput
from specserve.step_loop import StepLoop
from specserve.structured import AnswerGrammar, GrammarDeadEnd

logger = logging.getLogger(__name__)

STOP_JOIN_TIMEOUT_S = 10.0
DEBUG_TIMEOUT_S = 5.0  # /debug/lanes waits this long for each worker's state
MAX_BISECTION_SPLITS = 16  # splits one isolation may make before it fails the sequences still suspected
MAX_FAILED_STEPS = 3  # full steps in a row that fail while every part of them passes alone: then the batch is dropped
MAX_RETRY_S = 300.0  # the longest pause between two tries to bring a lost worker back
SUSPECT_CLEAR_STEPS = 8  # steps a suspect (a worker's killer or poisoner) runs without harm before it is no longer one


def draft_restore_delay(losses: int, retry_s: float) -> float:
    """The pause before a new draft is made after ``losses`` drafts lost in a row with none drafting a step: none
    after the first; after each further one ``retry_s``, doubling, up to MAX_RETRY_S (however long the run)."""
    return 0.0 if losses <= 1 else min(retry_s * 2.0 ** min(losses - 2, 64), MAX_RETRY_S)


class WorkerDebug(BaseModel):
    role: WorkerRole
    actor_name: str
    namespace: str
    node_id: str | None  # None: the actor is not reachable right now
    kv_slots_in_use: int | None
    restarts: int


def stop_lanes(lanes: Collection[Lane]) -> None:
    """Stop lanes together: every one is told first, then all are waited for until one deadline,
    STOP_JOIN_TIMEOUT_S away (one lane after another would take that long each, past Serve's graceful shutdown)."""
    for lane in lanes:
        lane.request_stop()
    by = time.monotonic() + STOP_JOIN_TIMEOUT_S
    for lane in lanes:
        lane.finish_stop(by)


class LaneDebug(BaseModel):
    index: int
    alive: bool
    in_flight: int
    running: int
    waiting: int
    draft_lost: bool  # a lost draft worker is being brought back (meanwhile every sequence decodes plainly)
    loading: bool  # its target worker is starting (new requests go to loaded lanes first)
    workers: list[WorkerDebug]


@dataclasses.dataclass(frozen=True)
class _Submit:
    request: Request
    sink: _Sink
    admitted: concurrent.futures.Future[None]
    grammar: AnswerGrammar | None  # the request's format, compiled (None: it has none)


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


@dataclasses.dataclass(frozen=True)
class _DraftBack:
    """A fresh draft worker, started, for a lane whose draft was lost."""

    worker: RemoteDraft


_Command = _Submit | _Abort | _Stop | _DraftBack
_Item = RequestOutput | APIError


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
            if isinstance(item, APIError):
                self._done = True
                self._lane.heard_lost(self._request_id)
                raise item
            self._done = item.finished
            yield item

    async def aclose(self) -> None:
        if not (self._closed or self._done):
            self._lane.abort(self._request_id)
            self._lane.heard_lost(self._request_id)  # a drop it will not read now
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
        stream_interval: int = AppArgs.model_fields["stream_interval"].default,
        max_bisection_splits: int = MAX_BISECTION_SPLITS,
        max_failed_steps: int = MAX_FAILED_STEPS,
        worker_retry_s: float = AppArgs.model_fields["worker_retry_s"].default,
        idle_check_s: float | None = AppArgs.model_fields["worker_idle_check_s"].default,
        spare: Callable[[], bool] = lambda: False,
        room: Callable[[], int] = lambda: 0,
    ) -> None:
        self.index = index
        self.loop = loop
        self.factory = factory
        self.geometry = geometry
        self.metrics = metrics
        self.max_worker_restarts = max_worker_restarts
        self.step_delay_s = step_delay_s
        self.max_bisection_splits = max_bisection_splits
        self.max_failed_steps = max_failed_steps
        self.start_poll_s = START_POLL_S  # a step waits for a worker still starting in slices this long
        self.worker_retry_s = worker_retry_s  # the pause after a failed try to bring a lost worker back (doubles)
        self.workers = dict(workers)  # the proxies the loop drives (replaced in both on a restart)
        self.generations = dict.fromkeys(self.workers, 0)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._active: set[str] = set()  # submitted and not yet finished or aborted (added on submit, else lane thread)
        self._sinks: dict[str, _Sink] = {}  # lane thread only
        # lane thread only: outputs held for a longer chunk
        self._coalescer = OutputCoalescer(stream_interval, texts=loop.tokenizer is not None)
        # dropped with LaneLostError, its stream not yet told: still held (the router moves it once told);
        # added on the lane thread, removed on the event loop
        self._lost: set[str] = set()
        # a request moves from _active to _lost under this lock, which ``in_flight`` reads under: an event loop that
        # read the two between the moves counted it twice (a request dropped as lost was in both for an instant)
        self._held_lock = threading.Lock()
        # running when the lane lost its target and no other lane could take them: their loss counts against
        # max_failovers when they are handed on (lane thread only; forgotten at the next step that runs)
        self._kept: set[str] = set()
        self._kept_suspects: set[str] = set()  # ... those of them that were in the step that lost it
        self._failed_alone: set[int] = set()  # suspects moved here whose first step alone failed (not a loss)
        self._failures = 0  # consecutive failed steps
        self._probes: deque[frozenset[int]] = deque()  # suspect groups (seq ids) to step alone, the first next
        self._splits = 0  # splits made by the isolation under way
        self._failed_steps = 0  # consecutive failed full steps (not counting a worker's death)
        # the sequence that failed alone on a worker that then failed its self-check (the worker was replaced): if
        # it breaks the fresh worker alone too, it is failed, not the worker replaced again for ever
        self._poisoner: int | None = None
        self._poisoner_clean = 0  # steps it ran without harm since (``_note_clean_step``)
        # the sequences whose step, alone, took their target down (a fresh one: the lane replaced it), each with the
        # steps it ran without harm since (one slot: two killers in a batch overwrote each other, each retry found
        # itself new, and neither was ever failed), and whether any step ran since the loss that began the search
        # (the lane's workers can serve: a node that fails every step fails no request for it)
        self._killers: dict[int, int] = {}
        self._stepped = True
        # draft workers lost in a row with no step drafted by one in between (a request whose input kills the draft
        # takes each fresh one down at its first proposal): each comes back after a longer pause than the last
        self._draft_losses = 0
        self.lost_workers = False  # its target could not be brought back (until a replacement or a step succeeds)
        self._lost_target: RemoteWorker | None = None  # ... the one it lost (one made since: replaced if found dead)
        self._retry_pause = worker_retry_s  # while lost: the pause before the next try (doubles)
        self._retry_at = 0.0  # ... and when that try is due (time.monotonic)
        self.spare = spare  # whether another lane could take this one's requests now (running, healthy, loaded)
        self.room = room  # free slots of the other lanes that serve: where requests waiting here would run now
        self.idle_check_s = idle_check_s  # how often, with nothing to step, it checks its workers answer (None: never)
        self._check_at = self._next_check()  # ... and when that check is due (time.monotonic)
        self._exited = threading.Event()  # the lane thread is ending: it takes no more requests
        self._stopping = threading.Event()  # set (under _restore_lock) once the lane thread stops or is told to
        self._stop_asked = False  # told to stop (``request_stop``), as against a lane thread that failed
        self._restore_lock = threading.Lock()
        # formats are compiled on a thread of their own, one at a time (a lane's batch waits for nothing compiled on
        # its thread: tens of ms for a large grammar), which first reads the vocabulary as grammars see it (0.3 s for
        # 49k tokens, holding the GIL: done as the lane starts, while its workers load, not at the first request)
        self._grammar_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"lane-{index}-grammars")
        if loop.tokenizer is not None:
            self._grammar_thread.submit(loop.grammars.prepare)
        self._thread = threading.Thread(target=self._run, name=f"lane-{index}", daemon=True)
        self._thread.start()

    # -- event-loop side --------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._exited.is_set()

    @property
    def healthy(self) -> bool:
        """Running, and not left without workers by failed replacements."""
        return self.alive and not self.lost_workers

    @property
    def loading(self) -> bool:
        """A worker of its is starting (loading its model, after a loss or at first; a draft too, at first: the
        lane steps nothing until it has): requests go to a lane that is not, first."""
        return any(worker.starting for worker in list(self.workers.values()))  # (a copy: the lane thread's dict)

    @property
    def starting_up(self) -> bool:
        """Loading its first workers (its replica starting), not a replacement for one lost."""
        return self.loading and not any(self.generations.values())

    @property
    def draft_lost(self) -> bool:
        """Its draft worker was lost and is being brought back: meanwhile every sequence decodes plainly."""
        return self._lacks_draft(self.workers)

    def _lacks_draft(self, roles: Collection[WorkerRole]) -> bool:
        return self.loop.serves_drafts and WorkerRole.draft not in roles

    @property
    def in_flight(self) -> int:
        """The requests it holds: submitted and not finished, or lost and not yet told so (then moved)."""
        with self._held_lock:
            return len(self._active) + len(self._lost)

    @property
    def handing_on(self) -> int:
        """Requests it dropped to move to another lane whose streams have not read the drop yet (resubmitted then)."""
        return len(self._lost)

    def heard_lost(self, request_id: str) -> None:
        """Its stream has read its drop (or will not): a move's pause or another lane counts it from here."""
        self._lost.discard(request_id)

    async def submit(self, request: Request) -> LaneStream:
        """Queue the request on the lane; returns once the StepLoop accepted it (raises what add_request raises)."""
        if request.request_id in self._active:  # refused here: the lane thread would forget the live one's stream
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if not self.alive:  # it never ran here: its move to another lane is no failover
            raise LaneHandoffError(f"lane {self.index} has stopped")
        self._active.add(request.request_id)  # in flight from here: a compile holds its place (capacity, lane choice)
        try:
            try:
                grammar = await self._compiled(request)
            except RuntimeError:  # the grammar thread was shut down: the lane is stopping
                if self.alive and not self._stopping.is_set():
                    raise
                grammar = None
            if not self.alive or self._stopping.is_set():  # it stopped, or was told to, while the format compiled
                raise LaneHandoffError(f"lane {self.index} has stopped")
        except BaseException:
            self._active.discard(request.request_id)
            raise
        sink = _Sink(asyncio.get_running_loop())
        admitted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Submit(request, sink, admitted, grammar))
        if not self.alive:  # it stopped after the check above and may have drained its queue before this put
            self._fail_pending()
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            self.abort(request.request_id)  # it may be admitted after all
            raise
        return LaneStream(self, request.request_id, sink)

    async def _compiled(self, request: Request) -> AnswerGrammar | None:
        fmt = request.params.output_format
        if fmt is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._grammar_thread, self.loop.grammars.compile, fmt)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stop(self) -> None:
        stop_lanes([self])

    def request_stop(self) -> None:
        """Tell the lane to stop (its thread ends after the step it is in); ``finish_stop`` waits for it."""
        self._stop_asked = True
        with self._restore_lock:
            self._stopping.set()
        self._commands.put(_Stop())

    def finish_stop(self, by: float) -> None:
        """Wait until ``by`` (time.monotonic) for the lane thread, then end its workers (the thread also ends them
        as it exits, any it attached meanwhile included: it makes no new one once told to stop)."""
        self._thread.join(max(0.0, by - time.monotonic()))
        self._kill_workers()
        self._grammar_thread.shutdown(wait=False)

    def _kill_workers(self) -> None:
        for worker in list(self.workers.values()):  # a copy: a lane thread still in a long step may replace one
            worker.kill()

    async def debug(self) -> LaneDebug:
        workers = []
        held = dict(self.workers)  # one snapshot for the list and draft_lost: a worker may come back meanwhile
        draft_lost = self._lacks_draft(held)
        for role, worker in held.items():
            try:  # a worker still loading its model, or one that cannot be placed, does not hold this up
                state: WorkerState = await asyncio.wait_for(worker.handle.state.remote(), DEBUG_TIMEOUT_S)
                node_id, slots = state.node_id, state.kv_slots_in_use
            except (RayError, TimeoutError):
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
            draft_lost=draft_lost,
            loading=self.loading,
            workers=workers,
        )

    # -- lane thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(wait=self._idle_wait()):
                if self.loop.has_work:
                    self._step()
                    self._check_at = self._next_check()  # a step has just heard from every worker
                elif self.lost_workers:
                    if time.monotonic() >= self._retry_at:
                        self._retry_target()
                elif self.loading:
                    self._await_start()
                elif time.monotonic() >= self._check_at:
                    self._check_idle()
            self._exited.set()  # told to stop: its running requests go on elsewhere (or hear why not)
            self._fail_all(f"lane {self.index} stopped", LaneLostError)
        except BaseException:  # SystemExit, KeyboardInterrupt too: its admitted requests would wait for ever
            self._exited.set()  # before its requests hear of it: none may come back here
            logger.exception("lane %d failed", self.index)
            # not moved to another lane: what broke the lane thread may be one of these requests' doing
            self._fail_all("the lane failed")
            raise
        finally:  # requests submitted but not yet admitted would otherwise wait for ever
            self._exited.set()
            with self._restore_lock:
                self._stopping.set()
            self._fail_pending()
            if self._stop_asked:  # a stop that timed out waiting for a long step ended the workers it saw then
                self._kill_workers()

    @property
    def _lost_roles(self) -> set[WorkerRole]:
        """The workers a failed call found dead (none marked: all of them, as the failure names none)."""
        return {role for role, w in self.workers.items() if w.dead} or set(self.workers)

    @property
    def _target_gone(self) -> bool:
        """Whether its target was found dead and not yet replaced (a lane over in-process workers has none)."""
        target = self.workers.get(WorkerRole.target)
        return target is not None and target.dead

    def _idle_wait(self) -> float | None:
        """How long to wait for a command: not at all with work to do (but for a target known gone, a slice at a
        time until the next try to bring it back); while its target is lost, until that try; else until the next
        check of its workers (for ever without checks)."""
        gone = self._target_gone
        if (self.loop.has_work and not gone) or (not self.lost_workers and self.loading):
            return 0.0
        if gone and self.loop.has_work:  # its requests wait for the next try, or for a lane to hand them to
            return max(0.0, min(self._retry_at - time.monotonic(), self.start_poll_s))
        due = self._retry_at if self.lost_workers else self._check_at
        return None if math.isinf(due) else max(0.0, due - time.monotonic())

    def _await_start(self) -> None:
        """With nothing to step, a worker still starting is waited for a slice (so ``loading`` ends when its start
        does, not with the next request); one whose start failed is replaced now."""
        try:
            self._starting()
        except (RayActorError, WorkerLostError) as e:
            self._replace_lost(e)

    def _next_check(self) -> float:
        return math.inf if self.idle_check_s is None else time.monotonic() + self.idle_check_s

    def _check_idle(self) -> None:
        """With nothing to step, a worker that died (its node, an out-of-memory kill) would be found only by the
        next request, which would then wait for its replacement to load, while health said the lane was fine:
        each worker is asked to answer, and a dead one replaced (a draft in the background) now."""
        self._check_at = self._next_check()
        try:
            dead = sorted(role.value for role, worker in self.workers.items() if not worker.answers())
        except Exception:  # not a worker's death (those are answers' False): the lane goes on, the steps will tell
            logger.exception("lane %d: checking its idle workers failed", self.index)
            return
        if dead:
            self._replace_lost(WorkerLostError(f"{', '.join(dead)} did not answer while lane {self.index} was idle"))
            self._check_at = self._next_check()
        elif not self.loading:
            self._failures = 0  # every worker up and answering: earlier losses no longer count as in a row

    def _fail_pending(self) -> None:
        """Answer every queued submit of a stopped lane with LaneHandoffError (any thread: the lane's is gone): they
        never ran here, so their moves to another lane are no failovers (a request with ``max_failovers: 0`` failed
        with a 503 for a lane it had only queued on)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _DraftBack):  # came back too late
                command.worker.kill()
            elif isinstance(command, _Submit):
                self._active.discard(command.request.request_id)
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # the client left meanwhile
                    command.admitted.set_exception(LaneHandoffError(f"lane {self.index} has stopped"))

    def _drain(self, *, wait: float | None) -> bool:
        """Apply queued commands, waiting at most ``wait`` seconds for the first (None: for ever); False once told
        to stop."""
        try:
            command = self._commands.get_nowait() if wait == 0.0 else self._commands.get(timeout=wait)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            try:
                self._apply(command)
            except Exception:  # one request's command must not take the lane (and every request on it) down
                logger.exception("lane %d: a command failed", self.index)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._report_queue()
                return True

    def _report_queue(self) -> None:
        self.metrics.lane_queue(self.index, running=len(self.loop.running), waiting=len(self.loop.waiting))

    def _apply(self, command: _Submit | _Abort | _DraftBack) -> None:
        if isinstance(command, _DraftBack):
            if self._stopping.is_set():  # came back as the lane was told to stop: nobody wants it
                command.worker.kill()
            else:
                self._attach_draft(command.worker)
            return
        if isinstance(command, _Abort):
            self._forget(command.request_id)
            self._lost.discard(command.request_id)  # dropped as lost after its stream closed (it heard nothing)
            self.loop.abort(command.request_id)
            return
        if not command.admitted.set_running_or_notify_cancel():  # the client left before it was admitted
            self._forget(command.request.request_id)
            return
        try:
            self.loop.add_request(command.request, command.grammar)
        except Exception as e:
            self._forget(command.request.request_id)
            if not isinstance(e, APIError | InvalidRequestError):  # a bug, not the request: still an error body
                logger.exception("lane %d: admitting %s failed", self.index, command.request.request_id)
                e = RequestFailedError("the request could not be admitted")
            command.admitted.set_exception(e)
            return
        self._sinks[command.request.request_id] = command.sink
        command.admitted.set_result(None)

    def _step(self) -> None:
        only = self._next_probe()
        t0 = time.perf_counter()
        failures: dict[int, SequenceError] = {}
        ran = False  # whether the step reached its workers (a new target that fails to start is no request's doing)
        steps_before = self.loop.stats.timing.steps
        try:
            gone = self._target_gone  # lost before these requests came (the lane was out of replacements, or none
            # could be made): none of them is stepped on it, nor blamed for it
            if gone or self._starting():
                self._flush_held()  # a target loading may take minutes
                if self._sinks and self.spare():  # requests admitted since the loss (queued during the failed step),
                    # or kept while no other lane was loaded: on at once on a lane that has its model. Only the
                    # ones kept have lost a lane here (counted now); the others merely waited (a handoff)
                    for request_id in list(self._sinks):
                        lost = (
                            StepLostError
                            if request_id in self._kept_suspects
                            else LaneLostError
                            if request_id in self._kept
                            else LaneHandoffError
                        )
                        self._drop(request_id, lost(f"lane {self.index} is starting its workers; handed on"))
                    self._kept.clear()
                    self._kept_suspects.clear()
                    self._report_queue()
                elif gone and time.monotonic() >= self._retry_at:  # work waits for it: its replacement, now
                    self._retry_target()
                return
            if only is not None and not self._probes and not self._workers_answer():  # a suspect's first step
                return  # here: its workers replaced first (a node under two lanes that failed took both targets;
                # the one lost before the suspect's step is not its doing)
            if only is not None:
                self._flush_held()  # the step leaves the others waiting
            ran = True
            outputs = self.loop.step(only)
            self._kept.clear()
            self._kept_suspects.clear()
        except PartialStepError as e:  # verified and committed but for a few: deliver, then fail those alone
            outputs, failures = e.outputs, e.failures
        except (RayActorError, WorkerLostError) as e:
            group = only or frozenset(s.seq_id for s in self.loop.running)
            generation = self.generations[WorkerRole.target]
            # a loss that convicts a request (its second alone) is explained: not one more in a row for the lane
            # (two killers in a batch lost four targets in a row and, at max_worker_restarts 3, the lane)
            # (a lost draft convicts no one: it costs only speculation, and the suspect steps alone again)
            convicted = self._repeat_killer(group, only) if ran and WorkerRole.target in self._lost_roles else None
            if convicted is not None:  # failed, not moved with the others (a spare lane takes them at once)
                self._killers.pop(convicted, None)
                self._fail_sequence(convicted, WorkerLostError("its step took a target down twice, the second alone"))
            self._replace_lost(e, counted=convicted is None, step=group if ran else frozenset())
            if ran and self.generations[WorkerRole.target] != generation:  # its target was replaced (not its draft)
                self._suspect_loss(group, only)
            self._report_queue()
            return
        except Exception as e:  # one request's bad input, or a bug: not a lost worker
            try:
                self._isolate(e, only)
            except Exception:
                logger.exception("lane %d: isolating a failed step failed", self.index)
                self._fail_all("the step failed")
            self._report_queue()  # failed requests left the queue and the batch
            return
        if self.loop.stats.timing.steps > steps_before:  # the target answered (a step whose every row met its
            # grammar's dead end before it, say, never called it: it says nothing of the workers' health)
            self._failures = 0
            self._stepped = True
            self._note_clean_step(only)
            self.lost_workers, self._retry_pause = False, self.worker_retry_s
        if only is None:
            self._failed_steps = 0
        elif self._probes and self._probes[0] == only:  # the group passed (not a suspect's first step here)
            self._probes.popleft()
        step_s = time.perf_counter() - t0
        for out in outputs:
            sink, ready = self._sinks.get(out.request_id), self._coalescer.offer(out)
            if out.finished:  # before its client can read the end: its place is free once it has its answer (the
                # router's capacity check, reading in between, refused the client's next request with a 429)
                self._forget(out.request_id)
            if sink is not None and ready is not None:
                sink.put(ready)
        # the loop recorded this step (one whose every sequence failed before the target recorded none)
        if outputs and self.loop.stats.timing.steps > steps_before:
            step = self.loop.stats.metrics[-1]
            if WorkerRole.draft in self.workers and step.model_drafted:  # (also for rows that finished in it)
                self._draft_losses = 0  # the draft model proposed in a step that went through: no longer suspect
            self.metrics.lane_step(
                self.index,
                step,
                running=len(self.loop.running),
                waiting=len(self.loop.waiting),
                step_s=step_s,
            )
        for seq_id, error in failures.items():
            self._fail_sequence(seq_id, error)
        if failures:
            self._report_queue()
        if only is None:
            self._hand_on_waiting()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def _hand_on_waiting(self) -> None:
        """Requests waiting here for a slot (beyond those the next step admits) while another lane that serves has
        one free (it came up later, or its requests finished sooner) go there, the oldest first: a handoff, as from
        a starting lane (token-identical, no failover spent). Only once the moves before have reached their lane,
        whose count then holds them."""
        free_here = max(0, self.loop.max_batch_size - len(self.loop.running))  # the next step admits as many
        if len(self.loop.waiting) <= free_here or self._lost or (room := self.room()) <= 0:
            return
        for seq in list(self.loop.waiting)[free_here : free_here + room]:
            self._drop(seq.request.request_id, LaneFullError(f"lane {self.index} is full; handed to one with room"))
        self._report_queue()

    def _note_clean_step(self, only: frozenset[int] | None) -> None:
        """A suspect that has run SUSPECT_CLEAR_STEPS steps without harm since it was marked is no longer one: a
        second, unrelated loss hours later must not fail it as a repeat (a request whose damage shows a step or two
        late is still caught)."""
        for killer in [k for k in self._killers if only is None or k in only]:
            self._killers[killer] += 1
            if self._killers[killer] >= SUSPECT_CLEAR_STEPS:
                del self._killers[killer]
        if self._poisoner is not None and (only is None or self._poisoner in only):
            self._poisoner_clean += 1
            if self._poisoner_clean >= SUSPECT_CLEAR_STEPS:
                self._poisoner = None

    def _starting(self) -> bool:
        """Whether a worker is still starting, after waiting one slice (``start_poll_s``) for it: a replaced target
        may take minutes to load its model, and meanwhile the lane applies its queued commands between slices (a
        client that left is let go, a new request admitted) rather than after the whole load."""
        waits = (worker.wait_started(self._stopping, within=self.start_poll_s) for worker in self.workers.values())
        return not all(waits)

    def _next_probe(self) -> frozenset[int] | None:
        """The suspect group to step next, less its sequences that finished or were aborted; with none, a suspect
        another lane lost its target with, alone (None: a full step)."""
        running = {s.seq_id for s in self.loop.running}
        while self._probes:
            if group := self._probes[0] & running:
                self._probes[0] = group
                return group
            self._probes.popleft()
        arrived = self.loop.next_suspect()
        return None if arrived is None else frozenset((arrived,))

    def _isolate(self, error: Exception, only: frozenset[int] | None) -> None:
        """Reset the failed step's sequences on the workers, then fail the one the error names; with none named,
        queue the step's sequences in halves to step alone (a lone sequence that fails alone is failed). Before a
        request is failed the workers run their self-check: one that fails it is replaced and the request goes on (a
        worker whose weights went non-finite names a sequence too, the first whose logits had no mass to sample)."""
        group = only or frozenset(s.seq_id for s in self.loop.running)
        if not group:  # nothing ran: nothing to pin it on
            logger.error("lane %d: step failed", self.index, exc_info=error)
            self._fail_all("the step failed")
            return
        self.loop.reset(group)
        if only is None:
            self._failed_steps += 1
            self._splits = 0
        elif self._probes and self._probes[0] == only:
            self._probes.popleft()
        blamed = blamed_sequence(error)
        named = blamed in group  # (a broken worker names a sequence too: its NaN logits have no mass to sample)
        lone = not named and only is not None and len(group) == 1  # it failed with others and again alone
        if lone and self.loop.is_suspect(first := next(iter(group))) and first not in self._failed_alone:
            # a suspect moved here (another lane's loss, maybe not its doing) failed its first step alone: it steps
            # alone once more before it is failed, as a request that failed in a batch here would
            self._failed_alone = {s for s in self._failed_alone if self.loop.request_id(s) is not None} | {first}
            self._probes.append(group)
            return
        drop = not named and only is None and self._failed_steps > self.max_failed_steps
        exhausted = not named and self._splits >= self.max_bisection_splits
        if (named or lone or drop or exhausted) and not self._workers_pass_check():
            # a worker that cannot run one token of its own is replaced, and every request goes on, but for one that
            # broke a fresh worker alone (or named) a second time: that one is failed (else the lane would replace
            # its worker over and over while the innocent half's steps kept resetting the loss count)
            suspect = blamed if named else next(iter(group)) if lone else None
            if suspect is not None and suspect == self._poisoner:
                self._fail_sequence(suspect, error)
                suspect = None
            self._poisoner, self._poisoner_clean = suspect, 0
            self._probes.clear()
            self._splits = self._failed_steps = 0
            self._replace_lost(WorkerLostError(f"a worker failed its self-check after: {error!r}"))
            return
        if lone:
            blamed = next(iter(group))
        if blamed is not None and blamed in group:
            self._fail_sequence(blamed, error)
            self._failed_steps = 0  # found
        elif drop:  # the batch that failed; requests still queued never ran in it and go on here (nor is it a
            # worker's loss: the lane's count of those stays)
            logger.error("lane %d: %d steps failed in a row", self.index, self._failed_steps, exc_info=error)
            reason = f"{self._failed_steps} steps failed in a row; the request was dropped"
            for seq_id in group:
                if (request_id := self.loop.request_id(seq_id)) is not None:
                    self._drop(request_id, WorkerFailedError(reason))
            self._failed_steps = self._splits = 0
            self._probes.clear()
        elif exhausted:
            logger.error("lane %d: no culprit after %d splits", self.index, self._splits, exc_info=error)
            for seq_id in group:
                self._fail_sequence(seq_id, error)
        else:
            logger.warning("lane %d: step of %d failed; splitting it", self.index, len(group), exc_info=error)
            self._splits += 1
            self._queue_halves(group)

    def _suspect_loss(self, group: frozenset[int], only: frozenset[int] | None) -> None:
        """The target died during a step of ``group`` and was replaced: its sequences step in halves on the new
        target, as after a failure naming none (a request whose input kills the target's process took it down with
        its whole batch after every replacement, until all of them had spent their failovers). One whose step alone
        convicts it (``_repeat_killer``) was failed already."""
        group &= {s.seq_id for s in self.loop.running}  # (none left: a free lane took them, or they were dropped)
        if not group:
            return
        if only is None:
            self._stepped = False
        elif self._probes and self._probes[0] == only:
            self._probes.popleft()
        if len(group) == 1:
            (suspect,) = group
            self._killers[suspect] = 0
            if only is None:  # a full step of one: retried as it was
                return
            self._probes.append(group)  # alone again after the rest of the search: a step of others must run
            return  # between its two losses (at the front, the other half never ran and it was never failed)
        self._queue_halves(group)

    def _repeat_killer(self, group: frozenset[int], only: frozenset[int] | None) -> int | None:
        """The one running sequence of ``group`` if its step alone (a probe: never a full step, which a lone request
        on a flaky node takes too) has taken a target down before, here or, in a batch, on the lane it came from (a
        suspect's first step here), with other steps run since: the target lost now is its doing too."""
        running = group & {s.seq_id for s in self.loop.running}
        if only is None or len(running) != 1 or not self._stepped:
            return None
        (suspect,) = running
        return suspect if suspect in self._killers or self.loop.is_suspect(suspect) else None

    def _queue_halves(self, group: frozenset[int]) -> None:
        """Step ``group``'s sequences in halves, each alone, before any other (a lone sequence: alone again)."""
        ids = sorted(group)
        halves = [frozenset(h) for h in (ids[: len(ids) // 2], ids[len(ids) // 2 :]) if h]
        self._probes.extendleft(reversed(halves))

    def _workers_answer(self) -> bool:
        """Whether every worker answers (those that do not are replaced now, as found while idle)."""
        try:
            dead = sorted(role.value for role, worker in self.workers.items() if not worker.answers())
        except Exception:  # not a worker's death (those are answers' False): the step will tell
            logger.exception("lane %d: asking its workers failed", self.index)
            return True
        if dead:
            self._replace_lost(WorkerLostError(f"{', '.join(dead)} did not answer before a suspect's step"))
        return not dead

    def _workers_pass_check(self) -> bool:
        """Whether every worker passes its self-check (those that fail it are marked dead)."""
        results = [worker.check() for worker in self.workers.values()]  # every one: each failing one is marked
        return all(results)

    def _replace_lost(
        self,
        error: Exception,
        *,
        counted: bool = True,
        step: frozenset[int] = frozenset(),
    ) -> None:
        """``step``: the sequences of the step the loss happened in. The step's requests go on as suspects, with
        those kept through earlier losses since the last step that went through (the halves of a batch still to
        step alone); the others that ran here, not in the step (a suspect group stepped alone), are blameless:
        handed on, no failover spent (unless a kept loss counts)."""
        ran = {seq.seq_id: seq.request.request_id for seq in self.loop.running}
        suspects = {r for s, r in ran.items() if s in step} | (self._kept_suspects & set(ran.values()))
        blameless = {r for s, r in ran.items() if step and s not in step} - suspects - self._kept
        try:
            self._recover(error, counted=counted, suspects=suspects, blameless=blameless)
        except Exception:  # no replacement could be made (placement, a failed create): the lane stays up,
            # answers its requests, and tries again with the next step's worker failure
            logger.exception("lane %d: replacing its workers failed", self.index)
            self.lost_workers = True  # before the requests hear of it: a caller may look at the health next
            self._lost_target = self.workers.get(WorkerRole.target)
            self._retry_at = time.monotonic() + self._retry_pause  # with no request to step, tried again then
            reason = "the lane could not replace a lost worker"
            self._fail_all(reason, LaneLostError, suspects=suspects, blameless=blameless)

    def _retry_target(self) -> None:
        """A lost target's replacement tried again while the lane has nothing to step (its requests went to other
        lanes, and new ones go to healthy lanes first): made, then waited for a slice (``start_poll_s``) at a time,
        the lane applying its commands in between, since one that was made but never starts (its model does not
        load, its device is out of memory) would otherwise pass for a lane back in order."""
        target = self.workers[WorkerRole.target]
        try:
            # the target lost, or one made since and found dead; not one made since whose start a step saw done
            if target is self._lost_target or target.dead:
                self._replace_target()
                target = self.workers[WorkerRole.target]
            if not target.wait_started(self._stopping, within=self.start_poll_s):
                self._retry_at = time.monotonic()  # still starting: again once the queued commands are applied
                return
        except Exception:
            self._retry_pause = min(2 * self._retry_pause, MAX_RETRY_S)
            self._retry_at = time.monotonic() + self._retry_pause
            logger.exception(
                "lane %d: its target could not be replaced; trying again in %.0f s", self.index, self._retry_pause
            )
            return
        self.lost_workers, self._retry_pause = False, self.worker_retry_s

    def _recover(
        self,
        error: Exception,
        *,
        counted: bool = True,
        suspects: Collection[str] = (),
        blameless: Collection[str] = (),
    ) -> None:
        """Replace a dead target, detach a dead draft (brought back in the background, its sequences decoding
        plainly meanwhile), reset any worker whose state ran ahead of the failed step, and let the loop re-prefill
        its running sequences on the next step. A target's loss counts as one more in a row unless ``counted`` is
        False (one request's doing, that request failed for it). ``suspects`` go on elsewhere each stepped alone
        there before it joins a batch (a request whose input kills the target went on with its batch and took the
        next lane's batch down too), ``blameless`` without a failover spent."""
        if self._stop_asked:  # failed as the lane was being stopped (its workers killed under it): no new worker;
            # its requests go on elsewhere, none left to step on caches that may have run ahead
            self._fail_all(f"lane {self.index} stopped", LaneLostError)
            return
        dead = self._lost_roles
        logger.warning("lane %d: %s worker died (%s); recreating", self.index, sorted(r.value for r in dead), error)
        if WorkerRole.target in dead and counted:  # a lost draft costs only speculation: it never counts against
            self._failures += 1  # the lane
        exhausted = self._failures > self.max_worker_restarts
        if exhausted:  # its requests go to other lanes; the lane reports itself lost and goes on replacing
            # lost until a step succeeds or a replacement has started (``_retry_target``); set before the requests
            # hear of it: a caller may look at the health next
            self.lost_workers = True
            self._lost_target = self.workers.get(WorkerRole.target)
            self._retry_at = time.monotonic() + self._retry_pause
            reason = f"lane {self.index} lost its workers {self._failures} times in a row"
            self._fail_all(reason, LaneLostError, suspects=suspects, blameless=blameless)
        if WorkerRole.draft in dead:  # first: a target's replacement that cannot be made must not leave it attached
            self._detach_draft()
        if WorkerRole.target in dead and not exhausted:  # (when exhausted, ``_retry_target`` makes the next one)
            self._replace_target()
            if self.spare():  # its requests go on at once on a lane that has its model, not after this one's load
                reason = f"lane {self.index} is bringing its target back"
                self._drop_all(reason, LaneLostError, suspects=suspects, blameless=blameless)
            else:  # kept for the new target, or handed on once a lane is up: a loss either way
                self._kept |= {seq.request.request_id for seq in self.loop.running} - set(blameless)
                self._kept_suspects |= set(suspects)
        target_reset = WorkerRole.target in dead
        # the draft proposed before the target failed: its cache holds an unverified proposal, so reset it too
        draft_reset = WorkerRole.draft in self.workers and target_reset
        if draft_reset:
            self.workers[WorkerRole.draft].release([seq.seq_id for seq in self.loop.running])
        self.loop.recover(target=target_reset, draft=draft_reset)

    def _detach_draft(self) -> None:
        """The lane goes on without its draft (plain decoding, lossless as ever) while a fresh one is made and
        started on another thread: the lane never waits for a draft model to load, nor fails a request for want
        of one."""
        old = self.workers.pop(WorkerRole.draft)
        self.loop.detach_draft()
        with contextlib.suppress(Exception):  # it may only have been unreachable: its bundle's resources come back
            old.kill()
        self.metrics.draft_detached(self.index, True)
        self._draft_losses += 1
        first = draft_restore_delay(self._draft_losses, self.worker_retry_s)
        restorer = threading.Thread(
            target=self._restore_draft, args=(first,), name=f"lane-{self.index}-draft", daemon=True
        )
        restorer.start()

    def _restore_draft(self, first_delay: float = 0.0) -> None:
        """After ``first_delay``, make and start a draft worker until one starts (pausing ``worker_retry_s`` after
        a failed try, doubling up to MAX_RETRY_S); the lane thread attaches it (``_DraftBack``). Ends with the lane,
        within START_POLL_S even while a new worker is still loading its model (that worker is then ended: it holds
        its resources)."""
        delay = first_delay
        pause = min(2 * first_delay, MAX_RETRY_S) if first_delay else self.worker_retry_s
        while not self._stopping.wait(delay):
            delay, pause = pause, min(2 * pause, MAX_RETRY_S)
            self.generations[WorkerRole.draft] += 1  # this thread's alone while the draft is detached
            try:
                worker = self.factory.create(self.index, WorkerRole.draft, self.generations[WorkerRole.draft])
            except Exception:
                logger.exception(
                    "lane %d: a new draft worker could not be made; trying again in %.0f s", self.index, delay
                )
                continue
            self.metrics.worker_restarted(self.index, WorkerRole.draft.value)  # made, as a target's is counted
            try:
                worker.start(self.geometry)
                if not worker.wait_started(cancel=self._stopping):  # the lane stopped: nobody wants it
                    worker.kill()
                    return
            except Exception:
                worker.kill()
                if self._stopping.is_set():  # torn down with the lane: nothing to report or to try again
                    return
                logger.exception(
                    "lane %d: the new draft worker did not start; trying again in %.0f s", self.index, delay
                )
                continue
            assert isinstance(worker, RemoteDraft)
            with self._restore_lock:
                if not self._stopping.is_set():
                    self._commands.put(_DraftBack(worker))
                    return
            worker.kill()
            return

    def _attach_draft(self, worker: RemoteDraft) -> None:
        self.workers[WorkerRole.draft] = worker
        self.loop.attach_draft(worker)
        self.metrics.draft_detached(self.index, False)
        logger.info("lane %d: its draft worker is back (%s)", self.index, worker.name)

    def _replace_target(self) -> None:
        old = self.workers[WorkerRole.target]
        old.kill()  # a worker taken for dead may only have been unreachable: its resources come back
        self.generations[WorkerRole.target] += 1
        worker = self.factory.create(self.index, WorkerRole.target, self.generations[WorkerRole.target])
        worker.start(self.geometry)
        assert isinstance(worker, RemoteTarget)
        self.workers[WorkerRole.target] = self.loop.target = worker
        self.metrics.worker_restarted(self.index, WorkerRole.target.value)

    def _fail_sequence(self, seq_id: int, error: Exception) -> None:
        request_id = self.loop.request_id(seq_id)
        if request_id is None:
            return
        if isinstance(cause := error.__cause__, GrammarDeadEnd):  # the request's format at fault: a 400 of its own
            logger.info("lane %d: request %s ended in its grammar: %s", self.index, request_id, cause)
            self._drop(request_id, APIError(str(cause), param=cause.param))
            return
        logger.warning("lane %d: request %s failed on its own: %s", self.index, request_id, error, exc_info=error)
        self._drop(request_id, RequestFailedError("the request failed while generating; it was dropped"))

    def _fail_all(
        self,
        reason: str,
        error: type[WorkerFailedError] = WorkerFailedError,
        *,
        suspects: Collection[str] = (),
        blameless: Collection[str] = (),
    ) -> None:
        """Drop every request with ``error`` and start counting failures afresh."""
        self._drop_all(reason, error, suspects=suspects, blameless=blameless)
        self._failures = 0

    def _drop_all(
        self,
        reason: str,
        error: type[WorkerFailedError],
        *,
        suspects: Collection[str] = (),
        blameless: Collection[str] = (),
    ) -> None:
        """Drop every request with ``error``: LaneLostError when the lane, not a request, is at fault (the router
        then moves them to another lane; those still queued, which never ran here, and ``blameless``, not in the
        step that lost the target, are handed on: LaneHandoffError, no failover spent; ``suspects``, in that step,
        as StepLostError). The lane's count of failed steps and its suspects go with them."""
        ran = {seq.request.request_id for seq in self.loop.running}
        for request_id in list(self._sinks):
            kind = error
            if issubclass(error, LaneLostError) and (request_id not in ran or request_id in blameless):
                kind = LaneHandoffError
            elif issubclass(error, LaneLostError) and request_id in suspects:
                kind = StepLostError
            self._drop(request_id, kind(f"{reason}; the request was dropped"))
        self._failed_steps = self._splits = 0
        self._probes.clear()
        self._report_queue()  # they left the queue and the batch: the lane's gauges must not count them on

    def _drop(self, request_id: str, error: APIError) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None and isinstance(error, LaneLostError):
            with self._held_lock:  # counted once throughout: never in both, never in neither
                self._lost.add(request_id)
                self._active.discard(request_id)
        try:  # (one moving to another lane joins the replica's shared suffix cache when it finishes there)
            self.loop.abort(request_id, remember=not isinstance(error, LaneLostError))
        except Exception:
            logger.exception("lane %d: abort of %s failed", self.index, request_id)
        held = self._coalescer.take(request_id)  # tokens handed out but not yet streamed go before the error
        self._forget(request_id)  # before the error is delivered: the request may be submitted here again at once
        if sink is not None:
            if held is not None:
                sink.put(held)
            sink.put(error)

    def _flush_held(self) -> None:
        for out in self._coalescer.flush():
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink.put(out)

    def _forget(self, request_id: str) -> None:
        self._kept.discard(request_id)  # (its id may come back: a request moved away and back again)
        self._kept_suspects.discard(request_id)
        self._sinks.pop(request_id, None)
        self._coalescer.take(request_id)
        self._active.discard(request_id)
