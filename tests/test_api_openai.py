"""What an OpenAI user sees (issue 16 items 7 and 9): context errors with ``param``, the SDKs' no-op defaults,
models.retrieve, strict JSON types; Retry-After from the queue, disconnects counted as aborts, a fresh queue gauge
after a failed step. Real HTTP against the in-process API (tests/api_backend) with the official client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from deployments.app_args import AppArgs, TinyModels
from deployments.failover import Moving
from deployments.lane import Lane
from deployments.router import Router
from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.error_bodies import OverloadedError, WorkerFailedError
from specserve.api.metrics import LoadEstimate, RequestStatus, ServeMetrics
from specserve.api.schemas import Health, HealthStatus
from specserve.api.server import build_api
from specserve.errors import InvalidRequestError
from specserve.sampling import SamplingParams
from specserve.sequence import Request, RequestOutput, RequestStats
from specserve.step_events import StepMetrics
from tests.api_backend import MODEL, LeavingClient, LocalBackend, api_server, module_server, requests_by_status
from tests.test_min_tokens import one_token_a_step, stop_seen_twice

CONTEXT = 128
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


backend, url = module_server(max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30.0)


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# -- item 7 ------------------------------------------------------------------------------------------------


def test_context_length_exceeded_names_the_parameter(url: str) -> None:
    prompt = [5] * 100
    fits = httpx.post(
        url + COMPLETIONS,
        json={"model": MODEL, "prompt": prompt, "max_tokens": CONTEXT - 100, "temperature": 0, "ignore_eos": True},
    )
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == CONTEXT - 100
    cases = [
        (COMPLETIONS, {"prompt": prompt, "max_tokens": CONTEXT - 99}, "max_tokens"),
        (COMPLETIONS, {"prompt": [5] * CONTEXT, "max_tokens": 1}, "prompt"),
        (CHAT, {"messages": USER, "max_tokens": CONTEXT}, "max_tokens"),
        (CHAT, {"messages": USER, "max_completion_tokens": CONTEXT}, "max_completion_tokens"),
        (CHAT, {"messages": [{"role": "user", "content": "word " * CONTEXT}]}, "messages"),
    ]
    for path, body, param in cases:
        error = _error(httpx.post(url + path, json={"model": MODEL, **body}))
        assert (error["code"], error["param"], error["type"]) == (
            "context_length_exceeded",
            param,
            "invalid_request_error",
        )
        assert f"maximum context length is {CONTEXT} tokens" in error["message"]


def test_nan_and_infinity_are_refused_as_not_finite(url: str) -> None:
    """Python's JSON parser takes NaN and Infinity (JSON has neither): the 400 said a NaN temperature was above 2."""
    for field, value in (("temperature", "NaN"), ("top_p", "Infinity"), ("temperature", "-Infinity")):
        content = f'{{"model": "{MODEL}", "prompt": "x", "{field}": {value}}}'
        r = httpx.post(url + COMPLETIONS, content=content, headers={"Content-Type": "application/json"})
        error = _error(r)
        assert error["param"] == field and "finite number" in error["message"], error


def test_chat_without_a_limit_generates_up_to_the_context(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=USER, temperature=0, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.total_tokens == CONTEXT and out.choices[0].finish_reason == "length"


def test_sdk_default_no_op_fields_are_accepted(client: openai.OpenAI, url: str) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=3,
        temperature=0,
        response_format={"type": "text"},
        store=False,  # type: ignore[arg-type]
        extra_body={"top_logprobs": None, "logprobs": None},  # sent as null by clients that spell out every field
    )
    assert out.choices[0].message.role == "assistant"
    spelled_out = client.chat.completions.create(  # what this server does, and OpenAI's unused hints: a 200
        model=MODEL,
        messages=USER,  # type: ignore[arg-type]
        max_tokens=3,
        temperature=0,
        modalities=["text"],
        service_tier="auto",
        safety_identifier="user-1",
        prompt_cache_key="tenant-a",
        extra_body={"prompt_cache_retention": None, "moderation": None, "prompt_cache_options": None},
    )
    assert spelled_out.choices[0].message.content == out.choices[0].message.content
    zero = {"model": MODEL, "messages": USER, "max_tokens": 1, "logprobs": False, "top_logprobs": 0}
    assert httpx.post(url + CHAT, json=zero).status_code == 200
    invalid = [("response_format", {"type": "json_xml"}), ("store", True), ("store", "no"), ("top_logprobs", -1)]
    invalid += [("modalities", ["text", "audio"]), ("service_tier", "flex"), ("prompt_cache_retention", "24h")]
    for field, value in invalid:
        body = {"model": MODEL, "messages": USER, field: value}
        error = _error(httpx.post(url + CHAT, json=body))
        assert error["param"] == field and error["code"] == "invalid_value"
    assert (
        "not supported"
        in _error(httpx.post(url + CHAT, json={"model": MODEL, "messages": USER, "store": True}))["message"]
    )


def test_the_sdks_own_assistant_message_can_be_sent_back(client: openai.OpenAI, url: str) -> None:
    """The usual multi-turn loop appends the message the SDK returned: its model carries OpenAI's other fields as
    null (refusal, tool_calls, audio, ...). Null or [] is unset and
    accepted; a value is refused by name, as are OpenAI's request fields this server does not take, unless null (an
    assistant message's tool_calls are taken: tests/test_api_tools.py)."""
    first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0)
    sent_back = first.choices[0].message.model_dump() | {"parsed": None, "tool_calls": []}
    assert sent_back["refusal"] is None and "tool_calls" in sent_back and "annotations" in sent_back
    again = [*USER, sent_back, {"role": "user", "content": "and then?"}]
    out = client.chat.completions.create(model=MODEL, messages=again, max_tokens=3, temperature=0)  # type: ignore[arg-type]
    assert out.choices[0].message.content
    # what the SDK's stream and parse helpers add, whatever its value: the message's ``parsed`` (a parsed response
    # format), a call's ``index`` and ``parsed_arguments`` (400s before: a tool loop on those helpers failed on its
    # second request)
    read = {
        "id": "c",
        "type": "function",
        "index": 0,
        "function": {"name": "f", "arguments": "{}", "parsed_arguments": {}},
    }
    helper = {"role": "assistant", "content": "{}", "parsed": {"unit": "f"}, "tool_calls": [read]}
    r = httpx.post(url + CHAT, json={"model": MODEL, "messages": [*USER, helper, *USER], "max_tokens": 1})
    assert r.status_code == 200, r.text
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for field, value in [("tool_calls", call), ("refusal", "no")]:
        messages = [*USER, {"role": "assistant", "content": "x", field: value}, {"role": "user", "content": "y"}]
        r = httpx.post(url + CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 1})
        if field == "tool_calls":
            assert r.status_code == 200, r.text
        else:
            assert field in _error(r)["message"], r.text
    nulls = {"tools": None, "tool_choice": None, "parallel_tool_calls": None, "service_tier": None}
    assert httpx.post(url + CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 1} | nulls).status_code == 200
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    error = _error(httpx.post(url + CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 1, "tools": tools}))
    assert error["param"] == "tool_choice" and "'auto'" in error["message"], error  # (the default beside tools)


def test_stream_options_include_obfuscation(url: str) -> None:
    """A typed SDK stream option: false (or null) is what this server does; true (padding each chunk) is refused."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "stream": True}
    for value in (False, None):
        options = {"include_usage": True, "include_obfuscation": value}
        assert httpx.post(url + CHAT, json=body | {"stream_options": options}).status_code == 200
    unset = httpx.post(url + CHAT, json=body | {"stream_options": {"include_usage": None}})  # as vLLM: null is unset
    assert unset.status_code == 200 and '"usage"' not in unset.text, unset.text
    for bad in (True, 0):
        r = httpx.post(url + CHAT, json=body | {"stream_options": {"include_obfuscation": bad}})
        assert r.status_code == 400 and "include_obfuscation" in r.json()["error"]["message"], r.text


def test_chunks_carry_a_null_usage_only_when_the_usage_was_asked_for(url: str) -> None:
    """As OpenAI's: with stream_options.include_usage every chunk has "usage" (null) and one more chunk, with no
    choices, has the usage; without it no chunk has the field (every chunk had a "usage": null)."""
    for path, body in ((COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": USER})):
        for include in (False, True):
            request = {"model": MODEL, "max_tokens": 3, "stream": True, "ignore_eos": True, **body}  # (no EOS: 3)
            if include:
                request["stream_options"] = {"include_usage": True}
            r = httpx.post(url + path, json=request, timeout=30)
            datas = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
            assert r.status_code == 200 and datas[-1] == "[DONE]", r.text
            chunks = [json.loads(d) for d in datas[:-1]]
            if not include:
                assert chunks and all("usage" not in c for c in chunks), chunks
                continue
            *content, last = chunks
            assert content and all(c["usage"] is None and c["choices"] for c in content), content
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3, last


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_content_chunk(url: str) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each content chunk carries its choice's
    usage so far, its completion tokens the tokens its choice was sent through that chunk; the last chunk's stays
    the request's; without include_usage it asks for nothing."""
    for path, body in ((COMPLETIONS, {"prompt": [3, 4]}), (CHAT, {"messages": USER})):
        request = {"model": MODEL, "max_tokens": 12, "stream": True, "ignore_eos": True, "return_token_ids": True}
        options = {"include_usage": True, "continuous_usage_stats": True}
        r = httpx.post(url + path, json=request | body | {"n": 2, "stream_options": options}, timeout=30)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        *content, last = chunks
        sent = [0, 0]
        for chunk in content:
            choice = chunk["choices"][0]
            sent[choice["index"]] += len(choice.get("token_ids") or [])
            if chunk["usage"] is not None:  # (chat's role chunks come before any output)
                assert chunk["usage"]["completion_tokens"] == sent[choice["index"]], (path, chunk)
                assert chunk["usage"]["total_tokens"] == chunk["usage"]["prompt_tokens"] + sent[choice["index"]]
        assert sum(c["usage"] is not None for c in content) >= 2 and sent == [12, 12]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 24
        alone = httpx.post(url + path, json=request | body | {"stream_options": {"continuous_usage_stats": True}})
        datas = [json.loads(line[6:]) for line in alone.text.splitlines() if line.startswith("data: {")]
        assert alone.status_code == 200 and all("usage" not in d for d in datas)


