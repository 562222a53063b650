"""EAGLE-2 tree building: beam selection, scores, rerank closed under ancestors."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.config import SpecConfig, SpecMethod
from specserve.spec_decode.draft_state import DraftState
from specserve.spec_decode.eagle2 import TreeBuilder, beam_mass, ddd_should_stop, grow_trees, tree_proposal


def logq_rows(rows: list[dict[int, float]], vocab: int = 8) -> torch.Tensor:
    out = torch.full((len(rows), vocab), -1e9)
    for i, row in enumerate(rows):
        for tok, p in row.items():
            out[i, tok] = math.log(p)
    return out


def test_expand_scores_beam_and_rerank() -> None:
    b = TreeBuilder(width=2)
    b.expand(logq_rows([{1: 0.6, 2: 0.3, 3: 0.1}]))  # depth 1: candidates 1 (0.6), 2 (0.3)
    assert b.beam_tokens() == [1, 2]
    assert beam_mass(b.beam_scores) == pytest.approx(math.log(0.9), abs=1e-6)
    # children of 1: 4 (0.5), 5 (0.5); children of 2: 6 (0.9), 7 (0.05)
    b.expand(logq_rows([{4: 0.5, 5: 0.5}, {6: 0.9, 7: 0.05}]))
    # path scores: 1-4 0.30, 1-5 0.30, 2-6 0.27, 2-7 0.015 -> beam = 1-4, 1-5
    assert b.beam_tokens() == [4, 5]
    tree = b.rerank(budget=5)  # keep 4 best of 6: 1 (.6), 2 (.3), 4 (.3), 5 (.3)
    assert tree.tokens == [1, 2, 4, 5]
    assert tree.parents == [0, 0, 1, 1]
    tree = b.rerank(budget=3)  # 1 and then the tie at 0.3 goes to the shallower node 2
    assert tree.tokens == [1, 2] and tree.parents == [0, 0]


def random_builder(gen: torch.Generator, levels: int) -> TreeBuilder:
    """A width-3 tree over 30 tokens grown ``levels`` levels from peaked random draft distributions."""
    b = TreeBuilder(width=3)
    for _ in range(levels):
        b.expand(torch.log_softmax(torch.randn(max(1, len(b.beam)), 30, generator=gen) * 3, -1))
    return b


def test_rerank_is_closed_under_ancestors_on_random_trees() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        b = random_builder(gen, levels=5)
        tree = b.rerank(budget=2 + trial)
        assert len(tree.tokens) == min(1 + trial, b.num_candidates)
        for j, par in enumerate(tree.parents, start=1):
            assert 0 <= par < j  # parents precede children and are in the tree


def test_a_draft_row_without_mass_ranks_its_children_last_and_keeps_trees_closed() -> None:
    """A NaN row (a draft's bf16 overflow) scored its children NaN, which broke the rerank's order: a kept child
    could lose its parent (a KeyError that failed the request). Its children now rank last, as -inf."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(100):
        b = TreeBuilder(width=3)
        b.expand(torch.log_softmax(torch.randn(1, 30, generator=gen) * 3, -1))
        level = torch.randn(3, 30, generator=gen) * 3
        level[trial % 3, 5] = math.nan if trial % 2 else math.inf  # log_softmax makes either a row of NaN
        b.expand(torch.log_softmax(level, -1))
        b.expand(torch.log_softmax(torch.randn(len(b.beam), 30, generator=gen) * 3, -1))
        assert not any(math.isnan(x) for x in b.scores)
        for budget in range(2, b.num_candidates + 2):
            tree = b.rerank(budget)
            assert all(0 <= par < j for j, par in enumerate(tree.parents, start=1))
            if any(b.scores[c] == -math.inf for c in tree.candidates):  # only once every scored node is in
                assert {c for c in range(b.num_candidates) if b.scores[c] > -math.inf} <= set(tree.candidates)


def test_a_beam_wider_than_the_draft_vocabulary_takes_every_column() -> None:
    b = TreeBuilder(width=5)
    b.expand(logq_rows([{0: 0.5, 1: 0.3, 2: 0.2}], vocab=3))
    assert sorted(b.beam_tokens()) == [0, 1, 2]
    b.expand(logq_rows([{0: 1.0}, {1: 1.0}, {2: 1.0}], vocab=3))
    assert b.num_candidates == 12 and len(b.rerank(budget=13).tokens) == 12


def test_rerank_drops_nodes_below_the_least_path_probability() -> None:
    b = TreeBuilder(width=2)
    b.expand(logq_rows([{1: 0.6, 2: 0.3, 3: 0.1}]))
    b.expand(logq_rows([{4: 0.5, 5: 0.5}, {6: 0.9, 7: 0.05}]))  # paths 1-4 .30, 1-5 .30, 2-6 .27, 2-7 .015
    tree = b.rerank(budget=8, min_score=math.log(0.29))
    assert tree.tokens == [1, 2, 4, 5] and tree.parents == [0, 0, 1, 1]  # 2-6 (.27) and 2-7 fall below
    assert b.rerank(budget=3, min_score=math.log(0.29)).tokens == [1, 2]  # the budget still binds first
    assert b.rerank(budget=8, min_score=math.log(0.5)).tokens == [1]
    empty = b.rerank(budget=8, min_score=math.log(0.7))  # nothing sure enough: the step verifies the root alone
    assert empty.tokens == [] and empty.parents == []


def test_pruned_trees_stay_closed_under_ancestors_on_random_trees() -> None:
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        b = random_builder(gen, levels=4)
        floor = math.log(0.01 + 0.02 * trial)
        tree = b.rerank(budget=64, min_score=floor)
        assert len(tree.tokens) == min(63, sum(s >= floor for s in b.scores))
        for j, par in enumerate(tree.parents, start=1):
            assert 0 <= par < j


def test_ddd_rule_only_fires_at_check_steps() -> None:
    assert ddd_should_stop(-1.0, 5, (5, 7, 9), -0.3, every_step=False)
    assert not ddd_should_stop(-1.0, 6, (5, 7, 9), -0.3, every_step=False)
    assert ddd_should_stop(-1.0, 6, (5, 7, 9), -0.3, every_step=True)
    assert not ddd_should_stop(-0.2, 5, (5, 7, 9), -0.3, every_step=False)
    # the boundary: H at x goes on, the next float below stops (docs/algorithms.md §3.1: stop when H_d < x)
    assert not ddd_should_stop(-0.3, 5, (5, 7, 9), -0.3, every_step=False)
    assert ddd_should_stop(math.nextafter(-0.3, -math.inf), 5, (5, 7, 9), -0.3, every_step=False)


def _states(specs: list[SpecConfig], depth: int) -> list[DraftState]:
    from specserve.messages import ProposeItem
    from specserve.sampling import SamplingParams

    return [
        DraftState(ProposeItem(i, [1], [], depth, spec), SamplingParams(), None, feed=[1], root_idx=0)
        for i, spec in enumerate(specs)
    ]


def test_a_proposal_of_no_levels_is_refused_when_made() -> None:
    """A draft worker given depth 0 fed nothing and cached no root, so its next proposal for the sequence failed an
    assert (the step loop sends no item for a step without drafting; a library caller could)."""
    from specserve.messages import ProposeItem

    with pytest.raises(ValueError, match="sequence 3: a proposal drafts at least one level, got depth 0"):
        ProposeItem(3, [5, 9], [], 0)
    assert ProposeItem(3, [5, 9], [], 1).depth == 1
    # nor one that feeds no token: the worker built an empty forward, an error blamed on no sequence (the whole
    # step was reset)
    with pytest.raises(ValueError, match="sequence 3: a proposal feeds at least its root token, got none"):
        ProposeItem(3, [], [], 1)


def _logits(peaked: bool, rows: int, vocab: int = 50) -> torch.Tensor:
    """A fake draft's logits: peaked puts ~all mass on one token (H stays near 0), else uniform (H drops by
    log(1/V) a level)."""
    if not peaked:
        return torch.zeros(rows, vocab)
    out = torch.full((rows, vocab), -20.0)
    out[:, 7] = 0.0
    return out


def _run_trees(states: list[DraftState], peaked: list[bool], forwarded: list[list[int]] | None = None) -> int:
    """grow_trees over a fake draft, sequence i peaked or uniform as ``peaked[i]``; ``forwarded`` collects the
    sequences of each level forward."""

    def forward(sts, tokens, *, num_logits=None, positions=None, masks=None, parent_rows=None):  # type: ignore[no-untyped-def]
        if forwarded is not None:
            forwarded.append([s.item.seq_id for s in sts])
        return [_logits(peaked[s.item.seq_id], len(t)) for s, t in zip(sts, tokens, strict=True)]

    return grow_trees([(s, _logits(peaked[s.item.seq_id], 1)) for s in states], forward, torch.device("cpu"))


@pytest.mark.parametrize("steps", [(), (0, 3), (5, 3), (3, 3)])
def test_ddd_check_steps_must_be_increasing_forwards(steps: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="ddd_check_steps"):
        SpecConfig(method=SpecMethod.ddd, ddd_check_steps=steps)


def test_ddd_stops_each_sequence_on_its_own_h_and_syncs_only_at_check_steps() -> None:
    spec = SpecConfig(method=SpecMethod.ddd, beam_width=2, budget=20, ddd_check_steps=(3, 5), ddd_threshold=-0.5)
    states = _states([spec, spec], depth=8)
    reads = _run_trees(states, peaked=[False, True])
    assert [s.depth for s in states] == [3, 8]  # uniform q: H_3 ~ -11 < x; peaked: H stays ~0 until the budget
    assert reads == 1 + 2  # the stopped one read H once; the other at both check steps


def test_ddd_check_step_counting_switch() -> None:
    """Default: check step d = the d-th forward (the root's included); the EAGLE-2 reading checks a level later."""
    spec = SpecConfig(method=SpecMethod.ddd, beam_width=2, budget=20, ddd_check_steps=(3,), ddd_threshold=-0.5)
    later = spec.model_copy(update={"ddd_count_first_forward": False})
    states = _states([spec, later], depth=8)
    _run_trees(states, peaked=[False, False])
    assert [s.depth for s in states] == [3, 4]
    eagle2 = _states([SpecConfig(method=SpecMethod.eagle2, beam_width=2, budget=20, tree_depth=8)], depth=6)
    assert _run_trees(eagle2, peaked=[False]) == 0 and eagle2[0].depth == 6  # EAGLE-2: the budget, no H reads


def test_a_check_at_the_roots_forward_stops_unsure_trees_before_any_level_forward() -> None:
    """Check step 1 reads H_1, the mass of the root's top-w children, after the catch-up forward alone: a flat root
    (top-2 of 50 uniform tokens: H_1 = log(2/50)) keeps a depth-1 tree and the worker forwards no level for it; a
    sure one (H_1 ~ 0) goes on to the next check."""
    spec = SpecConfig(method=SpecMethod.ddd, beam_width=2, budget=6, ddd_check_steps=(1, 2), ddd_threshold=-0.03)
    states = _states([spec, spec], depth=5)
    forwarded: list[list[int]] = []
    reads = _run_trees(states, peaked=[False, True], forwarded=forwarded)
    assert [s.depth for s in states] == [1, 5]  # the sure tree's H stays above x at check 2 and runs to its budget
    assert forwarded == [[1]] * 4  # the unsure tree never reached a level forward
    assert reads == 1 + 2
    assert [p.depth for p in (tree_proposal(s)[0] for s in states)] == [1, 5]


def test_levels_below_the_budget_cannot_enter_the_tree():
    """Budget T keeps T - 1 nodes closed under ancestors: a tree grown T - 1 levels deep reranks to the same tree as
    one grown deeper, so the planner drafts no deeper (SpecConfig.static_depth)."""
    gen = torch.Generator().manual_seed(0)
    levels = [torch.log_softmax(torch.randn(4, 50, generator=gen) * 3, dim=-1) for _ in range(7)]
    for budget in (2, 3, 4, 5, 8):
        trees = []
        for depth in (budget - 1, 7):
            b = TreeBuilder(width=4)
            b.expand(levels[0][:1])
            for d in range(1, depth):
                b.expand(levels[d][: len(b.beam)])
            trees.append(b.rerank(budget))
        assert trees[0] == trees[1]
    for method, field in ((SpecMethod.ddd, "ddd_max_depth"), (SpecMethod.eagle2, "tree_depth")):
        assert SpecConfig(method=method, budget=4, **{field: 6}).static_depth == 3
        assert SpecConfig(method=method, budget=16, **{field: 6}).static_depth == 6


# -- a floor on the path probability bounds the beam (docs/algorithms.md §2.3) --------------------------------------


def test_beam_nodes_below_the_floor_are_set_aside_not_forwarded() -> None:
    b = TreeBuilder(width=3, min_score=math.log(0.25))
    b.expand(logq_rows([{1: 0.6, 2: 0.3, 3: 0.1}]))
    assert b.beam_tokens() == [1, 2]  # 3 (.1) cannot enter the tree, nor can its children
    assert [math.exp(s) for s in b.set_aside] == pytest.approx([0.1])
    assert b.mass() == pytest.approx(math.log(1.0), abs=1e-6)  # the full beam's mass: .6 + .3 + .1
    b.expand(logq_rows([{4: 0.5, 5: 0.4}, {6: 0.9, 7: 0.05}]))  # paths 1-4 .30, 1-5 .24, 2-6 .27, 2-7 .015
    assert b.beam_tokens() == [4, 6]  # the top 3 are .30, .27, .24; 1-5 (.24) joins the set-aside
    assert [math.exp(s) for s in b.set_aside] == pytest.approx([0.1, 0.24])
    assert b.mass() == pytest.approx(math.log(0.30 + 0.27 + 0.24 + 0.1), abs=1e-6)
    tree = b.rerank(budget=8, min_score=math.log(0.25))
    assert tree.tokens == [1, 2, 4, 6] and tree.parents == [0, 0, 1, 2]
    b.expand(logq_rows([{3: 0.5, 5: 0.5}, {1: 0.2, 0: 0.1}]))  # every path now below .25
    assert b.beam == []  # nothing left to forward: the tree is complete


def _path_logq(path: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    """The fake draft's log-probabilities after a path of tokens: the same whichever builder asks."""
    gen = torch.Generator().manual_seed(hash((seed, *path)) % 2**31)
    return torch.log_softmax(torch.randn(vocab, generator=gen) * 3, dim=-1)


def _grow(b: TreeBuilder, levels: int, vocab: int, seed: int) -> list[float]:
    """Grow ``levels`` levels forwarding exactly the builder's beam; its mass after each level."""
    masses = []
    for _ in range(levels):
        if b.depth and not b.beam:
            break
        beam = [()] if b.depth == 0 else [_path_of(b, int(c)) for c in b.beam]
        b.expand(torch.stack([_path_logq(p, vocab, seed) for p in beam]))
        masses.append(b.mass())
    return masses


def _path_of(b: TreeBuilder, cand: int) -> tuple[int, ...]:
    path = []
    while cand >= 0:
        path.append(b.tokens[cand])
        cand = b.parents[cand]
    return tuple(reversed(path))


def _above(b: TreeBuilder, depth: int, min_score: float) -> set[tuple[int, ...]]:
    """The paths of the builder's depth-``depth`` candidates (0: the root's children) scoring at least min_score."""
    return {_path_of(b, c) for c, sc in enumerate(b.scores) if b.depths[c] == depth and sc >= min_score}


def test_a_bounded_beam_finds_every_candidate_above_the_floor_and_bounds_the_mass_from_above() -> None:
    """Against EAGLE-2's full beam on random drafts: the same candidates at or above the floor at every depth (so the
    same trees), at most 1 / floor rows forwarded a level, and a beam mass never below the full beam's (DDD, reading
    it, stops no earlier)."""
    for seed in range(12):
        floor = (0.1, 0.2, 0.3)[seed % 3]
        full, bounded = TreeBuilder(width=6), TreeBuilder(width=6, min_score=math.log(floor))
        full_mass, bounded_mass = _grow(full, 5, 40, seed), _grow(bounded, 5, 40, seed)
        for d in range(len(bounded_mass)):
            above = [_above(b, d, math.log(floor)) for b in (full, bounded)]
            assert above[0] == above[1]
            assert bounded_mass[d] >= full_mass[d] - 1e-6
        per_level = [bounded.depths.count(d) for d in range(1, bounded.depth)]
        assert all(n <= 6 * int(1 / floor) for n in per_level)  # children of <= 1 / floor rows
        for budget in (2, 4, 8, 16):
            assert full.rerank(budget, math.log(floor)).tokens == bounded.rerank(budget, math.log(floor)).tokens


def test_grow_trees_forwards_only_the_beam_rows_a_floor_lets_into_the_tree() -> None:
    """A sure draft (one token ~1.0 a level) under a floor of 0.5: one row a level instead of the beam's four, and the
    tree is that chain; unfloored, or with the switch off, every level forwards the whole beam."""
    spec = SpecConfig(method=SpecMethod.ddd, beam_width=4, budget=6, ddd_check_steps=(1, 2), ddd_threshold=-0.03)
    floored = spec.model_copy(update={"tree_min_prob": 0.5})
    switched_off = floored.model_copy(update={"floor_beam": False})
    for s, rows_per_level in ((spec, 4), (switched_off, 4), (floored, 1)):
        states = _states([s], depth=5)
        rows: list[int] = []

        def forward(sts, tokens, *, num_logits=None, positions=None, masks=None, parent_rows=None, rows=rows):  # type: ignore[no-untyped-def]
            rows.extend(len(t) for t in tokens)
            return [_logits(True, len(t)) for t in tokens]

        grow_trees([(states[0], _logits(True, 1))], forward, torch.device("cpu"))
        assert rows == [rows_per_level] * 4  # levels 2-5 of a depth-5 tree
    proposal = tree_proposal(states[0])[0]
    assert proposal.tokens == [7] * 5 and proposal.parents == [0, 1, 2, 3, 4]
