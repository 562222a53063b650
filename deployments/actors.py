"""Ray actors hosting a TargetWorker or DraftWorker, and proxies that let a StepLoop drive them like local workers.

An actor builds its model itself from a ``ModelRecipe``, so weights never cross the network. Per step only the
protocol objects (token ids, small index lists, sparse top-K probabilities) travel, and a draft head's features
in one buffer (``deployments/wire.py``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import (
    ActorPlacementGroupRemoved,
    ActorUnschedulableError,
    GetTimeoutError,
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    RaySystemError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.app_args import AppArgs, ModelRecipe, WorkerRole
from deployments.recipe_models import build_model
from deployments.wire import FeatureWire, WireFeatures, attach_features, strip_features
from specserve.build import local_draft_worker
from specserve.heap import freeze_loaded_objects
from specserve.host_memory import host_available_bytes
from specserve.limits import MemoryShare, device_kv_slots, slot_bytes
from specserve.messages import FeatureRequest, Proposal, ProposeItem, VerifyItem, VerifyOutput
from specserve.models.llama import LlamaModel
from specserve.sampling import SamplingParams
from specserve.spec_decode.eagle_head import EagleHead
from specserve.workers import DraftWorker, HeadDraftWorker, TargetWorker
from specserve.workers.head_draft import feature_request
from specserve.workers.self_check import self_check

ACTOR_NAMESPACE = "specserve"  # where worker actors are named (``ray.get_actor(name, namespace=ACTOR_NAMESPACE)``)


@dataclass(frozen=True)
class ModelInfo:
    """What the router needs to know about a worker's model without loading it."""

    vocab_size: int
    max_positions: int
    eos_token_ids: frozenset[int]
    features: FeatureRequest | None = None  # a draft head: the target hidden states it reads


@dataclass(frozen=True)
class KVGeometry:
    num_slots: int  # sequences at once (the lane's max batch size)
    max_len: int  # tokens per sequence, incl. one step's drafted tokens


@dataclass(frozen=True)
class WorkerState:
    node_id: str
    kv_slots_in_use: int


@dataclass(frozen=True)
class HostNeed:
    """What a CPU worker's KV cache and its slots' shares of a step's activations take of its node's memory."""

    node_id: str
    kv_bytes: int
    activation_bytes: int
    available: int  # the memory its node had available when asked (``host_available_bytes``)


