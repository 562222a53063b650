"""Greedy tokens from the LM head without reading all of it in float32 (``ModelSpec.bounded_argmax``).

A greedy step needs only the argmax of each row's logits, not the logits. The LM head of a small model is a large
share of its weights (SmolLM2-135M: 49152 x 576 float32, 113 MB of the 538 MB a decode step reads), so the step
first reads a bfloat16 copy (half the bytes, in the small-product kernel's packed layout) and bounds how far each
approximate logit can lie from the float32 one:

    |approx_v - exact_v| <= (2^-8 + 2 gamma_K) * sum_k |w_vk| |h_k| <= c_K * ||w_v||_2 * ||h||_2

(2^-8: bfloat16's rounding of each weight; gamma_K = K u / (1 - K u), u = 2^-24: the float32 rounding of either
K-term sum, whatever its order; Cauchy-Schwarz for the last step; c_K has a 1% margin for the rounding of the bound
itself). Only the tokens whose upper bound reaches the best lower bound can be the argmax; their exact float32
logits are computed by the same kernel as the full product (each output the same instruction sequence whichever
rows are computed), and the first of their maxima is taken, as ``argmax`` over the full row would. So the tokens are
exactly the full logits' argmax: lossless, not an approximation (docs/algorithms.md §11). On SmolLM2 over MT-bench
prompts one candidate is the median, 9 the most seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specserve.models.llama import LlamaModel, reads_copy, small_gemm_fits
from specserve.models.native_stack import extension

BF16_ROUNDING = 2.0**-8  # bfloat16 keeps 8 significant bits: round-to-nearest moves a value by at most 2^-8 of it
FP32_UNIT = 2.0**-24
ARGMAX_ROWS = 8  # bounded rows at most: from ~10 rows the products are compute-bound and the copy saves nothing


def rounding_bound(k: int) -> float:
    """c_K: |approx - exact| <= c_K ||w|| ||h|| for a K-term product read from bfloat16 weights against float32."""
    gamma = k * FP32_UNIT / (1 - k * FP32_UNIT)
    return (BF16_ROUNDING + 2 * gamma) * 1.01


@dataclass(frozen=True)
class BoundedArgmax:
    """The LM head's bfloat16 copy (packed) and each vocabulary row's norm, rounded up: [V]."""

    packed: Any  # ext.SmallPacked of bfloat16 [V, K]
    row_norms: torch.Tensor  # [V] float32, ||w_v||_2 * (1 + 2^-20)
    bound: float  # c_K


def attach_bounded_argmax(model: LlamaModel) -> bool:
    """Switch on (``ModelSpec.bounded_argmax``): where the small-product kernel computes the float32 LM head (no
    bias, as Llama's)."""
    head = model.lm_head
    if getattr(head, "small_gemm", None) is None or head.weight.dtype != torch.float32 or head.bias is not None:
        return False
    w = head.weight.detach()
    model.bounded_argmax = BoundedArgmax(
        packed=extension().small_pack(w.to(torch.bfloat16)),
        row_norms=(w.double().norm(dim=1) * (1 + 2.0**-20)).float(),
        bound=rounding_bound(w.shape[1]),
    )
    return True


def greedy_ids(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """argmax of ``model.logits(hidden)`` per row: [R, hidden] -> [R] int64: over the full logits where the kernel
    reads the LM head's Q8_0 records for these rows (``native_stack.attach_q8_head``: 0.57x the bfloat16 copy's
    bytes), else through the bounded copy where attached and the kernel computes these rows, else over the full
    logits."""
    bounded: BoundedArgmax | None = getattr(model, "bounded_argmax", None)
    head = model.lm_head
    rows = hidden.shape[0]
    if getattr(head, "small_records", None) is not None and reads_copy(getattr(head, "small_record_rows", 0), rows):
        return model.logits(hidden).argmax(dim=-1)  # the exact logits from the head's Q8_0 records: fewer bytes still
    if (
        bounded is None
        or rows > ARGMAX_ROWS
        or not small_gemm_fits(hidden, head.weight, getattr(head, "small_rows", 0))
    ):
        return model.logits(hidden).argmax(dim=-1)
    ids, ok = extension().small_bounded_argmax(
        hidden, bounded.packed, head.weight.detach(), bounded.row_norms, bounded.bound
    )
    return ids if ok else model.logits(hidden).argmax(dim=-1)  # not ok: a NaN / infinite state, or an overflow
