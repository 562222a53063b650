"""Device memory of a served model from its shapes and dtype: weights, KV per token / slot, a rough activation
bound, and how many KV slots fit in what a device has free (``gpu_memory_utilization``, as in other servers).

Pure arithmetic (no torch): ``cluster/`` configs are checked against GPU sizes with it (tests/test_memory.py), and
the workers size their KV caches with it on CUDA (``kv_slots_that_fit``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from specserve.errors import KVCapacityError

GIB = 1 << 30
CUDA_CONTEXT_BYTES = GIB // 2  # CUDA context + cuBLAS workspaces: outside PyTorch's allocator, not in our counts
LOGIT_COPIES = 3  # fp32 logits [R, V] live as the LM head's output, processed logits and probabilities


class ModelShape(BaseModel):
    """What decides a Llama-family model's memory (specserve/models/llama.py ArchConfig has the same names)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_positions: int = Field(default=0, ge=0, description="RoPE table rows kept on the device (0: none counted)")

    @property
    def num_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h  # qkv, o, gate/up/down, two norms
        per_layer += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + (2 * i + h) * self.mlp_bias
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h  # + the final norm


def weight_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Parameters plus the RoPE cos/sin tables [P, D], all in the serving dtype."""
    return (shape.num_params + 2 * shape.max_positions * shape.head_dim) * dtype_bytes


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes  # K and V, every layer


def kv_bytes_per_slot(shape: ModelShape, dtype_bytes: int, max_len: int) -> int:
    """One preallocated slot of ``max_len`` tokens (specserve/models/kv_cache.py)."""
    return kv_bytes_per_token(shape, dtype_bytes) * max_len


def activation_bytes(
    shape: ModelShape, dtype_bytes: int, *, batch: int, q_len: int, kv_len: int, logit_rows: int
) -> int:
    """A rough upper bound of one forward's transient memory: ``batch`` sequences of up to ``q_len`` new tokens
    against ``kv_len`` keys, returning ``logit_rows`` fp32 logit rows.

    Counts one layer's live tensors (layers run one after another): the residual stream, the norm's fp32 copy,
    q/k/v, the padded queries and attention output, gate/up and their product, the bool mask [B, Q, K], the RoPE
    rows, and for grouped heads K/V expanded to every query head (a masked or float32 step on CUDA:
    ``attention.expand_grouped_heads``); plus the fp32 logits (LOGIT_COPIES). Attention scores are not counted:
    on CUDA SDPA and flash-attn run fused kernels that never hold [B, H, Q, K]."""
    n = batch * q_len  # padded token rows (the upper bound of N)
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_token = (3 * h + (q + 2 * kv) + 2 * q + 3 * i + 2 * shape.head_dim) * dtype_bytes + 4 * h
    mask = batch * q_len * kv_len
    expanded_kv = 2 * batch * kv_len * q * dtype_bytes if shape.num_kv_heads != shape.num_heads else 0
    logits = LOGIT_COPIES * logit_rows * shape.vocab_size * 4 + logit_rows * shape.vocab_size * dtype_bytes
    return n * per_token + mask + expanded_kv + logits


class MemoryPlan(BaseModel):
    """One worker's device memory at a given KV geometry, in bytes."""

    model_config = ConfigDict(frozen=True)

    weights: int
    kv: int
    activations: int
    reserved: int = CUDA_CONTEXT_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.reserved


def plan(
    shape: ModelShape,
    dtype_bytes: int,
    *,
    num_slots: int,
    max_len: int,
    step_tokens: int,
    prefill_tokens: int,
) -> MemoryPlan:
    """Memory of a worker with ``num_slots`` slots of ``max_len``; its largest forward is either a verify step
    (``step_tokens`` per sequence, all returning logits) or a prefill of ``prefill_tokens`` per sequence (the
    last row's logits): every sequence in the batch at once, since prefills are not chunked."""
    verify = activation_bytes(
        shape, dtype_bytes, batch=num_slots, q_len=step_tokens, kv_len=max_len, logit_rows=num_slots * step_tokens
    )
    prefill = activation_bytes(
        shape, dtype_bytes, batch=num_slots, q_len=prefill_tokens, kv_len=max_len, logit_rows=num_slots
    )
    return MemoryPlan(
        weights=weight_bytes(shape, dtype_bytes),
        kv=num_slots * kv_bytes_per_slot(shape, dtype_bytes, max_len),
        activations=max(verify, prefill),
    )


def kv_slots_that_fit(
    *,
    total_bytes: int,
    free_bytes: int,
    utilization: float,
    slot_bytes: int,
    activation_bytes_per_slot: int,
    requested: int,
    fraction: float = 1.0,
    own_bytes: int | None = None,
) -> int:
    """Slots of KV (up to ``requested``) that fit once the weights are loaded, vLLM-style: this process may fill
    ``utilization * fraction * total_bytes`` (``fraction``: the share of the device its actor reserves, 1 when it
    has it alone), where what it holds already counts (``own_bytes``; None: everything in use, ``total - free``:
    our weights, the CUDA context, other processes), and the device keeps ``(1 - utilization) * total_bytes``
    free. Each slot also reserves its share of a step's activations. Raises KVCapacityError when not even one slot
    fits."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    own = total_bytes - free_bytes if own_bytes is None else own_bytes
    headroom = total_bytes - int(utilization * total_bytes)
    budget = min(int(utilization * fraction * total_bytes) - own, free_bytes - headroom)
    per_slot = slot_bytes + activation_bytes_per_slot
    fit = max(budget, 0) // per_slot
    if fit < 1:
        raise KVCapacityError(
            f"not even one KV slot fits: {free_bytes / GIB:.2f} GiB free of {total_bytes / GIB:.2f} GiB after "
            f"loading the weights, {utilization * fraction:.2f} of the device allowed, and one slot needs "
            f"{per_slot / GIB:.3f} GiB (KV {slot_bytes / GIB:.3f} GiB + activations); lower max_model_len, use a "
            "larger device or raise gpu_memory_utilization"
        )
    return min(requested, fit)
