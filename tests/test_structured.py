"""Structured output (specserve/structured.py): the target draws only what a grammar allows, at every row of a
draft tree, so greedy answers equal grammar-held plain decoding with every drafter and sampled answers are
always in the grammar's language."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import llguidance
import llguidance.hf
import numpy as np
import openai
import pytest
import torch
from jsonschema import Draft202012Validator
from scipy.stats import chisquare

from deployments.lane import Lane
from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.error_bodies import APIError, LaneHandoffError
from specserve.api.metrics import ServeMetrics
from specserve.config import ChainDraft, Drafter, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from specserve.sampling import SamplingParams, allowed_only, process_logits
from specserve.sequence import Delivered, Request
from specserve.structured import AnswerGrammar, FormatKind, GrammarCompiler, GrammarDeadEnd, OutputFormat
from tests.api_backend import MODEL, module_server
from tests.test_head_drafter import last_token_target, near_head

EOS = 2  # the tiny tokenizer's </s>
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}
FORMATS = [
    OutputFormat(kind=FormatKind.json_schema, schema_text=json.dumps(SCHEMA)),
    OutputFormat(kind=FormatKind.json_object),
    OutputFormat(kind=FormatKind.regex, pattern="[a-e]{2,6}-[0-9]{1,3}"),
    OutputFormat(kind=FormatKind.choice, choices=("yes", "no", 'a "quoted" one')),
    OutputFormat(kind=FormatKind.grammar, grammar_text='start: "(" N ("," N)? ")"\nN: /[0-9]{1,2}/'),  # Lark
    OutputFormat(kind=FormatKind.grammar, grammar_text='root ::= w "-" w\nw ::= [a-e] [a-e]? [a-e]?'),  # GBNF
]
# each grammar's language as a Python regular expression (the reference its answers are checked against)
GRAMMAR_REGEX = {FORMATS[4]: r"\([0-9]{1,2}(,[0-9]{1,2})?\)", FORMATS[5]: "[a-e]{1,3}-[a-e]{1,3}"}
ANSWER_SO_FAR = {FORMATS[2]: "ab", FORMATS[3]: "", FORMATS[1]: '{"a', FORMATS[4]: "(1", FORMATS[5]: "ab"}


def _fmt_id(fmt: OutputFormat) -> str:
    return fmt.kind.value + ("-gbnf" if "::=" in str(fmt.grammar_text) else "")


SPECS = [
    SpecConfig(method=SpecMethod.none),
    SpecConfig(method=SpecMethod.chain, sl=4),
    SpecConfig(method=SpecMethod.eagle2),
    SpecConfig(method=SpecMethod.ddd),
    SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.lookup),
]


def _bits(row: np.ndarray, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1}


def _fresh_matcher(fmt: OutputFormat, tokens: list[int]) -> Any:
    """A new llguidance matcher fed ``tokens``: the reference each test compares with."""
    lltok = llguidance.hf.from_tokenizer(tiny_tokenizer(), eos_token=[EOS])
    matcher = llguidance.LLMatcher(lltok, fmt.grammar(), log_level=0)
    assert matcher.consume_tokens(tokens) if tokens else True, matcher.get_error()
    return matcher


def _allowed_by(matcher: Any, vocab: int) -> set[int]:
    bias = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)  # one byte a token: 200 where allowed
    return {t for t in range(vocab) if t < len(bias) and bias[t]}


def test_allowed_only_keeps_each_rows_bits_and_nothing_past_them() -> None:
    vocab = 70  # (3 words: the last one's bits past 70 are no tokens)
    rows = [{0, 31, 32, 63, 64, 69}, set(range(vocab)), {5}]
    bitmask = np.zeros((3, 3), dtype=np.int64)
    for r, allowed in enumerate(rows):
        for t in allowed:
            bitmask[r, t // 32] |= 1 << (t % 32)
    bitmask = bitmask.astype(np.uint32).view(np.int32)  # (bit 31 is the sign bit)
    logits = torch.randn(3, vocab)
    out = allowed_only(logits, torch.from_numpy(bitmask))
    for r, allowed in enumerate(rows):
        for t in range(vocab):
            assert out[r, t] == (logits[r, t] if t in allowed else float("-inf")), (r, t)
    narrow = allowed_only(torch.randn(1, vocab), torch.from_numpy(np.full((1, 2), -1, dtype=np.int32)))
    assert torch.isinf(narrow[0, 64:]).all() and torch.isfinite(narrow[0, :64]).all()  # ids no bit names


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_a_trees_rows_are_what_a_fresh_matcher_allows_after_each_nodes_path(fmt: OutputFormat) -> None:
    tok = tiny_tokenizer()
    grammar = GrammarCompiler(tok, [EOS]).compile(fmt)
    vocab = len(tok)
    committed = tok.encode(ANSWER_SO_FAR.get(fmt, '{"colo'))
    first = sorted(_allowed_by(_fresh_matcher(fmt, committed), vocab))
    grammar.follow([*committed, first[-1]])  # (then back: a rollback took a token away)
    grammar.follow(committed)
    # a tree of tokens the grammar allows and of ones it refuses (their subtrees are never reached)
    tokens = [first[0], first[-1], 300, first[0], 7, 300]
    parents = [0, 0, 0, 1, 1, 3]
    rows = grammar.masks(tokens, parents)
    assert rows.shape == (7, (vocab + 31) // 32)
    nodes = [0, *tokens]
    for node in range(7):
        path, at = [], node
        while at:
            path.append(nodes[at])
            at = parents[at - 1]
        matcher = _fresh_matcher(fmt, committed)
        if all(matcher.consume_token(t) for t in reversed(path)):
            assert _bits(rows[node], vocab) == _allowed_by(matcher, vocab), (node, path)
        else:
            assert (rows[node] == -1).all(), node  # never read: the target rejects its node first
    assert grammar.fed == committed  # the walk left the matcher where it found it
    np.testing.assert_array_equal(grammar.masks([], [])[0], rows[0])


def test_a_drafted_eos_after_a_complete_answer_leaves_the_grammar_where_it_was() -> None:
    """A matcher whose grammar is complete takes EOS without recording it: fed in the walk and rolled back, it
    undid a token of the answer, and the next branch and the next step read the wrong state."""
    tok = tiny_tokenizer()
    fmt = OutputFormat(kind=FormatKind.choice, choices=("12", "13"))
    grammar = GrammarCompiler(tok, [EOS]).compile(fmt)
    one, two, three = (tok.encode(c)[0] for c in "123")
    grammar.follow([one])
    rows = grammar.masks([two, EOS, three, EOS], [0, 1, 0, 3])  # "2" EOS and "3" EOS: both complete the answer
    for node, path in ((0, []), (1, [two]), (3, [three])):
        assert _bits(rows[node], len(tok)) == _allowed_by(_fresh_matcher(fmt, [one, *path]), len(tok)), node
    assert _bits(rows[1], len(tok)) == {EOS} and (rows[2] == -1).all() and (rows[4] == -1).all()
    assert grammar.fed == [one]
    grammar.follow([one, three])  # the target took the sibling branch
    assert _bits(grammar.masks([], [])[0], len(tok)) == {EOS}


def test_answers_that_end_in_a_drafted_eos_equal_plain_decodings() -> None:
    """Prompt lookup proposes "1 2 EOS" (the prompt's own continuation) where the target, biased towards "3",
    answers "13": greedy and keyed sampled answers are plain decoding's."""
    tok = tiny_tokenizer()
    target = tiny_model(tiny_config(), seed=0)
    fmt = OutputFormat(kind=FormatKind.choice, choices=("12", "13"))
    one, two, three, q, z = (tok.encode(c)[0] for c in "123qz")
    prompt = [q, one, two, EOS, z, q]
    params = [
        SamplingParams(
            max_tokens=10, logit_bias={three: 50.0}, seed=seed, temperature=seed % 2 * 1.0, output_format=fmt
        )
        for seed in range(8)
    ]
    answers = []
    for spec in (SPECS[0], SpecConfig(method=SpecMethod.chain, sl=4, drafter=Drafter.lookup)):
        engine = Engine(target, tok, speculation=spec, max_batch_size=8, max_model_len=64)
        answers.append([o.text for o in engine.generate([prompt] * 8, params)])
    assert answers[0] == answers[1] and set(answers[0]) <= {"12", "13"}


def _held_greedy(model: LlamaModel, fmt: OutputFormat, prompt: list[int], n: int) -> list[int]:
    """Grammar-held greedy decoding, written out: the whole sequence re-run for every token, its next token the
    likeliest one a fresh matcher fed the answer allows."""
    matcher = _fresh_matcher(fmt, [])
    tokens, out = list(prompt), []
    for _ in range(n):
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(ForwardBatch.build(cache, [cache.allocate()], [tokens], num_logits=[1]), cache)[-1]
        allowed = sorted(_allowed_by(matcher, logits.shape[-1]))
        token = allowed[int(torch.argmax(logits[allowed]))]
        if token == EOS:
            break
        assert matcher.consume_token(token)
        out.append(token)
        tokens.append(token)
    return out


@pytest.fixture(scope="module")
def models() -> tuple[LlamaModel, LlamaModel]:
    target = tiny_model(tiny_config(), seed=0)
    return target, noisy_copy(target, 0.02, seed=1)


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_greedy_answers_equal_grammar_held_plain_decoding_with_every_drafter(
    models: tuple[LlamaModel, LlamaModel], fmt: OutputFormat
) -> None:
    target, draft = models
    tok = tiny_tokenizer()
    prompts = ["hello", "the tea is", "once upon a time"]
    want = [_held_greedy(target, fmt, tok.encode(p), 40) for p in prompts]
    for spec in SPECS:
        engine = Engine(target, tok, draft=draft, speculation=spec, max_batch_size=3, max_model_len=128)
        outs = engine.generate(prompts, SamplingParams(max_tokens=40, output_format=fmt))
        assert [o.token_ids for o in outs] == want, spec.method.value
    finished = [tok.decode(w) for w, o in zip(want, outs, strict=True) if o.finish_reason.value == "stop"]
    assert finished  # (the tiny model ends some answers within 40 tokens)
    for text in finished:
        if fmt.kind == FormatKind.json_schema:
            Draft202012Validator(SCHEMA).validate(json.loads(text))
        elif fmt.kind == FormatKind.json_object:
            assert isinstance(json.loads(text), dict)
        elif fmt.kind == FormatKind.regex:
            assert re.fullmatch(str(fmt.pattern), text)
        elif fmt.kind == FormatKind.grammar:
            assert re.fullmatch(GRAMMAR_REGEX[fmt], text), text
        else:
            assert text in fmt.choices


@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: s.method.value)
def test_sampled_answers_are_always_in_the_grammars_language(
    models: tuple[LlamaModel, LlamaModel], spec: SpecConfig
) -> None:
    target, draft = models
    tok = tiny_tokenizer()
    engine = Engine(target, tok, draft=draft, speculation=spec, max_batch_size=4, max_model_len=128)
    fmt = FORMATS[2]
    for seed in range(3):
        params = SamplingParams(max_tokens=30, temperature=1.5, seed=seed, output_format=fmt)
        for out in engine.generate(["a", "b c", "the", "xyz"], params):
            if out.finish_reason.value == "stop":
                assert re.fullmatch(str(fmt.pattern), out.text), out.text
            else:  # cut by max_tokens: a prefix of one
                assert _fresh_matcher(fmt, out.token_ids).is_error() is False


