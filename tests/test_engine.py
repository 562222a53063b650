"""Plain decoding engine: greedy equality, batching, sampling, limits, streaming, bad input."""

from __future__ import annotations

import gc
import itertools
import threading

import numpy as np
import pydantic
import pytest
import torch

from specserve.config import Drafter, SpecConfig, SpecMethod
from specserve.detok import IncrementalText
from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy
from specserve.sampling import SamplingParams, process_logits
from specserve.sequence import FinishReason
from specserve.spec_decode.suffix_tree import SuffixTrie
from tests.conftest import greedy_reference

PROMPTS = [[5, 9, 13], [100, 200, 300, 400, 7, 8, 9], [42], [7, 7, 7, 7, 7]]


def test_greedy_equals_reference_decoding(tiny: LlamaModel) -> None:
    engine = Engine(tiny, None, eos_token_ids=set())
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(tiny, prompt, 12)
        assert out.finish_reason == FinishReason.length
        assert out.stats.target_forwards == 12


def test_batched_equals_alone_and_respects_batch_limit(tiny: LlamaModel) -> None:
    params = SamplingParams(max_tokens=10)
    alone = [Engine(tiny, None, eos_token_ids=set()).generate([p], params)[0].token_ids for p in PROMPTS]
    engine = Engine(tiny, None, max_batch_size=2, eos_token_ids=set())
    batched = engine.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in (10, 3, 10, 6)])
    assert [b.token_ids for b in batched] == [alone[0], alone[1][:3], alone[2], alone[3][:6]]
    assert engine.loop.target.cache.num_free == 2  # every slot returned


def test_eos_stops_and_is_not_emitted(tiny: LlamaModel) -> None:
    ref = greedy_reference(tiny, PROMPTS[1], 8)
    eos = ref[4]
    first = ref.index(eos)
    out = Engine(tiny, None, eos_token_ids={eos}).generate(PROMPTS[1], SamplingParams(max_tokens=8))[0]
    assert out.token_ids == ref[:first]
    assert out.finish_reason == FinishReason.stop
    ignoring = Engine(tiny, None, eos_token_ids={eos}).generate(
        PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True)
    )[0]
    assert ignoring.token_ids == ref


def test_a_stop_token_id_ends_the_output_and_is_part_of_it(tiny: LlamaModel) -> None:
    """As vLLM's ``stop_token_ids``: the first generated one ends the output, which keeps it, with ignore_eos too;
    with speculation the tokens accepted past it are cut, and the counts still add up (accepted + forwards =
    tokens emitted)."""
    ref = greedy_reference(tiny, PROMPTS[1], 12)
    stop = ref[5]
    first = ref.index(stop)
    unseen = min(set(range(tiny.cfg.vocab_size)) - set(ref))  # a second stop id, never generated
    engines = {
        "plain": Engine(tiny, None, eos_token_ids=set()),
        "chain": Engine(  # an identical draft: every draft accepted, so the stop token comes inside an accepted run
            tiny,
            None,
            draft=noisy_copy(tiny, 0.0),
            speculation=SpecConfig(method=SpecMethod.chain, sl=4),
            eos_token_ids=set(),
        ),
    }
    for name, engine in engines.items():
        for ignore_eos in (False, True):
            params = SamplingParams(max_tokens=12, stop_token_ids=[stop, unseen], ignore_eos=ignore_eos)
            out = engine.generate(PROMPTS[1], params)[0]
            assert out.token_ids == ref[: first + 1], name
            assert out.finish_reason == FinishReason.stop and out.stop_reason == stop
            assert out.stats.accepted + out.stats.target_forwards == len(out.token_ids), (name, out.stats)
            if name == "chain":
                assert out.stats.accepted > 0
    # where it also is the EOS, EOS rules: not emitted, unless ignore_eos, when the stop token id ends the output
    engine = Engine(tiny, None, eos_token_ids={stop})
    at_eos = engine.generate(PROMPTS[1], SamplingParams(max_tokens=12, stop_token_ids=[stop]))[0]
    assert at_eos.token_ids == ref[:first] and at_eos.stop_reason is None  # (vLLM's: None for EOS)
    both = SamplingParams(max_tokens=12, stop_token_ids=[stop], ignore_eos=True)
    assert engine.generate(PROMPTS[1], both)[0].token_ids == ref[: first + 1]


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny: LlamaModel) -> None:
    engine = Engine(tiny, None, eos_token_ids=set())
    with pytest.raises(InvalidRequestError, match=rf"stop_token_ids must be in \[0, {tiny.cfg.vocab_size}\)"):
        engine.generate(PROMPTS[1], SamplingParams(stop_token_ids=[3, tiny.cfg.vocab_size]))
    assert not engine.loop.has_work


