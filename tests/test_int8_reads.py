"""Products over Q4_1 blocks with int8 activations (ModelSpec.int8_reads), on the AMX tiles, with AVX512-VNNI and
with AVX2: each row the product of its activations rounded to int8 per group of 32 (a reference written here from the
rounding rule) with the dequantised weight, the same bits whatever else the product holds and on every kernel; the
loader attaches them only where every decoder projection fits; speculation over such a target stays equal to its
plain greedy decoding."""

from __future__ import annotations

import logging

import pytest
import torch

from specserve.config import MODEL_PAIRS, PAIR_SPECULATION, ChainDraft, ModelSpec, SpecConfig, SpecMethod
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.lm_head import attach_bounded_argmax, greedy_ids
from specserve.models.native_stack import (
    Q8_HEAD_NAMES,
    NativeStackUnavailable,
    attach_int8_head,
    attach_int8_reads,
    attach_native_attention,
    attach_native_stack,
    attach_small_gemm,
    extension,
)
from specserve.models.q4 import Q4Blocks, Q8Blocks
from tests.test_q4_reads import q4_tiny_model, random_blocks
from tests.test_q8_head import random_q8

try:
    extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ extension cannot be built here: {e}", allow_module_level=True)

KERNELS = extension().int8_kernels()  # "amx", "avx512-vnni", "avx2": what this CPU and process run, the default first
Q8_KERNELS = [k for k in KERNELS if k != "amx"]  # the Q8_0 records' kernels (no AMX one)
needs_q8 = pytest.mark.skipif(not Q8_KERNELS, reason="this CPU or process has neither AVX512-VNNI nor AVX2")
needs_int8 = pytest.mark.skipif(not KERNELS, reason="this CPU or process runs no int8 kernel")
each_kernel = pytest.mark.parametrize("kernel", KERNELS or ["none here"])
each_q8_kernel = pytest.mark.parametrize("kernel", Q8_KERNELS or ["none here"])


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the products see it: each row's groups of 32 scaled to max |x| = 127 in float32, rounded half to even,
    scaled back by max |x| / 127; a group whose 127 / max |x| is not finite (all zeros, or tiny values) as zeros."""
    groups = x.view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.tensor(127.0) / amax
    inv = torch.where(inv.isfinite(), inv, torch.zeros_like(amax))
    return (torch.round(groups * inv).double() * (amax / 127.0).double()).view(x.shape)


@needs_int8
@each_kernel
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (64, 32), (128, 96)])
def test_each_row_is_its_int8_activations_times_the_dequantised_weight(kernel: str, n: int, k: int) -> None:
    ext = extension()
    blocks = random_blocks(n, k, seed=n + k)
    blocks.q[:16] = 15  # with a row of equal activations (every xq 127), the largest sums: AVX2's int16 pairs exact
    packed = ext.int8_pack_q4(blocks.q, blocks.d, blocks.m)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * 3
    x[3, :32] = 0.0  # a group of zeros: scale 0
    x[5, 7] = 500.0  # an outlier owns its group's scale
    x[7], x[8] = 2.5, -1.0
    x[9, -32:] = torch.linspace(-3e-38, 2e-38, 32)  # 127 / max |x| overflows: the group rounds to zeros
    w = blocks.dequantize().double()
    ref = int8_rounded(x) @ w.T
    bound = (int8_rounded(x).abs() @ w.abs().T) * 2e-6 + 1e-30  # float32 sums of the group terms
    y = ext.int8_linear(x, packed, kernel=kernel)
    assert y.dtype == torch.float32 and y.shape == (40, n)
    assert ((y.double() - ref).abs() <= bound).all()
    # against the float32 activations it is a rounding of the activations, not of the weights
    assert not torch.equal(y, (x.double() @ w.T).float())
    bias = torch.randn(n)
    assert torch.equal(ext.int8_linear(x, packed, bias, kernel=kernel), y + bias)


@needs_int8
@each_kernel
def test_every_row_gets_the_same_bits_alone_or_among_others(kernel: str) -> None:
    """1-40 rows (the tiles' products of 16 rows and a remainder; VNNI's records read in order for 1-4 rows and a
    block at a time in eights above; AVX2's 16 rows at a time): a verify's row is the row decoded alone."""
    ext = extension()
    blocks = random_blocks(192, 576, seed=7)
    packed = ext.int8_pack_q4(blocks.q, blocks.d, blocks.m)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(3))
    whole = ext.int8_linear(x, packed, kernel=kernel)
    alone = torch.cat([ext.int8_linear(x[i : i + 1], packed, kernel=kernel) for i in range(40)])
    assert torch.equal(whole, alone)
    for rows in (2, 3, 4, 5, 8, 9, 16, 17, 33):
        assert torch.equal(ext.int8_linear(x[:rows], packed, kernel=kernel), whole[:rows])
    assert torch.equal(ext.int8_linear(x[7:20], packed, kernel=kernel), whole[7:20])


def edge_groups(x: torch.Tensor) -> None:
    """Groups that test the rounding's edges, in place: zeros, tiny values, equal values, one outlier."""
    x[0, :32] = 0.0
    x[0, 32:64] = torch.linspace(-3e-38, 2e-38, 32)
    x[1, :64] = 2.5
    x[2, 40] = 1e4


@pytest.mark.skipif(len(KERNELS) < 2, reason="one int8 kernel here: nothing to compare it with")
def test_every_kernel_gives_the_same_bits() -> None:
    """The integer sums are exact on each and the rounding and the per-group scaling are the same operations in the
    same order, so a target may run on any (a replica on another CPU) and decode the same tokens."""
    ext = extension()
    blocks = random_blocks(320, 1536, seed=11)
    packed = ext.int8_pack_q4(blocks.q, blocks.d, blocks.m)
    x = torch.randn(37, 1536, generator=torch.Generator().manual_seed(5)) * 2
    edge_groups(x)
    for rows in (1, 3, 8, 37):
        first, *others = [ext.int8_linear(x[:rows], packed, kernel=k) for k in KERNELS]
        assert all(torch.equal(first, other) for other in others)


@pytest.mark.skipif(len(Q8_KERNELS) < 2, reason="one Q8_0 int8 kernel here: nothing to compare it with")
def test_every_q8_kernel_gives_the_same_bits() -> None:
    ext = extension()
    blocks = random_q8(256, 576, seed=12)
    packed = ext.int8_pack_q8(blocks.q, blocks.d)
    x = torch.randn(21, 576, generator=torch.Generator().manual_seed(8)) * 2
    edge_groups(x)
    for rows in (1, 4, 6, 21):
        first, *others = [ext.int8_linear_q8(x[:rows], packed, kernel=k) for k in Q8_KERNELS]
        assert all(torch.equal(first, other) for other in others)


@needs_int8
@pytest.mark.parametrize(
    ("records", "kernel"), [("q4_1", k) for k in KERNELS] + [("q8_0", k) for k in Q8_KERNELS] or [("q4_1", "none")]
)
def test_a_row_with_a_nan_or_an_infinity_gives_nan_and_leaves_the_others_alone(records: str, kernel: str) -> None:
    """As the float32 products: a non-finite activation makes its row's outputs NaN (a NaN among a group's first 16
    used to drop out of its scale, and the row came out finite: a greedy step then took token 0 instead of refusing
    the row), whatever else the call holds."""
    ext = extension()
    if records == "q4_1":
        blocks = random_blocks(128, 96, seed=4)
        packed, product = ext.int8_pack_q4(blocks.q, blocks.d, blocks.m), ext.int8_linear
    else:
        q8 = random_q8(128, 96, seed=4)
        packed, product = ext.int8_pack_q8(q8.q, q8.d), ext.int8_linear_q8

    def run(x: torch.Tensor, packed: object) -> torch.Tensor:
        return product(x, packed, kernel=kernel)

    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(6))
    x[1, 3] = float("nan")  # among the first 16 of its group, the rest finite
    x[4, 70] = float("inf")
    x[6, 40] = -float("inf")
    y = run(x, packed)
    bad = {1, 4, 6}
    assert all(y[i].isnan().all() for i in bad)
    good = [i for i in range(9) if i not in bad]
    assert y[good].isfinite().all()
    assert torch.equal(y[good], run(x[good], packed))


