"""specserve.policy: KLD signal, DSDE pure functions, per-sequence state and the batch policies."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pydantic
import pytest
import torch

from specserve.config import Drafter, ModelSpec, SLPolicyKind, SpecConfig, SpecMethod
from specserve.policy import (
    DSDEConfig,
    FlatKLD,
    SequenceDSDE,
    ShortWindow,
    SLMinRule,
    SparseTail,
    apply_cap,
    calibrate,
    kld_exact,
    kld_nodes,
    kld_positions,
    kld_sparse,
    predict_sl,
    scale_factor,
    short_window_size,
    sl_cap,
    sparse_topk_q,
    weighted_variance,
    wvir,
)
from specserve.policy.planner import SLPlanner
from specserve.sampling import SamplingParams

# ───────────────────────── config ─────────────────────────


def test_config_defaults_are_the_papers():
    c = DSDEConfig()
    assert (c.delta, c.n_short, c.n_long, c.alpha) == (0.85, 10, 30, 2.0)
    assert (c.sl_init, c.sl_hard_max, c.sl_min, c.calibration_c, c.flat_var_eps) == (4, 16, 2, 1.0, 1e-6)
    assert c.flat_kld is FlatKLD.stable and c.short_window is ShortWindow.paper and c.sl_min_rule is SLMinRule.paper
    assert (c.record_past_rejection, c.cap_warmup, c.cap_enabled) == (False, False, True)
    r = DSDEConfig.reference()
    assert (r.delta, r.calibration_c, r.flat_kld, r.short_window, r.sl_min_rule) == (
        0.9,
        0.5,
        FlatKLD.reference,
        ShortWindow.reference,
        SLMinRule.reference,
    )
    assert r.record_past_rejection


@pytest.mark.parametrize(
    "kw",
    [
        {"n_short": 31},
        {"sl_min": 17},
        {"sl_init": 20},
        {"sl_hard_max": 65},  # past any SL a step can verify: it would leave the models no context
        {"delta": 0.0},
        {"delta": 1.5},
        {"n_long": 1, "n_short": 1},  # its own bound (n_long 1 alone also fails n_short <= n_long)
        {"flat_kld": "bogus"},
        {"unknown_field": 1},
    ],
)
def test_config_rejects_bad_values(kw):
    with pytest.raises(pydantic.ValidationError):
        DSDEConfig(**kw)


def test_config_is_frozen():
    with pytest.raises(pydantic.ValidationError):
        DSDEConfig().delta = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("settings", "update"),
    [
        (DSDEConfig(), {"delta": 0.0}),  # a field's bound
        (DSDEConfig(), {"n_short": 31}),  # a check across fields (n_short <= n_long)
        (DSDEConfig(), {"sl_min": 17}),  # a check across fields
        (SpecConfig(), {"catch_up_window": 0}),
        (SpecConfig(), {"budget": 1}),
        (SpecConfig(), {"ddd_check_steps": (3, 2)}),
        (SpecConfig(), {"unknown_field": 1}),
        (SamplingParams(), {"max_tokens": 0}),
        (ModelSpec(), {"dtype": "float8"}),
        (ModelSpec(), {"native_q4": True, "dtype": "bfloat16"}),  # native_q4 off its terms
    ],
)
def test_a_settings_copy_is_checked_like_a_new_object(settings: pydantic.BaseModel, update: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        settings.model_copy(update=update)


def test_a_settings_copy_keeps_the_fields_it_does_not_change() -> None:
    base = SpecConfig(method=SpecMethod.ddd, budget=6, ddd_check_steps=(1, 2, 3), dsde=DSDEConfig(sl_init=3))
    assert base.model_copy(update={"budget": 8}) == SpecConfig(
        method=SpecMethod.ddd, budget=8, ddd_check_steps=(1, 2, 3), dsde=DSDEConfig(sl_init=3)
    )
    assert base.model_copy() == base and base.model_copy(deep=True) == base


# ───────────────────────── weighted variance / WVIR ─────────────────────────


def test_weighted_variance_by_hand():
    # x = [1, 2, 4] (oldest first), delta = 0.5: ages 2, 1, 0 -> w = [0.25, 0.5, 1], sum w = 1.75
    # m = (0.25*1 + 0.5*2 + 1*4) / 1.75 = 5.25 / 1.75 = 3
    # var = (0.25*(1-3)^2 + 0.5*(2-3)^2 + 1*(4-3)^2) / 1.75 = 2.5 / 1.75 = 10/7
    assert weighted_variance([1.0, 2.0, 4.0], 0.5) == pytest.approx(10 / 7, rel=1e-12)
    # Newest-last orientation matters: [4, 2, 1] -> m = 3/1.75 = 12/7,
    # var = (0.25*(16/7)^2 + 0.5*(2/7)^2 + (5/7)^2) / 1.75 = (91/49) / 1.75 = 52/49
    assert weighted_variance([4.0, 2.0, 1.0], 0.5) == pytest.approx(52 / 49, rel=1e-12)
    # delta = 1: the plain population variance, 14/9
    assert weighted_variance([1.0, 2.0, 4.0], 1.0) == pytest.approx(14 / 9, rel=1e-12)
    assert weighted_variance([3.0], 0.85) == 0.0
    assert weighted_variance([], 0.85) == 0.0


def test_wvir_by_hand():
    cfg = DSDEConfig(n_short=2, n_long=4, delta=0.5)
    h = [0.0, 0.0, 1.0, 3.0]
    # long: w = [1/8, 1/4, 1/2, 1], sum 15/8; m = (1/2 + 3) / (15/8) = 28/15
    #   var = (3/8*(28/15)^2 + 1/2*(13/15)^2 + (17/15)^2) / (15/8) = (667.5/225) / 1.875 = 356/225
    # short = [1, 3]: w = [1/2, 1], m = 7/3, var = (1/2*(4/3)^2 + (2/3)^2) / 1.5 = 8/9
    # WVIR = (8/9) / (356/225) = 150/267
    assert wvir(h, cfg) == pytest.approx(150 / 267, rel=1e-12)
    # only the newest n_long values count
    assert wvir([100.0, -50.0, *h], cfg) == pytest.approx(150 / 267, rel=1e-12)
    # reference short window: newest max(1, 4 // 3) = 1 value -> Var_w(short) = 0 -> WVIR 0
    assert wvir(h, cfg.model_copy(update={"short_window": ShortWindow.reference})) == 0.0
    # reference short window: the floor of a third (round would give 2 and 3 for 5 and 8 values)
    ref8 = DSDEConfig(n_long=8, n_short=2, delta=0.5, short_window=ShortWindow.reference)
    assert [short_window_size(n, ref8) for n in (2, 5, 8)] == [1, 1, 2]
    assert wvir([0.0, 0.0, 0.0, 1.0, 3.0], ref8) == 0.0  # 5 values: the newest alone
    # 6 values, reference short = newest 2 = [1, 3] again (8/9), long over all 6 with delta 0.5
    h6 = [0.0, 0.0, 0.0, 0.0, 1.0, 3.0]
    cfg6 = DSDEConfig(n_long=6, n_short=2, delta=0.5, short_window=ShortWindow.reference)
    assert wvir(h6, cfg6) == pytest.approx((8 / 9) / weighted_variance(h6, 0.5), rel=1e-12)
    # fewer than 2 values; 2 already give a ratio: long [1, 3] (w [1/2, 1], var 8/9) over short = newest 1 (var 0)
    assert wvir([], cfg) == 0.0
    assert wvir([0.7], cfg) == 0.0
    assert wvir([1.0, 3.0], cfg.model_copy(update={"n_short": 1})) == 0.0
    assert wvir([1.0, 3.0], cfg.model_copy(update={"n_short": 3})) == pytest.approx(1.0, rel=1e-12)  # short = both


def test_wvir_flat_history_both_variants():
    flat = [0.2] * 12
    assert wvir(flat, DSDEConfig()) == 1.0
    assert wvir(flat, DSDEConfig(flat_kld=FlatKLD.reference)) == 20.0
    # nearly flat: long variance ~ 6e-8 < 1e-6 still counts as flat
    ref = DSDEConfig(flat_kld=FlatKLD.reference)
    almost = [0.2, 0.2005] * 6
    assert weighted_variance(almost, 0.85) < 1e-6
    assert wvir(almost, DSDEConfig()) == 1.0 and wvir(almost, ref) == 20.0
    # just above the threshold it is a real ratio (close to 1: the same pattern in both windows), not 20
    wobbly = [0.2, 0.203] * 6
    assert weighted_variance(wobbly, 0.85) > 1e-6
    assert wvir(wobbly, ref) == pytest.approx(1.0, abs=0.05)
    assert wvir(wobbly, ref) == wvir(wobbly, DSDEConfig())


def test_wvir_detects_recent_instability():
    calm_then_spiky = [0.1] * 20 + [0.1, 2.0, 0.1, 2.0, 0.1, 2.0, 0.1, 2.0, 0.1, 2.0]
    assert wvir(calm_then_spiky, DSDEConfig()) > 1.0
    spiky_then_calm = [0.1, 2.0] * 10 + [0.1] * 10
    assert wvir(spiky_then_calm, DSDEConfig()) < 0.01


# ───────────────────────── SF / prediction / calibration ─────────────────────────


def test_scale_factor():
    assert scale_factor(0.0, 2.0) == 0.0
    assert scale_factor(0.5, 2.0) == pytest.approx(math.e - 1, rel=1e-12)
    assert scale_factor(0.1, 2.0) == pytest.approx(0.22140275816, rel=1e-9)
    assert math.isfinite(scale_factor(1e6, 2.0))


def test_predict_sl():
    # SL_min 2, SL_max 16, span 14
    assert predict_sl(0.0, 5.0, 2, 16) == 16  # WVIR 0
    assert predict_sl(0.5, 1.0, 2, 16) == 9  # 14 * 0.5 + 2 = 9 exactly, ceil keeps it
    assert predict_sl(0.3, 1.0, 2, 16) == 12  # 14 * 0.7 + 2 = 11.8 -> ceil 12
    assert predict_sl(0.25, 1.0, 2, 16) == 13  # 14 * 0.75 + 2 = 12.5 -> ceil 13 (not round-half-even 12)
    assert predict_sl(1.0, 1.0, 2, 16) == 2  # WVIR*SF = 1: still the formula, gives SL_min
    # instability fallback: WVIR*SF > 1 -> SL_min (the formula would give ceil(14 * -1 + 2) = -12)
    assert predict_sl(2.0, 1.0, 2, 16) == 2
    assert predict_sl(1.01, 1.0, 3, 9) == 3
    assert predict_sl(float("nan"), 1.0, 3, 9) == 3
    assert predict_sl(0.1, 0.1, 5, 5) == 5
    with pytest.raises(ValueError):
        predict_sl(0.1, 0.1, 6, 5)


def test_calibrate_both_c_and_both_sl_min_rules():
    # A_max 8, mu 0.3, M 0.6: c = 1 -> 8 * (1 + 0.5) = 12; c = 0.5 -> 8 * 1.25 = 10
    assert calibrate(8, 0.3, 0.6, DSDEConfig()) == (2, 12)
    assert calibrate(8, 0.3, 0.6, DSDEConfig(calibration_c=0.5)) == (2, 10)
    # clamped to SL_hard_max / up to SL_min
    assert calibrate(16, 0.5, 0.5, DSDEConfig()) == (2, 16)  # 16 * 2 = 32 -> 16
    assert calibrate(0, 0.0, 0.0, DSDEConfig()) == (2, 2)  # nothing accepted -> SL_min
    # round(): half to even, as the reference code. With M + 1e-8 exact in floats the product lands on the half:
    # 3 * (1 + 0.5 / 1) = 4.5 -> 4 and 1 * (1 + 3 * 0.25 / 0.5) = 2.5 -> 2 (half up would give 5 and 3)
    assert calibrate(3, 0.5, 1 - 1e-8, DSDEConfig())[1] == 4
    assert calibrate(1, 0.25, 0.5 - 1e-8, DSDEConfig(calibration_c=3.0, sl_min=1))[1] == 2
    # SL_min rules: paper = cfg.sl_min; reference = min(SL_max, max(cfg.sl_min, ceil(0.1 SL_max)))
    assert calibrate(8, 0.3, 0.6, DSDEConfig(sl_min=1)) == (1, 12)
    assert calibrate(8, 0.3, 0.6, DSDEConfig(sl_min=1, sl_min_rule=SLMinRule.reference)) == (2, 12)  # ceil(1.2)
    big = {"sl_min": 1, "sl_hard_max": 32}
    assert calibrate(16, 0.5, 0.5, DSDEConfig(**big)) == (1, 32)
    assert calibrate(16, 0.5, 0.5, DSDEConfig(**big, sl_min_rule=SLMinRule.reference)) == (4, 32)  # ceil(3.2)


def test_calibration_c_is_finite_and_a_huge_one_saturates_instead_of_failing_the_sequence():
    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(pydantic.ValidationError, match="calibration_c"):
            DSDEConfig(calibration_c=bad)
    huge = DSDEConfig(calibration_c=1e308)  # c mu overflows: float('inf') * 0 was NaN, round(inf) an OverflowError
    assert calibrate(8, 0.3, 1e-9, huge) == (2, 16)  # as large as SL_hard_max allows
    assert calibrate(0, 0.3, 1e-9, huge) == (2, 2)  # nothing accepted: SL_min, whatever c
    assert calibrate(16, 0.5, 0.5, DSDEConfig.reference(sl_hard_max=32)) == (3, 24)  # c .5: 16 * 1.5 = 24


# ───────────────────────── batch cap ─────────────────────────


def test_sl_cap_and_apply_cap():
    sls = [16, 4, 9, 2]
    post = [False, True, True, True]  # the first sequence is still in warm-up
    warm = [not p for p in post]
    cap = sl_cap(sls, post)
    assert cap == 5  # ceil(mean(4, 9, 2)) = ceil(5.0)
    assert apply_cap(sls, cap, warm, cap_warmup=False) == [16, 4, 5, 2]  # warm-up uncapped by default
    assert apply_cap(sls, cap, warm, cap_warmup=True) == [5, 4, 5, 2]
    assert sl_cap([4, 9, 3], [True, True, True]) == 6  # ceil(16/3)
    assert sl_cap([16, 8], [False, False]) is None
    assert apply_cap([16, 8], None, [True, True], cap_warmup=True) == [16, 8]
    with pytest.raises(ValueError):
        sl_cap([1, 2], [True])


@dataclass
class FakeState:
    sl: int
    in_warmup: bool

    def next_sl(self) -> int:
        return self.sl


@dataclass
class Row:
    spec: SpecConfig
    sl_state: FakeState | SequenceDSDE | None


DSDE_CHAIN = SpecConfig(method=SpecMethod.chain, policy=SLPolicyKind.dsde)


def _dsde_rows(
    states: list[FakeState], max_sls: list[int | None] | None = None, dsde: DSDEConfig | None = None
) -> list[Row]:
    max_sls = max_sls or [None] * len(states)
    update = {"dsde": dsde or DSDEConfig()}
    return [Row(DSDE_CHAIN.model_copy(update=update | {"max_sl": m}), s) for s, m in zip(states, max_sls, strict=True)]


def test_planner_dsde_cap():
    states = [FakeState(16, True), FakeState(4, False), FakeState(9, False), FakeState(2, False)]
    plan = SLPlanner().plan(_dsde_rows(states))
    assert (plan.depths, plan.uncapped, plan.cap) == ([16, 4, 5, 2], [16, 4, 9, 2], 5)
    plan = SLPlanner().plan(_dsde_rows(states, dsde=DSDEConfig(cap_warmup=True)))
    assert plan.depths == [5, 4, 5, 2]
    plan = SLPlanner().plan(_dsde_rows(states, dsde=DSDEConfig(cap_enabled=False)))
    assert (plan.depths, plan.cap) == ([16, 4, 9, 2], None)
    # the cap is taken over the depths the sequences would draft: per-request max_sl first (the third drafts 1, so
    # the cap is ceil((4 + 1 + 2) / 3) = 3), and SL stays >= 1
    plan = SLPlanner().plan(_dsde_rows(states, [3, None, 1, 8]))
    assert (plan.depths, plan.cap) == ([3, 3, 1, 2], 3)
    assert SLPlanner().plan([]).depths == []
    # a sequence with n tokens left drafts at most n - 1 (a step emits its drafts and one token of the target's),
    # and still 1 with one left; the cap is taken after this limit, as a level past a row's room keeps nobody
    # waiting: the rows past warm-up reach 2, 9 and 1, so the cap is ceil(12 / 3) = 4 (5 over the SLs before it)
    plan = SLPlanner().plan(_dsde_rows(states), room=[1, 3, 100, 2])
    assert (plan.depths, plan.cap) == ([1, 2, 4, 1], 4)
    # only warm-up sequences: no cap
    warm = [FakeState(8, True), FakeState(4, True)]
    assert SLPlanner().plan(_dsde_rows(warm, dsde=DSDEConfig(cap_warmup=True))).cap is None


def test_planner_reads_each_requests_own_cap_settings_and_caps_chains_and_trees_apart():
    # a request that turned the cap off is neither capped nor counted; one that caps warm-up is capped in warm-up
    off = DSDE_CHAIN.model_copy(update={"dsde": DSDEConfig(cap_enabled=False)})
    warm = DSDE_CHAIN.model_copy(update={"dsde": DSDEConfig(cap_warmup=True)})
    rows = [Row(off, FakeState(16, False)), Row(DSDE_CHAIN, FakeState(2, False)), Row(DSDE_CHAIN, FakeState(8, False))]
    rows.append(Row(warm, FakeState(12, True)))
    plan = SLPlanner().plan(rows)
    assert plan.cap == 5 and plan.depths == [16, 2, 5, 5]  # ceil((2 + 8) / 2) = 5
    # chains and trees draft in separate loops: each kind has its own cap
    tree = SpecConfig(method=SpecMethod.ddd, policy=SLPolicyKind.dsde, ddd_max_depth=16)
    rows = [Row(DSDE_CHAIN, FakeState(2, False)), Row(DSDE_CHAIN, FakeState(4, False))]
    rows += [Row(tree, FakeState(12, False)), Row(tree, FakeState(16, False))]
    plan = SLPlanner().plan(rows)
    assert plan.depths == [2, 3, 12, 14] and plan.cap == 14


def test_the_cap_is_over_depths_drafted_by_the_draft_model():
    """SL_cap averages the depths the draft model's lock-step loop would run: a tree's SL past its depth limit
    drafts no level anyone waits for, and a row only a model-free drafter serves runs no draft forward (it is
    neither counted nor capped; with the model as its fallback it is both)."""
    tree = SpecConfig(method=SpecMethod.ddd, policy=SLPolicyKind.dsde, ddd_max_depth=5)
    rows = [Row(tree, FakeState(10, False)), Row(tree, FakeState(2, False))]
    plan = SLPlanner().plan(rows)
    assert (plan.depths, plan.cap) == ([4, 2], 4)  # ceil((5 + 2) / 2); over the SLs it was ceil((10 + 2) / 2) = 6
    rows = [Row(tree, FakeState(16, False)), Row(tree, FakeState(2, False)), Row(tree, FakeState(2, False))]
    assert SLPlanner().plan(rows).depths == [3, 2, 2]  # the straggler is cut: ceil((5 + 2 + 2) / 3) = 3
    lookup = DSDE_CHAIN.model_copy(update={"drafter": Drafter.lookup, "model_fallback": False})
    rows = [Row(DSDE_CHAIN, FakeState(16, False))] + [Row(lookup, FakeState(2, False)) for _ in range(3)]
    assert SLPlanner().plan(rows).depths == [16, 2, 2, 2]  # the lone model chain waits for nobody
    rows = [Row(lookup, FakeState(16, False)), Row(DSDE_CHAIN, FakeState(2, False))]
    assert SLPlanner().plan(rows).depths == [16, 2]
    fallback = lookup.model_copy(update={"model_fallback": True})
    rows = [Row(fallback, FakeState(16, False)), Row(DSDE_CHAIN, FakeState(2, False))]
    assert SLPlanner().plan(rows).depths == [9, 2]
    # ... but only with a draft model to fall back on: without one (none loaded, or detached) no row runs a draft
    # forward, and a lookup row kept 7 of its 16 levels under a cap for a draft loop that never ran
    lookups = [Row(fallback, FakeState(12, False)), Row(fallback, FakeState(2, False))]
    assert (SLPlanner().plan(lookups).depths, SLPlanner().plan(lookups).cap) == ([7, 2], 7)
    plan = SLPlanner().plan(lookups, model=False)
    assert (plan.depths, plan.cap) == ([12, 2], None)
    # the model's own limit (model_max_sl) bounds the model's share alone, not the cap of a lookup row's depth
    limited = fallback.model_copy(update={"model_max_sl": 2})
    assert SLPlanner().plan([Row(limited, FakeState(8, False))]).depths == [8]
    # and the cap is over the model's shares: a tree whose model budget is 6 drafts at most 5 levels of its SL 16
    # (the default DDD depth limit is deeper), so beside two at 2 the cap is ceil((5 + 2 + 2) / 3) = 3, not 5
    budgeted = SpecConfig(method=SpecMethod.ddd, policy=SLPolicyKind.dsde, model_budget=6)
    rows = [Row(budgeted, FakeState(16, False)), Row(budgeted, FakeState(2, False)), Row(budgeted, FakeState(2, False))]
    plan = SLPlanner().plan(rows)
    assert budgeted.model_depth(plan.uncapped[0]) == 5 and (plan.depths, plan.cap) == ([3, 2, 2], 3)


def test_a_priced_count_tree_is_bounded_by_its_static_depth_not_by_the_sl():
    """A lookup tree whose nodes are each priced by their measured acceptance (``free_tree_priced``) may draft to
    its static depth (here T - 1 = 7) whatever DSDE's SL or SL_cap says; the draft model's share keeps the SL's
    depth. The room, max_sl and a step planned plain still bound it."""
    lookup = SpecConfig(
        method=SpecMethod.ddd, policy=SLPolicyKind.dsde, drafter=Drafter.lookup, budget=8, model_budget=6
    )
    assert lookup.free_tree_priced
    straggler = SpecConfig(method=SpecMethod.ddd, policy=SLPolicyKind.dsde, ddd_max_depth=16)
    rows = [Row(lookup, FakeState(2, False)), Row(lookup, FakeState(9, False)), Row(straggler, FakeState(16, False))]
    plan = SLPlanner().plan(rows)
    # the cap is over the head's shares, 2, min(7, 6 - 1) = 5 and 16: ceil(23 / 3) = 8
    assert plan.depths == [2, 7, 8] and plan.cap == 8
    assert [plan.free_depth(i) for i in range(3)] == [7, 7, 8]  # lookup: T - 1 levels; the head's row: its depth
    assert plan.select([0, 2]).free_depths == [7, 8]
    # SL_cap cuts the row's model share (the cap over 5, 2 and 2 is 3) but not its lookup tree
    heads = [Row(SpecConfig(method=SpecMethod.ddd, policy=SLPolicyKind.dsde), FakeState(2, False))] * 2
    plan = SLPlanner().plan([Row(lookup, FakeState(9, False)), *heads])
    assert plan.cap == 3 and plan.depths == [3, 2, 2] and plan.free_depths == [7, 2, 2]
    assert (plan.limit(0, by_model=True), plan.limit(0, by_model=False)) == (3, 7)
    assert (plan.was_cut(0, by_model=True), plan.was_cut(0, by_model=False)) == (True, False)
    assert SLPlanner().plan([Row(lookup, FakeState(9, False))], room=[4]).cut == [True]  # (the room bounds it)
    assert SLPlanner().plan(rows, room=[3, 100, 100]).free_depths == [2, 7, 8]
    capped = lookup.model_copy(update={"max_sl": 3})
    assert SLPlanner().plan([Row(capped, FakeState(9, False))]).free_depths == [3]
    # a step whose token budget leaves a tree nothing drafts no lookup levels either
    assert SLPlanner(max_step_tokens=3).plan(rows[:2]).free_depths == [0, 0]
    # count trees scored by their shares or kept whatever their score, and lookup chains, keep the SL's depth
    shares = lookup.model_copy(update={"model_free": lookup.model_free.model_copy(update={"calibrated": False})})
    unfloored = lookup.model_copy(update={"model_free": lookup.model_free.model_copy(update={"min_score": 0.0})})
    chain = DSDE_CHAIN.model_copy(update={"drafter": Drafter.lookup})
    for spec in (shares, unfloored, chain):
        assert not spec.free_tree_priced
        plan = SLPlanner().plan([Row(spec, FakeState(2, False))])
        assert plan.free_depths is None and plan.free_depth(0) == plan.depths[0] == 2


def test_planner_static_and_trees():
    spec = SpecConfig(method=SpecMethod.chain, sl=5)
    rows = [Row(spec, None), Row(spec.model_copy(update={"max_sl": 2}), None), Row(spec, None)]
    plan = SLPlanner().plan(rows)
    assert (plan.depths, plan.uncapped, plan.cap) == ([5, 2, 5], [5, 5, 5], None)
    with pytest.raises(pydantic.ValidationError):
        SpecConfig(sl=0)
    # trees: the DSDE SL bounds the depth budget, never beyond the method's own depth; plain rows draft nothing
    ddd = SpecConfig(method=SpecMethod.ddd, policy=SLPolicyKind.dsde, ddd_max_depth=6)
    rows = [Row(ddd, FakeState(9, True)), Row(ddd, FakeState(3, True)), Row(SpecConfig(method=SpecMethod.none), None)]
    assert SLPlanner().plan(rows).depths == [6, 3, 0]
    # a tree verified with budget T drafts at most T - 1 levels, whatever the DSDE SL
    small = ddd.model_copy(update={"budget": 4})
    assert SLPlanner().plan([Row(small, FakeState(9, True)), Row(small, FakeState(2, True))]).depths == [3, 2]


def test_planner_token_guard():
    spec = SpecConfig(method=SpecMethod.chain, sl=6)
    rows = [Row(spec, None), Row(spec.model_copy(update={"sl": 2}), None)]
    # 2 rows + 8 drafted fit 10; at 7 the longest chain shrinks first
    assert SLPlanner(max_step_tokens=10).plan(rows).depths == [6, 2]
    assert SLPlanner(max_step_tokens=7).plan(rows).depths == [3, 2]
    tree = SpecConfig(method=SpecMethod.eagle2, budget=8)
    assert SLPlanner(max_step_tokens=9).plan([Row(tree, None), Row(tree, None)]).depths == [0, 6]
    # among equals the one that gives way rotates from step to step: the oldest used to lose its tree every step
    planner = SLPlanner(max_step_tokens=3 + 2 * 8)
    plans = [planner.plan([Row(tree, None)] * 3).depths for _ in range(4)]
    assert plans == [[0, 6, 6], [6, 0, 6], [6, 6, 0], [0, 6, 6]]
    assert SLPlanner(max_step_tokens=3 + 3 * 8).plan([Row(tree, None)] * 3).depths == [6, 6, 6]
    # a tree only the draft model grows counts its own budget; one a model-free drafter may grow, the whole budget
    capped = tree.model_copy(update={"model_budget": 5})
    assert SLPlanner(max_step_tokens=10).plan([Row(capped, None), Row(capped, None)]).depths == [6, 6]
    lookup = capped.model_copy(update={"drafter": Drafter.lookup})
    assert SLPlanner(max_step_tokens=10).plan([Row(lookup, None), Row(lookup, None)]).depths == [0, 6]


def test_the_plan_marks_the_rows_the_batch_cut():
    chain = SpecConfig(method=SpecMethod.chain, sl=6)
    rows = [Row(chain, None), Row(chain.model_copy(update={"sl": 2}), None)]
    assert SLPlanner(max_step_tokens=7).plan(rows).cut == [True, False]  # depths [3, 2]: the budget
    assert SLPlanner().plan(rows, room=[3, 10]).cut == [True, False]  # depths [2, 2]: the first row's room
    assert SLPlanner().plan(rows, room=[10, 10]).cut == [False, False]
    # a tree's own depth, a request's max_sl and a tree dropped whole (not observed) are not cuts
    tree = SpecConfig(method=SpecMethod.eagle2, budget=8)
    limited = chain.model_copy(update={"max_sl": 2})
    plan = SLPlanner(max_step_tokens=12).plan([Row(tree, None), Row(tree, None), Row(limited, None)])
    assert (plan.depths, plan.cut) == ([0, 6, 2], [False, False, False])
    # SL_cap: a calibrated DSDE chain past the mean of its batch's SLs
    dsde = [Row(DSDE_CHAIN, FakeState(9, False)), Row(DSDE_CHAIN, FakeState(3, False))]
    plan = SLPlanner().plan(dsde)
    assert (plan.depths, plan.cut, plan.select([1, 0]).cut) == ([6, 3], [True, False], [False, True])
    assert plan.model_cut == [True, False] and plan.select([1, 0]).model_cut == [False, True]
    # the draft model's own limit: two chains in warm-up at SL 16 that the budget cuts to 9 each still draft
    # model_max_sl = 4 (the model was not cut: counted, warm-up ended in a full batch), at 3 each they are cut
    warm = [Row(DSDE_CHAIN.model_copy(update={"model_max_sl": 4}), FakeState(16, True))] * 2
    plan = SLPlanner(max_step_tokens=20).plan(warm)
    assert (plan.depths, plan.model_cut, plan.cut) == ([9, 9], [False, False], [True, True])
    assert [plan.was_cut(i, by_model=True) for i in (0, 1)] == [False, False]
    plan = SLPlanner(max_step_tokens=8).plan(warm)
    assert (plan.depths, plan.model_cut) == ([3, 3], [True, True])


def _shrunk_by_the_rule(rows: list[Row], depths: list[int], limit: int, turn: int) -> list[int]:
    """The token guard of docs/algorithms.md §7, one token (or tree) at a time over a scan of every row."""
    depths, n = list(depths), len(rows)

    def cost(i: int) -> int:
        return 0 if depths[i] == 0 else (rows[i].spec.max_tree_nodes if rows[i].spec.is_tree else depths[i])

    while sum(cost(i) for i in range(n)) > max(0, limit - n):
        i = max(range(n), key=lambda i: (cost(i), -((i - turn) % n)))
        depths[i] = depths[i] - 1 if not rows[i].spec.is_tree else 0
    return depths


def test_the_token_guard_shrinks_large_mixed_batches_as_its_rule_says():
    """The guard's shrink, now a heap (a scan per removed token took 2.7 s a step at batch 512), gives the rule's
    depths on random mixes of chains, trees and plain rows, step after step as the row that gives way rotates."""
    import random

    rng = random.Random(5)
    kinds = [
        SpecConfig(method=SpecMethod.chain, sl=12),
        SpecConfig(method=SpecMethod.chain, sl=3),
        SpecConfig(method=SpecMethod.eagle2, budget=8),
        SpecConfig(method=SpecMethod.ddd, budget=16),
        SpecConfig(method=SpecMethod.none),
    ]
    for _ in range(60):
        rows = [Row(rng.choice(kinds), None) for _ in range(rng.choice([1, 3, 16, 70, 300]))]
        limit = rng.choice([1, len(rows), len(rows) + 5, 2 * len(rows), 64, 10 * len(rows)])
        planner = SLPlanner(max_step_tokens=limit)
        unlimited = SLPlanner().plan(rows).depths
        for _ in range(3):
            turn = planner._shrunk
            assert planner.plan(rows).depths == _shrunk_by_the_rule(rows, unlimited, limit, turn)


def test_kld_nodes():
    assert kld_nodes([3, 7], 9, past_rejection=False) == [0, 3, 7]  # the root and the accepted path
    assert kld_nodes([], 5, past_rejection=False) == [0]
    assert kld_nodes([1], 4, past_rejection=True) == [0, 1, 2, 3]


def test_kld_positions():
    assert kld_positions(4, 2, record_past_rejection=False) == 3  # 2 accepted + the first rejected
    assert kld_positions(4, 4, record_past_rejection=False) == 4  # all accepted: no rejected position
    assert kld_positions(4, 2, record_past_rejection=True) == 4
    assert kld_positions(0, 0, record_past_rejection=False) == 0


# ───────────────────────── per-sequence state ─────────────────────────


def test_warmup_doubling_and_end_after_n_long_positions():
    s = SequenceDSDE(DSDEConfig())
    assert s.in_warmup and s.next_sl() == 4
    s.observe([0.1] * 4, 4, 4)  # all accepted -> double; 4 positions
    assert s.next_sl() == 8
    s.observe([0.1] * 3, 8, 2)  # 2 accepted + 1 rejected = 3 positions; no doubling
    assert s.next_sl() == 8 and s.positions == 7
    s.observe([0.1] * 8, 8, 8)  # 15 positions
    assert s.next_sl() == 16
    s.observe([0.1] * 14, 16, 13)  # 29 positions (< 30): still warm-up, SL unchanged
    assert s.in_warmup and s.next_sl() == 16 and s.a_max == 13
    s.observe([0.1] * 16, 16, 16)  # 45 positions: this step still counts as warm-up, then calibrate
    assert not s.in_warmup and s.a_max == 16
    assert (s.sl_min, s.sl_max) == (2, 16)  # round(16 * (1 + 0.1/0.1)) = 32 -> 16
    # history flat at 0.1 -> WVIR 1 (stable), SF = e^0.2 - 1 = 0.2214 -> ceil(14 * 0.7786 + 2) = 13
    assert s.next_sl() == 13


def test_warmup_doubling_is_capped_and_counts_positions_not_steps():
    cfg = DSDEConfig(sl_init=4, sl_hard_max=6, sl_min=2)
    s = SequenceDSDE(cfg)
    s.observe([0.0] * 4, 4, 4)
    assert s.next_sl() == 6  # min(8, 6)
    # every step rejects at the first position: 1 verified position per step; 4 KLDs recorded past the
    # rejection (reference option) must not shorten warm-up
    s2 = SequenceDSDE(DSDEConfig())
    for _ in range(29):
        s2.observe([0.5, 0.5, 0.5, 0.5], 4, 0)
    assert s2.in_warmup and s2.positions == 29 and s2.next_sl() == 4
    s2.observe([0.5], 4, 0)
    assert not s2.in_warmup
    assert (s2.sl_min, s2.sl_max) == (2, 2)  # A_max 0 -> SL_max clamps up to SL_min
    assert s2.next_sl() == 2


def test_warmup_does_not_count_a_step_the_batch_cut_and_the_draft_passed_whole():
    """A chain the batch shortened (its room, SL_cap, the step token budget) and accepted whole only says A >= its
    length: counted, a full batch calibrated SL_max to the budget's depth for the sequence's life."""
    s = SequenceDSDE(DSDEConfig(n_long=8, n_short=3))
    s.observe([0.1] * 2, 2, 2, cut=True)  # all accepted: A_max and the doubling as ever, no warm-up positions
    s.observe([0.1] * 2, 2, 2, cut=True)
    s.observe([0.1] * 3, 3, 3, cut=True)
    s.observe([0.1] * 3, 3, 3, cut=True)
    assert s.in_warmup and (s.positions, s.warmup_positions, s.a_max, s.next_sl()) == (10, 0, 3, 16)
    s.observe([0.1] * 3, 3, 2, cut=True)  # a rejection: A of this step is known, its positions count
    assert s.in_warmup and (s.positions, s.warmup_positions) == (13, 3)
    s.observe([0.1] * 5, 5, 5)  # not cut: counts; 8 positions end warm-up
    assert not s.in_warmup and s.a_max == 5 and s.sl_max == 10  # round(5 * (1 + 0.1 / 0.1))


def test_observe_validates_and_drops_nonfinite():
    s = SequenceDSDE(DSDEConfig())
    with pytest.raises(ValueError):
        s.observe([0.1], 2, 3)
    s.observe([0.1, float("nan"), float("inf")], 4, 2)
    assert list(s.history) == [0.1] and s.dropped_klds == 2


def test_sf_reads_the_mean_of_the_last_steps_finite_klds() -> None:
    """m (§4.4) is the last step's mean KLD, also over unequal values; a step with no finite KLD leaves it at the
    step before's (§4.7), not at 0 (which reads as perfect agreement)."""
    cfg = DSDEConfig()
    s = _run(cfg, 0.05, 40)
    assert (s.sl_min, s.sl_max) == (2, 16) and s.last_step_mean_kld == pytest.approx(0.05)
    s.observe([0.0, 0.2], 2, 2)
    assert s.last_step_mean_kld == pytest.approx(0.1)
    assert s.next_sl() == predict_sl(wvir(s.history, cfg), scale_factor(0.1, cfg.alpha), 2, 16)
    t = _run(cfg, 0.05, 40)
    t.observe([float("nan")], 2, 0)
    assert t.last_step_mean_kld == pytest.approx(0.05) and t.dropped_klds == 1
    assert t.next_sl() == predict_sl(wvir(t.history, cfg), scale_factor(0.05, cfg.alpha), 2, 16)