def test_context_limit_ends_with_length(tiny: LlamaModel) -> None:
    engine = Engine(tiny, None, max_model_len=20, eos_token_ids=set())
    out = engine.generate([list(range(1, 16))], SamplingParams(max_tokens=100))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == FinishReason.length


def test_a_draft_with_fewer_positions_than_its_target_bounds_the_context(tiny: LlamaModel) -> None:
    """The target has 512 positions, the draft 128, and a step keeps 64 (spec_headroom) past the context: 64
    tokens of context, not the 400 asked (the draft's cache would overflow mid-request)."""
    from specserve.config import SpecConfig, SpecMethod
    from specserve.models.tiny import tiny_config, tiny_model

    assert tiny.max_positions == 512
    draft = tiny_model(tiny_config(max_position_embeddings=128), seed=1)
    engine = Engine(
        tiny,
        None,
        draft=draft,
        speculation=SpecConfig(method=SpecMethod.chain, sl=4),
        max_model_len=400,
        spec_headroom=64,
        eos_token_ids=set(),
    )
    assert engine.loop.max_model_len == 64
    out = engine.generate([list(range(1, 11))], SamplingParams(max_tokens=300))[0]
    assert len(out.token_ids) == 54 and out.finish_reason == FinishReason.length


def test_seeded_sampling_is_reproducible_and_follows_the_distribution(tiny: LlamaModel) -> None:
    engine = Engine(tiny, None, eos_token_ids=set())
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=6)
    a = engine.generate(PROMPTS[0], params)[0].token_ids
    b = engine.generate(PROMPTS[0], params)[0].token_ids
    assert a == b
    # first-token frequencies over many seeds match the model's distribution (top-k 3 keeps it small)
    from specserve.models.batch import ForwardBatch

    cache = tiny.new_cache(1, 16)
    logits = tiny(ForwardBatch.build(cache, [cache.allocate()], [PROMPTS[0]], num_logits=[1]), cache)
    sp = SamplingParams(temperature=0.8, top_k=3, max_tokens=1)
    p = process_logits(logits, sp)[0]
    n = 600
    outs = engine.generate([PROMPTS[0]] * n, [sp.model_copy(update={"seed": s}) for s in range(n)])
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=p.numel()).float()
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(p).flatten().tolist())
    assert (counts / n - p).abs().max() < 0.07


def test_top_k_one_is_greedy(tiny: LlamaModel) -> None:
    engine = Engine(tiny, None, eos_token_ids=set())
    sampled = engine.generate(PROMPTS[1], SamplingParams(temperature=1.5, top_k=1, seed=1, max_tokens=8))[0]
    assert sampled.token_ids == greedy_reference(tiny, PROMPTS[1], 8)


def test_process_logits_top_p_keeps_smallest_prefix() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (0.8, None, 1.0, 0.0),
        (2.5, 5, 1.0, 0.0),
        (0.5, None, 0.9, 0.0),
        (1.7, 7, 0.8, 0.0),
        (1.3, None, 1.0, 0.05),
        (2.0, None, 0.6, 0.2),  # min-p before top-p: top-p's prefix is of the renormalised min-p set
        (0.9, 3, 0.95, 0.01),
        (1.0, None, 1.0, 1.0),  # the most likely token alone
    ],
)
def test_process_logits_is_softmax_of_logits_over_temperature_then_cut(
    temperature: float, top_k: int | None, top_p: float, min_p: float
) -> None:
    """Against a reference written here in float64 from the definitions (every other check took its expected
    distribution from process_logits itself: a temperature applied as T**0.5 passed them all)."""
    import math

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = process_logits(logits, params)
    for row, p in zip(logits.double().tolist(), got.tolist(), strict=True):
        weights = [math.exp(v / temperature) for v in row]
        order = sorted(range(len(row)), key=lambda i: -row[i])  # (no ties among random logits)
        order = [i for i in order if weights[i] >= min_p * max(weights)]  # min-p first, as vLLM's sampler
        kept = order[: top_k or len(row)]
        total = sum(weights[i] for i in kept)
        mass, nucleus = 0.0, []
        for i in kept:  # the smallest prefix whose mass reaches top_p
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += weights[i] / total
        norm = sum(weights[i] for i in nucleus)
        want = [weights[i] / norm if i in nucleus else 0.0 for i in range(len(row))]
        assert p == pytest.approx(want, abs=1e-6)


