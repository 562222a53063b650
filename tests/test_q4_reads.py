"""Q4_1 records for the small-product kernel (ModelSpec.q4_reads): the kernel forms each float32 weight from its
4-bit block in a register and must give the float32 path's bits for every row count, instruction set and prefetch;
the loader attaches the records only where the GGUF's blocks dequantise to exactly the loaded weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from specserve.config import ModelSpec, SourceKind
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_model, record_source
from specserve.models.native_stack import (
    EVERY_ROW,
    NativeStackUnavailable,
    attach_native_stack,
    attach_q4_reads,
    attach_small_gemm,
    extension,
    small_gemm_available,
)
from specserve.models.q4 import Q4Blocks
from specserve.models.tiny import tiny_config, tiny_model

try:
    extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ extension cannot be built here: {e}", allow_module_level=True)
if not small_gemm_available():  # pragma: no cover - a CPU without AVX2 + FMA
    pytest.skip("this CPU runs no small_gemm path", allow_module_level=True)

ISAS = list(extension().small_gemm_isas())
# (N, K): SmolLM2's fused q/k/v and down projections, an N with rows past the last block of 4, one group only
SHAPES = [(960, 576), (576, 1536), (7, 64), (5, 32), (13, 96)]


def random_blocks(n: int, k: int, seed: int) -> Q4Blocks:
    """Float16 d and m as ggml stores them; a constant group (d = 0) and a float16-subnormal d where there are
    groups enough."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    if d.numel() > 2:
        d.view(-1)[1] = 0.0
        d.view(-1)[2] = torch.tensor(2.0**-20).half().float()  # subnormal in float16
    return Q4Blocks(q, d, m)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_records_give_the_float32_kernels_bits(isa: str, n: int, k: int) -> None:
    """Every row count 1-64 (one call's rows in registers, more through the dequantised block), with and without a
    bias: the same bits as the float32 kernel over the dequantised weight, and within float32 rounding of float64."""
    ext = extension()
    blocks = random_blocks(n, k, seed=n * 100 + k)
    w, records = blocks.dequantize().contiguous(), ext.small_pack_q4(blocks.q, blocks.d, blocks.m)
    gen = torch.Generator().manual_seed(k)
    x, b = torch.randn(64, k, generator=gen), torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 33, 64):
        for bias in (b, None):
            got = ext.small_linear_packed_isa(x[:rows], records, bias, isa)
            assert torch.equal(got, ext.small_linear_isa(x[:rows], w, bias, isa)), (rows, bias is None)
        ref = x[:rows].double() @ w.double().T
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * k**1.5)


def test_every_prefetch_and_batch_gives_a_row_the_same_bits() -> None:
    ext = extension()
    blocks = random_blocks(1030, 192, seed=3)
    records, w = ext.small_pack_q4(blocks.q, blocks.d, blocks.m), blocks.dequantize()
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([ext.small_linear(x[i : i + 1], w, None) for i in range(64)])
    for rows in (1, 2, 3, 5, 8, 64):
        for pf in (ext.Prefetch.none, ext.Prefetch.l1, ext.Prefetch.l2):
            assert torch.equal(ext.small_linear_packed(x[:rows], records, None, pf), alone[:rows])


