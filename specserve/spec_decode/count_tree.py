"""Draft trees from occurrence counts (docs/algorithms.md §10.3): what the model-free drafters propose.

A ``CountNode`` whose children are the tokens seen after the matched context (with their counts) stands for the
root. A node's score is its empirical path probability: the product of count(child) / sum(counts of its
siblings) along the path, which never increases with depth, like EAGLE-2's draft scores. Chains follow the most
frequent child; trees keep the best-scoring nodes up to the verify budget (EAGLE-2's reranking); DDD's rule reads
the depth-d mass H_d = log sum(scores at depth d) in place of the draft's beam mass. Drafts are deterministic
(q = 1 at the drafted token), so verification is the deterministic-children rule; DSDE's KLD reads the
empirical distribution at each node, smoothed by ``alpha``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specserve.config import SpecMethod
from specserve.messages import DraftQ
from specserve.spec_decode.suffix_tree import CountNode

# (count, the parent's total, depth) -> the chance the node is accepted where its parent is; ``share``: count / total
NodeProb = Callable[[int, int, int], float]


def share(count: int, total: int, depth: int) -> float:
    return count / total


@dataclass(frozen=True)
class CountDraft:
    tokens: list[int]  # drafted nodes 1..T-1
    parents: list[int]  # parent node of each, 0 = root
    scores: list[float]  # empirical path probability of each
    depth: int  # deepest level drafted
    nodes: list[CountNode]  # the count node behind the root (index 0) and each drafted node


def successor_probs(node: CountNode, depth: int = 1, node_prob: NodeProb = share) -> tuple[list[int], list[float]]:
    """(tokens, node_prob) of the node's children at ``depth``, the most frequent first (stable: insertion order)."""
    items = sorted(node.successors(), key=lambda kv: -kv[1])
    total = sum(c for _, c in items)
    by_count: dict[int, float] = {}  # a score reads (count, total, depth) alone: once per distinct count
    for _, c in items:
        if c not in by_count:
            by_count[c] = node_prob(c, total, depth)
    return [t for t, _ in items], [by_count[c] for _, c in items]


def empirical_q(node: CountNode, alpha: float, k: int) -> tuple[list[int], list[float]]:
    """The top-k of q(t) = count(t) / (total + alpha): the empirical next-token distribution with mass alpha /
    (total + alpha) left for unseen tokens (the sparse tail of the KLD spreads it)."""
    succ = node.successors()
    total = sum(c for _, c in succ)
    items = sorted(succ, key=lambda kv: -kv[1])[:k]
    return [t for t, _ in items], [c / (total + alpha) for _, c in items]


def depth_mass(scores: list[float], depths: list[int], depth: int) -> float:
    """H_d: log of the total score of the drafted nodes at ``depth`` (-inf when none)."""
    mass = sum(s for s, d in zip(scores, depths, strict=True) if d == depth)
    return math.log(mass) if mass > 0 else -math.inf


def chain_from_counts(root: CountNode, max_depth: int, min_score: float, node_prob: NodeProb = share) -> CountDraft:
    """Follow the most frequent child while the path probability stays >= ``min_score``."""
    tokens: list[int] = []
    scores: list[float] = []
    nodes = [root]
    node, score = root, 1.0
    while len(tokens) < max_depth and node.has_children:
        succ, probs = successor_probs(node, len(tokens) + 1, node_prob)
        if score * probs[0] < min_score:
            break
        score *= probs[0]
        node = node.child(succ[0])
        tokens.append(succ[0])
        scores.append(score)
        nodes.append(node)
    return CountDraft(tokens, list(range(len(tokens))), scores, len(tokens), nodes)


def tree_from_counts(
    root: CountNode,
    max_depth: int,
    budget: int,
    min_score: float,
    ddd_threshold: float | None,
    node_prob: NodeProb = share,
) -> CountDraft:
    """The ``budget - 1`` best-scoring nodes up to ``max_depth`` (best-first, so parents precede children); with
    ``ddd_threshold`` x, the tree stops below the first depth d whose mass H_d < x (every depth is checked:
    reading a count costs nothing)."""
    order = itertools.count()
    heap: list[tuple[float, int, int, int, int, CountNode]] = []  # (-score, depth, tie, parent, token, node)

    def push_children(node: CountNode, index: int, score: float, depth: int) -> None:
        if depth >= max_depth or not node.has_children:
            return
        succ, probs = successor_probs(node, depth + 1, node_prob)
        kept = [j for j, p in enumerate(probs) if score * p >= min_score]
        if len(kept) >= budget:  # a node's children past its best budget - 1 (ties: the first) are never popped
            kept = sorted(heapq.nsmallest(budget - 1, kept, key=lambda j: (-score * probs[j], j)))  # (as the heap)
        for j in kept:
            heapq.heappush(heap, (-score * probs[j], depth + 1, next(order), index, succ[j], node.child(succ[j])))

    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    depths: list[int] = []
    nodes = [root]
    push_children(root, 0, 1.0, 0)
    while heap and len(tokens) < budget - 1:
        neg, depth, _, parent, tok, node = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        scores.append(-neg)
        depths.append(depth)
        nodes.append(node)
        push_children(node, len(tokens), -neg, depth)
    if ddd_threshold is not None and tokens:
        stop = next((d for d in range(1, max(depths) + 1) if depth_mass(scores, depths, d) < ddd_threshold), None)
        if stop is not None:
            keep = [i for i, d in enumerate(depths) if d <= stop]  # a kept node's parent is kept, and earlier
            renumber = {old + 1: new + 1 for new, old in enumerate(keep)}
            renumber[0] = 0
            tokens = [tokens[i] for i in keep]
            parents = [renumber[parents[i]] for i in keep]
            scores = [scores[i] for i in keep]
            depths = [depths[i] for i in keep]
            nodes = [root] + [nodes[i + 1] for i in keep]
    return CountDraft(tokens, parents, scores, max(depths, default=0), nodes)


def draft_from_counts(
    root: CountNode,
    method: SpecMethod,
    depth: int,
    budget: int,
    min_score: float,
    ddd_threshold: float | None,
    node_prob: NodeProb = share,
) -> CountDraft:
    """A chain or a tree by ``method``; DDD's rule cuts a tree where ``ddd_threshold`` is given."""
    if method == SpecMethod.chain:
        return chain_from_counts(root, depth, min_score, node_prob)
    x = ddd_threshold if method == SpecMethod.ddd else None
    return tree_from_counts(root, depth, budget, min_score, x, node_prob)


def count_draft_q(draft: CountDraft, alpha: float, k: int) -> DraftQ:
    """The empirical q at every node that has seen continuations (the root always has)."""
    nodes, rows = [], []
    for i, node in enumerate(draft.nodes):
        if node.has_children:
            nodes.append(i)
            rows.append(empirical_q(node, alpha, k))
    widths = tuple(len(ids) for ids, _ in rows)
    idx = np.zeros((len(rows), max(widths, default=0)), dtype=np.int32)  # [n, max width]
    prob = np.zeros(idx.shape, dtype=np.float32)
    for r, (ids, ps) in enumerate(rows):
        idx[r, : len(ids)] = ids
        prob[r, : len(ps)] = ps
    return DraftQ(nodes, idx=idx, prob=prob, widths=None if len(set(widths)) <= 1 else widths)
