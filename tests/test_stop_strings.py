"""Tokens past a stop string are not output (issue 16 item 5): with speculation a step emits several tokens, and
the ones after the token that completed the stop string must not be counted or returned."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest
from transformers import PreTrainedTokenizerBase

from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.config import Drafter, SpecConfig, SpecMethod
from specserve.detok import IncrementalText
from specserve.engine import Engine
from specserve.messages import VerifyOutput
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from specserve.sampling import SamplingParams
from specserve.sequence import Delivered, FinishReason, Request
from specserve.step_loop import StepLoop

PROMPTS = ("The quick brown fox", "hello world")


def test_incremental_text_counts_tokens_through_the_stop_string() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("say: hello STOP and more words", add_special_tokens=False)
    through = next(n for n in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:n]))
    assert through < len(ids)
    one_by_one = IncrementalText(tok, ["STOP"])
    for n in range(1, len(ids) + 1):
        one_by_one.update(ids[:n])
        if one_by_one.stopped:
            break
    assert one_by_one.stop_tokens == n == through
    in_steps = IncrementalText(tok, ["STOP"])  # a speculative step emits several tokens, past the stop string
    in_steps.update(ids[: through - 2])
    assert not in_steps.stopped and in_steps.stop_tokens is None
    in_steps.update(ids)
    assert in_steps.stopped and in_steps.stop_tokens == through
    assert in_steps.text == one_by_one.text == "say: hello "


STOP_SPECS = {
    "chain": SpecConfig(method=SpecMethod.chain, sl=4),
    "eagle2": SpecConfig(method=SpecMethod.eagle2, tree_depth=6, beam_width=2, budget=12),
    "ddd": SpecConfig(method=SpecMethod.ddd, beam_width=2, budget=12),
    "lookup": SpecConfig(method=SpecMethod.chain, sl=6, drafter=Drafter.lookup),
    "suffix": SpecConfig(method=SpecMethod.eagle2, tree_depth=6, budget=12, drafter=Drafter.suffix),
}


@pytest.mark.parametrize("name", list(STOP_SPECS))
def test_speculation_returns_no_tokens_past_a_stop_string(name: str) -> None:
    """A step can accept drafts past the stop string: they are neither returned, nor counted as accepted, nor
    remembered by the suffix trees (which would then draft text past a stop for the next request)."""
    target = tiny_model(tiny_config(), seed=0)
    tok = tiny_tokenizer()
    plain = Engine(target, tok, eos_token_ids=set())
    spec = Engine(
        target, tok, draft=noisy_copy(target, 0.02, seed=1), speculation=STOP_SPECS[name], eos_token_ids=set()
    )
    for prompt in PROMPTS:
        text = plain.generate(prompt, SamplingParams(max_tokens=40))[0].text
        for i in (5, 10, 15, 20):
            params = SamplingParams(max_tokens=40, stop=(text[i : i + 2],))
            alone = plain.generate(prompt, params)[0]
            drafted = spec.generate(prompt, params)[0]
            assert drafted.stats.accepted > 0 and drafted.text == alone.text
            assert drafted.token_ids == alone.token_ids  # the usage count and return_token_ids
            assert drafted.finish_reason == FinishReason.stop
            assert drafted.stop_reason == alone.stop_reason == text[i : i + 2]
            assert drafted.stats.accepted + drafted.stats.target_forwards == len(drafted.token_ids)
            cache = spec.loop.model_free.cache
            if name == "suffix":
                assert cache is not None and cache.entries[-1][1] == drafted.token_ids


def _plain_and(name: str) -> tuple[PreTrainedTokenizerBase, Engine, Engine]:
    """The tiny tokenizer, a plain engine, and one speculating as ``STOP_SPECS[name]`` ("plain": not at all)."""
    target = tiny_model(tiny_config(), seed=0)
    tok = tiny_tokenizer()
    spec = SpecConfig(method=SpecMethod.none) if name == "plain" else STOP_SPECS[name]
    drafting = Engine(target, tok, draft=noisy_copy(target, 0.02, seed=1), speculation=spec, eos_token_ids=set())
    return tok, Engine(target, tok, eos_token_ids=set()), drafting


@pytest.mark.parametrize("name", ["plain", *STOP_SPECS])
def test_a_stop_token_id_is_output_without_its_text(name: str) -> None:
    """As vLLM's ``stop_token_ids``: the first one generated ends the answer; its id is output (and counted), its
    text is not, from the first output token on, wherever in a speculative step's accepted run it comes."""
    tok, plain, engine = _plain_and(name)
    for prompt in PROMPTS:
        ids = plain.generate(prompt, SamplingParams(max_tokens=30))[0].token_ids
        for i in (0, 6, 13, 21):
            first = ids.index(ids[i])
            out = engine.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=[ids[i]]))[0]
            assert out.token_ids == ids[: first + 1] and out.finish_reason == FinishReason.stop
            assert out.stop_reason == ids[i]
            # (less an unfinished character at its end: the byte that may end it is not decoded)
            assert out.text == tok.decode(ids[:first], skip_special_tokens=True).rstrip("\ufffd")
            assert out.stats.accepted + out.stats.target_forwards == len(out.token_ids)
        if name != "plain":
            assert engine.generate(prompt, SamplingParams(max_tokens=30))[0].stats.accepted > 0
        j = next(j for j in range(8, 30) if ids.index(ids[j]) == j)  # a token's first place, well into the answer
        # the last token allowed: a length finish with its text (vLLM checks the length first)
        capped = engine.generate(prompt, SamplingParams(max_tokens=j + 1, stop_token_ids=[ids[j]]))[0]
        assert (capped.token_ids, capped.finish_reason, capped.stop_reason) == (ids[: j + 1], FinishReason.length, None)
        assert capped.text == tok.decode(ids[: j + 1], skip_special_tokens=True)
        # beside a stop string, whichever comes first ends the answer
        text_before = tok.decode(ids[:j], skip_special_tokens=True).rstrip("\ufffd")  # (complete characters)
        earlier = next(
            text_before[k : k + 2]
            for k in range(len(text_before) - 2, -1, -1)
            if "\ufffd" not in text_before[k : k + 2]
        )
        by_string = plain.generate(prompt, SamplingParams(max_tokens=30, stop=(earlier,)))[0]
        both = engine.generate(prompt, SamplingParams(max_tokens=30, stop=(earlier,), stop_token_ids=[ids[j]]))[0]
        assert (both.token_ids, both.text, both.stop_reason) == (by_string.token_ids, by_string.text, earlier)
        later = tok.decode(ids, skip_special_tokens=True)[-2:]
        if later not in tok.decode(ids[: j + 1], skip_special_tokens=True):
            both = engine.generate(prompt, SamplingParams(max_tokens=30, stop=(later,), stop_token_ids=[ids[j]]))[0]
            assert (both.token_ids, both.stop_reason) == (ids[: j + 1], ids[j])


