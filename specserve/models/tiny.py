"""Tiny random-weight models built in-process (no files): for tests and system benchmarks."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from specserve.models.llama import LlamaModel
from specserve.spec_decode.eagle_head import EagleHead, EagleHeadConfig

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_config(model_type: str = "llama", **overrides: Any) -> PretrainedConfig:
    return AutoConfig.for_model(model_type, **{**TINY_DEFAULTS, **overrides})


def tiny_model(config: PretrainedConfig | None = None, *, seed: int = 0, init_std: float = 1.0) -> LlamaModel:
    """Random weights, large enough (std 1.0) that next-token distributions are peaked rather than uniform."""
    model = LlamaModel(config or tiny_config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 * 4)
    return model.eval()


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The inverse of ``LlamaModel.load_hf_state_dict``: HF-named, unfused tensors."""
    cfg = model.cfg
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm,
        "lm_head.weight": model.lm_head.weight,
    }
    for i, layer in enumerate(model.decoder_layers()):
        p, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        sd[p + "input_layernorm.weight"] = layer.input_norm
        sd[p + "post_attention_layernorm.weight"] = layer.post_norm
        for name, part in zip("qkv", layer.qkv.weight.split([q_size, kv_size, kv_size]), strict=True):
            sd[att + f"{name}_proj.weight"] = part
        if cfg.qkv_bias:
            for name, part in zip("qkv", layer.qkv.bias.split([q_size, kv_size, kv_size]), strict=True):
                sd[att + f"{name}_proj.bias"] = part
        sd[att + "o_proj.weight"] = layer.o_proj.weight
        if cfg.o_bias:
            sd[att + "o_proj.bias"] = layer.o_proj.bias
        gate, up = layer.gate_up.weight.chunk(2)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = layer.down.weight
        if cfg.mlp_bias:
            gb, ub = layer.gate_up.bias.chunk(2)
            sd[p + "mlp.gate_proj.bias"], sd[p + "mlp.up_proj.bias"] = gb, ub
            sd[p + "mlp.down_proj.bias"] = layer.down.bias
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def noisy_copy(model: LlamaModel, noise: float, *, seed: int = 1) -> LlamaModel:
    """A draft = the target plus Gaussian noise (relative to each weight's std): tunable acceptance."""
    draft = LlamaModel(model.hf_config)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return draft.eval()


def tiny_head(target: LlamaModel, *, seed: int = 1, std: float = 0.2) -> EagleHead:
    """A random-weight EAGLE-1/2 head bound to ``target`` (for tests of the head's plumbing, not its acceptance)."""
    head = EagleHead(EagleHeadConfig.for_target(target), target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return head.to(target.device).eval().requires_grad_(False)  # made on the host: on the target's device too
