"""Q8_0 records for the LM head (ModelSpec.q8_head_reads): the kernel forms each float32 weight from its 8-bit block
by the dequantisation's own multiply and must give the float32 path's bits for every row count, instruction set and
prefetch; the loader attaches them only where the GGUF's blocks dequantise to exactly the loaded LM head, and greedy
steps that read them take the exact argmax of those logits."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from specserve.config import ModelSpec
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel, reads_copy
from specserve.models.lm_head import attach_bounded_argmax, greedy_ids
from specserve.models.loader import load_model
from specserve.models.native_stack import (
    EVERY_ROW,
    NativeStackUnavailable,
    attach_native_stack,
    attach_q8_head,
    attach_small_gemm,
    extension,
    small_gemm_available,
)
from specserve.models.q4 import Q8Blocks, q8_0_blocks
from specserve.models.tiny import tiny_config, tiny_model

try:
    extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ extension cannot be built here: {e}", allow_module_level=True)
if not small_gemm_available():  # pragma: no cover - a CPU without AVX2 + FMA
    pytest.skip("this CPU runs no small_gemm path", allow_module_level=True)

ISAS = list(extension().small_gemm_isas())
# (N, K): a vocabulary-like N with rows past the last block of 4, SmolLM2's hidden size, one group only
SHAPES = [(1027, 576), (7, 64), (5, 32), (13, 96)]


def random_q8(n: int, k: int, seed: int) -> Q8Blocks:
    """Float16 d as ggml stores it, the full int8 range; a zero group (d = 0) and a float16-subnormal d where there
    are groups enough."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half().float()
    if d.numel() > 2:
        d.view(-1)[1] = 0.0
        d.view(-1)[2] = torch.tensor(2.0**-20).half().float()  # subnormal in float16
    return Q8Blocks(q, d)


def test_gguf_bytes_decode_as_ggml_lays_them_out() -> None:
    """One row of two Q8_0 blocks written byte by byte (float16 d, then 32 int8 values): d * q per group."""
    values = [list(range(-16, 16)), list(range(127, 95, -1))]
    raw = b"".join(
        torch.tensor([d]).half().numpy().tobytes() + bytes(v % 256 for v in vs)
        for d, vs in zip((0.5, -2.0), values, strict=True)
    )
    blocks = q8_0_blocks(torch.frombuffer(bytearray(raw), dtype=torch.uint8).numpy().reshape(1, -1), (1, 64))
    assert blocks.q.tolist() == [values[0] + values[1]] and blocks.d.tolist() == [[0.5, -2.0]]
    assert blocks.dequantize().tolist() == [[0.5 * v for v in values[0]] + [-2.0 * v for v in values[1]]]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_q8_records_give_the_float32_kernels_bits(isa: str, n: int, k: int) -> None:
    """Every row count 1-64 (one call's rows in registers, more through the dequantised block), with and without a
    bias: the same bits as the float32 kernel over the dequantised weight, and within float32 rounding of float64."""
    ext = extension()
    blocks = random_q8(n, k, seed=n * 100 + k)
    w, records = blocks.dequantize().contiguous(), ext.small_pack_q8(blocks.q, blocks.d)
    gen = torch.Generator().manual_seed(k)
    x, b = torch.randn(64, k, generator=gen), torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 33, 64):
        for bias in (b, None):
            got = ext.small_linear_packed_isa(x[:rows], records, bias, isa)
            assert torch.equal(got, ext.small_linear_isa(x[:rows], w, bias, isa)), (rows, bias is None)
        ref = x[:rows].double() @ w.double().T
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-4 * k**1.5)


def test_every_prefetch_and_batch_gives_a_row_the_same_bits() -> None:
    ext = extension()
    blocks = random_q8(1030, 192, seed=3)
    records, w = ext.small_pack_q8(blocks.q, blocks.d), blocks.dequantize()
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([ext.small_linear(x[i : i + 1], w, None) for i in range(64)])
    for rows in (1, 2, 3, 5, 8, 64):
        for pf in (ext.Prefetch.none, ext.Prefetch.l1, ext.Prefetch.l2):
            assert torch.equal(ext.small_linear_packed(x[:rows], records, None, pf), alone[:rows])


