"""Passages of offline prose for teacher-forced training data (``train-draft --corpus``).

The drafter's misses on chat prompts are continuations any broadly read model knows; generating answers costs a
decode step a token on the CPU, while teacher-forcing a text costs one prefill. Any plain-text files serve: Debian's
dictionary and quotation packages (FOLDOC, the Jargon File, fortunes), a project's documentation sources, books.

A file is read as UTF-8 (``.gz`` / ``.dz`` decompressed) and cut into paragraphs at blank lines and at lines holding
only ``%`` (the fortune format). A paragraph whose lines average ``WRAPPED_LINE`` characters or more is hard-wrapped
prose and is joined into one line; shorter lines (verse, code, lists) are kept as they are, dedented. Consecutive
paragraphs of one file make a passage of at most ``max_chars``; shorter than ``min_chars`` is dropped, as is any
passage sharing an 8-word run with an MT-bench turn (the evaluation set).
"""

from __future__ import annotations

import gzip
import hashlib
import random
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path

from specserve.errors import SettingsError
from specserve.train.self_prompts import BannedRuns

BINARY_PROBE = 8192
COMPRESSED = (".gz", ".dz")  # dictzip is gzip with an index in its header
WRAPPED_LINE = 45  # mean characters a line at and above which a paragraph is taken for wrapped prose
ASKS = (
    "Write a passage.",
    "Tell me something worth knowing.",
    "Write a few paragraphs on a topic of your choice.",
    "Share a piece of writing.",
    "Explain something interesting.",
)


class CorpusError(SettingsError):
    """A corpus path is missing, unreadable or not UTF-8 text."""


def corpus_files(paths: list[Path]) -> list[Path]:
    """The files named, directories expanded recursively in sorted order, each file once (a link to a file already
    listed is dropped). Under a directory, a file with a NUL byte in its first ``BINARY_PROBE`` bytes is not text
    and is skipped (fortune's ``.dat`` indexes); a path that is not there is an error."""
    out: list[Path] = []
    seen: set[Path] = set()
    for path in paths:
        if path.is_dir():
            found = [p for p in sorted(path.rglob("*")) if p.is_file() and not _binary(p)]
        elif path.is_file():
            found = [path]
        else:
            raise CorpusError(f"corpus path {path} is neither a file nor a directory")
        for p in found:
            if p.resolve() not in seen:
                seen.add(p.resolve())
                out.append(p)
    if not out:
        raise CorpusError("the corpus paths hold no text files")
    return out


def _binary(path: Path) -> bool:
    try:
        with gzip.open(path, "rb") if path.suffix in COMPRESSED else path.open("rb") as f:
            return b"\0" in f.read(BINARY_PROBE)
    except (OSError, EOFError, zlib.error) as e:  # (a damaged deflate stream raises zlib.error)
        raise CorpusError(f"cannot read {path}: {e}") from None


def read_text(path: Path) -> str:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix in COMPRESSED else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # (a damaged deflate stream raises zlib.error)
        raise CorpusError(f"cannot read {path}: {e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def paragraphs(text: str) -> Iterator[str]:
    lines: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.strip() not in ("", "%"):
            lines.append(line.rstrip())
            continue
        if not lines:
            continue
        if sum(len(x.strip()) for x in lines) / len(lines) >= WRAPPED_LINE:
            yield " ".join(x.strip() for x in lines)
        else:
            yield textwrap.dedent("\n".join(lines))
        lines = []


def passages(text: str, min_chars: int, max_chars: int) -> Iterator[str]:
    """Runs of consecutive paragraphs, each run at most ``max_chars`` long (a longer paragraph is skipped)."""
    run: list[str] = []
    size = 0
    for para in paragraphs(text):
        if len(para) > max_chars:
            continue
        if run and size + 2 + len(para) > max_chars:
            if size >= min_chars:
                yield "\n\n".join(run)
            run, size = [], 0
        size += len(para) + (2 if run else 0)
        run.append(para)
    if run and size >= min_chars:
        yield "\n\n".join(run)


def corpus_digest(files: list[Path]) -> str:
    """sha256 over the files' names and bytes, in order: what a data directory's chunks were written from."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def corpus_passages(
    files: list[Path],
    n: int,
    seed: int,
    banned: BannedRuns,
    min_chars: int = 300,
    max_chars: int = 2000,
) -> list[tuple[str, str]]:
    """``n`` (ask, passage) pairs drawn without replacement from every file's passages, deterministic for a seed;
    fewer when the files hold fewer."""
    if not 0 < min_chars <= max_chars:
        raise CorpusError(f"need 0 < min_chars <= max_chars, got {min_chars}, {max_chars}")
    pool = [p for path in files for p in passages(read_text(path), min_chars, max_chars) if not banned.hit(p)]
    rng = random.Random(seed)
    rng.shuffle(pool)
    return [(rng.choice(ASKS), p) for p in pool[:n]]
