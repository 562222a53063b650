"""Benchmark prompts: MT-bench (80 questions, Apache-2.0, from lm-sys/FastChat; see data/LICENSE.fastchat), or any
file in its layout (one JSON object per line with ``question_id``, ``category`` and ``turns``)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specserve.errors import InvalidRequestError


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str
    text: str  # the first turn


def mt_bench_prompts(limit: int | None = None, categories: list[str] | None = None) -> list[BenchPrompt]:
    raw = resources.files("specserve.bench").joinpath("data/mt_bench.jsonl").read_text()
    out = parse_prompts(raw, "mt_bench.jsonl")
    if categories:
        out = [p for p in out if p.category in categories]
    return out[:limit] if limit is not None else out


def per_category(prompts: list[BenchPrompt], n: int) -> list[BenchPrompt]:
    """The first ``n`` prompts of each category, in file order."""
    seen: Counter[str] = Counter()
    keep = []
    for p in prompts:
        seen[p.category] += 1
        if seen[p.category] <= n:
            keep.append(p)
    return keep


def load_prompts(path: Path, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts from a JSONL file in the MT-bench layout (the first turn of each)."""
    try:
        raw = Path(path).read_text(encoding="utf-8-sig")  # JSONL is UTF-8 whatever the locale (a BOM allowed)
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"cannot read the prompts file {path}: {e}") from e
    out = parse_prompts(raw, str(path))
    return out[:limit] if limit is not None else out


def parse_prompts(raw: str, name: str) -> list[BenchPrompt]:
    out = []
    # lines end at LF (CR LF too) only: str.splitlines also ends them at U+2028, U+2029 and U+0085, which JSON
    # strings may hold raw
    for n, line in enumerate(raw.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            turns, question_id, category = r["turns"], r["question_id"], r["category"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise ValueError("'turns' must be a non-empty list of strings")
            if not turns[0].strip():  # (benchmarked as an empty user message: the chat template alone)
                raise ValueError("'turns[0]' is blank")
            if isinstance(question_id, bool) or not isinstance(question_id, int | str):
                raise ValueError(f"'question_id' must be an integer, not {question_id!r}")
            if not isinstance(category, str):
                raise ValueError(f"'category' must be a string, not {category!r}")
            for field, text in (("turns[0]", turns[0]), ("category", category)):
                _check_utf8(field, text)
            out.append(BenchPrompt(int(question_id), category, turns[0]))
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
            raise InvalidRequestError(
                f"{name} line {n}: want a JSON object with question_id, category and turns ({e})"
            ) from e
    if not out:
        raise InvalidRequestError(f"{name} holds no prompts")
    return out


def _check_utf8(field: str, text: str) -> None:
    """JSON's escapes reach lone surrogates (``"\\ud800"``), which no UTF-8 text holds: the chat template's encoding
    failed on them only after every model had loaded, naming neither the file nor the line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"'{field}' is not UTF-8 text: character {e.start} is a lone surrogate") from None
