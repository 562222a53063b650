"""Resumable streams (issue 16 item 11): SSE event ids, the seed the server drew with, resuming after any event id
(``resume_from`` or ``Last-Event-ID``) gives the rest token-identical, a changed request is refused rather than
spliced, and the client helper in load/ resumes across cut connections. Real HTTP against the in-process API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from deployments.lane import LaneStream
from load.resumable import ResumableStream, StreamFailedError
from specserve.api.resume import StreamMark
from specserve.config import ChainDraft, SpecConfig, SpecMethod
from specserve.sequence import Request, RequestOutput
from tests.api_backend import MODEL, LocalBackend, api_server, module_server, requests_by_status

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SAMPLED: dict[str, Any] = {"model": MODEL, "prompt": "the cat", "max_tokens": 40, "temperature": 0.9, "top_p": 0.95}
CHAT_BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 30,
    "temperature": 0,
    "ignore_eos": True,
}


backend, url = module_server(max_model_len=256, max_batch_size=4)


def _events(url: str, route: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every SSE event as {"id": ..., "data": parsed JSON or "[DONE]"}."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    with httpx.stream("POST", url + route, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id: "):
                current["id"] = line[4:]
            elif line.startswith("data: "):
                payload = line[6:]
                current["data"] = payload if payload == "[DONE]" else json.loads(payload)
                events.append(current)
                current = {}
    return events


def _content(events: list[dict[str, Any]]) -> tuple[str, list[int]]:
    text, ids = "", []
    for e in events:
        if e["data"] == "[DONE]" or not e["data"]["choices"]:
            continue
        choice = e["data"]["choices"][0]
        text += (choice.get("delta") or {}).get("content") or "" if "delta" in choice else choice["text"]
        ids += choice.get("token_ids") or []
    return text, ids


def test_events_carry_ids_and_the_seed_drawn_with(url: str) -> None:
    events = _events(url, COMPLETIONS, {**SAMPLED, "return_token_ids": True})
    data = [e for e in events if e["data"] != "[DONE]"]
    assert all("id" in e for e in data) and "id" not in events[-1]
    seeds = {e["data"]["seed"] for e in data}
    assert len(seeds) == 1 and isinstance(next(iter(seeds)), int)  # a sampled request without a seed gets one
    text, ids = _content(events)
    last = StreamMark.parse(data[-1]["id"])
    assert (last.tokens, last.text_bytes) == (len(ids), len(text.encode()))
    # the same request with the returned seed regenerates the same tokens, in a non-streamed response too
    seed = next(iter(seeds))
    full = httpx.post(url + COMPLETIONS, json={**SAMPLED, "seed": seed, "return_token_ids": True}, timeout=60).json()
    assert full["choices"][0]["token_ids"] == ids and full["seed"] == seed
    greedy = _events(url, COMPLETIONS, {**SAMPLED, "temperature": 0})
    assert all("seed" not in e["data"] for e in greedy if e["data"] != "[DONE]")


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_resuming_after_any_event_gives_the_rest_token_identical(url: str, route: str) -> None:
    body = {**(SAMPLED if route == COMPLETIONS else CHAT_BODY), "return_token_ids": True}
    if route == COMPLETIONS:  # sampled with a seed of the server's: EOS ignored, so that it always runs 40 tokens
        body |= {"prompt": "once upon", "ignore_eos": True}
    full = _events(url, route, body)
    seed = full[-2]["data"].get("seed")
    if seed is not None:
        body["seed"] = seed
    text, ids = _content(full)
    assert len(ids) >= 20
    marks = [e["id"] for e in full if "id" in e]
    for k in (0, 1, len(marks) // 2, len(marks) - 2, len(marks) - 1):
        head_text, head_ids = _content(full[: k + 1])
        by_field = _events(url, route, {**body, "resume_from": marks[k]})
        by_header = _events(url, route, body, headers={"Last-Event-ID": marks[k]})
        for rest in (by_field, by_header):
            rest_text, rest_ids = _content(rest)
            assert head_text + rest_text == text and head_ids + rest_ids == ids, k
            assert rest[-1]["data"] == "[DONE]"
            assert all(e["data"]["choices"][0].get("delta", {}).get("role") is None for e in rest if _is_choice(e))
            assert not any("prompt_token_ids" in json.dumps(e["data"]) for e in rest), k  # (the first event's)
    assert sum("prompt_token_ids" in json.dumps(e["data"]) for e in full) == 1


def test_a_resumed_stream_goes_on_with_the_logprobs_and_text_offsets_after_its_point(url: str) -> None:
    """The logprobs of a resumed stream are those of the tokens it sends, and its text offsets count the texts of
    the tokens the client had before (they are offsets into the whole answer)."""
    body = {**SAMPLED, "prompt": "once upon", "ignore_eos": True, "seed": 3, "logprobs": 2}
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def logprobs(events: list[dict[str, Any]]) -> dict[str, list[Any]]:
        chunks = [e["data"]["choices"][0]["logprobs"] for e in events if _is_choice(e)]
        return {f: [x for c in chunks if c for x in c[f]] for f in fields}

    full = _events(url, COMPLETIONS, body)
    whole = logprobs(full)
    assert len(whole["tokens"]) == 40 and whole["text_offset"][-1] > 0
    marks = [e["id"] for e in full if "id" in e]
    for k in (1, len(marks) // 2, len(marks) - 2):
        head, rest = logprobs(full[: k + 1]), logprobs(_events(url, COMPLETIONS, {**body, "resume_from": marks[k]}))
        assert len(rest["tokens"]) > 0, k
        for f in fields:
            assert head[f] + rest[f] == whole[f], (k, f)


def test_an_echoed_stream_starts_with_the_prompt_and_a_resumed_one_does_not_send_it_again(url: str) -> None:
    """OpenAI's echo, streamed: the first chunk's text starts with the prompt's and its logprobs with the prompt's
    tokens' (the first null), the chunks add up to the non-streamed answer; resumed after any event, the rest is
    the answer's rest, its text offsets still counting the prompt's tokens."""
    body = {**SAMPLED, "prompt": "once upon", "ignore_eos": True, "seed": 3, "logprobs": 2, "echo": True}
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def logprobs(events: list[dict[str, Any]]) -> dict[str, list[Any]]:
        chunks = [e["data"]["choices"][0]["logprobs"] for e in events if _is_choice(e)]
        return {f: [x for c in chunks if c for x in c[f]] for f in fields}

    whole = httpx.post(url + COMPLETIONS, json=body, timeout=60).json()["choices"][0]
    assert whole["text"].startswith("once upon") and whole["logprobs"]["token_logprobs"][0] is None
    full = _events(url, COMPLETIONS, body)
    first = next(e for e in full if _is_choice(e))["data"]["choices"][0]
    assert first["text"].startswith("once upon") and first["logprobs"]["token_logprobs"][0] is None
    assert _content(full)[0] == whole["text"] and logprobs(full) == {f: whole["logprobs"][f] for f in fields}
    marks = [e["id"] for e in full if "id" in e]
    for k in (0, 1, len(marks) // 2, len(marks) - 2):
        rest = _events(url, COMPLETIONS, {**body, "resume_from": marks[k]})
        assert _content(full[: k + 1])[0] + _content(rest)[0] == whole["text"], k
        head, tail = logprobs(full[: k + 1]), logprobs(rest)
        for f in fields:
            assert head[f] + tail[f] == whole["logprobs"][f], (k, f)
    # a first output that sends nothing (its token is the first byte of a character, held back beside a stop
    # string): the prompt's logprobs come with the first chunk that is sent
    held = {**body, "temperature": 0, "max_tokens": 4, "stop": ["zz"], "logit_bias": {"229": 100}}  # (byte 0xE2)
    whole = httpx.post(url + COMPLETIONS, json=held, timeout=60).json()["choices"][0]
    streamed = logprobs(_events(url, COMPLETIONS, held))
    assert streamed == {f: whole["logprobs"][f] for f in fields}


def _is_choice(e: dict[str, Any]) -> bool:
    return e["data"] != "[DONE]" and bool(e["data"]["choices"])


def test_a_changed_request_is_refused_not_spliced(url: str) -> None:
    body = {**SAMPLED, "seed": 11}
    full = _events(url, COMPLETIONS, body)
    mark = full[len(full) // 2]["id"]
    changed = _events(url, COMPLETIONS, {**body, "seed": 12, "resume_from": mark})
    errors = [e["data"]["error"] for e in changed if e["data"] != "[DONE]" and "error" in e["data"]]
    assert errors and errors[0]["code"] == "resume_mismatch" and errors[0]["param"] == "resume_from"
    beyond = StreamMark.parse(full[-2]["id"])
    far = StreamMark(beyond.tokens + 5, beyond.text_bytes + 5, beyond.crc).render()
    past_end = _events(url, COMPLETIONS, {**body, "max_tokens": beyond.tokens + 5, "resume_from": far})
    sent = [e["data"] for e in past_end if e["data"] != "[DONE]"]
    assert sent and all("error" in d for d in sent)  # the error alone: no finish event for a point never reached
    # past the request's max_tokens the point was never an event of its stream: a 409 before anything is generated
    r = httpx.post(url + COMPLETIONS, json={**body, "stream": True, "resume_from": far}, timeout=30)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "resume_mismatch" and r.json()["error"]["param"] == "resume_from"
    # OpenAI's SDK retries a 409 unless told not to: the same request would meet the same mismatch
    assert r.headers["x-should-retry"] == "false"
    # chat's opening event (no output yet): no event of a completions stream, whose first event has output (it sent
    # the whole answer again, without its echo and prompt ids, as if the client had had them)
    opening = StreamMark().render()
    for route, sent, opens in ((CHAT, CHAT_BODY | {"seed": 11}, True), (COMPLETIONS, body, False)):
        r = httpx.post(url + route, json=sent | {"stream": True, "resume_from": opening}, timeout=30)
        assert (r.status_code == 200) == opens, (route, r.text)
    assert (
        r.status_code == 409
        and "has no opening event" in r.json()["error"]["message"]
        and r.json()["error"]["param"] == "resume_from"
    )
    sent: list[httpx.Request] = []
    with httpx.Client(event_hooks={"request": [sent.append]}) as http:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=2, timeout=30.0, http_client=http)
        params = {k: v for k, v in body.items() if k not in ("model", "prompt")}
        with pytest.raises(openai.ConflictError):
            sdk.completions.create(
                model=body["model"], prompt=body["prompt"], stream=True, extra_body=params | {"resume_from": far}
            )
    assert len(sent) == 1


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({**SAMPLED, "seed": 1, "stream": True, "resume_from": "12-x-00"}, None, "resume_from"),
        ({**SAMPLED, "seed": 1, "resume_from": "1-2-0000abcd"}, None, "resume_from"),  # stream false
        ({**SAMPLED, "stream": True, "resume_from": "1-2-0000abcd"}, None, "seed"),  # sampled, seed missing
        ({**SAMPLED, "seed": 1, "stream": True}, {"Last-Event-ID": "nonsense"}, "resume_from"),
    ],
)
def test_bad_resume_requests_are_400(
    url: str, body: dict[str, Any], headers: dict[str, str] | None, param: str
) -> None:
    r = httpx.post(url + COMPLETIONS, json=body, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_server_drafting_sampled_chains_refuses_to_resume_a_sampled_stream_and_resumes_the_rest() -> None:
    """With ``chain_draft: sampled`` a sampled request's text depends on the requests beside it, so regenerating it
    to resume could only end in a 409 after the whole replay: the resume is a 400 at once. Greedy streams and
    sampled ones asked without speculation draw by position and resume as anywhere."""
    spec = SpecConfig(method=SpecMethod.chain, sl=4, chain_draft=ChainDraft.sampled)
    backend = LocalBackend(max_model_len=256, max_batch_size=4, speculation=spec)
    try:
        with api_server(backend) as url:
            sampled = {**SAMPLED, "seed": 7, "ignore_eos": True, "max_tokens": 12}
            for headers, extra in [(None, {"resume_from": "1-2-0000abcd"}), ({"Last-Event-ID": "1-2-0000abcd"}, {})]:
                body = {**sampled, "stream": True, **extra}
                r = httpx.post(url + COMPLETIONS, json=body, headers=headers, timeout=30)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "resume_from"
                assert "chain_draft" in r.json()["error"]["message"]
            for body in ({**sampled, "speculation": {"enabled": False}}, {**CHAT_BODY, "max_tokens": 12}):
                route = COMPLETIONS if "prompt" in body else CHAT
                full = _events(url, route, body)
                marks = [e["id"] for e in full if "id" in e]
                rest = _events(url, route, {**body, "resume_from": marks[2]})
                assert _content(full[:3])[0] + _content(rest)[0] == _content(full)[0]
    finally:
        backend.stop()


@pytest.mark.parametrize(("stream", "header"), [(False, "1-2-0000abcd"), (True, "")])
def test_a_last_event_id_header_off_a_stream_or_blank_is_no_resume(url: str, stream: bool, header: str) -> None:
    """Any Last-Event-ID header made a request a resume: a blank one, or one a client forwarded onto a request
    that does not stream, was a 400 (only resume_from in the body asks for a resume there). Either is the whole
    answer the same request gets without the header."""
    body = {**SAMPLED, "seed": 1, "max_tokens": 6, "stream": stream}

    def text(headers: dict[str, str] | None) -> str:
        if stream:
            events = _events(url, COMPLETIONS, body, headers=headers)
            assert events[-1]["data"] == "[DONE]"
            return "".join(c["text"] for e in events[:-1] for c in e["data"]["choices"])
        r = httpx.post(url + COMPLETIONS, json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text({"Last-Event-ID": header}) == text(None) != ""


class _CuttingTransport(httpx.BaseTransport):
    """Delivers each response's body only up to ``cut_after`` SSE events, then breaks the connection, the first
    ``cuts`` times; later connections get through."""

    def __init__(self, cut_after: int, cuts: int) -> None:
        self.inner = httpx.HTTPTransport()
        self.cut_after, self.cuts = cut_after, cuts
        self.connections = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        self.connections += 1
        if self.connections > self.cuts:
            return response
        return httpx.Response(response.status_code, headers=response.headers, stream=_Cut(response, self.cut_after))


class _Cut(httpx.SyncByteStream):
    def __init__(self, response: httpx.Response, events: int) -> None:
        self.response, self.events = response, events

    def __iter__(self) -> Iterator[bytes]:
        seen = 0
        for chunk in self.response.stream:  # type: ignore[union-attr]
            yield chunk
            seen += chunk.count(b"\n\n")
            if seen >= self.events:
                self.response.close()
                raise httpx.ReadError("connection cut by the test")

    def close(self) -> None:
        self.response.close()


def test_the_client_helper_resumes_across_cut_connections(url: str) -> None:
    body = {**SAMPLED, "max_tokens": 60, "return_token_ids": True, "ignore_eos": True}
    reference = ResumableStream(url, COMPLETIONS, body)
    ref = list(reference.deltas())
    assert reference.resumes == 0 and reference.seed is not None
    transport = _CuttingTransport(cut_after=3, cuts=4)
    stream = ResumableStream(
        url, COMPLETIONS, {**body, "seed": reference.seed}, client=httpx.Client(transport=transport, timeout=60)
    )
    got = list(stream.deltas())
    assert stream.resumes == 4 and transport.connections == 5
    assert "".join(d.text for d in got) == "".join(d.text for d in ref)
    assert [t for d in got for t in d.token_ids] == [t for d in ref for t in d.token_ids]


def test_ids_are_unique_and_resuming_after_the_finish_or_usage_event_repeats_neither(url: str) -> None:
    body = {**SAMPLED, "seed": 3, "stream_options": {"include_usage": True}}
    full = _events(url, COMPLETIONS, body)
    ids = [e["id"] for e in full if "id" in e]
    assert len(ids) == len(set(ids))
    finish = next(
        e for e in full if e["data"] != "[DONE]" and e["data"]["choices"] and e["data"]["choices"][0]["finish_reason"]
    )
    usage = next(e for e in full if e["data"] != "[DONE]" and not e["data"]["choices"])
    assert finish["id"].endswith("-f") and usage["id"].endswith("-u")
    after_finish = _events(url, COMPLETIONS, {**body, "resume_from": finish["id"]})
    assert [e["data"] if e["data"] == "[DONE]" else "usage" for e in after_finish] == ["usage", "[DONE]"]
    after_usage = _events(url, COMPLETIONS, {**body, "resume_from": usage["id"]})
    assert [e["data"] for e in after_usage] == ["[DONE]"]


def test_the_heal_timeout_counts_each_outage_not_the_whole_stream(url: str) -> None:
    """Four short outages, each shorter than the heal timeout, together longer: the stream still completes."""
    body = {**SAMPLED, "seed": 9, "max_tokens": 60, "ignore_eos": True}
    ref = "".join(d.text for d in ResumableStream(url, COMPLETIONS, body).deltas())
    transport = _CuttingTransport(cut_after=3, cuts=4)
    stream = ResumableStream(
        url,
        COMPLETIONS,
        body,
        client=httpx.Client(transport=transport, timeout=60),
        heal_timeout_s=0.25,
        retry_interval_s=0.1,
    )
    assert "".join(d.text for d in stream.deltas()) == ref
    assert stream.resumes == 4


def test_the_client_helper_waits_as_asked_and_resumes_after_a_cut_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 429 with Retry-After is resent no sooner than asked; a connection closed in the middle of an event (the
    partial line reaches the parser) is a cut to resume from, not a malformed stream."""
    import load.resumable as resumable

    first = b'id: 1-a\ndata: {"choices":[{"text":"Hel","finish_reason":null}]}\n\n'
    rest = b'id: 1-b\ndata: {"choices":[{"text":"lo","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    answers = iter(
        [
            httpx.Response(429, headers={"Retry-After": "7"}),
            httpx.Response(200, content=first + b'id: 1-b\ndata: {"choi'),  # closed mid-line
            httpx.Response(200, content=rest),
        ]
    )
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return next(answers)

    waits: list[float] = []
    monkeypatch.setattr(resumable.time, "sleep", waits.append)
    stream = ResumableStream("http://127.0.0.1:1", COMPLETIONS, {"prompt": "x"}, client=httpx.Client(
        transport=httpx.MockTransport(handler)), heal_timeout_s=60, retry_interval_s=0.5)  # fmt: skip
    assert stream.text() == "Hello" and stream.resumes == 2
    assert waits == [7.0, 0.5]
    assert "resume_from" not in bodies[1] and bodies[2]["resume_from"] == "1-a"


