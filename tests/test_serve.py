"""The Ray Serve deployment end to end, over HTTP, on tiny models.

One simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``) and two Serve applications for the whole module:
- ``main``: 2 lanes, a close draft; checked against the in-process Engine on the same weights;
- ``small``: 1 lane of batch 1 with a queue of 1 (429s), a slow step (fault injection lands mid-stream), and
  custom node resources that force its target and draft actors onto different nodes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
import ray
import yaml
from ray import serve
from ray.cluster_utils import Cluster
from ray.job_config import JobConfig
from ray.serve.schema import ServeDeploySchema

from deployments.actors import ModelInfo
from deployments.app import app_builder
from deployments.app_args import ActorResources, AppArgs, OmpWait, TinyModels, WorkerRole
from deployments.router import lane_limits
from deployments.tiny_tokenizer import tiny_tokenizer
from load.resumable import ResumableStream
from specserve.api.convert import speculation_for
from specserve.api.schemas import SpeculationOptions
from specserve.config import Drafter, DType, HeadSpec, ModelSpec, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import UnsupportedModelError
from specserve.limits import MemoryShare
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from specserve.sampling import SamplingParams
from specserve.structured import FormatKind, OutputFormat
from tests.ports import start_serve_on_free_port

HEAD_RESOURCE, WORKER_RESOURCE = "node_head", "node_worker"
SPEC = {"method": "chain", "sl": 4}
SMALL_CPU = {"num_cpus": 0.1}
MAIN_ARGS: dict[str, Any] = {
    "tiny": {"seed": 0, "draft_noise": 0.02},
    "speculation": SPEC,
    "num_lanes": 2,
    "max_batch_size": 4,
    "max_queued_requests": 8,
    "router_resources": SMALL_CPU,
    "target_resources": SMALL_CPU,
    "draft_resources": SMALL_CPU,
    "debug_routes": True,  # the tests read lane and KV state from /debug/lanes
}
SMALL_ARGS: dict[str, Any] = {
    "tiny": {"seed": 0, "draft_noise": 0.3},
    "speculation": {"method": "chain", "sl": 3},
    "num_lanes": 1,
    "max_batch_size": 1,
    "max_queued_requests": 1,
    "retry_after_s": 2,
    "router_resources": SMALL_CPU,
    "target_resources": {"num_cpus": 0.1, "resources": {HEAD_RESOURCE: 1}},
    "draft_resources": {"num_cpus": 0.1, "resources": {WORKER_RESOURCE: 1}},
    "debug_step_delay_s": 0.03,
    "worker_idle_check_s": 0.5,
    "debug_routes": True,
}
HEAD_ARGS: dict[str, Any] = {  # a random EAGLE head: features travel target actor -> router -> draft actor
    "tiny": {"seed": 0, "draft_head": True, "draft_seed": 3},
    "speculation": {"method": "ddd", "beam_width": 4, "budget": 12, "policy": "dsde"},
    "max_batch_size": 2,
    "router_resources": SMALL_CPU,
    "target_resources": SMALL_CPU,
    "draft_resources": {**SMALL_CPU, "omp_wait": "PASSIVE"},  # as app.yaml's draft actor
    "debug_routes": True,
    "stream_interval": 4,  # streamed chunks of at least 4 tokens after the first
}
MODEL = "tiny"
REPO = Path(__file__).resolve().parents[1]  # workers import `deployments` from here
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 8, "resources": {HEAD_RESOURCE: 4}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=4, resources={WORKER_RESOURCE: 4})
    try:
        ray.init(address=cluster.address, job_config=JobConfig(code_search_path=[str(REPO)]))
        port = start_serve_on_free_port(proxy_location="HeadOnly")
        serve.run_many(
            [
                serve.RunTarget(app_builder(MAIN_ARGS), name="main", route_prefix="/main"),
                serve.RunTarget(app_builder(SMALL_ARGS), name="small", route_prefix="/small"),
                serve.RunTarget(app_builder(HEAD_ARGS), name="head", route_prefix="/head"),
            ]
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def main_url(base_url: str) -> str:
    return f"{base_url}/main"


@pytest.fixture(scope="module")
def small_url(base_url: str) -> str:
    return f"{base_url}/small"


@pytest.fixture(scope="module")
def client(main_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{main_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The in-process engine on the main app's weights and settings."""
    target = tiny_model(tiny_config(), seed=0)
    draft = noisy_copy(target, MAIN_ARGS["tiny"]["draft_noise"], seed=1)
    return Engine(target, tiny_tokenizer(), draft=draft, speculation=SpecConfig(**SPEC), max_batch_size=4)


