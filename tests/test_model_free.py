"""Model-free drafting: prompt lookup and suffix tries (the maths, the bounded cache), lossless in the engine."""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.config import Drafter, EngineConfig, ModelFreeConfig, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from specserve.sampling import SamplingParams
from specserve.spec_decode.count_tree import (
    chain_from_counts,
    count_draft_q,
    depth_mass,
    empirical_q,
    share,
    tree_from_counts,
)
from specserve.spec_decode.lookup import TokenArray, continuation_trie, match_starts
from specserve.spec_decode.model_free import ModelFreeDrafter
from specserve.spec_decode.suffix_tree import ROOT, CountNode, CountTrie, SuffixCache, SuffixStream, SuffixTrie

from .conftest import greedy_reference

# --- prompt lookup ---------------------------------------------------------------------------------------------------


def test_a_token_array_fed_a_growing_sequence_is_that_sequence() -> None:
    """Prompt lookup's array of a request's tokens is fed only what each step adds (it was converted whole each
    step): the same values as converting the whole sequence, as it grows by 0-40 tokens a step past its room."""
    rng = np.random.default_rng(0)
    tokens: list[int] = []
    array = TokenArray()
    for _ in range(60):
        tokens += rng.integers(0, 50_000, rng.integers(0, 41)).tolist()
        got = array.extend(tokens)
        assert got.dtype == np.int64 and np.array_equal(got, np.asarray(tokens, dtype=np.int64))


def test_prompt_lookup_keeps_one_array_a_sequence_fed_only_what_each_step_adds() -> None:
    """The drafter's array of a sequence lives across its steps (built anew each step it cost O(context) a step)
    and goes with the sequence; what it drafts is what the whole context's array gives."""
    spec = SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.lookup)
    drafter = ModelFreeDrafter(None)
    context = [5, 6, 7, 8, 1, 2, 5, 6]
    first = drafter.propose(3, context, spec, 4, want_q=False)
    array = drafter.arrays[3]
    assert first is not None and first.tokens[:2] == [7, 8] and array.fed == len(context)
    context += [7, 8, 1]
    second = drafter.propose(3, context, spec, 4, want_q=False)
    assert drafter.arrays[3] is array and array.fed == len(context)
    assert second is not None and second.tokens[:2] == [2, 5]
    drafter.release([3])
    assert 3 not in drafter.arrays


def test_match_starts_finds_the_longest_ngram_and_every_earlier_occurrence() -> None:
    #                 0  1  2  3  4  5  6  7  8  9 10
    tokens = np.array([7, 1, 2, 3, 9, 1, 2, 3, 5, 2, 3])
    n, starts = match_starts(tokens, ngram_max=4, ngram_min=1)
    assert n == 2 and starts.tolist() == [4, 8]  # "2 3" occurs at 2-3 and 6-7; "1 2 3" is not the suffix
    n, starts = match_starts(tokens, ngram_max=1, ngram_min=1)
    assert n == 1 and starts.tolist() == [4, 8]  # "3" at 3 and 7
    assert match_starts(np.array([1, 2, 3, 4]), 4, 1)[0] == 0  # nothing repeats
    assert match_starts(tokens, ngram_max=4, ngram_min=3)[0] == 0  # the longest match (2) is below the minimum
    n, starts = match_starts(np.array([4, 4, 4, 4]), 3, 1)  # overlapping occurrences count
    assert n == 3 and starts.tolist() == [3]


def test_continuation_trie_counts_matches_and_the_most_recent_wins_ties() -> None:
    tokens = np.array([1, 2, 8, 9, 1, 2, 5, 6, 1, 2, 8, 4, 1, 2])
    n, starts = match_starts(tokens, 2, 2)
    assert n == 2 and starts.tolist() == [2, 6, 10]
    root = continuation_trie(tokens, starts, max_len=2, max_matches=8)
    assert root.as_dict() == {8: (2, {9: (1, {}), 4: (1, {})}), 5: (1, {6: (1, {})})}
    chain = chain_from_counts(root, max_depth=4, min_score=0.0)
    assert chain.tokens == [8, 4]  # 8 is the most frequent; below it 9 and 4 tie and 4 is the more recent
    assert chain.scores == pytest.approx([2 / 3, 1 / 3])
    assert chain_from_counts(root, 4, min_score=0.5).tokens == [8]  # 2/3 * 1/2 < 0.5
    recent = continuation_trie(tokens, starts, max_len=2, max_matches=1)
    assert recent.as_dict() == {8: (1, {4: (1, {})})}


# --- trees from counts -----------------------------------------------------------------------------------------------


def _counts(spec: dict[int, tuple[int, dict]]) -> CountNode:
    trie = CountTrie()

    def fill(node: int, spec: dict[int, tuple[int, dict]]) -> None:
        for tok, (count, sub) in spec.items():
            child = trie.bump(node, tok)
            trie.counts[child] = count
            fill(child, sub)

    fill(trie.root.id, spec)
    return trie.root


# root -> a (6) -> c (6) -> e (3), f (3); root -> b (2) -> d (2)
TREE = _counts({10: (6, {12: (6, {14: (3, {}), 15: (3, {})})}), 11: (2, {13: (2, {})})})


