"""Device cost model of one lane step (draft levels, verify, host work): fitted on recorded steps, timed from
batched forwards on a device, loaded from a JSON profile, or a named roofline estimate. ``load.simulate`` prices
simulated steps with it."""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Annotated

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from load.traces import CostSample, level_tokens
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel
from specserve.timing import timed


class Curve(BaseModel):
    """Piecewise-linear seconds(x) through ``points`` (x ascending), extended linearly past both ends, >= 0."""

    model_config = ConfigDict(frozen=True)

    points: list[tuple[float, float]]

    @field_validator("points")
    @classmethod
    def _sorted(cls, pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
        if not pts:
            raise ValueError("a curve needs at least one point")
        xs = [x for x, _ in pts]
        if any(b <= a for a, b in itertools.pairwise(xs)):
            raise ValueError("curve x values must be strictly ascending")
        if not all(math.isfinite(v) for pt in pts for v in pt):
            raise ValueError("curve points must be finite")
        return pts

    @classmethod
    def linear(cls, intercept: float, slope: float) -> Curve:
        return cls(points=[(0.0, intercept), (1.0, intercept + slope)])

    @classmethod
    def constant(cls, value: float) -> Curve:
        return cls(points=[(0.0, value)])

    def __call__(self, x: float) -> float:
        return max(0.0, _interp(self.points, x))


def _interp(pts: Sequence[tuple[float, float]], x: float) -> float:
    if len(pts) == 1:
        return pts[0][1]
    i = min(max(bisect.bisect_right([p[0] for p in pts], x) - 1, 0), len(pts) - 2)
    (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _hat(knots: Sequence[float], j: int, x: float) -> float:
    """The piecewise-linear basis function that is 1 at knot j and 0 at the others (extended linearly)."""
    return _interp([(k, 1.0 if i == j else 0.0) for i, k in enumerate(knots)], x)


def fit_knots(lo: float, hi: float, xs: Sequence[float] | None = None) -> list[float]:
    """lo, the powers of two between, and hi; with ``xs`` (the data), only the interior knots that have at least
    KNOT_MIN_SAMPLES values within a factor sqrt(2): a knot with no data near it would be fitted to noise (the
    curve then interpolates linearly across the gap)."""
    lo, hi = max(1.0, lo), max(1.0, hi)
    knots = [lo]
    while 2 ** math.floor(math.log2(knots[-1]) + 1) < hi:
        knots.append(2.0 ** math.floor(math.log2(knots[-1]) + 1))
    if xs is not None:
        near = [sum(k / math.sqrt(2) <= x <= k * math.sqrt(2) for x in xs) for k in knots]
        knots = [knots[0]] + [k for k, n in zip(knots[1:], near[1:], strict=True) if n >= KNOT_MIN_SAMPLES]
    if hi > knots[-1]:
        knots.append(hi)
    return knots


KNOT_MIN_SAMPLES = 3
PLAIN_FIT_MIN_STEPS = 8  # plain decoding steps needed for their own cost model (else the joint fit covers them)
# the terms of host work (per row, per step, per token emitted): a model timed on a device takes them from a fit
HOST_TERMS = (
    "draft_row_s",
    "tree_row_s",
    "tree_level_row_s",
    "verify_row_s",
    "verify_drafting_row_s",
    "verify_tree_row_s",
    "overhead",
    "host_drafting_row_s",
    "emit_token_s",
)
PREFILL_TIMING_TOKENS = 128  # a prompt chunk the draft reads in one forward, to time its cost per token


class FitKind(str, Enum):
    linear = "linear"  # draft level and verify costs linear in rows / tokens: robust far past the data
    piecewise = "piecewise"  # piecewise-linear over power-of-two knots: follows non-monotonic CPU costs


Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]  # a cost term: finite, never negative


class CostModel(BaseModel):
    """Seconds of one lane step.

    draft  = sum over levels k of draft_level(tokens in level k's forward: one per row still drafting, a tree
             row's beam width after level 1) + draft_row_s * drafting rows + draft_prefill_token_s * tokens fed
             at level 1 beyond one per row + tree_row_s * tree rows + tree_level_row_s * tree rows x later levels
    verify = verify(total tokens in the forward) + verify_row_s * rows + verify_drafting_row_s * drafting rows
             + verify_tree_row_s * tree rows
    host   = overhead(rows) + host_drafting_row_s * drafting rows + emit_token_s * tokens emitted

    The per-row terms are host work (sampling, acceptance, KLD, DSDE updates, tree masks and reranking): on a
    small model they dominate. A step where nothing drafts uses ``plain`` when it is set (fitted on plain
    decoding steps alone: their cost is not the speculative steps' cost minus the draft).
    """

    model_config = ConfigDict(frozen=True)

    source: str
    draft_level: Curve
    draft_row_s: Seconds = 0.0
    draft_prefill_token_s: Seconds = 0.0
    verify: Curve
    verify_row_s: Seconds = 0.0
    verify_drafting_row_s: Seconds = 0.0
    overhead: Curve = Curve.constant(0.0)
    host_drafting_row_s: Seconds = 0.0
    emit_token_s: Seconds = 0.0
    tree_row_s: Seconds = 0.0
    tree_level_row_s: Seconds = 0.0
    verify_tree_row_s: Seconds = 0.0
    plain: CostModel | None = None  # steps where no row drafts (None: the terms above with no drafting rows)

    def with_host_of(self, fitted: CostModel) -> CostModel:
        """This model's forwards with ``fitted``'s host terms, its plain steps' too (model time measured on a
        device, the scheduler's host work from the recorded steps)."""
        plain = None if fitted.plain is None else self.with_host_of(fitted.plain)
        return self.model_copy(update={k: getattr(fitted, k) for k in HOST_TERMS} | {"plain": plain})

    def draft_s(self, depths: Sequence[int], extra_fed: int = 0, widths: Sequence[int] | None = None) -> float:
        """Draft seconds of one lock-step batch; ``widths``: each row's beam width (1: a chain, the default)."""
        widths = [1] * len(depths) if widths is None else widths
        rows = level_rows(depths)
        trees = [d for d, w in zip(depths, widths, strict=True) if d > 0 and w > 1]
        return self.draft_levels_s(
            level_tokens(depths, widths),
            rows[0] if rows else 0,
            extra_fed,
            tree_rows=len(trees),
            tree_row_levels=sum(d - 1 for d in trees),
        )

    def draft_levels_s(
        self,
        tokens_per_level: Sequence[int],
        drafting_rows: int,
        extra_fed: int = 0,
        *,
        tree_rows: int = 0,
        tree_row_levels: int = 0,
    ) -> float:
        """Lock-step: level k is one forward over the rows still drafting there."""
        if not tokens_per_level:
            return 0.0
        levels = sum(self.draft_level(n) for n in tokens_per_level)
        return (
            levels
            + self.draft_row_s * drafting_rows
            + self.draft_prefill_token_s * extra_fed
            + self.tree_row_s * tree_rows
            + self.tree_level_row_s * tree_row_levels
        )

    def verify_s(self, rows: int, tokens: int, drafting_rows: int = 0, tree_rows: int = 0) -> float:
        if drafting_rows == 0 and self.plain is not None:
            return self.plain.verify_s(rows, tokens)
        return (
            self.verify(tokens)
            + self.verify_row_s * rows
            + self.verify_drafting_row_s * drafting_rows
            + self.verify_tree_row_s * tree_rows
        )

    def overhead_s(self, rows: int, emitted: int, drafting_rows: int = 0) -> float:
        if drafting_rows == 0 and self.plain is not None:
            return self.plain.overhead_s(rows, emitted)
        return self.overhead(rows) + self.host_drafting_row_s * drafting_rows + self.emit_token_s * emitted

    def predict(self, s: CostSample) -> tuple[float, float, float]:
        """(draft, verify, host) seconds of a recorded step."""
        return (
            self.draft_levels_s(
                s.level_tokens or s.level_rows,
                s.drafting_rows,
                s.draft_extra_fed,
                tree_rows=s.tree_rows,
                tree_row_levels=s.tree_row_levels,
            ),
            self.verify_s(s.batch, s.verify_tokens, s.drafting_rows, s.tree_rows),
            self.overhead_s(s.batch, s.emitted, s.drafting_rows),
        )

    @classmethod
    def fit(cls, samples: Iterable[CostSample], kind: FitKind = FitKind.linear, source: str = "fit") -> CostModel:
        """Least squares with non-negative coefficients, per component, on recorded steps."""
        samples = list(samples)
        if not samples:
            raise ValueError("no recorded steps to fit a cost model on")
        drafting = [s for s in samples if s.levels > 0]
        plain = [s for s in samples if s.drafting_rows == 0]
        if drafting and len(plain) >= PLAIN_FIT_MIN_STEPS:
            sub = cls.fit(plain, kind, source="plain decoding steps")
            return cls.fit(drafting, kind, source).model_copy(
                update={"plain": sub, "source": f"{source} ({kind.value}, {len(samples)} steps)"}
            )
        level_x = [n for s in drafting for n in (s.level_tokens or s.level_rows)]
        level_knots = [0.0, 1.0] if kind == FitKind.linear else fit_knots(1, max(level_x, default=1), level_x)
        draft_level, c, d, tr, tl = Curve.constant(0.0), 0.0, 0.0, 0.0, 0.0
        if drafting:
            # draft_s = sum_k f(tokens at level k) + c * extra fed + d * drafting rows + tree terms,
            # f piecewise-linear on knots
            x = [
                [
                    sum(_hat(level_knots, j, n) for n in (s.level_tokens or s.level_rows))
                    for j in range(len(level_knots))
                ]
                + [s.draft_extra_fed, s.drafting_rows, s.tree_rows, s.tree_row_levels]
                for s in drafting
            ]
            coef = _nnls(x, [s.draft_s for s in drafting], run_weights(drafting))
            draft_level = Curve(points=list(zip(level_knots, coef[: len(level_knots)], strict=True)))
            c, d, tr, tl = coef[-4:]
        tok = [s.verify_tokens for s in samples]
        tok_knots = [0.0, 1.0] if kind == FitKind.linear else fit_knots(min(tok), max(tok), tok)
        coef = _nnls(
            [
                [_hat(tok_knots, j, s.verify_tokens) for j in range(len(tok_knots))]
                + [s.batch, s.drafting_rows, s.tree_rows]
                for s in samples
            ],
            [s.verify_s for s in samples],
            run_weights(samples),
        )
        verify, (v_row, v_drow, v_tree) = Curve(points=list(zip(tok_knots, coef[:-3], strict=True))), coef[-3:]
        o0, o_row, o_drow, o_tok = _nnls(
            [[1.0, s.batch, s.drafting_rows, s.emitted] for s in samples],
            [s.overhead_s for s in samples],
            run_weights(samples),
        )
        return cls(
            source=f"{source} ({kind.value}, {len(samples)} steps)",
            draft_level=draft_level,
            draft_row_s=d,
            draft_prefill_token_s=c,
            tree_row_s=tr,
            tree_level_row_s=tl,
            verify=verify,
            verify_row_s=v_row,
            verify_drafting_row_s=v_drow,
            verify_tree_row_s=v_tree,
            overhead=Curve.linear(o0, o_row),
            host_drafting_row_s=o_drow,
            emit_token_s=o_tok,
        )

    @classmethod
    def roofline(
        cls,
        *,
        target_params: float,
        draft_params: float,
        bytes_per_param: float = 2.0,
        hbm_bytes_per_s: float = 3.35e12,
        flops_per_s: float = 4.0e14,
        target_launch_s: float = 2e-3,
        draft_launch_s: float = 1e-3,
        host_row_s: float = 2e-5,
        source: str = "roofline",
    ) -> CostModel:
        """A GPU estimate, NOT a measurement: one forward costs max(weights / bandwidth, 2 params tokens / FLOP/s)
        plus a fixed launch cost; KV-cache reads and attention are ignored. Defaults: H100 SXM (3.35 TB/s HBM,
        ~40% of the 989 dense bf16 TFLOP/s), bf16 weights."""

        def forward(params: float, launch: float) -> Curve:
            floor = params * bytes_per_param / hbm_bytes_per_s
            knee = floor * flops_per_s / (2.0 * params)  # tokens where compute catches up with weight reads
            return Curve(points=[(0.0, floor + launch), (knee, floor + launch), (2 * knee, 2 * floor + launch)])

        return cls(
            source=source,
            draft_level=forward(draft_params, draft_launch_s),
            # a prompt the draft reads (beyond a row's one token): the compute of each of its tokens
            draft_prefill_token_s=2.0 * draft_params / flops_per_s,
            verify=forward(target_params, target_launch_s),
            overhead=Curve.linear(0.0, host_row_s),
        )


def time_forward(
    model: LlamaModel,
    rows: int,
    tokens_per_row: int,
    *,
    context: int = 256,
    repeats: int = 3,
    logits: int | None = None,
) -> float:
    """Median seconds of one batched forward: ``rows`` sequences with ``context`` cached tokens each append
    ``tokens_per_row`` causal tokens (a draft level: 1; a chain verify: SL + 1); ``logits``: the LM head's rows
    for each sequence's last tokens (None: every token's, as a verify's; a prompt read takes its last one's)."""
    from specserve.models.batch import ForwardBatch

    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    cache = model.new_cache(rows, context + tokens_per_row + 1)
    slots = [cache.allocate() for _ in range(rows)]
    ctx = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in slots]
    model(ForwardBatch.build(cache, slots, ctx, num_logits=[1] * rows, device=model.device), cache)
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        new = [torch.randint(0, vocab, (tokens_per_row,), generator=gen).tolist() for _ in slots]
        times.append(timed(model.device, _forward, model, cache, slots, new, logits))
        for slot in slots:
            cache.truncate(slot, context)
    return statistics.median(times[1:])


