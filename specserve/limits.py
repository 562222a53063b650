"""Context and KV sizing shared by the in-process Engine and the Serve lanes."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import SpecConfig
from specserve.errors import UnsupportedModelError


@dataclass(frozen=True)
class ContextLimits:
    max_model_len: int  # prompt + generated tokens per sequence
    spec_headroom: int  # KV room beyond that for one step's drafted tokens
    kv_len: int  # KV slot length of each worker


def context_limits(
    *,
    max_model_len: int,
    spec_headroom: int,
    speculation: SpecConfig,
    target_positions: int,
    target_vocab: int,
    draft_positions: int | None = None,
    draft_vocab: int | None = None,
) -> ContextLimits:
    if draft_vocab is not None and draft_vocab != target_vocab:
        raise UnsupportedModelError(
            f"draft vocabulary ({draft_vocab}) differs from the target's ({target_vocab}); "
            "speculative decoding needs the same tokenizer"
        )
    headroom = max(spec_headroom, speculation.max_verify_tokens)  # model-free drafting needs no draft model
    limit = min(max_model_len, target_positions - headroom)
    if draft_positions is not None:
        limit = min(limit, draft_positions - headroom)
    return ContextLimits(limit, headroom, limit + headroom)