def test_calibration_reads_the_largest_kld_of_the_whole_warm_up() -> None:
    """M (§4.5) is the maximum over every warm-up KLD, not the last step's: one step at 1.0, then 0.1s."""
    s = SequenceDSDE(DSDEConfig())
    s.observe([1.0], 4, 0)  # 1 position
    while s.in_warmup:
        s.observe([0.1] * 4, 4, 4)  # 4 positions each: 8 of them end warm-up at 33
    assert s.positions == 33 and s.warmup_kld_max == 1.0
    # A_max 4, mu = (1.0 + 32 x 0.1) / 33 = 0.1273, M = 1.0: round(4 x 1.1273) = round(4.51) = 5 (M = 0.1: 9)
    assert (s.sl_min, s.sl_max) == (2, 5)
    # ... and within a step: its largest value, wherever it sits
    t = SequenceDSDE(DSDEConfig())
    t.observe([0.1, 1.0, 0.2], 4, 2)
    assert t.warmup_kld_max == 1.0


def test_warmup_doubles_only_after_a_step_that_accepted_every_drafted_token() -> None:
    """Not after one that drafted none (a tree its floor pruned to its root: 0 of 0), nor one short by a token."""
    s = SequenceDSDE(DSDEConfig())
    s.observe([0.1], 0, 0)
    assert s.next_sl() == 4
    s.observe([0.1] * 4, 4, 3)
    assert s.next_sl() == 4
    s.observe([0.1] * 4, 4, 4)
    assert s.next_sl() == 8