def test_tree_from_counts_keeps_the_best_paths_parents_first() -> None:
    t = tree_from_counts(TREE, max_depth=5, budget=10, min_score=0.0, ddd_threshold=None)
    assert t.tokens == [10, 12, 14, 15, 11, 13]  # best first: 0.75, 0.75, 0.375, 0.375, 0.25, 0.25
    assert t.parents == [0, 1, 2, 2, 0, 5]
    assert t.scores == pytest.approx([0.75, 0.75, 0.375, 0.375, 0.25, 0.25])
    assert t.depth == 3
    small = tree_from_counts(TREE, max_depth=5, budget=4, min_score=0.0, ddd_threshold=None)
    assert small.tokens == [10, 12, 14]  # the budget counts the root
    shallow = tree_from_counts(TREE, max_depth=1, budget=10, min_score=0.0, ddd_threshold=None)
    assert shallow.tokens == [10, 11]
    pruned = tree_from_counts(TREE, max_depth=5, budget=10, min_score=0.3, ddd_threshold=None)
    assert pruned.tokens == [10, 12, 14, 15]


def _tree_by_the_rule(root: CountNode, max_depth: int, budget: int, min_score: float, prob) -> list[tuple]:
    """EAGLE-2's reranking over counts, every child of every expanded node offered to one best-first heap."""
    heap: list[tuple] = []
    order = iter(range(10**9))

    def offer(node: CountNode, index: int, score: float, depth: int) -> None:
        if depth >= max_depth or not node.has_children:
            return
        items = sorted(node.successors(), key=lambda kv: -kv[1])
        total = sum(c for _, c in items)
        for tok, c in items:
            if score * prob(c, total, depth + 1) >= min_score:
                p = score * prob(c, total, depth + 1)
                heapq.heappush(heap, (-p, depth + 1, next(order), index, tok, node.child(tok)))

    kept: list[tuple] = []
    offer(root, 0, 1.0, 0)
    while heap and len(kept) < budget - 1:
        neg, depth, _, parent, tok, node = heapq.heappop(heap)
        kept.append((tok, parent, -neg))
        offer(node, len(kept), -neg, depth)
    return kept


def test_trees_over_diffuse_counts_keep_what_the_reranking_rule_keeps() -> None:
    """Each node now offers only its best budget - 1 children and scores each distinct count once (a match
    followed by 10k different tokens took 41 ms a step): the trees are the rule's, for count shares and for a
    score that is not monotone in the count, with ties and a floor."""
    rng = random.Random(3)

    def bumpy(count: int, total: int, depth: int) -> float:  # not monotone in the count; many ties
        return ((count * 7919 + depth) % 5 + 1) / 6 * count / total

    for _ in range(40):
        trie = SuffixTrie(depth=6)
        vocab = rng.choice([3, 8, 40])
        for _ in range(rng.choice([5, 60])):
            trie.add([rng.randrange(vocab) for _ in range(rng.randint(2, 30))])
        roots = [trie.match([tok], 1, 1)[1] for tok in range(vocab)]
        for root in (r for r in roots if r is not None):
            for prob in (share, bumpy):
                budget, depth, floor = rng.choice([2, 3, 5, 17]), rng.randint(1, 5), rng.choice([0.0, 0.01, 0.2])
                got = tree_from_counts(root, depth, budget, floor, None, prob)
                want = _tree_by_the_rule(root, depth, budget, floor, prob)
                assert list(zip(got.tokens, got.parents, got.scores, strict=True)) == want


def test_ddd_stop_on_counts_cuts_below_the_first_light_depth() -> None:
    # root -> 10 (4) -> 12 (4) -> 14 (2) -> 16, 15 (2) -> 17; root -> 11 (4). Depth masses 1, .5, .5, .5
    tree = _counts({10: (4, {12: (4, {14: (2, {16: (2, {})}), 15: (2, {17: (2, {})})})}), 11: (4, {})})
    full = tree_from_counts(tree, max_depth=8, budget=20, min_score=0.0, ddd_threshold=None)
    assert full.tokens == [10, 11, 12, 14, 15, 16, 17] and full.depth == 4
    depths = [1, 1, 2, 3, 3, 4, 4]
    assert depth_mass(full.scores, depths, 1) == pytest.approx(0.0)
    assert depth_mass(full.scores, depths, 2) == pytest.approx(math.log(0.5))
    assert depth_mass(full.scores, depths, 5) == -math.inf
    assert tree_from_counts(tree, 8, 20, 0.0, ddd_threshold=-0.8).tokens == full.tokens  # log .5 >= -0.8
    cut = tree_from_counts(tree, 8, 20, 0.0, ddd_threshold=-0.5)  # H_2 < x: depth 2 stays, deeper goes
    assert cut.tokens == [10, 11, 12] and cut.parents == [0, 0, 1] and cut.depth == 2


