"""Prompts the target writes itself (Magpie, Xu et al. 2024): given its chat template up to the start of a user
turn and nothing else, an instruction-tuned model samples a user request of the kind it was tuned on. Those
requests are closer to real chat traffic than templates, and need nothing but the target.

The requests are filtered (finished, plain text, not too short or long, no duplicates) and any request that
shares an 8-word run with an MT-bench turn is dropped: MT-bench is the evaluation set.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from importlib import resources

from transformers import PreTrainedTokenizerBase

# (user-turn prefix ids, how many, seed) -> each sampled request's ids, or None where it did not finish
AskFn = Callable[[list[int], int, int], list[list[int] | None]]

MIN_CHARS, MAX_CHARS = 16, 1500
SHINGLE_WORDS = 8


def user_turn_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The chat template's tokens before a user's first word (the default system turn, then the user header)."""
    marker = "\x00MARK\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if not isinstance(text, str) or marker not in text:
        raise ValueError("the tokenizer's chat template does not place the user's text verbatim")
    return list(tokenizer.encode(text[: text.index(marker)], add_special_tokens=False))


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def mt_bench_shingles(n: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    raw = resources.files("specserve.bench").joinpath("data/mt_bench.jsonl").read_text()
    turns = [t for line in raw.splitlines() if line.strip() for t in json.loads(line)["turns"]]
    return set().union(*(shingles(t, n) for t in turns))


def keep_requests(texts: Iterable[str | None], banned: set[tuple[str, ...]], special: Iterable[str]) -> list[str]:
    """The usable requests, in order: finished (not None), ``MIN_CHARS``..``MAX_CHARS`` long once stripped, no
    special-token text, none seen before, no ``SHINGLE_WORDS``-word run in ``banned``."""
    specials = [s for s in special if s]
    out: list[str] = []
    seen: set[str] = set()
    for text in texts:
        if text is None:
            continue
        text = text.strip()
        if not MIN_CHARS <= len(text) <= MAX_CHARS or any(s in text for s in specials):
            continue
        if text in seen or shingles(text) & banned:
            continue
        seen.add(text)
        out.append(text)
    return out


def self_prompts(
    tokenizer: PreTrainedTokenizerBase, ask: AskFn, n: int, seed: int, banned: set[tuple[str, ...]]
) -> list[str]:
    """Up to ``n`` requests the target writes (fewer where samples are dropped); deterministic for ``seed`` when
    ``ask`` is (seeded sampling here is a function of the seed and position alone)."""
    drawn = ask(user_turn_prefix(tokenizer), n, seed)
    texts = [None if ids is None else str(tokenizer.decode(ids, skip_special_tokens=False)) for ids in drawn]
    return keep_requests(texts, banned, tokenizer.all_special_tokens)
