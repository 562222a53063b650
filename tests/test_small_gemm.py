"""The small-product kernel (models/csrc/small_gemm.cpp): right values, the same bits for a row whatever the other
rows, every instruction-set path this CPU runs, clear errors, and the loader's switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specserve.models.batch import ForwardBatch
from specserve.models.llama import linear, reads_copy
from specserve.models.native_stack import (
    NativeStackUnavailable,
    attach_native_stack,
    attach_small_gemm,
    extension,
    small_gemm_available,
)
from specserve.models.tiny import tiny_config, tiny_model

try:
    extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ extension cannot be built here: {e}", allow_module_level=True)
if not small_gemm_available():  # pragma: no cover - a CPU without AVX2 + FMA
    pytest.skip("this CPU runs no small_gemm path", allow_module_level=True)

ISAS = list(extension().small_gemm_isas())
# (K, N): SmolLM2's layer shapes, K with a partial last chunk of lanes (45: in the second 8-lane half of a 16-float
# chunk, where AVX2 reads the packed layout's half), an N that is not a multiple of the block
SHAPES = [(576, 960), (1536, 576), (37, 13), (45, 10), (64, 7), (200, 1030)]


def ref_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_values_match_a_float64_reference(isa: str, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(64, k, generator=gen)
    for rows in (1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 64):
        for bias in (b, None):
            got = extension().small_linear_isa(x[:rows], w, bias, isa)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            # float32 sums of k products of N(0, 1) values: error ~ k * eps * sqrt(k) at worst
            torch.testing.assert_close(got.double(), ref_linear(x[:rows], w, bias), rtol=0, atol=1e-5 * k**1.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_a_row_gets_the_same_bits_whatever_the_other_rows(isa: str, k: int, n: int) -> None:
    """Batch invariance: row i of a product of r rows equals the product of row i alone, for every r and i, and
    does not depend on what the other rows hold."""
    gen = torch.Generator().manual_seed(n)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(64, k, generator=gen)
    alone = torch.cat([extension().small_linear_isa(x[i : i + 1], w, b, isa) for i in range(64)])
    for rows in [*range(1, 18), 31, 47, 64]:
        assert torch.equal(extension().small_linear_isa(x[:rows], w, b, isa), alone[:rows])
    other = x.clone()
    other[1:] = torch.randn(63, k, generator=gen) * 100
    assert torch.equal(extension().small_linear_isa(other, w, b, isa)[0], alone[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_the_packed_layout_gives_the_row_major_bits(isa: str, k: int, n: int) -> None:
    """The packed copy (blocks of 4 rows side by side, K padded to 16, the N % 4 last rows after) is read as the
    weight it came from: every product equal bit for bit, at every row count, with and without a bias."""
    gen = torch.Generator().manual_seed(7 * n + k)
    w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(64, k, generator=gen)
    packed = extension().small_pack(w)
    assert (packed.n, packed.k) == (n, k) and packed.data.numel() == n * ((k + 15) // 16 * 16)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 33, 64):
        for bias in (b, None):
            want = extension().small_linear_isa(x[:rows], w, bias, isa)
            assert torch.equal(extension().small_linear_packed_isa(x[:rows], packed, bias, isa), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_bf16_weights_give_the_bits_of_their_float32_values(isa: str, k: int, n: int) -> None:
    """A bfloat16 weight, row-major or packed, is widened lane by lane to the float32 it holds: every product equals
    the kernel's over the float32 copy bit for bit (ragged K: the tail chunk too), at every row count, with and
    without a bias."""
    gen = torch.Generator().manual_seed(11 * n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b, x = torch.randn(n, generator=gen), torch.randn(64, k, generator=gen)
    packed = extension().small_pack(w)
    assert packed.data.dtype == torch.bfloat16 and (packed.n, packed.k) == (n, k)
    for rows in (1, 2, 3, 5, 6, 7, 8, 13, 33, 64):
        for bias in (b, None):
            want = extension().small_linear_isa(x[:rows], w.float(), bias, isa)
            assert torch.equal(extension().small_linear_bf16_isa(x[:rows], w, bias, isa), want)
            assert torch.equal(extension().small_linear_packed_isa(x[:rows], packed, bias, isa), want)  # packed bf16


def test_bf16_reads_only_where_bf16_holds_the_weight_exactly() -> None:
    """``bf16_reads`` gives a head's bf16-exact weights (shipped in bf16, computed in float32) a bf16 copy and leaves
    any other weight on its float32 values; the head's outputs do not change by a bit."""
    from specserve.models.native_stack import bf16_exact
    from specserve.models.tiny import tiny_head

    target = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=2)
    head = tiny_head(target, seed=3)
    with torch.no_grad():
        for mod in (head.fc, head.layer.qkv, head.layer.down):
            mod.weight.copy_(mod.weight.to(torch.bfloat16).float())
    assert bf16_exact(head.fc.weight) and not bf16_exact(head.layer.o_proj.weight)
    h, x = torch.randn(4, target.cfg.hidden_size), torch.randn(3, head.fc.in_features)
    a = torch.randn(5, head.layer.qkv.in_features)
    assert attach_small_gemm(head)
    want = linear(head.fc, x), linear(head.layer.qkv, a), linear(head.layer.o_proj, h), head.logits(h)
    assert attach_small_gemm(head, bf16_reads=True)
    for mod in (head.fc, head.layer.qkv, head.layer.down):
        assert mod.small_packed.data.dtype == torch.bfloat16 and mod.small_copy_gemm == extension().small_linear_packed
    assert head.layer.o_proj.small_packed is None  # not bf16-exact: read as float32
    got = linear(head.fc, x), linear(head.layer.qkv, a), linear(head.layer.o_proj, h), head.logits(h)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_the_default_path_is_the_best_detected() -> None:
    w, x = torch.randn(40, 96), torch.randn(3, 96)
    assert torch.equal(extension().small_linear(x, w), extension().small_linear_isa(x, w, None, ISAS[0]))