CHI_FORMAT = OutputFormat(kind=FormatKind.regex, pattern="[a-h]{4}")  # (no EOS within two tokens: pairs at most)
CHI_PROMPT = [5, 9, 13, 21]
N_SAMPLES = 1200


def _held_pairs(target: LlamaModel, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(x1, x2) of the next two tokens under the grammar, top-k 3 at temperature 1, by enumeration: the model's
    logits with every token a fresh matcher refuses at -inf, then the cuts."""

    def next_probs(answer: list[int]) -> torch.Tensor:
        tokens = CHI_PROMPT + answer
        cache = target.new_cache(1, len(tokens) + 1)
        logits = target(ForwardBatch.build(cache, [cache.allocate()], [tokens], num_logits=[1]), cache)[-1:].clone()
        refused = set(range(logits.shape[-1])) - _allowed_by(_fresh_matcher(CHI_FORMAT, answer), logits.shape[-1])
        logits[0, sorted(refused)] = float("-inf")
        return process_logits(logits, params)[0].double()

    p1 = next_probs([])
    table = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = next_probs([x1])
        for x2 in p2.nonzero().flatten().tolist():
            table[(x1, x2)] = float(p1[x1] * p2[x2])
    return table


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(method=SpecMethod.chain, sl=2),
        SpecConfig(method=SpecMethod.chain, sl=2, chain_draft=ChainDraft.sampled),  # (verified from q, not keyed)
        SpecConfig(method=SpecMethod.eagle2, tree_depth=2, beam_width=3, budget=8),
    ],
    ids=["chain-keyed", "chain-sampled", "tree"],
)
def test_sampled_answers_have_the_held_targets_distribution(spec: SpecConfig) -> None:
    target = tiny_model(tiny_config(), seed=0)
    engine = Engine(
        target, tiny_tokenizer(), draft=noisy_copy(target, 0.1, seed=4), speculation=spec, max_batch_size=64
    )
    base = SamplingParams(temperature=1.0, top_k=3, max_tokens=2, output_format=CHI_FORMAT)
    outs = engine.generate([CHI_PROMPT] * N_SAMPLES, [base.model_copy(update={"seed": s}) for s in range(N_SAMPLES)])
    pairs = [(o.token_ids[0], o.token_ids[1]) for o in outs]
    table = _held_pairs(target, base)
    cells = sorted(table)
    assert set(pairs) <= set(cells)  # nothing the grammar refuses, nothing the cuts drop
    observed = np.array([pairs.count(c) for c in cells], dtype=float)
    expected = np.array([table[c] for c in cells])
    assert chisquare(observed, expected / expected.sum() * observed.sum()).pvalue > 1e-3
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert accepted > 100 and drafted > 0, (accepted, drafted)  # (the accepted path is tested too)


def test_an_eagle_head_drafts_held_answers_as_plain_decoding_gives_them() -> None:
    target = last_token_target()
    head = near_head(target, 0.01)
    tok = tiny_tokenizer()
    prompts = [tok.encode(p) for p in ("hello", "the tea is")]
    accepted = 0
    loose = OutputFormat(kind=FormatKind.regex, pattern="[^q]{0,200}")  # (most of what the head guesses it allows)
    for fmt in [*FORMATS, loose]:
        want = [_held_greedy(target, fmt, p, 30) for p in prompts]
        for spec in (SpecConfig(method=SpecMethod.chain, sl=3), SpecConfig(method=SpecMethod.ddd)):
            engine = Engine(target, tok, draft=head, speculation=spec, max_batch_size=2, max_model_len=96)
            outs = engine.generate(prompts, SamplingParams(max_tokens=30, output_format=fmt))
            assert [o.token_ids for o in outs] == want, (fmt.kind, spec.method)
            accepted += sum(o.stats.accepted for o in outs) if fmt is loose else 0
    assert accepted > 20  # (the head drafts the unheld target: a strict grammar's tokens are rarely its guess)


def test_a_format_that_cannot_be_compiled_or_cannot_end_is_refused() -> None:
    tok = tiny_tokenizer()
    compiler = GrammarCompiler(tok, [EOS])
    with pytest.raises(InvalidRequestError, match="unclosed character class") as e:
        compiler.compile(OutputFormat(kind=FormatKind.regex, pattern="[a-"))
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match=r"structured_outputs: .*foo"):
        compiler.compile(
            OutputFormat(kind=FormatKind.json_schema, schema_text='{"type": "foo"}', param="structured_outputs")
        )
    with pytest.raises(InvalidRequestError, match="this model has no tokenizer"):
        GrammarCompiler(None, [EOS]).compile(FORMATS[1])
    with pytest.raises(InvalidRequestError, match=r"none of its EOS ids \[10000\] is a token of its tokenizer"):
        GrammarCompiler(tok, [10_000]).compile(FORMATS[1])
    GrammarCompiler(tok, [EOS, 10_000]).compile(FORMATS[1])  # (an EOS id past the tokenizer's beside one: left out)
    with pytest.raises(InvalidRequestError, match="the JSON schema false accepts no answer"):
        compiler.compile(OutputFormat(kind=FormatKind.json_schema, schema_text="false"))
    assert _bits(compiler.compile(OutputFormat(kind=FormatKind.json_schema, schema_text="true")).masks([], [])[0], 512)
    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        OutputFormat(kind=FormatKind.json_schema, schema_text=json.dumps(_nested(100)))
    with pytest.raises(ValueError, match="NaN or Infinity"):
        OutputFormat(kind=FormatKind.json_schema, schema_text='{"const": NaN}')
    with pytest.raises(ValueError, match="65536 characters together"):
        OutputFormat(kind=FormatKind.choice, choices=("a" * 40_000, "b" * 40_000))
    model = tiny_model(tiny_config(), seed=0)
    spec = SpecConfig(method=SpecMethod.chain, sl=2, synthetic_accept=0.5)
    synthetic = Engine(model, tok, draft=noisy_copy(model, 0.1), speculation=spec)
    with pytest.raises(InvalidRequestError, match="synthetic benchmark mode"):
        synthetic.generate("hi", SamplingParams(max_tokens=4, output_format=FORMATS[1]))
    for fields in ({"ignore_eos": True}, {"min_tokens": 3}):
        with pytest.raises(ValueError, match="structured answer"):
            SamplingParams(max_tokens=5, output_format=FORMATS[1], **fields)
    with pytest.raises(ValueError, match="a regex format takes pattern"):
        OutputFormat(kind=FormatKind.regex)
    with pytest.raises(ValueError, match="a json_object format takes nothing else"):
        OutputFormat(kind=FormatKind.json_object, pattern="x")


# -- over HTTP ------------------------------------------------------------------------------------------------


backend, url = module_server(max_model_len=128)


def test_response_format_and_structured_outputs_hold_the_answer_over_http(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30.0)
    messages = [{"role": "user", "content": "pick a colour"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    seen = set()
    for seed in range(6):
        out = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
        )
        choice = out.choices[0]
        if choice.finish_reason == "stop":
            Draft202012Validator(SCHEMA).validate(json.loads(str(choice.message.content)))
        seen.add(choice.finish_reason)
    assert "stop" in seen
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,  # type: ignore[arg-type]
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    for held, check in (
        ({"regex": "[a-e]{2,6}-[0-9]{1,3}"}, lambda t: re.fullmatch("[a-e]{2,6}-[0-9]{1,3}", t)),
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"json": SCHEMA}, lambda t: Draft202012Validator(SCHEMA).validate(json.loads(t)) is None),
        ({"json": json.dumps(SCHEMA)}, lambda t: Draft202012Validator(SCHEMA).validate(json.loads(t)) is None),
        ({"grammar": FORMATS[5].grammar_text}, lambda t: re.fullmatch(GRAMMAR_REGEX[FORMATS[5]], t)),
    ):
        body = {"model": MODEL, "prompt": "answer:", "max_tokens": 60, "temperature": 0, "structured_outputs": held}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), (held, choice)
    body = {"model": MODEL, "prompt": "answer:", "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body | {"structured_outputs": {"json_object": True}}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{"), r.text
    assert not httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"].startswith("{")


ONE_FORMAT = "structured_outputs takes one of json, regex, choice, grammar or json_object"


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"a": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "unclosed character class"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format", "foo"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "takes its json_schema"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format", "takes its"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "response_format",
         "String should match pattern"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ONE_FORMAT),
        ({"structured_outputs": {}}, "structured_outputs", ONE_FORMAT),
        ({"structured_outputs": {"grammar": "x", "json_object": True}}, "structured_outputs", ONE_FORMAT),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", 'unknown name: "foo"'),
        ({"structured_outputs": {"grammar": "root ::= [a-"}}, "structured_outputs", "cannot read the grammar as GBNF"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs", "at least 1 character"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "Input should be True"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs", "must be a JSON boolean"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "not both"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format", "not with ignore_eos"),
        ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "structured_outputs", "not with min_tokens"),
        ({"structured_outputs": {"json": {"a": "b" * 70_000}}}, "structured_outputs", "at most 65536 characters"),
        ({"structured_outputs": {"json": _nested(500)}}, "structured_outputs", "nested deeper than 64 levels"),
        ({"structured_outputs": {"json": json.dumps(_nested(500))}}, "structured_outputs", "nested deeper than 64"),
        ({"structured_outputs": {"json": "[" * 60_000}}, "structured_outputs", "nested too deep to read"),
        ({"structured_outputs": {"json": "{" + " " * 70_000 + "}"}}, "structured_outputs", "at most 65536 characters"),
        ({"structured_outputs": {"json": '{"type": "foo"}'}}, "structured_outputs", "foo"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs", "json is not valid JSON"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs", "must hold a JSON object (a schema), not list"),
        # Python's JSON reader takes NaN and Infinity, which llguidance read as null: {"const": NaN} held to null
        ({"structured_outputs": {"json": '{"const": NaN}'}}, "structured_outputs", "NaN or Infinity"),
        ({"structured_outputs": {"json": '{"enum": [1, [-Infinity]]}'}}, "structured_outputs", "NaN or Infinity"),
        ({"structured_outputs": {"choice": ["ab" * 20_000, "cd" * 20_000]}}, "structured_outputs",
         "at most 65536 characters together"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(500)}}},
         "response_format", "nested deeper than 64 levels"),
    ],
)  # fmt: skip
def test_a_format_the_server_cannot_hold_an_answer_to_is_a_400(
    url: str, fields: dict[str, Any], param: str, says: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | fields
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.real_model
def test_bench_structured_runs_every_method_and_format_side_by_side(tmp_path: Path) -> None:
    from specserve.cli import main

    out = tmp_path / "out"
    argv = ["bench", "structured", "--num-prompts", "1", "--max-tokens", "12", "--passes", "1", "--out", str(out)]
    assert main(argv) == 0
    rows = list(csv.DictReader((out / "structured.csv").open()))
    assert [(r["method"].split()[0], r["format"]) for r in rows] == [
        (m, f) for m in ("plain", "ddd") for f in ("text", "json_object", "json_schema")
    ]
    assert [r["greedy_eq_plain"] for r in rows] == ["-"] * 3 + ["True"] * 3  # (plain is the reference)
    for r in rows:  # each ratio is to the row itself where the pair is its own reference
        assert (r["format"] == "text") <= (float(r["x_own_text"]) == 1.0)
        assert (r["method"] == "plain") <= (float(r["x_plain_same_format"]) == 1.0 == float(r["tau"]))
        assert float(r["tau"]) >= 1.0 and 0 < float(r["mean_tokens"]) <= 12


@pytest.mark.real_model
def test_a_grammar_that_validates_and_cannot_be_built_is_refused_at_admission() -> None:
    """llguidance validates some grammars whose matcher is in error once built (a lexer too large for SmolLM2's
    vocabulary): admitted, the request's first step failed, and its batch re-prefilled with it."""
    from specserve.config import DEFAULT_PAIR, MODEL_PAIRS
    from specserve.models.loader import load_tokenizer

    tok = load_tokenizer(MODEL_PAIRS[DEFAULT_PAIR][0])
    compiler = GrammarCompiler(tok, [tok.eos_token_id])
    with pytest.raises(InvalidRequestError, match=r"response_format: .*lexer"):
        compiler.compile(OutputFormat(kind=FormatKind.regex, pattern="(a|aa)*" * 500 + "b"))


def test_a_lane_compiles_a_format_off_its_thread_and_steps_its_batch_meanwhile(
    models: tuple[LlamaModel, LlamaModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A format compiled at admission held the lane's thread, and every request it was stepping waited (tens of ms
    for a large grammar; the first on a lane also reads the vocabulary, 0.3 s for SmolLM2's). Here the compile
    waits for a plain request submitted after it to finish: on the lane's thread, neither would."""
    target, draft = models
    tok = tiny_tokenizer()
    engine = Engine(target, tok, draft=draft, speculation=SPECS[1], max_batch_size=2, max_model_len=128)
    lane = Lane(0, engine.loop, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=0)  # type: ignore[arg-type]
    prompts = [tok.encode("hello"), tok.encode("the tea is")]
    held = SamplingParams(max_tokens=20, output_format=FORMATS[2])
    plain_done, compiled_on = threading.Event(), []
    compile_format = engine.loop.grammars.compile

    def waiting(fmt: OutputFormat) -> AnswerGrammar:
        compiled_on.append(threading.current_thread())
        assert plain_done.wait(60)
        return compile_format(fmt)

    monkeypatch.setattr(engine.loop.grammars, "compile", waiting)

    async def tokens(request: Request) -> list[int]:
        return [t async for out in await lane.submit(request) for t in out.token_ids]

    async def run() -> tuple[list[int], list[int]]:
        held_answer = asyncio.create_task(tokens(Request("held", prompts[0], held)))
        while not compiled_on:
            await asyncio.sleep(0.01)
        assert lane.in_flight == 1  # (the request compiling holds its place: capacity, the router's lane choice)
        plain = await tokens(Request("plain", prompts[1], SamplingParams(max_tokens=20, ignore_eos=True)))
        plain_done.set()
        return await held_answer, plain

    try:
        held_answer, plain = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        plain_done.set()
        lane.stop()
    assert held_answer == _held_greedy(target, FORMATS[2], prompts[0], 20)
    reference = Engine(target, tok, max_batch_size=1, max_model_len=128)
    assert plain == reference.generate([prompts[1]], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    assert len(compiled_on) == 1 and compiled_on[0].name != "lane-0"


DEAD_END = OutputFormat(kind=FormatKind.grammar, grammar_text='start: "a" b | "c"\nb: b "x"')  # (b never ends)


def test_a_grammar_with_no_first_token_is_refused_at_admission() -> None:
    """llguidance validates a rule without a way out; its first mask is in error (it was admitted, and its first
    step failed its whole batch)."""
    with pytest.raises(InvalidRequestError, match="allows no token after the answer so far") as e:
        GrammarCompiler(tiny_tokenizer(), [EOS]).compile(
            OutputFormat(kind=FormatKind.grammar, grammar_text='start: a\na: a "x"', param="structured_outputs")
        )
    assert e.value.param == "structured_outputs"


def test_a_drafted_node_the_grammar_has_no_way_on_from_is_left_unwalked() -> None:
    """After "a" the grammar allows nothing: the matcher is then in error for good (its rollback fails), which
    failed the request though the target might never take "a". The node keeps an allow-all row, its subtree is
    not walked, and the walk goes on with a fresh matcher: the sibling's row is a fresh matcher's."""
    tok = tiny_tokenizer()
    grammar = GrammarCompiler(tok, [EOS]).compile(DEAD_END)
    a, c, x = (tok.encode(t)[0] for t in "acx")
    rows = grammar.masks([a, x, c], [0, 1, 0])
    assert (rows[1] == -1).all() and (rows[2] == -1).all()
    assert _bits(rows[0], len(tok)) == _allowed_by(_fresh_matcher(DEAD_END, []), len(tok)) >= {a, c}
    assert _bits(rows[3], len(tok)) == {EOS} == _allowed_by(_fresh_matcher(DEAD_END, [c]), len(tok))
    assert grammar.fed == [] and not grammar.matcher.is_error()
    grammar.follow([c])  # (the target took the sibling)
    assert _bits(grammar.masks([], [])[0], len(tok)) == {EOS}


def test_an_answer_that_reaches_a_dead_end_fails_alone_with_the_same_error_speculating_or_not(
    models: tuple[LlamaModel, LlamaModel],
) -> None:
    """Biased to "a", the answer reaches the dead end: its request fails alone (a GrammarDeadEnd), the others keep
    plain decoding's tokens. Biased to "c", a drafted "a" (prompt lookup proposes it) costs nothing."""
    target, draft = models
    tok = tiny_tokenizer()
    a, c, q, x, z = (tok.encode(t)[0] for t in "acqxz")
    prompt = [z, q, a, x, x, z]  # (lookup proposes "a x x" after an answer's q: "z q" matches)
    dead = SamplingParams(max_tokens=8, logit_bias={a: 50.0}, output_format=DEAD_END)
    fine = SamplingParams(max_tokens=8, logit_bias={c: 50.0}, output_format=DEAD_END)
    free = SamplingParams(max_tokens=8, ignore_eos=True)
    # "q" first (its first step prefills: nothing drafted), then lookup drafts "a" after it, a node with no way on,
    # whose row allows everything: the target takes "a", then EOS (outbidding "a" there) ended an answer "qa", a 200
    after_q = OutputFormat(kind=FormatKind.grammar, grammar_text='start: "q" ("a" b | "c")\nb: b "x"')
    dead_eos = SamplingParams(max_tokens=8, logit_bias={a: 50.0, EOS: 60.0}, output_format=after_q)
    reference = Engine(target, tok, max_batch_size=1, max_model_len=64).generate([prompt], free)[0].token_ids
    lookup = SpecConfig(method=SpecMethod.chain, sl=3, drafter=Drafter.lookup)
    for spec in (SPECS[0], SPECS[1], lookup):
        engine = Engine(target, tok, draft=draft, speculation=spec, max_batch_size=4, max_model_len=64)
        resets: list[object] = []
        reset = engine.loop.reset

        def counted(ids: Any, resets: list[object] = resets, reset: Any = reset) -> None:
            resets.append(ids)
            reset(ids)

        engine.loop.reset = counted  # type: ignore[method-assign]
        outs = engine.generate([prompt] * 4, [dead, fine, free, dead_eos], return_exceptions=True)
        assert resets == []  # (the batch's other sequences were not reset to re-prefill)
        assert isinstance(outs[0], GrammarDeadEnd) and "allows no token after" in str(outs[0]), outs[0]
        assert isinstance(outs[3], GrammarDeadEnd), (spec.method.value, outs[3])
        assert not isinstance(outs[1], Exception) and outs[1].token_ids == [c], spec.method.value
        assert not isinstance(outs[2], Exception) and outs[2].token_ids == reference, spec.method.value


def test_an_answer_that_ends_at_a_drafted_dead_end_finishes_as_plain_decoding_does(
    models: tuple[LlamaModel, LlamaModel],
) -> None:
    """Lookup drafts "a" after "q", a node with no way on, and the target takes it: where "a" ends the answer (its
    last token allowed, a stop token, a stop string) plain decoding finishes it with a 200; speculation failed the
    row as a dead end (a 400) without looking where the answer ended."""
    target, draft = models
    tok = tiny_tokenizer()
    a, q, x, z = (tok.encode(t)[0] for t in "aqxz")
    prompt = [z, q, a, x, x, z]  # (after the answer's "q", lookup proposes "a x x": "z q" matches)
    after_q = OutputFormat(kind=FormatKind.grammar, grammar_text='start: "q" ("a" b | "c")\nb: b "x"')
    ending = [
        SamplingParams(max_tokens=2, logit_bias={a: 50.0}, output_format=after_q),
        SamplingParams(max_tokens=8, logit_bias={a: 50.0}, stop_token_ids=[a], output_format=after_q),
        SamplingParams(max_tokens=8, logit_bias={a: 50.0}, stop=["a"], output_format=after_q),
    ]
    expected = [([q, a], "qa", "length"), ([q, a], "q", "stop"), ([q, a], "q", "stop")]
    lookup = SpecConfig(method=SpecMethod.chain, sl=3, drafter=Drafter.lookup)
    for spec in (SPECS[0], SPECS[1], lookup):
        engine = Engine(target, tok, draft=draft, speculation=spec, max_batch_size=4, max_model_len=64)
        outs = engine.generate([prompt] * 3, ending, return_exceptions=True)
        got = [o if isinstance(o, Exception) else (o.token_ids, o.text, o.finish_reason.value) for o in outs]
        assert got == expected, spec.method.value


def test_a_step_whose_every_row_met_a_dead_end_says_nothing_of_the_lanes_workers(
    models: tuple[LlamaModel, LlamaModel],
) -> None:
    """A request moved here with an output its grammar has no way on from fails before the target sees the step; the
    lane took that step, which called no worker, for one that went through: a lane that had lost its workers
    reported itself healthy again and its count of losses in a row started afresh."""
    target, _ = models
    tok = tiny_tokenizer()
    a = tok.encode("a")[0]
    engine = Engine(target, tok, max_batch_size=2, max_model_len=64)
    lane = Lane(0, engine.loop, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=9)  # type: ignore[arg-type]
    lane.lost_workers, lane._failures, lane._retry_at = True, 2, math.inf  # (its target lost: not tried again here)
    params = SamplingParams(max_tokens=8, output_format=DEAD_END)
    moved = Request("moved", tok.encode("hi"), params, delivered=Delivered((a,), "a"))

    async def run() -> APIError:
        with pytest.raises(APIError) as e:
            async for _ in await lane.submit(moved):
                pass
        return e.value

    try:
        error = asyncio.run(asyncio.wait_for(run(), 60))
        assert error.status == 400 and "allows no token after" in str(error), error
        assert lane.lost_workers and lane._failures == 2 and not lane.healthy
    finally:
        lane.stop()


def test_a_dead_end_over_http_is_a_400_and_its_neighbours_finish(url: str) -> None:
    body = {"model": MODEL, "prompt": "answer:", "max_tokens": 8, "temperature": 0}
    held = {
        "structured_outputs": {"grammar": DEAD_END.grammar_text},
        "logit_bias": {str(tiny_tokenizer().encode("a")[0]): 50},
    }
    r = httpx.post(url + "/v1/completions", json=body | held, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs" and "allows no token after the answer so far" in error["message"]
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize(
    "text", ['root ::= "x" z\nz ::= "z"', '?start: "x" "z"', 'start: "x" Z\nZ: "z"'], ids=["gbnf", "lark?", "lark"]
)
def test_gbnf_is_told_from_lark_by_a_rule_defined_with_its_own_operator(text: str) -> None:
    """llguidance's own test (a line starting ``start:`` means Lark) read Lark that starts ``?start:`` as GBNF, and
    refused it. Each grammar here derives "xz" alone (two tokens the tiny tokenizer never merges)."""
    tok = tiny_tokenizer()
    x, z = tok.encode("x")[0], tok.encode("z")[0]
    grammar = GrammarCompiler(tok, [EOS]).compile(OutputFormat(kind=FormatKind.grammar, grammar_text=text))
    assert _bits(grammar.masks([], [])[0], len(tok)) == {x}
    grammar.follow([x])
    assert _bits(grammar.masks([], [])[0], len(tok)) == {z}
    grammar.follow([x, z])
    assert _bits(grammar.masks([], [])[0], len(tok)) == {EOS}


def test_a_client_gone_while_its_format_compiles_leaves_no_place_held(
    models: tuple[LlamaModel, LlamaModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, _ = models
    tok = tiny_tokenizer()
    engine = Engine(target, tok, max_batch_size=2, max_model_len=128)
    lane = Lane(0, engine.loop, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=0)  # type: ignore[arg-type]
    release, started = threading.Event(), threading.Event()
    compile_format = engine.loop.grammars.compile

    def waiting(fmt: OutputFormat) -> AnswerGrammar:
        started.set()
        assert release.wait(60)
        return compile_format(fmt)

    monkeypatch.setattr(engine.loop.grammars, "compile", waiting)

    async def run() -> None:
        submit = asyncio.create_task(lane.submit(Request("gone", tok.encode("hi"), SamplingParams(
            max_tokens=4, output_format=FORMATS[2]))))  # fmt: skip
        while not started.is_set():
            await asyncio.sleep(0.01)
        assert lane.in_flight == 1
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
        assert lane.in_flight == 0
        release.set()

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
        time.sleep(0.3)  # (the compile ends on its thread; nothing may be queued after it)
        assert not engine.loop.has_work and lane.in_flight == 0
    finally:
        release.set()
        lane.stop()


def test_a_lane_reads_the_vocabulary_for_grammars_as_it_starts(models: tuple[LlamaModel, LlamaModel]) -> None:
    """Reading it holds the GIL (0.3 s for SmolLM2's 49k tokens): at a lane's first structured request it stalled
    the lane's batch as long."""
    engine = Engine(models[0], tiny_tokenizer(), max_batch_size=1, max_model_len=64)
    lane = Lane(0, engine.loop, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=0)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 30
        while "_tokenizer" not in vars(engine.loop.grammars):  # (functools.cached_property's place)
            assert time.monotonic() < deadline, "the lane never read the vocabulary"
            time.sleep(0.01)
        assert not isinstance(engine.loop.grammars._tokenizer, str)  # (a view, not the reason there is none)
    finally:
        lane.stop()


def test_a_matcher_at_a_dead_end_says_so_when_rolled_back_too() -> None:
    tok = tiny_tokenizer()
    grammar = GrammarCompiler(tok, [EOS]).compile(DEAD_END)
    a, x = tok.encode("a")[0], tok.encode("x")[0]
    grammar.follow([a])
    with pytest.raises(GrammarDeadEnd):
        grammar.masks([], [])
    with pytest.raises(GrammarDeadEnd):  # (was a ValueError from the failed rollback: a 500)
        grammar.follow([])
    with pytest.raises(GrammarDeadEnd, match=f"refuses token {x}"):
        GrammarCompiler(tok, [EOS]).compile(DEAD_END).follow([x])


def test_a_lane_told_to_stop_hands_a_structured_request_on(models: tuple[LlamaModel, LlamaModel]) -> None:
    """Its grammar thread shut down while its thread still runs (a stop whose join timed out): a RuntimeError, a
    500. (Told to stop as ``request_stop`` tells it, short of the command that ends its thread.)"""
    engine = Engine(models[0], tiny_tokenizer(), max_batch_size=1, max_model_len=64)
    lane = Lane(0, engine.loop, {}, None, None, metrics=ServeMetrics(), max_worker_restarts=0)  # type: ignore[arg-type]
    lane._stopping.set()
    lane._grammar_thread.shutdown()
    assert lane.alive
    request = Request("r", [5, 6], SamplingParams(max_tokens=2, output_format=FORMATS[2]))
    try:
        with pytest.raises(LaneHandoffError):
            asyncio.run(lane.submit(request))
        assert lane.in_flight == 0
    finally:
        lane.stop()


def test_a_drafted_token_the_matcher_refuses_past_a_limit_is_a_dead_node_not_an_error() -> None:
    """(x{800}){800} allows "x" first, yet llguidance refuses to feed it after finding its row (too many
    expressions). Plain decoding meets that in ``follow`` (a GrammarDeadEnd, a 400); a drafted "x" raised a ValueError
    from ``masks`` (a 500)."""
    tok = tiny_tokenizer()
    x = tok.encode("x")[0]
    grammar = GrammarCompiler(tok, [EOS]).compile(OutputFormat(kind=FormatKind.regex, pattern="(x{800}){800}"))
    rows = grammar.masks([x, x], [0, 1])
    assert x in _bits(rows[0], len(tok))
    assert grammar.dead == {1} and (rows[1] == -1).all()


def test_a_drafted_token_the_matcher_refuses_over_http_is_a_400(url: str) -> None:
    x = tiny_tokenizer().encode("x")[0]
    body = {"model": MODEL, "prompt": [x] * 20, "max_tokens": 10, "temperature": 0}
    held = {"speculation": {"drafter": "lookup"}, "structured_outputs": {"regex": "(x{800}){800}"}}
    r = httpx.post(url + "/v1/completions", json=body | held, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs"


def test_the_mask_budget_is_a_rows_so_a_drafted_tree_never_fails_what_plain_decoding_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The budget held the whole call: a format of 2-5 ms a row failed at an EAGLE-2 tree's third step (~150 ms for
    60 rows) though plain decoding finishes it. Each call here takes 0.25 s (a fake clock): over 10 rows that is
    25 ms a row, no strike; alone, a strike each."""
    import itertools

    import specserve.structured as structured

    tok = tiny_tokenizer()
    x = tok.encode("x")[0]
    grammar = GrammarCompiler(tok, [EOS]).compile(OutputFormat(kind=FormatKind.regex, pattern="x{1,40}"))
    ticks = itertools.count(step=0.25)  # two reads a call, 0.25 s apart
    with monkeypatch.context() as m:
        m.setattr(structured.time, "perf_counter", lambda: next(ticks) * 1.0)
        for _ in range(structured.MASK_STRIKES + 1):
            rows = grammar.masks([x] * 9, list(range(9)))  # a chain of 9 drafts: 10 rows
        assert rows.shape[0] == 10 and grammar.row_s == pytest.approx(0.025)
        assert grammar.affords(4) and not grammar.affords(5)  # 4 rows: 0.1 s, the budget
        for _ in range(structured.MASK_STRIKES - 1):
            grammar.masks([], [])
        with pytest.raises(structured.GrammarTooCostly, match="250 ms"):
            grammar.masks([], [])


@pytest.mark.parametrize("spec", SPECS[1:], ids=lambda s: f"{s.method.value}-{s.drafter.value}")
def test_an_answer_whose_grammar_cannot_afford_a_tree_decodes_plainly_and_the_same(
    models: tuple[LlamaModel, LlamaModel], spec: SpecConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A structured answer whose tree's rows would cost its grammar more than the budget is planned no draft (the
    batch would wait on its walk); its neighbour without a format drafts on, and both answers are plain decoding's."""
    target, draft = models
    tok = tiny_tokenizer()
    fmt = FORMATS[2]
    prompts = ["the tea is", "the tea is"]
    want = _held_greedy(target, fmt, tok.encode(prompts[0]), 30)
    free = Engine(target, tok, max_batch_size=1, max_model_len=128).generate(
        [prompts[1]], SamplingParams(max_tokens=30)
    )[0]
    monkeypatch.setattr(AnswerGrammar, "affords", lambda self, rows: rows <= 1)
    engine = Engine(target, tok, draft=draft, speculation=spec, max_batch_size=2, max_model_len=128)
    held, other = engine.generate(
        prompts, [SamplingParams(max_tokens=30, output_format=fmt), SamplingParams(max_tokens=30)]
    )
    assert held.token_ids == want and other.token_ids == free.token_ids
    assert held.stats.drafted == 0 and other.stats.drafted > 0


def test_a_format_over_its_mask_budget_step_after_step_is_a_400_and_its_neighbours_finish(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step over budget here (a budget of 0): the answer fails on its MASK_STRIKES-th (the compile's first
    rows count), a 400 naming the format, while one slow step alone is forgiven."""
    import specserve.structured as structured

    grammar = GrammarCompiler(tiny_tokenizer(), [EOS]).compile(FORMATS[2])  # within the budget
    monkeypatch.setattr(structured, "MASK_BUDGET_S", 0.0)
    for _ in range(structured.MASK_STRIKES - 1):
        grammar.masks([], [])
    monkeypatch.setattr(structured, "MASK_BUDGET_S", 10.0)
    grammar.masks([], [])  # a step within it starts the count again
    monkeypatch.setattr(structured, "MASK_BUDGET_S", 0.0)
    for _ in range(structured.MASK_STRIKES - 1):
        grammar.masks([], [])
    with pytest.raises(structured.GrammarTooCostly):
        grammar.masks([], [])
    body = {"model": MODEL, "prompt": "answer:", "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body | {"structured_outputs": {"regex": "[a-e]{40}"}}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs" and "steps in a row" in error["message"], error
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