def test_a_top_p_cut_inside_tied_logits_keeps_their_lowest_ids() -> None:
    """An unstable sort picked an arbitrary subset of a tie group (ids up to 46079 of 49152 here), which could
    differ between a plain step's rows and a verify's on a device whose sort depends on the shape."""
    vocab = 49152
    p = process_logits(torch.zeros(8, vocab), SamplingParams(temperature=1.0, top_p=0.3))
    keep = int(vocab * 0.3) + 1  # the smallest prefix whose mass reaches 0.3 (float32 rounding: one more)
    assert torch.equal(p > 0, (torch.arange(vocab) < keep).expand(8, vocab))


def test_stream_yields_steps_and_an_abandoned_stream_frees_its_slot(tiny: LlamaModel) -> None:
    engine = Engine(tiny, None, eos_token_ids=set())
    outs = list(engine.stream(PROMPTS[0], SamplingParams(max_tokens=5)))
    assert [len(o.token_ids) for o in outs] == [1] * 5 and outs[-1].finished
    assert [o.stats.target_forwards for o in outs] == [1, 2, 3, 4, 5]  # each its step's counts, not the live ones
    stream = engine.stream(PROMPTS[1], SamplingParams(max_tokens=50))
    next(stream)
    assert engine.loop.target.cache.num_free == engine.loop.target.cache.num_slots - 1
    stream.close()
    assert engine.loop.target.cache.num_free == engine.loop.target.cache.num_slots
    assert not engine.loop.has_work
    # submitted at the call: bad input raises there, and a stream never started is dropped with it
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.stream([10**6])
    unstarted = engine.stream(PROMPTS[1], SamplingParams(max_tokens=50))
    assert engine.loop.has_work
    del unstarted
    gc.collect()
    assert not engine.loop.has_work and not engine._outbox
    # ... and one closed before its first ``next`` (contextlib.closing, a client gone before its first chunk): it
    # ran on to its end beside the others, its outputs kept, until the garbage collector took the stream
    unread = engine.stream(PROMPTS[1], SamplingParams(max_tokens=50))
    unread.close()
    assert not engine.loop.has_work and not engine._outbox
    unread.close()  # (again: nothing)
    with pytest.raises(StopIteration):
        next(unread)
    chains = SpecConfig(method=SpecMethod.chain, drafter=Drafter.lookup)  # per-request speculation, as submit
    looked_up = list(engine.stream([7, 7, 7, 7, 7], SamplingParams(max_tokens=8), speculation=chains))
    assert sum(o.stats.drafted > 0 for o in looked_up) > 0