def test_products_are_split_over_torchs_threads() -> None:
    """The kernel's parallel loop is ATen's header template, serial unless the extension is built with OpenMP: built
    without it every product ran on one core. It follows torch's thread setting (a worker given one thread keeps
    to one)."""
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            assert extension().small_gemm_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif("avx2" not in ISAS, reason="this CPU has no AVX2 + FMA path")
def test_the_path_can_be_chosen_by_name_for_benchmarks() -> None:
    """SPECSERVE_SMALL_GEMM_ISA=avx2 runs the AVX2 path on any CPU with it (an AVX-512 one included); a name the
    CPU lacks, or no ISA at all, is a clear error at the first product."""
    code = (
        "import torch\n"
        "from specserve.models.native_stack import extension\n"
        "ext = extension()\n"
        "w, x = torch.randn(40, 100), torch.randn(3, 100)\n"
        "assert ext.small_gemm_isa() == 'avx2', ext.small_gemm_isa()\n"
        "assert torch.equal(ext.small_linear(x, w), ext.small_linear_isa(x, w, None, 'avx2'))\n"
    )
    env = {**os.environ, "SPECSERVE_SMALL_GEMM_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    env["SPECSERVE_SMALL_GEMM_ISA"] = "neon"
    bad = "from specserve.models.native_stack import extension\nextension().small_gemm_isa()\n"
    done = subprocess.run([sys.executable, "-c", bad], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "avx512 or avx2, not neon" in done.stderr
    bad = "from specserve.models.native_stack import small_gemm_available\nsmall_gemm_available()\n"
    done = subprocess.run([sys.executable, "-c", bad], env=env, capture_output=True, text=True, timeout=300)
    assert "SettingsError: SPECSERVE_SMALL_GEMM_ISA: avx512 or avx2, not neon" in done.stderr  # what loading asks
    assert extension().small_gemm_isa() == (os.environ.get("SPECSERVE_SMALL_GEMM_ISA") or ISAS[0])  # unset: the best


def test_bad_arguments_are_clear_errors() -> None:
    ext = extension()
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match=r"1\.\.64 rows"):
        ext.small_linear(torch.randn(65, 32), w)
    with pytest.raises(RuntimeError, match="float32"):
        ext.small_linear(torch.randn(2, 32, dtype=torch.float64), w.double())
    with pytest.raises(RuntimeError, match="want x"):
        ext.small_linear(torch.randn(2, 31), w)
    with pytest.raises(RuntimeError, match="does not run"):
        ext.small_linear_isa(torch.randn(2, 32), w, None, "neon")
    with pytest.raises(ValueError, match=r"1\.\.64"):
        attach_small_gemm(tiny_model(), rows=65)
    with pytest.raises(RuntimeError, match="float32"):
        ext.small_pack(w.double())
    with pytest.raises(RuntimeError, match=r"want x \[M, 32\]"):
        ext.small_linear_packed(torch.randn(2, 31), ext.small_pack(w))
    with pytest.raises(RuntimeError, match="bfloat16 CPU weight"):
        ext.small_linear_bf16(torch.randn(2, 32), w)


@torch.no_grad()  # the tiny model's weights require grad; serving runs without autograd
def test_the_switch_attaches_to_float_linears_and_the_stack_uses_it() -> None:
    model = tiny_model(tiny_config("llama", num_hidden_layers=2), seed=4)
    cache = model.new_cache(1, 32)
    slot = cache.allocate()
    before = model(ForwardBatch.build(cache, [slot], [[3, 1, 4, 1, 5]]), cache)
    assert attach_small_gemm(model)
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert lins and all(m.small_rows == 64 for m in lins)
    x = torch.randn(5, model.cfg.hidden_size)
    assert torch.equal(linear(model.lm_head, x), extension().small_linear(x, model.lm_head.weight))
    assert torch.equal(linear(model.lm_head, x.repeat(14, 1)), F.linear(x.repeat(14, 1), model.lm_head.weight))  # 70
    outs = []
    for native in (False, True):
        if native:
            assert attach_native_stack(model)
        cache.truncate(slot, 0)
        outs.append(model(ForwardBatch.build(cache, [slot], [[3, 1, 4, 1, 5]]), cache))
    torch.testing.assert_close(outs[0], before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1], before, rtol=1e-4, atol=1e-4)
    assert not torch.equal(outs[0], before)  # the kernel really ran (another summation order than BLAS)
    bf16 = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=4).to(torch.bfloat16)
    assert not attach_small_gemm(bf16)


