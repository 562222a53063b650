"""Offline prose for teacher-forced training data (specserve.train.corpus): how files become passages."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from specserve.errors import SettingsError
from specserve.train.corpus import ASKS, CorpusError, corpus_files, corpus_passages, paragraphs, passages
from specserve.train.pipeline import TrainDraftConfig
from specserve.train.self_prompts import BannedRuns

PROSE = """   The quick brown fox jumps over the lazy dog while the farmer watches from
   the porch of the old wooden house at the end of the long and dusty road.
"""
VERSE = """Roses are red,
  Violets are blue,
"""


def test_wrapped_prose_is_joined_and_short_lines_are_kept() -> None:
    text = PROSE + "\n" + VERSE + "%\nA fortune of its own.\n%\n\n\n"
    assert list(paragraphs(text)) == [
        "The quick brown fox jumps over the lazy dog while the farmer watches from the porch of the old wooden house "
        "at the end of the long and dusty road.",
        "Roses are red,\n  Violets are blue,",
        "A fortune of its own.",
    ]


def test_passages_group_consecutive_paragraphs_up_to_the_limit() -> None:
    paras = ["a" * 40, "b" * 40, "c" * 40, "d" * 200, "e" * 10]
    text = "\n\n".join(paras)
    # a+b fit in 90 (40 + 2 + 40); c starts a new run; d is longer than 90 and skipped; e joins c
    assert list(passages(text, 1, 90)) == ["a" * 40 + "\n\n" + "b" * 40, "c" * 40 + "\n\n" + "e" * 10]
    assert list(passages(text, 60, 90)) == ["a" * 40 + "\n\n" + "b" * 40]  # c+e (52) is too short


def test_corpus_passages_are_seeded_prefix_stable_and_never_the_evaluation_set(tmp_path: Path) -> None:
    words = [f"word{i}" for i in range(4000)]
    paras = [" ".join(words[i : i + 12]) for i in range(0, 4000, 12)]  # 12 words a line: short lines, kept as is
    (tmp_path / "a.txt").write_text("\n\n".join(paras[:150]))
    with gzip.open(tmp_path / "b.dict.dz", "wt") as f:  # dictzip is read as gzip
        f.write("\n\n".join(paras[150:]))
    (tmp_path / "a.dat").write_bytes(b"\0\0\x02index")  # under a directory: not text, skipped
    (tmp_path / "a.u8").symlink_to(tmp_path / "a.txt")  # the same file again: read once
    files = corpus_files([tmp_path, tmp_path / "a.txt"])
    assert [f.name for f in files] == ["a.txt", "b.dict.dz"]
    banned = BannedRuns.of([paras[3] + " " + paras[200]])  # two paragraphs' 8-word runs, one in each file
    pairs = corpus_passages(files, 1000, seed=5, banned=banned, min_chars=50, max_chars=300)
    texts = [p for _, p in pairs]
    assert pairs == corpus_passages(files, 1000, seed=5, banned=banned, min_chars=50, max_chars=300)
    assert corpus_passages(files, 7, seed=5, banned=banned, min_chars=50, max_chars=300) == pairs[:7]
    assert [p for _, p in corpus_passages(files, 1000, 6, banned, 50, 300)] != texts  # another seed, another order
    assert all(ask in ASKS for ask, _ in pairs)
    assert not any(banned.hit(t) for t in texts)
    joined = "\n\n".join(texts)
    assert paras[3] not in joined and paras[200] not in joined
    unbanned = [p for _, p in corpus_passages(files, 1000, 5, BannedRuns.of([]), 50, 300)]
    # each paragraph lands in exactly one passage, a passage holds paragraphs of one file, and a banned run drops
    # only the passages holding it
    assert sorted(q for t in unbanned for q in t.split("\n\n")) == sorted(paras)
    assert not any(paras[149] in t and paras[150] in t for t in unbanned)
    assert sorted(texts) == sorted(t for t in unbanned if paras[3] not in t and paras[200] not in t)
    assert len(texts) == len(unbanned) - 2


def test_bad_corpus_settings_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="neither a file nor a directory"):
        corpus_files([tmp_path / "missing.txt"])
    with pytest.raises(CorpusError, match="hold no text files"):
        corpus_files([tmp_path])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1\.txt is not UTF-8"):
        corpus_passages(corpus_files([tmp_path]), 1, 0, BannedRuns.of([]), 1, 100)
    (tmp_path / "latin1.txt").unlink()
    (tmp_path / "cut.dz").write_bytes(gzip.compress(b"some text " * 1000)[:-30])
    with pytest.raises(CorpusError, match=r"cannot read .*cut\.dz"):
        corpus_files([tmp_path])
    with pytest.raises(CorpusError, match=r"cannot read .*cut\.dz"):
        corpus_passages([tmp_path / "cut.dz"], 1, 0, BannedRuns.of([]), 1, 100)
    damaged = bytearray(gzip.compress(b"some text " * 1000))  # a sound header, a damaged deflate stream
    damaged[20:40] = bytes(b ^ 0xFF for b in damaged[20:40])  # (zlib.error: was a traceback, not a CorpusError)
    (tmp_path / "cut.dz").write_bytes(bytes(damaged))
    with pytest.raises(CorpusError, match=r"cannot read .*cut\.dz"):
        corpus_files([tmp_path])
    with pytest.raises(CorpusError, match=r"cannot read .*cut\.dz"):
        corpus_passages([tmp_path / "cut.dz"], 1, 0, BannedRuns.of([]), 1, 100)
    with pytest.raises(SettingsError, match="corpus paths a number of passages"):
        TrainDraftConfig("smollm2-135m-instruct", corpus=(tmp_path,))
    with pytest.raises(SettingsError, match="corpus passages need corpus paths"):
        TrainDraftConfig("smollm2-135m-instruct", corpus_passages=3)
