"""Throughput guard: speculate only where it pays on this device at this batch size.

Speculation costs draft forwards and wider verification; on a CPU, or at large batch where the forward is
compute-bound, that can cost more than the accepted tokens save. The guard keeps an exponential moving average
of tokens/s for speculative and plain steps per batch-size bucket, runs the faster mode, and re-tries the other
every ``explore_every`` steps of the bucket so the estimates follow changing acceptance and load.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, 8, ...)."""
    return 1 << (batch_size - 1).bit_length()


@dataclass
class ThroughputGuard:
    explore_every: int = 20
    smoothing: float = 0.3  # weight of the newest step in the moving average
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # (bucket, speculative) -> tokens/s
    steps: dict[int, int] = field(default_factory=dict)  # steps seen per bucket

    def speculate(self, batch_size: int) -> bool:
        b = bucket(batch_size)
        spec, plain = self.rates.get((b, True)), self.rates.get((b, False))
        if spec is None or plain is None:
            return spec is None  # measure speculation first, then plain decoding
        better = spec >= plain
        explore = self.steps.get(b, 0) % self.explore_every == self.explore_every - 1
        return better != explore

    def record(self, batch_size: int, speculative: bool, tokens: int, seconds: float) -> None:
        b = bucket(batch_size)
        self.steps[b] = self.steps.get(b, 0) + 1
        rate = tokens / max(seconds, 1e-9)
        old = self.rates.get((b, speculative))
        self.rates[(b, speculative)] = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate
