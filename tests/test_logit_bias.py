"""OpenAI's ``logit_bias``: the target adds each bias to its token's logit before any other processing; drafts do not
see it, and verification keeps every token the biased target's (greedy equality here, its sampled distribution in
tests/test_seeded_sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_config, tiny_model
from specserve.sampling import SamplingParams, apply_logit_bias, process_logits
from tests.drafting import PROMPT, SPECS, drafting_engine


def biased_greedy_reference(model: LlamaModel, prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:
    """Greedy decoding over the whole sequence each token, the bias added to the logits here in float64."""
    tokens, out = list(prompt), []
    for _ in range(n):
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(ForwardBatch.build(cache, [cache.allocate()], [tokens], num_logits=[1]), cache)[-1].double()
        for t, b in bias.items():
            logits[t] += b
        out.append(int(logits.argmax()))
        tokens.append(out[-1])
    return out


def test_apply_logit_bias_adds_each_bias_to_its_column_only() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(torch.bfloat16)
    bias = {0: -100.0, 7: 2.5, 39: 0.25}
    got = apply_logit_bias(logits, SamplingParams(logit_bias=bias))
    want = logits.double().tolist()
    for row in want:
        for t, b in bias.items():
            row[t] += b
    assert got.dtype == torch.float32 and torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64))
    assert torch.equal(logits.float(), apply_logit_bias(logits, SamplingParams()))  # no bias: unchanged
    # before the temperature, as OpenAI and vLLM apply it: the biased logits are what is divided
    p = process_logits(apply_logit_bias(logits, SamplingParams(logit_bias=bias)), SamplingParams(temperature=0.5))
    assert torch.allclose(p.double(), torch.tensor(want, dtype=torch.float64).div(0.5).softmax(-1), atol=1e-6)


@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ({-1: 1.0}, "non-negative"),
        ({True: 1.0}, "non-negative"),
        ({"3": 1.0}, "non-negative"),
        ({3: 100.5}, r"\[-100, 100\]"),
        ({3: -101}, r"\[-100, 100\]"),
        ({3: float("nan")}, r"\[-100, 100\]"),
        ({3: True}, "a number"),
        ({3: "1"}, "a number"),
        ({3: np.complex128(1 + 5j)}, "a number"),
        ({3: 10**400}, r"\[-100, 100\]"),
        ({t: 1.0 for t in range(1025)}, "at most 1024"),
        ("3:1", "a mapping"),
        ([3], r"\(token id, bias\) pairs"),
    ],
)
def test_sampling_params_refuse_a_bad_logit_bias(bias: object, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]


def test_sampling_params_keep_a_logit_bias_as_sorted_pairs_without_zeros() -> None:
    """Kept as pairs, immutable: the params stay hashable, and the mapping a caller passed in can be changed after
    the engine checked its ids without changing the request (it indexed past the vocabulary, mid-step)."""
    given = {5: 0.5, 3: 100, 4: -100, 9: 0.0, 2: np.float32(1.5)}
    params = SamplingParams(logit_bias=given)
    assert params.logit_bias == ((2, 1.5), (3, 100.0), (4, -100.0), (5, 0.5)) and not params.raw_argmax
    given[10**6] = 1.0
    assert len(params.logit_bias) == 4 and hash(params) == hash(SamplingParams(logit_bias=params.logit_bias))
    assert SamplingParams(logit_bias={3: 0.0}).raw_argmax  # (nothing to add: the argmax-only path)
    assert SamplingParams().raw_argmax and not SamplingParams(temperature=1.0).raw_argmax


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_with_a_logit_bias_is_the_biased_targets(name: str) -> None:
    """Drafts ignore the bias (the head's and the copy's argmaxes are the unbiased target's), so a biased step
    rejects them where the bias moved the target's argmax and keeps them elsewhere."""
    target, engine = drafting_engine(name)
    unbiased = biased_greedy_reference(target, PROMPT, 24, {})
    other = next(t for t in range(target.cfg.vocab_size) if t not in unbiased)
    for bias in ({unbiased[0]: -100.0, unbiased[5]: -100.0}, {other: 20.0}, {unbiased[2]: -20.0, other: 1.5}):
        want = biased_greedy_reference(target, PROMPT, 24, bias)
        assert want != unbiased, bias  # (the bias moves the output: the check below can tell it was applied)
        out = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, logit_bias=bias))[0]
        assert out.token_ids == want, bias
        assert out.stats.accepted + out.stats.target_forwards == len(out.token_ids)
    if name != "plain":  # the unbiased tokens the bias left alone are still drafted and accepted
        assert out.stats.accepted > 0
    assert engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids == unbiased


@pytest.mark.parametrize("name", ["plain", "head-ddd"])
def test_a_seeded_greedy_request_with_a_bias_takes_the_argmax_without_drawing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seed on a greedy request changes nothing it returns; its biased rows' argmaxes are the tokens, with no
    distribution built and no keyed noise (T x V of it a step) drawn to pick the one-hot's single token."""
    target, engine = drafting_engine(name)
    unbiased = biased_greedy_reference(target, PROMPT, 16, {})
    bias = {unbiased[0]: -100.0, unbiased[4]: -100.0}
    want = biased_greedy_reference(target, PROMPT, 16, bias)

    def no_draw(*args: object, **kwargs: object) -> None:
        raise AssertionError("a greedy row was drawn from a distribution")

    monkeypatch.setattr("specserve.workers.target.keyed_sample", no_draw)
    monkeypatch.setattr("specserve.workers.target.process_logits", no_draw)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=bias, seed=5))[0]
    assert out.token_ids == want


@pytest.mark.parametrize("name", ["plain", "chain", "head-ddd"])
def test_sampled_output_follows_a_large_bias(name: str) -> None:
    """At +100 a token is all but certain at temperature 1, at -100 all but impossible."""
    _, engine = drafting_engine(name)
    forced = 11
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(8)]
    outs = engine.generate([PROMPT] * 8, [p.model_copy(update={"logit_bias": {forced: 100.0}}) for p in params])
    assert all(o.token_ids == [forced] * 12 for o in outs)
    free = engine.generate([PROMPT] * 8, params)
    banned = sorted({t for o in free for t in o.token_ids})[:20]
    outs = engine.generate(
        [PROMPT] * 8, [p.model_copy(update={"logit_bias": dict.fromkeys(banned, -100.0)}) for p in params]
    )
    assert not {t for o in outs for t in o.token_ids} & set(banned)


def test_a_bias_on_a_token_the_model_does_not_have_is_refused() -> None:
    target = tiny_model(tiny_config(), seed=0)
    engine = Engine(target, None, eos_token_ids=set())
    vocab = target.cfg.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"logit_bias token ids must be in \[0, {vocab}\)") as e:
        engine.submit(PROMPT, SamplingParams(logit_bias={3: 1.0, vocab: 1.0}))
    assert e.value.param == "logit_bias" and not engine.loop.has_work