@torch.no_grad()
def test_packed_copies_change_no_bit_of_a_forward() -> None:
    """A model whose kernel reads packed copies (ModelSpec.small_gemm_packed) computes the logits of the same model
    reading its row-major weights, bit for bit, through the Python loop and the C++ stack, at 1-64 rows."""
    ragged = tiny_config("llama", num_hidden_layers=2, hidden_size=72, intermediate_size=100)  # K % 16 != 0
    models = [tiny_model(ragged, seed=6) for _ in range(2)]
    assert attach_small_gemm(models[0]) and attach_small_gemm(models[1], packed=True)
    assert models[0].lm_head.small_packed is None and models[1].lm_head.small_packed is not None
    assert all(getattr(m, "small_packed", None) is not None for m in models[1].modules() if type(m) is torch.nn.Linear)
    prompt = [int(t) for t in torch.randint(0, ragged.vocab_size, (40,), generator=torch.Generator().manual_seed(1))]
    for native in (False, True):
        outs = []
        for model in models:
            if native:
                assert attach_native_stack(model)
            cache = model.new_cache(1, 128)
            slot = cache.allocate()
            steps = [model(ForwardBatch.build(cache, [slot], [prompt]), cache)]  # 40 rows
            steps += [model(ForwardBatch.build(cache, [slot], [[t]]), cache) for t in (5, 17)]
            steps.append(model(ForwardBatch.build(cache, [slot], [list(range(3, 67))]), cache))  # 64 rows
            outs.append(torch.cat(steps))
        assert torch.equal(outs[0], outs[1])
    # the copies are what runs: zero a layer's in the C++ stack (attached above), then the Python loop's LM head's
    cache = models[1].new_cache(1, 8)
    slot = cache.allocate()
    before = models[1](ForwardBatch.build(cache, [slot], [prompt[:3]]), cache)
    models[1].layers[0].down.small_packed.data.zero_()
    cache.truncate(slot, 0)
    assert not torch.equal(models[1](ForwardBatch.build(cache, [slot], [prompt[:3]]), cache), before)
    models[1].native_stack = None
    models[1].lm_head.small_packed.data.zero_()
    cache.truncate(slot, 0)
    assert not models[1](ForwardBatch.build(cache, [slot], [prompt[:3]]), cache).any()
    with pytest.raises(ValueError, match="frozen"):
        from specserve.models.tiny import tiny_head

        attach_small_gemm(tiny_head(models[0], seed=1), packed=True)