def _lanes(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/debug/lanes", timeout=TIMEOUT_S).json()["lanes"]


def _wait_idle(url: str) -> list[dict[str, Any]]:
    """Wait until no lane holds a request or a KV slot on any worker, and every lane has its draft worker."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        lanes = _lanes(url)
        busy = [
            lane
            for lane in lanes
            if lane["in_flight"]
            or lane["running"]
            or lane["draft_lost"]  # still being brought back
            or any(w["kv_slots_in_use"] != 0 for w in lane["workers"])
        ]
        if not busy:
            return lanes
        assert time.monotonic() < deadline, f"lanes still busy: {busy}"
        time.sleep(0.1)


ABORTED, GENERATED = 'specserve_requests_total{status="aborted"}', "specserve_generation_tokens_total"
FAILED = 'specserve_requests_total{status="failed"}'


def _metric(url: str, sample: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    for line in lines:
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else json.loads(payload)


# -- configuration and mapping (no cluster) ---------------------------------------------------------------


def test_speculation_options_map_onto_the_default() -> None:
    default = SpecConfig(sl=5)
    assert speculation_for(None, default) is None
    assert speculation_for(SpeculationOptions(), default) is None  # nothing to change
    with pytest.raises(pydantic.ValidationError, match="valid boolean"):  # ("none" took any enabled, of any type)
        SpeculationOptions.model_validate({"policy": "none", "enabled": "yes"})
    for off in (SpeculationOptions(enabled=False), SpeculationOptions.model_validate({"policy": "none"})):
        assert speculation_for(off, default) == SpecConfig(method=SpecMethod.none)
    dsde = speculation_for(SpeculationOptions(policy=SLPolicyKind.dsde, max_sl=3), default)
    assert dsde is not None and dsde.policy == SLPolicyKind.dsde and dsde.max_sl == 3 and dsde.sl == 5
    ceiling = default.model_copy(update={"max_sl": 6})
    assert speculation_for(SpeculationOptions(max_sl=9), ceiling) is None  # a request cannot raise the ceiling
    lower = speculation_for(SpeculationOptions(max_sl=2), ceiling)
    assert lower is not None and lower.max_sl == 2
    plain = speculation_for(SpeculationOptions(), SpecConfig(method=SpecMethod.none))
    assert plain is not None and plain.method == SpecMethod.chain
    lookup = speculation_for(
        SpeculationOptions(method=SpecMethod.ddd, drafter=Drafter.lookup, model_fallback=False), default
    )
    assert lookup is not None and (lookup.method, lookup.drafter, lookup.model_fallback, lookup.sl) == (
        SpecMethod.ddd,
        Drafter.lookup,
        False,
        5,
    )
    assert speculation_for(SpeculationOptions(method=SpecMethod.none), default) == SpecConfig(method=SpecMethod.none)


def test_a_deployment_without_a_draft_model_keeps_its_speculation_settings_for_requests() -> None:
    """A request's override starts from the operator's settings (here the lookup drafter's), not the library's."""
    from deployments.router import Router

    class Defaults:  # the router's own property, without Ray
        default_speculation = Router.func_or_class.default_speculation

    spec = SpecConfig(method=SpecMethod.none, sl=7, model_free={"ngram_max": 6, "ngram_min": 3})
    router: Any = Defaults()
    router.args = AppArgs(target=ModelSpec(), speculation=spec)
    lookup = speculation_for(SpeculationOptions(drafter=Drafter.lookup), router.default_speculation)
    assert lookup is not None and (lookup.method, lookup.drafter, lookup.sl) == (SpecMethod.chain, Drafter.lookup, 7)
    assert (lookup.model_free.ngram_max, lookup.model_free.ngram_min) == (6, 3)


def test_actors_sharing_a_gpu_size_their_kv_for_their_share() -> None:
    half = ActorResources(num_cpus=1, num_gpus=0.5)
    shared = AppArgs(gpu_memory_utilization=0.9, target_resources=half, draft_resources=half)
    assert shared.memory_share(WorkerRole.target) == shared.memory_share(WorkerRole.draft) == MemoryShare(0.9, 0.5)
    whole = AppArgs(gpu_memory_utilization=0.9, target_resources=ActorResources(num_cpus=1, num_gpus=1))
    assert whole.memory_share(WorkerRole.target) == MemoryShare(0.9)
    assert AppArgs().memory_share(WorkerRole.target) is None


def test_app_args_layout_and_validation() -> None:
    args = AppArgs()
    assert args.pair_name == "smollm2-eagle" and args.model_name == "smollm2-eagle" and args.has_draft
    on_gpu = AppArgs(draft_resources=ActorResources(num_cpus=1, num_gpus=1))
    assert on_gpu.pair_name == "smollm2-eagle"
    with pytest.raises(ValueError, match="native_q4"):
        AppArgs(pair="smollm2-q4", draft_resources=ActorResources(num_cpus=1, num_gpus=1))
    lanes = AppArgs(tiny=TinyModels(), num_lanes=2, router_resources=ActorResources(num_cpus=0.5))
    assert lanes.placement_bundles() == [{"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 0.5}]
    assert [lanes.bundle_index(1, r) for r in (WorkerRole.target, WorkerRole.draft)] == [3, 4]
    gpu = ActorResources(num_cpus=2, num_gpus=1, resources={"a100": 1})
    assert gpu.device == "cuda" and gpu.bundle() == {"CPU": 2, "GPU": 1, "a100": 1}
    solo = AppArgs(target=ModelSpec(), speculation=SpecConfig(method=SpecMethod.none))
    assert solo.roles == [WorkerRole.target] and solo.recipe(WorkerRole.draft) is None
    lookup_only = AppArgs(target=ModelSpec(), speculation=SpecConfig(drafter=Drafter.suffix))  # needs no draft
    assert lookup_only.roles == [WorkerRole.target]
    for bad in (
        {"tiny": {}, "pair": "smollm2-bf16"},
        {"pair": "no-such-pair"},
        {"draft": {}},
        {"target": {}, "speculation": {"method": "chain"}},  # chains, but no draft
        {"speculation": {"kld_mode": "exact"}},  # dense draft logits must not cross actors
        {"target_resources": {"num_cpus": 0}},
        {"target_resources": {"num_cpus": float("inf")}},
        {"target_resources": {"num_cpus": 1, "resources": {"node_a": -1.0}}},
        {"api_key": ""},  # would switch authentication off
        {"served_model_name": ""},  # no client could name it
        {"max_batch_size": 0},
        {"stream_interval": 0},  # a chunk of no tokens
        {"stream_interval": 1.5},
        {"retry_after_s": 3601},  # above the router's cap: the "least Retry-After" could not hold
        {"target": {"source": ""}},  # read as the current directory
        {"target": {}, "draft": {"head": ""}},  # (without a target: refused for that alone)
        {"speculation": {"dsde": {"alpha": float("inf")}}},  # a range check alone lets infinity through
        {"speculation": {"ddd_threshold": float("-inf")}},
        {"guard": {"warmup_z": float("inf")}},
        # a boolean for a number (pydantic reads True as 1; YAML's no is false: max_queued_requests 0, no queue)
        {"max_queued_requests": False},
        {"max_batch_size": True},
        {"speculation": {"sl": True}},
        {"target_resources": {"num_cpus": True}},
        {"speculation": {"ddd_check_steps": [True, 2]}},  # ... within a list (YAML's yes read as check step 1)
        {"target_resources": {"num_cpus": 1, "resources": {"node_a": True}}},  # ... or a mapping
        {"tiny": {"seed": 2**70}},  # (torch's generator takes 64 bits: it failed inside the actor)
    ):
        with pytest.raises(pydantic.ValidationError):
            AppArgs.model_validate(bad)
    flags = AppArgs.model_validate({"tiny": {"draft_head": True}, "speculation": {"adaptive_floor": True}})
    assert flags.tiny is not None and flags.tiny.draft_head and flags.speculation.adaptive_floor  # (bools still)
    numbers = {"speculation": {"ddd_check_steps": [1, 2]}, "target_resources": {"resources": {"node_a": 0.5}}}
    nested = AppArgs.model_validate(numbers)
    assert nested.speculation.ddd_check_steps == (1, 2) and nested.target_resources.resources == {"node_a": 0.5}


@pytest.mark.parametrize(
    "path", ["deployments/app.yaml", "deployments/app-tiny.yaml", "cluster/serve-gpu.yaml", "cluster/rayservice.yaml"]
)
def test_shipped_serve_configs_validate(path: str) -> None:
    """Every shipped Serve config passes Serve's own schema and our AppArgs (what `serve run` would check)."""
    doc = yaml.safe_load((REPO / path).read_text())
    if doc.get("kind") == "RayService":
        doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
    apps = doc["applications"]
    assert len(ServeDeploySchema.model_validate(doc).applications) == len(apps)
    for app in apps:
        assert app["import_path"] == "deployments.app:app_builder"
        args = AppArgs.model_validate(app["args"])
        assert args.speculation.policy == SLPolicyKind.dsde  # the product: DSDE sets SL under SL_cap
        assert args.speculation.dsde.cap_enabled


def test_default_app_serves_the_shipped_head_with_its_serving_defaults() -> None:
    from specserve.config import DEFAULT_PAIR, SERVING_MAX_STEP_TOKENS, SERVING_THROUGHPUT_GUARD, serving_speculation

    args = AppArgs.model_validate(
        yaml.safe_load((REPO / "deployments/app.yaml").read_text())["applications"][0]["args"]
    )
    assert args.pair == DEFAULT_PAIR == "smollm2-eagle" and args.model_name == "smollm2-135m-instruct"
    assert args.speculation == serving_speculation(DEFAULT_PAIR) and args.throughput_guard == SERVING_THROUGHPUT_GUARD
    assert args.speculation.method == SpecMethod.ddd and args.speculation.policy == SLPolicyKind.dsde
    assert args.max_step_tokens == SERVING_MAX_STEP_TOKENS == 64
    # the draft actor's threads sleep between its forwards instead of spinning through the target's on shared cores
    assert args.draft_resources.omp_wait == OmpWait.passive and args.target_resources.omp_wait is None
    # streamed chunks of 4 tokens after the first: the serving side's CPU per token is taken from the forward
    assert args.stream_interval == 4 and AppArgs().stream_interval == 1
    recipe = args.recipe(WorkerRole.draft)
    assert recipe is not None and recipe.spec == HeadSpec(head="smollm2-eagle3")
    target = args.recipe(WorkerRole.target)
    assert target is not None and target.spec == ModelSpec()


def test_a_pair_left_without_speculation_settings_gets_its_measured_serving_defaults() -> None:
    """`args: {pair: smollm2-eagle}` served static chains of 4 without the guard (SpecConfig's own defaults), not
    what the pair was measured fastest with; a target without a draft was refused (chains need a draft)."""
    from specserve.config import SERVING_MAX_STEP_TOKENS, SERVING_SPECULATION, serving_speculation

    eagle = AppArgs.model_validate({"pair": "smollm2-eagle"})
    assert eagle.speculation.method == SpecMethod.ddd and eagle.speculation == serving_speculation("smollm2-eagle")
    assert eagle.throughput_guard and eagle.max_step_tokens == SERVING_MAX_STEP_TOKENS
    on_gpus = {"num_cpus": 1, "num_gpus": 1}
    gpu = AppArgs.model_validate({"pair": "smollm2-eagle", "draft_resources": on_gpus, "target_resources": on_gpus})
    assert gpu.speculation == serving_speculation("smollm2-eagle", "cuda") != eagle.speculation
    for side in ("draft_resources", "target_resources"):  # one actor on a GPU: the CPU's trees (its own rows cost)
        assert AppArgs.model_validate({"pair": "smollm2-eagle", side: on_gpus}).speculation == eagle.speculation
    assert AppArgs.model_validate({}).speculation == eagle.speculation  # the default pair's
    assert AppArgs.model_validate({"pair": "smollm2-q4"}).speculation == SERVING_SPECULATION
    alone = AppArgs.model_validate({"target": {"source": "smollm2-135m-instruct"}})
    assert alone.speculation.method == SpecMethod.none and not alone.throughput_guard
    given = AppArgs.model_validate(
        {"pair": "smollm2-eagle", "speculation": {"method": "chain"}, "throughput_guard": False}
    )
    assert given.speculation == SpecConfig(method=SpecMethod.chain) and not given.throughput_guard  # kept as given
    tiny = AppArgs.model_validate({"tiny": {}})
    assert tiny.speculation == SpecConfig() and not tiny.throughput_guard  # no measured pair: as configured


def test_the_guards_settings_are_app_args_checked_where_they_are_read() -> None:
    from specserve.guard import GuardConfig

    assert AppArgs.model_validate({"guard": {"margin": 0.2, "explore_every": 7}}).guard == GuardConfig(
        margin=0.2, explore_every=7
    )
    assert AppArgs().guard == GuardConfig()
    for bad, field in (
        ({"margin": 1.5}, "guard.margin"),
        ({"warmup": 5, "max_warmup": 4}, "guard"),
        ({"x": 1}, "guard.x"),
    ):
        with pytest.raises(pydantic.ValidationError, match=field):
            AppArgs.model_validate({"guard": bad})


def test_a_draft_is_a_head_or_a_model_by_the_fields_it_names() -> None:
    """``draft: {dtype: bfloat16}`` (the YAML of the smollm2-bf16 pair's draft without its source) silently became
    the default EAGLE head in bf16: both kinds accept it, and the union took the first. Now the fields decide, and a
    draft that names only fields both kinds have is refused."""
    from specserve.config import EngineConfig

    for build in (lambda d: AppArgs(target={}, draft=d).draft, lambda d: EngineConfig(draft=d).draft):
        assert build({"head": "smollm2-eagle3", "dtype": "bfloat16"}) == HeadSpec(dtype=DType.bfloat16)
        assert build({"quantize": "none"}) == HeadSpec(quantize="none")  # type: ignore[arg-type]
        assert build({"source": "smollm2", "dtype": "bfloat16"}) == ModelSpec(source="smollm2", dtype=DType.bfloat16)
        assert build({"dtype": "bfloat16", "int8_dynamic": False}) == ModelSpec(dtype=DType.bfloat16)
        assert build(ModelSpec(dtype=DType.float16)) == ModelSpec(dtype=DType.float16)
        for ambiguous in ({}, {"dtype": "bfloat16"}):
            with pytest.raises(pydantic.ValidationError, match="a draft names its `head`"):
                build(ambiguous)


def test_generate_drafts_with_the_default_pair_of_its_device() -> None:
    from specserve.cli import _draft_for
    from specserve.config import MODEL_PAIRS, HeadSpec

    assert _draft_for("auto", ModelSpec()) == MODEL_PAIRS["smollm2-eagle"][1]
    assert isinstance(_draft_for("auto", ModelSpec()), HeadSpec)
    assert _draft_for("auto", ModelSpec(source="/some/other/model")) is None
    assert _draft_for("none", ModelSpec()) is None


def test_generate_speculates_as_measured_fastest_for_its_pair() -> None:
    from specserve.cli import _pair_for
    from specserve.config import SERVING_SPECULATION, serving_speculation

    pair = _pair_for("auto", ModelSpec())
    assert pair == "smollm2-eagle" and _pair_for("auto", ModelSpec(dtype=DType.bfloat16)) is None
    assert serving_speculation("smollm2-q4") == SERVING_SPECULATION  # DSDE chains of the 4-bit copy
    head = serving_speculation(pair)  # on the CPU: prompt lookup's trees, else the EAGLE-3 head's shallow DDD trees
    assert head.method == SpecMethod.ddd and head.ddd_check_steps == (1, 2, 3) and head.model_tree_budget == 6
    assert head.policy == SLPolicyKind.dsde and head.free_tree_priced  # DSDE: the head's depth budget
    assert head.ddd_threshold == -0.03 and head.adaptive_floor and head.model_free.calibrated
    assert head.drafter == Drafter.lookup and head.model_fallback and head.budget == 8
    gpu = serving_speculation(pair, "cuda:0")  # on a GPU, where verify rows are cheap: wider, deeper trees
    assert gpu.method == SpecMethod.ddd and gpu.ddd_check_steps == (2, 3, 4) and gpu.budget == 32
    assert serving_speculation("smollm2-q4", "cuda") == SERVING_SPECULATION  # no GPU measurement: the CPU's
    assert _pair_for("smollm2-eagle", ModelSpec()) == "smollm2-eagle"
    assert _pair_for("/some/head/dir", ModelSpec()) is None and _pair_for("none", ModelSpec()) is None
    assert serving_speculation(None) == SERVING_SPECULATION  # a head directory: the serving default


def test_lane_limits_match_the_engine() -> None:
    target = tiny_model(tiny_config(), seed=0)
    info = ModelInfo(target.cfg.vocab_size, target.max_positions, frozenset({2}))
    for spec in (SpecConfig(), SpecConfig(method=SpecMethod.ddd, budget=80), SpecConfig(policy=SLPolicyKind.dsde)):
        args = AppArgs(tiny=TinyModels(), speculation=spec, max_model_len=300)
        limits = lane_limits(args, info, info)
        loop = Engine(target, None, draft=target, speculation=spec, max_model_len=300).loop
        assert (limits.max_model_len, limits.spec_headroom) == (loop.max_model_len, loop.spec_headroom)
        assert limits.kv_len == loop.target.cache.max_len
    with pytest.raises(UnsupportedModelError):
        lane_limits(AppArgs(tiny=TinyModels()), info, ModelInfo(100, 512, frozenset()))


# -- the OpenAI client, and equality with the in-process engine ------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_equal_engine(client: openai.OpenAI, engine: Engine, stream: bool) -> None:
    prompt = "The quick brown fox"
    ref = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2))[0]
    extra = {"return_token_ids": True, "ignore_eos": True}
    if stream:
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True, logprobs=2, extra_body=extra
            )
        )
        text = "".join(c.choices[0].text for c in chunks)
        ids = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
        finish = chunks[-1].choices[0].finish_reason
        logprobs = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs or []]
    else:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=2, extra_body=extra
        )
        text, ids, finish = out.choices[0].text, out.choices[0].model_extra["token_ids"], out.choices[0].finish_reason
        assert out.choices[0].logprobs is not None
        logprobs = list(out.choices[0].logprobs.token_logprobs or [])
        assert out.usage is not None and out.usage.completion_tokens == 24
        assert out.usage.prompt_tokens == len(ref.prompt_ids)
        spec = out.usage.model_extra["speculation"]
        assert spec["target_forwards"] == ref.stats.target_forwards and spec["accepted"] == ref.stats.accepted
        assert spec["mean_accepted_length"] > 1.0
    assert ids == ref.token_ids and text == ref.text and finish == "length"
    # through the actors too (the target actor's logprobs travel with the step's results)
    assert ref.logprobs is not None and logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