def _run(cfg: DSDEConfig, kld: float, steps: int) -> SequenceDSDE:
    """A sequence whose every drafted token is accepted and whose KLD is constant."""
    s = SequenceDSDE(cfg)
    for _ in range(steps):
        n = s.next_sl()
        s.observe([kld] * n, n, n)
    return s


def test_flat_kld_paper_vs_reference():
    stable, ref = DSDEConfig(), DSDEConfig(flat_kld=FlatKLD.reference)
    # A steady, good draft (constant KLD 0.05, everything accepted): the history is flat.
    # stable: WVIR 1, SF = e^0.1 - 1 = 0.10517 -> ceil(14 * 0.89483 + 2) = ceil(14.53) = 15, for ever
    # reference: WVIR 20, 20 * SF = 2.1 > 1 -> fallback SL_min = 2, for ever (every step is all-accepted)
    a, b = _run(stable, 0.05, 40), _run(ref, 0.05, 40)
    assert not a.in_warmup and not b.in_warmup
    assert a.next_sl() == 15
    assert b.next_sl() == 2
    for _ in range(20):  # b keeps drafting 2, accepting 2, and never recovers
        b.observe([0.05, 0.05], 2, 2)
    assert b.next_sl() == 2
    # At KLD = 1e-5 SF ~ 2e-5 is too small for the flat value to matter: both give SL_max = 16.
    # (The reference only collapses to SL_min when 20 * (e^{2m} - 1) > 1, i.e. m > ln(1.05)/2 = 0.0244.)
    assert _run(stable, 1e-5, 40).next_sl() == 16
    assert _run(ref, 1e-5, 40).next_sl() == 16