@pytest.mark.parametrize("name", ["plain", *STOP_SPECS])
def test_include_stop_str_in_output_keeps_the_stop_in_the_text(name: str) -> None:
    """vLLM's ``include_stop_str_in_output``: the text ends with the stop string (nothing of its token past it), or
    with the stop token's text; the token ids are those without it."""
    tok, plain, engine = _plain_and(name)
    for prompt in PROMPTS:
        whole = plain.generate(prompt, SamplingParams(max_tokens=30))[0]
        for i in (4, 11, 19):
            stop = whole.text[i : i + 2]
            without = plain.generate(prompt, SamplingParams(max_tokens=30, stop=(stop,)))[0]
            keep = SamplingParams(max_tokens=30, stop=(stop,), include_stop_str_in_output=True)
            out = engine.generate(prompt, keep)[0]
            assert out.text == without.text + stop and out.token_ids == without.token_ids
            assert (out.finish_reason, out.stop_reason) == (FinishReason.stop, stop)
            stop_id = whole.token_ids[i]
            first = whole.token_ids.index(stop_id)
            keep = SamplingParams(max_tokens=30, stop_token_ids=[stop_id], include_stop_str_in_output=True)
            out = engine.generate(prompt, keep)[0]
            assert out.token_ids == whole.token_ids[: first + 1]
            assert out.text == tok.decode(whole.token_ids[: first + 1], skip_special_tokens=True)
            assert out.stats.accepted + out.stats.target_forwards == len(out.token_ids)


def test_nested_stop_strings_cut_where_one_token_a_step_cuts() -> None:
    """Stop strings one inside the other ("the end." holds "end"): decoding one token a step stops at the token
    that completes "end", before "the end." is complete, and cuts at "end"; a step bringing every token at once
    must cut the same text, not at "the end.", which starts earlier but completed later."""
    tok = tiny_tokenizer()
    ids = tok.encode("so the end. more", add_special_tokens=False)
    stop = ["the end.", "end"]

    def run(per_step: int) -> tuple[str, int | None]:
        text, t = "", IncrementalText(tok, stop)
        for n in range(per_step, len(ids) + per_step, per_step):
            text += t.update(ids[:n])
            if t.stopped:
                break
        return text, t.stop_tokens

    one_by_one = run(1)
    assert one_by_one[0] == "so the "
    for per_step in (2, 3, 4, len(ids)):
        assert run(per_step) == one_by_one


