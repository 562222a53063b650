"""EAGLE heads on disk: the two published checkpoint layouts (EAGLE-1/2's ``fc`` + ``layers.0``, EAGLE-3's
``midlayer`` with ``d2t`` / ``t2d``, and the speculators library's config), read and written in their own tensor
names, with every check a head must pass before it drafts for a target (docs/algorithms.md §8.3)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from specserve import config
from specserve.durable import write_durably
from specserve.errors import CorruptModelError, SpecServeError, UnsupportedModelError
from specserve.models.llama import (
    LlamaModel,
)
from specserve.models.sources import sha256_file
from specserve.spec_decode.eagle_head import (
    AUX_INPUTS_MARKER,
    EagleHead,
    EagleHeadConfig,
    HeadKind,
    HeadLayer,
    aux_layer_inputs,
    check_compatible,
    default_aux_layers,
    dense_weight,
    rope_scaling_of,
)

log = logging.getLogger(__name__)


_MLP = ("gate_proj", "up_proj")


def _layer_tensors(layer: HeadLayer, prefix: str) -> dict[str, torch.Tensor]:
    cfg = layer.cfg
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = layer.qkv.weight.detach().split([q_size, kv_size, kv_size])
    gate, up = layer.gate_up.weight.detach().chunk(2)
    out = {
        f"{prefix}self_attn.q_proj.weight": q,
        f"{prefix}self_attn.k_proj.weight": k,
        f"{prefix}self_attn.v_proj.weight": v,
        f"{prefix}self_attn.o_proj.weight": layer.o_proj.weight.detach(),
        f"{prefix}post_attention_layernorm.weight": layer.post_norm.detach(),
        f"{prefix}mlp.gate_proj.weight": gate,
        f"{prefix}mlp.up_proj.weight": up,
        f"{prefix}mlp.down_proj.weight": layer.down.weight.detach(),
    }
    if cfg.qkv_bias:
        qb, kb, vb = layer.qkv.bias.detach().split([q_size, kv_size, kv_size])
        out |= {f"{prefix}self_attn.q_proj.bias": qb, f"{prefix}self_attn.k_proj.bias": kb}
        out[f"{prefix}self_attn.v_proj.bias"] = vb
    if cfg.o_bias:
        out[f"{prefix}self_attn.o_proj.bias"] = layer.o_proj.bias.detach()
    return out


def head_state_dict(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names (EAGLE-1/2: ``fc``, ``layers.0.*``; EAGLE-3: ``midlayer.*``,
    ``norm``, ``lm_head``, ``d2t``, ``t2d``). A reduced EAGLE-1/2 vocabulary is saved as ``d2t`` too."""
    cfg = head.cfg
    sd = {"fc.weight": head.fc.weight.detach()}
    if cfg.fc_bias:
        sd["fc.bias"] = head.fc.bias.detach()
    if cfg.kind == HeadKind.eagle3:
        sd |= _layer_tensors(head.layer, "midlayer.")
        sd["midlayer.input_layernorm.weight"] = head.input_norm.detach()
        sd["midlayer.hidden_norm.weight"] = head.hidden_norm.detach()
        sd["norm.weight"] = head.norm.detach()
        sd["lm_head.weight"] = head.lm_head.weight.detach()
    else:
        sd |= _layer_tensors(head.layer, "layers.0.")
    if cfg.kind == HeadKind.eagle3 or head.maps_draft_ids:
        ids = head.draft_ids.cpu()
        sd["d2t"] = ids - torch.arange(ids.numel())
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        sd["t2d"] = t2d
    return sd


def hf_config_dict(cfg: EagleHeadConfig, **extra: Any) -> dict[str, Any]:
    """config.json in the published form: a one-layer Llama config plus EAGLE's keys."""
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.kind == HeadKind.eagle3 else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "bias": cfg.fc_bias,
        **attention_bias_flags(cfg),
    }
    if cfg.kind == HeadKind.eagle3:
        d["draft_vocab_size"] = cfg.draft_vocab_size or cfg.vocab_size
        # the ids name layer inputs here; the marker keeps a list that starts at 1 from being read as outputs
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers), AUX_INPUTS_MARKER: True}
        if cfg.norm_before_residual:
            d["norm_before_residual"] = True
    return d | extra


