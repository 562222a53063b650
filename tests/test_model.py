"""Model runner: parity with transformers, ragged and tree-masked batches, KV slot operations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch
from transformers import AutoModelForCausalLM

from deployments.app_args import AppArgs
from specserve.config import EngineConfig, ModelSpec, SourceKind, derived_draft
from specserve.errors import KVCapacityError, UnsupportedModelError
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel, quantize_int8_dynamic
from specserve.models.tiny import hf_state_dict, tiny_config, tiny_model

ROPE_VARIANTS = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    },
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
}

ARCHS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    ("llama", {"head_dim": 32}),
    ("mistral", {"sliding_window": 4096}),
    ("qwen2", {}),
    # flags transformers' Mistral and Qwen2 ignore (their biases are fixed by type): a checkpoint they load was
    # refused here as missing o_proj / mlp biases
    ("mistral", {"sliding_window": 4096, "attention_bias": True, "mlp_bias": True}),
    ("qwen2", {"attention_bias": True, "mlp_bias": True}),
    # Qwen2's switch on with no layer past max_window_layers: no layer slides (the context was cut to the window)
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}),
]


def hf_twin(model: LlamaModel) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_config(model.hf_config).eval()
    hf.load_state_dict(hf_state_dict(model), strict=not model.cfg.tie_word_embeddings)
    return hf


def run_one(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 256)
    return model(ForwardBatch.build(cache, [cache.allocate()], [tokens]), cache)


@pytest.mark.parametrize(("model_type", "extra"), ARCHS)
def test_logits_match_transformers(model_type: str, extra: dict) -> None:
    model = tiny_model(tiny_config(model_type, **extra), seed=1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_twin(model)(ids).logits[0]
    assert (run_one(model, ids[0].tolist()) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_variants_match_transformers(variant: str) -> None:
    model = tiny_model(tiny_config("llama", **ROPE_VARIANTS[variant]), seed=2)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_twin(model)(ids).logits[0]
    assert (run_one(model, ids[0].tolist()) - ref).abs().max().item() < 1e-4


def test_rope_that_changes_with_the_length_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        LlamaModel(tiny_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    longrope = {  # Phi-3's: short factors up to the original context, long ones past it (one table cannot)
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
        "original_max_position_embeddings": 64,
    }
    with pytest.raises(UnsupportedModelError, match="longrope"):
        LlamaModel(tiny_config("llama", rope_scaling=longrope))


@pytest.mark.parametrize("theta", [0, -10000.0, float("nan"), float("inf"), 10**400, True, "10000", None])
def test_a_rope_base_that_gives_no_angles_is_a_clear_error(theta: object) -> None:
    with pytest.raises(UnsupportedModelError, match="rope_theta"):
        LlamaModel(tiny_config("llama", rope_theta=theta))
    with pytest.raises(UnsupportedModelError, match="rope_theta"):  # a scaled variant refuses it too
        LlamaModel(tiny_config("llama", rope_theta=theta, rope_scaling={"rope_type": "linear", "factor": 2.0}))


def test_a_rope_base_of_any_real_number_type_is_taken() -> None:
    ids = list(range(1, 30))
    ref = run_one(tiny_model(tiny_config("llama", rope_theta=50000.0), seed=3), ids)
    for theta in (50000, np.float32(50000.0), np.int64(50000)):
        assert torch.equal(run_one(tiny_model(tiny_config("llama", rope_theta=theta), seed=3), ids), ref), theta


def test_a_sliding_window_below_the_models_positions_is_said_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    """Mistral-7B-v0.1 (32768 positions, window 4096) is served up to 4096 positions: the limit's warning named
    only "the models' 4096 positions", never the window."""
    with caplog.at_level("WARNING", logger="specserve.models.llama"):
        model = LlamaModel(tiny_config("mistral", sliding_window=64, max_position_embeddings=256))
    assert model.max_positions == 64
    assert "sliding_window 64 is below max_position_embeddings 256: the model is served up to 64" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="specserve.models.llama"):
        LlamaModel(tiny_config("mistral", sliding_window=4096, max_position_embeddings=256))
    assert "sliding_window" not in caplog.text


def test_a_mistral_window_applies_whatever_a_use_sliding_window_key_says() -> None:
    """transformers' Mistral slides whenever ``sliding_window`` is set (it reads no ``use_sliding_window``, a Qwen2
    key). A Mistral config.json carrying ``"use_sliding_window": false`` was served to all its positions with full
    attention: past the window its logits differed from transformers' (argmax 20 of 40 positions)."""
    cfg = tiny_config("mistral", sliding_window=16, use_sliding_window=False, max_position_embeddings=256)
    assert LlamaModel(cfg).max_positions == 16
    qwen = tiny_config("qwen2", sliding_window=16, use_sliding_window=False, max_position_embeddings=256)
    assert LlamaModel(qwen).max_positions == 256  # Qwen2 slides only with its switch on
    qwen = tiny_config(
        "qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1, max_position_embeddings=256
    )
    assert LlamaModel(qwen).max_positions == 16  # its second layer slides
    # ... in the layers its layer_types name sliding; transformers' Llama never slides
    full = ["full_attention"] * 2
    for model_type, extra in (("qwen2", {"layer_types": full}), ("llama", {})):
        cfg = tiny_config(model_type, sliding_window=16, use_sliding_window=True, max_position_embeddings=256, **extra)
        assert LlamaModel(cfg).max_positions == 256, model_type


