"""The Ray Serve ingress deployment: the OpenAI-compatible HTTP API in front of a replica's lanes.

A replica reserves its resources through the deployment's placement group (bundle 0: this router; then one
bundle per worker actor, see ``AppArgs.placement_bundles``) and creates its lanes' actors in those bundles.
Requests go to the least-loaded healthy lane (one whose target has its model loaded first), and move to another
lane when theirs loses its workers for good or, with another lane loaded, while it loads a new target
(``deployments/failover.py``); beyond ``Router.capacity`` (the KV slots that fit, plus the queue) they get
a 429.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from fastapi import FastAPI
from pydantic import BaseModel
from ray import serve
from ray.util import get_current_placement_group
from transformers import PreTrainedTokenizerBase

from deployments.actors import HostNeed, KVGeometry, ModelInfo, RemoteDraft, RemoteTarget, RemoteWorker, WorkerFactory
from deployments.app_args import MAX_RETRY_AFTER_S, AppArgs, WorkerRole
from deployments.failover import FailoverStream, Moving
from deployments.lane import Lane, LaneDebug, stop_lanes
from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.error_bodies import OverloadedError
from specserve.api.metrics import ServeMetrics
from specserve.api.schemas import Health, HealthStatus
from specserve.api.server import build_api
from specserve.build import build_step_loop, eos_ids_of, new_suffix_cache
from specserve.config import ModelSpec, SpecConfig
from specserve.errors import KVCapacityError
from specserve.heap import freeze_loaded_objects
from specserve.host_memory import check_host_fits
from specserve.limits import ContextLimits, context_limits
from specserve.models.loader import load_tokenizer, warn_on_another_tokenizer
from specserve.prompts import PromptEncoder
from specserve.sequence import Request

T = TypeVar("T")


class RouterDebug(BaseModel):
    model: str
    capacity: int
    lanes: list[LaneDebug]


def lane_limits(args: AppArgs, target: ModelInfo, draft: ModelInfo | None) -> ContextLimits:
    return context_limits(
        max_model_len=args.max_model_len,
        spec_headroom=args.spec_headroom,
        speculation=args.speculation,
        target_positions=target.max_positions,
        target_vocab=target.vocab_size,
        draft_positions=None if draft is None else draft.max_positions,
        draft_vocab=None if draft is None else draft.vocab_size,
    )


def hosts_fit(needs: Sequence[HostNeed | None], geometry: KVGeometry) -> None:
    """Refuse CPU workers whose KV caches, with their slots' shares of a step's activations, would together take more
    of a node than it has available: each worker's own check counts only itself, and every one is asked before
    any has allocated, so lanes packed on one host each passed and the kernel's OOM killer ended them later."""
    nodes: dict[str, list[HostNeed]] = {}
    for need in needs:
        if need is not None:
            nodes.setdefault(need.node_id, []).append(need)
    for node, on_node in nodes.items():
        kv, act = sum(n.kv_bytes for n in on_node), sum(n.activation_bytes for n in on_node)
        try:
            check_host_fits(
                kv,
                geometry.num_slots,
                geometry.max_len,
                available=min(n.available for n in on_node),
                activation_bytes=act,
            )
        except KVCapacityError as e:
            raise KVCapacityError(f"the {len(on_node)} CPU workers on node {node[:12]} together: {e}") from None


async def _within(waiting: Awaitable[T], timeout_s: float, done: str) -> T:
    """A replica's start-up wait on its worker actors, at most ``worker_start_timeout_s``: a model whose load
    stalls fails the replica's start with a message (``serve status`` shows it) instead of holding it for ever."""
    try:
        return await asyncio.wait_for(waiting, timeout_s)
    except TimeoutError:
        raise RuntimeError(f"the worker actors have not {done} within worker_start_timeout_s ({timeout_s} s)") from None


def free_slots(lanes: Sequence[Lane], index: int, slots: int, moving: Moving) -> int:
    """Free KV slots of the lanes other than ``index`` that serve (running, with their workers, none loading), less
    the requests on their way to a lane: pausing before a move, or dropped by another lane and not yet resubmitted
    (two full lanes would each hand a third its free slots)."""
    free = sum(
        max(0, slots - lane.in_flight)
        for lane in lanes
        if lane.index != index and lane.alive and lane.healthy and not lane.loading
    )
    on_the_way = moving.count + sum(lane.handing_on for lane in lanes if lane.index != index)
    return max(0, free - on_the_way)


