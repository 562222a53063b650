"""The tree floor measured from the loop's own steps (specserve/policy/tree_floor.py, docs/algorithms.md §2.3)."""

from __future__ import annotations

import random

import pytest

from specserve.config import SpecConfig, SpecMethod
from specserve.policy.planner import SLPlanner
from specserve.policy.tree_floor import RowFit, TreeFloor, theil_sen


def _steps(floor: TreeFloor, n: int, *, base: float, per_row: float, batch: int = 1, seed: int = 0) -> None:
    """``n`` steps verifying 1-6 rows a sequence, each ``base + per_row * rows`` seconds with 3% noise."""
    rng = random.Random(seed)
    for _ in range(n):
        rows = batch * rng.randint(1, 6)
        floor.record_verify(batch, rows, (base + per_row * rows) * rng.uniform(0.97, 1.03))


def test_row_fit_recovers_a_line() -> None:
    fit = RowFit()
    for x in (1, 2, 3, 4, 5, 6, 1, 6):
        fit.add(float(x), 0.5 + 0.25 * x, keep=1.0)
    line = fit.line()
    assert line is not None
    assert line[0] == pytest.approx(0.5) and line[1] == pytest.approx(0.25)
    flat = RowFit()
    for _ in range(5):
        flat.add(3.0, 1.0, keep=0.9)
    assert flat.spread == pytest.approx(0.0, abs=1e-6) and flat.line() is None


def test_floor_is_row_cost_times_tokens_per_second() -> None:
    floor = TreeFloor()
    _steps(floor, 15, base=0.015, per_row=0.002)
    assert floor.row_cost(1) is None  # fewer than min_steps
    _steps(floor, 60, base=0.015, per_row=0.002, seed=1)
    cost = floor.row_cost(1)
    assert cost == pytest.approx(0.002, rel=0.15)
    assert floor.floor(1) is None  # no speculative step's rate yet
    for _ in range(10):
        floor.record_rate(1, 3, 0.05)  # 60 tokens a second
    assert floor.tokens_per_s(1) == pytest.approx(60.0)
    assert floor.floor(1) == pytest.approx(cost * 60.0)


def test_the_fit_follows_a_drifting_row_cost() -> None:
    floor = TreeFloor(memory=32)
    _steps(floor, 100, base=0.015, per_row=0.001)
    assert floor.row_cost(1) == pytest.approx(0.001, rel=0.2)
    _steps(floor, 200, base=0.020, per_row=0.003, seed=2)  # the host slowed down
    assert floor.row_cost(1) == pytest.approx(0.003, rel=0.15)


def test_one_stalled_step_barely_moves_the_slope() -> None:
    floor = TreeFloor()
    _steps(floor, 64, base=0.015, per_row=0.002)
    before = floor.row_cost(1)
    floor.record_verify(1, 6, 0.5)  # a 20x step at the widest tree (a GC pause, another process)
    after = floor.row_cost(1)
    assert before is not None and after is not None
    assert after == pytest.approx(before, rel=0.3)
    unclipped = TreeFloor(outlier_clip=1e9)
    _steps(unclipped, 64, base=0.015, per_row=0.002)
    unclipped.record_verify(1, 6, 0.5)
    assert unclipped.row_cost(1) > 2 * after  # type: ignore[operator]


def test_rows_that_stop_varying_keep_the_last_slope() -> None:
    floor = TreeFloor()
    _steps(floor, 64, base=0.015, per_row=0.002)
    cost = floor.row_cost(1)
    for _ in range(300):  # the floor pruned every tree to its root: no spread left to read a slope from
        floor.record_verify(1, 1, 0.017)
    assert floor.fits[1].spread < floor.min_spread
    frozen = floor.row_cost(1)
    assert frozen == pytest.approx(cost, rel=0.05)
    for _ in range(100):  # ... while those steps get slower (the line through them alone is undefined)
        floor.record_verify(1, 1, 0.030)
    assert floor.row_cost(1) == frozen


def test_theil_sen_takes_the_median_slope_past_an_outlier() -> None:
    points = [(1.0, 3.0), (2.0, 5.0), (3.0, 7.0), (4.0, 9.0), (1.0, 40.0)]  # y = 1 + 2x, and one 13x point
    assert theil_sen(points) == (1.0, 2.0)
    assert theil_sen([(3.0, 1.0), (3.0, 2.0)]) is None  # x never varies


