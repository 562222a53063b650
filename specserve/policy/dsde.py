"""DSDE: per-sequence speculation length from KLD stability (docs/algorithms.md §4).

Host-side and pure: no model code, no Ray. The step loop owns one ``SequenceDSDE`` per sequence and, per step
(docs/algorithms.md §4.6, the signal is post-hoc: step t's KLD sets step t+1's SL):

    plan = planner.plan(rows)                  # policy/planner.py: SL_i per sequence, SL_cap, max_sl, guards
    ... draft, verify, compute KLDs at ``kld_nodes`` ...
    state.observe(klds, num_drafted, num_accepted)   # history -> next SL_i

Every **[choice]** between the paper and the reference code is a `DSDEConfig` field (docs/algorithms.md §4.9);
`DSDEConfig.reference()` gives the published reference code's variants so both can be measured.

Notation: h = KLD history of a sequence (newest last), SL_min/SL_max = calibrated per-sequence bounds,
WVIR = weighted variance intensity ratio, SF = scale factor.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from enum import Enum
from typing import Protocol, runtime_checkable

from pydantic import ConfigDict, Field, model_validator

from specserve.validated import Validated

# ───────────────────────────── config ─────────────────────────────


class FlatKLD(str, Enum):
    """WVIR when the long-window weighted variance is below `flat_var_eps` (docs/algorithms.md §4.3)."""

    stable = "stable"  # [choice] flat KLD is stable: WVIR = 1.0
    reference = "reference"  # reference code: WVIR = 20.0 (forces SL_min forever on a near-perfect draft)

    @property
    def wvir(self) -> float:
        return 1.0 if self is FlatKLD.stable else 20.0


class ShortWindow(str, Enum):
    """Which history values form the short window of WVIR (docs/algorithms.md §4.2)."""

    paper = "paper"  # newest n_short values (all of h while len(h) <= n_short)
    reference = "reference"  # newest max(1, floor(len(h) / 3)) values, as the reference code does


class SLMinRule(str, Enum):
    """How the calibrated SL_min is chosen at the end of warm-up (docs/algorithms.md §4.5)."""

    paper = "paper"  # SL_min = cfg.sl_min (paper: 2)
    reference = "reference"  # SL_min = min(SL_max, max(cfg.sl_min, ceil(0.1 * SL_max))) (cfg.sl_min is the floor)


class DSDEConfig(Validated):
    """DSDE parameters. Defaults: the paper's values and the [choice]s of docs/algorithms.md §4.9."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    delta: float = Field(default=0.85, gt=0.0, le=1.0, description="decay of the weights delta^age (reference: 0.9)")
    n_short: int = Field(default=10, ge=1, description="short window size for ShortWindow.paper")
    n_long: int = Field(
        default=30, ge=2, description="history length kept (long window) and warm-up length in verified positions"
    )
    alpha: float = Field(default=2.0, ge=0.0, description="SF = exp(alpha * mean KLD of the last step) - 1")
    sl_init: int = Field(default=4, ge=1, description="warm-up starting SL")
    sl_hard_max: int = Field(
        default=16, ge=1, le=64, description="absolute SL ceiling (warm-up doubling and calibration)"
    )
    sl_min: int = Field(default=2, ge=1, description="SL_min (paper rule) or its floor (reference rule)")
    calibration_c: float = Field(
        default=1.0,
        ge=0.0,
        allow_inf_nan=False,
        description="SL_max = round(A_max (1 + c mu / (M + 1e-8))) (reference: 0.5)",
    )
    flat_var_eps: float = Field(default=1e-6, gt=0.0, description="long-window variance below this counts as flat")
    flat_kld: FlatKLD = Field(default=FlatKLD.stable, description="WVIR for a flat history: stable=1.0, reference=20.0")
    short_window: ShortWindow = ShortWindow.paper
    sl_min_rule: SLMinRule = SLMinRule.paper
    kld_over_temperature: bool = Field(
        default=False,
        description="[choice] the reference code divides the last step's mean KLD by the sampling temperature "
        "before SF (greedy requests: unchanged); the paper does not",
    )
    record_past_rejection: bool = Field(
        default=False,
        description="[choice] False: KLD at the accepted positions plus the first rejected one; True (reference "
        "code): at every drafted position. Read by the caller that computes the KLDs.",
    )
    cap_enabled: bool = Field(default=True, description="apply the batch cap SL_cap (docs/algorithms.md §5)")
    cap_warmup: bool = Field(default=False, description="also cap sequences still in warm-up (docs/algorithms.md §5)")

    @model_validator(mode="after")
    def _check(self) -> DSDEConfig:
        if self.n_short > self.n_long:
            raise ValueError(f"n_short ({self.n_short}) must be <= n_long ({self.n_long})")
        if self.sl_min > self.sl_hard_max:
            raise ValueError(f"sl_min ({self.sl_min}) must be <= sl_hard_max ({self.sl_hard_max})")
        if self.sl_init > self.sl_hard_max:
            raise ValueError(f"sl_init ({self.sl_init}) must be <= sl_hard_max ({self.sl_hard_max})")
        return self

    @classmethod
    def reference(cls, **overrides: object) -> DSDEConfig:
        """The published reference code's variants of every [choice] (delta 0.9, short = n // 3, flat WVIR 20,
        c 0.5, SL_min = ceil(0.1 SL_max) with floor 1, KLD recorded past the first rejection, KLD / temperature
        before SF).
        The floor 1 is this package's reading of the code's configured k_min; override it if needed."""
        values: dict[str, object] = {
            "delta": 0.9,
            "short_window": ShortWindow.reference,
            "flat_kld": FlatKLD.reference,
            "calibration_c": 0.5,
            "sl_min_rule": SLMinRule.reference,
            "sl_min": 1,
            "record_past_rejection": True,
            "kld_over_temperature": True,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


# ───────────────────────── pure functions ─────────────────────────

CALIBRATION_EPS = 1e-8


def weighted_variance(x: Sequence[float], delta: float) -> float:
    """Var_w(x) = sum w_j (x_j - m)^2 / sum w_j, m = sum w_j x_j / sum w_j, w_j = delta^age_j.

    x: [n] host floats (the step's KLDs reach the policy as lists), oldest first (the newest value is the last element
    and has age 0). Empty -> 0.
    """
    xs = list(x)
    n = len(xs)
    if n == 0:
        return 0.0
    w = [delta ** (n - 1 - j) for j in range(n)]
    sw = sum(w)
    m = sum(wj * xj for wj, xj in zip(w, xs, strict=True)) / sw
    return sum(wj * (xj - m) ** 2 for wj, xj in zip(w, xs, strict=True)) / sw


def short_window_size(n: int, cfg: DSDEConfig) -> int:
    """Number of newest history values in the short window for a history of n values."""
    if cfg.short_window is ShortWindow.paper:
        return min(cfg.n_short, n)
    return max(1, n // 3)


def wvir(history: Sequence[float], cfg: DSDEConfig) -> float:
    """WVIR = Var_w(short) / Var_w(long) over the newest n_long values of `history` (oldest first).

    Fewer than 2 values -> 0. Var_w(long) < flat_var_eps -> cfg.flat_kld.wvir (1.0, or 20.0 for the reference).
    """
    h = list(history)[-cfg.n_long :]
    n = len(h)
    if n < 2:
        return 0.0
    var_long = weighted_variance(h, cfg.delta)
    if var_long < cfg.flat_var_eps:
        return cfg.flat_kld.wvir
    var_short = weighted_variance(h[n - short_window_size(n, cfg) :], cfg.delta)
    return var_short / var_long


def scale_factor(mean_kld_last_step: float, alpha: float) -> float:
    """SF = exp(alpha * m) - 1, m = mean KLD of the last step (docs/algorithms.md §4.4)."""
    return math.expm1(min(alpha * mean_kld_last_step, 700.0))


def predict_sl(wvir_value: float, sf: float, sl_min: int, sl_max: int) -> int:
    """docs/algorithms.md §4.4: WVIR*SF <= 1 -> ceil((SL_max - SL_min)(1 - WVIR*SF) + SL_min); else SL_min (fallback).

    The result is clamped to [sl_min, sl_max] (guards against a slightly negative SF from rounding).
    """
    if sl_min > sl_max:
        raise ValueError(f"sl_min ({sl_min}) > sl_max ({sl_max})")
    r = wvir_value * sf
    if not r <= 1.0:  # also catches NaN
        return sl_min
    sl = math.ceil((sl_max - sl_min) * (1.0 - r) + sl_min)
    return max(sl_min, min(sl_max, sl))


def calibrate(a_max: int, mu: float, m_max: float, cfg: DSDEConfig) -> tuple[int, int]:
    """End of warm-up (docs/algorithms.md §4.5): SL_max = round(A_max (1 + c mu / (M + 1e-8))) clamped to
    [cfg.sl_min, sl_hard_max]; SL_min per `cfg.sl_min_rule`. Returns (sl_min, sl_max).

    `round` is Python's (half to even), as in the reference code. KLDs are non-negative: a mean or maximum a
    rounding left below 0 counts as 0 (a mean of -1e-6 against a maximum of 0 would pin SL_max to SL_min).
    """
    mu, m_max = max(mu, 0.0), max(m_max, 0.0)
    grown = a_max * (1.0 + cfg.calibration_c * mu / (m_max + CALIBRATION_EPS)) if a_max else 0.0
    raw = round(grown) if math.isfinite(grown) else cfg.sl_hard_max  # a huge c overflows: as large as allowed
    sl_max = max(cfg.sl_min, min(cfg.sl_hard_max, raw))
    if cfg.sl_min_rule is SLMinRule.reference:
        return min(sl_max, max(cfg.sl_min, math.ceil(0.1 * sl_max))), sl_max
    return cfg.sl_min, sl_max


def sl_cap(sls: Sequence[int], post_warmup: Sequence[bool]) -> int | None:
    """SL_cap = ceil(mean of SL_i over the post-warm-up sequences); None when there is none (docs/algorithms.md §5)."""
    if len(sls) != len(post_warmup):
        raise ValueError("sls and post_warmup differ in length")
    vals = [s for s, post in zip(sls, post_warmup, strict=True) if post]
    if not vals:
        return None
    return math.ceil(sum(vals) / len(vals))


def apply_cap(sls: Sequence[int], cap: int | None, warmup_flags: Sequence[bool], cap_warmup: bool) -> list[int]:
    """min(SL_i, cap) per sequence; sequences in warm-up are left uncapped unless cap_warmup."""
    if len(sls) != len(warmup_flags):
        raise ValueError("sls and warmup_flags differ in length")
    if cap is None:
        return list(sls)
    return [s if (warm and not cap_warmup) else min(s, cap) for s, warm in zip(sls, warmup_flags, strict=True)]


def verified_positions(num_drafted: int, num_accepted: int) -> int:
    """Positions verified on a chain (docs/algorithms.md §6): the accepted ones plus the first rejected one, if any."""
    return min(num_drafted, num_accepted + 1)


def kld_nodes(accepted: Sequence[int], num_nodes: int, past_rejection: bool) -> list[int]:
    """The one rule for where the KLD signal is taken (docs/algorithms.md §6): the tree nodes whose next-token
    distributions the target verified, i.e. the root and each accepted node (the last of them is where the first
    rejection, or the bonus, happened); with ``past_rejection`` (the reference code, chains only) every node."""
    if past_rejection:
        return list(range(num_nodes))
    return [0, *accepted]


def kld_positions(num_drafted: int, num_accepted: int, record_past_rejection: bool) -> int:
    """How many leading drafted positions of a chain get a KLD: ``kld_nodes`` on a chain, whose draft
    distributions exist at nodes 0..SL-1 (the last drafted token is never fed back to the draft)."""
    nodes = kld_nodes(range(1, num_accepted + 1), num_drafted + 1, record_past_rejection)
    return sum(1 for n in nodes if n < num_drafted)


def _check_counts(num_drafted: int, num_accepted: int) -> None:
    if num_drafted < 0 or not 0 <= num_accepted <= num_drafted:
        raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted=} {num_drafted=}")


# ───────────────────────── per-sequence state ─────────────────────────


class SequenceDSDE:
    """DSDE state of one sequence.

    Warm-up (docs/algorithms.md §4.5): SL starts at sl_init and doubles (up to sl_hard_max) after every step in which
    all drafted tokens were accepted (num_drafted > 0 and num_accepted == num_drafted); otherwise it stays.
    Warm-up lasts for the first n_long *verified positions* (accepted + the first rejected, see
    `verified_positions`), counted over steps, independent of how many KLD values the caller records; a step the
    batch cut short (``cut``) whose drafts were all accepted does not count (its A is only a lower bound).
    During warm-up it tracks A_max (most tokens accepted in one step) and the mean mu and max M of the
    warm-up KLDs. The step whose positions reach n_long still counts as warm-up; right after it, SL_min and
    SL_max are calibrated and from then on SL_i = predict_sl(WVIR(h), SF(mean KLD of the last step)).

    Every observed KLD is appended to the history h (deque, maxlen n_long), warm-up included.
    Non-finite KLD values are dropped (and counted in `dropped_klds`).
    """

    __slots__ = (
        "_a_max",
        "_cfg",
        "_kld_max",
        "_kld_n",
        "_kld_sum",
        "_last_mean",
        "_sl",
        "_temperature",
        "dropped_klds",
        "history",
        "positions",
        "sl_max",
        "sl_min",
        "steps",
        "warmup_positions",
    )

    def __init__(self, cfg: DSDEConfig, temperature: float = 1.0) -> None:
        self._cfg = cfg
        self._temperature = temperature  # the request's sampling temperature (kld_over_temperature)
        self.history: deque[float] = deque(maxlen=cfg.n_long)
        self.positions = 0  # verified positions so far
        self.warmup_positions = 0  # those that count towards warm-up: all but a cut step's accepted whole
        self.steps = 0  # observed steps
        self.dropped_klds = 0
        self._sl = cfg.sl_init  # SL for the next step (uncapped)
        self._a_max = 0
        self._kld_sum = 0.0
        self._kld_n = 0
        self._kld_max = 0.0
        self._last_mean = 0.0
        self.sl_min: int | None = None  # calibrated at the end of warm-up
        self.sl_max: int | None = None

    @property
    def cfg(self) -> DSDEConfig:
        return self._cfg

    @property
    def in_warmup(self) -> bool:
        return self.sl_max is None

    @property
    def a_max(self) -> int:
        return self._a_max

    @property
    def warmup_kld_mean(self) -> float:
        return self._kld_sum / self._kld_n if self._kld_n else 0.0

    @property
    def warmup_kld_max(self) -> float:
        return self._kld_max

    @property
    def last_step_mean_kld(self) -> float:
        return self._last_mean

    def next_sl(self) -> int:
        """The uncapped SL_i for the next step."""
        return self._sl

    def observe(self, klds: Sequence[float], num_drafted: int, num_accepted: int, *, cut: bool = False) -> None:
        """Feed one verified step: its KLD values (one per verified position, or per drafted position with
        record_past_rejection), the number of drafted tokens and of accepted drafted tokens (bonus excluded).
        ``cut``: the batch gave this sequence fewer levels than its SL asked for (the room, SL_cap, the step token
        budget); all of them accepted, the step only bounds A from below and does not count towards warm-up.
        Updates the history and the SL for the next step."""
        _check_counts(num_drafted, num_accepted)
        vals = [float(v) for v in klds]
        finite = [v for v in vals if math.isfinite(v)]
        self.dropped_klds += len(vals) - len(finite)
        self.history.extend(finite)
        if finite:
            self._last_mean = sum(finite) / len(finite)
        self.steps += 1
        self.positions += verified_positions(num_drafted, num_accepted)
        censored = cut and num_accepted == num_drafted
        if not censored:
            self.warmup_positions += verified_positions(num_drafted, num_accepted)

        cfg = self._cfg
        if self.in_warmup:
            self._a_max = max(self._a_max, num_accepted)
            if finite:
                self._kld_sum += sum(finite)
                self._kld_n += len(finite)
                self._kld_max = max(self._kld_max, max(finite))
            if num_drafted > 0 and num_accepted == num_drafted:
                self._sl = min(self._sl * 2, cfg.sl_hard_max)
            if self.warmup_positions < cfg.n_long:
                return
            self.sl_min, self.sl_max = calibrate(self._a_max, self.warmup_kld_mean, self._kld_max, cfg)
        assert self.sl_min is not None and self.sl_max is not None
        m = self._last_mean
        if cfg.kld_over_temperature and self._temperature > 0:  # the reference code's variant (§4.4)
            m /= self._temperature
        self._sl = predict_sl(wvir(self.history, cfg), scale_factor(m, cfg.alpha), self.sl_min, self.sl_max)


# ───────────────────────── what the planner reads ─────────────────────────


@runtime_checkable
class SLState(Protocol):
    @property
    def in_warmup(self) -> bool: ...

    def next_sl(self) -> int: ...