def test_every_prefetch_gives_the_same_bits() -> None:
    ext = extension()
    gen = torch.Generator().manual_seed(3)
    w, b, x = (
        torch.randn(1030, 200, generator=gen),
        torch.randn(1030, generator=gen),
        torch.randn(64, 200, generator=gen),
    )
    packed, w16 = ext.small_pack(w), w.to(torch.bfloat16)
    for rows in (1, 2, 5, 8, 13, 64):
        want, want16 = ext.small_linear(x[:rows], w, b), ext.small_linear_bf16(x[:rows], w16, b)
        for pf in (ext.Prefetch.none, ext.Prefetch.l1, ext.Prefetch.l2):
            assert torch.equal(ext.small_linear(x[:rows], w, b, pf), want)
            assert torch.equal(ext.small_linear_packed(x[:rows], packed, b, pf), want)
            assert torch.equal(ext.small_linear_bf16(x[:rows], w16, b, pf), want16)


def test_probe_mask_gives_each_winning_probe_its_rows_up_to_the_next() -> None:
    from specserve.models.native_stack import EVERY_ROW, describe_rows, probe_mask

    probes = (1, 2, 4, 8, 16, 32)
    assert probe_mask(probes, [True] * 6) == EVERY_ROW
    assert probe_mask(probes, [False] * 6) == 0
    mask = probe_mask(probes, [True, True, True, True, False, False])
    assert [r for r in range(1, 65) if reads_copy(mask, r)] == list(range(1, 16))
    mask = probe_mask(probes, [True, False, False, True, False, True])
    assert [r for r in range(1, 65) if reads_copy(mask, r)] == [1, *range(8, 16), *range(32, 65)]
    assert describe_rows(mask) == "1, 8-15, 32-64 rows" and describe_rows(0) == "no rows"
    assert describe_rows(0b1) == "1 row" and describe_rows(0b10) == "2 rows"
    for bad in ((2, 4), (1, 4, 2), (1, 65), ()):
        with pytest.raises(ValueError, match="ascend"):
            probe_mask(bad, [True] * len(bad))