def _errors(events: list[dict[str, Any]]) -> list[str]:
    return [e["data"]["error"]["code"] for e in events if e["data"] != "[DONE]" and "error" in e["data"]]


def _sent(events: list[dict[str, Any]]) -> tuple[str, list[int]]:
    return _content([e for e in events if e["data"] == "[DONE]" or "error" not in e["data"]])


def test_an_id_is_checked_on_its_tokens_and_its_text_before_anything_past_it_is_sent(url: str) -> None:
    """The id's CRC covers the token ids as well as the text, and nothing past the resume point is sent before the
    regenerated stream has reached it in both: a changed request resumed from an event that sent token ids but no
    text (a held-back partial character) was spliced, and a forged token count re-sent or withheld token ids."""
    base = {**SAMPLED, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}
    body = {**base, "seed": 21}
    full = _events(url, COMPLETIONS, body)
    text, ids = _content(full)
    marks = [StreamMark.parse(e["id"]) for e in full if "id" in e]
    mid = marks[len(marks) // 2]
    assert 0 < mid.tokens < len(ids)
    after = min(mid.tokens + 3, len(ids))  # (within max_tokens: past it the id is refused up front)
    for forged in (StreamMark(0, mid.text_bytes, mid.crc), StreamMark(after, mid.text_bytes, mid.crc)):
        rest = _events(url, COMPLETIONS, {**body, "resume_from": forged.render()})
        assert _errors(rest) == ["resume_mismatch"] and _sent(rest) == ("", [])
    # a point past some token ids but short of the text they make is no point of the stream: refused, where the
    # text up to it was dropped (only the token CRC was checked, and the empty text's CRC is 0)
    assert any(0 < m.tokens < len(ids) and m.text_bytes for m in marks)  # text on the way to the point
    off = StreamMark(len(ids), 0, zlib.crc32(struct.pack(f"<{len(ids)}I", *ids)))
    rest = _events(url, COMPLETIONS, {**body, "resume_from": off.render()})
    assert _errors(rest) == ["resume_mismatch"] and _sent(rest) == ("", [])
    # a token-only point (an event that sent token ids and no text yet: a held-back partial character): only the
    # token ids can tell a changed request
    for seed in range(21, 121):
        body = {**base, "seed": seed}
        full = _events(url, COMPLETIONS, body)
        token_only = next((m for e in full if "id" in e and (m := StreamMark.parse(e["id"])).tokens), None)
        if token_only is not None and token_only.text_bytes == 0:
            break
    else:
        raise AssertionError("no stream in 100 seeds opens with a held-back partial character")
    text, ids = _content(full)
    rest = _events(url, COMPLETIONS, {**body, "resume_from": token_only.render()})
    assert not _errors(rest) and _content(rest) == (text, ids[token_only.tokens :])
    changed = _events(url, COMPLETIONS, {**body, "seed": seed + 1000, "resume_from": token_only.render()})
    assert _errors(changed) == ["resume_mismatch"] and _sent(changed) == ("", [])


def test_a_resume_point_inside_a_character_is_refused_not_spliced() -> None:
    """A point between a character's bytes, with its true CRC (a client's own id: every event ends on a whole
    character), was accepted, and the rest began with the character's tail as U+FFFD: not the stream's text."""
    from specserve.api.error_bodies import ResumeMismatchError
    from specserve.api.resume import StreamCursor
    from specserve.sequence import RequestStats

    text = "é and ü"  # é is two bytes
    out = RequestOutput("r", [5, 6, 7], text, None, 3, 3, RequestStats())
    whole = StreamMark().after([5], "é".encode())  # a point the stream has: after the character
    rest = StreamCursor(whole).advance(out)
    assert rest is not None and rest.text == " and ü" and rest.token_ids == [6, 7]
    inside = StreamMark().after([5], "é".encode()[:1])
    with pytest.raises(ResumeMismatchError, match="falls inside a character"):
        StreamCursor(inside).advance(out)


def test_a_replay_that_goes_on_past_the_finish_event_is_refused(url: str) -> None:
    """The same request with a larger max_tokens reproduces the text up to the finish event: the rest used to be
    streamed after the finish_reason the client already had."""
    body = {"model": MODEL, "prompt": "once upon", "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    full = _events(url, COMPLETIONS, body)
    finish = next(e["id"] for e in full if "id" in e and e["id"].endswith("-f"))
    longer = _events(url, COMPLETIONS, {**body, "max_tokens": 20, "resume_from": finish})
    assert _errors(longer) == ["resume_mismatch"] and _sent(longer) == ("", [])
    same = _events(url, COMPLETIONS, {**body, "resume_from": finish})
    assert [e["data"] for e in same] == ["[DONE]"]


def test_the_client_helper_reads_a_chunk_with_line_separators_in_its_text() -> None:
    """JSON leaves U+2028, U+2029 and U+0085 raw (another server may send them so): the helper read such a chunk
    as a cut line and resumed from the same id until its heal timeout."""
    text = "a\u2028b\x85c"
    chunk = json.dumps({"choices": [{"text": text, "finish_reason": "length"}]}, ensure_ascii=False)
    body = f"id: 1-a\ndata: {chunk}\n\ndata: [DONE]\n\n".encode()
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body)))
    stream = ResumableStream("http://127.0.0.1:1", COMPLETIONS, {"prompt": "x"}, client=client, heal_timeout_s=0)
    assert stream.text() == text and stream.resumes == 0


