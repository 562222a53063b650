"""How often a model-free draft node is accepted where its parent was, measured as the loop runs
(docs/algorithms.md §10.6).

A count tree's share count / total says what followed the matched context before, not how likely the target is to
agree: a continuation seen once after a 2-token match is accepted about half the time, one seen once after a match of
3+ tokens three times in four, and a continuation that shares its parent with others one time in three to seven,
whatever its share. So a node's chance is read from the acceptance of the nodes like it (``node_cell``: the match
length, the parent's total count, whether the node is the parent's only continuation, the larger share of several
or a smaller one, its depth), counted from the verify results of this drafter's own proposals and starting from a
prior of count / (total + 1). A node below the first level is scored at least as its cell at the first level
(accepted where its parent was, a deeper node was at least as likely in every cell measured but one, where the two
agreed within noise), so the tries that keep the first level's cells measured keep the deeper ones from locking in.
"""

from __future__ import annotations

import numpy as np

MATCH_CELLS = 3  # match length 1, 2, >= 3 tokens
TOTAL_CELLS = 3  # the parent's total count 1, 2, >= 3
SHARE_CELLS = 3  # a smaller share of several continuations, the larger (>= 1/2), the only one
DEPTH_CELLS = 2  # depth 1, >= 2
PRIOR_WEIGHT = 4.0  # trials the prior counts for
WINDOW = 2000.0  # a cell's trials past this are halved with its hits: the rates follow the workload
TRY_EVERY = 16  # a step whose matches' best node is below the floor proposes that node alone once in this many

Cell = tuple[int, int, int, int]  # (match, total, share, depth) indices


def node_cell(match_len: int, count: int, total: int, depth: int) -> Cell:
    """The cell of a node ``count`` of whose parent's ``total`` continuations went its way, ``depth`` levels below a
    context matched over ``match_len`` tokens (all >= 1)."""
    share = 2 if count == total else int(2 * count >= total)
    return (min(match_len, MATCH_CELLS) - 1, min(total, TOTAL_CELLS) - 1, share, min(depth, DEPTH_CELLS) - 1)


def smoothed_rate(hits: float, trials: float, prior: float, weight: float) -> float:
    """(hits + weight * prior) / (trials + weight): a cell's acceptance with ``weight`` trials of ``prior``."""
    return (hits + weight * prior) / (trials + weight)


class CountCalibration:
    """Hits and trials per cell; one per drafter (the step loop's), fed by ``observe`` after each verify."""

    def __init__(self, prior_weight: float = PRIOR_WEIGHT, window: float = WINDOW, try_every: int = TRY_EVERY) -> None:
        shape = (MATCH_CELLS, TOTAL_CELLS, SHARE_CELLS, DEPTH_CELLS)
        self.hits = np.zeros(shape)  # [match, total, share, depth]
        self.trials = np.zeros(shape)
        self.declined = np.zeros(shape, dtype=np.int64)  # steps declined since the cell's last try
        self.prior_weight = prior_weight
        self.window = window
        self.try_every = try_every

    def acceptance(self, cell: Cell, count: int, total: int) -> float:
        """The chance that a node of ``cell`` is accepted where its parent is: its cell's rate, and below the first
        level at least the first level's."""
        prior = count / (total + 1)
        rate = smoothed_rate(float(self.hits[cell]), float(self.trials[cell]), prior, self.prior_weight)
        if cell[3] == 0:
            return rate
        first = (*cell[:3], 0)
        return max(rate, smoothed_rate(float(self.hits[first]), float(self.trials[first]), prior, self.prior_weight))

    def decline(self, cell: Cell) -> bool:
        """A step whose best node (of ``cell``) scored below the floor: whether to propose it anyway, as a try
        (every ``try_every``-th time), so that a cell whose rate fell is measured again."""
        self.declined[cell] += 1
        if self.declined[cell] < self.try_every:
            return False
        self.declined[cell] = 0
        return True

    def observe(self, cells: list[Cell], parents: list[int], accepted: list[int]) -> None:
        """One verified proposal: node i (1-based) of ``cells`` / ``parents`` (0 = the root) is a trial where its
        parent was accepted (the root always is), a hit where it was accepted too (``accepted``: its nodes)."""
        hit = set(accepted)
        for node, (cell, parent) in enumerate(zip(cells, parents, strict=True), start=1):
            if parent == 0 or parent in hit:
                self.trials[cell] += 1.0
                self.hits[cell] += node in hit
                if self.trials[cell] > self.window:
                    self.trials[cell] /= 2.0
                    self.hits[cell] /= 2.0
