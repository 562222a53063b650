"""What every drafter shares: one sequence's drafting state for one propose call, the forward a worker lends
the drafter, and the draft distributions shipped for the KLD signal.

A drafter (``chain.py``, ``eagle2.py``) runs its level loop over ``DraftForward`` and never sees a KV cache or a
slot: the worker that owns the model and its cache implements the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.config import KLDMode
from specserve.messages import DraftQ, Proposal, ProposeItem
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
    root_idx: int  # a draft model's: cache index (= position) of the root; a head's: position of the root's pair
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


Fed = list[tuple[int, int]]  # (tree node, its row of the state's draft logits) for every fed node


def draft_q(s: DraftState, fed: Fed) -> DraftQ | None:
    """The draft's distribution at each fed node (node, logits row), for the target's KLD signal."""
    return draft_qs([(s, fed)])[0]


def draft_qs(pending: list[tuple[DraftState, Fed]]) -> list[DraftQ | None]:
    """``draft_q`` of every state of a propose call: the sparse top-Ks come to the host together (one copy of the
    ids and one of the probabilities per distinct K, not two per sequence: each is a device wait on a GPU)."""
    out: list[DraftQ | None] = [None] * len(pending)
    sparse: dict[int, list[tuple[int, list[int], torch.Tensor, torch.Tensor]]] = {}  # by K: (i, nodes, ids, prob)
    for i, (s, fed) in enumerate(pending):
        mode = s.item.kld_mode
        if mode is None or not fed or not s.q_logits:
            continue
        logits = torch.cat(s.q_logits)[: max(r for _, r in fed) + 1]  # [rows, V_d]
        if [r for _, r in fed] != list(range(len(fed))):  # (a chain's rows are its nodes, in order)
            # non_blocking: a blocking upload would wait for the device's queue once per sequence
            rows = torch.tensor([r for _, r in fed]).to(logits.device, non_blocking=True)
            logits = logits.index_select(0, rows)  # [n, V_d] (a list or tensor index took 3x as long)
        nodes = [node for node, _ in fed]
        if mode == KLDMode.exact:
            if s.token_ids is not None:  # spread over the target's vocabulary: tokens outside V_d have q = 0
                full = logits.new_full((logits.shape[0], s.vocab_size), float("-inf"))  # [n, V]
                logits = full.index_copy_(1, s.token_ids, logits)
            out[i] = DraftQ(nodes, dense_logits=logits)
            continue
        idx, prob = sparse_topk_q(logits, s.item.spec.kld_top_k)  # [n, K], [n, K]
        sparse.setdefault(idx.shape[1], []).append((i, nodes, target_ids(s, idx).to(torch.int32), prob.float()))
    for group in sparse.values():
        ids = torch.cat([g[2] for g in group]).cpu().numpy()  # host sync: the step's draft q ids ...
        probs = torch.cat([g[3] for g in group]).cpu().numpy()  # ... and probabilities
        start = 0
        for i, nodes, _, _ in group:
            out[i] = DraftQ(nodes, idx=ids[start : start + len(nodes)], prob=probs[start : start + len(nodes)])
            start += len(nodes)
    return out


def sampled_chain_qs(states: list[DraftState]) -> list[tuple[list[list[int]], list[list[float]]] | None]:
    """Per state, a sampled chain's (ids, probabilities) [SL][K] of the sparse q each draft was drawn from (None:
    not a sampled chain), read to the host in one copy per support size K for the whole step."""
    out: list[tuple[list[list[int]], list[list[float]]] | None] = [None] * len(states)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(states):
        if s.q_idx:
            groups.setdefault(s.q_idx[0].shape[-1], []).append(i)
    for members in groups.values():
        ids = torch.cat([torch.stack(states[i].q_idx) for i in members]).cpu().tolist()  # host sync: sampled
        probs = torch.cat([torch.stack(states[i].q_prob) for i in members]).cpu().tolist()  # chains' q
        start = 0
        for i in members:
            n = len(states[i].q_idx)
            out[i] = (ids[start : start + n], probs[start : start + n])
            start += n
    return out


def with_draft_qs(built: list[tuple[DraftState, Proposal, Fed]]) -> list[Proposal]:
    """The proposals, each with its draft q when its item asked for one (``draft_qs``), and a sampled chain's with
    the sparse q its drafts were drawn from (``sampled_chain_qs``)."""
    qs = draft_qs([(s, fed) for s, _, fed in built])
    chains = sampled_chain_qs([s for s, _, _ in built])
    out = []
    for (_, p, _), q, chain in zip(built, qs, chains, strict=True):
        if chain is not None:
            p = replace(p, q_idx=chain[0], q_prob=chain[1])
        out.append(p if q is None else replace(p, draft_q=q))
    return out