def test_rope_over_part_of_a_head_is_a_clear_error() -> None:
    """transformers' scaled rope types honour partial_rotary_factor: the tables came out half a head wide and the
    load died in its first forward with a torch RuntimeError."""
    scaled = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match=r"RoPE over 8 of the 16 dimensions.*partial_rotary_factor 0.5"):
        LlamaModel(tiny_config("llama", partial_rotary_factor=0.5, rope_scaling=scaled))


def test_query_heads_that_do_not_share_kv_heads_evenly_are_refused_when_built() -> None:
    """6 query heads over 4 KV heads built a model whose first forward died with a torch RuntimeError, not the
    clear refusal other configs get."""
    with pytest.raises(UnsupportedModelError, match="num_attention_heads 6 is not a multiple of num_key_value_heads 4"):
        LlamaModel(tiny_config("llama", num_attention_heads=6, num_key_value_heads=4, hidden_size=96))


def test_an_rms_norm_eps_outside_zero_to_one_is_refused_by_name() -> None:
    """-1 loaded, and every logit was NaN: greedy decoding emitted token 0 for ever (a head's config and a GGUF
    already refused such values)."""
    for eps in (-1.0, 0.0, float("nan"), 2.0):  # (transformers refuses a string)
        with pytest.raises(UnsupportedModelError, match=r"rms_norm_eps .* is not a number between 0 and 1"):
            LlamaModel(tiny_config("llama", rms_norm_eps=eps))
    assert LlamaModel(tiny_config("llama", rms_norm_eps=1e-6)).cfg.rms_norm_eps == 1e-6


def test_a_context_too_short_to_answer_in_is_refused_by_name() -> None:
    """max_position_embeddings (transformers takes any value) of 0 or below failed at load inside a KV cache or a
    range, naming neither (a short one loads: tests/test_lm_head_argmax.py)."""
    for value in (0, 1, -5):
        with pytest.raises(UnsupportedModelError, match=f"max_position_embeddings {value} leaves no room"):
            LlamaModel(tiny_config("llama", max_position_embeddings=value))
    with pytest.raises(UnsupportedModelError, match="sliding_window 1 leaves no room"):
        LlamaModel(tiny_config("mistral", sliding_window=1, max_position_embeddings=256))


def test_unsupported_architecture_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LlamaModel(tiny_config("gpt2"))


