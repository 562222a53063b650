"""Load a ModelSpec into a ready LlamaModel (dtype, int8 variant) and its tokenizer; a draft model or head."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NoReturn

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from specserve.config import DraftSpec, DType, HeadSpec, ModelSpec, SourceKind, local_path
from specserve.errors import (
    CorruptModelError,
    ModelSourceError,
    NonFiniteWeightsError,
    SpecServeError,
    UnsupportedModelError,
)
from specserve.models.llama import (
    MODEL_TYPE_BIASES,
    ArchConfig,
    LlamaModel,
    attach_gemv_copies,
    attach_mkl_packed,
    attach_row_padding,
    quantize_int8_dynamic,
    token_id_set,
)
from specserve.models.lm_head import attach_bounded_argmax
from specserve.models.native_stack import (
    Q8_HEAD_NAMES,
    SMALL_GEMM_ROWS,
    attach_head_records,
    attach_head_stack,
    attach_int8_head,
    attach_int8_reads,
    attach_native_attention,
    attach_native_stack,
    attach_q4_reads,
    attach_q8_head,
    attach_small_gemm,
    cached_kernel_plan,
    follow_target_plan,
)
from specserve.models.q4 import (
    Q4Blocks,
    Q4Linear,
    dense_rows_on_this_cpu,
    gguf_layer_blocks,
    gguf_q8_blocks,
    native_q4_available,
)
from specserve.models.sources import builtin_gguf, builtin_gguf_path, gguf_tensors, resolve
from specserve.spec_decode.eagle_head import EagleHead, HeadKind
from specserve.spec_decode.head_checkpoint import load_eagle_head

log = logging.getLogger(__name__)


def load_model(spec: ModelSpec, *, device: str | torch.device = "cpu", max_positions: int | None = None) -> LlamaModel:
    path = resolve(spec)
    try:
        model = load_model_dir(path, spec, device=device, max_positions=max_positions)
    except ModelSourceError as e:
        _raise_in_conversion(spec, e)
    if spec.native_q4:
        use_native_q4(model, spec)
        attach_cpu_paths(model, spec)  # over the float linears left (the LM head), not the ones just replaced
    return model


def use_native_q4(model: LlamaModel, spec: ModelSpec) -> None:
    """Swap the decoder layers' float32 linears for packed Q4_1 ones read straight from the spec's GGUF."""
    kind = spec.resolved_kind()
    if kind not in (SourceKind.builtin, SourceKind.gguf):
        raise UnsupportedModelError(f"native_q4 needs a GGUF source (a builtin or a .gguf file), not {kind.value}")
    if spec.dtype != DType.float32 or spec.int8_dynamic or model.device.type != "cpu" or not native_q4_available():
        raise UnsupportedModelError(
            "native_q4 runs on the CPU, from float32, without int8_dynamic, on a torch with the int4 CPU kernel"
        )
    gguf = builtin_gguf(spec.source) if kind == SourceKind.builtin else local_path(spec.source)
    cfg = model.cfg
    blocks = gguf_layer_blocks(gguf_tensors(gguf), cfg.num_heads, cfg.num_kv_heads)
    dense_from = dense_rows_on_this_cpu(spec.q4_dense_from)

    def take(layer: torch.nn.Module, projection: str, *names: str) -> Q4Linear:
        missing = [n for n in names if n not in blocks]
        if missing:
            raise UnsupportedModelError(f"native_q4: {gguf.name} has no Q4_1 tensor {missing[0]!r}")
        joined = Q4Blocks.cat([blocks[n] for n in names])
        loaded = getattr(layer, projection).weight.detach()
        if joined.q.shape != loaded.shape or not torch.equal(joined.dequantize(), loaded):
            # the GGUF read here is not the one the loaded weights were converted from (damaged, or replaced)
            raise CorruptModelError(f"native_q4: {gguf} does not hold the loaded model's {names[0]}")
        return Q4Linear(joined, dense_from=dense_from)

    for i, layer in enumerate(model.decoder_layers()):
        p, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        layer.swap_projections(
            qkv=take(layer, "qkv", att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"),
            o_proj=take(layer, "o_proj", att + "o_proj.weight"),
            gate_up=take(layer, "gate_up", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            down=take(layer, "down", p + "mlp.down_proj.weight"),
        )


SAFETENSORS_INDEX = "model.safetensors.index.json"
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def weight_files(path: Path) -> list[Path]:
    """The shards a ``model.safetensors.index.json`` names, or without one every ``*.safetensors`` but Mistral's
    ``consolidated*`` copy (the same weights under other names): never a stale or extra file beside them."""
    index = path / SAFETENSORS_INDEX
    if index.exists():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptModelError(f"cannot read {index}: {e!r}") from None
        if not all(isinstance(n, str) and "/" not in n for n in names):
            raise CorruptModelError(f"{index}: its weight_map must name files in {path}")
        missing = sorted(n for n in names if not (path / n).is_file())
        if missing:
            raise ModelSourceError(f"{index} names weight files that are not there: {', '.join(missing[:3])}")
        files = sorted(path / n for n in names)
    else:
        # (a file: a named pipe of that name blocked the load in open(), past Ctrl-C)
        files = sorted(f for f in path.glob("*.safetensors") if f.is_file() and not f.name.startswith("consolidated"))
    if not files:
        raise ModelSourceError(f"no *.safetensors weights in {path}")
    return files


def load_model_dir(
    path: Path, spec: ModelSpec, *, device: str | torch.device = "cpu", max_positions: int | None = None
) -> LlamaModel:
    """Weights go tensor by tensor from the safetensors files to ``device`` in the serving dtype: no full copy of
    the model is ever built on the host (an 8B bf16 target needs 16 GB on its GPU and one tensor on the host)."""
    hf_config = read_config(path)
    # by name before any weight is read: a GPT-2 had been refused for holding "0 decoder layers", a GPTQ checkpoint
    # for a missing ``weight``, and bitsandbytes' int8 weights were cast to floats and built into a model
    ArchConfig.from_hf(hf_config)
    quantized = getattr(hf_config, "quantization_config", None)
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
        raise UnsupportedModelError(
            f"{path} holds a quantised checkpoint (quantization_config: {str(method)[:40]}); load its float16, "
            "bfloat16 or float32 weights (this runner quantises them itself: int8_dynamic, native_q4)"
        )
    files = weight_files(path)
    if spec.int8_dynamic and (spec.dtype != DType.float32 or torch.device(device).type != "cpu"):
        raise UnsupportedModelError("int8_dynamic models run on the CPU from float32 weights")
    dtype = spec.dtype.torch
    with ExitStack() as stack:
        where: dict[str, tuple[Any, Path]] = {}  # tensor name -> (open file, its path)
        for f in files:
            try:
                handle = stack.enter_context(safe_open(f, framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
                raise CorruptModelError(f"cannot read weights {f}: {e}") from e
            for name in handle.keys():  # noqa: SIM118 - not a dict
                if name in where:
                    raise CorruptModelError(f"tensor {name!r} is in both {where[name][1].name} and {f.name}")
                where[name] = (handle, f)

        read: set[str] = set()

        def get(name: str) -> torch.Tensor:
            if name not in where:
                raise UnsupportedModelError(f"checkpoint is missing tensor {name!r}")
            read.add(name)
            handle, f = where[name]
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise CorruptModelError(f"cannot read weights {f}: {e}") from e
            if tensor.dtype not in WEIGHT_DTYPES:  # float8 or integers: quantised weights, not taken as floats
                raise UnsupportedModelError(
                    f"{f}: tensor {name!r} is {tensor.dtype}; the weights must be float32, float16, bfloat16 or "
                    "float64 (a quantised checkpoint is not supported)"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise NonFiniteWeightsError(f"{f}: tensor {name!r} holds NaN or infinite values")
            cast = tensor.to(dtype=dtype)
            narrower = torch.finfo(dtype).max < torch.finfo(tensor.dtype).max  # (widening cannot overflow)
            if narrower and not bool(torch.isfinite(cast).all()):
                raise UnsupportedModelError(
                    f"{f}: tensor {name!r} does not fit in {spec.dtype.value} (infinite once cast)"
                    + ("; load the model in float32 or bfloat16" if spec.dtype == DType.float16 else "")
                )
            return cast.to(device)

        layers = {int(m.group(1)) for name in where if (m := re.match(r"model\.layers\.(\d+)\.", name))}
        named = getattr(hf_config, "num_hidden_layers", None)
        held = max(layers) + 1 if layers else 0
        # before building: an absurd count would take minutes to refuse (every index held, not just the last)
        if isinstance(named, int) and (held != named or len(layers) != held):
            bare = not layers and any(name.startswith("layers.") for name in where)
            raise UnsupportedModelError(
                f"the weights in {path} hold {len(layers)} decoder layers, numbered up to {held - 1}; "
                f"its config.json names {named}"
                + (
                    "; its tensors lack the 'model.' prefix (saved from the base model, not ...ForCausalLM)"
                    if bare
                    else ""
                )
            )
        try:
            model = LlamaModel.from_hf_weights(hf_config, get, dtype=dtype, device=device, max_positions=max_positions)
        except (SpecServeError, torch.OutOfMemoryError):
            raise
        except (RuntimeError, ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
            # a tensor whose shape the config does not imply (torch's size mismatch), a malformed config field
            raise UnsupportedModelError(f"the weights in {path} do not fit its config.json: {e!r}") from e
        _check_unused(path, where.keys() - read, model, get)
    model.eos_token_ids = stop_token_ids(path)
    model.requires_grad_(False)  # frozen: with autograd on, the kernel (which has no backward) would step aside
    if spec.int8_dynamic:
        return quantize_int8_dynamic(model)
    if not spec.native_q4:  # native_q4 replaces the decoder's linears first (load_model)
        attach_cpu_paths(model, spec)
    return model


def read_config(path: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError, StrictDataclassError) as e:
        raise ModelSourceError(f"cannot read config.json in {path}: {e!r}") from e


def model_config(spec: ModelSpec) -> PretrainedConfig:
    """The model's config.json, read as its load reads it (without its weights)."""
    try:
        return read_config(resolve(spec, weights=False))
    except ModelSourceError as e:
        _raise_in_conversion(spec, e)


