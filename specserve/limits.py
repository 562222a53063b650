"""Context and KV sizing shared by the in-process Engine and the Serve lanes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specserve.config import SpecConfig
from specserve.errors import SettingsError, UnsupportedModelError
from specserve.host_memory import check_host_fits, host_available_bytes
from specserve.models.llama import LlamaModel
from specserve.models.memory import ModelShape, activation_bytes, kv_bytes_per_slot, kv_slots_that_fit
from specserve.spec_decode.eagle_head import EagleHead

logger = logging.getLogger(__name__)

MemInfo = Callable[[torch.device], tuple[int, int]]  # (free, total) bytes, as torch.cuda.mem_get_info


@dataclass(frozen=True)
class MemoryShare:
    """What a worker's KV sizing may fill of its device: ``utilization`` of it in all (``gpu_memory_utilization``)
    and, of that, the ``fraction`` its actor reserves (``num_gpus`` < 1: actors sharing a GPU)."""

    utilization: float
    fraction: float = 1.0


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
    # room past max_model_len for a step's verified tokens, and for the rows a draft's tree levels append
    headroom = max(spec_headroom, speculation.max_verify_tokens, speculation.max_draft_rows)
    limit = min(max_model_len, target_positions - headroom)
    if draft_positions is not None:
        limit = min(limit, draft_positions - headroom)
    if limit < 1:
        raise SettingsError(
            f"speculation needs room for {headroom} tokens a step, which leaves the models' "
            f"{min(target_positions, draft_positions or target_positions)} positions no context"
        )
    if limit < max_model_len:
        logger.warning(
            "max_model_len %d lowered to %d: the models' %d positions keep %d past it for one speculative step's "
            "tokens (spec_headroom)",
            max_model_len,
            limit,
            min(target_positions, draft_positions or target_positions),
            headroom,
        )
    return ContextLimits(limit, headroom, limit + headroom)


def model_shape(model: LlamaModel | EagleHead) -> ModelShape:
    if isinstance(model, LlamaModel):
        layers, vocab, tied = model.cfg.num_layers, model.cfg.vocab_size, model.cfg.tie_word_embeddings
    else:  # a head: one decoder layer over the target's features; its embedding and LM head are the target's
        layers, vocab, tied = 1, model.cfg.draft_vocab_size or model.cfg.vocab_size, True
    cfg = model.cfg
    return ModelShape(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        qkv_bias=cfg.qkv_bias,
        o_bias=cfg.o_bias,
        mlp_bias=getattr(cfg, "mlp_bias", False),
    )


def kv_dtype(model: LlamaModel | EagleHead) -> torch.dtype:
    return model.dtype if isinstance(model, LlamaModel) else model.fc.weight.dtype


def slot_bytes(models: Sequence[LlamaModel | EagleHead], *, max_len: int, step_tokens: int) -> tuple[int, int]:
    """A KV slot of ``max_len`` in every one of ``models``, and its share of their largest forwards (a prefill of
    ``max_len`` or a step of ``step_tokens``): (KV bytes, activation bytes)."""
    kv = sum(kv_bytes_per_slot(model_shape(m), kv_dtype(m).itemsize, max_len) for m in models)
    act = 0
    for model in models:
        shape, size = model_shape(model), kv_dtype(model).itemsize
        act += max(
            activation_bytes(shape, size, batch=1, q_len=max_len, kv_len=max_len, logit_rows=1),
            activation_bytes(shape, size, batch=1, q_len=step_tokens, kv_len=max_len, logit_rows=step_tokens),
        )
    return kv, act


def device_kv_slots(
    models: Sequence[LlamaModel | EagleHead],
    *,
    requested: int,
    max_len: int,
    step_tokens: int,
    share: MemoryShare | None,
    mem_info: MemInfo | None = None,
    reserved: Callable[[torch.device], int] | None = None,
) -> int:
    """KV slots of ``max_len`` for ``models`` (on one device, weights loaded), each reserving its KV in every model
    and its share of the largest forward (a prefill of ``max_len`` or a step of ``step_tokens``): ``requested`` on
    the CPU (refused when they would not fit in the memory the host has available: ``check_host_fits``) or without
    a share; on CUDA as many as fit (at most ``requested``). An actor sharing its GPU
    counts against its fraction only what this process holds (``reserved``: torch's reserved memory); the
    others' weights are in the device's free memory, which it may not exceed."""
    device = models[0].device
    slot, act = slot_bytes(models, max_len=max_len, step_tokens=step_tokens)
    if device.type == "cpu":
        available = host_available_bytes()
        check_host_fits(requested * slot, requested, max_len, available=available, activation_bytes=requested * act)
    if share is None or device.type != "cuda":
        return requested
    if mem_info is None:
        torch.cuda.empty_cache()  # loading's freed blocks count as free
        mem_info = torch.cuda.mem_get_info
    free, total = mem_info(device)
    own = None if share.fraction >= 1.0 else (reserved or torch.cuda.memory_reserved)(device)
    return kv_slots_that_fit(
        total_bytes=total,
        free_bytes=free,
        utilization=share.utilization,
        fraction=share.fraction,
        own_bytes=own,
        slot_bytes=slot,
        activation_bytes_per_slot=act,
        requested=requested,
    )
