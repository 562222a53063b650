"""The tree floor from the loop's own step times (docs/algorithms.md §2.3).

A verified tree node adds its acceptance probability p in tokens and one verify row, c seconds, to a step; at the
loop's rate of R tokens a second the node pays where p >= c * R. Both sides are measured as the loop runs, per
power-of-two batch-size bucket: c as the slope of an exponentially weighted least-squares fit of a speculative step's
verify seconds on its verified rows (trees pruned by the floor, to the root alone at times, and DDD's early stops vary
the rows from step to step), R as the weighted ratio of tokens to seconds over those steps. The guard's plain steps
are in neither: the floor sizes speculative steps, and a plain step's cost is the guard's to weigh. A fit, not a
profile timed at load: the host's speed drifts (a memory-bound one-row step moved 14-20 ms within an hour on one CPU),
and each step's own time follows it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field

from specserve.guard import bucket


@dataclass
class RowFit:
    """Exponentially weighted least squares of y (a step's verify seconds) on x (its verified rows)."""

    weight: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    steps: int = 0

    def add(self, x: float, y: float, keep: float) -> None:
        """Add one step; every earlier one's weight is first multiplied by ``keep``."""
        self.weight = keep * self.weight + 1.0
        self.sx = keep * self.sx + x
        self.sy = keep * self.sy + y
        self.sxx = keep * self.sxx + x * x
        self.sxy = keep * self.sxy + x * y
        self.steps += 1

    @property
    def spread(self) -> float:
        """Weighted standard deviation of x."""
        if self.weight <= 0:
            return 0.0
        mean = self.sx / self.weight
        return math.sqrt(max(0.0, self.sxx / self.weight - mean * mean))

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the fit (None: x has not varied)."""
        if self.weight <= 0:
            return None
        mx, my = self.sx / self.weight, self.sy / self.weight
        var = self.sxx / self.weight - mx * mx
        if var <= 1e-9 * (1.0 + mx * mx):  # x constant up to rounding
            return None
        slope = (self.sxy / self.weight - mx * my) / var
        return my - slope * mx, slope


def theil_sen(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of the Theil-Sen line through (x, y) points: the median of the slopes between pairs with
    different x, and the median of y - slope * x (None: x never varies)."""
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(points, 2) if x2 != x1]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    return statistics.median(y - slope * x for x, y in points), slope