def test_empirical_q_leaves_alpha_for_unseen_tokens() -> None:
    idx, prob = empirical_q(TREE, alpha=1.0, k=8)
    assert idx == [10, 11] and prob == pytest.approx([6 / 9, 2 / 9])
    q = count_draft_q(chain_from_counts(TREE, 3, 0.0), alpha=1.0, k=1)
    assert q.nodes == [0, 1, 2]  # the last node (14) has no continuation: no q there
    assert q.idx is not None and q.prob is not None and q.widths is None
    assert q.idx.tolist() == [[10], [12], [14]]
    assert q.prob[:, 0].tolist() == pytest.approx([6 / 9, 6 / 7, 3 / 7])
    # rows of several widths: each row reads back as its node's own top-k, whatever the padding
    wide = count_draft_q(chain_from_counts(TREE, 3, 0.0), alpha=1.0, k=8)
    rows = [(ids.tolist(), ps.tolist()) for ids, ps in map(wide.row, range(len(wide.nodes)))]
    want = [empirical_q(node, 1.0, 8) for node in chain_from_counts(TREE, 3, 0.0).nodes if node.has_children]
    assert [ids for ids, _ in rows] == [ids for ids, _ in want]
    assert [ps for _, ps in rows] == [pytest.approx(ps) for _, ps in want]
    assert wide.widths is not None and len(set(wide.widths)) > 1


# --- suffix tries ----------------------------------------------------------------------------------------------------


