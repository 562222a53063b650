"""Hostile and odd request bodies over real HTTP: every answer is a 200 that completes or a 4xx with OpenAI's error
body that names the field in the request's own terms; none is a 5xx, a hang, or a stream cut without [DONE]; and
the server serves ordinary requests afterwards with nothing left in its batch."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from specserve.api.schemas import INT64_END, MAX_CONTENT_PARTS, MAX_MESSAGES
from tests.api_backend import MODEL, LocalBackend, api_server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOKENIZE = ("/tokenize", "/detokenize")
CONTEXT = 128
VOCAB = 512  # the tiny model's
# what a message may not show a user: pydantic's names for a union's members, function reprs, memory addresses
INTERNALS = re.compile(r"function-after|function-plain|constrained-|list\[|<string>|<list>|0x[0-9a-f]{6,}|Tag|tagged")
HUGE = int("9" * 4300)  # the longest integer Python's JSON parser takes (one digit more is a parse error)
JUNK: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, HUGE, 1e308, float("nan"), float("inf"),
    -0.0, 1e-320, "", " ", "\x00", "\ud800", "<|im_end|>", "a" * 3000, "é", [], [1], ["a"], {}, {"a": 1}, [None], [[]],
]  # fmt: skip


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    backend = LocalBackend(max_model_len=CONTEXT)
    with api_server(backend) as url:
        yield url
    assert not backend.engine.loop.running and not backend.engine.loop.waiting, "requests left in the batch"
    backend.stop()


class Bodies:
    """Mostly valid requests of every shape the API accepts, a third with one or two fields replaced by junk."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def text(self) -> str:
        return self.r.choice(
            ["hi", "How are you?", "", " ", "\x00\x01", "<|im_end|>", "<|im_start|>user\nx<|im_end|>", "é€😀",
             "a" * self.r.choice([1, 50, 400, 2000]), "\n" * 20, "\ud83d", '{"x": 1}', "the end."]
        )  # fmt: skip

    def pick(self, options: dict[str, Callable[[], Any]], p: float) -> dict[str, Any]:
        return {k: make() for k, make in options.items() if self.r.random() < p}

    def common(self) -> dict[str, Any]:
        r = self.r
        speculation = {
            "enabled": lambda: r.choice([True, False]),
            "method": lambda: r.choice(["chain", "eagle2", "ddd", "none"]),
            "drafter": lambda: r.choice(["model", "lookup", "suffix"]),
            "model_fallback": lambda: r.choice([True, False]),
            "policy": lambda: r.choice(["static", "dsde", "none"]),
            "max_sl": lambda: r.choice([1, 2, 8, 64]),
        }
        fields = {
            "max_tokens": lambda: r.choice([1, 2, 8, 30, CONTEXT - 1, CONTEXT, 200]),
            "temperature": lambda: r.choice([0, 0.0, 0.3, 1, 2, 1e-30]),
            "top_p": lambda: r.choice([1, 0.95, 0.1, 1e-30]),
            "top_k": lambda: r.choice([1, 5, VOCAB - 1, VOCAB, VOCAB + 1, 10**9]),
            "seed": lambda: r.choice([0, 1, -1, 2**63 - 1, -(2**63)]),
            "stop": lambda: r.choice([self.text() or "x", [self.text() or "x" for _ in range(r.randint(1, 4))]]),
            "stream": lambda: r.choice([True, False]),
            "user": self.text,
            "ignore_eos": lambda: r.choice([True, False]),
            "return_token_ids": lambda: r.choice([True, False]),
            "speculation": lambda: self.pick(speculation, 0.4),
            "n": lambda: r.choice([1, 2, 3]),
            "logprobs": lambda: r.choice([False, None, 0, 3, True]),  # (a count in completions, a flag in chat)
            "top_logprobs": lambda: r.choice([0, 2, None]),  # (chat's: in completions an unknown field)
            "logit_bias": lambda: r.choice([{}, {"3": 5}, {"7": -100, "9": 100}, {str(VOCAB): 1}]),
            "truncate_prompt_tokens": lambda: r.choice([-1, 1, 5, CONTEXT - 1, CONTEXT, CONTEXT + 1]),
        }  # fmt: skip
        body = self.pick(fields, 0.35)
        if body.get("stream") and r.random() < 0.5:
            body["stream_options"] = {"include_usage": r.choice([True, False])}
        return body

    def message(self) -> dict[str, Any]:
        r = self.r
        message: dict[str, Any] = {"role": r.choice(["system", "developer", "user", "assistant", "tool", "user"])}
        kind = r.random()
        if kind < 0.7:
            message["content"] = self.text()
        elif kind < 0.85:
            message["content"] = [{"type": "text", "text": self.text()} for _ in range(r.randint(0, 3))]
        elif kind < 0.9:
            message["content"] = None
        arguments = r.choice(["{}", '{"a": 1}', "x"])
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return message | self.pick({"name": self.text, "tool_call_id": self.text, "tool_calls": lambda: [call]}, 0.1)

    def tools(self) -> dict[str, Any]:
        """OpenAI's tools and tool_choice (held calls, the 'auto' default refused, unknown names, a format beside)."""
        r = self.r
        schema = r.choice([None, {}, {"type": "object", "properties": {"a": {"enum": [1, 2]}}}, {"type": "foo"}])
        tool = {"type": "function", "function": {"name": r.choice(["f", "g"])} | ({} if schema is None else {
            "parameters": schema})}  # fmt: skip
        named = {"type": "function", "function": {"name": r.choice(["f", "g", "h"])}}
        options = {
            "tool_choice": lambda: r.choice(["none", "auto", "required", named, None]),
            "parallel_tool_calls": lambda: r.choice([True, False, None]),
            "response_format": lambda: {"type": "json_object"},
        }
        return {"tools": r.choice([[tool], [tool, tool], []])} | self.pick(options, 0.5)

    def chat_options(self) -> dict[str, Any]:
        flags = {"add_generation_prompt": lambda: self.r.choice([True, False]), "continue_final_message": lambda: True}
        return self.pick(flags, 0.1)

    def tokenize(self) -> tuple[str, dict[str, Any]]:
        r = self.r
        if r.random() < 0.3:
            return TOKENIZE[1], {"tokens": [r.randrange(VOCAB + 2) - 1 for _ in range(r.randint(0, 40))]}
        if r.random() < 0.5:
            body = {"messages": [self.message() for _ in range(r.randint(1, 3))]} | self.chat_options()
        else:
            body = {"prompt": self.text()} | self.pick({"add_special_tokens": lambda: r.choice([True, False])}, 0.3)
        return TOKENIZE[0], body | self.pick(
            {"model": lambda: r.choice([MODEL, "x"]), "return_token_strs": lambda: True}, 0.3
        )

    def __call__(self) -> tuple[str, dict[str, Any]]:
        r = self.r
        if r.random() < 0.15:
            return self.tokenize()
        if r.random() < 0.5:
            path, body = CHAT, {"model": MODEL, "messages": [self.message() for _ in range(r.randint(1, 4))]}
            body |= self.pick({"max_completion_tokens": lambda: r.choice([1, 5, 100])}, 0.1) | self.chat_options()
            if r.random() < 0.2:
                body |= self.tools()
        else:
            ids = [r.randrange(VOCAB) for _ in range(r.randint(1, CONTEXT + 2))]
            batch = [self.text() or "x" for _ in range(r.randint(1, 3))]  # (OpenAI's batch of prompts)
            prompt = r.choice([self.text() or "x", ids, batch])
            path, body = COMPLETIONS, {"model": MODEL, "prompt": prompt}
        body |= self.common()
        if r.random() < 0.3:
            for _ in range(r.randint(1, 2)):
                body[r.choice([*body, "resume_from", "echo", "best_of", "suffix", "store", "unknown"])] = r.choice(JUNK)
        return path, body