def test_a_stream_the_collector_finalises_inside_another_abort_is_aborted_after_it(
    tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The garbage collector may finalise a dropped stream at any allocation, so inside the engine's own call into the
    loop: here inside another stream's abort, while that holds the suffix cache's lock (not re-entrant). The
    finalised stream's abort waits for the outer call to end (it re-entered the lock: the thread hung for good)."""
    suffix = SpecConfig(method=SpecMethod.chain, drafter=Drafter.suffix)
    engine = Engine(tiny, None, eos_token_ids=set(), speculation=suffix)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    first, second = engine.stream(PROMPTS[0], params), engine.stream(PROMPTS[1], params)
    next(first), next(second)
    add = SuffixTrie.add

    def collecting_add(trie: SuffixTrie, tokens: list[int]) -> None:
        gc.collect()  # as the collector may at any allocation
        add(trie, tokens)

    gc.disable()  # the collector runs where the test says only
    try:
        cycle: list[object] = [first]
        cycle.append(cycle)  # the half-read first stream is held by a reference cycle alone
        del first, cycle
        monkeypatch.setattr(SuffixTrie, "add", collecting_add)
        closer = threading.Thread(target=second.close, daemon=True)
        closer.start()
        closer.join(timeout=60)
    finally:
        gc.enable()
    assert not closer.is_alive(), "the second stream's abort hung"
    assert not engine.loop.has_work and not engine._outbox and not engine._deferred_aborts
    assert engine.loop.target.cache.num_free == engine.loop.target.cache.num_slots
    [after] = engine.generate(PROMPTS[2], SamplingParams(max_tokens=6))
    assert after.token_ids == greedy_reference(tiny, PROMPTS[2], 6)


def test_an_abort_cut_short_by_an_interrupt_leaves_later_aborts_running(
    tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt inside a stream's abort (while it adds the output to the suffix cache) left the engine counted
    inside a loop call for good: every later abort waited for an outermost call that never ended, and the dropped
    requests ran on holding their KV."""
    suffix = SpecConfig(method=SpecMethod.chain, drafter=Drafter.suffix)
    engine = Engine(tiny, None, eos_token_ids=set(), speculation=suffix)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    first, second = engine.stream(PROMPTS[0], params), engine.stream(PROMPTS[1], params)
    next(first), next(second)
    add, interrupted = SuffixTrie.add, []

    def interrupted_once(trie: SuffixTrie, tokens: list[int]) -> None:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        add(trie, tokens)

    monkeypatch.setattr(SuffixTrie, "add", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        first.close()
    second.close()
    assert not engine._deferred_aborts and [s.request.request_id for s in engine.loop.running] == []
    assert engine.loop.target.cache.num_free == engine.loop.target.cache.num_slots


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"max_tokens": 0},
        {"seed": 2**64},
        {"stop": [""]},
        {"nonsense": 1},
        # a bool read as 1 (top_k=True made a sampled request greedy), as the HTTP API refuses it
        {"top_k": True},
        {"max_tokens": True},
        {"seed": False},
        {"temperature": True},
        {"top_k": np.True_},  # numpy's bool is no Python bool
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"min_p": True},
        {"stop_token_ids": 5},
        {"stop_token_ids": "5"},
        {"stop_token_ids": [True]},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": [1.0]},
        {"stop_token_ids": list(range(1025))},
    ],
)
def test_invalid_sampling_values_raise_naming_the_field(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_bad_prompts_raise_clear_errors(tiny: LlamaModel) -> None:
    engine = Engine(tiny, None, max_model_len=32, eos_token_ids=set())
    with pytest.raises(InvalidRequestError, match="context limit is 32"):
        engine.generate([list(range(40))])
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine.generate([[10**6]])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.generate("hello")
    for bad, names in (([5, True, 13], "bool True"), ([1.0, 2.0], "float 1.0"), ([5, "a"], "str 'a'")):
        with pytest.raises(InvalidRequestError, match=f"token ids .* not {names}"):
            engine.generate([bad])
    with pytest.raises(InvalidRequestError, match="SamplingParams, not dict"):
        engine.generate([[5, 9]], {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="SpecConfig or None, not dict"):  # (was an AttributeError)
        engine.generate([[5, 9]], speculation={"method": "chain"})  # type: ignore[arg-type]
    assert not engine.loop.has_work
    ints = engine.generate([[5, 9, 13]], SamplingParams(max_tokens=4))[0].token_ids
    numpy_ints = [np.int64(5), np.int32(9), np.uint16(13)]  # what a tokenizer or an array hands over
    assert engine.generate([numpy_ints], SamplingParams(max_tokens=4))[0].token_ids == ints  # type: ignore[list-item]
    # one prompt, not a list of prompts: its ids as numpy integers read as one prompt too, not as one-token prompts
    (single,) = engine.generate(numpy_ints, SamplingParams(max_tokens=4))  # type: ignore[arg-type]
    assert single.token_ids == ints


def test_eos_token_ids_must_be_token_ids(tiny: LlamaModel) -> None:
    from specserve.errors import SettingsError

    for bad in (2, "</s>", {"</s>"}, [True]):
        with pytest.raises(SettingsError, match="eos_token_ids"):
            Engine(tiny, None, eos_token_ids=bad)  # type: ignore[arg-type]
    assert Engine(tiny, None, eos_token_ids=[np.int64(2)]).loop.eos_token_ids == {2}  # type: ignore[list-item]


def test_one_engine_serves_several_threads_at_once(tiny: LlamaModel) -> None:
    """Six threads generating on one engine: every call gets plain decoding's tokens (they used to fail with
    another request's KV or sequence errors), and every KV slot comes back."""
    engine = Engine(tiny, None, max_batch_size=4, max_model_len=128, eos_token_ids=set())
    prompts = [[3 + i, 7, 9] for i in range(6)]
    want = [greedy_reference(tiny, p, 24) for p in prompts]
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = [engine.generate([prompts[i]], SamplingParams(max_tokens=24))[0].token_ids for _ in range(3)]
        except BaseException as e:  # reported below, with the thread's index
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == {i: [want[i]] * 3 for i in range(6)}
    assert not engine.loop.has_work and engine.loop.target.cache.num_free == 4


class CharTokenizer:
    """decode() and no byte tokens: token id i is chr(i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {}


def test_incremental_text_holds_back_possible_stop_prefixes() -> None:
    text = IncrementalText(CharTokenizer(), stop=["END", "xy"])  # type: ignore[arg-type]
    ids: list[int] = []
    deltas = []
    for ch in "abcENxENDzzz":
        ids.append(ord(ch))
        deltas.append(text.update(ids))
        if text.stopped:
            break
    assert "".join(deltas) == "abcENx"
    assert deltas[3] == "" and deltas[4] == ""  # "E", "EN" held back
    assert text.stopped


def test_incremental_text_final_flushes_everything() -> None:
    text = IncrementalText(CharTokenizer(), stop=["END"])  # type: ignore[arg-type]
    assert text.update([ord("a"), ord("E")]) == "a"
    assert text.update([ord("a"), ord("E")], final=True) == "E"


@pytest.mark.parametrize("temperature", [1e-300, 1e-50, 1e-45, 1e-38, 1e-8])
def test_tiny_temperatures_are_numerically_safe(tiny: LlamaModel, temperature: float) -> None:
    """A temperature the schema accepts but that overflows a naive logits / T: probabilities stay a distribution
    (no inf or nan) and decoding, plain or speculative with sampled drafts, is the greedy one."""
    from specserve.models.tiny import noisy_copy

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 5
    p = process_logits(logits, SamplingParams(temperature=temperature, seed=0))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(4))
    assert torch.equal(p.argmax(-1), logits.argmax(-1)) and (p.max(-1).values > 0.99).all()
    greedy = Engine(tiny, None, eos_token_ids=set()).generate([[1, 2, 3]], SamplingParams(max_tokens=12))[0]
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=1)
    spec = SpecConfig(method=SpecMethod.chain, sl=3)  # sampled drafts: the draft samples at T too
    for engine in (Engine(tiny, None), Engine(tiny, None, draft=noisy_copy(tiny, 0.2), speculation=spec)):
        out = engine.generate([[1, 2, 3]], params)[0]
        assert out.token_ids == greedy.token_ids


@pytest.mark.parametrize("top_p", [1e-300, 1e-50, 1e-9])
def test_a_tiny_top_p_keeps_the_most_likely_token(tiny: LlamaModel, top_p: float) -> None:
    """A top_p the schema accepts (> 0) but below float32's range keeps the smallest prefix reaching it: the most
    likely token alone, so sampling is greedy, not a distribution of nans."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 5
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=0))
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 64).float())
    greedy = Engine(tiny, None, eos_token_ids=set()).generate([[1, 2, 3]], SamplingParams(max_tokens=8))[0]
    out = Engine(tiny, None, eos_token_ids=set()).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=8, temperature=1.0, top_p=top_p, seed=1)
    )[0]
    assert out.token_ids == greedy.token_ids


