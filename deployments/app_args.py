"""The Serve application's arguments (``args`` in app.yaml), validated before anything starts."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from enum import Enum
from typing import Any

from pydantic import ConfigDict, Field, ModelWrapValidatorHandler, SecretStr, field_validator, model_validator

from deployments.wire import FeatureWire
from specserve.api.http_guard import API_KEY_ENV, MAX_TIMEOUT_S, HTTPOptions, checked_api_key, checked_hosts
from specserve.config import (
    DEFAULT_PAIR,
    FREEZE_GC_HELP,
    MODEL_PAIRS,
    SERVING_MAX_STEP_TOKENS,
    SERVING_THROUGHPUT_GUARD,
    DraftSpec,
    HeadSpec,
    KLDMode,
    LoopConfig,
    ModelSpec,
    SpecConfig,
    SpecMethod,
    TargetSpec,
    cpu_kernel,
    serving_speculation,
)
from specserve.limits import MemoryShare
from specserve.validated import Validated

TINY_MODEL_NAME = "tiny"
MAX_RETRY_AFTER_S = 3600  # a 429's Retry-After, however long the queue
_HTTP_DEFAULTS = HTTPOptions()


class WorkerRole(str, Enum):
    target = "target"
    draft = "draft"


class PlacementStrategy(str, Enum):
    """Ray placement-group strategies for a replica's bundles (router + its lanes' actors)."""

    pack = "PACK"
    spread = "SPREAD"
    strict_pack = "STRICT_PACK"
    strict_spread = "STRICT_SPREAD"


RAY_RESOURCE_STEP = 1e-4  # the smallest quantity of a resource Ray schedules


class OmpWait(str, Enum):
    """How an actor's idle OpenMP threads wait for the next parallel region (``OMP_WAIT_POLICY``)."""

    active = "ACTIVE"  # spin: the next region starts at once, and the cores stay busy meanwhile
    passive = "PASSIVE"  # sleep at once: the cores are free for the other actors' work between regions

    @classmethod
    def _missing_(cls, value: object) -> OmpWait | None:
        """Either case, as OpenMP reads it."""
        return next((m for m in cls if isinstance(value, str) and value.upper() == m.value), None)


class ActorResources(Validated):
    """Resources one actor reserves (its placement-group bundle); GPUs select the CUDA device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_cpus: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    num_gpus: float = Field(default=0.0, ge=0.0, allow_inf_nan=False, description="at most 1: a worker uses one GPU")
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources, e.g. a node label")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads; None: Ray's default")
    omp_wait: OmpWait | None = Field(
        default=None,
        description="the actor's OMP_WAIT_POLICY; None: the OpenMP runtime's default (idle threads spin a while). "
        "PASSIVE for a draft actor sharing a CPU's cores with its target: its threads then do not spin through "
        "the target's forward",
    )

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, resources: dict[str, float]) -> dict[str, float]:
        builtin = sorted(set(resources) & {"CPU", "GPU"})
        if builtin:
            raise ValueError(f"give {', '.join(builtin)} as num_cpus / num_gpus, not as custom resources")
        bad = sorted(k for k, v in resources.items() if not (math.isfinite(v) and v > 0))
        if bad:
            raise ValueError(f"custom resources are positive amounts: {bad}")
        return resources

    @field_validator("num_gpus")
    @classmethod
    def _one_gpu_at_most(cls, num_gpus: float) -> float:
        if num_gpus > 1:
            raise ValueError(
                f"num_gpus {num_gpus} > 1: a worker runs its model on one GPU (no tensor parallelism), so the rest "
                "would sit idle"
            )
        return num_gpus

    @model_validator(mode="after")
    def _reserves_something(self) -> ActorResources:
        fine = [k for k, v in self.bundle().items() if v < RAY_RESOURCE_STEP]
        if fine:
            raise ValueError(f"Ray counts resources in steps of {RAY_RESOURCE_STEP}: {fine} ask for less than one")
        if not any(v > 0 for v in self.bundle().values()):
            raise ValueError("an actor must reserve some resource (num_cpus, num_gpus or a custom resource)")
        return self

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus > 0 else "cpu"

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in bundle.items() if v > 0}

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": dict(self.resources),
        }
        if self.omp_wait is not None:  # read when the OpenMP runtime loads: set in the process's environment
            options["runtime_env"] = {"env_vars": {"OMP_WAIT_POLICY": self.omp_wait.value}}
        return options


class TinyModels(Validated):
    """Tiny random-weight models built inside the actors (for tests): ``tiny_model(seed)`` as the target and
    ``noisy_copy(target, draft_noise, seed=draft_seed)`` as the draft; text goes through a byte-level tokenizer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = Field(default=0, ge=0, lt=2**63)  # (torch's generator takes 64 bits: more failed in the actor)
    draft_noise: float = Field(default=0.05, ge=0.0)
    draft_seed: int = Field(default=1, ge=0, lt=2**63)
    draft_head: bool = Field(default=False, description="draft with a random EAGLE head over the target instead")


