"""EAGLE-2 dynamic draft trees (docs/algorithms.md §2) and DDD's stop rule (§3.1), as small tensor functions.

A ``TreeBuilder`` collects one sequence's candidates level by level; the draft worker runs the forwards.
Scores are log draft probabilities at temperature 1 summed along the path (they only decrease with depth).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    """Candidates of one sequence's tree. Candidate c: token, parent candidate (-1 = root), score, depth."""

    width: int
    tokens: list[torch.Tensor] = field(default_factory=list)  # per level [w * n_parents]
    parents: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    beam: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # candidate ids
    beam_scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1))
    num_candidates: int = 0

    @property
    def depth(self) -> int:
        return len(self.tokens)

    def expand(self, logq: torch.Tensor) -> None:
        """Add the top-w children of every beam node (of the root at depth 0) and pick the next beam.

        logq: [n_beam, V] draft log-probabilities (temperature 1) at the current beam nodes, in beam order.
        """
        top_logq, top_tok = logq.topk(self.width, dim=-1)  # [n_beam, w]
        parent_ids = self.beam if self.depth > 0 else torch.tensor([-1])
        scores = (self.beam_scores[:, None] + top_logq).flatten()  # [n_beam * w]
        self.tokens.append(top_tok.flatten())
        self.parents.append(parent_ids.repeat_interleave(self.width))
        self.scores.append(scores)
        keep = scores.topk(min(self.width, scores.numel())).indices.sort().values  # next beam, in candidate order
        self.beam = keep + self.num_candidates
        self.beam_scores = scores[keep]
        self.num_candidates += scores.numel()

    def beam_tokens(self) -> torch.Tensor:
        return torch.cat(self.tokens)[self.beam]

    def beam_parents(self) -> torch.Tensor:
        return torch.cat(self.parents)[self.beam]

    def rerank(self, budget: int) -> DraftTreeOut:
        """Keep the budget-1 best candidates (closed under ancestors), ordered by depth: parents first."""
        tokens, parents, scores = torch.cat(self.tokens), torch.cat(self.parents), torch.cat(self.scores)
        depth = torch.cat([torch.full_like(t, d) for d, t in enumerate(self.tokens)])
        n = min(budget - 1, scores.numel())
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
