"""Model-free draft nodes scored by their measured acceptance (docs/algorithms.md §10.6): the cells, the counting,
the trees they shape, and the loop feeding them its verify results."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.config import Drafter, ModelFreeConfig, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.messages import Proposal, VerifyOutput
from specserve.models.tiny import tiny_config, tiny_model
from specserve.policy import DSDEConfig
from specserve.sampling import SamplingParams
from specserve.sequence import RequestOutput, Sequence
from specserve.spec_decode.count_calibration import TRY_EVERY, CountCalibration, node_cell, smoothed_rate
from specserve.spec_decode.count_tree import tree_from_counts
from specserve.spec_decode.model_free import ModelFreeDrafter, draft_cells
from specserve.spec_decode.suffix_tree import CountTrie, SuffixCache
from specserve.step_events import StepEvent, StepObserver
from specserve.step_loop import StepLoop

from .conftest import greedy_reference


def test_node_cells_cap_the_match_the_total_and_the_depth_and_split_the_shares() -> None:
    assert node_cell(match_len=2, count=1, total=1, depth=1) == (1, 0, 2, 0)  # the only continuation
    assert node_cell(match_len=1, count=1, total=2, depth=1) == (0, 1, 1, 0)  # one of two: the larger share
    assert node_cell(match_len=9, count=5, total=5, depth=7) == (2, 2, 2, 1)  # >= 3, >= 3, only child, >= 2
    assert node_cell(match_len=3, count=2, total=7, depth=2) == (2, 2, 0, 1)  # a smaller share
    assert node_cell(match_len=3, count=4, total=7, depth=2) == (2, 2, 1, 1)


def test_a_deeper_node_is_scored_at_least_as_its_first_level_cell() -> None:
    """Deeper nodes were accepted at least as often as first-level ones in the cells measured (one within noise);
    a deeper cell that fell low recovers with the first level's (whose tries go on)."""
    cal = CountCalibration(prior_weight=4.0)
    first, deeper = node_cell(2, 1, 1, 1), node_cell(2, 1, 1, 2)
    for _ in range(6):
        cal.observe([first, deeper], [0, 1], [1])  # the first level accepted, the second not: 6 trials each
    assert cal.acceptance(first, 1, 1) == pytest.approx((6 + 2) / 10)
    assert cal.acceptance(deeper, 1, 1) == pytest.approx(0.8)  # its own rate 2 / 10, the first level's 0.8
    for _ in range(40):
        cal.observe([deeper], [0], [1])  # (cells given directly) the deeper cell hits 40 more times
    assert cal.acceptance(deeper, 1, 1) == pytest.approx((40 + 2) / 50)  # above the first level's 0.8: its own


def test_acceptance_starts_at_the_prior_and_moves_to_the_measured_rate() -> None:
    cal = CountCalibration(prior_weight=4.0)
    cell = node_cell(2, 1, 1, 1)
    assert cal.acceptance(cell, 1, 1) == pytest.approx(0.5)  # 1 / (1 + 1)
    assert cal.acceptance(node_cell(2, 3, 3, 1), 3, 3) == pytest.approx(0.75)
    for accepted in ([1], [1], [], [1], [1], [1]):  # a one-node chain: 5 hits in 6 trials
        cal.observe([cell], [0], accepted)
    assert cal.acceptance(cell, 1, 1) == pytest.approx((5 + 4 * 0.5) / (6 + 4))
    assert smoothed_rate(5.0, 6.0, 0.5, 4.0) == pytest.approx(0.7)
    other = node_cell(3, 1, 1, 1)
    assert cal.acceptance(other, 1, 1) == pytest.approx(0.5)  # other cells keep their prior


def test_a_node_is_a_trial_only_where_its_parent_was_accepted() -> None:
    """Nodes 1 and 2 hang from the root, 3 from 1, 4 from 3, 5 from 2; 1 and 3 were accepted: 1, 2, 3 and 4 were
    tried (4's parent 3 was accepted), 5 was not (its parent 2 was rejected); 1 and 3 hit."""
    cal = CountCalibration()
    cells = [(0, 0, 2, 0), (1, 0, 2, 0), (0, 0, 2, 1), (1, 0, 2, 1), (2, 0, 2, 1)]
    cal.observe(cells, [0, 0, 1, 3, 2], [1, 3])
    tried = {c for c in zip(*np.nonzero(cal.trials), strict=True)}
    assert tried == {cells[0], cells[1], cells[2], cells[3]}
    assert {c for c in zip(*np.nonzero(cal.hits), strict=True)} == {cells[0], cells[2]}
    assert cal.trials.sum() == 4 and cal.hits.sum() == 2


