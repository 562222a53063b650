"""Llama-family forward pass built for serving (Llama, Mistral, Qwen2, SmolLM).

RMSNorm, RoPE (incl. the HF ``rope_scaling`` variants), GQA, SwiGLU, tied embeddings. One call runs a ragged
batch (``ForwardBatch``) against per-sequence KV slots, with causal or tree masks. Q/K/V and gate/up are
fused into single matmuls at load time.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specserve.errors import UnsupportedModelError
from specserve.models.attention import AttendKernel, attention, flash_attn_available, write_kv
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.timing import interleaved_medians

logger = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# the biases of the types whose flags transformers ignores (Llama reads attention_bias and mlp_bias)
MODEL_TYPE_BIASES = {"mistral": "no biases", "qwen2": "biases on q, k and v only"}
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # a decoder layer's matmuls, fused as loaded
GEMV_MAX_ROWS = 3  # at most this many rows take the transposed-copy path (``linear``, ``gemv_rows_for``)
PAD_WIDTH = 16  # products of ``mod.pad_from`` .. PAD_WIDTH - 1 rows run padded to this many (``pad_rows_for``)
ELEMENTWISE_GRAIN = 32768  # ATen's GRAIN_SIZE: a CPU elementwise op of this many elements or more is split
# positions a model serves at most: its RoPE tables are built for every one up front (128k positions of head_dim 128
# are 128 MiB; a 1M-context config's would be 1 GiB, and a malformed one's 2**26 several GiB before any check)
MAX_POSITIONS = 1 << 17


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @staticmethod
    def from_hf(config: PretrainedConfig) -> ArchConfig:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; this runner implements {SUPPORTED_MODEL_TYPES}"
            )
        if config.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported (SwiGLU needs 'silu')")
        eps = config.rms_norm_eps
        if not (isinstance(eps, numbers.Real) and 0 < float(eps) < 1):  # (NaN fails both; at or below 0: NaN logits)
            raise UnsupportedModelError(f"rms_norm_eps {eps!r} is not a number between 0 and 1")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # the biases as transformers builds each type: Llama reads both flags, Mistral has none, Qwen2 q/k/v only
        # (a flag those two ignore made a checkpoint they load "miss" a bias tensor here)
        attention_bias = model_type == "llama" and bool(getattr(config, "attention_bias", False))
        mlp_bias = model_type == "llama" and bool(getattr(config, "mlp_bias", False))
        max_pos = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        # Mistral slides whenever it has a window (transformers reads no switch there); Qwen2 in the layers its
        # layer_types name sliding (its config derives them from use_sliding_window and max_window_layers); Llama never
        sliding = model_type == "mistral" or (
            model_type == "qwen2" and "sliding_attention" in (getattr(config, "layer_types", None) or ())
        )
        if window and sliding:
            max_pos = min(max_pos, window)  # within the window sliding attention equals full attention
        if max_pos < 2:  # (a prompt's one token and one to generate)
            named = "sliding_window" if max_pos != config.max_position_embeddings else "max_position_embeddings"
            raise UnsupportedModelError(f"{named} {max_pos} leaves no room for a prompt and its answer (at least 2)")
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        return ArchConfig(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            max_position_embeddings=max_pos,
        )


def rope_tables(config: PretrainedConfig, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] (HF rotate-half layout, attention scaling folded in)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    try:
        theta = float(base) if isinstance(base, numbers.Real) and not isinstance(base, bool) else math.nan
    except OverflowError:  # an integer past float's range
        theta = math.inf
    if not math.isfinite(theta) or theta <= 0:  # such a base gives infinite or NaN angles: every logit NaN
        raise UnsupportedModelError(f"rope_theta must be a finite number above 0, got {base!r}")
    factor = params.get("factor", 1.0)
    try:
        scale = float(factor) if isinstance(factor, numbers.Real) and not isinstance(factor, bool) else math.nan
    except OverflowError:
        scale = math.inf
    if not 0 < scale < math.inf:  # factor 0 gave NaN tables, a negative one turned positions backwards
        raise UnsupportedModelError(f"the RoPE scaling factor must be a finite number above 0, got {factor!r}")
    if rope_type in ("dynamic", "longrope"):  # one table for every position cannot hold them
        raise UnsupportedModelError(f"rope_type {rope_type!r} changes RoPE with the sequence length; not supported")
    if rope_type == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    else:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported")
    if inv_freq.numel() * 2 != head_dim:  # transformers' scaled rope types honour partial_rotary_factor
        raise UnsupportedModelError(
            f"RoPE over {inv_freq.numel() * 2} of the {head_dim} dimensions of a head (partial_rotary_factor "
            f"{params.get('partial_rotary_factor', getattr(config, 'partial_rotary_factor', None))!r}) is not supported"
        )
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D], cos/sin [N, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def linear(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)``; products of at most ``mod.small_rows`` rows through the batch-invariant kernel where attached;
    with at most ``mod.gemv_rows`` rows and a transposed weight copy attached
    (``attach_gemv_copies``), a row-major product over that copy instead: on some CPUs it reads the weights
    1.3-1.4x faster at 1-3 rows (a 2-core AMD EPYC), on others only at 1 row (an AMX Xeon): measured at load."""
    int8 = getattr(mod, "int8_records", None)  # switch: native_stack.attach_int8_reads, every row count
    if int8 is not None and x.dtype == torch.float32:
        return mod.int8_gemm(x.reshape(-1, x.shape[-1]), int8, mod.bias).reshape(*x.shape[:-1], -1)  # type: ignore[operator]
    small = getattr(mod, "small_gemm", None)  # switch: native_stack.attach_small_gemm
    most = getattr(mod, "small_rows", 0)
    chunked = small is not None and x.dim() == 2 and 0 < most < x.shape[0] <= getattr(mod, "small_chunks", 0)
    if chunked and small_gemm_fits(x[:most], mod.weight, most):
        # more rows than one product takes (a large verify, a short prefill): products of `most` rows, so that
        # every row gets the bits it gets decoded alone, whatever else the forward holds
        return torch.cat([linear(mod, part) for part in x.split(most)])
    if small is not None and small_gemm_fits(x, mod.weight, most):
        rows = x.shape[0]
        plan = getattr(mod, "small_prefetch", None)  # the kernel's prefetch per row count, measured at load
        prefetch = None if plan is None else plan[rows - 1]
        records = getattr(mod, "small_records", None)  # the weight as Q4_1 / Q8_0 records (native_stack), if any
        if records is not None and reads_copy(getattr(mod, "small_record_rows", 0), rows):
            return mod.small_records_gemm(x, records, mod.bias, prefetch)  # type: ignore[operator]
        own = getattr(mod, "small_packed", None)  # the kernel's own copy of the weight (packed, or bf16), if any
        read_own: Any = getattr(mod, "small_copy_gemm", None)  # the kernel's entry for that copy
        if own is not None and reads_copy(getattr(mod, "small_copy_rows", 0), rows):
            return read_own(x, own, mod.bias, prefetch)
        return small(x, mod.weight, mod.bias, prefetch)
    wt: torch.Tensor | None = getattr(mod, "weight_t", None)
    if wt is not None and x.numel() <= getattr(mod, "gemv_rows", GEMV_MAX_ROWS) * wt.shape[0]:
        y = x @ wt
        return y if mod.bias is None else y + mod.bias
    packed: tuple[tuple[int, int, torch.Tensor], ...] = getattr(mod, "mkl_packed", ())
    rows = x.shape[0]
    for low, width, weight in packed:  # MKL's packed sgemm for the row counts it was packed for (zero rows pad)
        if low <= rows <= width:
            return torch.ops.mkl._mkl_linear(pad_rows(x, width), weight, mod.weight, mod.bias, width)[:rows]
    pad_from: int = getattr(mod, "pad_from", 0)
    if 0 < pad_from <= rows < PAD_WIDTH:  # zero rows change no real row; MKL's kernel for 16 rows is the faster
        return mod(pad_rows(x, PAD_WIDTH))[:rows]
    return mod(x)