def test_incremental_decoding_equals_full_forward() -> None:
    model = tiny_model(seed=3)
    tokens = list(range(5, 45))
    full = run_one(model, tokens)
    cache = model.new_cache(2, 128)
    slot = cache.allocate()
    parts = [model(ForwardBatch.build(cache, [slot], [tokens[:17]]), cache)]
    for t in tokens[17:]:
        parts.append(model(ForwardBatch.build(cache, [slot], [[t]]), cache))
    assert (torch.cat(parts) - full).abs().max().item() < 1e-4


def test_ragged_batch_equals_sequences_run_alone() -> None:
    model = tiny_model(seed=4)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (7, 19, 3, 12)]
    extra = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 4, 2, 3)]
    cache = model.new_cache(6, 64)
    cache.allocate()  # slot 0 busy: the batch below uses non-consecutive slots 1, 3, 4, 5
    slots = [cache.allocate() for _ in range(5)]
    cache.free(slots.pop(1))
    first = model(ForwardBatch.build(cache, slots, prompts), cache)  # all logits of every prompt
    second = model(ForwardBatch.build(cache, slots, extra), cache)
    off1 = off2 = 0
    for p, e in zip(prompts, extra, strict=True):
        alone = run_one(model, p + e)
        assert (first[off1 : off1 + len(p)] - alone[: len(p)]).abs().max() < 1e-4
        assert (second[off2 : off2 + len(e)] - alone[len(p) :]).abs().max() < 1e-4
        off1, off2 = off1 + len(p), off2 + len(e)


def test_num_logits_returns_only_the_last_rows() -> None:
    model = tiny_model(seed=5)
    cache = model.new_cache(2, 64)
    slots = [cache.allocate(), cache.allocate()]
    out = model(ForwardBatch.build(cache, slots, [[3, 4, 5], [6, 7]], num_logits=[1, 2]), cache)
    assert out.shape == (3, model.cfg.vocab_size)
    assert (out[0] - run_one(model, [3, 4, 5])[-1]).abs().max() < 1e-4
    assert (out[1:] - run_one(model, [6, 7])).abs().max() < 1e-4


def tree_fixture() -> tuple[list[int], list[int]]:
    """A tree of 7 nodes, parents precede children: 0 root; 1,2 children of 0; 3 of 1; 4,5 of 2; 6 of 4."""
    return [10, 20, 30, 40, 50, 60, 70], [-1, 0, 0, 1, 2, 2, 4]


def tree_mask(parents: list[int]) -> tuple[torch.Tensor, list[int]]:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for j, par in enumerate(parents):
        mask[j, j] = True
        if par >= 0:
            mask[j] |= mask[par]
            depth[j] = depth[par] + 1
    return mask, depth


def test_tree_mask_equals_each_path_run_alone_and_keep_commits_a_path() -> None:
    model = tiny_model(seed=6)
    context = [5, 6, 7, 8, 9]
    tokens, parents = tree_fixture()
    mask, depth = tree_mask(parents)
    cache = model.new_cache(3, 64)
    other = cache.allocate()
    slot = cache.allocate()
    model(ForwardBatch.build(cache, [other, slot], [[1, 2, 3], context]), cache)
    positions = [len(context) + d for d in depth]
    out = model(
        ForwardBatch.build(cache, [other, slot], [[4], tokens], positions=[None, positions], tree_masks=[None, mask]),
        cache,
    )[1:]
    for j in range(len(tokens)):
        path = [i for i in range(len(tokens)) if mask[j, i]]
        alone = run_one(model, context + [tokens[i] for i in path])
        assert (out[j] - alone[-1]).abs().max() < 1e-4
    # commit the path root -> 2 -> 4 -> 6 and continue decoding: equals the linear sequence
    cache.keep(slot, len(context), [0, 2, 4, 6])
    assert cache.length(slot) == len(context) + 4
    nxt = model(ForwardBatch.build(cache, [slot], [[99]]), cache)
    alone = run_one(model, [*context, 10, 30, 50, 70, 99])
    assert (nxt[0] - alone[-1]).abs().max() < 1e-4


