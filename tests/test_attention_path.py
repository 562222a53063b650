"""The attention path a GPU takes, checked on the CPU: chain verification is a causal batch (flash-attn eligible)
with the masked path's logits; the flash path reads the KV slots in place, right-aligns ragged queries, and no
forward reads the device per layer (counted by a hook on device-to-host reads)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.messages import VerifyItem
from specserve.models import attention, llama
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_config, tiny_model
from specserve.sampling import SamplingParams
from specserve.spec_decode.draft_tree import DraftTree, step_layout
from specserve.workers.target import TargetWorker


def _tree(parents: list[int]) -> DraftTree:
    return DraftTree(tokens=torch.arange(10, 11 + len(parents)), parents=torch.tensor([0, *parents]))


def test_step_layout_makes_chains_causal_and_keeps_tree_masks() -> None:
    assert step_layout(_tree([0, 1, 2]), 2, 5) == (None, None)  # a chain: consecutive causal positions
    mask, positions = step_layout(_tree([0, 0, 1]), 2, 5)  # nodes 1 and 2 are siblings
    assert mask is not None and positions == [5, 6, 7, 8, 8, 9]
    assert not mask[4, 3]  # a sibling is hidden


def test_chain_verification_is_causal_with_the_masked_paths_logits() -> None:
    model = tiny_model(seed=21)
    prompts, chains = [[3, 4, 5, 6, 7], [8, 9, 10]], [[11, 12, 13, 14], [15, 16]]

    def verify(masked: bool) -> tuple[torch.Tensor, ForwardBatch]:
        cache = model.new_cache(2, 64)
        slots = [cache.allocate() for _ in prompts]
        model(ForwardBatch.build(cache, slots, prompts), cache)
        masks = [torch.ones(len(c), len(c), dtype=torch.bool).tril() for c in chains] if masked else None
        batch = ForwardBatch.build(cache, slots, chains, tree_masks=masks)
        return model(batch, cache), batch

    (causal_logits, causal), (masked_logits, masked) = verify(False), verify(True)
    assert causal.causal and not masked.causal
    assert torch.equal(causal_logits, masked_logits)


def test_target_worker_verifies_chains_causally_and_trees_with_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = TargetWorker(tiny_model(seed=22), num_slots=2, max_len=64)
    built: list[ForwardBatch] = []
    build = ForwardBatch.build

    def spy(*args: Any, **kwargs: Any) -> ForwardBatch:
        built.append(build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(ForwardBatch, "build", staticmethod(spy))
    for seq in (0, 1):
        worker.add(seq, SamplingParams(max_tokens=8), 3 - seq)
    worker.verify([VerifyItem(0, [3, 4, 5]), VerifyItem(1, [6, 7])])  # prefill
    worker.verify([VerifyItem(0, [8], [9, 10, 11], [0, 1, 2]), VerifyItem(1, [12], [13, 14], [0, 1])])
    assert built[-1].causal and built[-1].attn_mask is not None  # ragged: SDPA still pads with a mask
    worker.verify([VerifyItem(0, [20], [21, 22], [0, 0])])
    assert not built[-1].causal


def reference_flash_with_kvcache(
    q: torch.Tensor,  # [B, Q, H, D]
    k_cache: torch.Tensor,  # [S, L, H_kv, D]
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,  # [B] int32
    cache_batch_idx: torch.Tensor,  # [B] int32
    causal: bool,
) -> torch.Tensor:  # [B, Q, H, D]
    """flash_attn_with_kvcache as flash-attn documents it: causal aligned bottom-right, rows that see no key
    give 0."""
    assert causal and k_cache.stride(-1) == 1
    b_size, q_len = q.shape[:2]
    out = torch.zeros_like(q)
    for b in range(b_size):
        length, slot = int(cache_seqlens[b]), int(cache_batch_idx[b])
        k = k_cache[slot, :length].transpose(0, 1)  # [H_kv, K, D]
        v = v_cache[slot, :length].transpose(0, 1)
        rows, cols = torch.arange(q_len)[:, None], torch.arange(length)[None]
        mask = cols <= rows + length - q_len  # [Q, K]
        o = F.scaled_dot_product_attention(q[b].transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)
        out[b] = torch.where(mask.any(-1)[None, :, None], o, 0.0).transpose(0, 1)
    return out


@contextmanager
def flash_path(monkeypatch: pytest.MonkeyPatch, kernel: Any) -> Iterator[None]:
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", kernel)
    monkeypatch.setattr(llama, "flash_attn_available", lambda device, dtype: True)
    yield


def _steps(model: LlamaModel) -> list[torch.Tensor]:
    """Prefill three ragged prompts, decode one token each, verify ragged chains, verify a tree: logits."""
    cache = model.new_cache(4, 64)
    cache.allocate()  # slot 0 stays unused: the batch's slots are not 0..B-1
    slots = [cache.allocate() for _ in range(3)]
    out = [model(ForwardBatch.build(cache, slots, [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]), cache)]
    out.append(model(ForwardBatch.build(cache, slots, [[13], [14], [15]]), cache))
    out.append(model(ForwardBatch.build(cache, slots[::-1], [[16, 17, 18], [19], [20, 21]]), cache))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    out.append(model(ForwardBatch.build(cache, slots[:1], [[22, 23, 24]], tree_masks=[tree]), cache))
    return out


def test_flash_path_equals_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(seed=23)
    ref = _steps(model)
    with flash_path(monkeypatch, reference_flash_with_kvcache):
        got = _steps(model)
    for r, g in zip(ref, got, strict=True):
        assert (r - g).abs().max() < 1e-4


def test_flash_path_reads_the_kv_slots_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(seed=24)
    cache = model.new_cache(3, 32)
    slots = [cache.allocate() for _ in range(2)]
    seen: list[int] = []

    def kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append(k_cache.untyped_storage().data_ptr())
        return torch.zeros_like(q)

    with flash_path(monkeypatch, kernel):
        model(ForwardBatch.build(cache, slots, [[3, 4, 5], [6]]), cache)
    assert seen == [k.untyped_storage().data_ptr() for k in cache.k]  # every layer: its cache, not a copy


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (``.item()``, ``bool(t)``, ``int(t)``: on a GPU
    each one waits for the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_reads(monkeypatch: pytest.MonkeyPatch, model: LlamaModel, batch_of: Any) -> int:
    cache = model.new_cache(3, 64)
    slots = [cache.allocate() for _ in range(3)]
    model(ForwardBatch.build(cache, slots, [[3, 4, 5, 6], [7, 8], [9]]), cache)
    batch = batch_of(cache, slots)
    tolist = torch.Tensor.tolist
    calls = [0]

    def counting_tolist(self: torch.Tensor) -> Any:
        calls[0] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    with HostReads() as mode:
        model(batch, cache)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return mode.count + calls[0]


@pytest.mark.parametrize("flash", [False, True])
def test_forward_reads_nothing_back_per_layer(monkeypatch: pytest.MonkeyPatch, flash: bool) -> None:
    def chains(cache: Any, slots: list[int]) -> ForwardBatch:
        return ForwardBatch.build(cache, slots, [[10, 11, 12], [13], [14, 15]])

    def tree(cache: Any, slots: list[int]) -> ForwardBatch:
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        return ForwardBatch.build(cache, slots[:1], [[16, 17, 18]], tree_masks=[mask])

    if flash:
        monkeypatch.setattr(attention, "flash_attn_with_kvcache", lambda q, *a, **kw: torch.zeros_like(q))
        monkeypatch.setattr(llama, "flash_attn_available", lambda device, dtype: True)
    for layers in (2, 6):
        model = tiny_model(tiny_config(num_hidden_layers=layers), seed=25)
        assert _host_reads(monkeypatch, model, chains) == 0
        assert _host_reads(monkeypatch, model, tree) == 0


def test_host_read_hook_sees_a_per_layer_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook is not blind: the old flash path's per-layer ``batch.slots.tolist()`` is counted once a layer."""

    def old_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        batch.slots.tolist()
        return q

    monkeypatch.setattr(attention, "_flash_kvcache", old_kernel)
    monkeypatch.setattr(llama, "flash_attn_available", lambda device, dtype: True)
    model = tiny_model(tiny_config(num_hidden_layers=3), seed=26)
    reads = _host_reads(monkeypatch, model, lambda cache, slots: ForwardBatch.build(cache, slots, [[1], [2], [3]]))
    assert reads == 3