def _check(path: str, body: dict[str, Any], status: int, content_type: str, raw: bytes) -> None:
    where = f"{path} {json.dumps(body)[:300]}"
    assert status < 500, f"{status} for {where}: {raw[:300]!r}"
    if status >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], where
        assert not INTERNALS.search(error["message"]), f"{error['message']!r} for {where}"
    elif content_type.startswith("text/event-stream"):
        text = raw.decode()
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, f"{where}: {text[-300:]}"
    elif path in TOKENIZE:
        answer = json.loads(raw)
        assert answer["count"] == len(answer["tokens"]) if path == TOKENIZE[0] else isinstance(answer["prompt"], str)
    else:
        assert json.loads(raw)["choices"], where


def test_random_bodies_never_fail_the_server(url: str) -> None:
    bodies, statuses = Bodies(seed=0), set()
    with httpx.Client(base_url=url, timeout=60, headers={"content-type": "application/json"}) as client:
        for _ in range(300):
            path, body = bodies()
            with client.stream("POST", path, content=json.dumps(body, allow_nan=True)) as r:
                raw = b"".join(r.iter_bytes())
            _check(path, body, r.status_code, r.headers.get("content-type", ""), raw)
            statuses.add(r.status_code)
        # still serving; ignore_eos: a sampled answer of the tiny model may end early
        r = client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert {200, 400, 404} <= statuses  # the bodies reach generation as well as validation


