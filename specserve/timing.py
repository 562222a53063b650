"""Wall-clock timing of device work: on a GPU, kernels run asynchronously, so a timer that does not synchronise
measures launch latency. Every profiler here (``specserve.tune``, ``load/cost.py``) times through ``timed``."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[..., object], *args: object) -> float:
    """Seconds ``fn(*args)`` takes, including the device work it queued (and none queued before it)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn(*args)
    synchronize(device)
    return time.perf_counter() - t0