def test_a_stream_tells_proxies_to_pass_its_events_on_unbuffered(url: str) -> None:
    """nginx, the reverse proxy deployments/README.md suggests, buffers a proxied body unless told not to: tokens
    (and the keep-alives) would reach the client in bursts."""
    for path, body in ((COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": USER})):
        with httpx.stream("POST", url + path, json={"model": MODEL, "max_tokens": 2, "stream": True, **body}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache", r.headers
            assert any(line == "data: [DONE]" for line in r.iter_lines())
    plain = httpx.post(url + COMPLETIONS, json={"model": MODEL, "max_tokens": 1, "prompt": "hi"})
    assert plain.status_code == 200 and "x-accel-buffering" not in plain.headers


def test_the_sdk_reads_a_stream_with_keep_alive_lines_between_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A keep-alive comment ended by a blank line, once an event had an id, made the OpenAI SDK's decoder dispatch an
    empty event and fail on it (JSONDecodeError): every stream silent for a while after its first chunk broke."""
    import specserve.api.server as server

    monkeypatch.setattr(server, "SSE_KEEPALIVE_S", 0.1)
    backend = LocalBackend(max_model_len=CONTEXT, step_delay_s=0.3)
    try:
        with api_server(backend) as url:
            body = {"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0.0, "stream": True}
            with httpx.stream("POST", url + CHAT, json=body, timeout=30) as r:
                lines = [line for line in r.iter_lines() if line]
            first = next(i for i, line in enumerate(lines) if line.startswith("data: "))
            assert ": keep-alive" in lines[first:], lines  # between chunks, after an event with an id
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30.0)
            create = sdk.chat.completions.create
            chunks = list(create(model=MODEL, messages=USER, max_tokens=4, temperature=0.0, stream=True))
    finally:
        backend.stop()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length" and text, chunks


def test_models_retrieve(client: openai.OpenAI, url: str) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.model_extra["max_model_len"] == CONTEXT
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    error = _error(httpx.get(url + "/v1/models/org/some-model"), 404)  # ids may hold a slash
    assert (error["type"], error["code"], error["param"]) == ("not_found_error", "model_not_found", "model")


def test_an_error_quotes_at_most_the_start_of_a_long_value(url: str) -> None:
    """A 200 KB model name or response_format type came back whole in the error (twice its size with the escapes
    of repr): an error body quotes the first 40 characters, as for unknown fields."""
    huge = "\\" * 200_000
    bodies = [
        ("/v1/completions", {"model": huge, "prompt": [5]}, 404),
        (CHAT, {"model": huge, "messages": USER}, 404),
        (CHAT, {"model": MODEL, "messages": USER, "response_format": {"type": huge}}, 400),
        # a few long keys (more than 8 unknown ones were cut already): each came back whole, twice
        (CHAT, {"model": MODEL, "messages": USER, huge: 1}, 400),
        (CHAT, {"model": MODEL, "messages": USER, "metadata": {huge: "x"}}, 400),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi", huge: 1}]}, 400),
        (CHAT, {"model": MODEL, "messages": USER, "speculation": {huge: 1}}, 400),
    ]
    for path, body, status in bodies:
        r = httpx.post(url + path, json=body)
        assert len(r.content) < 1000 and _error(r, status)["message"], r.content[:200]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "yes"),
        ("max_tokens", "10"),
        ("max_tokens", 10.5),
        ("temperature", "0.5"),
        ("ignore_eos", "true"),
        ("return_token_ids", 1),
        ("n", True),
        ("seed", "7"),
        ("top_k", "5"),
        ("prompt", [False]),
        ("prompt", [1, True]),
        ("prompt", [1.0]),
        ("prompt", [-1]),
        ("speculation", {"enabled": "yes"}),
        ("speculation", {"max_sl": "3"}),
        ("speculation", {"model_fallback": 1}),
        ("speculation", {"drafter": "ngram"}),
    ],
)
def test_json_types_are_strict(url: str, field: str, value: Any) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}
    assert _error(httpx.post(url + COMPLETIONS, json=body))["param"] == field


def test_a_tokenizer_token_past_the_models_vocabulary_is_a_400(caplog: pytest.LogCaptureFixture) -> None:
    """A tokenizer with an added token the checkpoint's embedding has no row for: the server starts with a warning,
    serves prompts without it, and refuses a text or chat prompt with it as a 400 naming the id (it was a 500
    while generating; on CUDA a device-side assert)."""
    tokenizer = tiny_tokenizer()  # 512 tokens, as the tiny model's vocabulary
    tokenizer.add_tokens(["<extra_tok>"])
    extra = tokenizer.convert_tokens_to_ids("<extra_tok>")
    assert extra == 512
    with caplog.at_level(logging.WARNING, logger="specserve.prompts"):
        backend = LocalBackend(max_model_len=CONTEXT, tokenizer=tokenizer)
    assert any("513 tokens" in r.getMessage() and "only 512" in r.getMessage() for r in caplog.records)
    try:
        with api_server(backend) as url:
            fine = {"model": MODEL, "prompt": "hi there", "max_tokens": 3}
            assert httpx.post(url + COMPLETIONS, json=fine, timeout=30).status_code == 200
            extra_prompt = {"model": MODEL, "prompt": "hi <extra_tok>", "max_tokens": 3}
            extra_chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi <extra_tok>"}], "max_tokens": 3}
            for path, body, param in ((COMPLETIONS, extra_prompt, "prompt"), (CHAT, extra_chat, "messages")):
                error = _error(httpx.post(url + path, json=body, timeout=30))
                assert error["param"] == param and error["code"] == "invalid_value"
                assert f"token id {extra}" in error["message"] and "vocabulary has 512 tokens" in error["message"]
    finally:
        backend.stop()


def test_top_k_minus_one_or_zero_is_no_top_k(url: str) -> None:
    """vLLM's clients send top_k -1 (some 0) for "no top-k": the same sampled answer as without the field; other
    negatives stay a 400."""

    def sampled(**top_k: int) -> list[int]:
        body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 8, "temperature": 1.0, "seed": 11}
        r = httpx.post(url + COMPLETIONS, json={**body, **top_k, "return_token_ids": True, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    unlimited = sampled()
    assert sampled(top_k=-1) == sampled(top_k=0) == unlimited != sampled(top_k=1)
    for bad in (-2, -(2**40)):
        assert (
            _error(httpx.post(url + COMPLETIONS, json={"model": MODEL, "prompt": "x", "top_k": bad}))["param"]
            == "top_k"
        )


def test_return_token_ids_sends_the_prompts_ids_where_vllm_does(url: str) -> None:
    """vLLM's return_token_ids returns the prompt's token ids beside the output's: on each completion choice (a
    batch's each its own prompt's; streamed, in each choice's first chunk) and at a chat answer's top level (the
    template's ids; streamed, in its first chunk). Only the output's came back; without it, neither does."""
    tok = tiny_tokenizer()
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def events(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        r = httpx.post(url + path, json=body | {"stream": True}, timeout=60)
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    batch = base | {"prompt": [[3, 4], [5, 6, 7]], "n": 2}
    r = httpx.post(url + COMPLETIONS, json=batch, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["prompt_token_ids"] for c in r.json()["choices"]] == [[3, 4], [3, 4], [5, 6, 7], [5, 6, 7]]
    firsts: dict[int, list[int]] = {}
    for event in events(COMPLETIONS, batch):
        for choice in event["choices"]:
            if choice["index"] in firsts:
                assert "prompt_token_ids" not in choice, choice
            else:
                firsts[choice["index"]] = choice["prompt_token_ids"]
    assert firsts == {0: [3, 4], 1: [3, 4], 2: [5, 6, 7], 3: [5, 6, 7]}
    text = base | {"prompt": "the cat"}
    r = httpx.post(url + COMPLETIONS, json=text, timeout=60)
    assert r.json()["choices"][0]["prompt_token_ids"] == tok.encode("the cat")

    template = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    chat = base | {"messages": USER}
    answer = httpx.post(url + CHAT, json=chat, timeout=60).json()
    assert answer["prompt_token_ids"] == template and "prompt_token_ids" not in answer["choices"][0]
    streamed = events(CHAT, chat)
    assert streamed[0]["prompt_token_ids"] == template
    assert all("prompt_token_ids" not in e for e in streamed[1:])

    plain = {k: v for k, v in base.items() if k != "return_token_ids"}
    for path, body in ((COMPLETIONS, plain | {"prompt": [3, 4]}), (CHAT, plain | {"messages": USER})):
        answer = httpx.post(url + path, json=body, timeout=60).json()
        assert "prompt_token_ids" not in json.dumps(answer)
        assert all("prompt_token_ids" not in json.dumps(e) for e in events(path, body))


def test_vllms_min_p_stop_token_ids_and_neutral_repetition_penalty(url: str, client: openai.OpenAI) -> None:
    """vLLM's sampling extensions as its clients send them (the OpenAI SDK's ``extra_body``): min_p 1 keeps the most
    likely token alone, so a sampled answer is the greedy one; a stop token id ends the answer, its id in it and
    its text not; ``stop_reason`` names the stop token id or string; repetition_penalty only at its neutral 1; each
    bad value a 400 naming the field."""

    def post(**fields: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 8, "return_token_ids": True, "ignore_eos": True}
        return httpx.post(url + COMPLETIONS, json=body | fields, timeout=30)

    def tokens(r: httpx.Response) -> list[int]:
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    greedy = tokens(post(temperature=0))
    sampled = dict(temperature=1.0, seed=11)
    assert tokens(post(**sampled)) != greedy  # (this seed's sampled answer is another)
    assert tokens(post(**sampled, min_p=1.0)) == greedy
    assert tokens(post(**sampled, min_p=0)) == tokens(post(**sampled, min_p=None)) == tokens(post(**sampled))

    stop = next(t for t in greedy[2:] if greedy.index(t) >= 2)
    r = post(temperature=0, stop_token_ids=[stop])
    cut = greedy[: greedy.index(stop) + 1]
    assert tokens(r) == cut and r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["stop_reason"] == stop  # (vLLM's: the stop token id, or stop string, that ended it)
    assert r.json()["usage"]["completion_tokens"] == len(cut)
    # as vLLM's (without include_stop_str_in_output): the stop token's id is output, its text is not
    before_stop = post(temperature=0, max_tokens=len(cut) - 1).json()["choices"][0]["text"]
    through_stop = post(temperature=0, max_tokens=len(cut)).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == before_stop != through_stop
    via_sdk = client.completions.create(
        model=MODEL, prompt=[3, 4], max_tokens=8, temperature=0, extra_body={"stop_token_ids": [stop], "min_p": 0.5}
    )
    assert via_sdk.choices[0].finish_reason == "stop" and via_sdk.usage is not None
    assert via_sdk.usage.completion_tokens == len(cut) and via_sdk.choices[0].text == before_stop
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=[3, 4], max_tokens=8, temperature=0, stream=True, extra_body={"stop_token_ids": [stop]}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == before_stop
    assert [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in chunks if c.choices][-1] == ("stop", stop)
    assert all(c.choices[0].stop_reason is None for c in chunks[:-1])
    text = post(temperature=0).json()["choices"][0]["text"]
    by_string = post(temperature=0, stop=[text[3:5], "never"]).json()["choices"][0]
    assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", text[3:5])
    assert post(temperature=0).json()["choices"][0]["stop_reason"] is None  # a length limit (EOS too)
    kept = post(temperature=0, stop=[text[3:5]], include_stop_str_in_output=True).json()["choices"][0]
    assert kept["text"] == by_string["text"] + text[3:5]
    kept_stream = client.completions.create(
        model=MODEL,
        prompt=[3, 4],
        max_tokens=8,
        temperature=0,
        stream=True,
        stop=[text[3:5]],
        extra_body={"include_stop_str_in_output": True, "ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in kept_stream if c.choices) == kept["text"]
    kept_id = post(temperature=0, stop_token_ids=[stop], include_stop_str_in_output=True).json()["choices"][0]
    assert kept_id["text"] == through_stop and kept_id["token_ids"] == cut

    def chat(**fields: Any) -> dict[str, Any]:
        body = {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + CHAT, json=body | fields, timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json()["choices"][0])

    answer = chat(stop_token_ids=[], return_token_ids=True)
    assert answer["stop_reason"] is None
    chat_stop = answer["token_ids"][2]
    stopped = chat(stop_token_ids=[chat_stop])
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", chat_stop)
    streamed = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0, stream=True, extra_body={"stop_token_ids": [chat_stop]}
    )
    ends = [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in streamed if c.choices]
    assert ends[-1] == ("stop", chat_stop) and all(end == (None, None) for end in ends[:-1])

    assert tokens(post(temperature=0, repetition_penalty=1)) == tokens(post(temperature=0, repetition_penalty=None))
    spelled_out = post(temperature=0, skip_special_tokens=True, spaces_between_special_tokens=True)  # (the defaults)
    assert tokens(spelled_out) == tokens(post(temperature=0, skip_special_tokens=None))
    for field, value, says in (
        ("repetition_penalty", 1.2, "not supported"),
        ("min_p", 1.5, "less than or equal to 1"),
        ("min_p", "0.1", "valid number"),
        ("stop_token_ids", [3, True], "valid integer"),
        ("stop_token_ids", 3, "valid list"),
        ("stop_token_ids", [512], "must be in [0, 512)"),
        ("include_stop_str_in_output", 1, "valid boolean"),
        ("skip_special_tokens", False, "false is not supported; special tokens are always skipped"),
        ("spaces_between_special_tokens", False, "false is not supported"),
    ):
        error = _error(post(temperature=0, **{field: value}))
        assert error["param"] == field and says in error["message"], (field, value, error)


def test_logit_bias_moves_the_answer_over_http_and_the_sdk(url: str, client: openai.OpenAI) -> None:
    """OpenAI's logit_bias (token ids as decimal strings): -100 keeps a token out of the answer, +100 makes it the
    whole answer, sampled or greedy, in both endpoints, streamed and through the OpenAI SDK's own parameter; the
    token ids and values it cannot take are a 400 naming the field."""

    def post(path: str = COMPLETIONS, **fields: Any) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 8, "return_token_ids": True, "ignore_eos": True, "temperature": 0}
        body |= {"prompt": [3, 4]} if path == COMPLETIONS else {"messages": USER}
        return httpx.post(url + path, json=body | fields, timeout=30)

    def tokens(r: httpx.Response) -> list[int]:
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    for path in (COMPLETIONS, CHAT):
        greedy = tokens(post(path))
        banned = {str(t): -100 for t in set(greedy)}
        assert not set(tokens(post(path, logit_bias=banned))) & set(greedy)
        assert tokens(post(path, logit_bias={"7": 100})) == [7] * 8
        assert tokens(post(path, logit_bias={"7": 100}, temperature=1.0, seed=3)) == [7] * 8
        assert tokens(post(path, logit_bias={})) == tokens(post(path, logit_bias=None)) == greedy
    via_sdk = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=4, temperature=0, logit_bias={"9": 100})
    assert via_sdk.choices[0].text == tiny_tokenizer().decode([9] * 4)
    chunks = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, temperature=0, stream=True, logit_bias={"9": 100}
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == via_sdk.choices[0].text
    for value, says in (
        ({"512": 1}, "logit_bias token ids must be in [0, 512), not [512]"),
        ({"7": 100.5}, "numbers in [-100, 100], not 100.5 (token 7)"),
        ({"7": "1"}, "numbers in [-100, 100], not '1'"),
        ({"07": 1}, "token ids in decimal ('42'), not '07'"),
        ({"-1": 1}, "not '-1'"),
        ({str(t): 1 for t in range(1025)}, "at most 1024 entries, not 1025"),
        ([7], "valid dictionary"),
    ):
        error = _error(post(logit_bias=value))
        assert error["param"] == "logit_bias" and says in error["message"], (value, error)


def test_echo_starts_the_answer_with_the_prompt_and_its_logprobs(url: str, client: openai.OpenAI) -> None:
    """OpenAI's echo (as lm-eval's loglikelihood requests send it: max_tokens 1, logprobs 1): the text starts with the
    prompt's, and the logprobs list the prompt's tokens first, the first without a log-probability (nothing comes
    before it), each other one the model's log-probability of it after the tokens before it."""
    tok = tiny_tokenizer()
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for prompt in ("the cat sat", [3, 40, 41, 7]):
        plain = httpx.post(url + COMPLETIONS, json=body | {"prompt": prompt, "logprobs": 2}, timeout=30).json()
        echoed = httpx.post(url + COMPLETIONS, json=body | {"prompt": prompt, "logprobs": 2, "echo": True}).json()
        ids = tok.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        prompt_text = prompt if isinstance(prompt, str) else tok.decode(prompt)
        choice, lp = echoed["choices"][0], echoed["choices"][0]["logprobs"]
        assert choice["text"] == prompt_text + plain["choices"][0]["text"]
        assert choice["token_ids"] == plain["choices"][0]["token_ids"]  # (the output's alone)
        assert echoed["usage"] == plain["usage"]
        assert lp["tokens"] == [tok.decode([t]) for t in ids] + plain["choices"][0]["logprobs"]["tokens"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][len(ids) :] == plain["choices"][0]["logprobs"]["token_logprobs"]
        assert all(v is not None and v < 0 for v in lp["token_logprobs"][1:])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        text_only = httpx.post(url + COMPLETIONS, json=body | {"prompt": prompt, "echo": True}).json()["choices"][0]
        assert text_only["text"] == choice["text"] and text_only["logprobs"] is None
    lm_eval = client.completions.create(model=MODEL, prompt=[3, 40, 41, 7], max_tokens=1, logprobs=1, echo=True)
    assert lm_eval.choices[0].logprobs is not None and len(lm_eval.choices[0].logprobs.token_logprobs or []) == 5
    # an answer that is EOS at once: its entry is still the one after the prompt's (lm-eval reads [len(prompt):-1])
    eos = tok.eos_token_id
    at_eos = client.completions.create(
        model=MODEL, prompt=[3, 40, 41, 7], max_tokens=1, logprobs=1, echo=True, logit_bias={str(eos): 100}
    )
    lp = at_eos.choices[0].logprobs
    assert at_eos.choices[0].finish_reason == "stop" and lp is not None and lp.token_logprobs is not None
    assert len(lp.token_logprobs) == 5 and lp.token_logprobs[:4] == lm_eval.choices[0].logprobs.token_logprobs[:4]
    assert (
        lp.tokens is not None
        and lp.tokens[-1] == tok.decode([eos])
        and at_eos.choices[0].text == tok.decode([3, 40, 41, 7])
    )
    # streamed (tests/test_resume.py: with logprobs, and resumed): the first chunk starts with the prompt's text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="the cat sat", max_tokens=3, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith("the cat sat")
    whole = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=3, temperature=0, echo=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_max_tokens_0_with_echo_scores_the_prompt_alone(url: str, client: openai.OpenAI) -> None:
    """vLLM's prompt-only scoring (max_tokens 0, as lm-eval's older OpenAI client sent it): the prompt's text and
    logprobs as echo gives them, no output token, the answer ended by its length; without echo, or with min_tokens,
    a 400."""
    tok = tiny_tokenizer()
    prompt = [3, 40, 41, 7]
    body = {"model": MODEL, "prompt": prompt, "logprobs": 2, "echo": True, "return_token_ids": True}
    one = httpx.post(url + COMPLETIONS, json=body | {"max_tokens": 1, "temperature": 0}, timeout=30).json()
    for temperature in (0, 1.0):  # (a sampled token is dropped as well)
        r = httpx.post(url + COMPLETIONS, json=body | {"max_tokens": 0, "temperature": temperature}, timeout=30)
        assert r.status_code == 200, r.text
        choice, lp = r.json()["choices"][0], r.json()["choices"][0]["logprobs"]
        assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (tok.decode(prompt), [], "length")
        assert lp["tokens"] == [tok.decode([t]) for t in prompt] and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"] == one["choices"][0]["logprobs"]["token_logprobs"][:4]
        assert lp["top_logprobs"] == one["choices"][0]["logprobs"]["top_logprobs"][:4]
        assert r.json()["usage"] | {"speculation": None} == {
            "prompt_tokens": 4,
            "completion_tokens": 0,
            "total_tokens": 4,
            "speculation": None,
        }
    sdk = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert sdk.choices[0].logprobs is not None and len(sdk.choices[0].logprobs.token_logprobs or []) == 4
    chunks = list(client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "the cat sat"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    without_echo = _error(httpx.post(url + COMPLETIONS, json={"model": MODEL, "prompt": prompt, "max_tokens": 0}))
    assert without_echo["param"] == "max_tokens" and "echo" in without_echo["message"]
    floor = _error(httpx.post(url + COMPLETIONS, json=body | {"max_tokens": 0, "min_tokens": 1}))
    assert floor["param"] == "min_tokens"
    whole = _error(httpx.post(url + COMPLETIONS, json=body | {"prompt": [5] * CONTEXT, "max_tokens": 0}))
    assert whole["code"] == "context_length_exceeded"
    # a resume point after an output token is no event of its stream (which has none): refused before it is scored
    past = body | {"max_tokens": 0, "stream": True, "temperature": 0, "resume_from": "1-1-00000000"}
    assert _error(httpx.post(url + COMPLETIONS, json=past), 409)["param"] == "resume_from"


def test_min_tokens_keeps_stop_ids_out_until_then_over_http(url: str, client: openai.OpenAI) -> None:
    """vLLM's min_tokens: a stop token id the answer would end at is not generated before that many tokens, a stop
    string completed before then does not stop it; more than max_tokens a 400 naming it."""

    def post(**fields: Any) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 10, "return_token_ids": True, "temperature": 0}
        r = httpx.post(url + COMPLETIONS, json=body | fields, timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json()["choices"][0])

    greedy = post(ignore_eos=True)["token_ids"]
    stop = greedy[1]
    assert post(stop_token_ids=[stop])["token_ids"] == greedy[:2]
    held = post(stop_token_ids=[stop], min_tokens=6)
    assert len(held["token_ids"]) >= 6 and stop not in held["token_ids"][:6], held
    assert (held["finish_reason"] == "stop") == (held["token_ids"][-1] == stop)
    via_sdk = client.completions.create(
        model=MODEL, prompt=[3, 4], max_tokens=10, temperature=0, extra_body={"stop_token_ids": [stop], "min_tokens": 6}
    )
    assert via_sdk.choices[0].text == tiny_tokenizer().decode(
        held["token_ids"][: 10 if held["finish_reason"] == "length" else -1]
    )
    # a stop string the first tokens complete does not stop the answer before min_tokens, a later one does
    tok = tiny_tokenizer()
    long = post(ignore_eos=True, max_tokens=40)["token_ids"]
    letter, first = stop_seen_twice(tok, long)
    text, n = one_token_a_step(tok, long, [letter], first)
    passed = post(ignore_eos=True, max_tokens=40, stop=[letter], min_tokens=first)
    assert (passed["text"], passed["token_ids"], passed["finish_reason"]) == (text, long[:n], "stop")
    streamed = client.completions.create(
        model=MODEL, prompt=[3, 4], max_tokens=40, temperature=0, stop=[letter], stream=True,
        extra_body={"ignore_eos": True, "min_tokens": first},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    for fields, says in (
        ({"min_tokens": 11}, "min_tokens (11) must be at most max_tokens (10)"),
        ({"min_tokens": -1}, "greater than or equal to 0"),
        ({"min_tokens": "2"}, "valid integer"),
    ):
        body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 10} | fields
        error = _error(httpx.post(url + COMPLETIONS, json=body))
        assert error["param"] == "min_tokens" and says in error["message"], (fields, error)
    # chat: named as the client set the limit (or left it to the context)
    for fields, says in (
        ({"max_completion_tokens": 5, "min_tokens": 6}, "min_tokens (6) must be at most max_completion_tokens (5)"),
        ({"max_tokens": 5, "min_tokens": 6}, "min_tokens (6) must be at most max_tokens (5)"),
        ({"min_tokens": 10**6}, "min_tokens (1000000) must be at most the room the context leaves the answer ("),
    ):
        error = _error(httpx.post(url + CHAT, json={"model": MODEL, "messages": USER} | fields))
        assert error["param"] == "min_tokens" and says in error["message"], (fields, error)


def test_logprobs_over_http_streamed_and_through_the_sdk(url: str, client: openai.OpenAI) -> None:
    """OpenAI's logprobs in both endpoints' shapes: per output token its text, log-probability and the likeliest
    tokens' (the engine's values, tests/test_logprobs.py), the same streamed as whole, through the SDK's types; a
    count past 20, or top_logprobs without logprobs, a 400 naming the field."""

    def post(path: str, **fields: Any) -> dict[str, Any]:
        body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        body |= {"prompt": [3, 4]} if path == COMPLETIONS else {"messages": USER}
        r = httpx.post(url + path, json=body | fields, timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json()["choices"][0])

    tok = tiny_tokenizer()
    whole = post(COMPLETIONS, logprobs=2)
    lp = whole["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in whole["token_ids"]]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value < 0 and top[token] == value and max(top.values()) == value  # greedy: the likeliest
        assert 1 <= len(top) <= 2
    sampled = post(COMPLETIONS, logprobs=0, temperature=1.0, seed=5)["logprobs"]
    assert all(list(top) == [t] for t, top in zip(sampled["tokens"], sampled["top_logprobs"], strict=True))
    events = [
        json.loads(line[6:])
        for line in httpx.post(
            url + COMPLETIONS,
            json={"model": MODEL, "prompt": [3, 4], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            | {"logprobs": 2, "stream": True},
            timeout=30,
        ).text.splitlines()
        if line.startswith("data: {")
    ]
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for chunk in streamed for x in chunk[field]] == lp[field], field

    chat = post(CHAT, logprobs=True, top_logprobs=3)
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in chat["token_ids"]]
    assert all(len(c["top_logprobs"]) == 3 for c in content)
    # (the tokens' own bytes: decoded together, the text of the tokens, its invalid bytes as U+FFFD)
    assert bytes(b for c in content for b in c["bytes"]).decode(errors="replace") == tok.decode(chat["token_ids"])
    assert all(c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)  # greedy: the likeliest first
    assert post(CHAT, logprobs=True)["logprobs"]["content"][0]["top_logprobs"] == []
    assert post(CHAT)["logprobs"] is None and post(CHAT, logprobs=False, top_logprobs=0)["logprobs"] is None
    via_sdk = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    sdk_content = [
        c
        for chunk in via_sdk
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content or []
    ]
    assert [(c.token, c.logprob) for c in sdk_content] == [(c["token"], c["logprob"]) for c in content]
    legacy = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=8, temperature=0, logprobs=2)
    assert legacy.choices[0].logprobs is not None and legacy.choices[0].logprobs.token_logprobs == lp["token_logprobs"]

    for path, fields, param, says in (
        (COMPLETIONS, {"logprobs": 21}, "logprobs", "less than or equal to 20"),
        (COMPLETIONS, {"logprobs": True}, "logprobs", ""),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        (CHAT, {"logprobs": False, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        (CHAT, {"logprobs": 1}, "logprobs", "valid boolean"),
    ):
        body = {"model": MODEL} | ({"prompt": "hi"} if path == COMPLETIONS else {"messages": USER}) | fields
        error = _error(httpx.post(url + path, json=body))
        assert error["param"] == param and says in error["message"], (fields, error)


# -- item 9 ------------------------------------------------------------------------------------------------


def test_load_estimate_follows_the_measured_rates() -> None:
    load = LoadEstimate(weight=0.5)
    assert load.wait_s(queued=3, slots=2) is None  # nothing measured yet
    load.observe_step(0.2)
    load.observe_request(30)
    assert load.wait_s(queued=3, slots=2) == pytest.approx(4 * 30 * 0.2 / 2)
    load.observe_step(0.4)  # slower steps: a longer wait
    assert load.wait_s(queued=3, slots=2) == pytest.approx(4 * 30 * 0.3 / 2)


def test_retry_after_is_estimated_from_the_queue_and_step_rate() -> None:
    class BusyLane:
        alive = True
        loading = False
        draft_lost = False
        healthy = True
        in_flight = 12  # batch 4 running + 8 queued: the router is full

    class Admission:  # the router's own admission code, without Ray
        submit = Router.func_or_class.submit
        check_capacity = Router.func_or_class.check_capacity
        retry_after_s = Router.func_or_class.retry_after_s
        capacity = Router.func_or_class.capacity
        running_slots = Router.func_or_class.running_slots

    router: Any = Admission()
    router.args = AppArgs(tiny=TinyModels(), max_batch_size=4, max_queued_requests=8, retry_after_s=1)
    router._lane_slots = 4  # one lane's KV slots
    router._metrics = metrics = ServeMetrics()
    router._moving = moving = Moving()
    router.lanes = [BusyLane()]
    request = Request("r", [1, 2], SamplingParams())

    def retry_after() -> int:
        with pytest.raises(OverloadedError) as info:
            asyncio.run(router.submit(request))
        return info.value.retry_after_s

    assert retry_after() == 1  # nothing measured: the configured floor
    for _ in range(3):  # fed as the lanes and the HTTP layer feed it
        step = StepMetrics(4, [0] * 4, [0] * 4, [0] * 4, None, [False] * 4, 0, 0.0, 0.0, 0.4, 0.1, 4, False)
        metrics.lane_step(0, step, running=4, waiting=8, step_s=0.5)
        out = RequestOutput("x", [7], "", None, 2, 40, RequestStats(target_forwards=40))
        metrics.request_finished(out, ttft_s=None, tpot_s=None)
    assert retry_after() == 45  # (8 queued + 1) requests x 40 steps x 0.5 s / 4 slots
    # the SL_cap and idle gauges are the last step's: a plain step after a DSDE one clears them
    dsde = StepMetrics(4, [3, 1, 1, 1], [0] * 4, [0] * 4, 3, [False] * 4, 3, 0.5, 0.0, 0.4, 0.1, 4, False)
    metrics.lane_step(0, dsde, running=4, waiting=8, step_s=0.5)
    shown = metrics.render().decode()
    assert 'specserve_sl_cap{lane="0"} 3.0' in shown and 'specserve_straggler_idle_fraction{lane="0"} 0.5' in shown
    metrics.lane_step(0, step, running=4, waiting=8, step_s=0.5)
    shown = metrics.render().decode()
    assert 'specserve_sl_cap{lane="0"} 0.0' in shown and 'specserve_straggler_idle_fraction{lane="0"} 0.0' in shown
    BusyLane.in_flight = 11  # one place left, but a request pausing before a move to another lane holds it
    with moving.pausing():
        assert retry_after() == 45


def test_a_full_server_refuses_before_tokenising_the_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 MiB prompt costs ~2 s of tokenisation: a server at capacity answers 429 without paying it, and one with
    room answers a prompt longer than any tokenisation could fit with a 400 before tokenising it too. A prompt the
    bound cannot refuse is tokenised, and refused by its tokens."""
    backend = LocalBackend(max_model_len=CONTEXT, capacity=0)
    encoder, calls, tokenised = backend.encoder, [], []
    text, encode = encoder.text, encoder.tokenizer.encode
    monkeypatch.setattr(encoder, "text", lambda prompt, **kw: calls.append(len(prompt)) or text(prompt, **kw))
    monkeypatch.setattr(encoder.tokenizer, "encode", lambda t, **kw: tokenised.append(len(t)) or encode(t, **kw))
    try:
        with api_server(backend) as url:
            body = {"model": MODEL, "prompt": "x" * 100_000, "max_tokens": 2}
            r = httpx.post(url + COMPLETIONS, json=body, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            assert calls == []
            backend.capacity = 1  # room again: at least 20,000 tokens (no piece of the tokenizer is over 5 bytes)
            r = httpx.post(url + COMPLETIONS, json=body, timeout=30)
            error = r.json()["error"]
            assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
            assert error["param"] == "prompt" and "at least 20000 tokens" in error["message"]
            assert calls == [100_000] and tokenised == []
            messages = [{"role": "user", "content": "x" * 100_000}]
            r = httpx.post(url + CHAT, json={"model": MODEL, "messages": messages}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert tokenised == []
            body["prompt"] = "x" * 600  # at least 120 tokens, room for 126: tokenised (600 tokens), then refused
            r = httpx.post(url + COMPLETIONS, json=body, timeout=30)
            assert r.status_code == 400 and "resulted in 600 tokens" in r.json()["error"]["message"], r.text
            assert tokenised == [600]
    finally:
        backend.stop()


def test_prompts_being_tokenised_count_against_the_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of prompts all passed the capacity check while none was admitted yet (each still tokenising), and
    queued without bound; one on its way in now holds its place."""
    backend = LocalBackend(max_model_len=CONTEXT, capacity=1)
    encoder, started, release = backend.encoder, threading.Event(), threading.Event()
    text = encoder.text

    def slow_text(prompt: str, **kw: Any) -> list[int]:
        started.set()
        assert release.wait(30)
        return text(prompt, **kw)

    monkeypatch.setattr(encoder, "text", slow_text)
    try:
        with api_server(backend) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
            first = pool.submit(httpx.post, url + COMPLETIONS, json=body, timeout=30)
            assert started.wait(30)
            r = httpx.post(url + COMPLETIONS, json=body, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            release.set()
            assert first.result().status_code == 200
            assert httpx.post(url + COMPLETIONS, json=body, timeout=30).status_code == 200  # its place given back
    finally:
        backend.stop()


@pytest.mark.parametrize("hops", range(6))
def test_a_cancel_landing_as_a_left_clients_answer_is_cancelled_still_cancels_the_handler(hops: int) -> None:
    """A client leaves a non-streaming request; the handler cancels the answer it was waiting for and waits for it
    to end. A cancel of the handler itself (Serve's for a client that left, a caller's timeout) landing ``hops``
    loop iterations after the disconnect was swallowed with the answer's own CancelledError at 3 hops: the handler
    returned a 204 and its task ended not cancelled."""
    from specserve.api.resume import StreamCursor
    from specserve.api.server import _Choice, _Outcome, _Routes, _Tracker

    class Never:  # an admitted request's stream that has produced nothing yet
        def __aiter__(self) -> AsyncIterator[RequestOutput]:
            return self._outputs()

        async def _outputs(self) -> AsyncIterator[RequestOutput]:
            await asyncio.Event().wait()
            yield RequestOutput("r", [], "", None, 1, 0, RequestStats())  # (never reached)

        async def aclose(self) -> None:
            pass

    class Body:
        stream = False
        return_token_ids = False
        logprob_count = None

    async def trial() -> None:
        outcome = _Outcome(Never(), ServeMetrics(), _Tracker())  # type: ignore[arg-type]
        routes, receive = _Routes(None), LeavingClient(hops)  # type: ignore[arg-type]
        choice = _Choice(outcome, None, StreamCursor())  # type: ignore[arg-type]
        task = receive.task = asyncio.ensure_future(routes._collect([choice], Body(), receive))  # type: ignore[arg-type]
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled() and outcome.closed

    asyncio.run(trial())


def test_a_request_that_left_holds_its_place_until_its_tokenisation_ends() -> None:
    """A request cancelled while its prompt was tokenised (Serve cancels the handler of a client that went away)
    gave its place back at once while the tokenisation went on in a thread: clients that sent long prompts and hung
    up queued tokenisations without bound."""
    from specserve.api.schemas import CompletionRequest
    from specserve.api.server import _CompletionFormat, _Routes, _TokenLimit, _Tracker

    class OnePlace:
        model_name, max_model_len, metrics = MODEL, CONTEXT, ServeMetrics()

        def check_capacity(self, *, pending: int = 0) -> None:
            if pending >= 1:
                raise OverloadedError("full", retry_after_s=1)

    release = threading.Event()
    routes = _Routes(OnePlace())  # type: ignore[arg-type]

    def encode(room: int) -> list[int]:
        assert release.wait(30)
        return [5, 6]

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    def request() -> Awaitable[Any]:
        limit, fmt = _TokenLimit(2, "max_tokens", "prompt"), _CompletionFormat(MODEL)
        body = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "max_tokens": 2})
        return routes._generate(body, encode, limit, fmt, _Tracker(), receive)

    async def main() -> None:
        first = asyncio.ensure_future(request())
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(OverloadedError):  # its tokenisation still runs, and holds the one place
            await asyncio.wait_for(request(), 10)
        release.set()
        for _ in range(1000):
            if not routes._encoding:
                break
            await asyncio.sleep(0.01)
        assert routes._encoding == 0  # given back once the thread is done

    asyncio.run(main())


def test_client_disconnect_mid_stream_is_an_abort(backend: LocalBackend, url: str) -> None:
    before = requests_by_status(backend)
    body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("id: ")  # each event: its resume id, then its data
    deadline = time.monotonic() + 10
    while requests_by_status(backend).get("aborted", 0) == before.get("aborted", 0):
        assert time.monotonic() < deadline, requests_by_status(backend)
        time.sleep(0.05)
    after = requests_by_status(backend)
    assert after.get("aborted", 0) == before.get("aborted", 0) + 1
    assert after.get("failed", 0) == before.get("failed", 0)


def _sample(backend: LocalBackend, name: str) -> float:
    for line in backend.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_request_the_client_leaves_counts_its_tokens_and_first_token_latency(backend: LocalBackend, url: str) -> None:
    """Only finished requests fed the token counters and the TTFT histogram: tokens generated for a client that
    then left were never counted, and the slow requests clients give up on were missing from the latency tail."""
    names = ("specserve_generation_tokens_total", "specserve_time_to_first_token_seconds_count")
    before = {n: _sample(backend, n) for n in names} | {"aborted": requests_by_status(backend).get("aborted", 0)}
    body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 100, "ignore_eos": True, "stream": True}
    got = 0
    with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                got += 1
                if got == 3:
                    break
    deadline = time.monotonic() + 10
    while requests_by_status(backend).get("aborted", 0) == before["aborted"]:
        assert time.monotonic() < deadline, requests_by_status(backend)
        time.sleep(0.05)
    tokens = _sample(backend, names[0]) - before[names[0]]
    assert r.status_code == 200 and got == 3
    assert 3 <= tokens < 100  # at least what the client read, and the request was stopped before its end
    assert _sample(backend, names[1]) == before[names[1]] + 1


def test_a_finished_request_whose_last_event_fails_is_counted_once(
    backend: LocalBackend, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request was counted as finished (status, tokens, TTFT) before its usage event was built; a failure there
    counted it again as failed, with its tokens a second time."""
    import specserve.api.server as server

    def broken(out: RequestOutput) -> None:
        raise RuntimeError("usage cannot be built")

    monkeypatch.setattr(server, "usage_for", broken)
    name = "specserve_generation_tokens_total"
    before = requests_by_status(backend) | {name: _sample(backend, name)}
    body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 5, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + COMPLETIONS, json=body | {"stream_options": {"include_usage": True}}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and '"internal_error"' in events[-1], events[-3:]
    after = requests_by_status(backend)
    assert after.get("ok", 0) == before.get("ok", 0) + 1
    assert after.get("failed", 0) == before.get("failed", 0), after
    assert _sample(backend, name) == before[name] + 5


@pytest.mark.parametrize("finished", [True, False])
def test_a_request_is_counted_after_its_work_so_a_scrape_never_sees_one_without_the_other(finished: bool) -> None:
    """The status was counted first: a scrape between the two (the server's thread paused there) saw the request
    ended and none of its tokens."""
    metrics = ServeMetrics()
    seen: list[str] = []
    count = metrics.request_done

    def done(status: RequestStatus) -> None:
        seen.append(metrics.render().decode())
        count(status)

    metrics.request_done = done  # type: ignore[method-assign]
    out = RequestOutput("x", [7, 8, 9], "", None, 2, 3, RequestStats(target_forwards=3))
    if finished:
        metrics.request_finished(out, ttft_s=0.1, tpot_s=0.01)
    else:
        metrics.request_unfinished(RequestStatus.aborted, out, ttft_s=0.1)
    (scrape,) = seen
    assert "specserve_generation_tokens_total 3.0" in scrape and "specserve_target_forwards_total 3.0" in scrape
    assert "specserve_time_to_first_token_seconds_count 1.0" in scrape


def _body_then(body: str, after: Callable[[], dict[str, Any]]) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI receive: the whole body, then, 0.3 s later and on every later call, what ``after`` gives or raises."""
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body.encode(), "more_body": False}
        await asyncio.sleep(0.3)
        return after()

    return receive


def _completions_scope() -> dict[str, Any]:
    """An ASGI scope of a POST to the completions route, for driving the app with a scripted receive."""
    return {
        "type": "http",
        "method": "POST",
        "path": COMPLETIONS,
        "raw_path": COMPLETIONS.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "scheme": "http",
        "http_version": "1.1",
    }


def test_failing_receive_is_a_disconnect_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    """Ray Serve's receive raises (TaskCancelledError) when its proxy dropped the request of a client that left."""
    backend = LocalBackend(max_model_len=CONTEXT, step_delay_s=0.05)  # 120 tokens take seconds
    app = build_api(backend)
    body = json.dumps({"model": MODEL, "prompt": [3, 4], "max_tokens": 120, "ignore_eos": True, "stream": True})
    sent: list[dict[str, Any]] = []

    def proxy_dropped() -> dict[str, Any]:
        raise RuntimeError("the proxy no longer knows this request")

    receive = _body_then(body, proxy_dropped)  # a few events go out first

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    before = requests_by_status(backend)
    try:
        with caplog.at_level(logging.WARNING):
            asyncio.run(app(_completions_scope(), receive, send))  # type: ignore[arg-type]
    finally:
        backend.stop()
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    events = b"".join(m.get("body", b"") for m in sent[1:])
    assert events.startswith(b"id: ") and b"\ndata: " in events and b"[DONE]" not in events  # cut off, not finished
    after = requests_by_status(backend)
    assert after.get("failed", 0) == before.get("failed", 0)
    assert after.get("aborted", 0) == before.get("aborted", 0) + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_that_leaves_a_non_streaming_request_aborts_it() -> None:
    """Only a streaming response listened for the client's disconnect: a non-streaming request whose client left
    ran to its last token for nobody, holding its KV slot."""
    backend = LocalBackend(max_model_len=CONTEXT, step_delay_s=0.05)  # 120 tokens take seconds
    app = build_api(backend)
    body = json.dumps({"model": MODEL, "prompt": [3, 4], "max_tokens": 120, "ignore_eos": True})
    receive = _body_then(body, lambda: {"type": "http.disconnect"})  # a few steps run first

    async def send(message: dict[str, Any]) -> None:
        return None

    before = requests_by_status(backend)
    try:
        asyncio.run(app(_completions_scope(), receive, send))  # type: ignore[arg-type]
        after = requests_by_status(backend)
        assert after.get("aborted", 0) == before.get("aborted", 0) + 1
        assert after.get("ok", 0) == before.get("ok", 0)  # not run to its end
        deadline = time.monotonic() + 10  # the lane thread takes the abort at its next step
        while backend.lane.in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        backend.stop()


class _FailingLoop:
    """A step loop whose every step raises ``error`` (after ``delay_s``)."""

    def __init__(self, error: BaseException, delay_s: float = 0.0) -> None:
        self.error, self.delay_s = error, delay_s
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.tokenizer = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def add_request(self, request: Request, grammar: object = None) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str, *, remember: bool = True) -> None:
        self.waiting = [r for r in self.waiting if r.request_id != request_id]

    def step(self, only: frozenset[int] | None = None) -> list[RequestOutput]:
        time.sleep(self.delay_s)
        raise self.error


async def _fails_with_503(lane: Lane) -> None:
    stream = await lane.submit(Request("r", [1, 2], SamplingParams()))
    with pytest.raises(WorkerFailedError):
        async for _ in stream:
            pass


def test_queue_gauge_is_refreshed_after_a_failed_step() -> None:
    metrics = ServeMetrics()
    failing = _FailingLoop(RuntimeError("a step that fails"), delay_s=0.05)  # the gauge reads 1 waiting before it
    lane = Lane(0, failing, {}, None, None, metrics=metrics, max_worker_restarts=0)  # type: ignore[arg-type]

    try:
        asyncio.run(_fails_with_503(lane))
        gauge = metrics.queue_depth.labels("0")
        deadline = time.monotonic() + 5
        while gauge._value.get() != 0:
            assert time.monotonic() < deadline, "queue_depth still counts the dropped request"
            time.sleep(0.02)
    finally:
        lane.stop()


def test_a_lane_thread_ended_by_a_base_exception_answers_its_admitted_requests() -> None:
    """Only an Exception failed a lane's requests: a SystemExit (or KeyboardInterrupt) in the lane thread ended it
    with the admitted requests' streams waiting for ever."""
    exiting = _FailingLoop(SystemExit("the interpreter is going down"))
    lane = Lane(0, exiting, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=0)  # type: ignore[arg-type]

    try:
        asyncio.run(asyncio.wait_for(_fails_with_503(lane), 10))
        assert not lane.alive
    finally:
        lane.stop()


def test_every_503_carries_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane that lost its workers for good (a 503 worker_failed) and a failing /health tell the client when to
    come back, as a 429 does: the configured seconds, from a deployment's worker_retry_s (when a lost lane tries
    again)."""
    backend = LocalBackend(max_model_len=CONTEXT)
    backend.lane.stop()
    gone = _FailingLoop(RuntimeError("a worker that is gone"))
    backend.lane = Lane(0, gone, {}, None, None, metrics=backend.metrics, max_worker_restarts=0)  # type: ignore[arg-type]
    failing = Health(status=HealthStatus.failing, lanes=1, lanes_alive=0)
    monkeypatch.setattr(backend, "health", lambda: failing)
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}
    try:
        for options, seconds in (({}, "5"), ({"unavailable_retry_after_s": 7}, "7")):
            with api_server(backend, **options) as url:
                r = httpx.post(url + COMPLETIONS, json=body, timeout=30)
                assert _error(r, 503)["code"] == "worker_failed" and r.headers["retry-after"] == seconds
                r = httpx.get(url + "/health", timeout=30)
                assert r.status_code == 503 and r.headers["retry-after"] == seconds
    finally:
        backend.stop()
    assert AppArgs(tiny=TinyModels(), worker_retry_s=2.5).http_options(environ={}).unavailable_retry_after_s == 3


def test_a_developer_message_is_the_system_prompt_and_tool_messages_carry_their_call_id(url: str) -> None:
    """OpenAI's newer models take instructions as `developer` messages: the chat template gets them as its system
    turn (the same prompt as a `system` message). A tool message carries the `tool_call_id` OpenAI requires."""

    def prompt_tokens(messages: list[dict[str, str]]) -> int:
        r = httpx.post(url + CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    as_system = prompt_tokens([{"role": "system", "content": "Answer in French."}, *USER])
    assert prompt_tokens([{"role": "developer", "content": "Answer in French."}, *USER]) == as_system
    tool = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    asked = [*USER, {"role": "assistant", "content": "calling"}]
    assert prompt_tokens([*asked, tool]) > prompt_tokens(asked)  # the tool's answer is in the prompt


def test_a_chat_continues_its_last_message_or_leaves_the_assistants_turn_unopened(url: str) -> None:
    """vLLM's continue_final_message (a prefill: the answer continues the assistant's message as given) and
    add_generation_prompt: each answer is the completion of the prompt the tiny template renders, written here."""
    tokenizer = tiny_tokenizer()
    prefill = [{"role": "user", "content": "the tea"}, {"role": "assistant", "content": "is hot and"}]
    for fields, rendered in (
        ({"add_generation_prompt": False, "continue_final_message": True}, "<|user|>the tea\n<|assistant|>is hot and"),
        ({"add_generation_prompt": False}, "<|user|>the tea\n<|assistant|>is hot and\n"),
        ({}, "<|user|>the tea\n<|assistant|>is hot and\n<|assistant|>"),
    ):
        body = {"model": MODEL, "messages": prefill, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        chat = httpx.post(url + CHAT, json=body | fields, timeout=30)
        assert chat.status_code == 200, chat.text
        ids = tokenizer.encode(rendered)
        plain = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        completion = httpx.post(url + COMPLETIONS, json=plain, timeout=30).json()
        assert chat.json()["usage"]["prompt_tokens"] == len(ids), (fields, chat.json()["usage"])
        assert chat.json()["choices"][0]["message"]["content"] == completion["choices"][0]["text"], fields
    both = {"model": MODEL, "messages": prefill, "continue_final_message": True}
    error = _error(httpx.post(url + CHAT, json=both, timeout=30))
    assert error["param"] == "continue_final_message" and "set add_generation_prompt to false" in error["message"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(url: str) -> None:
    """vLLM's truncate_prompt_tokens: the answer, usage and echo are those of a prompt of the last k tokens, written
    here; a text too long for the context before tokenisation is not refused where its kept tokens fit."""
    tokenizer = tiny_tokenizer()
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    def answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(url + path, json=base | body, timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json())

    ids, text = list(range(5, 45)), "the tea is hot " * 100  # (1500 characters: at least 300 tokens, over CONTEXT)
    for prompt, kept in ((ids, ids[-10:]), (text, tokenizer.encode(text)[-10:])):
        cut = answer(COMPLETIONS, {"prompt": prompt, "truncate_prompt_tokens": 10, "echo": True})
        whole = answer(COMPLETIONS, {"prompt": kept})
        assert cut["usage"]["prompt_tokens"] == 10
        assert cut["choices"][0]["text"] == tokenizer.decode(kept) + whole["choices"][0]["text"]
    assert _error(httpx.post(url + COMPLETIONS, json=base | {"prompt": text}))["code"] == "context_length_exceeded"
    short = answer(COMPLETIONS, {"prompt": ids, "truncate_prompt_tokens": -1})  # (the context: all of these)
    assert short["usage"]["prompt_tokens"] == len(ids)
    long = httpx.post(url + COMPLETIONS, json=base | {"prompt": [5] * 300, "truncate_prompt_tokens": -1})
    assert _error(long)["code"] == "context_length_exceeded"  # 128 kept leave no room for 4
    chat = answer(CHAT, {"messages": USER, "truncate_prompt_tokens": 3})
    rendered = tokenizer.encode("<|user|>hi\n<|assistant|>")
    assert chat["usage"]["prompt_tokens"] == 3 < len(rendered)
    plain = answer(COMPLETIONS, {"prompt": rendered[-3:]})
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    for value, says in (
        (CONTEXT + 1, "more than this model's context length (128)"),
        (0, "at least 1"),
        (-2, "greater than or equal to -1"),
    ):
        error = _error(httpx.post(url + COMPLETIONS, json=base | {"prompt": ids, "truncate_prompt_tokens": value}))
        assert error["param"] == "truncate_prompt_tokens" and says in error["message"], error


def test_the_suffix_cache_is_partitioned_by_cache_salt() -> None:
    """A repeat drafts from the replica's cache of recent outputs only under the salt its first answer was kept
    under: another salt (or none) gets the drafts of its own tokens alone, as the first answer did, and every
    answer is the same greedy one. A salt that is not a non-empty string is a 400 naming it."""
    suffix = {"drafter": "suffix", "method": "ddd", "model_fallback": False, "policy": "static"}
    backend = LocalBackend(max_model_len=CONTEXT)
    try:
        with api_server(backend) as url:

            def run(**salt: Any) -> tuple[list[int], int]:
                body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                body |= {"return_token_ids": True, "speculation": suffix, **salt}
                r = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30)
                assert r.status_code == 200, r.text
                out = r.json()
                return out["choices"][0]["token_ids"], out["usage"]["speculation"]["accepted"]

            ids, first = run(cache_salt="tenant-a")
            for other in ({"cache_salt": "tenant-b"}, {}):
                assert run(**other) == (ids, first), other
            for same in ({"cache_salt": "tenant-a"}, {"cache_salt": None}):  # null: no salt, as the request before
                again, accepted = run(**same)
                assert again == ids and accepted >= 12 and accepted > first, same
            for bad in ("", 7, ["a"], "x" * 257):
                body = {"model": MODEL, "prompt": "hi", "cache_salt": bad}
                error = _error(httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30))
                assert error["param"] == "cache_salt", (bad, error)
    finally:
        backend.stop()


class _CutShort(LocalBackend):
    """A backend whose streams end after one unfinished output (a backend bug, not a client's doing)."""

    async def submit(self, request: Request) -> Any:
        stream = await super().submit(request)

        class Cut:
            def __aiter__(self) -> AsyncIterator[RequestOutput]:
                return self._outputs()

            async def _outputs(self) -> AsyncIterator[RequestOutput]:
                async for out in stream:
                    if not out.finished:
                        yield out
                        return

            async def aclose(self) -> None:
                await stream.aclose()

        return Cut()


class _SplitCharacterFirst(LocalBackend):
    """A backend whose streams' first token has no text yet (a character's first byte) and whose next output, with
    that text, comes half a second later."""

    async def submit(self, request: Request) -> Any:
        stream = await super().submit(request)

        class Held:
            def __aiter__(self) -> AsyncIterator[RequestOutput]:
                return self._outputs()

            async def _outputs(self) -> AsyncIterator[RequestOutput]:
                held: str | None = None
                async for out in stream:
                    if held is None:
                        held = out.text
                        yield replace(out, text="")
                        await asyncio.sleep(0.5)
                    else:
                        yield replace(out, text=held + out.text)
                        held = ""

            async def aclose(self) -> None:
                await stream.aclose()

        return Held()


def test_a_streams_first_token_latency_is_of_the_first_chunk_sent() -> None:
    """A first token whose text is held back (no chunk goes out for it) was counted sent: the TTFT histogram took
    its step (~ms) for the client's first token, half a second later, and TPOT took the wait instead."""
    backend = _SplitCharacterFirst(max_model_len=256, max_batch_size=2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True}
    try:
        with api_server(backend) as url:
            before = _sample(backend, "specserve_time_to_first_token_seconds_sum")
            with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: {")]
            assert r.status_code == 200 and len(lines) >= 2  # (the rest may come in one chunk, after the wait)
            assert _sample(backend, "specserve_time_to_first_token_seconds_sum") - before >= 0.45
    finally:
        backend.stop()


class _FailsMidway(LocalBackend):
    """A backend whose streams raise ``error`` after their first output."""

    error: Exception = RuntimeError("unset")

    async def submit(self, request: Request) -> Any:
        stream, error = await super().submit(request), self.error

        class Failing:
            def __aiter__(self) -> AsyncIterator[RequestOutput]:
                return self._outputs()

            async def _outputs(self) -> AsyncIterator[RequestOutput]:
                async for out in stream:
                    yield out
                    raise error

            async def aclose(self) -> None:
                await stream.aclose()

        return Failing()


@pytest.mark.parametrize(
    ("error", "status", "type_", "counted"),
    [
        # valid when it came: found as it ran (on another lane), the server's failure, not a 400
        (InvalidRequestError("the output already reaches max_tokens"), 500, "server_error", "failed"),
        (OverloadedError("no lane takes it", retry_after_s=3), 429, "rate_limit_error", "rejected"),
        (WorkerFailedError("no lane of this replica is running"), 503, "service_unavailable_error", "failed"),
        (RuntimeError("a bug"), 500, "server_error", "failed"),
    ],
)
def test_an_error_after_the_first_output_is_answered_and_counted_alike_streaming_or_not(
    error: Exception, status: int, type_: str, counted: str
) -> None:
    """A non-streaming request counted every error after its first output as failed (a 429 included), and
    answered a request error found as it ran with a 400 where a stream sent a 500's body."""
    backend = _FailsMidway(max_model_len=CONTEXT)
    backend.error = error
    try:
        with api_server(backend) as url:
            body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 20, "ignore_eos": True}
            answer = httpx.post(url + COMPLETIONS, json=body, timeout=30)
            with httpx.stream("POST", url + COMPLETIONS, json=body | {"stream": True}, timeout=30) as r:
                data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            counts = requests_by_status(backend)
    finally:
        backend.stop()
    assert answer.status_code == status and answer.json()["error"]["type"] == type_, answer.text
    assert r.status_code == 200 and json.loads(data[-1])["error"]["type"] == type_, data
    assert counts == {counted: 2.0}, counts


def test_a_stream_that_raises_cancelled_error_itself_ends_the_read_not_an_endless_wait() -> None:
    """The stream is read by a task: one ended by a CancelledError of the stream's own left the reader waiting
    for ever (a keep-alive every 15 s, the request never closed nor counted)."""
    from specserve.api.server import _Outcome, _Tracker

    class Cancelled:
        def __aiter__(self) -> AsyncIterator[RequestOutput]:
            return self._outputs()

        async def _outputs(self) -> AsyncIterator[RequestOutput]:
            yield RequestOutput("r", [7], "a", None, 1, 1, RequestStats())
            raise asyncio.CancelledError  # (a future it awaited, cancelled by other code)

        async def aclose(self) -> None:
            pass

    async def trial() -> None:
        outcome = _Outcome(Cancelled(), ServeMetrics(), _Tracker())  # type: ignore[arg-type]
        assert (await outcome.next_output(within=0.5)) is not None
        with pytest.raises(asyncio.CancelledError):
            await outcome.next_output(within=0.5)

    asyncio.run(asyncio.wait_for(trial(), 10))


def test_a_client_leaving_a_stream_aborts_it_even_where_closing_it_awaits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server cancels a response whose client left at every turn of the loop: a stream whose close awaits
    anything was cut there, and the request generated on, never aborted nor counted."""
    import deployments.lane as lane_module

    close = lane_module.LaneStream.aclose
    closed: list[str] = []

    async def awaiting_close(self: Any) -> None:
        await asyncio.sleep(0)  # (an RPC to abort, a lock)
        await close(self)
        closed.append(self._request_id)

    monkeypatch.setattr(lane_module.LaneStream, "aclose", awaiting_close)
    backend = LocalBackend(max_model_len=CONTEXT, step_delay_s=0.3)
    try:
        with api_server(backend) as url:
            body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 60, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=30) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))
            deadline = time.monotonic() + 10
            while not closed and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(closed) == 1 and requests_by_status(backend) == {"aborted": 1.0}
    finally:
        backend.stop()


def test_a_stream_that_ends_before_its_request_finished_is_an_error_event_not_a_silent_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The non-streaming answer was a 500; the stream used to end with neither an error event nor ``[DONE]``, so
    a client read a cut answer as a whole one. Both failures are logged with the request's id (the non-streaming
    one was left to the ASGI server's anonymous traceback)."""
    backend = _CutShort(max_model_len=CONTEXT)
    try:
        with api_server(backend) as url:
            body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 20, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=30) as r:
                data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            assert data[-1] != "[DONE]"
            assert json.loads(data[-1])["error"]["type"] == "server_error"
            with caplog.at_level(logging.ERROR, logger="specserve.api.server"):
                assert httpx.post(url + COMPLETIONS, json=body | {"stream": False}, timeout=30).status_code == 500
    finally:
        backend.stop()
    failed = [r for r in caplog.records if r.name == "specserve.api.server" and r.levelno == logging.ERROR]
    assert [r.getMessage().split()[0::2] for r in failed] == [["request", "failed"]] * 2  # the stream's, the 500's
    assert all(r.getMessage().split()[1].startswith("cmpl-") and r.exc_info for r in failed)


