"""The drafted tokens one verification checks: a tree rooted at the last committed token (a chain is a tree).

Shared by every drafter (they build one) and by verification (it walks one); ``step_layout`` places a tree after
a sequence's not-yet-cached tokens in one target forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT = 0  # node index of the root (the last committed token) in a DraftTree


@dataclass(frozen=True)
class DraftTree:
    """Drafted tokens as a tree rooted at the last committed token; a chain is the tree with ``parents[j] = j - 1``.

    Node 0 is the root (not a draft); nodes 1..T-1 are drafted tokens, ordered so that ``parents[j] < j``.
    The root is its own parent (``parents[0] == ROOT``) so that parent lookups never need a sentinel.
    Children of a node are tried in index order (docs/algorithms.md §1.2).
    """

    tokens: torch.Tensor  # [T] long
    parents: torch.Tensor  # [T] long; parents[0] == ROOT, parents[j] < j for j >= 1

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.shape[0] < 1:
            raise ValueError(f"tokens must have shape [T] with T >= 1, got {tuple(self.tokens.shape)}")
        if self.parents.shape != self.tokens.shape:
            raise ValueError(f"parents shape {tuple(self.parents.shape)} != tokens shape {tuple(self.tokens.shape)}")
        if self.tokens.dtype != torch.long or self.parents.dtype != torch.long:
            raise ValueError("tokens and parents must be torch.long")

    @classmethod
    def chain(cls, root_token: int, drafted: list[int] | torch.Tensor) -> DraftTree:
        drafted_t = torch.as_tensor(drafted, dtype=torch.long).reshape(-1)  # [SL]
        tokens = torch.cat([drafted_t.new_tensor([root_token]), drafted_t])  # [SL+1]
        parents = (torch.arange(tokens.shape[0], device=tokens.device) - 1).clamp_min(ROOT)  # [SL+1]
        return cls(tokens=tokens, parents=parents)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_drafted(self) -> int:
        return self.num_nodes - 1

    def ancestor_mask(self) -> torch.Tensor:
        """[T, T] bool; row j is True at j itself and at all its ancestors, the root included.

        Pointer doubling on the device (no host sync): after k squarings a row covers ancestors up to 2^k levels up.
        """
        n = self.num_nodes
        eye = torch.eye(n, dtype=torch.bool, device=self.parents.device)  # [T, T]
        parent_hot = torch.nn.functional.one_hot(self.parents, n).bool()  # [T, T]
        reach = (eye | parent_hot).float()  # [T, T]
        for _ in range((n - 1).bit_length()):
            reach = ((reach @ reach) > 0).float()
        return reach.bool()

    def depths(self) -> torch.Tensor:
        """[T] long; the root has depth 0."""
        return self.ancestor_mask().sum(-1) - 1

    def is_chain(self) -> bool:
        expected = (torch.arange(self.num_nodes, device=self.parents.device) - 1).clamp_min(ROOT)  # [T]
        return bool(torch.equal(self.parents, expected))  # host sync


def step_layout(tree: DraftTree, num_pending: int, start: int) -> tuple[torch.Tensor | None, list[int] | None]:
    """Mask and positions for ``num_pending`` causal tokens followed by a tree; (None, None) = plain causal.

    A chain after the pending tokens is just consecutive causal positions, so it gets (None, None) too: its
    batch stays causal (flash-attn on CUDA) and the explicit mask is kept for real trees. ``tree`` lives on
    the host here (the target worker builds it from the request's lists), so ``is_chain`` costs no device sync.
    """
    if tree.num_nodes == 1 or tree.is_chain():
        return None, None
    n = num_pending + tree.num_nodes
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:num_pending, :num_pending] = torch.ones(num_pending, num_pending, dtype=torch.bool).tril()
    mask[num_pending:, :num_pending] = True
    mask[num_pending:, num_pending:] = tree.ancestor_mask()
    positions = list(range(start, start + num_pending)) + (start + num_pending + tree.depths()).tolist()
    return mask, positions
