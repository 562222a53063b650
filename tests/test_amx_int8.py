"""AMX-INT8 products over Q4_1 blocks (ModelSpec.amx_int8_reads): each row the product of its activations rounded
to int8 per group of 32 (a reference written here from the rounding rule) with the dequantised weight, the same bits
whatever else the product holds; the loader attaches them only where every decoder projection fits; speculation
over such a target stays equal to its plain greedy decoding."""

from __future__ import annotations

import logging

import pytest
import torch

from specserve.config import MODEL_PAIRS, PAIR_SPECULATION, ChainDraft, ModelSpec, SpecConfig, SpecMethod
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.native_stack import (
    NativeStackUnavailable,
    attach_amx_int8_reads,
    attach_native_attention,
    attach_native_stack,
    attach_small_gemm,
    extension,
)
from specserve.models.q4 import Q4Blocks
from tests.test_q4_reads import q4_tiny_model, random_blocks

try:
    extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ extension cannot be built here: {e}", allow_module_level=True)

AMX = extension().amx_int8_supported()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU or process has no AMX-INT8 tiles")


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the products see it: each row's groups of 32 scaled to max |x| = 127 in float32, rounded half to even,
    scaled back by max |x| / 127."""
    groups = x.view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return (torch.round(groups * inv).double() * (amax / 127.0).double()).view(x.shape)


@needs_amx
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (64, 32), (128, 96)])
def test_each_row_is_its_int8_activations_times_the_dequantised_weight(n: int, k: int) -> None:
    ext = extension()
    blocks = random_blocks(n, k, seed=n + k)
    packed = ext.amx_pack_q4(blocks.q, blocks.d, blocks.m)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * 3
    x[3, :32] = 0.0  # a group of zeros: scale 0
    x[5, 7] = 500.0  # an outlier owns its group's scale
    w = blocks.dequantize().double()
    ref = int8_rounded(x) @ w.T
    bound = (int8_rounded(x).abs() @ w.abs().T) * 2e-6 + 1e-30  # float32 sums of the group terms
    y = ext.amx_linear(x, packed)
    assert y.dtype == torch.float32 and y.shape == (40, n)
    assert ((y.double() - ref).abs() <= bound).all()
    # against the float32 activations it is a rounding of the activations, not of the weights
    assert not torch.equal(y, (x.double() @ w.T).float())
    bias = torch.randn(n)
    assert torch.equal(ext.amx_linear(x, packed, bias), y + bias)


@needs_amx
def test_every_row_gets_the_same_bits_alone_or_among_others() -> None:
    """1-40 rows (tile products of 16 rows and a remainder): a verify's row is the row decoded alone."""
    ext = extension()
    blocks = random_blocks(192, 576, seed=7)
    packed = ext.amx_pack_q4(blocks.q, blocks.d, blocks.m)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(3))
    whole = ext.amx_linear(x, packed)
    alone = torch.cat([ext.amx_linear(x[i : i + 1], packed) for i in range(40)])
    assert torch.equal(whole, alone)
    for rows in (2, 5, 16, 17, 33):
        assert torch.equal(ext.amx_linear(x[:rows], packed), whole[:rows])
    assert torch.equal(ext.amx_linear(x[7:20], packed), whole[7:20])