def test_unstable_history_drops_to_sl_min():
    s = SequenceDSDE(DSDEConfig())
    for _ in range(10):  # calm warm-up: 4 -> 8 -> 16 -> 16 ...
        n = s.next_sl()
        s.observe([0.05] * n, n, n)
    assert not s.in_warmup and s.next_sl() >= 14
    for _ in range(6):  # a sudden, jumpy run of disagreements
        s.observe([3.0, 0.01, 3.0], 3, 2)
    assert s.next_sl() == s.sl_min == 2


def test_dsde_policy_end_to_end_cap():
    states = [SequenceDSDE(DSDEConfig()) for _ in range(3)]
    # sequence 0 leaves warm-up with a good draft, sequence 1 with a poor one, sequence 2 stays in warm-up
    for _ in range(5):
        states[0].observe([0.01] * states[0].next_sl(), states[0].next_sl(), states[0].next_sl())
    for _ in range(30):
        states[1].observe([1.0], 4, 0)
    plan = SLPlanner().plan([Row(DSDE_CHAIN, st) for st in states])
    assert [s.in_warmup for s in states] == [False, False, True]
    hi, lo = plan.uncapped[0], plan.uncapped[1]
    assert hi == 16 and lo == 2
    assert plan.cap == 9  # ceil((16 + 2) / 2)
    assert plan.depths == [9, 2, 4]


