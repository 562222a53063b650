"""A step's draft-head features between the actors and the router as one byte buffer.

Ray pickles a torch tensor through its storage, 0.3-0.6 ms each on a 2-core CPU, and a step of B sequences sent
B of them (one per ``VerifyOutput`` or ``ProposeItem``). One ``bytes`` object for the step's rows costs a fraction of
that (inline in the call up to Ray's 100 KiB, through the object store beyond: a prefill's rows);
docs/benchmarks.md, "The deployment's actors on a shared CPU". ``FeatureWire.float16`` sends float32 rows rounded to
float16, half the bytes: 16 EAGLE-3 rows of SmolLM2 (110.6 KB) stay inline at 55 KB (docs/benchmarks.md, "Features
on the wire in float16").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import TypeVar

import torch

from specserve.messages import ProposeItem, VerifyOutput


class FeatureWire(str, Enum):
    """How float32 features cross: as they are, or rounded to float16 (the heads train on float16 features;
    drafts change by the rounding only, and the target verifies them all the same). Other dtypes cross as they
    are, and so does a whole step if any of its values is not finite in float16 (past 65504, inf or NaN)."""

    native = "native"
    float16 = "float16"


@dataclass(frozen=True)
class WireFeatures:
    data: bytes  # the rows of every message that had features, in message order, [sum rows, width] of ``dtype``
    dtype: torch.dtype
    width: int
    rows: tuple[int | None, ...]  # per message: its rows; None where it had no features
    restore: torch.dtype | None = None  # the dtype rows rounded for the wire are given back in (None: not rounded)


M = TypeVar("M", VerifyOutput, ProposeItem)


def strip_features(messages: list[M], wire: FeatureWire = FeatureWire.native) -> tuple[list[M], WireFeatures | None]:
    """The messages without their features, and the features as one buffer (None: no message had any)."""
    feats = [m.features for m in messages if m.features is not None]
    if not feats:
        return messages, None
    kinds = {(f.dtype, f.shape[1:]) for f in feats}
    if len(kinds) > 1:
        raise ValueError(f"one step's features differ in dtype or width: {sorted(map(str, kinds))}")
    step = torch.cat(feats)  # [sum n, F] on the worker's device
    restore, host = None, None
    if wire == FeatureWire.float16 and step.dtype == torch.float32:  # rounded where they are: half the copy
        rounded = step.to(torch.float16).cpu()
        if bool(rounded.isfinite().all()):  # else some row was past float16's range (or not finite): none rounded
            restore, host = step.dtype, rounded
    if host is None:
        host = step.cpu()
    host = host.contiguous()
    raw = host.view(torch.uint8).numpy().tobytes()  # a byte view: any dtype, bfloat16 included
    rows = tuple(None if m.features is None else m.features.shape[0] for m in messages)
    sent = WireFeatures(raw, host.dtype, host.shape[1], rows, restore)
    return [m if m.features is None else replace(m, features=None) for m in messages], sent


def attach_features(messages: list[M], wire: WireFeatures | None) -> list[M]:
    """``strip_features`` undone: each message gets its rows back, in storage of its own (a view of the step's
    buffer would keep every other sequence's rows alive as long as its own)."""
    if wire is None:
        return messages
    if len(wire.rows) != len(messages):
        raise ValueError(f"features for {len(wire.rows)} messages arrived with {len(messages)}")
    # a writable copy: torch warns on read-only bytes, and silencing it (warnings.catch_warnings) is not safe beside
    # the other lanes' threads
    flat = torch.frombuffer(bytearray(wire.data), dtype=torch.uint8) if wire.data else torch.empty(0, dtype=torch.uint8)
    table = flat.view(wire.dtype).view(-1, wire.width)  # [sum n, F]
    out, start = [], 0
    for m, n in zip(messages, wire.rows, strict=True):
        if n is None:
            out.append(m)
            continue
        rows = table[start : start + n]
        out.append(replace(m, features=rows.clone() if wire.restore is None else rows.to(wire.restore)))
        start += n
    if start != table.shape[0]:
        raise ValueError(f"{table.shape[0]} feature rows arrived for {start}")
    return out