def reads_copy(row_mask: int, rows: int) -> bool:
    """Whether a product of ``rows`` rows reads the kernel's own copy: bit r - 1 of ``row_mask`` (rows 1..64)."""
    return bool(row_mask >> (rows - 1) & 1)


def small_gemm_fits(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Whether the small-product kernel takes x [R, K] @ weight.T: 1..rows float32 CPU rows, a contiguous weight, no
    autograd (the kernel has no backward)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= rows or x.device.type != "cpu" or not weight.is_contiguous():
        return False
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return x.dtype == weight.dtype == torch.float32 and not grad


def stack_forward(
    stack: Any,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch: ForwardBatch,
    cache: KVCache,
    aux_layers: list[int],
    first_input: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """One forward of a C++ ``DecoderStack`` (native_stack) over a ragged batch: [last layer's output, the inputs of
    ``aux_layers``...]; ``first_input``: the first layer's attention input, given instead of its normed residual."""
    first, end = batch.slot_range if batch.slot_range is not None else (-1, -1)
    return stack.forward(
        x, cos, sin, cache.k, cache.v, batch.write_slot, batch.write_pos, batch.write_from, batch.attn_mask,
        batch.slots, first, end, len(batch.num_new), max(batch.num_new), batch.kv_len, aux_layers, first_input,
    )  # fmt: skip


def pad_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """[R, K] -> [width, K] with zero rows after x's (x itself when it has width rows)."""
    return x if x.shape[0] == width else torch.cat([x, x.new_zeros(width - x.shape[0], x.shape[1])])


def gemv_rows_for(weight: torch.Tensor, max_rows: int = GEMV_MAX_ROWS, repeats: int = 15) -> int:
    """The most rows r (0..max_rows) such that ``x @ W.T-copy`` beat ``F.linear(x, W)`` at every 1..r rows on
    this machine (median of ``repeats`` timings, 5% margin): the instruction set decides, so measure."""
    wt = weight.detach().t().contiguous()
    best = 0
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)

            def by_copy(x: torch.Tensor = x) -> torch.Tensor:
                return x @ wt

            def by_linear(x: torch.Tensor = x) -> torch.Tensor:
                return F.linear(x, weight)

            three = [lambda: [by_copy() for _ in range(3)], lambda: [by_linear() for _ in range(3)]]
            copy, plain = interleaved_medians(three, repeats)  # three calls a timing: one is a few microseconds
            if copy > 0.95 * plain:
                break
            best = rows
    return best


def pad_rows_for(weights: list[torch.Tensor], width: int = PAD_WIDTH, repeats: int = 3) -> int:
    """The fewest rows r among 15, 12, 10 (below ``width``) such that padding with zero rows to ``width`` beat the
    unpadded products at r and at every larger candidate, timed over all ``weights`` in one pass (a model's
    weights together, as a step reads them: one weight timed alone would sit in cache); median of ``repeats``,
    5% margin; 0: none. On the AMX Xeon SmolLM2's matmuls took 72.5 ms at 13 rows and 50.1 at 16 (docs/benchmarks.md,
    "Row padding to 16")."""

    def products(rows: int, padded: bool) -> Callable[[], None]:
        ref = weights[0]
        xs = {k: torch.randn(rows, k, dtype=ref.dtype, device=ref.device) for k in {w.shape[1] for w in weights}}

        def run() -> None:
            for w in weights:
                x = xs[w.shape[1]]
                F.linear(pad_rows(x, width), w)[:rows] if padded else F.linear(x, w)

        return run

    best = 0
    with torch.inference_mode():
        for rows in (r for r in (15, 12, 10) if r < width):
            padded, unpadded = interleaved_medians([products(rows, True), products(rows, False)], repeats)
            if padded > 0.95 * unpadded:
                break
            best = rows
    return best


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:  # one fused op (the same values: normalise, then scale)
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up [N, I], each row's values whatever rows share the forward. On a CPU, ATen splits an
    elementwise op past ``ELEMENTWISE_GRAIN`` elements between threads at element counts, and a split inside a row
    moved some of its elements between its vectorised exp and its scalar one, which round differently: a row's
    hidden state then depended on the batch (plain decoding's, alone, differed by an ulp from a verify's; with 16
    threads or an intermediate size off a multiple of 16). Rows go in groups below the grain (each on one thread,
    every row's elements in the same vector blocks), one op each; the C++ stack does the same."""
    if gate.device.type != "cpu" or gate.numel() < ELEMENTWISE_GRAIN:
        return F.silu(gate) * up
    rows = max(1, (ELEMENTWISE_GRAIN - 1) // gate.shape[-1])
    return torch.cat([F.silu(g) * u for g, u in zip(gate.split(rows), up.split(rows), strict=True)])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size, device=device))
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias, device=device)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias, device=device)
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size, device=device))
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, device=device)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, device=device)

    def swap_projections(self, **mods: nn.Module) -> None:
        """Other implementations of the projections (``qkv``, ``o_proj``, ``gate_up``, ``down``) with the same call:
        e.g. packed 4-bit weights (``specserve.models.q4.Q4Linear``)."""
        for name, mod in mods.items():
            if name not in PROJECTIONS:
                raise ValueError(f"{name!r} is not one of the projections {PROJECTIONS}")
            self.add_module(name, mod)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden] packed new tokens
        cos: torch.Tensor,  # [N, 1, D]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [S, H_kv, L, D]
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        use_flash: bool,
        kernel: AttendKernel | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        n_tok = x.shape[0]
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = linear(self.qkv, h)  # [N, (H_q + 2 H_kv) D]
        qk_size = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
        # RoPE once over q and k together (half the small ops; elementwise, so the same values)
        qk = apply_rope(qkv[:, :qk_size].view(n_tok, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        write_kv(k_cache, v_cache, k, qkv[:, qk_size:].view(n_tok, cfg.num_kv_heads, cfg.head_dim), batch)
        out = attention(q, k_cache, v_cache, batch, use_flash=use_flash, kernel=kernel)  # [N, H, D]
        x = x + linear(self.o_proj, out.reshape(n_tok, -1))
        gate, up = linear(self.gate_up, rms_norm(x, self.post_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
        return x + linear(self.down, silu_mul(gate, up))


def token_id_set(value: object) -> frozenset[int]:
    """A config's ``eos_token_id``: one id, a list of them, or none."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise UnsupportedModelError(f"eos_token_id must be a token id or a list of them, got {str(value)[:80]}")
    return frozenset(values)


class LlamaModel(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(
        self, hf_config: PretrainedConfig, *, max_positions: int | None = None, device: torch.device | str | None = None
    ) -> None:
        """``device="meta"`` allocates no weights (``from_hf_weights`` then assigns the loaded ones); the RoPE
        tables are always made on the CPU."""
        super().__init__()
        self.hf_config = hf_config
        self.cfg = cfg = ArchConfig.from_hf(hf_config)
        # the ids generation stops at (with the tokenizer's EOS): the loader adds generation_config.json's
        self.eos_token_ids = token_id_set(hf_config.eos_token_id)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, device=device))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_positions = min(max_positions or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if cfg.max_position_embeddings < hf_config.max_position_embeddings:  # said once, at load, with its reason
            logger.warning(
                "sliding_window %d is below max_position_embeddings %d: the model is served up to %d positions, "
                "where its sliding attention equals full attention",
                cfg.max_position_embeddings,
                hf_config.max_position_embeddings,
                cfg.max_position_embeddings,
            )
        if self.max_positions > MAX_POSITIONS:
            logger.warning(
                "the model's %d positions are served up to %d (MAX_POSITIONS: RoPE tables are built for each)",
                self.max_positions,
                MAX_POSITIONS,
            )
            self.max_positions = MAX_POSITIONS
        cos, sin = rope_tables(hf_config, cfg.head_dim, self.max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.use_flash_attn = True  # switch: flash-attn varlen for causal batches on CUDA when installed
        self.native_stack: Any = None  # switch: the decoder layers from C++ (``native_stack.attach_native_stack``)
        # switch: float32 attention from C++ (``native_stack.attach_native_attention``), in both layer loops
        self.attention_kernel: AttendKernel | None = None
        self.bounded_argmax: Any = None  # switch: greedy steps read a bf16 copy of the LM head (lm_head.py)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def new_cache(self, num_slots: int, max_len: int | None = None) -> KVCache:
        cfg = self.cfg
        return KVCache(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            num_slots=num_slots,
            max_len=min(max_len or self.max_positions, self.max_positions),
            dtype=self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Append the batch's tokens to the cache; return float32 logits [R, V] for ``batch.logit_rows``."""
        return self.logits(self.final_hidden(batch, cache)[batch.logit_rows])

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Append the batch's tokens to the cache; the last hidden state after the final norm, [N, hidden] for
        every new token (packed order): the feature an EAGLE-1/2 head drafts from."""
        return self.hidden_states(batch, cache)[0]

    @torch.inference_mode()
    def hidden_states(
        self, batch: ForwardBatch, cache: KVCache, aux_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final-norm hidden [N, hidden], the inputs of decoder layers ``aux_layers`` concatenated
        [N, len(aux_layers) * hidden], or None without aux layers): EAGLE-3 fuses the latter."""
        x = self.embed_tokens(batch.tokens)  # [N, hidden]
        cos = self.rope_cos[batch.positions].to(x.dtype).unsqueeze(1)  # [N, 1, D]
        sin = self.rope_sin[batch.positions].to(x.dtype).unsqueeze(1)
        use_flash = self.use_flash_attn and flash_attn_available(x.device, x.dtype)
        aux: list[torch.Tensor] = []
        if self.native_stack is not None and not use_flash:
            x, aux = self._native_layers(x, cos, sin, batch, cache, aux_layers)
            return self.native_stack.final_norm(x, self.norm), torch.cat(aux, dim=-1) if aux else None
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, cache.k, cache.v, strict=True)):
            if i in aux_layers:
                aux.append(x)
            x = layer(x, cos, sin, k_cache, v_cache, batch, use_flash, self.attention_kernel)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps), torch.cat(aux, dim=-1) if aux else None

    def _native_layers(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,  # [N, 1, D]
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        aux_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layer loop above, in C++: (last layer's output, the inputs of ``aux_layers`` in layer order)."""
        out = stack_forward(self.native_stack, x, cos, sin, batch, cache, sorted(set(aux_layers)))
        return out[0], out[1:]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, V] from final-norm hidden states [R, hidden]."""
        return linear(self.lm_head, hidden).float()

    # -- weights ----------------------------------------------------------------------------------------
    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights (``model.layers.N.self_attn.q_proj.weight`` ...) into this model, fusing q/k/v
        and gate/up."""

        def get(name: str) -> torch.Tensor:
            if name not in sd:
                raise UnsupportedModelError(f"checkpoint is missing tensor {name!r}")
            return sd[name]

        params = dict(self.named_parameters())  # a tied lm_head is listed once, as embed_tokens.weight
        with torch.no_grad():
            for name, tensor in fused_weights(self.cfg, get):
                params[name].copy_(tensor)

    @classmethod
    def from_hf_weights(
        cls,
        hf_config: PretrainedConfig,
        get: Callable[[str], torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_positions: int | None = None,
    ) -> LlamaModel:
        """A model whose weights are exactly the tensors ``get(hf_name)`` returns, fused: built on the meta
        device, so no full-size copy exists anywhere else. ``get`` should return each tensor already in
        ``dtype`` on ``device`` (loading then holds one checkpoint tensor at a time besides the model)."""
        model = cls(hf_config, max_positions=max_positions, device="meta")
        state = dict(fused_weights(model.cfg, get))
        if model.cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        if model.cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.rope_cos = model.rope_cos.to(device=device, dtype=dtype)  # as ``.to(device, dtype)`` would
        model.rope_sin = model.rope_sin.to(device=device, dtype=dtype)
        return model.eval()


def fused_weights(cfg: ArchConfig, get: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(this model's parameter name, tensor) for every weight, from HF-named tensors: q/k/v and gate/up fused
    (each fused tensor is made right after its parts are read, so only one layer's parts are alive at once)."""
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    rows = {"q": q_rows, "k": kv_rows, "v": kv_rows, "gate": cfg.intermediate_size, "up": cfg.intermediate_size}

    def fused(names: dict[str, str]) -> torch.Tensor:
        """Each part checked before the parts are joined (a joined tensor hides q and k sized the other's way)."""
        parts = []
        for part, name in names.items():
            tensor = get(name)
            if tensor.shape[0] != rows[part]:
                raise ValueError(f"{name} has {tensor.shape[0]} rows; the config implies {rows[part]}")
            parts.append(tensor)
        return torch.cat(parts)

    yield "embed_tokens.weight", get("model.embed_tokens.weight")
    yield "norm", get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", get("lm_head.weight")
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        att = hf + "self_attn."
        yield ours + "input_norm", get(hf + "input_layernorm.weight")
        yield ours + "post_norm", get(hf + "post_attention_layernorm.weight")
        yield ours + "qkv.weight", fused({n: att + f"{n}_proj.weight" for n in "qkv"})
        if cfg.qkv_bias:
            yield ours + "qkv.bias", fused({n: att + f"{n}_proj.bias" for n in "qkv"})
        yield ours + "o_proj.weight", get(att + "o_proj.weight")
        if cfg.o_bias:
            yield ours + "o_proj.bias", get(att + "o_proj.bias")
        yield ours + "gate_up.weight", fused({n: hf + f"mlp.{n}_proj.weight" for n in ("gate", "up")})
        yield ours + "down.weight", get(hf + "mlp.down_proj.weight")
        if cfg.mlp_bias:
            yield ours + "gate_up.bias", fused({n: hf + f"mlp.{n}_proj.bias" for n in ("gate", "up")})
            yield ours + "down.bias", get(hf + "mlp.down_proj.bias")


def drop_native_stack(model: LlamaModel) -> None:
    """A C++ layer stack was built over the projections' paths as they were: after a switch changes them the model
    runs the Python loop until ``native_stack.attach_native_stack`` builds it again (never a stale stack)."""
    model.native_stack = None


def attach_gemv_copies(model: LlamaModel, rows: int | None = None) -> int:
    """Switch: keep a transposed copy of every linear weight for GEMVs of up to ``rows`` rows (CPU decode and
    short verifies); ``rows=None`` measures the threshold on this machine per weight shape (``gemv_rows_for``),
    and 0 attaches nothing. Up to 2x weight memory; call after the final ``.to(dtype, device)``. Quantised
    linears are skipped. Returns the largest threshold used.
    """
    linears = [mod for mod in model.modules() if type(mod) is nn.Linear]
    by_shape: dict[tuple[int, ...], int] = {}  # one measurement per weight shape (qkv, o, gate_up, down, lm_head)
    for mod in linears:
        shape = tuple(mod.weight.shape)
        if shape not in by_shape:
            by_shape[shape] = gemv_rows_for(mod.weight) if rows is None else rows
        mod_rows = by_shape[shape]
        if mod_rows > 0:
            mod.weight_t = mod.weight.detach().t().contiguous()  # type: ignore[assignment]
        mod.gemv_rows = mod_rows  # type: ignore[assignment]
    drop_native_stack(model)
    return max(by_shape.values(), default=0)


def attach_row_padding(model: LlamaModel, pad_from: int | None = None) -> int:
    """Switch: products of ``pad_from`` .. PAD_WIDTH - 1 rows (verifies of 10-15 tokens, batches of 10-15) run
    padded with zero rows to PAD_WIDTH, where the BLAS kernel for 16 rows is faster than those for fewer.
    ``None`` measures the threshold on this machine over the model's own weights (``pad_rows_for``); 0 attaches
    nothing. Float linears on the CPU only. Returns the threshold used."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.is_floating_point()]
    if model.device.type != "cpu" or not linears:
        return 0
    if pad_from is None:
        unique = {id(m.weight): m.weight.detach() for m in linears}  # a tied LM head is timed once
        pad_from = pad_rows_for(list(unique.values()))
    for mod in linears:
        mod.pad_from = pad_from  # type: ignore[assignment]
    drop_native_stack(model)
    return pad_from


def mkl_packing_available() -> bool:
    try:
        w = torch.ones(2, 2)
        return bool(torch.ops.mkl._mkl_linear(w, torch.ops.mkl._mkl_reorder_linear_weight(w, 2), w, None, 2).sum() == 8)
    except (AttributeError, RuntimeError):  # a torch built without MKL (e.g. aarch64)
        return False


def attach_mkl_packed(model: LlamaModel, widths: tuple[int, ...], *, served: int = 0) -> bool:
    """Switch: for each width w (ascending), a copy of every float32 linear weight in MKL's packed sgemm layout
    for w rows; the first width serves products of exactly w rows, each later one those of (previous width, w]
    rows, padded with zero rows to w (``linear``). On the AMX Xeon MKL's packed product over 4 rows took
    SmolLM2's matmuls from 36 to 24 ms and over 16 from 47 to 36 ms (2-3 rows gained nothing), at 2-5x the weight
    memory per width (docs/benchmarks.md). ``served``: products of up to this many rows take the small-product kernel
    (its rows and chunks): a width's rows among them get no copy (it was built and never read). Returns False
    (nothing attached) where torch has no MKL, the model is not float32 on the CPU, or the kernel serves every
    width's rows."""
    if not widths or model.device.type != "cpu" or model.dtype != torch.float32 or not mkl_packing_available():
        return False
    bounds = sorted(set(widths))
    ranges = [(lo + 1, hi) for lo, hi in zip([bounds[0] - 1, *bounds[:-1]], bounds, strict=True)]
    ranges = [(max(lo, served + 1), hi) for lo, hi in ranges if hi > served]
    if not ranges:
        logger.warning("mkl_packed_widths %s: the small-product kernel serves all their rows; no copy", list(widths))
        return False
    for mod in (m for m in model.modules() if type(m) is nn.Linear):
        w = mod.weight.detach()
        mod.mkl_packed = tuple(  # type: ignore[assignment]
            (lo, hi, torch.ops.mkl._mkl_reorder_linear_weight(w, hi)) for lo, hi in ranges
        )
    drop_native_stack(model)
    return True


def quantize_int8_dynamic(model: LlamaModel) -> LlamaModel:
    """Dynamic int8 weights for every linear layer (a cheap CPU draft); embeddings stay in float."""
    if model.dtype != torch.float32:
        raise ValueError("dynamic int8 quantisation starts from a float32 model")
    if model.cfg.tie_word_embeddings:  # untie so the embedding stays float while lm_head is quantised
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
