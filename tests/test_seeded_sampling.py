"""Sampling keyed by (seed, position) (docs/algorithms.md §1.4): a seeded request's text is a function of the request
alone -- alone, in any batch, with or without speculation, with any drafter -- and the engine's samples have the
target's distribution (chi-square over enumerated continuations, for every route a draft takes to the target)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.config import ChainDraft, Drafter, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Completion, Engine
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_model
from specserve.sampling import (
    SamplingParams,
    greedy_draw,
    keyed_exponentials,
    keyed_sample,
    make_generator,
    position_key,
    process_logits,
)
from specserve.spec_decode.draft_tree import DraftTree
from specserve.spec_decode.eagle_head import EagleHead, HeadKind
from specserve.spec_decode.verify import accept_tree
from specserve.workers import target as target_module
from specserve.workers.target import TargetWorker
from tests.test_head_drafter import last_token_target, near_head, random_head
from tests.test_speculative import PROMPTS

SPECS = {
    "off": SpecConfig(method=SpecMethod.none),
    "chain-keyed": SpecConfig(method=SpecMethod.chain, sl=3),
    "chain-greedy-drafts": SpecConfig(method=SpecMethod.chain, sl=5, chain_draft=ChainDraft.greedy),
    "eagle2": SpecConfig(method=SpecMethod.eagle2, tree_depth=4, beam_width=3, budget=12),
    "ddd": SpecConfig(method=SpecMethod.ddd, beam_width=3, budget=12, ddd_max_depth=7, ddd_check_steps=(2, 4, 6)),
    "lookup": SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.lookup, model_fallback=False),
    # lengths the batch sets: DSDE's per-sequence SL under SL_cap, and the suffix trees' matches with the model behind
    "chain-dsde": SpecConfig(method=SpecMethod.chain, sl=4, policy=SLPolicyKind.dsde),
    "ddd-dsde": SpecConfig(method=SpecMethod.ddd, beam_width=3, budget=12, policy=SLPolicyKind.dsde),
    "suffix": SpecConfig(
        method=SpecMethod.eagle2, tree_depth=4, budget=10, drafter=Drafter.suffix, model_fallback=True
    ),
}
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=2**63 - 5, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def draft(target: LlamaModel) -> LlamaModel:
    return noisy_copy(target, 0.05, seed=3)  # some of its drafts accepted even at temperature 0.9


def _alone(target: LlamaModel, draft: LlamaModel, spec: SpecConfig, prompt: list[int]) -> list[int]:
    engine = Engine(target, None, draft=draft, speculation=spec, eos_token_ids=set(), max_batch_size=1)
    return engine.generate(prompt, SEEDED)[0].token_ids


def test_keyed_noise_is_a_function_of_seed_and_position() -> None:
    a = keyed_exponentials(11, [3, 4, 3], 50, "cpu")  # [3, 50]
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    assert torch.equal(keyed_exponentials(11, [4], 50, "cpu")[0], a[1])  # the same alone as among other rows
    assert not torch.equal(keyed_exponentials(12, [3], 50, "cpu")[0], a[0])
    assert (a > 0).all()


def test_keys_that_share_their_low_32_bits_still_draw_apart() -> None:
    """torch's CPU generator seeds from a key's low 32 bits: these two positions of one request drew the same noise
    when the rows came from it."""
    assert position_key(42, 32497) & 0xFFFF_FFFF == position_key(42, 94160) & 0xFFFF_FFFF
    assert position_key(42, 32497) != position_key(42, 94160)
    a, b = keyed_exponentials(42, [32497, 94160], 64, "cpu")
    assert not torch.equal(a, b)


def test_the_tensor_splitmix64_stream_is_the_reference_generator() -> None:
    """int64 tensors wrap and shift arithmetically: the stream must still be splitmix64's unsigned one, keys at and
    past 2**63 included."""
    from specserve.sampling import _as_int64, _splitmix64, _splitmix64_stream

    keys = [0, 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1, 0x9E3779B97F4A7C15, 12345678901234567890]
    got = _splitmix64_stream(torch.tensor([_as_int64(k) for k in keys]), 40)  # [8, 40]
    golden = 0x9E3779B97F4A7C15
    want = [[_as_int64(_splitmix64((k + i * golden) % 2**64)) for i in range(40)] for k in keys]
    assert got.tolist() == want


def test_keyed_noise_is_exponential_and_uncorrelated() -> None:
    noise = keyed_exponentials(5, list(range(40)), 5000, "cpu")  # [40, 5000]: 200k draws
    assert noise.dtype == torch.float32 and (noise > 0).all()
    noise = noise.double()
    assert abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.03  # Exp(1): mean 1, var 1
    row = noise[0].sort().values  # Kolmogorov-Smirnov against 1 - exp(-x) over one row of 5000
    ks = ((1 - (-row).exp()) - torch.arange(1, 5001, dtype=torch.float64) / 5000).abs().max().item()
    assert ks < 1.63 / 5000**0.5  # the 1% critical value
    lag = torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1].item()
    assert abs(lag) < 0.01  # neighbouring columns (consecutive outputs of one stream) uncorrelated
    rows = torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]))[0, 1].item()
    assert abs(rows) < 0.01  # neighbouring positions too


def test_keyed_sample_draws_from_p_and_maps_reduced_columns() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draws = torch.cat([keyed_sample(p[None], seed, [9], 4) for seed in range(20_000)])  # one draw per seed
    counts = np.bincount(draws.numpy(), minlength=4)
    assert counts[3] == 0
    assert chisquare(counts[:3], 20_000 * p[:3].numpy()).pvalue > 1e-3
    # a reduced vocabulary races with the noise of its columns' target ids: the same token as the full race
    full = torch.tensor([[0.0, 0.4, 0.0, 0.6]])
    for seed in range(50):
        column = keyed_sample(full[:, [1, 3]], seed, [2], 4, columns=torch.tensor([1, 3]))
        assert [1, 3][int(column)] == int(keyed_sample(full, seed, [2], 4))
    assert int(keyed_sample(torch.zeros(1, 4), 0, [0], 4)) == 4  # no mass: out of range, for the caller to reject


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_sampled_row_with_non_finite_logits_has_no_mass(bad: str) -> None:
    """A nan logit, or a +inf one (inf - inf after the shift), leaves no distribution: the keyed draw is out of
    range, as the unseeded inverse-CDF draw is, so verification raises instead of emitting token 0."""
    logits = torch.zeros(2, 8)
    logits[1, 5] = float(bad)
    probs = process_logits(logits, SamplingParams(temperature=1.0, seed=3))
    assert keyed_sample(probs, 3, [10, 10], 8).tolist()[1] == 8
    with pytest.raises(ValueError, match="no mass"):
        accept_tree(DraftTree.chain(1, []), keyed_sample(probs[1:], 3, [10], 8), 8)


def test_a_greedy_row_without_a_finite_maximum_has_no_mass() -> None:
    """Greedy draws the argmax only where the row's maximum is finite: a NaN anywhere (torch's argmax picks it),
    a +inf or a row of -inf draws V, out of range, and the greedy one-hot row is all zeros, as a sampled row with
    such logits is without mass; verification then raises instead of emitting token 0."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.0, 2.0, 1.0], [nan, nan, nan], [0.0, inf, 1.0], [-inf, -inf, -inf], [0.0, 5.0, nan]])
    assert greedy_draw(logits).tolist() == [1, 3, 3, 3, 3]
    probs = process_logits(logits, SamplingParams())
    assert probs[0].tolist() == [0.0, 1.0, 0.0] and probs[1:].abs().sum() == 0
    with pytest.raises(ValueError, match="no mass"):
        accept_tree(DraftTree.chain(1, []), greedy_draw(logits[1:2]), 3)