# ───────────────────────── KLD ─────────────────────────


def test_kld_exact_by_hand_and_against_a_loop():
    p = torch.tensor([[0.5, 0.25, 0.25]]).log()
    q = torch.tensor([[0.25, 0.5, 0.25]]).log()
    # 0.5 ln 2 + 0.25 ln(1/2) + 0 = 0.25 ln 2
    assert kld_exact(p, q).item() == pytest.approx(0.25 * math.log(2), rel=1e-6)
    assert kld_exact(q, q).item() == pytest.approx(0.0, abs=1e-7)
    g = torch.Generator().manual_seed(0)
    pl, ql = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    got = kld_exact(pl, ql)
    assert got.shape == (5,) and got.dtype == torch.float64
    for i in range(5):
        pe = [math.exp(v) for v in pl[i].tolist()]
        qe = [math.exp(v) for v in ql[i].tolist()]
        pp = [v / sum(pe) for v in pe]
        qq = [v / sum(qe) for v in qe]
        want = sum(a * (math.log(a) - math.log(b)) for a, b in zip(pp, qq, strict=True))
        assert got[i].item() == pytest.approx(want, rel=1e-10)
    # half precision is computed in float32
    assert kld_exact(pl.half(), ql.half()).dtype == torch.float32


def test_kld_exact_clamps_probabilities():
    inf = float("inf")
    # q has a zero where p does not: without the 1e-8 floor the KLD is infinite.
    # p = [.5, .5], q = [1, 1e-8] -> .5 ln .5 + .5 ln(.5 / 1e-8) = .5 ln(2.5e7)
    got = kld_exact(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -inf]]))
    assert got.item() == pytest.approx(0.5 * math.log(2.5e7), rel=1e-5)
    # p has the zero: p = [1, 1e-8], q = [.5, .5] -> ln 2 + 1e-8 ln(2e-8)
    got = kld_exact(torch.tensor([[0.0, -inf]]), torch.tensor([[0.0, 0.0]]))
    assert got.item() == pytest.approx(math.log(2) + 1e-8 * math.log(2e-8), rel=1e-6)