def _substring_counts(seqs: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                out[tuple(s[i:j])] += 1
    return out


def _trie_counts(trie: SuffixTrie) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()

    def walk(node: CountNode, path: tuple[int, ...]) -> None:
        for tok, child in node.items():
            out[(*path, tok)] = child.count
            walk(child, (*path, tok))

    walk(trie.root, ())
    return out


def test_suffix_trie_counts_every_substring_and_streams_equal_batch_inserts() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    trie = SuffixTrie(depth=5)
    for s in seqs:
        trie.add(s)
    assert _trie_counts(trie) == _substring_counts(seqs, 5)
    assert trie.num_nodes == len(_substring_counts(seqs, 5))
    streamed = SuffixTrie(depth=5)
    stream = SuffixStream(streamed)
    grown: list[int] = []
    for tok in seqs[0]:
        grown.append(tok)
        stream.extend(grown)
    assert _trie_counts(streamed) == _substring_counts(seqs[:1], 5)
    for s in seqs[1:]:
        trie.remove(s)
    assert trie.root.as_dict() == streamed.root.as_dict() and trie.num_nodes == streamed.num_nodes


def test_count_trie_moves_between_one_child_and_several() -> None:
    """A node's children live inline while it has one and in a dict while it has several; cutting and re-adding
    children moves it between the two without changing what it reports, a cut frees its whole subtree (branches
    included) once, and freed ids are reused."""
    trie = CountTrie()
    a = trie.bump(ROOT, 7)
    assert trie.kids[ROOT] is None and trie.children(ROOT) == [(7, a)] and trie.child(ROOT, 7) == a
    assert trie.child(ROOT, 8) is None and not trie.has_children(a)
    trie.add_path([7, 1, 2])  # 7 again, then a chain below it
    trie.add_path([7, 3])  # and a branch: 7's children move to a dict
    b = trie.bump(ROOT, 0)  # token 0: a token like any other, not "no child"
    assert trie.kids[ROOT] == {7: a, 0: b} and trie.root.successors() == [(7, 3), (0, 1)]
    assert trie.root.child(7).successors() == [(1, 1), (3, 1)] and trie.num_nodes == 5
    trie.cut(ROOT, 7)  # 7, 7 1, 7 1 2 and 7 3 go; the root is back to one child
    assert trie.kids[ROOT] is None and trie.children(ROOT) == [(0, b)] and trie.num_nodes == 1
    assert (a, b, trie.capacity) == (1, 5, 6) and sorted(trie.free) == [1, 2, 3, 4]
    trie.add_path([5, 6, 4])
    assert trie.capacity == 6 and len(trie.free) == 1  # three of the freed ids, reused
    assert trie.root.as_dict() == {0: (1, {}), 5: (1, {6: (1, {4: (1, {})})})}
    trie.cut(ROOT, 0)
    trie.cut(ROOT, 5)
    assert trie.num_nodes == 0 and not trie.has_children(ROOT) and trie.root.as_dict() == {}
    assert sorted(trie.free) == [1, 2, 3, 4, 5]
    with pytest.raises(KeyError):
        trie.root.child(5)


def test_tries_hold_nothing_the_collector_tracks() -> None:
    """The collector's full passes hold the GIL, so every lane of a replica: a trie's nodes must not be objects they
    visit (docs/benchmarks.md, "The suffix cache's cost")."""
    rng = random.Random(2)
    gc.collect()
    before = len(gc.get_objects())
    trie, own, cache = SuffixTrie(depth=8), SuffixTrie(depth=8), SuffixCache(max_tokens=500, depth=8)
    tokens = [rng.randrange(300) for _ in range(2000)]
    trie.add(tokens)
    SuffixStream(own).extend(tokens)
    for i in range(0, 2000, 100):
        cache.add(tokens[i : i + 100], salt=str(i % 3))
    assert trie.num_nodes > 10_000 and own.num_nodes == trie.num_nodes
    gc.collect()
    assert len(gc.get_objects()) - before < 100  # the tries, their stores and the cache's kept outputs


def test_suffix_match_is_the_longest_suffix_with_a_continuation() -> None:
    trie = SuffixTrie(depth=6)
    trie.add([1, 2, 3, 4, 9, 2, 3, 5])
    n, node = trie.match([7, 1, 2, 3], max_len=4, min_len=1)
    assert n == 3 and node is not None and node.as_dict() == {4: (1, {9: (1, {2: (1, {})})})}
    n, node = trie.match([8, 2, 3], max_len=4, min_len=1)
    assert n == 2 and node is not None and set(node.as_dict()) == {4, 5}
    assert trie.match([8, 2, 3], max_len=4, min_len=3) == (0, None)
    assert trie.match([5], max_len=4, min_len=1) == (0, None)  # 5 occurs, but nothing followed it


def test_suffix_cache_stays_within_its_bound_and_evicts_oldest_first() -> None:
    """One token bound and one eviction order across the salts' partitions; each partition's trie is exactly the trie
    of its kept outputs, and a partition whose outputs are all evicted is gone."""
    rng = random.Random(1)
    cache = SuffixCache(max_tokens=300, depth=8)
    added = []
    for i in range(400):  # a long run: ~12k tokens through a 300-token cache
        out = [rng.randrange(50) for _ in range(rng.randrange(1, 60))]
        salt = None if i < 300 else rng.choice([None, "a", "b"])  # "a" and "b" from step 300 on
        cache.add(out, salt)
        added.append((salt, out))
        assert cache.tokens <= 300 and cache.num_nodes <= cache.max_nodes
        for trie in cache.tries.values():  # evicted nodes' storage is reused, so it stays within the bound too
            assert trie.capacity == 1 + trie.num_nodes + len(trie.free) <= 1 + cache.max_nodes
    kept = list(cache.entries)
    assert kept == added[-len(kept) :]  # the newest ones, in order
    for salt in (None, "a", "b"):
        fresh = SuffixTrie(depth=8)
        for _, out in (e for e in kept if e[0] == salt):
            fresh.add(out)
        trie = cache.trie(salt)
        assert trie is not None and trie.root.as_dict() == fresh.root.as_dict() and trie.num_nodes == fresh.num_nodes
    for _ in range(20):  # the unsalted outputs age out
        cache.add(list(range(30)), "a")
    assert cache.trie(None) is None and set(cache.tries) == {"a"}
    big = SuffixCache(max_tokens=10, depth=4)
    big.add(list(range(25)))  # longer than the whole cache: its last 10 tokens
    assert list(big.entries) == [(None, list(range(15, 25)))]
    SuffixCache(max_tokens=0, depth=4).add([1, 2])  # a disabled cache takes nothing


@pytest.mark.parametrize("cut", ["insert", "eviction"])
def test_an_add_cut_short_leaves_the_cache_exactly_the_outputs_it_keeps(
    cut: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception (Ctrl-C on the lane thread) inside an add left its trie, counts and lists disagreeing for good:
    cut in the insert, the trie kept counts of an output no eviction would remove (drafted from forever); cut in
    an eviction, the count stayed high (the 100-token cache held 20) and the evicted output drafted on."""
    cache = SuffixCache(max_tokens=100, depth=4)
    cache.add(list(range(10, 90)))  # 80 tokens
    real_bump, real_remove, calls = SuffixTrie.bump, SuffixTrie.remove, [0]

    def bump(trie: SuffixTrie, node: Any, tok: int) -> Any:
        calls[0] += 1
        if calls[0] == 10:
            raise KeyboardInterrupt
        return real_bump(trie, node, tok)

    def remove(trie: SuffixTrie, tokens: Any) -> None:
        raise KeyboardInterrupt

    if cut == "insert":
        monkeypatch.setattr(SuffixTrie, "bump", bump)
        added = [1, 2, 3] * 5  # fits beside the 80: nothing evicted, the insert cut
    else:
        monkeypatch.setattr(SuffixTrie, "remove", remove)
        added = [1, 2, 3] * 10  # evicts the 80
    with pytest.raises(KeyboardInterrupt):
        cache.add(added)
    monkeypatch.setattr(SuffixTrie, "bump", real_bump)
    monkeypatch.setattr(SuffixTrie, "remove", real_remove)
    kept = [tokens for _, tokens in cache.entries]
    assert cache.tokens == sum(map(len, kept))
    fresh = SuffixTrie(depth=4)
    for tokens in kept:
        fresh.add(tokens)
    trie = cache.trie(None)
    assert (trie.root.as_dict() if trie is not None else {}) == fresh.root.as_dict()
    for _ in range(3):
        cache.add([40] * 5)
    assert cache.tokens == sum(len(t) for _, t in cache.entries) <= 100


def test_a_salt_that_once_held_a_long_output_gives_its_storage_back() -> None:
    """A trie kept the storage of its largest size while any output of its salt stayed cached: salts that each
    once held a long output and still held a short one pinned that storage each, well past ``max_nodes`` in all."""
    rng = random.Random(2)
    cache = SuffixCache(max_tokens=2000, depth=8)
    salts: list[str] = []
    for i in range(12):
        salts.append(f"s{i}")
        cache.add([rng.randrange(5000) for _ in range(1500)], salts[-1])  # ~12k nodes, evicted by the short ones
        for s in salts:
            cache.add([rng.randrange(5000) for _ in range(2)], s)
    assert len(cache.tries) == 12  # every salt still holds outputs
    storage = sum(t.capacity for t in cache.tries.values())
    assert storage <= 2 * cache.max_nodes, storage  # (before: ~140k ids for 16k nodes at most)
    for salt in salts:  # the rebuilt tries are the tries of the kept outputs
        fresh = SuffixTrie(depth=8)
        for _, out in (e for e in cache.entries if e[0] == salt):
            fresh.add(out)
        trie = cache.trie(salt)
        assert trie is not None and trie.root.as_dict() == fresh.root.as_dict() and trie.num_nodes == fresh.num_nodes


def test_a_repetitive_output_is_not_re_read_at_every_eviction() -> None:
    """A rebuild re-reads every kept token (depth nodes each); a repetitive output keeps few nodes for many tokens,
    so evicting a short output beside it rebuilt the trie from all of them, each eviction (16k tokens: 0.5 s under
    the lock every lane shares). Now the free ids must outnumber that re-reading first."""
    cache = SuffixCache(max_tokens=4000, depth=24)
    cache.add(list(range(100, 300)), "a")  # ~4.5k nodes
    cache.add([5] * 3700, "a")  # 3700 tokens, a few dozen nodes
    trie = cache.trie("a")
    cache.add(list(range(1000, 1200)), "b")  # evicts the 200 varied tokens: ~4.5k ids freed, 3700 x 24 to re-read
    assert cache.trie("a") is trie and trie.num_nodes < 100
    fresh = SuffixTrie(depth=24)
    fresh.add([5] * 3700)
    assert trie.root.as_dict() == fresh.root.as_dict()


def test_many_salts_each_once_holding_a_long_output_stay_within_a_multiple_of_the_bound() -> None:
    """Tries under 4096 ids were never rebuilt: 120 salts each keeping a short output after a 500-token one held
    ~490k ids for a 16k-node bound, 31x, growing with the number of salts (anyone may send a new cache_salt)."""
    rng = random.Random(3)
    cache = SuffixCache(max_tokens=2000, depth=8)
    for i in range(120):
        cache.add([rng.randrange(50000) for _ in range(500)], f"tenant{i}")
        for j in range(i + 1):
            cache.add([rng.randrange(50000)], f"tenant{j}")  # every tenant keeps a short output cached
    for _ in range(4):
        cache.add([rng.randrange(50000) for _ in range(400)])  # the long ones age out
    assert len(cache.tries) > 100
    storage = sum(t.capacity for t in cache.tries.values())
    assert storage <= 9 * cache.max_nodes, storage  # (the rebuild's rule: 4 x live nodes + 4 x depth a trie, or
    # live nodes + depth x kept tokens)
    for salt, trie in cache.tries.items():
        fresh = SuffixTrie(depth=8)
        for _, out in (e for e in cache.entries if e[0] == salt):
            fresh.add(out)
        assert trie.root.as_dict() == fresh.root.as_dict() and trie.num_nodes == fresh.num_nodes


def test_model_free_config_validates() -> None:
    with pytest.raises(ValueError, match="ngram_min"):
        ModelFreeConfig(ngram_min=5, ngram_max=3)
    with pytest.raises(ValueError, match="continuation"):
        ModelFreeConfig(ngram_max=8, suffix_depth=8)


# --- in the engine ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab() -> LlamaModel:
    """Vocabulary 8: greedy output falls into repeats quickly, so lookup finds matches."""
    return tiny_model(tiny_config(vocab_size=8), seed=0)


PROMPTS = [[1, 2, 3, i % 8, 4] for i in range(4)]
SPECS = [
    SpecConfig(method=SpecMethod.chain, sl=6),
    SpecConfig(method=SpecMethod.eagle2, tree_depth=6, budget=16),
    SpecConfig(method=SpecMethod.ddd, budget=16),
    SpecConfig(method=SpecMethod.chain, policy=SLPolicyKind.dsde),
    SpecConfig(method=SpecMethod.ddd, budget=16, policy=SLPolicyKind.dsde),
]


@pytest.mark.parametrize("drafter", [Drafter.lookup, Drafter.suffix])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method.value}-{s.policy.value}")
def test_model_free_drafting_is_greedy_equal_without_a_draft_model(
    small_vocab: LlamaModel, drafter: Drafter, spec: SpecConfig
) -> None:
    spec = spec.model_copy(update={"drafter": drafter})
    engine = Engine(small_vocab, None, speculation=spec, eos_token_ids=set(), max_batch_size=4)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=60, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(small_vocab, prompt, 60)
    assert sum(o.stats.accepted for o in outs) >= 40  # it drafted, and drafts were accepted
    drafter_state = engine.loop.model_free
    assert engine.loop.target.cache.num_free == 4 and not drafter_state.streams and not drafter_state.arrays


@dataclass
class _DraftLog:
    """What each drafter was asked and gave in an engine's steps (``_spy_on_drafters``)."""

    model_depths: list[int] = field(default_factory=list)  # the depth of every ProposeItem the draft model got
    model_sizes: list[int] = field(default_factory=list)  # drafted nodes of each of its proposals
    free_sizes: list[int] = field(default_factory=list)  # drafted nodes of each model-free proposal (matches only)

    def clear(self) -> None:
        self.model_depths.clear()
        self.model_sizes.clear()
        self.free_sizes.clear()


def _spy_on_drafters(engine: Engine) -> _DraftLog:
    log = _DraftLog()
    model_propose, free_propose = engine.loop.draft.propose, engine.loop.model_free.propose  # type: ignore[union-attr]

    def model(items):  # type: ignore[no-untyped-def]
        log.model_depths.extend(it.depth for it in items)
        out = model_propose(items)
        log.model_sizes.extend(len(p.tokens) for p in out)
        return out

    def free(*a, **k):  # type: ignore[no-untyped-def]
        p = free_propose(*a, **k)
        if p is not None:
            log.free_sizes.append(len(p.tokens))
        return p

    engine.loop.draft.propose = model  # type: ignore[union-attr,method-assign]
    engine.loop.model_free.propose = free  # type: ignore[method-assign]
    return log


def test_lookup_falls_back_to_the_draft_model_and_both_stay_in_step(small_vocab: LlamaModel) -> None:
    """Lookup where it matches, the draft model elsewhere: the model's cache skips the steps lookup drafted."""
    draft = noisy_copy(small_vocab, 0.05, seed=2)
    spec = SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.lookup, model_max_sl=2)
    engine = Engine(small_vocab, None, draft=draft, speculation=spec, eos_token_ids=set(), max_batch_size=4)
    log = _spy_on_drafters(engine)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=60, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(small_vocab, prompt, 60)
    assert len(log.model_depths) >= 10 and len(log.free_sizes) >= 10
    # model_max_sl caps the model alone (1: where a sequence has 2 tokens left, room for one draft)
    assert max(log.model_depths) == 2 and set(log.model_depths) <= {1, 2} and max(log.free_sizes) == 4
    no_fallback = spec.model_copy(update={"model_fallback": False})
    log.clear()
    engine.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True), speculation=no_fallback)
    assert not log.model_depths and len(log.free_sizes) >= 5