def test_a_draft_with_non_finite_logits_only_drafts_badly(target: LlamaModel) -> None:
    """The keyed chain of a draft whose logits are nan proposes a token of the vocabulary (its row's argmax) and
    the target's draws stand: the output is the seeded output without speculation."""
    broken = noisy_copy(target, 0.0)
    with torch.no_grad():
        broken.norm.fill_(float("nan"))
    spec = SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft.keyed)
    assert _alone(target, broken, spec, PROMPTS[0]) == _alone(target, broken, SPECS["off"], PROMPTS[0])


def test_a_sampled_chain_from_a_draft_with_non_finite_logits_drafts_its_argmax(target: LlamaModel) -> None:
    """``chain_draft = sampled`` drew from the nan row with ``torch.multinomial``, which raised: the step failed for
    every sequence in the batch. The row now drafts its argmax, shipped as a point mass."""
    broken = noisy_copy(target, 0.0)
    with torch.no_grad():
        broken.norm.fill_(float("nan"))
    spec = SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft.sampled)
    engine = Engine(target, None, draft=broken, speculation=spec, eos_token_ids=set(), max_batch_size=2)
    done = engine.generate([PROMPTS[0], PROMPTS[1]], SEEDED)
    assert [len(c.token_ids) for c in done] == [24, 24]
    assert all(c.stats.drafted > 0 for c in done)  # it drafted (each draft the argmax of a nan row)


