"""Locust users that stream OpenAI chat completions from a specserve deployment and record TTFT, TPOT, ITL and
output tokens as custom Locust metrics (rows TTFT / TPOT / ITL / E2E / TOKENS in the stats CSV).

    .venv/bin/python -m locust -f load/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000 \
        --csv bench_out/locust/run --only-summary

Settings come from environment variables (see ``LoadSettings``), e.g. SPECSERVE_CATEGORIES=coding:3,writing:1
SPECSERVE_MAX_TOKENS=64. Only loopback hosts are accepted unless SPECSERVE_ALLOW_REMOTE=1.

Rows: TTFT, TPOT, ITL and E2E hold milliseconds; TOKENS holds output tokens per request in its "response time"
columns (so its percentiles are token-count percentiles). Names are the MT-bench categories.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from enum import Enum
from typing import Any

from locust import HttpUser, between, events, task
from locust.env import Environment
from pydantic import BaseModel, ConfigDict, Field

from load.sse import RemoteHostError, StreamStats, check_loopback, parse_sse_line
from specserve.bench.prompts import BenchPrompt, mt_bench_prompts

DEFAULT_HOST = "http://127.0.0.1:8000"
CHAT_PATH = "/v1/chat/completions"


class Metric(str, Enum):
    ttft = "TTFT"
    tpot = "TPOT"
    itl = "ITL"
    e2e = "E2E"
    tokens = "TOKENS"


class SpecPolicyOverride(str, Enum):
    """Per-request ``speculation`` extension; ``server`` sends none (the deployment's default applies)."""

    server = "server"
    none = "none"
    static = "static"
    dsde = "dsde"


class LoadSettings(BaseModel):
    """What each simulated user sends. ``from_env`` reads SPECSERVE_<FIELD> (upper case) variables."""

    model_config = ConfigDict(frozen=True)

    categories: dict[str, float] = Field(default_factory=dict, description="category -> weight; empty: all")
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    ignore_eos: bool = True  # fixed output lengths make runs comparable
    model: str | None = None  # None: the first id of GET /v1/models
    policy: SpecPolicyOverride = SpecPolicyOverride.server
    record_itl: bool = True
    seed: int = 0
    timeout_s: float = Field(default=300.0, gt=0.0)
    wait_min_s: float = Field(default=0.0, ge=0.0)
    wait_max_s: float = Field(default=0.5, ge=0.0)

    @staticmethod
    def parse_categories(spec: str) -> dict[str, float]:
        """``coding,math`` (equal weights) or ``coding:3,writing:1``."""
        out: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, weight = part.partition(":")
            out[name.strip()] = float(weight) if weight else 1.0
        return out

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> LoadSettings:
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(f"SPECSERVE_{name.upper()}")
            if raw is None or raw == "":
                continue
            values[name] = cls.parse_categories(raw) if name == "categories" else raw
        return cls.model_validate(values)

    def prompt_pool(self) -> dict[str, list[BenchPrompt]]:
        prompts = mt_bench_prompts(categories=list(self.categories) or None)
        pool: dict[str, list[BenchPrompt]] = {}
        for p in prompts:
            pool.setdefault(p.category, []).append(p)
        unknown = set(self.categories) - set(pool)
        if unknown:
            known = sorted({p.category for p in mt_bench_prompts()})
            raise ValueError(f"unknown MT-bench categories {sorted(unknown)}; known: {known}")
        return pool

    def body(self, prompt: BenchPrompt, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.policy != SpecPolicyOverride.server:
            body["speculation"] = {"policy": self.policy.value}
        return body


@events.init.add_listener
def _refuse_remote_hosts(environment: Environment, **_: Any) -> None:
    try:
        check_loopback(environment.host or SpecServeUser.host)
    except RemoteHostError as e:
        logging.error("%s", e)
        sys.exit(2)  # SystemExit passes through Locust's event hook


def _fire(env: Environment, metric: Metric, name: str, value: float, length: int = 0) -> None:
    env.events.request.fire(
        request_type=metric.value, name=name, response_time=value, response_length=length, exception=None, context={}
    )


class SpecServeUser(HttpUser):
    host = DEFAULT_HOST
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        self.settings = LoadSettings.from_env()
        self.wait_time = between(self.settings.wait_min_s, self.settings.wait_max_s)
        self.pool = self.settings.prompt_pool()
        self.rng = random.Random(self.settings.seed * 1_000_003 + id(self) % 1_000_003)
        self.model = self.settings.model or self._served_model()

    def _served_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as resp:
            try:
                return str(resp.json()["data"][0]["id"])
            except (ValueError, KeyError, IndexError) as e:
                resp.failure(f"cannot read the served model from /v1/models: {e}")
                return "default"

    def _pick(self) -> BenchPrompt:
        names = list(self.pool)
        weights = [self.settings.categories.get(n, 1.0) for n in names]
        category = self.rng.choices(names, weights=weights)[0]
        return self.rng.choice(self.pool[category])

    @task
    def chat(self) -> None:
        prompt = self._pick()
        stats = StreamStats()
        t0 = time.perf_counter()
        with self.client.post(
            CHAT_PATH,
            json=self.settings.body(prompt, self.model),
            name=f"{CHAT_PATH} [stream]",
            stream=True,
            catch_response=True,
            timeout=self.settings.timeout_s,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                for line in resp.iter_lines():
                    event = parse_sse_line(line)
                    if event is not None:
                        stats.add(event, time.perf_counter() - t0)
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
