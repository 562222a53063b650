"""The small data objects that cross between the scheduler (router) and the workers.

Only token ids, small index lists and sparse top-K probabilities cross; never [B, SL, |V|] tensors.
Cache convention shared by both workers: after a call, a worker's KV for a sequence holds every committed
token except the last one, which is the root of the next step's tree. ``new_tokens`` carries the committed
tokens the worker has not seen yet (the whole prompt on the first call, the whole token state after a
worker restart), its last element being that root.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.config import SpecConfig


@dataclass(frozen=True)
class VerifyItem:
    seq_id: int
    new_tokens: list[int]
    draft_tokens: list[int] = field(default_factory=list)  # tree nodes 1..T-1 (node 0 is the root)
    draft_parents: list[int] = field(default_factory=list)  # parent node of each drafted node, 0 = root
    q_idx: list[list[int]] | None = None  # sampled chain only: the draft's top-K ids per drafted token
    q_prob: list[list[float]] | None = None  # ... and their probabilities (the distribution it sampled from)


@dataclass(frozen=True)
class VerifyOutput:
    seq_id: int
    accepted: list[int]  # accepted drafted nodes (1-based node indices, root excluded), in depth order
    tokens: list[int]  # accepted draft tokens + the correction or bonus token
    kld: list[float] = field(default_factory=list)  # per verified position, when requested


@dataclass(frozen=True)
class ProposeItem:
    seq_id: int
    new_tokens: list[int]
    accepted: list[int]  # accepted nodes of this worker's previous proposal for the sequence
    depth: int  # SL: chain length, or the tree's maximum depth (after the batch cap); 0 = no drafting
    spec: SpecConfig = field(default_factory=SpecConfig)  # method and its parameters for this sequence


@dataclass(frozen=True)
class Proposal:
    seq_id: int
    tokens: list[int]  # drafted nodes 1..T-1
    parents: list[int]  # parent node of each, 0 = root
    q_idx: list[list[int]] | None = None  # sampled chain: the sparse q each token was drawn from
    q_prob: list[list[float]] | None = None
    depth: int = 0  # levels drafted
    ranks: list[int] | None = None  # trees: score rank of each node (for the budget auto-tune)