def test_sparse_topk_q():
    q = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    idx, prob = sparse_topk_q(q, 2)
    full = torch.softmax(q, -1)
    assert idx.tolist() == [[1, 2]]
    assert torch.allclose(prob, full[:, [1, 2]])  # not renormalised
    assert prob.sum().item() < 0.99
    idx, prob = sparse_topk_q(q, 10)  # K > V -> V
    assert idx.shape == (1, 4)
    with pytest.raises(ValueError):
        sparse_topk_q(q, 0)


def test_kld_sparse_by_hand():
    # p uniform over 4 tokens; q ships token 0 with 0.7 -> the other three get 0.1 each
    p = torch.zeros(1, 4)
    idx, prob = torch.tensor([[0]]), torch.tensor([[0.7]])
    want = 0.25 * (math.log(0.25 / 0.7) + 3 * math.log(0.25 / 0.1))
    assert kld_sparse(p, idx, prob).item() == pytest.approx(want, rel=1e-6)
    assert kld_sparse(p, idx, prob.log(), q_is_log=True).item() == pytest.approx(want, rel=1e-6)
    # lumped: 0.25 ln(0.25/0.7) + 0.75 ln(0.75/0.3)
    want_l = 0.25 * math.log(0.25 / 0.7) + 0.75 * math.log(0.75 / 0.3)
    assert kld_sparse(p, idx, prob, tail=SparseTail.lumped).item() == pytest.approx(want_l, rel=1e-6)
    # a probability of q's top-K that underflowed to 0 counts as the floor, in either tail (inf before, in lumped:
    # observe drops it, and the sequence loses its signal)
    from specserve.policy.kld import PROB_FLOOR

    idx, prob = torch.tensor([[0, 1]]), torch.tensor([[0.0, 0.7]])
    floored = 0.25 * math.log(0.25 / PROB_FLOOR) + 0.25 * math.log(0.25 / 0.7)
    want = floored + 2 * 0.25 * math.log(0.25 / 0.15)  # the leftover 0.3 over the other two
    assert kld_sparse(p, idx, prob).item() == pytest.approx(want, rel=1e-5)
    want_l = floored + 0.5 * math.log(0.5 / 0.3)
    assert kld_sparse(p, idx, prob, tail=SparseTail.lumped).item() == pytest.approx(want_l, rel=1e-5)