@torch.no_grad()
@pytest.mark.parametrize("wins", [(True, False, True), (False, False, False)])
def test_the_measured_plan_is_what_each_row_count_runs(monkeypatch: pytest.MonkeyPatch, wins: tuple) -> None:
    """kernel_plan_for sets its measured plan on every kernel linear: both the Python loop and the C++ stack read
    the packed copies for exactly the row counts whose probe chose them (a zeroed copy shows which path ran), and
    take each count's prefetch; where no count gains, the copies are dropped."""
    from specserve.models import native_stack

    ext = extension()
    probes = (1, 2, 4)
    fastest = {1: ext.Prefetch.l2, 2: ext.Prefetch.l1, 4: ext.Prefetch.l2}
    verdicts = dict(zip(probes, wins, strict=True))

    def fake_times(lins: list, rows: int, variants: list, repeats: int) -> list[float]:
        return [
            (0.5 if packed and verdicts[rows] else 1.0) + (0.0 if pf == fastest[rows] else 0.1)
            for packed, pf in variants
        ]

    monkeypatch.setattr(native_stack, "time_variants", fake_times)
    model = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=6)
    assert attach_small_gemm(model, packed=True)
    plan = native_stack.kernel_plan_for(model, (True, False), probes)
    mask = plan.packed_rows
    assert plan.prefetch == (ext.Prefetch.l2, ext.Prefetch.l1, ext.Prefetch.l1, *[ext.Prefetch.l2] * 61)
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert all(m.small_copy_rows == mask and m.small_prefetch == plan.prefetch for m in lins)
    assert native_stack._proj(ext, model.lm_head).small_prefetch == list(plan.prefetch)
    if not any(wins):
        assert mask == 0 and all(m.small_packed is None for m in lins)
        assert plan.describe() == "packed copies for no rows; prefetch l1 for 2-3 rows, l2 for 1, 4-64 rows"
        return
    assert [r for r in range(1, 65) if reads_copy(mask, r)] == [1, *range(4, 65)]
    # the C++ stack: a layer's zeroed copy changes the logits of 1 and 4 rows, not of 2 or 3
    assert attach_native_stack(model)
    cache = model.new_cache(1, 32)
    slot = cache.allocate()

    def logits(tokens: list[int]) -> torch.Tensor:
        cache.truncate(slot, 0)
        return model(ForwardBatch.build(cache, [slot], [tokens]), cache)

    before = {r: logits(list(range(3, 3 + r))) for r in (1, 2, 3, 4)}
    model.layers[0].down.small_packed.data.zero_()
    for r, b in before.items():
        assert torch.equal(logits(list(range(3, 3 + r))), b) == (not reads_copy(mask, r))
    # the Python path: the LM head's zeroed copy makes a product that reads it zero
    x = torch.randn(64, model.cfg.hidden_size)
    want = {r: linear(model.lm_head, x[:r]) for r in (1, 2, 3, 4, 9)}
    model.lm_head.small_packed.data.zero_()
    for r, w in want.items():
        assert torch.equal(linear(model.lm_head, x[:r]), torch.zeros_like(w) if reads_copy(mask, r) else w)


@torch.no_grad()
@pytest.mark.parametrize(("gain", "chosen"), [(0.99, False), (0.95, True)])
def test_a_variant_replaces_the_built_in_one_only_by_the_margin(
    monkeypatch: pytest.MonkeyPatch, gain: float, chosen: bool
) -> None:
    """Packed copies and the l2 prefetch that measure 1% faster than the row-major weights with the built-in prefetch
    are noise and not taken; 5% faster they are."""
    from specserve.models import native_stack

    ext = extension()
    built_in = {1: ext.Prefetch.none, 2: ext.Prefetch.l1}

    def fake_times(lins: list, rows: int, variants: list, repeats: int) -> list[float]:
        return [(gain if packed else 1.0) * (1.0 if pf == built_in[rows] else gain) for packed, pf in variants]

    monkeypatch.setattr(native_stack, "time_variants", fake_times)
    model = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=6)
    assert attach_small_gemm(model, packed=True)
    plan = native_stack.kernel_plan_for(model, (True, False), (1, 2))
    assert plan.packed_rows == (native_stack.EVERY_ROW if chosen else 0)
    want = (ext.Prefetch.l2,) * 64 if chosen else (ext.Prefetch.none, *[ext.Prefetch.l1] * 63)
    assert plan.prefetch == want


