"""Verification is lossless: chi-square of emitted tokens against the target, greedy equality, tree helpers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.sampling import SamplingParams, process_logits
from specserve.spec_decode.draft_sampling import draft_sample_sparse, sparse_topk
from specserve.spec_decode.draft_tree import ROOT, DraftTree, step_layout
from specserve.spec_decode.synthetic import synthetic_verify
from specserve.spec_decode.verify import VerifyResult, inverse_cdf_sample, verify_chain_sampled, verify_tree

NUM_DRAWS = 100_000
P_THRESHOLD = 1e-3  # a correct implementation fails one check with probability 1e-3
MIN_EXPECTED = 5.0  # chi-square needs this many expected counts per cell
SAMPLING = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray, tested: Sequence[int] = ()) -> float:
    """counts [G, V] observed tokens in G groups, probs [G, V] each group's claimed distribution.

    Groups with too few draws for the chi-square approximation are dropped (those in ``tested`` must not be); a
    token of probability 0 gives p-value 0. Degrees of freedom: (cells - 1) minus (G - 1) fitted group totals.
    """
    probs = probs.astype(np.float64)
    probs = probs / probs.sum(-1, keepdims=True)  # totals must match to 1e-8 for chisquare
    if counts[probs == 0].any():
        return 0.0
    totals = counts.sum(-1, keepdims=True)  # [G, 1]
    expected = totals * probs  # [G, V]
    support = probs > 0
    keep = np.array([e[s].min() >= MIN_EXPECTED for e, s in zip(expected, support, strict=True)])
    assert keep.any(), "no group has enough draws"
    assert keep[list(tested)].all(), f"too few draws to test groups {[g for g in tested if not keep[g]]}"
    obs, exp = counts[keep][support[keep]], expected[keep][support[keep]]
    return float(chisquare(obs, exp, ddof=int(keep.sum()) - 1).pvalue)


def _count_by_node(results: list[VerifyResult], num_nodes: int, vocab: int) -> np.ndarray:
    """counts [T, V]: how often the token emitted right after reaching node j was v (j = root, then accepted nodes)."""
    counts = np.zeros((num_nodes, vocab), dtype=np.int64)
    for res in results:
        for node, token in zip([ROOT, *res.accepted_nodes], res.tokens, strict=True):
            counts[node, token] += 1
    return counts


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return process_logits(logits, SAMPLING)


# --- DraftTree ------------------------------------------------------------------------------------------------------

#        0
#      / | \ \
#     1  2  3  7        (7 repeats 2's token: unreachable)
#    / \  \
#   4   5  6
#   |      |
#   8      9
TREE_TOKENS = [0, 3, 5, 7, 1, 2, 3, 5, 4, 4]
TREE_PARENTS = [0, 0, 0, 0, 1, 1, 2, 0, 4, 6]


def _tree() -> DraftTree:
    return DraftTree(torch.tensor(TREE_TOKENS), torch.tensor(TREE_PARENTS))


def test_tree_helpers() -> None:
    tree = _tree()
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for j in range(10):
        node = j
        expected[j, node] = True
        while node != ROOT:
            node = TREE_PARENTS[node]
            expected[j, node] = True
    assert torch.equal(tree.ancestor_mask(), expected)
    assert torch.equal(tree.ancestor_mask(pad=2), torch.cat([torch.ones(10, 2, dtype=torch.bool), expected], 1))
    assert tree.depths().tolist() == [0, 1, 1, 1, 2, 2, 2, 1, 3, 3]
    assert not tree.is_chain()
    assert tree.num_drafted == 9


def test_chain_construction() -> None:
    chain = DraftTree.chain(11, [4, 6, 8])
    assert chain.tokens.tolist() == [11, 4, 6, 8]
    assert chain.parents.tolist() == [0, 0, 1, 2]
    assert chain.is_chain()
    assert chain.depths().tolist() == [0, 1, 2, 3]
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(DraftTree.chain(11, torch.tensor([4, 6, 8])).tokens, chain.tokens)
    root_only = DraftTree.chain(11, [])
    assert root_only.num_drafted == 0 and root_only.is_chain() and root_only.depths().tolist() == [0]


def test_tree_validation() -> None:
    with pytest.raises(ValueError):
        DraftTree(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError):
        DraftTree(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]))
    bad_order = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 0]))
    with pytest.raises(ValueError):
        verify_tree(bad_order, torch.full((3, 4), 0.25), None)
    with pytest.raises(ValueError, match="parents"):
        step_layout(bad_order, 1, 5)  # the target lays out a step before it verifies
    with pytest.raises(ValueError):
        verify_tree(_tree(), torch.full((3, 4), 0.25), None)


# --- sequential rule == single draw ---------------------------------------------------------------------------------


def _sequential_rule(p: torch.Tensor, children: list[int]) -> tuple[list[float], torch.Tensor]:
    """Exact outcome of the sequential rule of docs/algorithms.md §1.2 at one node: p [V] -> (probability that each
    child is accepted, distribution [V] of the token that follows the node, accepted child or residual)."""
    residual = p.double().clone()
    reach = 1.0  # probability that every earlier child was rejected
    accept_probs = []
    emitted = torch.zeros_like(residual)
    for token in children:
        accept = float(residual[token] / residual.sum())
        accept_probs.append(reach * accept)
        emitted[token] += reach * accept
        reach *= 1.0 - accept
        residual[token] = 0.0
    emitted += reach * residual / residual.sum()
    return accept_probs, emitted


def test_sequential_rule_matches_single_draw() -> None:
    """The single draw (child = first child carrying y ~ p) has the same law as the sequential rejection rule."""
    gen = torch.Generator().manual_seed(1)
    p = _probs(torch.randn(1, 12, generator=gen))[0]
    children = [3, 7, 3, 0]
    accept_probs, emitted = _sequential_rule(p, children)
    assert torch.allclose(emitted, p.double(), atol=1e-6)
    p_list = p.tolist()
    assert accept_probs == pytest.approx([p_list[3], p_list[7], 0.0, p_list[0]], abs=1e-6)
    # and verify_tree's single draw accepts each of a node's children as often as the sequential rule says
    distinct = [3, 7, 0]
    tree = DraftTree(torch.tensor([5, *distinct]), torch.tensor([0, 0, 0, 0]))  # (the root its own parent)
    rows = p.unsqueeze(0).expand(tree.num_nodes, -1)  # [T, V]
    firsts = Counter(
        tuple(r.accepted_tokens[:1]) for r in (verify_tree(tree, rows, gen) for _ in range(NUM_DRAWS // 5))
    )
    rule, _ = _sequential_rule(p, distinct)
    counts = np.array([[firsts[(t,)] for t in distinct] + [firsts[()]]])
    assert _chi2_pvalue(counts, np.array([[*rule, 1 - sum(rule)]])) > P_THRESHOLD


# --- chi-square: the emitted tokens follow the target -------------------------------------------------------------


def test_greedy_draft_chain_distribution() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab, sl = 8, 3
    p = _probs(0.7 * torch.randn(sl + 1, vocab, generator=gen))  # [SL+1, V]
    q = _probs(0.7 * torch.randn(sl, vocab, generator=gen) + p[:sl].log())  # [SL, V], a noisy draft
    chain = DraftTree.chain(0, q.argmax(-1))
    results = [verify_tree(chain, p, gen) for _ in range(NUM_DRAWS)]
    counts = _count_by_node(results, chain.num_nodes, vocab)  # [SL+1, V]
    assert counts[1:].sum() > NUM_DRAWS // 10, "too few acceptances to test the later positions"
    assert _chi2_pvalue(counts[:1], p[:1].numpy()) > P_THRESHOLD
    assert _chi2_pvalue(counts[1:], p[1:].numpy()) > P_THRESHOLD


def test_tree_distribution() -> None:
    gen = torch.Generator().manual_seed(3)
    tree = _tree()
    vocab = 10
    p = _probs(0.5 * torch.randn(tree.num_nodes, vocab, generator=gen))  # [T, V]
    # the paths to the depth-3 nodes 8 (tokens 3, 1, 4) and 9 (5, 3, 4) made likely: at random rows they were
    # reached ~40 times in 100k, too few for their rows to be tested (only that they were reached)
    for row, tokens in {0: [3, 5], 1: [1], 4: [4], 2: [3], 6: [4]}.items():
        p[row] *= 0.2
        p[row, tokens] += 0.8 / len(tokens)
    p[7] = torch.nn.functional.one_hot(torch.tensor(9), vocab).float()  # node 7 is unreachable: any use shows
    results = [verify_tree(tree, p, gen) for _ in range(NUM_DRAWS)]
    counts = _count_by_node(results, tree.num_nodes, vocab)  # [T, V]
    assert counts[7].sum() == 0
    assert _chi2_pvalue(counts[:1], p[:1].numpy(), tested=[0]) > P_THRESHOLD
    # every reachable node's row (groups: nodes 1-9)
    assert _chi2_pvalue(counts[1:], p[1:].numpy(), tested=[0, 1, 2, 3, 4, 5, 7, 8]) > P_THRESHOLD


def _markov_tables(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Toy target and draft that condition on the last token: (p_table [V, V], q_table [V, V]) with row = last token.
    The target uses top-k so that some tokens have probability 0."""
    target_logits = torch.randn(vocab, vocab, generator=gen)
    p_table = process_logits(target_logits, SamplingParams(temperature=1.0, top_k=vocab - 2))
    q_table = _probs(target_logits + torch.randn(vocab, vocab, generator=gen))
    return p_table, q_table