def test_records_are_a_fifth_of_the_float32_bytes_and_bad_blocks_are_clear_errors() -> None:
    ext = extension()
    blocks = random_blocks(8, 64, seed=1)
    records = ext.small_pack_q4(blocks.q, blocks.d, blocks.m)
    assert records.data.dtype == torch.uint8 and records.data.numel() == 8 * 64 * 3 // 4  # 0.1875x of float32
    assert (records.n, records.k) == (8, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.small_pack_q4(blocks.q[:, :48], blocks.d[:, :1], blocks.m[:, :1])
    with pytest.raises(RuntimeError, match="4-bit"):
        ext.small_pack_q4(blocks.q + 16, blocks.d, blocks.m)
    with pytest.raises(RuntimeError, match=r"scales \[N, K / 32\]"):
        ext.small_pack_q4(blocks.q, blocks.d[:, :1], blocks.m)
    with pytest.raises(RuntimeError, match="float16 values in d"):  # d * q would round: not the dequantised value
        ext.small_pack_q4(blocks.q, blocks.d + 1e-9, blocks.m)
    with pytest.raises(RuntimeError, match="64"):
        ext.small_linear_packed(torch.randn(3, 32), records, None)


def q4_tiny_model(seed: int, **config: int) -> tuple[LlamaModel, dict[str, Q4Blocks]]:
    """A tiny model (``tiny_config(**config)``) whose decoder projections are Q4_1 blocks dequantised (as a GGUF's
    load), and those blocks by HF tensor name, split as a GGUF holds them (q, k, v and gate, up apart)."""
    cfg = tiny_config(**config)
    model = tiny_model(cfg, seed=seed)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q_size, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    blocks: dict[str, Q4Blocks] = {}
    parts = {
        "qkv": [("self_attn.q_proj", q_size), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
        "o_proj": [("self_attn.o_proj", cfg.hidden_size)],
        "gate_up": [("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)],
        "down": [("mlp.down_proj", cfg.hidden_size)],
    }
    with torch.no_grad():
        for i, layer in enumerate(model.decoder_layers()):
            for attr, names in parts.items():
                mod = getattr(layer, attr)
                for j, (name, rows) in enumerate(names):
                    blocks[f"model.layers.{i}.{name}.weight"] = random_blocks(
                        rows, mod.in_features, seed * 97 + i * 7 + j
                    )
                fused = Q4Blocks.cat([blocks[f"model.layers.{i}.{name}.weight"] for name, _ in names])
                mod.weight.copy_(fused.dequantize())
    return model, blocks


def forwards(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 160)
    slot = cache.allocate()
    steps = [model(ForwardBatch.build(cache, [slot], [prompt]), cache)]  # 40 rows
    steps += [model(ForwardBatch.build(cache, [slot], [[t]]), cache) for t in (5, 17)]
    steps += [model(ForwardBatch.build(cache, [slot], [list(range(3, 3 + r))]), cache) for r in (2, 3, 6, 64)]
    return torch.cat(steps)


def test_a_model_reading_its_q4_blocks_computes_the_float32_models_logits() -> None:
    """Through the Python loop and the C++ stack, at 1-64 rows; and the records are what runs."""
    (plain, blocks), (q4, _) = q4_tiny_model(seed=2), q4_tiny_model(seed=2)
    assert attach_small_gemm(plain) and attach_small_gemm(q4) and attach_q4_reads(q4, blocks)
    layer = q4.decoder_layers()[1]
    assert all(getattr(layer, p).small_records.data.dtype == torch.uint8 for p in ("qkv", "o_proj", "gate_up", "down"))
    assert getattr(q4.lm_head, "small_records", None) is None  # not a Q4_1 tensor
    prompt = [int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))]
    for native in (False, True):
        if native:
            assert attach_native_stack(plain) and attach_native_stack(q4)
        assert torch.equal(forwards(plain, prompt), forwards(q4, prompt))
    layer.down.small_records.data.zero_()
    assert not torch.equal(forwards(plain, prompt), forwards(q4, prompt))


def test_blocks_that_do_not_match_the_weights_attach_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model, blocks = q4_tiny_model(seed=3)
    assert attach_small_gemm(model)
    with torch.no_grad():
        model.decoder_layers()[0].o_proj.weight[0, 0] += 1e-3
    with caplog.at_level(logging.WARNING):
        assert not attach_q4_reads(model, blocks)
    assert "do not dequantise" in caplog.text
    assert all(getattr(m, "small_records", None) is None for m in model.modules() if type(m) is torch.nn.Linear)
    del blocks["model.layers.1.mlp.up_proj.weight"]
    with caplog.at_level(logging.WARNING):
        assert not attach_q4_reads(q4_tiny_model(seed=3)[0], blocks)
    assert "every decoder projection" in caplog.text


def test_the_loader_reads_blocks_only_from_a_gguf_on_disk(tmp_path: Path) -> None:
    model = tiny_model(seed=0)
    gguf = tmp_path / "x.gguf"
    assert record_source(model, ModelSpec(source=str(tmp_path), kind=SourceKind.hf_dir)) is None
    assert record_source(model, ModelSpec(source=str(gguf))) is None  # not there: float32 reads
    gguf.write_bytes(b"")
    assert record_source(model, ModelSpec(source=str(gguf))) == gguf
    assert record_source(model, ModelSpec(source=str(gguf), q4_reads=False)) == gguf  # the LM head's Q8_0 blocks
    assert record_source(model, ModelSpec(source=str(gguf), q4_reads=False, q8_head_reads=False)) is None
    assert record_source(model.to(torch.bfloat16), ModelSpec(source=str(gguf))) is None  # the records are float32


@pytest.mark.real_model
def test_the_builtin_target_reads_its_q4_blocks_and_keeps_its_logits() -> None:
    """SmolLM2 from its Q4_1 GGUF: every decoder projection on records (read at every row count: no plan, whose
    choice depends on the machine), the logits of the float32 reads bit for bit (a prompt, single steps and
    verifies of 2-64 rows)."""
    q4 = load_model(ModelSpec(small_gemm_plan=False, q8_head_reads=False))
    f32 = load_model(ModelSpec(q4_reads=False, q8_head_reads=False, small_gemm_plan=False))
    downs = [layer.down for layer in q4.decoder_layers()]
    assert all(d.small_records is not None and d.small_record_rows == EVERY_ROW for d in downs)
    assert not any(getattr(m, "small_records", None) is not None for m in f32.modules())
    prompt = [int(t) for t in torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(5))]
    with torch.inference_mode():
        assert torch.equal(forwards(q4, prompt), forwards(f32, prompt))


@torch.no_grad()
@pytest.mark.parametrize("q4_probes", [(1, 2), ()])
def test_the_plan_reads_records_where_they_measure_faster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, q4_probes: tuple[int, ...]
) -> None:
    """kernel_plan_for times the records against the float32 variant it chose at each probe: they serve the probes
    they win up to the next probe, in the Python loop and the C++ stack (a zeroed record shows which path ran); no
    win drops them; the stored plan brings the same mask back without timing."""
    from specserve.models import native_stack
    from specserve.models.llama import linear, reads_copy

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    timed: list[int] = []

    def fake_q4(
        lins: list, rows: int, packed: bool, prefetch: object, record_prefetches: tuple, repeats: int
    ) -> tuple[float, tuple[float, ...]]:
        timed.append(rows)
        return 1.0, (0.5, 0.5) if rows in q4_probes else (2.0, 2.0)

    monkeypatch.setattr(native_stack, "time_records", fake_q4)
    monkeypatch.setattr(native_stack, "time_variants", lambda lins, rows, variants, repeats: [1.0] * len(variants))
    model, blocks = q4_tiny_model(seed=4)
    assert attach_small_gemm(model, packed=True) and attach_q4_reads(model, blocks)
    plan = native_stack.cached_kernel_plan(model, (True, False), (1, 2, 4))
    assert timed == [1, 2, 4]
    down = model.decoder_layers()[0].down
    if not q4_probes:
        assert plan.q4_rows == 0 and down.small_records is None
        assert "Q4_1" not in plan.describe()
        return
    assert [r for r in range(1, 65) if reads_copy(plan.q4_rows, r)] == [1, 2, 3]
    assert plan.describe().startswith("Q4_1 records for 1-3 rows")
    assert down.small_record_rows == plan.q4_rows and getattr(model.lm_head, "small_records", None) is None
    x = torch.randn(5, down.in_features)
    want = {r: linear(down, x[:r]) for r in range(1, 6)}
    assert attach_native_stack(model)
    prompt = list(range(3, 8))
    cache = model.new_cache(1, 16)
    slot = cache.allocate()

    def logits(rows: int) -> torch.Tensor:
        cache.truncate(slot, 0)
        return model(ForwardBatch.build(cache, [slot], [prompt[:rows]]), cache)

    before = {r: logits(r) for r in (1, 3, 4)}
    down.small_records.data.zero_()
    for r, b in before.items():
        assert torch.equal(logits(r), b) == (r > 3)  # the stack read the zeroed records for 1-3 rows only
    for r, w in want.items():
        got = linear(down, x[:r])
        assert torch.equal(got, torch.zeros_like(w)) if r <= 3 else torch.equal(got, w)
    timed.clear()
    again, blocks = q4_tiny_model(seed=4)
    assert attach_small_gemm(again, packed=True) and attach_q4_reads(again, blocks)
    assert native_stack.cached_kernel_plan(again, (True, False), (1, 2, 4)).q4_rows == plan.q4_rows
    assert timed == [1]  # the stored choice at one row, timed against the other: not contradicted


