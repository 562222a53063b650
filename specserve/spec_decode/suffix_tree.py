"""Suffix tries with occurrence counts (docs/algorithms.md §10.2): one over a request's own tokens, grown a token at
a time, and a bounded cache of recent requests' outputs shared by a replica's lanes.

A depth-D trie holds every substring of length <= D of what was inserted; a node's ``count`` is the number of
its occurrences. Matching the longest suffix of the context finds a node whose children are every token that
followed that suffix before, with how often: the empirical next-token distribution the drafter proposes from.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence


class CountNode:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, CountNode] | None = None

    def child(self, token: int) -> CountNode | None:
        return None if self.children is None else self.children.get(token)

    def bump(self, token: int) -> tuple[CountNode, bool]:
        """Count one more occurrence of ``token`` after this node: (its child, whether the child is new)."""
        if self.children is None:
            self.children = {}
        child = self.children.get(token)
        created = child is None
        if child is None:
            child = self.children[token] = CountNode()
        child.count += 1
        return child, created

    def items(self) -> Iterator[tuple[int, CountNode]]:
        return iter(()) if self.children is None else iter(self.children.items())

    def as_dict(self) -> dict[int, tuple[int, dict]]:
        """{token: (count, subtree)}: for comparing tries in tests."""
        return {t: (c.count, c.as_dict()) for t, c in self.items()}


class SuffixTrie:
    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.root = CountNode()
        self.num_nodes = 0

    def _inc(self, node: CountNode, token: int) -> CountNode:
        child, created = node.bump(token)
        self.num_nodes += created
        return child

    def add(self, tokens: Sequence[int]) -> None:
        """Count every substring of length <= depth of ``tokens``."""
        for i in range(len(tokens)):
            node = self.root
            for tok in tokens[i : i + self.depth]:
                node = self._inc(node, tok)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``; nodes whose count drops to 0 go (a child never outcounts its parent)."""
        for i in range(len(tokens)):
            node = self.root
            for tok in tokens[i : i + self.depth]:
                child = node.child(tok)
                if child is None:
                    raise ValueError("remove() of tokens that were never added")
                child.count -= 1
                if child.count == 0:
                    assert node.children is not None
                    del node.children[tok]
                    self.num_nodes -= _size(child)
                    break
                node = child

    def match(self, context: Sequence[int], max_len: int, min_len: int) -> tuple[int, CountNode | None]:
        """The longest suffix of ``context`` (``min_len`` to ``max_len`` tokens) that occurred with a continuation:
        (its length, its node), or (0, None)."""
        longest = min(max_len, len(context), self.depth - 1)
        for n in range(longest, min_len - 1, -1):
            node: CountNode | None = self.root
            for tok in context[len(context) - n :]:
                node = node.child(tok)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is not None and node.children:
                return n, node
        return 0, None


def _size(node: CountNode) -> int:
    return 1 + sum(_size(c) for _, c in node.items())


class SuffixStream:
    """Feeds one growing token sequence into a trie a token at a time: O(depth) per token."""

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self.fed = 0
        self._open: list[CountNode] = []  # nodes of the current suffixes of length 1..depth-1, shortest first

    def extend(self, tokens: Sequence[int]) -> None:
        """Feed ``tokens[self.fed:]`` (the caller passes the whole sequence so far)."""
        trie = self.trie
        for tok in tokens[self.fed :]:
            grown = [trie._inc(node, tok) for node in (trie.root, *self._open)]
            self._open = grown[: trie.depth - 1]
        self.fed = max(self.fed, len(tokens))


class SuffixCache:
    """Recent requests' outputs, at most ``max_tokens`` of them, the oldest evicted first, in one trie per cache salt:
    a request drafts only from outputs of requests with its own salt (None, the default, is one partition like any
    other), so a tenant that sets a salt neither sees nor reveals others' outputs through its speculation's speed or
    ``usage.speculation``. Shared by the lanes of a replica (their threads): ``lock`` guards the tries and any node
    read from them."""

    def __init__(self, max_tokens: int, depth: int) -> None:
        self.max_tokens = max_tokens
        self.depth = depth
        self.tries: dict[str | None, SuffixTrie] = {}
        self.entries: deque[tuple[str | None, list[int]]] = deque()
        self.tokens = 0
        self.lock = threading.Lock()
        # outputs are kept only once a lane serves the suffix drafter: until then the trie (~10^5 tracked objects
        # per 16k tokens, each output costing ~75 us a token on the lane thread, and the collector's full passes
        # over them stalling every lane) would be paid for by replicas that never draft from it
        self.in_use = False

    @property
    def max_nodes(self) -> int:
        """The memory bound: each cached token starts at most ``depth`` nodes, whichever trie holds it."""
        return self.max_tokens * self.depth

    @property
    def num_nodes(self) -> int:
        with self.lock:  # lanes' threads add and drop tries
            return sum(t.num_nodes for t in self.tries.values())

    def trie(self, salt: str | None = None) -> SuffixTrie | None:
        """The outputs of requests with this salt (None where there are none); read it under ``lock``."""
        return self.tries.get(salt)

    def add(self, tokens: Sequence[int], salt: str | None = None) -> None:
        if self.max_tokens == 0 or not tokens:
            return
        entry = list(tokens[-self.max_tokens :])
        with self.lock:
            while self.entries and self.tokens + len(entry) > self.max_tokens:
                old_salt, old = self.entries.popleft()
                self.tries[old_salt].remove(old)
                if self.tries[old_salt].num_nodes == 0:  # a salt's last output gone: so is its trie
                    del self.tries[old_salt]
                self.tokens -= len(old)
            if salt not in self.tries:
                self.tries[salt] = SuffixTrie(self.depth)
            self.tries[salt].add(entry)
            self.entries.append((salt, entry))
            self.tokens += len(entry)
