"""EAGLE-2 dynamic draft trees (docs/algorithms.md §2) with DDD's dynamic depth (§3).

``TreeBuilder`` holds one sequence's candidates and picks each level's beam; ``grow_trees`` runs the level loop
for a batch of sequences over the forward their worker lends it (the beam's ancestry becomes each level's tree
mask); DDD's rule decides, only at its check steps, whether a tree stops early; ``tree_proposal`` reranks the
candidates to the verify budget. Scores are log draft probabilities at temperature 1 summed along the path (they
only decrease with depth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specserve.config import SpecMethod
from specserve.messages import Proposal
from specserve.spec_decode.draft_state import DraftForward, DraftState, draft_q


def beam_mass(beam_scores: torch.Tensor) -> torch.Tensor:
    """H_d: log of the total draft probability of the beam's paths. beam_scores [w] -> []"""
    return torch.logsumexp(beam_scores, dim=-1)


def is_check_step(depth: int, check_steps: tuple[int, ...], every_step: bool) -> bool:
    """Whether DDD reads H on the host after expansion step ``depth`` (only these steps may sync)."""
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
    """Candidates of one sequence's tree. Candidate c: token, parent candidate (-1 = root), score, depth.

    ``min_score`` (log of the tree's floor, docs/algorithms.md §2.3): a beam node below it can neither enter the tree
    nor have a descendant that does (scores only decrease with depth), so it is set aside instead of forwarded; its
    score still counts in the beam's mass, standing for its descendants' mass, which it bounds."""

    width: int
    min_score: float = -math.inf
    tokens: list[torch.Tensor] = field(default_factory=list)  # per level [w * n_parents]
    parents: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    beam: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # candidate ids
    beam_scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1))
    set_aside: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [s] scores of beam nodes below the floor
    num_candidates: int = 0

    @property
    def depth(self) -> int:
        return len(self.tokens)

    def expand(self, logq: torch.Tensor, token_ids: torch.Tensor | None = None) -> None:
        """Add the top-w children of every beam node (of the root at depth 0) and pick the next beam.

        logq: [n_beam, V_d] draft log-probabilities (temperature 1) at the current beam nodes, in beam order;
        token_ids: [V_d] target id of each column (None: columns are target ids).
        """
        top_logq, top_tok = logq.topk(self.width, dim=-1)  # [n_beam, w]
        if token_ids is not None:
            top_tok = token_ids[top_tok]
        dev = logq.device
        parent_ids = self.beam if self.depth > 0 else torch.full((1,), -1, dtype=torch.long, device=dev)
        beam_scores = self.beam_scores if self.depth > 0 else torch.zeros(1, device=dev)  # the root's score: 0
        scores = (beam_scores[:, None] + top_logq).flatten()  # [n_beam * w]
        self.tokens.append(top_tok.flatten())
        self.parents.append(parent_ids.repeat_interleave(self.width))
        self.scores.append(scores)
        keep = scores.topk(min(self.width, scores.numel())).indices.sort().values  # next beam, in candidate order
        if self.min_score > -math.inf:  # beam nodes below the floor: set aside, not forwarded (a host sync on a GPU)
            below = scores[keep] < self.min_score
            self.set_aside = torch.cat([self.set_aside.to(dev), scores[keep[below]]])
            keep = keep[~below]
        self.beam = keep + self.num_candidates
        self.beam_scores = scores[keep]
        self.num_candidates += scores.numel()

    def mass(self) -> torch.Tensor:
        """H_d: the beam's mass with the set-aside nodes' (at least the mass of the beam EAGLE-2 would have kept)."""
        return beam_mass(torch.cat([self.beam_scores, self.set_aside.to(self.beam_scores.device)]))

    def beam_tokens(self) -> torch.Tensor:
        return torch.cat(self.tokens)[self.beam]

    def beam_parents(self) -> torch.Tensor:
        return torch.cat(self.parents)[self.beam]

    def rerank(self, budget: int, min_score: float = -math.inf) -> DraftTreeOut:
        """Keep the budget-1 best candidates whose score is at least ``min_score`` (closed under ancestors),
        ordered by depth: parents first."""
        tokens, parents, scores = torch.cat(self.tokens), torch.cat(self.parents), torch.cat(self.scores)
        depth = torch.cat([torch.full_like(t, d) for d, t in enumerate(self.tokens)])
        n = min(budget - 1, scores.numel())
        if min_score > -math.inf:
            n = min(n, int((scores >= min_score).sum()))  # host sync (the tree's size)
        # order by score, ties towards shallower then earlier candidates: a parent always outranks its
        # children (scores never increase along a path), so every prefix of the order is closed under ancestors
        order = torch.sort(depth, stable=True).indices
        order = order[torch.sort(-scores[order], stable=True).indices]
        kept = order[:n]
        kept = kept[torch.sort(depth[kept] * scores.numel() + kept).indices]  # by depth: parents first
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        kept_list, parent_list, rank_list = kept.tolist(), parents[kept].tolist(), rank[kept].tolist()
        node_of = {c: i + 1 for i, c in enumerate(kept_list)}
        out_parents = [0 if par < 0 else node_of[par] for par in parent_list]
        return DraftTreeOut(tokens[kept].tolist(), out_parents, kept_list, rank_list)