def _forward(model: LlamaModel, cache: KVCache, slots: list[int], new: list[list[int]], logits: int | None) -> None:
    from specserve.models.batch import ForwardBatch

    num_logits = None if logits is None else [logits] * len(slots)
    model(ForwardBatch.build(cache, slots, new, num_logits=num_logits, device=model.device), cache)


def measure_cost_model(
    target: LlamaModel,
    draft: LlamaModel,
    rows: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    *,
    verify_tokens_per_row: int = 5,
    context: int = 256,
    source: str = "measured",
) -> CostModel:
    """Draft level vs rows, the draft's cost per prompt token it reads and verify vs total tokens from timed
    batched forwards on this device (model time only: the host overhead of the scheduler is not in it)."""
    draft_pts = [(float(r), time_forward(draft, r, 1, context=context)) for r in rows]
    verify_pts = [
        (float(r * verify_tokens_per_row), time_forward(target, r, verify_tokens_per_row, context=context))
        for r in rows
    ]
    # (the draft's prompt read takes one logit row, as the draft worker's does: not the LM head over every token)
    chunk, one = (time_forward(draft, 1, n, context=context, logits=1) for n in (PREFILL_TIMING_TOKENS, 1))
    per_prompt_token = max(0.0, (chunk - one) / (PREFILL_TIMING_TOKENS - 1))
    return CostModel(
        source=source,
        draft_level=Curve(points=draft_pts),
        draft_prefill_token_s=per_prompt_token,
        verify=Curve(points=verify_pts),
    )