def test_q8_records_take_9_32_of_the_float32_bytes_and_bad_blocks_are_clear_errors() -> None:
    ext = extension()
    blocks = random_q8(8, 64, seed=1)
    records = ext.small_pack_q8(blocks.q, blocks.d)
    assert records.data.dtype == torch.int8 and records.data.numel() == 8 * 64 * 9 // 8  # 0.28x of float32
    assert (records.n, records.k) == (8, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.small_pack_q8(blocks.q[:, :48], blocks.d[:, :1])
    with pytest.raises(RuntimeError, match="int8"):
        ext.small_pack_q8(blocks.q.to(torch.uint8), blocks.d)
    with pytest.raises(RuntimeError, match=r"scales \[N, K / 32\]"):
        ext.small_pack_q8(blocks.q, blocks.d[:, :1])
    with pytest.raises(RuntimeError, match="float16 values in d"):  # d * q would round: not the dequantised value
        ext.small_pack_q8(blocks.q, blocks.d + 1e-9)
    with pytest.raises(RuntimeError, match="64"):
        ext.small_linear_packed(torch.randn(3, 32), records, None)


def q8_tiny_model(seed: int, tied: bool = False) -> tuple[LlamaModel, dict[str, Q8Blocks]]:
    """A tiny model whose LM head is Q8_0 blocks dequantised (as a GGUF's load), and those blocks by HF tensor name:
    the head's own, or with tied embeddings the token embedding's."""
    model = tiny_model(tiny_config(tie_word_embeddings=tied), seed=seed)
    n, k = model.lm_head.weight.shape
    blocks = random_q8(n, k, seed)
    with torch.no_grad():
        model.lm_head.weight.copy_(blocks.dequantize())
    return model, {"model.embed_tokens.weight" if tied else "lm_head.weight": blocks}


def steps(model: LlamaModel, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, greedy ids) of a prompt, single steps and verifies of 2-6 rows, as a decode reads them."""
    cache = model.new_cache(1, 96)
    slot = cache.allocate()
    logits, ids = [], []
    for tokens in (prompt, [5], [17], [3, 4], [6, 7, 8], list(range(9, 15))):
        hidden = model.final_hidden(ForwardBatch.build(cache, [slot], [tokens]), cache)
        logits.append(model.logits(hidden))
        ids.append(greedy_ids(model, hidden))
    return torch.cat(logits), torch.cat(ids)


@torch.inference_mode()
@pytest.mark.parametrize("tied", [False, True])
def test_a_model_reading_its_q8_head_computes_the_float32_models_logits_and_tokens(tied: bool) -> None:
    """Through the Python loop and the C++ stack; greedy tokens the full logits' argmax (with or without the bounded
    copy beside the records); and the records are what runs."""
    (plain, blocks), (q8, _) = q8_tiny_model(seed=2, tied=tied), q8_tiny_model(seed=2, tied=tied)
    assert attach_small_gemm(plain) and attach_small_gemm(q8) and attach_q8_head(q8, blocks)
    assert q8.lm_head.small_records.data.dtype == torch.int8 and q8.lm_head.small_record_rows == EVERY_ROW
    assert attach_bounded_argmax(q8)
    prompt = [int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))]
    for native in (False, True):
        if native:
            assert attach_native_stack(plain) and attach_native_stack(q8)
        want_logits, want_ids = steps(plain, prompt)
        got_logits, got_ids = steps(q8, prompt)
        assert torch.equal(got_logits, want_logits) and torch.equal(got_ids, want_logits.argmax(-1))
        assert torch.equal(got_ids, want_ids)
    q8.lm_head.small_records.data.zero_()
    got_logits, got_ids = steps(q8, prompt)
    assert not got_logits.any() and not got_ids.any()  # zeroed records: zero logits, token 0 (greedy read them too)


def test_blocks_that_do_not_match_the_head_attach_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model, blocks = q8_tiny_model(seed=3)
    assert attach_small_gemm(model)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1e-3
    with caplog.at_level(logging.WARNING):
        assert not attach_q8_head(model, blocks)
    assert "do not dequantise" in caplog.text and getattr(model.lm_head, "small_records", None) is None
    model, blocks = q8_tiny_model(seed=3, tied=True)
    assert attach_small_gemm(model)
    assert not attach_q8_head(model, {"lm_head.weight": blocks["model.embed_tokens.weight"]})  # tied: the embedding's
    with caplog.at_level(logging.WARNING):
        assert not attach_q8_head(*q8_tiny_model(seed=3))  # not on the kernel
    assert "not on the small-product kernel" in caplog.text


@torch.no_grad()
def test_the_plan_times_the_heads_records_apart_from_the_layers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kernel_plan_for times the LM head's records on their own: they serve the probes they win (here 1-3 rows) up to
    the next probe, greedy steps of those counts read them, and the stored plan brings the same mask back."""
    from specserve.models import native_stack

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    timed: list[tuple[int, int]] = []

    def fake(
        lins: list, rows: int, packed: bool, prefetch: object, record_prefetches: tuple, repeats: int
    ) -> tuple[float, tuple[float, ...]]:
        timed.append((len(lins), rows))
        return 1.0, (0.5, 0.5) if rows in (1, 2) else (2.0, 2.0)

    monkeypatch.setattr(native_stack, "time_records", fake)
    monkeypatch.setattr(native_stack, "time_variants", lambda lins, rows, variants, repeats: [1.0] * len(variants))
    model, blocks = q8_tiny_model(seed=4)
    assert attach_small_gemm(model, packed=True) and attach_q8_head(model, blocks)
    plan = native_stack.cached_kernel_plan(model, (True, False), (1, 2, 4))
    assert timed == [(1, 1), (1, 2), (1, 4)]  # the head alone: no decoder projection holds records
    assert plan.q4_rows == 0 and [r for r in range(1, 65) if reads_copy(plan.q8_rows, r)] == [1, 2, 3]
    assert "the LM head's Q8_0 records for 1-3 rows" in plan.describe()
    head = model.lm_head
    assert head.small_record_rows == plan.q8_rows
    assert attach_bounded_argmax(model)
    hidden = torch.randn(5, head.in_features)
    want = extension().small_linear(hidden, head.weight, None).argmax(-1)  # the float32 kernel's own logits
    head.small_records.data.zero_()
    for rows in range(1, 6):  # zeroed records: token 0 where greedy reads them, the true argmax where it does not
        expected = [0] * rows if rows <= 3 else want[:rows].tolist()
        assert greedy_ids(model, hidden[:rows]).tolist() == expected
    timed.clear()
    again, blocks = q8_tiny_model(seed=4)
    assert attach_small_gemm(again, packed=True) and attach_q8_head(again, blocks)
    assert native_stack.cached_kernel_plan(again, (True, False), (1, 2, 4)).q8_rows == plan.q8_rows
    assert timed == [(1, 1)]  # the head's stored choice at one row, timed against the other: not contradicted


@pytest.mark.real_model
def test_the_builtin_target_reads_its_q8_head_and_keeps_its_logits_and_tokens() -> None:
    """SmolLM2's LM head shares the GGUF's Q8_0 token embedding: records read at every row count (no plan), the
    logits and greedy tokens of the float32 reads bit for bit."""
    q8 = load_model(ModelSpec(small_gemm_plan=False))
    f32 = load_model(ModelSpec(q8_head_reads=False, small_gemm_plan=False))
    assert q8.lm_head.small_records is not None and q8.lm_head.small_record_rows == EVERY_ROW
    assert getattr(f32.lm_head, "small_records", None) is None
    prompt = [int(t) for t in torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(5))]
    with torch.inference_mode():
        (a_logits, a_ids), (b_logits, b_ids) = steps(q8, prompt), steps(f32, prompt)
    assert torch.equal(a_logits, b_logits) and torch.equal(a_ids, b_ids)
