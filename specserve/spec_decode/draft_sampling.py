"""Draft-side sampling: the top-K truncated distribution a sampled chain draws from and ships for verification
(docs/algorithms.md §1.1)."""

from __future__ import annotations

import torch


def sparse_topk(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [N, V] -> (idx [N, K], prob [N, K]): the top-K truncated, renormalised distribution q_K (K = min(k, V)),
    which is what the draft samples from and ships to the verifier."""
    values, idx = probs.topk(min(k, probs.shape[-1]), dim=-1)  # [N, K], [N, K]
    return idx, values / values.sum(-1, keepdim=True)


def draft_sample_sparse(idx: torch.Tensor, prob: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(idx [N, K], prob [N, K]) -> token ids [N] drawn from the sparse distribution."""
    pos = torch.multinomial(prob, 1, generator=generator)  # [N, 1]
    return idx.gather(-1, pos).squeeze(-1)