def _sampled_chain_inputs(
    gen: torch.Generator, num: int, sl: int, k: int, root: int, p_table: torch.Tensor, q_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``num`` independent draft chains, vectorised: drafted [N, SL], q_idx/q_prob [N, SL, K], p [N, SL+1, V]."""
    q_idx_table, q_prob_table = sparse_topk(q_table, k)  # [V, K]
    last = torch.full((num,), root)
    drafted, q_idx, q_prob = [], [], []
    for _ in range(sl):
        q_idx.append(q_idx_table[last])
        q_prob.append(q_prob_table[last])
        last = draft_sample_sparse(q_idx[-1], q_prob[-1], gen)
        drafted.append(last)
    prefix = torch.cat([torch.full((num, 1), root), torch.stack(drafted, 1)], 1)  # [N, SL+1]
    return torch.stack(drafted, 1), torch.stack(q_idx, 1), torch.stack(q_prob, 1), p_table[prefix]


def _count_by_last_token(results: list[VerifyResult], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(first [V], later [V, V]): counts of the first emitted token, and of each later one by the token before it."""
    first = np.zeros(vocab, dtype=np.int64)
    later = np.zeros((vocab, vocab), dtype=np.int64)
    for res in results:
        tokens = res.tokens
        first[tokens[0]] += 1
        for prev, token in pairwise(tokens):
            later[prev, token] += 1
    return first, later


def test_sampled_chain_distribution() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab, sl, k, root = 10, 3, 6, 0
    p_table, q_table = _markov_tables(gen, vocab)
    drafted, q_idx, q_prob, p = _sampled_chain_inputs(gen, NUM_DRAWS, sl, k, root, p_table, q_table)
    results = [verify_chain_sampled(drafted[n], q_idx[n], q_prob[n], p[n], gen) for n in range(NUM_DRAWS)]
    num_accepted = np.array([res.num_accepted for res in results])
    assert 0 < num_accepted.mean() < sl and (num_accepted == sl).any()
    first, later = _count_by_last_token(results, vocab)
    assert _chi2_pvalue(first[None], p_table[root][None].numpy()) > P_THRESHOLD
    assert _chi2_pvalue(later, p_table.numpy()) > P_THRESHOLD


def test_wrong_variants_fail_the_checks() -> None:
    """The checks have power: simulate classic bugs on the same inputs and require the chi-square to reject them."""
    gen = torch.Generator().manual_seed(5)
    vocab, sl, k, root = 10, 1, 6, 0
    p_table, q_table = _markov_tables(gen, vocab)
    drafted, _, _, _ = _sampled_chain_inputs(gen, NUM_DRAWS, sl, k, root, p_table, q_table)
    x = drafted[:, 0]  # [N]
    p0 = p_table[root]  # [V]

    def first_pvalue(tokens: torch.Tensor) -> float:
        return _chi2_pvalue(np.bincount(tokens.numpy(), minlength=vocab)[None], p0[None].numpy())

    # accept every draft
    assert first_pvalue(x) < P_THRESHOLD
    # on rejection, resample from p instead of the residual max(p - q, 0)
    q0 = sparse_topk(q_table[root : root + 1], k)
    q0_dense = torch.zeros(vocab).scatter(0, q0[0][0], q0[1][0])
    accepted = torch.rand(NUM_DRAWS, generator=gen) < p0[x] / q0_dense[x]
    resampled = torch.multinomial(p0, NUM_DRAWS, replacement=True, generator=gen)
    assert first_pvalue(torch.where(accepted, x, resampled)) < P_THRESHOLD
    # the token after an accepted draft drawn from the previous position's distribution (off by one)
    later = np.zeros((vocab, vocab), dtype=np.int64)
    np.add.at(later, (x.numpy(), torch.multinomial(p0, NUM_DRAWS, replacement=True, generator=gen).numpy()), 1)
    assert _chi2_pvalue(later, p_table.numpy()) < P_THRESHOLD


# --- deterministic cases ------------------------------------------------------------------------------------------


def test_identical_draft_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(6)
    vocab, sl = 12, 5
    p = _probs(torch.randn(sl + 1, vocab, generator=gen))  # [SL+1, V]
    q_idx = torch.arange(vocab).expand(sl, vocab)  # [SL, V]: q = p exactly, no truncation
    for _ in range(200):
        drafted = draft_sample_sparse(q_idx, p[:sl], gen)
        res = verify_chain_sampled(drafted, q_idx, p[:sl], p, gen)
        assert res.accepted_nodes == [1, 2, 3, 4, 5]
        assert res.accepted_tokens == drafted.tolist() and res.num_drafted == sl

    # tree whose target puts all its mass on one child at each level: the path to leaf 9, then the bonus
    tree = _tree()
    target_next = {0: 5, 2: 3, 6: 4, 9: 11}  # node -> token the target emits there
    p_tree = torch.full((tree.num_nodes, vocab), 1.0 / vocab)
    for node, token in target_next.items():
        p_tree[node] = torch.nn.functional.one_hot(torch.tensor(token), vocab).float()
    for _ in range(20):
        res = verify_tree(tree, p_tree, gen)
        assert res.accepted_nodes == [2, 6, 9] and res.tokens == [5, 3, 4, 11]


def test_all_zero_residual_falls_back_to_p() -> None:
    """A q with more mass than p everywhere (not a valid input, but reachable through float error) must not crash,
    and the token then comes from p: never one p rules out, and in p's proportions. The drafted token has p = 0,
    so every draw is a rejection with an all-zero residual."""
    gen = torch.Generator().manual_seed(7)
    vocab = 6
    logits = torch.randn(2, vocab, generator=gen)
    logits[0, [0, 3]] = -torch.inf
    p = _probs(logits)
    q_idx = torch.arange(vocab)[None]
    q_prob = 1.5 * p[:1]
    q_prob[0, 3] = 0.2  # the draft's token, which p rules out
    n = 3000
    counts = np.zeros(vocab)
    for _ in range(n):
        res = verify_chain_sampled(torch.tensor([3]), q_idx, q_prob, p, gen)
        assert res.accepted_nodes == []
        counts[res.next_token] += 1
    assert counts[0] == counts[3] == 0
    support = [1, 2, 4, 5]
    expected = p[0, support].double().numpy()
    assert chisquare(counts[support], expected / expected.sum() * n).pvalue > 1e-3


def test_verify_chain_sampled_refuses_a_draft_outside_q() -> None:
    """A drafted token q gives no mass could not have been drawn from q; p_x / 0 would accept it every time (here
    where p allows it 10% of the time), so the proposal is refused rather than silently biasing the output."""
    p = torch.tensor([[0.1, 0.9], [0.5, 0.5]])
    q_idx, q_prob = torch.tensor([[0, 1]]), torch.tensor([[0.0, 1.0]])
    with pytest.raises(ValueError, match="outside the support"):
        verify_chain_sampled(torch.tensor([0]), q_idx, q_prob, p, torch.Generator().manual_seed(0))
    res = verify_chain_sampled(torch.tensor([1]), q_idx, q_prob, p, torch.Generator().manual_seed(0))
    assert res.num_drafted == 1


def test_inverse_cdf_sample_edges() -> None:
    """u = 0 and the largest u below 1 land on the first and last tokens with mass, never on a zero one."""
    row = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0, 0.0])
    probs = torch.stack([row, row, 5.0 * row])  # rows need not be normalised
    u = torch.tensor([0.0, np.nextafter(1.0, 0.0), np.nextafter(1.0, 0.0)], dtype=torch.float64)
    assert inverse_cdf_sample(probs, u).tolist() == [1, 3, 3]
    assert inverse_cdf_sample(torch.zeros(1, 6), u[:1]).tolist() == [6]  # no mass: out of range, callers raise
    with pytest.raises(ValueError):
        verify_tree(DraftTree.chain(0, [1]), torch.tensor([[0.0, 0.0], [0.5, 0.5]]), None)


