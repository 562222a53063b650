"""Local ports for test servers."""

from __future__ import annotations

import socket
from typing import Any

BIND_ATTEMPTS = 5


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
