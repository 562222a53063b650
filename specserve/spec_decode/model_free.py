"""The model-free drafter (docs/algorithms.md §10): prompt lookup and suffix trees, in the router's process.

It needs no model and no KV cache: per sequence it keeps an index of the tokens the step loop passes in (a token
array for lookup, a suffix trie for the suffix drafter); every finished request's output joins the replica's
``SuffixCache`` (``remember``). A proposal is a ``Proposal`` like any drafter's, verified by the same lossless rule;
its verify result comes back (``observe``) to the ``CountCalibration`` that scores the next trees' nodes.
"""

from __future__ import annotations

from specserve.config import Drafter, ModelFreeConfig, SpecConfig
from specserve.messages import Proposal
from specserve.spec_decode.count_calibration import Cell, CountCalibration, node_cell
from specserve.spec_decode.count_tree import (
    CountDraft,
    NodeProb,
    chain_from_counts,
    count_draft_q,
    draft_from_counts,
    share,
)
from specserve.spec_decode.lookup import TokenArray, continuation_trie, match_starts
from specserve.spec_decode.suffix_tree import CountNode, SuffixCache, SuffixStream, SuffixTrie


class ModelFreeDrafter:
    def __init__(self, cache: SuffixCache | None = None) -> None:
        self.cache = cache  # recent outputs across requests (None: the request's own tokens only)
        self.streams: dict[int, SuffixStream] = {}  # the suffix drafter's trie over each request's tokens
        self.arrays: dict[int, TokenArray] = {}  # prompt lookup's array of each request's tokens
        self.calibration = CountCalibration()  # nodes' acceptance as measured (ModelFreeConfig.calibrated)
        self._cells: dict[int, tuple[Proposal, list[Cell]]] = {}  # each sequence's last calibrated proposal

    def propose(
        self,
        seq_id: int,
        tokens: list[int],
        spec: SpecConfig,
        depth: int,
        *,
        want_q: bool,
        cache_salt: str | None = None,
        min_prob: float | None = None,
    ) -> Proposal | None:
        """A draft of at most ``depth`` levels after ``tokens`` (the committed tokens, ending with the root), or
        None where nothing matches (or nothing scores at least the floor); ``want_q``: ship the empirical q for
        DSDE's KLD; ``cache_salt``: the partition of the cross-request cache this request may draft from;
        ``min_prob``: this step's measured tree floor (None: the spec's ``tree_min_prob``)."""
        self._cells.pop(seq_id, None)
        cfg = spec.model_free
        floor = max(cfg.min_score, spec.tree_min_prob if min_prob is None else min_prob)
        if spec.drafter == Drafter.lookup:
            arr = self.arrays.setdefault(seq_id, TokenArray()).extend(tokens)
            n, starts = match_starts(arr, cfg.ngram_max, cfg.ngram_min)
            root = continuation_trie(arr, starts, depth, cfg.max_matches) if n else None
            return self._first(seq_id, [(n, root)], spec, depth, want_q, floor)
        stream = self.streams.get(seq_id)
        if stream is None or stream.trie.depth != cfg.suffix_depth:
            stream = self.streams[seq_id] = SuffixStream(SuffixTrie(cfg.suffix_depth))
        stream.extend(tokens)
        n_own, own = stream.trie.match(tokens, cfg.ngram_max, cfg.ngram_min)
        if self.cache is None:
            return self._first(seq_id, [(n_own, own)], spec, depth, want_q, floor)
        with self.cache.lock:  # the cache's nodes may change under another lane's thread
            trie = self.cache.trie(cache_salt)
            n_cached, cached = (0, None) if trie is None else trie.match(tokens, cfg.ngram_max, cfg.ngram_min)
            # the longer match drafts, ties going to the request's own tokens; a match whose continuations are too
            # diffuse to draft leaves the other its turn
            order = [(n_cached, cached), (n_own, own)] if n_cached > n_own else [(n_own, own), (n_cached, cached)]
            return self._first(seq_id, order, spec, depth, want_q, floor)

    def observe(self, seq_id: int, proposal: Proposal | None, accepted: list[int]) -> None:
        """The verify result of a step's proposal for the sequence (any drafter's: only this drafter's last
        calibrated proposal is counted)."""
        mine = self._cells.pop(seq_id, None)
        if mine is not None and proposal is mine[0]:
            self.calibration.observe(mine[1], proposal.parents, accepted)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.streams.pop(seq_id, None)
            self.arrays.pop(seq_id, None)
            self._cells.pop(seq_id, None)

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

    def _first(
        self,
        seq_id: int,
        matches: list[tuple[int, CountNode | None]],
        spec: SpecConfig,
        depth: int,
        want_q: bool,
        floor: float,
    ) -> Proposal | None:
        """The tree of the first match (match length, root) that keeps a node; where none does, every
        ``TRY_EVERY``-th time the first match's best node alone, as a try (docs/algorithms.md §10.6)."""
        cfg = spec.model_free
        # DDD's rule saves draft forwards, which a count tree does not run; with scores that are acceptance chances
        # the floor alone weighs each node against its verify row (docs/algorithms.md §10.6)
        x = None if cfg.calibrated else spec.ddd_threshold
        for n, root in matches:
            if root is not None:
                draft = draft_from_counts(root, spec.method, depth, spec.budget, floor, x, self._scorer(cfg, n))
                if draft.tokens:
                    return self._emit(seq_id, draft, n, spec, want_q)
        first = next(((n, root) for n, root in matches if root is not None and root.has_children), None)
        if cfg.calibrated and first is not None:  # a cell whose rate fell below the floor could never recover
            n, root = first
            tried = chain_from_counts(root, 1, 0.0, self._scorer(cfg, n))
            if self.calibration.decline(draft_cells(tried, n)[0]):
                return self._emit(seq_id, tried, n, spec, want_q)
        return None

    def _scorer(self, cfg: ModelFreeConfig, match_len: int) -> NodeProb:
        if not cfg.calibrated:
            return share
        cal = self.calibration

        def node_prob(count: int, total: int, level: int) -> float:
            return cal.acceptance(node_cell(match_len, count, total, level), count, total)

        return node_prob

    def _emit(self, seq_id: int, draft: CountDraft, match_len: int, spec: SpecConfig, want_q: bool) -> Proposal:
        q = count_draft_q(draft, spec.model_free.alpha, spec.kld_top_k) if want_q else None
        proposal = Proposal(seq_id, draft.tokens, draft.parents, depth=draft.depth, draft_q=q)
        if spec.model_free.calibrated:
            self._cells[seq_id] = (proposal, draft_cells(draft, match_len))
        return proposal


def draft_cells(draft: CountDraft, match_len: int) -> list[Cell]:
    """The calibration cell of each drafted node."""
    depths = [0]
    cells = []
    totals: dict[int, int] = {}  # each parent's children counted once, not once per drafted child
    for node, parent in enumerate(draft.parents, start=1):
        depths.append(depths[parent] + 1)
        if parent not in totals:
            totals[parent] = sum(c for _, c in draft.nodes[parent].successors())
        cells.append(node_cell(match_len, draft.nodes[node].count, totals[parent], depths[node]))
    return cells
