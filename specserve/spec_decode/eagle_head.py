"""EAGLE draft heads: one decoder layer over the target's own features (docs/algorithms.md §8.3).

Two published layouts (read and written in their own tensor names by ``head_checkpoint.py``):

EAGLE-1/2 (``HeadKind.eagle``): for a token t at position j with feature f (the target's last hidden state
after its final norm at position j-1, or the head's own output there while drafting)
    x = fc([embed(t); f])                     fc: [H, 2H] (+ bias)
    h = x + attn(x)                           layer 0 has no input norm
    h = h + mlp(post_norm(h))
    logits = lm_head(h)                       the target's frozen embedding and LM head; h is the next feature
EAGLE-3 (``HeadKind.eagle3``): target features are three of its layers' outputs, fused first
    f = fc([h_low; h_mid; h_high])            fc: [H, 3H]; the head's own outputs skip it
    a = [input_norm(embed(t)); hidden_norm(f)]            [2H] into q/k/v
    h = f + attn(a);  h = h + mlp(post_norm(h))           h is the next feature (``norm_before_residual``:
                                                          hidden_norm(f) + attn(a), as the speculators' heads)
    logits = lm_head(norm(h))                 its own [V_d, H] head; draft id i is target id i + d2t[i]

A reduced draft vocabulary (FR-Spec) restricts an EAGLE-1/2 head's logits to the target ids in ``draft_ids``
(rows of the target's LM head); drafting stays lossless because the target verifies over the full vocabulary.
The head keeps its own one-layer KV cache (``new_cache``); pair j of that cache holds (token j+1, feature j)
at RoPE position j, so the row fed with the root predicts the first drafted token.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn
from transformers import LlamaConfig

from specserve.errors import UnsupportedModelError
from specserve.models.attention import attention, write_kv
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.models.llama import (
    LlamaModel,
    apply_rope,
    linear,
    rms_norm,
    rope_tables,
    small_gemm_fits,
    stack_forward,
)


class HeadKind(str, Enum):
    eagle = "eagle"  # EAGLE-1 / EAGLE-2 layout
    eagle3 = "eagle3"


class EagleHeadConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: HeadKind = HeadKind.eagle
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    rms_norm_eps: float = Field(default=1e-5, gt=0, lt=1, allow_inf_nan=False)  # (a huge eps zeroes every norm)
    vocab_size: int = Field(ge=2, description="the target's vocabulary")
    draft_vocab_size: int | None = Field(
        default=None, ge=1, description="reduced draft vocabulary (None = the target's)"
    )
    fc_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    aux_layers: tuple[int, ...] = Field(default=(), description="EAGLE-3: target layers whose inputs are fused")
    rope_theta: float = Field(default=10000.0, gt=0, allow_inf_nan=False)
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = Field(default=8192, ge=1)
    norm_before_residual: bool = Field(default=False, description="EAGLE-3: the residual is hidden_norm(f), not f")

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _normalise_rope(cls, value: Any) -> dict[str, Any] | None:
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"rope_scaling must be a mapping or null, got {type(value).__name__}")
        return rope_scaling_of({"rope_scaling": value})

    @model_validator(mode="after")
    def _consistent(self) -> EagleHeadConfig:
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads do not divide into {self.num_kv_heads} KV heads")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the {self.vocab_size}-token vocabulary")
        if len(set(self.aux_layers)) != len(self.aux_layers) or any(i < 0 for i in self.aux_layers):
            raise ValueError(f"aux layers must be distinct layer indices, got {list(self.aux_layers)}")
        if list(self.aux_layers) != sorted(self.aux_layers):  # the target hands their features over in layer order
            raise ValueError(f"aux layers must be in ascending order, got {list(self.aux_layers)}")
        if self.norm_before_residual and self.kind != HeadKind.eagle3:
            raise ValueError("norm_before_residual is an EAGLE-3 option (an EAGLE-1/2 head has no hidden_norm)")
        return self

    @property
    def feature_size(self) -> int:
        """Width of the target features the head takes: H, or 3H for EAGLE-3 (before its fc)."""
        return self.hidden_size * max(1, len(self.aux_layers)) if self.kind == HeadKind.eagle3 else self.hidden_size

    def llama_config(self) -> LlamaConfig:
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return LlamaConfig(
            rope_parameters=rope,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
        )

    @staticmethod
    def for_target(target: LlamaModel, **overrides: Any) -> EagleHeadConfig:
        """A head shaped like one of the target's layers (the EAGLE-1/2 recipe)."""
        cfg, hf = target.cfg, target.hf_config
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        scaling = {"rope_scaling": getattr(hf, "rope_scaling", None), "rope_parameters": rope}
        fields: dict[str, Any] = {
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps,
            "vocab_size": cfg.vocab_size,
            "rope_theta": float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            "rope_scaling": rope_scaling_of(scaling),
            "max_position_embeddings": cfg.max_position_embeddings,
        }
        return EagleHeadConfig(**(fields | overrides))