def test_a_non_streaming_500_is_logged_once() -> None:
    """The route logged the failure under the request's id and raised it on to the 500 handler, whose middleware
    raises it again for the ASGI server to log: two tracebacks for one failure, one of them with no request id."""
    tracebacks: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info:
                tracebacks.append(record)

    keep, loggers = Keep(logging.ERROR), [logging.getLogger(name) for name in ("uvicorn.error", "specserve.api.server")]
    backend = _CutShort(max_model_len=CONTEXT)
    try:
        with api_server(backend) as url:
            for logger in loggers:  # (once uvicorn has configured its loggers, which drops their handlers)
                logger.addHandler(keep)
            body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 20, "ignore_eos": True}
            r = httpx.post(url + COMPLETIONS, json=body, timeout=30)
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
            assert requests_by_status(backend).get("failed") == 1
    finally:
        backend.stop()
        for logger in loggers:
            logger.removeHandler(keep)
    assert [r.getMessage().split()[0::2] for r in tracebacks] == [["request", "failed"]], tracebacks


def test_every_chunk_of_a_stream_carries_the_streams_created_time() -> None:
    """OpenAI's chunks of one completion share ``created``; each chunk read the clock afresh, so a stream longer
    than a second changed it midway. The stream here spans more than a second."""
    backend = LocalBackend(max_model_len=CONTEXT, step_delay_s=0.25)
    try:
        with api_server(backend) as url, httpx.Client(timeout=60) as http:
            for path, body in ((COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": USER})):
                request = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
                request |= {"stream_options": {"include_usage": True}, **body}
                created, arrived = [], []
                with http.stream("POST", url + path, json=request) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            created.append(json.loads(line.removeprefix("data: "))["created"])
                            arrived.append(time.time())
                assert len(created) >= 3 and arrived[-1] - arrived[0] > 1.0  # at least one second boundary crossed
                assert len(set(created)) == 1 and abs(created[0] - arrived[0]) <= 2, (path, created)
    finally:
        backend.stop()


def test_openais_other_forms_of_a_request_read_as_they_mean_or_are_refused_by_name(
    url: str, backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forms OpenAI's API takes that were refused as malformed (a one-prompt batch, SDKs' nulls for unset fields),
    and ones it refuses that were served (an empty content array, an assistant turn with no content, a tool answer
    without its call id); a chat message's name reaches the chat template instead of being dropped."""

    def post(path: str, **fields: Any) -> httpx.Response:  # (json.dumps escapes a lone surrogate; httpx cannot)
        body = json.dumps({"model": MODEL, "max_tokens": 3, "temperature": 0, **fields})
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)

    def tokens(r: httpx.Response) -> list[int]:
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    ids = dict(return_token_ids=True, ignore_eos=True)
    assert tokens(post(COMPLETIONS, prompt=["hello"], **ids)) == tokens(post(COMPLETIONS, prompt="hello", **ids))
    assert tokens(post(COMPLETIONS, prompt=[[5, 6, 7]], **ids)) == tokens(post(COMPLETIONS, prompt=[5, 6, 7], **ids))
    for batch in (["a", "b"], [[5], [6]]):  # (OpenAI's batch: tests/test_api_choices.py)
        answer = post(COMPLETIONS, prompt=batch, **ids)
        assert answer.status_code == 200 and [c["index"] for c in answer.json()["choices"]] == [0, 1], answer.text
    for unset in ({"echo": None}, {"logit_bias": None}, {"logit_bias": {}}, {"metadata": {"run": "a"}}):
        assert post(COMPLETIONS, prompt="hi", **unset).status_code == 200, unset
    for no_op in ({"echo": False}, {"best_of": 1}, {"best_of": None}, {"suffix": None}):
        assert post(COMPLETIONS, prompt="hi", **no_op).status_code == 200, no_op
    for field, value in (("best_of", 2), ("suffix", "and so on")):
        error = _error(post(COMPLETIONS, prompt="hi", **{field: value}))
        assert error["param"] == field and f"{field} " in error["message"] and "not supported" in error["message"]
    assert _error(post(COMPLETIONS, prompt="hi", stream_options={"include_usage": True}))["param"] == "stream_options"
    bad_stream = _error(post(COMPLETIONS, prompt="hi", stream="yes", stream_options={"include_usage": True}))
    assert bad_stream["param"] == "stream" and "stream_options" not in bad_stream["message"]  # its own error alone
    assert _error(post(CHAT, messages=USER, echo=None))["param"] == "echo"  # completions' field: unknown in chat
    for messages, says in (
        ([{"role": "user", "content": []}], "List should have at least 1 item"),
        ([*USER, {"role": "assistant"}], "an assistant message needs its content"),
        ([*USER, {"role": "tool", "content": "42"}], "a tool message needs the tool_call_id it answers"),
        ([{"role": "user", "content": "hi", "name": "\ud800"}], "not valid Unicode"),
    ):
        error = _error(post(CHAT, messages=messages))
        assert error["param"] == "messages" and says in error["message"], error
    seen: list[list[dict[str, str]]] = []
    chat = backend.encoder.chat
    monkeypatch.setattr(backend.encoder, "chat", lambda messages, **kw: seen.append(messages) or chat(messages, **kw))
    named = [{"role": "user", "content": "hi", "name": "bob"}, {"role": "tool", "content": "4", "tool_call_id": "c"}]
    assert post(CHAT, messages=named).status_code == 200
    assert seen == [
        [{"role": "user", "content": "hi", "name": "bob"}, {"role": "tool", "content": "4", "tool_call_id": "c"}]
    ]


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        (COMPLETIONS, b'{"prompt": "x", "\\ud800": 1}', None, "a key '\\ud800'"),
        (COMPLETIONS, b'{"prompt": "x", "metadata": {"\\ud800": ""}}', "metadata", "metadata: a key '\\ud800'"),
        (COMPLETIONS, b'{"prompt": "x", "stop": "\\ud800"}', "stop", "stop: the text '\\ud800'"),
        (COMPLETIONS, b'{"prompt": "x", "stop": ["a", "b\\ud800"]}', "stop", "stop.1: the text 'b\\ud800'"),
        (COMPLETIONS, b'{"prompt": "x", "metadata": {"body": "\\ud800"}}', "metadata", "metadata.body: the text"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x", "\\ud800": 1}]}', "messages", "messages.0: a key"),
        (CHAT, b'{"messages": [{"role": "\\ud800", "content": "x"}]}', "messages", "messages.0.role: the text"),
    ],
    ids=["top-level-key", "metadata-key", "stop", "stop-list", "metadata-body", "message-key", "role"],
)
def test_a_lone_surrogate_is_named_as_a_key_or_as_a_text(
    url: str, path: str, body: bytes, param: str | None, says: str
) -> None:
    """pydantic reports an unknown key at its object's location and a text at its own: the 400 says which it was."""
    content = b'{"model": "' + MODEL.encode() + b'", ' + body[1:]
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    error = _error(r)
    assert error["param"] == param and says in error["message"], error
    assert "is not valid Unicode (a lone surrogate)" in error["message"] and "\ufffd" not in error["message"]