def test_a_kernel_this_cpu_does_not_run_is_refused() -> None:
    ext = extension()
    blocks = random_blocks(64, 64, seed=1)
    packed = ext.int8_pack_q4(blocks.q, blocks.d, blocks.m)
    with pytest.raises(RuntimeError, match=r"kernel 'sve' is not available here|runs none of its int8 kernels"):
        ext.int8_linear(torch.randn(2, 64), packed, kernel="sve")
    q8 = random_q8(64, 64, seed=1)
    with pytest.raises(RuntimeError, match=r"kernel 'amx' is not available here|runs none of its int8 kernels"):
        ext.int8_linear_q8(torch.randn(2, 64), ext.int8_pack_q8(q8.q, q8.d), kernel="amx")  # no AMX Q8_0 kernel


@needs_int8
def test_shapes_the_records_do_not_take_are_refused() -> None:
    ext = extension()
    narrow = random_blocks(48, 64, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ext.int8_pack_q4(narrow.q, narrow.d, narrow.m)
    blocks = random_blocks(64, 64, seed=1)
    packed = ext.int8_pack_q4(blocks.q, blocks.d, blocks.m)
    with pytest.raises(RuntimeError, match=r"\[M, 64\] float32"):
        ext.int8_linear(torch.randn(2, 32), packed)


@needs_q8
@each_q8_kernel
@pytest.mark.parametrize(("n", "k"), [(1024, 576), (64, 32), (128, 96)])
def test_an_int8_lm_head_is_its_int8_activations_times_the_dequantised_q8_weight(kernel: str, n: int, k: int) -> None:
    """Q8_0 records (the full int8 range, which the kernel offsets to unsigned bytes and takes back off in int32):
    each row the rounding rule's product, within float32 sums of the group terms; 1-40 rows (four at a time in
    column groups of 64) give each row the bits it gets alone."""
    ext = extension()
    blocks = random_q8(n, k, seed=n + k)
    blocks.q[:16], blocks.q[16:32] = 127, -128  # the extremes (AVX2 splits q + 128 into nibbles: its sums exact)
    packed = ext.int8_pack_q8(blocks.q, blocks.d)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * 3
    x[3, :32] = 0.0  # a group of zeros: scale 0
    x[5, 7] = 500.0  # an outlier owns its group's scale
    x[7], x[8] = 2.5, -1.0
    x[9, :32] = torch.linspace(-3e-38, 2e-38, 32)  # 127 / max |x| overflows: the group rounds to zeros
    w = blocks.dequantize().double()
    ref = int8_rounded(x) @ w.T
    bound = (int8_rounded(x).abs() @ w.abs().T) * 2e-6 + 1e-30
    y = ext.int8_linear_q8(x, packed, kernel=kernel)
    assert y.dtype == torch.float32 and y.shape == (40, n)
    assert ((y.double() - ref).abs() <= bound).all()
    assert not torch.equal(y, (x.double() @ w.T).float())
    alone = torch.cat([ext.int8_linear_q8(x[i : i + 1], packed, kernel=kernel) for i in range(40)])
    assert torch.equal(y, alone)
    for rows in (2, 3, 4, 5, 8, 9, 17):
        assert torch.equal(ext.int8_linear_q8(x[:rows], packed, kernel=kernel), y[:rows])
    bias = torch.randn(n)
    assert torch.equal(ext.int8_linear_q8(x, packed, bias, kernel=kernel), y + bias)


@needs_q8
def test_q8_blocks_the_int8_head_does_not_take_are_refused() -> None:
    ext = extension()
    narrow = random_q8(48, 64, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ext.int8_pack_q8(narrow.q, narrow.d)
    blocks = random_q8(64, 64, seed=1)
    with pytest.raises(RuntimeError, match=r"q must be \[N, K\] int8"):
        ext.int8_pack_q8(blocks.q.to(torch.uint8), blocks.d)
    packed = ext.int8_pack_q8(blocks.q, blocks.d)
    with pytest.raises(RuntimeError, match=r"\[M, 64\] float32"):
        ext.int8_linear_q8(torch.randn(2, 32), packed)
    with pytest.raises(RuntimeError, match="not an int8_pack_q8 record set"):
        ext.int8_linear_q8(torch.randn(2, 64), ext.int8_pack_q4(*random_blocks(64, 64, seed=1).__dict__.values()))


def int8_tiny_model(seed: int) -> tuple[LlamaModel, dict[str, Q4Blocks]]:
    """Head dim 64 (SmolLM2's, which the attention kernel serves: decoding and verifying then differ only in the
    products); every projection's N a multiple of 64."""
    return q4_tiny_model(seed, hidden_size=256, intermediate_size=256)


def q8_head(model: LlamaModel, seed: int) -> dict[str, Q8Blocks]:
    """The model's LM head set to Q8_0 blocks dequantised (as a GGUF's load), and those blocks by HF tensor name."""
    blk = random_q8(model.cfg.vocab_size, model.cfg.hidden_size, seed)
    with torch.no_grad():
        model.lm_head.weight.copy_(blk.dequantize())
    return {Q8_HEAD_NAMES[1]: blk}


def steps(model: LlamaModel, prompt: list[int], verify: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``verify`` after ``prompt``: decoded one token a step, and as one forward of all its rows."""
    one, many = model.new_cache(1, 160), model.new_cache(1, 160)
    a, b = one.allocate(), many.allocate()
    model(ForwardBatch.build(one, [a], [prompt]), one)
    model(ForwardBatch.build(many, [b], [prompt]), many)
    singles = torch.cat([model(ForwardBatch.build(one, [a], [[t]]), one) for t in verify])
    return singles, model(ForwardBatch.build(many, [b], [verify]), many)


@needs_int8
@torch.no_grad()
def test_a_model_on_int8_products_verifies_what_it_decodes() -> None:
    """Through the Python loop and the C++ stack, with the attention kernel: a forward of 20 rows gives each row the
    logits its own step gives (speculation's losslessness rests on it), as the float32 products do, and the int8
    products are what runs (their logits differ from the float32 products')."""
    (plain, _), (int8, blocks) = int8_tiny_model(seed=4), int8_tiny_model(seed=4)
    q8_head(plain, seed=9)
    heads = q8_head(int8, seed=9)
    assert attach_small_gemm(plain) and attach_small_gemm(int8) and attach_int8_reads(int8, blocks)
    if extension().int8_q8_supported():
        assert attach_int8_head(int8, heads)
    assert attach_native_attention(plain) and attach_native_attention(int8)
    gen = torch.Generator().manual_seed(2)
    prompt = [int(t) for t in torch.randint(0, 512, (30,), generator=gen)]
    verify = [int(t) for t in torch.randint(0, 512, (20,), generator=gen)]
    head_only, _ = int8_tiny_model(seed=4)  # the int8 head over float32 decoder products
    head_only_blocks = q8_head(head_only, seed=9)
    assert attach_small_gemm(head_only) and attach_native_attention(head_only)
    if extension().int8_q8_supported():
        assert attach_int8_head(head_only, head_only_blocks)
    for native in (False, True):
        if native:
            assert attach_native_stack(plain) and attach_native_stack(int8) and attach_native_stack(head_only)
        singles, together = steps(int8, prompt, verify)
        assert torch.equal(singles, together)
        reference, reference_together = steps(plain, prompt, verify)
        assert torch.equal(reference, reference_together)
        assert not torch.equal(singles, reference)
        assert (singles - reference).abs().max() < 0.05 * reference.abs().max()
        # the decoder's products are int8 too, in the Python loop and in the C++ stack (Proj.int8_records)
        assert not torch.equal(singles, steps(head_only, prompt, verify)[0])


@needs_q8
@torch.no_grad()
def test_greedy_tokens_of_an_int8_head_are_the_argmax_of_its_logits() -> None:
    """With the int8 LM head, every greedy token (a plain step's and a verify's) is the argmax of the int8 logits:
    the bounded bfloat16 copy, which finds the float32 head's argmax, is never attached beside it, and the head's
    logits are its int8 products (not the float32 head's)."""
    model, _ = int8_tiny_model(seed=8)
    reference, _ = int8_tiny_model(seed=8)
    heads = q8_head(model, seed=3)
    q8_head(reference, seed=3)
    assert attach_small_gemm(model) and attach_small_gemm(reference) and attach_int8_head(model, heads)
    assert not attach_bounded_argmax(model, measure=False) and model.bounded_argmax is None
    hidden = torch.randn(12, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = model.logits(hidden)
    assert torch.equal(logits, extension().int8_linear_q8(hidden, model.lm_head.int8_records))
    assert not torch.equal(logits, reference.logits(hidden))
    for rows in (1, 3, 12):
        assert torch.equal(greedy_ids(model, hidden[:rows]), logits[:rows].argmax(-1))


@needs_q8
def test_an_lm_head_whose_blocks_do_not_match_gets_no_int8_records(caplog: pytest.LogCaptureFixture) -> None:
    model, _ = int8_tiny_model(seed=5)
    heads = q8_head(model, seed=2)
    assert attach_small_gemm(model)
    assert not attach_int8_head(model, {})  # no blocks for this head
    with torch.no_grad():
        model.lm_head.weight[3, 1] += 1e-3
    with caplog.at_level(logging.WARNING):
        assert not attach_int8_head(model, heads)
    assert "do not dequantise" in caplog.text and getattr(model.lm_head, "int8_records", None) is None


def test_no_int8_kernel_attaches_nothing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from specserve.models import native_stack

    model, blocks = int8_tiny_model(seed=5)
    assert attach_small_gemm(model)

    class NoInt8:
        def __getattr__(self, name: str) -> object:
            return (lambda: []) if name == "int8_kernels" else getattr(extension(), name)

    monkeypatch.setattr(native_stack, "extension", NoInt8)
    with caplog.at_level(logging.WARNING):
        assert not attach_int8_reads(model, blocks)
    assert "no int8 kernel (AMX-INT8, AVX512-VNNI, AVX2)" in caplog.text
    assert not any(getattr(m, "int8_records", None) is not None for m in model.modules())


@needs_int8
def test_blocks_that_do_not_match_the_weights_attach_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model, blocks = int8_tiny_model(seed=6)
    assert attach_small_gemm(model)
    with torch.no_grad():
        model.decoder_layers()[1].down.weight[0, 3] += 1e-3
    with caplog.at_level(logging.WARNING):
        assert not attach_int8_reads(model, blocks)
    assert "do not dequantise" in caplog.text
    assert not any(getattr(m, "int8_records", None) is not None for m in model.modules())


@needs_int8
@pytest.mark.real_model
def test_speculation_on_int8_products_equals_their_plain_greedy() -> None:
    """SmolLM2 with every decoder product on the int8 kernel, the shipped head drafting: chains, DDD trees and the
    pair's serving mode emit exactly the same target's plain greedy tokens."""
    from specserve.models.loader import load_draft, load_model
    from tests.test_real_model import _assert_each_equals_plain_greedy

    target = load_model(ModelSpec(int8_reads=True, small_gemm_plan=False))
    assert all(layer.down.int8_records is not None for layer in target.decoder_layers())
    # nothing reads the float32 kernel's records beside them (80 MB, and a second comparison of every block at load)
    assert all(getattr(layer.down, "small_records", None) is None for layer in target.decoder_layers())
    assert (getattr(target.lm_head, "int8_records", None) is not None) == extension().int8_q8_supported()
    draft = load_draft(MODEL_PAIRS["smollm2-eagle"][1], target)
    specs = (
        SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft.greedy),
        SpecConfig(method=SpecMethod.ddd, beam_width=4, budget=12, ddd_max_depth=6),
        PAIR_SPECULATION["smollm2-eagle"],
    )
    _assert_each_equals_plain_greedy(target, draft, specs, num_prompts=4)


@needs_int8
def test_a_record_set_is_read_only_by_the_kernels_it_was_packed_for() -> None:
    """The small kernel's and the int8 kernels' Q4_1 records are both uint8 of one size: each kernel took the
    other's and returned infinities and NaNs. The int8 products' bias was added however it was shaped or typed."""
    ext = extension()
    blocks = random_blocks(64, 64, seed=3)
    x = torch.randn(3, 64)
    small, int8 = ext.small_pack_q4(blocks.q, blocks.d, blocks.m), ext.int8_pack_q4(blocks.q, blocks.d, blocks.m)
    assert small.data.dtype == int8.data.dtype and small.data.numel() == int8.data.numel()
    with pytest.raises(RuntimeError, match="not an int8_pack_q4 record set"):
        ext.int8_linear(x, small)
    with pytest.raises(RuntimeError, match="packed for the int8 kernels"):
        ext.small_linear_packed(x, int8)
    for bias in (torch.randn(3, 64), torch.randn(1), torch.randn(64, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match=r"a bias is float32 \[N\]"):
            ext.int8_linear(x, int8, bias)
    if Q8_KERNELS:
        q8 = random_q8(64, 64, seed=3)
        with pytest.raises(RuntimeError, match=r"a bias is float32 \[N\]"):
            ext.int8_linear_q8(x, ext.int8_pack_q8(q8.q, q8.d), torch.randn(3, 64))