def test_speculation_with_nested_stop_strings_returns_the_plain_text() -> None:
    target = tiny_model(tiny_config(), seed=0)
    tok = tiny_tokenizer()
    plain = Engine(target, tok, eos_token_ids=set())
    spec = Engine(target, tok, draft=noisy_copy(target, 0.0, seed=1),
                  speculation=SpecConfig(method=SpecMethod.chain, sl=6), eos_token_ids=set())  # fmt: skip
    nested = 0
    for prompt in PROMPTS:
        text = plain.generate(prompt, SamplingParams(max_tokens=40))[0].text
        for i in (6, 12, 18):
            stop = (text[i - 2 : i + 4], text[i : i + 2])  # the second inside the first, completing earlier
            params = SamplingParams(max_tokens=40, stop=stop)
            alone, drafted = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
            assert drafted.stats.accepted > 0
            assert (drafted.text, drafted.token_ids) == (alone.text, alone.token_ids)
            nested += 0 <= text.find(stop[0]) < len(alone.text)  # the longer one starts inside the kept text
    assert nested > 0  # cases where cutting at the earliest start of any stop string would cut elsewhere


TEXTS = (
    "plain ascii words, then numbers 12345 and punctuation!?",
    "naïve café — “quotes” and 日本語のテキスト, emoji 🎉🚀 and ünïcödé",
    "  leading spaces\n\nnew lines\tand tabs  ",
)


def _check_incremental_text_is_the_whole_decode(tok: object, texts: tuple[str, ...]) -> None:
    gen = random.Random(0)
    for text in texts:
        ids = tok.encode(text * 4, add_special_tokens=False)  # type: ignore[attr-defined]
        for _ in range(8):
            random_ids = [gen.randrange(3, 259) if gen.random() < 0.2 else t for t in ids]  # stray bytes: cut UTF-8
            for seq in (ids, random_ids):
                inc, n, streamed = IncrementalText(tok), 0, ""  # type: ignore[arg-type]
                while n < len(seq):
                    n = min(len(seq), n + gen.choice((1, 1, 2, 3, 7)))
                    streamed += inc.update(seq[:n], final=n == len(seq))
                    assert inc.text == tok.decode(seq[:n], skip_special_tokens=True)  # type: ignore[attr-defined]
                assert streamed == inc.text
                assert inc._fixed > len(seq) // 2  # most of the output was settled, not decoded again each time


def test_incremental_text_is_the_whole_decode_at_every_update() -> None:
    """The text an update holds is decode(all tokens so far), although only the tokens after the settled point
    are decoded again: for any number of tokens per update, through multi-byte characters and stray bytes."""
    _check_incremental_text_is_the_whole_decode(tiny_tokenizer(), TEXTS)


@pytest.mark.real_model
def test_incremental_text_is_the_whole_decode_with_smollm2s_tokenizer() -> None:
    from specserve.config import ModelSpec
    from specserve.models.loader import load_tokenizer

    _check_incremental_text_is_the_whole_decode(load_tokenizer(ModelSpec()), TEXTS)


def test_a_stop_string_of_the_replacement_character_waits_for_a_characters_last_bytes() -> None:
    """The first byte of a multi-byte character decodes as U+FFFD until its next bytes come: a stop string holding
    U+FFFD stopped "hi €uro" at "hi " though its text has none. Bytes that stay invalid still stop it."""
    tok = tiny_tokenizer()
    ids = tok.encode("hi €uro", add_special_tokens=False)
    euro = tok.encode("€", add_special_tokens=False)
    assert len(euro) == 3  # the tiny tokenizer spells "€" as its three bytes
    for step in (1, 2):
        text = IncrementalText(tok, ["\ufffd"])
        deltas = [text.update(ids[:n], final=n >= len(ids)) for n in range(step, len(ids) + step, step)]
        assert not text.stopped and "".join(deltas) == "hi €uro"
    head = tok.encode("hi ", add_special_tokens=False)
    invalid = head + euro[:1] + tok.encode("ab", add_special_tokens=False)  # "€"'s first byte, then "ab"
    assert tok.decode(invalid) == "hi \ufffdab"
    text = IncrementalText(tok, ["\ufffd"])
    deltas = [text.update(invalid[:n], final=n == len(invalid)) for n in range(1, len(invalid) + 1)]
    assert text.stopped and "".join(deltas) == "hi " and text.stop_tokens == len(head) + 2


