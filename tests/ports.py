"""Local ports for test servers, and a Serve app on one."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BIND_ATTEMPTS = 5
REPO = Path(__file__).resolve().parents[1]  # Ray workers import `deployments` from here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve_on_free_port(**serve_options: Any) -> int:
    """``serve.start`` on a loopback port nobody holds; returns the port.

    A port found free can be taken before Serve's proxy binds it (Ray's own processes open outgoing connections from
    the same ephemeral range), so a failed bind is retried on a fresh port.
    """
    from ray import serve

    for attempt in range(BIND_ATTEMPTS):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port}, **serve_options)
            return port
        except Exception as e:
            if "Failed to bind" not in str(e) or attempt == BIND_ATTEMPTS - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


@contextmanager
def serve_app(app: Any, *, name: str, route_prefix: str, **ray_init: Any) -> Iterator[str]:
    """A fresh Ray (``ray.init(**ray_init)``), Serve on a free loopback port and ``app`` at ``route_prefix``;
    yields the app's base URL and shuts both down after."""
    import ray
    from ray import serve
    from ray.job_config import JobConfig

    ray_init.setdefault("address", "local")  # a new Ray even where another runs on this machine
    ray.init(include_dashboard=False, job_config=JobConfig(code_search_path=[str(REPO)]), **ray_init)
    try:
        port = start_serve_on_free_port()
        serve.run(app, name=name, route_prefix=route_prefix)
        yield f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}"
    finally:
        serve.shutdown()
        ray.shutdown()
