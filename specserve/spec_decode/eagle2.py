"""EAGLE-2 dynamic draft trees (docs/algorithms.md §2) with DDD's dynamic depth (§3).

``TreeBuilder`` holds one sequence's candidates and picks each level's beam; ``grow_trees`` runs the level loop
for a batch of sequences over the forward their worker lends it (the beam's ancestry becomes each level's tree
mask); DDD's rule decides, only at its check steps, whether a tree stops early; ``tree_proposal`` reranks the
candidates to the verify budget. Scores are log draft probabilities at temperature 1 summed along the path (they
only decrease with depth).

The draft's distributions stay where its forward ran; a level's top-w children per beam node (w <= beam width,
tens of numbers) come to the host once for the whole batch, in ``expand_level``, the level's one host sync, and
everything after that (scores, the beam, the floor, H, the rerank, the ancestry) is bookkeeping over a few dozen
Python numbers (docs/algorithms.md §3.2).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.config import SpecMethod
from specserve.messages import Proposal
from specserve.spec_decode.draft_state import DraftForward, DraftState, Fed


def beam_mass(beam_scores: Sequence[float]) -> float:
    """H_d: log of the total draft probability of the beam's paths (a log-sum-exp of their log scores)."""
    top = max(beam_scores, default=-math.inf)
    if top == -math.inf:
        return -math.inf
    return top + math.log(math.fsum(math.exp(s - top) for s in beam_scores))


def is_check_step(depth: int, check_steps: tuple[int, ...], every_step: bool) -> bool:
    """Whether DDD reads H after expansion step ``depth``."""
    return every_step or depth in check_steps


def ddd_should_stop(h: float, depth: int, check_steps: tuple[int, ...], threshold: float, every_step: bool) -> bool:
    """DDD's rule: at a check step, stop expanding when the beam's mass H_d is below the threshold x."""
    return is_check_step(depth, check_steps, every_step) and h < threshold


@dataclass
class DraftTreeOut:
    tokens: list[int]  # drafted nodes 1..T-1 (root excluded)
    parents: list[int]  # parent node of each, 0 = root
    candidates: list[int]  # candidate index of each node (to map back to cache entries)
    ranks: list[int]  # score rank of each node (0 = best): the top-(T-1) ranks form the tree at budget T


@dataclass
class TreeBuilder:
    """Candidates of one sequence's tree, on the host. Candidate c: ``tokens[c]``, ``parents[c]`` (-1 = root),
    ``scores[c]``, ``depths[c]`` (0 = a child of the root); candidates are numbered level by level.

    ``min_score`` (log of the tree's floor, docs/algorithms.md §2.3): a beam node below it can neither enter the tree
    nor have a descendant that does (scores only decrease with depth), so it is set aside instead of forwarded; its
    score still counts in the beam's mass, standing for its descendants' mass, which it bounds."""

    width: int
    min_score: float = -math.inf
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    beam: list[int] = field(default_factory=list)  # candidate ids of the next level's parents, ascending
    beam_scores: list[float] = field(default_factory=list)
    set_aside: list[float] = field(default_factory=list)  # scores of beam nodes below the floor
    depth: int = 0  # levels expanded

    @property
    def num_candidates(self) -> int:
        return len(self.tokens)

    def expand(self, logq: torch.Tensor, token_ids: torch.Tensor | None = None) -> None:
        """Add the top-w children of every beam node (of the root at depth 0) and pick the next beam.

        logq: [n_beam, V_d] draft log-probabilities (temperature 1) at the current beam nodes, in beam order;
        token_ids: [V_d] target id of each column (None: columns are target ids).
        """
        self.add_level(*_top_children(logq, self.width, token_ids))

    def add_level(self, values: list[list[float]], toks: list[list[int]]) -> None:
        """``expand`` given each beam node's top-w children on the host: their log-probabilities and target ids."""
        parent_ids, base = (self.beam, self.beam_scores) if self.depth > 0 else ([-1], [0.0])  # the root scores 0
        if len(values) != len(parent_ids):
            raise ValueError(f"logq has {len(values)} rows for a beam of {len(parent_ids)} nodes")
        first = self.num_candidates
        for parent, score, vals, ts in zip(parent_ids, base, values, toks, strict=True):
            self.tokens += ts
            self.parents += [parent] * len(ts)
            self.scores += [score + v for v in vals]
        self.depths += [self.depth] * (self.num_candidates - first)
        # the next beam, in candidate order (ties go to the earlier candidate)
        keep = sorted(heapq.nlargest(self.width, range(first, self.num_candidates), key=self.scores.__getitem__))
        self.set_aside += [self.scores[c] for c in keep if self.scores[c] < self.min_score]
        self.beam = [c for c in keep if self.scores[c] >= self.min_score]
        self.beam_scores = [self.scores[c] for c in self.beam]
        self.depth += 1

    def mass(self) -> float:
        """H_d: the beam's mass with the set-aside nodes' (at least the mass of the beam EAGLE-2 would have kept)."""
        return beam_mass(self.beam_scores + self.set_aside)

    def beam_tokens(self) -> list[int]:
        return [self.tokens[c] for c in self.beam]

    def beam_parents(self) -> list[int]:
        return [self.parents[c] for c in self.beam]

    def rerank(self, budget: int, min_score: float = -math.inf) -> DraftTreeOut:
        """Keep the budget-1 best candidates whose score is at least ``min_score`` (closed under ancestors),
        ordered by depth: parents first."""
        n = min(budget - 1, self.num_candidates)
        if min_score > -math.inf:
            n = min(n, sum(s >= min_score for s in self.scores))
        # by score, ties towards shallower then earlier candidates: a parent always outranks its children (scores
        # never increase along a path), so every prefix of the order is closed under ancestors
        order = sorted(range(self.num_candidates), key=lambda c: (-self.scores[c], self.depths[c], c))
        rank = {c: r for r, c in enumerate(order[:n])}
        kept = sorted(order[:n], key=lambda c: (self.depths[c], c))  # by depth: parents first
        node_of = {c: i + 1 for i, c in enumerate(kept)}
        return DraftTreeOut(
            [self.tokens[c] for c in kept],
            [0 if self.parents[c] < 0 else node_of[self.parents[c]] for c in kept],
            kept,
            [rank[c] for c in kept],
        )


