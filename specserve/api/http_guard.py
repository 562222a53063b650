"""What the HTTP layer checks before a request reaches a route: the API key, the body's size and how long the
client may take to send it. A pure ASGI middleware, so a slow or huge body never reaches JSON parsing and never
holds the event loop: ``/health`` answers whatever the other connections send. It runs once the server has a
request's whole head: a connection that never completes one is the HTTP server's (or a proxy's) to time out.

Every 503 it lets out carries a ``Retry-After`` (``HTTPOptions.unavailable_retry_after_s``), whichever route or
handler sent it: a 429's own estimate is the router's, a 503 (a lane that lost its workers, failovers used up, a
failing /health) has none of its own.

It also turns a failing ``receive`` (Ray Serve raises when its proxy dropped a request whose client went away)
into the ``http.disconnect`` the ASGI spec promises, so a client that leaves is an abort, not a server error.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from http import HTTPStatus

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.api.error_bodies import error_body
from specserve.api.metrics import RequestStatus, ServeMetrics
from specserve.api.schemas import ErrorCode, ErrorType

logger = logging.getLogger(__name__)

API_KEY_ENV = "SPECSERVE_API_KEY"
COMPLETIONS_PATH, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
GENERATION_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH})  # the requests specserve_requests_total counts
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})  # no key needed
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
WIDE_TEXT = "the request body is not valid JSON (UTF-8 text): it is UTF-16 or UTF-32"
NO_CONTENT_TYPE = "the request body must be a JSON object sent as Content-Type: application/json (got none)"
# a 503's Retry-After where nothing configures one: deployments' default worker_retry_s, the pause before a lane that
# lost its workers tries again to bring them back
UNAVAILABLE_RETRY_AFTER_S = 5
# a timeout's bound (30 days): far longer ones overflow the waits they reach (a thread's, a socket's, Ray's)
MAX_TIMEOUT_S = 30 * 24 * 3600.0
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # the Host names a keyless server answers by default


class HTTPOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_request_bytes: int = Field(default=4 * 2**20, ge=1, description="larger request bodies get a 413")
    body_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="a request body not fully received this long after the request started: 408",
    )
    api_key: SecretStr | None = Field(
        default=None, description="clients send `Authorization: Bearer <key>`; None: no authentication"
    )

    @field_validator("api_key")
    @classmethod
    def _key(cls, key: SecretStr | None) -> SecretStr | None:
        return checked_api_key(key)

    debug_routes: bool = Field(default=False, description="serve /debug/* (actor names, node ids, KV slots)")
    allowed_hosts: tuple[str, ...] = Field(
        default=LOOPBACK_HOSTS,
        description="without an api_key, the Host names served besides addresses (a web page whose own name its "
        "script rebinds to 127.0.0.1 would reach a keyless local server through the browser); '*': any. With a key: "
        "any",
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        return checked_hosts(hosts)

    unavailable_retry_after_s: int = Field(
        default=UNAVAILABLE_RETRY_AFTER_S, ge=1, description="the Retry-After header of every 503, in seconds"
    )


def checked_hosts(hosts: tuple[str, ...]) -> tuple[str, ...]:
    """Host names as the check compares them (lower case, no brackets, no trailing dot); a port or a wildcard in
    a name could never match and is refused."""
    names = tuple(h.strip().lower().removeprefix("[").removesuffix("]").rstrip(".") for h in hosts)
    if not all(names):
        raise ValueError("allowed_hosts holds an empty name")
    odd = [n for n in names if n != "*" and ("*" in n or (":" in n and not _is_ip(n)))]
    if odd:
        raise ValueError(f"allowed_hosts are names without a port or wildcard (or '*' alone): {odd}")
    return names


def checked_api_key(key: SecretStr | None, source: str = "api_key") -> SecretStr | None:
    """The key without the whitespace around it (a secret file's trailing newline: clients' tokens are stripped
    too, so it would lock every one of them out); a blank one is refused, as it would switch authentication off."""
    if key is None:
        return None
    stripped = key.get_secret_value().strip()
    if not stripped:
        raise ValueError(f"{source} is empty: give a key, or leave it unset for a server without authentication")
    return SecretStr(stripped)


class RequestGuard:
    """ASGI middleware enforcing HTTPOptions; rejections are OpenAI-style error bodies."""

    def __init__(self, app: ASGIApp, options: HTTPOptions, metrics: ServeMetrics) -> None:
        self.app = app
        self.options = options
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive = _disconnect_on_error(receive)
        send = _retry_after_on_503(send, self.options.unavailable_retry_after_s)
        if not self._host_allowed(scope):
            body = error_body(
                "without an API key this server answers only requests whose Host is an address or in its allowed_hosts",
                ErrorType.invalid_request,
                code=ErrorCode.invalid_host,
            )
            await self._refuse(scope, send, HTTPStatus.BAD_REQUEST, body)
            return
        if not self._authorized(scope):
            body = error_body(
                "a valid API key is required: send `Authorization: Bearer <key>`",
                ErrorType.invalid_request,
                code=ErrorCode.invalid_api_key,
            )
            await self._refuse(scope, send, HTTPStatus.UNAUTHORIZED, body, [(b"www-authenticate", b"Bearer")])
            return
        if scope["method"] in BODY_METHODS:
            try:
                content = await self._read_body(scope, receive)
            except _Rejected as rejected:
                await self._refuse(scope, send, rejected.status, rejected.body)
                return
            if content is None:  # the client left before it finished sending
                return
            problem = _not_json(content, scope)
            if problem is not None:
                body = error_body(problem, ErrorType.invalid_request, code=ErrorCode.invalid_json)
                await self._refuse(scope, send, HTTPStatus.BAD_REQUEST, body)
                return
            receive = _replay(content, receive)
        await self.app(scope, receive, send)

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        status: HTTPStatus,
        body: BaseModel,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        if scope["method"] == "POST" and _route_path(scope) in GENERATION_PATHS:  # the counter is of generation
            self.metrics.request_done(RequestStatus.invalid)  # requests, as routed ones (a GET there is a 405)
        await _send_error(send, status, body, headers)

    def _host_allowed(self, scope: Scope) -> bool:
        allowed = self.options.allowed_hosts
        if self.options.api_key is not None or "*" in allowed or _route_path(scope) in OPEN_PATHS:
            return True
        hosts = [value for key, value in scope["headers"] if key == b"host"]
        if not hosts:  # not a browser's request
            return True
        if len(hosts) > 1:  # (RFC 9112 §3.2: a 400; the last had been read, the first may be what routed it)
            return False
        name = host_name(hosts[0])
        return name in allowed or _is_ip(name)  # (rebinding takes a name: an address in Host is no page's own)

    def _authorized(self, scope: Scope) -> bool:
        # (the open paths are open to reading: a body sent to one without the key is not read, it held a request
        # slot for the whole body timeout)
        if self.options.api_key is None or (_route_path(scope) in OPEN_PATHS and scope["method"] not in BODY_METHODS):
            return True
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        expected = self.options.api_key.get_secret_value().encode()
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.options.max_request_bytes
        too_large = _Rejected(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is larger than this server's limit of {limit} bytes",
            ErrorCode.request_too_large,
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():  # (the server has checked it against the body)
            digits = declared.lstrip(b"0")  # int() refuses more than 4300 digits, and leading zeros are allowed
            if len(digits) > len(str(limit)) or int(digits or b"0") > limit:
                raise too_large  # before reading a byte of it
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.options.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise _Rejected(
                HTTPStatus.REQUEST_TIMEOUT,
                f"the request body was not received within {self.options.body_timeout_s:g} s",
                ErrorCode.request_timeout,
            ) from None


class _Rejected(Exception):
    def __init__(self, status: HTTPStatus, message: str, code: ErrorCode) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, ErrorType.invalid_request, code=code)


def host_name(header: bytes) -> str:
    """A Host header's name, without its port, lower-cased, without a trailing dot ("[::1]:8000" -> "::1")."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].partition("]")[0]
    if _is_ip(text):  # a bare IPv6 address
        return text
    return text.partition(":")[0].rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _route_path(scope: Scope) -> str:
    """The path inside the app: Serve mounts an application under its route prefix (the ASGI root_path)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return (path[len(root) :] or "/") if root and path.startswith(root) else path


def _disconnect_on_error(receive: Receive) -> Receive:
    async def guarded() -> Message:
        try:
            return await receive()
        except Exception as e:  # the transport to the client is gone: for the app, the client disconnected
            logger.debug("receive failed (%s): treating it as a client disconnect", type(e).__name__)
            return {"type": "http.disconnect"}

    return guarded


def _retry_after_on_503(send: Send, seconds: int) -> Send:
    """``send`` with a Retry-After added to a 503 response that has none."""
    header = (b"retry-after", str(seconds).encode())

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] == HTTPStatus.SERVICE_UNAVAILABLE:
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"retry-after" for name, _ in headers):
                message = {**message, "headers": [*headers, header]}
        await send(message)

    return sending


def _replay(content: bytes, receive: Receive) -> Receive:
    """The body read up front, then the client's own messages (a streaming response listens for its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": content, "more_body": False}
        return await receive()

    return replay


async def _send_error(
    send: Send, status: HTTPStatus, body: BaseModel, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    payload = body.model_dump_json().encode()
    await send(
        {
            "type": "http.response.start",
            "status": int(status),
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),  # the rest of an unread body must not be parsed as the next request
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def _not_json(content: bytes, scope: Scope) -> str | None:
    """Why a body is no JSON for the app to parse, or None: text in UTF-16 or UTF-32 (json.loads takes bytes in any
    of them, as a byte order mark or a zero byte in the first four tells; RFC 8259's JSON is UTF-8), or a body with
    no Content-Type (a page's no-cors fetch sends none: no preflight, and an address in Host passes the rebinding
    check; FastAPI before its strict_content_type parsed it as JSON, whatever the version installed)."""
    if content[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in content[:4]:
        return WIDE_TEXT
    if content and not any(key == b"content-type" for key, _ in scope["headers"]):
        return NO_CONTENT_TYPE
    return None