@torch.no_grad()
def test_the_kernel_plan_is_measured_once_per_machine_and_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The loader's plan is timed on the first load and kept in the cache; a later load of the same model sets the
    same plan without timing; another model shape or set of layouts is timed anew; an unreadable file is timed
    again and replaced."""
    from specserve.config import ModelSpec
    from specserve.models import native_stack
    from specserve.models.loader import attach_cpu_paths

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    ext = extension()
    timed: list[int] = []

    def fake_times(lins: list, rows: int, variants: list, repeats: int) -> list[float]:
        timed.append(rows)  # packed copies win at 2 rows only, l2 wins at 4
        return [(0.5 if packed and rows == 2 else 1.0) * (0.5 if pf == ext.Prefetch.l2 and rows == 4 else 1.0)
                for packed, pf in variants]  # fmt: skip

    monkeypatch.setattr(native_stack, "time_variants", fake_times)

    def load(layers: int = 1, spec: ModelSpec | None = None) -> torch.nn.Module:
        model = tiny_model(tiny_config("llama", num_hidden_layers=layers), seed=6)
        attach_cpu_paths(model, spec or ModelSpec())
        return model

    first = load()
    assert timed == list(native_stack.PLAN_PROBES)
    stored = list((tmp_path / "profiles").glob("kernel-plan-*.json"))
    assert len(stored) == 1
    timed.clear()
    again = load()
    assert timed == []  # set from the cache
    for a, b in zip(native_stack.kernel_linears(first), native_stack.kernel_linears(again), strict=True):
        assert a.small_prefetch == b.small_prefetch and a.small_copy_rows == b.small_copy_rows
    lm = again.lm_head
    assert [r for r in range(1, 65) if reads_copy(lm.small_copy_rows, r)] == [2, 3]
    assert lm.small_prefetch[3] == ext.Prefetch.l2 and lm.small_prefetch[1] == ext.Prefetch.l1
    assert again.native_stack is not None  # the C++ stack was built over the planned projections
    load(layers=2)
    assert timed == list(native_stack.PLAN_PROBES)  # another model: its own plan
    timed.clear()
    load(spec=ModelSpec(small_gemm_packed=False))
    assert timed == list(native_stack.PLAN_PROBES)  # other layouts measured: another plan
    timed.clear()
    stored[0].write_text("{not json")
    load()
    assert timed == list(native_stack.PLAN_PROBES)
    assert json.loads(stored[0].read_text())["packed_rows"] == lm.small_copy_rows


@torch.no_grad()
def test_time_variants_times_each_variant_in_changing_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The passes change the variants' order, and each time still lands on its own variant: the one whose products
    are slowed down measures slower in whichever slot it runs. The timer's clock is one only the slowed products
    advance (real sleeps on a real clock failed 3 runs in 30 on a loaded 2-core host)."""
    from types import SimpleNamespace

    from specserve import timing
    from specserve.models import native_stack

    ext = extension()
    order: list[str] = []
    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class SlowPacked:
        def __getattr__(self, name: str) -> object:
            return getattr(ext, name)

        def small_linear_packed(self, *args: object) -> torch.Tensor:
            order.append("packed")
            now[0] += 0.002
            return ext.small_linear_packed(*args)

        def small_linear(self, *args: object) -> torch.Tensor:
            order.append("rowmajor")
            return ext.small_linear(*args)

    monkeypatch.setattr(native_stack, "extension", lambda: SlowPacked())
    model = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=6)
    assert attach_small_gemm(model, packed=True)
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    variants = [(True, ext.Prefetch.l1), (False, ext.Prefetch.l1), (False, ext.Prefetch.l2)]
    times = native_stack.time_variants(lins, 2, variants, repeats=3)
    assert times[0] == pytest.approx(0.002 * len(lins)) and times[1:] == [0.0, 0.0]
    # pass by pass (the untimed one, then three timed ones in the first balanced orders [0, 1, 2], [1, 2, 0],
    # [2, 0, 1]), the packed variant ran first, first, last, then second
    lasts = [order[(i + 1) * 3 * len(lins) - 1] for i in range(4)]
    firsts = [order[i * 3 * len(lins)] for i in range(4)]
    assert firsts == ["packed", "packed", "rowmajor", "rowmajor"] and lasts[2] == "packed" != lasts[3]


@pytest.mark.real_model
def test_the_loaded_target_takes_the_kernel_and_agrees_with_blas() -> None:
    from specserve.config import ModelSpec
    from specserve.models.loader import load_model

    target = load_model(ModelSpec())
    blas = load_model(ModelSpec(small_gemm=False, gemv_copies=False, pad_rows=False))
    assert target.lm_head.small_rows == 64 and getattr(blas.lm_head, "small_gemm", None) is None
    # ModelSpec.small_gemm_plan: the plan was measured at load and set on every kernel product (one prefetch per row
    # count; without it no product carries one; the decoder projections, all reading Q4_1 records where they do, one
    # plan), and with no row count reading the copies they were dropped
    lins = [m for m in target.modules() if getattr(m, "small_gemm", None) is not None]
    projections = [m for m in lins if m is not target.lm_head]
    assert all(len(m.small_prefetch) == 64 for m in lins)
    assert all(m.small_prefetch == projections[0].small_prefetch for m in projections)
    assert getattr(blas.lm_head, "small_prefetch", None) is None
    assert target.lm_head.small_copy_rows != 0 or target.lm_head.small_packed is None
    assert getattr(target.lm_head, "weight_t", None) is None  # no GEMV copies beside the kernel
    prompt = torch.randint(0, target.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (target, blas):
        cache = model.new_cache(1, 64)
        slot = cache.allocate()
        model(ForwardBatch.build(cache, [slot], [prompt]), cache)
        steps = [model(ForwardBatch.build(cache, [slot], [[t]]), cache) for t in (5, 17, 99)]
        steps.append(model(ForwardBatch.build(cache, [slot], [[7, 8, 9, 10, 11, 12]]), cache))
        logits.append(torch.cat(steps))
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4 * logits[1].abs().max().item())