def _top_children(
    logq: torch.Tensor, width: int, token_ids: torch.Tensor | None
) -> tuple[list[list[float]], list[list[int]]]:
    """The top-``width`` log-probabilities and target ids of each row of ``logq`` [R, V_d], on the host (all its
    columns where it has fewer). A row without mass (NaN: a draft's overflow) gives children scored -inf, ranked
    last: NaN scores would break the order that keeps every kept prefix closed under ancestors."""
    top_logq, top_col = logq.topk(min(width, logq.shape[-1]), dim=-1)  # [R, w]
    top_logq = top_logq.nan_to_num(nan=-math.inf)
    top_tok = top_col if token_ids is None else token_ids[top_col]
    return top_logq.tolist(), top_tok.tolist()  # host sync: the level's device->host copy


def expand_level(level: list[tuple[TreeBuilder, torch.Tensor, torch.Tensor | None]]) -> None:
    """Expand each builder by its level's draft logits [n_i, V_d] (its beam's rows, the root's at depth 0) and
    column map: one log-softmax, top-k and host read for the builders that share a width and a map (a batch's
    do), so a level's device work and syncs do not grow with its sequences. Row-wise, as each builder alone."""
    groups: dict[tuple[int, int], list[tuple[TreeBuilder, torch.Tensor, torch.Tensor | None]]] = {}
    for entry in level:
        groups.setdefault((entry[0].width, id(entry[2])), []).append(entry)
    for group in groups.values():
        if len(group) == 1:
            builder, lg, token_ids = group[0]
            builder.expand(torch.log_softmax(lg, dim=-1), token_ids)
            continue
        width, token_ids = group[0][0].width, group[0][2]
        values, toks = _top_children(torch.log_softmax(torch.cat([e[1] for e in group]), dim=-1), width, token_ids)
        start = 0
        for builder, lg, _ in group:
            end = start + lg.shape[0]
            builder.add_level(values[start:end], toks[start:end])
            start = end


@dataclass
class TreeGrowth:
    """One sequence's tree while it grows: the candidates, and which forwarded row holds each of them."""

    builder: TreeBuilder
    anc: list[int] = field(default_factory=lambda: [1])  # per forwarded row (0: the root) its ancestor rows, as bits
    row_of: list[int] = field(default_factory=list)  # [1 + candidates] forwarded row of each (0: the root / none)

    def row(self, candidate: int) -> int:
        """The forwarded row of a candidate (0: never forwarded)."""
        return self.row_of[candidate + 1] if candidate + 1 < len(self.row_of) else 0


