"""EAGLE heads in the published layouts: written with the official names and shapes, loaded, and compared with
a reference forward written here from the layer equations (not from the module under test)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specserve.config import HeadQuant, HeadSpec
from specserve.errors import CorruptModelError, UnsupportedModelError
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_draft
from specserve.models.tiny import tiny_config, tiny_model
from specserve.spec_decode.eagle_head import EagleHead, EagleHeadConfig, HeadKind, default_aux_layers
from specserve.spec_decode.head_checkpoint import checkpoint_kind, load_eagle_head, save_eagle_head

H, FF, NH, NKV, D, V = 64, 160, 4, 2, 16, 512  # the tiny target's shapes
THETA = 10000.0


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(seed=3)


def _rand(gen: torch.Generator, *shape: int, scale: float = 0.2) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def eagle1_tensors(seed: int, *, fc_bias: bool, d2t: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "fc.weight": _rand(g, H, 2 * H),
        "layers.0.self_attn.q_proj.weight": _rand(g, NH * D, H),
        "layers.0.self_attn.k_proj.weight": _rand(g, NKV * D, H),
        "layers.0.self_attn.v_proj.weight": _rand(g, NKV * D, H),
        "layers.0.self_attn.o_proj.weight": _rand(g, H, NH * D),
        "layers.0.post_attention_layernorm.weight": 1 + _rand(g, H, scale=0.1),
        "layers.0.mlp.gate_proj.weight": _rand(g, FF, H),
        "layers.0.mlp.up_proj.weight": _rand(g, FF, H),
        "layers.0.mlp.down_proj.weight": _rand(g, H, FF),
    }
    if fc_bias:
        sd["fc.bias"] = _rand(g, H)
    if d2t is not None:
        sd["d2t"] = d2t
    return sd


def eagle3_tensors(seed: int, vd: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randperm(V, generator=g)[:vd]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return {
        "fc.weight": _rand(g, H, 3 * H),
        "midlayer.self_attn.q_proj.weight": _rand(g, NH * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": _rand(g, NKV * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": _rand(g, NKV * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": _rand(g, H, NH * D),
        "midlayer.input_layernorm.weight": 1 + _rand(g, H, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + _rand(g, H, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + _rand(g, H, scale=0.1),
        "midlayer.mlp.gate_proj.weight": _rand(g, FF, H),
        "midlayer.mlp.up_proj.weight": _rand(g, FF, H),
        "midlayer.mlp.down_proj.weight": _rand(g, H, FF),
        "norm.weight": 1 + _rand(g, H, scale=0.1),
        "lm_head.weight": _rand(g, vd, H),
        "d2t": ids - torch.arange(vd),
        "t2d": t2d,
    }


def write_head(path: Path, sd: dict[str, torch.Tensor], config: dict[str, object], *, bin_format: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if bin_format:
        torch.save(sd, path / "pytorch_model.bin")
    else:
        save_file(sd, path / "model.safetensors")
    base = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": H,
        "intermediate_size": FF,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "rope_theta": THETA,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(base | config))
    return path


# -- the reference forward, from the equations --------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D] rotated by position (rotate-half convention)."""
    inv = 1.0 / THETA ** (torch.arange(0, D, 2).float() / D)
    ang = pos[:, None].float() * inv[None]  # [n, D/2]
    cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_layer(sd: dict[str, torch.Tensor], p: str, a: torch.Tensor, res: torch.Tensor, pos: torch.Tensor):
    n = a.shape[0]

    def proj(name: str) -> torch.Tensor:  # with the projection's bias where the checkpoint has one
        out = a @ sd[p + f"self_attn.{name}_proj.weight"].T
        return out + sd[p + f"self_attn.{name}_proj.bias"] if p + f"self_attn.{name}_proj.bias" in sd else out

    q, k, v = rope(proj("q").view(n, NH, D), pos), rope(proj("k").view(n, NKV, D), pos), proj("v").view(n, NKV, D)
    rep = NH // NKV
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, NH * D)
    h = res + att @ sd[p + "self_attn.o_proj.weight"].T + sd.get(p + "self_attn.o_proj.bias", torch.zeros(()))
    m = rms(h, sd[p + "post_attention_layernorm.weight"])
    gate, up = m @ sd[p + "mlp.gate_proj.weight"].T, m @ sd[p + "mlp.up_proj.weight"].T
    return h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T


def reference_eagle1(sd, emb, lm_head, tokens, feats, positions=None):
    x = torch.cat([emb[tokens], feats], dim=-1) @ sd["fc.weight"].T
    if "fc.bias" in sd:
        x = x + sd["fc.bias"]
    h = reference_layer(sd, "layers.0.", x, x, torch.arange(len(tokens)) if positions is None else positions)
    return h, h @ lm_head.T


def reference_eagle3(sd, emb, tokens, aux_feats, *, norm_before_residual: bool = False):
    f = aux_feats @ sd["fc.weight"].T
    f_normed = rms(f, sd["midlayer.hidden_norm.weight"])
    a = torch.cat([rms(emb[tokens], sd["midlayer.input_layernorm.weight"]), f_normed], -1)
    h = reference_layer(sd, "midlayer.", a, f_normed if norm_before_residual else f, torch.arange(len(tokens)))
    return h, rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


def run_head(head, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cache = head.new_cache(1, 64)
    batch = ForwardBatch.build(cache, [cache.allocate()], [tokens.tolist()])
    hidden = head(tokens, head.fuse(feats), batch, cache)
    return hidden, head.logits(hidden)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, *, kernel: bool) -> None:
    """Within float32 rounding of the reference; the small-product kernel sums in another order than BLAS, so its
    outputs are held to a bound scaled by the largest value (logits here reach ~100)."""
    atol = 2e-6 * float(want.abs().max()) + 1e-5 if kernel else 1e-4
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


def with_native_layer(head: EagleHead) -> EagleHead:
    """The head as the loader gives it for drafting on a CPU: the kernel, then its layer from the C++ stack."""
    from specserve.models.native_stack import NativeStackUnavailable, attach_head_stack, attach_small_gemm, extension

    try:
        extension()
    except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
        pytest.skip(f"the C++ extension cannot be built here: {e}")
    attach_small_gemm(head, bf16_reads=True)
    assert attach_head_stack(head) and head.native_stack is not None
    return head


def test_a_float16_heads_layer_runs_in_python_not_from_the_stack(tmp_path: Path, target: LlamaModel) -> None:
    """The C++ stack's norm and RoPE kernels take float32 or bfloat16: a float16 head (``HeadSpec.dtype``) keeps its
    layer in Python, as close to the reference as float16 rounds (the stack's norm raised at its first forward)."""
    from specserve.models.native_stack import NativeStackUnavailable, attach_head_stack, attach_small_gemm, extension

    try:
        extension()
    except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
        pytest.skip(f"the C++ extension cannot be built here: {e}")
    sd = eagle1_tensors(1, fc_bias=False)
    head = load_eagle_head(write_head(tmp_path / "h", sd, {"bias": False}), target, dtype=torch.float16)
    attach_small_gemm(head, bf16_reads=True)
    assert not attach_head_stack(head) and head.native_stack is None and head.native_norm is None
    g = torch.Generator().manual_seed(5)
    tokens, feats = torch.randint(0, V, (9,), generator=g), torch.randn(9, H, generator=g)
    _, logits = run_head(head, tokens, feats)
    emb, lm = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    _, ref_logits = reference_eagle1(sd, emb, lm, tokens, feats)
    torch.testing.assert_close(logits.float(), ref_logits, atol=0.05 * float(ref_logits.abs().max()), rtol=0)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("bin_format", [False, True])
@pytest.mark.parametrize("fc_bias", [False, True])
def test_eagle1_layout_matches_reference(
    tmp_path: Path, target: LlamaModel, fc_bias: bool, bin_format: bool, native: bool
) -> None:
    sd = eagle1_tensors(1, fc_bias=fc_bias)
    path = write_head(tmp_path / "h", sd, {"bias": fc_bias}, bin_format=bin_format)
    head = load_eagle_head(path, target)
    if native:
        with_native_layer(head)
    assert head.cfg.kind == HeadKind.eagle and head.draft_vocab_size == V
    g = torch.Generator().manual_seed(5)
    tokens, feats = torch.randint(0, V, (9,), generator=g), torch.randn(9, H, generator=g)
    hidden, logits = run_head(head, tokens, feats)
    emb, lm = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    ref_h, ref_logits = reference_eagle1(sd, emb, lm, tokens, feats)
    assert_close_to(hidden, ref_h, kernel=native)
    assert_close_to(logits, ref_logits, kernel=native)


