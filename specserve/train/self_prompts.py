"""Prompts the target writes itself (Magpie, Xu et al. 2024): given its chat template up to the start of a user
turn and nothing else, an instruction-tuned model samples a user request of the kind it was tuned on. Those
requests are closer to real chat traffic than templates, and need nothing but the target.

The requests are filtered (finished, plain text, not too short or long, no duplicates) and any request that
shares an 8-word run with an MT-bench turn, or holds a shorter turn whole, is dropped: MT-bench is the evaluation
set.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources

from transformers import PreTrainedTokenizerBase

from specserve.train.distill import TRAINING_DATE

# (user-turn prefix ids, how many, seed) -> each sampled request's ids, or None where it did not finish
AskFn = Callable[[list[int], int, int], list[list[int] | None]]

MIN_CHARS, MAX_CHARS = 16, 1500
SHINGLE_WORDS = 8


def user_turn_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The chat template's tokens before a user's first word (the default system turn, then the user header)."""
    marker = "\x00MARK\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, date_string=TRAINING_DATE
    )
    if not isinstance(text, str) or marker not in text:
        raise ValueError("the tokenizer's chat template does not place the user's text verbatim")
    return list(tokenizer.encode(text[: text.index(marker)], add_special_tokens=False))


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower().replace("\u2019", "'"))


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    return _runs(words(text), n)


def _runs(w: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


@dataclass(frozen=True)
class BannedRuns:
    """The word runs no training text may hold: every ``n``-word run of the banned texts, and each banned text
    shorter than ``n`` words whole (an MT-bench turn such as "Prove the Pythagorean theorem." has no 8-word run)."""

    runs: frozenset[tuple[str, ...]]
    short: tuple[str, ...]  # the short texts' words, space-joined and space-padded
    n: int = SHINGLE_WORDS

    @classmethod
    def of(cls, texts: Iterable[str], n: int = SHINGLE_WORDS) -> BannedRuns:
        texts = list(texts)
        short = {" " + " ".join(w) + " " for t in texts if 0 < len(w := words(t)) < n}
        return cls(frozenset().union(*(shingles(t, n) for t in texts)), tuple(sorted(short)), n)

    def digest(self) -> str:
        h = hashlib.sha256(repr((self.n, sorted(self.runs), self.short)).encode())
        return h.hexdigest()

    def hit(self, text: str) -> bool:
        w = words(text)
        if not _runs(w, self.n).isdisjoint(self.runs):
            return True
        joined = " " + " ".join(w) + " "
        return any(run in joined for run in self.short)


def mt_bench_runs(n: int = SHINGLE_WORDS) -> BannedRuns:
    raw = resources.files("specserve.bench").joinpath("data/mt_bench.jsonl").read_text()
    return BannedRuns.of((t for line in raw.splitlines() if line.strip() for t in json.loads(line)["turns"]), n)


FILTER_VERSION = 2  # bumped with every change to what keep_requests keeps (2: short MT-bench turns held whole)


def filter_record(banned: BannedRuns) -> dict[str, object]:
    """What decided which written requests were kept, for a data directory's manifest: chunks kept under another
    filter (an older one that let an MT-bench turn through) are refused on a resume, not trained on."""
    return {"version": FILTER_VERSION, "chars": [MIN_CHARS, MAX_CHARS], "banned_sha256": banned.digest()}


def keep_requests(texts: Iterable[str | None], banned: BannedRuns, special: Iterable[str]) -> list[str]:
    """The usable requests, in order: finished (not None), ``MIN_CHARS``..``MAX_CHARS`` long once stripped, no
    special-token text, none seen before, none holding a run of ``banned``."""
    specials = [s for s in special if s]
    out: list[str] = []
    seen: set[str] = set()
    for text in texts:
        if text is None:
            continue
        text = text.strip()
        if not MIN_CHARS <= len(text) <= MAX_CHARS or any(s in text for s in specials):
            continue
        if text in seen or banned.hit(text):
            continue
        seen.add(text)
        out.append(text)
    return out


def self_prompts(tokenizer: PreTrainedTokenizerBase, ask: AskFn, n: int, seed: int, banned: BannedRuns) -> list[str]:
    """Up to ``n`` requests the target writes (fewer where samples are dropped); deterministic for ``seed`` when
    ``ask`` is (seeded sampling here is a function of the seed and position alone)."""
    drawn = ask(user_turn_prefix(tokenizer), n, seed)
    texts = [None if ids is None else str(tokenizer.decode(ids, skip_special_tokens=False)) for ids in drawn]
    return keep_requests(texts, banned, tokenizer.all_special_tokens)
