"""Attention over a ragged batch against the KV cache: SDPA everywhere; flash-attn on CUDA for causal batches
(prefill, plain decoding, chain verification), reading the KV slots in place (trees keep SDPA with their mask); on
the CPU a model's attention kernel where attached (``native_stack.attach_native_attention``: csrc/attention.cpp)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specserve.models.batch import ForwardBatch

# csrc/attention.cpp's attend(q, k_cache, v_cache, write_slot, write_pos, write_from, mask, q_len) -> [N, H_q, D]
AttendKernel = Callable[..., torch.Tensor]

try:  # optional GPU extra
    from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_with_kvcache = None


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn's kernels take nothing else (fp32 raises)


def flash_attn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return flash_attn_with_kvcache is not None and device.type == "cuda" and dtype in FLASH_DTYPES


def expand_grouped_heads(device: torch.device, dtype: torch.dtype, *, masked: bool) -> bool:
    """Whether grouped K/V heads go to SDPA expanded to every query head. CUDA's SDPA runs grouped heads only in
    flash attention (no mask, fp16 / bf16) or the math kernel, which holds fp32 scores [B, H_q, Q, K] (17 GiB for
    an 8k-token prefill of a 32-head model): expanded K/V [B, H_q, K, D] let the memory-efficient kernel run a
    masked step, or any step in float32 (memory.activation_bytes counts them)."""
    return device.type == "cuda" and (masked or dtype not in FLASH_DTYPES)


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
    kernel: AttendKernel | None = None,
) -> torch.Tensor:  # [N, H_q, D]
    if use_flash and batch.causal:
        return _flash_kvcache(q, k_cache, v_cache, batch)
    mask = batch.attn_mask
    if kernel is not None and q.dtype == torch.float32 and (mask is None or mask.dtype == torch.bool):  # as in C++
        rows = (batch.write_slot, batch.write_pos, batch.write_from)
        return kernel(q, k_cache, v_cache, *rows, mask, max(batch.num_new))
    n_tok, h_q, d = q.shape
    b_size, q_len = len(batch.num_new), max(batch.num_new)
    if b_size * q_len == n_tok:  # no padding (one sequence, or equal lengths): a view
        q_pad = q.view(b_size, q_len, h_q, d)
    else:
        q_pad = q.new_zeros(b_size * q_len, h_q, d)
        q_pad[batch.write_from] = q
        q_pad = q_pad.view(b_size, q_len, h_q, d)
    k = read_kv(k_cache, batch)  # [B, H_kv, K, D]
    v = read_kv(v_cache, batch)
    is_causal = batch.attn_mask is None and q_len > 1
    gqa = k.shape[1] != h_q
    if gqa and expand_grouped_heads(q.device, q.dtype, masked=batch.attn_mask is not None):
        k, v = (t.repeat_interleave(h_q // t.shape[1], dim=1) for t in (k, v))
        gqa = False
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k, v, attn_mask=batch.attn_mask, is_causal=is_causal, enable_gqa=gqa
    )  # [B, H_q, Q, D]
    out = out.transpose(1, 2).reshape(b_size * q_len, h_q, d)
    return out if b_size * q_len == n_tok else out[batch.write_from]


def _flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Causal ragged attention read in place from the KV slots (no copy of the context, no host sync).

    flash-attn's causal mask is aligned bottom-right (query row r of Q sees keys up to r + len_k - Q), so each
    sequence's n_b queries sit at the end of its padded row: its query i then sees keys 0..start_b + i. The
    padding rows in front are computed and dropped.
    """
    assert flash_attn_with_kvcache is not None
    h_q, d = q.shape[1:]
    b_size, q_len = len(batch.num_new), max(batch.num_new)
    q_pad = q.new_zeros(b_size * q_len, h_q, d)
    q_pad[batch.flash_rows] = q
    out = flash_attn_with_kvcache(
        q_pad.view(b_size, q_len, h_q, d),
        k_cache.transpose(1, 2),  # [S, L, H_kv, D] view: the kernel takes any strides but the last
        v_cache.transpose(1, 2),
        cache_seqlens=batch.kv_lens,
        cache_batch_idx=batch.slots_i32,
        causal=True,
    )  # [B, Q, H_q, D]
    return out.reshape(b_size * q_len, h_q, d)[batch.flash_rows]