def _attention_biases(seed: int, projections: str) -> dict[str, torch.Tensor]:
    g, width = torch.Generator().manual_seed(seed), {"q": NH * D, "k": NKV * D, "v": NKV * D, "o": H}
    return {f"layers.0.self_attn.{n}_proj.bias": _rand(g, width[n], scale=0.5) for n in projections}


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize(
    ("projections", "config", "saved"),
    [
        ("qkvo", {"attention_bias": True}, {"attention_bias": True}),  # a Llama config's attention_bias: all four
        ("qkv", {"attention_bias": True}, {"attention_bias": False, "qkv_bias": True}),  # a Qwen2 target's head
        ("qkv", {"attention_bias": False, "qkv_bias": True}, {"attention_bias": False, "qkv_bias": True}),
        ("o", {"attention_bias": True, "qkv_bias": False}, {"attention_bias": True, "qkv_bias": False}),
    ],
)
def test_attention_biases_load_in_each_spelling_and_save_in_one_that_says_which(
    tmp_path: Path, target: LlamaModel, projections: str, config: dict[str, bool], saved: dict[str, bool], native: bool
) -> None:
    """Biases on q, k, v and o (HF Llama's attention_bias), on q, k and v alone (as heads for Qwen2 targets have
    them, under attention_bias or under vLLM's qkv_bias), or on o alone: each loaded and run as the reference
    computes it, and saved with flags that name exactly the projections that have one."""
    sd = eagle1_tensors(3, fc_bias=True) | _attention_biases(4, projections)
    head = load_eagle_head(write_head(tmp_path / "h", sd, {"bias": True} | config), target)
    assert (head.cfg.qkv_bias, head.cfg.o_bias) == ("q" in projections, "o" in projections)
    if native:
        with_native_layer(head)
    g = torch.Generator().manual_seed(5)
    tokens, feats = torch.randint(0, V, (7,), generator=g), torch.randn(7, H, generator=g)
    hidden, logits = run_head(head, tokens, feats)
    emb, lm = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    ref_h, ref_logits = reference_eagle1(sd, emb, lm, tokens, feats)
    assert_close_to(hidden, ref_h, kernel=native)
    assert_close_to(logits, ref_logits, kernel=native)
    save_eagle_head(head, tmp_path / "saved", dtype=torch.float32)
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert {k: written.get(k) for k in saved} == saved and ("qkv_bias" in written) == ("qkv_bias" in saved)
    assert_close_to(run_head(load_eagle_head(tmp_path / "saved", target), tokens, feats)[1], ref_logits, kernel=False)


def test_attention_bias_flags_that_contradict_the_tensors_are_named(tmp_path: Path, target: LlamaModel) -> None:
    sd = eagle1_tensors(3, fc_bias=False)
    cases = [
        ("qkv_bias_missing", "", {"qkv_bias": True}, "qkv_bias is true but the checkpoint has no q_proj.bias"),
        ("o_missing", "qkv", {"attention_bias": True, "qkv_bias": True}, "attention_bias is true .* no o_proj.bias"),
        ("o_extra", "qkvo", {"attention_bias": False, "qkv_bias": True}, "attention_bias is false .* a o_proj.bias"),
        ("o_unsaid", "o", {"attention_bias": False}, "attention_bias is false .* a o_proj.bias"),
    ]
    for name, projections, config, match in cases:
        with pytest.raises(UnsupportedModelError, match=match):
            load_eagle_head(write_head(tmp_path / name, sd | _attention_biases(1, projections), config), target)


def test_eagle1_reduced_vocabulary(tmp_path: Path, target: LlamaModel) -> None:
    ids = torch.tensor([0, 1, 2, 7, 30, 100, 311, 511])
    sd = eagle1_tensors(2, fc_bias=True, d2t=ids - torch.arange(len(ids)))
    head = load_eagle_head(write_head(tmp_path / "h", sd, {"bias": True}), target)
    assert head.draft_ids.tolist() == ids.tolist()
    tokens, feats = torch.tensor([5, 9, 13]), torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    _, logits = run_head(head, tokens, feats)
    _, full = reference_eagle1(sd, target.embed_tokens.weight.detach(), target.lm_head.weight.detach(), tokens, feats)
    torch.testing.assert_close(logits, full[:, ids], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("native", "bf16_exact"), [(False, False), (True, False), (True, True)])
def test_eagle3_layout_matches_reference(tmp_path: Path, native: bool, bf16_exact: bool) -> None:
    """The EAGLE-3 layout against the reference forward, in Python and from the C++ stack; with weights bfloat16
    holds exactly (as the shipped head's) the stack reads bf16 copies of them: a zeroed copy changes the output."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd = eagle3_tensors(3, vd=96)
    if bf16_exact:
        sd = {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in sd.items()}
    cfg = {"draft_vocab_size": 96, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}}
    head = load_eagle_head(write_head(tmp_path / "h3", sd, cfg), target)
    if native:
        with_native_layer(head)
    assert head.cfg.kind == HeadKind.eagle3 and head.cfg.aux_layers == (2, 3, 4)
    ids = sd["d2t"] + torch.arange(96)
    assert head.draft_ids.tolist() == ids.tolist()
    g = torch.Generator().manual_seed(6)
    tokens, aux = torch.randint(0, V, (7,), generator=g), torch.randn(7, 3 * H, generator=g)
    hidden, logits = run_head(head, tokens, aux)
    ref_h, ref_logits = reference_eagle3(sd, target.embed_tokens.weight.detach(), tokens, aux)
    assert_close_to(hidden, ref_h, kernel=native)
    assert_close_to(logits, ref_logits, kernel=native)
    if not native:
        return
    copies = [getattr(head.layer, n).small_packed for n in ("qkv", "o_proj", "gate_up", "down")]
    assert all(c is not None and c.data.dtype == torch.bfloat16 for c in copies) == bf16_exact
    if bf16_exact:
        copies[3].data.zero_()  # the stack holds the copy itself: its down projection now reads zeros
        changed, _ = run_head(head, tokens, aux)
        assert not torch.allclose(changed, hidden)


class _Counted:
    """A stand-in for the C++ stack that counts its forwards."""

    def __init__(self, stack: object) -> None:
        self.stack, self.calls = stack, 0

    def forward(self, *args: object) -> list[torch.Tensor]:
        self.calls += 1
        return self.stack.forward(*args)  # type: ignore[attr-defined]


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_native_layer_drafts_as_the_python_one(tmp_path: Path, kind: str) -> None:
    """Across steps on a cached prefix: a tree of 4 nodes under its mask, then a ragged batch of two slots, the head
    with its layer from C++ gives the Python layer's outputs and logits (to float rounding: the fused norms), and
    the C++ stack is what ran."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    if kind == "eagle":
        path = write_head(tmp_path / "h", eagle1_tensors(1, fc_bias=True), {"bias": True})
    else:
        cfg = {"draft_vocab_size": 96, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}}
        path = write_head(tmp_path / "h3", eagle3_tensors(3, vd=96), cfg)
    from specserve.models.native_stack import attach_small_gemm

    python_layer = load_eagle_head(path, target)
    attach_small_gemm(python_layer, bf16_reads=True)  # the same products: only the layer's path differs
    heads = [python_layer, with_native_layer(load_eagle_head(path, target))]
    counted = heads[1].native_stack = _Counted(heads[1].native_stack)
    g = torch.Generator().manual_seed(7)
    feat_size = heads[0].cfg.feature_size if kind == "eagle3" else H
    prefix, tree = torch.randint(0, V, (2, 9), generator=g), torch.randint(0, V, (4,), generator=g)
    feats = torch.randn(2, 9, feat_size, generator=g)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    outs = []
    for head in heads:
        cache = head.new_cache(2, 64)
        slots = [cache.allocate(), cache.allocate()]
        steps = []
        for b, n in ((0, 9), (1, 6)):  # prefixes of two sequences
            batch = ForwardBatch.build(cache, [slots[b]], [prefix[b, :n].tolist()])
            steps.append(head(prefix[b, :n], head.fuse(feats[b, :n]), batch, cache))
        batch = ForwardBatch.build(cache, [slots[0]], [tree.tolist()], tree_masks=[mask], positions=[[9, 10, 10, 11]])
        steps.append(
            head(tree, head.fuse(torch.randn(4, feat_size, generator=torch.Generator().manual_seed(1))), batch, cache)
        )
        cache.truncate(slots[0], 9)
        batch = ForwardBatch.build(cache, slots, [tree[:2].tolist(), prefix[1, 6:].tolist()])
        toks = torch.cat([tree[:2], prefix[1, 6:]])
        steps.append(head(toks, head.fuse(torch.cat([feats[0, :2], feats[1, 6:]])), batch, cache))
        hidden = torch.cat(steps)
        outs.append((hidden, head.logits(hidden)))
    assert counted.calls == 4
    for got, want in zip(outs[1], outs[0], strict=True):
        assert_close_to(got, want, kernel=True)