def test_a_cold_first_step_does_not_set_the_floor_to_zero_and_lock_it_there() -> None:
    """A process's first speculative step (allocations, first calls) took 10x a one-row step. Unclipped, it read the
    row cost below zero: floor 0, every tree verified whole, the rows stopped varying and the slope was never read
    again (the straggler sweep's batch 1 on the Zen 4: 5 drafted nodes in every speculative step, 15 ms verifies
    against 5.8 ms plain steps, and the guard kept plain decoding for the rest of the sweep)."""
    floor = TreeFloor()
    floor.record_verify(1, 1, 0.08)
    floor.record_rate(1, 2, 0.08)
    rng = random.Random(0)
    first = None
    for step in range(300):
        p = floor.floor(1)
        # the loop's trees: the sequence's own floor while none is measured, whole below 0.05, else 1-2 rows
        rows = rng.randint(1, 4) if p is None else 6 if p < 0.05 else rng.randint(1, 2)
        seconds = 0.0058 + 0.0011 * (rows - 1)
        floor.record_verify(1, rows, seconds)
        floor.record_rate(1, 2, seconds + 0.001)
        if step == floor.min_steps - 2:  # the cold step and 15 more: the fit rebuilt from them
            first = floor.row_cost(1)
    assert first == pytest.approx(0.0011, rel=0.25)  # the cold step counted as the first steps' Theil-Sen line
    assert floor.row_cost(1) == pytest.approx(0.0011, rel=0.1)
    assert floor.floor(1) == pytest.approx(0.0011 * 2 / 0.0075, rel=0.15)  # c x R: every tree pruned as it should be


def test_a_cold_step_among_first_steps_of_one_size_counts_as_their_median() -> None:
    """First trees all whole (6 rows): no Theil-Sen line through them, and a cold first step counted 10x; now as the
    steps' median, so the row cost read once the rows vary is the true one."""
    floor = TreeFloor()
    floor.record_verify(1, 6, 0.1)
    for _ in range(19):
        floor.record_verify(1, 6, 0.0113)
    _steps(floor, 20, base=0.0047, per_row=0.0011)
    assert floor.row_cost(1) == pytest.approx(0.0011, rel=0.15)


@pytest.mark.parametrize("at", [16, 17, 30])  # (16: the first step the fit clips)
def test_a_pause_among_whole_trees_after_the_first_steps_is_clipped(at: int) -> None:
    """Past the first steps, rows that never varied give the fit no line, yet a step still counts as at most twice
    their mean: unclipped, a 10x step there read a row at twice its cost once the rows varied."""
    floor = TreeFloor()
    for i in range(40):
        floor.record_verify(1, 6, 0.1 if i == at else 0.0113)
    _steps(floor, 20, base=0.0047, per_row=0.0011)
    assert floor.row_cost(1) == pytest.approx(0.0011, rel=0.15)


def test_a_wider_step_after_steps_of_one_size_counts_whole_and_a_pause_among_them_is_clipped() -> None:
    """Steps whose trees the floor pruned to their roots (16 rows at batch 16, one size, no line): a step of 40
    rows after them is not a pause, though it takes 2.5x their mean; one of 16 rows taking 10x is."""
    floor = TreeFloor()
    for _ in range(20):
        floor.record_verify(16, 16, 0.06)
    fit = floor.fits[16]
    before = fit.sy * floor.keep
    floor.record_verify(16, 40, 0.15)
    assert fit.sy - before == pytest.approx(0.15)
    before = fit.sy * floor.keep
    floor.record_verify(16, 16, 0.6)
    assert fit.sy - before < 0.2


def test_buckets_and_bounds() -> None:
    floor = TreeFloor(max_floor=0.5)
    _steps(floor, 64, base=0.060, per_row=0.002, batch=16)
    assert floor.row_cost(16) is not None and floor.fits.keys() == {16}
    assert floor.row_cost(12) == floor.row_cost(16)  # one bucket spans 9-16
    floor.record_rate(16, 400, 0.1)  # 4000 tokens a second: 8 a row's worth -> capped
    assert floor.floor(16) == 0.5
    negative = TreeFloor()
    for i in range(64):
        rows = 1 + i % 6
        negative.record_verify(1, rows, 0.02 - 0.001 * rows)
    negative.record_rate(1, 2, 0.02)
    # a slope at or below zero is no row's cost (it read as 0 once: floor 0, every tree whole): none is kept, and the
    # sequences' own floor applies
    assert negative.row_cost(1) is None and negative.floor(1) is None
    with pytest.raises(ValueError, match="max_floor"):
        TreeFloor(max_floor=1.0)
    with pytest.raises(ValueError, match="memory"):
        TreeFloor(memory=0.5)