def test_every_64_bit_seed_works_and_larger_ones_are_rejected(tiny: LlamaModel) -> None:
    from specserve.config import SpecConfig, SpecMethod
    from specserve.models.tiny import noisy_copy

    spec = SpecConfig(method=SpecMethod.chain, sl=3)
    engine = Engine(tiny, None, draft=noisy_copy(tiny, 0.2), speculation=spec)
    for seed in (2**63 - 1, -(2**63), 0):
        params = SamplingParams(max_tokens=8, temperature=0.8, seed=seed)
        first, again = engine.generate([[1, 2]], params)[0], engine.generate([[1, 2]], params)[0]
        assert first.token_ids == again.token_ids and len(first.token_ids) == 8
    for seed in (2**63, 2**70, -(2**63) - 1):
        with pytest.raises(pydantic.ValidationError, match="seed"):
            SamplingParams(seed=seed)


def test_streams_and_generate_consumed_together_each_get_their_own_output(tiny: LlamaModel) -> None:
    """Two streams read side by side, and a generate call while a stream is open: each step's outputs reach the
    consumer of their request, none is dropped and no consumer waits for an output another one took."""
    engine = Engine(tiny, None, max_batch_size=4, eos_token_ids=set())
    params = SamplingParams(max_tokens=12)
    alone = [greedy_reference(tiny, p, 12) for p in PROMPTS[:3]]
    got: list[list[int]] = [[], []]
    streams = [engine.stream(PROMPTS[0], params), engine.stream(PROMPTS[1], params)]
    for outs in itertools.zip_longest(*streams):
        for i, out in enumerate(outs):
            if out is not None:
                got[i] += out.token_ids
    assert got == alone[:2]
    stream = engine.stream(PROMPTS[0], params)
    first = next(stream).token_ids
    assert engine.generate([PROMPTS[2]], params)[0].token_ids == alone[2]
    assert first + [t for out in stream for t in out.token_ids] == alone[0]
    early = engine.stream(PROMPTS[1], params)
    next(early)
    early.close()  # a consumer that stops early frees its request
    assert engine.loop.target.cache.num_free == 4 and not engine.loop.has_work