def test_seeded_output_is_the_same_alone_batched_and_with_any_drafter(target: LlamaModel, draft: LlamaModel) -> None:
    prompt = PROMPTS[1]
    reference = _alone(target, draft, SPECS["off"], prompt)
    assert len(reference) == 24
    for name, spec in SPECS.items():
        engine = Engine(target, None, draft=draft, speculation=spec, eos_token_ids=set(), max_batch_size=1)
        alone = engine.generate(prompt, SEEDED)[0]
        assert alone.token_ids == reference, name
        # the accepted path in play (a draft it almost never accepted tested little beyond plain sampling)
        assert alone.stats.accepted >= 3 or spec.method == SpecMethod.none or spec.drafter == Drafter.lookup, name
    # in a batch of 8 beside other requests (greedy, other seeds, unseeded, other drafters), each drafting differently
    for name, spec in SPECS.items():
        engine = Engine(target, None, draft=draft, speculation=spec, eos_token_ids=set(), max_batch_size=8)
        others = [SamplingParams(max_tokens=30), SamplingParams(temperature=1.0, seed=1, max_tokens=10)]
        others += [SamplingParams(temperature=0.7, max_tokens=40)] * 2
        other_specs = itertools.cycle(SPECS.values())
        ids = [engine.submit(PROMPTS[i % 4], p, speculation=next(other_specs)) for i, p in enumerate(others)]
        for _ in range(2):  # the seeded request joins a running batch
            engine.loop.step()
        seeded_id = engine.submit(prompt, SEEDED)  # the engine's own speculation
        ids += [engine.submit(PROMPTS[i % 4], p, speculation=next(other_specs)) for i, p in enumerate(others[:3])]
        assert len(ids) == 7
        got: list[int] = []
        while engine.loop.has_work:
            got += [t for out in engine.loop.step() if out.request_id == seeded_id for t in out.token_ids]
        assert got == reference, name


def test_keyed_chains_draw_the_targets_token_from_an_identical_draft(target: LlamaModel) -> None:
    """Coupling: an identical draft racing with the target's noise proposes exactly the target's draws, so every
    drafted token is accepted even at temperature 1 (an off-by-one in the draft's key would reject most)."""
    spec = SpecConfig(method=SpecMethod.chain, sl=4)
    engine = Engine(target, None, draft=noisy_copy(target, 0.0), speculation=spec, eos_token_ids=set())
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    stats = [c.stats for c in engine.generate(PROMPTS, params)]
    assert sum(s.accepted for s in stats) == sum(s.drafted for s in stats) > 60


# -- the engine's samples have the target's distribution -------------------------------------------------------

CHI_PROMPT = [5, 9, 13, 21]
CHI_PARAMS = {"temperature": 1.0, "top_k": 3, "max_tokens": 2, "ignore_eos": True}
N_SAMPLES = 2400


def _exact_pairs(target: LlamaModel, chi_params: dict[str, object] = CHI_PARAMS) -> dict[tuple[int, int], float]:
    """P(x1, x2) of the next two tokens under top-k 3 at temperature 1 (or ``chi_params``), by enumeration."""
    params = SamplingParams(**{k: v for k, v in chi_params.items() if k != "logit_bias"})  # type: ignore[arg-type]
    bias = chi_params.get("logit_bias", {})
    assert isinstance(bias, dict)
    banned = params.stop_token_ids if params.min_tokens >= 2 else frozenset()  # (both tokens drawn without them)

    def next_probs(tokens: list[int]) -> torch.Tensor:
        cache = target.new_cache(1, len(tokens) + 1)
        logits = target(ForwardBatch.build(cache, [cache.allocate()], [tokens], num_logits=[1]), cache)[-1:].clone()
        for t, b in bias.items():  # (added here, not by the code under test)
            logits[0, t] += b
        for t in banned:
            logits[0, t] = float("-inf")
        return process_logits(logits, params)[0].double()

    p1 = next_probs(CHI_PROMPT)
    table = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = next_probs([*CHI_PROMPT, x1])
        for x2 in p2.nonzero().flatten().tolist():
            table[(x1, x2)] = float(p1[x1] * p2[x2])
    return table


