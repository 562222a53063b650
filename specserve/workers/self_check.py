"""A worker's self-check: one token through its model in a scratch cache, apart from every sequence's KV slot.

The serving lane asks for it before it pins a failure that names no sequence on the one request left running: a
worker that cannot run one token of its own (a poisoned device context, weights gone non-finite) is broken and is
replaced; one that can leaves the blame with the request.
"""

from __future__ import annotations

import torch

from specserve.errors import SpecServeError
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.spec_decode.eagle_head import EagleHead


class WorkerBrokenError(SpecServeError):
    """The worker's model cannot compute one token correctly: the worker, not a request, is at fault."""


@torch.inference_mode()
def self_check(model: LlamaModel | EagleHead) -> None:
    """Raise (WorkerBrokenError, or whatever the device raises) unless one token's logits come out finite."""
    cache = model.new_cache(1, 2)
    slot = cache.allocate()
    batch = ForwardBatch.build(cache, [slot], [[0]], device=model.device)
    if isinstance(model, EagleHead):
        features = torch.zeros(1, model.cfg.feature_size, device=model.device)
        logits = model.logits(model(batch.tokens.reshape(-1), model.fuse(features), batch, cache))  # [1, V_d]
    else:
        logits = model(batch, cache)  # [1, V]
    if not bool(torch.isfinite(logits).all()):  # the one host sync of the check
        raise WorkerBrokenError(f"the {type(model).__name__}'s logits for one token are not finite")
