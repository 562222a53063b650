"""What every drafter shares: one sequence's drafting state for one propose call, the forward a worker lends
the drafter, and the draft distributions shipped for the KLD signal.

A drafter (``chain.py``, ``eagle2.py``) runs its level loop over ``DraftForward`` and never sees a KV cache or a
slot: the worker that owns the model and its cache implements the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.config import KLDMode
from specserve.messages import DraftQ, ProposeItem
from specserve.policy import sparse_topk_q
from specserve.sampling import SamplingParams

if TYPE_CHECKING:
    from specserve.spec_decode.eagle2 import TreeGrowth


@dataclass
class DraftState:
    """One sequence inside a propose call."""

    item: ProposeItem
    params: SamplingParams
    generator: torch.Generator | None
    feed: list[int]  # tokens fed at level 0: what the drafter has not cached yet, ending with the root
    root_idx: int  # cache index (= position) of the root
    tokens: list[int] = field(default_factory=list)  # chains: drafted tokens
    q_idx: list[torch.Tensor] = field(default_factory=list)  # sampled chains: [K] support of each draw
    q_prob: list[torch.Tensor] = field(default_factory=list)  # ... and its probabilities
    q_logits: list[torch.Tensor] = field(default_factory=list)  # draft logits per fed node row, in row order
    depth: int = 0  # draft levels run (SL for a chain, tree depth for a tree)
    token_ids: torch.Tensor | None = None  # [V_d] target id of each draft-vocabulary column (None: the same ids)
    vocab_size: int = 0  # the target's vocabulary (for a reduced draft vocabulary)
    tree: TreeGrowth | None = None  # trees: the candidates and ancestry grown so far


class DraftForward(Protocol):
    """One ragged forward of the draft over ``tokens`` (target ids) per state; per state the logits [m, V_d] of its
    last m rows (m = ``num_logits[i]``, or every new row when None). ``positions`` / ``masks`` place tree nodes;
    ``parent_rows`` name, per new row, the earlier row (0 = the root) it extends (a draft head reads its features
    there)."""

    def __call__(
        self,
        states: list[DraftState],
        tokens: list[list[int]] | list[torch.Tensor],
        *,
        num_logits: list[int] | None = None,
        positions: list[list[int]] | None = None,
        masks: list[torch.Tensor] | None = None,
        parent_rows: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]: ...


def target_ids(s: DraftState, columns: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary columns -> target token ids (a reduced draft vocabulary maps; a full one is the identity)."""
    return columns if s.token_ids is None else torch.take(s.token_ids, columns)


def draft_q(s: DraftState, fed: list[tuple[int, int]]) -> DraftQ | None:
    """The draft's distribution at each fed node (node, logits row), for the target's KLD signal."""
    mode = s.item.kld_mode
    if mode is None or not fed or not s.q_logits:
        return None
    rows = torch.tensor([r for _, r in fed], device=s.q_logits[0].device)
    logits = torch.cat(s.q_logits).index_select(0, rows)  # [n, V_d] (a list or tensor index took 3x as long)
    nodes = [node for node, _ in fed]
    if mode == KLDMode.exact:
        if s.token_ids is not None:  # spread over the target's vocabulary: tokens outside V_d have q = 0
            full = logits.new_full((logits.shape[0], s.vocab_size), float("-inf"))  # [n, V]
            logits = full.index_copy_(1, s.token_ids, logits)
        return DraftQ(nodes, dense_logits=logits)
    idx, prob = sparse_topk_q(logits, s.item.spec.kld_top_k)  # [n, K], [n, K]
    ids = target_ids(s, idx).to(torch.int32).cpu().numpy()  # host sync
    return DraftQ(nodes, idx=ids, prob=prob.float().cpu().numpy())
