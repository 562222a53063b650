"""Native 4-bit weights: a GGUF's Q4_1 blocks kept packed and multiplied by torch's int4 weight-only CPU kernel
(``torch._weight_int4pack_mm_for_cpu``, bf16 activations, groups of 32) instead of dequantised to float32.

Q4_1 stores each run of 32 weights as w = d * q + m with q in 0..15 (d, m float16). The kernel computes with
w = (q - 8) * scale + zero per group, so scale = d and zero = m + 8 d map onto it exactly up to the bf16 rounding
of scale and zero. Norms, attention and the LM head stay in the model's own dtype; only the decoder layers'
matmuls read 4-bit weights (4.5 bits each with the group scales: 0.14x the float32 bytes).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import UnsupportedModelError

if TYPE_CHECKING:
    from gguf import ReaderTensor

Q4_GROUP = 32  # weights per Q4_1 block (and per scale/zero group of the kernel)
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of nibbles
Q8_0_BLOCK_BYTES = 34  # float16 d, 32 int8 values
INNER_K_TILES = 2  # the packing layout the CPU kernel reads
Q4_ROWS_MULTIPLE = 16  # the CPU kernel packs output rows in sixteens


@dataclass(frozen=True)
class Q4Blocks:
    """A [N, K] weight as Q4_1 blocks along K."""

    q: torch.Tensor  # [N, K] uint8, 0..15
    d: torch.Tensor  # [N, K / 32] float32 (exact float16 values)
    m: torch.Tensor  # [N, K / 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, exactly as llama.cpp (and this project's GGUF converter) dequantises Q4_1."""
        n, k = self.shape
        groups = self.q.view(n, k // Q4_GROUP, Q4_GROUP).float()
        return (groups * self.d[..., None] + self.m[..., None]).view(n, k)

    def rows(self, order: torch.Tensor) -> Q4Blocks:
        return Q4Blocks(self.q[order], self.d[order], self.m[order])

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Stacked along N (output rows): fused QKV and gate/up, as the runner holds them."""
        return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))


def q4_1_blocks(raw: np.ndarray, shape: tuple[int, int]) -> Q4Blocks:
    """GGUF Q4_1 tensor bytes ([N, K / 32 * 20] uint8, as gguf-py reads them) -> Q4Blocks of ``shape`` [N, K].

    Block layout (ggml): d float16, m float16, then 16 bytes whose low nibbles are weights 0..15 and high
    nibbles weights 16..31.
    """
    n, k = shape
    if k % Q4_GROUP:
        raise UnsupportedModelError(f"a Q4_1 row of {k} weights is not a whole number of {Q4_GROUP}-blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // Q4_GROUP, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]  # [N, K/32, 16]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, k)
    return Q4Blocks(torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(m))


class Q4Linear(nn.Module):
    """y = x W^T with W held as packed int4 (no bias: Llama's projections have none). With ``dense_from``, products
    of at least that many rows use a bf16 copy of the dequantised weights instead: the int4 kernel is the faster
    one for a few rows, but at 16+ rows (a draft's catch-up, a large batch) bf16 products on the CPU's matrix units
    win by far. That copy costs 4x the packed bytes and makes a row's result depend on how many rows came
    with it (no longer batch-invariant): for drafts, not targets."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    dense: torch.Tensor | None

    def __init__(self, blocks: Q4Blocks, dense_from: int | None = None) -> None:
        super().__init__()
        n, k = blocks.shape
        if n % Q4_ROWS_MULTIPLE:
            raise UnsupportedModelError(
                f"native_q4: a projection of {n} output rows; torch's int4 CPU kernel packs multiples of "
                f"{Q4_ROWS_MULTIPLE}"
            )
        self.in_features, self.out_features = k, n
        self.dense_from = dense_from
        self.register_buffer("dense", None if dense_from is None else blocks.dequantize().to(torch.bfloat16))
        packed = torch._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), INNER_K_TILES)
        scale = blocks.d.t()  # [K / 32, N]
        zero = (blocks.m + 8 * blocks.d).t()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [M, K] (the int4 kernel's need)
        if self.dense is not None and self.dense_from is not None and flat.shape[0] >= self.dense_from:
            y = F.linear(flat, self.dense)
        else:
            y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, Q4_GROUP, self.scales_and_zeros)  # [M, N]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def dense_rows_on_this_cpu(dense_from: int | None) -> int | None:
    """``dense_from`` where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), else None: without it a bf16
    copy would be slower than the int4 kernel at any row count. (oneDNN's own "bf16 supported" holds on any
    AVX-512 CPU, where it emulates bf16.)"""
    try:
        fast = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # a torch without these checks
        fast = False
    return dense_from if fast else None


@dataclass(frozen=True)
class Q8Blocks:
    """A [N, K] weight as Q8_0 blocks along K (the GGUF's token embedding, which SmolLM2's LM head shares)."""

    q: torch.Tensor  # [N, K] int8
    d: torch.Tensor  # [N, K / 32] float32 (exact float16 values)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, exactly as llama.cpp (and this project's GGUF converter) dequantises Q8_0: d * q."""
        n, k = self.q.shape
        return (self.q.view(n, k // Q4_GROUP, Q4_GROUP).float() * self.d[..., None]).view(n, k)


def quantize_q8_0(weight: torch.Tensor) -> Q8Blocks:
    """A float [N, K] weight as Q8_0 blocks, as llama.cpp quantises it (per 32: d = max |w| / 127 in float16,
    q = round(w / d)), except that q divides by the float16 d the blocks keep."""
    n, k = weight.shape
    if k % Q4_GROUP:
        raise ValueError(f"Q8_0 blocks want K a multiple of {Q4_GROUP}, got {k}")
    w = weight.detach().float().reshape(n, k // Q4_GROUP, Q4_GROUP)
    d = (w.abs().amax(-1) / 127).half().float()  # [N, K/32]
    q = torch.where(d[..., None] > 0, w / d[..., None].clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return Q8Blocks(q.round().clamp(-128, 127).to(torch.int8).reshape(n, k), d)


def quantize_q4_1(weight: torch.Tensor) -> Q4Blocks:
    """A float [N, K] weight as Q4_1 blocks, as llama.cpp quantises it (per 32: m = min w, d = (max - min) / 15,
    both float16, q = round((w - m) / d) in 0..15), dividing by the float16 d and m the blocks keep."""
    n, k = weight.shape
    if k % Q4_GROUP:
        raise ValueError(f"Q4_1 blocks want K a multiple of {Q4_GROUP}, got {k}")
    w = weight.detach().float().reshape(n, k // Q4_GROUP, Q4_GROUP)
    m = w.amin(-1).half().float()  # [N, K/32]
    d = ((w.amax(-1) - m) / 15).half().float()
    q = torch.where(d[..., None] > 0, (w - m[..., None]) / d[..., None].clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return Q4Blocks(q.round().clamp(0, 15).to(torch.uint8).reshape(n, k), d, m)


def q8_0_blocks(raw: np.ndarray, shape: tuple[int, int]) -> Q8Blocks:
    """GGUF Q8_0 tensor bytes ([N, K / 32 * 34] uint8) -> Q8Blocks of ``shape`` [N, K]. Block layout (ggml): d
    float16, then the 32 values as int8."""
    n, k = shape
    if k % Q4_GROUP:
        raise UnsupportedModelError(f"a Q8_0 row of {k} weights is not a whole number of {Q4_GROUP}-blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // Q4_GROUP, Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return Q8Blocks(torch.from_numpy(q), torch.from_numpy(d))


def gguf_q8_blocks(tensors: Iterable[ReaderTensor], names: Collection[str]) -> dict[str, Q8Blocks]:
    """Those of the HF tensor ``names`` the GGUF holds as Q8_0 -> their blocks, decoded (only these: a GGUF may hold
    every tensor as Q8_0), rows in the GGUF's order (the converter permutes only the q and k projections' rows, so
    ask for neither)."""
    from gguf import GGMLQuantizationType

    from specserve.models.sources import hf_tensor_name

    out = {}
    for tensor in tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q8_0:  # (first: a Llama 3 GGUF's rope_freqs has no HF name)
            continue
        name = hf_tensor_name(tensor.name)
        if name in names:
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml's order is reversed
            out[name] = q8_0_blocks(np.asarray(tensor.data), shape)
    return out


def native_q4_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def gguf_layer_blocks(tensors: Iterable[ReaderTensor], n_heads: int, n_kv_heads: int) -> dict[str, Q4Blocks]:
    """HF names of the GGUF's Q4_1 tensors -> their blocks, q/k rows in HF's order (the converter's unpermute)."""
    from gguf import GGMLQuantizationType

    from specserve.models.sources import hf_tensor_name, unpermute_rope_rows

    out = {}
    for tensor in tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or len(tensor.shape) != 2:  # (a norm stored as Q4_1)
            continue
        name = hf_tensor_name(tensor.name)
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml's order is reversed
        blocks = q4_1_blocks(np.asarray(tensor.data), shape)
        heads = n_heads if name.endswith("q_proj.weight") else n_kv_heads if name.endswith("k_proj.weight") else 0
        if heads:
            order = unpermute_rope_rows(np.arange(shape[0]), heads)
            blocks = blocks.rows(torch.from_numpy(np.ascontiguousarray(order)))
        out[name] = blocks
    return out
