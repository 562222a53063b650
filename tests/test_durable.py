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


def test_writes_go_through_no_link_planted_at_a_predictable_name(tmp_path: Path) -> None:
    """The temporary files had fixed names (``manifest.tmp``, ``ckpt.tmp``, ``<name>.<pid>.tmp``) and were opened
    through whatever stood there: a symlink another user planted in a shared work directory sent the write to the
    file it pointed to."""
    from specserve.train.distill import claim_data_dir

    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    work = tmp_path / "work"
    work.mkdir()
    for name in ("manifest.tmp", f"profile.{os.getpid()}.tmp", "profile.json.tmp"):
        (work / name).symlink_to(victim)
    claim_data_dir(work, {"kind": "text"})
    store_json(work / "profile.json", {"a": 1})
    assert victim.read_text() == "untouched"
    assert json.loads((work / "manifest.json").read_text()) == {"kind": "text"}
    assert json.loads((work / "profile.json").read_text()) == {"a": 1}


def test_a_durable_write_that_fails_leaves_nothing_and_a_new_file_takes_the_umasks_permissions(
    tmp_path: Path,
) -> None:
    path = tmp_path / "out.json"

    def fails(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("killed midway")

    with pytest.raises(RuntimeError):
        durable.write_durably(path, fails)
    assert list(tmp_path.iterdir()) == []
    umask = os.umask(0o022)
    try:
        durable.write_durably(path, lambda tmp: tmp.write_text("whole"))
    finally:
        os.umask(umask)
    assert path.read_text() == "whole" and path.stat().st_mode & 0o777 == 0o644
    assert list(tmp_path.iterdir()) == [path]


def test_a_training_runs_directory_drops_the_temporary_files_of_writes_killed_midway(tmp_path: Path) -> None:
    """Random temporary names are never written again: a killed write's file (up to a whole checkpoint) stayed for
    good. A directory one run owns drops them when the run claims it; other files, and links, stay."""
    from specserve.train.distill import claim_data_dir

    work = tmp_path / "data"
    work.mkdir()
    killed = work / ".chunk_0003.safetensors.0123456789abcdef.tmp"
    killed.write_bytes(b"half a chunk")
    kept = [work / "notes.tmp", work / ".chunk_0001.safetensors", work / ".x.0123456789abcdef.tmp.keep"]
    for path in kept:
        path.write_text("mine")
    link = work / ".ckpt.pt.fedcba9876543210.tmp"
    link.symlink_to(tmp_path / "elsewhere")
    claim_data_dir(work, {"kind": "text"})
    assert not killed.exists() and all(path.exists() for path in kept) and link.is_symlink()
