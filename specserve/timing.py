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


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` items (Williams' design) in which each item takes every place equally often and follows every
    other item equally often: n orders for even n, and they with their reverses for odd n."""
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        if len(base) % 2:
            base, low = [*base, low], low + 1
        else:
            base, high = [*base, high], high - 1
    orders = [[(b + r) % n for b in base] for r in range(n)]
    return orders + [o[::-1] for o in orders] if n % 2 and n > 1 else orders


def interleaved_medians(fns: Sequence[Callable[[], object]], repeats: int, device: torch.device = CPU) -> list[float]:
    """Median seconds of each of ``fns`` over ``repeats`` passes, after one untimed pass. A pass calls every fn once,
    the passes taking ``balanced_orders`` in turn, so that other load on the machine hits all alike and none always
    runs first or right after the same other one (which may leave a cache warm or cold for it)."""
    if repeats < 1 or not fns:
        raise ValueError(f"interleaved_medians needs functions and repeats >= 1, not {len(fns)} and {repeats}")
    times: list[list[float]] = [[] for _ in fns]
    orders = balanced_orders(len(fns))
    for run in range(repeats + 1):  # the untimed pass, then the timed ones from the first order on (balanced)
        for i in orders[max(0, run - 1) % len(orders)]:
            took = timed(device, fns[i])
            if run:
                times[i].append(took)
    return [statistics.median(t) for t in times]