def _engine_outputs(
    engine: Engine, max_tokens: int = 2, chi_params: dict[str, object] = CHI_PARAMS
) -> list[Completion]:
    """``max_tokens`` 3: a head, which drafts from the step after the prompt's, drafts the second token with room
    for its bonus (with one token left a step's draft is counted as the target's token)."""
    params = [
        SamplingParams(**{**chi_params, "max_tokens": max_tokens}, seed=seed)  # type: ignore[arg-type]
        for seed in range(N_SAMPLES)
    ]
    return engine.generate([CHI_PROMPT] * N_SAMPLES, params)


def _engine_pairs(
    engine: Engine, max_tokens: int = 2, chi_params: dict[str, object] = CHI_PARAMS
) -> list[tuple[int, int]]:
    return [(o.token_ids[0], o.token_ids[1]) for o in _engine_outputs(engine, max_tokens, chi_params)]


def _pvalue(pairs: list[tuple[int, int]], table: dict[tuple[int, int], float]) -> float:
    cells = sorted(table)
    if not set(pairs) <= set(cells):  # a token outside the target's support has probability 0
        return 0.0
    obs = np.array([sum(1 for x in pairs if x == c) for c in cells], dtype=float)
    exp = np.array([table[c] for c in cells]) * len(pairs)
    return float(chisquare(obs, exp / exp.sum() * obs.sum()).pvalue)


CHI_SPECS = {
    "chain-keyed": SpecConfig(method=SpecMethod.chain, sl=2),
    "chain-sampled": SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.sampled),
    "tree": SpecConfig(method=SpecMethod.eagle2, tree_depth=2, beam_width=3, budget=8),
    "head-chain": SpecConfig(method=SpecMethod.chain, sl=2),
    # sampled chains from heads whose draft columns are not target ids (q's support must be mapped to target ids)
    "head-reduced-chain-sampled": SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.sampled),
    "head-eagle3-chain-sampled": SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.sampled),
    # min-p instead of top-k: the target's first token keeps 3 candidates (its probabilities 0.80, 0.061, 0.029,
    # then 0.021, under 0.03 x 0.80), and draft and target cut the same way
    "chain-keyed-min-p": SpecConfig(method=SpecMethod.chain, sl=2),
    "chain-sampled-min-p": SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.sampled),
    # a logit bias the target applies and the drafts do not: +1.5 on every even id (which reorders the top 3 at
    # both positions), -100 on the unbiased target's likeliest first token
    "chain-keyed-bias": SpecConfig(method=SpecMethod.chain, sl=2),
    "chain-sampled-bias": SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.sampled),
    "tree-bias": SpecConfig(method=SpecMethod.eagle2, tree_depth=2, beam_width=3, budget=8),
    # min_tokens 2 with the target's likeliest first token as a stop id: both tokens drawn without it
    "chain-keyed-min-tokens": SpecConfig(method=SpecMethod.chain, sl=2),
    "chain-sampled-min-tokens": SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.sampled),
}
CHI_MIN_P = {"temperature": 1.0, "min_p": 0.03, "max_tokens": 2, "ignore_eos": True}


def constant_target() -> LlamaModel:
    """A last-token target whose embeddings are all one row: its next-token distribution is the same everywhere."""
    target = last_token_target()
    with torch.no_grad():
        target.embed_tokens.weight[:] = target.embed_tokens.weight[0]
    return target