def test_the_client_helper_joins_an_events_data_lines_and_fails_a_whole_malformed_one() -> None:
    """An event's data lines join with a newline, as the SSE format says (each line read alone, a chunk over two
    lines was a cut line, resumed from the same id until the heal timeout); an event that ended and is not JSON
    is the stream's failure, not a cut to resume from."""
    split = 'id: 1-a\ndata: {"choices":[{"text":\ndata: "a\\nb","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=split.encode())))
    stream = ResumableStream("http://127.0.0.1:1", COMPLETIONS, {"prompt": "x"}, client=client, heal_timeout_s=60)
    assert stream.text() == "a\nb" and stream.resumes == 0 and stream.last_event_id == "1-a"
    broken = b'id: 1-a\ndata: {"choices":\n\ndata: [DONE]\n\n'
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=broken)))
    stream = ResumableStream("http://127.0.0.1:1", COMPLETIONS, {"prompt": "x"}, client=client, heal_timeout_s=60)
    with pytest.raises(StreamFailedError, match="malformed event"):
        stream.text()
    assert stream.resumes == 0


def test_the_client_helper_resumes_from_an_id_sent_without_data_and_not_from_an_empty_one() -> None:
    """An event with an ``id`` and no data moves the point a reconnect resumes from (the SSE format sets the last
    event id at every dispatch); an empty ``id`` resets it: a cut past it, with content delivered, cannot go on
    without sending that content again, so it fails (it sent ``resume_from: ""`` once, then started over: "abab")."""
    answers = iter(
        [
            b'id: 1-a\ndata: {"choices":[{"text":"a","finish_reason":null}]}\n\nid: 1-b\n\n',  # cut after an ack
            b'data: {"choices":[{"text":"b","finish_reason":null}]}\n\nid\n\n',  # then an empty id, cut
            b'data: {"choices":[{"text":"ab","finish_reason":"length"}]}\n\ndata: [DONE]\n\n',
        ]
    )
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=next(answers))

    client = httpx.Client(transport=httpx.MockTransport(handler))
    stream = ResumableStream("http://127.0.0.1:1", COMPLETIONS, {"prompt": "x"}, client=client, retry_interval_s=0)
    got: list[str] = []
    with pytest.raises(StreamFailedError, match="no event id to resume from"):
        got.extend(d.text for d in stream.deltas())
    assert got == ["a", "b"] and stream.resumes == 1
    assert "resume_from" not in bodies[0] and bodies[1]["resume_from"] == "1-b" and len(bodies) == 2