def test_a_slots_next_sequence_reads_nothing_its_last_one_wrote() -> None:
    """A padded batch's SDPA reads every row's entries up to the longest row and masks the rest, and a mask does
    not hide a non-finite value: a sequence whose K/V overflowed (fp16) left its slot poisoning every later sequence
    there that stepped beside a longer one (NaN logits; alone, or on the C++ kernel, which reads no masked entry,
    it was fine). Freeing a slot zeroes what it wrote."""
    model = tiny_model(tiny_config(num_key_value_heads=2), seed=4)
    cache = model.new_cache(2, 32)
    a, b = cache.allocate(), cache.allocate()
    model(ForwardBatch.build(cache, [a, b], [list(range(3, 13)), list(range(20, 30))]), cache)
    for t in (*cache.k, *cache.v):
        t[a, :, 8] = float("inf")  # as an overflowing sequence leaves it
    cache.free(a)
    assert cache.allocate() == a
    model(ForwardBatch.build(cache, [a], [[5, 9, 13]]), cache)
    both = model(ForwardBatch.build(cache, [a, b], [[7], [7]]), cache)
    assert bool(both.isfinite().all())
    alone = model.new_cache(1, 32)
    ref = model(ForwardBatch.build(alone, [alone.allocate()], [[5, 9, 13, 7]]), alone)[-1]
    assert torch.allclose(both[0], ref, atol=1e-5)


def test_grouped_heads_are_expanded_wherever_cudas_sdpa_would_otherwise_hold_every_score() -> None:
    """Without a mask CUDA's SDPA runs grouped heads in flash attention, which takes fp16 / bf16 only: a float32
    prefill of one sequence of a GQA model fell to the math kernel and its fp32 scores [1, H_q, L, L] (32 GiB for a
    16k-token prompt of Llama-3.2-1B), which the memory plan does not count."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert attention.expand_grouped_heads(cuda, torch.float32, masked=False)  # the case that was missed
    assert attention.expand_grouped_heads(cuda, torch.float32, masked=True)
    assert attention.expand_grouped_heads(cuda, torch.bfloat16, masked=True)
    assert not attention.expand_grouped_heads(cuda, torch.bfloat16, masked=False)  # flash attention takes them
    assert not attention.expand_grouped_heads(cpu, torch.float32, masked=True)  # the CPU's SDPA groups them itself
