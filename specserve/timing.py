"""Wall-clock timing of device work: on a GPU, kernels run asynchronously, so a timer that does not synchronise
measures launch latency. Every profiler here (``specserve.tune``, ``load/cost.py``) times through ``timed``, and
those comparing variants on this machine through ``interleaved_medians``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

CPU = torch.device("cpu")


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


def interleaved_medians(fns: Sequence[Callable[[], object]], repeats: int, device: torch.device = CPU) -> list[float]:
    """Median seconds of each of ``fns`` over ``repeats`` passes, after one untimed pass. A pass calls every fn once,
    its order rotated by one from the last pass's, so that other load on the machine hits all alike and none always
    runs right after the same other one (which may leave a cache warm or cold for it)."""
    if repeats < 1 or not fns:
        raise ValueError(f"interleaved_medians needs functions and repeats >= 1, not {len(fns)} and {repeats}")
    times: list[list[float]] = [[] for _ in fns]
    for run in range(repeats + 1):
        shift = run % len(fns)
        for i in [*range(shift, len(fns)), *range(shift)]:
            took = timed(device, fns[i])
            if run:
                times[i].append(took)
    return [statistics.median(t) for t in times]