def test_truncate_rolls_back_a_chain() -> None:
    model = tiny_model(seed=7)
    cache = model.new_cache(1, 64)
    slot = cache.allocate()
    model(ForwardBatch.build(cache, [slot], [[1, 2, 3, 4]]), cache)
    model(ForwardBatch.build(cache, [slot], [[50, 51, 52]]), cache)
    cache.truncate(slot, 5)  # keep only 50
    out = model(ForwardBatch.build(cache, [slot], [[60]]), cache)
    assert (out[0] - run_one(model, [1, 2, 3, 4, 50, 60])[-1]).abs().max() < 1e-4


def test_kv_capacity_and_slot_errors() -> None:
    model = tiny_model(seed=8)
    cache = model.new_cache(1, 8)
    slot = cache.allocate()
    with pytest.raises(KVCapacityError, match="all 1 KV slots"):
        cache.allocate()
    with pytest.raises(KVCapacityError, match="capacity of 8"):
        ForwardBatch.build(cache, [slot], [list(range(9))])
    assert cache.length(slot) == 0  # a failed reservation reserves nothing
    ForwardBatch.build(cache, [slot], [[1, 2, 3]])
    for start in (4, -1):  # past the entries, or before the first: stale entries would become visible
        with pytest.raises(ValueError, match=f"keep from {start}"):
            cache.keep(slot, start, [])
    assert cache.length(slot) == 3
    cache.truncate(slot, 0)
    cache.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(slot)
    slot = cache.allocate()
    ForwardBatch.build(cache, [slot], [[1, 2, 3]])
    with pytest.raises(ValueError, match="ascending"):
        cache.keep(slot, 0, [2, 1])
    # one slot twice: each part was checked against the old length (6 + 6 past 8 passed) and wrote the same rows
    with pytest.raises(ValueError, match="more than once"):
        ForwardBatch.build(cache, [slot, slot], [[1, 2, 3], [4, 5, 6]])
    assert cache.length(slot) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_copies_track_float32(dtype: torch.dtype) -> None:
    model = tiny_model(seed=9)
    low = tiny_model(seed=9).to(dtype)
    tokens = list(range(3, 30))
    ref = run_one(model, tokens).softmax(-1)
    out = run_one(low, tokens)
    assert out.dtype == torch.float32
    assert (out.softmax(-1) - ref).abs().sum(-1).mean() / 2 < 0.1  # mean total variation distance
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_int8_dynamic_copy_runs_and_tracks_float32() -> None:
    model = tiny_model(seed=10)
    q = quantize_int8_dynamic(tiny_model(seed=10))
    assert any("quantized.dynamic" in type(m).__module__ for m in q.modules())
    tokens = list(range(3, 30))
    ref, out = run_one(model, tokens), run_one(q, tokens)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.5
    assert not torch.equal(out, ref)


def test_a_free_cut_short_while_zeroing_zeroes_the_slot_when_retried() -> None:
    """free() marked the slot's entries unwritten before zeroing them: a release cut short mid-zeroing (an
    interrupt) and retried skipped the zeroing and handed the next sequence the old K/V (inf after an fp16
    overflow: NaN in every row beside a longer one)."""

    class Interrupted:
        def __getitem__(self, index: object) -> torch.Tensor:
            raise KeyboardInterrupt

    model = tiny_model(seed=0)
    cache = model.new_cache(1, 16)
    slot = cache.allocate()
    model(ForwardBatch.build(cache, [slot], [[5, 6, 7, 8]]), cache)
    values = cache.v
    cache.v = [Interrupted() for _ in values]  # type: ignore[misc]  # the keys zeroed, then the interrupt
    with pytest.raises(KeyboardInterrupt):
        cache.free(slot)
    cache.v = values
    assert cache.allocated(slot) and any(bool(v[slot].any()) for v in cache.v)
    cache.free(slot)  # the release retried
    assert not any(bool(t[slot].any()) for t in (*cache.k, *cache.v))


