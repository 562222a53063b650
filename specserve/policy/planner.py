"""The one speculation-length planner: per-sequence SL -> depth limits and max_sl -> room -> SL_cap -> guards
(docs/algorithms.md §4, §5).

The step loop and the simulator (``load/simulate.py``) both call ``SLPlanner.plan`` once per step, so what the
simulator replays is what serving runs.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specserve.config import SpecConfig, SpecMethod
from specserve.guard import Outlook, ThroughputGuard
from specserve.policy.dsde import SLState, apply_cap, sl_cap
from specserve.policy.tree_floor import TreeFloor


class PlanRow(Protocol):
    """What the planner reads of one sequence: its speculation settings and its DSDE state (None: static SL)."""

    @property
    def spec(self) -> SpecConfig: ...

    @property
    def sl_state(self) -> SLState | None: ...


@dataclass(frozen=True)
class StepPlan:
    depths: list[int]  # draft levels allowed per sequence this step (0 = not drafting)
    uncapped: list[int]  # the policy's SL_i before SL_cap, max_sl and the guards (static: its depth)
    cap: int | None  # SL_cap over the lock-step batch (None: no DSDE sequence past warm-up, or the cap is off)
    post_warmup: list[bool]  # DSDE sequences past warm-up (static ones: False)
    min_prob: float | None = None  # the measured tree floor for sequences with ``adaptive_floor`` (None: their own)
    # the mode the step was planned in: the throughput guard's answer where it was asked (the loop may still run
    # the step plainly: its draft worker detached, ``max_step_tokens``), else whether any sequence drafts
    speculate: bool = False
    # levels a model-free drafter may draft per sequence (None: ``depths``): a priced count tree
    # (``SpecConfig.free_tree_priced``) is bounded by its static depth, max_sl and the room, not by its SL or SL_cap
    free_depths: list[int] | None = None
    # rows whose drafter the batch gave fewer levels than it would draft alone (the room, SL_cap or
    # ``max_step_tokens``), for a model-free drafter and for the draft model (whose own limits, ``model_max_sl`` and
    # its tree budget, may leave it as deep either way): a draft accepted whole there says only that the sequence
    # could go at least that deep (DSDE's warm-up, §4.5)
    cut: list[bool] | None = None
    model_cut: list[bool] | None = None

    def free_depth(self, i: int) -> int:
        return self.depths[i] if self.free_depths is None else self.free_depths[i]

    def limit(self, i: int, *, by_model: bool) -> int:
        """The levels row ``i``'s drafter was allowed: ``depths`` for the draft model, ``free_depth`` otherwise."""
        return self.depths[i] if by_model else self.free_depth(i)

    def select(self, rows: list[int]) -> StepPlan:
        pick = [self.depths[i] for i in rows], [self.uncapped[i] for i in rows], [self.post_warmup[i] for i in rows]
        free = None if self.free_depths is None else [self.free_depths[i] for i in rows]
        cut = None if self.cut is None else [self.cut[i] for i in rows]
        model_cut = None if self.model_cut is None else [self.model_cut[i] for i in rows]
        return StepPlan(pick[0], pick[1], self.cap, pick[2], self.min_prob, self.speculate, free, cut, model_cut)

    def was_cut(self, i: int, *, by_model: bool) -> bool:
        """Whether the batch cut row ``i``'s drafter: the draft model's (``by_model``) or a model-free one's."""
        cut = self.model_cut if by_model else self.cut
        return cut is not None and cut[i]


