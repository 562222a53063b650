"""Log-probabilities of the output (OpenAI's ``logprobs``): per output token its log-probability under the target's
own distribution (before bias, temperature or cuts, as vLLM's default) and the likeliest tokens', whichever drafter
proposed it; checked against a reference written here that re-runs the whole sequence each token."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.resume import StreamCursor, StreamMark
from specserve.api.server import _CompletionFormat
from specserve.detok import IncrementalText
from specserve.engine import Completion, Engine
from specserve.messages import TokenLogprob
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_config, tiny_model
from specserve.prompts import PromptEncoder
from specserve.sampling import SamplingParams
from specserve.sequence import Delivered, FinishReason, Request, RequestOutput, RequestStats, Sequence
from tests.drafting import PROMPT, SPECS, drafting_engine


def reference_logprobs(model: LlamaModel, prompt: list[int], tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each token's log-probability after the prompt and the tokens before it, from a fresh forward of the whole
    sequence, in float64, and the k likeliest tokens'."""
    out = []
    for i, tok in enumerate(tokens):
        seq = [*prompt, *tokens[:i]]
        cache = model.new_cache(1, len(seq) + 1)
        logits = model(ForwardBatch.build(cache, [cache.allocate()], [seq], num_logits=[1]), cache)[-1]
        lp = logits.double().log_softmax(-1)
        top = lp.topk(k)
        top_pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        out.append(TokenLogprob(tok, float(lp[tok]), top_pairs))
    return out


def assert_close(got: list[TokenLogprob], want: list[TokenLogprob]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.token == w.token and g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-4)


@pytest.mark.parametrize("name", list(SPECS))
def test_logprobs_are_the_targets_whoever_drafted(name: str) -> None:
    """Greedy, sampled and with a logit bias (the values are the unbiased distribution's, as vLLM's default): one
    entry per output token, drafted and accepted or the step's own, with the likeliest tokens in order."""
    target, engine = drafting_engine(name)
    cases = [
        SamplingParams(max_tokens=20, logprobs=3),
        SamplingParams(max_tokens=20, logprobs=0, temperature=1.0, seed=4),
        SamplingParams(max_tokens=20, logprobs=5, logit_bias={PROMPT[0]: 3.0, 40: -100.0}),
    ]
    accepted = 0
    for params in cases:
        out = engine.generate([PROMPT], params)[0]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 20
        assert_close(out.logprobs, reference_logprobs(target, PROMPT, out.token_ids, params.logprobs or 0))
        accepted += out.stats.accepted
    if name != "plain":
        assert accepted > 0  # (drafted tokens' logprobs are among those checked)
    assert engine.generate([PROMPT], SamplingParams(max_tokens=5))[0].logprobs is None  # not asked for


@pytest.mark.parametrize("name", ["plain", "chain", "ddd"])
def test_an_answer_ended_by_eos_lists_the_eos_last(name: str) -> None:
    """EOS is not an output token here (nor in the text or usage), but as in vLLM its log-probability is listed
    after the output's: lm-eval reads the entry after the prompt's as the answer's first token's."""
    target, _ = drafting_engine(name)
    free_ids = Engine(target, None, eos_token_ids=set()).generate([PROMPT], SamplingParams(max_tokens=12))[0].token_ids
    for at in (0, 4, 9):
        eos = free_ids[at]
        if eos in free_ids[:at]:
            continue
        _, engine = drafting_engine(name)
        engine.loop.eos_token_ids = frozenset({eos})
        out = engine.generate([PROMPT], SamplingParams(max_tokens=12, logprobs=2))[0]
        assert out.token_ids == free_ids[:at] and out.logprobs is not None and len(out.logprobs) == at + 1
        assert_close(out.logprobs, reference_logprobs(target, PROMPT, free_ids[: at + 1], 2))
        stopped = engine.generate([PROMPT], SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True))[0]
        assert stopped.logprobs is not None and len(stopped.logprobs) == len(stopped.token_ids) == 12


@pytest.mark.parametrize("name", ["plain", "chain", "head-ddd"])
def test_prompt_logprobs_come_with_the_first_output(name: str) -> None:
    """vLLM's prompt_logprobs: each prompt token's after the ones before it, once, with the request's first output
    (the step that prefilled it), beside a request that asks for none in the same step."""
    target, engine = drafting_engine(name)
    params = SamplingParams(max_tokens=6, prompt_logprobs=3, logprobs=1)
    first_ids = engine.submit(PROMPT, params), engine.submit(PROMPT[::-1], SamplingParams(max_tokens=6))
    outputs = []
    while engine.loop.has_work:
        outputs += [o for o in engine.loop.step() if o.request_id == first_ids[0]]
        if len(outputs) == 1:  # a fresh target worker: it re-prefills the prompt, and does not send them again
            engine.loop.recover(target=True, draft=False)
    assert outputs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outputs[1:])
    assert_close(outputs[0].prompt_logprobs, reference_logprobs(target, PROMPT[:1], PROMPT[1:], 3))
    done = engine.generate([PROMPT, PROMPT[1:]], [params, SamplingParams(max_tokens=6)])
    assert done[0].prompt_logprobs is not None and len(done[0].prompt_logprobs) == len(PROMPT) - 1
    assert done[1].prompt_logprobs is None
    assert engine.generate([[7]], params)[0].prompt_logprobs == []  # (a prompt of one token: none before it)