@dataclass
class TreeFloor:
    memory: float = 64.0  # steps: each step's weight in the fits decays by 1 - 1 / memory a step
    min_steps: int = 16  # steps of a bucket before its floor is used
    min_spread: float = 0.5  # verified rows must vary by this much (weighted std) for the slope to be read
    outlier_clip: float = 2.0  # a step counts as at most this many times the fit's prediction (a GC pause, a burst
    # of another process: six times a step once would move the slope for a whole memory)
    max_floor: float = 0.9  # above this no node would be verified: the guard's decision to make, not the floor's
    max_settle_steps: int = 64  # speculative steps of a bucket after which it counts as settled even without a
    # floor (its rows never varied enough to read a slope): the guard then judges speculation as it runs
    fits: dict[int, RowFit] = field(default_factory=dict)  # bucket -> verify seconds on rows
    rates: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> weighted (tokens, seconds)
    # of speculative steps
    slopes: dict[int, float] = field(default_factory=dict)  # bucket -> the last slope above zero read with enough
    # spread once the fit has ``min_steps`` steps (docs/algorithms.md §2.3)
    starts: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # bucket -> its first steps (rows,
    # seconds) until ``min_steps``, when the fit is rebuilt from them clipped

    def __post_init__(self) -> None:
        if self.memory < 1:
            raise ValueError(f"memory must be at least 1 step, got {self.memory}")
        if self.min_steps < 2:
            raise ValueError(f"min_steps must be at least 2, got {self.min_steps}")
        if self.min_spread < 0 or self.outlier_clip < 1:
            raise ValueError(f"min_spread >= 0 and outlier_clip >= 1, got {self.min_spread}, {self.outlier_clip}")
        if not 0 < self.max_floor < 1:
            raise ValueError(f"max_floor must be in (0, 1), got {self.max_floor}")
        if self.max_settle_steps < 0:
            raise ValueError(f"max_settle_steps must be at least 0, got {self.max_settle_steps}")

    @property
    def keep(self) -> float:
        return 1.0 - 1.0 / self.memory

    def record_verify(self, batch_size: int, rows: int, seconds: float) -> None:
        """One step's verification: ``rows`` tokens verified over the batch (roots included) in ``seconds``. A step
        counts as at most ``outlier_clip`` times the fit's prediction (``_predicted``); the first ``min_steps``
        steps, before the fit predicts anything, are checked against their own Theil-Sen line once they are all in (a
        cold first step alone, 10x a step at one row, had read a row's cost below zero). Only a slope above zero,
        read once the fit has ``min_steps`` steps, is a row's cost."""
        b = bucket(batch_size)
        fit = self.fits.setdefault(b, RowFit())
        predicted = self._predicted(fit, rows) if fit.steps >= self.min_steps else None
        if predicted is not None and predicted > 0:
            seconds = min(seconds, self.outlier_clip * predicted)
        fit.add(float(rows), seconds, self.keep)
        if fit.steps <= self.min_steps:
            start = self.starts.setdefault(b, [])
            start.append((float(rows), seconds))
            if fit.steps == self.min_steps:
                steps = self.starts.pop(b)
                if len(steps) == fit.steps:  # (a fit handed in with steps of its own is left as it is)
                    self.fits[b] = fit = self._clipped_start(steps)
        if fit.steps < self.min_steps:  # no row cost is read from the first steps alone
            return
        if fit.spread >= self.min_spread and (line := fit.line()) is not None and line[1] > 0:
            self.slopes[b] = line[1]

    @staticmethod
    def _predicted(fit: RowFit, rows: int) -> float | None:
        """The fit's seconds for a step of ``rows``. Where its rows never varied there is no line: their mean
        seconds, scaled up in proportion for more rows than theirs (a pause among whole trees went in unclipped,
        and the mean alone clipped batches of trees after steps the floor had pruned to their roots)."""
        if (line := fit.line()) is not None:
            return line[0] + line[1] * rows
        if fit.weight <= 0 or fit.sx <= 0:
            return None
        return fit.sy / fit.weight * max(1.0, rows * fit.weight / fit.sx)

    def _clipped_start(self, steps: list[tuple[float, float]]) -> RowFit:
        """A fit of a bucket's first steps in which a step above ``outlier_clip`` times the Theil-Sen line through
        them (the median of the pairwise slopes, robust to a few outliers where least squares is not; their median
        seconds where the rows never varied) counts as the line's prediction: clipped only to twice the line, a cold
        step still held the slope down for a memory."""
        fit = RowFit()
        line = theil_sen(steps) or (statistics.median(y for _, y in steps), 0.0)
        for x, y in steps:
            predicted = line[0] + line[1] * x
            fit.add(x, predicted if 0 < predicted < y / self.outlier_clip else y, self.keep)
        return fit

    def record_rate(self, batch_size: int, tokens: int, seconds: float) -> None:
        """One speculative step: ``tokens`` emitted over the batch in ``seconds`` (drafting and verifying)."""
        b = bucket(batch_size)
        tok, sec = self.rates.get(b, (0.0, 0.0))
        self.rates[b] = (self.keep * tok + tokens, self.keep * sec + seconds)

    def row_cost(self, batch_size: int) -> float | None:
        """Seconds a verified row adds to a step in this bucket (None: measured in no bucket yet). A bucket not yet
        measured borrows the nearest measured bucket's (the smaller of two as near): a row costs much the same at a
        neighbouring batch size, and a bucket the loop rarely reaches (a larger batch's last sequences) would
        otherwise settle only after ``min_steps`` of its own speculative steps, every one unjudged by the guard."""
        b = bucket(batch_size)
        if (own := self._measured_row_cost(b)) is not None:
            return own
        measured = [k for k in self.fits if self._measured_row_cost(k) is not None]
        if not measured:
            return None
        nearest = min(measured, key=lambda k: (abs(k.bit_length() - b.bit_length()), k))
        return self._measured_row_cost(nearest)

    def _measured_row_cost(self, b: int) -> float | None:
        fit = self.fits.get(b)
        if fit is None or fit.steps < self.min_steps or b not in self.slopes:
            return None
        return self.slopes[b]

    def tokens_per_s(self, batch_size: int) -> float | None:
        tok, sec = self.rates.get(bucket(batch_size), (0.0, 0.0))
        return tok / sec if sec > 0 else None

    def floor(self, batch_size: int) -> float | None:
        """The path probability a node needs to pay for its row: c * R, at most ``max_floor`` (None: c or R not
        measured yet; the sequence's own ``tree_min_prob`` applies meanwhile)."""
        cost, rate = self.row_cost(batch_size), self.tokens_per_s(batch_size)
        if cost is None or rate is None:
            return None
        return min(self.max_floor, cost * rate)

    def settling(self, batch_size: int) -> bool:
        """Whether this bucket's trees are still sized by the sequences' own ``tree_min_prob`` while its floor is
        measured (fewer than ``max_settle_steps`` speculative steps so far): the throughput guard does not judge
        speculation by such steps (docs/algorithms.md §2.3)."""
        fit = self.fits.get(bucket(batch_size))
        steps = fit.steps if fit is not None else 0
        return steps < self.max_settle_steps and self.floor(batch_size) is None
