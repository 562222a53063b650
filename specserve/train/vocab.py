"""The reduced draft vocabulary (FR-Spec / EAGLE-3 style): the most frequent target ids of the training data."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def token_counts(sequences: Iterable[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """[V] long: how often each id occurs over the sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(seq.long(), minlength=vocab_size)[:vocab_size]
    return counts


def top_vocab(counts: torch.Tensor, size: int, forced: Iterable[int] = ()) -> torch.Tensor:
    """[size] ascending target ids: every forced id, then the most frequent others (ties: lower id first)."""
    vocab_size = counts.numel()
    forced_ids = sorted({int(i) for i in forced})
    if not 0 < size <= vocab_size or len(forced_ids) > size:
        raise ValueError(f"draft vocabulary of {size} with {len(forced_ids)} forced ids over {vocab_size} tokens")
    return frequency_order(counts, forced_ids)[:size].sort().values


def frequency_order(counts: torch.Tensor, forced: Iterable[int] = ()) -> torch.Tensor:
    """[V] every target id: the forced ones first, then by falling count (ties: lower id first). Its first V_d
    entries are the draft vocabulary of size V_d (shipped as the head's vocabulary map)."""
    vocab_size = counts.numel()
    forced_ids = sorted({int(i) for i in forced})
    if any(not 0 <= i < vocab_size for i in forced_ids):
        raise ValueError(f"forced ids outside the {vocab_size}-token vocabulary")
    score = counts.double().clone()
    score[forced_ids] = float("inf")
    order = torch.sort(torch.arange(vocab_size), stable=True).indices  # lower id first among ties
    return order[torch.sort(-score[order], stable=True).indices]


def column_of(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] long: the draft column of each target id, -1 where it is outside the draft vocabulary."""
    col = torch.full((vocab_size,), -1, dtype=torch.long)
    col[draft_ids] = torch.arange(draft_ids.numel())
    return col


def coverage(counts: torch.Tensor, draft_ids: torch.Tensor) -> float:
    """Share of the counted tokens inside the draft vocabulary."""
    total = int(counts.sum())
    return 0.0 if total == 0 else int(counts[draft_ids].sum()) / total