def level_rows(depths: Sequence[int]) -> list[int]:
    """Rows still drafting at each level 1..max(depths): the batch drafts in lock-step."""
    drafting = sorted(d for d in depths if d > 0)
    return [len(drafting) - bisect.bisect_left(drafting, k) for k in range(1, (drafting[-1] if drafting else 0) + 1)]


def run_weights(samples: Sequence[CostSample]) -> list[float] | None:
    """1 / run seconds per step (None when a sample does not know its run: unweighted)."""
    runs = [s.run_s for s in samples]
    return [1.0 / r for r in runs if r] if all(runs) else None


def _nnls(x: list[list[float]], y: list[float], weights: Sequence[float] | None = None) -> list[float]:
    """Weighted least squares, dropping the most negative coefficient until all are >= 0 (a small active-set NNLS).
    Per-step relative weights were validated worse on the tiny sweep (the few large prefill steps matter for the
    totals); weighting a run's steps by 1 / its duration makes each run's relative time error count alike."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if weights is not None:
        w = np.asarray(weights, dtype=float)
        a, b = a * w[:, None], b * w
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


def fit_quality(model: CostModel, samples: Sequence[CostSample]) -> dict[str, float]:
    """Relative error of the summed predicted time per component over the samples (0 = exact in total)."""
    pred = [model.predict(s) for s in samples]
    out = {}
    for i, name in enumerate(("draft", "verify", "host")):
        measured = sum((s.draft_s, s.verify_s, s.overhead_s)[i] for s in samples)
        out[name] = sum(p[i] for p in pred) / measured - 1.0 if measured > 0 else 0.0
    total = sum(s.draft_s + s.verify_s + s.overhead_s for s in samples)
    out["step"] = sum(sum(p) for p in pred) / total - 1.0 if total > 0 else 0.0
    return out


class RooflineName(str, Enum):
    h100_llama8b_1b = "h100-llama8b-1b"  # Llama-3.1-8B (8.03e9 params) + Llama-3.2-1B (1.24e9), bf16, H100 SXM

    def cost_model(self) -> CostModel:
        return CostModel.roofline(
            target_params=8.03e9, draft_params=1.24e9, source="roofline estimate: H100, Llama-3.1-8B + Llama-3.2-1B"
        )