def test_a_sequence_asks_the_target_for_prompt_logprobs_only_if_its_request_does() -> None:
    """A Sequence made without the step loop's add_request (its prompt_logprobs_sent at the default) asked for
    them whatever its request said, and a target worker then failed on the count it had not been given."""
    loop = Engine(tiny_model(tiny_config(), seed=0), None, eos_token_ids=set()).loop
    for params, asks in ((SamplingParams(), False), (SamplingParams(prompt_logprobs=2), True)):
        seq = Sequence(0, Request("r", [1, 2, 3], params), IncrementalText(None, ()))
        assert loop._verify_item(seq, None).prompt_logprobs is asks
    # a continuation of a request another lane started: that lane sent them with its first output
    params = SamplingParams(max_tokens=6, prompt_logprobs=2)
    started = Engine(tiny_model(tiny_config(), seed=0), None, eos_token_ids=set()).generate([PROMPT], params)[0]
    assert started.prompt_logprobs is not None
    loop.add_request(Request("c", PROMPT, params, delivered=Delivered(tuple(started.token_ids[:2]), "")))
    outputs = []
    while loop.has_work:
        outputs += loop.step()
    assert [t for o in outputs for t in o.token_ids] == started.token_ids[2:]
    assert outputs and all(o.prompt_logprobs is None for o in outputs)


@pytest.mark.parametrize("name", ["plain", "chain", "ddd"])
def test_logprobs_follow_the_tokens_a_stop_cuts(name: str) -> None:
    """A stop string cuts accepted tokens off a step, a stop token id ends it: their logprobs go with them."""
    target, engine = drafting_engine(name, tokenizer=tiny_tokenizer())
    whole = engine.generate([PROMPT], SamplingParams(max_tokens=30, logprobs=1))[0]
    for i in (6, 13, 21):
        stop = whole.text[i : i + 2]
        out = engine.generate([PROMPT], SamplingParams(max_tokens=30, logprobs=1, stop=(stop,)))[0]
        assert out.finish_reason == FinishReason.stop and 0 < len(out.token_ids) < 30
        assert out.logprobs == whole.logprobs[: len(out.token_ids)]  # type: ignore[index]
        stop_id = whole.token_ids[i]
        by_id = engine.generate([PROMPT], SamplingParams(max_tokens=30, logprobs=1, stop_token_ids=[stop_id]))[0]
        assert by_id.token_ids[-1] == stop_id and by_id.logprobs == whole.logprobs[: len(by_id.token_ids)]  # type: ignore[index]
    assert_close(whole.logprobs or [], reference_logprobs(target, PROMPT, whole.token_ids, 1))


def test_a_batch_of_requests_asking_for_different_counts() -> None:
    """One step's rows: some ask for logprobs (different counts), some not, greedy and sampled side by side."""
    target, engine = drafting_engine("chain")
    params = [
        SamplingParams(max_tokens=12, logprobs=2),
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=12, logprobs=0, temperature=0.8, seed=1),
        SamplingParams(max_tokens=12, logprobs=7, temperature=1.0, seed=2),
    ]
    prompts = [PROMPT, PROMPT[1:], [3, 4], PROMPT[::-1]]
    for prompt, p, out in zip(prompts, params, engine.generate(prompts, params), strict=True):
        if p.logprobs is None:
            assert out.logprobs is None
        else:
            assert_close(out.logprobs or [], reference_logprobs(target, prompt, out.token_ids, p.logprobs))


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_sampling_params_refuse_a_bad_logprobs_count(bad: object) -> None:
    with pytest.raises(ValidationError, match="logprobs"):
        SamplingParams(logprobs=bad)  # type: ignore[arg-type]


def test_a_vocabulary_smaller_than_the_count_lists_every_token() -> None:
    target = tiny_model(tiny_config(vocab_size=16), seed=0)
    out = Engine(target, None, eos_token_ids=set()).generate([[1, 2, 3]], SamplingParams(max_tokens=3, logprobs=20))[0]
    assert out.logprobs is not None and [len(lp.top) for lp in out.logprobs] == [16, 16, 16]
    assert_close(out.logprobs, reference_logprobs(target, [1, 2, 3], out.token_ids, 16))


def test_params_with_logprobs_and_a_bias_go_through_their_own_json() -> None:
    params = SamplingParams(logprobs=3, logit_bias={7: -2.0, 3: 1.0}, min_tokens=2)
    assert SamplingParams.model_validate_json(params.model_dump_json()) == params