def rope_scaling_of(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A config's RoPE scaling as ``rope_type`` plus its parameters, or None for plain RoPE: from ``rope_scaling``
    (the legacy key ``type`` too) or transformers 5's ``rope_parameters``."""
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    params.pop("rope_theta", None)
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    return params if params.get("rope_type", "default") != "default" else None


class HeadLayer(nn.Module):
    """The head's one decoder layer; q/k/v read ``in_size`` inputs (H, or 2H for EAGLE-3)."""

    def __init__(self, cfg: EagleHeadConfig, in_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(in_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def qkv_split(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """a [N, in] -> q [N, H_q, D], k [N, H_kv, D], v [N, H_kv, D] (before RoPE)."""
        cfg = self.cfg
        n = a.shape[0]
        q, k, v = linear(self.qkv, a).split(
            [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim], dim=-1
        )
        return (
            q.view(n, cfg.num_heads, cfg.head_dim),
            k.view(n, cfg.num_kv_heads, cfg.head_dim),
            v.view(n, cfg.num_kv_heads, cfg.head_dim),
        )

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """residual [N, H] + o_proj(attention) [N, H_q*D], then the MLP block."""
        h = residual + linear(self.o_proj, attn_out)
        gate, up = linear(self.gate_up, rms_norm(h, self.post_norm, self.cfg.rms_norm_eps)).chunk(2, dim=-1)
        return h + linear(self.down, F.silu(gate) * up)


class EagleHead(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    draft_ids: torch.Tensor  # [V_d] target id of each draft-vocabulary row (arange(V) for the full vocabulary)

    def __init__(self, cfg: EagleHeadConfig, target: LlamaModel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        eagle3 = cfg.kind == HeadKind.eagle3
        self.fc = nn.Linear(cfg.feature_size if eagle3 else 2 * h, h, bias=cfg.fc_bias)
        self.layer = HeadLayer(cfg, 2 * h if eagle3 else h)
        v_d = cfg.draft_vocab_size or cfg.vocab_size
        if eagle3:
            self.input_norm = nn.Parameter(torch.ones(h))
            self.hidden_norm = nn.Parameter(torch.ones(h))
            self.norm = nn.Parameter(torch.ones(h))
            self.lm_head = nn.Linear(h, v_d, bias=False)
        self.register_buffer("draft_ids", torch.arange(v_d), persistent=False)
        cos, sin = rope_tables(cfg.llama_config(), cfg.head_dim, min(cfg.max_position_embeddings, 1 << 16))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.embed_weight: torch.Tensor | None = None  # the embedding drafted with, frozen (bound, never saved)
        self.target_lm_head: torch.Tensor | None = None  # EAGLE-1/2: the target's LM head rows of draft_ids
        # where the checkpoint carries its own copies of the target's embedding or (EAGLE-1/2) LM head that are not
        # the target's, they are bound instead (head_checkpoint.own_copy)
        self.own_embed: torch.Tensor | None = None
        self.own_lm_head: torch.Tensor | None = None
        self._target_lm_full: torch.Tensor | None = None
        self.trained_for: str | None = None  # the target a specserve-trained head was distilled from
        self.small_gemm: Any = None  # the small-product kernel for the LM-head slice (native_stack.attach_small_gemm)
        self.small_rows = 0
        self.native_stack: Any = None  # the layer from C++, for drafting (native_stack.attach_head_stack)
        self.native_norm: Any = None  # with it, the stack's fused norm
        if target is not None:
            self.bind(target)

    # -- the target's shared pieces ----------------------------------------------------------------------
    def bind(self, target: LlamaModel) -> None:
        """Share the target's embedding (and, for EAGLE-1/2, its LM head rows of the draft vocabulary), or bind the
        head's own copies of them."""
        check_compatible(self.cfg, target)
        if target.max_positions != self.max_positions:
            # the head drafts at the target's positions, whatever its own config's max_position_embeddings says
            cos, sin = rope_tables(self.cfg.llama_config(), self.cfg.head_dim, target.max_positions)
            like = self.rope_cos
            self.rope_cos, self.rope_sin = cos.to(like), sin.to(like)
        own_embed, own_lm = self.own_embed, self.own_lm_head
        self.embed_weight = target.embed_tokens.weight.detach() if own_embed is None else own_embed.to(self.device)
        if self.cfg.kind == HeadKind.eagle:
            self._target_lm_full = dense_weight(target.lm_head) if own_lm is None else own_lm.to(self.device)
            self._slice_lm_head()

    def _slice_lm_head(self) -> None:
        w = self._target_lm_full
        if w is None:
            return
        ids = self.draft_ids.to(w.device)
        whole = ids.numel() == w.shape[0] and bool((ids == torch.arange(w.shape[0], device=w.device)).all())
        if whole and w.dtype == self.fc.weight.dtype and w.is_contiguous():  # the target's own rows: no copy of them
            self.target_lm_head = w
        else:
            self.target_lm_head = w[ids].to(self.fc.weight.dtype).contiguous()

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """Restrict an EAGLE-1/2 head's logits to these target ids ([V_d] long, ascending)."""
        if self.cfg.kind != HeadKind.eagle:
            raise ValueError("an EAGLE-3 head's draft vocabulary is fixed by its own lm_head and d2t")
        if not valid_draft_ids(draft_ids, self.cfg.vocab_size):
            raise ValueError(f"draft ids must be a 1-D tensor of distinct target ids in [0, {self.cfg.vocab_size})")
        self.draft_ids = draft_ids.to(self.device, torch.long)  # (a loaded head is already on its device)
        self.cfg = self.cfg.model_copy(update={"draft_vocab_size": int(draft_ids.numel())})
        self._slice_lm_head()

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def max_positions(self) -> int:
        return int(self.rope_cos.shape[0])

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def maps_draft_ids(self) -> bool:
        """Whether some draft column c is not target id c: a reduced vocabulary, or a full one in another order."""
        ids = self.draft_ids
        return ids.numel() != self.cfg.vocab_size or not torch.equal(ids.cpu(), torch.arange(ids.numel()))

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache(
            num_layers=1,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            num_slots=num_slots,
            max_len=min(max_len, self.rope_cos.shape[0]),
            dtype=self.fc.weight.dtype,
            device=self.device,
        )

    # -- forward ---------------------------------------------------------------------------------------
    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features [N, feature_size] -> the head's feature space [N, H] (EAGLE-3's fc; else as is)."""
        x = target_features.to(self.fc.weight.dtype)
        return linear(self.fc, x) if self.cfg.kind == HeadKind.eagle3 else x

    def layer_input(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [N, in], residual [N, H]) for tokens [N] and head-space features [N, H]."""
        if self.embed_weight is None:
            raise RuntimeError("the head is not bound to a target: call bind(target) first")
        e = F.embedding(tokens, self.embed_weight).to(features.dtype)
        if self.cfg.kind == HeadKind.eagle3:
            f = self._norm(features, self.hidden_norm)
            a = torch.cat([self._norm(e, self.input_norm), f], dim=-1)
            return a, f if self.cfg.norm_before_residual else features
        x = linear(self.fc, torch.cat([e, features], dim=-1))
        return x, x

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, features: torch.Tensor, batch: ForwardBatch, cache: KVCache
    ) -> torch.Tensor:
        """Append (token, feature) pairs to the head's cache; their outputs [N, H] (the next features).

        tokens [N] and features [N, H] in the batch's packed order; positions and masks come from ``batch``.
        """
        a, residual = self.layer_input(tokens, features)
        cos = self.rope_cos[batch.positions].to(a.dtype).unsqueeze(1)  # [N, 1, D]
        sin = self.rope_sin[batch.positions].to(a.dtype).unsqueeze(1)
        if self.native_stack is not None:  # switch: the same layer from C++ (native_stack.attach_head_stack)
            return stack_forward(self.native_stack, residual.contiguous(), cos, sin, batch, cache, [], a)[0]
        q, k, v = self.layer.qkv_split(a)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(cache.k[0], cache.v[0], k, v, batch)
        out = attention(q, cache.k[0], cache.v[0], batch, use_flash=False)  # [N, H_q, D]
        return self.layer.finish(residual, out.reshape(out.shape[0], -1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, V_d] over the draft vocabulary; ``draft_ids`` maps a column to its target id."""
        if self.cfg.kind == HeadKind.eagle3:
            return linear(self.lm_head, self._norm(hidden, self.norm)).float()
        if self.target_lm_head is None:
            raise RuntimeError("the head is not bound to a target: call bind(target) first")
        kernel = self.small_gemm  # switch: native_stack.attach_small_gemm
        if kernel is not None and small_gemm_fits(hidden, self.target_lm_head, self.small_rows):
            return kernel(hidden, self.target_lm_head, None)
        return (hidden @ self.target_lm_head.t()).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rms_norm(x) * weight: the C++ stack's fused norm where attached (drafting, no autograd; the same values
        to float rounding), else the target's."""
        if self.native_norm is not None and not torch.is_grad_enabled() and x.dim() == 2:
            return self.native_norm(x.contiguous(), weight, self.cfg.rms_norm_eps)
        return rms_norm(x, weight, self.cfg.rms_norm_eps)


AUX_INPUTS_MARKER = "specserve_aux_ids_are_layer_inputs"  # in configs this project writes


def aux_layer_inputs(ids: list[int], marked: bool) -> tuple[int, ...]:
    """The decoder layers whose inputs a published EAGLE-3 config's ``eagle_aux_hidden_state_layer_ids`` name.

    Checkpoints ship two conventions (docs/algorithms.md §8.3): layer inputs (vLLM's reading; EAGLE-3's default
    (2, L/2, L-3) is one) and layer outputs (SpecForge's, whose default list starts at 1, the first block's output,
    i.e. the input of layer 2). SGLang reads every list as outputs, vLLM as inputs; here a list that starts at 1 is
    read as outputs, any other as inputs, unless this project wrote it (``marked``): no EAGLE-3 recipe fuses the
    embedding block's output as its low feature."""
    if marked or not ids or ids[0] != 1:
        return tuple(ids)
    return tuple(i + 1 for i in ids)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high feature layers of a ``num_layers``-layer target: (2, L/2, L-3) from 7 layers
    on; below that, where those coincide, the first, middle and last layer; every layer of a target with fewer than
    three."""
    if num_layers >= 7:
        return (2, num_layers // 2, num_layers - 3)
    if num_layers >= 3:
        return (0, num_layers // 2, num_layers - 1)
    return tuple(range(num_layers))


def dense_weight(mod: nn.Module) -> torch.Tensor:
    w: Any = mod.weight
    return w().dequantize() if callable(w) else w.detach()  # a dynamic-int8 linear keeps a packed weight


def check_compatible(cfg: EagleHeadConfig, target: LlamaModel) -> None:
    t = target.cfg
    if cfg.vocab_size != t.vocab_size:
        raise UnsupportedModelError(f"the head's vocabulary has {cfg.vocab_size} tokens; the target's {t.vocab_size}")
    if cfg.kind == HeadKind.eagle and cfg.hidden_size != t.hidden_size:
        raise UnsupportedModelError(f"the head's hidden size is {cfg.hidden_size}; the target's is {t.hidden_size}")
    if cfg.kind == HeadKind.eagle3:
        if cfg.feature_size != t.hidden_size * len(cfg.aux_layers):
            raise UnsupportedModelError(
                f"the head fuses {cfg.feature_size} feature channels; the target gives {t.hidden_size} per layer "
                f"x {len(cfg.aux_layers)} layers"
            )
        bad = [i for i in cfg.aux_layers if not 0 <= i < t.num_layers]
        if bad:
            raise UnsupportedModelError(
                f"aux layers {bad} (as layer inputs) do not exist in the {t.num_layers}-layer target; the output of "
                "its last layer is not one of the features this target hands over"
            )


def valid_draft_ids(ids: torch.Tensor, vocab_size: int) -> bool:
    """Whether ``ids`` is a non-empty 1-D integer tensor of distinct target ids in [0, vocab_size): a repeated id
    would give its token two rows of the head's distribution, which the sampled chains' q(x) cannot express."""
    if ids.ndim != 1 or not ids.numel() or ids.is_floating_point() or ids.dtype == torch.bool:
        return False
    return int(ids.min()) >= 0 and int(ids.max()) < vocab_size and int(ids.unique().numel()) == ids.numel()