@pytest.mark.parametrize(
    ("path", "fields", "param", "message"),
    [
        (COMPLETIONS, {"prompt": 5}, "prompt",
         "prompt: Input should be text, a list of token ids, or a list of either"),
        (COMPLETIONS, {"prompt": ["a", ""]}, "prompt", "prompt.1: String should have at least 1 character"),
        (COMPLETIONS, {"prompt": [[3], [-1]]}, "prompt", "prompt.1.0: Input should be greater than or equal to 0"),
        (COMPLETIONS, {"prompt": [[3], []]}, "prompt",
         "prompt.1: List should have at least 1 item after validation, not 0"),
        (COMPLETIONS, {"prompt": ["a", [3]]}, "prompt", "prompt.1: Input should be a valid string"),
        (COMPLETIONS, {"prompt": ""}, "prompt", "prompt: String should have at least 1 character"),
        (COMPLETIONS, {"prompt": [3, -1]}, "prompt", "prompt.1: Input should be greater than or equal to 0"),
        (COMPLETIONS, {"prompt": [3, VOCAB]}, "prompt", f"prompt token ids must be in [0, {VOCAB})"),
        (COMPLETIONS, {"prompt": "hi", "stop": 3}, "stop",
         "stop: Input should be a string or a list of up to 4 strings"),
        (COMPLETIONS, {"prompt": "hi", "stop": ["x", ""]}, "stop", "stop.1: String should have at least 1 character"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages",
         "messages.0.content: Input should be a string or a list of text parts"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages",
         "messages.0.content.0.text: Input should be a valid string"),
        (CHAT, {"messages": [{"role": "user"}]}, "messages",
         "messages.0: Value error, a user message needs its content"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages", "messages.0.content.1: Value error, content parts of type 'image_url' are not supported: this "
         "server reads text parts"),
        (CHAT, {"messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)}, "messages",
         f"messages: Value error, at most {MAX_MESSAGES} messages, got {MAX_MESSAGES + 1}"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}]},
         "messages", f"messages: Value error, at most {MAX_CONTENT_PARTS} content parts in all messages together, "
         f"got {MAX_CONTENT_PARTS + 1}"),
        # parts under the bound in every message, over it together: validating 160k parts held the event loop 0.6 s
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 3000}] * 2}, "messages",
         f"messages: Value error, at most {MAX_CONTENT_PARTS} content parts in all messages together, got 6000"),
        (CHAT, {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, "messages",
         "messages.0: Value error, a system message needs its content"),
    ],
)  # fmt: skip
def test_a_string_or_list_field_reports_the_member_its_json_type_chose(
    url: str, path: str, fields: dict[str, Any], param: str, message: str
) -> None:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == message and r.json()["error"]["param"] == param


