"""Lossless verification of drafted tokens (docs/algorithms.md §1): deterministic chains and trees, sampled chains.

All distributions are probabilities after ``sampling.process_logits`` (the same processing for draft and target);
greedy is the one-hot case and goes through the same code. Each rule comes in two halves: one on the logits'
device that reads nothing back (``tree_draws``, ``chain_outcome``), one on the host over its result read back
(``walk_tree``, ``chain_result``), so that a batch reads every sequence's result in one transfer (the target
worker's); ``accept_tree`` (so ``verify_tree``) and ``verify_chain_sampled`` join the halves with one device->host
transfer each, marked ``# host sync``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.spec_decode.draft_tree import ROOT, DraftTree


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification: the accepted drafted nodes (root excluded, in depth order) and the one token
    the target emits after them (the correction/residual token, or the bonus token if the path reached a leaf)."""

    accepted_nodes: list[int]
    accepted_tokens: list[int]
    next_token: int
    num_drafted: int

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def tokens(self) -> list[int]:
        """Every token to commit: the accepted drafts, then the next token."""
        return [*self.accepted_tokens, self.next_token]


def verify_tree(tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """Deterministic-children rule (docs/algorithms.md §1.2), single-draw form.

    ``p[j]`` ([T, V]) is the target's next-token distribution after the context plus the path to node j.
    At node j draw y ~ p[j]; if y is one of j's children, descend into it and repeat, else emit y and stop (at a
    leaf y is the bonus token). One draw per node in one call is exact, since each node's draw is independent and
    only those on the walked path are used. If two children of a node carry the same token, the first one wins
    (the sequential rule rejects the later ones with probability 1).
    """
    return accept_tree(tree, tree_draws(tree, p, generator), p.shape[-1])


def tree_draws(tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``verify_tree``'s draw at every node, p [T, V] -> [T] long on p's device (V where a row has no mass)."""
    if p.ndim != 2 or p.shape[0] != tree.num_nodes:
        raise ValueError(f"p must have shape [{tree.num_nodes}, V], got {tuple(p.shape)}")
    u = torch.rand(tree.num_nodes, generator=generator, device=p.device, dtype=torch.float64)  # [T]
    return inverse_cdf_sample(p, u)


def accept_tree(tree: DraftTree, draws: torch.Tensor, vocab: int) -> VerifyResult:
    """The walk of ``verify_tree`` given the target's draw at every node (``draws`` [T] long, each an exact sample
    of that node's p, independent across depths): descend while the draw is a child, emit the draw where it is not.

    The draws may come from a per-request stream or be keyed by position (``sampling.keyed_sample``); greedy
    passes the argmaxes.
    """
    if draws.shape != (tree.num_nodes,):
        raise ValueError(f"draws must have shape [{tree.num_nodes}], got {tuple(draws.shape)}")
    return walk_tree(tree, draws.tolist(), vocab)  # host sync


def walk_tree(tree: DraftTree, draws_h: list[int], vocab: int) -> VerifyResult:
    """``accept_tree``'s walk over draws already on the host (the tree's tokens and parents are host tensors)."""
    if len(draws_h) != tree.num_nodes:
        raise ValueError(f"{len(draws_h)} draws for a tree of {tree.num_nodes} nodes")
    tokens_h, parents_h = tree.tokens.tolist(), tree.parents.tolist()

    child_by_token: list[dict[int, int]] = [{} for _ in tokens_h]  # node -> {token: first child carrying it}
    for node in range(1, len(tokens_h)):
        parent = parents_h[node]
        if not 0 <= parent < node:
            raise ValueError(f"parents[{node}] = {parent}; need 0 <= parents[j] < j")
        child_by_token[parent].setdefault(tokens_h[node], node)

    accepted: list[int] = []
    node = ROOT
    while (child := child_by_token[node].get(draws_h[node])) is not None:
        accepted.append(child)
        node = child
    check_token(draws_h[node], vocab, node)
    return VerifyResult(
        accepted_nodes=accepted,
        accepted_tokens=[tokens_h[j] for j in accepted],
        next_token=draws_h[node],
        num_drafted=tree.num_drafted,
    )


def verify_chain_sampled(
    drafted: torch.Tensor,  # [SL] long, x_i ~ q_i
    q_idx: torch.Tensor,  # [SL, K] long, support of q_i (distinct per row)
    q_prob: torch.Tensor,  # [SL, K] float, q_i on that support (the exact distribution x_i was drawn from)
    p: torch.Tensor,  # [SL+1, V] float, p[i] = target after the context and drafted[:i]
    generator: torch.Generator | None,
) -> VerifyResult:
    """Sampled-draft chain (docs/algorithms.md §1.1): accept x_i w.p. min(1, p_i(x_i)/q_i(x_i)); at the first rejection
    emit a token from norm(max(p_i - q_i, 0)); if all are accepted emit a bonus token from p[SL].

    ``accepted_nodes`` uses DraftTree.chain numbering: drafted[i] is node i + 1.
    """
    return chain_result(chain_outcome(drafted, q_idx, q_prob, p, generator).tolist(), p.shape[-1])  # host sync


def chain_outcome(
    drafted: torch.Tensor,  # [SL] long, x_i ~ q_i
    q_idx: torch.Tensor,  # [SL, K] long, support of q_i (distinct per row)
    q_prob: torch.Tensor,  # [SL, K] float, q_i on that support
    p: torch.Tensor,  # [SL+1, V] float, p[i] = target after the context and drafted[:i]
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``verify_chain_sampled``'s draws on p's device: [3 + SL] long, (accepted count, next token, drafts outside
    q's support, the drafts), read by ``chain_result``."""
    sl = drafted.shape[0]
    if q_idx.shape != q_prob.shape or q_idx.shape[0] != sl or p.ndim != 2 or p.shape[0] != sl + 1:
        raise ValueError(
            f"shapes: drafted {tuple(drafted.shape)}, q_idx {tuple(q_idx.shape)}, q_prob {tuple(q_prob.shape)}, "
            f"p {tuple(p.shape)}; want [SL], [SL, K], [SL, K], [SL+1, V]"
        )
    drafted, q_idx = drafted.to(p.device), q_idx.to(p.device)  # the host's draft ids, the device's logits
    # The row after the last draft keeps q = 0, so its "residual" is p[SL] itself: the bonus.
    q = torch.zeros_like(p)  # [SL+1, V]
    q[:sl].scatter_(-1, q_idx, q_prob.to(p.device, p.dtype))
    p_x = p[:sl].gather(-1, drafted[:, None]).squeeze(-1)  # [SL]
    q_x = q[:sl].gather(-1, drafted[:, None]).squeeze(-1)  # [SL]
    u = torch.rand(sl + 1, generator=generator, device=p.device, dtype=torch.float64)  # [SL+1]; the last one samples
    accepted = u[:sl] < p_x / q_x  # [SL]; P(u < r) = min(1, r); always true when p_x >= q_x
    num_accepted = accepted.long().cumprod(0).sum().view(1)  # [1], index of the first rejection (SL if none)

    p_stop = p.index_select(0, num_accepted)  # [1, V]
    residual = (p_stop - q.index_select(0, num_accepted)).clamp_min(0.0)  # [1, V]
    # An all-zero residual means p <= q everywhere, i.e. p == q, where rejection cannot happen; fall back to p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)  # [1, V]
    next_token = inverse_cdf_sample(residual, u[sl:])  # [1]

    outside = (q_x <= 0).long().sum().view(1)  # [1]; drafts q could not have drawn (p_x / 0 would accept them all)
    return torch.cat([num_accepted, next_token, outside, drafted])  # [3 + SL]


def chain_result(outcome_h: list[int], vocab: int) -> VerifyResult:
    """``chain_outcome``'s result read back to the host."""
    n_acc, next_tok, n_outside, drafted_h = outcome_h[0], outcome_h[1], outcome_h[2], outcome_h[3:]
    if n_outside:
        raise ValueError(f"{n_outside} drafted token(s) lie outside the support of the q they were drawn from")
    check_token(next_tok, vocab, n_acc)
    return VerifyResult(
        accepted_nodes=list(range(ROOT + 1, ROOT + 1 + n_acc)),
        accepted_tokens=drafted_h[:n_acc],
        next_token=next_tok,
        num_drafted=len(drafted_h),
    )


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (rows with positive mass, need not be normalised), u [N] float64 uniforms in [0, 1) -> [N] long.

    One uniform per row instead of V random numbers: on a CPU this is 10-20x cheaper than torch.multinomial at
    V ~ 50k. The CDF is float64 so that tail probabilities are not distorted; a token of probability 0 is never drawn.
    A row without mass gives V (out of range), which the callers reject after their host sync.
    """
    cdf = probs.double().cumsum(-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # [N, 1]; u * total may round up to total
    target = torch.minimum(u[:, None].double() * total, below_total)  # [N, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first index with cdf > target


def check_token(token: int, vocab: int, node: int) -> None:
    if not 0 <= token < vocab:
        raise ValueError(f"target distribution at node {node} has no mass (drew {token}, vocabulary {vocab})")
