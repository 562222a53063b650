"""Which machine a figure was taken on: CPU model and the vector extensions torch can use (never assumed)."""

from __future__ import annotations

import os

import torch

from specserve.cpu import cpu_info, huge_pages
from specserve.errors import SettingsError
from specserve.host_memory import host_available_bytes

# what the kernels choose by (csrc/int8_q4.cpp: AMX-INT8 + AMX-TILE, AVX512-VNNI on F/BW/VL, AVX2 + FMA), and Arm's
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "i8mm",
    "sve",
    "sve2",
)


def cpu_summary() -> str:
    """e.g. 'Intel(R) Xeon(R) Processor, 2 logical CPUs, avx2 avx512f avx512_bf16 amx_bf16, torch 2.13.0 (2
    threads), huge pages off (THP madvise)'. Logical CPUs: on a host with SMT two of them share a core."""
    model, flags = cpu_info()
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "no vector extension flags seen"
    usable, host = len(os.sched_getaffinity(0)), os.cpu_count()  # a cpuset or taskset leaves fewer than the host's
    cores = f"{usable} logical CPUs" if usable == host else f"{usable} of {host} logical CPUs"
    return f"{model}, {cores}, {isa}, torch {torch.__version__} ({torch.get_num_threads()} threads), {huge_pages()}"


def device_summary(device: str | torch.device) -> str:
    """The CPU summary, led by the accelerator's name and CUDA version where ``device`` is one."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"CPU: {cpu_summary()}"
    name = torch.cuda.get_device_name(dev)
    return f"GPU: {name}, CUDA {torch.version.cuda}; host CPU: {cpu_summary()}"


def check_fits(nbytes: int, what: str) -> None:
    """Refuse a benchmark whose arguments ask for more than half the memory available (an allocator traceback, or
    the kernel's OOM killer, otherwise)."""
    limit = host_available_bytes() // 2
    if nbytes > limit:
        raise SettingsError(
            f"{what} needs ~{nbytes / 2**30:.1f} GiB, more than half the {2 * limit / 2**30:.1f} GiB available here"
        )