def test_the_client_helper_resends_a_stream_without_ids_only_while_nothing_was_delivered() -> None:
    """A stream of several choices carries no event ids: a cut before any content is resent from the start; a cut
    after content fails rather than deliver that content twice (it restarted: "Hello worldHello world!")."""
    part = b'data: {"choices":[{"index":0,"text":"Hello","finish_reason":null}]}\n\n'
    part += b'data: {"choices":[{"index":1,"text":" world","finish_reason":null}]}\n\n'
    whole = part + b'data: {"choices":[{"index":0,"text":"!","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    role_only = b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}\n\n'

    def run(answers: list[httpx.Response]) -> tuple[ResumableStream, list[str]]:
        queue = iter(answers)
        client = httpx.Client(transport=httpx.MockTransport(lambda request: next(queue)))
        stream = ResumableStream(
            "http://127.0.0.1:1", COMPLETIONS, {"prompt": "x", "n": 2}, client=client, retry_interval_s=0
        )
        got: list[str] = []
        try:
            got.extend(d.text for d in stream.deltas())
        except StreamFailedError:
            got.append("<failed>")
        return stream, got

    stream, got = run([httpx.Response(503), httpx.Response(200, content=role_only), httpx.Response(200, content=whole)])
    assert "".join(got) == "Hello world!" and stream.resumes == 2
    stream, got = run([httpx.Response(200, content=part), httpx.Response(200, content=whole)])
    assert got == ["Hello", " world", "<failed>"] and stream.resumes == 0


