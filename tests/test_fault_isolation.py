"""Per-sequence fault isolation (issue 16): a failure pinned on one sequence fails it alone; an unattributed one is
bisected until a lone sequence fails; transient failures lose nobody; every other request finishes with the tokens
it has alone. The lane runs in-process over an Engine's StepLoop on tiny models (its workers wrapped to fail)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import pickle
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterator

import httpx
import pytest
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from deployments.lane import Lane
from specserve.api.error_bodies import APIError, RequestFailedError, WorkerFailedError
from specserve.api.metrics import ServeMetrics
from specserve.config import SLPolicyKind, SpecConfig, SpecMethod
from specserve.detok import IncrementalText
from specserve.engine import Completion, Engine
from specserve.errors import (
    InvalidRequestError,
    PartialStepError,
    SequenceError,
    SpecServeError,
    blame,
    blamed_sequence,
)
from specserve.messages import Proposal, ProposeItem, VerifyItem, VerifyOutput
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_config, tiny_head, tiny_model
from specserve.policy import SequenceDSDE
from specserve.sampling import SamplingParams
from specserve.sequence import Request, RequestOutput, Sequence
from specserve.spec_decode.model_free import ModelFreeDrafter
from specserve.step_events import StepEvent, StepObserver
from specserve.step_loop import StepLoop
from specserve.structured import AnswerGrammar
from specserve.workers import DraftWorker, HeadDraftWorker, TargetWorker
from specserve.workers import draft as draft_module
from specserve.workers.base import TargetWorkerAPI
from tests.api_backend import MODEL, LocalBackend, api_server

SPEC = SpecConfig(method=SpecMethod.chain, sl=4)
PROMPTS = [[5, 9, 13], [100, 200, 300, 400, 7, 8, 9], [42, 43], [7, 7, 7, 7, 7]]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
Fault = Callable[[set[int], set[int]], Exception | None]  # (the step's seq ids, the poisoned ones) -> what to raise
Result = list[int] | APIError


@pytest.fixture(scope="module")
def models() -> tuple[LlamaModel, LlamaModel]:
    target = tiny_model(tiny_config(), seed=0)
    return target, noisy_copy(target, 0.02, seed=1)


def _engine(models: tuple[LlamaModel, LlamaModel]) -> Engine:
    target, draft = models
    return Engine(target, None, draft=draft, speculation=SPEC, max_batch_size=4, max_model_len=64, eos_token_ids=set())


@pytest.fixture(scope="module")
def alone(models: tuple[LlamaModel, LlamaModel]) -> list[list[int]]:
    """Each prompt's greedy tokens when it runs alone."""
    return [_engine(models).generate([p], GREEDY)[0].token_ids for p in PROMPTS]


class FaultyTarget:
    """The loop's target worker, raising what ``fault`` returns for a step after the worker verified it (its cache
    then holds part of the failed step, as a real mid-step failure may leave it). Sequences added with params
    that ``poison`` holds true of are the poisoned ones."""

    def __init__(self, worker: TargetWorkerAPI, poison: Callable[[SamplingParams], bool], fault: Fault) -> None:
        self.worker = worker
        self.poison = poison
        self.fault = fault
        self.poisoned: set[int] = set()
        self.failed: list[list[int]] = []  # the seq ids of each failed step

    def add(self, seq_id: int, params: SamplingParams, position: int) -> None:
        if self.poison(params):
            self.poisoned.add(seq_id)
        self.worker.add(seq_id, params, position)

    def release(self, seq_ids: list[int]) -> None:
        self.worker.release(seq_ids)

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        outputs = self.worker.verify(items)
        batch = {it.seq_id for it in items}
        error = self.fault(batch, self.poisoned)
        if error is not None:
            self.failed.append(sorted(batch))
            raise error
        return outputs


def _faulty(engine: Engine, poison: SamplingParams | None, fault: Fault) -> FaultyTarget:
    """Wrap the engine's target; ``poison``: the params object (by identity) of the poisoned requests."""
    faulty = FaultyTarget(engine.loop.target, lambda params: params is poison, fault)
    engine.loop.target = faulty
    return faulty


def _lane_outputs(
    engine: Engine, requests: list[Request], **options: int
) -> list[tuple[list[RequestOutput], APIError | None]]:
    """Each request's outputs as its stream hands them out, and the error that ended it (None: it finished)."""
    lane = Lane(0, engine.loop, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=0, **options)  # type: ignore[arg-type]

    async def one(request: Request) -> tuple[list[RequestOutput], APIError | None]:
        outs: list[RequestOutput] = []
        try:
            async for out in await lane.submit(request):
                outs.append(out)
        except APIError as e:
            return outs, e
        return outs, None

    async def run() -> list[tuple[list[RequestOutput], APIError | None]]:
        return await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), 120)

    try:
        results = asyncio.run(run())
        _settle(lane)
    finally:
        lane.stop()
    return results


def _run_lane(engine: Engine, requests: list[Request], **options: int) -> list[Result]:
    """Submit every request to a lane over the engine's loop at once; each one's tokens, or the error it got."""
    results = _lane_outputs(engine, requests, **options)
    return [[t for o in outs for t in o.token_ids] if error is None else error for outs, error in results]


def _settle(lane: Lane) -> None:
    """Wait for the lane thread to forget the finished requests (it does so just after handing out their end)."""
    deadline = time.monotonic() + 5
    while lane.in_flight:
        assert time.monotonic() < deadline, f"{lane.in_flight} requests still in flight"
        time.sleep(0.01)
    assert lane.alive


