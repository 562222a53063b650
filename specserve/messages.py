"""The small data objects that cross between the scheduler (router) and the workers.

Only token ids, small index lists and sparse top-K probabilities cross, and for a structured answer its grammar's
allowed tokens as bits (|V| / 8 bytes a row); never [B, SL, |V|] tensors.
Cache convention shared by both workers: after a call, a worker's KV for a sequence holds every committed
token except the last one, which is the root of the next step's tree. ``new_tokens`` carries the committed
tokens the worker has not seen yet (the whole prompt on the first call, the whole token state after a
worker restart), its last element being that root.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.config import KLDMode, SpecConfig
from specserve.policy import SparseTail


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target, and the likeliest tokens' (id, log-probability), most likely
    first (as many as the request asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, eq=False)  # arrays: compared by identity (an elementwise == has no truth value)
class DraftQ:
    """The draft's temperature-1 next-token distribution at some tree nodes (node 0 = the root).

    Sparse (top-K probabilities, not renormalised) crosses actors, as host arrays: pickled whole and read by the
    target without a per-number conversion; dense logits only within one process.
    """

    nodes: list[int]
    idx: np.ndarray | None = None  # [n, K] int32 target token ids (sparse); row r's entries past widths[r] unused
    prob: np.ndarray | None = None  # [n, K] float32, the probabilities of ``idx``
    widths: tuple[int, ...] | None = None  # ragged rows (a model-free drafter's counts): row r holds widths[r]
    # entries; None: every row holds K
    dense_logits: torch.Tensor | None = None  # [n, V], KLDMode.exact only

    def check(self, vocab_size: int) -> None:
        """Raise ValueError where the shapes disagree or an id lies outside a vocabulary of ``vocab_size``."""
        n = len(self.nodes)
        if self.dense_logits is not None:
            shape = tuple(self.dense_logits.shape)
            if shape != (n, vocab_size):
                raise ValueError(f"dense draft q of shape {shape} for {n} nodes of a vocabulary of {vocab_size}")
            return
        if self.idx is None or self.prob is None:
            raise ValueError("sparse draft q without ids or probabilities")
        if self.idx.ndim != 2 or self.prob.shape != self.idx.shape or self.idx.shape[0] != n:
            raise ValueError(f"draft q ids {self.idx.shape} and probabilities {self.prob.shape} for {n} nodes")
        k = self.idx.shape[1]
        if self.widths is not None and (len(self.widths) != n or not all(0 <= w <= k for w in self.widths)):
            raise ValueError(f"draft q row widths {self.widths} for {n} rows of {k}")
        if self.idx.size and not 0 <= int(self.idx.min()) <= int(self.idx.max()) < vocab_size:
            raise ValueError(f"draft q names token ids outside the vocabulary of {vocab_size}")

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Row r's ids and probabilities [k_r] (sparse mode)."""
        assert self.idx is not None and self.prob is not None
        k = self.idx.shape[1] if self.widths is None else self.widths[r]
        return self.idx[r, :k], self.prob[r, :k]

    @property
    def mode(self) -> KLDMode:
        return KLDMode.exact if self.dense_logits is not None else KLDMode.sparse


@dataclass(frozen=True)
class FeatureRequest:
    """Which target hidden states a draft head reads (docs/algorithms.md §8.3)."""

    aux_layers: tuple[int, ...] | None = None  # EAGLE-3: inputs of these decoder layers, concatenated
    # (None: the final-norm hidden state, EAGLE-1/2)