def _byte_fallback_tokenizer() -> PreTrainedTokenizerBase:
    """Llama-2's and Mistral's kind: characters outside the vocabulary spelt as byte tokens, decoded by their
    tokenizer.json's decoder, which turns a run of byte tokens that is not UTF-8 as a whole into U+FFFD for every
    byte: a prefix's text is then not a prefix of the longer output's ("a€" + a byte of "😀" decodes "a" + 4 x
    U+FFFD)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)} | {"▁a": 259, "▁x": 260}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _bytes(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


def test_incremental_text_is_the_whole_decode_with_byte_fallback() -> None:
    """A settled point four tokens into an emoji's four byte tokens decoded the rest of the run as U+FFFD and kept
    it: "a😀\\n😀\\n😀\\n x" streamed as "a😀\\n😀" and U+FFFD. Any number of tokens per update."""
    tok = _byte_fallback_tokenizer()
    ids = [259, *_bytes("😀\n😀\n😀\n"), 260, 259, *_bytes("€ü\n日本\n"), 260]
    for step in (1, 2, 3, 5):
        text, streamed = IncrementalText(tok), ""
        for n in [*range(step, len(ids), step), len(ids)]:
            streamed += text.update(ids[:n], final=n == len(ids))
            assert text.text == tok.decode(ids[:n], skip_special_tokens=True)
        assert streamed == text.text == "a😀\n😀\n😀\n x a€ü\n日本\n x"


@pytest.mark.parametrize("tail", ["😀é", "日本", "ü€", "ab"])
def test_an_output_joining_the_prompts_last_run_of_byte_tokens_decodes_as_the_whole(tail: str) -> None:
    """The output was decoded after the prompt's last four tokens: inside an emoji's four byte tokens, so the run
    the output's first bytes joined decoded as U+FFFD for every byte ("ü x" streamed as two U+FFFD and " x")."""
    tok = _byte_fallback_tokenizer()
    prompt, out = [259, *_bytes(tail)], [*_bytes("ü"), 260]
    want = tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)) :]
    assert want == "ü x"
    for step in (1, 3):
        text, streamed = IncrementalText(tok, prompt_ids=prompt), ""
        for n in [*range(step, len(out), step), len(out)]:
            streamed += text.update(out[:n], final=n == len(out))
        assert streamed == want


def test_stop_tokens_do_not_depend_on_where_steps_end_with_byte_fallback() -> None:
    """ "€" is complete at the fourth token and gone again at the fifth (a byte of "😀" after it): a speculative
    step that ended there searched for the stop only after it and kept the emoji's four tokens."""
    tok = _byte_fallback_tokenizer()
    ids = [259, *_bytes("€😀"), 259]
    one = IncrementalText(tok, ["€"])
    for n in range(1, len(ids) + 1):
        one.update(ids[:n])
        if one.stopped:
            break
    steps = IncrementalText(tok, ["€"])
    for n in (1, 5, len(ids)):  # steps of 1, 4 and 4 tokens
        steps.update(ids[:n])
    assert (one.text, one.stop_tokens) == ("a", 4) == (steps.text, steps.stop_tokens)


class _ScriptedTarget:
    """A target whose steps are given: each step's first len - 1 tokens are accepted drafts, the last its own."""

    def __init__(self, steps: list[list[int]]) -> None:
        self.steps = iter(steps)

    def add(self, *args: object) -> None:
        return None

    def release(self, ids: list[int]) -> None:
        return None

    def verify(self, items: list) -> list[VerifyOutput]:  # type: ignore[type-arg]
        step = next(self.steps)
        return [VerifyOutput(it.seq_id, list(range(1, len(step))), step, [], None) for it in items]


def _scripted_loop(tok: PreTrainedTokenizerBase, steps: list[list[int]]) -> StepLoop:
    target: Any = _ScriptedTarget(steps)
    return StepLoop(target, tokenizer=tok, eos_token_ids={2}, max_batch_size=4, max_model_len=100)


def _delivered(
    tok: PreTrainedTokenizerBase, steps: list[list[int]], stop: str, max_tokens: int = 20
) -> tuple[list[int], str, str]:
    """The ids, text and finish reason handed out over a request whose steps bring ``steps``; after each step, what
    a lane move would carry (the ids and text delivered so far) is checked to resume: the text the ids decode to
    starts with the text, and a continuation with them is admitted."""
    loop = _scripted_loop(tok, steps)
    params = SamplingParams(max_tokens=max_tokens, stop=(stop,))
    loop.add_request(Request("r", [1, 259], params))
    got: list[int] = []
    text, reason = "", ""
    while loop.has_work:
        for out in loop.step():
            got += out.token_ids
            text += out.text
            assert out.num_output_tokens == len(got)
            if out.finished:
                reason = out.finish_reason.value  # type: ignore[union-attr]
            else:
                IncrementalText(tok, [stop], [1, 259]).resume(got, text)
                moved = Request("m", [1, 259], params, delivered=Delivered(tuple(got), text))
                _scripted_loop(tok, []).add_request(moved)  # InvalidRequestError where the two disagree
    return got, text, reason