def test_the_target_sends_a_draft_head_features_only_for_requests_it_may_draft_for() -> None:
    """A lookup request without the model fallback never drafts with the head, yet the target returned its hidden
    states every step (across actors in Serve) and the sequence queued them."""
    from specserve.models.tiny import tiny_head
    from specserve.workers.target import TargetWorker

    target = tiny_model(seed=0)
    spec = SpecConfig(method=SpecMethod.chain, sl=3, drafter=Drafter.lookup, model_fallback=False)
    engine = Engine(target, None, draft=tiny_head(target), speculation=spec, eos_token_ids=set(), max_batch_size=2)
    asked: list[tuple[bool, bool]] = []  # per verified item: (features asked, returned)
    verify = TargetWorker.verify

    def spy(self: TargetWorker, items):  # type: ignore[no-untyped-def]
        outs = verify(self, items)
        asked.extend((i.features is not None, o.features is not None) for i, o in zip(items, outs, strict=True))
        return outs

    prompt = [5, 9, 33, 71, 2] * 3
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TargetWorker, "verify", spy)
        out = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert len(asked) >= 2 and asked == [(False, False)] * len(asked)
        assert out.token_ids == greedy_reference(target, prompt, 12)
        asked.clear()
        with_head = spec.model_copy(update={"model_fallback": True})
        engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True), speculation=with_head)
        assert asked and all(a == (True, True) for a in asked)


