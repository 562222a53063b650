"""What CPU this is, read from the system (never assumed): its model name and the feature flags it reports."""

from __future__ import annotations

import platform
from pathlib import Path

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