def test_a_tokens_bytes_are_its_own_where_its_text_is_part_of_a_character() -> None:
    """A byte-level BPE piece maps back to its bytes: the two tokens of "é" each decode to U+FFFD, and their bytes
    join to the character (what OpenAI's ``bytes`` is for)."""
    tok = tiny_tokenizer()
    encoder = PromptEncoder(tok, 512)
    ids = tok.encode("é café", add_special_tokens=False)
    assert [encoder.token_text(t) for t in ids[:2]] == ["\ufffd", "\ufffd"]
    assert b"".join(encoder.token_bytes(t) for t in ids) == "é café".encode()
    assert PromptEncoder(None, 512).token_bytes(7) == b"token_id:7"


@pytest.mark.parametrize("decoder", ["metaspace", "replace"])
def test_a_sentencepiece_tokens_bytes_keep_the_space_its_marker_stands_for(decoder: str) -> None:
    """A SentencePiece piece decoded alone drops its leading space ("▁and" -> "and"): an answer's bytes joined ran
    its words together ("aband" for " a b and", the answer's text in context). Its marker is the space; an added
    token's bytes stay its text."""
    from tokenizers import decoders

    from specserve.detok import IncrementalText
    from tests.test_prompts import _metaspace_tokenizer

    tok = _metaspace_tokenizer()
    if decoder == "replace":  # Llama-2's: the marker replaced, byte fallback, then the first space stripped
        tok.backend_tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    encoder = PromptEncoder(tok, len(tok))
    ids = tok.encode("a b and", add_special_tokens=False)
    text = IncrementalText(tok, prompt_ids=tok.encode("[INST] x", add_special_tokens=False))
    answer = text.update(ids, final=True)
    assert answer == " a b and"  # (the answer keeps its leading space in context)
    assert b"".join(encoder.token_bytes(t) for t in ids) == answer.encode()
    assert encoder.token_bytes(tok.eos_token_id) == b"</s>"


def test_joined_and_resumed_outputs_keep_their_logprobs_with_their_tokens() -> None:
    lps = [TokenLogprob(i + 1, -0.5 - i, ((i, -0.1),)) for i in range(5)]

    def output(ids: list[int], text: str, logprobs: list[TokenLogprob], finished: bool = False) -> RequestOutput:
        reason = FinishReason.length if finished else None
        return RequestOutput("r", ids, text, reason, 3, len(ids), RequestStats(), logprobs=logprobs)

    first, second = output([1, 2], "ab", lps[:2]), output([3, 4, 5], "cde", lps[2:], finished=True)
    assert first.then(second).logprobs == lps
    cursor = StreamCursor(StreamMark().after([1, 2, 3], b"abc"))
    assert cursor.advance(first) is None
    assert StreamCursor.passed_over(first, None) == [1, 2]
    rest = cursor.advance(second)  # (the resume point inside this output: its first token was sent before)
    assert rest is not None and rest.token_ids == [4, 5] and rest.logprobs == lps[3:]
    assert StreamCursor.passed_over(second, rest) == [3]
    # a completions stream's text offsets count the tokens it passed over: those of the whole answer
    fmt = _CompletionFormat("m", PromptEncoder(tiny_tokenizer(), 512))
    fmt.skip([1, 2, 3])
    chunk = fmt.chunk(rest, with_ids=False)
    texts = [fmt.token_text(t) for t in [1, 2, 3, 4, 5]]
    assert chunk.choices[0].logprobs.text_offset == [len("".join(texts[:3])), len("".join(texts[:4]))]  # type: ignore[attr-defined]


def test_an_interrupted_commit_keeps_logprobs_in_step_with_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in a row's detokenisation, after its output (and logprobs) grew: the row's state goes back, logprobs
    included, so the step committed again adds each token's entry once."""
    target, engine = drafting_engine("chain", tokenizer=tiny_tokenizer())
    params = SamplingParams(max_tokens=16, logprobs=2, ignore_eos=True)
    alone = engine.generate([PROMPT], params)[0]
    rid, other = engine.submit(PROMPT, params), engine.submit(PROMPT[1:], params)
    seq = engine.loop.waiting[0]
    real_update = IncrementalText.update
    fired: list[int] = []

    def update(text: IncrementalText, token_ids: list[int], *, final: bool = False, drop_open: bool = False) -> str:
        if text is seq.text and len(token_ids) > 4 and not fired:
            fired.append(len(seq.pending_logprobs))
            raise KeyboardInterrupt
        return real_update(text, token_ids, final=final, drop_open=drop_open)

    monkeypatch.setattr(IncrementalText, "update", update)
    with pytest.raises(KeyboardInterrupt):
        engine.collect([other])  # (the interrupted caller's request goes)
    assert fired and fired[0] > 0
    done: Completion = engine.collect([rid])[0]
    assert done.token_ids == alone.token_ids
    assert_close(done.logprobs or [], alone.logprobs or [])  # (one entry per token: none twice, none lost)
    assert_close(done.logprobs or [], reference_logprobs(target, PROMPT, done.token_ids, 2))
