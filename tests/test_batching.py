"""Continuous batching with DSDE: lossless under any SL, SL adaptation, SL_cap, guard, metrics, no leaks."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest

from specserve.config import ChainDraft, Drafter, KLDMode, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.guard import GuardConfig, Outlook, ThroughputGuard
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_model
from specserve.policy import DSDEConfig
from specserve.policy.tree_floor import TreeFloor
from specserve.sampling import SamplingParams
from specserve.sequence import Request
from specserve.spec_decode.eagle_head import EagleHead, EagleHeadConfig
from specserve.step_events import StepEvent, StepObserver, idle_fraction
from tests.conftest import greedy_reference

MISSED = 50  # tokens the draft re-reads in a switch step of the guard tests below (a catch-up)
PROMPTS = [[5, 9, 13], [100, 200, 300, 400, 7, 8, 9], [42], [7, 7, 7, 7, 7, 1, 2], [300, 301], [11, 12, 13, 14]]
DSDE_CHAIN = SpecConfig(method=SpecMethod.chain, policy=SLPolicyKind.dsde, dsde=DSDEConfig(n_long=8, n_short=3))
DSDE_DDD = SpecConfig(
    method=SpecMethod.ddd,
    policy=SLPolicyKind.dsde,
    dsde=DSDEConfig(n_long=8, n_short=3),
    beam_width=3,
    budget=12,
    ddd_max_depth=8,
    ddd_check_steps=(2, 4, 6),
)


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(seed=0)


@pytest.mark.parametrize("spec", [DSDE_CHAIN, DSDE_DDD], ids=["dsde-chain", "dsde-ddd"])
@pytest.mark.parametrize("mode", [KLDMode.exact, KLDMode.sparse])
def test_dsde_output_equals_plain_greedy(target: LlamaModel, spec: SpecConfig, mode: KLDMode) -> None:
    engine = Engine(
        target,
        None,
        draft=noisy_copy(target, 0.02),
        speculation=spec.model_copy(update={"kld_mode": mode}),
        max_batch_size=4,
        eos_token_ids=set(),
    )
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=30))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 30)
    assert any(m.cap is not None for m in engine.loop.stats.metrics)  # sequences left warm-up and were capped


def test_dsde_grows_sl_for_a_perfect_draft_and_shrinks_it_for_a_bad_one(target: LlamaModel) -> None:
    paper = SpecConfig(method=SpecMethod.chain, policy=SLPolicyKind.dsde)  # n_long 30: 4 + 8 + 16 in warm-up
    perfect = Engine(target, None, draft=target, speculation=paper, eos_token_ids=set())
    perfect.generate(PROMPTS[:1], SamplingParams(max_tokens=60))
    planned = [m.planned[0] for m in perfect.loop.stats.metrics]
    assert planned[:3] == [4, 8, 16]  # warm-up doubles after fully accepted steps
    assert max(planned) == 16
    bad = Engine(target, None, draft=noisy_copy(target, 0.3), speculation=DSDE_CHAIN, eos_token_ids=set())
    bad.generate(PROMPTS[:1], SamplingParams(max_tokens=40))
    planned = [m.planned[0] for m in bad.loop.stats.metrics]
    assert planned[0] == 4 and planned[-1] <= 3  # calibrated down after warm-up (A_max small)


def test_dsde_observes_the_depth_of_the_tree_the_target_verified(
    target: LlamaModel, dsde_observed: list[tuple[int, int]]
) -> None:
    """A tree's rerank keeps T - 1 nodes, and may drop the deepest levels the draft grew: DSDE is told the depth of
    the tree verified, so a perfect draft's fully accepted trees count as fully accepted (warm-up doubles)."""
    observed = dsde_observed

    class Trees(StepObserver):
        def __init__(self) -> None:
            self.kept: list[tuple[int, int]] = []  # (levels grown, depth of the kept tree)

        def on_step(self, event: StepEvent) -> None:
            for p in event.proposals:
                if p is not None:
                    depth = {0: 0}
                    for node, parent in enumerate(p.parents, start=1):
                        depth[node] = depth[parent] + 1
                    self.kept.append((p.depth, max(depth.values())))

    spec = SpecConfig(method=SpecMethod.eagle2, policy=SLPolicyKind.dsde, budget=6, tree_depth=6, beam_width=4)
    engine = Engine(target, None, draft=target, speculation=spec, eos_token_ids=set())
    trees = Trees()
    engine.loop.observers.append(trees)
    engine.generate(PROMPTS[:1], SamplingParams(max_tokens=60, ignore_eos=True))
    assert len(observed) == len(trees.kept) > 0
    assert [d for d, _ in observed] == [kept for _, kept in trees.kept]
    assert any(grown > kept for grown, kept in trees.kept)  # levels the rerank dropped
    assert any(a == d for d, a in observed)


def test_sl_cap_is_the_ceiled_mean_of_post_warmup_sls(target: LlamaModel) -> None:
    engine = Engine(target, None, draft=noisy_copy(target, 0.02), speculation=DSDE_CHAIN, eos_token_ids=set())
    rooms: list[list[int]] = []  # the tokens each row may still emit, per step (they bound its depth too)
    plan = engine.loop.planner.plan
    engine.loop.planner.plan = lambda rows, **kw: rooms.append(list(kw["room"])) or plan(rows, **kw)  # type: ignore
    engine.generate(PROMPTS, SamplingParams(max_tokens=40))
    assert len(rooms) == len(engine.loop.stats.metrics)
    capped_steps = [(m, r) for m, r in zip(engine.loop.stats.metrics, rooms, strict=True) if m.cap is not None]
    assert capped_steps
    for m, room in capped_steps:  # SL_cap = ceil(mean depth over the post-warm-up rows: SL_i within its room)
        post = [min(u, max(1, n - 1)) for u, p, n in zip(m.uncapped, m.post_warmup, room, strict=True) if p]
        assert m.cap == math.ceil(sum(post) / len(post))
        for u, planned, p, n in zip(m.uncapped, m.planned, m.post_warmup, room, strict=True):
            assert planned == min(min(u, m.cap) if p else u, max(1, n - 1))  # warm-up exempt from the cap
    assert any(min(u, n - 1) > p for m, r in capped_steps for u, p, n in zip(m.uncapped, m.planned, r, strict=True))
    no_cap = DSDE_CHAIN.model_copy(update={"dsde": DSDEConfig(n_long=8, n_short=3, cap_enabled=False)})
    engine2 = Engine(target, None, draft=noisy_copy(target, 0.02), speculation=no_cap, eos_token_ids=set())
    engine2.generate(PROMPTS, SamplingParams(max_tokens=40))
    assert all(m.cap is None for m in engine2.loop.stats.metrics)


def test_plan_applies_the_cap_to_post_warmup_sequences_only(target: LlamaModel) -> None:
    from specserve.policy import SequenceDSDE

    engine = Engine(target, None, draft=target, speculation=DSDE_CHAIN, eos_token_ids=set())
    for p in PROMPTS[:3]:
        engine.submit(p, SamplingParams(max_tokens=5))
    engine.loop._admit()
    seqs = engine.loop.running
    states = [SequenceDSDE(DSDEConfig(n_long=8, n_short=3)) for _ in seqs]
    for st in states[:2]:  # two calibrated sequences (SL 9 and 2), one still warming up at SL 16
        st.sl_min, st.sl_max = 2, 16
    states[0]._sl, states[1]._sl, states[2]._sl = 9, 2, 16
    for seq, st in zip(seqs, states, strict=True):
        seq.sl_state = st
    plan = engine.loop.planner.plan(seqs)
    assert plan.uncapped == [9, 2, 16] and plan.cap == math.ceil((9 + 2) / 2) and plan.depths == [6, 2, 16]


def test_max_sl_override_and_the_token_guard(target: LlamaModel) -> None:
    spec = SpecConfig(method=SpecMethod.chain, sl=8, max_sl=3)
    engine = Engine(target, None, draft=target, speculation=spec, eos_token_ids=set())
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=10))
    assert all(max(m.planned) <= 3 for m in engine.loop.stats.metrics)
    guarded = Engine(
        target,
        None,
        draft=target,
        speculation=SpecConfig(method=SpecMethod.chain, sl=8),
        max_step_tokens=10,
        eos_token_ids=set(),
    )
    outs = guarded.generate(PROMPTS[:4], SamplingParams(max_tokens=12))
    for m in guarded.loop.stats.metrics:
        assert sum(m.planned) + m.batch_size <= 10 or sum(m.planned) == 0
    for prompt, out in zip(PROMPTS[:4], outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 12)