@dataclass
class TreeGrowth:
    """One sequence's tree while it grows: the candidates, and which forwarded row holds each of them."""

    builder: TreeBuilder
    anc: torch.Tensor  # [F+1, F+1] ancestor rows of the root and the F forwarded beam nodes
    row_of: torch.Tensor  # [1 + candidates] forwarded row of each candidate (index 0: the root)


def grow_trees(trees: list[tuple[DraftState, torch.Tensor]], forward: DraftForward, device: torch.device) -> int:
    """Grow every tree level by level until its depth budget (``item.depth``) or DDD's stop; ``trees`` pairs each
    state with its level-0 logits. Returns how many times DDD's H was read on the host."""
    h_reads = 0
    for s, lg in trees:
        if s.item.depth == 0:
            continue
        spec = s.item.spec
        builder = TreeBuilder(spec.beam_width, min_score=floor_score(s) if spec.floor_beam else -math.inf)
        s.q_logits.append(lg)
        builder.expand(torch.log_softmax(lg, dim=-1), s.token_ids)
        s.tree = TreeGrowth(
            builder,
            anc=torch.ones(1, 1, dtype=torch.bool, device=device),
            row_of=torch.zeros(1 + builder.num_candidates, dtype=torch.long, device=device),
        )
        s.depth = 1
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
            positions.append([s.root_idx + s.depth] * s.tree.builder.beam.numel())
        out = forward(active, tokens, positions=positions, masks=masks, parent_rows=parent_rows)
        still = []
        for s, lg in zip(active, out, strict=True):
            assert s.tree is not None
            s.q_logits.append(lg)
            s.tree.builder.expand(torch.log_softmax(lg, dim=-1), s.token_ids)
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
    beam, parents = t.builder.beam, t.builder.beam_parents()
    n, f1 = beam.numel(), t.anc.shape[0]
    parent_rows = t.row_of[parents + 1]  # [n]
    new = torch.zeros(n, f1 + n, dtype=torch.bool, device=device)  # [n, F+1+n]
    new[:, :f1] = t.anc[parent_rows]
    new[:, f1:] = torch.eye(n, dtype=torch.bool, device=device)
    t.anc = torch.cat([torch.nn.functional.pad(t.anc, (0, n)), new])  # [F+1+n, F+1+n]
    t.row_of = torch.nn.functional.pad(t.row_of, (0, t.builder.num_candidates + 1 - t.row_of.numel()))
    t.row_of[beam + 1] = torch.arange(f1, f1 + n, device=device)
    return new, parent_rows


def _tree_done(s: DraftState) -> tuple[bool, int]:
    """After expansion step s.depth: stop at the depth budget, or where DDD's H falls below x. (done, H reads)"""
    assert s.tree is not None
    if s.depth >= s.item.depth or s.tree.builder.beam.numel() == 0:  # no beam node left above the floor
        return True, 0
    spec = s.item.spec
    step = s.depth if spec.ddd_count_first_forward else s.depth - 1  # docs/algorithms.md §3.2
    if spec.method != SpecMethod.ddd or not is_check_step(step, spec.ddd_check_steps, spec.ddd_check_every_step):
        return False, 0
    h = float(s.tree.builder.mass())  # host sync: DDD's check, only at check steps
    return ddd_should_stop(h, step, spec.ddd_check_steps, spec.ddd_threshold, spec.ddd_check_every_step), 1


def floor_score(s: DraftState) -> float:
    """log of the step's floor on a node's path probability (the loop's measured one, else the spec's; §2.3)."""
    floor = s.item.spec.tree_min_prob if s.item.min_prob is None else s.item.min_prob
    return math.log(floor) if floor > 0 else -math.inf


def tree_proposal(s: DraftState) -> tuple[Proposal, list[int | None]]:
    """The budget-T tree, and the cache index of each node (root first; None where the node was never fed)."""
    assert s.tree is not None
    t = s.tree
    tree = t.builder.rerank(s.item.spec.model_tree_budget, floor_score(s))
    row_of = torch.nn.functional.pad(t.row_of, (0, t.builder.num_candidates + 1 - t.row_of.numel()))
    cand = torch.tensor(tree.candidates, dtype=torch.long, device=row_of.device)
    rows = row_of[cand + 1].tolist()  # host sync
    cached: list[int | None] = [s.root_idx] + [s.root_idx + r if r > 0 else None for r in rows]
    fed = [(0, 0)] + [(node, r) for node, r in enumerate(rows, start=1) if r > 0]  # (node, logits row)
    proposal = Proposal(
        s.item.seq_id, tree.tokens, tree.parents, depth=s.depth, ranks=tree.ranks, draft_q=draft_q(s, fed)
    )
    return proposal, cached