def near_eagle3_head(target: LlamaModel) -> EagleHead:
    """An EAGLE-3 head over a constant target that drafts the target's distribution over half the vocabulary, its
    draft columns in a shuffled order (d2t): fc passes the first aux layer's feature through, the layer adds
    nothing, and its LM head rows are the target's rows of its draft ids. Its ids hold the target's two likeliest
    tokens but not the third (top-k 3: that one only from the residual)."""
    vocab = target.cfg.vocab_size
    cache = target.new_cache(1, 2)
    logits = target(ForwardBatch.build(cache, [cache.allocate()], [[5]], num_logits=[1]), cache)[-1]
    top = logits.topk(3).indices.tolist()
    rest = [i for i in torch.randperm(vocab, generator=torch.Generator().manual_seed(11)).tolist() if i not in top]
    ids = torch.tensor([top[0], *rest[: vocab // 2 - 2], top[1]])
    head = random_head(target, HeadKind.eagle3)
    h = target.cfg.hidden_size
    with torch.no_grad():
        head.layer.o_proj.weight.zero_()
        head.layer.down.weight.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
    head.draft_ids = ids
    return head


def _chi_case(target: LlamaModel, name: str) -> tuple[LlamaModel, LlamaModel | EagleHead]:
    """(target, draft) whose drafts the target accepts often: a test of the accepted path too."""
    if not name.startswith("head"):
        return target, noisy_copy(target, 0.1, seed=4)
    if "eagle3" in name:
        target = constant_target()
        return target, near_eagle3_head(target)
    target = last_token_target()
    head = near_head(target, 0.01)
    if "reduced" in name:
        head.set_draft_vocab(torch.arange(1, target.cfg.vocab_size, 2))
    return target, head


def _first_argmax(target: LlamaModel) -> int:
    cache = target.new_cache(1, len(CHI_PROMPT))
    return int(target(ForwardBatch.build(cache, [cache.allocate()], [CHI_PROMPT], num_logits=[1]), cache)[-1].argmax())


def _chi_bias(target: LlamaModel) -> dict[str, object]:
    bias = {t: 1.5 for t in range(0, target.cfg.vocab_size, 2)} | {_first_argmax(target): -100.0}
    return {**CHI_PARAMS, "logit_bias": bias}


def _chi_min_tokens(target: LlamaModel) -> dict[str, object]:
    return {**CHI_PARAMS, "min_tokens": 2, "stop_token_ids": [_first_argmax(target)]}


@pytest.mark.parametrize("name", list(CHI_SPECS))
def test_engine_samples_have_the_targets_distribution(target: LlamaModel, name: str) -> None:
    """Drafts the target mostly rejects test little beyond plain sampling: each case has at least 10% of its drafts
    accepted (their tokens then come from the accepted path)."""
    target, draft = _chi_case(target, name)
    chi_params = (
        CHI_MIN_P
        if name.endswith("min-p")
        else _chi_bias(target)
        if name.endswith("bias")
        else _chi_min_tokens(target)
        if name.endswith("min-tokens")
        else CHI_PARAMS
    )
    engine = Engine(target, None, draft=draft, speculation=CHI_SPECS[name], eos_token_ids=set(), max_batch_size=64)
    outs = _engine_outputs(engine, 3 if isinstance(draft, EagleHead) else 2, chi_params)
    pairs = [(o.token_ids[0], o.token_ids[1]) for o in outs]
    assert _pvalue(pairs, _exact_pairs(target, chi_params)) > 1e-3
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert accepted >= 0.1 * drafted > 0, (accepted, drafted)
    if isinstance(draft, EagleHead) and draft.maps_draft_ids:
        assert engine.loop.draft.token_ids is not None  # type: ignore[attr-defined]  # (the mapping is in play)
    if "sampled" not in name:  # keyed draws: the same seeds give the same samples with speculation off
        plain = Engine(target, None, eos_token_ids=set(), max_batch_size=64)
        assert _engine_pairs(plain, 2, chi_params) == pairs


def test_the_chi_square_catches_a_lossy_acceptance(target: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting the first drafted child whatever the target drew makes the first token the draft's argmax (an
    identical draft keeps it inside the target's support): the same test must fail on the distribution."""
    real = target_module.walk_tree

    def lossy(tree, draws_h, vocab):  # type: ignore[no-untyped-def]
        if tree.num_nodes > 1:
            draws_h = [int(tree.tokens[1]), *draws_h[1:]]
        return real(tree, draws_h, vocab)

    monkeypatch.setattr(target_module, "walk_tree", lossy)
    spec = SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.greedy)
    engine = Engine(
        target, None, draft=noisy_copy(target, 0.0), speculation=spec, eos_token_ids=set(), max_batch_size=64
    )
    pairs, table = _engine_pairs(engine), _exact_pairs(target)
    assert set(pairs) <= set(table)
    assert _pvalue(pairs, table) < 1e-3


def test_a_sequence_registered_again_draws_afresh(target: LlamaModel, draft: LlamaModel) -> None:
    """Sampled chains (``chain_draft=sampled``) draw from the workers' per-sequence generators. A sequence registered
    again (a new worker, a reset after a failed step, a move to another lane) must not repeat the draws it began with:
    they would no longer be independent of the tokens it already emitted. The loop registers it at its length."""
    worker = TargetWorker(target, num_slots=1, max_len=64)
    draws: dict[int, list[torch.Tensor]] = {}
    for position in (5, 9, 5):
        worker.add(0, SEEDED, position)
        draws.setdefault(position, []).append(torch.rand(8, generator=worker.generators[0]))
        worker.release([0])
    assert torch.equal(draws[5][0], draws[5][1]) and not torch.equal(draws[5][0], draws[9][0])
    for seed, position, stream in itertools.product((0, 1, 2**40 + 7, 2**63 - 5), (0, 3, 17), (0, 1)):
        # nor the noise of a keyed draw (§1.4): a sampled chain's uniforms after a keyed token must not be its noise
        noise = torch.empty(50).exponential_(generator=make_generator(seed, stream=stream, position=position))
        assert not torch.equal(noise, keyed_exponentials(seed, [position], 50, "cpu")[0])

    spec = SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft.sampled)
    engine = Engine(target, None, draft=draft, speculation=spec, eos_token_ids=set())
    positions: list[int] = []
    add = engine.loop.target.add

    def spy(seq_id: int, params: SamplingParams, position: int) -> None:
        positions.append(position)
        add(seq_id, params, position)

    engine.loop.target.add = spy  # type: ignore[method-assign]
    engine.submit(PROMPTS[1], SEEDED)
    emitted = [t for _ in range(2) for out in engine.loop.step() for t in out.token_ids]
    engine.loop.recover(target=True, draft=False)
    assert emitted and positions == [len(PROMPTS[1]), len(PROMPTS[1]) + len(emitted)]


def test_a_step_reads_every_sampled_rows_draws_back_at_once(
    target: LlamaModel, draft: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampled rules' draws (keyed trees) and outcomes (sampled chains) of all of a step's sequences reach the
    host in one transfer: on a GPU one host sync a step, not one a sequence; and each row is finished with its own
    slice of it (the seeded row's tokens are those it draws alone)."""
    reference = _alone(target, draft, SPECS["off"], PROMPTS[1])
    joined: list[int] = []
    read_back = target_module.read_back

    def spy(values: list[torch.Tensor]) -> list[int]:
        joined.append(len(values))
        return read_back(values)

    monkeypatch.setattr(target_module, "read_back", spy)
    engine = Engine(target, None, draft=draft, speculation=SPECS["eagle2"], eos_token_ids=set(), max_batch_size=4)
    verifies: list[int] = []
    verify = engine.loop.target.verify

    def counted(items: list) -> list:  # type: ignore[type-arg]
        verifies.append(len(items))
        return verify(items)

    engine.loop.target.verify = counted  # type: ignore[method-assign]
    unseeded = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    sampled_chain = SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft.sampled)
    engine.submit(PROMPTS[0], unseeded)  # (the engine gives it a seed: keyed draws)
    engine.submit(PROMPTS[2], unseeded, speculation=sampled_chain)
    seeded_id = engine.submit(PROMPTS[1], SEEDED)  # after two rows whose draws come first in the joined read
    engine.submit(PROMPTS[3], SamplingParams(max_tokens=24, ignore_eos=True))  # greedy: its argmaxes read before
    got: list[int] = []
    while engine.loop.has_work:
        got += [t for out in engine.loop.step() if out.request_id == seeded_id for t in out.token_ids]
    assert got == reference
    assert len(joined) == len(verifies) and max(joined) == 3  # the three sampled rows, the greedy one not among them
