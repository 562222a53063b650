"""What CPU this is, read from the system (never assumed): its model name and the feature flags it reports."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo where there is one, else what ``platform`` says and no flags."""
    model, flags = platform.processor() or platform.machine(), frozenset[str]()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model.startswith(value.strip()):
                model = value.strip()
            elif key.strip() == "flags":
                flags = frozenset(value.split())
    return model, flags
