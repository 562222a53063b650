"""Which machine a figure was taken on: CPU model and the vector extensions torch can use (never assumed)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from specserve.cpu import cpu_info
from specserve.errors import SettingsError

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_summary() -> str:
    """e.g. 'Intel(R) Xeon(R) Processor, 2 cores, avx2 avx512f avx512_bf16 amx_bf16, torch 2.13.0 (2 threads)'."""
    model, flags = cpu_info()
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2/AVX-512 flags seen"
    usable, host = len(os.sched_getaffinity(0)), os.cpu_count()  # a cpuset or taskset leaves fewer than the host's
    cores = f"{usable} cores" if usable == host else f"{usable} of {host} cores"
    return f"{model}, {cores}, {isa}, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def device_summary(device: str | torch.device) -> str:
    """The CPU summary, led by the accelerator's name and CUDA version where ``device`` is one."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"CPU: {cpu_summary()}"
    name = torch.cuda.get_device_name(dev)
    return f"GPU: {name}, CUDA {torch.version.cuda}; host CPU: {cpu_summary()}"


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
    (``memory.max``, ``memory.current``) or v1 (``memory/memory.limit_in_bytes``, ``memory.usage_in_bytes``); None
    where none is set or none can be read."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2, mounted at the root or, on hybrid hosts, at root/unified
            layouts = [(base, "memory.max", "memory.current") for base in (root, root / "unified")]
        elif "memory" in controllers.split(","):
            layouts = [(root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]
        else:
            continue
        for base, limit_name, usage_name in layouts:
            here = base / path.strip("/")
            for folder in [here, *(p for p in here.parents if p == base or base in p.parents)]:  # up to the mount
                with contextlib.suppress(OSError, ValueError):
                    limit = (folder / limit_name).read_text().strip()
                    if limit != "max" and int(limit) < NO_LIMIT:
                        found.append(max(0, int(limit) - int((folder / usage_name).read_text())))
    return min(found) if found else None


def check_fits(nbytes: int, what: str) -> None:
    """Refuse a benchmark whose arguments ask for more than half the memory available (an allocator traceback, or
    the kernel's OOM killer, otherwise)."""
    limit = host_available_bytes() // 2
    if nbytes > limit:
        raise SettingsError(
            f"{what} needs ~{nbytes / 2**30:.1f} GiB, more than half the {2 * limit / 2**30:.1f} GiB available here"
        )
