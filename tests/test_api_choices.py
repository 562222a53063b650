"""OpenAI's ``n``: several answers to one request, each a choice with its index. A sampled choice i draws with the
request's seed plus i (vLLM's rule for one prompt; a batch's choice k, the seed plus k), so each is the answer a
request of one choice with that seed gets; the usage counts the prompt once and every choice's tokens."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.error_bodies import OverloadedError
from specserve.api.metrics import ServeMetrics
from specserve.api.resume import StreamCursor
from specserve.api.server import _Choice, _CompletionFormat, _Outcome, _Routes, _Tracker
from specserve.sequence import FinishReason, Request, RequestOutput, RequestStats
from tests.api_backend import MODEL, LeavingClient, LocalBackend, api_server, module_server, requests_by_status

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SAMPLED: dict[str, Any] = {
    "model": MODEL,
    "prompt": "once upon",
    "max_tokens": 12,
    "temperature": 1.0,
    "ignore_eos": True,
    "return_token_ids": True,
}
USER = [{"role": "user", "content": "hello there"}]


backend, url = module_server(max_model_len=256, max_batch_size=4)


def post(url: str, body: dict[str, Any], path: str = COMPLETIONS) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def events(url: str, body: dict[str, Any], path: str = COMPLETIONS) -> tuple[list[str], list[Any]]:
    """(the stream's lines that are not data, the data of each event: parsed JSON or "[DONE]")."""
    other, data = [], []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            elif line:
                other.append(line)
    return other, data


def same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert (got["text"], got["token_ids"], got["finish_reason"]) == (want["text"], want["token_ids"], "length")
    if want.get("logprobs"):
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["text_offset"] == want["logprobs"]["text_offset"]
        got_lp, want_lp = got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
        assert [v is None for v in got_lp] == [v is None for v in want_lp]
        assert [v for v in got_lp if v is not None] == pytest.approx([v for v in want_lp if v is not None], abs=1e-4)


def test_each_choice_is_the_answer_its_seed_gives(backend: LocalBackend, url: str) -> None:
    before = requests_by_status(backend).get("ok", 0)
    several = post(url, SAMPLED | {"n": 3, "seed": 5, "logprobs": 1})
    assert several["seed"] == 5 and [c["index"] for c in several["choices"]] == [0, 1, 2]
    alone = [post(url, SAMPLED | {"seed": 5 + i, "logprobs": 1}) for i in range(3)]
    for choice, one in zip(several["choices"], alone, strict=True):
        same_answer(choice, one["choices"][0])
    assert len({c["text"] for c in several["choices"]}) == 3  # (three draws, not one answer three times)
    prompt = alone[0]["usage"]["prompt_tokens"]
    assert several["usage"] | {"speculation": None} == {
        "prompt_tokens": prompt,  # once, as OpenAI counts it
        "completion_tokens": 36,
        "total_tokens": prompt + 36,
        "speculation": None,
    }
    spec = several["usage"]["speculation"]
    assert spec["target_forwards"] == sum(a["usage"]["speculation"]["target_forwards"] for a in alone)
    assert requests_by_status(backend).get("ok", 0) == before + 6  # (each choice a request in the metrics)
    # unseeded: the seed drawn is returned and choice i drew with it plus i; at the top of the range it wraps
    drawn = post(url, SAMPLED | {"n": 2})
    same_answer(drawn["choices"][1], post(url, SAMPLED | {"seed": drawn["seed"] + 1})["choices"][0])
    top = post(url, SAMPLED | {"n": 2, "seed": 2**63 - 1})
    same_answer(top["choices"][1], post(url, SAMPLED | {"seed": -(2**63)})["choices"][0])


def test_greedy_choices_are_one_answer(url: str) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 0, "n": 2}
    out = post(url, body, CHAT)
    one, two = out["choices"]
    assert (one["index"], two["index"]) == (0, 1) and one["message"] == two["message"] and "seed" not in out