def test_a_bucket_settles_once_its_floor_is_measured_or_after_max_settle_steps() -> None:
    floor = TreeFloor(max_settle_steps=40)
    assert floor.settling(1) and floor.settling(16)  # nothing measured anywhere
    _steps(floor, 20, base=0.015, per_row=0.002)
    assert floor.row_cost(1) is not None and floor.settling(1)  # no speculative step's rate yet
    floor.record_rate(1, 2, 0.02)
    assert not floor.settling(1) and floor.settling(16)  # per bucket: no speculative step's rate at 16 yet
    flat = TreeFloor(max_settle_steps=40)
    for _ in range(39):  # rows that never vary: no slope, so no floor ...
        flat.record_verify(16, 16, 0.05)
    flat.record_rate(16, 16, 0.05)
    assert flat.row_cost(16) is None and flat.settling(16)
    flat.record_verify(16, 16, 0.05)  # ... until the 40th step
    assert not flat.settling(16)
    assert not TreeFloor(max_settle_steps=0).settling(1)
    with pytest.raises(ValueError, match="max_settle_steps"):
        TreeFloor(max_settle_steps=-1)


def test_a_bucket_without_its_own_fit_borrows_the_nearest_row_cost_and_settles_on_its_first_rate() -> None:
    """A bucket the loop reaches a few steps at a time (a batch of 4's last two sequences) used to settle only after
    16 speculative steps of its own, and until then the guard did not judge its speculation: the straggler sweep's
    batch-4 runs speculated in every run's two-sequence tail at 2.6x a plain step's time for 2x its tokens."""
    floor = TreeFloor()
    _steps(floor, 64, base=0.015, per_row=0.002)  # batch 1
    _steps(floor, 64, base=0.060, per_row=0.0005, batch=16, seed=1)
    c1, c16 = floor.row_cost(1), floor.row_cost(16)
    assert c1 == pytest.approx(0.002, rel=0.15) and c16 == pytest.approx(0.0005, rel=0.3)
    assert floor.row_cost(2) == c1 and floor.row_cost(4) == c1  # nearest by powers of two; the smaller of two as near
    assert floor.row_cost(8) == c16 and floor.row_cost(64) == c16
    assert floor.settling(2) and floor.floor(2) is None  # no speculative step's rate in the bucket yet
    floor.record_rate(2, 4, 0.025)  # its own rate, from its first measured step
    assert not floor.settling(2) and floor.floor(2) == pytest.approx(c1 * 160.0)
    _steps(floor, 16, base=0.020, per_row=0.004, batch=2, seed=2)  # its own fit, once it has min_steps
    assert floor.row_cost(2) == pytest.approx(0.004, rel=0.2) and floor.row_cost(1) == c1


class _Row:
    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec
        self.sl_state = None


def test_the_plan_carries_the_floor_only_where_a_tree_asks_for_it() -> None:
    floor = TreeFloor()
    _steps(floor, 64, base=0.015, per_row=0.002)
    floor.record_rate(1, 2, 0.02)
    planner = SLPlanner(floor=floor)
    ddd = SpecConfig(method=SpecMethod.ddd, budget=6, tree_min_prob=0.06)
    assert planner.plan([_Row(ddd)]).min_prob is None
    plan = planner.plan([_Row(ddd.model_copy(update={"adaptive_floor": True}))])
    assert plan.min_prob == pytest.approx(floor.floor(1))
    assert plan.select([0]).min_prob == plan.min_prob
    chain = SpecConfig(method=SpecMethod.chain, sl=2, adaptive_floor=True)
    assert planner.plan([_Row(chain)]).min_prob is None  # chains have no floor to set
    assert SLPlanner().plan([_Row(ddd.model_copy(update={"adaptive_floor": True}))]).min_prob is None


def test_the_rate_forgets_old_steps_at_its_memory() -> None:
    """R is a decayed ratio (docs/algorithms.md §2.3): after 100 steps at 60 tokens/s and 200 at 20 it reads close to
    20, as the geometric weights say, where a cumulative ratio read 33."""
    floor = TreeFloor()
    for tokens_per_s, steps in ((60.0, 100), (20.0, 200)):
        for _ in range(steps):
            floor.record_rate(1, 2, 2 / tokens_per_s)
    k = 1.0 - 1.0 / floor.memory
    new, old = (1 - k**200) / (1 - k), k**200 * (1 - k**100) / (1 - k)  # the steps' summed weights
    assert floor.tokens_per_s(1) == pytest.approx(2 * (new + old) / (new * 2 / 20 + old * 2 / 60), rel=1e-9)
    assert floor.tokens_per_s(1) < 22