def test_a_resume_takes_up_a_long_output_in_steps_not_every_prefix_decoded_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request moved to another lane takes up its delivered output in one update: with a stop string and a byte
    token anywhere in it, that update searched every prefix for the stop string, each decoded from the first
    token, on the lane's thread (2.3 million tokens decoded for a 2161-token output). The text goes on the same."""
    tok = _byte_fallback_tokenizer()
    ids = ([259, 260] * 5 + _bytes("é")) * 180 + [259]  # 2161 tokens, a character in byte tokens every 12
    whole = tok.decode([*ids, 260], skip_special_tokens=True)
    decoded: list[int] = []
    decode = tok.decode

    def counting(token_ids: list[int], **kwargs: Any) -> str:
        decoded.append(len(token_ids))
        return cast(str, decode(token_ids, **kwargs))

    monkeypatch.setattr(tok, "decode", counting)
    text = IncrementalText(tok, ("zz",))
    text.resume(ids, whole[:5])
    assert sum(decoded) < 100 * len(ids), sum(decoded)
    assert whole[:5] + text.update([*ids, 260], final=True) == whole


def _finished(tok: PreTrainedTokenizerBase, steps: list[list[int]], params: SamplingParams) -> tuple[Any, ...]:
    """The ids, text, finish reason, stop reason and counts (accepted + forwards) of a request whose steps bring
    ``steps``."""
    loop = _scripted_loop(tok, steps)
    loop.add_request(Request("r", [1, 259], params))
    got: list[int] = []
    text = ""
    while loop.has_work:
        for out in loop.step():
            got += out.token_ids
            text += out.text
            if out.finished:
                ends = (out.finish_reason, out.stop_reason, out.stats.accepted + out.stats.target_forwards)
    return got, text, *ends


def test_a_stop_token_id_after_an_incomplete_character_keeps_its_id_and_drops_the_bytes() -> None:
    """The stop token's text is not decoded (vLLM's): the bytes before it that began a character are dropped, not
    output as U+FFFD, so a stop string of U+FFFD (which waits for a character's last byte) does not match them and
    cut the stop token off: it did, and the ids lost the stop token and the counts an emitted token."""
    tok = _byte_fallback_tokenizer()
    ids = [259, *_bytes("€"), 260]  # " a", the euro sign's three bytes, " x"
    stop_id = ids[3]  # the euro sign's last byte
    for steps in ([[t] for t in ids], [ids[:2], ids[2:]], [ids]):
        for stop in ((), ("\ufffd",)):
            params = SamplingParams(max_tokens=20, stop=stop, stop_token_ids=[stop_id])
            assert _finished(tok, steps, params) == (ids[:4], " a", FinishReason.stop, stop_id, 4), (steps, stop)
            keep = params.model_copy(update={"include_stop_str_in_output": True})
            assert _finished(tok, steps, keep) == (ids[:4], " a€", FinishReason.stop, stop_id, 4), (steps, stop)


def test_a_stop_token_ids_own_text_completes_no_stop_string() -> None:
    """A stop token id ends the answer before any stop string its own text would complete (vLLM checks stop ids
    first), with include_stop_str_in_output as without: its text was cut inside the token at the stop string,
    and the stop string named as the reason. A stop string the tokens before it complete still ends it first."""
    tok = tiny_tokenizer()
    ids = tok.encode("say hello wor", add_special_tokens=False)  # ..., " w", "or"
    stop_id = ids[-1]
    assert tok.decode(ids[-2:]) == " wor"
    for steps in ([[t] for t in ids], [ids[:3], ids[3:]], [ids]):
        params = SamplingParams(max_tokens=20, stop=(" wo",), stop_token_ids=[stop_id])
        assert _finished(tok, steps, params) == (ids, "say hello w", FinishReason.stop, stop_id, len(ids)), steps
        keep = params.model_copy(update={"include_stop_str_in_output": True})
        assert _finished(tok, steps, keep) == (ids, "say hello wor", FinishReason.stop, stop_id, len(ids)), steps
        before = keep.model_copy(update={"stop": (" w",)})  # complete at the token before it
        assert _finished(tok, steps, before) == (ids[:-1], "say hello w", FinishReason.stop, " w", len(ids) - 1)


def test_min_tokens_ending_inside_a_run_of_byte_tokens_counts_the_characters_before_it() -> None:
    """vLLM's min_tokens: a stop string in the text of the first min_tokens tokens does not stop the answer. With
    byte fallback those tokens can end inside a character, whose incomplete bytes turned the run of byte tokens
    they end in into U+FFFD: the characters complete before it were not counted as theirs, and a stop string
    among them stopped the answer, at some min_tokens and not at others."""
    tok = _byte_fallback_tokenizer()
    ids = [259, *_bytes("€"), *_bytes("😀"), 260, 259]  # " a", the euro sign's 3 bytes, the emoji's 4, " x", " a"
    for floor in range(4, 9):  # (the euro sign complete in the first 4 tokens)
        params = SamplingParams(max_tokens=len(ids), stop=("€",), min_tokens=floor)
        for steps in ([[t] for t in ids], [ids]):
            got = _finished(tok, steps, params)
            assert got == (ids, " a€😀 x a", FinishReason.length, None, len(ids)), (floor, steps)
    # a skipped token right after a complete character: the count went back over it into the character, and the
    # stop string the first 4 tokens complete stopped the answer
    ids = [259, *_bytes("€"), 0, 260]  # (0 is <unk>, a special token decoding skips)
    params = SamplingParams(max_tokens=len(ids), stop=("€",), min_tokens=4)
    for steps in ([[t] for t in ids], [ids]):
        assert _finished(tok, steps, params) == (ids, " a€ x", FinishReason.length, None, len(ids)), steps
    # ... but one inside a character is (its bytes on both sides of it join): the euro sign ends past 4 tokens
    ids = [259, *_bytes("€")[:2], 0, _bytes("€")[2], 260]
    for steps in ([[t] for t in ids], [ids]):
        got = _finished(tok, steps, params)
        assert got == (ids[:5], " a", FinishReason.stop, "€", 5), steps