def test_an_int8_dynamic_model_verifies_nothing_its_rows_depend_on_their_batch() -> None:
    """Dynamic int8 quantises a product's activations with one scale for all its rows: a row's logits change with the
    rows beside it (another request's, a draft's), so a target may not be one (a draft may)."""
    q = quantize_int8_dynamic(tiny_model(seed=10))
    cache = q.new_cache(2, 64)
    slots = [cache.allocate(), cache.allocate()]
    alone = q(ForwardBatch.build(cache, slots[:1], [[5, 6, 7]]), cache)
    cache.free(slots[0])
    slots[0] = cache.allocate()
    beside = q(ForwardBatch.build(cache, slots, [[5, 6, 7], list(range(40, 60))]), cache)[:3]
    assert not torch.equal(alone, beside)
    for build in (
        lambda: EngineConfig(target=ModelSpec(int8_dynamic=True)),
        lambda: AppArgs(target={"int8_dynamic": True}),
    ):
        with pytest.raises(pydantic.ValidationError, match="int8_dynamic is for drafts"):
            build()
    assert EngineConfig(target=ModelSpec(), draft=derived_draft(ModelSpec(), "int8")).draft is not None


def test_a_target_may_not_switch_to_dense_weights_by_row_count() -> None:
    """``q4_dense_from`` multiplies products of that many rows with other weights (a bf16 copy): a target's rows
    would change with the rows verified beside them, as with int8_dynamic; a draft may."""
    q4 = derived_draft(ModelSpec(), "q4")
    assert isinstance(q4, ModelSpec) and q4.q4_dense_from is not None
    for build in (
        lambda: EngineConfig(target=q4),
        lambda: AppArgs(target=q4.model_dump(), draft={"head": "smollm2-eagle3"}),
    ):
        with pytest.raises(pydantic.ValidationError, match="q4_dense_from is for drafts"):
            build()
    assert EngineConfig(target=q4.model_copy(update={"q4_dense_from": None})).target.native_q4
    assert EngineConfig(target=ModelSpec(), draft=q4).draft == q4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attn_varlen_matches_sdpa_on_cuda() -> None:
    pytest.importorskip("flash_attn")
    model = tiny_model(seed=11).to("cuda", torch.bfloat16)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]

    def run(flash: bool) -> torch.Tensor:
        model.use_flash_attn = flash
        cache = model.new_cache(3, 64)
        slots = [cache.allocate() for _ in prompts]
        model(ForwardBatch.build(cache, slots, prompts, device="cuda"), cache)
        return model(ForwardBatch.build(cache, slots, [[1, 2], [3], [4, 5, 6]], device="cuda"), cache)

    assert (run(True) - run(False)).abs().max() < 5e-2


def test_window_mask_hides_cached_non_ancestors() -> None:
    """Level-by-level tree drafting: cached sibling nodes must be invisible to a later level's nodes."""
    model = tiny_model(seed=12)
    context = [5, 6, 7]
    cache = model.new_cache(1, 32)
    slot = cache.allocate()
    model(ForwardBatch.build(cache, [slot], [context]), cache)
    siblings = torch.eye(2, dtype=torch.bool)  # A=20 and B=30 both children of the context's last token
    model(ForwardBatch.build(cache, [slot], [[20, 30]], positions=[[3, 3]], tree_masks=[siblings]), cache)
    window = torch.tensor([[False, True, True]])  # C=40 sees B (its parent) and itself, not A
    out = model(ForwardBatch.build(cache, [slot], [[40]], positions=[[4]], tree_masks=[window]), cache)
    assert (out[0] - run_one(model, [*context, 30, 40])[-1]).abs().max() < 1e-4
    length = cache.length(slot)
    bad_layouts = [  # each refused before it reserves anything in the slot
        ({"tree_masks": [torch.ones(1, 99, dtype=torch.bool)]}, "tree mask"),
        ({"positions": [[7, 8]]}, "2 positions for 1 new tokens"),
        ({"num_logits": [2]}, "num_logits 2"),
    ]
    for layout, says in bad_layouts:
        with pytest.raises(ValueError, match=says):
            ForwardBatch.build(cache, [slot], [[1]], **layout)  # type: ignore[arg-type]
        assert cache.length(slot) == length