def test_a_structured_answer_equals_the_engines_through_the_actors(client: openai.OpenAI, engine: Engine) -> None:
    """The grammar's bit rows travel to the target actor with the step: the held answer is the engine's."""
    pattern = "[a-f]{3,8}-[0-9]{2}"
    fmt = OutputFormat(kind=FormatKind.regex, pattern=pattern, param="structured_outputs")
    ref = engine.generate("A code:", SamplingParams(max_tokens=20, output_format=fmt))[0]
    out = client.completions.create(
        model=MODEL,
        prompt="A code:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}, "return_token_ids": True},
    )
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids and out.choices[0].text == ref.text
    assert ref.finish_reason.value == "stop" and re.fullmatch(pattern, ref.text)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_equals_engine(client: openai.OpenAI, engine: Engine, stream: bool) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ref = engine.generate(messages, SamplingParams(max_tokens=20), chat=True)[0]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        assert not chunks[-1].choices and usage is not None
    else:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)  # type: ignore[arg-type]
        text, finish, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
        assert out.choices[0].message.role == "assistant"
    assert text == ref.text and finish == ref.finish_reason.value
    assert usage is not None and usage.completion_tokens == len(ref.token_ids)
    assert usage.prompt_tokens == len(ref.prompt_ids) and usage.total_tokens == usage.prompt_tokens + len(ref.token_ids)