def test_the_first_steps_clip_only_steps_above_their_line() -> None:
    """Once a bucket's first ``min_steps`` are in, its fit is rebuilt from them with a step above ``outlier_clip``
    times their Theil-Sen line counted as the line's value; a step below the line (a quick one) is kept as it was,
    not raised to the line."""
    floor = TreeFloor(min_steps=8, memory=64.0)
    steps = [(float(x), 1.0 + x + (0.1 if x % 2 else -0.1)) for x in range(1, 9)]  # off their line a little
    steps[1] = (2.0, 30.0)  # a cold step, 10x its line
    steps[5] = (6.0, 2.0)  # a quick one, under a third of its line (and of twice it)
    for rows, seconds in steps:
        floor.record_verify(1, int(rows), seconds)
    line = theil_sen(steps)
    assert line is not None
    intercept, slope = line
    want = RowFit()
    for i, (x, y) in enumerate(steps):
        want.add(x, intercept + slope * x if i == 1 else y, floor.keep)
    got = floor.fits[1]
    assert got.steps == want.steps == 8
    assert (got.weight, got.sx, got.sy, got.sxx, got.sxy) == pytest.approx(
        (want.weight, want.sx, want.sy, want.sxx, want.sxy), rel=1e-12
    )


class _PlainFirst:
    """A guard that holds plain decoding for its first ``plain`` recorded steps, then speculation for good."""

    def __init__(self, plain: int) -> None:
        self.plain, self.steps = plain, 0

    def speculate(self, batch_size: int, *, measured: bool = True, outlook: object = None) -> bool:
        return self.steps >= self.plain

    def record(self, batch_size: int, speculative: bool, tokens: int, seconds: float, **kw: object) -> None:
        self.steps += 1


def _loop_rates(max_step_tokens: int | None, guard: _PlainFirst | None) -> tuple[TreeFloor, list[int], list[int]]:
    """A DDD loop with the measured floor over 16 sequences (tiny models): the floor, and the catch-up tokens of
    each step it fitted and of each whose rate it took."""
    from specserve.config import SLPolicyKind
    from specserve.engine import Engine
    from specserve.models.tiny import noisy_copy, tiny_model
    from specserve.sampling import SamplingParams

    target = tiny_model(seed=0)
    spec = SpecConfig(
        method=SpecMethod.ddd, budget=8, ddd_check_steps=(1, 2, 3), tree_min_prob=0.06, adaptive_floor=True,
        policy=SLPolicyKind.dsde,
    )  # fmt: skip
    engine = Engine(
        target, None, draft=noisy_copy(target, 0.05), speculation=spec, max_batch_size=16,
        max_step_tokens=max_step_tokens, eos_token_ids=set(), throughput_guard=guard is not None,
    )  # fmt: skip
    floor = engine.loop.planner.floor = TreeFloor()
    if guard is not None:
        engine.loop.planner.guard = guard  # type: ignore[assignment]
    fitted: list[int] = []
    rated: list[int] = []
    record_verify, record_rate = floor.record_verify, floor.record_rate

    def caught_up() -> int:
        return sum(s.draft_caught_up for s in engine.loop.running)

    def verifying(batch_size: int, rows: int, seconds: float) -> None:
        fitted.append(caught_up())
        record_verify(batch_size, rows, seconds)

    def rating(batch_size: int, tokens: int, seconds: float) -> None:
        rated.append(caught_up())
        record_rate(batch_size, tokens, seconds)

    floor.record_verify, floor.record_rate = verifying, rating  # type: ignore[method-assign]
    prompts = [[(7 * i + j) % 500 + 1 for j in range(6)] for i in range(16)]
    engine.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    return floor, fitted, rated


def test_the_loop_rate_counts_catch_ups_within_speculation_not_a_switchs() -> None:
    """Under a step token budget some row is caught up in every step (the budget drops whole trees in turn): R left
    out every such step, so at batch 16 under the serving budget the floor was never measured (the fixed
    ``tree_min_prob`` sized every tree) and the guard judged no step until ``max_settle_steps``. A catch-up after
    plain steps (the guard's switch) stays out: its re-read is the switch's cost, not speculation's rate."""
    floor, fitted, rated = _loop_rates(64, None)
    # (the rate, what this is about; the floor also needs a positive row-cost slope, which a loaded host's timings
    # may not give a tiny model: it failed a CI run so)
    assert floor.rates.get(16) and floor.tokens_per_s(16) is not None
    # every speculative step's, catch-ups among them, but the first's (no step planned to speculate came before)
    assert any(rated) and rated == fitted[1:]
    floor, fitted, rated = _loop_rates(None, _PlainFirst(plain=5))
    assert fitted[0] == 16 * 12  # the switch: 16 sequences re-read the 12 tokens plain steps left them
    assert rated == fitted[1:] and floor.rates.get(16)  # every speculative step's but the switch's
