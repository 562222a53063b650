"""csrc/attention.cpp: attention of a few new tokens per sequence, reading the KV cache in place; SDPA's values to
float rounding, the same bits whatever else is in the batch, in both layer loops."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pytest
import torch

from specserve.config import ModelSpec
from specserve.models.attention import attention
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.models.native_stack import NativeStackUnavailable, attach_native_attention, build_stack, extension
from specserve.models.tiny import tiny_config, tiny_model
from tests.test_native_stack import STEPS, Step, both_paths

try:
    ext = extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ extension cannot be built here: {e}", allow_module_level=True)
if not ext.attention_supported(64):  # pragma: no cover - a CPU without AVX2 + FMA
    pytest.skip("the attention kernel needs AVX2 + FMA", allow_module_level=True)

TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


def filled_cache(lengths: list[int], *, kv_heads: int = 3, head_dim: int = 64, seed: int = 0) -> KVCache:
    """Random K and V in every slot, slot s holding lengths[s] cached entries."""
    cache = KVCache(
        num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, num_slots=len(lengths), max_len=96,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    for slot, n in enumerate(lengths):
        assert cache.allocate() == slot
        cache.begin_append([slot], [n])
    return cache


def queries(batch: ForwardBatch, heads: int, head_dim: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch.write_slot.numel(), heads, head_dim, generator=gen)


def kernel_and_sdpa(cache: KVCache, batch: ForwardBatch, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = cache.k[0], cache.v[0]
    return attention(q, k, v, batch, use_flash=False, kernel=ext.attend), attention(q, k, v, batch, use_flash=False)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 128), (4, 4, 64), (8, 2, 64), (10, 1, 64)]
)
def test_the_kernel_gives_sdpas_values(heads: int, kv_heads: int, head_dim: int) -> None:
    """Ragged causal steps over non-consecutive, out-of-order slots (SDPA gathers and pads them), a tree verify beside
    a decode step, and one sequence's chain alone (SDPA's unmasked causal path)."""
    cache = filled_cache([10, 3, 20, 0, 41], kv_heads=kv_heads, head_dim=head_dim)
    for slots, tokens, trees in [
        ([4, 0, 2], [[1, 1], [1], [1, 1, 1, 1]], None),
        ([2, 1, 4], [[1], [1, 1, 1, 1], [1]], [None, TREE, None]),
        ([3], [[1] * 7], None),
        ([1], [[1]], None),
    ]:
        batch = ForwardBatch.build(cache, slots, tokens, tree_masks=trees)
        got, want = kernel_and_sdpa(cache, batch, queries(batch, heads, head_dim))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for slot, new in zip(slots, tokens, strict=True):
            cache.truncate(slot, cache.length(slot) - len(new))


def test_a_token_gets_the_same_bits_alone_and_among_others() -> None:
    """A chain of four tokens verified in a ragged batch beside a tree and a decode step, against each token
    decoded alone after the same cache: equal bit for bit (SDPA gives no such promise)."""
    cache = filled_cache([12, 30, 5])
    batch = ForwardBatch.build(cache, [0, 1, 2], [[1] * 4, [1] * 4, [1]], tree_masks=[None, TREE, None])
    q = queries(batch, 9, 64)
    together = attention(q, cache.k[0], cache.v[0], batch, use_flash=False, kernel=ext.attend)
    for slot, n in ((0, 4), (1, 4), (2, 1)):
        cache.truncate(slot, cache.length(slot) - n)
    for j in range(4):  # sequence 0's chain token j, decoded after 12 + j cached entries
        alone = ForwardBatch.build(cache, [0], [[1]])
        got = attention(q[j : j + 1], cache.k[0], cache.v[0], alone, use_flash=False, kernel=ext.attend)
        assert torch.equal(got, together[j : j + 1])


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.__name__)
def test_both_layer_loops_run_the_kernel_bit_for_bit(step: Step) -> None:
    """The Python layer loop and the C++ stack each run the attached kernel: the same values, bit for bit; and
    the model's outputs are SDPA's to float rounding."""
    model = tiny_model(tiny_config("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2), seed=5)
    assert model.cfg.head_dim == 32 and attach_native_attention(model) is False  # a head dim it does not serve
    model = tiny_model(tiny_config("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2), seed=5)
    sdpa = step(model, model.new_cache(4, 64))
    assert attach_native_attention(model) is True and model.attention_kernel is not None
    both_paths(model, step)
    for got, want in zip(step(model, model.new_cache(4, 64)), sdpa, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_fused_stack_runs_the_kernel_to_rounding() -> None:
    """The serving stack (fused norms and RoPE) with the kernel against the Python loop with it: the loop's values to
    float rounding (the fused norms are not bit for bit), on a ragged step, a tree verify and out-of-order slots."""
    model = tiny_model(tiny_config("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2), seed=6)
    assert attach_native_attention(model)
    fused = build_stack(model, fused=True)
    for step in STEPS:
        outs = []
        for stack in (None, fused):
            model.native_stack = stack
            outs.append(step(model, model.new_cache(4, 64)))
        for got, want in zip(outs[1], outs[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bad_input_is_a_clear_error() -> None:
    cache = filled_cache([6, 6])
    batch = ForwardBatch.build(cache, [0, 1], [[1], [1, 1]])
    q = queries(batch, 9, 64)
    rows = (batch.write_slot, batch.write_pos, batch.write_from)
    k, v = cache.k[0], cache.v[0]
    with pytest.raises(RuntimeError, match="float32"):
        ext.attend(q.double(), k, v, *rows, batch.attn_mask, 2)
    with pytest.raises(RuntimeError, match="query heads"):
        ext.attend(q[:, :8], k, v, *rows, batch.attn_mask, 2)
    assert batch.attn_mask is not None
    blind = batch.attn_mask.clone()
    blind[1, 0, 1] = False
    with pytest.raises(RuntimeError, match="may attend to nothing"):
        ext.attend(q, k, v, *rows, blind, 2)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.attend(q, k, v, batch.write_slot + 5, batch.write_pos, batch.write_from, batch.attn_mask, 2)


def test_a_nan_score_reaches_the_output_as_sdpas_does() -> None:
    """A NaN key gave a finite output: the clamp in the kernel's exp turned a NaN score into its upper bound, so
    that key took the whole softmax (two such keys gave 0.0) where SDPA gives NaN, and a corrupt cache never
    reached the logits' checks for non-finite values. Keys large enough to dominate, but finite, agree too."""
    for bad in (float("nan"), 1e30):
        cache = filled_cache([10, 10])
        cache.k[0][0, 1, 3] = bad  # slot 0, KV head 1, position 3
        cache.k[0][0, 2, 4:6] = bad  # KV head 2, two positions
        batch = ForwardBatch.build(cache, [0, 1], [[1], [1, 1]])
        got, want = kernel_and_sdpa(cache, batch, queries(batch, 9, 64))
        assert want[1:].isfinite().all() and want[0].isfinite().all() == (bad == 1e30)  # NaN: slot 0's row only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_the_switch_and_where_it_does_not_apply() -> None:
    assert ModelSpec().native_attention is True
    bf16 = tiny_model(tiny_config("llama", hidden_size=256), seed=2).to(torch.bfloat16)
    assert attach_native_attention(bf16) is False and bf16.attention_kernel is None


def test_the_attention_benchmark_writes_a_row_per_shape(tmp_path: Path) -> None:
    from specserve.bench.attention import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--batch-sizes", "1", "3", "--tokens", "1", "4", "--context", "16", "--repeats", "1"])
    args.out = tmp_path
    assert run(args) == 0
    with (tmp_path / "attention.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["batch"], r["tokens"]) for r in rows] == [("1", "1"), ("1", "4"), ("3", "1"), ("3", "4")]
    assert all(float(r["sdpa_us"]) > 0 and float(r["kernel_us"]) > 0 for r in rows)