def test_warmup_under_the_token_budget_calibrates_to_the_draft_not_to_the_budget(
    target: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A perfect draft warmed up in a full batch whose step budget cuts its chains to 4 tokens or fewer: those steps
    (all accepted) leave warm-up running, and the sequence left alone calibrates to the depth its draft reaches
    (docs/algorithms.md §4.5). Counted, SL_max stayed about the budget's depth for the sequence's life."""
    from specserve.policy import SequenceDSDE

    states: dict[int, SequenceDSDE] = {}
    observe = SequenceDSDE.observe

    def recording(self: SequenceDSDE, klds: list[float], drafted: int, accepted: int, *, cut: bool) -> None:
        states[id(self)] = self
        observe(self, klds, drafted, accepted, cut=cut)

    monkeypatch.setattr(SequenceDSDE, "observe", recording)
    engine = Engine(target, None, draft=target, speculation=DSDE_CHAIN, max_step_tokens=20, eos_token_ids=set())
    params = [SamplingParams(max_tokens=n) for n in (20, 20, 20, 48)]
    outs = engine.generate(PROMPTS[:4], params)
    for prompt, p, out in zip(PROMPTS[:4], params, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, p.max_tokens)
    *short, alone = sorted(states.values(), key=lambda st: st.positions)
    seen = [(st.in_warmup, st.positions, st.a_max) for st in short]
    assert all(warm and positions >= 8 and a_max <= 4 for warm, positions, a_max in seen), seen
    assert not alone.in_warmup and alone.a_max >= 8 and alone.sl_max is not None and alone.sl_max >= 8
    # a draft model that drafts at most 4 levels (model_max_sl) is not cut by a budget of 4 a row: its steps count,
    # and warm-up ends in the full batch (read as cut, it never did while the batch stayed full)
    states.clear()
    spec = DSDE_CHAIN.model_copy(update={"model_max_sl": 4})
    engine = Engine(target, None, draft=target, speculation=spec, max_step_tokens=20, eos_token_ids=set())
    engine.generate(PROMPTS[:4], SamplingParams(max_tokens=20))
    seen = [(st.in_warmup, st.positions, st.a_max) for st in states.values()]
    assert len(seen) == 4 and all(not warm and a_max == 4 for warm, _, a_max in seen), seen


def test_synthetic_acceptance_follows_the_configured_rates(target: LlamaModel) -> None:
    engine = Engine(
        target, None, draft=target, speculation=SpecConfig(method=SpecMethod.chain, sl=6), eos_token_ids=set()
    )
    rates = {}
    for a in (0.9, 0.3):
        spec = SpecConfig(method=SpecMethod.chain, sl=6, synthetic_accept=a)
        # 16 x 200 tokens: the measured rate's spread is ~0.02 (4 x 200: ~0.04, and 0.08 was then a 2-sigma bound)
        outs = engine.generate([PROMPTS[0]] * 16, SamplingParams(max_tokens=200), speculation=spec)
        rates[a] = sum(o.stats.accepted for o in outs) / sum(o.stats.drafted for o in outs)
    # accepted prefix of 6 Bernoulli(a): E[accepted] = sum_{k=1..6} a^k
    for a, got in rates.items():
        expected = sum(a**k for k in range(1, 7)) / 6
        assert abs(got - expected) < 0.08, (a, got, expected)
    assert engine.loop.stats.metrics[-1].synthetic


def test_idle_fraction() -> None:
    assert idle_fraction([4, 4, 4]) == 0.0
    assert idle_fraction([8, 2, 2]) == pytest.approx(1 - 12 / 24)
    assert idle_fraction([0, 0]) == 0.0


def test_continuous_batching_arrivals_cancellations_and_no_leaks(target: LlamaModel) -> None:
    """200 random requests arriving at random steps, some cancelled mid-flight, mixed methods and policies."""
    rng = random.Random(0)
    draft = noisy_copy(target, 0.02)
    engine = Engine(target, None, draft=draft, speculation=DSDE_CHAIN, max_batch_size=6, eos_token_ids=set())
    specs = [
        DSDE_CHAIN,
        DSDE_DDD,
        SpecConfig(method=SpecMethod.none),
        SpecConfig(method=SpecMethod.eagle2, beam_width=2, budget=8, tree_depth=3),
    ]
    pending = [
        ([rng.randrange(1, 500) for _ in range(rng.randint(1, 12))], rng.randint(1, 10), rng.choice(specs))
        for _ in range(200)
    ]
    got: dict[str, list[int]] = {}
    meta: dict[str, tuple[list[int], int]] = {}
    cancelled: set[str] = set()
    while pending or engine.loop.has_work:
        for _ in range(rng.randint(0, 3)):
            if pending:
                prompt, n, spec = pending.pop()
                rid = engine.submit(prompt, SamplingParams(max_tokens=n), speculation=spec)
                got[rid], meta[rid] = [], (prompt, n)
        for out in engine.loop.step():
            got[out.request_id] += out.token_ids
        if rng.random() < 0.05 and engine.loop.running:
            victim = rng.choice(engine.loop.running).request.request_id
            assert engine.loop.abort(victim)
            cancelled.add(victim)
    checked = 0
    for rid, (prompt, n) in meta.items():
        if rid not in cancelled and checked < 40:  # spot-check outputs against plain greedy decoding
            assert got[rid] == greedy_reference(target, prompt, n)
            checked += 1
    assert cancelled
    assert engine.loop.target.cache.num_free == engine.loop.target.cache.num_slots
    assert engine.loop.draft.cache.num_free == engine.loop.draft.cache.num_slots  # type: ignore[union-attr]
    assert not engine.loop.target.params and not engine.loop.draft.params  # type: ignore[union-attr]


def test_throughput_guard_picks_the_faster_mode_and_explores() -> None:
    from specserve.guard import bucket

    assert [bucket(b) for b in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    # switches as cheap as a step: no spacing
    guard = ThroughputGuard(GuardConfig(explore_every=5, warmup=1, explore_cost=1.0))
    assert not guard.speculate(8)  # nothing measured: plain decoding first (no draft prefill needed)
    guard.record(8, False, tokens=40, seconds=1.0)
    assert guard.speculate(8)  # then speculation
    guard.record(8, True, tokens=1, seconds=1.0, caught_up_tokens=MISSED)  # the switch: a catch-up, not measured
    assert guard.speculate(8) and guard.faster(8) is None  # so speculation is measured on the next step
    guard.record(8, True, tokens=10, seconds=1.0)
    tries, prev = [], True
    for step in range(3, 40):
        s = guard.speculate(8)
        if s:
            tries.append(step)
        guard.record(8, s, tokens=10 if s else 40, seconds=1.0, caught_up_tokens=MISSED if s and not prev else 0)
        prev = s
    # plain is 4x faster: speculation only on exploration tries (the switch step, then a measured step); the
    # interval counts measured steps (5, then 10, 20: the switch steps are not counted) and doubles per confirmation
    assert tries == [5, 6, 16, 17, 37, 38]
    assert not guard.speculate(1)  # other buckets are independent
    # speculation becomes much faster: the next try flips the choice and the interval starts over
    flipped = ThroughputGuard(
        GuardConfig(explore_every=5, smoothing=1.0, token_smoothing=1.0, warmup=1, explore_cost=1.0)
    )
    for spec, tokens, missed in ((False, 40, 0), (True, 10, MISSED), (True, 10, 0)):  # plain; switch; measured
        flipped.record(8, spec, tokens, seconds=1.0, caught_up_tokens=missed)
    choices, prev = [], True
    for _ in range(12):
        s = flipped.speculate(8)
        choices.append(s)
        flipped.record(8, s, tokens=80 if s else 40, seconds=1.0, caught_up_tokens=MISSED if s and not prev else 0)
        prev = s
    assert choices[:3] == [False, False, True] and all(choices[3:8])  # the try (switch + measured step) flips it
    assert choices[8] is False and all(choices[9:])  # ... re-try plain 5 measured steps after the flip (reset)
    assert flipped.intervals[8] == 10  # that try confirmed speculation: the interval doubles again
    # a bucket spans batch sizes 9-16: rates are per sequence, so a step of 9 sequences emitting 12 tokens beats
    # one of 16 emitting 16 in the same time
    mixed = ThroughputGuard(GuardConfig(warmup=1))
    for batch, spec, tokens in ((16, False, 16), (9, True, 0), (9, True, 12)):
        mixed.record(batch, spec, tokens, seconds=1.0, caught_up_tokens=MISSED if tokens == 0 else 0)
    assert mixed.faster(16) is True
    # a step's time weighs as it does in throughput: one speculative step 10x slower outweighs a fast one (a
    # moving average of rates would say 55 tok/s per sequence, still above plain's 40); unclipped here, since
    # by default one step counts as at most 2x the average (test_one_slow_step_counts_as_at_most_twice_...)
    timed = ThroughputGuard(GuardConfig(warmup=1, smoothing=0.5, outlier_clip=100.0))
    for spec, tokens, seconds, missed in ((False, 40, 1, 0), (True, 0, 1, MISSED), (True, 100, 1, 0)):
        timed.record(1, spec, tokens, seconds, caught_up_tokens=missed)
    assert timed.faster(1) is True
    timed.record(1, True, 100, 10.0)
    assert timed.faster(1) is False and timed.rates[(1, True)] == pytest.approx(100 / 5.5)


def test_one_slow_step_that_flips_the_guard_is_re_checked_at_once() -> None:
    """Plain decoding is 2x faster; one plain step that also admits a long prompt (10x a step) flips the choice to
    speculation. The guard re-tries plain after ``warmup`` steps (here 1: at once), and that try's fresh step
    replaces plain's average (blended, the slow step would keep plain looking slower for many tries): plain again,
    and since a try flipped the choice, the try interval starts over (speculation re-tried 5 steps later). (The
    slow step is not clipped here; by default one this slow counts as 2x the average: the next test.)"""
    guard = ThroughputGuard(
        GuardConfig(explore_every=5, max_explore_every=640, warmup=1, explore_cost=1.0, outlier_clip=100.0)
    )
    guard.record(1, False, tokens=1, seconds=0.02)
    guard.record(1, True, tokens=0, seconds=0.02, caught_up_tokens=MISSED)
    guard.record(1, True, tokens=1, seconds=0.04)
    assert guard.faster(1) is False
    for _ in range(400):  # long enough that the try interval has grown well past warmup
        s = guard.speculate(1)
        guard.record(1, s, tokens=1, seconds=0.04 if s else 0.02)
    assert guard.intervals[1] > 100
    guard.record(1, False, tokens=1, seconds=0.2)  # the admission step
    assert guard.faster(1) is True  # flipped by the running mode's own slow step
    choices = []
    for _ in range(6):
        s = guard.speculate(1)
        choices.append(s)
        guard.record(1, s, tokens=1, seconds=0.04 if s else 0.02)
    assert choices == [False, False, False, False, False, True]
    assert guard.faster(1) is False and guard.rates[(1, False)] == pytest.approx(50.0)


def test_one_slow_step_counts_as_at_most_twice_the_average() -> None:
    """Plain decoding 2x faster than speculation: one plain step 13x slower (a GC pause) counts as 2x plain's
    average and leaves the choice; a real slowdown (every step 3x slower) flips it within a few steps."""
    guard = ThroughputGuard(GuardConfig(explore_every=1000, warmup=1))
    guard.record(1, False, tokens=1, seconds=0.02)
    guard.record(1, True, tokens=1, seconds=0.04)
    guard.record(1, False, tokens=1, seconds=0.26)
    assert guard.work[(1, False)][1] == pytest.approx(0.02 + 0.3 * 0.02)  # clipped at 2 x 0.02
    assert guard.faster(1) is False
    slow = 0
    while guard.faster(1) is False:
        guard.record(1, False, tokens=1, seconds=0.06)
        slow += 1
    assert slow <= 4
    with pytest.raises(ValueError, match="outlier_clip"):
        ThroughputGuard(GuardConfig(outlier_clip=0.5))


def _plain_held_after_a_try(follow_drift: bool) -> ThroughputGuard:
    """Batch 32: plain decoding 0.18 s a step, speculation's warm-up 0.25 s for 34 tokens (~22% slower): plain holds
    (drift followed from there on: ``drift_after_tries`` 0)."""
    cfg = GuardConfig(explore_every=1000, warmup=1, follow_drift=follow_drift, drift_after_tries=0)
    guard = ThroughputGuard(cfg)
    guard.record(32, False, tokens=32, seconds=0.18)
    guard.record(32, True, tokens=34, seconds=0.25)
    assert guard.faster(32) is False
    return guard


def test_with_follow_drift_a_host_slowing_plain_steps_does_not_make_speculation_look_faster() -> None:
    """A host that slows (plain steps 0.18 -> 0.30 s) slows speculation alike: without ``follow_drift`` speculation's
    old time soon looks faster and the guard switches to it (a switch step and a measured step, each time the host
    drifts); with it, speculation's time counts as moved by as much as plain decoding's, and plain holds."""
    drifting = [0.18 + 0.012 * i for i in range(1, 11)]
    old, new = _plain_held_after_a_try(False), _plain_held_after_a_try(True)
    for seconds in drifting:
        for guard in (old, new):
            guard.record(32, False, tokens=32, seconds=seconds)
    assert old.faster(32) is True
    assert new.faster(32) is False
    spec_tok, spec_s = new.work[(32, True)]
    assert new._spec_rate(32) == pytest.approx(spec_tok / spec_s * 0.18 / new.work[(32, False)][1])


def test_follow_drift_follows_plain_decoding_only_from_a_try_of_speculation() -> None:
    """Speculation held and then slowed until plain decoding took over: its time is its own recent one, not one
    measured beside plain decoding, so plain decoding's later drift is not followed and can hand the choice back
    (as without the switch); a plain average replaced by a fresh step ends what drift there was to follow."""
    guard = ThroughputGuard(GuardConfig(explore_every=1000, warmup=1, follow_drift=True, drift_after_tries=0))
    guard.record(32, False, tokens=32, seconds=0.18)
    guard.record(32, True, tokens=48, seconds=0.2)
    assert guard.faster(32) is True and 32 in guard.drift_base  # the warm-up ran beside plain decoding
    steps = 0
    while guard.faster(32):  # speculation's own steps slow down: plain takes over
        guard.record(32, True, tokens=48, seconds=0.3)
        steps += 1
        assert 32 not in guard.drift_base  # speculation running: its time is fresh
    assert steps < 10
    for seconds in (0.2, 0.26, 0.32, 0.38, 0.44):  # the flip's refreshed plain step, then the host slows
        guard.record(32, False, tokens=32, seconds=seconds)
    assert guard.faster(32) is True


def test_follow_drift_waits_for_tries_in_a_row_that_confirm_plain_decoding() -> None:
    """By default drift is followed once two tries of speculation in a row confirmed plain decoding (one that
    happened to measure speculation slow is not held against it while the host drifts); a flip to speculation
    starts the count again."""
    guard = ThroughputGuard(GuardConfig(explore_every=5, warmup=1, explore_cost=1.0, follow_drift=True))
    followed, prev = [], False
    for _ in range(60):
        s = guard.speculate(32)
        guard.record(32, s, 34 if s else 32, 0.25 if s else 0.18, caught_up_tokens=MISSED if s and not prev else 0)
        if s and prev:  # a try's measured step
            followed.append(32 in guard.drift_base)
        prev = s
    # speculation's warm-up (no try), the first try, then the second and every later one
    assert followed[:4] == [False, False, True, True] and guard.confirmed_plain[32] >= 3
    for seconds in (0.2, 0.22, 0.24, 0.26, 0.28, 0.3):  # the host slows: plain holds
        guard.record(32, False, tokens=32, seconds=seconds)
    assert guard.faster(32) is False
    guard.record(32, True, tokens=32 * 3, seconds=0.26)  # a try that finds speculation 2x faster
    assert guard.faster(32) is True and 32 not in guard.confirmed_plain and 32 not in guard.drift_base


def test_the_guards_first_decision_has_no_margin() -> None:
    """§7: the first decision, from the two warm-ups, takes the faster mode whatever the margin."""
    guard = ThroughputGuard(GuardConfig(warmup=1, margin=0.05))
    guard.record(1, False, 100, 1.0)
    guard.record(1, True, 0, 1.0, caught_up_tokens=MISSED)  # the switch: not timed
    guard.record(1, True, 102, 1.0)  # 2% faster, within the margin
    assert guard.faster(1) is True


def test_a_guard_try_that_flips_the_choice_starts_the_interval_over() -> None:
    """§7: a try that flips the choice resets the interval to ``explore_every``, however far it had grown."""
    cfg = GuardConfig(explore_every=5, warmup=1, explore_cost=1.0, smoothing=1.0, token_smoothing=1.0)
    guard = ThroughputGuard(cfg)
    for spec, tokens, missed in ((False, 40, 0), (True, 8, MISSED), (True, 8, 0)):
        guard.record(8, spec, tokens, 1.0, caught_up_tokens=missed)
    assert guard.faster(8) is False
    before = False
    for _ in range(80):  # plain 5x faster: every try confirms it and the interval doubles
        spec = guard.speculate(8)
        guard.record(8, spec, 8 if spec else 40, 1.0, caught_up_tokens=MISSED if spec and not before else 0)
        before = spec
    assert guard.intervals[8] >= 20
    for _ in range(200):  # now speculation 4x faster: the next try flips the choice
        spec = guard.speculate(8)
        guard.record(8, spec, 160 if spec else 40, 1.0, caught_up_tokens=MISSED if spec and not before else 0)
        before = spec
        if guard.faster(8):
            break
    assert guard.faster(8) is True and guard.intervals[8] == cfg.explore_every


def test_throughput_guard_spaces_its_tries_by_what_they_cost() -> None:
    # plain steps take 0.125 s for 5 tokens a sequence; switching to speculation costs a 10 s catch-up (the draft
    # re-reads what it missed), then speculation measures slower (1 s for 1.25 tokens a sequence, where plain
    # decoding takes 0.03125 s: 0.96875 s more): each try waits until the plain time since the last one is
    # 1 / explore_cost times what the last try cost
    def switch_steps(explore_cost: float, steps: int) -> list[int]:
        guard = ThroughputGuard(GuardConfig(explore_every=5, warmup=1, explore_cost=explore_cost))
        out, prev = [], False
        for i in range(steps):
            s = guard.speculate(8)
            switch = s and not prev
            if switch:
                out.append(i)
            seconds = 10.0 if switch else 1 if s else 0.125
            tokens = 0 if switch else 10 if s else 40
            guard.record(8, s, tokens=tokens, seconds=seconds, caught_up_tokens=MISSED if switch else 0)
            prev = s
        assert guard.plain_step_s[8] == 0.125
        return out, guard.switch_s[8]

    # explore_cost 1: the warm-up's switch at step 1 (10 s), its measured step 2 (decision: plain; next try after
    # 10 / 0.125 = 80 measured steps, not 5, 10, 20), a try at 82 costing 10.96875 s: the next after 88 steps
    assert switch_steps(1.0, 200) == ([1, 82, 171], 10.0 + 0.96875)
    assert switch_steps(0.25, 200) == ([1], 10.0)  # 320 plain steps before the first try


def test_a_try_measured_on_a_swamped_host_spaces_the_next_by_at_most_max_try_spacing() -> None:
    """Plain steps 0.125 s; a try measured while the host was swamped takes 100 s (~800 plain steps' time): at
    ``explore_cost`` 0.0075 it would space the next try by ~107000 steps; capped, the next try comes 2560 steps on."""
    guard = ThroughputGuard(GuardConfig(explore_every=5, warmup=1))
    guard.record(8, False, tokens=8, seconds=0.125)
    guard.record(8, True, tokens=0, seconds=100.0, caught_up_tokens=MISSED)
    guard.record(8, True, tokens=8, seconds=100.0)
    assert guard.faster(8) is False
    steps = 0
    while not guard.speculate(8):
        guard.record(8, False, tokens=8, seconds=0.125)
        steps += 1
    assert steps == guard.cfg.max_try_spacing - 1 == 2559  # counted from the warm-up's last step
    assert math.ceil(guard.switch_s[8] / (guard.cfg.explore_cost * 0.125)) > 100_000  # what the cost alone asked
    with pytest.raises(ValueError, match="explore_cost"):
        ThroughputGuard(GuardConfig(explore_cost=0.0))
    with pytest.raises(ValueError, match="max_try_spacing"):
        ThroughputGuard(GuardConfig(max_try_spacing=100))


def test_a_switch_step_costs_its_time_beyond_plain_decoding_for_what_it_emitted() -> None:
    # plain steps 0.125 s for 40 tokens (5 a sequence); the switch step (a catch-up) takes 1 s, and the measured step
    # after it 1 s for 10 tokens (0.96875 s beyond plain decoding). A switch step that emits nothing costs its second;
    # one that emits 320 tokens (what plain decoding emits in 1 s, as an EAGLE head's catch-up step at batch 1 emits
    # its accepted tokens) costs nothing, so the tries come as often as their measured steps' cost allows
    def switches(switch_tokens: int) -> tuple[list[int], float]:
        guard = ThroughputGuard(GuardConfig(explore_every=5, warmup=1, explore_cost=1.0))
        out, prev = [], False
        for i in range(30):
            s = guard.speculate(8)
            switch = s and not prev
            if switch:
                out.append(i)
            tokens = switch_tokens if switch else 10 if s else 40
            guard.record(8, s, tokens=tokens, seconds=1.0 if s else 0.125, caught_up_tokens=MISSED if switch else 0)
            prev = s
        return out, guard.switch_s[8]

    # nothing emitted: after the warm-up (steps 0-2) the first try waits 1 / 0.125 = 8 steps (next at step count 9,
    # i = 10); that try cost 1 + 0.96875 s, 16 plain steps, so the next comes at step count 25 (i = 27)
    assert switches(0) == ([1, 10, 27], 1.0 + 0.96875)
    # 320 tokens: the warm-up's switch costs nothing (next at step count max(5, 2) - 1 = 4, i = 5); that try costs
    # 0.96875 s, 8 plain steps, fewer than the doubled interval of 10 (next at step count 14, i = 16)
    assert switches(320) == ([1, 5, 16], 0.96875)


def test_a_switch_no_try_followed_is_not_charged_to_a_later_try() -> None:
    """The warm-up's switch step (a 0.5 s catch-up) is paid for by the warm-up; the try thousands of steps later,
    whose draft had nothing to re-read, costs only its own 5 ms beyond a 20 ms plain step, and spaces the next try
    by that: 0.005 / (explore_cost 0.0075 x 0.02 s) = 34 plain steps, under the doubled interval of 40."""
    guard = ThroughputGuard()
    for _ in range(3):
        guard.record(1, False, tokens=1, seconds=0.02)
    guard.record(1, True, tokens=1, seconds=0.5, caught_up_tokens=60)
    for _ in range(3):
        assert guard.speculate(1)
        guard.record(1, True, tokens=1, seconds=0.03)
    assert guard.faster(1) is False
    while not guard.speculate(1):
        guard.record(1, False, tokens=1, seconds=0.02)
    guard.record(1, True, tokens=1, seconds=0.025)  # the try: no catch-up of its own
    assert guard.switch_s[1] == pytest.approx(0.005)
    assert guard.next_try[1] - guard._steps(1) == 40 - 1


def test_throughput_guard_decides_on_the_mean_of_its_warmup_steps() -> None:
    # plain decoding runs at 40 tok/s and speculation at 20, but the very first plain step was slow (a page
    # fault): judged on one step per mode the guard would speculate; on the mean of three it keeps plain
    def choices(guard: ThroughputGuard, steps: int) -> list[bool]:
        out, plain_steps, prev = [], 0, False
        for _ in range(steps):
            s = guard.speculate(1)
            out.append(s)
            plain_steps += not s
            seconds = 10.0 if plain_steps == 1 and not s else 1.0
            missed = MISSED if s and not prev else 0
            guard.record(1, s, tokens=20 if s else 40, seconds=seconds, caught_up_tokens=missed)
            prev = s
        return out

    warm = choices(ThroughputGuard(GuardConfig(explore_every=100)), 10)
    assert warm == [False] * 3 + [True] * 4 + [False] * 3  # 3 plain, the switch + 3 speculative, then plain
    # one step each: misled
    assert choices(ThroughputGuard(GuardConfig(explore_every=100, warmup=1)), 10)[2:] == [True] * 8
    with pytest.raises(ValueError, match="warmup"):
        ThroughputGuard(GuardConfig(warmup=0))


def drive(guard: ThroughputGuard, batch: int, spec_tokens: list[int], steps: int) -> list[bool]:
    """The guard's choices over ``steps`` steps: plain steps emit one token per sequence in 10 ms, speculative ones
    the next of ``spec_tokens`` per sequence in 12 ms (the first after plain steps is a catch-up)."""
    out, prev, spec_steps = [], False, iter(spec_tokens)
    for _ in range(steps):
        s = guard.speculate(batch)
        out.append(s)
        if s and not prev:
            guard.record(batch, True, tokens=batch, seconds=0.03, caught_up_tokens=MISSED)
        else:
            guard.record(batch, s, tokens=batch * (next(spec_steps) if s else 1), seconds=0.012 if s else 0.01)
        prev = s
    return out


def test_speculations_warmup_runs_until_its_acceptance_tells_the_modes_apart() -> None:
    """Batch 1, speculation 1.6-1.7x faster than plain decoding but its first three steps take 1 token each: a
    three-step warm-up chooses plain; the guard measures on until the mean tokens per step stands a standard error
    from break-even (1.2 tokens in 12 ms), and speculates. Where every step takes 1 token it chooses plain within
    ``max_warmup`` steps; at batch 16, whose steps average over the batch, three steps decide."""
    lucky = [1, 1, 1, 3, 2, 4, 1, 3, 2, 2] * 10
    short = drive(ThroughputGuard(GuardConfig(explore_every=1000, max_warmup=3)), 1, lucky, 20)
    assert short == [False] * 3 + [True] * 4 + [False] * 13
    guard = ThroughputGuard(GuardConfig(explore_every=1000))
    assert drive(guard, 1, lucky, 20) == [False] * 3 + [True] * 17
    assert guard.samples[(1, True)] == 16 and guard.faster(1) is True
    never = ThroughputGuard(GuardConfig(explore_every=1000))
    choices = drive(never, 1, [1] * 100, 20)
    assert never.faster(1) is False and 3 + 1 + 3 < choices.index(False, 3) <= 3 + 1 + never.cfg.max_warmup
    assert choices[choices.index(False, 3) :] == [False] * (20 - choices.index(False, 3))
    wide = ThroughputGuard(GuardConfig(explore_every=1000))
    assert drive(wide, 16, [1] * 100, 10) == [False] * 3 + [True] * 4 + [False] * 3
    with pytest.raises(ValueError, match="max_warmup"):
        ThroughputGuard(GuardConfig(warmup=4, max_warmup=3))


@pytest.mark.parametrize("warmup", [1, 3])
def test_the_engines_guard_runs_with_the_settings_it_is_given(target: LlamaModel, warmup: int) -> None:
    """The loop's guard is built from ``guard`` (it had only the defaults): with ``warmup`` plain steps measured
    after the prefill step, the first drafting step is step 1 + ``warmup``."""
    settings = GuardConfig(warmup=warmup, margin=0.2)
    engine = Engine(
        target,
        None,
        draft=noisy_copy(target, 0.02),
        speculation=DSDE_CHAIN,
        throughput_guard=True,
        guard=settings,
        eos_token_ids=set(),
    )
    engine.generate(PROMPTS, SamplingParams(max_tokens=12))
    guard = engine.loop.planner.guard
    assert guard is not None and guard.cfg == settings
    drafting = [m.levels > 0 for m in engine.loop.stats.metrics]
    assert drafting.index(True) == 1 + warmup


def test_guarded_engine_stays_lossless(target: LlamaModel) -> None:
    engine = Engine(
        target,
        None,
        draft=noisy_copy(target, 0.02),
        speculation=DSDE_CHAIN,
        throughput_guard=True,
        eos_token_ids=set(),
    )
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=30))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 30)
    guard = engine.loop.planner.guard
    assert guard is not None
    full = max(b for b, _ in guard.rates)  # the full batch's bucket ran long enough to measure both modes
    assert (full, True) in guard.rates and (full, False) in guard.rates
    drafting = [m.levels > 0 for m in engine.loop.stats.metrics]
    assert any(drafting) and not all(drafting)
    # all prompts prefill in step 1 (not recorded: a step in which any row prefills is skipped, the 1-token prompt
    # [42] included); each switch to speculation is a catch-up
    assert any(len(p) == 1 for p in PROMPTS) and not drafting[0]
    switches = sum(d and (i == 1 or not drafting[i - 1]) for i, d in enumerate(drafting) if i >= 1)
    assert switches >= 1
    assert sum(guard.steps.values()) == len(drafting) - switches - 1
    assert guard.switch_s  # the switch steps' times, kept to space the tries


class _FixedGuard(ThroughputGuard):
    def __init__(self, answer: bool) -> None:
        super().__init__()
        self.answer = answer
        self.asked = 0

    def speculate(self, batch_size: int, *, measured: bool = True, outlook: Outlook | None = None) -> bool:
        self.asked += 1
        return self.answer


@pytest.mark.parametrize("answer", [False, True])
def test_guard_decision_gates_drafting(target: LlamaModel, answer: bool) -> None:
    """The StepLoop asks the guard every step and drafts only when it says so; output is plain greedy either way."""
    engine = Engine(target, None, draft=noisy_copy(target, 0.02), speculation=DSDE_CHAIN, eos_token_ids=set())
    guard = engine.loop.planner.guard = _FixedGuard(answer)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=20))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 20)
    steps = list(engine.loop.stats.metrics)
    assert guard.asked == len(steps)
    assert all((m.levels > 0) == answer for m in steps)


class _ScriptedGuard(ThroughputGuard):
    """Answers from a script (then True) and keeps what the loop records."""

    def __init__(self, script: list[bool]) -> None:
        super().__init__()
        self.script = list(script)
        self.recorded: list[tuple[bool, bool]] = []  # (speculative, a catch-up) per recorded step
        self.caught_up: list[int] = []  # tokens the draft re-read, per recorded step
        self.measured: list[bool] = []  # per step asked: whether the loop will record it
        self.outlooks: list[Outlook | None] = []  # per step asked
        self.planned: list[bool | None] = []  # per recorded step: the mode it was planned in

    def speculate(self, batch_size: int, *, measured: bool = True, outlook: Outlook | None = None) -> bool:
        self.measured.append(measured)
        self.outlooks.append(outlook)
        return self.script.pop(0) if self.script else True

    def record(
        self,
        batch_size: int,
        speculative: bool,
        tokens: int,
        seconds: float,
        *,
        caught_up_tokens: int = 0,
        planned: bool | None = None,
    ) -> None:
        self.recorded.append((speculative, caught_up_tokens > 0))
        self.caught_up.append(caught_up_tokens)
        self.planned.append(planned)


def test_the_loop_tells_the_guard_when_the_draft_catches_up(target: LlamaModel) -> None:
    """A speculative step in which the draft model first re-reads what it missed (the prompt, or plain steps) is
    reported as a catch-up; one that follows a speculative step is not."""
    engine = Engine(target, None, draft=noisy_copy(target, 0.02), speculation=DSDE_CHAIN, eos_token_ids=set())
    guard = engine.loop.planner.guard = _ScriptedGuard([False, True, True, False, False, True, True, True])
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=12))
    # step 1 (prefill, plain) is not recorded; then spec after the prompt, spec, plain x2, spec after plain, spec ...
    assert guard.recorded[:6] == [
        (True, True),
        (True, False),
        (False, False),
        (False, False),
        (True, True),
        (True, False),
    ]
    # how many tokens: each prompt and its first token after the prefill step, then two plain steps' tokens and
    # the bonus token of the speculative step before them (its accepted drafts are in the draft's cache)
    assert guard.caught_up[:6] == [sum(len(p) + 1 for p in PROMPTS[:2]), 0, 0, 0, 2 * 3, 0]
    # and what the guard was told before each step: the draft has read nothing at admission; 12 tokens each to go
    assert guard.outlooks[0] == Outlook(sum(len(p) for p in PROMPTS[:2]), 2 * 12)
    assert guard.outlooks[1] == Outlook(sum(len(p) + 1 for p in PROMPTS[:2]), 2 * 11)
    # then the draft is 1 token behind (the bonus), 1, 2 (no catch-up yet: not counted), 3 after two plain steps
    assert [o.draft_missed for o in guard.outlooks[2:6] if o is not None] == [0, 0, 0, 2 * 3]


class _AdmittingGuard(_ScriptedGuard):
    """Speculates in every step it will time; in the others (admissions) plain decoding or speculation as told."""

    def __init__(self, admitted_plain: bool) -> None:
        super().__init__([])
        self.admitted_plain = admitted_plain

    def speculate(self, batch_size: int, *, measured: bool = True, outlook: Outlook | None = None) -> bool:
        super().speculate(batch_size, measured=measured, outlook=outlook)
        return measured or not self.admitted_plain


def test_the_guard_does_not_time_a_draft_heads_prefill(target: LlamaModel) -> None:
    """A draft head drafts nothing in a request's admission step (no features yet) and reads the prompt's features
    in the next: its prefill, a request's cost (19 ms against a 12 ms step on the Zen 4), is not timed as a step of
    speculation. A head that did not draft the admission step (plain) reads the prompt in a switch step, which the
    guard is told about as a catch-up."""

    class Steps(StepObserver):
        def __init__(self) -> None:
            self.prefills: list[bool] = []

        def on_step(self, event: StepEvent) -> None:
            self.prefills.append(event.prefills)

    head = EagleHead(EagleHeadConfig.for_target(target), target).eval()
    spec = SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.greedy, catch_up_window=6)
    for admitted_plain in (False, True):
        engine = Engine(target, None, draft=head, speculation=spec, max_batch_size=1, eos_token_ids=set())
        guard = engine.loop.planner.guard = _AdmittingGuard(admitted_plain)
        steps = Steps()
        engine.loop.observers.append(steps)
        lengths = [6, 5]
        outs = engine.generate(PROMPTS[:2], [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
        for prompt, out, n in zip(PROMPTS[:2], outs, lengths, strict=True):
            assert out.token_ids == greedy_reference(target, prompt, n)
        admissions = [i for i, p in enumerate(steps.prefills) if p]
        assert len(admissions) == 2
        decoding = len(steps.prefills) - len(admissions)
        if admitted_plain:  # each prompt read in a recorded switch step, a catch-up of the window
            assert len(guard.recorded) == decoding
            assert [guard.recorded[i - k] for k, i in enumerate(admissions)] == [(True, True)] * 2
            # the prompt and the admission step's token, at most the window
            assert [guard.caught_up[i - k] for k, i in enumerate(admissions)] == [3 + 1, 6]
        else:  # the step after each admission is the head's prefill: not recorded
            assert len(guard.recorded) == decoding - len(admissions)
            assert not any(catch_up for _, catch_up in guard.recorded)


def test_trees_pruned_to_their_root_count_as_speculation_and_plain_steps_stay_out_of_the_floor(
    target: LlamaModel,
) -> None:
    """A step the guard let speculate whose trees kept no node (the floor above every path) still paid for drafting:
    the guard records it as speculative. The measured tree floor fits speculative steps only: the guard's plain
    steps cost what the guard weighs, not what a verify row costs a speculative step."""
    pruned = SpecConfig(method=SpecMethod.ddd, budget=8, ddd_check_steps=(1, 2), tree_min_prob=0.999)
    engine = Engine(target, None, draft=noisy_copy(target, 0.5), speculation=pruned, eos_token_ids=set())
    guard = engine.loop.planner.guard = _ScriptedGuard([])
    out = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=12, ignore_eos=True))
    assert sum(o.stats.draft_steps for o in out) == 0  # no tree kept a node ...
    assert guard.recorded and all(spec for spec, _ in guard.recorded)  # ... and every step was speculative
    planned = [any(m.planned) for m in engine.loop.stats.metrics]
    assert any(planned)  # and where the draft ran, its time counts as drafting, not as the loop's overhead
    assert [m.draft_s > 0 for m in engine.loop.stats.metrics] == planned
    for plain in (True, False):  # plain throughout, or speculative
        adaptive = pruned.model_copy(update={"adaptive_floor": True, "tree_min_prob": 0.0})
        engine = Engine(target, None, draft=noisy_copy(target, 0.02), speculation=adaptive, eos_token_ids=set())
        guard = engine.loop.planner.guard = _ScriptedGuard([not plain] * 40)
        floor = engine.loop.planner.floor = TreeFloor(max_settle_steps=0)  # the guard records from the first step
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, ignore_eos=True))
        assert len(guard.recorded) >= 3 and all(spec != plain for spec, _ in guard.recorded)
        assert sum(f.steps for f in floor.fits.values()) == (0 if plain else len(guard.recorded))


class _RowClock(TreeFloor):
    """Verifies timed at 1 ms + 0.1 ms a row: the tiny model's real verify times barely grow with the rows, and on a
    busy host their fitted slope could come out negative, so no floor was ever measured (a CI failure)."""

    def record_verify(self, batch_size: int, rows: int, seconds: float) -> None:
        super().record_verify(batch_size, rows, 1e-3 + 1e-4 * rows)


def test_the_guard_waits_for_the_measured_tree_floor(target: LlamaModel) -> None:
    """Trees sized by the sequences' own floor while the measured one is pending are not the speculation the guard
    chooses between (on one CPU their wide verifies made DDD's first steps twice a plain step's time, and the guard
    chose plain decoding for good): the guard records a bucket's steps from the first one planned with the measured
    floor on, or after ``max_settle_steps`` speculative steps where no floor can be measured."""

    class Plans(StepObserver):
        def __init__(self) -> None:
            self.min_probs: list[float | None] = []  # per step the guard may record: the floor it was planned with

        def on_step(self, event: StepEvent) -> None:
            if not event.prefills:
                self.min_probs.append(event.plan.min_prob)

    adaptive = SpecConfig(
        method=SpecMethod.ddd, budget=8, ddd_check_steps=(1, 2), tree_min_prob=0.2, adaptive_floor=True
    )
    engine = Engine(target, None, draft=noisy_copy(target, 0.2), speculation=adaptive, eos_token_ids=set())
    guard = engine.loop.planner.guard = _ScriptedGuard([])
    floor = engine.loop.planner.floor = _RowClock(min_steps=4, min_spread=0.0)
    plans = Plans()
    engine.loop.observers.append(plans)
    engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16, ignore_eos=True))
    measured = [p is not None for p in plans.min_probs]
    assert measured[0] is False and measured[-1] is True  # the floor was measured along the way
    assert floor.floor(1) is not None
    assert len(guard.recorded) == sum(measured) < len(plans.min_probs)  # only steps planned with the floor
    # a floor that cannot be measured (every tree pruned to its root: the rows never vary) settles by step count
    pruned = adaptive.model_copy(update={"tree_min_prob": 0.999})
    engine = Engine(target, None, draft=noisy_copy(target, 0.3), speculation=pruned, eos_token_ids=set())
    guard = engine.loop.planner.guard = _ScriptedGuard([])
    floor = engine.loop.planner.floor = TreeFloor(min_steps=4, max_settle_steps=5)
    engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True))
    steps = sum(f.steps for f in floor.fits.values())
    assert floor.floor(1) is None and steps >= 8
    assert len(guard.recorded) == steps - 5


def test_sequences_a_model_free_drafter_serves_put_no_catch_up_in_the_outlook(target: LlamaModel) -> None:
    """With prompt lookup in front (the draft model only its fallback), the draft model falls behind whenever
    lookup finds a match; that backlog is read only if it falls back, so it is no switching cost for the guard."""
    lookup = DSDE_CHAIN.model_copy(update={"drafter": Drafter.lookup})
    engine = Engine(target, None, draft=noisy_copy(target, 0.02), speculation=lookup, eos_token_ids=set())
    guard = engine.loop.planner.guard = _ScriptedGuard([])
    engine.generate([[5, 6, 7, 8] * 6], SamplingParams(max_tokens=12))  # repetitive: lookup matches
    assert guard.outlooks and all(o is not None and o.draft_missed == 0 for o in guard.outlooks)
    model = DSDE_CHAIN
    engine = Engine(target, None, draft=noisy_copy(target, 0.02), speculation=model, eos_token_ids=set())
    guard = engine.loop.planner.guard = _ScriptedGuard([])
    engine.generate([[5, 6, 7, 8] * 6], SamplingParams(max_tokens=12))
    assert guard.outlooks[0] is not None and guard.outlooks[0].draft_missed == 24  # the prompt, for the model


def test_without_a_draft_model_no_row_is_planned_under_sl_cap(target: LlamaModel) -> None:
    """Prompt lookup under DSDE with the model as its fallback (the default) but no draft model loaded: its rows were
    averaged into SL_cap and cut by it, for a lock-step draft loop that never runs (the planner's own test has the
    numbers: SLs 12 and 2 drafted 7 and 2)."""
    lookup = DSDE_CHAIN.model_copy(update={"drafter": Drafter.lookup})
    for draft in (None, noisy_copy(target, 0.02)):
        engine = Engine(target, None, draft=draft, speculation=lookup, eos_token_ids=set())
        plan, seen = engine.loop.planner.plan, []

        def spy(*args: Any, plan: Any = plan, seen: list[bool] = seen, **kwargs: Any) -> Any:
            seen.append(kwargs["model"])
            return plan(*args, **kwargs)

        engine.loop.planner.plan = spy  # type: ignore[method-assign]
        engine.generate([[5, 6, 7, 8] * 6], SamplingParams(max_tokens=6))
        assert seen and set(seen) == {draft is not None}


def test_the_guard_times_no_step_in_which_a_request_is_admitted(target: LlamaModel) -> None:
    """A step that prefills an admitted prompt beside decoding rows costs several decode steps in either mode: the
    guard records only steps in which every sequence decodes (docs/algorithms.md §7)."""

    class Events(StepObserver):
        def __init__(self) -> None:
            self.prefills: list[bool] = []
            self.mixed = 0  # steps that admitted a prompt beside a decoding row

        def on_step(self, event: StepEvent) -> None:
            self.prefills.append(event.prefills)
            self.mixed += event.prefills and not event.only_prefill

    engine = Engine(
        target, None, draft=noisy_copy(target, 0.02), speculation=DSDE_CHAIN, max_batch_size=2, eos_token_ids=set()
    )
    guard = engine.loop.planner.guard = _ScriptedGuard([])
    events = Events()
    engine.loop.observers.append(events)
    lengths = [2, 60, 6, 30]
    outs = engine.generate(PROMPTS[:4], [SamplingParams(max_tokens=n) for n in lengths])
    assert [len(o.token_ids) for o in outs] == lengths
    assert events.mixed >= 1  # a later prompt admitted beside the long one decoding
    assert len(guard.recorded) == events.prefills.count(False) > 0
    assert guard.measured == [not p for p in events.prefills]  # the guard is told which steps go unrecorded


def test_the_guard_times_no_step_that_cut_rows(target: LlamaModel) -> None:
    """An admitted prompt whose row fails in its commit: the step's time holds that prompt's prefill, its event only
    the rows that committed, which decoded. It was recorded as a decode step of the smaller batch (0.04 s against
    plain steps' 0.002-0.01 s in a review's run)."""
    from specserve.errors import PartialStepError, SequenceError

    engine = Engine(
        target, None, draft=noisy_copy(target, 0.02), speculation=DSDE_CHAIN, max_batch_size=4, eos_token_ids=set()
    )
    loop = engine.loop
    guard = loop.planner.guard = _ScriptedGuard([])
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        loop.add_request(Request(rid, prompt, params))
    for _ in range(3):
        loop.step()
    recorded = len(guard.recorded)
    assert recorded > 0
    commit = loop._commit

    def failing(seq: Any, proposal: Any, out: Any) -> Any:
        if seq.request.request_id == "c":
            raise SequenceError(seq.seq_id, "detokenising failed")
        return commit(seq, proposal, out)

    loop._commit = failing  # type: ignore[method-assign]
    loop.add_request(Request("c", list(range(10, 200)), params))
    before = replace(loop.stats.timing)
    with pytest.raises(PartialStepError):
        loop.step()
    assert len(guard.recorded) == recorded  # not timed
    # nor booked as a decode step's time: its prefill is in it (the step timings of tune and bench spec read these)
    cut_step = loop.stats.timing - before
    assert cut_step.decode_steps == 0 and cut_step.prefill_s == cut_step.total_s > 0
    loop.abort("c")  # (as its lane or the Engine does)
    loop.step()  # (the next, every row decoding: timed)
    assert len(guard.recorded) == recorded + 1


def test_the_guard_starts_no_try_in_a_step_it_will_not_time() -> None:
    """A try is one recorded step; begun in an admission step (unrecorded), it would run the slower mode until the
    next recorded step. Unrecorded steps run the mode measured faster (plain before the first decision)."""
    guard = ThroughputGuard(GuardConfig(explore_every=5, warmup=1, explore_cost=1.0))
    assert guard.speculate(4, measured=False) is False  # nothing measured yet: plain
    guard.record(4, False, tokens=4, seconds=0.1)
    assert guard.speculate(4) is True and guard.speculate(4, measured=False) is False  # warm-up's spec step
    guard.record(4, True, tokens=4, seconds=0.3)  # speculation slower: plain, the first try at step 5
    for _ in range(2):
        assert guard.speculate(4) is False
        guard.record(4, False, tokens=4, seconds=0.1)
    assert guard.speculate(4) is True  # the try is due ...
    assert guard.speculate(4, measured=False) is False  # ... but not in a step the loop will not time
    guard.record(4, True, tokens=4, seconds=0.05)  # the try: speculation now faster
    assert guard.speculate(4, measured=False) is True  # unrecorded steps run the faster mode


def test_the_guard_switches_to_speculation_only_where_the_catch_up_pays() -> None:
    """Before speculating, a draft model re-reads what it missed (its catch-up, here ~0.01 s a token, measured
    beyond a speculative step's time). With 50 tokens to re-read (~0.5 s), speculation that saves 1/15 s per token
    of each sequence pays only past 7.5 tokens each; a try (or a first measurement), which might find any saving,
    only if plain decoding of what remains takes longer than the catch-up (5 tokens at 10 per second)."""
    guard = ThroughputGuard(GuardConfig(warmup=1, explore_every=5, explore_cost=1.0))
    guard.record(8, False, tokens=8, seconds=0.1)  # plain: 10 tokens/s per sequence
    assert guard.missed_token_s is None
    guard.record(8, True, tokens=8, seconds=1.1, caught_up_tokens=100)  # 1 s beyond a plain step
    assert guard.missed_token_s == pytest.approx(0.01)  # (before any speculative step, the catch-up's base)
    guard.record(8, True, tokens=24, seconds=0.1)  # speculation: 30 tokens/s per sequence
    assert guard.faster(8) is True
    guard.record(8, False, tokens=8, seconds=0.1)  # a try of plain decoding, then the switch back to speculation:
    guard.record(8, True, tokens=24, seconds=0.2, caught_up_tokens=3)  # 3 tokens, 0.1 s more
    assert guard.missed_token_s == pytest.approx(0.73 / 70.9)  # weighed by size (not 0.033 a token blended in)
    catch_up = 50
    assert guard.speculate(8)  # nothing to catch up: speculation
    assert guard.speculate(8, outlook=Outlook(0, 8))
    assert not guard.speculate(8, outlook=Outlook(catch_up, 8 * 7))  # saves 7/15 s < 0.5 s
    assert guard.speculate(8, outlook=Outlook(catch_up, 8 * 8))  # 8/15 s > 0.5 s
    assert guard.speculate(6, outlook=Outlook(catch_up, 6 * 8))  # per sequence: the bucket's 8 is 5-8 sequences
    # speculation measured slower: plain, then a try when due, put off while the batch could not pay a catch-up
    slow = ThroughputGuard(GuardConfig(warmup=1, explore_every=5, explore_cost=1.0))
    slow.record(8, False, tokens=8, seconds=0.1)
    slow.record(8, True, tokens=8, seconds=1.0, caught_up_tokens=100)
    slow.record(8, True, tokens=8, seconds=0.2)
    assert slow.faster(8) is False
    while not slow.speculate(8):
        slow.record(8, False, tokens=8, seconds=0.1)
    assert not slow.speculate(8, outlook=Outlook(catch_up, 8 * 4))  # 0.4 s of plain decoding left < 0.45 s
    assert slow.speculate(8, outlook=Outlook(catch_up, 8 * 5))  # 0.5 s
    assert slow.speculate(8)  # a query: the try stays due, not spent
    # with no catch-up measured yet, the outlook changes nothing
    fresh = ThroughputGuard(GuardConfig(warmup=1))
    fresh.record(8, False, tokens=8, seconds=0.1)
    assert fresh.speculate(8, outlook=Outlook(10_000, 8))


def test_catch_ups_within_speculation_are_measured_as_its_steps() -> None:
    """At batch 32 a step's token budget leaves most rows undrafted for a few steps, so the draft re-reads a few
    tokens of some row in every speculative step. Only the switch after plain steps goes unmeasured; the steps after
    it are speculation's own cost there and turn the guard back to plain decoding where speculation is slower
    (unmeasured, a try of speculation lasted as long as the catch-ups did: 26-81 steps at ~0.7x plain's rate
    in an AMX Xeon's straggler sweeps; docs/benchmarks.md, "The guard's catch-ups within speculation")."""
    guard = ThroughputGuard()
    speculated = 0
    for _ in range(300):
        if guard.speculate(32):
            speculated += 1
            guard.record(32, True, tokens=35, seconds=0.064, caught_up_tokens=30)  # 0.6x plain's rate per step
        else:
            guard.record(32, False, tokens=32, seconds=0.035)
    assert guard.faster(32) is False
    # the last try's cost: its switch step and its measured step (at batch 32 one step tells the modes apart), each
    # beyond plain decoding's time for its tokens
    assert guard.switch_s[32] == pytest.approx(2 * (0.064 - 35 / 32 * 0.035))
    assert 4 <= speculated <= 30  # the warm-up, then tries spaced by what they cost


def test_a_switch_after_plain_steps_of_another_batch_size_is_no_measured_step() -> None:
    """Whether a catch-up is a switch depends on the steps that ran, whatever their bucket: the batch shrank from
    16, whose steps ran plain, to 8, where speculation runs. Its first step there re-read what the draft missed at 16
    and was blended into bucket 8's speculative step time as speculation's own (its bucket's last step had
    speculated): 0.0325 s for 0.025 s here, which can flip the choice to plain (a review's scenario stayed plain 800
    steps before its next try)."""

    def after_plain_at_16(guard: ThroughputGuard) -> int:
        """Plain steps at batch 8 before it speculates again, after a switch from batch 16's plain steps."""
        for _ in range(60):  # (recorded as planned: no try of speculation among them)
            guard.record(16, False, tokens=16, seconds=0.03)
        assert guard.speculate(8)
        guard.record(8, True, tokens=12, seconds=0.15, caught_up_tokens=320)  # the switch: 6x a speculative step
        plain = 0
        while not guard.speculate(8) and plain < 2000:
            guard.record(8, False, tokens=8, seconds=0.02)
            plain += 1
        return plain

    guard = ThroughputGuard()
    for bucket_size, tokens, seconds in ((16, 16, 0.03), (8, 8, 0.02)):  # plain decoding measured ...
        for _ in range(3):
            guard.record(bucket_size, False, tokens=tokens, seconds=seconds)
    for _ in range(3):  # ... then batch 16's speculation, slower, and batch 8's, 1.2x faster
        guard.record(16, True, tokens=18, seconds=0.045)
    guard.record(8, True, tokens=12, seconds=0.15, caught_up_tokens=320)
    for _ in range(3):
        guard.record(8, True, tokens=12, seconds=0.025)
    assert guard.faster(16) is False and guard.faster(8) is True
    assert after_plain_at_16(guard) == 0
    assert guard.work[(8, True)][1] == pytest.approx(0.025)  # (the switch's 0.15 s is not speculation's step time)


def test_two_short_speculative_steps_do_not_flip_a_long_held_choice() -> None:
    """Tokens per speculative step vary 1-4 from one step to the next at batch 1 (a tree's accepted path): their
    average needs a longer memory than step time, or two 1-token steps take a head that emits 2.3 tokens in
    27 ms (85 tokens/s against plain decoding's 64) below break-even, as the straggler sweep's traces showed."""
    for token_smoothing, flips in ((0.05, False), (0.3, True)):  # (no margin: the averages alone decide)
        guard = ThroughputGuard(GuardConfig(warmup=1, token_smoothing=token_smoothing, margin=0.0))
        guard.record(1, False, tokens=1, seconds=0.0156)
        guard.record(1, True, tokens=2, seconds=0.027)
        for i in range(30):
            guard.record(1, True, tokens=(2, 2, 3)[i % 3], seconds=0.027)
        assert guard.faster(1) is True
        guard.record(1, True, tokens=1, seconds=0.027)
        guard.record(1, True, tokens=1, seconds=0.027)
        assert guard.faster(1) is (not flips)
    with pytest.raises(ValueError, match="smoothing"):
        ThroughputGuard(GuardConfig(token_smoothing=0.0))


def test_tokens_per_step_start_as_the_plain_mean_of_the_steps_so_far() -> None:
    """Until 1 / token_smoothing steps are measured, tokens per step are their plain mean: a slow moving average
    started from a low first step would stay low for dozens of steps (the 4-bit copy's 9-token first step
    against its ~12-token mean: tied with plain decoding, so the guard never ran it long enough to learn)."""
    guard = ThroughputGuard(GuardConfig(warmup=1, token_smoothing=0.05))
    guard.record(1, False, tokens=1, seconds=0.03)  # slower than speculation from its first step: no tries
    steps = [9, 17, 17, 17, 17, 3, 12]
    for tokens in steps:
        guard.record(1, True, tokens=tokens, seconds=0.15)
    assert guard.work[(1, True)][0] == pytest.approx(sum(steps) / len(steps))
    for _ in range(40):  # past 20 steps the newest weighs 0.05
        guard.record(1, True, tokens=10, seconds=0.15)
    before = guard.work[(1, True)][0]
    guard.record(1, True, tokens=30, seconds=0.15)
    assert guard.work[(1, True)][0] == pytest.approx(before + 0.05 * (30 - before))


def test_plain_steps_run_because_a_catch_up_would_not_pay_are_measurements_not_tries() -> None:
    """Speculation is the faster mode but the catch-up would not pay: the plain steps that follow are ordinary
    measurements of plain decoding (blended into its average), not tries whose one step replaces it: one slow step
    there had made plain decoding look 20% slower and turned the 4-bit copy on at batch 4."""
    guard = ThroughputGuard(GuardConfig(warmup=1))
    guard.record(4, False, tokens=4, seconds=0.1)
    guard.record(4, True, tokens=4, seconds=1.0, caught_up_tokens=100)
    guard.record(4, True, tokens=24, seconds=0.2)
    assert guard.faster(4) is True
    assert not guard.speculate(4, outlook=Outlook(100, 4))  # 1 token each to go: the catch-up would not pay
    guard.record(4, False, tokens=4, seconds=0.15)
    assert guard.work[(4, False)][1] == pytest.approx(0.1 + 0.3 * (0.15 - 0.1))  # blended, not replaced
    assert 4 not in guard.intervals  # and no try was counted
    assert not guard.speculate(4, measured=False, outlook=Outlook(100, 4))  # an admission step: no switch either
    guard.next_try[4] = guard._steps(4)  # a try of plain decoding comes due during the deferral: plain runs
    assert not guard.speculate(4, outlook=Outlook(100, 4))  # anyway, measured, so it is not a try
    guard.record(4, False, tokens=4, seconds=0.1)
    assert 4 not in guard.intervals and guard.work[(4, False)][1] < 0.115  # blended again
    assert not guard.speculate(4, outlook=Outlook(100, 4 * 100))  # the batch could now pay: the due try runs
    assert 4 not in guard.deferred  # (once it is recorded, speculation follows: below)
    guard.next_try[4] = 10**6
    assert guard.speculate(4)  # a batch with nothing to catch up speculates
    guard.next_try[4] = guard._steps(4)
    assert not guard.speculate(4)  # and outside a deferral a due try of plain decoding is one
    guard.record(4, False, tokens=4, seconds=0.15)
    assert guard.work[(4, False)][1] == pytest.approx(0.15) and guard.intervals[4] == 2 * guard.cfg.explore_every


def test_a_planned_speculative_step_that_found_no_draft_is_plain_but_no_try() -> None:
    """A step the guard let speculate in which no drafter found anything (prompt lookup without a match) ran as
    plain decoding: it is measured as a plain step, blended and clipped like any, and is no try of plain decoding
    (a try's one step replaces plain's average and respaces the tries; here one fast step flipped the choice)."""

    def warmed() -> ThroughputGuard:
        guard = ThroughputGuard()
        for _ in range(3):
            guard.record(1, False, 1, 0.020)
        for _ in range(12):
            guard.record(1, True, 2, 0.038)  # speculation 1.05x plain
        assert guard.faster(1) is True
        return guard

    guard = warmed()
    next_try, intervals = dict(guard.next_try), dict(guard.intervals)
    guard.record(1, False, 1, 0.018, planned=True)
    assert guard.faster(1) is True and guard.next_try == next_try and guard.intervals == intervals
    assert guard.rates[1, False] == pytest.approx(1 / (0.020 + 0.3 * (0.018 - 0.020)))  # blended
    guard.record(1, False, 1, 0.2, planned=True)  # a pause in such a step: clipped at twice the average
    assert guard.rates[1, False] == pytest.approx(1 / (0.0194 + 0.3 * (2 * 0.0194 - 0.0194)))
    tried = warmed()  # the same fast step as a try the guard asked for (planned plain): it replaces the average
    tried.record(1, False, 1, 0.018, planned=False)
    assert tried.faster(1) is False and tried.rates[1, False] == pytest.approx(1 / 0.018)


def test_a_try_of_speculation_that_found_no_draft_is_no_try() -> None:
    """Plain decoding measured faster, a try of speculation due, and the drafters find nothing: the step ran plainly.
    It is an ordinary plain step (blended, clipped: one pause does not replace plain's average and flip the choice
    to the unmeasured-since mode), the try stays due, and the interval between tries does not double."""
    guard = ThroughputGuard()
    for _ in range(3):
        guard.record(1, False, 1, 0.020)
    while guard.faster(1) is None:
        guard.record(1, True, 1, 0.030)  # speculation 0.67x plain
    assert guard.faster(1) is False
    while not guard.speculate(1):  # plain steps until the try of speculation is due
        guard.record(1, False, 1, 0.020)
    next_try, intervals = dict(guard.next_try), dict(guard.intervals)
    guard.record(1, False, 1, 0.12, planned=True)  # found no draft, and a 6x pause
    assert guard.rates[1, False] == pytest.approx(1 / (0.020 + 0.3 * (2 * 0.020 - 0.020)))  # clipped, blended
    assert guard.faster(1) is False
    assert guard.next_try == next_try and guard.intervals == intervals
    assert guard.speculate(1)  # the try is still due
    guard.record(1, True, 1, 0.030)  # the try itself: measured, plain still faster, the interval doubles
    assert guard.faster(1) is False and guard.intervals[1] == 2 * intervals.get(1, guard.cfg.explore_every)


def test_a_confirming_try_never_brings_the_interval_below_where_it_starts() -> None:
    """``explore_every`` above ``max_explore_every``: a try that confirmed plain decoding "doubled" the interval to
    min(2 x 30, 8), so the next try came after 8 steps, not 30: confirming tries made them more frequent."""
    guard = guard_at_a_try(explore_every=30, max_explore_every=8)
    guard.record(1, True, 1, 0.030)  # the try: plain still faster
    assert guard.faster(1) is False and guard.intervals[1] == 30
    plain = 0
    while not guard.speculate(1):
        guard.record(1, False, 1, 0.020)
        plain += 1
    assert plain >= 29


def test_a_measured_try_that_confirms_plain_decoding_doubles_the_interval() -> None:
    """``measured_tries``: the same try measures on until its tokens tell the modes apart, then counts as one try."""
    guard = guard_at_a_try(measured_tries=True)
    intervals = dict(guard.intervals)
    guard.record(1, False, 1, 0.12, planned=True)  # found no draft, and a 6x pause: plain's average 26 ms
    steps = 0
    while guard.speculate(1):  # the try, measured on as speculation's warm-up: plain still faster
        guard.record(1, True, 1, 0.030)
        steps += 1
    # 1 token a step in 1.15 plain steps' time, 0.15 tokens from break-even, told apart once half a token's
    # standard error is below that: 0.5 / sqrt(11) < 0.154
    assert steps == 11
    assert guard.faster(1) is False and guard.intervals[1] == 2 * intervals.get(1, guard.cfg.explore_every)
    assert guard.switch_s[1] == pytest.approx(11 * (0.030 - 0.026))  # each step's time beyond plain decoding's
    wide = ThroughputGuard(GuardConfig(measured_tries=True))  # batch 32: one step of 32 sequences tells the modes apart
    for _ in range(3):
        wide.record(32, False, 32, 0.035)
    while wide.faster(32) is None:
        wide.record(32, True, 35, 0.064)
    while not wide.speculate(32):
        wide.record(32, False, 32, 0.035)
    wide.record(32, True, 35, 0.064)
    assert 32 not in wide.trying and wide.faster(32) is False and wide.intervals[32] == 2 * wide.cfg.explore_every


def guard_at_a_try(measured_tries: bool = False, **settings: Any) -> ThroughputGuard:
    """Batch 1: plain decoding 1 token in 20 ms; speculation's warm-up 1 token in 30 ms (plain chosen); then plain
    steps until a try of speculation is due."""
    guard = ThroughputGuard(GuardConfig(measured_tries=measured_tries, **settings))
    for _ in range(3):
        guard.record(1, False, 1, 0.020)
    while guard.faster(1) is None:
        guard.record(1, True, 1, 0.030)
    assert guard.faster(1) is False
    while not guard.speculate(1):
        guard.record(1, False, 1, 0.020)
    return guard


def test_a_try_of_speculation_measures_on_as_its_warm_up() -> None:
    """``measured_tries``: a try of speculation measures on until its tokens per step stand a standard error from
    break-even with plain decoding (as its warm-up does) and decides on their mean tokens and median seconds; it
    costs what each of its steps took beyond plain decoding's time for its tokens. The try's first step takes 1
    token: a one-step try (the switch off) takes its time for speculation's and keeps plain decoding, where the
    steps after it accept 2.25 tokens a step in 1.5 plain steps' time."""
    tokens = [1, 3, 2, 3, 2, 2, 3, 1, 3, 2]
    one_step = guard_at_a_try(measured_tries=False)
    one_step.record(1, True, tokens[0], 0.030)
    assert one_step.faster(1) is False
    guard = guard_at_a_try(measured_tries=True)
    taken: list[int] = []
    for t in tokens:
        assert guard.speculate(1) and guard.faster(1) in (False, None)  # speculating, until the try decides
        guard.record(1, True, t, 0.030)
        taken.append(t)
        if 1 not in guard.trying:
            break
    assert taken == [1, 3, 2, 3]  # three steps (2 +- 0.58 tokens) could not tell 2 from break-even's 1.5; four can
    assert guard.faster(1) is True and guard.work[(1, True)] == pytest.approx((2.25, 0.030))
    assert guard.switch_s[1] == pytest.approx(0.030 - 0.020)  # only the 1-token step took longer than plain decoding
    assert guard.intervals[1] == guard.cfg.explore_every  # a try that flipped the choice starts the interval over


def test_the_guard_takes_zero_second_steps_and_refuses_bad_ones() -> None:
    """A coarse clock's 0-second steps: the warm-up's median of 0 neither divides by zero when speculation's warm-up
    compares with it nor clips every later step to 0 (plain decoding's rate would stay at a billion tokens a
    second); NaN and negative times are refused."""
    guard = ThroughputGuard()
    for _ in range(3):
        guard.record(1, False, 1, 0.0)
    for _ in range(3):
        guard.record(1, True, 2, 0.0)
    for _ in range(200):
        guard.record(1, False, 1, 0.05)
    assert guard.rates[1, False] == pytest.approx(20, rel=0.01)
    for bad in (float("nan"), -0.1, float("inf")):
        with pytest.raises(ValueError, match="seconds"):
            guard.record(1, False, 1, bad)


def test_the_loop_tells_the_guard_a_step_was_planned_to_speculate(target: LlamaModel) -> None:
    lookup = SpecConfig(method=SpecMethod.chain, sl=3, drafter=Drafter.lookup, model_fallback=False)
    engine = Engine(target, None, speculation=lookup, eos_token_ids=set())
    guard = engine.loop.planner.guard = _ScriptedGuard([])  # speculate on every step
    engine.generate([[5, 9, 13, 21, 34]], SamplingParams(max_tokens=12, ignore_eos=True))
    pairs = set(zip((spec for spec, _ in guard.recorded), guard.planned, strict=True))
    assert (False, True) in pairs  # lookup found no match: a plain step, planned to speculate
    assert all(planned for planned in guard.planned)


def test_steps_the_loop_runs_plainly_for_want_of_a_draft_worker_are_planned_to_speculate(target: LlamaModel) -> None:
    """While the draft worker is detached (being brought back) the guard still answers speculate, and the loop
    runs plain steps: they were recorded as planned plain, tries of plain decoding that confirmed speculation each
    time (the interval between tries doubling to 640 within five steps)."""
    engine = Engine(target, None, draft=noisy_copy(target, 0.02), speculation=DSDE_CHAIN, eos_token_ids=set())
    guard = engine.loop.planner.guard = _ScriptedGuard([])  # speculate on every step
    loop = engine.loop
    loop.add_request(Request("r", PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True)))
    for _ in range(3):
        loop.step()
    detached_from = len(guard.recorded)
    loop.detach_draft()
    while loop.has_work:
        loop.step()
    assert len(guard.recorded) > detached_from
    assert all(not spec for spec, _ in guard.recorded[detached_from:])  # plain steps ...
    assert all(guard.planned[detached_from:])  # ... planned to speculate: no tries of plain decoding


def test_a_catch_up_within_speculation_does_not_space_the_tries_as_a_switch_would() -> None:
    """A draft worker attached afresh re-reads every sequence's context in its first step (3 s at batch 16 here):
    recorded as a try's switch, it spaced the next try of speculation, once plain decoding measured faster, by
    thousands of steps (its cost / 1.5% of a 20 ms step). Only a catch-up after steps planned plain is a switch."""

    def warmed() -> ThroughputGuard:
        guard = ThroughputGuard()
        for _ in range(3):
            guard.record(16, False, 16, 0.020)
        while guard.faster(16) is None:
            guard.record(16, True, 32, 0.025)  # speculation 1.6x plain
        assert guard.faster(16) is True
        return guard

    def steps_to_next_try(guard: ThroughputGuard, catch_up_s: float, planned_before: bool) -> int:
        guard.record(16, not planned_before, 16, 0.020, planned=planned_before)  # the step before the catch-up
        guard.record(16, True, 32, catch_up_s, caught_up_tokens=16 * 1000)
        while guard.faster(16):  # speculation slows until plain decoding is faster
            guard.record(16, True, 16, 0.030)
        return guard.next_try[16] - guard._steps(16)

    within = steps_to_next_try(warmed(), 3.0, planned_before=True)  # a re-attached draft, speculating throughout
    assert within < 100
    # after a plain step (a try of plain decoding): a switch back to the faster speculation, which no try of
    # speculation follows: forgotten too (docs/algorithms.md §7), the tries' spacing stays the last try's cost
    assert steps_to_next_try(warmed(), 3.0, planned_before=False) < 100


@pytest.mark.parametrize("warm_up_switch_s", [0.05, 0.5])
def test_the_warm_up_start_does_not_space_the_re_check_after_a_flip(warm_up_switch_s: float) -> None:
    """The warm-up chose speculation (1.3x plain at batch 4); two slowed speculative steps flip the choice to
    plain. The re-check of speculation is spaced by the last try's cost: there was none, so it comes at once.
    The warm-up's start (the draft reading whole prompts) had been kept as that cost: a 0.5 s start held
    plain decoding for 2559 steps, 51 s, while speculation was 1.3x faster."""
    guard = ThroughputGuard()
    speculated = False
    for _ in range(12):
        if guard.speculate(4):
            first = not speculated
            guard.record(4, True, 8, warm_up_switch_s if first else 0.031, caught_up_tokens=40 if first else 0)
            speculated = True
        else:
            guard.record(4, False, 4, 0.020)
    assert speculated and guard.faster(4) is True
    while guard.faster(4):
        assert guard.speculate(4)
        guard.record(4, True, 8, 0.060)
    plain_steps = 0
    while not guard.speculate(4):
        guard.record(4, False, 4, 0.020)
        plain_steps += 1
    assert plain_steps <= guard.cfg.warmup


@pytest.mark.parametrize("margin", [0.0, 0.05])
def test_the_guard_hands_over_to_the_other_mode_only_past_its_margin(margin: float) -> None:
    """Hysteresis: the mode the last decision did not choose must measure ``margin`` faster to take over. Plain
    decoding holds (speculation emits 0.75 tokens a sequence a second); as plain steps slow, speculation 3.4% faster
    takes over without a margin and not with 5%, and 12.5% faster takes over either way. Then held by speculation,
    plain decoding 3% faster takes it back only without a margin."""
    guard = ThroughputGuard(
        GuardConfig(warmup=1, explore_every=1000, smoothing=1.0, token_smoothing=1.0, outlier_clip=100.0, margin=margin)
    )
    guard.record(16, False, tokens=16, seconds=1.0)
    guard.record(16, True, tokens=0, seconds=1.0, caught_up_tokens=MISSED)  # the switch: not measured
    guard.record(16, True, tokens=12, seconds=1.0)
    assert guard.faster(16) is False
    guard.record(16, False, tokens=16, seconds=1.38)  # plain 0.725 tokens/s a sequence
    assert guard.faster(16) is (margin == 0.0)
    guard.record(16, False, tokens=16, seconds=1.5)  # 0.667
    assert guard.faster(16) is True
    guard.record(16, True, tokens=0, seconds=1.0, caught_up_tokens=MISSED)
    guard.record(16, True, tokens=12, seconds=0.75 / 0.72)  # speculation 0.72
    assert guard.faster(16) is True
    guard.record(16, True, tokens=12, seconds=0.75 / (0.667 / 1.03))  # plain now 3% faster
    assert guard.faster(16) is (margin != 0.0)
    with pytest.raises(ValueError, match="margin"):
        ThroughputGuard(GuardConfig(margin=-0.1))


@pytest.mark.parametrize("batch", [1, 16])
def test_after_a_flip_the_mode_taken_up_is_timed_afresh_from_batch_warmup_on(batch: int) -> None:
    """Plain decoding 2x faster; then the host slows, plain steps take 3 s and flip the choice to speculation,
    whose average (2 s a step) dates from before. From batch ``warmup`` (3) on, its first measured step after the
    switch replaces that average, as a try's does: 3 s, and plain decoding is back at once. At batch 1, where one
    step's time follows its own acceptance, the step is blended (2.3 s) and speculation runs on."""
    guard = ThroughputGuard(GuardConfig(explore_every=1000))
    for _ in range(3):
        guard.record(batch, False, tokens=batch, seconds=1.0)
    guard.record(batch, True, tokens=0, seconds=2.0, caught_up_tokens=MISSED)
    for _ in range(3):
        guard.record(batch, True, tokens=batch, seconds=2.0)
    assert guard.faster(batch) is False
    slow = 0
    while not guard.speculate(batch):
        guard.record(batch, False, tokens=batch, seconds=3.0)
        slow += 1
    assert slow <= 6
    guard.record(batch, True, tokens=0, seconds=3.0, caught_up_tokens=MISSED)
    guard.record(batch, True, tokens=batch, seconds=3.0)
    assert guard.work[(batch, True)][1] == pytest.approx(3.0 if batch >= guard.cfg.warmup else 2.3)
    assert guard.speculate(batch) is (batch < guard.cfg.warmup)
    if batch >= guard.cfg.warmup:  # the switch: off, the stale 2 s would be blended with the fresh 3 s
        off = ThroughputGuard(GuardConfig(explore_every=1000, refresh_on_flip=False))
        for spec, tokens, seconds, missed in (
            [(False, batch, 1.0, 0)] * 3 + [(True, 0, 2.0, MISSED)] + [(True, batch, 2.0, 0)] * 3
        ):
            off.record(batch, spec, tokens, seconds, caught_up_tokens=missed)
        while not off.speculate(batch):
            off.record(batch, False, tokens=batch, seconds=3.0)
        off.record(batch, True, tokens=0, seconds=3.0, caught_up_tokens=MISSED)
        off.record(batch, True, tokens=batch, seconds=3.0)
        assert off.work[(batch, True)][1] == pytest.approx(2.3)


def _held_speculation(spec_seconds: float) -> ThroughputGuard:
    """Bucket 16: plain decoding 1 token a sequence a second, speculation (first decided, no margin) 16 tokens in
    ``spec_seconds`` (one warm-up step decides: ``warmup_z`` 0); a catch-up costs 1 s for ``MISSED`` tokens."""
    guard = ThroughputGuard(
        GuardConfig(warmup=1, warmup_z=0.0, explore_every=1000, smoothing=1.0, token_smoothing=1.0, outlier_clip=100.0)
    )
    guard.record(16, False, tokens=16, seconds=1.0)
    guard.record(16, True, tokens=0, seconds=2.0, caught_up_tokens=MISSED)
    guard.record(16, True, tokens=16, seconds=spec_seconds)
    assert guard.faster(16) is True and guard.missed_token_s == pytest.approx(1.0 / MISSED)
    return guard


def test_a_catch_up_that_does_not_pay_hands_a_slower_held_speculation_over_to_plain_decoding() -> None:
    """Speculation held within the margin though 2% slower: a step that would first catch the draft up cannot pay
    that back, so it runs plainly, and plain decoding takes the hold: a plain step that then drifts 3% slower
    (below speculation's rate, within the margin) does not flip it back to another catch-up."""
    guard = _held_speculation(0.95)
    guard.record(16, True, tokens=16, seconds=1.02)  # speculation now 0.980 against plain's 1.0: still held
    assert guard.faster(16) is True
    due = Outlook(draft_missed=100, horizon=16 * 40)
    assert guard.speculate(16, outlook=due) is False
    assert guard.held[16] is False and guard.faster(16) is False
    guard.record(16, False, tokens=16, seconds=1.03)
    assert guard.speculate(16, outlook=due) is False and 16 not in guard.deferred


def test_plain_steps_run_while_speculation_waits_for_a_paying_catch_up_keep_their_average() -> None:
    """Speculation held and faster, but the batch is nearly done: the catch-up would not pay, plain steps run, and
    one of them (plain decoding faster now) flips the choice. Plain decoding's average is that fresh step, not an
    old one, so its next step is blended, not taken alone."""
    guard = _held_speculation(0.9)
    near_end = Outlook(draft_missed=1000, horizon=16 * 2)
    assert guard.speculate(16, outlook=near_end) is False and 16 in guard.deferred
    guard.record(16, False, tokens=16, seconds=0.8)  # 1.25 a second: plain decoding takes over
    assert guard.faster(16) is False and (16, False) not in guard.stale


def test_a_catch_up_put_off_for_max_try_spacing_steps_runs_and_its_cost_replaces_the_estimate() -> None:
    """The catch-up's cost is measured only where one runs: one measured on a swamped host (1000 s) made every
    later switch look unpaying, and speculation, 4x faster, never ran again. Now the switch runs once it has been
    put off ``max_try_spacing`` steps, though a try of plain decoding came due meanwhile (the default tries come due
    every 20-640 steps, long before the cap), and its catch-up's cost replaces the estimate (blended, a 1000x
    estimate would take dozens of such switches to come down: at smoothing 1 the two are one)."""
    cfg = GuardConfig(warmup=1, warmup_z=0.0, smoothing=0.3, token_smoothing=1.0, outlier_clip=100.0)
    guard = ThroughputGuard(cfg)
    guard.record(16, False, tokens=16, seconds=1.0)
    guard.record(16, True, tokens=0, seconds=1001.0, caught_up_tokens=MISSED)  # the host swamped
    guard.record(16, True, tokens=64, seconds=1.0)
    assert guard.faster(16) is True and guard.missed_token_s == pytest.approx(1000.0 / MISSED)
    due = Outlook(draft_missed=MISSED, horizon=16 * 40)  # would save 30 s; the estimate says 1000
    for i in range(cfg.max_try_spacing):
        assert guard.speculate(16, outlook=due) is False and 16 in guard.deferred
        guard.record(16, False, tokens=16, seconds=1.0 + 0.5 * (i % 2))  # measurements, blended (no try's)
    assert guard.steps[16] >= guard.next_try.get(16, cfg.explore_every - 1)  # a try of plain decoding is due
    assert guard.speculate(16, measured=False, outlook=due) is False  # a step not recorded measures no catch-up
    assert guard.speculate(16, outlook=due) is True and 16 not in guard.deferred
    guard.record(16, True, tokens=0, seconds=3.0, caught_up_tokens=MISSED)  # 2 s beyond a speculative step
    assert guard.missed_token_s == pytest.approx(2.0 / MISSED) and not guard.overdue
    guard.record(16, True, tokens=64, seconds=1.0)
    assert guard.switch_pays(16, due, expected=True)
    # the plain try that had come due is spent (the plain steps run meanwhile measured plain decoding): speculation
    # runs on, not one step and then a try of plain decoding and another catch-up
    assert guard.speculate(16, outlook=Outlook(draft_missed=0, horizon=16 * 40)) is True


def test_admission_steps_do_not_restart_the_wait_of_a_try_put_off() -> None:
    """A try of speculation put off (its catch-up measured on a swamped host, so it looks unpaying) runs once put off
    ``max_try_spacing`` recorded steps. An admission step (not recorded, it considers no try) cleared that wait, so
    on a server admitting a request every few hundred steps the try never ran: plain decoding for good."""
    guard = ThroughputGuard()
    for _ in range(guard.cfg.warmup):
        assert not guard.speculate(1)
        guard.record(1, False, tokens=1, seconds=0.02)
    assert guard.speculate(1)
    guard.record(1, True, tokens=2, seconds=100.0, caught_up_tokens=3, planned=True)  # a swamped host's catch-up
    while guard.faster(1) is None:
        guard.record(1, True, tokens=1, seconds=0.05, planned=True)
    assert guard.faster(1) is False
    due = Outlook(draft_missed=50, horizon=1000)
    recorded = 0
    for step in range(1, 4 * guard.cfg.max_try_spacing):
        if step % 500 == 0:  # an admission
            assert not guard.speculate(1, measured=False, outlook=due)
            continue
        if guard.speculate(1, outlook=due):
            break
        guard.record(1, False, tokens=1, seconds=0.02)
        recorded += 1
    else:
        pytest.fail("the try put off never ran")
    assert recorded <= 2 * guard.cfg.max_try_spacing  # due within the spacing's cap, then put off at most as long


def test_an_overdue_switch_that_ran_no_catch_up_leaves_the_next_one_blended() -> None:
    """The forced switch's step found nothing to draft (a plain step as run): the overdue mark stayed, and a later,
    unrelated catch-up replaced the estimate instead of joining its average."""
    cfg = GuardConfig(warmup=1, warmup_z=0.0, smoothing=0.5, token_smoothing=1.0, outlier_clip=100.0)
    guard = ThroughputGuard(cfg)
    guard.record(16, False, tokens=16, seconds=1.0)
    guard.record(16, True, tokens=0, seconds=1001.0, caught_up_tokens=MISSED)
    guard.record(16, True, tokens=64, seconds=1.0)
    due = Outlook(draft_missed=MISSED, horizon=16 * 40)
    while not guard.speculate(16, outlook=due):
        guard.record(16, False, tokens=16, seconds=1.0)
    assert guard.overdue == {16}
    guard.record(16, False, tokens=16, seconds=1.0, planned=True)  # planned to speculate, ran plainly
    assert not guard.overdue
    guard.record(16, True, tokens=0, seconds=101.0, caught_up_tokens=MISSED)  # blended: (1000 + 100) / 2
    assert guard.missed_token_s == pytest.approx(550.0 / MISSED)


def test_a_tiny_explore_cost_spaces_tries_by_max_try_spacing() -> None:
    """explore_cost 1e-310 made the spacing's quotient infinite, and ceil() raised OverflowError on each record."""
    guard = ThroughputGuard(GuardConfig(explore_cost=1e-310))
    for _ in range(3):
        guard.record(1, False, 1, 0.01)
    guard.record(1, True, 2, 0.5, caught_up_tokens=MISSED)  # the switch step that starts speculation's warm-up
    for _ in range(12):
        guard.record(1, True, 1, 0.03)  # slower: the warm-up chooses plain decoding
    assert guard.faster(1) is False and guard.next_try[1] == guard.steps[1] + guard.cfg.max_try_spacing - 1


def test_the_first_step_after_a_flip_is_clipped_and_costs_no_try() -> None:
    """The refresh replaces the old average with the step's time, up to ``outlier_clip`` times that average (a
    pause stays a pause), and leaves the cost of the last try alone (it is no try)."""
    guard = ThroughputGuard(GuardConfig(explore_every=1000))
    for _ in range(3):
        guard.record(16, False, tokens=16, seconds=1.0)
    guard.record(16, True, tokens=0, seconds=2.0, caught_up_tokens=MISSED)
    for _ in range(3):
        guard.record(16, True, tokens=16, seconds=2.0)
    while not guard.speculate(16):
        guard.record(16, False, tokens=16, seconds=3.0)
    guard.record(16, True, tokens=0, seconds=3.0, caught_up_tokens=MISSED)
    switch = guard.switch_s[16]
    assert (16, True) in guard.stale
    guard.record(16, True, tokens=16, seconds=30.0)  # a 15x pause
    assert guard.work[(16, True)][1] == pytest.approx(2 * 2.0) and guard.switch_s[16] == switch