def test_the_model_budget_caps_the_draft_models_trees_alone(small_vocab: LlamaModel) -> None:
    """Lookup trees up to ``budget``, the draft model's fallback trees up to ``model_budget``: both lossless."""
    draft = noisy_copy(small_vocab, 0.05, seed=2)
    spec = SpecConfig(method=SpecMethod.ddd, budget=12, model_budget=4, beam_width=3, drafter=Drafter.lookup)
    assert (spec.model_tree_budget, spec.model_depth(11), spec.static_depth) == (4, 3, 11)
    engine = Engine(small_vocab, None, draft=draft, speculation=spec, eos_token_ids=set(), max_batch_size=4)
    log = _spy_on_drafters(engine)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=60, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(small_vocab, prompt, 60)
    assert max(log.model_depths) <= 3  # no level past T - 1
    assert len(log.model_sizes) >= 10 and max(log.model_sizes) == 3  # T = 4: the root and 3 drafted nodes
    assert len(log.free_sizes) >= 10 and max(log.free_sizes) > 3
    with pytest.raises(ValueError, match="model_budget"):
        SpecConfig(model_budget=1)


def test_per_request_model_free_drafting_on_a_plain_engine(small_vocab: LlamaModel) -> None:
    engine = Engine(small_vocab, None, eos_token_ids=set())
    spec = SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.suffix)
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True), speculation=spec)[0]
    assert out.token_ids == greedy_reference(small_vocab, PROMPTS[0], 40) and out.stats.accepted > 0
    with pytest.raises(InvalidRequestError, match="needs a draft model"):
        engine.submit(PROMPTS[0], speculation=SpecConfig(method=SpecMethod.chain))
    EngineConfig(speculation=spec)  # no draft model needed
    with pytest.raises(ValueError, match="needs a draft model"):
        EngineConfig(speculation=SpecConfig(method=SpecMethod.chain))


