"""Argument types of the command lines (``specserve``, ``python -m load...``): a value out of range is a one-line
usage error when parsed, not a traceback from deep inside a run."""

from __future__ import annotations

import argparse

import torch


def positive_int(text: str) -> int:
    """A count that must be at least 1 (prompts, tokens, repeats, rows, batch sizes)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def non_negative_int(text: str) -> int:
    """A count where 0 means none (or off)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


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


def present_device_arg(text: str) -> str:
    """``--device`` for a command that runs models on it: one this machine has."""
    if torch.device(device_arg(text)).type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch has no CUDA device")
    return text
