"""Chain drafting: SL tokens one after another, greedy or sampled from the draft's top-K (docs/algorithms.md §1.1)."""

from __future__ import annotations

import torch

from specserve.config import ChainDraft
from specserve.messages import Proposal
from specserve.sampling import keyed_sample, process_logits
from specserve.spec_decode.draft_sampling import draft_sample_sparse, sparse_topk
from specserve.spec_decode.draft_state import DraftForward, DraftState, Fed, target_ids


def draft_chains(chains: list[tuple[DraftState, torch.Tensor]], forward: DraftForward) -> None:
    """Grow every chain to its SL (``item.depth``) in lock-step; ``chains`` pairs each state with its level-0 logits."""
    active = [(s, lg) for s, lg in chains if s.item.depth > 0]
    while active:
        level = torch.cat([_next_token(s, lg).reshape(1).long() for s, lg in active])  # [B] on the device
        for (s, lg), token in zip(active, level.tolist(), strict=True):  # host sync: the level's tokens, once
            s.q_logits.append(lg[-1:])
            s.tokens.append(token)
            s.depth += 1
        active = [(s, lg) for s, lg in active if s.depth < s.item.depth]
        if active:
            out = forward([s for s, _ in active], [[s.tokens[-1]] for s, _ in active])
            active = [(s, lg) for (s, _), lg in zip(active, out, strict=True)]


def _next_token(s: DraftState, logits: torch.Tensor) -> torch.Tensor:
    """The chain's next token id (a target id), left on the device."""
    mode = s.item.spec.chain_draft
    if s.params.greedy or mode == ChainDraft.greedy:
        return target_ids(s, logits[-1].argmax())
    root = s.item.root_position
    if mode == ChainDraft.keyed and s.params.seed is not None and root is not None:
        # the draft's own race with the target's noise for this position: it proposes the target's draw whenever
        # its distribution ranks that token first under the same noise (docs/algorithms.md §1.4)
        vocab = s.vocab_size or logits.shape[-1]
        position = root + s.depth + 1
        probs = process_logits(logits[-1:], s.params)  # [1, V']
        column = keyed_sample(probs, s.params.seed, [position], vocab, s.token_ids)  # [1]
        # a draft row without mass (non-finite logits) proposes its argmax: any proposal is lossless
        column = torch.where(column < probs.shape[-1], column, logits[-1:].argmax(-1))
        return target_ids(s, column)[0]
    probs = process_logits(logits[-1:], s.params)  # [1, V']
    # a draft row without mass (non-finite logits) proposes its argmax with q a point mass there (lossless, §1.1)
    point = torch.zeros_like(probs).scatter_(-1, logits[-1:].argmax(-1, keepdim=True), 1.0)  # [1, V']
    probs = torch.where(probs.sum(-1, keepdim=True) > 0, probs, point)
    idx, prob = sparse_topk(probs, s.item.spec.q_top_k)
    idx = target_ids(s, idx)
    s.q_idx.append(idx[0])
    s.q_prob.append(prob[0])
    return draft_sample_sparse(idx, prob, s.generator)[0]


def chain_proposal(s: DraftState) -> tuple[Proposal, list[int | None], Fed]:
    """The proposal (its draft q, and a sampled chain's q support, are ``with_draft_qs``'s to add: read to the host
    with the step's others), the cache index of each node (root first; the last draft was never fed: None) and its
    fed nodes."""
    n = len(s.tokens)
    proposal = Proposal(s.item.seq_id, s.tokens, list(range(n)), depth=s.depth)
    return proposal, [s.root_idx + i for i in range(n)] + [None], [(i, i) for i in range(n)]
