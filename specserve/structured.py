"""Structured output: an answer held to a JSON schema, to JSON, to a regular expression, to one of a few strings or
to a context-free grammar (Lark or GBNF).

A grammar (llguidance's) tells, after each prefix of the answer, which tokens may come next. The target draws from
its distribution renormalised over those tokens, at every row it verifies: a draft tree's node row gets the tokens
allowed after the answer and the node's path. Drafts never see the grammar; verification against the held target
keeps greedy output equal to plain decoding under the grammar and sampled output distributed as the held target
(docs/algorithms.md §1.5)."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Collection, Sequence
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ConfigDict, Field, model_validator

from specserve.errors import InvalidRequestError
from specserve.validated import Validated

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_SCHEMA_CHARS = 65_536  # a JSON schema's (as sent) or a grammar's: each compile holds a thread while it runs
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 64  # objects and lists within each other in a schema (Python's JSON recursion stops near 1000)
BITS = 32  # tokens per word of a mask row
# one answer's rows of a step, computed on its lane's thread while the batch waits: a JSON schema's take ~1 ms, yet a
# short regex such as (x{600}){600} compiles and then costs ~0.3 s a step, every step; an answer over budget a row
# this many steps in a row (one slow step is the host's noise) is failed as its format's fault. A drafted tree's rows
# cost as many times more: an answer whose tree would cost more than the budget decodes plainly (``affords``)
MASK_BUDGET_S = 0.1
MASK_STRIKES = 3
GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z0-9_-]+\s*::=")  # a grammar with one is GBNF (llama.cpp's), else Lark


def check_json_data(value: object, limit: int = MAX_SCHEMA_DEPTH) -> object:
    """``value`` (JSON data, a schema) if its objects and lists nest at most ``limit`` deep (walked without
    recursion) and its numbers are finite: Python's JSON reader takes NaN and Infinity, which JSON has not, and
    llguidance read them as null (``{"const": NaN}`` held the answer to null)."""
    level: list[object] = [value]
    for _ in range(limit + 1):
        if any(isinstance(x, float) and not math.isfinite(x) for x in level):
            raise ValueError("a JSON schema holds NaN or Infinity, which are not JSON numbers")
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())]
        if not level:
            return value
    raise ValueError(f"a JSON schema nested deeper than {limit} levels")


def check_choices(choices: Sequence[str]) -> Sequence[str]:
    """A choice format's strings, if they hold at most MAX_SCHEMA_CHARS characters together (each compile holds
    the lane's one grammar thread, as a schema's does: a 3 MB choice took a second)."""
    if sum(len(c) for c in choices) > MAX_SCHEMA_CHARS:
        raise ValueError(f"a choice format's strings take at most {MAX_SCHEMA_CHARS} characters together")
    return choices


class FormatKind(str, Enum):
    json_schema = "json_schema"  # JSON valid against a schema
    json_object = "json_object"  # any JSON object (OpenAI's JSON mode)
    regex = "regex"  # text matching a regular expression, whole
    choice = "choice"  # exactly one of a few strings
    grammar = "grammar"  # text a context-free grammar derives (Lark, llguidance's dialect, or llama.cpp's GBNF)


class OutputFormat(Validated):
    """The form a request's answer must take; ``param`` names the request field it came from, for errors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: FormatKind
    schema_text: str | None = Field(default=None, max_length=MAX_SCHEMA_CHARS, description="json_schema's, as JSON")
    pattern: str | None = Field(default=None, max_length=MAX_SCHEMA_CHARS, description="regex's")
    choices: tuple[str, ...] = Field(default=(), max_length=MAX_CHOICES, description="choice's")
    grammar_text: str | None = Field(default=None, min_length=1, max_length=MAX_SCHEMA_CHARS, description="grammar's")
    max_depth: int = Field(
        default=MAX_SCHEMA_DEPTH,
        ge=1,
        le=2 * MAX_SCHEMA_DEPTH,
        description="json_schema's nesting limit (more where the schema wraps client schemas checked on their own)",
    )
    param: str = "response_format"

    @model_validator(mode="after")
    def _its_own_fields(self) -> OutputFormat:
        given = {"schema_text": self.schema_text is not None, "pattern": self.pattern is not None}
        given |= {"choices": bool(self.choices), "grammar_text": self.grammar_text is not None}
        wanted = {FormatKind.json_schema: "schema_text", FormatKind.regex: "pattern", FormatKind.choice: "choices"}
        wanted[FormatKind.grammar] = "grammar_text"
        need = wanted.get(self.kind)
        if any(v for k, v in given.items() if k != need) or (need is not None and not given[need]):
            raise ValueError(f"a {self.kind.value} format takes {need or 'nothing else'}")
        check_choices(self.choices)
        if self.schema_text is not None:
            try:
                schema = json.loads(self.schema_text)
            except RecursionError:
                raise ValueError(f"a JSON schema nested deeper than {self.max_depth} levels") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema is an object (or true / false)")
            check_json_data(schema, self.max_depth)
        return self

    def grammar(self) -> str:
        """The llguidance grammar (checked where it is compiled against a tokenizer)."""
        from llguidance import LLMatcher

        if self.kind == FormatKind.json_schema:
            schema = json.loads(str(self.schema_text))
            if schema is False:
                raise ValueError("the JSON schema false accepts no answer")
            return LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=_json_layout())
        if self.kind == FormatKind.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_json_layout())
        if self.kind == FormatKind.regex:
            return LLMatcher.grammar_from_regex(str(self.pattern))
        if self.kind == FormatKind.grammar:
            return LLMatcher.grammar_from_lark(_as_lark(str(self.grammar_text)))
        # each choice a string literal of a Lark grammar (JSON's escapes: any text is one)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choices))