def test_collect_runs_submitted_requests_in_the_order_given(tiny: LlamaModel) -> None:
    engine = Engine(tiny, None, max_batch_size=4, eos_token_ids=set())
    ids = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS[:3], (5, 9, 7), strict=True)]
    done = engine.collect(ids[::-1])
    assert [c.request_id for c in done] == ids[::-1]
    want = [greedy_reference(tiny, p, n) for p, n in zip(PROMPTS[2::-1], (7, 9, 5), strict=True)]
    assert [c.token_ids for c in done] == want
    with pytest.raises(InvalidRequestError, match="req-0"):
        engine.collect([ids[0]])  # finished and consumed
    assert not engine.loop.has_work
    again = engine.submit(PROMPTS[0], SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError, match="given twice"):
        engine.collect([again, again])
    assert [c.token_ids for c in engine.collect([again])] == [greedy_reference(tiny, PROMPTS[0], 3)]


def test_a_request_read_by_a_stream_cannot_be_collected_too(tiny: LlamaModel) -> None:
    """``collect`` took the outputs of a request a stream was reading: the completion lacked the stream's tokens
    yet read finished, and the stream then failed."""
    engine = Engine(tiny, None, max_batch_size=2, eos_token_ids=set())
    params = SamplingParams(max_tokens=6)
    stream = engine.stream(PROMPTS[0], params)
    rid = "req-0"  # the engine's first request
    with pytest.raises(InvalidRequestError, match="already read by a stream"):
        engine.collect([rid])  # before the stream's first next, too
    first = next(stream)
    assert first.request_id == rid
    with pytest.raises(InvalidRequestError, match="already read by a stream"):
        engine.collect([rid])
    assert first.token_ids + [t for out in stream for t in out.token_ids] == greedy_reference(tiny, PROMPTS[0], 6)
    # a collect that is refused claims none of its other ids either
    other = engine.submit(PROMPTS[1], params)
    held = engine.stream(PROMPTS[2], params)
    with pytest.raises(InvalidRequestError, match="already read"):
        engine.collect([other, next(held).request_id])
    assert [c.token_ids for c in engine.collect([other])] == [greedy_reference(tiny, PROMPTS[1], 6)]
    held.close()
    assert engine.loop.target.cache.num_free == 2 and not engine.loop.has_work