def test_eagle3_default_aux_layers(tmp_path: Path) -> None:
    target = tiny_model(tiny_config(num_hidden_layers=8), seed=4)
    head = load_eagle_head(write_head(tmp_path / "h3", eagle3_tensors(3, vd=96), {"draft_vocab_size": 96}), target)
    assert head.cfg.aux_layers == (2, 4, 5)  # EAGLE-3's default: low, middle and third-from-last layers


def test_default_aux_layers_are_distinct_on_shallow_targets(tmp_path: Path) -> None:
    for layers in range(1, 80):
        aux = default_aux_layers(layers)
        assert len(set(aux)) == min(3, layers) and all(0 <= i < layers for i in aux), (layers, aux)
        assert list(aux) == sorted(aux)
    shallow = tiny_model(tiny_config(num_hidden_layers=6), seed=5)  # (2, L/2, L-3) would fuse layer 3 twice
    head = load_eagle_head(write_head(tmp_path / "h6", eagle3_tensors(3, vd=96), {"draft_vocab_size": 96}), shallow)
    assert head.cfg.aux_layers == (0, 3, 5)  # the first, middle and last layers


def test_malformed_checkpoints_get_clear_errors(tmp_path: Path) -> None:
    target = tiny_model(tiny_config(num_hidden_layers=4), seed=6)  # room for three aux layers
    sd1, sd3 = eagle1_tensors(1, fc_bias=False), eagle3_tensors(3, vd=96)
    e3 = {"draft_vocab_size": 96}
    cases: list[tuple[str, type[Exception], str]] = []

    def case(name: str, sd: dict[str, torch.Tensor], config: dict[str, object], error: type[Exception], match: str):
        write_head(tmp_path / name, sd, config)
        cases.append((name, error, match))

    case("json", sd1, {}, UnsupportedModelError, "not readable JSON")
    (tmp_path / "json" / "config.json").write_text("{not json")
    case("list", sd1, {}, UnsupportedModelError, "holds a list")
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    case("field", sd1, {}, UnsupportedModelError, "num_attention_heads")
    raw = json.loads((tmp_path / "field" / "config.json").read_text())
    (tmp_path / "field" / "config.json").write_text(
        json.dumps({k: v for k, v in raw.items() if k != "num_attention_heads"})
    )
    case("kv", sd1, {"num_key_value_heads": 3}, UnsupportedModelError, "do not divide")
    case("rope", sd1, {"rope_scaling": {"type": "linear"}}, UnsupportedModelError, "RoPE")
    case("vd", sd3, {"draft_vocab_size": V + 1}, UnsupportedModelError, "exceeds")
    aux = e3 | {"eagle_aux_hidden_state_layer_ids": [1, 1, 3]}
    case("aux", sd3, aux, UnsupportedModelError, "distinct")
    case(
        "nan",
        sd1 | {"fc.weight": sd1["fc.weight"].clone().index_fill_(0, torch.tensor([3]), float("nan"))},
        {},
        CorruptModelError,
        "NaN",
    )
    dup = sd3["d2t"].clone()
    dup[1] = dup[0] - 1  # draft ids 0 and 1 both map to target id ids[0]
    case("dup", sd3 | {"d2t": dup}, e3, UnsupportedModelError, "another already has")
    case("2d", sd3 | {"d2t": sd3["d2t"][:, None].contiguous()}, e3, UnsupportedModelError, "1-D")
    case("gelu", sd1, {"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act is 'gelu'")
    case("wide", sd3, e3 | {"target_hidden_size": 2 * H}, UnsupportedModelError, "target_hidden_size 128")
    case("sharded", sd1, {}, UnsupportedModelError, "sharded checkpoint")
    (tmp_path / "sharded" / "model.safetensors").rename(tmp_path / "sharded" / "model-00001-of-00001.safetensors")
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("{}")
    case("empty", sd1, {}, CorruptModelError, "cannot read")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    for field in ("hidden_size", "num_attention_heads", "vocab_size"):  # int(inf): an OverflowError traceback
        case(f"inf_{field}", sd1, {field: float("inf")}, UnsupportedModelError, f"{field} must be an integer")
    # int() read 1.9 as 1 and "4" as 4 (transformers' strict config refuses both for the target)
    case("layers_1.9", sd1, {"num_hidden_layers": 1.9}, UnsupportedModelError, r"num_hidden_layers .* got 1\.9")
    case("heads_str", sd1, {"num_attention_heads": "4"}, UnsupportedModelError, "num_attention_heads .* got '4'")
    case("kv_float", sd1, {"num_key_value_heads": 2.0}, UnsupportedModelError, "num_key_value_heads .* got 2.0")
    case("positions_bool", sd1, {"max_position_embeddings": True}, UnsupportedModelError, "max_position_embeddings")
    case("wide_str", sd3, e3 | {"target_hidden_size": str(H)}, UnsupportedModelError, "target_hidden_size .* got '")
    # a flag as text: "true" was read as not true (the other variant, loaded without a word)
    residual = e3 | {"norm_before_residual": "true"}
    case("residual_str", sd3, residual, UnsupportedModelError, "norm_before_residual is 'true': true or false")
    nested = {"eagle_config": {"norm_output": 1}}
    case("norm_int", sd1, nested, UnsupportedModelError, "norm_output is 1: true or false")
    # a config its own tensors contradict is blamed on itself, not on the target (both are H wide here)
    case("half", sd1, {"hidden_size": H // 2}, UnsupportedModelError, f"hidden_size is {H // 2}; .* has shape")
    case("theta_digits", sd1, {"rope_theta": 10**400}, UnsupportedModelError, "malformed field .*OverflowError")
    for factor in (0, -2.0, float("nan")):  # factor 0 loaded with every RoPE table NaN, -2 loaded
        rope = {"rope_scaling": {"rope_type": "linear", "factor": factor}}
        case(f"factor_{factor}", sd1, rope, UnsupportedModelError, "RoPE scaling factor must be a finite number")
    for eps in (1e30, float("inf")):  # loaded, every norm's output zero
        case(f"eps_{eps}", sd1, {"rms_norm_eps": eps}, UnsupportedModelError, "rms_norm_eps")
    llama3 = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 0, "high_freq_factor": 4}
    llama3 |= {"original_max_position_embeddings": 64}  # (a ZeroDivisionError)
    case("llama3_0", sd1, {"rope_scaling": llama3}, UnsupportedModelError, "cannot build the head's RoPE")
    yarn = {"rope_type": "yarn", "factor": 2, "beta_fast": "x"}  # (transformers' own validation error)
    case("yarn_str", sd1, {"rope_scaling": yarn}, UnsupportedModelError, "cannot build the head's RoPE")
    # one tensor under two spellings: one copy was dropped, whichever came last
    both = sd3 | {"layers.0.hidden_norm.weight": torch.zeros_like(sd3["midlayer.hidden_norm.weight"])}
    case("both3", both, e3, UnsupportedModelError, "midlayer.hidden_norm.weight twice")
    for name, error, match in cases:
        with pytest.raises(error, match=match):
            load_eagle_head(tmp_path / name, target)
    # a pickle states any view of any storage: a 200 KB file's expanded one was read as 40 TB (a raw RuntimeError)
    for name, odd in {
        "expanded": torch.zeros(1).expand(10**7, 10**6),
        "sparse": sd1["fc.weight"].to_sparse(),
        "meta": torch.empty(3, device="meta"),
    }.items():
        write_head(tmp_path / name, sd1 | {"zzz": odd}, {}, bin_format=True)
        with pytest.raises(CorruptModelError, match="zzz is not a dense tensor holding its own values"):
            load_eagle_head(tmp_path / name, target)
    listed = write_head(tmp_path / "bin", sd1, {}, bin_format=True)
    torch.save([1, 2], listed / "pytorch_model.bin")
    with pytest.raises(CorruptModelError, match="not a mapping"):
        load_eagle_head(listed, target)


def test_a_damaged_pickled_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    """Every byte of a pytorch_model.bin's pickle changed in turn: the head loads (a byte of data) or the load is
    a CorruptModelError; before, a quarter of the changes raised the unpickler's own KeyError, TypeError,
    IndexError or AttributeError."""
    import io
    import zipfile

    from specserve.errors import SpecServeError

    target = tiny_model(tiny_config(num_hidden_layers=4), seed=3)
    head = write_head(tmp_path / "h", eagle1_tensors(1, fc_bias=False), {}, bin_format=True)
    weights = head / "pytorch_model.bin"
    whole = weights.read_bytes()
    pkl = next(i for i in zipfile.ZipFile(io.BytesIO(whole)).infolist() if i.filename.endswith("data.pkl"))
    start = pkl.header_offset + 30 + len(pkl.filename) + len(pkl.extra)  # past the member's local header
    outcomes: dict[str, int] = {}
    for at in range(start, start + pkl.compress_size):
        damaged = bytearray(whole)
        damaged[at] ^= 0x59
        weights.write_bytes(bytes(damaged))
        try:
            load_eagle_head(head, target)
            outcome = "loaded"
        except CorruptModelError:
            outcome = "corrupt"
        except SpecServeError as e:
            outcome = type(e).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert set(outcomes) <= {"loaded", "corrupt", "UnsupportedModelError"} and outcomes["corrupt"] > 0, outcomes


def test_a_full_vocabulary_eagle1_head_reads_the_targets_lm_head_without_a_copy(
    tmp_path: Path, target: LlamaModel
) -> None:
    """The head's LM head rows were always a copy: the whole of a large target's LM head again (2 GB for a
    Llama-3-8B head in float32). The rows are the target's own where the head keeps every id in its dtype."""
    from specserve.spec_decode.eagle_head import dense_weight

    full = dense_weight(target.lm_head)
    head = load_eagle_head(write_head(tmp_path / "h", eagle1_tensors(4, fc_bias=False), {}), target)
    assert head.target_lm_head is not None and head.target_lm_head.data_ptr() == full.data_ptr()
    ids = torch.tensor([0, 3, 9, 500])
    head.set_draft_vocab(ids)
    assert head.target_lm_head.data_ptr() != full.data_ptr() and torch.equal(head.target_lm_head, full[ids])
    half = load_eagle_head(
        write_head(tmp_path / "h16", eagle1_tensors(4, fc_bias=False), {}), target, dtype=torch.float16
    )
    assert half.target_lm_head is not None and half.target_lm_head.dtype == torch.float16
    torch.testing.assert_close(half.target_lm_head.float(), full, atol=1e-3, rtol=1e-3)


def test_mismatches_are_named(tmp_path: Path, target: LlamaModel) -> None:
    sd = eagle1_tensors(1, fc_bias=False)
    with pytest.raises(UnsupportedModelError, match="vocabulary"):
        load_eagle_head(write_head(tmp_path / "v", sd, {"vocab_size": 1000}), target)
    wide = tiny_model(tiny_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2), seed=0)
    with pytest.raises(UnsupportedModelError, match="hidden size"):
        load_eagle_head(write_head(tmp_path / "h", sd, {}), wide)
    bad = dict(sd)
    bad["layers.0.mlp.down_proj.weight"] = torch.zeros(H, FF + 1)
    with pytest.raises(UnsupportedModelError, match="down_proj"):
        load_eagle_head(write_head(tmp_path / "s", bad, {}), target)
    missing = {k: v for k, v in sd.items() if "o_proj" not in k}
    with pytest.raises(UnsupportedModelError, match="missing"):
        load_eagle_head(write_head(tmp_path / "m", missing, {}), target)
    emb = dict(sd, **{"embed_tokens.weight": torch.zeros(V + 5, H)})
    with pytest.raises(UnsupportedModelError, match="embedding"):
        load_eagle_head(write_head(tmp_path / "e", emb, {}), target)
    for theta in (0, float("inf"), float("nan")):  # no RoPE angles from such a base
        with pytest.raises(UnsupportedModelError, match="rope_theta"):
            load_eagle_head(write_head(tmp_path / f"r{theta}", sd, {"rope_theta": theta}), target)
    with pytest.raises(UnsupportedModelError, match="aux layers"):
        sd3 = eagle3_tensors(3, vd=96)
        load_eagle_head(
            write_head(tmp_path / "a", sd3, {"draft_vocab_size": 96, "eagle_aux_hidden_state_layer_ids": [0, 1, 9]}),
            target,
        )


def test_a_head_trained_for_another_target_of_the_same_shapes_is_refused(tmp_path: Path, target: LlamaModel) -> None:
    """The target's embedding as the head knew it (the checkpoint's own copy, or the sample train-draft writes in
    config.json) against this target's: another model's is refused by name, a quantised copy of this one loads."""
    sd = eagle1_tensors(1, fc_bias=False)
    emb = target.embed_tokens.weight.detach()
    other = tiny_model(seed=4).embed_tokens.weight.detach()
    blocks = emb.reshape(-1, 32)  # 4-bit absmax blocks of 32, as a Q4_0 copy of the target stores it
    scale = blocks.abs().amax(1, keepdim=True) / 7
    four_bit = (torch.round(blocks / scale) * scale).reshape(emb.shape)
    rows = [round(i * (V - 1) / 63) for i in range(64)]  # the sample: 64 rows evenly spaced, their first 8 columns
    for name, weight, loads in [("same", emb, True), ("q4", four_bit, True), ("other", other, False)]:
        copy = write_head(tmp_path / f"copy-{name}", dict(sd, **{"embed_tokens.weight": weight.clone()}), {})
        sample = weight[rows, :8].flatten().tolist()
        noted = write_head(tmp_path / f"sample-{name}", sd, {"specserve_target_embedding_sample": sample})
        for path in (copy, noted):
            if loads:
                load_eagle_head(path, target)
            else:
                with pytest.raises(UnsupportedModelError, match="trained for another target"):
                    load_eagle_head(path, target)
    for bad in ("0.1", [0.1] * 7, [[0.0] * 8] * 64, [float("nan")] * 512):
        with pytest.raises(UnsupportedModelError, match="specserve_target_embedding_sample"):
            load_eagle_head(write_head(tmp_path / "bad", sd, {"specserve_target_embedding_sample": bad}), target)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"type": "linear", "factor": 4.0}},  # the legacy key, as EAGLE's own configs write it
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": THETA}},  # transformers 5
    ],
)
def test_rope_scaling_is_applied_in_every_spelling(tmp_path: Path, target: LlamaModel, rope: dict) -> None:
    sd = eagle1_tensors(4, fc_bias=False)
    head = load_eagle_head(write_head(tmp_path / "h", sd, rope), target)
    g = torch.Generator().manual_seed(6)
    tokens, feats = torch.randint(0, V, (9,), generator=g), torch.randn(9, H, generator=g)
    hidden, _ = run_head(head, tokens, feats)
    emb, lm = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    linear_positions = torch.arange(len(tokens)) / 4.0  # linear scaling: position t turns as t / factor
    assert_close_to(hidden, reference_eagle1(sd, emb, lm, tokens, feats, linear_positions)[0], kernel=False)