def _requests(poisoned: int | None, poison: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", p, poison if i == poisoned else GREEDY) for i, p in enumerate(PROMPTS)]


def _assert_kv_free(engine: Engine, faulty: FaultyTarget) -> None:
    assert isinstance(faulty.worker, TargetWorker) and isinstance(engine.loop.draft, DraftWorker)
    assert faulty.worker.cache.num_free == engine.loop.max_batch_size and not faulty.worker.params
    assert engine.loop.draft.cache.num_free == engine.loop.max_batch_size and not engine.loop.draft.params


def _named(seq_id: int, *, ray: bool) -> Exception:
    error = SequenceError(seq_id, "poisoned")
    return RayTaskError("verify", "traceback", error).as_instanceof_cause() if ray else error


@pytest.mark.parametrize("ray", [False, True], ids=["in-process", "ray-task-error"])
def test_attributed_failure_fails_that_request_alone(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], ray: bool
) -> None:
    engine = _engine(models)
    poison = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    faulty = _faulty(engine, poison, lambda batch, bad: _named(min(bad & batch), ray=ray) if bad & batch else None)
    results = _run_lane(engine, _requests(2, poison))
    assert isinstance(results[2], RequestFailedError) and results[2].status == 500
    assert [results[i] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]
    assert len(faulty.failed) == 1  # named at once: no bisection
    _assert_kv_free(engine, faulty)


@pytest.mark.parametrize("poisoned", [0, 2])
def test_a_commit_failure_fails_that_request_and_the_others_keep_every_token(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], poisoned: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence whose commit raises (its detokenisation, say) after the step verified the whole batch, on its
    third step: the requests committed beside it in that step keep their tokens (delivered, not re-run)."""
    engine = _engine(models)
    poison = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    real = StepLoop._commit
    commits: dict[int, int] = {}

    def commit(self: StepLoop, seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> RequestOutput:
        result = real(self, seq, proposal, out)  # state already advanced: the worst case for the others
        commits[seq.seq_id] = commits.get(seq.seq_id, 0) + 1
        if seq.request.params is poison and commits[seq.seq_id] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return result

    monkeypatch.setattr(StepLoop, "_commit", commit)
    results = _run_lane(engine, _requests(poisoned, poison))
    assert isinstance(results[poisoned], RequestFailedError) and results[poisoned].status == 500
    others = [i for i in range(len(PROMPTS)) if i != poisoned]
    assert [results[i] for i in others] == [alone[i] for i in others]
    assert isinstance(engine.loop.target, TargetWorker) and isinstance(engine.loop.draft, DraftWorker)
    assert engine.loop.target.cache.num_free == engine.loop.max_batch_size
    assert engine.loop.draft.cache.num_free == engine.loop.max_batch_size


def test_a_client_gone_before_admission_leaves_the_lane_running(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose client left while it waited to be admitted (its admission future cancelled) is dropped;
    the lane and the request it was stepping go on (this once killed the lane, failing every request on it). The
    lane thread holds the request's admission until the client has gone (no sleeps to race the lane's steps)."""
    engine = _engine(models)
    lane = Lane(0, engine.loop, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=0, step_delay_s=0.05)  # type: ignore[arg-type]
    gone_left = threading.Event()
    cancelled_when_applied: list[bool] = []
    apply = lane._apply

    def holding(command: object) -> None:  # on the lane thread
        request = getattr(command, "request", None)
        if request is not None and request.request_id == "gone":
            assert gone_left.wait(30)
            cancelled_when_applied.append(command.admitted.cancelled())  # type: ignore[attr-defined]
        apply(command)  # type: ignore[arg-type]

    monkeypatch.setattr(lane, "_apply", holding)
    admitted: list[str] = []
    add_request = engine.loop.add_request

    def recording(request: Request, grammar: AnswerGrammar | None = None) -> None:
        admitted.append(request.request_id)
        add_request(request, grammar)

    monkeypatch.setattr(engine.loop, "add_request", recording)

    async def run() -> list[int]:
        stream = await lane.submit(Request("victim", PROMPTS[0], GREEDY))  # admitted: the lane is stepping it
        victim = asyncio.create_task(_collect(stream))
        gone = asyncio.create_task(lane.submit(Request("gone", PROMPTS[1], GREEDY)))
        await asyncio.sleep(0)  # queued, its admission held
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        gone_left.set()
        return await asyncio.wait_for(victim, 60)

    try:
        assert asyncio.run(run()) == alone[0]
        assert cancelled_when_applied == [True]
        assert admitted == ["victim"]  # the request whose client left never reached the step loop
        _settle(lane)
        assert not engine.loop.has_work
    finally:
        gone_left.set()
        lane.stop()


async def _collect(stream: AsyncIterable[RequestOutput]) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


def test_unattributed_failure_is_bisected_to_its_request(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    engine = _engine(models)
    poison = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    faulty = _faulty(engine, poison, lambda batch, bad: RuntimeError("no mass") if bad & batch else None)
    results = _run_lane(engine, _requests(3, poison))
    assert isinstance(results[3], RequestFailedError)
    assert results[:3] == alone[:3]
    (bad,) = faulty.poisoned
    assert len(faulty.failed[0]) > 1 and faulty.failed[-1] == [bad]  # split until it failed alone
    assert len(faulty.failed) <= 4  # 4 sequences: the batch, a half, the culprit alone
    _assert_kv_free(engine, faulty)


def test_transient_failure_loses_nobody(models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]) -> None:
    engine = _engine(models)
    raised: list[bool] = []

    def once(batch: set[int], _: set[int]) -> Exception | None:
        if len(batch) < 2 or raised:
            return None
        raised.append(True)
        return RuntimeError("a glitch")

    faulty = _faulty(engine, None, once)
    assert _run_lane(engine, _requests(None, GREEDY)) == alone
    assert len(faulty.failed) == 1
    _assert_kv_free(engine, faulty)