def test_a_submitted_request_no_one_reads_can_be_aborted(tiny: LlamaModel) -> None:
    """The engine had no way to stop a submitted request: one never collected ran to its end and its outputs stayed
    in the engine for its life. ``abort`` frees its slot and outputs; a request a stream reads is the stream's."""
    engine = Engine(tiny, None, max_batch_size=2, eos_token_ids=set())
    params = SamplingParams(max_tokens=40)
    dropped, kept = engine.submit(PROMPTS[0], params), engine.submit(PROMPTS[1], SamplingParams(max_tokens=6))
    stream = engine.stream(PROMPTS[2], SamplingParams(max_tokens=6))
    first = next(stream)  # a step: every request has begun
    engine.abort(dropped)
    with pytest.raises(InvalidRequestError, match="no submitted and unconsumed request"):
        engine.collect([dropped])
    with pytest.raises(InvalidRequestError, match="read by a stream or a collect"):
        engine.abort(first.request_id)
    with pytest.raises(InvalidRequestError, match="no submitted and unconsumed request"):
        engine.abort("req-99")
    assert [c.token_ids for c in engine.collect([kept])] == [greedy_reference(tiny, PROMPTS[1], 6)]
    assert first.token_ids + [t for out in stream for t in out.token_ids] == greedy_reference(tiny, PROMPTS[2], 6)
    assert engine.loop.target.cache.num_free == 2 and not engine.loop.has_work and not engine._outbox


def test_bad_engine_arguments_are_clear_errors(tiny: LlamaModel) -> None:
    from specserve.errors import SettingsError

    for eos in ({tiny.cfg.vocab_size}, {-1}):  # never sampled: every request ran to max_tokens
        with pytest.raises(SettingsError, match="outside the model's vocabulary"):
            Engine(tiny, None, eos_token_ids=eos)
    with pytest.raises(InvalidRequestError, match="no prompts given"):  # was read as one prompt of no tokens
        Engine(tiny, None, eos_token_ids=set()).generate([])
    # a chat message outside its list ran its keys as two text prompts; a set's members ran in no order
    with pytest.raises(InvalidRequestError, match=r"not a dict \(a chat's messages go in a list\)"):
        Engine(tiny, None, eos_token_ids=set()).generate({"role": "user", "content": "hi"}, chat=True)
    with pytest.raises(InvalidRequestError, match="not a set"):
        Engine(tiny, None, eos_token_ids=set()).generate({(5, 6), (7, 8)})  # type: ignore[arg-type]


def test_engine_settings_are_checked_when_the_engine_is_built(
    tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device that cannot run the models, and speculation that needs a draft model on an engine without one, are
    refused at construction (not by the model loader's misleading error, nor by every request); ``from_config``
    passes every loop setting on, ``spec_headroom`` included (it was dropped: 64 whatever the config said)."""
    import specserve.engine as engine_module
    from specserve.config import EngineConfig, ModelSpec, SpecConfig, SpecMethod
    from specserve.errors import SettingsError

    for device in ("foo", "", "meta", "cuda:99"):
        with pytest.raises(pydantic.ValidationError, match="device"):
            EngineConfig(device=device)
    with pytest.raises(SettingsError, match="needs a draft model"):
        Engine(tiny, None, speculation=SpecConfig(method=SpecMethod.ddd))
    monkeypatch.setattr(engine_module, "load_model", lambda spec, device="cpu": tiny)
    monkeypatch.setattr(engine_module, "load_draft", lambda spec, target, device="cpu": tiny)
    monkeypatch.setattr(engine_module, "load_tokenizer", lambda spec: None)
    spec = SpecConfig(method=SpecMethod.chain, sl=4)
    engine = Engine.from_config(EngineConfig(draft=ModelSpec(), speculation=spec, spec_headroom=200))
    assert engine.loop.spec_headroom == 200
    wide = SpecConfig(method=SpecMethod.eagle2, budget=100, beam_width=3)  # needs more than the default 64 rows
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), speculation=wide)[0].token_ids


def test_a_max_model_len_lowered_for_the_speculative_headroom_says_so(
    tiny: LlamaModel, caplog: pytest.LogCaptureFixture
) -> None:
    """The KV slot keeps room past max_model_len for one speculative step's tokens; where the model's positions
    cannot hold both, max_model_len was lowered without a word (a plain engine asked for 512 served 448)."""
    positions = tiny.cfg.max_position_embeddings
    with caplog.at_level("WARNING", logger="specserve.limits"):
        engine = Engine(tiny, None, max_model_len=positions, eos_token_ids=set())
    assert engine.loop.max_model_len == positions - 64
    assert f"max_model_len {positions} lowered to {positions - 64}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="specserve.limits"):
        Engine(tiny, None, max_model_len=positions - 64, eos_token_ids=set())
    assert "lowered" not in caplog.text


def test_a_batch_interrupted_while_it_is_submitted_leaves_nothing_running(
    tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while generate encodes a long batch of text prompts: the prompts submitted before it kept KV slots,
    ran in every later call, and kept their outputs for the engine's life (their ids were never returned)."""
    engine = Engine(tiny, None, max_batch_size=4, eos_token_ids=set())
    submit = engine.submit
    calls = itertools.count()

    def interrupted(*args: object, **kwargs: object) -> str:
        if next(calls) == 2:
            raise KeyboardInterrupt
        return submit(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS[:3], SamplingParams(max_tokens=8))
    monkeypatch.undo()
    done = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=4))
    assert len(done) == 1 and not engine._outbox and not engine.loop.has_work
    assert engine.loop.target.cache.num_free == 4