@pytest.mark.parametrize(
    "payload", ['{"error": "lane gone"}', "5", '{"choices": [{"delta": "hi"}]}', '{"choices": [], "seed": "7"}']
)
def test_the_client_helper_fails_a_misshapen_chunk_with_its_own_error(payload: str) -> None:
    body = f'id: 1-a\ndata: {{"choices": [{{"text": "a"}}]}}\n\nid: 1-b\ndata: {payload}\n\ndata: [DONE]\n\n'
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body.encode())))
    stream = ResumableStream("http://127.0.0.1:1", COMPLETIONS, {"prompt": "x"}, client=client, heal_timeout_s=0)
    with pytest.raises(StreamFailedError, match="lane gone" if "error" in payload else "unexpected chunk"):
        stream.text()


@pytest.mark.parametrize("payload", ["1" * 5000, "[" * 100_000])
def test_the_client_helper_fails_json_python_refuses_to_read_with_its_own_error(payload: str) -> None:
    body = f'id: 1-a\ndata: {{"choices": [{{"text": "a"}}]}}\n\nid: 1-b\ndata: {payload}\n\ndata: [DONE]\n\n'
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body.encode())))
    stream = ResumableStream("http://127.0.0.1:1", COMPLETIONS, {"prompt": "x"}, client=client, heal_timeout_s=0)
    with pytest.raises(StreamFailedError, match="malformed event"):
        stream.text()


