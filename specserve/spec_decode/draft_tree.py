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

    def paths(self) -> list[list[int]]:
        """Per node the nodes from the root to it, both included (one pass on the host: ``parents[j] < j``)."""
        parents = self.parents.tolist()
        paths = [[ROOT]]
        for j in range(1, len(parents)):
            if not 0 <= parents[j] < j:
                raise ValueError(f"parents[{j}] = {parents[j]}; need 0 <= parents[j] < j")
            paths.append([*paths[parents[j]], j])
        return paths

    def ancestor_mask(self, pad: int = 0) -> torch.Tensor:
        """[T, T] bool; row j is True at j itself and at all its ancestors, the root included. ``pad``: that many
        columns of True in front ([T, pad + T]), for keys every node sees."""
        return _ancestry(self.paths(), pad).to(self.parents.device)

    def depths(self) -> torch.Tensor:
        """[T] long; the root has depth 0."""
        return torch.tensor([len(path) - 1 for path in self.paths()], device=self.parents.device)

    def is_chain(self) -> bool:
        return self.parents.tolist() == [ROOT, *range(self.num_nodes - 1)]  # host sync


def step_layout(tree: DraftTree, num_pending: int, start: int) -> tuple[torch.Tensor | None, list[int] | None]:
    """Mask and positions for ``num_pending`` causal tokens followed by a tree; (None, None) = plain causal.

    A chain after the pending tokens is just consecutive causal positions, so it gets (None, None) too: its
    batch stays causal (flash-attn on CUDA) and the explicit mask is kept for real trees. ``tree`` lives on
    the host here (the target worker builds it from the request's lists), so ``is_chain`` costs no device sync.
    """
    if tree.num_nodes == 1 or tree.is_chain():
        return None, None
    paths = tree.paths()
    mask = torch.zeros(num_pending + tree.num_nodes, num_pending + tree.num_nodes, dtype=torch.bool)  # [n, n]
    mask[:num_pending, :num_pending] = torch.ones(num_pending, num_pending, dtype=torch.bool).tril()
    mask[num_pending:] = _ancestry(paths, num_pending)  # every pending token, then the node's ancestry
    positions = [*range(start, start + num_pending), *(start + num_pending + len(p) - 1 for p in paths)]
    return mask, positions


def _ancestry(paths: list[list[int]], pad: int) -> torch.Tensor:
    """[T, pad + T] bool on the host: row j True at the first ``pad`` columns and at pad + each node of path j."""
    n, width = len(paths), pad + len(paths)
    cols = [[*range(pad), *(pad + k for k in path)] for path in paths]
    flat = torch.tensor([j * width + c for j, row in enumerate(cols) for c in row])  # one copy to a tensor
    return torch.zeros(n * width, dtype=torch.bool).index_fill_(0, flat, True).view(n, width)