def test_lumped_kld_floors_the_rest_of_either_distribution() -> None:
    """Lumped tail, the mass outside q's top-K: where q's top-K holds all of q's mass, Q_rest is the floor, not 0
    (ln 0: an infinite KLD, which ``observe`` drops); where it holds all of p's, P_rest is the floor (0 ln 0: NaN)."""
    from specserve.policy.kld import PROB_FLOOR

    p = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))  # 0.2 of p outside q's top-2
    idx, prob = torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]])  # q: all its mass in its top-2
    want = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / PROB_FLOOR)
    assert kld_sparse(p, idx, prob, tail=SparseTail.lumped).item() == pytest.approx(want, rel=1e-5)
    p = torch.log(torch.tensor([[0.6, 0.4, 0.0]]))  # all of p inside q's top-2; q keeps 0.1 outside
    idx, prob = torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.4]])
    want = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.4) + PROB_FLOOR * math.log(PROB_FLOOR / 0.1)
    assert kld_sparse(p, idx, prob, tail=SparseTail.lumped).item() == pytest.approx(want, rel=1e-5)


def test_kld_sparse_equals_exact_when_k_is_v():
    g = torch.Generator().manual_seed(1)
    p, q = 3 * torch.randn(6, 50, generator=g), 3 * torch.randn(6, 50, generator=g)
    idx, prob = sparse_topk_q(q, 50)
    exact = kld_exact(p, q)
    torch.testing.assert_close(kld_sparse(p, idx, prob), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kld_sparse(p, idx, prob, tail=SparseTail.lumped), exact, rtol=1e-5, atol=1e-5)
    # and in float64, K = V is exact to rounding
    p64, q64 = p.double(), q.double()
    idx, prob = sparse_topk_q(q64, 50)
    torch.testing.assert_close(kld_sparse(p64, idx, prob), kld_exact(p64, q64), rtol=1e-12, atol=1e-12)