def grow_trees(trees: list[tuple[DraftState, torch.Tensor]], forward: DraftForward, device: torch.device) -> int:
    """Grow every tree level by level until its depth budget (``item.depth``) or DDD's stop; ``trees`` pairs each
    state with its level-0 logits. Returns how many times DDD's H was read."""
    h_reads = 0
    roots = []
    for s, lg in trees:
        if s.item.depth == 0:
            continue
        spec = s.item.spec
        builder = TreeBuilder(spec.beam_width, min_score=floor_score(s) if spec.floor_beam else -math.inf)
        s.q_logits.append(lg)
        roots.append((builder, lg, s.token_ids))
        s.tree = TreeGrowth(builder)
        s.depth = 1
    expand_level(roots)
    active = []
    for s, _ in trees:
        if s.tree is not None:
            done, read = _tree_done(s)
            h_reads += read
            if not done:
                active.append(s)
    while active:
        tokens, masks, positions, parent_rows = [], [], [], []
        for s in active:
            assert s.tree is not None
            mask, parents = _grow_mask(s.tree, device)
            masks.append(mask)
            parent_rows.append(parents)
            tokens.append(s.tree.builder.beam_tokens())
            positions.append([s.root_idx + s.depth] * len(s.tree.builder.beam))
        out = forward(active, tokens, positions=positions, masks=masks, parent_rows=parent_rows)
        level = []
        for s, lg in zip(active, out, strict=True):
            assert s.tree is not None
            s.q_logits.append(lg)
            level.append((s.tree.builder, lg, s.token_ids))
        expand_level(level)
        still = []
        for s in active:
            assert s.tree is not None
            s.depth += 1
            done, read = _tree_done(s)
            h_reads += read
            if not done:
                still.append(s)
        active = still
    return h_reads


def _grow_mask(t: TreeGrowth, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the beam's rows to the ancestry; returns their mask [n, F+1+n] over the rows forwarded so far and
    each one's parent row [n] (0 = the root)."""
    beam = t.builder.beam
    f1, n = len(t.anc), len(beam)
    parent_rows = [t.row(p) for p in t.builder.beam_parents()]
    new = [t.anc[r] | 1 << (f1 + i) for i, r in enumerate(parent_rows)]  # a row sees its parent's and itself
    t.anc += new
    t.row_of += [0] * (t.builder.num_candidates + 1 - len(t.row_of))
    for i, c in enumerate(beam):
        t.row_of[c + 1] = f1 + i
    mask = torch.tensor([[bool(a >> j & 1) for j in range(f1 + n)] for a in new], device=device)  # [n, F+1+n]
    return mask, torch.tensor(parent_rows, dtype=torch.long, device=device)


def _tree_done(s: DraftState) -> tuple[bool, int]:
    """After expansion step s.depth: stop at the depth budget, or where DDD's H falls below x. (done, H reads)"""
    assert s.tree is not None
    if s.depth >= s.item.depth or not s.tree.builder.beam:  # no beam node left above the floor
        return True, 0
    spec = s.item.spec
    step = s.depth if spec.ddd_count_first_forward else s.depth - 1  # docs/algorithms.md §3.2
    if spec.method != SpecMethod.ddd or not is_check_step(step, spec.ddd_check_steps, spec.ddd_check_every_step):
        return False, 0
    h = s.tree.builder.mass()  # DDD's check, only at check steps
    return ddd_should_stop(h, step, spec.ddd_check_steps, spec.ddd_threshold, spec.ddd_check_every_step), 1


def floor_score(s: DraftState) -> float:
    """log of the step's floor on a node's path probability (the loop's measured one, else the spec's; §2.3)."""
    floor = s.item.spec.tree_min_prob if s.item.min_prob is None else s.item.min_prob
    return math.log(floor) if floor > 0 else -math.inf


def tree_proposal(s: DraftState) -> tuple[Proposal, list[int | None], Fed]:
    """The budget-T tree (its draft q is ``with_draft_qs``'s to add), the cache index of each node (root first; None
    where the node was never fed) and its fed nodes."""
    assert s.tree is not None
    t = s.tree
    tree = t.builder.rerank(s.item.spec.model_tree_budget, floor_score(s))
    rows = [t.row(c) for c in tree.candidates]
    cached: list[int | None] = [s.root_idx, *(s.root_idx + r if r > 0 else None for r in rows)]
    fed = [(0, 0)] + [(node, r) for node, r in enumerate(rows, start=1) if r > 0]  # (node, logits row)
    proposal = Proposal(s.item.seq_id, tree.tokens, tree.parents, depth=s.depth, ranks=tree.ranks)
    return proposal, cached, fed
