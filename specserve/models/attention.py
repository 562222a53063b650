"""Attention over a ragged batch against the KV cache: SDPA everywhere, flash-attn varlen on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.models.batch import ForwardBatch

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn's kernels take nothing else (fp32 raises)


def flash_attn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return flash_attn_varlen_func is not None and device.type == "cuda" and dtype in FLASH_DTYPES


def write_kv(
    k_cache: torch.Tensor,  # [S, H_kv, L, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [N, H_kv, D] packed new tokens
    v: torch.Tensor,
    batch: ForwardBatch,
) -> None:
    k_cache[batch.write_slot, :, batch.write_pos] = k
    v_cache[batch.write_slot, :, batch.write_pos] = v


def read_kv(cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[B, H_kv, K, D]: a view when the batch's slots are consecutive, a gather otherwise."""
    k_len = batch.kv_len
    if batch.slot_range is not None:
        first, end = batch.slot_range
        return cache[first:end, :, :k_len]
    return cache[batch.slots, :, :k_len]


def attention(
    q: torch.Tensor,  # [N, H_q, D] packed new tokens
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    *,
    use_flash: bool,
) -> torch.Tensor:  # [N, H_q, D]
    if use_flash and batch.causal:
        return _flash_varlen(q, k_cache, v_cache, batch)
    n_tok, h_q, d = q.shape
    b_size, q_len = len(batch.num_new), max(batch.num_new)
    if b_size * q_len == n_tok:  # no padding (one sequence, or equal lengths): a view
        q_pad = q.view(b_size, q_len, h_q, d)
    else:
        q_pad = q.new_zeros(b_size * q_len, h_q, d)
        q_pad[batch.write_from] = q
        q_pad = q_pad.view(b_size, q_len, h_q, d)
    k = read_kv(k_cache, batch)
    v = read_kv(v_cache, batch)
    is_causal = batch.attn_mask is None and q_len > 1
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k, v, attn_mask=batch.attn_mask, is_causal=is_causal, enable_gqa=True
    )  # [B, H_q, Q, D]
    out = out.transpose(1, 2).reshape(b_size * q_len, h_q, d)
    return out if b_size * q_len == n_tok else out[batch.write_from]


def _flash_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Causal ragged attention with flash-attn over packed queries and each sequence's whole context."""
    assert flash_attn_varlen_func is not None
    ks, vs = [], []
    for b, slot in enumerate(batch.slots.tolist()):
        end = batch.cache_start[b] + batch.num_new[b]
        ks.append(k_cache[slot, :, :end].transpose(0, 1))
        vs.append(v_cache[slot, :, :end].transpose(0, 1))
    k = torch.cat(ks)  # [ΣK_b, H_kv, D]
    v = torch.cat(vs)
    dev = q.device
    cu_q = torch.tensor([0, *torch.tensor(batch.num_new).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    lens_k = [s + n for s, n in zip(batch.cache_start, batch.num_new, strict=True)]
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    # [N, H_q, D]; causal is aligned bottom-right, so each query sees its whole cache
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(batch.num_new), max(lens_k), causal=True)
