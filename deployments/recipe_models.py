"""An actor's model, built from its ``ModelRecipe`` where it runs (Ray-free, so a GPU image without Ray can test it)."""

from __future__ import annotations

from deployments.app_args import ModelRecipe, WorkerRole
from specserve.config import HeadSpec
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_draft, load_model
from specserve.models.tiny import noisy_copy, tiny_config, tiny_head, tiny_model
from specserve.spec_decode.eagle_head import EagleHead


def build_model(recipe: ModelRecipe, device: str) -> LlamaModel | EagleHead:
    if recipe.tiny is not None:
        tiny = recipe.tiny
        target = tiny_model(tiny_config(), seed=tiny.seed)
        if recipe.role == WorkerRole.target:
            return target.to(device)
        if tiny.draft_head:
            return tiny_head(target.to(device), seed=tiny.draft_seed)
        return noisy_copy(target, tiny.draft_noise, seed=tiny.draft_seed).to(device)
    assert recipe.spec is not None
    if isinstance(recipe.spec, HeadSpec):
        assert recipe.head_target is not None
        # the head needs its target's embedding and LM head weights only: no records for a decoder it never runs
        # nor for an LM head whose rows it reads directly
        head_target = recipe.head_target.model_copy(update={"q4_reads": False, "q8_head_reads": False})
        return load_draft(recipe.spec, load_model(head_target, device=device), device=device)
    return load_model(recipe.spec, device=device)