def test_a_resumed_stream_is_kept_alive_while_it_replays_to_its_resume_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume regenerates everything before its point and sends none of it: with no bytes for longer than the
    client's read timeout, the client cut the connection, which aborted the replay, over and over (any resume past
    ~300 tokens at the default CPU app's speed). Comment lines keep the connection alive meanwhile."""
    import specserve.api.server as server

    monkeypatch.setattr(server, "REPLAY_KEEPALIVE_S", 0.1)
    body = {**CHAT_BODY, "max_tokens": 24}
    backend = LocalBackend(max_model_len=256, max_batch_size=2, step_delay_s=0.05)
    try:
        with api_server(backend) as url:
            full = _events(url, CHAT, body)
            cut = [e["id"] for e in full if "id" in e][-3]  # the replay takes ~1.1 s: 22 steps of 50 ms
            reference = "".join(
                e["data"]["choices"][0]["delta"].get("content") or ""
                for e in full[full.index(next(e for e in full if e.get("id") == cut)) + 1 :]
                if e["data"] != "[DONE]" and e["data"]["choices"]
            )
            stream = ResumableStream(url, CHAT, body, timeout_s=0.5, heal_timeout_s=0.0, last_event_id=cut)
            assert stream.text() == reference and stream.resumes == 0
    finally:
        backend.stop()