def test_the_stop_string_that_starts_first_ends_the_text() -> None:
    """Two stop strings one token completes: the text is cut where the first of them starts (the shortest text
    holding neither), and ``stop_reason`` names that one; with include_stop_str_in_output the text ends with it."""
    tok = _byte_fallback_tokenizer()
    ids = [260, 259, 260]  # " x", " a", " x"
    for stop in (("a", "x a"), ("x a", "a")):  # (whatever their order)
        params = SamplingParams(max_tokens=20, stop=stop)
        assert _finished(tok, [ids], params) == (ids[:2], " ", FinishReason.stop, "x a", 2)
        keep = params.model_copy(update={"include_stop_str_in_output": True})
        assert _finished(tok, [[t] for t in ids], keep) == (ids[:2], " x a", FinishReason.stop, "x a", 2)


def test_the_loop_hands_out_no_token_a_later_step_cuts_at_a_stop_string() -> None:
    """The step that ended one byte into "😀" had "€" hidden in its text and handed out its four tokens; the next
    found the stop at the fourth and cut the output, but the tokens were already delivered (a joined completion
    held one more token than plain decoding's, and num_output_tokens went down). Tokens whose text may still
    hold a stop string wait for the step that settles them, as their text does."""
    tok = _byte_fallback_tokenizer()
    ids = [259, *_bytes("€😀"), 259, 260]
    plain = _delivered(tok, [[t] for t in ids], "€")
    assert plain == (ids[:4], " a", "stop")  # (after the prompt's "a": a space)
    for split in ([ids[:1], ids[1:5], ids[5:9]], [ids[:5], ids[5:9]], [ids[:2], ids[2:6], ids[6:]]):
        assert _delivered(tok, split, "€") == plain, split
    # one step brings the token completing "€", a byte that breaks the run and the word that ends it: "€" is in no
    # text of that step's end, only in the text of its fourth token's prefix
    ids = [259, *_bytes("€"), _bytes("😀")[0], 259, 260, 259, 260]
    assert _delivered(tok, [ids[:1], ids[1:]], "€") == plain == _delivered(tok, [ids[:1], ids[1:5], ids[5:]], "€")
    # no stop string met: a step ending one byte into "ü" after " é x" handed out that text with none of its ids
    # (held back), and a lane move then refused the request
    ids = [259, *_bytes("é"), 260, *_bytes("ü"), 259, 2]
    whole = _delivered(tok, [[t] for t in ids], "zz")
    assert whole == _delivered(tok, [ids[:1], ids[1:5], ids[5:]], "zz") == (ids[:-1], " aé xü a", "stop")


