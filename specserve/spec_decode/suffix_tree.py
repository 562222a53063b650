"""Count tries (docs/algorithms.md §10.2): a suffix trie with occurrence counts over a request's own tokens, grown a
token at a time, a bounded cache of recent requests' outputs shared by a replica's lanes, and the small tries prompt
lookup merges its matches into.

A depth-D suffix trie holds every substring of length <= D of what was inserted; a node's count is the number of its
occurrences. Matching the longest suffix of the context finds a node whose children are every token that followed
that suffix before, with how often: the empirical next-token distribution the drafter proposes from.

Nodes are integer ids into flat storage: the counts in an ``array``; a node's only child, the common case deep in a
suffix trie, in two more arrays; the children of a node with several in a dict of ints. None of these is an object
the cyclic collector tracks, so a trie of 10^5-10^6 nodes adds next to nothing to the collector's full passes
(which hold the GIL, and so every lane of a replica), and a node costs tens of bytes, not an object and a dict.
``CountNode`` is a read-only view of one node for the drafters.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Iterator, Sequence

ROOT = 0
NO_CHILD = ROOT  # in ``CountTrie.only_child``: the root is never anyone's child


class CountTrie:
    """A trie of token counts; node ``ROOT`` is the root, freed ids are reused. A node has no children
    (``only_child`` NO_CHILD, ``kids`` None), one (``only_child`` and ``only_token``) or several (``kids``)."""

    def __init__(self) -> None:
        self.counts = array("q", [0])  # [nodes]: occurrences of each node's path (the root's is unused)
        self.only_child = array("q", [NO_CHILD])  # [nodes]: the child of a node with exactly one
        self.only_token = array("q", [0])  # [nodes]: its token
        self.kids: list[dict[int, int] | None] = [None]  # [nodes]: token -> child id of a node with several
        self.free: list[int] = []
        self.num_nodes = 0  # excluding the root

    @property
    def root(self) -> CountNode:
        return CountNode(self, ROOT)

    @property
    def capacity(self) -> int:
        """Node ids allocated so far, the root's and freed ones included."""
        return len(self.counts)

    def new_node(self) -> int:
        self.num_nodes += 1
        if self.free:
            return self.free.pop()
        self.counts.append(0)
        self.only_child.append(NO_CHILD)
        self.only_token.append(0)
        self.kids.append(None)
        return len(self.counts) - 1

    def bump(self, node: int, token: int) -> int:
        """Count one more occurrence of ``token`` after ``node``: its child's id. The trie's whole insert cost."""
        kids = self.kids[node]
        if kids is not None:
            child = kids.get(token)
            if child is None:
                child = kids[token] = self.new_node()
        else:
            child = self.only_child[node]
            if child == NO_CHILD:
                child = self.only_child[node] = self.new_node()
                self.only_token[node] = token
            elif self.only_token[node] != token:  # a second child: the node's children move to a dict
                first, child = child, self.new_node()
                self.kids[node] = {self.only_token[node]: first, token: child}
                self.only_child[node] = NO_CHILD
        self.counts[child] += 1
        return child

    def child(self, node: int, token: int) -> int | None:
        kids = self.kids[node]
        if kids is not None:
            return kids.get(token)
        child = self.only_child[node]
        return child if child != NO_CHILD and self.only_token[node] == token else None

    def children(self, node: int) -> list[tuple[int, int]]:
        """(token, child id) of every child, in insertion order."""
        kids = self.kids[node]
        if kids is not None:
            return list(kids.items())
        child = self.only_child[node]
        return [] if child == NO_CHILD else [(self.only_token[node], child)]

    def has_children(self, node: int) -> bool:
        return self.kids[node] is not None or self.only_child[node] != NO_CHILD

    def add_path(self, tokens: Sequence[int], node: int = ROOT) -> None:
        """Count one occurrence of every prefix of ``tokens`` below ``node``."""
        for tok in tokens:
            node = self.bump(node, tok)

    def cut(self, node: int, token: int) -> None:
        """Unlink ``node``'s child after ``token`` and free its subtree."""
        kids = self.kids[node]
        if kids is None:
            child = self.only_child[node]
            self.only_child[node] = NO_CHILD
        else:
            child = kids.pop(token)
            if len(kids) == 1:  # back to one child
                [(self.only_token[node], self.only_child[node])] = kids.items()
                self.kids[node] = None
        kids_of, only, counts, free, stack = self.kids, self.only_child, self.counts, self.free, [child]
        while stack:
            n = stack.pop()
            while n != NO_CHILD:  # down the chain of only children, branches onto the stack
                kids = kids_of[n]
                if kids is not None:
                    stack.extend(kids.values())
                    kids_of[n] = None
                nxt, only[n], counts[n] = only[n], NO_CHILD, 0
                free.append(n)
                self.num_nodes -= 1
                n = nxt


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
        return self.trie.has_children(self.id)

    def child(self, token: int) -> CountNode:
        """The child after ``token``; KeyError where that token never followed this node."""
        child = self.trie.child(self.id, token)
        if child is None:
            raise KeyError(token)
        return CountNode(self.trie, child)

    def successors(self) -> list[tuple[int, int]]:
        """(token, count) of every child, in insertion order."""
        counts = self.trie.counts
        return [(t, counts[c]) for t, c in self.trie.children(self.id)]

    def items(self) -> Iterator[tuple[int, CountNode]]:
        return ((t, CountNode(self.trie, c)) for t, c in self.trie.children(self.id))

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
        SuffixStream(self).extend(tokens)  # the substrings ending at each token in turn: the same counts

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``; nodes whose count drops to 0 go (a child never outcounts its parent)."""
        counts, find, toks = self.counts, self.child, list(tokens)
        for i in range(len(toks)):
            node = ROOT
            for tok in toks[i : i + self.depth]:
                child = find(node, tok)
                if child is None:
                    raise ValueError("remove() of tokens that were never added")
                counts[child] -= 1
                if counts[child] == 0:
                    self.cut(node, tok)
                    break
                node = child

    def match(self, context: Sequence[int], max_len: int, min_len: int) -> tuple[int, CountNode | None]:
        """The longest suffix of ``context`` (``min_len`` to ``max_len`` tokens) that occurred with a continuation:
        (its length, its node), or (0, None)."""
        longest = min(max_len, len(context), self.depth - 1)
        for n in range(longest, min_len - 1, -1):
            node = ROOT
            for tok in context[len(context) - n :]:
                found = self.child(node, tok)
                if found is None:
                    break
                node = found
            else:
                if self.has_children(node):
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
        bump, keep, opened = self.trie.bump, self.trie.depth - 1, self._open
        for tok in tokens[self.fed :]:
            opened = [bump(node, tok) for node in (ROOT, *opened)][:keep]
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
        self.by_salt: dict[str | None, deque[list[int]]] = {}  # each salt's entries, oldest first
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
            try:
                self._add(entry, salt)
            except BaseException:  # cut short (an error, Ctrl-C on the lane thread): the tries, counts and lists
                self._rebuild()  # had disagreed for good (an evicted output drafted on, the bound shrunk)
                raise

    def _add(self, entry: list[int], salt: str | None) -> None:
        shrunk: set[str | None] = set()
        while self.entries and self.tokens + len(entry) > self.max_tokens:
            old_salt, old = self.entries.popleft()
            self.by_salt[old_salt].popleft()
            self.tries[old_salt].remove(old)
            if not self.by_salt[old_salt]:  # a salt's last output gone: so is its trie
                del self.tries[old_salt], self.by_salt[old_salt]
                shrunk.discard(old_salt)
            else:
                shrunk.add(old_salt)
            self.tokens -= len(old)
        for s in shrunk:
            self._compact(s)
        if salt not in self.tries:
            self.tries[salt], self.by_salt[salt] = SuffixTrie(self.depth), deque()
        self.tries[salt].add(entry)
        self.entries.append((salt, entry))
        self.by_salt[salt].append(entry)
        self.tokens += len(entry)

    def _rebuild(self) -> None:
        """Every partition made again from ``entries``: the cache is once more exactly the outputs it keeps."""
        self.by_salt = {}
        for salt, tokens in self.entries:
            self.by_salt.setdefault(salt, deque()).append(tokens)
        self.tries = {salt: self._trie_of(kept) for salt, kept in self.by_salt.items()}
        self.tokens = sum(len(tokens) for _, tokens in self.entries)

    def _compact(self, salt: str | None) -> None:
        """Rebuild a salt's trie from its live outputs once most of its node ids are free: a trie keeps the storage
        of its largest size, so without this every salt that once held a long output would pin that much memory
        (``max_nodes`` bounds the nodes in use, not the storage). A rebuild re-reads every token the salt keeps,
        up to depth nodes each, so it waits until the free ids outnumber that too: then it costs at most the ids
        freed since the last one, amortised nothing (a repetitive output keeps few nodes for many tokens, and
        16k of them cost 0.5 s under the lock every eviction). Each trie then holds at most 4 x its live nodes +
        4 x depth ids, or its live nodes + depth x its kept tokens; all of them together at most 9 x
        ``max_nodes`` (a salt holds a token at least); a floor of a fixed 4096 ids a trie had let every salt keep
        up to that many, thousands of salts far past the bound."""
        trie = self.tries[salt]
        free = trie.capacity - trie.num_nodes
        if trie.capacity <= 4 * (trie.num_nodes + self.depth) or free < self.depth * sum(map(len, self.by_salt[salt])):
            return
        self.tries[salt] = self._trie_of(self.by_salt[salt])

    def _trie_of(self, kept: deque[list[int]]) -> SuffixTrie:
        trie = SuffixTrie(self.depth)
        for tokens in kept:
            trie.add(tokens)
        return trie
