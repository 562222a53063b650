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

import logging
from dataclasses import dataclass
from typing import Any

import torch

from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel, reads_copy, small_gemm_fits
from specserve.models.native_stack import PLAN_MARGIN, describe_rows, extension, probe_mask
from specserve.sampling import greedy_draw
from specserve.timing import interleaved_medians

log = logging.getLogger(__name__)

BF16_ROUNDING = 2.0**-8  # bfloat16 keeps 8 significant bits: round-to-nearest moves a value by at most 2^-8 of it
FP32_UNIT = 2.0**-24
ARGMAX_ROWS = 8  # bounded rows at most: from ~10 rows the products are compute-bound and the copy saves nothing
EVERY_BOUNDED = (1 << ARGMAX_ROWS) - 1  # a row mask (llama.reads_copy) of 1..ARGMAX_ROWS
ARGMAX_PROBES = (1, 2, 4, 6, 8)  # row counts timed at load; a count's choice holds up to the next probe


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
    rows: int = EVERY_BOUNDED  # the row counts that read the copy (the others compute the full logits)


def attach_bounded_argmax(model: LlamaModel, *, measure: bool = False) -> bool:
    """Switch on (``ModelSpec.bounded_argmax``): where the small-product kernel computes the float32 LM head (no
    bias, as Llama's). ``measure``: time the copy against the full logits at ``ARGMAX_PROBES`` rows on this machine
    and keep it only for the counts where it wins by the kernel plan's margin (``bounded_rows``; against the logits
    as the head computes them, from its Q8_0 records where the plan gave them the count), or not at all where it wins
    none (False); else every count up to ``ARGMAX_ROWS``. Never beside an int8 LM head (``ModelSpec.int8_reads``),
    whose own logits give every greedy token."""
    head = model.lm_head
    if getattr(head, "small_gemm", None) is None or head.weight.dtype != torch.float32 or head.bias is not None:
        return False
    if getattr(head, "int8_records", None) is not None:  # greedy tokens are the int8 logits' argmax (greedy_ids)
        return False
    w = head.weight.detach()
    # a subnormal weight: bf16 rounds it by more than c_K allows for
    if ((w != 0) & (w.abs() < torch.finfo(torch.float32).tiny)).any():
        log.info("the LM head holds subnormal weights: greedy tokens from its full logits")
        return False
    model.bounded_argmax = BoundedArgmax(
        packed=extension().small_pack(w.to(torch.bfloat16)),
        row_norms=(w.double().norm(dim=1) * (1 + 2.0**-20)).float(),
        bound=rounding_bound(w.shape[1]),
    )
    if measure:
        rows = bounded_rows(model)
        if getattr(head, "small_records", None) is not None:  # greedy reads the head's records first where it may
            rows &= ~getattr(head, "small_record_rows", 0)
        if not rows:  # the head's own logits (its Q8_0 records, or float32) won everywhere: the copy is not kept
            model.bounded_argmax = None
            log.info("greedy tokens from the bfloat16 LM head measured slower at every row count: copy dropped")
            return False
        model.bounded_argmax = BoundedArgmax(**{**model.bounded_argmax.__dict__, "rows": rows})
        log.info("greedy tokens from the bfloat16 LM head for %s (measured at load)", describe_rows(rows))
    return True


@torch.inference_mode()
def bounded_rows(model: LlamaModel, repeats: int = 5) -> int:
    """A row mask of the counts up to ``ARGMAX_ROWS`` where ``greedy_ids`` through the bounded copy beats the full
    logits' argmax on this machine (each probe serves up to the next), timed interleaved on the model's own
    final-norm states over fixed tokens, as a decode step's are (random states would leave the bound many
    candidates to recompute). On a 2-core Zen 4 EPYC the copy won at 1-3 rows and lost at 4-8, where the float32
    product streams the head once for all rows (docs/benchmarks.md, "Q8_0 records for the LM head")."""
    probes = [r for r in ARGMAX_PROBES if r <= min(ARGMAX_ROWS, model.max_positions - 1)]  # (a short context's)
    cache = model.new_cache(1, max(probes) + 1)
    slot = cache.allocate()
    tokens = torch.randint(0, model.cfg.vocab_size, (max(probes),), generator=torch.Generator().manual_seed(0))
    hidden = model.final_hidden(ForwardBatch.build(cache, [slot], [tokens], device=model.device), cache)
    wins = []
    for r in probes:
        states = hidden[:r].contiguous()
        fns = [lambda x=states: model.logits(x).argmax(-1), lambda x=states: bounded_ids(model, x)]
        logits_s, bounded_s = interleaved_medians(fns, repeats, model.device)
        wins.append(bounded_s < PLAN_MARGIN * logits_s)
    return probe_mask(tuple(probes), wins) & EVERY_BOUNDED


def greedy_ids(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """argmax of ``model.logits(hidden)`` per row (V where a row has no finite maximum, ``greedy_draw``): [R, hidden]
    -> [R] int64: over the full logits where the LM head's products are int8 (every row count), or where the kernel
    reads the LM head's Q8_0 records for these rows (``native_stack.attach_q8_head``: 0.57x the bfloat16 copy's
    bytes), else through the bounded copy where attached and the kernel computes these rows, else over the full
    logits."""
    bounded: BoundedArgmax | None = getattr(model, "bounded_argmax", None)
    head = model.lm_head
    rows = hidden.shape[0]
    if getattr(head, "int8_records", None) is not None:  # int8 products (native_stack.attach_int8_head): their logits
        return argmax_rows(model, model.logits(hidden))
    if getattr(head, "small_records", None) is not None and reads_copy(getattr(head, "small_record_rows", 0), rows):
        return argmax_rows(model, model.logits(hidden))  # exact logits from Q8_0 records: fewer bytes still
    if (
        bounded is None
        or rows > ARGMAX_ROWS
        or not reads_copy(bounded.rows, rows)
        or not small_gemm_fits(hidden, head.weight, getattr(head, "small_rows", 0))
    ):
        return argmax_rows(model, model.logits(hidden))
    return bounded_ids(model, hidden)


def argmax_rows(model: LlamaModel, logits: torch.Tensor) -> torch.Tensor:
    """``greedy_draw`` of logits [R, V] -> [R] int64, from the extension (``csrc/argmax.cpp``: ATen's max tracks an
    index per element in a scalar loop, ~40 us a row of 49,152 against ~5) where the model's layers run from C++ and
    the logits are float32 on the CPU; the same indices either way."""
    if model.native_stack is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
        return extension().first_max_ids(logits)
    return greedy_draw(logits)


def bounded_ids(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """The argmax per row through the bounded copy (attached), whatever the row count."""
    bounded: BoundedArgmax = model.bounded_argmax
    ids, ok = extension().small_bounded_argmax(
        hidden, bounded.packed, model.lm_head.weight.detach(), bounded.row_norms, bounded.bound
    )
    return ids if ok else argmax_rows(model, model.logits(hidden))  # not ok: a NaN / infinite state, or an overflow
