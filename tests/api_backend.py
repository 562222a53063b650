"""The HTTP API in-process: a Backend over one Lane (the Serve router's StepLoop thread) on tiny models, served by
uvicorn on a free loopback port, so tests talk real HTTP (partial bodies, disconnects) without Ray."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from deployments.lane import Lane, LaneStream
from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.error_bodies import OverloadedError
from specserve.api.http_guard import HTTPOptions
from specserve.api.metrics import ServeMetrics
from specserve.api.schemas import Health, HealthStatus
from specserve.api.server import build_api
from specserve.config import SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from specserve.prompts import PromptEncoder
from specserve.sequence import Request

MODEL = "tiny"
SPEC = SpecConfig(method=SpecMethod.chain, sl=4)


class LocalDebug(BaseModel):
    running: int
    waiting: int


class LocalBackend:
    def __init__(
        self,
        *,
        max_model_len: int = 128,
        max_batch_size: int = 2,
        capacity: int = 8,
        step_delay_s: float = 0.0,
        tokenizer: PreTrainedTokenizerBase | None = None,
        speculation: SpecConfig = SPEC,
    ) -> None:
        self.speculation = speculation
        target = tiny_model(tiny_config(), seed=0)
        draft = noisy_copy(target, 0.02, seed=1)
        self.engine = Engine(
            target,
            tiny_tokenizer() if tokenizer is None else tokenizer,
            draft=draft,
            speculation=speculation,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
        )
        self.capacity = capacity
        self._metrics = ServeMetrics()
        self.lane = Lane(
            0,
            self.engine.loop,
            {},
            None,  # type: ignore[arg-type]  # no worker actors to recreate in-process
            None,  # type: ignore[arg-type]
            metrics=self._metrics,
            max_worker_restarts=0,
            step_delay_s=step_delay_s,
        )

    @property
    def model_name(self) -> str:
        return MODEL

    @property
    def max_model_len(self) -> int:
        return self.engine.loop.max_model_len

    @property
    def encoder(self) -> PromptEncoder:
        return self.engine.encoder

    @property
    def default_speculation(self) -> SpecConfig:
        return self.speculation

    @property
    def metrics(self) -> ServeMetrics:
        return self._metrics

    @property
    def most_capacity(self) -> int:
        return self.capacity

    def check_capacity(self, *, pending: int = 0) -> None:
        if self.lane.in_flight + pending >= self.capacity:
            raise OverloadedError("at capacity", retry_after_s=1)

    async def submit(self, request: Request) -> LaneStream:
        self.check_capacity()
        return await self.lane.submit(request)

    def health(self) -> Health:
        return Health(status=HealthStatus.ok, lanes=1, lanes_alive=1)

    async def debug_state(self) -> LocalDebug:
        return LocalDebug(running=len(self.engine.loop.running), waiting=len(self.engine.loop.waiting))

    def stop(self) -> None:
        self.lane.stop()


class LeavingClient:
    """An ASGI ``receive`` whose client leaves after 10 ms; the handler's task (``task``, set once made) is then
    cancelled ``hops`` turns of the loop later, as Serve cancels the handler of a client that left."""

    def __init__(self, hops: int) -> None:
        self.hops = hops
        self.task: asyncio.Future[Any] | None = None

    async def __call__(self) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        self._cancel_after(self.hops)
        return {"type": "http.disconnect"}

    def _cancel_after(self, n: int) -> None:
        if n == 0:
            assert self.task is not None
            self.task.cancel()
        else:
            asyncio.get_running_loop().call_soon(self._cancel_after, n - 1)


def requests_by_status(backend: LocalBackend) -> dict[str, float]:
    """specserve_requests_total by its status label, as the backend's metrics render it."""
    found = {}
    for line in backend.metrics.render().decode().splitlines():
        if line.startswith('specserve_requests_total{status="'):
            found[line.split('"')[1]] = float(line.split()[-1])
    return found


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a thread; yields its base URL."""
    sock = socket.socket()  # bound here and handed over: a port found free, then bound by uvicorn, may be taken between
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def api_server(backend: LocalBackend, **options: Any) -> Iterator[str]:
    with serving(build_api(backend, HTTPOptions(**options))) as url:
        yield url


def module_server(**backend_args: Any) -> tuple[Any, Any]:
    """A test module's ``backend`` (a LocalBackend of ``backend_args``) and ``url`` (the API served over it)
    fixtures, one of each per module: ``backend, url = module_server(max_model_len=128)``."""

    @pytest.fixture(scope="module")
    def backend() -> Iterator[LocalBackend]:
        local = LocalBackend(**backend_args)
        yield local
        local.stop()

    @pytest.fixture(scope="module")
    def url(backend: LocalBackend) -> Iterator[str]:
        with api_server(backend) as served:
            yield served

    return backend, url