@torch.no_grad()
def test_a_head_takes_the_kernel_for_its_layer_and_its_lm_head_slice() -> None:
    from specserve.models.tiny import tiny_head

    target = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=2)
    head = tiny_head(target, seed=3)
    head.set_draft_vocab(torch.arange(0, 512, 2))
    h = torch.randn(4, target.cfg.hidden_size)
    x = torch.randn(3, head.fc.in_features)
    before_logits, before_fc = head.logits(h), linear(head.fc, x)
    assert attach_small_gemm(head)
    assert head.small_rows == 64 and head.fc.small_rows == 64 and head.layer.down.small_rows == 64
    got = head.logits(h)
    assert torch.equal(got, extension().small_linear(h, head.target_lm_head))
    torch.testing.assert_close(got, before_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(head.fc, x), before_fc, rtol=1e-5, atol=1e-5)
    assert torch.equal(head.logits(h.repeat(17, 1)), (h.repeat(17, 1) @ head.target_lm_head.t()).float())  # 68 rows


@pytest.mark.real_model
def test_the_shipped_head_follows_its_targets_switch() -> None:
    from specserve.config import MODEL_PAIRS, ModelSpec
    from specserve.models.loader import load_draft, load_model

    target_spec, head_spec = MODEL_PAIRS["smollm2-eagle"]
    for small in (True, False):
        target = load_model(target_spec.model_copy(update={"small_gemm": small}))
        head = load_draft(head_spec, target)
        assert (head.small_gemm is not None) == small
        assert (getattr(head.fc, "small_gemm", None) is not None) == small
        lins = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
        # quantised at load (HeadSpec.quantize, Q8_0 by default): every linear read from its records on the kernel
        assert lins and all((getattr(m, "small_records", None) is not None) == small for m in lins)
        # prefetching as the target's plan measured on this machine says (ModelSpec.small_gemm_plan)
        plan = getattr(target.lm_head, "small_prefetch", None)
        assert (plan is not None) == small and all(getattr(m, "small_prefetch", None) is plan for m in lins)
        if small:  # as shipped (bf16): every linear read from a packed bf16 copy (HeadSpec.bf16_reads)
            as_shipped = load_draft(head_spec.model_copy(update={"quantize": "none"}), target)
            lins = [m for m in as_shipped.modules() if isinstance(m, torch.nn.Linear)]
            assert lins and all(m.small_packed.data.dtype == torch.bfloat16 for m in lins)
            assert all(getattr(m, "small_records", None) is None for m in lins)
    target = load_model(target_spec)
    head = load_draft(head_spec.model_copy(update={"bf16_reads": False, "quantize": "none"}), target)
    assert head.fc.small_gemm is not None and head.fc.small_packed is None
    # the head's layer from the C++ stack where the target has one (HeadSpec.native_layer, on)
    assert target.native_stack is not None and head.native_stack is not None
    assert load_draft(head_spec.model_copy(update={"native_layer": False}), target).native_stack is None
    unplanned = load_model(target_spec.model_copy(update={"small_gemm_plan": False}))
    assert all(getattr(m, "small_prefetch", None) is None for m in load_draft(head_spec, unplanned).modules())
    no_stack = load_model(target_spec.model_copy(update={"native_stack": False}))
    assert load_draft(head_spec, no_stack).native_stack is None
    assert ModelSpec().small_gemm