def test_the_cross_request_cache_drafts_a_repeated_request() -> None:
    """A vocabulary of 64 rarely repeats within one answer; the same request again is drafted from the cache."""
    target = tiny_model(tiny_config(vocab_size=64), seed=0)
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = SpecConfig(method=SpecMethod.chain, sl=8, drafter=Drafter.suffix)
    engine = Engine(target, None, speculation=spec, eos_token_ids=set())
    first = engine.generate(prompt, params)[0]
    second = engine.generate(prompt, params)[0]
    assert first.token_ids == second.token_ids == greedy_reference(target, prompt, 40)
    assert first.stats.accepted <= 10 and second.stats.accepted >= 30
    assert second.stats.target_forwards <= 10
    # once the cache is in use (this engine's default drafts from it), every finished request feeds it, whoever
    # drafted it (here: nobody)
    fresh = Engine(target, None, speculation=spec, eos_token_ids=set())
    fresh.generate(prompt, params, speculation=SpecConfig(method=SpecMethod.none))
    assert fresh.generate(prompt, params)[0].stats.accepted >= 30
    alone = Engine(target, None, speculation=spec, eos_token_ids=set(), suffix_cache_tokens=0)
    assert alone.generate(prompt, params)[0].stats.accepted == alone.generate(prompt, params)[0].stats.accepted


def test_the_engine_drafts_a_repeat_from_the_cache_only_under_its_salt() -> None:
    """``cache_salt`` in-process, as the API's field: a repeat under another salt (or none) drafts as the first
    request did, from its own tokens; under the first one's salt it drafts from its answer. Not a non-empty string:
    refused at the call."""
    target = tiny_model(tiny_config(vocab_size=64), seed=0)
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = SpecConfig(method=SpecMethod.chain, sl=8, drafter=Drafter.suffix)
    engine = Engine(target, None, speculation=spec, eos_token_ids=set())
    first = engine.generate(prompt, params, cache_salt="a")[0]
    assert first.stats.accepted <= 10
    for other in ("b", None):
        again = engine.generate(prompt, params, cache_salt=other)[0]
        assert again.token_ids == first.token_ids and again.stats.accepted == first.stats.accepted, other
    stream = engine.stream(prompt, params, cache_salt="a")
    assert sum(out.stats.accepted for out in stream if out.finished) >= 30
    for bad in ("", 3):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            engine.submit(prompt, params, cache_salt=bad)  # type: ignore[arg-type]


def test_outputs_are_kept_only_once_a_request_may_draft_from_the_cache() -> None:
    """An engine whose requests never ask for the suffix drafter builds no cache (its trie's nodes would cost the
    lane thread and the collector for nothing); one that does keeps every output from then on."""
    target = tiny_model(tiny_config(vocab_size=64), seed=0)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = Engine(target, None, eos_token_ids=set())  # plain decoding by default
    cache = engine.loop.model_free.cache
    assert cache is not None
    engine.generate([[3, 1, 4], [1, 5, 9]], params)
    engine.generate([2, 6, 5], params, speculation=SpecConfig(method=SpecMethod.chain, drafter=Drafter.lookup))
    assert cache.tokens == 0 and not cache.entries
    suffix = SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.suffix)
    engine.generate([3, 5, 8], params, speculation=suffix)
    engine.generate([9, 7, 9], params)  # plain again: kept now
    assert cache.tokens == 40 and len(cache.entries) == 2


def test_a_diffuse_cache_match_leaves_the_requests_own_draft_its_turn() -> None:
    """The cache's longer match ("9 1 2", followed by eleven different tokens) is too diffuse to draft; the
    request's own shorter one ("1 2", followed by "3 5 6 7") used to be skipped for it."""
    context = [1, 2, 3, 5, 6, 7, 9, 1, 2]
    shares = ModelFreeConfig(calibrated=False)  # count shares: the diffuse match's nodes are below min_score
    spec = SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.suffix, model_free=shares)
    alone = ModelFreeDrafter(None).propose(0, context, spec, 4, want_q=False)
    assert alone is not None and alone.tokens == [3, 5, 6, 7]
    cache = SuffixCache(1000, spec.model_free.suffix_depth)
    for t in range(20, 31):
        cache.add([9, 1, 2, t])
    drafter = ModelFreeDrafter(cache)
    drafter.use_cache()
    trie = cache.trie()
    assert trie is not None and trie.match(context, 4, 1)[0] > 2  # the cache's match is the longer one
    proposal = drafter.propose(0, context, spec, 4, want_q=False)
    assert proposal is not None and proposal.tokens == [3, 5, 6, 7]


