"""Prompt lookup (docs/algorithms.md §10.1): find the last n tokens (n from ``ngram_max`` down to ``ngram_min``)
earlier in the request's prompt and output, and propose what followed them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.spec_decode.suffix_tree import CountNode, CountTrie


class TokenArray:
    """One growing token sequence as an int64 array, fed only the tokens added since the last call (lookup reads the
    whole context every step: converting it whole each step cost O(context) there)."""

    def __init__(self) -> None:
        self.data = np.empty(0, dtype=np.int64)
        self.fed = 0

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """``tokens`` [L] (the caller passes the whole sequence so far, grown from the last one) as an array."""
        n = len(tokens)
        if n > self.data.shape[0]:  # room doubles: O(1) a token over a sequence's life
            grown = np.empty(max(n, 2 * self.data.shape[0], 64), dtype=np.int64)
            grown[: self.fed] = self.data[: self.fed]
            self.data = grown
        self.data[self.fed : n] = tokens[self.fed :]
        self.fed = n
        return self.data[:n]


def match_starts(tokens: np.ndarray, ngram_max: int, ngram_min: int) -> tuple[int, np.ndarray]:
    """(n, starts): the longest n in [ngram_min, ngram_max] whose last-n-gram occurs earlier in ``tokens`` [L], and
    where the continuation after each earlier occurrence starts (ascending); (0, []) without a match.

    Candidates are narrowed one token further back at a time, so the cost is O(L) for the first token and
    O(matches) after it.
    """
    n_tok = tokens.shape[0]
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) if n_tok > 1 else np.empty(0, dtype=np.int64)  # [m]
    best_n, best = 0, np.empty(0, dtype=np.int64)
    n = 1
    while ends.size and n <= ngram_max:
        if n >= ngram_min:
            best_n, best = n, ends
        if n >= n_tok - 1:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[n_tok - 1 - n]]
        n += 1
    return best_n, best + 1


def continuation_trie(tokens: np.ndarray, starts: np.ndarray, max_len: int, max_matches: int) -> CountNode:
    """The continuations after the ``max_matches`` most recent matches, merged into a trie whose counts say how
    many of them pass through each node; the most recent is inserted first (it wins ties)."""
    trie = CountTrie()
    for s in starts[::-1][:max_matches].tolist():
        trie.add_path(tokens[s : s + max_len].tolist())
    return trie.root
