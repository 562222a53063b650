"""Files replaced whole: after a crash, a killed writer or a power loss a reader finds the old file or the whole
new one, never a file cut short (the data is flushed to the disk before the rename, the rename after it)."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flush(tmp: Path) -> None:
    """Flush the fully written ``tmp`` (a file, or a directory of files) to the disk, ready to be renamed."""
    for file in sorted(tmp.rglob("*")) if tmp.is_dir() else [tmp]:
        if file.is_file():
            _fsync(file)
    if tmp.is_dir():
        # each directory's entries, deepest first: a file under a subdirectory is not found after a power loss
        # unless the subdirectory's own entry list reached the disk
        for folder in sorted((d for d in tmp.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            _fsync(folder)
        _fsync(tmp)


def replace_durably(tmp: Path, path: Path) -> None:
    """Move the fully written ``tmp`` (a file, or a directory of files) to ``path``."""
    flush(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)  # the rename itself


def swap_durably(tmp: Path, path: Path, aside: Path) -> None:
    """Replace the directory ``path`` with the fully written directory ``tmp``, moving the old one to ``aside``.

    Everything is flushed first, so ``path`` is missing only between two renames, never while data is written.
    """
    flush(tmp)
    os.replace(path, aside)
    os.replace(tmp, path)
    _fsync(path.parent)


def write_durably(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a new file beside ``path``, then move it there durably; on any failure the temporary file
    goes. The temporary file is created here, never opened through whatever a predictable name could already be (a
    symlink planted in a shared directory would have had the write land where it points): a random name, created
    exclusively, with the permissions the umask gives a new file."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
    try:
        write(tmp)
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_TEMP = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")  # write_durably's temporary files


def drop_leftovers(directory: Path) -> None:
    """Remove the temporary files of writes killed midway (``write_durably``'s, this user's) from a directory one
    process writes at a time (a training run's work directory): each holds up to a whole checkpoint."""
    for path in directory.glob(".*.tmp"):
        mine = path.is_file() and not path.is_symlink() and path.stat().st_uid == os.getuid()
        if mine and _TEMP.fullmatch(path.name):
            path.unlink(missing_ok=True)