def _as_lark(text: str) -> str:
    """A grammar as Lark: GBNF (a rule defined with ``::=``) rewritten, Lark as it is (llguidance's own test for
    Lark, a ``start:`` line, misreads GBNF with a rule named start and Lark that starts ``?start:``)."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if not GBNF_RULE.search(text):
        return text
    try:
        return gbnf_to_lark(text)
    except Exception as e:  # (its parser's own errors, a RecursionError for deep nesting)
        raise ValueError(f"cannot read the grammar as GBNF: {e}") from None


def _json_layout() -> Any:
    """JSON on one line, spaced as Python's json.dumps spaces it: free whitespace would let a model pad an answer
    with blanks up to its max_tokens (a schema's "x-guidance" options may still ask for it)."""
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """A step loop's: the tokenizer's vocabulary as the grammars read it (built on first use, or as a Serve lane
    starts: 0.3 s for SmolLM2's 49k tokens), and each request's grammar checked and compiled against it. Thread-safe: a
    Serve lane compiles on other threads (``Lane.submit``) while its own steps."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: Collection[int]) -> None:
        self._hf = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)

    @cached_property
    def _tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, or the reason there is none (kept: not rebuilt per request)."""
        from llguidance.hf import from_tokenizer

        if self._hf is None:
            return "this model has no tokenizer"
        named = [t for t in self.eos_token_ids if t < len(self._hf)]  # (an id past the tokenizer's: never allowed)
        if not named:
            return f"none of its EOS ids {self.eos_token_ids} is a token of its tokenizer"
        try:
            return from_tokenizer(self._hf, eos_token=named)  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:  # a slow tokenizer, an EOS id it does not name
            return f"its tokenizer cannot be read as a grammar's vocabulary ({e})"

    def prepare(self) -> None:
        """Read the vocabulary now (it holds the GIL: a lane's first structured request stalled its batch ~0.3 s)."""
        _ = self._tokenizer

    def compile(self, fmt: OutputFormat) -> AnswerGrammar:
        from llguidance import LLMatcher

        tokenizer = self._tokenizer
        if isinstance(tokenizer, str):
            raise InvalidRequestError(
                f"{fmt.param}: this server cannot hold answers to a format: {tokenizer}", param=fmt.param
            )
        try:
            grammar = fmt.grammar()
        except (ValueError, RecursionError) as e:  # (a schema llguidance cannot read as JSON)
            raise InvalidRequestError(f"{fmt.param}: {e}", param=fmt.param) from None
        if error := LLMatcher.validate_grammar(grammar, tokenizer):
            raise InvalidRequestError(f"{fmt.param}: {error.strip()[:500]}", param=fmt.param)
        answer = AnswerGrammar(
            lambda: LLMatcher(tokenizer, grammar, log_level=0), tokenizer.vocab_size, self.eos_token_ids, fmt.param
        )
        if answer.matcher.is_error():  # (some grammars validate and still fail to build: a lexer too large)
            raise InvalidRequestError(f"{fmt.param}: {answer.matcher.get_error().strip()[:500]}", param=fmt.param)
        answer.masks([], [])  # (a GrammarDeadEnd where it allows no first token: a rule without a way out)
        return answer


class GrammarDeadEnd(InvalidRequestError):
    """A format's grammar allows no token after the answer so far (nor its end): a rule that never ends, say
    ``b: b "x"``, which llguidance validates. The request is at fault; the answer cannot go on."""


class GrammarTooCostly(GrammarDeadEnd):
    """A format whose allowed tokens cost more than ``MASK_BUDGET_S`` a step, ``MASK_STRIKES`` steps in a row: the
    answer cannot go on without holding up every answer on its lane."""


class AnswerGrammar:
    """One sequence's grammar state: the matcher fed its committed answer (``follow``), and the tokens allowed at
    each row of a step's tree (``masks``). ``new_matcher`` makes a fresh matcher: one that met a dead end is in
    error for good (its rollback fails too), so the walk starts a fresh one and feeds it the answer again."""

    def __init__(
        self, new_matcher: Callable[[], Any], vocab_size: int, eos_token_ids: Collection[int], param: str
    ) -> None:
        self.new_matcher = new_matcher
        self.matcher = new_matcher()
        self.param = param  # the request field the format came from, for errors
        self.width = (vocab_size + BITS - 1) // BITS
        self.eos = frozenset(eos_token_ids)
        self.fed: list[int] = []  # the answer's tokens the matcher has consumed
        self.dead: frozenset[int] = frozenset()  # the last walk's nodes the grammar has no way on from
        self.slow_steps = 0  # masks calls over MASK_BUDGET_S a row, in a row
        self.row_s = 0.0  # seconds a row of the last masks call took

    def follow(self, output: list[int]) -> None:
        """Bring the matcher to the end of ``output``: back past tokens a rollback took away, then on through the
        new ones. A token the grammar refuses (none the target drew under it can be) is a GrammarDeadEnd."""
        same = len(self.fed)
        if output[:same] != self.fed:  # (a list comparison in C: the common case, an answer grown, costs no loop)
            same = next((i for i, (a, b) in enumerate(zip(self.fed, output, strict=False)) if a != b), len(output))
        if same < len(self.fed):
            if self.matcher.is_error():  # (a dead end met here before: its rollback fails too)
                raise self._dead_end("allows no token after the answer so far, nor its end")
            self._check(self.matcher.rollback(len(self.fed) - same), "rolling back")
            del self.fed[same:]
        for token in output[same:]:
            if not self.matcher.consume_token(token):
                raise self._dead_end(f"refuses token {token} after the answer so far")
            self.fed.append(token)

    def masks(self, draft_tokens: list[int], draft_parents: list[int]) -> np.ndarray:
        """[T, W] int32 bit rows (bit j of word w: token 32 w + j allowed) for a tree of T = 1 + len(draft_tokens)
        nodes: node 0, the root (the answer's last token, fed already), then the drafts, each after its parent
        (``draft_parents``: 0 for the root). A node the grammar refuses after its path is never accepted: its row
        and its subtree's allow everything (never read). An EOS node ends the answer: its subtree is never emitted,
        and it is not fed (a matcher whose grammar is complete takes EOS without recording it, so the walk's
        rollback would undo a token of the answer). A node after which the grammar allows nothing (a dead end), or
        whose token the matcher refuses although its parent's row allows it (a limit llguidance meets feeding it),
        keeps a row that allows everything and its subtree is not walked: accepted, the answer is cut after it
        (``first_dead``) and fails unless it ends there, as plain decoding's fails at the next step. A dead end at
        the root is a GrammarDeadEnd; ``MASK_STRIKES`` calls in a row over ``MASK_BUDGET_S`` a row a
        GrammarTooCostly (a row: as plain decoding's step, so a tree never fails an answer plain decoding finishes;
        the whole call, it failed a format of 2-5 ms a row at its third 60-node tree)."""
        start = time.perf_counter()
        rows = self._walk(draft_tokens, draft_parents)
        self.row_s = (time.perf_counter() - start) / len(rows)
        self.slow_steps = self.slow_steps + 1 if self.row_s > MASK_BUDGET_S else 0
        if self.slow_steps >= MASK_STRIKES:
            raise GrammarTooCostly(
                f"{self.param}: the format's grammar took {self.row_s * 1e3:.0f} ms to find the tokens it allows, over "
                f"{MASK_BUDGET_S * 1e3:.0f} ms for {self.slow_steps} steps in a row; a format this costly to follow "
                "would hold up every answer beside it (a regex of nested counted repeats?)",
                param=self.param,
            )
        return rows

    def affords(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows (the root and its drafts) keeps within MASK_BUDGET_S at the last call's
        cost a row."""
        return self.row_s * rows <= MASK_BUDGET_S

    def _walk(self, draft_tokens: list[int], draft_parents: list[int]) -> np.ndarray:
        rows = np.full((1 + len(draft_tokens), self.width), -1, dtype=np.int32)
        children: list[list[int]] = [[] for _ in range(len(rows))]
        for node, parent in enumerate(draft_parents, start=1):
            children[parent].append(node)
        if not self._fill(rows, 0):
            raise self._dead_end("allows no token after the answer so far, nor its end")
        dead = set()
        stack = [(child, False) for child in reversed(children[0])]
        while stack:  # depth-first; (node, True): the walk leaves node, whose token the matcher fed
            node, leaving = stack.pop()
            if leaving:
                self._check(self.matcher.rollback(1), "rolling back")
                continue
            parent = draft_parents[node - 1]
            token = draft_tokens[node - 1]
            if token in self.eos or not _allowed(rows[parent], token):
                continue
            # refused although its parent's row allows it (a limit llguidance meets feeding it, as plain decoding's
            # follow would meet it: a dead end there) or nothing allowed after it: a fresh matcher, fed the answer
            # and the path to the parent
            if not self.matcher.consume_token(token) or not self._fill(rows, node):
                rows[node] = -1
                dead.add(node)
                self._restart(_path(parent, draft_tokens, draft_parents))
                continue
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children[node]))
        self.dead = frozenset(dead)
        return rows

    def first_dead(self, accepted: list[int]) -> int | None:
        """The index in ``accepted`` of a drafted node of the last walk the grammar has no way on from (at most
        one: its subtree is not walked), or None. The tokens after it came from a row that allowed everything."""
        return next((i for i, node in enumerate(accepted) if node in self.dead), None)

    def dead_after_accepted(self) -> GrammarDeadEnd:
        return self._dead_end("allows no token after a drafted token the answer took, nor its end")

    def _fill(self, rows: np.ndarray, node: int) -> bool:
        """Node's row of allowed tokens; False: the grammar allows none there (the matcher is then in error)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, rows, node)
        return not self.matcher.is_error()

    def _restart(self, path: list[int]) -> None:
        matcher = self.new_matcher()
        self._check(matcher.consume_tokens([*self.fed, *path]) if self.fed or path else True, "starting afresh")
        self.matcher = matcher

    def _dead_end(self, what: str) -> GrammarDeadEnd:
        error = self.matcher.get_error().strip()[:300] if self.matcher.is_error() else ""
        detail = f" ({error})" if error else ""
        return GrammarDeadEnd(f"{self.param}: the format's grammar {what}{detail}", param=self.param)

    def _check(self, ok: bool, doing: str) -> None:
        if not ok:
            raise ValueError(f"the answer's grammar failed {doing}: {self.matcher.get_error()}")


def _path(node: int, draft_tokens: list[int], draft_parents: list[int]) -> list[int]:
    """The drafted tokens from the root's child down to ``node`` (none for the root)."""
    path = []
    while node:
        path.append(draft_tokens[node - 1])
        node = draft_parents[node - 1]
    return path[::-1]


def _allowed(row: np.ndarray, token: int) -> bool:
    return token < row.shape[0] * BITS and bool((int(row[token // BITS]) >> (token % BITS)) & 1)
