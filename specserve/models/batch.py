"""The one data object a model forward takes: a ragged batch of new tokens, built on the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.models.kv_cache import KVCache


@dataclass(frozen=True)
class ForwardBatch:
    """B sequences; sequence b appends n_b new tokens to its KV slot (Q = max n_b, K = max total length)."""

    slots: torch.Tensor  # [B] long
    tokens: torch.Tensor  # [N] long new tokens, packed (N = Σ n_b)
    positions: torch.Tensor  # [N] long RoPE positions of the new tokens, packed
    write_slot: torch.Tensor  # [N] long slot of every real new token (N = Σ n_b)
    write_pos: torch.Tensor  # [N] long cache index of every real new token
    write_from: torch.Tensor  # [N] long flat index b*Q+q of every real new token
    attn_mask: torch.Tensor | None  # [B, 1, Q, K] bool, True = may attend; None: B == 1, causal, no cache or Q == 1
    logit_rows: torch.Tensor  # [R] long packed index of the tokens whose logits are returned, in order
    num_new: tuple[int, ...]
    num_logits: tuple[int, ...]
    cache_start: tuple[int, ...]
    slot_range: tuple[int, int] | None  # (first, end) when slots are consecutive: K/V are read as a view
    causal: bool  # every sequence uses a plain causal mask (the flash-attn path takes it)
    # flash-attn inputs, made once per batch so that no layer reads the device: queries padded to [B, Q] with
    # each sequence's n_b tokens at the END of its row (bottom-right causal alignment), and each slot's length
    flash_rows: torch.Tensor  # [N] long index into [B * Q] of every real new token, right-aligned
    kv_lens: torch.Tensor  # [B] int32 cache length of each sequence after this step (start + n_b)
    slots_i32: torch.Tensor  # [B] int32 the slots again, as flash-attn's cache_batch_idx

    @property
    def kv_len(self) -> int:
        return max(s + n for s, n in zip(self.cache_start, self.num_new, strict=True))

    @staticmethod
    def build(
        cache: KVCache,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int] | torch.Tensor],
        *,
        positions: Sequence[Sequence[int] | None] | None = None,
        tree_masks: Sequence[torch.Tensor | None] | None = None,
        num_logits: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> ForwardBatch:
        """Reserve KV room for every sequence's new tokens and lay out the padded step.

        positions[b]: RoPE positions of the new tokens (default: cache length + 0..n_b-1).
        tree_masks[b]: [n_b, w_b] bool with w_b >= n_b over the last w_b keys (the newest w_b - n_b cached
        entries, then the new tokens): row j sees those it may attend to (itself and its ancestors); every key
        before that window is visible. None = causal. num_logits[b]: logits for the last m_b new tokens
        (default all). ``device``: where the forward runs (default: the cache's device).
        """
        device = cache.device if device is None else device
        b_size = len(slots)
        num_new = [len(t) for t in tokens]
        if b_size == 0 or min(num_new) < 1:
            raise ValueError("a forward batch needs at least one sequence and one new token per sequence")
        _check_layout(cache, slots, num_new, positions, tree_masks, num_logits)  # before anything is reserved
        starts = cache.begin_append(list(slots), num_new)
        q_len = max(num_new)
        k_len = max(s + n for s, n in zip(starts, num_new, strict=True))
        masks = tree_masks or [None] * b_size
        causal = all(m is None for m in masks)
        need_mask = b_size > 1 or not causal or (q_len > 1 and starts[0] > 0)
        mask = _step_mask(starts, num_new, masks, q_len, k_len, device) if need_mask else None
        w_slot: list[int] = []
        w_pos: list[int] = []
        w_from: list[int] = []
        f_rows: list[int] = []
        rows: list[int] = []
        pos: list[int] = []
        m_list = list(num_logits) if num_logits is not None else num_new
        offset = 0
        for b, (slot, start, n) in enumerate(zip(slots, starts, num_new, strict=True)):
            p = positions[b] if positions is not None else None
            pos += range(start, start + n) if p is None else list(p)
            w_slot += [slot] * n
            w_pos += range(start, start + n)
            w_from += range(b * q_len, b * q_len + n)
            f_rows += range((b + 1) * q_len - n, (b + 1) * q_len)
            m = m_list[b]
            rows += range(offset + n - m, offset + n)
            offset += n
        first = slots[0]
        consecutive = list(slots) == list(range(first, first + b_size))
        return ForwardBatch(
            slots=torch.as_tensor(list(slots), dtype=torch.long, device=device),
            tokens=_tokens(tokens, device),
            positions=torch.tensor(pos, dtype=torch.long, device=device),
            write_slot=torch.tensor(w_slot, dtype=torch.long, device=device),
            write_pos=torch.tensor(w_pos, dtype=torch.long, device=device),
            write_from=torch.tensor(w_from, dtype=torch.long, device=device),
            attn_mask=None if mask is None else mask[:, None],
            logit_rows=torch.tensor(rows, dtype=torch.long, device=device),
            num_new=tuple(num_new),
            num_logits=tuple(m_list),
            cache_start=tuple(starts),
            slot_range=(first, first + b_size) if consecutive else None,
            causal=causal,
            flash_rows=torch.tensor(f_rows, dtype=torch.long, device=device),
            kv_lens=torch.tensor(
                [s + n for s, n in zip(starts, num_new, strict=True)], dtype=torch.int32, device=device
            ),
            slots_i32=torch.as_tensor(list(slots), dtype=torch.int32, device=device),
        )


def _tokens(tokens: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The step's new tokens [N] on ``device``: one copy where they all come from the host (the target's lists), the
    parts moved one by one only where some already live on a device (a draft level's sampled tokens)."""
    parts = [torch.as_tensor(t, dtype=torch.long) for t in tokens]
    if all(p.device.type == "cpu" for p in parts):
        return torch.cat(parts).to(device)
    return torch.cat([p.to(device) for p in parts])


def _step_mask(
    starts: list[int],
    num_new: list[int],
    tree_masks: Sequence[torch.Tensor | None],
    q_len: int,
    k_len: int,
    device: torch.device | str,
) -> torch.Tensor:
    """The padded step's attention mask [B, q_len, k_len] bool, built where the forward runs in a number of
    operations that does not grow with B (GPU steps are launch-bound): row j of sequence b sees every key below a
    per-row limit, and a tree's rows then get their window over the last w keys from its mask (the one
    per-sequence copy, trees only; a mask made on the device is copied without a host round trip).

    Limits: a causal row j < n sees keys < start + j + 1; a tree's rows see the keys before its window, start + n - w;
    a padded row j >= n sees the keys before the window too, and key 0 at least (its softmax stays finite)."""
    limit: list[int] = []  # [B * q_len], row by row
    for start, n, tree in zip(starts, num_new, tree_masks, strict=True):
        before = start if tree is None else start + n - tree.shape[1]  # keys visible to every row
        limit += range(start + 1, start + n + 1) if tree is None else [before] * n
        limit += [max(before, 1)] * (q_len - n)
    rows = torch.tensor(limit, device=device).view(len(starts), q_len, 1)
    mask = torch.arange(k_len, device=device) < rows  # [B, q_len, k_len]
    for b, tree in enumerate(tree_masks):
        if tree is not None:
            lo = starts[b] + num_new[b] - tree.shape[1]
            mask[b, : num_new[b], lo : lo + tree.shape[1]] = tree
    return mask


def _check_layout(
    cache: KVCache,
    slots: Sequence[int],
    num_new: list[int],
    positions: Sequence[Sequence[int] | None] | None,
    tree_masks: Sequence[torch.Tensor | None] | None,
    num_logits: Sequence[int] | None,
) -> None:
    """A clear error for a step laid out inconsistently (one position per new token, tree masks of (n, w) with
    n <= w <= the sequence's keys, 1..n logits)."""
    for b, (slot, n) in enumerate(zip(slots, num_new, strict=True)):
        pos = None if positions is None else positions[b]
        if pos is not None and len(pos) != n:
            raise ValueError(f"sequence {b}: {len(pos)} positions for {n} new tokens")
        tree = None if tree_masks is None else tree_masks[b]
        keys = cache.length(slot) + n
        if tree is not None and (tree.ndim != 2 or tree.shape[0] != n or not n <= tree.shape[1] <= keys):
            raise ValueError(f"tree mask {b} has shape {tuple(tree.shape)}; want ({n}, w), {n} <= w <= {keys}")
        m = n if num_logits is None else num_logits[b]
        if not 1 <= m <= n:
            raise ValueError(f"sequence {b}: num_logits {m} must be in [1, {n}]")