@torch.no_grad()
def test_a_stored_plan_that_a_one_row_check_contradicts_is_measured_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A plan measured while another process timed beside it chose float32 weights at one row where the records
    read 3.5x faster, and every later load kept it: a load times the stored choice at one row against the other,
    and a choice more than RECHECK_MARGIN slower is measured again (and stored); a closer one is kept."""
    from specserve.models import native_stack
    from specserve.models.llama import reads_copy

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    records_s = {1: 2.0, 2: 0.5, 4: 2.0}  # the busy machine's timing: the records lost at one row
    measured: list[int] = []
    checked: list[tuple[bool, object]] = []  # the check's float32 layout and the records' prefetch

    def fake_q4(
        lins: list, rows: int, packed: bool, prefetch: object, record_prefetches: tuple, repeats: int
    ) -> tuple[float, tuple[float, ...]]:
        if repeats == native_stack.RECHECK_REPEATS:
            checked.append((packed, record_prefetches))
        return 1.0, tuple(records_s[rows] for _ in record_prefetches)

    def fake_variants(lins: list, rows: int, variants: list, repeats: int) -> list[float]:
        measured.append(rows)
        return [1.0] * len(variants)

    monkeypatch.setattr(native_stack, "time_records", fake_q4)
    monkeypatch.setattr(native_stack, "time_variants", fake_variants)

    def load() -> native_stack.KernelPlan:
        model, blocks = q4_tiny_model(seed=4)
        assert attach_small_gemm(model, packed=True) and attach_q4_reads(model, blocks)
        return native_stack.cached_kernel_plan(model, (True, False), (1, 2, 4))

    busy = load()
    assert [r for r in range(1, 65) if reads_copy(busy.q4_rows, r)] == [2, 3] and measured == [1, 2, 4]
    records_s[1] = 1.0 / native_stack.RECHECK_MARGIN * 1.01  # quiet now: within the margin, kept
    measured.clear()
    assert load() == busy and measured == []
    assert checked == [(bool(busy.packed_rows & 1), (busy.q4_prefetch[0],))]  # as the plan reads one row
    records_s[1] = 0.3  # the records read 3.3x faster at one row: measured again, and the new plan stored
    fresh = load()
    assert [r for r in range(1, 65) if reads_copy(fresh.q4_rows, r)] == [1, 2, 3] and measured == [1, 2, 4]
    measured.clear()
    assert load() == fresh and measured == []


@torch.no_grad()
def test_the_records_prefetch_as_measured_on_the_records(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """kernel_plan_for times the records with each prefetch, not with the one the float32 copies chose: here the
    copies keep none at one row and the records take l2 there, in the Python loop's and the C++ stack's plan, the
    LM head (no records) keeping the copies'; the stored plan brings both back."""
    from specserve.models import native_stack

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    ext = extension()
    asked: list[tuple[int, object, tuple]] = []

    def fake_q4(
        lins: list, rows: int, packed: bool, prefetch: object, record_prefetches: tuple, repeats: int
    ) -> tuple[float, tuple[float, ...]]:
        asked.append((rows, prefetch, record_prefetches))
        return 1.0, tuple(0.5 if rows == 1 and pf == ext.Prefetch.l2 else 0.9 for pf in record_prefetches)

    monkeypatch.setattr(native_stack, "time_records", fake_q4)
    monkeypatch.setattr(native_stack, "time_variants", lambda lins, rows, variants, repeats: [1.0] * len(variants))
    model, blocks = q4_tiny_model(seed=4)
    assert attach_small_gemm(model, packed=True) and attach_q4_reads(model, blocks)
    plan = native_stack.cached_kernel_plan(model, (True, False), (1, 2, 4))
    none, l1, l2 = ext.Prefetch.none, ext.Prefetch.l1, ext.Prefetch.l2
    assert asked == [(1, none, (none, l2)), (2, l1, (l1, l2)), (4, l1, (l1, l2))]  # float32 chose the built-in ones
    assert plan.q4_rows == EVERY_ROW and plan.prefetch[:2] == (none, l1)
    down = model.decoder_layers()[0].down
    assert down.small_prefetch[:3] == (l2, l1, l1) and model.lm_head.small_prefetch == plan.prefetch
    assert plan.describe().endswith("Q4_1 records' prefetch l1 for 2-64 rows, l2 for 1 row")
    assert attach_native_stack(model)
    assert native_stack._proj(ext, down).small_prefetch[:2] == [l2, l1]
    asked.clear()
    again, blocks = q4_tiny_model(seed=4)
    assert attach_small_gemm(again, packed=True) and attach_q4_reads(again, blocks)
    assert native_stack.cached_kernel_plan(again, (True, False), (1, 2, 4)) == plan
    assert asked == [(1, none, (l2,))]  # (the one-row check of the stored choice, with the records' own prefetch)
    assert again.decoder_layers()[0].down.small_prefetch == down.small_prefetch