@serve.deployment
@serve.ingress()
class Router:
    async def __init__(self, args: AppArgs) -> None:  # type: ignore[misc]  # Serve awaits async constructors
        self.args = args
        self.lanes: list[Lane] = []
        self._metrics = ServeMetrics()
        self._moving = Moving()  # requests pausing before a move to another lane
        context = serve.get_replica_context()
        prefix = f"specserve:{context.app_name}:{context.replica_tag}"
        factory = WorkerFactory(args, get_current_placement_group(), prefix)
        workers = [{role: factory.create(i, role, 0) for role in args.roles} for i in range(args.num_lanes)]
        self.tokenizer = self._load_tokenizer()  # while the actors load their models
        target_info, draft_info = await self._model_infos(workers[0], args.worker_start_timeout_s)
        limits = lane_limits(args, target_info, draft_info)
        geometry = await self._fit_geometry(workers, KVGeometry(args.max_batch_size, limits.kv_len), limits)
        loop_args = args.model_copy(update={"max_batch_size": geometry.num_slots})  # fewer fit: fewer at once
        self._lane_slots = geometry.num_slots  # requests a lane runs at once; the rest queue
        self._max_model_len = limits.max_model_len
        self._encoder = PromptEncoder(self.tokenizer, target_info.vocab_size)
        eos = eos_ids_of(list(target_info.eos_token_ids), self.tokenizer)
        self.suffix_cache = new_suffix_cache(args)  # recent outputs, shared by this replica's lanes
        for i, lane_workers in enumerate(workers):
            for worker in lane_workers.values():
                worker.start(geometry)
            target = lane_workers[WorkerRole.target]
            draft = lane_workers.get(WorkerRole.draft)
            assert isinstance(target, RemoteTarget) and (draft is None or isinstance(draft, RemoteDraft))
            features = None if draft_info is None else draft_info.features
            loop = build_step_loop(target, draft, loop_args, limits, self.tokenizer, eos, features, self.suffix_cache)
            lane = Lane(
                i,
                loop,
                lane_workers,
                factory,
                geometry,
                metrics=self._metrics,
                max_worker_restarts=args.max_worker_restarts,
                step_delay_s=args.debug_step_delay_s,
                stream_interval=args.stream_interval,
                worker_retry_s=args.worker_retry_s,
                idle_check_s=args.worker_idle_check_s,
                spare=functools.partial(self._spare_for, i),
                room=functools.partial(free_slots, self.lanes, i, self._lane_slots, self._moving),
            )
            self.lanes.append(lane)
        if args.freeze_gc:
            freeze_loaded_objects()

    def _spare_for(self, index: int) -> bool:
        """Whether a lane other than ``index`` could take its requests now: running, healthy, its model loaded."""
        return any(lane.index != index and lane.alive and lane.healthy and not lane.loading for lane in self.lanes)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self, self.args.http_options())

    def _load_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.args.tiny is not None:
            return tiny_tokenizer()
        recipe = self.args.recipe(WorkerRole.target)
        assert recipe is not None and isinstance(recipe.spec, ModelSpec)
        tokenizer = load_tokenizer(recipe.spec)
        draft = self.args.recipe(WorkerRole.draft)
        # (the draft loads in its actor, maybe on another node: only a local directory's tokenizer is read here)
        warn_on_another_tokenizer(recipe.spec, tokenizer, None if draft is None else draft.spec, local_only=True)
        return tokenizer

    async def _fit_geometry(
        self, workers: list[dict[WorkerRole, RemoteWorker]], geometry: KVGeometry, limits: ContextLimits
    ) -> KVGeometry:
        """Refused where the CPU workers on one node would need more than it has available (``hosts_fit``); with
        ``gpu_memory_utilization``, as many slots as fit on every worker's device (each sizes its own, within its
        share of the GPU: ``AppArgs.memory_share``)."""
        timeout_s = self.args.worker_start_timeout_s
        needs = (w.handle.host_need.remote(geometry, limits.spec_headroom) for lane in workers for w in lane.values())
        hosts_fit(await _within(asyncio.gather(*needs), timeout_s, "sized their KV"), geometry)
        if self.args.gpu_memory_utilization is None:
            return geometry
        asked = (
            w.handle.kv_slots.remote(geometry, limits.spec_headroom, self.args.memory_share(role))
            for lane in workers
            for role, w in lane.items()
        )
        fits: list[int] = await _within(asyncio.gather(*asked), timeout_s, "sized their KV")
        return KVGeometry(min(fits), geometry.max_len)

    @staticmethod
    async def _model_infos(
        workers: dict[WorkerRole, RemoteWorker], timeout_s: float
    ) -> tuple[ModelInfo, ModelInfo | None]:
        roles = list(workers)
        asked: Awaitable[list[ModelInfo]] = asyncio.gather(*(workers[r].handle.info.remote() for r in roles))
        found: list[ModelInfo] = await _within(asked, timeout_s, "loaded their models")
        infos = dict(zip(roles, found, strict=True))
        return infos[WorkerRole.target], infos.get(WorkerRole.draft)

    # -- the Backend the HTTP API runs on ---------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.args.model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def encoder(self) -> PromptEncoder:
        return self._encoder

    @property
    def default_speculation(self) -> SpecConfig:
        return self.args.speculation  # (without a draft model AppArgs admits only settings that need none)

    @property
    def metrics(self) -> ServeMetrics:
        return self._metrics

    def check_capacity(self, *, pending: int = 0) -> None:
        in_flight = sum(lane.in_flight for lane in self.lanes) + self._moving.count + pending
        if in_flight >= self.capacity:
            raise OverloadedError(
                f"the server is at capacity ({self.capacity} requests running or queued); retry later",
                retry_after_s=self.retry_after_s(in_flight),
            )

    async def submit(self, request: Request) -> FailoverStream:
        self.check_capacity()  # again: others may have been admitted while this one's prompt was tokenised
        # seeded here, so that after a move to another lane it goes on with the same draws (docs/algorithms.md §1.4)
        request = dataclasses.replace(request, params=request.params.seeded())
        stream = FailoverStream(
            lambda: self.lanes,
            request,
            max_failovers=self.args.max_failovers,
            backoff_s=self.args.failover_backoff_s,
            on_failover=self._metrics.request_failed_over,
            on_rebalance=self._metrics.request_rebalanced,
            moving=self._moving,
        )
        await stream.open()
        return stream

    def retry_after_s(self, in_flight: int) -> int:
        """Seconds until the requests queued now (and one more) should have run, from the measured step time and
        steps per request; at least ``args.retry_after_s``, which also stands in before anything was measured."""
        slots = self.running_slots
        wait = self._metrics.load.wait_s(queued=max(0, in_flight - slots), slots=slots)
        floor = self.args.retry_after_s
        return floor if wait is None else min(MAX_RETRY_AFTER_S, max(floor, math.ceil(wait)))

    @property
    def running_slots(self) -> int:
        """KV slots of the lanes that serve: a lane that lost its workers, or is loading one (a replacement, or at
        first) while another serves, runs nothing (its requests went to the others) until it has started; while
        none serves yet, those of the lanes the requests wait for (every lane with its workers, or one)."""
        serving = sum(lane.healthy and not lane.loading for lane in self.lanes)
        return self._lane_slots * max(1, serving or sum(lane.healthy for lane in self.lanes))

    @property
    def capacity(self) -> int:
        """Requests this replica holds at once: as many running as its serving lanes' KV slots fit, plus the
        queue."""
        return self.running_slots + self.args.max_queued_requests

    @property
    def most_capacity(self) -> int:
        """``capacity`` with every lane serving."""
        return self._lane_slots * len(self.lanes) + self.args.max_queued_requests

    def health(self) -> Health:
        """Ok while every lane serves, or every one loads its first workers (the replica starting); degraded while a
        lane brings its workers back or loads a replacement (also with no other lane serving: a 200 still, so Serve
        keeps the replica); failing, and Serve's health check then replaces the replica (new placement, new
        actors), once a lane thread has stopped or no lane has its workers."""
        healthy = sum(lane.healthy for lane in self.lanes)
        serving = sum(lane.healthy and not lane.loading for lane in self.lanes)
        if healthy == 0 or not all(lane.alive for lane in self.lanes):
            status = HealthStatus.failing
        elif healthy == len(self.lanes) and (serving == healthy or all(lane.starting_up for lane in self.lanes)):
            status = HealthStatus.ok
        else:
            status = HealthStatus.degraded
        return Health(status=status, lanes=len(self.lanes), lanes_alive=healthy)

    async def debug_state(self) -> RouterDebug:
        lanes = await asyncio.gather(*(lane.debug() for lane in self.lanes))
        return RouterDebug(model=self.model_name, capacity=self.capacity, lanes=list(lanes))

    # -- Serve hooks ------------------------------------------------------------------------------------
    def check_health(self) -> None:
        if not all(lane.alive for lane in self.lanes):
            raise RuntimeError("a lane thread has stopped")
        if self.health().status == HealthStatus.failing:
            raise RuntimeError("no lane has its workers: every lane lost them and could not bring them back yet")

    def __del__(self) -> None:
        stop_lanes(self.lanes)