@needs_amx
def test_shapes_the_tiles_do_not_take_are_refused() -> None:
    ext = extension()
    narrow = random_blocks(48, 64, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ext.amx_pack_q4(narrow.q, narrow.d, narrow.m)
    blocks = random_blocks(64, 64, seed=1)
    packed = ext.amx_pack_q4(blocks.q, blocks.d, blocks.m)
    with pytest.raises(RuntimeError, match=r"\[M, 64\] float32"):
        ext.amx_linear(torch.randn(2, 32), packed)


def amx_tiny_model(seed: int) -> tuple[LlamaModel, dict[str, Q4Blocks]]:
    """Head dim 64 (SmolLM2's, which the attention kernel serves: decoding and verifying then differ only in the
    products); every projection's N a multiple of 64."""
    return q4_tiny_model(seed, hidden_size=256, intermediate_size=256)


def steps(model: LlamaModel, prompt: list[int], verify: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``verify`` after ``prompt``: decoded one token a step, and as one forward of all its rows."""
    one, many = model.new_cache(1, 160), model.new_cache(1, 160)
    a, b = one.allocate(), many.allocate()
    model(ForwardBatch.build(one, [a], [prompt]), one)
    model(ForwardBatch.build(many, [b], [prompt]), many)
    singles = torch.cat([model(ForwardBatch.build(one, [a], [[t]]), one) for t in verify])
    return singles, model(ForwardBatch.build(many, [b], [verify]), many)


@needs_amx
@torch.no_grad()
def test_a_model_on_the_tiles_verifies_what_it_decodes() -> None:
    """Through the Python loop and the C++ stack, with the attention kernel: a forward of 20 rows gives each row the
    logits its own step gives (speculation's losslessness rests on it), as the float32 products do, and the tiles are
    what runs (their logits differ from the float32 products')."""
    (plain, _), (amx, blocks) = amx_tiny_model(seed=4), amx_tiny_model(seed=4)
    assert attach_small_gemm(plain) and attach_small_gemm(amx) and attach_amx_int8_reads(amx, blocks)
    assert attach_native_attention(plain) and attach_native_attention(amx)
    gen = torch.Generator().manual_seed(2)
    prompt = [int(t) for t in torch.randint(0, 512, (30,), generator=gen)]
    verify = [int(t) for t in torch.randint(0, 512, (20,), generator=gen)]
    for native in (False, True):
        if native:
            assert attach_native_stack(plain) and attach_native_stack(amx)
        singles, together = steps(amx, prompt, verify)
        assert torch.equal(singles, together)
        reference, reference_together = steps(plain, prompt, verify)
        assert torch.equal(reference, reference_together)
        assert not torch.equal(singles, reference)
        assert (singles - reference).abs().max() < 0.05 * reference.abs().max()


def test_no_tiles_attach_nothing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from specserve.models import native_stack

    model, blocks = amx_tiny_model(seed=5)
    assert attach_small_gemm(model)

    class NoTiles:
        def __getattr__(self, name: str) -> object:
            return (lambda: False) if name == "amx_int8_supported" else getattr(extension(), name)

    monkeypatch.setattr(native_stack, "extension", NoTiles)
    with caplog.at_level(logging.WARNING):
        assert not attach_amx_int8_reads(model, blocks)
    assert "no AMX-INT8" in caplog.text
    assert not any(getattr(m, "amx_records", None) is not None for m in model.modules())


@needs_amx
def test_blocks_that_do_not_match_the_weights_attach_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model, blocks = amx_tiny_model(seed=6)
    assert attach_small_gemm(model)
    with torch.no_grad():
        model.decoder_layers()[1].down.weight[0, 3] += 1e-3
    with caplog.at_level(logging.WARNING):
        assert not attach_amx_int8_reads(model, blocks)
    assert "do not dequantise" in caplog.text
    assert not any(getattr(m, "amx_records", None) is not None for m in model.modules())


@needs_amx
@pytest.mark.real_model
def test_speculation_on_the_tiles_equals_their_plain_greedy() -> None:
    """SmolLM2 with every decoder product on the tiles, the shipped head drafting: chains, DDD trees and the pair's
    serving mode emit exactly the same target's plain greedy tokens."""
    from specserve.models.loader import load_draft, load_model
    from tests.test_real_model import _assert_each_equals_plain_greedy

    target = load_model(ModelSpec(amx_int8_reads=True, small_gemm_plan=False))
    assert all(layer.down.amx_records is not None for layer in target.decoder_layers())
    draft = load_draft(MODEL_PAIRS["smollm2-eagle"][1], target)
    specs = (
        SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft.greedy),
        SpecConfig(method=SpecMethod.ddd, beam_width=4, budget=12, ddd_max_depth=6),
        PAIR_SPECULATION["smollm2-eagle"],
    )
    _assert_each_equals_plain_greedy(target, draft, specs, num_prompts=4)