def attention_bias_flags(cfg: EagleHeadConfig) -> dict[str, bool]:
    """The config keys that say which attention projections have biases. A Llama config's ``attention_bias``
    gives q, k, v and o one each; a head with biases on q, k and v alone (one trained for a Qwen2 target) adds
    ``qkv_bias`` for those, ``attention_bias`` then naming o's alone (as vLLM's Llama layer reads the pair)."""
    if cfg.qkv_bias == cfg.o_bias:
        return {"attention_bias": cfg.qkv_bias}
    return {"attention_bias": cfg.o_bias, "qkv_bias": cfg.qkv_bias}


def save_eagle_head(
    head: EagleHead, out: Path, *, dtype: torch.dtype = torch.bfloat16, extra_config: dict[str, Any] | None = None
) -> Path:
    """``model.safetensors`` + ``config.json`` in the published layout; returns the weights file."""
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in head_state_dict(head).items()}
    weights = out / "model.safetensors"
    data = safetensors_bytes(sd)  # (written into write_durably's file: see distill.write_chunk)
    write_durably(weights, lambda tmp: tmp.write_bytes(data))
    text = config_text(hf_config_dict(head.cfg, **(extra_config or {})))
    write_durably(out / "config.json", lambda tmp: tmp.write_text(text))
    return weights


def config_text(config: dict[str, Any]) -> str:
    """config.json with one key a line (a value, such as the embedding sample, on its key's line)."""
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in config.items()) + "\n}\n"