class ModelRecipe(Validated):
    """How an actor builds its model: small and picklable, so weights are built where they run and never travel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: WorkerRole
    spec: DraftSpec | None = None  # a model, or (draft role) an EAGLE head
    head_target: ModelSpec | None = None  # the target a head binds to (its embedding and LM head)
    tiny: TinyModels | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelRecipe:
        if (self.spec is None) == (self.tiny is None):
            raise ValueError("a model recipe has either a ModelSpec or tiny settings")
        if isinstance(self.spec, HeadSpec) and (self.role != WorkerRole.draft or self.head_target is None):
            raise ValueError("a draft head runs in the draft role and needs its target's ModelSpec")
        return self


class AppArgs(LoopConfig):
    """Which models, how speculation runs by default, and how a router replica is laid out.

    Models: ``pair`` (a name in MODEL_PAIRS), or ``target`` (+ optional ``draft``) ModelSpecs, or ``tiny``;
    nothing given means ``specserve.config.DEFAULT_PAIR``. A replica owns ``num_lanes``
    lanes; each lane is one target and one draft actor with its own continuous-batching loop. Per replica,
    ``num_lanes * max_batch_size`` requests run and ``max_queued_requests`` more wait; beyond that requests get a
    429.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pair: str | None = None
    target: TargetSpec | None = None
    draft: DraftSpec | None = None
    tiny: TinyModels | None = None
    served_model_name: str | None = Field(
        default=None, min_length=1, description="the model id clients send (default: the pair's or target's name)"
    )
    speculation: SpecConfig = SpecConfig()  # the loop settings (LoopConfig) speculate by default here
    num_lanes: int = Field(default=1, ge=1, le=64)
    max_queued_requests: int = Field(default=64, ge=0)
    stream_interval: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="tokens a streamed chunk gathers before it is sent (a request's first tokens and its end go at "
        "once): fewer, longer chunks cost the router and Serve's proxy less CPU (specserve/coalesce.py)",
    )
    retry_after_s: int = Field(
        default=1,
        ge=1,
        le=MAX_RETRY_AFTER_S,
        description="the least Retry-After of a 429 (estimated from the queue and step rate above it)",
    )
    max_request_bytes: int = Field(default=_HTTP_DEFAULTS.max_request_bytes, ge=1, description="larger bodies: 413")
    body_timeout_s: float = Field(
        default=_HTTP_DEFAULTS.body_timeout_s,
        gt=0.0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="a body not received within this: 408",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description=f"require `Authorization: Bearer <key>`; unset: the {API_KEY_ENV} environment variable",
    )

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, key: SecretStr | None) -> SecretStr | None:
        return checked_api_key(key)

    debug_routes: bool = Field(default=False, description="serve /debug/lanes (actor names, node ids, KV slots)")
    allowed_hosts: tuple[str, ...] = Field(
        default=_HTTP_DEFAULTS.allowed_hosts,
        description="without an API key, the Host names served (DNS rebinding); '*': any; with a key: any",
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:  # when the config is read, not at a replica's start
        return checked_hosts(hosts)

    freeze_gc: bool = Field(default=True, description=FREEZE_GC_HELP + "; in the router and in each worker actor")
    feature_wire: FeatureWire = Field(
        default=FeatureWire.float16,
        description="a draft head's float32 features between the actors: rounded to float16 (half the bytes; what "
        "the heads train on) or native (deployments/wire.py)",
    )
    router_resources: ActorResources = ActorResources(num_cpus=0.5)

    @field_validator("router_resources")
    @classmethod
    def _router_runs_no_model(cls, resources: ActorResources) -> ActorResources:
        for name in ("torch_threads", "omp_wait"):
            if getattr(resources, name) is not None:  # it would be accepted and do nothing
                raise ValueError(f"the router runs no model: {name} is for target_resources and draft_resources")
        if resources.num_gpus:  # a GPU each replica would hold idle
            raise ValueError("the router runs no model: num_gpus is for target_resources and draft_resources")
        return resources

    target_resources: ActorResources = ActorResources(num_cpus=1.0)
    draft_resources: ActorResources = ActorResources(num_cpus=0.5)
    placement_strategy: PlacementStrategy = PlacementStrategy.pack
    max_worker_restarts: int = Field(
        default=3, ge=0, description="consecutive losses of its target a lane recovers from"
    )
    worker_retry_s: float = Field(
        default=5.0,
        gt=0.0,
        le=300.0,
        description="pause after a failed try to bring a lost worker back (doubles, up to 300 s)",
    )
    worker_idle_check_s: float | None = Field(
        default=10.0,
        gt=0.0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="how often a lane with nothing to step checks that its workers answer (a dead one is replaced "
        "then, not when a request finds it); null: never",
    )
    max_failovers: int = Field(
        default=2,
        ge=0,
        description="times a request moves to another lane: its lane lost its workers for good, or handed it on while "
        "loading a new target",
    )
    failover_backoff_s: float = Field(
        default=1.0,
        ge=0.0,
        le=60.0,
        description="pause before a moved request goes to a lane still bringing its workers back (doubles each move, "
        "up to 60 s)",
    )
    worker_start_timeout_s: float = Field(
        default=900.0,
        gt=0.0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="a worker actor that has not loaded its model within this is replaced (at a replica's start: "
        "the start fails, saying so)",
    )
    worker_call_timeout_s: float = Field(
        default=600.0,
        gt=0.0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="a worker whose step call has not returned within this is replaced",
    )
    debug_step_delay_s: float = Field(default=0.0, ge=0.0, le=10.0, description="debug: sleep after each lane step")

    @model_validator(mode="wrap")
    @classmethod
    def _serving_defaults(cls, data: Any, handler: ModelWrapValidatorHandler[AppArgs]) -> AppArgs:
        """Left unset, a pair speculates as measured fastest for it on its devices (``speculation_device``), with
        the serving loop's guard and step budget (what `specserve generate` and app.yaml use; SpecConfig's own
        defaults are static chains of 4), and a target without a draft decodes plainly (chains would need a draft)."""
        if not isinstance(data, dict):
            return handler(data)
        if "speculation" not in data and data.get("target") is not None and data.get("draft") is None:
            data = {**data, "speculation": SpecConfig(method=SpecMethod.none)}
        args = handler(data)
        if args.pair_name is None:
            return args
        unset = {
            "speculation": serving_speculation(args.pair_name, args.speculation_device),
            "throughput_guard": SERVING_THROUGHPUT_GUARD,
            "max_step_tokens": SERVING_MAX_STEP_TOKENS,
        }
        unset = {k: v for k, v in unset.items() if k not in data}
        return handler({**data, **unset}) if unset else args

    @property
    def speculation_device(self) -> str:
        """Where the pair's speculation defaults are read for: cuda only where both actors have a GPU (the GPU's
        large trees on a CPU target, or on a CPU draft, were never measured and cost what the CPU's avoid)."""
        devices = {self.target_resources.device, self.draft_resources.device}
        return "cuda" if devices == {"cuda"} else "cpu"

    @model_validator(mode="after")
    def _one_model_source(self) -> AppArgs:
        sources = [self.pair is not None, self.target is not None, self.tiny is not None]
        if sum(sources) > 1:
            raise ValueError("give one of `pair`, `target` (+ `draft`) or `tiny`")
        if self.draft is not None and self.target is None:
            raise ValueError("`draft` needs a `target`")
        if self.pair is not None and self.pair not in MODEL_PAIRS:
            raise ValueError(f"unknown model pair {self.pair!r}; choose one of {sorted(MODEL_PAIRS)}")
        if self.speculation.needs_model and not self.has_draft:
            raise ValueError(f"speculation {self.speculation.method.value!r} needs a draft model")
        if self.speculation.synthetic_accept is not None:
            raise ValueError(
                "speculation.synthetic_accept is a benchmark mode whose outputs are not the target's: a deployment "
                "serves only lossless speculation"
            )
        if self.speculation.kld_mode != KLDMode.sparse:
            raise ValueError("draft and target run in separate actors: the KLD signal must use kld_mode 'sparse'")
        for role in self.roles if self.tiny is None else []:
            if (recipe := self.recipe(role)) is None or self.resources(role).device == "cpu":
                continue
            # CPU kernels: the actor would fail at load
            if (kernel := cpu_kernel(recipe.spec)) is not None:
                raise ValueError(f"a {kernel} {role.value} runs on the CPU; on a GPU, draft with a head")
            if (kernel := cpu_kernel(recipe.head_target)) is not None:
                raise ValueError(
                    f"the draft head loads its {kernel} target's embedding and LM head beside it, on the CPU only: "
                    "give the draft actor no GPU, or the target another format"
                )
        return self

    def http_options(self, environ: Mapping[str, str] = os.environ) -> HTTPOptions:
        """The HTTP layer's limits; the API key from the args, else from the environment of the replica."""
        # set, even to nothing, is a key given: an empty secret must not serve without authentication
        from_env = SecretStr(environ[API_KEY_ENV]) if API_KEY_ENV in environ else None
        key = self.api_key or checked_api_key(from_env, API_KEY_ENV)
        return HTTPOptions(
            max_request_bytes=self.max_request_bytes,
            body_timeout_s=self.body_timeout_s,
            api_key=key,
            debug_routes=self.debug_routes,
            allowed_hosts=self.allowed_hosts,
            unavailable_retry_after_s=math.ceil(self.worker_retry_s),  # when a lost lane tries its workers again
        )

    @property
    def pair_name(self) -> str | None:
        if self.pair is not None:
            return self.pair
        return DEFAULT_PAIR if self.target is None and self.tiny is None else None

    @property
    def has_draft(self) -> bool:
        return self.target is None or self.draft is not None

    @property
    def model_name(self) -> str:
        if self.served_model_name is not None:
            return self.served_model_name
        if self.tiny is not None:
            return TINY_MODEL_NAME
        if self.target is not None:
            return self.target.source
        assert self.pair_name is not None
        return self.pair_name

    def recipe(self, role: WorkerRole) -> ModelRecipe | None:
        if self.tiny is not None:
            return ModelRecipe(role=role, tiny=self.tiny)
        if self.target is not None:
            target, draft = self.target, self.draft
        else:
            assert self.pair_name is not None
            target, draft = MODEL_PAIRS[self.pair_name]
        spec = target if role == WorkerRole.target else draft
        head_target = target if isinstance(spec, HeadSpec) else None
        return None if spec is None else ModelRecipe(role=role, spec=spec, head_target=head_target)

    def resources(self, role: WorkerRole) -> ActorResources:
        return self.target_resources if role == WorkerRole.target else self.draft_resources

    def memory_share(self, role: WorkerRole) -> MemoryShare | None:
        """What an actor may fill of its GPU's memory (weights, KV, activations): ``gpu_memory_utilization`` times
        the fraction of the GPU it reserves, so actors sharing one GPU never size their KV for all of it."""
        if self.gpu_memory_utilization is None:
            return None
        return MemoryShare(self.gpu_memory_utilization, min(1.0, self.resources(role).num_gpus or 1.0))

    @property
    def roles(self) -> list[WorkerRole]:
        return [WorkerRole.target, WorkerRole.draft] if self.has_draft else [WorkerRole.target]

    @property
    def capacity(self) -> int:
        """Requests one replica holds at once: running plus queued."""
        return self.num_lanes * self.max_batch_size + self.max_queued_requests

    def placement_bundles(self) -> list[dict[str, float]]:
        """Bundle 0: the router replica; then per lane one bundle per actor, in ``bundle_index`` order."""
        bundles = [self.router_resources.bundle()]
        for _ in range(self.num_lanes):
            bundles += [self.resources(role).bundle() for role in self.roles]
        return bundles

    def bundle_index(self, lane: int, role: WorkerRole) -> int:
        return 1 + lane * len(self.roles) + self.roles.index(role)