def test_a_cell_past_its_window_halves_its_counts() -> None:
    cal = CountCalibration(window=10.0)
    cell = (0, 0, 2, 0)
    for i in range(11):
        cal.observe([cell], [0], [1] if i < 8 else [])
    assert (cal.trials[cell], cal.hits[cell]) == (5.5, 4.0)  # 11 trials, 8 hits, halved


def _chain_trie(path: list[int]) -> CountTrie:
    trie = CountTrie()
    trie.add_path(path)
    return trie


def test_a_tree_scored_by_acceptance_keeps_what_the_floor_pays_for() -> None:
    """One continuation seen once: its shares are all 1, so the share-scored tree keeps the whole chain; scored 0.6
    a level, the path probabilities are 0.6, 0.36, 0.216, 0.13, and a floor of 0.2 keeps three levels."""
    root = _chain_trie([5, 6, 7, 8]).root
    shares = tree_from_counts(root, max_depth=4, budget=10, min_score=0.2, ddd_threshold=None)
    assert shares.tokens == [5, 6, 7, 8] and shares.scores == [1.0, 1.0, 1.0, 1.0]
    calibrated = tree_from_counts(root, 4, 10, 0.2, None, node_prob=lambda count, total, depth: 0.6)
    assert calibrated.tokens == [5, 6, 7] and calibrated.scores == pytest.approx([0.6, 0.36, 0.216])
    by_depth = tree_from_counts(
        root, 4, 10, 0.22, None, node_prob=lambda count, total, depth: 0.9 if depth > 1 else 0.3
    )
    assert by_depth.scores == pytest.approx([0.3, 0.27, 0.243])  # the depth reaches the scorer (0.2187 < 0.22)


def test_draft_cells_read_each_nodes_match_count_total_and_depth() -> None:
    trie = CountTrie()
    for path in ([5, 6], [5, 7], [5, 6], [9]):
        trie.add_path(path)
    draft = tree_from_counts(trie.root, max_depth=2, budget=10, min_score=0.0, ddd_threshold=None)
    assert draft.tokens == [5, 6, 9, 7] and draft.parents == [0, 1, 0, 1]  # scores 3/4, 1/2, 1/4, 1/4
    assert draft_cells(draft, match_len=4) == [
        node_cell(4, 3, 4, 1),  # 5: 3 of the root's 4
        node_cell(4, 2, 3, 2),  # 6: 2 of 5's 3
        node_cell(4, 1, 4, 1),
        node_cell(4, 1, 3, 2),
    ]


