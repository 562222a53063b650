"""Locust users that stream OpenAI chat completions from a specserve deployment and record TTFT, TPOT, ITL and
output tokens as custom Locust metrics (rows TTFT / TPOT / ITL / E2E / TOKENS in the stats CSV).

    .venv/bin/python -m locust -f load/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000 \
        --csv bench_out/locust/run --only-summary

Settings come from environment variables (see ``LoadSettings``), e.g. SPECSERVE_CATEGORIES=coding:3,writing:1
SPECSERVE_MAX_TOKENS=64. Only loopback hosts are accepted unless SPECSERVE_ALLOW_REMOTE=1.

Rows: TTFT, TPOT, ITL and E2E hold milliseconds; TOKENS holds output tokens per request in its "response time"
columns (so its percentiles are token-count percentiles). Locust rounds the values it takes percentiles over
(docs/load.md); averages, min and max are exact. Names are the MT-bench categories.
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
import time
from collections.abc import Iterator
from enum import Enum
from typing import Any, ClassVar

from locust import HttpUser, events, task
from locust.env import Environment
from pydantic import ValidationError

from load.client import (
    LoadSettings,
    RemoteHostError,
    StreamStats,
    auth_headers,
    check_loopback,
    read_stream,
    sse_lines,
)
from specserve.bench.prompt_sets import BenchPrompt

DEFAULT_HOST = "http://127.0.0.1:8000"
CHAT_PATH = "/v1/chat/completions"


class Metric(str, Enum):
    ttft = "TTFT"
    tpot = "TPOT"
    itl = "ITL"
    e2e = "E2E"
    tokens = "TOKENS"


@events.init.add_listener
def _refuse_remote_hosts(environment: Environment, **_: Any) -> None:
    try:
        environment.host = check_loopback(environment.host or SpecServeUser.host)  # (the runners copy it to users)
    except RemoteHostError as e:
        logging.error("%s", e)
        sys.exit(2)  # SystemExit passes through Locust's event hook


@events.init.add_listener
def _check_settings(environment: Environment, **_: Any) -> None:
    """The SPECSERVE_* settings, checked once before any user starts (each user's on_start reads them again)."""
    try:
        LoadSettings.from_env().prompt_pool()
    except (ValueError, ValidationError) as e:  # ValidationError is a ValueError; named for the reader
        logging.error("bad SPECSERVE_* load settings: %s", e)
        sys.exit(2)


def _fire(env: Environment, metric: Metric, name: str, value: float, length: int = 0) -> None:
    env.events.request.fire(
        request_type=metric.value, name=name, response_time=value, response_length=length, exception=None, context={}
    )


def _http_error(resp: Any) -> str:
    if resp.status_code == 0:  # no response at all
        return f"connection failed: {resp.error}"
    return f"HTTP {resp.status_code}: {resp.text[:200]}"


def _arriving(resp: Any) -> Iterator[bytes]:
    """A streamed body's bytes as they arrive, whatever its framing: requests' ``iter_content(None)`` reads a body
    without chunked encoding whole (every event stamped at the end), and its ``iter_lines`` made an extra blank line
    of a CR LF split across two reads."""
    while chunk := resp.raw.read1(1 << 16, decode_content=True):
        yield chunk


class SpecServeUser(HttpUser):
    host = DEFAULT_HOST
    started: ClassVar[itertools.count[int]] = itertools.count()  # users started in this process, in order

    def on_start(self) -> None:
        self.settings = LoadSettings.from_env()
        self.pool = self.settings.prompt_pool()
        # the n-th user started in this process: the same seed gives the same prompt streams run to run (an object's
        # id() differs every run, so an A/B pair of runs saw different prompt mixes)
        self.rng = random.Random(self.settings.seed * 1_000_003 + next(SpecServeUser.started))
        self.model: str | None = self.settings.model  # None: asked of the server before the next request
        self.client.headers.update(auth_headers())  # a keyed deployment answered every request 401

    def wait_time(self) -> float:
        return self.rng.uniform(self.settings.wait_min_s, self.settings.wait_max_s)

    def _served_model(self) -> str | None:
        """The model the server serves; None (a failure recorded) while it cannot say, e.g. as it starts."""
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(_http_error(resp))
                return None
            try:
                return str(resp.json()["data"][0]["id"])
            except (ValueError, KeyError, IndexError, TypeError) as e:
                resp.failure(f"cannot read the served model from /v1/models: {e}")
                return None

    def _pick(self) -> BenchPrompt:
        names = list(self.pool)
        weights = [self.settings.categories.get(n, 1.0) for n in names]
        category = self.rng.choices(names, weights=weights)[0]
        return self.rng.choice(self.pool[category])

    @task
    def chat(self) -> None:
        model = self.model or self._served_model()
        if model is None:
            return  # asked again next time (a guessed name would fail every request of this user for good)
        self.model = model
        prompt = self._pick()
        t0 = time.perf_counter()
        with self.client.post(
            CHAT_PATH,
            json=self.settings.body(prompt, model),
            name=f"{CHAT_PATH} [stream]",
            stream=True,
            catch_response=True,
            timeout=self.settings.timeout_s,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(_http_error(resp))
                return
            try:
                stats = read_stream(sse_lines(_arriving(resp)), t0, self.settings.timeout_s)
            except Exception as e:  # connection reset mid-stream
                resp.failure(f"stream broken: {type(e).__name__}: {e}")
                return
            problem = stats.failure()
            if problem is not None:
                resp.failure(problem)
                return
            resp.success()
        self._record(prompt.category, stats)

    def _record(self, name: str, stats: StreamStats) -> None:
        env, tokens = self.environment, stats.output_tokens
        if stats.ttft_s is not None:
            _fire(env, Metric.ttft, name, stats.ttft_s * 1e3, tokens)
        if stats.tpot_s is not None:
            _fire(env, Metric.tpot, name, stats.tpot_s * 1e3, tokens)
        if self.settings.record_itl:
            for gap in stats.itl_s:
                _fire(env, Metric.itl, name, gap * 1e3)
        if stats.end_s is not None:
            _fire(env, Metric.e2e, name, stats.end_s * 1e3, tokens)
        _fire(env, Metric.tokens, name, float(tokens), tokens)
