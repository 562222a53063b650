"""KL-divergence signal for DSDE (docs/algorithms.md §4.1).

KLD_j = sum_v p_j(v) (log p_j(v) - log q_j(v)), p = target, q = draft, both softmaxed at temperature 1
(the signal measures draft/target disagreement, not the sampling setting) and both clamped at >= 1e-8.

Across actors the draft ships q sparsely: its top-K temperature-1 probabilities, NOT renormalised, so the
receiver knows the leftover mass 1 - sum(top-K) and spreads it uniformly over the other V - K tokens.
(Verification of sampled chains uses another shipment, docs/algorithms.md §1.1: the renormalised top-K of the
distribution the draft sampled from, after the request's temperature, top-k and top-p.)

How the leftover mass is modelled is `SparseTail`: `uniform` is the paper's rule; `lumped` treats all
non-top-K tokens as one outcome (KL over the partition {each top-K token, "the rest"}), which by the data
processing inequality is a lower bound on the exact KLD (the unfloored one: where the draft puts less than 1e-8 on
each token outside its top-K, `kld_exact`'s per-token floor lowers it below the lumped value), is 0 when p = q
(up to float32 rounding), and on draft-like pairs (p = q + noise) is far closer to the exact value (see
tests/test_policy.py for the measured errors).

All functions are pure, batched over rows, and work on any device; inputs in half precision are computed
in float32, float64 inputs stay float64. Each KLD is floored at 0: rounding leaves values down to -6e-7 for a
draft close to the target, and a negative one would skew DSDE's calibration (docs/algorithms.md §4.5).
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor

PROB_FLOOR = 1e-8


class SparseTail(str, Enum):
    """How `kld_sparse` models q outside the shipped top-K."""

    uniform = "uniform"  # docs/algorithms.md §4.1: leftover mass spread uniformly over the other V - K tokens
    lumped = "lumped"  # leftover mass as one outcome against p's mass outside the top-K (lower bound)


def _softmax(logits: Tensor) -> Tensor:
    # [N, V] -> [N, V], temperature 1, computed in at least float32
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return torch.softmax(x, dim=-1)


def _kl_dense(p: Tensor, q: Tensor, eps: float) -> Tensor:
    # p, q: [N, V] probabilities -> [N]
    p = p.clamp_min(eps)
    q = q.clamp_min(eps)
    return (p * (p.log() - q.log())).sum(dim=-1).clamp_min(0.0)  # KL >= 0: rounding left down to -6e-7 for q ~ p


def kld_exact(p_logits: Tensor, q_logits: Tensor, eps: float = PROB_FLOOR) -> Tensor:
    """KL(p || q) per row from dense logits.

    p_logits: [N, V] target logits; q_logits: [N, V] draft logits (same vocabulary) -> [N].
    """
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"shape mismatch: p {tuple(p_logits.shape)} vs q {tuple(q_logits.shape)}")
    p = _softmax(p_logits)  # [N, V]
    q = _softmax(q_logits).to(p.dtype)  # [N, V]
    return _kl_dense(p, q, eps)  # [N]


def sparse_topk_q(q_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-K of the temperature-1 draft distribution, for shipping q across actors.

    q_logits: [N, V] -> (idx [N, K] long, prob [N, K]); K = min(k, V). The probabilities are NOT
    renormalised: 1 - prob.sum(-1) is the leftover mass that `kld_sparse` spreads over the other tokens.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    probs = _softmax(q_logits)  # [N, V]
    prob, idx = probs.topk(min(k, probs.shape[-1]), dim=-1)  # [N, K], [N, K]
    return idx, prob


def dense_from_sparse(q_idx: Tensor, q_prob: Tensor, vocab_size: int) -> Tensor:
    """Rebuild the dense approximation of q: the top-K probabilities at their indices, the leftover mass
    (1 - sum top-K, floored at 0) spread uniformly over the other V - K tokens.

    q_idx: [N, K] long (distinct per row), q_prob: [N, K] -> [N, V].
    """
    n, k = q_idx.shape
    if k > vocab_size:
        raise ValueError(f"K={k} > V={vocab_size}")
    leftover = (1.0 - q_prob.sum(dim=-1)).clamp_min(0.0)  # [N]
    fill = leftover / (vocab_size - k) if vocab_size > k else torch.zeros_like(leftover)  # [N]
    q = fill.unsqueeze(-1).expand(n, vocab_size).clone()  # [N, V]
    return q.scatter_(-1, q_idx, q_prob)  # [N, V]


def kld_sparse(
    p_logits: Tensor,
    q_idx: Tensor,
    q_prob: Tensor,
    eps: float = PROB_FLOOR,
    *,
    q_is_log: bool = False,
    tail: SparseTail = SparseTail.uniform,
) -> Tensor:
    """KL(p || q~) per row from dense target logits and the sparse top-K of q (see module doc).

    p_logits: [N, V] target logits; q_idx: [N, K] long, distinct per row; q_prob: [N, K] temperature-1
    probabilities (log-probabilities with q_is_log=True), not renormalised -> [N].
    tail=uniform (spec): q~ = top-K of q plus the leftover spread uniformly; with K = V equals `kld_exact`.
    tail=lumped: sum_{top-K} p ln(p/q) + P_rest ln(P_rest / Q_rest), P_rest/Q_rest = mass outside the top-K.
    """
    if q_idx.shape != q_prob.shape or q_idx.dim() != 2 or p_logits.dim() != 2 or q_idx.shape[0] != p_logits.shape[0]:
        raise ValueError(
            f"bad shapes: p_logits {tuple(p_logits.shape)}, q_idx {tuple(q_idx.shape)}, q_prob {tuple(q_prob.shape)}"
        )
    x = p_logits if p_logits.dtype in (torch.float32, torch.float64) else p_logits.float()  # [N, V]
    idx = q_idx.to(x.device).long()  # [N, K]
    qk = q_prob.to(device=x.device, dtype=x.dtype)  # [N, K]
    if q_is_log:
        qk = qk.exp()
    if tail is SparseTail.uniform:
        q = dense_from_sparse(idx, qk, x.shape[-1])  # [N, V]
        return _kl_dense(_softmax(x), q, eps)  # [N]
    # lumped: P_rest = 1 - sum(top-K of p) (in float64), where a mask of the rest made two more [N, V] temporaries
    pk = _softmax(x).gather(-1, idx)  # [N, K]
    p_rest = (1.0 - pk.sum(dim=-1, dtype=torch.float64)).to(x.dtype).clamp_min(eps)  # [N]
    q_rest = (1.0 - qk.sum(dim=-1, dtype=torch.float64)).to(x.dtype).clamp_min(eps)  # [N], as P_rest
    pk = pk.clamp_min(eps)
    head = (pk * (pk.log() - qk.clamp_min(eps).log())).sum(dim=-1)  # [N]
    return (head + p_rest * (p_rest.log() - q_rest.log())).clamp_min(0.0)  # [N]
