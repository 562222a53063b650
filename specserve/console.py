"""The commands' console: text its encoding cannot hold (an ASCII or Latin-1 locale, ``PYTHONIOENCODING=ascii``)
is written escaped while a command runs, not raised as UnicodeEncodeError mid-line."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def console_safe() -> Iterator[None]:
    """sys.stdout and sys.stderr write ``\\xe9`` for what they cannot encode, until the block ends (a caller running a
    command in-process gets its streams back as they were)."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
            changed.append(stream)
    try:
        yield
    finally:
        for stream in changed:
            with contextlib.suppress(OSError, ValueError):  # (a reader gone away, a stream closed meanwhile)
                stream.reconfigure(errors="strict")