def _rel_err(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (approx - exact).abs() / exact


def test_kld_sparse_error_on_peaked_random_distributions():
    """q logits = 4 randn over V = 1000, K = 64 (the top 64 hold ~97.7% of q's mass).

    Measured with this seed (float64, 512 rows):
      p independent of q (KLD ~11):    uniform tail  rel err mean 0.26, max 0.51
      p = q + 1.0 randn (KLD ~0.36):   uniform tail  rel err mean 0.15, max 0.72, mean bias +0.047 nats
                                       lumped tail   rel err mean 0.04, max 0.24, mean bias -0.013 nats
      p = q + 0.3 randn (KLD ~0.03):   uniform tail  rel err mean 1.5,  max 5.5 (bias +0.04 nats)
                                       lumped tail   rel err mean 0.04, max 0.15
      p = q (KLD 0):                   uniform tail  +0.04 nats mean, up to 0.19; lumped exactly 0
    The asserted bounds sit a little above the measured numbers.
    """
    g = torch.Generator().manual_seed(0)
    n, v, k = 512, 1000, 64
    q = 4 * torch.randn(n, v, generator=g, dtype=torch.float64)
    idx, prob = sparse_topk_q(q, k)
    assert 0.015 < (1 - prob.sum(-1)).mean().item() < 0.035  # the leftover mass is real

    p_ind = 4 * torch.randn(n, v, generator=g, dtype=torch.float64)
    rel = _rel_err(kld_sparse(p_ind, idx, prob), kld_exact(p_ind, q))
    assert rel.mean().item() < 0.30 and rel.max().item() < 0.60

    p_near = q + 1.0 * torch.randn(n, v, generator=g, dtype=torch.float64)
    exact = kld_exact(p_near, q)
    uni = kld_sparse(p_near, idx, prob)
    lump = kld_sparse(p_near, idx, prob, tail=SparseTail.lumped)
    rel_u, rel_l = _rel_err(uni, exact), _rel_err(lump, exact)
    assert rel_u.mean().item() < 0.18 and rel_u.max().item() < 0.85
    assert rel_l.mean().item() < 0.05 and rel_l.max().item() < 0.30
    assert (lump <= exact + 1e-9).all()  # lumped is a lower bound (data processing inequality)
    assert (uni - exact).mean().item() > 0.02  # the uniform tail over-estimates on draft-like pairs

    p_close = q + 0.3 * torch.randn(n, v, generator=g, dtype=torch.float64)
    exact = kld_exact(p_close, q)
    rel_l = _rel_err(kld_sparse(p_close, idx, prob, tail=SparseTail.lumped), exact)
    assert rel_l.mean().item() < 0.05 and rel_l.max().item() < 0.25

    # identical distributions: the uniform tail reports a spurious disagreement, the lumped one does not
    same_u = kld_sparse(q, idx, prob)
    same_l = kld_sparse(q, idx, prob, tail=SparseTail.lumped)
    assert same_u.mean().item() > 0.02
    assert same_l.abs().max().item() < 1e-9


def test_kld_over_temperature_switch_scales_the_signal_before_sf():
    """The reference variant divides the last step's mean KLD by the temperature before SF: at T = 0.5 a KLD
    of 0.1 acts like 0.2 (a lower SL); at T = 0 (greedy) nothing changes; the default ignores T."""
    cfg = DSDEConfig(n_long=4, n_short=2)
    ref = cfg.model_copy(update={"kld_over_temperature": True})

    def sl_after(c: DSDEConfig, temperature: float) -> int:
        s = SequenceDSDE(c, temperature)
        s.observe([0.1, 0.1], 2, 2)
        s.observe([0.1, 0.1, 0.1, 0.1], 4, 4)  # leaves warm-up: A_max 4, SL_max = round(4 (1 + 0.1 / 0.1)) = 8
        for _ in range(3):
            s.observe([0.1, 0.1], 2, 1)
        return s.next_sl()

    base = sl_after(cfg, 0.5)
    assert sl_after(cfg, 2.0) == base  # the default ignores the temperature
    assert sl_after(ref, 0.0) == base and sl_after(ref, 1.0) == base
    assert sl_after(ref, 0.5) < base  # doubled KLD: a larger SF
    assert not cfg.kld_over_temperature and DSDEConfig.reference().kld_over_temperature


def test_klds_are_never_negative_and_calibration_reads_a_negative_mean_as_zero() -> None:
    """Rounding left KL(p || q) down to -6e-7 for a draft close to the target (half the rows, exact mode), and a
    warm-up mean of -1e-6 against a maximum of 0 made mu / M hugely negative: SL_max pinned to SL_min (2) for the
    request's life, for the best of drafts."""
    from specserve.policy.dsde import calibrate
    from specserve.policy.kld import kld_exact

    g = torch.Generator().manual_seed(0)
    p = torch.randn(32, 49152, generator=g) * 3
    q = p + torch.randn(32, 49152, generator=g) * 1e-4
    assert bool((kld_exact(p, q) >= 0).all())
    idx, prob = sparse_topk_q(q, 64)
    for tail in SparseTail:
        assert bool((kld_sparse(p, idx, prob, tail=tail) >= 0).all())
    assert calibrate(16, -1e-6, 0.0, DSDEConfig()) == (2, 16)
    assert calibrate(16, 0.0, 0.0, DSDEConfig()) == (2, 16)  # (mu = M = 0: A_max, as a flat zero warm-up)