def test_bisection_gives_up_after_its_split_limit(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    """One split allowed: the half still failing after it is failed whole; the other half goes on."""
    engine = _engine(models)
    poison = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    faulty = _faulty(engine, poison, lambda batch, bad: RuntimeError("no mass") if bad & batch else None)
    results = _run_lane(engine, _requests(3, poison), max_bisection_splits=1)
    (bad,) = faulty.poisoned
    failed_half = {i for i, r in enumerate(results) if isinstance(r, RequestFailedError)}
    assert 3 in failed_half and len(failed_half) == 2
    assert all(results[i] == alone[i] for i in range(4) if i not in failed_half)
    assert len(faulty.failed) == 2 and bad in faulty.failed[-1]


def test_a_failure_no_sequence_causes_alone_drops_the_batch_after_a_bounded_number_of_steps(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    """A step fails whenever it holds two sequences and passes for each alone: bisection finds no culprit; after
    max_failed_steps full steps in a row the batch is dropped (503), and the lane goes on serving."""
    engine = _engine(models)
    faulty = _faulty(engine, None, lambda batch, _: RuntimeError("batched") if len(batch) > 1 else None)
    results = _run_lane(engine, _requests(None, GREEDY), max_failed_steps=2)
    assert all(isinstance(r, WorkerFailedError) for r in results)
    assert sum(len(f) > 1 for f in faulty.failed) <= 3 * 4  # 3 rounds of at most 4 failing groups each
    assert _run_lane(engine, [Request("again", PROMPTS[0], GREEDY)]) == [alone[0]]
    _assert_kv_free(engine, faulty)


def test_a_dropped_batch_takes_none_of_the_requests_still_queued(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    """The batch dropped after max_failed_steps held two requests; the two queued behind it (the lane holds two at
    a time) never ran in those steps. They were dropped with it, 503s for a fault not theirs; they run next."""
    target, draft = models
    engine = Engine(
        target, None, draft=draft, speculation=SPEC, max_batch_size=2, max_model_len=64, eos_token_ids=set()
    )
    pair = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    faulty = _faulty(engine, pair, lambda batch, bad: RuntimeError("pair") if len(bad & batch) == 2 else None)
    requests = [Request(f"r{i}", p, pair if i < 2 else GREEDY) for i, p in enumerate(PROMPTS)]
    results = _run_lane(engine, requests, max_failed_steps=2)
    assert isinstance(results[0], WorkerFailedError) and isinstance(results[1], WorkerFailedError)
    assert "steps failed in a row" in str(results[0])
    assert results[2:] == alone[2:]
    assert sum(len(f) == 2 for f in faulty.failed) == 3  # three full steps failed, then the batch was dropped
    _assert_kv_free(engine, faulty)


# -- the pieces ------------------------------------------------------------------------------------------


def test_sequence_error_names_its_sequence_in_process_and_through_ray() -> None:
    error = pickle.loads(pickle.dumps(SequenceError(7, "boom")))
    assert isinstance(error, SequenceError) and error.seq_id == 7 and "boom" in str(error)
    assert blamed_sequence(error) == 7
    assert blamed_sequence(RayTaskError("verify", "tb", error)) == 7  # .cause
    assert blamed_sequence(RayTaskError("verify", "tb", error).as_instanceof_cause()) == 7
    assert blamed_sequence(RayTaskError("verify", "tb", RuntimeError("x")).as_instanceof_cause()) is None
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = error
    assert blamed_sequence(wrapped) == 7
    assert blamed_sequence(RuntimeError("plain")) is None


class _Blaming:
    def fail(self, seq_id: int) -> None:
        with blame(seq_id):
            raise KeyError("missing")


def test_sequence_error_arrives_through_a_ray_actor() -> None:
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")  # a new one
    try:
        actor = ray.remote(_Blaming).remote()
        with pytest.raises(RayTaskError) as caught:
            ray.get(actor.fail.remote(5))
        assert blamed_sequence(caught.value) == 5 and not isinstance(caught.value, RayActorError)
    finally:
        if started:
            ray.shutdown()


def test_workers_pin_per_item_failures_on_the_sequence(models: tuple[LlamaModel, LlamaModel]) -> None:
    target, draft = models
    worker = TargetWorker(target, num_slots=2, max_len=32)
    for seq_id in (0, 1):
        worker.add(seq_id, GREEDY, 3 - seq_id)
    worker.params[1] = None  # type: ignore[assignment]  # its per-item processing fails
    with pytest.raises(SequenceError) as caught:
        worker.verify([VerifyItem(0, [5, 9, 13]), VerifyItem(1, [42, 43])])
    assert caught.value.seq_id == 1 and isinstance(caught.value.__cause__, AttributeError)

    drafts: list[DraftWorker | HeadDraftWorker] = [
        DraftWorker(draft, num_slots=2, max_len=32),
        HeadDraftWorker(tiny_head(target, seed=1), num_slots=2, max_len=32),
    ]
    for drafter in drafts:
        drafter.add(0, GREEDY, 3)  # sequence 1 was never added: its item cannot be drafted
        with pytest.raises(SequenceError) as caught:
            drafter.propose([ProposeItem(0, [5, 9, 13], [], 2, SPEC), ProposeItem(1, [42, 43], [], 2, SPEC)])
        assert caught.value.seq_id == 1


def test_step_over_a_subset_leaves_the_others_waiting(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    engine = _engine(models)
    ids = [engine.submit(p, GREEDY) for p in PROMPTS[:3]]
    tokens: dict[str, list[int]] = {}

    def collect(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)

    collect(engine.loop.step())
    seq_of = {s.request.request_id: s.seq_id for s in engine.loop.running}
    late = engine.submit(PROMPTS[3], GREEDY)
    before = {s.seq_id: len(s.output) for s in engine.loop.running}
    outputs = engine.loop.step(only={seq_of[ids[1]]})
    collect(outputs)
    assert [o.request_id for o in outputs] == [ids[1]]
    after = {s.seq_id: len(s.output) for s in engine.loop.running}
    assert after[seq_of[ids[1]]] > before[seq_of[ids[1]]]
    assert {k: v for k, v in after.items() if k != seq_of[ids[1]]} == {
        k: v for k, v in before.items() if k != seq_of[ids[1]]
    }
    assert [s.request.request_id for s in engine.loop.waiting] == [late]  # a subset step admits nobody
    engine.loop.reset(set(seq_of.values()))  # their caches dropped: rebuilt from the loop's tokens, same output
    while engine.loop.has_work:
        collect(engine.loop.step())
    assert [tokens[r] for r in [*ids, late]] == alone
    assert engine.loop.target.cache.num_free == 4  # type: ignore[attr-defined]


# -- the API under hostile requests ------------------------------------------------------------------------

VICTIMS = [[5, 9, 13], [100, 200, 300, 400, 7, 8, 9], [42, 43]]
HOSTILE: list[tuple[str, dict[str, object]]] = [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 8, "temperature": 1e-45}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1e-45}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0.7, "seed": 2**63 - 1}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 2.0, "seed": -(2**63), "top_p": 1e-9}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2**62}),
    ("/v1/completions", {"prompt": "ab\ud800cd", "max_tokens": 4}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 24, "stop": ["x" * 1024, "yz" * 512, "\ud800", "a"]}),
    ("/v1/completions", {"prompt": [9] * 100, "max_tokens": 27, "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"prompt": [3, 4], "max_tokens": 16, "temperature": 2.0, "top_k": 1, "stream": True}),
]


def _victim(url: str, prompt: list[int]) -> tuple[list[int], str]:
    """A streamed greedy completion: its token ids and how it finished."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    tokens: list[int] = []
    finish = "none"
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0].get("token_ids") or []
            finish = chunk["choices"][0]["finish_reason"] or finish
    return tokens, finish


def _hostile(url: str, path: str, body: dict[str, object]) -> int:
    content = json.dumps({"model": MODEL, **body})  # ASCII: a lone surrogate travels as its escape
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60.0)
    return r.status_code


@pytest.fixture(scope="module")
def hostile_backend() -> Iterator[LocalBackend]:
    backend = LocalBackend(max_batch_size=8, capacity=64)
    yield backend
    backend.stop()


def test_hostile_requests_leave_every_victim_its_own_output(hostile_backend: LocalBackend) -> None:
    """Schema-valid hostile requests beside victim streams; the tiny temperatures are also made to break the step
    unattributed (as item 1's "no mass" did), so they must be isolated. Every victim ends with its solo tokens."""
    backend = hostile_backend
    with api_server(backend) as url:
        solo = [_victim(url, p) for p in VICTIMS]
        assert all(finish == "length" and len(tokens) == 24 for tokens, finish in solo)
        faulty = FaultyTarget(
            backend.engine.loop.target,
            lambda params: 0 < params.temperature < 1e-30,
            lambda batch, bad: RuntimeError("target distribution has no mass") if bad & batch else None,
        )
        backend.engine.loop.target = faulty
        try:
            with concurrent.futures.ThreadPoolExecutor(len(VICTIMS) + len(HOSTILE)) as pool:
                victims = [pool.submit(_victim, url, p) for p in VICTIMS]
                hostile = [pool.submit(_hostile, url, path, body) for path, body in HOSTILE]
                statuses = [h.result() for h in hostile]
                assert [v.result() for v in victims] == solo
        finally:
            backend.engine.loop.target = faulty.worker
        assert statuses[:2] == [500, 500]  # the poisoned ones failed alone
        assert all(s < 500 for s in statuses[2:]), statuses
        assert len(faulty.poisoned) == 2 and faulty.failed
        assert all(faulty.poisoned & set(f) for f in faulty.failed)
        assert httpx.get(url + "/health").status_code == 200
        _settle(backend.lane)
        assert isinstance(faulty.worker, TargetWorker) and faulty.worker.cache.num_free == 8


def test_the_engine_frees_a_request_that_failed_to_commit(
    models: tuple[LlamaModel, LlamaModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process there is no lane to fail the request alone: the error reaches the caller, and the request is
    gone from the loop with its KV freed (not left running with nobody to read it)."""
    engine = _engine(models)
    real = StepLoop._commit

    def commit(self: StepLoop, seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> RequestOutput:
        result = real(self, seq, proposal, out)
        if seq.request.prompt_ids == PROMPTS[1]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return result

    monkeypatch.setattr(StepLoop, "_commit", commit)
    with pytest.raises(PartialStepError, match="poisoned"):
        engine.generate(PROMPTS, GREEDY)
    assert all(s.request.prompt_ids != PROMPTS[1] for s in engine.loop.running)
    monkeypatch.setattr(StepLoop, "_commit", real)
    while engine.loop.has_work:  # the others can still run to their end
        engine.loop.step()
    assert isinstance(engine.loop.target, TargetWorker)
    assert engine.loop.target.cache.num_free == engine.loop.max_batch_size


# -- failures the step loop's checks and the engine's consumers must survive -------------------------------------


def test_an_unattributed_drafting_failure_is_found_with_the_throughput_guard_on(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft fails, naming no sequence, whenever it drafts for one request's settings. Isolating it steps
    suspect groups that re-prefill, where the guard would plan plain decoding and never call the draft: the groups
    passed, the full step failed again, and the lane dropped every request. A group now drafts as its SLs say."""
    bad = SpecConfig(method=SpecMethod.chain, sl=5)
    real = draft_module.draft_chains

    def draft_chains(pairs, forward):  # type: ignore[no-untyped-def]
        if any(s.item.spec == bad for s, _ in pairs):
            raise RuntimeError("chain drafting failed")
        return real(pairs, forward)

    monkeypatch.setattr(draft_module, "draft_chains", draft_chains)
    target, draft = models
    engine = Engine(target, None, draft=draft, speculation=SpecConfig(method=SpecMethod.chain, sl=3),
                    max_batch_size=4, max_model_len=64, eos_token_ids=set(), throughput_guard=True)  # fmt: skip
    requests = [Request(f"r{i}", p, GREEDY, bad if i == 2 else None) for i, p in enumerate(PROMPTS)]
    results = _run_lane(engine, requests)
    assert isinstance(results[2], RequestFailedError)
    assert [results[i] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]


def test_a_failed_sl_update_after_the_commit_fails_its_request_alone(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SL update runs after the step committed every row: a failure there used to discard the step's outputs
    (every request missing that step's tokens, reported as finished) or leave a finished request's stream open."""
    real = SequenceDSDE.observe
    calls = []

    def observe(self: SequenceDSDE, klds, drafted, accepted, *, cut):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("accepted tokens exceed drafted tokens")
        return real(self, klds, drafted, accepted, cut=cut)

    monkeypatch.setattr(SequenceDSDE, "observe", observe)
    dsde = SpecConfig(method=SpecMethod.chain, sl=3, policy=SLPolicyKind.dsde)
    requests = [Request(f"r{i}", p, GREEDY, dsde if i == 2 else None) for i, p in enumerate(PROMPTS)]
    results = _run_lane(_engine(models), requests)
    assert isinstance(results[2], RequestFailedError)
    assert [results[i] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]


def test_an_engine_stream_gets_the_tokens_committed_before_its_failed_sl_update(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine queued the request's error ahead of the outputs of the step that had committed its tokens: the
    stream raised one step's tokens short (the lane delivers them first, then fails the request)."""
    real = SequenceDSDE.observe
    committed: list[int] = []
    dsde = SpecConfig(method=SpecMethod.chain, sl=3, policy=SLPolicyKind.dsde)
    engine = Engine(models[0], None, draft=models[1], speculation=dsde, max_model_len=64, eos_token_ids=set())

    def observe(self: SequenceDSDE, klds, drafted, accepted, *, cut):  # type: ignore[no-untyped-def]
        if len(committed) == 2:
            (seq,) = engine.loop.running
            committed.append(len(seq.tokens) - len(PROMPTS[0]))  # the step committed its row before this update
            raise ValueError("accepted tokens exceed drafted tokens")
        committed.append(0)
        return real(self, klds, drafted, accepted, cut=cut)

    monkeypatch.setattr(SequenceDSDE, "observe", observe)
    delivered: list[int] = []
    with pytest.raises(PartialStepError, match="accepted tokens exceed drafted tokens"):
        for out in engine.stream(PROMPTS[0], GREEDY):
            delivered += out.token_ids
    assert len(committed) == 3 and 0 < committed[-1] < MAX_TOKENS
    assert delivered == alone[0][: committed[-1]]


def test_a_failing_step_observer_or_guard_record_loses_no_tokens(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken(StepObserver):
        def on_step(self, event: StepEvent) -> None:
            raise RuntimeError("a metrics bug")

    engine = _engine(models)
    engine.loop.observers.append(Broken())
    monkeypatch.setattr(StepLoop, "_record", lambda self, event: 1 / 0)
    assert _run_lane(engine, _requests(None, GREEDY)) == alone
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == alone


def _remember_fails(self: ModelFreeDrafter, output: list[int], cache_salt: str | None = None) -> None:
    raise ValueError("remove() of tokens that were never added")


def test_a_failing_release_of_finished_sequences_loses_no_tokens(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finished sequences are released after the step committed (their outputs joining the suffix cache among it):
    a failure there used to lose the whole step's outputs (the other requests skipping its tokens) and leave the
    finished ones in the batch, their final output never sent."""
    monkeypatch.setattr(ModelFreeDrafter, "remember", _remember_fails)
    engine = _engine(models)
    assert _run_lane(engine, _requests(None, GREEDY)) == alone
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == alone
    assert not engine.loop.has_work


def test_a_failing_cache_insert_as_a_failed_request_is_aborted_loses_no_other_tokens(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aborting a failed request adds its output to the suffix cache. An insert that raised there escaped the abort
    (the request's slots already freed): the failure reached the caller that stepped, with_exceptions or not, and
    the failed request never heard of its own error."""
    monkeypatch.setattr(ModelFreeDrafter, "remember", _remember_fails)
    engine = _engine(models)
    poison = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    _faulty(engine, poison, lambda batch, bad: _named(min(bad & batch), ray=False) if bad & batch else None)
    ids = [engine.submit(p, poison if i == 1 else GREEDY) for i, p in enumerate(PROMPTS)]
    results = engine.collect(ids, return_exceptions=True)
    assert isinstance(results[1], SequenceError) and results[1].message == "poisoned", results[1]
    assert [r.token_ids for r in results if isinstance(r, Completion)] == [alone[i] for i in (0, 2, 3)]
    assert not engine.loop.has_work


def test_a_worker_that_fails_to_release_once_holds_no_slot_for_good(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One failed ``release`` of a finished request used to leak its target slot and skip the draft's release
    (so its draft slot leaked too); with every slot taken, a later full batch failed a request on
    ``KVCapacityError``. Each owner now releases whatever the others do, and a failed release is retried before
    the next admission."""
    engine = _engine(models)
    target, draft = engine.loop.target, engine.loop.draft
    assert isinstance(target, TargetWorker) and isinstance(draft, DraftWorker)
    real_release, calls = target.release, []

    def release(seq_ids: list[int]) -> None:
        if not engine.loop.running and not calls:  # the finished request's release (not a registering one)
            calls.append(seq_ids)
            raise RuntimeError("a transient failure")
        real_release(seq_ids)

    monkeypatch.setattr(target, "release", release)
    assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == alone[0]
    assert calls and draft.cache.num_free == engine.loop.max_batch_size  # the draft released although the target failed
    batch = [PROMPTS[i % len(PROMPTS)] for i in range(engine.loop.max_batch_size)]
    assert [c.token_ids for c in engine.generate(batch, GREEDY)] == [alone[i % len(PROMPTS)] for i in range(4)]
    assert target.cache.num_free == draft.cache.num_free == engine.loop.max_batch_size


@pytest.mark.parametrize("where", ["before the release", "between freeing the slot and forgetting it"])
def test_an_interrupt_while_a_finished_sequence_is_released_holds_no_slot_for_good(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], where: str
) -> None:
    """A Ctrl-C during a finished request's release skipped the record of what was left to release (kept only
    after a release returned with an Exception): its target slot stayed taken, and every later full batch failed a
    request on KVCapacityError. The ids are recorded first and cleared once every owner has released them, and a
    slot is freed before it is forgotten (and not freed again on the retry)."""
    engine = _engine(models)
    target, draft = engine.loop.target, engine.loop.draft
    assert isinstance(target, TargetWorker) and isinstance(draft, DraftWorker)
    real_release, real_free, interrupted = target.release, target.table.cache.free, []

    def release(seq_ids: list[int]) -> None:
        if not engine.loop.running and not interrupted:  # the finished request's release
            interrupted.append(seq_ids)
            raise KeyboardInterrupt
        real_release(seq_ids)

    def free(slot: int) -> None:
        real_free(slot)
        if not engine.loop.running and not interrupted:
            interrupted.append(slot)
            raise KeyboardInterrupt

    if where == "before the release":
        target.release = release  # type: ignore[method-assign]
    else:
        target.table.cache.free = free  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        engine.generate([PROMPTS[0]], GREEDY)
    assert interrupted
    batch = [PROMPTS[i % len(PROMPTS)] for i in range(engine.loop.max_batch_size)]
    for _ in range(2):
        assert [c.token_ids for c in engine.generate(batch, GREEDY)] == [alone[i % len(PROMPTS)] for i in range(4)]
    assert target.cache.num_free == draft.cache.num_free == engine.loop.max_batch_size
    assert sorted(target.cache._free) == list(range(engine.loop.max_batch_size))  # each slot once


def test_a_reset_whose_release_fails_still_registers_its_sequences_afresh(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reset`` after a failed step: should the draft's release fail once the target's has run, the sequences
    used to stay registered, so the next step sent the (emptied) target only the newest token and decoded without
    context. They are marked for registering first, and registering releases whatever the worker still held."""
    engine = _engine(models)
    draft = engine.loop.draft
    assert isinstance(draft, DraftWorker)
    first, second = engine.submit(PROMPTS[0], GREEDY), engine.submit(PROMPTS[1], GREEDY)
    for _ in range(3):
        engine.loop.step()  # its outputs go nowhere: the sequences' own tokens are compared below
    seqs = list(engine.loop.running)
    real_release = draft.release

    def release(seq_ids: list[int]) -> None:
        monkeypatch.setattr(draft, "release", real_release)  # once
        raise RuntimeError("a transient failure")

    monkeypatch.setattr(draft, "release", release)
    with pytest.raises(RuntimeError, match="transient"):
        engine.loop.reset({s.seq_id for s in engine.loop.running})
    engine.collect([first, second])
    assert [s.output for s in seqs] == alone[:2]


def test_outputs_of_a_submitted_request_wait_until_it_is_collected(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    engine = _engine(models)
    ids = [engine.submit(p, GREEDY) for p in PROMPTS]
    got = [engine.collect([rid])[0].token_ids for rid in ids]  # the later ones ran (and some finished) meanwhile
    assert got == alone
    with pytest.raises(InvalidRequestError, match="no submitted"):
        engine.collect(ids[:1])  # consumed


def test_a_prompt_that_fails_to_encode_leaves_none_of_its_batch_running(models: tuple[LlamaModel, LlamaModel]) -> None:
    engine = _engine(models)
    with pytest.raises(InvalidRequestError):
        engine.generate([PROMPTS[0], "text, but this engine has no tokenizer"], GREEDY)
    assert not engine.loop.has_work


@pytest.mark.parametrize("where", ["commit", "verify"])
def test_one_streams_failure_leaves_the_interleaved_streams_every_token(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Three streams consumed in turn; the third one's sequence fails (committing, or in the target's verify before
    anything committed). Its consumer gets the error; the others get every token they have alone (before: the commit
    case dropped their tokens of that step, the verify case crashed them on the next step)."""
    engine = _engine(models)
    victim = "req-2"  # the third stream's request: ids are given as the streams start, in turn

    def poisoned(seq: Sequence) -> bool:
        return seq.request.request_id == victim and len(seq.output) > 3

    if where == "commit":
        real_commit = StepLoop._commit

        def commit(self: StepLoop, seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> RequestOutput:
            result = real_commit(self, seq, proposal, out)
            if poisoned(seq):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
            return result

        monkeypatch.setattr(StepLoop, "_commit", commit)
    else:
        real_verify = engine.loop.target.verify

        def verify(items: list[VerifyItem]) -> list[VerifyOutput]:
            out = real_verify(items)
            for seq in engine.loop.running:
                if poisoned(seq) and any(it.seq_id == seq.seq_id for it in items):
                    raise SequenceError(seq.seq_id, "poisoned verify")
            return out

        monkeypatch.setattr(engine.loop.target, "verify", verify)
    streams = [engine.stream(p, GREEDY) for p in PROMPTS[:3]]
    tokens: list[list[int]] = [[], [], []]
    errors: list[Exception | None] = [None, None, None]
    live = [0, 1, 2]
    while live:
        for i in list(live):
            try:
                tokens[i] += next(streams[i]).token_ids
            except StopIteration:
                live.remove(i)
            except (PartialStepError, SequenceError) as e:
                errors[i] = e
                live.remove(i)
    assert errors[:2] == [None, None] and "poisoned" in str(errors[2])
    assert tokens[:2] == alone[:2]
    assert not engine.loop.has_work
    assert isinstance(engine.loop.target, TargetWorker) and engine.loop.target.cache.num_free == 4


def test_a_stream_closed_during_another_callers_step_is_aborted_after_it(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A half-read stream finalised inside a step (the garbage collector may run there) used to abort its sequence
    while the step still used it: the step failed and took the unrelated generate with it."""
    engine = _engine(models)
    dropped = engine.stream(PROMPTS[0], GREEDY)
    next(dropped)
    real_verify = engine.loop.target.verify

    def verify(items: list[VerifyItem]) -> list[VerifyOutput]:
        dropped.close()  # its finally asks to abort its request, mid-step
        return real_verify(items)

    monkeypatch.setattr(engine.loop.target, "verify", verify)
    assert engine.generate([PROMPTS[1]], GREEDY)[0].token_ids == alone[1]
    assert not engine.loop.has_work
    target, draft = engine.loop.target, engine.loop.draft
    assert isinstance(target, TargetWorker) and isinstance(draft, DraftWorker)
    assert target.cache.num_free == draft.cache.num_free == engine.loop.max_batch_size


def test_an_interrupted_step_leaves_the_other_requests_their_own_tokens(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after the target's forward, before the commit: the interrupted caller's requests go, and the others
    re-prefill instead of decoding on top of the uncommitted step (wrong tokens, or a crash in the draft)."""
    engine = _engine(models)
    real_verify = engine.loop.target.verify
    calls = []

    def verify(items: list[VerifyItem]) -> list[VerifyOutput]:
        out = real_verify(items)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(engine.loop.target, "verify", verify)
    first, second = engine.submit(PROMPTS[0], GREEDY), engine.submit(PROMPTS[1], GREEDY)
    with pytest.raises(KeyboardInterrupt):
        engine.collect([first])
    assert engine.collect([second])[0].token_ids == alone[1]
    assert not engine.loop.has_work


def test_an_interrupt_in_the_commit_loses_and_repeats_no_token(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C inside the commit, in the third row's detokenisation (its output already extended), in the step where
    the first row's request reaches its max_tokens: the rows committed before it used to lose that step's outputs
    (the first request then ran on past its end, the second skipped tokens); now they come with the next step, the
    cut row commits again from its state before, and every request ends as it does alone."""
    engine = _engine(models)
    short = SamplingParams(max_tokens=9, ignore_eos=True)
    ids = [engine.submit(PROMPTS[0], short), *(engine.submit(p, GREEDY) for p in PROMPTS[1:])]
    finishing, committed, cut, _ = seqs = list(engine.loop.waiting)  # the batch's rows, in this order
    real_update = IncrementalText.update
    fired: list[int] = []

    def update(text: IncrementalText, token_ids: list[int], *, final: bool = False, drop_open: bool = False) -> str:
        if text is cut.text and finishing.finish_reason is not None and not fired:
            fired.append(len(token_ids) - cut.delivered)  # tokens the cut row had added to its output
            raise KeyboardInterrupt
        return real_update(text, token_ids, final=final, drop_open=drop_open)

    monkeypatch.setattr(IncrementalText, "update", update)
    with pytest.raises(KeyboardInterrupt):
        engine.collect([ids[3]])  # the interrupted caller's request goes
    assert fired and fired[0] > 0 and committed.finish_reason is None
    done = engine.collect(ids[:3])
    assert [c.token_ids for c in done] == [alone[0][:9], alone[1], alone[2]]
    assert all(len(s.output) <= s.request.params.max_tokens for s in seqs)
    assert not engine.loop.has_work
    target, draft = engine.loop.target, engine.loop.draft
    assert isinstance(target, TargetWorker) and isinstance(draft, DraftWorker)
    assert target.cache.num_free == draft.cache.num_free == engine.loop.max_batch_size


def test_an_interrupt_after_the_commit_loses_no_output(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    """Ctrl-C in an observer, after the step committed and retired a finished request: its last output (and the
    others') come with the next step, which the finished request's own collect still runs for."""
    engine = _engine(models)
    ids = [engine.submit(PROMPTS[0], SamplingParams(max_tokens=9, ignore_eos=True)), engine.submit(PROMPTS[1], GREEDY)]
    finishing = engine.loop.waiting[0]

    class Interrupting(StepObserver):
        fired = False

        def on_step(self, event: StepEvent) -> None:
            if finishing.finish_reason is not None and not self.fired:
                self.fired = True
                raise KeyboardInterrupt

    engine.loop.observers.append(observer := Interrupting())
    with pytest.raises(KeyboardInterrupt):
        engine.collect([ids[1]])
    assert observer.fired and finishing not in engine.loop.running
    assert [c.token_ids for c in engine.collect([ids[0]])] == [alone[0][:9]]


def test_a_duplicate_request_id_is_refused_without_touching_the_live_request(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    lane = Lane(0, _engine(models).loop, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=0)  # type: ignore[arg-type]

    async def run() -> list[int]:
        stream = await lane.submit(Request("r0", PROMPTS[0], GREEDY))
        with pytest.raises(InvalidRequestError, match="duplicate"):
            await lane.submit(Request("r0", PROMPTS[1], GREEDY))
        tokens: list[int] = []
        async for out in stream:
            tokens += out.token_ids
        return tokens

    try:
        assert asyncio.run(asyncio.wait_for(run(), 60)) == alone[0]
        _settle(lane)
    finally:
        lane.stop()


@pytest.mark.parametrize("spec", [SPEC, None], ids=["chain", "plain"])
@pytest.mark.parametrize("mixed", [False, True], ids=["greedy-batch", "beside-a-sampled-request"])
def test_a_greedy_row_of_nan_logits_fails_its_request_alone(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], spec: SpecConfig | None, mixed: bool
) -> None:
    """A target whose state for one request goes NaN (here: the embedding of a token only its prompt holds) gives
    that request a clear error, not token 0 (the argmax of a row of NaN); with ``return_exceptions`` the requests
    after it in the call still come back, each with its own tokens, and every slot is freed. Beside a sampled
    request the step computes full logits and takes the greedy rows' argmaxes from them: the same rule."""
    target, draft = models
    poisoned = noisy_copy(target, 0.0)  # an exact copy
    used = {t for ids in [*PROMPTS, *alone] for t in ids}
    bad = next(t for t in range(3, target.cfg.vocab_size) if t not in used)
    with torch.no_grad():
        poisoned.embed_tokens.weight[bad] = float("nan")
    engine = Engine(
        poisoned, None, draft=draft, speculation=spec, max_batch_size=8, max_model_len=64, eos_token_ids=set()
    )
    prompts = [PROMPTS[0], [5, bad, 13], *PROMPTS[1:]]
    params = [GREEDY] * len(prompts)
    if mixed:
        prompts.append(PROMPTS[2])
        params.append(SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True))
    results = engine.generate(prompts, params, return_exceptions=True)
    failed = results[1]
    assert isinstance(failed, SpecServeError) and "no mass" in str(failed), failed
    assert [r.token_ids for r in results[:1] + results[2:5] if isinstance(r, Completion)] == alone
    if mixed:
        assert isinstance(results[5], Completion) and len(results[5].token_ids) == MAX_TOKENS
    assert not engine.loop.has_work
    assert isinstance(engine.loop.target, TargetWorker) and engine.loop.target.cache.num_free == 8
    with pytest.raises(SpecServeError, match="no mass"):  # without return_exceptions: the error itself
        engine.generate([[5, bad, 13]], GREEDY)


def test_collect_with_return_exceptions_keeps_every_other_completion(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request fails in the target's verify; the requests submitted beside it are collected in full (without
    the switch the first failure raises and the requests after it in the call are aborted)."""
    engine = _engine(models)
    poison = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)  # GREEDY's values, another object
    _faulty(engine, poison, lambda batch, bad: _named(min(bad & batch), ray=False) if bad & batch else None)
    ids = [engine.submit(p, poison if i == 1 else GREEDY) for i, p in enumerate(PROMPTS)]
    results = engine.collect(ids, return_exceptions=True)
    assert isinstance(results[1], SequenceError) and results[1].message == "poisoned"
    assert [r.token_ids for r in results if isinstance(r, Completion)] == [alone[i] for i in (0, 2, 3)]
    assert not engine.loop.has_work
    ids = [engine.submit(p, poison if i == 1 else GREEDY) for i, p in enumerate(PROMPTS)]
    steps: list[int] = []
    step = engine.loop.step
    monkeypatch.setattr(engine.loop, "step", lambda *a, **k: steps.append(1) or step(*a, **k))
    with pytest.raises(SequenceError, match="poisoned"):
        engine.collect(ids)
    # raised as the step that failed it ended, not once the request before it in the list had run to its end
    assert len(steps) == 1  # (the step that fails it; 6 before)
    assert not engine.loop.has_work  # the ones after it aborted, not left running


def test_a_lane_streams_chunks_of_its_interval_with_every_token(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]]
) -> None:
    """``stream_interval``: a request's first tokens go at once, then chunks of at least the interval, then its
    end; the tokens are those of one output a step."""
    each = _lane_outputs(_engine(models), _requests(None, GREEDY))
    chunked = _lane_outputs(_engine(models), _requests(None, GREEDY), stream_interval=5)
    for (outs, error), (steps, step_error), want in zip(chunked, each, alone, strict=True):
        assert error is None and step_error is None
        assert [t for o in outs for t in o.token_ids] == want == [t for o in steps for t in o.token_ids]
        assert outs[0].token_ids and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert all(len(o.token_ids) >= 5 for o in outs[1:-1])
        assert len(outs) < len(steps)  # chain SL 4 on a noisy copy: several steps of fewer than 5 tokens
        assert outs[-1].stats == steps[-1].stats and outs[-1].num_output_tokens == len(want)


def test_a_failing_request_gets_the_tokens_a_chunk_held_before_its_error(
    models: tuple[LlamaModel, LlamaModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose fifth commit fails hears every token it committed before, whatever the stream interval
    held back, and then its error."""
    poison = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    real = StepLoop._commit
    commits: dict[str, int] = {}

    def commit(self: StepLoop, seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> RequestOutput:
        rid = seq.request.request_id
        commits[rid] = commits.get(rid, 0) + 1
        if seq.request.params is poison and commits[rid] == 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return real(self, seq, proposal, out)

    monkeypatch.setattr(StepLoop, "_commit", commit)
    heard = {}
    for interval in (1, 64):
        commits.clear()
        outs, error = _lane_outputs(_engine(models), _requests(1, poison), stream_interval=interval)[1]
        assert isinstance(error, RequestFailedError)
        heard[interval] = [t for o in outs for t in o.token_ids]
    assert len(heard[1]) >= 4 and heard[64] == heard[1]


def test_a_lane_that_cannot_step_for_a_while_sends_what_it_holds(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that finds the target starting (minutes, for a real model) first hands out the tokens its chunks
    held; the streams then go on to the same tokens."""
    calls, flushes = [0], []
    real_flush = Lane._flush_held

    def starting(self: Lane) -> bool:
        calls[0] += 1
        return calls[0] == 4  # the fourth step finds its target loading

    def flush(self: Lane) -> None:
        before = self._coalescer.holding
        real_flush(self)
        flushes.append((before, self._coalescer.holding))

    monkeypatch.setattr(Lane, "_starting", starting)
    monkeypatch.setattr(Lane, "_flush_held", flush)
    results = _lane_outputs(_engine(models), _requests(None, GREEDY), stream_interval=64)
    assert [[t for o in outs for t in o.token_ids] for outs, _ in results] == alone
    assert len(flushes) == 1 and flushes[0][0] > 0 and flushes[0][1] == 0


def test_a_step_over_a_suspect_group_first_sends_what_the_others_hold(
    models: tuple[LlamaModel, LlamaModel], alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an unattributed failure is bisected, each step runs a few sequences and leaves the others waiting:
    their held tokens go out before it, and every request but the culprit still gets its own tokens."""
    engine = _engine(models)
    poison = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    verifies = [0]

    def late(batch: set[int], bad: set[int]) -> Exception | None:
        verifies[0] += 1
        return RuntimeError("no mass") if bad & batch and verifies[0] >= 4 else None

    flushes: list[int] = []
    real_flush = Lane._flush_held

    def flush(self: Lane) -> None:
        flushes.append(self._coalescer.holding)
        real_flush(self)

    monkeypatch.setattr(Lane, "_flush_held", flush)
    faulty = _faulty(engine, poison, late)
    results = _lane_outputs(engine, _requests(3, poison), stream_interval=64)
    assert isinstance(results[3][1], RequestFailedError)
    assert [[t for o in outs for t in o.token_ids] for outs, _ in results[:3]] == alone[:3]
    assert len(faulty.failed) > 1 and flushes and flushes[0] > 0  # held tokens went out before the first probe