def weights_path(path: Path) -> Path:
    """The head's weights file in ``path``: ``model.safetensors``, else ``pytorch_model.bin``."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (Path(path) / name).is_file():  # (a named pipe or a directory would hang or fail in the reader)
            return Path(path) / name
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (Path(path) / index).is_file():
            raise UnsupportedModelError(
                f"{path} holds a sharded checkpoint ({index}); a one-layer head is read from one file: merge the "
                "shards into model.safetensors"
            )
    raise UnsupportedModelError(f"no model.safetensors or pytorch_model.bin in {path}")


_EAGLE3_IN_LAYERS_0 = "layers.0.hidden_norm.weight"  # an EAGLE-3 head saved under layers.0.* (vLLM reads both)


def _kind_of(names: Any) -> HeadKind:
    """EAGLE-3 by its ``midlayer.*`` names, or by its ``hidden_norm`` under ``layers.0.*``; else EAGLE-1/2."""
    eagle3 = any(n.startswith("midlayer.") for n in names) or _EAGLE3_IN_LAYERS_0 in names
    return HeadKind.eagle3 if eagle3 else HeadKind.eagle


def checkpoint_kind(path: Path) -> HeadKind:
    """The layout of the head in ``path`` from its tensor names (read from the safetensors header when there)."""
    weights = weights_path(path)
    if weights.suffix == ".safetensors":
        try:
            with safe_open(weights, framework="pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CorruptModelError(f"cannot read the head's weights {weights}: {e}") from e
    else:
        names = list(_read_tensors(path))
    return _kind_of(set(names))


DIGESTED_BESIDE = ("config.json", "vocab_map.json")  # what a head's load reads beside its weights
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def check_digest(weights: Path, *, required: bool = False) -> None:
    """Refuse a head whose ``<weights>.sha256`` beside the weights names another digest for a file it lists: a
    truncated or altered copy. Its lines are sha256sum's, ``<digest>  <name>`` (a first line of the digest alone
    names the weights), as ``train-draft`` writes them: the weights, then DIGESTED_BESIDE (one not there is not
    read, so not checked: a head copied without its vocabulary map). Without that file there is nothing to check,
    unless ``required`` (a shipped head: a package that lost the file would otherwise load whatever weights it kept;
    it must also list every file of DIGESTED_BESIDE the head has)."""
    digest_file = weights.with_name(weights.name + ".sha256")
    if not digest_file.is_file():
        if required:
            raise CorruptModelError(f"{weights} has no {digest_file.name} beside it to check it against")
        return
    try:
        lines = [line.split(maxsplit=1) for line in digest_file.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{digest_file} is not readable: {e}") from e
    listed: dict[str, str] = {}
    for i, fields in enumerate(lines):
        name = fields[1].strip().removeprefix("*") if len(fields) > 1 else weights.name if i == 0 else ""
        if not _SHA256.fullmatch(fields[0]) or not name or Path(name).name != name or name in listed:
            raise CorruptModelError(f"{digest_file}: line {i + 1} is not a sha256 digest and a file name beside it")
        listed[name] = fields[0].lower()
    if weights.name not in listed:
        raise CorruptModelError(f"{digest_file} does not hold a sha256 digest of {weights.name}")
    unlisted = [n for n in DIGESTED_BESIDE if required and n not in listed and (weights.parent / n).exists()]
    if unlisted:
        raise CorruptModelError(f"{digest_file} lists no digest of {', '.join(unlisted)}, which a shipped head must")
    for name, expected in listed.items():
        path = weights.parent / name
        if not path.exists() and name != weights.name:  # (a head copied without its vocabulary map: nothing read)
            continue
        actual = sha256_file(path)
        if actual != expected:
            raise CorruptModelError(f"{path} does not match {digest_file.name}: sha256 {actual}, expected {expected}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = weights_path(path)
    try:
        sd = (
            load_file(weights)
            if weights.suffix == ".safetensors"
            else torch.load(weights, map_location="cpu", weights_only=True)
        )
    except Exception as e:  # a damaged pickle fails with whatever its opcodes raise (KeyError, TypeError, ...)
        raise CorruptModelError(f"cannot read the head's weights {weights}: {e!r}") from e
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CorruptModelError(f"{weights} is not a mapping of tensor names to tensors")
    for name, t in sd.items():  # a pickle states any view: a 200 KB file's expanded one read as 40 TB when checked
        if t.layout != torch.strided or t.device.type != "cpu" or _stored_bytes(t) < t.numel() * t.element_size():
            raise CorruptModelError(
                f"{weights}: {name} is not a dense tensor holding its own values ({t.layout}, {t.device}, shape "
                f"{tuple(t.shape)})"
            )
    if _EAGLE3_IN_LAYERS_0 in sd:  # one spelling from here on
        sd = renamed_tensors(
            sd, lambda k: "midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k
        )
    return sd


def _stored_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # (no storage to read)
        return 0


def renamed_tensors(sd: dict[str, torch.Tensor], rename: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """``sd`` with each name renamed; two names that become one are refused by name (one of them was dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        new = rename(name)
        if new in out:
            raise UnsupportedModelError(f"the head's weights hold {new} twice (as {name} and under another name)")
        out[new] = t
    return out


def config_from_checkpoint(raw: dict[str, Any], sd: dict[str, torch.Tensor], target: LlamaModel) -> EagleHeadConfig:
    kind = _kind_of(sd)
    prefix = "midlayer." if kind == HeadKind.eagle3 else "layers.0."
    if f"{prefix}self_attn.q_proj.weight" not in sd or "fc.weight" not in sd:
        raise UnsupportedModelError("not an EAGLE head: want fc.weight and layers.0.* (EAGLE-1/2) or midlayer.*")
    if _whole(raw, "num_hidden_layers", 1) != 1:
        raise UnsupportedModelError(f"an EAGLE head has one decoder layer; config.json says {raw['num_hidden_layers']}")
    if (act := raw.get("hidden_act", "silu")) not in ("silu", "swish"):
        raise UnsupportedModelError(f"the head's hidden_act is {act!r}; its MLP is Llama's SiLU-gated one")
    hidden = _whole(raw, "hidden_size", sd["fc.weight"].shape[0])
    if (wide := _whole(raw, "target_hidden_size", hidden, null_too=True)) != hidden:
        raise UnsupportedModelError(
            f"the head's hidden size is {hidden} and its target_hidden_size {wide}: heads narrower or wider than "
            "their target (fc from 3 x target_hidden_size, an embedding of their own) are not supported"
        )
    for key, what in _UNSUPPORTED_NORMS.items():  # (none needs tensors of its own: nothing else tells them apart)
        if _flag(raw, key) is True:
            raise UnsupportedModelError(
                f"{key} ({what}) is not supported: drafting without it would load without error and be mostly rejected"
            )
    heads = _whole(raw, "num_attention_heads")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})  # a base inside wins, as transformers'
    aux: tuple[int, ...] = ()
    if kind == HeadKind.eagle3:
        eagle_cfg = raw.get("eagle_config") or {}
        ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
        if ids and (not isinstance(ids, list) or not all(type(i) is int for i in ids)):
            raise UnsupportedModelError(f"eagle_aux_hidden_state_layer_ids must be a list of layer indices, got {ids}")
        # in layer order whatever order the config lists them in: the order the target computes them, in which
        # published EAGLE-3 implementations concatenate them for the head's fc (and so does the target here)
        marked = eagle_cfg.get(AUX_INPUTS_MARKER) is True or raw.get(AUX_INPUTS_MARKER) is True
        aux = aux_layer_inputs(sorted(ids), marked) if ids else default_aux_layers(target.cfg.num_layers)
    att = f"{prefix}self_attn."
    q_bias, o_bias = (att + "q_proj.bias", "q_proj.bias"), (att + "o_proj.bias", "o_proj.bias")
    flags = {"bias": ("fc.bias", "fc.bias"), "attention_bias": q_bias, "qkv_bias": q_bias}
    # attention_bias names o's bias where a qkv_bias key names q, k and v's; without one, q's (o's may be missing
    # under true: heads for Qwen2 targets have none) and, under false, o's too: no bias at all
    if isinstance(raw.get("qkv_bias"), bool) or (raw.get("attention_bias") is False and o_bias[0] in sd):
        flags["attention_bias"] = o_bias
    for key, (name, short) in flags.items():  # a flag the config states must describe the tensors
        if isinstance(raw.get(key), bool) and raw[key] != (name in sd):
            raise UnsupportedModelError(
                f"config.json says {key} is {str(raw[key]).lower()} but the checkpoint "
                f"{'has no' if raw[key] else 'has a'} {short}"
            )
    return EagleHeadConfig(
        kind=kind,
        hidden_size=hidden,
        intermediate_size=_whole(raw, "intermediate_size"),
        num_heads=heads,
        num_kv_heads=_whole(raw, "num_key_value_heads", heads, null_too=True),
        head_dim=_whole(raw, "head_dim", hidden // heads, null_too=True),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        vocab_size=_whole(raw, "vocab_size"),
        draft_vocab_size=_whole(raw, "draft_vocab_size") if raw.get("draft_vocab_size") else None,
        fc_bias="fc.bias" in sd,
        qkv_bias=f"{prefix}self_attn.q_proj.bias" in sd,
        o_bias=f"{prefix}self_attn.o_proj.bias" in sd,
        aux_layers=aux,
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling_of(raw),
        max_position_embeddings=_whole(raw, "max_position_embeddings", 8192),
        norm_before_residual=kind == HeadKind.eagle3 and _flag(raw, "norm_before_residual") is True,
    )


def _whole(raw: dict[str, Any], key: str, default: int | None = None, *, null_too: bool = False) -> int:
    """An integer field, else ``default`` where it is absent (or null or 0, under ``null_too``): int() read 1.9 as
    1 and "4" as 4, where transformers' config for the target refuses both."""
    if key not in raw or (null_too and not raw[key]):
        if default is None:
            raise UnsupportedModelError(f"the head's config.json has no {key}")
        return default
    if type(raw[key]) is not int:
        raise UnsupportedModelError(f"the head's config.json: {key} must be an integer, got {raw[key]!r}")
    return int(raw[key])


# flags for norms this head does not apply; a checkpoint may omit their tensors (the norm's weight then ones)
_UNSUPPORTED_NORMS = {
    "norm_output": "the next feature is norm(h), not h",
    "norm_before_fc": "an RMSNorm over the fused target features before fc",
    "fc_norm": "an RMSNorm over each fused target feature before fc",
}


def _flag(raw: dict[str, Any], key: str) -> bool | None:
    """A config flag at the top, else under ``eagle_config`` (where NVIDIA's heads put some), else None. One that is
    not a JSON boolean is an error (``"true"`` read as not true: a head of the other variant, drafting mostly
    rejected tokens without a word)."""
    nested = raw.get("eagle_config")
    value = raw[key] if key in raw else nested.get(key) if isinstance(nested, dict) else None
    if value is not None and not isinstance(value, bool):
        raise UnsupportedModelError(f"config.json's {key} is {value!r}: true or false")
    return value


def lifted_speculators_config(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """A config in the speculators' format (``speculators_model_type``; RedHatAI's published EAGLE-3 heads) as the
    flat one: its Llama fields, nested under ``transformer_layer_config``, lifted to the top where the top does not
    set them, its ``fusion_bias`` read as ``bias``, and an EAGLE-3 one without ``norm_before_residual`` given the
    speculators' default, true. Any other config as it is."""
    if "speculators_model_type" not in raw:
        return raw
    kind = raw["speculators_model_type"]
    if kind not in ("eagle", "eagle3"):
        raise UnsupportedModelError(f"{where}: speculators_model_type {kind!r}; EAGLE heads are 'eagle' or 'eagle3'")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UnsupportedModelError(f"{where}: a speculators config without a transformer_layer_config object")
    if raw.get("layernorms") is True:
        raise UnsupportedModelError(f"{where}: layernorms (extra norms around an EAGLE-1 layer) are not supported")
    flat = {k: v for k, v in layer.items() if v is not None} | raw
    if "bias" not in flat and isinstance(raw.get("fusion_bias"), bool):
        flat["bias"] = raw["fusion_bias"]
    if kind == "eagle3" and "norm_before_residual" not in flat:
        flat["norm_before_residual"] = True  # the speculators' default (a flat EAGLE-3 config's is false)
    return flat


# an EAGLE-1 head the speculators saved: its fc as fusion_fc, its decoder layer as transformer (vLLM maps them too)
_SPECULATORS_EAGLE_NAMES = (("fusion_fc.", "fc."), ("transformer.", "layers.0."))


def speculators_tensor_names(raw: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if raw.get("speculators_model_type") != "eagle":
        return sd

    def renamed(name: str) -> str:
        for old, new in _SPECULATORS_EAGLE_NAMES:
            if name.startswith(old):
                return new + name.removeprefix(old)
        return name

    return renamed_tensors(sd, renamed)


TARGET_SAMPLE_KEY = "specserve_target_embedding_sample"  # config.json: what the head's target embedding looked like
SAMPLE_ROWS, SAMPLE_COLS = 64, 8
# relative distance between two samples of one embedding: a quantised copy of the target (Q8_0, Q4) stays well
# under it (a 4-bit copy of SmolLM2-135M's: 0.24), another model's of the same shape near 1.2-1.4 (docs/benchmarks.md)
MAX_EMBEDDING_DISTANCE = 0.5


def embedding_sample(weight: torch.Tensor) -> torch.Tensor:
    """[SAMPLE_ROWS * SAMPLE_COLS] float32: rows evenly spaced over the vocabulary, their first columns."""
    rows = torch.linspace(0, weight.shape[0] - 1, SAMPLE_ROWS).round().long()  # [SAMPLE_ROWS]
    return weight.detach()[rows, :SAMPLE_COLS].float().flatten().cpu()


def check_target_embedding(ours: torch.Tensor, target: LlamaModel, what: str) -> None:
    """Refuse a head whose record of its target's embedding (a sample, or the checkpoint's own copy) is not this
    target's: trained for another model of the same shapes, its drafts would be lossless but mostly rejected."""
    theirs = embedding_sample(target.embed_tokens.weight)
    if ours.shape != theirs.shape or not bool(torch.isfinite(ours).all()):
        raise UnsupportedModelError(f"the head's {what} is not a sample of {theirs.numel()} finite values")
    distance = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-12))
    if distance > MAX_EMBEDDING_DISTANCE:
        raise UnsupportedModelError(
            f"the head was trained for another target: its {what} differs from this target's embedding "
            f"(relative distance {distance:.2f}, at most {MAX_EMBEDDING_DISTANCE} for the same model)"
        )


def load_eagle_head(
    path: Path,
    target: LlamaModel,
    *,
    dtype: torch.dtype | None = None,
    check_target: bool = True,
) -> EagleHead:
    """A head from a directory in either published layout, bound to ``target`` (shapes checked, clear errors; with
    ``check_target``, its record of its target's embedding too, and its own copies of the target's embedding or LM
    head bound where they are not the target's: off to fine-tune a head for a new target; a head shipped in the
    package must carry its ``.sha256``)."""
    path = config.local_path(path)
    if not (path / "config.json").is_file():
        raise UnsupportedModelError(f"no config.json in {path}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UnsupportedModelError(f"{path / 'config.json'} is not readable JSON: {e}") from e
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{path / 'config.json'} holds a {type(raw).__name__}, not a config object")
    raw = lifted_speculators_config(raw, path / "config.json")
    shipped = path.resolve().is_relative_to(config.BUILTIN_HEADS_DIR.resolve())  # (to serve or to fine-tune)
    check_digest(weights_path(path), required=shipped)
    sd = speculators_tensor_names(raw, _read_tensors(path))
    try:
        cfg = config_from_checkpoint(raw, sd, target)
    except SpecServeError:
        raise
    except ValidationError as e:
        fields = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise UnsupportedModelError(f"{path / 'config.json'}: {fields}") from e
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:  # (int(inf): OverflowError)
        raise UnsupportedModelError(f"{path / 'config.json'}: a missing or malformed field ({e!r})") from e
    check_weight_tensors(sd, cfg)  # (first: a config its own tensors contradict is not the target's mismatch)
    check_compatible(cfg, target)
    emb = sd.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != tuple(target.embed_tokens.weight.shape):
        raise UnsupportedModelError(
            f"the head was trained with an embedding of shape {tuple(emb.shape)}; "
            f"the target's is {tuple(target.embed_tokens.weight.shape)}"
        )
    lm = sd.get("lm_head.weight") if cfg.kind == HeadKind.eagle else None  # (EAGLE-3's is its own, reduced)
    if lm is not None and tuple(lm.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise UnsupportedModelError(
            f"the head's lm_head.weight has shape {tuple(lm.shape)}; the target's LM head is "
            f"{(cfg.vocab_size, cfg.hidden_size)}"
        )
    if emb is not None and check_target:
        check_target_embedding(embedding_sample(emb), target, "copy of the target's embedding (embed_tokens.weight)")
    if (sample := raw.get(TARGET_SAMPLE_KEY)) is not None and check_target:
        try:
            values = torch.tensor(sample, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as e:
            raise UnsupportedModelError(f"{path / 'config.json'}: {TARGET_SAMPLE_KEY} is not a list of numbers") from e
        check_target_embedding(values, target, f"{TARGET_SAMPLE_KEY} in config.json")
    trained_for = raw.get("specserve_target")
    try:
        head = EagleHead(cfg)
    except (KeyError, TypeError, ValueError, ArithmeticError, StrictDataclassError) as e:  # RoPE
        # parameters transformers cannot build tables from
        raise UnsupportedModelError(f"{path / 'config.json'}: cannot build the head's RoPE ({e!r})") from e
    _load_tensors(head, sd)
    if trained_for is not None:
        head.trained_for = str(trained_for)
    head = head.to(dtype=dtype or target.dtype)
    if check_target:  # (fine-tuned for a new target, a head learns that target's own, and is saved without copies)
        head.own_embed = own_copy(emb, target.embed_tokens.weight, head.fc.weight.dtype)
        if lm is not None:  # (a quantised target's LM head is dequantised to compare: only where there is a copy)
            head.own_lm_head = own_copy(lm, dense_weight(target.lm_head), head.fc.weight.dtype)
    overflow = sorted(n for n, p in head.named_parameters() if not bool(torch.isfinite(p).all()))
    if overflow:
        raise UnsupportedModelError(f"the head's {overflow} do not fit in {head.fc.weight.dtype} (infinite once cast)")
    head.eval().requires_grad_(False)
    head.bind(target)
    return head


def own_copy(theirs: torch.Tensor | None, targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A checkpoint's copy of a target weight, in ``dtype``, where it is not the target's own (trained, or taken from
    another precision than the target was loaded in): the head drafts with what it was trained with, as the
    reference code and vLLM load it. None where it is the target's (shared, not held twice)."""
    if theirs is None or torch.equal(theirs.to(targets.device, targets.dtype), targets):  # (the target's device)
        return None
    return theirs.to(dtype).contiguous()


_NOT_WEIGHTS = ("d2t", "t2d", "embed_tokens.weight")
_EAGLE1_LAYER_NORM = "layers.0.input_layernorm.weight"
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_weight_tensors(sd: dict[str, torch.Tensor], cfg: EagleHeadConfig) -> None:
    """Before the head is built: weights of a float type torch computes in, finite, and the sizes the config
    gives matching the tensors' (a config that names huge sizes would otherwise allocate them first)."""
    odd = sorted(f"{k} ({t.dtype})" for k, t in sd.items() if k not in ("d2t", "t2d") and t.dtype not in _WEIGHT_DTYPES)
    if odd:
        raise UnsupportedModelError(f"the head's weights must be float32, float16, bfloat16 or float64: {odd}")
    bad = sorted(k for k, t in sd.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if bad:
        raise CorruptModelError(f"the head's weights hold NaN or infinite values in {bad}")
    prefix = "midlayer." if cfg.kind == HeadKind.eagle3 else "layers.0."
    rows = {  # config field: (its value, the tensor whose rows it counts)
        "hidden_size": (cfg.hidden_size, "fc.weight"),
        "num_attention_heads x head_dim": (cfg.num_heads * cfg.head_dim, f"{prefix}self_attn.q_proj.weight"),
        "num_key_value_heads x head_dim": (cfg.num_kv_heads * cfg.head_dim, f"{prefix}self_attn.k_proj.weight"),
        "intermediate_size": (cfg.intermediate_size, f"{prefix}mlp.gate_proj.weight"),
    }
    for field, (value, name) in rows.items():
        if (t := sd.get(name)) is None:  # (its size unchecked, the head would be built with the config's first)
            raise UnsupportedModelError(f"the head checkpoint is missing {[name]}")
        if t.ndim != 2 or t.shape[0] != value:
            raise UnsupportedModelError(f"config.json's {field} is {value}; {name} has shape {tuple(t.shape)}")


def _load_tensors(head: EagleHead, sd: dict[str, torch.Tensor]) -> None:
    cfg = head.cfg
    prefix = "midlayer." if cfg.kind == HeadKind.eagle3 else "layers.0."
    want = head_state_dict(head)
    missing = sorted(k for k in want if k not in sd and k not in ("d2t", "t2d"))
    if missing:
        raise UnsupportedModelError(f"the head checkpoint is missing {missing}")
    # the target's embedding (some heads carry a copy) and RoPE tables saved by old transformers are not weights
    ignored = set(_NOT_WEIGHTS) | ({"lm_head.weight"} if cfg.kind == HeadKind.eagle else set())  # (own copies)
    if cfg.kind == HeadKind.eagle and _EAGLE1_LAYER_NORM in sd:
        # EAGLE-1/2's layer 0 has no input norm: the reference code builds none and loads non-strictly, vLLM skips
        # the tensor; a head saved with one (an untrained ones vector, from a stock Llama layer) is read the same way
        log.warning("%s is not part of an EAGLE-1/2 head (its layer 0 has no input norm): ignored", _EAGLE1_LAYER_NORM)
        ignored.add(_EAGLE1_LAYER_NORM)
    unexpected = sorted(k for k in sd if k not in want and k not in ignored and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise UnsupportedModelError(f"the head checkpoint has tensors a one-layer EAGLE head does not: {unexpected}")
    for name, t in want.items():
        if name in sd and name not in ("d2t", "t2d") and tuple(sd[name].shape) != tuple(t.shape):
            raise UnsupportedModelError(
                f"{name} has shape {tuple(sd[name].shape)}; the config implies {tuple(t.shape)}"
            )
    layer = head.layer
    att = prefix + "self_attn."
    with torch.no_grad():
        head.fc.weight.copy_(sd["fc.weight"])
        if cfg.fc_bias:
            head.fc.bias.copy_(sd["fc.bias"])
        layer.qkv.weight.copy_(torch.cat([sd[att + f"{n}_proj.weight"] for n in "qkv"]))
        if cfg.qkv_bias:
            layer.qkv.bias.copy_(torch.cat([sd[att + f"{n}_proj.bias"] for n in "qkv"]))
        layer.o_proj.weight.copy_(sd[att + "o_proj.weight"])
        if cfg.o_bias:
            layer.o_proj.bias.copy_(sd[att + "o_proj.bias"])
        layer.post_norm.copy_(sd[prefix + "post_attention_layernorm.weight"])
        layer.gate_up.weight.copy_(torch.cat([sd[prefix + f"mlp.{n}.weight"] for n in _MLP]))
        layer.down.weight.copy_(sd[prefix + "mlp.down_proj.weight"])
        if cfg.kind == HeadKind.eagle3:
            head.input_norm.copy_(sd[prefix + "input_layernorm.weight"])
            head.hidden_norm.copy_(sd[prefix + "hidden_norm.weight"])
            head.norm.copy_(sd["norm.weight"])
            head.lm_head.weight.copy_(sd["lm_head.weight"])
    # a full-vocabulary EAGLE-3 head's t2d says nothing (every id is a draft id); EAGLE drops it there, and such
    # checkpoints may hold it untouched (no id marked), so it is not checked; its d2t may still permute the columns
    full = cfg.kind == HeadKind.eagle3 and head.lm_head.weight.shape[0] == cfg.vocab_size
    if "d2t" in sd:
        d2t = sd["d2t"]
        if d2t.ndim != 1 or not d2t.numel() or d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise UnsupportedModelError(
                f"d2t must be a non-empty 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}"
            )
        ids = d2t.long() + torch.arange(d2t.numel())
        if cfg.kind == HeadKind.eagle3 and d2t.numel() != head.lm_head.weight.shape[0]:
            raise UnsupportedModelError(
                f"d2t has {d2t.numel()} entries; lm_head has {head.lm_head.weight.shape[0]} rows"
            )
        if cfg.draft_vocab_size is not None and d2t.numel() != cfg.draft_vocab_size:
            raise UnsupportedModelError(f"d2t has {d2t.numel()} entries; draft_vocab_size is {cfg.draft_vocab_size}")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise UnsupportedModelError(f"d2t maps draft ids outside the target's {cfg.vocab_size}-token vocabulary")
        if (repeats := ids.numel() - int(ids.unique().numel())) > 0:  # see valid_draft_ids
            raise UnsupportedModelError(f"d2t maps {repeats} draft ids onto target ids another already has")
        if "t2d" in sd and not full:
            _check_t2d(sd["t2d"], ids, cfg.vocab_size)
        head.draft_ids = ids
        head.cfg = cfg.model_copy(update={"draft_vocab_size": int(ids.numel())})
    elif head.draft_vocab_size != cfg.vocab_size:
        raise UnsupportedModelError(
            f"a head with a reduced vocabulary ({head.draft_vocab_size} of {cfg.vocab_size} ids) needs its d2t map"
        )
    elif "t2d" in sd and not full:
        _check_t2d(sd["t2d"], head.draft_ids, cfg.vocab_size)


def _check_t2d(t2d: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> None:
    """``t2d`` ([V] bool: the target ids in the draft vocabulary) must mark exactly the ids ``d2t`` maps to."""
    flags = t2d.dtype == torch.bool or (not t2d.is_floating_point() and bool(((t2d == 0) | (t2d == 1)).all()))
    if t2d.ndim != 1 or t2d.numel() != vocab_size or not flags:
        raise UnsupportedModelError(
            f"t2d must be a [{vocab_size}] bool tensor (or 0/1 integers), got {t2d.dtype} {tuple(t2d.shape)}"
        )
    marked = t2d.bool()
    if int(marked.sum()) != ids.numel() or not bool(marked[ids].all()):
        raise UnsupportedModelError(
            f"t2d marks {int(marked.sum())} target ids, not the {ids.numel()} that d2t maps the draft vocabulary to"
        )