class _WorkerHost:
    """Loads the model at construction; ``start`` then sizes the KV cache (the router decides the geometry)."""

    feature_wire = FeatureWire.native  # how a step's features leave this actor (``deployments/wire.py``)

    def __init__(
        self,
        recipe: ModelRecipe,
        device: str,
        torch_threads: int | None,
        freeze_gc: bool,
        feature_wire: FeatureWire = FeatureWire.native,
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.feature_wire = feature_wire
        self.model = build_model(recipe, device)
        if freeze_gc:
            freeze_loaded_objects()
        self.worker: TargetWorker | DraftWorker | HeadDraftWorker | None = None

    def info(self) -> ModelInfo:
        if isinstance(self.model, EagleHead):
            features = feature_request(self.model)
            return ModelInfo(self.model.cfg.vocab_size, self.model.max_positions, frozenset(), features)
        return ModelInfo(self.model.cfg.vocab_size, self.model.max_positions, self.model.eos_token_ids)

    def kv_slots(self, geometry: KVGeometry, step_tokens: int, share: MemoryShare | None) -> int:
        """KV slots of ``geometry.max_len`` that fit on this actor's device, at most ``geometry.num_slots``."""
        return device_kv_slots(
            [self.model], requested=geometry.num_slots, max_len=geometry.max_len, step_tokens=step_tokens, share=share
        )

    def host_need(self, geometry: KVGeometry, step_tokens: int) -> HostNeed | None:
        """None: the model is on a GPU (``kv_slots`` sizes its cache)."""
        if self.model.device.type != "cpu":
            return None
        kv, act = slot_bytes([self.model], max_len=geometry.max_len, step_tokens=step_tokens)
        node = ray.get_runtime_context().get_node_id()
        return HostNeed(node, geometry.num_slots * kv, geometry.num_slots * act, host_available_bytes())

    def add(self, seq_id: int, params: SamplingParams, position: int) -> None:
        self._worker().add(seq_id, params, position)

    def release(self, seq_ids: list[int]) -> None:
        self._worker().release(seq_ids)

    def check(self) -> None:
        """Raise unless the model computes one token correctly (``self_check``: no sequence's slot is touched)."""
        self_check(self.model)

    def state(self) -> WorkerState:
        slots = 0 if self.worker is None else len(self.worker.cache.in_use())
        return WorkerState(ray.get_runtime_context().get_node_id(), slots)

    def _worker(self) -> TargetWorker | DraftWorker | HeadDraftWorker:
        if self.worker is None:
            raise RuntimeError("the worker is not started: call start(geometry) first")
        return self.worker


class TargetActor(_WorkerHost):
    def start(self, geometry: KVGeometry) -> None:
        assert isinstance(self.model, LlamaModel)
        self.worker = TargetWorker(self.model, num_slots=geometry.num_slots, max_len=geometry.max_len)

    def verify(self, items: list[VerifyItem]) -> tuple[list[VerifyOutput], WireFeatures | None]:
        """Features for a draft head leave on the host, in one buffer for the step (``deployments/wire.py``): a
        CUDA tensor would make the router (no GPU reserved) open a context on the node's first GPU, or fail to
        unpickle on a node without one."""
        worker = self._worker()
        assert isinstance(worker, TargetWorker)
        return strip_features(worker.verify(items), self.feature_wire)


class DraftActor(_WorkerHost):
    def start(self, geometry: KVGeometry) -> None:
        self.worker = local_draft_worker(self.model, num_slots=geometry.num_slots, max_len=geometry.max_len)

    def propose(self, items: list[ProposeItem], features: WireFeatures | None) -> list[Proposal]:
        worker = self._worker()
        assert isinstance(worker, DraftWorker | HeadDraftWorker)
        return worker.propose(attach_features(items, features))


ACTOR_CLASSES: dict[WorkerRole, type[_WorkerHost]] = {WorkerRole.target: TargetActor, WorkerRole.draft: DraftActor}


# Ray's errors that say the actor, its process or its node is gone, was never placed, or does not answer: not a
# request's fault (an exception raised inside a worker's method arrives as a RayTaskError and is the request's)
WORKER_FAULTS: tuple[type[Exception], ...] = (
    RayActorError,  # ActorDiedError, ActorUnavailableError
    ActorUnschedulableError,
    ActorPlacementGroupRemoved,
    OutOfMemoryError,  # Ray's memory monitor killed the worker's task
    NodeDiedError,
    LocalRayletDiedError,
    WorkerCrashedError,
    RaySystemError,
    GetTimeoutError,  # a call past ``call_timeout_s``: a hung actor
    ObjectLostError,  # the step's result was lost with the actor's node (or its owner) before it was read
)


START_FAULTS: tuple[type[Exception], ...] = (*WORKER_FAULTS, RayTaskError)
START_POLL_S = 1.0  # how often a cancellable wait for a worker's start looks whether it is still wanted
ANSWER_TIMEOUT_S = 30.0  # the idle check's cheap call to a worker that has nothing to do (``answers``): a hung actor
# holds the idle lane's thread this long, not a step's ``call_timeout_s`` (600 s), while new requests reach the lane


class WorkerLostError(Exception):
    """A worker actor died, failed to start, or stopped answering: the lane replaces it and its requests go on."""


class RemoteWorker:
    """One worker actor behind the worker's own method names.

    ``add``, ``release`` and ``start`` do not wait: one caller's calls to an actor run in submission order, so they
    are done before the next ``propose`` / ``verify`` returns. The first ``propose`` / ``verify`` waits for
    ``start`` (at most ``start_timeout_s``: a model that cannot load, a device out of memory), each call at most
    ``call_timeout_s``. A call that finds the actor dead, unplaceable or hung, or its start failed, marks this proxy
    ``dead`` and raises WorkerLostError; the lane then replaces the actor.
    """

    def __init__(
        self,
        handle: ActorHandle,
        name: str,
        role: WorkerRole,
        *,
        start_timeout_s: float | None = None,
        call_timeout_s: float | None = None,
        feature_wire: FeatureWire = FeatureWire.native,
    ) -> None:
        self.handle = handle
        self.feature_wire = feature_wire  # how the features this proxy sends cross (``deployments/wire.py``)
        self.name = name
        self.role = role
        self.dead = False
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self._started: Any = None  # the start call's ObjectRef until a call has seen it succeed
        self._start_deadline: float | None = None  # when a start still not done has taken too long (monotonic)

    def start(self, geometry: KVGeometry) -> None:
        self._started = self.handle.start.remote(geometry)
        self._start_deadline = None if self.start_timeout_s is None else time.monotonic() + self.start_timeout_s

    def add(self, seq_id: int, params: SamplingParams, position: int) -> None:
        self.handle.add.remote(seq_id, params, position)

    def release(self, seq_ids: list[int]) -> None:
        self.handle.release.remote(seq_ids)

    def kill(self) -> None:
        """End the actor for good (a replaced one may only have been unreachable, and still holds its bundle)."""
        with contextlib.suppress(ValueError):  # not an actor handle Ray knows (already gone)
            ray.kill(self.handle, no_restart=True)

    def check(self) -> bool:
        """Whether the actor passes its self-check; one that fails it, dies or does not answer is marked ``dead``."""
        try:
            ray.get(self.handle.check.remote(), timeout=self.call_timeout_s)
        except START_FAULTS:
            self.dead = True
            return False
        return True

    @property
    def starting(self) -> bool:
        """Its start was called and no call has yet seen it done (nor found it failed)."""
        return self._started is not None and not self.dead

    def answers(self) -> bool:
        """Whether the actor is there: one cheap call (an actor still starting within its start timeout is not
        waited for, its first call waits for it). One that is dead, whose start failed or has taken longer than
        ``start_timeout_s``, or that does not answer is marked ``dead``."""
        if self._started is not None:
            ready, _ = ray.wait([self._started], timeout=0)
            late = self._start_deadline is not None and time.monotonic() > self._start_deadline
            if not ready and not late:
                return True
            try:
                self.wait_started()
            except WorkerLostError:
                return False
        timeout = ANSWER_TIMEOUT_S if self.call_timeout_s is None else min(self.call_timeout_s, ANSWER_TIMEOUT_S)
        try:
            ray.get(self.handle.state.remote(), timeout=timeout)
        except START_FAULTS:
            self.dead = True
            return False
        return True

    def wait_started(self, cancel: threading.Event | None = None, *, within: float | None = None) -> bool:
        """Wait for ``start`` (done at most ``start_timeout_s`` after it was called); raises WorkerLostError when it
        failed or took longer. Returns False, the actor left to the caller, when it is still starting after
        ``within`` seconds, or within START_POLL_S of ``cancel`` being set (at once when it is set already)."""
        if self._started is None:
            return True
        until = None if within is None else time.monotonic() + within
        while True:
            if cancel is not None and cancel.is_set():
                return False
            now = time.monotonic()
            left = None if self._start_deadline is None else max(0.0, self._start_deadline - now)
            pause = None if until is None else max(0.0, until - now)
            if cancel is not None:
                pause = START_POLL_S if pause is None else min(pause, START_POLL_S)
            sliced = pause is not None and (left is None or left > pause)
            try:
                ray.get(self._started, timeout=pause if sliced else left)
                break
            except GetTimeoutError as e:
                if sliced or (cancel is not None and cancel.is_set()):  # a slice has passed, or the wait is off
                    if until is not None and time.monotonic() >= until:
                        return False
                    continue
                self.dead = True
                raise WorkerLostError(f"worker {self.name} did not start within {self.start_timeout_s} s") from e
            except START_FAULTS as e:  # or start() itself raised: this actor cannot serve
                self.dead = True
                raise WorkerLostError(f"worker {self.name} did not start: {e!r}") from e
        self._started = None
        return True

    def _call(self, method: Any, *args: Any) -> Any:
        if self.dead:  # found dead, hung or broken before: not asked again (a hung actor would take the whole
            # ``call_timeout_s`` once more, the call queued behind its stuck one), the lane replaces it now
            raise WorkerLostError(f"worker {self.name} was lost before this call")
        self.wait_started()
        try:
            return ray.get(method.remote(*args), timeout=self.call_timeout_s)
        except WORKER_FAULTS as e:
            self.dead = True
            raise WorkerLostError(f"worker {self.name} was lost: {e!r}") from e


class RemoteTarget(RemoteWorker):
    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        return attach_features(*self._call(self.handle.verify, items))


class RemoteDraft(RemoteWorker):
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        return self._call(self.handle.propose, *strip_features(items, self.feature_wire))


PROXY_CLASSES: dict[WorkerRole, type[RemoteWorker]] = {WorkerRole.target: RemoteTarget, WorkerRole.draft: RemoteDraft}


class WorkerFactory:
    """Creates the worker actors of a replica's lanes, each in its own bundle of the replica's placement group.

    A replacement actor gets the same recipe and the same bundle (the dead actor's resources are back in it).
    Names are ``<prefix>:lane<i>:<role>:<generation>`` in ACTOR_NAMESPACE, unique across restarts.
    """

    def __init__(self, args: AppArgs, placement_group: PlacementGroup | None, name_prefix: str) -> None:
        self.args = args
        self.placement_group = placement_group
        self.name_prefix = name_prefix

    def create(self, lane: int, role: WorkerRole, generation: int) -> RemoteWorker:
        recipe = self.args.recipe(role)
        if recipe is None:
            raise ValueError(f"no {role.value} model is configured")
        resources = self.args.resources(role)
        name = f"{self.name_prefix}:lane{lane}:{role.value}:{generation}"
        options = resources.actor_options()
        if self.placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.args.bundle_index(lane, role),
            )
        handle = (
            ray.remote(ACTOR_CLASSES[role])
            .options(name=name, namespace=ACTOR_NAMESPACE, max_restarts=0, max_task_retries=0, **options)
            .remote(recipe, resources.device, resources.torch_threads, self.args.freeze_gc, self.args.feature_wire)
        )
        return PROXY_CLASSES[role](
            cast(ActorHandle, handle),
            name,
            role,
            start_timeout_s=self.args.worker_start_timeout_s,
            call_timeout_s=self.args.worker_call_timeout_s,
            feature_wire=self.args.feature_wire,
        )
