"""Memory this host can give the process: what refuses a KV cache or a benchmark that would not fit (the kernel's
OOM killer, otherwise, once the lazily committed pages are written)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from specserve.errors import KVCapacityError
from specserve.models.memory import GIB


def host_available_bytes() -> int:
    """Memory the host can give this process without swapping (Linux's MemAvailable; sysconf elsewhere), or less
    where a cgroup's memory limit (a container's) leaves less."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        available = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), available)
    limited = cgroup_free_bytes()
    return available if limited is None else min(available, limited)


NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def cgroup_free_bytes(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> int | None:
    """Limit minus usage of the tightest memory limit on this process's cgroup and its ancestors, cgroup v2
    (``memory.max``, ``memory.current``) or v1 (``memory/memory.limit_in_bytes``, ``memory.usage_in_bytes``), usage
    less the reclaimable page cache (``memory.stat``); None where none is set or none can be read."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2, mounted at the root or, on hybrid hosts, at root/unified
            layouts = [(base, "memory.max", "memory.current", "inactive_file") for base in (root, root / "unified")]
        elif "memory" in controllers.split(","):
            layouts = [(root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")]
        else:
            continue
        for base, limit_name, usage_name, cache_name in layouts:
            here = base / path.strip("/")
            for folder in [here, *(p for p in here.parents if p == base or base in p.parents)]:  # up to the mount
                with contextlib.suppress(OSError, ValueError):
                    limit = (folder / limit_name).read_text().strip()
                    if limit != "max" and int(limit) < NO_LIMIT:
                        used = max(
                            0, int((folder / usage_name).read_text()) - _stat(folder / "memory.stat", cache_name)
                        )
                        found.append(max(0, int(limit) - used))
    return min(found) if found else None


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat (0 where unreadable): usage counts the page cache, which the kernel
    reclaims before it kills, so its inactive file pages (a checkpoint just read) are subtracted, as Docker and
    cAdvisor do."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return max(0, int(value))
    return 0


def check_host_fits(kv_bytes: int, slots: int, max_len: int, *, available: int, activation_bytes: int = 0) -> None:
    """Refuse a CPU KV cache (with its slots' shares of a step's activations) larger than the memory available:
    zeroing the cache commits its pages at once, so the kernel's OOM killer would end the process at start without
    a word, or, with the cache alone fitting, at its first full batch of whole-prompt prefills."""
    if kv_bytes + activation_bytes > available:
        also = f" and {activation_bytes / GIB:.1f} GiB for a step's activations" if activation_bytes else ""
        raise KVCapacityError(
            f"a KV cache of {slots} slots x {max_len} tokens needs {kv_bytes / GIB:.1f} GiB{also}; this host has "
            f"{available / GIB:.1f} GiB available: lower max_batch_size or max_model_len"
        )