def test_byte_runs_give_one_output_whatever_the_steps() -> None:
    """A step that brought the token completing "€" and a byte of "😀" after it, together, hid the stop string from
    the step's text, and the output ran on past it; without stop strings, the text of a run of byte tokens was
    handed out while a later byte could still turn it into U+FFFD, so the streamed text depended on where steps
    ended, and a lane move of the request was refused. Random outputs of words, byte runs (whole characters, and
    first bytes that break them) and a special token, random steps: the same ids, text and finish reason as one
    token a step, and without a stop, the text the ids decode to."""
    tok = _byte_fallback_tokenizer()
    rng = random.Random(0)
    # (0 is <unk>, a special token: decoding skips it, so the bytes on both sides of it make one run)
    pieces = [[259], [260], _bytes("€"), _bytes("😀"), _bytes("😀")[:1], _bytes("é"), _bytes("ü")[:1], [0]]
    prompt_text = tok.decode([1, 259], skip_special_tokens=True)
    for _ in range(30):
        ids = [t for _ in range(rng.randrange(2, 8)) for t in rng.choice(pieces)]
        for stop in ("zz", "€", "😀", "a€", "\ufffd"):
            plain = _delivered(tok, [[t] for t in ids], stop, max_tokens=len(ids))
            if stop == "zz":
                whole = tok.decode([1, 259, *ids], skip_special_tokens=True)
                assert plain == (ids, whole[len(prompt_text) :], "length")
            for _ in range(3):
                cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randrange(1, 4))))
                steps = [ids[i:j] for i, j in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
                assert _delivered(tok, steps, stop, max_tokens=len(ids)) == plain, (ids, stop, steps)


def _metaspace_tokenizer() -> PreTrainedTokenizerBase:
    """A SentencePiece-style (Llama-2, Mistral) tokenizer: a word's piece carries its leading space as "▁", and
    decoding drops the first piece's space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁is": 5, "▁Paris": 6, "▁nice": 7, ".": 8}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_the_first_output_token_is_decoded_after_the_prompt() -> None:
    """Decoded alone, the output "▁Paris ▁is ▁nice ." of "The capital is" lost its first space ("The capital
    isParis is nice."), and a stop string " Paris" could not match there."""
    tok = _metaspace_tokenizer()
    prompt, out = tok.encode("The capital is", add_special_tokens=False), [6, 5, 7, 8]
    assert tok.decode(out) == "Paris is nice."  # (what decoding the output alone gives)
    whole = tok.decode(prompt + out)[len(tok.decode(prompt)) :]
    assert whole == " Paris is nice."
    for stream in (True, False):
        text = IncrementalText(tok, prompt_ids=prompt)
        steps = range(1, len(out) + 1) if stream else [len(out)]
        assert "".join(text.update(out[:n], final=n == len(out)) for n in steps) == whole
    stop = IncrementalText(tok, [" Paris"], prompt_ids=prompt)
    assert stop.update(out[:1]) == "" and stop.stopped and stop.stop_tokens == 1
    stop = IncrementalText(tok, [" nice"], prompt_ids=prompt)
    assert stop.update(out) == " Paris is" and stop.stop_tokens == 3


@pytest.mark.parametrize("make", [_byte_fallback_tokenizer, _metaspace_tokenizer])
def test_a_run_of_skipped_special_tokens_loses_no_space(make: Any) -> None:
    """Four EOS tokens in a row (kept by ignore_eos, skipped by decoding) made the window decoded before the next
    tokens empty, and the SentencePiece decoder dropped the next word's space: " a x a x" + 4 x EOS + " a x a x a"
    streamed "... a xa" one token a step, whole in larger steps, and a stop string across the lost space was missed
    one token a step (text past it sent, finish "length") but found in larger steps."""
    tok = make()
    a, x = tok.convert_tokens_to_ids(["▁a", "▁x"] if make is _byte_fallback_tokenizer else ["▁Paris", "▁nice"])
    prompt, eos = [1, a], 2
    out = [a, x, a, x, eos, eos, eos, eos, a, x, a, x, a]
    want = tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)) :]
    for cuts in ([*range(1, len(out)), len(out)], [6, len(out)], [len(out)]):
        text, streamed = IncrementalText(tok, prompt_ids=prompt), ""
        for n in cuts:
            streamed += text.update(out[:n], final=n == len(out))
        assert streamed == text.text == want, cuts
    out = [a] * 4 + [eos] * 4 + [x] * 5 + [a] * 3
    word_a, word_x = tok.decode([a]).strip(), tok.decode([x]).strip()
    stop = " ".join([word_a] + [word_x] * 5)  # across the four EOS, through the fifth x: output token 13
    for cuts in ([*range(1, len(out)), len(out)], [6, len(out)]):
        text = IncrementalText(tok, [stop], prompt_ids=prompt)
        for n in cuts:
            text.update(out[:n], final=n == len(out))
        assert (text.stopped, text.stop_tokens, text.text) == (True, 13, f" {word_a}" * 3 + " "), cuts


@pytest.mark.parametrize("make", [_byte_fallback_tokenizer, _metaspace_tokenizer])
def test_a_run_of_unnamed_special_tokens_loses_no_space(make: Any) -> None:
    """An added token marked special but in no special-token list (Mistral's control tokens) is skipped by decoding
    but was not in ``all_special_ids``, what the detokenizer took for the skipped ids: four in a row emptied the
    window before the next word, whose space the SentencePiece decoder dropped (" ... nice" + "Paris nice")."""
    from tokenizers import AddedToken

    tok = make()
    tok.backend_tokenizer.add_special_tokens([AddedToken("[CTRL]", special=True)])
    ctrl = tok.convert_tokens_to_ids("[CTRL]")
    assert ctrl not in tok.all_special_ids and tok.decode([ctrl], skip_special_tokens=True) == ""
    a, x = tok.convert_tokens_to_ids(["▁a", "▁x"] if make is _byte_fallback_tokenizer else ["▁Paris", "▁nice"])
    prompt = [1, a]
    out = [a, x, a, x, ctrl, ctrl, ctrl, ctrl, a, x, a, x, a, x]
    want = tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)) :]
    for cuts in ([*range(1, len(out)), len(out)], [len(out)]):
        text, streamed = IncrementalText(tok, prompt_ids=prompt), ""
        for n in cuts:
            streamed += text.update(out[:n], final=n == len(out))
        assert streamed == text.text == want, cuts


