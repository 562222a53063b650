"""The HTTP guard in front of the routes: body size (413), body-read timeout (408), API key (401), debug routes,
and /health staying fast whatever other clients send. Real HTTP against the in-process API (tests/api_backend)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import SecretStr

from deployments.app_args import AppArgs
from specserve.api.http_guard import API_KEY_ENV, HTTPOptions
from specserve.api.schemas import Health, HealthStatus
from specserve.config import SpecConfig
from tests.api_backend import MODEL, LocalBackend, api_server, requests_by_status

REPO = Path(__file__).resolve().parents[1]
COMPLETIONS = "/v1/completions"
OK_BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def backend() -> Iterator[LocalBackend]:
    backend = LocalBackend()
    yield backend
    backend.stop()


def _error(r: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == code
    return error


def test_body_over_the_size_limit_is_413(backend: LocalBackend) -> None:
    with api_server(backend, max_request_bytes=2048) as url:
        assert httpx.post(url + COMPLETIONS, json=OK_BODY).status_code == 200
        declared = httpx.post(url + COMPLETIONS, json={**OK_BODY, "prompt": "x" * 4000})
        _error(declared, 413, "request_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: the guard counts what arrives
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(3):
                yield b"y" * 1000
            yield b'"}'

        chunked = httpx.post(url + COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
        _error(chunked, 413, "request_too_large")
    assert 'specserve_requests_total{status="invalid"}' in backend.metrics.render().decode()


def test_an_oversized_body_counts_as_a_request_only_on_the_generation_routes() -> None:
    """specserve_requests_total counts generation requests: a large junk POST to /health or an unknown path is
    refused (413) as on any route, but is not one (a small one, a 404, was not counted either)."""
    backend = LocalBackend()
    try:
        with api_server(backend, max_request_bytes=1024) as url:
            for path in ("/health", "/metrics", "/no-such-route", "/v1/models"):
                assert httpx.post(url + path, content=b"x" * 5000).status_code == 413
            assert 'specserve_requests_total{status="invalid"}' not in backend.metrics.render().decode()
            _error(httpx.post(url + COMPLETIONS, content=b"x" * 5000), 413, "request_too_large")
            assert 'specserve_requests_total{status="invalid"} 1.0' in backend.metrics.render().decode()
    finally:
        backend.stop()


def test_a_request_refused_for_its_key_or_host_counts_as_invalid_only_on_the_generation_routes() -> None:
    """A 401 (no or a wrong key) and a 400 invalid_host are answered before any route: they were never counted, so
    a client sending a stale key showed as no traffic at all."""
    backend = LocalBackend()
    try:
        with api_server(backend, api_key=SecretStr("k")) as url:
            assert httpx.post(url + COMPLETIONS, json=OK_BODY).status_code == 401
            wrong = {"authorization": "Bearer x"}
            assert httpx.post(url + "/v1/chat/completions", json=CHAT_OK, headers=wrong).status_code == 401
            assert httpx.get(url + "/metrics").status_code == 401 and httpx.get(url + "/v1/models").status_code == 401
            for method in ("GET", "OPTIONS"):  # no generation request (with the key, a GET is an uncounted 405)
                assert httpx.request(method, url + COMPLETIONS).status_code == 401
            assert requests_by_status(backend) == {"invalid": 2.0}
        with api_server(backend) as url:
            evil = {"Host": "evil.example"}
            assert httpx.post(url + COMPLETIONS, json=OK_BODY, headers=evil).status_code == 400
            assert httpx.get(url + "/v1/models", headers=evil).status_code == 400
            assert requests_by_status(backend) == {"invalid": 3.0}
    finally:
        backend.stop()


def _raw_post(url: str, head: str, body: bytes) -> bytes:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        request_line = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{request_line}{head}\r\n".encode())
        sock.sendall(body)
        response = b""
        while not response.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    return response


def test_a_content_length_padded_with_zeros_is_read_as_its_value(backend: LocalBackend) -> None:
    """The server (httptools) passes a length of thousands of leading zeros on; int() of more than 4300 digits
    raised in the guard, a 500."""
    body = json.dumps(OK_BODY).encode()
    with api_server(backend, max_request_bytes=2048) as url:
        for zeros, status in ((5000, b"200"), (1, b"200")):
            response = _raw_post(url, f"Content-Length: {'0' * zeros}{len(body)}\r\nConnection: close\r\n", body)
            assert response.split(b"\r\n", 1)[0].split()[1] == status, response
        big = json.dumps({**OK_BODY, "prompt": "x" * 3000}).encode()
        response = _raw_post(url, f"Content-Length: {'0' * 5000}{len(big)}\r\nConnection: close\r\n", big)
        assert response.split(b"\r\n", 1)[0].split()[1] == b"413" and b"request_too_large" in response


def test_a_declared_length_over_the_limit_is_refused_before_any_body_byte(backend: LocalBackend) -> None:
    """The body never comes: the only answer that can come is the one given on the declared length (without that
    check the guard waits for the body until ``body_timeout_s``, and this client's read times out first)."""
    with api_server(backend, max_request_bytes=2048, body_timeout_s=60.0) as url:
        response = _raw_post(url, "Content-Length: 1000000\r\n", b"")
        assert response.split(b"\r\n", 1)[0].split()[1] == b"413" and b"request_too_large" in response


def test_health_is_503_only_when_the_replica_fails_its_health_check(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica with a lane bringing its workers back serves on its other lanes: a 503 took it out of rotation
    for anything that probes /health. Its body still says which lanes serve."""
    with api_server(backend) as url:
        for status, code in ((HealthStatus.degraded, 200), (HealthStatus.failing, 503)):
            health = Health(status=status, lanes=2, lanes_alive=1)
            monkeypatch.setattr(backend, "health", lambda health=health: health)
            r = httpx.get(url + "/health")
            assert r.status_code == code and r.json() == {"status": status.value, "lanes": 2, "lanes_alive": 1}


def _health_latencies(url: str, seconds: float) -> list[float]:
    latencies = []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    return latencies


def test_partial_body_gets_408_in_time_and_health_stays_fast(backend: LocalBackend) -> None:
    timeout_s = 0.6
    with api_server(backend, body_timeout_s=timeout_s) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            head += "Content-Length: 1000\r\n\r\n"
            t0 = time.monotonic()
            sock.sendall(head.encode() + b'{"model": "tiny", "pro')  # ...and never the rest
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                health = pool.submit(_health_latencies, url, timeout_s + 0.3)
                response = b""
                while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    response += chunk
                elapsed = time.monotonic() - t0
                latencies = health.result()
    status_line, _, rest = response.partition(b"\r\n")
    assert status_line.split()[1] == b"408", response
    assert b'"code":"request_timeout"' in rest
    assert timeout_s - 0.05 <= elapsed < timeout_s + 1.0
    assert latencies and max(latencies) < 1.0


def test_health_answers_within_a_second_while_a_large_prompt_is_tokenised(backend: LocalBackend) -> None:
    """A prompt just under the default size limit is tokenised off the event loop (then refused: it does not fit)."""
    limit = HTTPOptions().max_request_bytes
    body = {"model": MODEL, "prompt": "the quick brown fox " * ((limit - 200) // 20)}
    with api_server(backend) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, url + COMPLETIONS, json=body, timeout=120.0)
        time.sleep(0.2)
        latencies = _health_latencies(url, 1.5)
        error = _error(big.result(), 400, "context_length_exceeded")
    assert error["param"] == "prompt"
    assert max(latencies) < 1.0


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (COMPLETIONS, {"model": MODEL, "prompt": [-1] * 1_300_000}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{}] * 1_300_000}, "messages"),
    ],
)
def test_health_stays_fast_while_a_list_of_bad_items_is_refused(
    backend: LocalBackend, route: str, body: dict[str, object], param: str
) -> None:
    """A list of invalid items filling the body limit is refused at its first bad item: an error per item (1.3 M of
    them) took pydantic and FastAPI ~30 s to build on the event loop, stalling /health and every stream."""
    with api_server(backend) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        bad = pool.submit(httpx.post, url + route, json=body, timeout=120.0)
        time.sleep(0.2)
        latencies = _health_latencies(url, 1.5)
        response = bad.result()
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert max(latencies) < 1.0


def test_lists_a_request_can_fill_stop_at_their_first_bad_item() -> None:
    from pydantic import ValidationError

    from specserve.api.schemas import ChatCompletionRequest, CompletionRequest

    bodies = [
        (CompletionRequest, {"model": MODEL, "prompt": [5, -1, -1, -1]}, ("prompt", "<list>", 1)),
        (
            ChatCompletionRequest,
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {}, {}, {}]},
            ("messages", 1, "role"),
        ),
        (
            ChatCompletionRequest,
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] + [{}] * 3}]},
            ("messages", 0, "content", "<list>", 1),
        ),
    ]
    for model, body, where in bodies:
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        locs = {err["loc"][: len(where)] for err in e.value.errors()}
        assert locs == {where}, e.value.errors()  # the first bad item only, not one error per item


def test_maps_a_request_can_fill_are_refused_whole_before_their_entries() -> None:
    """A few MiB of logit_bias or metadata entries with bad values gave one error per entry (seconds of the event
    loop); each map is now refused as a whole, in one error (logit_bias's names its first bad entry)."""
    from pydantic import ValidationError

    from specserve.api.schemas import ChatCompletionRequest, CompletionRequest

    bad = {str(i): "x" for i in range(1000)}
    for model, extra in (
        (CompletionRequest, {"prompt": "hi"}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        for field, says in (("logit_bias", "not 'x' (token 0)"), ("metadata", "at most 16 keys, not 1000")):
            with pytest.raises(ValidationError) as e:
                model.model_validate({"model": MODEL, **extra, field: bad})
            assert [err["loc"] for err in e.value.errors()] == [(field,)] and says in str(e.value)
        ok = model.model_validate({"model": MODEL, **extra, "metadata": {"k": "v"} | {str(i): "v" for i in range(15)}})
        assert ok.metadata is not None and len(ok.metadata) == 16
    with pytest.raises(ValidationError, match="at most 64 characters"):  # OpenAI's bound on a key
        CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "metadata": {"k" * 65: "v"}})


def test_a_messages_text_parts_are_joined_on_lines_of_their_own_as_vllm_does() -> None:
    from specserve.api.schemas import ChatCompletionRequest

    parts = [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour"}]
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    assert body.messages[0].text == "Translate:\nbonjour"


def test_a_request_without_max_tokens_fits_the_longest_context_a_model_may_have() -> None:
    """Without max_tokens a request may generate up to the context minus its prompt; at the largest context the
    engine allows that was a 400 blaming max_tokens, which the client never sent."""
    from specserve.api.convert import sampling_params_for
    from specserve.api.schemas import ChatCompletionRequest
    from specserve.config import EngineConfig

    longest = EngineConfig.model_fields["max_model_len"].metadata
    context = next(m.le for m in longest if hasattr(m, "le"))
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert sampling_params_for(body, max_tokens=context - 9).max_tokens == context - 9


def test_completions_default_to_16_tokens_and_a_null_max_tokens_means_the_context_as_in_vllm() -> None:
    """OpenAI's completions default max_tokens to 16 and chat to the context; an explicit null asks for no limit
    (the rest of the context) on both, as vLLM reads it (deployments/README.md)."""
    from specserve.api.schemas import ChatCompletionRequest, CompletionRequest

    completion = {"model": MODEL, "prompt": [5]}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert CompletionRequest.model_validate(completion).max_tokens == 16
    assert CompletionRequest.model_validate({**completion, "max_tokens": None}).max_tokens is None
    assert ChatCompletionRequest.model_validate(chat).max_tokens is None
    assert ChatCompletionRequest.model_validate({**chat, "max_tokens": None}).max_tokens is None


def test_a_chunks_line_separators_are_escaped_so_it_stays_one_line_for_every_client() -> None:
    from specserve.api.schemas import CompletionChoice, CompletionResponse
    from specserve.api.server import _sse

    text = "a\u2028b\u2029c\x85d"
    event = _sse(CompletionResponse(id="x", created=0, model=MODEL, choices=[CompletionChoice(index=0, text=text)]))
    assert event.endswith("\n\n") and len(event.removesuffix("\n\n").splitlines()) == 1
    assert json.loads(event.removeprefix("data: "))["choices"][0]["text"] == text


def test_api_key(backend: LocalBackend) -> None:
    with api_server(backend, api_key=SecretStr("s3cret")) as url:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = httpx.post(url + COMPLETIONS, json=OK_BODY, headers=headers)
            _error(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + "/metrics").status_code == 401
        auth = {"authorization": "Bearer s3cret"}
        assert httpx.post(url + COMPLETIONS, json=OK_BODY, headers=auth).status_code == 200
        assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
        assert httpx.get(url + "/health").status_code == 200  # load balancers and Serve probe without a key
        # ... but a body sent there without the key is not read: a POST that never sent the body it announced held
        # a request slot for the body timeout (30 s here), then got a 408
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")  # (a socket.timeout after 10 s before)
        doc = httpx.get(url + "/openapi.json").json()
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert "401" in doc["paths"][COMPLETIONS]["post"]["responses"]
    with api_server(backend) as url:  # no key configured: no authentication
        assert httpx.post(url + COMPLETIONS, json=OK_BODY).status_code == 200


def test_api_key_from_app_args_or_environment() -> None:
    assert AppArgs().http_options(environ={}).api_key is None
    for empty in ("", " \n"):  # set to nothing (an empty secret) is refused, not a server without authentication
        with pytest.raises(ValueError, match=f"{API_KEY_ENV} is empty"):
            AppArgs().http_options(environ={API_KEY_ENV: empty})
    from_env = AppArgs().http_options(environ={API_KEY_ENV: "env-key"}).api_key
    assert from_env is not None and from_env.get_secret_value() == "env-key"
    args = AppArgs.model_validate({"api_key": "arg-key"})
    key = args.http_options(environ={API_KEY_ENV: "env-key"}).api_key
    assert key is not None and key.get_secret_value() == "arg-key"
    assert "arg-key" not in repr(args)


def test_whitespace_around_the_api_key_is_not_part_of_it(backend: LocalBackend) -> None:
    """A key read from a secret file ends with its newline: clients' tokens are stripped, so the configured key is
    too, from the args and from SPECSERVE_API_KEY alike (it locked every client out); a blank one is an error."""
    for args, environ in (
        (AppArgs.model_validate({"api_key": " s3cret\n"}), {}),
        (AppArgs(), {API_KEY_ENV: "s3cret\n"}),
    ):
        options = args.http_options(environ=environ)
        assert options.api_key is not None and options.api_key.get_secret_value() == "s3cret"
        with api_server(backend, **options.model_dump()) as url:
            r = httpx.post(url + COMPLETIONS, json=OK_BODY, headers={"authorization": "Bearer s3cret"})
            assert r.status_code == 200, r.text
    with pytest.raises(ValueError, match=f"{API_KEY_ENV} is empty"):
        AppArgs().http_options(environ={API_KEY_ENV: " \n"})
    with pytest.raises(ValueError, match="api_key is empty"):
        AppArgs.model_validate({"api_key": "\t\n"})
    with pytest.raises(ValueError, match="api_key is empty"):
        HTTPOptions(api_key=SecretStr(" "))


def test_a_body_without_a_content_type_is_refused_before_the_app_whatever_fastapis_version() -> None:
    """A page's no-cors fetch posts a JSON body with no Content-Type (no preflight), and FastAPI before its
    strict_content_type parsed such a body as JSON: a keyless server on loopback spent its compute on any page's
    requests. The guard refuses it before the app sees it."""
    from specserve.api.http_guard import RequestGuard
    from specserve.api.metrics import ServeMetrics

    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guarded = RequestGuard(app, HTTPOptions(), ServeMetrics())
    transport = httpx.ASGITransport(app=guarded)

    async def post(headers: dict[str, str]) -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.post(COMPLETIONS, content=json.dumps(OK_BODY).encode(), headers=headers)

    r = asyncio.run(post({}))
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json") and "(got none)" in r.text
    assert reached == []
    assert asyncio.run(post({"content-type": "application/json"})).status_code == 200 and reached == [COMPLETIONS]


def test_a_path_with_a_trailing_slash_is_a_404_with_an_error_body(backend: LocalBackend) -> None:
    """Starlette redirected it (a bare 307 to a Location built from the client's Host header, http:// behind a TLS
    proxy, outside the error shape and the request counts)."""
    with api_server(backend) as url:
        for method, path in (("POST", COMPLETIONS + "/"), ("POST", "/v1/chat/completions/"), ("GET", "/metrics/")):
            r = httpx.request(method, url + path, json=OK_BODY if method == "POST" else None)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found"), r.text
            assert "location" not in r.headers


def test_debug_routes_only_when_enabled(backend: LocalBackend) -> None:
    with api_server(backend) as url:
        assert httpx.get(url + "/debug/lanes").status_code == 404
        assert "/debug/lanes" not in httpx.get(url + "/openapi.json").json()["paths"]
    with api_server(backend, debug_routes=True) as url:
        assert httpx.get(url + "/debug/lanes").json() == {"running": 0, "waiting": 0}
    assert not AppArgs().debug_routes


def test_single_machine_configs_bind_loopback() -> None:
    """`serve run` on one machine listens on 127.0.0.1; only the cluster configs bind every interface."""
    for path in ("deployments/app.yaml", "deployments/app-tiny.yaml"):
        doc = yaml.safe_load((REPO / path).read_text())
        assert doc["http_options"]["host"] == "127.0.0.1", path
        for app in doc["applications"]:
            args = AppArgs.model_validate(app["args"])
            assert not args.debug_routes and args.api_key is None, path


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions"])
def test_a_body_that_is_not_a_json_object_is_named_as_such(backend: LocalBackend, path: str) -> None:
    """Every way a body can fail to be a JSON object is a 400 with code invalid_json and a message saying which:
    bytes that are not UTF-8 (FastAPI's own 'error parsing the body' had no code), an empty body, a JSON array, or
    JSON sent under another Content-Type (as `curl -d` does), which FastAPI does not parse at all."""
    json_ct = {"content-type": "application/json"}
    cases = [
        (b'\xff\xfe{"model": "tiny"}', json_ct, "not valid JSON"),
        # JSON text in UTF-16 or UTF-32 (json.loads reads bytes in any of them): a 200 before
        *((json.dumps(OK_BODY).encode(enc), json_ct, "UTF-16 or UTF-32") for enc in ("utf-16", "utf-16-le", "utf-32")),
        (b'{"model":', json_ct, "not valid JSON"),
        (b"", json_ct, "empty"),
        (b"[1, 2]", json_ct, "must be a JSON object"),
        (b'{"model": "tiny", "prompt": "a"}', {"content-type": "application/x-www-form-urlencoded"}, "Content-Type"),
        (b'{"model": "tiny", "prompt": "a"}', {"content-type": "text/plain"}, "text/plain"),
    ]
    with api_server(backend) as url:
        for content, headers, words in cases:
            r = httpx.post(url + path, content=content, headers=headers)
            error = _error(r, 400, "invalid_json")
            assert words in str(error["message"]), (content, error)
        assert httpx.post(url + path, json=OK_BODY if path == COMPLETIONS else CHAT_OK).status_code == 200


class _BreaksAfterOneOutput:
    """An admitted request's stream that fails (a bug, not an APIError) after its first output."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        self.stream = stream

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        async for out in self.stream:
            yield out
            raise RuntimeError("boom")

    async def aclose(self) -> None:
        await self.stream.aclose()


class _BrokenBackend(LocalBackend):
    async def submit(self, request):  # type: ignore[no-untyped-def]
        return _BreaksAfterOneOutput(await super().submit(request))

    def health(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("health is broken")


class _InternalValidationBackend(LocalBackend):
    async def submit(self, request):  # type: ignore[no-untyped-def]
        SpecConfig(budget=1)  # a settings object the server builds wrongly: pydantic raises, as a bug would


def test_an_internal_pydantic_error_is_a_500_counted_once_as_failed() -> None:
    """A pydantic ValidationError raised inside the server (not from the request body) became a 400 naming the
    settings object's field, and the request was counted both failed and invalid."""
    backend = _InternalValidationBackend()
    try:
        with api_server(backend) as url:
            resp = httpx.post(url + COMPLETIONS, json={**OK_BODY, "max_tokens": 8})
            assert resp.status_code == 500, resp.text
            error = resp.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "internal_error", error
            assert "budget" not in error["message"], error
            assert requests_by_status(backend) == {"failed": 1.0}
    finally:
        backend.stop()


def test_a_request_that_fails_inside_is_counted_once_and_a_stream_gets_an_error_event() -> None:
    """A bug after admission counted a request both aborted (its stream's close) and failed (the 500 handler); a
    stream ended with neither an error event nor [DONE]; and any route's 500 (here /health) counted as a failed
    generation request."""
    backend = _BrokenBackend()
    try:
        with api_server(backend) as url:
            plain = httpx.post(url + COMPLETIONS, json={**OK_BODY, "max_tokens": 8})
            assert plain.status_code == 500 and plain.json()["error"]["code"] == "internal_error"
            streamed = httpx.post(url + COMPLETIONS, json={**OK_BODY, "max_tokens": 8, "stream": True})
            events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
            assert streamed.status_code == 200 and events[-1] != "[DONE]"
            error = json.loads(events[-1])["error"]
            assert error["type"] == "server_error" and error["code"] == "internal_error", error
            assert httpx.get(url + "/health").status_code == 500
            assert requests_by_status(backend) == {"failed": 2.0}
    finally:
        backend.stop()


def test_a_keyless_server_answers_only_requests_for_its_loopback_names(backend: LocalBackend) -> None:
    """DNS rebinding: a web page whose own name its script then resolves to 127.0.0.1 reached a keyless local server
    through the visitor's browser (generations, /metrics). Without a key, only the loopback names (or those in
    ``allowed_hosts``) are served; with a key any Host is, the key being what a page cannot send."""

    def status(url: str, host: str, **headers: str) -> tuple[int, str | None]:
        r = httpx.post(url + COMPLETIONS, json=OK_BODY, headers={"Host": host, **headers}, timeout=30)
        return r.status_code, r.json().get("error", {}).get("code")

    with api_server(backend) as url:
        for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"):
            assert status(url, host) == (400, "invalid_host"), host
        # an address in Host is no page's own name: any is served (a node's, a pod's)
        for host in ("localhost", "LOCALHOST.:8000", "127.0.0.1:80", "[::1]:8000", "::1", "10.1.2.3:8000"):
            assert status(url, host) == (200, None), host
        assert httpx.get(url + "/health", headers={"Host": "evil.example"}).status_code == 200  # open, as without
        # a key it always is
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps(OK_BODY).encode()
        for hosts in (("evil.example", "localhost"), ("localhost", "localhost")):  # two Hosts: the last was read
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                head = "".join(f"Host: {h}\r\n" for h in hosts)
                sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\n{head}Content-Type: application/json\r\n".encode())
                sock.sendall(f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                response = b""
                while chunk := sock.recv(65536):
                    response += chunk
            assert response.startswith(b"HTTP/1.1 400") and b"invalid_host" in response, (hosts, response[:200])
    with api_server(backend, allowed_hosts=("API.example.",)) as url:
        assert status(url, "api.example:443") == (200, None) and status(url, "localhost")[0] == 400
    with api_server(backend, allowed_hosts=("*",)) as url:
        assert status(url, "evil.example") == (200, None)
    with api_server(backend, api_key=SecretStr("k")) as url:
        assert status(url, "evil.example", Authorization="Bearer k") == (200, None)
        assert status(url, "evil.example") == (401, "invalid_api_key")
    args = AppArgs.model_validate({"allowed_hosts": ["[::1]", "Api.Example"]})
    assert args.http_options(environ={}).allowed_hosts == ("::1", "api.example")
    assert AppArgs().http_options(environ={}).allowed_hosts == ("localhost", "127.0.0.1", "::1")
    with pytest.raises(ValueError, match="empty name"):
        HTTPOptions(allowed_hosts=(" ",))
    for odd in ("localhost:8000", "*.example"):  # they could never match: a name is compared without its port
        with pytest.raises(ValueError, match="without a port or wildcard"):
            HTTPOptions(allowed_hosts=(odd,))
        # refused when the config is read: a replica's start checks its HTTP options only after loading the models
        with pytest.raises(ValueError, match="without a port or wildcard"):
            AppArgs.model_validate({"allowed_hosts": [odd]})
    assert HTTPOptions(allowed_hosts=("[::1]", "*")).allowed_hosts == ("::1", "*")