def test_gemv_copies_give_the_same_logits() -> None:
    from specserve.models.llama import attach_gemv_copies

    model = tiny_model(seed=13)
    tokens = list(range(3, 20))
    ref = [run_one(model, tokens[:n]) for n in (1, 2, 3, 4, 17)]
    assert attach_gemv_copies(model, rows=3) == 3  # every 1-3 row product takes the copy path
    assert model.layers[0].qkv.weight_t.shape == model.layers[0].qkv.weight.t().shape
    for n, r in zip((1, 2, 3, 4, 17), ref, strict=True):
        assert (run_one(model, tokens[:n]) - r).abs().max() < 1e-4
    bare = tiny_model(seed=13)
    assert attach_gemv_copies(bare, rows=0) == 0 and not hasattr(bare.layers[0].qkv, "weight_t")
    timed = tiny_model(seed=13)
    measured = attach_gemv_copies(timed)  # the threshold this machine measures, per weight shape
    linears = [m for m in timed.modules() if type(m) is torch.nn.Linear]
    assert measured == max(m.gemv_rows for m in linears)
    assert all(hasattr(m, "weight_t") == (m.gemv_rows > 0) for m in linears)  # a copy exactly where it is used
    for n, r in zip((1, 2, 3, 4, 17), ref, strict=True):
        assert (run_one(timed, tokens[:n]) - r).abs().max() < 1e-4


