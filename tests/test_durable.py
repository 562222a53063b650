"""Files replaced whole are on the disk before they take the old one's name, and the rename is on the disk after."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import specserve.durable as durable
from specserve.models.sources import store_json


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        seen.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    monkeypatch.setattr(durable.os, "replace", replace)
    return seen


def test_a_file_is_flushed_before_its_rename_and_the_rename_after(
    tmp_path: Path, events: list[tuple[str, str]]
) -> None:
    path = tmp_path / "profile.json"
    store_json(path, {"a": 1})
    tmp = events[0][1]
    assert events == [("fsync", tmp), ("replace", str(path)), ("fsync", str(tmp_path))]
    assert json.loads(path.read_text()) == {"a": 1} and not Path(tmp).exists()


def test_a_directory_is_flushed_file_by_file_before_its_rename(tmp_path: Path, events: list[tuple[str, str]]) -> None:
    work = tmp_path / ".model.tmp"
    (work / "sub").mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "sub/vocab.json"):
        (work / name).write_text(name)
    durable.replace_durably(work, tmp_path / "model")
    flushed = [p for kind, p in events[: events.index(("replace", str(tmp_path / "model")))] if kind == "fsync"]
    assert {str(work / n) for n in ("model.safetensors", "config.json", "sub/vocab.json")} <= set(flushed)
    assert str(work) in flushed and events[-1] == ("fsync", str(tmp_path))
    # a subdirectory's entries before its parent's: its file is found after a power loss
    assert flushed.index(str(work / "sub")) < flushed.index(str(work))
    assert (tmp_path / "model" / "sub" / "vocab.json").read_text() == "sub/vocab.json"
