"""Argument types of the command lines (``specserve``, ``python -m load...``): a value out of range is a one-line
usage error when parsed, not a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch

from specserve.sampling import MAX_BATCH_SIZE


def positive_int(text: str) -> int:
    """A count that must be at least 1 (prompts, tokens, repeats, rows, batch sizes)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def batch_size(text: str) -> int:
    """A number of sequences one loop runs at once: 1 to ``MAX_BATCH_SIZE`` (an engine refuses more, and a
    benchmark would find that out only after the runs before it)."""
    value = positive_int(text)
    if value > MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_BATCH_SIZE}, not {value}")
    return value


def non_negative_int(text: str) -> int:
    """A count where 0 means none (or off)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


def finite_float(text: str) -> float:
    """A real number (nan and inf are usage errors, not values a range check then misreports)."""
    value = _float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, not {text}")
    return value


def logit_bias_arg(text: str) -> tuple[int, float]:
    """``ID=BIAS``: a token id and the value added to its logit (the bias's range is SamplingParams')."""
    token, sep, bias = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"ID=BIAS (a token id and a number), not {text!r}")
    value = finite_float(bias)
    return non_negative_int(token), value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def device_arg(text: str) -> str:
    """``--device``: a torch device's name (a clear usage error otherwise, not a traceback later)."""
    try:
        torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({e})") from None
    return text


def device_problem(text: str) -> str | None:
    """Why models cannot run on the device ``text`` names (None: the CPU, or a CUDA device this machine has)."""
    try:
        device = torch.device(text)
    except RuntimeError as e:
        return f"{text!r} is not a torch device ({e})"
    if device.type not in ("cpu", "cuda"):
        return f"{text!r}: models run on cpu or cuda, not {device.type}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"{text!r}: this torch has no CUDA device"
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        return f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def present_device_arg(text: str) -> str:
    """``--device`` for a command that runs models on it: the CPU, or a CUDA device this machine has."""
    problem = device_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def out_dir_arg(text: str) -> Path:
    """``--out``: a directory results go to, checked before the run (not after it, the results lost): it, or the
    nearest part of its path that exists, is a directory this process can write in. An empty one is refused (Path
    reads it as the current directory: a blank variable in a script wrote a head's files there)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is no directory to write results to")
    path = Path(text)
    try:  # (a name too long for a path, or a part this process may not look into: OSError from exists() too)
        existing = next((p for p in (path, *path.parents) if p.exists()), Path.cwd())
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory results can be written to ({e})") from None
    return path


def out_file_arg(text: str) -> Path:
    """``--out`` naming a file: its directory as ``out_dir_arg``, and not a directory itself."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is no file to write results to")
    try:
        is_dir = Path(text).is_dir()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file results can be written to ({e})") from None
    if is_dir:
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; this --out names the file results go to")
    out_dir_arg(str(Path(text).parent))
    return Path(text)