@torch.no_grad()
def test_float32_copies_serve_only_the_row_counts_the_records_do_not() -> None:
    """The records are read first, so a decoder projection's packed float32 copy keeps the other row counts only
    (dropped where the records take them all); the LM head, without records, keeps the plan's packed rows."""
    from specserve.models import native_stack

    ext = extension()
    model, blocks = q4_tiny_model(seed=5)
    assert attach_small_gemm(model, packed=True) and attach_q4_reads(model, blocks)
    prefetch = tuple([ext.Prefetch.l1] * 64)
    native_stack.apply_plan(model, native_stack.KernelPlan(EVERY_ROW, prefetch, q4_rows=0b111))
    down = model.decoder_layers()[0].down
    assert down.small_copy_rows == EVERY_ROW & ~0b111 and down.small_record_rows == 0b111
    assert model.lm_head.small_copy_rows == EVERY_ROW
    plan = native_stack.KernelPlan(0b111, prefetch, q4_rows=0b111)
    assert plan.describe().startswith(
        "Q4_1 records for 1-3 rows; packed copies for no rows (the LM head's for 1-3 rows)"
    )
    native_stack.apply_plan(model, plan)
    assert down.small_packed is None and down.small_records is not None
    assert model.lm_head.small_packed is not None and model.lm_head.small_copy_rows == 0b111


@torch.no_grad()
def test_the_plan_times_the_records_for_real() -> None:
    """kernel_plan_for with its own timing (one repeat): a valid mask for the records, and the model's logits
    unchanged whichever row counts they took."""
    from specserve.models import native_stack

    (plain, _), (q4, blocks) = q4_tiny_model(seed=6), q4_tiny_model(seed=6)
    assert attach_small_gemm(plain) and attach_small_gemm(q4, packed=True) and attach_q4_reads(q4, blocks)
    plan = native_stack.kernel_plan_for(q4, (True, False), (1, 2, 4), repeats=1)
    assert 0 <= plan.q4_rows <= EVERY_ROW
    assert all((plan.q4_rows >> r & 1) == (plan.q4_rows >> 3 & 1) for r in range(3, 64))  # probe 4 serves 4-64
    prompt = [int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(2))]
    assert torch.equal(forwards(plain, prompt), forwards(q4, prompt))
