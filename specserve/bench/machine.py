"""Which machine a figure was taken on: CPU model and the vector extensions torch can use (never assumed)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_summary() -> str:
    """e.g. 'Intel(R) Xeon(R) Processor, 2 cores, avx2 avx512f avx512_bf16 amx_bf16, torch 2.13.0 (2 threads)'."""
    model, flags = platform.processor() or platform.machine(), set()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model.startswith(value.strip()):
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2/AVX-512 flags seen"
    cores = os.cpu_count()
    return f"{model}, {cores} cores, {isa}, torch {torch.__version__} ({torch.get_num_threads()} threads)"