def test_a_resumed_streams_first_token_latency_is_of_its_first_token_sent() -> None:
    """A resume regenerates what it sent before its point and sends none of it: the TTFT histogram took the
    replay's first token (~one step) for the client's first token (after the whole replay), and TPOT spread the
    time after it over every regenerated token."""
    body = {**CHAT_BODY, "max_tokens": 24}
    backend = LocalBackend(max_model_len=256, max_batch_size=2, step_delay_s=0.05)

    def ttft_sum() -> float:
        for line in backend.metrics.render().decode().splitlines():
            if line.startswith("specserve_time_to_first_token_seconds_sum "):
                return float(line.split()[-1])
        return 0.0

    try:
        with api_server(backend) as url:
            cut = [e["id"] for e in _events(url, CHAT, body) if "id" in e][-3]  # the replay: ~22 steps of 50 ms
            before = ttft_sum()
            stream = ResumableStream(url, CHAT, body, timeout_s=30.0, heal_timeout_s=0.0, last_event_id=cut)
            assert stream.text()
            assert ttft_sum() - before > 0.5  # the replay before the first token sent, not one step
    finally:
        backend.stop()


class _LateStream:
    """A stream whose first output comes only after a silence (a queue, a target reloading, a long prefill)."""

    def __init__(self, stream: LaneStream, silence_s: float) -> None:
        self.stream = stream
        self.silence_s = silence_s
        self.closed = False
        self.interrupted = False  # the wait for its first output was cancelled

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            await asyncio.sleep(self.silence_s)
        except asyncio.CancelledError:
            self.interrupted = True
            raise
        async for out in self.stream:
            yield out

    async def aclose(self) -> None:
        self.closed = True
        await self.stream.aclose()