def _one_hot_rows(argmaxes: list[int], vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[N, V] greedy-processed target rows whose argmax is the given token."""
    logits = torch.randn(len(argmaxes), vocab, generator=gen)
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return process_logits(logits, GREEDY)


def test_greedy_tree_follows_target_argmax() -> None:
    gen = torch.Generator().manual_seed(8)
    tree, vocab = _tree(), 12
    # root -> node 2 (token 5) -> node 6 (token 3) -> node 9 (token 4) -> bonus 10
    argmax = [5, 0, 3, 0, 0, 0, 4, 0, 0, 10]
    res = verify_tree(tree, _one_hot_rows(argmax, vocab, gen), gen)
    assert res.accepted_nodes == [2, 6, 9] and res.tokens == [5, 3, 4, 10]
    # root -> node 1 (token 3) -> no child carries 6: stop with the correction 6
    argmax = [3, 6, 0, 0, 0, 0, 0, 0, 0, 0]
    res = verify_tree(tree, _one_hot_rows(argmax, vocab, gen), gen)
    assert res.accepted_nodes == [1] and res.tokens == [3, 6]
    # rejected at the first level: emit the target's argmax at the root
    argmax = [9, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    res = verify_tree(tree, _one_hot_rows(argmax, vocab, gen), gen)
    assert res.accepted_nodes == [] and res.tokens == [9] and res.num_drafted == 9


TOY_VOCAB = 16


def _toy_logits(seed: int, context: list[int]) -> torch.Tensor:
    """A deterministic toy language model: next-token logits [V] from the last 3 tokens and the position."""
    key = hash((seed, len(context), *context[-3:])) % 2**63
    return torch.randn(TOY_VOCAB, generator=torch.Generator().manual_seed(key))


def _toy_draft_logits(context: list[int]) -> torch.Tensor:
    """The target's logits plus noise: a draft that is often, not always, right."""
    return _toy_logits(0, context) + 0.8 * _toy_logits(1, context)


def _greedy_speculative(prompt: list[int], length: int, mode: str) -> tuple[list[int], int]:
    """Greedy speculative decoding of the toy models; mode chain | sampled_chain | tree. Returns (tokens, steps)."""
    gen = torch.Generator().manual_seed(0)
    context = list(prompt)
    steps = 0
    while len(context) < len(prompt) + length:
        if mode == "tree":  # two children per node, depth 2
            paths: list[list[int]] = [[]]
            paths += [[a] for a in _toy_draft_logits(context).topk(2).indices.tolist()]
            paths += [[a, b] for (a,) in paths[1:] for b in _toy_draft_logits([*context, a]).topk(2).indices.tolist()]
            tokens = torch.tensor([context[-1]] + [path[-1] for path in paths[1:]])
            tree = DraftTree(tokens, torch.tensor([0, 0, 0, 1, 1, 2, 2]))
        else:
            drafted: list[int] = []
            for _ in range(4):
                drafted.append(int(_toy_draft_logits(context + drafted).argmax()))
            paths = [drafted[:i] for i in range(len(drafted) + 1)]
            tree = DraftTree.chain(context[-1], drafted)
        p = process_logits(torch.stack([_toy_logits(0, context + path) for path in paths]), GREEDY)  # [T, V]
        if mode == "sampled_chain":
            q = process_logits(torch.stack([_toy_draft_logits(context + path) for path in paths[:-1]]), GREEDY)
            q_idx, q_prob = sparse_topk(q, 3)
            drafted_t = draft_sample_sparse(q_idx, q_prob, gen)
            assert drafted_t.tolist() == drafted
            res = verify_chain_sampled(drafted_t, q_idx, q_prob, p, gen)
        else:
            res = verify_tree(tree, p, gen)
        context += res.tokens
        steps += 1
    return context[len(prompt) : len(prompt) + length], steps


@pytest.mark.parametrize("mode", ["chain", "sampled_chain", "tree"])
def test_greedy_end_to_end_equals_plain_greedy(mode: str) -> None:
    length, prompt = 80, [0, 1, 2]
    plain = list(prompt)
    for _ in range(length):
        plain.append(int(_toy_logits(0, plain).argmax()))
    spec, steps = _greedy_speculative(prompt, length, mode)
    assert spec == plain[len(prompt) :]
    assert length / 5 < steps < length * 0.8, "the draft should be partly right"


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_synthetic_acceptance_refuses_a_row_without_mass(temperature: float) -> None:
    """The benchmark mode draws its next token from p too: a row of NaN logits is an error naming the node, as in
    every other rule, never token V committed (its embedding lookup would fail the whole batch the next step)."""
    logits = torch.zeros(2, 5)
    logits[0] = float("nan")
    p = process_logits(logits, SamplingParams(temperature=temperature))
    with pytest.raises(ValueError, match="no mass"):
        synthetic_verify([3, 4], [0, 0], p, 0.0, torch.Generator().manual_seed(0))  # rejects at once: node 0's p
    ok = synthetic_verify([3, 4], [0, 0], p, 1.0, torch.Generator().manual_seed(0))  # accepts node 1: its p is fine
    assert ok.accepted_nodes == [1] and 0 <= ok.next_token < 5