@dataclass(frozen=True)
class VerifyItem:
    seq_id: int
    new_tokens: list[int]
    draft_tokens: list[int] = field(default_factory=list)  # tree nodes 1..T-1 (node 0 is the root)
    draft_parents: list[int] = field(default_factory=list)  # parent node of each drafted node, 0 = root
    q_idx: list[list[int]] | None = None  # sampled chain only: the draft's top-K ids per drafted token
    q_prob: list[list[float]] | None = None  # ... and their probabilities (the distribution it sampled from)
    draft_q: DraftQ | None = None  # the draft's temperature-1 distributions, when the policy needs the KLD signal
    kld_past_rejection: bool = False  # chains: also score drafted positions after the first rejection
    kld_tail: SparseTail = SparseTail.lumped  # how a sparse q's leftover mass is modelled
    synthetic_accept: float | None = None  # SYNTHETIC benchmark mode (see SpecConfig.synthetic_accept)
    features: FeatureRequest | None = None  # return the hidden states of the positions this step caches
    prompt_logprobs: bool = False  # return the logprobs of new_tokens after the first (a first prefill: the prompt's)
    banned: tuple[int, ...] = ()  # tokens the target does not draw at sequence positions below ``banned_below``
    banned_below: int = 0  # (min_tokens: EOS and the stop ids, before that many output tokens)
    allowed: np.ndarray | None = None  # [T, ceil(V / 32)] int32: the tokens a grammar allows at each node's row

    def by_argmax(self, raw_argmax: bool) -> bool:
        """Its tokens are the argmaxes of the target's logits as computed (``SamplingParams.raw_argmax``): nothing
        moves a row (no synthetic acceptance, no banned tokens, no grammar's rows)."""
        return raw_argmax and self.synthetic_accept is None and not self.banned and self.allowed is None

    def banned_rows(self, draw_positions: list[int]) -> list[int]:
        """The tree nodes whose token is drawn without ``banned``: ``draw_positions`` [T] per node."""
        if not self.banned:
            return []
        return [i for i, pos in enumerate(draw_positions) if pos < self.banned_below]


@dataclass(frozen=True)
class VerifyOutput:
    seq_id: int
    accepted: list[int]  # accepted drafted nodes (1-based node indices, root excluded), in depth order
    tokens: list[int]  # accepted draft tokens + the correction or bonus token
    kld: list[float] = field(default_factory=list)  # KL(p || q) per verified position, when draft_q was sent
    features: torch.Tensor | None = None  # [n, F] hidden states of the positions cached this step, in order
    # (the pending tokens, the root, the accepted path), when VerifyItem.features asked for them
    logprobs: list[TokenLogprob] | None = None  # per token of ``tokens``, where the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # per token of ``new_tokens`` after the first, where asked


@dataclass(frozen=True)
class ProposeItem:
    seq_id: int
    new_tokens: list[int]
    accepted: list[int]  # accepted nodes of this worker's previous proposal for the sequence
    depth: int  # draft levels allowed: the chain's SL, or the tree's depth budget (after SL_cap); >= 1
    spec: SpecConfig = field(default_factory=SpecConfig)  # method and its parameters for this sequence
    kld_mode: KLDMode | None = None  # ship the draft's distributions for the KLD signal (None: not needed)
    features: torch.Tensor | None = None  # draft heads: [n, F] target hidden states of positions feature_start..
    feature_start: int = 0
    root_position: int | None = None  # index of the root in the sequence (keyed chains draw the token after it at +1)
    min_prob: float | None = None  # trees: this step's measured floor, in place of spec.tree_min_prob (None: that)

    def __post_init__(self) -> None:
        # a step without drafting sends no item: a draft worker given depth 0 fed nothing, yet took its next item's
        # tokens as following a cached root (an AssertionError there, or a cache out of step)
        if self.depth < 1:
            raise ValueError(f"sequence {self.seq_id}: a proposal drafts at least one level, got depth {self.depth}")
        if not self.new_tokens:  # (a step commits at least one token: a worker given none built an empty forward)
            raise ValueError(f"sequence {self.seq_id}: a proposal feeds at least its root token, got none")


@dataclass(frozen=True)
class Proposal:
    seq_id: int
    tokens: list[int]  # drafted nodes 1..T-1
    parents: list[int]  # parent node of each, 0 = root
    q_idx: list[list[int]] | None = None  # sampled chain: the sparse q each token was drawn from
    q_prob: list[list[float]] | None = None
    depth: int = 0  # levels drafted
    ranks: list[int] | None = None  # trees: score rank of each node (for the budget auto-tune)
    draft_q: DraftQ | None = None  # when ProposeItem.kld_mode asked for it

    @property
    def verified_depth(self) -> int:
        """The depth of the drafted nodes the target verifies: a chain's length, a tree's deepest kept node (the
        rerank and the floor may drop levels a tree grew: ``depth`` counts those)."""
        depths = [0]  # node 0: the root
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return max(depths)
