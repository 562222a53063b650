"""Count tries (docs/algorithms.md §10.2): a suffix trie with occurrence counts over a request's own tokens, grown a
token at a time, a bounded cache of recent requests' outputs shared by a replica's lanes, and the small tries prompt
lookup merges its matches into.

A depth-D suffix trie holds every substring of length <= D of what was inserted; a node's count is the number of its
occurrences. Matching the longest suffix of the context finds a node whose children are every token that followed
that suffix before, with how often: the empirical next-token distribution the drafter proposes from.

Nodes are integer ids into flat storage: the counts in an ``array`` and each node's children in a dict of ints.
Neither is an object the cyclic collector tracks, so a trie of 10^5-10^6 nodes adds nothing to the collector's full
passes (which hold the GIL, and so every lane of a replica), and inserting costs dict and array operations, not an
object per node. ``CountNode`` is a read-only view of one node for the drafters.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Iterator, Sequence

ROOT = 0


class CountTrie:
    """A trie of token counts; node ``ROOT`` is the root, freed ids are reused."""

    def __init__(self) -> None:
        self.counts = array("q", [0])  # [nodes]: occurrences of each node's path (the root's is unused)
        self.kids: list[dict[int, int] | None] = [None]  # [nodes]: token -> child id, None for a leaf
        self.free: list[int] = []
        self.num_nodes = 0  # excluding the root

    @property
    def root(self) -> CountNode:
        return CountNode(self, ROOT)

    def new_node(self) -> int:
        self.num_nodes += 1
        if self.free:
            return self.free.pop()
        self.counts.append(0)
        self.kids.append(None)
        return len(self.kids) - 1

    def bump(self, node: int, token: int) -> int:
        """Count one more occurrence of ``token`` after ``node``: its child's id."""
        kids = self.kids[node]
        if kids is None:
            kids = self.kids[node] = {}
        child = kids.get(token)
        if child is None:
            child = kids[token] = self.new_node()
        self.counts[child] += 1
        return child

    def add_path(self, tokens: Sequence[int], node: int = ROOT) -> None:
        """Count one occurrence of every prefix of ``tokens`` below ``node``."""
        for tok in tokens:
            node = self.bump(node, tok)

    def drop(self, node: int) -> None:
        """Free ``node`` and its subtree (the caller unlinks it from its parent)."""
        stack = [node]
        while stack:
            n = stack.pop()
            kids = self.kids[n]
            if kids:
                stack.extend(kids.values())
            self.kids[n] = None
            self.counts[n] = 0
            self.free.append(n)
            self.num_nodes -= 1


class CountNode:
    """A read-only view of one node of a ``CountTrie``."""

    __slots__ = ("id", "trie")

    def __init__(self, trie: CountTrie, node_id: int) -> None:
        self.trie = trie
        self.id = node_id

    @property
    def count(self) -> int:
        return self.trie.counts[self.id]

    @property
    def has_children(self) -> bool:
        return bool(self.trie.kids[self.id])

    def child(self, token: int) -> CountNode:
        """The child after ``token``; KeyError where that token never followed this node."""
        kids = self.trie.kids[self.id]
        if kids is None:
            raise KeyError(token)
        return CountNode(self.trie, kids[token])

    def successors(self) -> list[tuple[int, int]]:
        """(token, count) of every child, in insertion order."""
        kids, counts = self.trie.kids[self.id], self.trie.counts
        return [] if kids is None else [(t, counts[c]) for t, c in kids.items()]

    def items(self) -> Iterator[tuple[int, CountNode]]:
        kids = self.trie.kids[self.id]
        return iter(()) if kids is None else ((t, CountNode(self.trie, c)) for t, c in kids.items())

    def as_dict(self) -> dict[int, tuple[int, dict]]:
        """{token: (count, subtree)}: for comparing tries in tests."""
        return {t: (c.count, c.as_dict()) for t, c in self.items()}


class SuffixTrie(CountTrie):
    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        super().__init__()
        self.depth = depth

    def add(self, tokens: Sequence[int]) -> None:
        """Count every substring of length <= depth of ``tokens``."""
        counts, kids, depth, new_node = self.counts, self.kids, self.depth, self.new_node
        toks = list(tokens)
        for i in range(len(toks)):
            node = ROOT
            for tok in toks[i : i + depth]:  # the bump, inlined: this loop is the trie's whole insert cost
                out = kids[node]
                if out is None:
                    out = kids[node] = {}
                child = out.get(tok)
                if child is None:
                    child = out[tok] = new_node()
                counts[child] += 1
                node = child

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``; nodes whose count drops to 0 go (a child never outcounts its parent)."""
        counts, kids, depth = self.counts, self.kids, self.depth
        toks = list(tokens)
        for i in range(len(toks)):
            node = ROOT
            for tok in toks[i : i + depth]:
                out = kids[node]
                child = None if out is None else out.get(tok)
                if out is None or child is None:
                    raise ValueError("remove() of tokens that were never added")
                counts[child] -= 1
                if counts[child] == 0:
                    del out[tok]
                    if not out:
                        kids[node] = None
                    self.drop(child)
                    break
                node = child

    def match(self, context: Sequence[int], max_len: int, min_len: int) -> tuple[int, CountNode | None]:
        """The longest suffix of ``context`` (``min_len`` to ``max_len`` tokens) that occurred with a continuation:
        (its length, its node), or (0, None)."""
        kids = self.kids
        longest = min(max_len, len(context), self.depth - 1)
        for n in range(longest, min_len - 1, -1):
            node: int | None = ROOT
            for tok in context[len(context) - n :]:
                out = kids[node]  # type: ignore[index]
                node = None if out is None else out.get(tok)
                if node is None:
                    break
            if node is not None and kids[node]:
                return n, CountNode(self, node)
        return 0, None


class SuffixStream:
    """Feeds one growing token sequence into a trie a token at a time: O(depth) per token."""

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self.fed = 0
        self._open: list[int] = []  # nodes of the current suffixes of length 1..depth-1, shortest first

    def extend(self, tokens: Sequence[int]) -> None:
        """Feed ``tokens[self.fed:]`` (the caller passes the whole sequence so far)."""
        trie = self.trie
        counts, kids, new_node, keep = trie.counts, trie.kids, trie.new_node, trie.depth - 1
        opened = self._open
        for tok in tokens[self.fed :]:
            grown = []
            for node in (ROOT, *opened):  # the bump, inlined
                out = kids[node]
                if out is None:
                    out = kids[node] = {}
                child = out.get(tok)
                if child is None:
                    child = out[tok] = new_node()
                counts[child] += 1
                grown.append(child)
            opened = grown[:keep]
        self._open = opened
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
        # outputs are kept only once a lane serves the suffix drafter: until then the trie (~4 * 10^5 nodes for
        # 16k tokens, each output costing ~15-30 us a token on the lane thread) would be paid for by replicas that
        # never draft from it
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