def test_a_flood_of_unknown_fields_is_one_error(url: str) -> None:
    """An error per unknown key, built on the event loop: a body of 380k of them held every stream of the replica
    for seconds. Past a few, one error names the first ones; a few still get an error each."""
    flood = {f"k{i}": 0 for i in range(50_000)}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body, param in [
        (COMPLETIONS, {"prompt": "hi", **flood}, None),
        (COMPLETIONS, {"prompt": "hi", "speculation": flood}, "speculation"),
        (CHAT, {**chat, "stream": True, "stream_options": flood}, "stream_options"),
        (CHAT, {"messages": [{"role": "user", "content": "hi", **flood}]}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", **flood}]}]}, "messages"),
    ]:
        r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"].endswith("50000 unknown fields ('k0', 'k1', 'k2', ...)")
    r = httpx.post(f"{url}{COMPLETIONS}", json={"model": MODEL, "prompt": "hi", "a": 0, "b": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "a: Extra inputs are not permitted; b: Extra inputs are not permitted"
    )
    nine = {f"k{i}": 0 for i in range(9)}  # one past the limit, far fewer keys than the request's own fields
    r = httpx.post(f"{url}{COMPLETIONS}", json={"model": MODEL, "prompt": "hi", **nine}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("9 unknown fields ('k0', 'k1', 'k2', ...)")
    # a field the body names by its alias (``schema``, ``json``) is no unknown one: it led the list, counted in it
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, **nine}}
    r = httpx.post(f"{url}{COMPLETIONS}", json={"model": MODEL, "prompt": "hi", "response_format": schema}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("9 unknown fields ('k0', 'k1', 'k2', ...)")
    eight = {f"k{i}": 0 for i in range(8)}  # as many as the limit: an error each
    r = httpx.post(
        f"{url}{COMPLETIONS}", json={"model": MODEL, "prompt": "hi", "structured_outputs": {"json": {}, **eight}}
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("structured_outputs.k0: Extra inputs are not permitted"), r.text


@pytest.mark.parametrize(
    ("path", "fields", "param", "message"),
    [
        (COMPLETIONS, {"prompt": "hi", "max_tokens": HUGE}, "max_tokens", f"less than {INT64_END}"),
        (CHAT, {"max_completion_tokens": HUGE}, "max_completion_tokens", f"less than {INT64_END}"),
        (COMPLETIONS, {"prompt": "hi", "top_k": HUGE}, "top_k", f"less than {INT64_END}"),
        (COMPLETIONS, {"prompt": [HUGE]}, "prompt", f"less than {INT64_END}"),
        (COMPLETIONS, {"prompt": "hi", "echo": 0}, "echo", "Input should be a valid boolean"),
        (COMPLETIONS, {"prompt": "hi", "best_of": True}, "best_of", "must be a JSON integer"),
        (COMPLETIONS, {"prompt": "hi", "best_of": 1.0}, "best_of", "must be a JSON integer"),
        (CHAT, {"store": 0}, "store", "must be a JSON boolean"),
    ],
)
def test_huge_integers_and_loosely_typed_no_ops_are_400(
    url: str, path: str, fields: dict[str, Any], param: str, message: str
) -> None:
    """An integer of thousands of digits used to reach an error message it could not be printed in (a 500), and
    the no-op fields took 0 for false and true or 1.0 for 1, unlike what /openapi.json says they accept."""
    body = {"model": MODEL, **({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {}), **fields}
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
