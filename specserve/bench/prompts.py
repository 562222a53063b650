"""MT-bench prompts (80 questions, Apache-2.0, from lm-sys/FastChat; see data/LICENSE.fastchat)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str
    text: str  # the first turn


def mt_bench_prompts(limit: int | None = None, categories: list[str] | None = None) -> list[BenchPrompt]:
    raw = resources.files("specserve.bench").joinpath("data/mt_bench.jsonl").read_text()
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    out = [BenchPrompt(r["question_id"], r["category"], r["turns"][0]) for r in rows]
    if categories:
        out = [p for p in out if p.category in categories]
    return out[:limit] if limit is not None else out