def test_a_diffuse_own_match_leaves_the_caches_match_its_turn() -> None:
    """The other way round: the request's own match ("1 2", followed by eleven different tokens) ties the cache's
    and is too diffuse to draft; the cache's ("1 2", followed by "7 8 9") used to be skipped for it."""
    context = [t for k in range(20, 31) for t in (1, 2, k)] + [1, 2]
    spec = SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.suffix)
    assert ModelFreeDrafter(None).propose(0, context, spec, 4, want_q=False) is None  # too diffuse alone
    cache = SuffixCache(1000, spec.model_free.suffix_depth)
    cache.add([1, 2, 7, 8, 9])
    drafter = ModelFreeDrafter(cache)
    drafter.use_cache()
    proposal = drafter.propose(0, context, spec, 4, want_q=False)
    assert proposal is not None and proposal.tokens == [7, 8, 9]


def test_lookup_sampling_keeps_the_targets_distribution(small_vocab: LlamaModel) -> None:
    """Chi-square of the first two sampled tokens against the target's exact distributions, with lookup drafts
    (deterministic, q = 1) accepted on the way."""
    prompt = PROMPTS[0] + greedy_reference(small_vocab, PROMPTS[0], 10)  # ends in a run of 2s: lookup drafts 2s
    n = 3000
    # count shares: measured acceptance would soon stop drafting on this random model, and the test needs drafts
    shares = ModelFreeConfig(calibrated=False)
    spec = SpecConfig(method=SpecMethod.chain, sl=3, drafter=Drafter.lookup, model_free=shares)
    engine = Engine(small_vocab, None, speculation=spec, eos_token_ids=set(), max_batch_size=64)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=2, ignore_eos=True) for i in range(n)]
    outs = engine.generate([prompt] * n, params)
    accepted = sum(o.stats.accepted for o in outs)
    assert accepted > n // 10, accepted  # drafts were accepted, so the test sees verification
    first = np.zeros(8)
    pairs = np.zeros((8, 8))
    for o in outs:
        first[o.token_ids[0]] += 1
        pairs[o.token_ids[0], o.token_ids[1]] += 1
    p1 = _next_probs(small_vocab, [prompt])[0]
    p2 = _next_probs(small_vocab, [[*prompt, t] for t in range(8)])
    assert chisquare(first, p1 * n).pvalue > 1e-3
    cells = [_lumped(pairs[t], pairs[t].sum() * p2[t]) for t in range(8) if pairs[t].sum() >= 50]
    assert len(cells) >= 2
    obs = np.concatenate([o for o, _ in cells])
    exp = np.concatenate([e for _, e in cells])
    assert chisquare(obs, exp, ddof=len(cells) - 1).pvalue > 1e-3


def _lumped(obs: np.ndarray, exp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells expecting fewer than 5 draws merged into one (and that into the smallest other if still below 5)."""
    small = exp < 5
    o, e = list(obs[~small]), list(exp[~small])
    if small.any():
        o.append(obs[small].sum())
        e.append(exp[small].sum())
        if e[-1] < 5:
            i = int(np.argmin(e[:-1]))
            o[i] += o.pop()
            e[i] += e.pop()
    return np.array(o), np.array(e)


def _next_probs(model: LlamaModel, contexts: list[list[int]]) -> np.ndarray:
    rows = []
    for ctx in contexts:
        cache = model.new_cache(1, 64)
        slot = cache.allocate()
        with torch.inference_mode():
            logits = model(ForwardBatch.build(cache, [slot], [ctx], device=model.device), cache)
        rows.append(torch.softmax(logits[-1].double(), -1).numpy())
    p = np.stack(rows)
    return p / p.sum(-1, keepdims=True)


def test_a_request_drafts_only_from_outputs_of_its_own_cache_salt() -> None:
    """The cross-request cache is partitioned by salt: an output kept under "a" drafts for "a" only, not for "b"
    nor for requests without a salt (and an unsalted output not for "a")."""
    shares = ModelFreeConfig(calibrated=False)  # whole continuations: the salts decide, not their chances
    spec = SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.suffix, model_free=shares)
    cache = SuffixCache(1000, spec.model_free.suffix_depth)
    drafter = ModelFreeDrafter(cache)
    drafter.use_cache()
    drafter.remember([40, 41, 42, 43, 44, 45], "a")
    drafter.remember([50, 51, 52, 53, 54, 55], None)
    a = drafter.propose(0, [7, 40, 41], spec, 4, want_q=False, cache_salt="a")
    assert a is not None and a.tokens == [42, 43, 44, 45]
    assert drafter.propose(1, [7, 40, 41], spec, 4, want_q=False, cache_salt="b") is None
    assert drafter.propose(2, [7, 40, 41], spec, 4, want_q=False) is None
    unsalted = drafter.propose(3, [7, 50, 51], spec, 4, want_q=False)
    assert unsalted is not None and unsalted.tokens == [52, 53, 54, 55]
    assert drafter.propose(4, [7, 50, 51], spec, 4, want_q=False, cache_salt="a") is None
