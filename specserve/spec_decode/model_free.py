"""The model-free drafter (docs/algorithms.md §10): prompt lookup and suffix trees, in the router's process.

It needs no model and no KV cache: per sequence it keeps an index of the tokens the step loop passes in (a token
array for lookup, a suffix trie for the suffix drafter); every finished request's output joins the replica's
``SuffixCache`` (``remember``). A proposal is a ``Proposal`` like any drafter's, verified by the same lossless rule.
"""

from __future__ import annotations

import numpy as np

from specserve.config import Drafter, SpecConfig
from specserve.messages import Proposal
from specserve.spec_decode.count_tree import count_draft_q, draft_from_counts
from specserve.spec_decode.lookup import continuation_trie, match_starts
from specserve.spec_decode.suffix_tree import CountNode, SuffixCache, SuffixStream, SuffixTrie


class ModelFreeDrafter:
    def __init__(self, cache: SuffixCache | None = None) -> None:
        self.cache = cache  # recent outputs across requests (None: the request's own tokens only)
        self.streams: dict[int, SuffixStream] = {}  # the suffix drafter's trie over each request's tokens

    def propose(
        self,
        seq_id: int,
        tokens: list[int],
        spec: SpecConfig,
        depth: int,
        *,
        want_q: bool,
        cache_salt: str | None = None,
    ) -> Proposal | None:
        """A draft of at most ``depth`` levels after ``tokens`` (the committed tokens, ending with the root), or
        None where nothing matches; ``want_q``: ship the empirical q for DSDE's KLD; ``cache_salt``: the partition
        of the cross-request cache this request may draft from."""
        cfg = spec.model_free
        if spec.drafter == Drafter.lookup:
            arr = np.asarray(tokens, dtype=np.int64)
            n, starts = match_starts(arr, cfg.ngram_max, cfg.ngram_min)
            root = continuation_trie(arr, starts, depth, cfg.max_matches) if n else None
            return _proposal(seq_id, root, spec, depth, want_q)
        stream = self.streams.get(seq_id)
        if stream is None or stream.trie.depth != cfg.suffix_depth:
            stream = self.streams[seq_id] = SuffixStream(SuffixTrie(cfg.suffix_depth))
        stream.extend(tokens)
        n_own, own = stream.trie.match(tokens, cfg.ngram_max, cfg.ngram_min)
        if self.cache is None:
            return _proposal(seq_id, own, spec, depth, want_q)
        with self.cache.lock:  # the cache's nodes may change under another lane's thread
            trie = self.cache.trie(cache_salt)
            n_cached, cached = (0, None) if trie is None else trie.match(tokens, cfg.ngram_max, cfg.ngram_min)
            # the longer match drafts, ties going to the request's own tokens; a match whose continuations are too
            # diffuse to draft leaves the other its turn
            for root in (cached, own) if n_cached > n_own else (own, cached):
                if (proposal := _proposal(seq_id, root, spec, depth, want_q)) is not None:
                    return proposal
        return None

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.streams.pop(seq_id, None)

    def use_cache(self) -> None:
        """A sequence that may draft from the cross-request cache was admitted: finished outputs are kept from now
        on (by every lane sharing the cache)."""
        if self.cache is not None:
            self.cache.in_use = True

    def remember(self, output: list[int], cache_salt: str | None = None) -> None:
        """A finished (or aborted) request's output joins the cross-request cache's partition of its salt, whoever
        drafted it, once the cache is in use."""
        if self.cache is not None and self.cache.in_use:
            self.cache.add(output, cache_salt)


def _proposal(seq_id: int, root: CountNode | None, spec: SpecConfig, depth: int, want_q: bool) -> Proposal | None:
    if root is None:
        return None
    cfg = spec.model_free
    draft = draft_from_counts(root, spec.method, depth, spec.budget, cfg, spec.ddd_threshold)
    if not draft.tokens:
        return None
    q = count_draft_q(draft, cfg.alpha, spec.kld_top_k) if want_q else None
    return Proposal(seq_id, draft.tokens, draft.parents, depth=draft.depth, draft_q=q)