@pytest.mark.parametrize("top_level", [None, THETA])
def test_a_rope_base_given_inside_rope_scaling_is_the_one_used(
    tmp_path: Path, target: LlamaModel, top_level: float | None
) -> None:
    """NVIDIA ModelOpt's heads write the base inside ``rope_scaling`` (with or without a top-level copy); transformers
    reads the inner one first, and so must the head, or it turns its keys at the wrong rate without an error."""
    base = 500000.0
    path = write_head(tmp_path / "h", eagle1_tensors(4, fc_bias=False), {})
    config = json.loads((path / "config.json").read_text())
    del config["rope_theta"]
    scaling = {"rope_type": "default", "rope_theta": base}
    (path / "config.json").write_text(
        json.dumps(config | {"rope_scaling": scaling} | ({"rope_theta": top_level} if top_level else {}))
    )
    head = load_eagle_head(path, target)
    pos = torch.tensor([0, 1, 7, 300])
    inv = 1.0 / base ** (torch.arange(0, D, 2).float() / D)
    ang = pos[:, None].float() * inv[None]  # [4, D/2]
    torch.testing.assert_close(head.rope_cos[pos], torch.cat([ang.cos(), ang.cos()], -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(head.rope_sin[pos], torch.cat([ang.sin(), ang.sin()], -1), atol=1e-5, rtol=0)


def test_dynamic_rope_in_the_legacy_key_is_refused(tmp_path: Path, target: LlamaModel) -> None:
    config = {"rope_scaling": {"type": "dynamic", "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        load_eagle_head(write_head(tmp_path / "h", eagle1_tensors(4, fc_bias=False), config), target)


def test_tensors_of_a_deeper_or_other_head_are_refused(tmp_path: Path, target: LlamaModel) -> None:
    sd = eagle1_tensors(5, fc_bias=False)
    second = {k.replace("layers.0.", "layers.1."): v.clone() for k, v in sd.items() if k.startswith("layers.0.")}
    with pytest.raises(UnsupportedModelError, match="one decoder layer"):
        load_eagle_head(write_head(tmp_path / "two", sd | second, {"num_hidden_layers": 2}), target)
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.down_proj"):
        load_eagle_head(write_head(tmp_path / "extra", sd | second, {}), target)
    mlp_bias = {"layers.0.mlp.down_proj.bias": torch.zeros(H)}
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.bias"):
        load_eagle_head(write_head(tmp_path / "bias", sd | mlp_bias, {}), target)
    inv_freq = {"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(D // 2)}  # saved by old transformers
    plain = load_eagle_head(write_head(tmp_path / "plain", sd, {}), target)
    with_buffer = load_eagle_head(write_head(tmp_path / "buf", sd | inv_freq, {}), target)
    tokens, feats = torch.tensor([3, 4, 5]), torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(run_head(with_buffer, tokens, feats)[1], run_head(plain, tokens, feats)[1])


def test_the_head_drafts_at_every_position_of_its_target(tmp_path: Path, target: LlamaModel) -> None:
    """A published config's max_position_embeddings (EAGLE-3's LLaMA-3.1 heads say 2048) does not cap the context:
    the head's RoPE table spans the target's positions."""
    head = load_eagle_head(
        write_head(tmp_path / "h", eagle1_tensors(6, fc_bias=False), {"max_position_embeddings": 64}), target
    )
    assert head.max_positions == target.max_positions == 512
    pos = torch.tensor([0, 63, 64, 300, 511])
    inv = 1.0 / THETA ** (torch.arange(0, D, 2).float() / D)
    ang = pos[:, None].float() * inv[None]
    torch.testing.assert_close(head.rope_cos[pos], torch.cat([ang.cos(), ang.cos()], -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(head.rope_sin[pos], torch.cat([ang.sin(), ang.sin()], -1), atol=1e-5, rtol=0)


def test_save_then_load_roundtrip(tmp_path: Path, target: LlamaModel) -> None:

    sd = eagle1_tensors(7, fc_bias=True)
    head = load_eagle_head(write_head(tmp_path / "a", sd, {"bias": True}), target)
    head.set_draft_vocab(torch.arange(0, V, 2))
    save_eagle_head(head, tmp_path / "b", dtype=torch.float32)
    # readable by whoever serves it, as its config.json is (safetensors writes its files 0600)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "b").iterdir()}
    assert modes["model.safetensors"] & 0o044 == 0o044 and set(modes) == {"model.safetensors", "config.json"}
    again = load_eagle_head(tmp_path / "b", target)
    assert again.draft_ids.tolist() == list(range(0, V, 2))
    tokens, feats = torch.tensor([3, 4, 5, 6]), torch.randn(4, H, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(run_head(again, tokens, feats)[1], run_head(head, tokens, feats)[1])


@pytest.mark.parametrize("name", ["smollm2-eagle3", "smollm2-eagle1"])
def test_shipped_head_is_intact_and_documented(name: str) -> None:
    """The committed SmolLM2 heads: weights match their sha256, at most 20 MB, with provenance and a vocabulary
    map."""
    import hashlib

    from specserve.config import HeadSpec

    d = HeadSpec(head=name).path()
    weights = d / "model.safetensors"
    assert weights.stat().st_size <= 20 * 1024 * 1024
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (d / "model.safetensors.sha256").read_text().split()[0] == digest
    prov = json.loads((d / "provenance.json").read_text())
    assert prov["sha256"] == digest and prov["command"].startswith("specserve train-draft")
    assert {"data", "train", "steps", "draft_vocab", "seconds"} <= set(prov) and prov["train"]["seed"] == 0
    assert "never MT-bench" in prov["data"]["source"]
    vocab = json.loads((d / "vocab_map.json").read_text())
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["specserve_target"] == "smollm2-135m-instruct"
    assert len(vocab["by_frequency"]) >= prov["draft_vocab"]["size"] and set(vocab["forced"]) <= set(
        vocab["by_frequency"][: len(vocab["forced"])]
    )


@pytest.mark.real_model
def test_shipped_head_loads_on_its_target_with_any_vocabulary_prefix() -> None:
    from specserve.config import MODEL_PAIRS, HeadSpec
    from specserve.models.loader import load_draft, load_model

    target_spec, head_spec = MODEL_PAIRS["smollm2-eagle1"]  # the EAGLE-1/2 head (EAGLE-3 fixes its vocabulary)
    assert isinstance(head_spec, HeadSpec)
    target = load_model(target_spec)
    head = load_draft(head_spec, target)
    assert isinstance(head, EagleHead) and head.trained_for == "smollm2-135m-instruct"
    small = load_draft(head_spec.model_copy(update={"draft_vocab": 1024}), target)
    assert isinstance(small, EagleHead) and small.draft_vocab_size == 1024
    assert set(small.draft_ids.tolist()) < set(head.draft_ids.tolist())  # a prefix of the trained vocabulary
    full = load_draft(head_spec.model_copy(update={"draft_vocab": target.cfg.vocab_size}), target)
    assert isinstance(full, EagleHead) and full.draft_vocab_size == target.cfg.vocab_size


def test_a_model_spec_that_cannot_load_is_refused_at_validation() -> None:
    import pydantic

    from specserve.config import DType, ModelSpec

    with pytest.raises(pydantic.ValidationError, match="int8_dynamic"):
        ModelSpec(int8_dynamic=True, dtype=DType.bfloat16)
    with pytest.raises(pydantic.ValidationError, match="row counts"):
        ModelSpec(mkl_packed_widths=(0,))


def test_an_unreadable_head_checkpoint_is_named(tmp_path: Path) -> None:

    bad = write_head(tmp_path / "h", eagle1_tensors(1, fc_bias=False), {})
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptModelError, match="cannot read"):
        checkpoint_kind(bad)


def test_weights_that_do_not_match_their_sha256_file_are_refused(tmp_path: Path, target: LlamaModel) -> None:
    import hashlib

    path = write_head(tmp_path / "h", eagle1_tensors(1, fc_bias=False), {})
    weights = path / "model.safetensors"
    digest_file = path / "model.safetensors.sha256"
    load_eagle_head(path, target)  # no digest file: nothing to check
    digest_file.write_text(f"{hashlib.sha256(weights.read_bytes()).hexdigest().upper()}  model.safetensors\n")
    load_eagle_head(path, target)
    altered = bytearray(weights.read_bytes())
    altered[-1] ^= 1  # one bit of the last weight: still a readable checkpoint
    weights.write_bytes(bytes(altered))
    with pytest.raises(CorruptModelError, match=r"does not match model\.safetensors\.sha256"):
        load_eagle_head(path, target)
    digest_file.write_text("")
    with pytest.raises(CorruptModelError, match=r"does not hold a sha256 digest of model\.safetensors"):
        load_eagle_head(path, target)
    # sha256sum's lines: every file listed is checked (config.json here)
    weights.write_bytes(bytes(altered[:-1] + bytes([altered[-1] ^ 1])))  # the original weights back
    good = f"{hashlib.sha256(weights.read_bytes()).hexdigest()}  model.safetensors\n"
    config_digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    digest_file.write_text(good + f"{config_digest}  *config.json\n")  # (sha256sum -b marks a name with *)
    load_eagle_head(path, target)
    (path / "config.json").write_text((path / "config.json").read_text() + " ")
    with pytest.raises(CorruptModelError, match=r"config\.json does not match model\.safetensors\.sha256"):
        load_eagle_head(path, target)
    digest_file.write_text(good + f"{config_digest}  vocab_map.json\n")  # a file not there is not read: not checked
    (path / "config.json").write_text((path / "config.json").read_text()[:-1])
    load_eagle_head(path, target)
    for bad, says in [
        (good + f"{config_digest}  ../config.json\n", "line 2 is not a sha256 digest and a file name"),
        (good + "abc  config.json\n", "line 2 is not"),
        (good + good, "line 2 is not"),
    ]:
        digest_file.write_text(bad)
        with pytest.raises(CorruptModelError, match=says):
            load_eagle_head(path, target)


def test_a_shipped_head_without_its_sha256_file_is_refused(
    tmp_path: Path, target: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head shipped in the package must carry its digest, to be served or fine-tuned (``train-draft
    --init-head``); a head in a directory of its own need not."""
    import hashlib
    import shutil

    from specserve.models.loader import load_draft

    shipped = tmp_path / "heads"
    monkeypatch.setattr("specserve.config.BUILTIN_HEADS_DIR", shipped)
    path = write_head(shipped / "h", eagle1_tensors(1, fc_bias=False), {})
    spec = HeadSpec(head="h", quantize=HeadQuant.none)
    assert spec.shipped and spec.path() == path
    with pytest.raises(CorruptModelError, match=r"no model\.safetensors\.sha256 beside it"):
        load_draft(spec, target)
    with pytest.raises(CorruptModelError, match=r"no model\.safetensors\.sha256 beside it"):
        load_eagle_head(path, target, check_target=False)  # as train-draft --init-head loads it
    own = shutil.copytree(path, tmp_path / "own")
    load_eagle_head(own, target)  # a directory of its own: nothing to check

    def digest(name: str) -> str:
        return f"{hashlib.sha256((path / name).read_bytes()).hexdigest()}  {name}\n"

    (path / "vocab_map.json").write_text(json.dumps({"by_frequency": [0, 1], "forced": [0]}))
    record = path / "model.safetensors.sha256"
    record.write_text(digest("model.safetensors"))  # the weights alone: enough for a head of one's own ...
    with pytest.raises(CorruptModelError, match=r"lists no digest of config\.json, vocab_map\.json, which a shipped"):
        load_draft(spec, target)  # ... not for a shipped one: its config and vocabulary map are read too
    record.write_text(digest("model.safetensors") + digest("config.json") + digest("vocab_map.json"))
    load_draft(spec, target)
    (path / "vocab_map.json").write_text(json.dumps({"by_frequency": [1, 0], "forced": [1]}))  # edited after
    with pytest.raises(CorruptModelError, match=r"vocab_map\.json does not match model\.safetensors\.sha256"):
        load_draft(spec, target)


def test_a_t2d_that_disagrees_with_d2t_is_refused(tmp_path: Path) -> None:
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd = eagle3_tensors(3, vd=96)
    cfg = {"draft_vocab_size": 96}
    load_eagle_head(write_head(tmp_path / "ok", sd, cfg), target)
    ids = sd["d2t"] + torch.arange(96)
    moved = sd["t2d"].clone()
    moved[ids[0]] = False
    moved[(~sd["t2d"]).nonzero()[0]] = True  # as many marks, one on a token the draft vocabulary lacks
    for t2d, match in [(moved, "not the 96"), (sd["t2d"][:-1], r"\[512\] bool"), (sd["t2d"].float(), "bool")]:
        with pytest.raises(UnsupportedModelError, match=match):
            load_eagle_head(write_head(tmp_path / "bad", sd | {"t2d": t2d}, cfg), target)


def test_aux_layer_ids_are_read_in_the_convention_their_checkpoint_was_trained_in(tmp_path: Path) -> None:
    """SpecForge-trained heads name layer outputs (their default list starts at 1: the first block's output, the
    input of layer 2); read as inputs, every feature came one layer early and the head was mostly rejected. A list
    from EAGLE-3's own default (inputs, starting at 2) and one this project wrote are read as they are."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd, base = eagle3_tensors(3, vd=96), {"draft_vocab_size": 96}
    for ids, aux in (([1, 3, 4], (2, 4, 5)), ([3, 1, 2], (2, 3, 4)), ([2, 3, 5], (2, 3, 5)), ([0, 1, 3], (0, 1, 3))):
        for where in ("eagle_config", "top level"):
            config = base | ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}} if where == "eagle_config"
                             else {"eagle_aux_hidden_state_layer_ids": ids})  # fmt: skip
            head = load_eagle_head(write_head(tmp_path / f"{ids}{where}", sd, config), target)
            assert head.cfg.aux_layers == aux, (ids, where)
    with pytest.raises(UnsupportedModelError, match=r"aux layers \[6\] \(as layer inputs\)"):  # the last output
        load_eagle_head(
            write_head(tmp_path / "last", sd, base | {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}), target
        )
    # a head this project saves with layers from 1 keeps them: its config says its ids are inputs
    written = load_eagle_head(
        write_head(tmp_path / "ours", sd, base | {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}), target
    )
    assert written.cfg.aux_layers == (2, 4, 5)
    ours = EagleHead(written.cfg.model_copy(update={"aux_layers": (1, 3, 4)}), target)
    ours.load_state_dict(written.state_dict(), strict=False)
    save_eagle_head(ours, tmp_path / "saved")
    assert load_eagle_head(tmp_path / "saved", target).cfg.aux_layers == (1, 3, 4)


def test_aux_layers_listed_out_of_order_are_fused_in_layer_order(tmp_path: Path) -> None:
    """The target hands the aux features over in layer order (as published EAGLE-3 implementations concatenate
    them), so a config listing [4, 2, 3] describes the head of [2, 3, 4]; non-integer ids are refused."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd, base = eagle3_tensors(3, vd=96), {"draft_vocab_size": 96}
    listed = load_eagle_head(
        write_head(tmp_path / "a", sd, base | {"eagle_aux_hidden_state_layer_ids": [4, 2, 3]}), target
    )
    assert listed.cfg.aux_layers == (2, 3, 4)
    with pytest.raises(UnsupportedModelError, match="list of layer indices"):
        load_eagle_head(
            write_head(tmp_path / "f", sd, base | {"eagle_aux_hidden_state_layer_ids": [0.9, 1.5, 3.2]}), target
        )
    with pytest.raises(ValueError, match="ascending"):
        EagleHeadConfig.model_validate(listed.cfg.model_dump() | {"aux_layers": (4, 1, 3)})


def test_checkpoints_that_contradict_themselves_are_refused(tmp_path: Path, target: LlamaModel) -> None:
    """Config flags and sizes that the tensors contradict, vocabulary maps that do not add up, weights of a type
    the head cannot compute in, and weights that overflow the dtype they are cast to: each a clear error."""
    import os

    sd1, sd1b = eagle1_tensors(1, fc_bias=False), eagle1_tensors(1, fc_bias=True)
    q_bias = {
        "layers.0.self_attn.q_proj.bias": torch.zeros(NH * D),
        "layers.0.self_attn.k_proj.bias": torch.zeros(NKV * D),
        "layers.0.self_attn.v_proj.bias": torch.zeros(NKV * D),
    }
    ids = torch.arange(0, V, 4)
    d2t = ids - torch.arange(len(ids))
    full_t2d = torch.ones(V, dtype=torch.bool)
    cases: list[tuple[str, dict[str, torch.Tensor], dict[str, object], type[Exception], str]] = [
        ("bias_missing", sd1, {"bias": True}, UnsupportedModelError, "bias is true but the checkpoint has no fc.bias"),
        ("bias_extra", sd1b, {"bias": False}, UnsupportedModelError, "bias is false but the checkpoint has a fc.bias"),
        ("attn_bias", sd1, {"attention_bias": True}, UnsupportedModelError, "attention_bias is true"),
        ("attn_extra", sd1 | q_bias, {"attention_bias": False}, UnsupportedModelError, "attention_bias is false"),
        ("vd_no_map", sd1, {"draft_vocab_size": 100}, UnsupportedModelError, "needs its d2t map"),
        ("vd_count", sd1 | {"d2t": d2t}, {"draft_vocab_size": 100}, UnsupportedModelError, "d2t has 128 entries"),
        (
            "t2d_alone",
            sd1 | {"t2d": full_t2d.clone().index_fill_(0, torch.arange(10), False)},
            {},
            UnsupportedModelError,
            "t2d marks 502",
        ),
        (
            "t2d_int",
            sd1
            | {
                "d2t": d2t,
                "t2d": torch.zeros(V, dtype=torch.long).index_fill_(0, ids, 1).index_fill_(0, torch.tensor([1]), 7),
            },
            {},
            UnsupportedModelError,
            "0/1 integers",
        ),
        ("int_weights", {k: (v * 10).long() for k, v in sd1.items()}, {}, UnsupportedModelError, "must be float32"),
        ("fp8", sd1 | {"fc.weight": sd1["fc.weight"].to(torch.float8_e4m3fn)}, {}, UnsupportedModelError, "float8"),
        ("huge", sd1, {"intermediate_size": 10**9}, UnsupportedModelError, "intermediate_size is 1000000000"),
        (  # (its size could not be checked: the head was built with the config's 400 GB first)
            "huge_missing",
            {k: v for k, v in sd1.items() if k != "layers.0.mlp.gate_proj.weight"},
            {"intermediate_size": 10**11},
            UnsupportedModelError,
            r"missing \['layers.0.mlp.gate_proj.weight'\]",
        ),
        ("heads", sd1, {"head_dim": 2 * D}, UnsupportedModelError, "num_attention_heads x head_dim"),
    ]
    for name, sd, config, error, match in cases:
        with pytest.raises(error, match=match):
            load_eagle_head(write_head(tmp_path / name, sd, config), target)
    big = write_head(tmp_path / "overflow", sd1 | {"fc.weight": sd1["fc.weight"] * 1e6}, {})
    load_eagle_head(big, target)  # finite in float32 ...
    with pytest.raises(UnsupportedModelError, match=r"do not fit in torch\.float16"):
        load_eagle_head(big, target, dtype=torch.float16)  # ... not once cast
    piped = write_head(tmp_path / "fifo", sd1, {})
    (piped / "model.safetensors").unlink()
    os.mkfifo(piped / "model.safetensors")  # a reader would wait on it for ever
    with pytest.raises(UnsupportedModelError, match=r"no model\.safetensors or pytorch_model\.bin"):
        load_eagle_head(piped, target)


def test_only_a_shipped_heads_name_resolves_to_the_shipped_heads() -> None:
    """'.' and '..' named the shipped-heads folder and the package itself (both are folders there)."""
    from specserve.config import BUILTIN_HEADS_DIR, HeadSpec

    assert HeadSpec(head="smollm2-eagle3").path() == BUILTIN_HEADS_DIR / "smollm2-eagle3"
    for name in (".", ".."):
        assert HeadSpec(head=name).path() == Path(name)


@pytest.mark.parametrize("native", [False, True])
def test_eagle3_norm_before_residual_matches_reference(tmp_path: Path, native: bool) -> None:
    """``norm_before_residual: true`` (the speculators' EAGLE-3 heads): the layer's residual is hidden_norm(f)."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd = eagle3_tensors(3, vd=96)
    cfg = {"draft_vocab_size": 96, "norm_before_residual": True}
    head = load_eagle_head(write_head(tmp_path / "h", sd, cfg), target)
    if native:
        with_native_layer(head)
    assert head.cfg.norm_before_residual
    g = torch.Generator().manual_seed(6)
    tokens, aux = torch.randint(0, V, (7,), generator=g), torch.randn(7, 3 * H, generator=g)
    hidden, logits = run_head(head, tokens, aux)
    emb = target.embed_tokens.weight.detach()
    ref_h, ref_logits = reference_eagle3(sd, emb, tokens, aux, norm_before_residual=True)
    assert_close_to(hidden, ref_h, kernel=native)
    assert_close_to(logits, ref_logits, kernel=native)
    other_h, _ = reference_eagle3(sd, emb, tokens, aux)
    assert not torch.allclose(other_h, ref_h, atol=1e-2)  # the flag matters for these weights
    saved = load_eagle_head(save_eagle_head(head, tmp_path / "saved", dtype=torch.float32).parent, target)
    assert saved.cfg.norm_before_residual


def test_eagle3_saved_under_layers_0_loads_as_midlayer(tmp_path: Path) -> None:
    """vLLM reads an EAGLE-3 head's layer as ``midlayer.*`` or ``layers.0.*``; the latter is told from an
    EAGLE-1/2 head by its hidden_norm."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd = eagle3_tensors(3, vd=96)
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    path = write_head(tmp_path / "h", renamed, {"draft_vocab_size": 96})
    assert checkpoint_kind(path) == HeadKind.eagle3
    head = load_eagle_head(path, target)
    g = torch.Generator().manual_seed(6)
    tokens, aux = torch.randint(0, V, (7,), generator=g), torch.randn(7, 3 * H, generator=g)
    hidden, logits = run_head(head, tokens, aux)
    ref_h, ref_logits = reference_eagle3(sd, target.embed_tokens.weight.detach(), tokens, aux)
    assert_close_to(hidden, ref_h, kernel=False)
    assert_close_to(logits, ref_logits, kernel=False)


def test_an_eagle3_head_in_the_speculators_format_loads(tmp_path: Path) -> None:
    """The speculators' layout (RedHatAI's EAGLE-3 heads): the Llama fields nested under transformer_layer_config,
    the EAGLE ones at the top, the layer under layers.0.*; the same head as the flat layout gives."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd = eagle3_tensors(3, vd=96)
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    path = write_head(tmp_path / "h", renamed, {})
    flat = json.loads((path / "config.json").read_text())
    layer = {k: flat[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")}
    layer |= {k: flat[k] for k in ("num_hidden_layers", "rms_norm_eps", "vocab_size", "rope_theta", "hidden_act")}
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer | {"model_type": "llama", "rope_scaling": None},
        "draft_vocab_size": 96,
        "norm_before_residual": True,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [2, 3, 4],
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}},
    }
    (path / "config.json").write_text(json.dumps(config))
    head = load_eagle_head(path, target)
    assert head.cfg.kind == HeadKind.eagle3 and head.cfg.aux_layers == (2, 3, 4) and head.cfg.norm_before_residual
    assert head.cfg.rope_theta == THETA and head.draft_vocab_size == 96
    g = torch.Generator().manual_seed(6)
    tokens, aux = torch.randint(0, V, (7,), generator=g), torch.randn(7, 3 * H, generator=g)
    hidden, logits = run_head(head, tokens, aux)
    ref_h, ref_logits = reference_eagle3(
        sd, target.embed_tokens.weight.detach(), tokens, aux, norm_before_residual=True
    )
    assert_close_to(hidden, ref_h, kernel=False)
    assert_close_to(logits, ref_logits, kernel=False)
    for bad, says in [
        ({"speculators_model_type": "mlp"}, "speculators_model_type 'mlp'"),
        ({"transformer_layer_config": None}, "without a transformer_layer_config"),
        ({"layernorms": True}, "layernorms"),
        ({"norm_output": True}, "norm_output"),
    ]:
        (path / "config.json").write_text(json.dumps(config | bad))
        with pytest.raises(UnsupportedModelError, match=says):
            load_eagle_head(path, target)
    # the speculators' own default is norm_before_residual true (a flat EAGLE-3 config's, false)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "norm_before_residual"}))
    assert load_eagle_head(path, target).cfg.norm_before_residual
    (path / "config.json").write_text(json.dumps(config | {"norm_before_residual": False}))
    assert not load_eagle_head(path, target).cfg.norm_before_residual


def test_norms_the_head_does_not_apply_are_refused_wherever_the_config_sets_them(tmp_path: Path) -> None:
    """norm_output, norm_before_fc and fc_norm change what the head computes, and a checkpoint may carry them with no
    tensor (the norm's weight then ones): set at the top or under eagle_config (NVIDIA's gpt-oss heads), each is
    refused by name; norm_before_residual is read from eagle_config too."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd = eagle3_tensors(3, vd=96)
    path = write_head(tmp_path / "h", sd, {"draft_vocab_size": 96})
    config = json.loads((path / "config.json").read_text())
    for key in ("norm_output", "norm_before_fc", "fc_norm"):
        for where in ({key: True}, {"eagle_config": {key: True}}):
            (path / "config.json").write_text(json.dumps(config | where))
            with pytest.raises(UnsupportedModelError, match=f"{key} .* is not supported"):
                load_eagle_head(path, target)
        (path / "config.json").write_text(json.dumps(config | {"eagle_config": {key: False}}))
        load_eagle_head(path, target)
    (path / "config.json").write_text(json.dumps(config | {"eagle_config": {"norm_before_residual": True}}))
    head = load_eagle_head(path, target)
    assert head.cfg.norm_before_residual
    g = torch.Generator().manual_seed(6)
    tokens, aux = torch.randint(0, V, (7,), generator=g), torch.randn(7, 3 * H, generator=g)
    hidden, _ = run_head(head, tokens, aux)
    emb = target.embed_tokens.weight.detach()
    assert_close_to(hidden, reference_eagle3(sd, emb, tokens, aux, norm_before_residual=True)[0], kernel=False)


@pytest.mark.parametrize("names", ["speculators", "eagle"])
def test_an_eagle1_head_in_the_speculators_format_loads(tmp_path: Path, target: LlamaModel, names: str) -> None:
    """The speculators' EAGLE-1/HASS heads: the config nested as for EAGLE-3, fusion_bias for bias, and (in their
    saved layout) fc as fusion_fc.*, the layer as transformer.*, beside copies of the target's embedding and LM
    head; the same head as the flat layout gives."""
    sd = eagle1_tensors(4, fc_bias=True)
    emb, lm = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    saved = {
        (k.replace("fc.", "fusion_fc.", 1) if k.startswith("fc.") else k.replace("layers.0.", "transformer.", 1))
        if names == "speculators"
        else k: v
        for k, v in sd.items()
    }
    path = write_head(tmp_path / "h", saved | {"embed_tokens.weight": emb.clone(), "lm_head.weight": lm.clone()}, {})
    flat = json.loads((path / "config.json").read_text())
    layer = {k: v for k, v in flat.items() if k not in ("bias", "architectures")}
    config = {
        "speculators_model_type": "eagle",
        "architectures": ["EagleSpeculator"],
        "layernorms": False,
        "fusion_bias": True,
        "transformer_layer_config": layer | {"model_type": "llama"},
        "speculators_config": {"algorithm": "eagle", "verifier": {"name_or_path": "tiny"}},
    }
    (path / "config.json").write_text(json.dumps(config))
    head = load_eagle_head(path, target)
    assert head.cfg.kind == HeadKind.eagle and head.cfg.fc_bias
    g = torch.Generator().manual_seed(5)
    tokens, feats = torch.randint(0, V, (9,), generator=g), torch.randn(9, H, generator=g)
    hidden, logits = run_head(head, tokens, feats)
    ref_h, ref_logits = reference_eagle1(sd, emb, lm, tokens, feats)
    assert_close_to(hidden, ref_h, kernel=False)
    assert_close_to(logits, ref_logits, kernel=False)
    if names == "eagle":  # fc beside the speculators' spelling of it: one copy was dropped, whichever came last
        both = saved | {"fusion_fc.weight": torch.zeros_like(sd["fc.weight"])}
        twice = write_head(tmp_path / "twice", both | {"embed_tokens.weight": emb.clone()}, {})
        (twice / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedModelError, match=r"fc\.weight twice \(as fusion_fc\.weight"):
            load_eagle_head(twice, target)


def test_a_heads_own_embedding_and_lm_head_are_drafted_with_where_not_the_targets(
    tmp_path: Path, target: LlamaModel
) -> None:
    """A checkpoint's copy of the target's embedding (EAGLE-3, the speculators' embed_requires_grad) or, for
    EAGLE-1/2, of its LM head that differs from the target's is what the head was trained with: the reference code
    and vLLM draft with it. An exact copy is shared, not held twice; fine-tuning (check_target off) uses the
    target's."""
    emb, lm = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    g = torch.Generator().manual_seed(9)
    own_emb = emb + 0.05 * emb.std() * torch.randn(emb.shape, generator=g)
    own_lm = lm + 0.05 * lm.std() * torch.randn(lm.shape, generator=g)
    tokens = torch.randint(0, V, (7,), generator=g)

    target6 = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    emb6 = target6.embed_tokens.weight.detach()
    own_emb6 = emb6 + 0.05 * emb6.std() * torch.randn(emb6.shape, generator=g)
    sd3 = eagle3_tensors(3, vd=96)
    aux = torch.randn(7, 3 * H, generator=g)
    trained = write_head(tmp_path / "e3", sd3 | {"embed_tokens.weight": own_emb6}, {"draft_vocab_size": 96})
    hidden, logits = run_head(load_eagle_head(trained, target6), tokens, aux)
    ref_h, ref_logits = reference_eagle3(sd3, own_emb6, tokens, aux)
    assert_close_to(hidden, ref_h, kernel=False)
    assert_close_to(logits, ref_logits, kernel=False)
    fine_tuned = load_eagle_head(trained, target6, check_target=False)
    assert fine_tuned.embed_weight is not None and fine_tuned.embed_weight.data_ptr() == emb6.data_ptr()
    copy = write_head(tmp_path / "e3copy", sd3 | {"embed_tokens.weight": emb6.clone()}, {"draft_vocab_size": 96})
    shared = load_eagle_head(copy, target6)
    assert shared.embed_weight is not None and shared.embed_weight.data_ptr() == emb6.data_ptr()

    sd1 = eagle1_tensors(4, fc_bias=True)
    feats = torch.randn(7, H, generator=g)
    head = load_eagle_head(
        write_head(tmp_path / "e1", sd1 | {"embed_tokens.weight": own_emb, "lm_head.weight": own_lm}, {}), target
    )
    hidden, logits = run_head(head, tokens, feats)
    ref_h, ref_logits = reference_eagle1(sd1, own_emb, own_lm, tokens, feats)
    assert_close_to(hidden, ref_h, kernel=False)
    assert_close_to(logits, ref_logits, kernel=False)
    narrow = {"lm_head.weight": own_lm[:, :-1].contiguous()}
    with pytest.raises(UnsupportedModelError, match=r"lm_head\.weight has shape"):
        load_eagle_head(write_head(tmp_path / "e1bad", sd1 | narrow, {}), target)


def test_a_heads_own_embedding_moves_with_the_head_to_its_device(tmp_path: Path) -> None:
    """``load_draft`` moves the loaded head to its device; the head's own copy of the target's embedding was bound
    before, as a plain attribute that ``Module.to`` does not move: on a GPU the first draft step embedded CUDA ids
    in a CPU table. (The meta device stands in for CUDA here; tests/test_cuda.py drafts with one on the device.)"""
    target6 = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    emb6 = target6.embed_tokens.weight.detach()
    own = emb6 + 0.05 * emb6.std() * torch.randn(emb6.shape, generator=torch.Generator().manual_seed(2))
    path = write_head(
        tmp_path / "e3", eagle3_tensors(3, vd=96) | {"embed_tokens.weight": own}, {"draft_vocab_size": 96}
    )
    head = load_draft(HeadSpec(head=str(path)), target6, device="meta")
    assert isinstance(head, EagleHead) and head.device.type == "meta"
    assert head.embed_weight is not None and head.embed_weight.device.type == "meta"


def test_an_eagle1_input_norm_is_ignored_as_the_reference_does(tmp_path: Path, target: LlamaModel) -> None:
    """EAGLE-1/2's layer 0 has no input norm; a checkpoint saved with one loads and drafts without it."""
    sd = eagle1_tensors(1, fc_bias=True)
    norm = {"layers.0.input_layernorm.weight": 1 + torch.randn(H, generator=torch.Generator().manual_seed(9))}
    head = load_eagle_head(write_head(tmp_path / "h", sd | norm, {}), target)
    g = torch.Generator().manual_seed(5)
    tokens, feats = torch.randint(0, V, (9,), generator=g), torch.randn(9, H, generator=g)
    hidden, logits = run_head(head, tokens, feats)
    emb, lm = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    ref_h, ref_logits = reference_eagle1(sd, emb, lm, tokens, feats)
    assert_close_to(hidden, ref_h, kernel=False)
    assert_close_to(logits, ref_logits, kernel=False)


def test_a_full_vocabulary_eagle3_head_loads_with_an_untouched_t2d(tmp_path: Path) -> None:
    """With lm_head over the whole vocabulary, EAGLE deletes d2t / t2d before loading; checkpoints may hold them
    untouched (zeros, no id marked): such a head loads, column i being target id i."""
    target = tiny_model(tiny_config(num_hidden_layers=6), seed=4)
    sd = eagle3_tensors(3, vd=V)
    untouched = {"d2t": torch.zeros(V, dtype=torch.long), "t2d": torch.zeros(V, dtype=torch.bool)}
    head = load_eagle_head(write_head(tmp_path / "h", sd | untouched, {"draft_vocab_size": V}), target)
    assert head.draft_ids.tolist() == list(range(V)) and not head.maps_draft_ids
    g = torch.Generator().manual_seed(6)
    tokens, aux = torch.randint(0, V, (5,), generator=g), torch.randn(5, 3 * H, generator=g)
    _, logits = run_head(head, tokens, aux)
    _, ref_logits = reference_eagle3(sd, target.embed_tokens.weight.detach(), tokens, aux)
    assert_close_to(logits, ref_logits, kernel=False)
