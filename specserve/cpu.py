"""What CPU this is, read from the system (never assumed): its model name and the feature flags it reports."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from pathlib import Path

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ARM_PART_KEYS = ("CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision")


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo where there is one, else what ``platform`` says and no flags. Arm
    kernels print no model name and call the flags ``Features``: there the name is the machine and the core's
    implementer / part ids (Neoverse N1 and V1 differ in them)."""
    model, flags = platform.processor() or platform.machine(), frozenset[str]()
    named = False
    part: dict[str, str] = {}
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and not named:
                model, named = (model if model.startswith(value) else value), True
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
            elif key in ARM_PART_KEYS:
                part.setdefault(key, value)
    if not named and part:
        model = f"{model} " + " ".join(f"{k.removeprefix('CPU ')} {part[k]}" for k in ARM_PART_KEYS if k in part)
    return model, flags


def thp_mode(setting: Path = THP_SETTING) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``; None: not Linux, or unreadable):
    the bracketed word of ``always [madvise] never``."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages(environ: Mapping[str, str] = os.environ, setting: Path = THP_SETTING) -> str:
    """Whether torch's large CPU allocations get huge pages here, e.g. 'huge pages on (THP madvise)': torch asks for
    them (``madvise``) when THP_MEM_ALLOC_ENABLE is 1 before its first allocation (off unless the environment
    sets it: docs/benchmarks.md, "Huge pages for the weights and caches"); the kernel grants them in
    ``madvise`` mode only to those who ask, in ``always`` mode to every large allocation."""
    mode = thp_mode(setting)
    if mode is None or mode == "never":
        return f"huge pages off (THP {mode or 'unknown'})"
    asked = environ.get("THP_MEM_ALLOC_ENABLE") == "1"  # torch reads "1" and "0" alone (it ignores "true", " 1")
    return f"huge pages {'on' if asked or mode == 'always' else 'off'} (THP {mode})"