def test_concurrent_requests_batch_across_lanes(client: openai.OpenAI, engine: Engine, main_url: str) -> None:
    prompts = [[5, 9, 13], [100, 200, 300, 400, 7], [42], [7, 7, 7, 7], [300, 1, 2, 3], [11, 12], [99, 98, 97]]
    refs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))

    def one(prompt: list[int]) -> list[int]:
        out = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return out.choices[0].model_extra["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(one, prompts))
    assert outs == [r.token_ids for r in refs]
    _wait_idle(main_url)


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, engine: Engine) -> None:
    """The same seeded request twice gets the same tokens: those the engine samples in-process for it (a function
    of the request alone), not greedy decoding's."""
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "abc", "max_tokens": 16, "temperature": 0.9, "seed": 7}
    extra = {"return_token_ids": True, "top_k": 20, "ignore_eos": True}
    a = client.completions.create(**kwargs, extra_body=extra)
    b = client.completions.create(**kwargs, extra_body=extra)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=16, ignore_eos=True)
    assert a.choices[0].model_extra["token_ids"] == engine.generate("abc", sampled)[0].token_ids
    greedy = engine.generate("abc", SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    assert a.choices[0].model_extra["token_ids"] != greedy
    # n choices through the Serve app: choice i is the engine's answer with the seed plus i
    several = client.completions.create(**kwargs, n=3, extra_body=extra)
    assert [c.index for c in several.choices] == [0, 1, 2]
    for i, c in enumerate(several.choices):
        want = engine.generate("abc", sampled.model_copy(update={"seed": 7 + i}))[0].token_ids
        assert c.model_extra is not None and c.model_extra["token_ids"] == want, i
    assert several.usage is not None and several.usage.completion_tokens == 48


def test_speculation_options(client: openai.OpenAI, engine: Engine) -> None:
    ref = engine.generate([1, 2, 3], SamplingParams(max_tokens=24, ignore_eos=True))[0]

    def run(speculation: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        out = client.completions.create(
            model=MODEL,
            prompt=[1, 2, 3],
            max_tokens=24,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True, "speculation": speculation},
        )
        return out.choices[0].model_extra["token_ids"], out.usage.model_extra["speculation"]  # type: ignore[union-attr]

    for options in ({"enabled": False}, {"policy": "none"}):
        ids, spec = run(options)
        assert ids == ref.token_ids and spec["drafted"] == 0 and spec["target_forwards"] == 24
    ids, spec = run({"max_sl": 2, "policy": "static"})
    assert ids == ref.token_ids and 0 < spec["drafted"] <= 2 * spec["target_forwards"]
    ids, spec = run({"policy": "dsde"})
    assert ids == ref.token_ids and spec["drafted"] > 0
    # model-free: the replica's suffix cache keeps answers from the first request that may draft from it (this
    # one, whose own answer is the first kept), so the repeat is drafted from the cache
    suffix = {"drafter": "suffix", "method": "ddd", "model_fallback": False, "policy": "static"}
    ids, first = run(suffix)
    assert ids == ref.token_ids
    ids, spec = run(suffix)
    assert ids == ref.token_ids and spec["accepted"] >= 12 and spec["accepted"] > first["accepted"]
    ids, spec = run({"drafter": "lookup", "method": "chain", "model_fallback": False})
    assert ids == ref.token_ids


# -- bad input: a 4xx with OpenAI's error body, never a 500 ----------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, JSON body or raw bytes, status, param)
    ("malformed-json", COMPLETIONS, b'{"model": "tiny", "prompt": ', 400, None),
    ("not-an-object", COMPLETIONS, [1, 2, 3], 400, None),
    ("missing-prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    ("prompt-wrong-type", COMPLETIONS, {"model": MODEL, "prompt": {"text": "x"}}, 400, "prompt"),
    ("max-tokens-string", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("max-tokens-negative", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("max-tokens-absurd", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("temperature-negative", COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature-huge", COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": 1e9}, 400, "temperature"),
    ("top-p-zero", COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top-k-negative", COMPLETIONS, {"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),  # -1, 0: off
    ("seed-beyond-int64", COMPLETIONS, {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),  # OpenAI: int64
    ("stop-empty", COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop"),
    ("stop-wrong-type", COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": 5}, 400, "stop"),
    ("n-seventeen", COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("unknown-field", COMPLETIONS, {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("empty-prompt", COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, None),
    ("token-out-of-vocab", COMPLETIONS, {"model": MODEL, "prompt": [1, 99999]}, 400, None),
    ("prompt-too-long", COMPLETIONS, {"model": MODEL, "prompt": [5] * 1000}, 400, "prompt"),
    ("stream-options-no-stream", COMPLETIONS, {"model": MODEL, "prompt": "x", "stream_options": {}}, 400, None),
    ("spec-max-sl-zero", COMPLETIONS, {"model": MODEL, "prompt": "x", "speculation": {"max_sl": 0}}, 400, None),
    ("spec-bad-policy", COMPLETIONS, {"model": MODEL, "prompt": "x", "speculation": {"policy": "x"}}, 400, None),
    ("unknown-model", COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("chat-missing-messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("chat-messages-string", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("chat-empty-messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat-bad-role", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("chat-n-zero", CHAT, {**OK_CHAT, "n": 0}, 400, "n"),
    ("chat-unknown-model", CHAT, {**OK_CHAT, "model": "nope"}, 404, "model"),
    ("lone-surrogate", COMPLETIONS, b'{"model": "tiny", "prompt": "ab\\ud800cd"}', 400, None),
    ("chat-surrogate", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("surrogate-key", COMPLETIONS, b'{"model": "tiny", "prompt": "x", "\\ud800": 1}', 400, None),
    (
        "surrogate-metadata-key",
        COMPLETIONS,
        b'{"model": "tiny", "prompt": "x", "metadata": {"\\ud800": ""}}',
        400,
        "metadata",
    ),
    (
        "chat-surrogate-key",
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x", "\\ud800": 1}]}',
        400,
        "messages",
    ),
    ("chat-long", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "word " * 800}]}, 400, "messages"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_is_4xx_with_openai_error(
    main_url: str, path: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = httpx.post(main_url + path, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    else:
        r = httpx.post(main_url + path, json=body, timeout=TIMEOUT_S)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    if b'\\ud800":' in (body if isinstance(body, bytes) else b""):  # a key: named escaped, not as U+FFFD
        assert "a key '\\ud800' is not valid Unicode" in error["message"] and "\ufffd" not in error["message"]


def test_unknown_route_and_method(main_url: str) -> None:
    r = httpx.get(f"{main_url}/v1/nothing", timeout=TIMEOUT_S)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{main_url}{COMPLETIONS}", timeout=TIMEOUT_S)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", n=17)
    assert info.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


# -- cancellation and overload ---------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_kv_on_both_workers(small_url: str) -> None:
    """The small app steps slowly: left alone, this request would run for many seconds; the abort frees it at once."""
    _wait_idle(small_url)
    aborted, generated, failed = (_metric(small_url, name) for name in (ABORTED, GENERATED, FAILED))
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{small_url}{COMPLETIONS}", json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        events = _sse_events(r.iter_lines())
        next(events), next(events)
        (lane,) = _lanes(small_url)
        assert lane["running"] == 1 and [w["kv_slots_in_use"] for w in lane["workers"]] == [1, 1]
    closed = time.monotonic()
    lanes = _wait_idle(small_url)  # the abort released the sequence on the target and on the draft
    assert time.monotonic() - closed < 3.0
    assert all(w["kv_slots_in_use"] == 0 for lane in lanes for w in lane["workers"])
    assert _metric(small_url, ABORTED) == aborted + 1
    assert _metric(small_url, FAILED) == failed  # a client that leaves is not a server failure
    # the tokens delivered to it count: only finished requests' used to, so throughput read from /metrics left out
    # every request a client gave up on
    assert generated + 1 <= _metric(small_url, GENERATED) < generated + 400


def _open_stream(url: str, stack: list[Any], max_tokens: int = 300) -> httpx.Response:
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    cm = httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=TIMEOUT_S)
    stack.append(cm)
    return cm.__enter__()


def test_full_queue_is_429_with_retry_after(small_url: str) -> None:
    _wait_idle(small_url)
    opened: list[Any] = []
    try:
        running, queued = _open_stream(small_url, opened), _open_stream(small_url, opened)  # batch 1 + queue 1
        assert running.status_code == 200 and queued.status_code == 200
        r = httpx.post(f"{small_url}{COMPLETIONS}", json={"model": MODEL, "prompt": "x"}, timeout=TIMEOUT_S)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 2  # args.retry_after_s is the floor
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        for cm in reversed(opened):
            cm.__exit__(None, None, None)
    _wait_idle(small_url)
    ok = httpx.post(
        f"{small_url}{COMPLETIONS}", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=TIMEOUT_S
    )
    assert ok.status_code == 200
    assert _metric(small_url, 'specserve_requests_total{status="rejected"}') == 1.0


# -- faults: a killed worker actor is recreated and the streams go on ------------------------------------


@pytest.mark.parametrize("role", ["target", "draft"])
def test_killed_worker_mid_stream_is_recovered(small_url: str, engine: Engine, role: str) -> None:
    _wait_idle(small_url)
    before = {w["role"]: w for w in _lanes(small_url)[0]["workers"]}
    prompts = [[3, 4, 5], [8, 9]]
    refs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))  # same target weights
    client = openai.OpenAI(base_url=f"{small_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
    streams = [
        client.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        for p in prompts  # the first runs, the second waits in the queue
    ]
    first = iter(streams[0])
    ids = [next(first).choices[0].model_extra["token_ids"] for _ in range(2)]
    ray.kill(ray.get_actor(before[role]["actor_name"], namespace=before[role]["namespace"]))
    ids += [c.choices[0].model_extra["token_ids"] for c in first]
    got = [[t for chunk in ids for t in chunk], [t for c in streams[1] for t in c.choices[0].model_extra["token_ids"]]]
    assert got == [r.token_ids for r in refs]
    after = {w["role"]: w for w in _wait_idle(small_url)[0]["workers"]}
    assert after[role]["restarts"] == before[role]["restarts"] + 1
    assert after[role]["actor_name"] != before[role]["actor_name"]
    assert after[role]["node_id"] == before[role]["node_id"]  # same placement bundle


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_worker_killed_while_its_lane_is_idle_is_replaced_with_no_request(
    small_url: str, engine: Engine, role: str
) -> None:
    """Its death was found only by the next request, which then waited for the new worker to load."""
    before = {w["role"]: w for w in _wait_idle(small_url)[0]["workers"]}
    ray.kill(ray.get_actor(before[role]["actor_name"], namespace=before[role]["namespace"]))
    deadline = time.monotonic() + TIMEOUT_S
    name = before[role]["actor_name"]
    while (now := {w["role"]: w for w in _lanes(small_url)[0]["workers"]}).get(role, before[role])[
        "actor_name"
    ] == name:
        assert time.monotonic() < deadline, "the idle lane did not replace its dead worker"
        time.sleep(0.2)  # (a dead draft is detached first, then a new one attached)
    assert now[role]["actor_name"] != before[role]["actor_name"] and now[role]["restarts"] > before[role]["restarts"]
    _wait_idle(small_url)  # (a draft comes back in the background)
    client = openai.OpenAI(base_url=f"{small_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
    out = client.completions.create(
        model=MODEL, prompt=[3, 4, 5], max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    ref = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=12))[0]
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids


def test_a_replaced_worker_is_ended_even_if_it_was_only_unreachable() -> None:
    """A lane replaces a worker whose call raised RayActorError, which includes ActorUnavailableError (an actor
    that was unreachable for a while and may still run, holding its bundle's resources): the old actor is killed
    before its replacement is made, or the replacement could not be placed in that bundle."""
    from types import SimpleNamespace

    from deployments.actors import RemoteTarget
    from deployments.lane import Lane

    events: list[str] = []

    class Handle:
        def __init__(self, name: str) -> None:
            self.start = SimpleNamespace(remote=lambda geometry: events.append(f"start {name}"))

    class Old(RemoteTarget):
        def kill(self) -> None:
            events.append(f"kill {self.name}")

    def create(lane: int, role: WorkerRole, generation: int) -> RemoteTarget:
        events.append(f"create {generation}")
        return RemoteTarget(Handle(f"new{generation}"), f"new{generation}", role)  # type: ignore[arg-type]

    old = Old(Handle("old"), "old", WorkerRole.target)  # type: ignore[arg-type]
    lane = SimpleNamespace(
        workers={WorkerRole.target: old},
        generations={WorkerRole.target: 0},
        factory=SimpleNamespace(create=create),
        geometry=None,
        loop=SimpleNamespace(target=old, draft=None),
        metrics=SimpleNamespace(worker_restarted=lambda index, role: events.append("counted")),
        index=0,
        lost_workers=True,  # a replacement that failed before
        worker_retry_s=5.0,
        _retry_pause=80.0,
    )
    Lane._replace_target(lane)  # type: ignore[arg-type]
    assert events == ["kill old", "create 1", "start new1", "counted"]
    assert lane.loop.target is lane.workers[WorkerRole.target] and lane.loop.target.name == "new1"
    # made is not started: the lane is healthy again once a step succeeds or the replacement has started
    assert lane.lost_workers and lane._retry_pause == 80.0


def test_eagle_head_deployment_is_lossless_and_survives_a_draft_restart(base_url: str, engine: Engine) -> None:
    """The head drafts from target features shipped through the router; killing its actor mid-stream loses
    them (the new head restarts from later features) and the output still equals plain greedy decoding."""
    url = f"{base_url}/head"
    _wait_idle(url)
    prompts = [[3, 4, 5, 6], [8, 9, 10]]
    refs = Engine(engine.model, None, eos_token_ids=set()).generate(
        prompts, SamplingParams(max_tokens=30, ignore_eos=True)
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
    extra = {"return_token_ids": True, "ignore_eos": True}
    full = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=30, temperature=0, extra_body=extra)
    assert full.choices[0].model_extra["token_ids"] == refs[1].token_ids
    assert full.usage.model_extra["speculation"]["drafted"] > 0
    lookup = {**extra, "speculation": {"drafter": "lookup"}}  # the default's drafters: lookup, the head where it fails
    both = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=30, temperature=0, extra_body=lookup)
    assert both.choices[0].model_extra["token_ids"] == refs[1].token_ids
    assert both.usage.model_extra["speculation"]["drafted"] > 0
    draft = next(w for w in _lanes(url)[0]["workers"] if w["role"] == "draft")
    stream = iter(
        client.completions.create(
            model=MODEL, prompt=prompts[0], max_tokens=30, temperature=0, stream=True, extra_body=extra
        )
    )
    ids = [next(stream).choices[0].model_extra["token_ids"] for _ in range(3)]
    target = next(w for w in _lanes(url)[0]["workers"] if w["role"] == "target")
    assert _actor_env(draft, "OMP_WAIT_POLICY") == "PASSIVE"  # its omp_wait, set in its process's environment
    assert _actor_env(target, "OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY")  # inherited, not set
    ray.kill(ray.get_actor(draft["actor_name"], namespace=draft["namespace"]))
    ids += [c.choices[0].model_extra["token_ids"] for c in stream]
    assert [t for chunk in ids for t in chunk] == refs[0].token_ids
    assert len(ids[0]) >= 1 and all(len(chunk) >= HEAD_ARGS["stream_interval"] for chunk in ids[1:-1])
    deadline = time.monotonic() + TIMEOUT_S
    while not (new := [w for w in _lanes(url)[0]["workers"] if _replaced(w, draft)]):
        assert time.monotonic() < deadline, "the lost draft actor was not replaced"
        time.sleep(0.2)
    assert _actor_env(new[0], "OMP_WAIT_POLICY") == "PASSIVE"  # the replacement too


def _replaced(worker: dict[str, Any], lost: dict[str, Any]) -> bool:
    return worker["role"] == "draft" and worker["actor_name"] != lost["actor_name"] and worker["node_id"] is not None


def _actor_env(worker: dict[str, Any], name: str) -> str | None:
    actor = ray.get_actor(worker["actor_name"], namespace=worker["namespace"])
    return ray.get(actor.__ray_call__.remote(lambda _: os.environ.get(name)), timeout=TIMEOUT_S)


# -- placement -------------------------------------------------------------------------------------------


def test_draft_and_target_are_separate_actors_on_their_nodes(small_url: str, main_url: str) -> None:
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    workers = {w["role"]: w for w in _lanes(small_url)[0]["workers"]}
    assert workers["target"]["actor_name"] != workers["draft"]["actor_name"]
    assert HEAD_RESOURCE in nodes[workers["target"]["node_id"]]
    assert WORKER_RESOURCE in nodes[workers["draft"]["node_id"]]
    main_lanes = _lanes(main_url)
    names = {w["actor_name"] for lane in main_lanes for w in lane["workers"]}
    assert len(main_lanes) == 2 and len(names) == 4  # one target and one draft actor per lane
    actors = ray.util.list_named_actors(all_namespaces=True)
    assert {n for n in names} <= {a["name"] for a in actors}


# -- observability (last: counts what the tests above did) -----------------------------------------------


def test_models_health_metrics(client: openai.OpenAI, main_url: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == 512 - 64
    health = httpx.get(f"{main_url}/health", timeout=TIMEOUT_S)
    assert health.status_code == 200 and health.json() == {"status": "ok", "lanes": 2, "lanes_alive": 2}
    dsde = {"speculation": {"policy": "dsde"}, "ignore_eos": True}  # long enough to leave DSDE's warm-up
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=150, temperature=0, extra_body=dsde)
    metrics = httpx.get(f"{main_url}/metrics", timeout=TIMEOUT_S)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in (
        'specserve_requests_total{status="ok"}',
        'specserve_requests_total{status="invalid"}',
        "specserve_time_to_first_token_seconds_count",
        "specserve_time_per_output_token_seconds_count",
        "specserve_generation_tokens_total",
        "specserve_accepted_tokens_total",
        "specserve_request_acceptance_rate_count",
        "specserve_request_mean_accepted_length_count",
        'specserve_speculation_length_count{lane="0"}',
        'specserve_queue_depth{lane="0"}',
        'specserve_step_seconds_count{lane="1"}',
        "specserve_sl_cap{lane=",
        "specserve_straggler_idle_fraction{lane=",
    ):
        assert name in text, name


def test_tokenize_through_the_app_counts_the_prompt_a_request_is_made_of(main_url: str, engine: Engine) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    got = httpx.post(f"{main_url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=TIMEOUT_S)
    assert got.status_code == 200 and got.json()["tokens"] == engine.encode(messages, chat=True), got.text
    back = httpx.post(f"{main_url}/detokenize", json={"tokens": engine.encode("a red fox")}, timeout=TIMEOUT_S)
    assert back.status_code == 200 and back.json() == {"prompt": "a red fox"}, back.text


# -- the Router itself killed mid-stream (last: its replica is replaced) ------------------------------------


def _router_replica(app: str) -> ray.actor.ActorHandle:
    replicas = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#Router#")
    ]
    assert len(replicas) == 1, replicas
    return ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])


def test_router_killed_mid_stream_every_resumed_stream_equals_the_fault_free_run(
    small_url: str, engine: Engine
) -> None:
    """kill -9 of the Router replica cuts its streams without [DONE]; Serve starts a new replica (with new worker
    actors) and the client helper resends each request after its last event id: the text and tokens equal the
    fault-free run, for a sampled stream cut mid-way (resent with the seed the server returned and its last event
    id) and for a greedy one cut while it waited in the queue."""
    _wait_idle(small_url)
    n = 150  # tokens: seconds of generation at the small app's step delay, so the kill lands mid-stream
    body: dict[str, Any] = {"model": MODEL, "max_tokens": n, "return_token_ids": True, "ignore_eos": True}
    greedy = {**body, "prompt": [3, 4, 5], "temperature": 0}
    sampled = {**body, "prompt": [8, 9], "temperature": 0.8, "top_k": 30}
    fault_free = ResumableStream(small_url, "/v1/completions", sampled)
    reference = {"sampled": list(fault_free.deltas())}
    assert fault_free.seed is not None and fault_free.resumes == 0
    reference["greedy"] = list(ResumableStream(small_url, "/v1/completions", greedy).deltas())
    ref_ids = engine.generate([3, 4, 5], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids
    assert [t for d in reference["greedy"] for t in d.token_ids] == ref_ids

    streams = {  # the sampled one runs (batch 1), the greedy one waits in the queue
        "sampled": ResumableStream(small_url, "/v1/completions", {**sampled, "seed": fault_free.seed}),
        "greedy": ResumableStream(small_url, "/v1/completions", greedy),
    }
    iters = {name: s.deltas() for name, s in streams.items()}
    got = {"sampled": [next(iters["sampled"]) for _ in range(3)], "greedy": []}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(next, iters["greedy"])  # sends the greedy request, which queues behind the sampled one
        time.sleep(0.5)
        ray.kill(_router_replica("small"), no_restart=True)
        got["greedy"].append(queued.result())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rest = dict(zip(iters, pool.map(list, iters.values()), strict=True))
    for name in streams:
        deltas = got[name] + rest[name]
        assert "".join(d.text for d in deltas) == "".join(d.text for d in reference[name]), name
        assert [t for d in deltas for t in d.token_ids] == [t for d in reference[name] for t in d.token_ids], name
        assert streams[name].resumes >= 1, name
    assert httpx.get(f"{small_url}/health", timeout=TIMEOUT_S).status_code == 200


def test_a_misspelt_model_or_head_field_is_refused_not_dropped() -> None:
    """A draft head spec with a typo must not fall back to a whole draft model (the union's other member), nor a
    target's misspelt dtype to float32."""
    target = {"source": "smollm2-135m-instruct"}
    head_typo = {
        "target": target,
        "draft": {"head": "smollm2-eagle3", "draft_vocb": 2048},
        "speculation": {"method": "eagle2"},
    }
    with pytest.raises(pydantic.ValidationError, match="draft_vocb"):
        AppArgs.model_validate(head_typo)
    with pytest.raises(pydantic.ValidationError, match="dtpye"):
        AppArgs.model_validate({"target": {"source": "smollm2-135m-instruct", "dtpye": "bfloat16"}})
    ok = AppArgs.model_validate(
        {
            "target": target,
            "draft": {"head": "smollm2-eagle3", "draft_vocab": 2048},
            "speculation": {"method": "eagle2"},
        }
    )
    assert ok.draft is not None and getattr(ok.draft, "head", None) == "smollm2-eagle3"


def test_settings_that_would_fail_at_load_or_in_ray_are_refused_at_validation() -> None:
    """native_q4 off its terms (a GPU actor, bfloat16, int8, a source without GGUF blocks), and CPU / GPU given as
    custom resources or in quantities Ray cannot schedule, fail when the config is read, not in an actor later."""
    q4 = {"source": "smollm2-135m-instruct", "native_q4": True}
    gpu = {"num_cpus": 1, "num_gpus": 1}
    with pytest.raises(pydantic.ValidationError, match="native_q4 target runs on the CPU"):
        AppArgs.model_validate({"target": q4, "speculation": {"method": "none"}, "target_resources": gpu})
    # int8_dynamic is a CPU kernel too: the shipped int8 pair with a GPU draft validated, then failed at its load
    with pytest.raises(pydantic.ValidationError, match="int8_dynamic draft runs on the CPU"):
        AppArgs.model_validate({"pair": "smollm2-int8", "draft_resources": gpu})
    with pytest.raises(pydantic.ValidationError, match="draft head loads its native_q4 target's embedding"):
        head = {"draft": {"head": "smollm2-eagle3"}, "speculation": {"method": "ddd"}}
        AppArgs.model_validate({"target": q4, **head, "draft_resources": gpu})
    for bad, says in (({"dtype": "bfloat16"}, "float32"), ({"int8_dynamic": True}, "int8_dynamic")):
        with pytest.raises(pydantic.ValidationError, match=says):
            AppArgs.model_validate({"target": q4 | bad, "speculation": {"method": "none"}})
    with pytest.raises(pydantic.ValidationError, match=r"builtin model or a \.gguf file"):
        AppArgs.model_validate(
            {"target": {"source": "org/model", "native_q4": True}, "speculation": {"method": "none"}}
        )
    with pytest.raises(pydantic.ValidationError, match="GPU as num_cpus / num_gpus"):
        AppArgs.model_validate({"target_resources": {"num_cpus": 1, "resources": {"GPU": 1}}})
    with pytest.raises(pydantic.ValidationError, match="one GPU"):  # Ray would reserve two, the worker use one
        AppArgs.model_validate({"target_resources": {"num_cpus": 1, "num_gpus": 2}})
    with pytest.raises(pydantic.ValidationError, match=r"steps of 0\.0001"):
        AppArgs.model_validate({"target_resources": {"num_cpus": 0.00001}})
    for runs_a_model in ({"torch_threads": 1}, {"omp_wait": "PASSIVE"}, {"num_gpus": 1}):
        with pytest.raises(pydantic.ValidationError, match="router runs no model"):  # accepted, it did nothing
            AppArgs.model_validate({"router_resources": {"num_cpus": 0.5, **runs_a_model}})
    options = ActorResources(num_cpus=0.5, omp_wait=OmpWait.passive).actor_options()
    assert options["runtime_env"] == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}} and options["num_cpus"] == 0.5
    assert "runtime_env" not in ActorResources(num_cpus=0.5).actor_options()  # the runtime's default, no env of its own
    assert ActorResources(num_cpus=0.5, omp_wait="passive").omp_wait == OmpWait.passive  # either case, as OpenMP
    with pytest.raises(pydantic.ValidationError, match="omp_wait"):
        ActorResources(num_cpus=0.5, omp_wait="sometimes")
    assert AppArgs.model_validate({"target": q4, "speculation": {"method": "none"}}).target == ModelSpec(**q4)


def test_a_deployment_refuses_lossy_speculation_and_endless_timeouts() -> None:
    """synthetic_accept (a benchmark mode: its tokens are the draft's, unchecked) validated in app.yaml and served
    wrong text; an infinite worker timeout validated and then failed every request in ray.get, and a finite one too
    long for the waits it reaches (1e10 s as the idle check: every lane thread died) validated too."""
    with pytest.raises(pydantic.ValidationError, match="synthetic_accept is a benchmark mode"):
        AppArgs.model_validate({"tiny": {}, "speculation": {"method": "chain", "synthetic_accept": 0.99}})
    for field in ("worker_call_timeout_s", "worker_start_timeout_s", "body_timeout_s", "worker_idle_check_s"):
        # 1e10 s: a lane's idle wait on its command queue overflowed (threading.TIMEOUT_MAX) and its thread died
        for value in (float("inf"), float("nan"), 1e10):
            with pytest.raises(pydantic.ValidationError, match=field):
                AppArgs.model_validate({"tiny": {}, field: value})
        assert getattr(AppArgs.model_validate({"tiny": {}, field: 30.0}), field) == 30.0