def test_the_held_back_tail_is_the_longest_start_of_a_stop_string() -> None:
    """The text held back at each update: the longest k < len(s) for which the text ends with s[:k], over the
    stop strings s (compared with that definition written out, on random texts over a small alphabet)."""
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab€") for _ in range(rng.randrange(1, 9))) for _ in range(rng.randrange(1, 4))]
        head = "".join(rng.choice("ab€ ") for _ in range(rng.randrange(0, 12)))
        want = max((k for s in stops for k in range(1, len(s)) if head[len(head) - k :] == s[:k] and k <= len(head)),
                   default=0)  # fmt: skip
        assert IncrementalText(tiny_tokenizer(), stops)._hold(head) == want, (stops, head)


def test_the_held_back_tail_of_a_growing_text_is_the_longest_start_of_a_stop_string() -> None:
    """One request's hold-back, update after update, reads only what the text adds: compared with the definition at
    every update of texts that grow by 0-12 characters a time, and sometimes shrink or change where it was read."""
    rng = random.Random(1)
    for _ in range(300):
        stops = ["".join(rng.choice("ab€") for _ in range(rng.randrange(1, 9))) for _ in range(rng.randrange(1, 4))]
        text, head = IncrementalText(tiny_tokenizer(), stops), ""
        for _ in range(30):
            if head and rng.random() < 0.2:  # not grown from the last text: changed or cut somewhere
                cut = rng.randrange(min(len(head), rng.choice([8, len(head)])))
                head = head[:cut] + rng.choice(["", "b", "€a", rng.choice("ab€ ") + head[cut + 1 :]])
            head += "".join(rng.choice("ab€ ") for _ in range(rng.randrange(0, 13)))
            want = max((k for s in stops for k in range(1, min(len(s), len(head) + 1)) if head.endswith(s[:k])),
                       default=0)  # fmt: skip
            assert text._hold(head) == want, (stops, head)


def test_the_engine_decodes_an_answer_after_its_prompt() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = tiny_config()
    vocab = {"<unk>": 0} | {f"▁w{i}": i for i in range(1, cfg.vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    target = tiny_model(cfg, seed=0)
    for engine in (Engine(target, tok, eos_token_ids=set()), Engine(
        target, tok, draft=noisy_copy(target, 0.02, seed=1), speculation=SpecConfig(method=SpecMethod.chain, sl=3),
        eos_token_ids=set(),
    )):  # fmt: skip
        out = engine.generate("w5 w9 w13", SamplingParams(max_tokens=6))[0]
        prompt = tok.encode("w5 w9 w13", add_special_tokens=False)
        assert out.text == tok.decode(prompt + out.token_ids)[len(tok.decode(prompt)) :]
        assert out.text.startswith(" w") and len(out.text.split()) == 6


class _CountingText(IncrementalText):
    """Counts the token ids each update decodes."""

    decoded = 0

    def _decode_ids(self, token_ids: Any) -> str:
        self.decoded += len(token_ids)
        return super()._decode_ids(token_ids)


def _work_per_update(
    tok: PreTrainedTokenizerBase, ids: list[int], stop: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> tuple[float, float]:
    """(tokens decoded, characters searched for a stop string) per update, over the last 100 of one update a token."""
    import specserve.detok as detok

    searched = [0]
    settled = detok._settled

    def counting(text: str, final: bool) -> str:
        searched[0] += len(text)
        return settled(text, final)

    text = _CountingText(tok, stop)
    for n in range(1, len(ids) - 99):
        text.update(ids[:n])
    text.decoded = 0
    with monkeypatch.context() as m:
        m.setattr(detok, "_settled", counting)
        for n in range(len(ids) - 99, len(ids) + 1):
            text.update(ids[:n])
    return text.decoded / 100, searched[0] / 100


def test_an_updates_work_does_not_grow_with_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens decoded and characters searched per update are the same at 4,000 output tokens as at 500 (about 20
    and 3 with byte fallback, 34 and 6 with the tiny tokenizer): a run of byte tokens (an emoji every 40 tokens)
    sent updates back to decoding the whole output, and stop strings were searched for in the whole text every
    update."""
    fallback = _byte_fallback_tokenizer()
    emoji = ([259, 260] * 20 + _bytes("😀😀😀")) * 100
    words = [5 + (i * 7) % 200 for i in range(4000)]
    for tok, ids, stop in ((fallback, emoji, ()), (tiny_tokenizer(), words, ("zzzz",))):
        short = _work_per_update(tok, ids[:500], stop, monkeypatch)
        long = _work_per_update(tok, ids[:4000], stop, monkeypatch)
        for few, many in zip(short, long, strict=True):
            assert many <= 1.5 * few + 8, (short, long)
