"""The one place a StepLoop is wired: the in-process Engine and each Serve lane both call ``build_step_loop``."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from specserve.config import LoopConfig
from specserve.guard import ThroughputGuard
from specserve.limits import ContextLimits
from specserve.messages import FeatureRequest
from specserve.models.llama import LlamaModel
from specserve.policy.planner import SLPlanner
from specserve.policy.tree_floor import TreeFloor
from specserve.spec_decode.eagle_head import EagleHead
from specserve.spec_decode.model_free import ModelFreeDrafter
from specserve.spec_decode.suffix_tree import SuffixCache
from specserve.step_loop import StepLoop
from specserve.workers.base import DraftWorkerAPI, TargetWorkerAPI
from specserve.workers.draft import DraftWorker
from specserve.workers.head_draft import HeadDraftWorker


def eos_ids_of(config_eos: int | list[int] | None, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """The model's EOS id(s) (``LlamaModel.eos_token_ids``: config.json's and generation_config.json's) and the
    tokenizer's: generation stops at any of them."""
    ids = set(config_eos if isinstance(config_eos, list) else [] if config_eos is None else [config_eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def build_step_loop(
    target: TargetWorkerAPI,
    draft: DraftWorkerAPI | None,
    cfg: LoopConfig,
    limits: ContextLimits,
    tokenizer: PreTrainedTokenizerBase | None,
    eos: set[int],
    features: FeatureRequest | None = None,
    suffix_cache: SuffixCache | None = None,
) -> StepLoop:
    """``features``: the target hidden states the draft head reads (None for a draft model); ``suffix_cache``: the
    replica's cache of recent outputs, shared by its lanes (None: a new one of ``cfg.suffix_cache_tokens``)."""
    if suffix_cache is None:
        suffix_cache = new_suffix_cache(cfg)
    guard = ThroughputGuard(cfg.guard) if cfg.throughput_guard else None
    planner = SLPlanner(guard=guard, max_step_tokens=cfg.max_step_tokens, floor=TreeFloor())
    return StepLoop(
        target,
        draft,
        speculation=cfg.speculation,
        spec_headroom=limits.spec_headroom,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        max_batch_size=cfg.max_batch_size,
        max_model_len=limits.max_model_len,
        planner=planner,
        features=features,
        model_free=ModelFreeDrafter(suffix_cache),
    )


def new_suffix_cache(cfg: LoopConfig) -> SuffixCache:
    return SuffixCache(cfg.suffix_cache_tokens, cfg.speculation.model_free.suffix_depth)


def local_draft_worker(draft: LlamaModel | EagleHead, *, num_slots: int, max_len: int) -> DraftWorker | HeadDraftWorker:
    if isinstance(draft, EagleHead):
        return HeadDraftWorker(draft, num_slots=num_slots, max_len=max_len)
    return DraftWorker(draft, num_slots=num_slots, max_len=max_len)


def draft_geometry(draft: LlamaModel | EagleHead | None) -> tuple[int | None, int | None]:
    """(max positions, vocabulary) a draft constrains the context to (None, None without a draft)."""
    if draft is None:
        return None, None
    return draft.max_positions, draft.cfg.vocab_size