def test_choices_stream_with_their_index_and_without_event_ids(url: str) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 10, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    whole = post(url, body | {"n": 3}, CHAT)
    other, data = events(url, body | {"n": 3, "stream_options": {"include_usage": True}}, CHAT)
    assert not any(line.startswith("id:") for line in other)  # (several choices' events cannot be resumed after)
    assert data[-1] == "[DONE]" and data[-2]["choices"] == [] and data[-2]["usage"] == whole["usage"]
    chunks = [d["choices"][0] for d in data[:-2]]
    for i, choice in enumerate(whole["choices"]):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine[1:]) == choice["message"]["content"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
    # completions with echo and logprobs: each choice's chunks start with the prompt, its offsets count from it
    text = SAMPLED | {"n": 2, "seed": 4, "echo": True, "logprobs": 1}
    whole = post(url, text)
    _, data = events(url, text)
    for i, choice in enumerate(whole["choices"]):
        mine = [d["choices"][0] for d in data[:-1] if d["choices"][0]["index"] == i]
        assert mine[0]["text"].startswith("once upon")
        streamed = {
            "text": "".join(c["text"] for c in mine),
            "token_ids": [t for c in mine for t in c["token_ids"]],
            "finish_reason": mine[-1]["finish_reason"],
            "logprobs": {f: [x for c in mine for x in c["logprobs"][f]] for f in choice["logprobs"]},
        }
        same_answer(streamed, choice)


def test_a_batch_of_prompts_answers_each_with_its_choices(url: str) -> None:
    """OpenAI's batch (a list of texts or of token lists), as lm-eval's batched requests send it: choice k = p * n + i
    is prompt p's i-th, the answer a request of that prompt with the seed plus k gets (with the seed plus i, a prompt
    sent twice for two samples got one answer twice); with echo each starts with its own prompt; the usage counts
    each prompt once."""
    tok = tiny_tokenizer()
    texts = ["once upon", "the cat sat on", "hello"]
    body = SAMPLED | {"seed": 3, "logprobs": 1, "echo": True}
    for prompts in (texts, [tok.encode(t, add_special_tokens=False) for t in texts]):
        batch = post(url, body | {"prompt": prompts, "n": 2})
        assert [c["index"] for c in batch["choices"]] == list(range(6)) and batch["seed"] == 3
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for k, choice in enumerate(batch["choices"]):
            one = post(url, body | {"prompt": prompts[k // 2], "seed": 3 + k})
            same_answer(choice, one["choices"][0])
            assert choice["text"].startswith(texts[k // 2])
            usage["prompt_tokens"] += one["usage"]["prompt_tokens"] * (k % 2 == 0)
            usage["completion_tokens"] += one["usage"]["completion_tokens"]
        assert {k: batch["usage"][k] for k in usage} == usage
        _, data = events(url, body | {"prompt": prompts, "n": 2, "stream_options": {"include_usage": True}})
        assert data[-2]["choices"] == [] and data[-2]["usage"] == batch["usage"]
        for k, choice in enumerate(batch["choices"]):
            mine = [d["choices"][0]["text"] for d in data[:-2] if d["choices"][0]["index"] == k]
            assert "".join(mine) == choice["text"]
    for seed in ({"seed": 3}, {}):  # (without one, the seed the server draws)
        twice = post(url, SAMPLED | seed | {"prompt": [texts[0]] * 2, "ignore_eos": True})
        assert twice["choices"][0]["text"] != twice["choices"][1]["text"]
    # left to the context, each prompt's limit is its own room (the longest not first: not the first one's)
    ids = [[5] * 100, [5] * 10]
    room = post(url, {"model": MODEL, "prompt": ids, "max_tokens": None, "ignore_eos": True, "temperature": 0})
    assert [c["finish_reason"] for c in room["choices"]] == ["length"] * 2
    assert room["usage"]["completion_tokens"] == (256 - 100) + (256 - 10)
    assert room["usage"]["prompt_tokens"] == 110


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"n": 2, "stream": True, "resume_from": "1-1-00000000"}, "resume_from", "needs one choice"),
        ({"prompt": ["a", "b"], "stream": True, "resume_from": "1-1-00000000"}, "resume_from", "needs one choice"),
        ({"prompt": ["a"] * 129}, "prompt", "List should have at most 128 items"),
        ({"prompt": ["a", "b"], "n": 5}, "prompt", "10 choices (n x prompts) are more than this server runs or"),
        ({"prompt": [[5], [5] * 300]}, "prompt", "your prompt at index 1 of the batch resulted in 300 tokens"),
        # refused before it is tokenised (5 characters a token at most: at least 300 tokens)
        ({"prompt": ["a", "b", "c" * 1500]}, "prompt", "prompt at index 2 of the batch resulted in at least 300 tok"),
        ({"prompt": [[5], [5, 512]]}, "prompt", "prompt token ids must be in [0, 512) (the prompt at index 1 of the"),
        (  # each prompt's room where max_tokens is left to the context: the least of them bounds min_tokens
            {"prompt": [[5] * 10, [5] * 250], "max_tokens": None, "min_tokens": 8},
            "min_tokens",
            "min_tokens (8) must be at most the room the context leaves the answer (6)",
        ),
    ],
)
def test_a_count_out_of_range_or_a_resume_is_a_400(url: str, fields: dict[str, Any], param: str, says: str) -> None:
    r = httpx.post(url + COMPLETIONS, json=SAMPLED | {"temperature": 0} | fields, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


class _LaneDown(LocalBackend):
    """A server one of whose two lanes is down: it holds half of what it holds with both serving."""

    @property
    def most_capacity(self) -> int:
        return 2 * self.capacity


def test_more_choices_than_fit_while_part_of_the_server_is_down_wait() -> None:
    """What a server holds shrinks while a lane is down: a request of more choices than that, and no more than it
    holds with every lane serving, is a 429 to retry (a 400, which clients never retry, refused it for good)."""
    backend = _LaneDown(capacity=3)
    try:
        with api_server(backend) as url:
            r = httpx.post(url + COMPLETIONS, json=SAMPLED | {"n": 5}, timeout=30)
            assert r.status_code == 429 and r.headers["retry-after"], r.text
            r = httpx.post(url + COMPLETIONS, json=SAMPLED | {"n": 7}, timeout=30)
            assert r.status_code == 400 and "at once (6 requests" in r.json()["error"]["message"], r.text
            assert httpx.post(url + COMPLETIONS, json=SAMPLED | {"n": 3}, timeout=30).status_code == 200
    finally:
        backend.stop()


def test_choices_that_do_not_all_fit_are_refused_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each choice takes a place: more than the server ever holds is a 400; more than the free places (counting
    the choices of requests still being tokenised) a 429 before the prompt is tokenised; a choice the backend
    refuses after others were submitted aborts them (no answer is half sent, nothing is left running)."""
    backend = LocalBackend(max_model_len=256, capacity=3, step_delay_s=0.1)  # (200 tokens: seconds)
    submit, submitted = backend.submit, []
    text, tokenised, started, release = backend.encoder.text, [], threading.Event(), threading.Event()

    def slow_text(prompt: str, **kw: Any) -> list[int]:
        tokenised.append(prompt)
        started.set()
        assert release.wait(30)
        return text(prompt, **kw)

    async def refusing_the_third(request: Request) -> Any:
        if len(submitted) == 2:
            raise OverloadedError("at capacity", retry_after_s=1)
        submitted.append(request.request_id)
        return await submit(request)

    try:
        with api_server(backend) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
            r = httpx.post(url + COMPLETIONS, json=SAMPLED | {"n": 4}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            assert "more than this server runs or queues at once (3 requests" in r.json()["error"]["message"]
            monkeypatch.setattr(backend.encoder, "text", slow_text)
            first = pool.submit(httpx.post, url + COMPLETIONS, json=SAMPLED | {"n": 2}, timeout=30)
            assert started.wait(30)  # its two choices hold two of the three places while it is tokenised
            r = httpx.post(url + COMPLETIONS, json=SAMPLED | {"n": 2}, timeout=30)
            assert r.status_code == 429 and tokenised == ["once upon"], r.text
            release.set()
            assert first.result().status_code == 200
            monkeypatch.setattr(backend, "submit", refusing_the_third)
            r = httpx.post(url + COMPLETIONS, json=SAMPLED | {"n": 3, "max_tokens": 200}, timeout=30)
            assert r.status_code == 429 and len(submitted) == 2, r.text
            deadline = time.monotonic() + 2
            while backend.lane.in_flight:
                assert time.monotonic() < deadline, "the submitted choices were left running"
                time.sleep(0.05)
    finally:
        backend.stop()


def test_a_client_leaving_a_stream_aborts_every_choice(backend: LocalBackend, url: str) -> None:
    before = requests_by_status(backend).get("aborted", 0)
    body = SAMPLED | {"n": 2, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
    deadline = time.monotonic() + 10
    while requests_by_status(backend).get("aborted", 0) < before + 2:
        assert time.monotonic() < deadline, requests_by_status(backend)
        time.sleep(0.05)


class _Stream:
    """An admitted choice's stream: ``outputs`` then, with ``fail``, an error; else it waits for ever. Its close
    awaits (an RPC to abort it) before it counts as closed."""

    def __init__(self, closed: list[int], index: int, outputs: int = 0, fail: bool = False, ends: bool = False) -> None:
        self.closed, self.index, self.outputs, self.fail, self.ends = closed, index, outputs, fail, ends

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        for i in range(self.outputs):
            finish = FinishReason.length if self.ends and i == self.outputs - 1 else None  # (``ends``: its last one)
            yield RequestOutput("r", [5], "a", finish, 1, i + 1, RequestStats())
        if self.fail:
            raise RuntimeError("the lane broke")
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        await asyncio.sleep(0)
        self.closed.append(self.index)


class _Body:
    stream = False
    return_token_ids = False
    logprob_count = None


class _StreamedBody(_Body):
    stream = True
    include_usage_in_stream = False
    usage_in_every_chunk = False
    n = 1


def test_a_client_that_leaves_as_the_last_chunk_is_sent_leaves_a_finished_request() -> None:
    """The answer had finished: the client left while its finish chunk was being sent (the response cancelled at
    that send). It was counted aborted, not served, and its tokens and latencies were left out of the finished
    request's counters."""

    async def trial() -> None:
        closed: list[int] = []
        metrics = ServeMetrics()
        choice = _Choice(
            _Outcome(_Stream(closed, 0, outputs=2, ends=True), metrics, _Tracker()),  # type: ignore[arg-type]
            _CompletionFormat(MODEL),
            StreamCursor(),
        )
        events = _Routes(None)._events([choice], _StreamedBody())  # type: ignore[arg-type]
        async for event in events:
            if '"finish_reason":"length"' in event:
                break
        else:
            raise AssertionError("no finish chunk")
        await events.aclose()  # the client left: the generator is closed at the yield of that chunk
        counted = {
            line.split('"')[1]: float(line.split()[-1])
            for line in metrics.render().decode().splitlines()
            if line.startswith('specserve_requests_total{status="')
        }
        assert closed == [0] and counted == {"ok": 1.0}, counted

    asyncio.run(asyncio.wait_for(trial(), 10))


@pytest.mark.parametrize("hops", range(12))
def test_a_cancel_while_choices_close_closes_every_choice(hops: int) -> None:
    """A client leaves a non-streamed request of two choices and the handler is cancelled ``hops`` turns of the
    loop later (Serve cancels the handler of a client that left): the choices were closed one after another, and a
    cancel landing while the first closed left the second generating for nobody, never counted."""

    async def trial() -> None:
        closed: list[int] = []
        choices = [
            _Choice(_Outcome(_Stream(closed, i), ServeMetrics(), _Tracker()), _CompletionFormat(MODEL), StreamCursor())  # type: ignore[arg-type]
            for i in range(2)
        ]

        receive = LeavingClient(hops)
        task = receive.task = asyncio.ensure_future(_Routes(None)._collect(choices, _Body(), receive))  # type: ignore[arg-type]
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert sorted(closed) == [0, 1] and all(c.outcome.closed for c in choices)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []  # (no reader left)

    asyncio.run(trial())


def test_a_choice_that_fails_fails_the_answer_at_once() -> None:
    """A non-streamed answer read its choices one after another: one failing was seen only once the others had
    finished (here: never), and those were counted as served."""

    async def trial() -> None:
        closed: list[int] = []
        metrics = ServeMetrics()
        streams = [_Stream(closed, 0), _Stream(closed, 1, outputs=1, fail=True)]
        choices = [
            _Choice(_Outcome(s, metrics, _Tracker()), _CompletionFormat(MODEL).for_choice(i), StreamCursor())  # type: ignore[arg-type]
            for i, s in enumerate(streams)
        ]

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client stays
            return {}

        response = await _Routes(None)._collect(choices, _Body(), receive)  # type: ignore[arg-type]
        assert response.status_code == 500 and sorted(closed) == [0, 1]
        assert 'status="failed"} 2.0' in metrics.render().decode()

    asyncio.run(asyncio.wait_for(trial(), 10))