def stop_token_ids(path: Path) -> frozenset[int]:
    """The EOS ids config.json and generation_config.json name, as transformers' ``generate`` and vLLM stop at them
    (an instruct model may name a stop id in the second alone). Read from the files: a config class fills in a
    default id (Llama's 2) that no file names."""
    ids: frozenset[int] = frozenset()
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ModelSourceError(f"cannot read {f}: {e!r}") from None
        if not isinstance(data, dict):
            raise CorruptModelError(f"{f} is not a JSON object")
        try:
            ids |= token_id_set(data.get("eos_token_id"))
        except UnsupportedModelError as e:
            raise CorruptModelError(f"{f}: {e}") from None
    return ids


def _check_unused(path: Path, unused: set[str], model: LlamaModel, get: Callable[[str], torch.Tensor]) -> None:
    """Tensors the config did not ask for change what the checkpoint computes (biases under attention_bias false, an
    LM head of its own under tie_word_embeddings): refused, as transformers would load them. RoPE's cached
    inv_freq, and a tied LM head that equals the embedding, are the same model."""
    unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" in unused:
        if not torch.equal(get("lm_head.weight"), model.embed_tokens.weight):
            raise UnsupportedModelError(
                f"{path}/config.json ties the LM head to the embedding (tie_word_embeddings), but the checkpoint's "
                "lm_head.weight differs from it"
            )
        unused.discard("lm_head.weight")
    if unused:
        shown = ", ".join(sorted(unused)[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        why = (  # (transformers' Mistral and Qwen2 fix their biases by type, whatever the flags say)
            "a bias flag (attention_bias, mlp_bias) or another setting disagrees with the checkpoint"
            if model.cfg.model_type == "llama" or not all(n.endswith(".bias") for n in unused)
            else f"model_type {model.cfg.model_type!r} has {MODEL_TYPE_BIASES[model.cfg.model_type]}, whatever its "
            "config's bias flags say (as transformers builds it, which would drop these tensors)"
        )
        raise UnsupportedModelError(f"the weights in {path} hold tensors its config.json does not use ({shown}): {why}")


def attach_cpu_paths(model: LlamaModel, spec: ModelSpec) -> None:
    """The spec's CPU switches for the model's float linears (the small-product kernel with its copies and Q4_1
    and Q8_0 records, or else GEMV copies and row padding; MKL-packed copies), then
    the C++ layer stack over the projections as they now are."""
    packed = spec.small_gemm_packed is not False
    small = (
        spec.small_gemm
        and model.device.type == "cpu"
        and attach_small_gemm(model, packed=packed, chunks=spec.small_gemm_chunks)
    )
    gguf = record_source(model, spec) if small else None
    if gguf is not None:  # (under native_q4 the decoder's linears are its own Q4_1 ones: the LM head's records only)
        attach_records(model, spec.model_copy(update={"q4_reads": False}) if spec.native_q4 else spec, gguf)
    if small and spec.small_gemm_plan:  # layouts and prefetches timed on this machine (the same bits either way)
        cached_kernel_plan(model, (True, False) if spec.small_gemm_packed is None else (spec.small_gemm_packed,))
    if model.device.type == "cpu" and not small:  # the kernel serves the rows these switches are for
        if spec.gemv_copies:
            attach_gemv_copies(model)
        if spec.pad_rows:
            attach_row_padding(model)
    served = max(SMALL_GEMM_ROWS, spec.small_gemm_chunks) if small else 0  # (those rows take the kernel)
    attach_mkl_packed(model, spec.mkl_packed_widths, served=served)
    if small and spec.bounded_argmax:  # the row counts it serves timed at load with the kernel's plan
        attach_bounded_argmax(model, measure=spec.small_gemm_plan)
    if spec.native_attention:
        attach_native_attention(model)
    if spec.native_stack and model.device.type == "cpu":
        attach_native_stack(model)


def record_source(model: LlamaModel, spec: ModelSpec) -> Path | None:
    """The spec's GGUF, whose quantised blocks the kernel may read as records (``ModelSpec.q4_reads``,
    ``q8_head_reads``), where either is on (under ``native_q4`` the head's: the decoder's linears are Q4_1 already),
    the model float32 on the CPU and its source a GGUF still on disk; else None."""
    kind = spec.resolved_kind()
    if not (spec.q8_head_reads or (spec.q4_reads and not spec.native_q4)) or not spec.small_gemm:
        return None
    if kind not in (SourceKind.builtin, SourceKind.gguf) or model.device.type != "cpu" or model.dtype != torch.float32:
        return None
    gguf = builtin_gguf_path(spec.source) if kind == SourceKind.builtin else local_path(spec.source)
    if not gguf.is_file():
        log.warning("quantised reads: %s is not on disk; the kernel reads float32 weights", gguf)
        return None
    return gguf


def attach_records(model: LlamaModel, spec: ModelSpec, gguf: Path) -> None:
    """The GGUF's Q4_1 decoder blocks (``q4_reads``) and Q8_0 LM head blocks (``q8_head_reads``) as the kernel's
    records, and both as int8 products' records (``int8_reads``; the head's only where the decoder's attached), where
    the spec asks for them and they dequantise to the loaded weights; an unreadable GGUF leaves the float32 weights
    serving as they are (a logged reason)."""
    try:
        tensors = gguf_tensors(gguf)  # one read of the header (its tokenizer metadata is most of it) for both
        int8_decoder = False
        if spec.q4_reads and (q4 := gguf_layer_blocks(tensors, model.cfg.num_heads, model.cfg.num_kv_heads)):
            int8_decoder = spec.int8_reads and attach_int8_reads(model, q4)
            if not int8_decoder:  # int8 products read the decoder's blocks at every row count: no float32 records
                attach_q4_reads(model, q4)
        q8 = gguf_q8_blocks(tensors, Q8_HEAD_NAMES) if spec.q8_head_reads or spec.int8_reads else None
        int8_head = bool(int8_decoder and q8 and attach_int8_head(model, q8))  # only beside the decoder's
        if spec.q8_head_reads and q8 and not int8_head:  # int8 products read the head at every row count
            attach_q8_head(model, q8)
    except Exception as e:  # the float32 weights are loaded already, and serve as they are
        log.warning("quantised reads: cannot read %s (%s); the kernel reads float32 weights", gguf, e)


def load_draft(spec: DraftSpec, target: LlamaModel, *, device: str | torch.device = "cpu") -> LlamaModel | EagleHead:
    """A draft model, or a draft head bound to ``target`` (whose embedding it shares)."""
    if isinstance(spec, HeadSpec):
        head = load_eagle_head(spec.path(), target, dtype=spec.dtype.torch)
        if head.device != torch.device(device):
            head = head.to(device)
            head.bind(target)  # again: its own copies of the target's weights are no module state that moves
        if spec.draft_vocab is not None and head.cfg.kind == HeadKind.eagle3:
            raise ModelSourceError(
                f"draft_vocab applies to EAGLE-1/2 heads; the EAGLE-3 head {spec.path()} drafts over its own "
                f"{head.draft_vocab_size}-token LM head (leave draft_vocab unset)"
            )
        if spec.draft_vocab is not None:
            head.set_draft_vocab(frequent_ids(spec.path(), spec.draft_vocab, head.cfg.vocab_size))
        if getattr(target.lm_head, "small_gemm", None) is not None:  # the target's ModelSpec.small_gemm
            attach_small_gemm(head, bf16_reads=spec.bf16_reads)
            attach_head_records(head, spec.quantize, int8=spec.int8_products)
            follow_target_plan(head, target)
        if spec.native_layer and target.native_stack is not None:  # and the target's ModelSpec.native_stack
            attach_head_stack(head)
        return head
    return load_model(spec, device=device)


def frequent_ids(head_dir: Path, size: int, vocab_size: int) -> torch.Tensor:
    """[size] ascending ids: the first ``size`` of the head's vocabulary map (see specserve/train/pipeline.py),
    then ids never seen in training, lowest first."""
    path = head_dir / "vocab_map.json"
    try:
        order = json.loads(path.read_text())["by_frequency"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelSourceError(f"draft_vocab needs the head's vocabulary map {path}: {e!r}") from e
    if size > vocab_size:
        raise ModelSourceError(f"draft_vocab {size} exceeds the target's {vocab_size}-token vocabulary")
    if not isinstance(order, list) or not all(type(i) is int and 0 <= i < vocab_size for i in order):
        raise ModelSourceError(f"{path}: by_frequency must be a list of token ids in [0, {vocab_size})")
    if len(set(order)) != len(order):
        raise ModelSourceError(f"{path}: by_frequency lists {len(order) - len(set(order))} token ids twice")
    seen = set(order)
    order = order + [i for i in range(vocab_size) if i not in seen]
    return torch.tensor(order[:size], dtype=torch.long).sort().values


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    path = resolve(spec, weights=False)  # (a hub repo's weights are fetched where its model loads, not here)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # the tokenizers library raises bare Exceptions (a tokenizer.json it cannot parse)
        named = ModelSourceError(f"cannot load the tokenizer in {path}: {e}")
        named.__cause__ = e
        _raise_in_conversion(spec, named)


def warn_on_another_tokenizer(
    target: ModelSpec, tokenizer: PreTrainedTokenizerBase, draft: DraftSpec | None, *, local_only: bool = False
) -> int:
    """The target's token ids that a draft model's tokenizer maps to other tokens than the target's ``tokenizer``
    does (a warning names them; 0 for a head, a draft of the target's own source, or a draft without a tokenizer of
    its own to compare). ``local_only``: only a checkpoint directory's (where the draft loads elsewhere, reading
    another source here would fetch or convert it a second time). The loaders compare vocabulary sizes only: Llama 2
    and Mistral 7B both hold 32000 tokens, and a draft with the other's tokenizer is lossless and mostly rejected."""
    if not isinstance(draft, ModelSpec) or (draft.source, draft.kind) == (target.source, target.kind):
        return 0
    if local_only and draft.resolved_kind() != SourceKind.hf_dir:
        return 0
    try:
        theirs = load_tokenizer(draft).get_vocab()
    except ModelSourceError as e:  # a draft's weights and config serve without a tokenizer of their own
        log.info("the draft %s's tokenizer is not compared with the target's: %s", draft.source, e)
        return 0
    by_id = {i: t for t, i in theirs.items()}
    ours = tokenizer.get_vocab()
    differ = sorted(i for t, i in ours.items() if by_id.get(i) != t)
    if differ:
        log.warning(
            "the draft %s's tokenizer maps %d of the target's %d token ids (%.1f%%) to other tokens (ids %s%s): "
            "its drafts will mostly be rejected (output stays lossless); speculative decoding needs the target's "
            "tokenizer",
            draft.source,
            len(differ),
            len(ours),
            100 * len(differ) / max(len(ours), 1),
            differ[:5],
            ", ..." if len(differ) > 5 else "",
        )
    return len(differ)


def _raise_in_conversion(spec: ModelSpec, e: ModelSourceError) -> NoReturn:
    """``e`` again, or where a file of this project's conversion in the cache failed to load (damaged in a way its
    sizes do not show: they are checked at start), ``e`` naming the command that converts it again. A user GGUF's
    own non-finite weights are converted as they are (converting again cannot help); a builtin's are known finite."""
    kind = spec.resolved_kind()
    if kind not in (SourceKind.builtin, SourceKind.gguf) or (
        kind == SourceKind.gguf and isinstance(e, NonFiniteWeightsError)
    ):
        raise e
    raise type(e)(
        f"{e} (the cached conversion of {spec.source} is damaged: `specserve models pull --force {spec.source}` "
        "converts it again)"
    ) from e