def test_a_model_converted_after_attaching_falls_back_to_blas() -> None:
    model = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=8)
    assert attach_small_gemm(model)
    model.to(torch.bfloat16)
    x = torch.randn(3, model.cfg.hidden_size, dtype=torch.bfloat16)
    assert torch.equal(linear(model.lm_head, x), F.linear(x, model.lm_head.weight))


def test_the_kernel_is_skipped_where_it_cannot_serve() -> None:
    """No rows, a non-contiguous weight, or autograd (the kernel has no backward): BLAS, and gradients flow."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=9)
    assert attach_small_gemm(model)
    lin = model.lm_head
    assert linear(lin, torch.randn(0, model.cfg.hidden_size)).shape == (0, model.cfg.vocab_size)
    x = torch.randn(2, model.cfg.hidden_size, requires_grad=True)
    linear(lin, x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, lin.weight.detach().sum(0).expand(2, -1))
    t = torch.nn.Linear(8, 6, bias=False)
    t.weight = torch.nn.Parameter(torch.randn(6, 8).t().contiguous().t(), requires_grad=False)  # non-contiguous
    t.small_gemm, t.small_rows = extension().small_linear, 64
    with torch.no_grad():
        assert torch.equal(linear(t, torch.ones(2, 8)), F.linear(torch.ones(2, 8), t.weight))


def test_products_of_more_rows_than_the_kernel_takes_give_each_row_its_own_bits() -> None:
    """Past 64 rows (a large batch's verify, a short prompt with its drafts) BLAS ran, whose bits for a row are not
    the kernel's: up to ``chunks`` rows the kernel now runs 64 rows at a time, so every row gets its one-row
    product's bits; past them BLAS still runs (long prefills, where it is the faster)."""
    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(200, 1030, bias=True)
    assert attach_small_gemm(lin, chunks=150)
    x = torch.randn(151, 200, generator=gen)
    blas = torch.nn.Linear(200, 1030, bias=True)
    blas.load_state_dict(lin.state_dict())
    with torch.inference_mode():
        alone = torch.cat([linear(lin, row[None]) for row in x])
        assert torch.equal(linear(lin, x[:150]), alone[:150])
        torch.testing.assert_close(linear(lin, x[:150]), ref_linear(x[:150], lin.weight, lin.bias).float())
        assert torch.equal(linear(lin, x), blas(x))  # past the chunks: BLAS's bits


@pytest.mark.real_model
@pytest.mark.parametrize("native_stack", [True, False])
@pytest.mark.parametrize("prompt_len", [58, 100])
def test_a_prompt_and_its_drafts_in_one_forward_get_plain_decodings_bits(native_stack: bool, prompt_len: int) -> None:
    """A draft model's first step verifies the prompt and its drafts in one forward: past 64 rows their logits
    were BLAS's, not the kernel's of plain decoding (the prompt, then one token a step), so greedy speculation
    could pick another token at a near-tie."""
    from specserve.config import ModelSpec
    from specserve.models.loader import load_model

    model = load_model(ModelSpec(native_stack=native_stack))
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=gen)
    drafts = torch.randint(0, model.cfg.vocab_size, (8,), generator=gen)
    with torch.inference_mode():
        cache = model.new_cache(1, prompt_len + 8)
        slot = cache.allocate()
        plain = [model(ForwardBatch.build(cache, [slot], [prompt], num_logits=[1]), cache)]
        plain += [model(ForwardBatch.build(cache, [slot], [t[None]]), cache) for t in drafts]
        cache.truncate(slot, 0)
        together = model(ForwardBatch.build(cache, [slot], [torch.cat([prompt, drafts])], num_logits=[9]), cache)
    assert torch.equal(torch.cat(plain), together)


@pytest.mark.real_model
def test_a_loaded_target_takes_the_kernel_with_autograd_on_too() -> None:
    """Its weights required gradients, so a forward outside inference mode (a script, a benchmark) skipped the
    kernel for BLAS and got other bits than serving does."""
    from specserve.config import ModelSpec
    from specserve.models.loader import load_model

    model = load_model(ModelSpec())
    hidden = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert not any(p.requires_grad for p in model.parameters())
    with torch.inference_mode():
        served = model.logits(hidden)
    assert torch.equal(model.logits(hidden), served)