class _LateBackend(LocalBackend):
    def __init__(self) -> None:
        super().__init__(max_model_len=256, max_batch_size=2)
        self.silence_s = 0.0
        self.streams: list[_LateStream] = []

    async def submit(self, request: Request) -> _LateStream:  # type: ignore[override]
        stream = _LateStream(await super().submit(request), self.silence_s)
        self.streams.append(stream)
        return stream


def _timed_lines(url: str, body: dict[str, Any], headers: dict[str, str]) -> list[tuple[float, str]]:
    start = time.monotonic()
    with httpx.stream("POST", url + COMPLETIONS, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [(time.monotonic() - start, line) for line in r.iter_lines() if line]


LATE_BODY = {"model": MODEL, "prompt": "once upon", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@contextlib.contextmanager
def _resumable_late(silence_s: float) -> Iterator[tuple[_LateBackend, str, str]]:
    """A server whose streams then wait ``silence_s`` before their first output: (backend, url, an event id of a
    stream of LATE_BODY to resume from)."""
    backend = _LateBackend()
    try:
        with api_server(backend) as url:
            cut = [e["id"] for e in _events(url, COMPLETIONS, LATE_BODY) if "id" in e][2]
            backend.silence_s = silence_s
            yield backend, url, cut
    finally:
        backend.stop()


def test_a_resumed_stream_is_kept_alive_before_its_first_output() -> None:
    """The comment went out only when an output came: a resumed request waiting in a queue, for a reloading target
    or through a long prefill sent nothing, and the client's read timeout cut it again."""
    with _resumable_late(3.0) as (backend, url, cut):
        lines = _timed_lines(url, LATE_BODY, {"Last-Event-ID": cut})
    kept_alive = [t for t, line in lines if line == ": replaying"]
    first_data = next(t for t, line in lines if line.startswith("data: "))
    assert kept_alive and kept_alive[0] < 1.8 and first_data >= 2.9, lines
    assert len([t for t in kept_alive if t < first_data]) >= 2, lines  # one a second meanwhile
    assert lines[-1][1] == "data: [DONE]" and all(s.closed for s in backend.streams)


def test_a_fresh_stream_is_kept_alive_while_it_waits_for_its_first_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a resumed stream got comment lines: a fresh completions stream (no first chunk) sent nothing while it
    waited in the queue, and a proxy's or the client's read timeout cut it there."""
    import specserve.api.server as server

    monkeypatch.setattr(server, "SSE_KEEPALIVE_S", 0.5)
    backend = _LateBackend()
    try:
        with api_server(backend) as url:
            backend.silence_s = 2.0
            lines = _timed_lines(url, LATE_BODY, {})
    finally:
        backend.stop()
    kept_alive = [t for t, line in lines if line == ": keep-alive"]
    first_data = next(t for t, line in lines if line.startswith("data: "))
    assert len([t for t in kept_alive if t < first_data]) >= 2 and kept_alive[0] < 1.5, lines
    assert lines[-1][1] == "data: [DONE]" and ": replaying" not in [line for _, line in lines]


def test_a_resumed_stream_left_while_it_waits_is_closed() -> None:
    """The client leaves while the wait for the next output, past a keepalive, is still pending: the stream is
    closed (the request aborted) and that wait cancelled, not left running."""
    with _resumable_late(30.0) as (backend, url, cut):
        body, headers = {**LATE_BODY, "stream": True}, {"Last-Event-ID": cut}
        with httpx.stream("POST", url + COMPLETIONS, json=body, headers=headers) as r:
            assert next(line for line in r.iter_lines() if line) == ": replaying"
        deadline = time.monotonic() + 10
        stream = backend.streams[-1]
        while not (stream.closed and stream.interrupted) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stream.closed and stream.interrupted  # nothing goes on waiting for an output nobody reads
        assert requests_by_status(backend).get("aborted") == 1.0
