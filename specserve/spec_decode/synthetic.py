"""SYNTHETIC acceptance for system benchmarks (never a default, labelled in every output).

Each drafted token is accepted with a configured probability a, independent of the models, so batches with a
controlled heterogeneous acceptance mix can be studied on real forward passes. The emitted tokens are then NOT
the target's distribution: this mode measures the system, never quality.
"""

from __future__ import annotations

import math

import torch

from specserve.spec_decode.draft_tree import ROOT
from specserve.spec_decode.verify import VerifyResult, check_token, inverse_cdf_sample


def synthetic_verify(
    tokens: list[int], parents: list[int], p: torch.Tensor, accept: float, generator: torch.Generator
) -> VerifyResult:
    """Walk the first-child path while each step succeeds with probability ``accept``; then draw from p.

    tokens/parents: tree nodes incl. the root (node 0); p: [T, V] target probabilities at each node.
    """
    first_child: dict[int, int] = {}
    for node in range(1, len(tokens)):
        first_child.setdefault(parents[node], node)
    accepted: list[int] = []
    node = ROOT
    u = torch.rand(len(tokens) + 1, generator=generator, dtype=torch.float64, device=generator.device).tolist()
    while node in first_child and u[len(accepted)] < accept:
        node = first_child[node]
        accepted.append(node)
    nxt = int(inverse_cdf_sample(p[node : node + 1], torch.tensor([u[-1]], dtype=torch.float64, device=p.device))[0])
    check_token(nxt, p.shape[-1], node)  # a row without mass (non-finite logits) draws V: an error, not a token
    return VerifyResult(accepted, [tokens[j] for j in accepted], nxt, len(tokens) - 1)


def synthetic_kld(accept: float, n: int, generator: torch.Generator) -> list[float]:
    """KLD stand-ins that track the synthetic acceptance: Exp-distributed with mean -ln(accept)."""
    mean = -math.log(accept)
    draws = torch.empty(n, dtype=torch.float64, device=generator.device)  # (a worker's generator is on its device)
    return draws.exponential_(1.0 / mean, generator=generator).tolist()