def test_a_str_where_a_list_of_ids_or_params_goes_is_refused_by_name(tiny: LlamaModel) -> None:
    """A str is a Sequence: collect("req-3") looked for the ids "r", "e", ... and generate(p, params="ab") counted
    two parameter sets."""
    engine = Engine(tiny, None, eos_token_ids=set())
    with pytest.raises(InvalidRequestError, match="request_ids are a list of ids, not a str"):
        engine.collect("req-3")
    with pytest.raises(InvalidRequestError, match="params are SamplingParams or a list of them, not a str"):
        engine.generate([PROMPTS[0]], "ab")  # type: ignore[arg-type]


def test_misused_arguments_get_errors_that_name_them(tiny: LlamaModel) -> None:
    """Values the engine's settings accept as numbers ("256", 256.0) were then used as given (a TypeError from the KV
    cache's torch.zeros); collect(None) was a bare TypeError; a chat list with one item not a dict was blamed on its
    first, valid message."""
    for kw in ({"max_model_len": 256.0}, {"max_model_len": "256"}, {"max_batch_size": 4.0}, {"spec_headroom": "8"}):
        engine = Engine(tiny, None, eos_token_ids=set(), **kw)  # type: ignore[arg-type]
        assert engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4))[0].token_ids
    with pytest.raises(InvalidRequestError, match="request_ids are a list of ids, not NoneType"):
        engine.collect(None)  # type: ignore[call-overload]
    with pytest.raises(InvalidRequestError, match="chat messages are dicts; message 1 is str 'and more'"):
        engine.encode([{"role": "user", "content": "hi"}, "and more"])  # type: ignore[arg-type]


def test_the_library_errors_pickle_with_their_fields() -> None:
    """Errors that cross a Ray call are pickled: a PromptTooLongError or PartialStepError could not be rebuilt
    (their __init__ takes fields the message arguments leave out)."""
    import pickle

    from specserve.errors import PartialStepError, PromptTooLongError, SequenceError

    for error in (
        InvalidRequestError("bad top_p", param="top_p"),
        PromptTooLongError("too long", param="prompt", fewest=9),
        PartialStepError([], {3: SequenceError(3, "detok failed")}),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert {k: str(v) for k, v in vars(again).items()} == {k: str(v) for k, v in vars(error).items()}


def test_an_engine_given_a_name_for_its_model_or_tokenizer_says_what_it_takes(tiny: LlamaModel) -> None:
    """Engine(model, "HuggingFaceTB/SmolLM2-135M") died with "'str' object has no attribute 'eos_token_id'" deep in
    the build."""
    from specserve.errors import SettingsError

    with pytest.raises(SettingsError, match=r"tokenizer is a transformers tokenizer \(load_tokenizer\(...\)\) or None"):
        Engine(tiny, "HuggingFaceTB/SmolLM2-135M")  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match=r"model is a loaded LlamaModel \(load_model\(...\)\), not a str"):
        Engine("smollm2-135m-instruct", None)  # type: ignore[arg-type]
    with pytest.raises(
        SettingsError, match=r"draft is a loaded LlamaModel or EagleHead \(load_draft\(...\)\), not a str"
    ):
        Engine(tiny, None, draft="smollm2-eagle1")  # type: ignore[arg-type]