class SLPlanner:
    def __init__(
        self,
        *,
        guard: ThroughputGuard | None = None,
        max_step_tokens: int | None = None,
        floor: TreeFloor | None = None,
    ) -> None:
        self.guard = guard  # None: always speculate as planned
        self.max_step_tokens = max_step_tokens  # drafted tokens + batch size verified per step (None: no limit)
        self.floor = floor  # measures the tree floor for sequences with ``adaptive_floor`` (None: never measured)
        self._shrunk = 0  # steps ``max_step_tokens`` shrank: the row that gives way first among equals rotates

    def plan(
        self,
        rows: Sequence[PlanRow],
        *,
        prefills: bool = False,
        outlook: Outlook | None = None,
        guarded: bool = True,
        room: Sequence[int] | None = None,
        model: bool = True,
    ) -> StepPlan:
        """``prefills``: some row feeds a prompt this step (the guard does not time such a step); ``outlook``: what
        speculating would first cost the draft and what the batch can still emit (the guard's switch rule);
        ``guarded=False``: the throughput guard is not asked (each sequence drafts as its SL says); ``room``: the
        tokens each row may still emit (its max_tokens or the context, None: no limit): a step emits at most its
        drafts and one token of the target's, so a row drafts at most room - 1 levels, and still 1 with one token
        left (a step planned to speculate stays one: the guard times the two modes' steps apart); ``model``: a draft
        model is attached (without one no row is in a lock-step draft loop: none counts towards SL_cap or is capped)."""
        uncapped = [r.sl_state.next_sl() if r.sl_state is not None else r.spec.static_depth for r in rows]
        own = [self._depth(r.spec, sl) for r, sl in zip(rows, uncapped, strict=True)]
        reach = own
        if room is not None:  # before the cap: a level past a row's room is never drafted, so nobody waits for it
            reach = [min(d, max(1, n - 1)) for d, n in zip(own, room, strict=True)]
        depths, cap = self._cap(rows, reach) if model else (reach, None)
        post = [r.sl_state is not None and not r.sl_state.in_warmup for r in rows]
        min_prob = self.floor.floor(len(rows)) if self.floor is not None and self.adaptive(rows) else None
        depths, speculate = self._guard(rows, depths, prefills, outlook, guarded)
        free = self._free_depths(rows, depths, room)
        alone = self._free_depths(rows, own, None) or own  # (what each drafter would draft with the batch away)
        cut = [0 < d < o for d, o in zip(free or depths, alone, strict=True)]
        model_cut = [
            0 < r.spec.model_depth(d) < r.spec.model_depth(o) for r, d, o in zip(rows, depths, own, strict=True)
        ]
        return StepPlan(depths, uncapped, cap, post, min_prob, speculate, free, cut, model_cut)

    @classmethod
    def _free_depths(cls, rows: Sequence[PlanRow], depths: list[int], room: Sequence[int] | None) -> list[int] | None:
        """A priced count tree's levels (None: no row has one): its static depth, max_sl and the room, wherever the
        plan lets it draft; each node already pays for its row, and it runs no draft forward anyone waits for."""
        if not any(r.spec.free_tree_priced for r in rows):
            return None
        free = list(depths)
        for i, r in enumerate(rows):
            if free[i] and r.spec.free_tree_priced:
                own = cls._depth(r.spec, r.spec.static_depth)
                free[i] = own if room is None else min(own, max(1, room[i] - 1))
        return free

    @staticmethod
    def adaptive(rows: Sequence[PlanRow]) -> bool:
        """Whether some sequence takes the measured tree floor (and so the loop measures it)."""
        return any(r.spec.adaptive_floor and r.spec.is_tree for r in rows)

    @staticmethod
    def _cap(rows: Sequence[PlanRow], reach: list[int]) -> tuple[list[int], int | None]:
        """SL_cap (docs/algorithms.md §5) over the depths the sequences would draft (``reach``: their SLs after a
        tree's depth limit, the request's max_sl and the room, then the draft model's own limits; a level no
        sequence drafts keeps nobody waiting), one per lock-step loop of the draft model: its chains and its trees
        draft in separate loops, so each kind gets the cap of its own DSDE sequences. Rows only a model-free
        drafter serves run no draft forward: they neither count nor are capped. Each sequence's own
        ``cap_enabled`` / ``cap_warmup`` decide whether it counts and is capped. Returns the depths and the larger
        cap (reported)."""
        depths = list(reach)
        caps: list[int] = []
        for tree in (False, True):
            group = [
                i
                for i, r in enumerate(rows)
                if r.sl_state is not None and r.spec.uses_model and r.spec.is_tree == tree and r.spec.dsde.cap_enabled
            ]
            if not group:
                continue
            warm = [rows[i].sl_state.in_warmup for i in group]  # type: ignore[union-attr]
            # over the levels the draft model runs for each: its own depth limits (model_max_sl, model_budget)
            cap = sl_cap([rows[i].spec.model_depth(reach[i]) for i in group], [not w for w in warm])
            if cap is None:
                continue
            caps.append(cap)
            for i, w in zip(group, warm, strict=True):
                capped = apply_cap([reach[i]], cap, [w], rows[i].spec.dsde.cap_warmup)[0]
                # a cap the model's share already stays within leaves the row alone (its model-free drafts too)
                depths[i] = reach[i] if capped >= rows[i].spec.model_depth(reach[i]) else capped
        return depths, max(caps, default=None)

    @staticmethod
    def _depth(spec: SpecConfig, sl: int) -> int:
        """Draft levels for an SL: the chain length, or min(tree depth / DDD n, SL); then the request's max_sl."""
        if spec.method == SpecMethod.none:
            return 0
        depth = sl if spec.method == SpecMethod.chain else min(spec.static_depth, sl)
        return max(1, depth if spec.max_sl is None else min(depth, spec.max_sl))

    def _guard(
        self, rows: Sequence[PlanRow], depths: list[int], prefills: bool, outlook: Outlook | None, guarded: bool
    ) -> tuple[list[int], bool]:
        """The throughput guard first: plain decoding where it measured faster at this batch size (no try of
        the other mode in a step that prefills). Then shrink speculation until drafted tokens + one per sequence
        fit ``max_step_tokens``: at large batch a CPU forward is compute-bound, and verifying tokens that are
        likely rejected slows everyone. Returns the depths and the mode the step is planned in."""
        guard = self.guard if guarded else None
        if guard is not None and any(depths) and not guard.speculate(len(rows), measured=not prefills, outlook=outlook):
            return [0] * len(depths), False
        speculate = any(depths)
        if self.max_step_tokens is None:
            return depths, speculate
        depths = list(depths)

        def cost(i: int) -> int:
            spec = rows[i].spec
            return 0 if depths[i] == 0 else (spec.max_tree_nodes if spec.is_tree else depths[i])

        allowance, n, turn = max(0, self.max_step_tokens - len(rows)), len(rows), self._shrunk
        total = sum(cost(i) for i in range(n))
        if total <= allowance:
            return depths, speculate
        self._shrunk = turn + 1
        if allowance == 0:  # (large batches: every draft gives way)
            return [0] * n, speculate
        # the costliest gives way, a token (a chain) or a tree at a time; among equals, the first from a row that
        # moves on by one each shrunk step, so one sequence (the oldest) does not lose its drafts on every step.
        # A heap: O(tokens removed x log B) per step, where a scan per token took seconds at batch 512
        heap = [(-cost(i), (i - turn) % n, i) for i in range(n) if cost(i) > 0]
        heapq.heapify(heap)
        while total > allowance:
            _, _, i = heapq.heappop(heap)
            before = cost(i)
            depths[i] = depths[i] - 1 if not rows[i].spec.is_tree else 0
            total -= before - cost(i)
            if cost(i) > 0:
                heapq.heappush(heap, (-cost(i), (i - turn) % n, i))
        return depths, speculate
