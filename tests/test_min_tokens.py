"""vLLM's ``min_tokens``: before that many output tokens the target draws without EOS (unless ignore_eos) and the stop
token ids; drafts may propose them, and verification rejects them there."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_config, tiny_model
from specserve.sampling import SamplingParams
from specserve.sequence import FinishReason
from tests.drafting import PROMPT, SPECS, drafting_engine


def reference(model: LlamaModel, n: int, *, ends: set[int], banned: set[int], min_tokens: int) -> list[int]:
    """Greedy decoding over the whole sequence each token; before ``min_tokens`` outputs the argmax is taken over
    the tokens outside ``banned``; a token of ``ends`` ends the output (its own place in it left to the caller)."""
    tokens, out = list(PROMPT), []
    for _ in range(n):
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(ForwardBatch.build(cache, [cache.allocate()], [tokens], num_logits=[1]), cache)[-1].tolist()
        allowed = [t for t in range(len(logits)) if len(out) >= min_tokens or t not in banned]
        tok = max(allowed, key=lambda t: logits[t])
        out.append(tok)
        tokens.append(tok)
        if tok in ends:
            break
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_no_eos_or_stop_id_before_min_tokens(name: str) -> None:
    target, _ = drafting_engine(name)
    free = reference(target, 24, ends=set(), banned=set(), min_tokens=0)
    eos, stop = free[3], free[5]
    _, engine = drafting_engine(name, eos=frozenset({eos}))
    assert engine.generate([PROMPT], SamplingParams(max_tokens=24))[0].token_ids == free[:3]  # (EOS at index 3)
    for m in (4, 9):
        want = reference(target, 24, ends={eos, stop}, banned={eos, stop}, min_tokens=m)
        out = engine.generate([PROMPT], SamplingParams(max_tokens=24, min_tokens=m, stop_token_ids=[stop]))[0]
        assert len(want) > m and not {eos, stop} & set(want[:m])  # (the ban changed the output)
        assert out.token_ids == [t for t in want if t != eos], m  # (EOS ends it, not in the output; a stop id is)
        assert out.stats.accepted + out.stats.target_forwards == len(out.token_ids) + (want[-1] == eos)
    # ignore_eos: EOS is no stop, so min_tokens keeps only the stop id out
    want = reference(target, 24, ends={stop}, banned={stop}, min_tokens=9)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=24, min_tokens=9, stop_token_ids=[stop], ignore_eos=True))
    assert out[0].token_ids == want


@pytest.mark.parametrize("name", ["plain", "chain", "eagle2", "lookup"])
def test_the_ban_ends_at_exactly_min_tokens(name: str) -> None:
    """EOS as the token at output index m: with min_tokens m it is drawn there (m tokens before it), and the raw
    logprobs still show it at the banned positions before (the ban is on a copy of the step's logits)."""
    target, _ = drafting_engine(name)
    free = reference(target, 14, ends=set(), banned=set(), min_tokens=0)
    for m in range(1, 12):
        if free[m] in free[:m]:
            continue
        _, engine = drafting_engine(name, eos=frozenset({free[m]}))
        out = engine.generate([PROMPT], SamplingParams(max_tokens=14, min_tokens=m, logprobs=3))[0]
        assert out.token_ids == free[:m] and out.finish_reason == FinishReason.stop, m
        assert out.logprobs is not None and out.logprobs[m - 1].logprob < 0
    eos = free[2]
    _, engine = drafting_engine(name, eos=frozenset({eos}))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=14, min_tokens=4, logprobs=5))[0]
    assert out.logprobs is not None and eos in [t for t, _ in out.logprobs[2].top]  # (banned there, still listed)


def test_an_eos_id_past_the_vocabulary_is_no_ban_and_a_ban_of_every_token_is_refused() -> None:
    target = tiny_model(tiny_config(), seed=0)
    engine = Engine(target, None, eos_token_ids=set())
    free = engine.generate([PROMPT], SamplingParams(max_tokens=8))[0].token_ids
    engine.loop.eos_token_ids = frozenset({free[2], 600})  # (a config's EOS id the model cannot emit, vocab 512)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, min_tokens=4))[0]
    assert len(out.token_ids) >= 4 and free[2] not in out.token_ids[:4]
    with pytest.raises(InvalidRequestError, match="no token to generate"):
        engine.submit(PROMPT, SamplingParams(max_tokens=8, min_tokens=1, stop_token_ids=range(511)))


def test_min_tokens_as_large_as_max_tokens_runs_to_the_length() -> None:
    target, _ = drafting_engine("chain")
    free = reference(target, 12, ends=set(), banned=set(), min_tokens=0)
    _, engine = drafting_engine("chain", eos=frozenset({free[1]}))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=12, min_tokens=12))[0]
    assert out.finish_reason == FinishReason.length and len(out.token_ids) == 12 and free[1] not in out.token_ids


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"min_tokens": -1}, "greater than or equal to 0"),
        ({"min_tokens": 9, "max_tokens": 8}, r"min_tokens \(9\) must be at most max_tokens \(8\)"),
        ({"min_tokens": 2, "stop": ["x"]}, "min_tokens with stop strings is not supported"),
        ({"min_tokens": True}, "a number"),
    ],
)
def test_sampling_params_refuse_a_min_tokens_they_cannot_keep(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        SamplingParams(**fields)  # type: ignore[arg-type]