def test_the_drafter_learns_from_its_own_proposals_only() -> None:
    spec = SpecConfig(method=SpecMethod.ddd, budget=8, drafter=Drafter.lookup)  # DDD's cut (x = -0.3) left out
    context = [1, 2, 3, 4, 5, 6, 9, 1, 2]  # "1 2" once before, followed by 3 4 5 6 9
    fresh = ModelFreeDrafter()
    first = fresh.propose(0, context, spec, 5, want_q=False)
    assert first is not None and first.tokens == [3, 4, 5]  # prior 0.5 a level: 0.5, 0.25, 0.125 >= min_score 0.1
    fresh.observe(0, Proposal(0, [3], [0]), accepted=[1])  # the step verified another drafter's proposal
    assert fresh.calibration.trials.sum() == 0
    fresh.observe(0, first, accepted=[])  # too late: that step's proposal was not this one
    assert fresh.calibration.trials.sum() == 0
    first = fresh.propose(0, context, spec, 5, want_q=False)
    fresh.observe(0, first, accepted=[])  # its own: the first node was tried and missed
    assert fresh.calibration.trials.sum() == 1 and fresh.calibration.hits.sum() == 0
    fresh.observe(0, first, accepted=[])  # counted once
    assert fresh.calibration.trials.sum() == 1
    learner = ModelFreeDrafter()
    for _ in range(40):  # every node accepted, step after step: the chain grows to the depth
        p = learner.propose(0, context, spec, 5, want_q=False)
        assert p is not None
        learner.observe(0, p, accepted=list(range(1, len(p.tokens) + 1)))
    assert p.tokens == [3, 4, 5, 6, 9]
    doubter = ModelFreeDrafter()
    for _ in range(17):  # the first node always rejected: 2 / (n + 4) < min_score 0.1 from n = 17
        p = doubter.propose(0, context, spec, 5, want_q=False)
        assert p is not None
        doubter.observe(0, p, accepted=[])
    tries = [doubter.propose(0, context, spec, 5, want_q=False) for _ in range(2 * TRY_EVERY)]
    assert [i for i, t in enumerate(tries) if t is not None] == [TRY_EVERY - 1, 2 * TRY_EVERY - 1]
    assert all(t.tokens == [3] for t in tries if t is not None)  # the best node alone: one verify row a try
    for _ in range(4):  # the tries are accepted: the cell recovers and whole drafts come back
        p = None
        while p is None:
            p = doubter.propose(0, context, spec, 5, want_q=False)
        doubter.observe(0, p, accepted=list(range(1, len(p.tokens) + 1)))
    assert doubter.propose(0, context, spec, 5, want_q=False) is not None


def test_the_floor_of_the_step_prunes_model_free_trees() -> None:
    spec = SpecConfig(method=SpecMethod.ddd, budget=8, drafter=Drafter.lookup)
    context = [1, 2, 3, 4, 5, 6, 9, 1, 2]
    drafter = ModelFreeDrafter()
    assert drafter.propose(0, context, spec, 5, want_q=False, min_prob=0.3).tokens == [3]  # 0.5 >= 0.3 > 0.25
    assert drafter.propose(0, context, spec, 5, want_q=False, min_prob=0.6) is None  # the model's turn
    floored = spec.model_copy(update={"tree_min_prob": 0.2})  # no measured floor: the spec's
    assert drafter.propose(0, context, floored, 5, want_q=False).tokens == [3, 4]
    shares = spec.model_copy(update={"model_free": ModelFreeConfig(calibrated=False)})
    assert drafter.propose(0, context, shares, 5, want_q=False, min_prob=0.6).tokens == [3, 4, 5, 6, 9]


class _Accepted(StepObserver):
    def __init__(self) -> None:
        self.accepted = 0
        self.proposed = 0
        self.last = 0  # nodes the last step accepted

    def on_step(self, event: StepEvent) -> None:
        for p, out in zip(event.proposals, event.verified, strict=True):
            self.last = len(out.accepted)
            if p is not None:
                self.accepted += len(out.accepted)
                self.proposed += 1


def test_the_loop_feeds_the_drafters_calibration_and_stays_lossless() -> None:
    """Every node the target accepted from lookup is a hit of the calibration (its parent was accepted), the
    request's last step's too (its sequence is released in that step): the loop's verify results reach it, and the
    greedy tokens are plain decoding's."""
    target = tiny_model(tiny_config(vocab_size=8), seed=0)  # greedy output falls into repeats: lookup matches
    prompt = [1, 2, 3, 0, 4]
    spec = SpecConfig(method=SpecMethod.ddd, budget=8, drafter=Drafter.lookup)
    engine = Engine(target, None, speculation=spec, eos_token_ids=set())
    seen = _Accepted()
    engine.loop.observers.append(seen)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))
    assert out.token_ids == greedy_reference(target, prompt, 32)
    cal = engine.loop.model_free.calibration
    assert seen.proposed > 0 and seen.last > 0  # the finishing step drafted, and the target took some of it
    assert cal.hits.sum() == seen.accepted
    assert cal.trials.sum() >= seen.proposed  # each proposal's first level was tried


