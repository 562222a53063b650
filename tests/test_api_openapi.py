"""/openapi.json matches the server (issue 16 item 8): the statuses and bodies it documents are the ones sent, and a
value the documented request schema allows is accepted while one it forbids is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

from tests.api_backend import MODEL, LocalBackend, api_server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
PROBES: dict[str, list[Any]] = {  # values on both sides of each documented constraint
    "top_p": [0, 1e-3, 0.5, 1, 1.01, None],  # null: the default, as OpenAI SDKs send "unset"
    "temperature": [-0.1, 0, 2, 2.01, "1", True, None],
    "top_k": [-2, -1, 0, 1, 50, "5"],  # -1 and 0: no top-k, as vLLM's clients send it
    "n": [0, 1, 2, True, None],
    "seed": [-(2**63) - 1, -(2**63), 7, 2**63 - 1, 2**63],
    "max_tokens": [0, 1, "2", None],
    "logprobs": [True, 1, 0, 20, 21, -1, "1", False, None],
    "presence_penalty": [0, 0.0, 0.5, -1, None],
    "repetition_penalty": [1, 1.0, 1.2, 0.9, 0, "1", None],
    "min_p": [-0.1, 0, 0.05, 1, 1.01, "0.1", True, None],
    "stop_token_ids": [[], [3], [-1], [True], [1.5], "3", [3] * 1024, [3] * 1025, None],
    "include_stop_str_in_output": [True, False, 1, "true", None],
    "stream": [True, False, "yes", 0, None],
    "stop": ["", "x", ["a", "b"], ["a"] * 5, "y" * 1024, "y" * 1025],
    "prompt": ["", "hello", [], [1, 2], [False], [-1], [1.5], ["a", "b"], ["a", ""], [[1], [2]], [[1], []], ["a", [1]]],
    "echo": [False, True],
    "stream_options": [{"include_usage": True}],
    "cache_salt": ["", "s", "s" * 256, "s" * 257, 5, None],
    "min_tokens": [0, 1, 2, -1, "1", True, 1.5],
    "skip_special_tokens": [True, None, False, 1, "true"],  # (vLLM's, at its default only)
    "spaces_between_special_tokens": [True, None, False, 0],  # (at most max_tokens, 2 here: the schema cannot say so)
    # (ids below the vocabulary, which the schema cannot know: the model decides it)
    "logit_bias": [
        *({}, {"3": 5}, {"3": 100}, {"3": -100}, {"3": 100.5}, {"3": -100.01}, {"3": "5"}, {"3": True}),
        *({"03": 1}, {"0": 1}, {"-1": 1}, {"x": 1}, {"3": 1, "4": -1.5}, [3], None),
    ],
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    backend = LocalBackend()
    with api_server(backend) as url:
        yield url
    backend.stop()


@pytest.fixture(scope="module")
def doc(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/openapi.json")
    assert r.status_code == 200
    return dict(r.json())


def _validator(doc: dict[str, Any], name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


@pytest.mark.parametrize("field", list(PROBES))
def test_documented_request_schema_is_what_the_server_accepts(url: str, doc: dict[str, Any], field: str) -> None:
    body_schema = doc["paths"][COMPLETIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema == {"$ref": "#/components/schemas/CompletionRequest"}
    request = _validator(doc, "CompletionRequest")
    error = _validator(doc, "ErrorResponse")
    for value in PROBES[field]:
        body = {**BASE, field: value}
        if field == "stream_options":
            body["stream"] = True
        r = httpx.post(url + COMPLETIONS, json=body, timeout=30)
        documented = request.is_valid(body)
        assert (r.status_code == 200) == documented, (field, value, r.status_code, r.text[:300])
        if not documented:
            assert r.status_code == 400 and error.is_valid(r.json()), r.text
            assert r.json()["error"]["param"] == field


def test_documented_statuses_are_the_ones_sent(url: str, doc: dict[str, Any]) -> None:
    assert not any("422" in op["responses"] for item in doc["paths"].values() for op in item.values())
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in (COMPLETIONS, CHAT):
        responses = doc["paths"][path]["post"]["responses"]
        for status in ("400", "404", "408", "413", "429"):
            assert responses[status]["content"]["application/json"]["schema"] == error_ref, (path, status)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    model = doc["paths"]["/v1/models/{model}"]["get"]["responses"]
    assert model["404"]["content"]["application/json"]["schema"] == error_ref
    assert "ModelCard" in model["200"]["content"]["application/json"]["schema"]["$ref"]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "application/json" not in metrics and any(t.startswith("text/plain") for t in metrics)
    assert httpx.get(url + "/metrics").headers["content-type"].startswith("text/plain")
    for chunk in ("CompletionChunk", "ChatCompletionChunk"):
        assert chunk in doc["components"]["schemas"]
    # what the server sends for the documented statuses validates against the documented body
    error = _validator(doc, "ErrorResponse")
    sent = [
        httpx.post(url + COMPLETIONS, json={**BASE, "top_p": 0}),
        httpx.post(url + COMPLETIONS, json={**BASE, "model": "nope"}),
        httpx.get(url + "/v1/models/nope"),
        httpx.post(url + COMPLETIONS, content=b"{", headers={"content-type": "application/json"}),
    ]
    assert [r.status_code for r in sent] == [400, 404, 404, 400]
    assert all(error.is_valid(r.json()) for r in sent)
    card = httpx.get(url + f"/v1/models/{MODEL}").json()
    assert _validator(doc, "ModelCard").is_valid(card)


def test_tokenize_and_detokenize_are_documented_as_answered(url: str, doc: dict[str, Any]) -> None:
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, request, response, body in (
        ("/tokenize", "TokenizeRequest", "TokenizeResponse", {"prompt": "hi there", "return_token_strs": True}),
        ("/detokenize", "DetokenizeRequest", "DetokenizeResponse", {"tokens": [5, 6]}),
    ):
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{request}"
        }
        for status in ("400", "404", "408", "413"):
            assert post["responses"][status]["content"]["application/json"]["schema"] == error_ref, (path, status)
        assert _validator(doc, request).is_valid(body)
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 200 and _validator(doc, response).is_valid(r.json()), r.text
        bad = httpx.post(url + path, json={**body, "model": 5}, timeout=30)
        assert bad.status_code == 400 and _validator(doc, "ErrorResponse").is_valid(bad.json())
        assert not _validator(doc, request).is_valid({**body, "model": 5})


def test_logprobs_are_answered_in_every_form_that_asks_for_them(url: str) -> None:
    """OpenAI answers logprobs=0 with the sampled tokens' log-probabilities (no alternatives): 0 gets them as 1
    does, not a choice whose logprobs are null; false or null gets none."""
    for value, listed in ((0, 1), (1, 1), (3, 3)):  # (vLLM's and OpenAI's: the output token's entry among them)
        r = httpx.post(url + COMPLETIONS, json={**BASE, "logprobs": value}, timeout=30)
        lp = r.json()["choices"][0]["logprobs"]
        assert r.status_code == 200 and len(lp["token_logprobs"]) == BASE["max_tokens"], r.text
        assert all(len(top) <= listed for top in lp["top_logprobs"]) and len(lp["top_logprobs"][0]) >= 1
    for value in (False, None):
        r = httpx.post(url + COMPLETIONS, json={**BASE, "logprobs": value}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_null_means_the_default_for_openais_nullable_fields(url: str, path: str) -> None:
    """OpenAI's schema makes these nullable and its SDKs send null for "unset": a 200 with the default, not a 400."""
    body = {**BASE} if path == COMPLETIONS else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body["max_tokens"] = 2
    fields = (
        "temperature",
        "top_p",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "include_stop_str_in_output",
        "stream",
        "ignore_eos",
    )
    for field in fields:
        r = httpx.post(url + path, json={**body, field: None}, timeout=30)
        assert r.status_code == 200, (field, r.text[:300])
    everything = httpx.post(url + path, json={**body, **dict.fromkeys(fields)}, timeout=30)
    assert everything.status_code == 200 and "choices" in everything.json()


@pytest.mark.parametrize(
    "schema", ["CompletionResponse", "ChatCompletionResponse", "CompletionChunk", "ChatCompletionChunk"]
)
def test_the_response_extensions_are_described(doc: dict[str, Any], schema: str) -> None:
    """A client reading /openapi.json learns what vLLM's and this server's own response fields mean."""
    schemas = doc["components"]["schemas"]
    choice = schemas[schema]["properties"]["choices"]["items"]["$ref"].rsplit("/", 1)[-1]
    for name, field in (("seed", schemas[schema]), ("stop_reason", schemas[choice]), ("token_ids", schemas[choice])):
        assert "extension" in field["properties"][name].get("description", ""), (schema, name)