def _assert_products_at_1_to_20_rows(mod: torch.nn.Linear) -> None:
    """``linear(mod, x)`` equals ``x W^T + b`` for 1..20 rows, whichever path serves each row count."""
    from specserve.models.llama import linear

    torch.manual_seed(1)
    for rows in range(1, 21):
        x = torch.randn(rows, mod.in_features)
        want = x @ mod.weight.t() + (0 if mod.bias is None else mod.bias)
        got = linear(mod, x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_padding_runs_10_to_15_row_products_at_16_rows_with_the_same_products() -> None:
    from specserve.models.llama import PAD_WIDTH, attach_row_padding, linear

    model = tiny_model(seed=0)
    assert attach_row_padding(model, 10) == 10
    mod = model.decoder_layers()[0].gate_up
    seen: list[int] = []
    mod.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    _assert_products_at_1_to_20_rows(mod)  # zero rows change no real row
    assert seen == [*range(1, 10), *[PAD_WIDTH] * 6, *range(16, 21)]  # 10-15 rows ran as 16
    off = tiny_model(seed=0)
    assert attach_row_padding(off, 0) == 0
    seen.clear()
    off.decoder_layers()[0].gate_up.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    linear(off.decoder_layers()[0].gate_up, torch.randn(12, mod.in_features))
    assert seen == [12]
    timed = tiny_model(seed=0)
    measured = attach_row_padding(timed)  # measured over the model's weights: a candidate or none
    assert measured in (0, 10, 12, 15)
    assert all(m.pad_from == measured for m in timed.modules() if type(m) is torch.nn.Linear)
    _assert_products_at_1_to_20_rows(timed.decoder_layers()[0].gate_up)


def test_mkl_packed_weights_serve_their_row_ranges_with_the_same_products() -> None:
    from torch import nn

    from specserve.models.llama import attach_mkl_packed, linear, mkl_packing_available

    if not mkl_packing_available():
        pytest.skip("torch without MKL")
    model = tiny_model(seed=0)
    assert attach_mkl_packed(model, (16, 4))
    mod = model.decoder_layers()[0].gate_up
    assert [(lo, hi) for lo, hi, _ in mod.mkl_packed] == [(4, 4), (5, 16)]  # exactly 4 rows; then 5-16
    assert all(hasattr(m, "mkl_packed") for m in model.modules() if type(m) is nn.Linear)
    _assert_products_at_1_to_20_rows(mod)  # zero-row padding changes no real row
    x = torch.randn(7, mod.in_features)
    assert torch.equal(linear(mod, x), linear(mod, torch.cat([x, torch.randn(3, mod.in_features)]))[:7])
    assert not attach_mkl_packed(tiny_model(seed=0).to(torch.bfloat16), (4,))  # float32 only
    # rows the small-product kernel serves (its 64 and its chunks) get no copy: built, they were never read
    served = tiny_model(seed=0)
    assert attach_mkl_packed(served, (4, 16, 200), served=128)
    assert [(lo, hi) for lo, hi, _ in served.decoder_layers()[0].gate_up.mkl_packed] == [(129, 200)]
    unserved = tiny_model(seed=0)
    assert not attach_mkl_packed(unserved, (4, 16), served=64)
    assert not any(hasattr(m, "mkl_packed") for m in unserved.modules())


def test_the_loader_packs_no_mkl_copy_for_rows_the_kernel_serves(tmp_path: Path) -> None:
    from specserve.models.llama import mkl_packing_available
    from specserve.models.loader import attach_cpu_paths
    from specserve.models.native_stack import NativeStackUnavailable, extension

    try:
        extension()
    except NativeStackUnavailable as e:
        pytest.skip(f"no small-product kernel: {e}")
    if not mkl_packing_available():
        pytest.skip("torch without MKL")
    model = tiny_model(seed=0)
    local = {"source": str(tmp_path), "kind": SourceKind.hf_dir, "small_gemm_plan": False, "native_stack": False}
    attach_cpu_paths(model, ModelSpec(**local, mkl_packed_widths=(4, 16)))  # the kernel serves 1-128 rows
    assert not any(hasattr(m, "mkl_packed") for m in model.modules())
    attach_cpu_paths(model, ModelSpec(**local, mkl_packed_widths=(4, 16), small_gemm=False))  # no kernel: copies
    assert all(hasattr(m, "mkl_packed") for m in model.modules() if type(m) is torch.nn.Linear)


def test_a_config_with_a_huge_context_serves_up_to_max_positions() -> None:
    """Its RoPE tables were built for every position of max_position_embeddings up front: a 1M-context config's
    took ~1 GiB, and a malformed context length of 2**30 ran the host out of memory before any check."""
    from specserve.models.llama import MAX_POSITIONS

    model = tiny_model(tiny_config(max_position_embeddings=2**30), seed=0)
    assert model.max_positions == MAX_POSITIONS == model.rope_cos.shape[0]
    assert tiny_model(tiny_config(max_position_embeddings=512), seed=0).max_positions == 512


def test_a_rows_mlp_activation_does_not_depend_on_the_rows_beside_it() -> None:
    """``llama.silu_mul`` on 2 threads: every row of 33 and of 40 equals the row alone, bit for bit (ATen's SiLU of
    the whole batch differed in 19 of 150 rows so compared)."""
    from specserve.models.llama import silu_mul

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(10):
            both = torch.randn(40, 2000, generator=torch.Generator().manual_seed(seed)) * 4
            gate, up = both[:, :1000], both[:, 1000:]  # strided halves, as the fused gate_up's chunk
            for n in (33, 40):
                out = silu_mul(gate[:n], up[:n])
                assert all(torch.equal(out[r], silu_mul(gate[r : r + 1], up[r : r + 1])[0]) for r in range(n))
            torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)
    finally:
        torch.set_num_threads(threads)