@pytest.mark.parametrize("calibrated", [True, False])
def test_under_dsde_a_priced_count_tree_drafts_past_the_sl(calibrated: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """DSDE's SL held at 2: the loop asks a count tree scored by measured acceptance for its static depth's 7 levels
    (T - 1; docs/algorithms.md §10.6), one scored by shares for the SL's 2; both stay lossless."""
    target = tiny_model(tiny_config(vocab_size=8), seed=0)
    prompt = [1, 2, 3, 0, 4]
    spec = SpecConfig(
        method=SpecMethod.ddd,
        budget=8,
        drafter=Drafter.lookup,
        policy=SLPolicyKind.dsde,
        dsde=DSDEConfig(sl_init=2, sl_min=2, sl_hard_max=2),
        model_free=ModelFreeConfig(calibrated=calibrated),
    )
    depths: list[int] = []
    real_propose = ModelFreeDrafter.propose

    def propose(self: ModelFreeDrafter, seq_id: int, tokens: list[int], spec: SpecConfig, depth: int, **kw: object):
        depths.append(depth)
        return real_propose(self, seq_id, tokens, spec, depth, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ModelFreeDrafter, "propose", propose)
    engine = Engine(target, None, speculation=spec, eos_token_ids=set())
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))
    assert out.token_ids == greedy_reference(target, prompt, 32)
    assert depths and max(depths) == (7 if calibrated else 2)
    planned = [d for m in engine.loop.stats.metrics for d in m.planned]  # the metrics record what lookup was allowed
    assert max(planned) == max(depths)


def test_a_try_never_takes_the_step_from_another_matchs_draft() -> None:
    """The cache's longer match ("9 1 2", eleven continuations seen once each: 1/12 a node, below min_score) keeps
    nothing; the request's own ("1 2", then 3 5 6 7) drafts every time, the 16th too: a try is made only where no
    match keeps a node."""
    context = [1, 2, 3, 5, 6, 7, 9, 1, 2]
    spec = SpecConfig(method=SpecMethod.ddd, budget=8, drafter=Drafter.suffix)
    cache = SuffixCache(1000, spec.model_free.suffix_depth)
    for t in range(20, 31):
        cache.add([9, 1, 2, t])
    drafter = ModelFreeDrafter(cache)
    drafts = [drafter.propose(0, context, spec, 4, want_q=False) for _ in range(2 * TRY_EVERY)]
    assert all(d is not None and d.tokens == [3, 5, 6] for d in drafts)  # prior 0.5 a level down to min_score


def test_rows_that_failed_to_commit_teach_nothing_and_a_failing_calibration_loses_no_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = tiny_model(tiny_config(vocab_size=8), seed=0)
    spec = SpecConfig(method=SpecMethod.ddd, budget=8, drafter=Drafter.lookup)
    prompts = [[1, 2, 3, 0, 4], [1, 2, 3, 1, 4]]
    good, poison = SamplingParams(max_tokens=24, ignore_eos=True), SamplingParams(max_tokens=24, ignore_eos=True)
    observed: list[int] = []
    poisoned: list[int] = []
    real_observe, real_commit = ModelFreeDrafter.observe, StepLoop._commit

    def observe(self: ModelFreeDrafter, seq_id: int, proposal: Proposal | None, accepted: list[int]) -> None:
        observed.append(seq_id)
        real_observe(self, seq_id, proposal, accepted)

    def commit(self: StepLoop, seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> RequestOutput:
        if seq.request.params is poison and seq.output:  # its second step: it has drafted by then
            poisoned.append(seq.seq_id)
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return real_commit(self, seq, proposal, out)

    monkeypatch.setattr(ModelFreeDrafter, "observe", observe)
    monkeypatch.setattr(StepLoop, "_commit", commit)
    engine = Engine(target, None, speculation=spec, eos_token_ids=set())
    results = engine.generate(prompts, [good, poison], return_exceptions=True)
    assert isinstance(results[1], Exception) and not isinstance(results[0], Exception)
    assert poisoned and observed.count(poisoned[0]) == 1  # its first step (a prefill), not the failed one
    assert results[0].token_ids == greedy_reference(target, prompts[0], 24)

    def broken(self: ModelFreeDrafter, seq_id: int, proposal: Proposal | None, accepted: list[int]) -> None:
        raise RuntimeError("calibration")

    monkeypatch.setattr(ModelFreeDrafter, "observe", broken)
    (again,) = Engine(target, None, speculation=spec, eos_token_ids=set()).generate([prompts[0]], good)
    assert again.token_ids == results[0].token_ids
