"""vLLM's ``min_tokens``: before that many output tokens the target draws without EOS (unless ignore_eos) and the stop
token ids; drafts may propose them, and verification rejects them there."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.detok import IncrementalText
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
    engine.loop.eos_token_ids = frozenset({600})  # its only EOS past the vocabulary: nothing to ban (the empty id
    # list made a float index, and every such request failed its first step)
    for params in (SamplingParams(max_tokens=8, min_tokens=4), SamplingParams(max_tokens=8, min_tokens=4, seed=1)):
        assert engine.generate([PROMPT], params)[0].token_ids == engine.generate([PROMPT], params.model_copy(
            update={"min_tokens": 0}))[0].token_ids  # fmt: skip
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
        ({"min_tokens": True}, "a number"),
    ],
)
def test_sampling_params_refuse_a_min_tokens_they_cannot_keep(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        SamplingParams(**fields)  # type: ignore[arg-type]


def one_token_a_step(tok: PreTrainedTokenizerBase, ids: list[int], stop: list[str], floor: int) -> tuple[str, int]:
    """vLLM's rule, decoding one token at a time: after each token past the first ``floor``, a stop string counts
    where it ends in the text that token added, and the text is cut where the earliest such match starts; (the
    text, the tokens through the one that completed it), or (the whole text, len(ids)) where none does. (For stop
    strings and texts of whole characters: a character completed by a later byte replaces the U+FFFD before it.)"""
    before = ""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        if n > floor:
            starts = [i for i in (text.find(s, max(0, len(before) - len(s) + 1)) for s in stop) if i >= 0]
            if starts:
                return text[: min(starts)], n
        before = text
    return before, len(ids)


STOP_TEXTS = ("so ab then ab and the end. ab again, end.", "xx xxx x xxxx end end")


@pytest.mark.parametrize("text", STOP_TEXTS)
def test_a_stop_string_in_the_first_min_tokens_does_not_stop(text: str) -> None:
    """At every floor (min_tokens) and any number of tokens an update brings (speculation), the streamed text and
    the tokens kept are those of the one-token rule, and the deltas add up to the text."""
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    stops = (["ab"], ["end", "the end."], ["x x"], [" "], ["end."])
    for stop in stops:
        for floor in range(len(ids) + 1):
            want = one_token_a_step(tok, ids, stop, floor)
            for per_step in (1, 2, 3, 5, len(ids)):
                inc, streamed, n = IncrementalText(tok, stop, floor=floor), "", 0
                while n < len(ids) and not inc.stopped:
                    n = min(len(ids), n + per_step)
                    streamed += inc.update(ids[:n], final=n == len(ids))
                got = (inc.text, inc.stop_tokens if inc.stopped else len(ids))
                assert got == want, (stop, floor, per_step)
                assert streamed == inc.text


def stop_seen_twice(tok: PreTrainedTokenizerBase, ids: list[int]) -> tuple[str, int]:
    """(a letter the text of ``ids`` holds more than once, the tokens through its first one)."""
    text = tok.decode(ids, skip_special_tokens=True)
    letter = next(c for c in text if c.isascii() and c.isalpha() and text.count(c) > 1)
    return letter, one_token_a_step(tok, ids, [letter], 0)[1]


@pytest.mark.parametrize("name", list(SPECS))
def test_min_tokens_with_a_stop_string_keeps_the_one_token_answer(name: str) -> None:
    """A stop string the first tokens complete is passed over up to min_tokens; a later one stops the answer, its
    text and tokens those of the one-token rule over plain greedy decoding, with every drafter."""
    tok = tiny_tokenizer()
    target, engine = drafting_engine(name, tokenizer=tok)
    free = reference(target, 40, ends=set(), banned=set(), min_tokens=0)
    stop, first = stop_seen_twice(tok, free)
    for m in (first, first + 2):
        text, n = one_token_a_step(tok, free, [stop], m)
        assert n > first and n < len(free)  # (the floor passed over the first match; a later one stopped it)
        out = engine.generate([PROMPT], SamplingParams(max_tokens=40, min_tokens=m, stop=[stop]))[0]
        assert (out.text, out.token_ids, out.finish_reason) == (text, free[:n], FinishReason.stop), m
