"""Self-distillation data for a draft head: the target answers seed prompts through its chat template
(greedy; answers end in EOS when the target finished) and its features are recorded, either from the very
forwards that generate the answers (``greedy_distiller``: nothing computed twice) or, for answers written by any
other function, from one prefill over each whole conversation afterwards (``prefill_distiller``).

The data set is a directory of chunk files ``chunk_NNNNN.safetensors``, each holding
``tokens`` [N] int32 (conversations concatenated), ``offsets`` [S+1] int64, ``prompt_lens`` [S] int64 and
``features`` [N, H] float16 (the target's last hidden state after the final norm, one row per token), and for an
EAGLE-3 head ``aux_features`` [N, A*H] float16 (the inputs of the target's decoder layers ``aux_layers``, the
features the head fuses; the final features still give the target's next-token distributions).
Chunks already on disk are skipped, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from transformers import PreTrainedTokenizerBase

from specserve.durable import drop_leftovers, write_durably
from specserve.errors import SettingsError, UnsupportedModelError
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel

ProgressFn = Callable[[int, int], None]  # (done, total) conversations


@dataclass(frozen=True)
class DistillConfig:
    num_prompts: int = 2048
    seed: int = 0
    max_new_tokens: int = 256
    chunk_size: int = 64  # conversations per chunk file
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: also record the inputs of these target layers


@dataclass
class Conversation:
    tokens: list[int]  # chat-formatted prompt + the target's answer (ending in EOS when it finished)
    prompt_len: int


TRAINING_DATE = "26 Jul 2024"  # the date Llama 3's template prints where it has no clock


def chat_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The prompt as the target's chat template renders it, with a fixed ``date_string``: a template that prints
    today's date (Llama 3's) would otherwise make the data depend on the day it was written, and a resumed run's
    tokenizer fingerprint change at midnight."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        date_string=TRAINING_DATE,
    )
    return list(ids)  # type: ignore[arg-type]


AnswerFn = Callable[[list[list[int]], int], list[list[int]]]  # (chat-formatted prompt ids, max new tokens) -> answers


@dataclass
class Features:
    final: list[torch.Tensor]  # per conversation [n_i, H] float16
    aux: list[torch.Tensor] | None = None  # per conversation [n_i, A*H] float16 (EAGLE-3)


class Distiller(Protocol):
    """Chat-formatted prompts -> the target's conversations (prompt + answer) and their features."""

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: int, aux_layers: tuple[int, ...]
    ) -> tuple[list[Conversation], Features]: ...


def prefill_distiller(model: LlamaModel, answer: AnswerFn) -> Distiller:
    """Answers from ``answer``, then one prefill per conversation for the features."""

    def distill(
        prompts: list[list[int]], max_new_tokens: int, aux_layers: tuple[int, ...]
    ) -> tuple[list[Conversation], Features]:
        convs = [Conversation(p + a, len(p)) for p, a in zip(prompts, answer(prompts, max_new_tokens), strict=True)]
        return convs, target_features(model, convs, aux_layers)

    return distill


def greedy_distiller(model: LlamaModel, eos_ids: set[int], batch_size: int = 64) -> Distiller:
    """The target's greedy answers with their features from the same forwards (``generate_with_features``),
    ``batch_size`` conversations at a time."""

    def distill(
        prompts: list[list[int]], max_new_tokens: int, aux_layers: tuple[int, ...]
    ) -> tuple[list[Conversation], Features]:
        convs: list[Conversation] = []
        feats = Features([], [] if aux_layers else None)
        for i in range(0, len(prompts), batch_size):
            c, f = generate_with_features(model, prompts[i : i + batch_size], max_new_tokens, eos_ids, aux_layers)
            convs += c
            feats.final += f.final
            if feats.aux is not None and f.aux is not None:
                feats.aux += f.aux
        return convs, feats

    return distill


@torch.inference_mode()
def generate_with_features(
    model: LlamaModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    aux_layers: tuple[int, ...] = (),
) -> tuple[list[Conversation], Features]:
    """Greedy answers to all ``prompts`` at once (one ragged prefill, then one decode row per unfinished answer a
    step), keeping every forward's hidden states: the features of each conversation's tokens come from the
    forwards that generated them, so no second prefill. A finished answer (EOS or ``max_new_tokens``) is fed one
    last time for its final token's features. Rows equal ``target_features``' up to float rounding (a different
    grouping of the same products)."""
    if not prompts or min(len(p) for p in prompts) < 1 or max_new_tokens < 1:
        raise ValueError("generate_with_features needs prompts of at least one token and max_new_tokens >= 1")
    need = max(len(p) for p in prompts) + max_new_tokens + 1
    if need > model.max_positions:
        raise SettingsError(f"a prompt and its answer need {need} positions, the model has {model.max_positions}")
    cache = model.new_cache(len(prompts), need)
    slots = [cache.allocate() for _ in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    final: list[list[torch.Tensor]] = [[] for _ in prompts]
    aux: list[list[torch.Tensor]] = [[] for _ in prompts]
    feed = [list(p) for p in prompts]  # each sequence's tokens not yet through the model
    active = list(range(len(prompts)))
    while active:
        batch = ForwardBatch.build(
            cache,
            [slots[i] for i in active],
            [feed[i] for i in active],
            num_logits=[1] * len(active),
            device=model.device,
        )
        f, a = model.hidden_states(batch, cache, aux_layers)  # [N, H], [N, A*H] | None
        nxt = model.logits(f[batch.logit_rows]).argmax(-1).tolist()  # host sync: one per step
        sizes = list(batch.num_new)
        f_host = stored_features(f, "last hidden states")  # one copy a step, then split on the host
        a_rows = stored_features(a, "aux layer inputs").split(sizes) if a is not None else [None] * len(active)
        still = []
        for i, fi, ai, tok in zip(active, f_host.split(sizes), a_rows, nxt, strict=True):
            final[i].append(fi)
            if ai is not None:
                aux[i].append(ai)
            ans = answers[i]
            if ans and (ans[-1] in eos_ids or len(ans) >= max_new_tokens):
                continue  # that was its last token's feed
            ans.append(tok)
            feed[i] = [tok]
            still.append(i)
        active = still
    convs = [Conversation(p + ans, len(p)) for p, ans in zip(prompts, answers, strict=True)]
    return convs, Features(
        [torch.cat(rows) for rows in final], [torch.cat(rows) for rows in aux] if aux_layers else None
    )


def stored_features(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as the data set keeps it (float16, on the host). A value float16 cannot hold is refused: stored as
    infinity it would turn the first training step that reads it, and every weight after it, into NaN."""
    half = t.to(torch.float16).cpu()
    if not bool(torch.isfinite(half).all()):
        if not bool(torch.isfinite(t).all()):
            raise UnsupportedModelError(f"the target computed non-finite {what}: its weights or inputs are broken")
        raise UnsupportedModelError(
            f"the target's {what} reach {float(t.abs().max()):.4g}, beyond float16's range (65504), in which the "
            "training data keeps features: a head cannot be trained for this target here"
        )
    return half


@torch.inference_mode()
def target_features(model: LlamaModel, convs: list[Conversation], aux_layers: tuple[int, ...] = ()) -> Features:
    """The target's last hidden state (after the final norm) at every token of each conversation, and the inputs
    of ``aux_layers``: the same rows the serving target computes, from one prefill per conversation."""
    final: list[torch.Tensor] = []
    aux: list[torch.Tensor] = []
    for conv in convs:
        cache = model.new_cache(1, len(conv.tokens))
        slot = cache.allocate()
        batch = ForwardBatch.build(cache, [slot], [conv.tokens], device=model.device)
        f, a = model.hidden_states(batch, cache, aux_layers)
        final.append(stored_features(f, "last hidden states"))
        if a is not None:
            aux.append(stored_features(a, "aux layer inputs"))
    return Features(final, aux if aux_layers else None)


def build_dataset(
    distill: Distiller,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    prompts: list[str],
    cfg: DistillConfig,
    progress: ProgressFn | None = None,
) -> list[Path]:
    """Generate answers and features chunk by chunk into ``out`` (resumable); the chunks of these prompts."""
    size = cfg.chunk_size

    def prompts_of(n: int) -> list[str]:
        return prompts[n * size : (n + 1) * size]

    return _distill_chunks(
        distill, tokenizer, out, len(prompts), prompts_of, cfg, progress, items_of=lambda n: items_digest(prompts_of(n))
    )


def build_self_dataset(
    distill: Distiller,
    tokenizer: PreTrainedTokenizerBase,
    requests: Callable[[int, int], list[str]],
    out: Path,
    num_requests: int,
    cfg: DistillConfig,
    progress: ProgressFn | None = None,
) -> list[Path]:
    """``build_dataset`` over requests the target writes itself (``specserve.train.self_prompts``): chunk ``n``
    asks ``requests(chunk_size, seed)`` for its prompts with a seed of its own, so chunks are independent and an
    interrupted run resumes. A chunk holds the requests that survived filtering (fewer than asked)."""
    size = cfg.chunk_size

    def prompts_of(n: int) -> list[str]:
        return requests(min(size, num_requests - n * size), (cfg.seed << 20) + n)

    return _distill_chunks(distill, tokenizer, out, num_requests, prompts_of, cfg, progress)


def _distill_chunks(
    distill: Distiller,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    total: int,
    prompts_of: Callable[[int], list[str]],
    cfg: DistillConfig,
    progress: ProgressFn | None,
    *,
    items_of: Callable[[int], str] | None = None,
) -> list[Path]:
    """Chunk ``n`` of ``ceil(total / cfg.chunk_size)``: ``prompts_of(n)`` answered by the target, with its
    features; chunks already on disk are skipped (``prompts_of`` is not called for them), unless ``items_of(n)``,
    the digest of the prompts chunk ``n`` holds now, differs from the one it was written with. Returns the chunks."""
    out.mkdir(parents=True, exist_ok=True)
    chunks = []
    for n in range(-(-total // cfg.chunk_size)):
        path = out / f"chunk_{n:05d}.safetensors"
        asked = min(cfg.chunk_size, total - n * cfg.chunk_size)
        items = None if items_of is None else items_of(n)
        _drop_if_other(path, asked, items)
        if not path.exists():
            ids = [chat_ids(tokenizer, p) for p in prompts_of(n)]
            if ids:  # (a chunk of self-written requests may have none left after filtering)
                write_chunk(path, *distill(ids, cfg.max_new_tokens, cfg.aux_layers), asked=asked, items=items)
        if path.exists():
            chunks.append(path)
        if progress is not None:
            progress(min((n + 1) * cfg.chunk_size, total), total)
    return chunks


def build_text_dataset(
    model: LlamaModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    pairs: list[tuple[str, str]],
    chunk_size: int = 64,
    progress: ProgressFn | None = None,
    aux_layers: tuple[int, ...] = (),
) -> list[Path]:
    """Teacher-forced conversations (prompt, an offline text as the answer): features from one prefill each, no
    generation, so ~6x cheaper per token than ``build_dataset``. The head still learns the target's own
    next-token distributions (the trainer computes them from the features)."""
    out.mkdir(parents=True, exist_ok=True)
    chunks = []
    for n in range(0, len(pairs), chunk_size):
        path = out / f"chunk_{n // chunk_size:05d}.safetensors"
        chunks.append(path)
        chunk = pairs[n : n + chunk_size]
        items = items_digest(chunk)
        _drop_if_other(path, len(chunk), items)
        if not path.exists():
            convs = [teacher_forced(tokenizer, prompt, text, model.max_positions) for prompt, text in chunk]
            write_chunk(path, convs, target_features(model, convs, aux_layers), asked=len(convs), items=items)
        if progress is not None:
            progress(min(n + chunk_size, len(pairs)), len(pairs))
    return chunks


def teacher_forced(
    tokenizer: PreTrainedTokenizerBase, prompt: str, text: str, max_positions: int | None = None
) -> Conversation:
    """The chat prompt, then ``text`` as the answer and EOS, cut to the target's ``max_positions`` (a passage
    longer than a short-context target's window had failed the run in the KV cache, after the generation step).
    Special-token text in ``text`` (a passage quoting ``<|im_end|>``) is spelt in ordinary tokens: parsed, it would
    end the answer where the text goes on."""
    ids = chat_ids(tokenizer, prompt)
    answer = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tokens = (ids + answer + eos)[:max_positions]
    return Conversation(tokens, min(len(ids), len(tokens)))


def items_digest(items: list[str] | list[tuple[str, str]]) -> str:
    """The sha256 of a chunk's items (prompts, or (prompt, text) pairs), recorded in the chunk."""
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()


def _drop_if_other(path: Path, asked: int, items: str | None = None) -> None:
    """A chunk on disk written for another number of items (the last, partial chunk of a run with another count)
    or, where ``items`` is given, for other items than these (their digest: a text passage list that depends on
    the stdlib modules a Python has, seed prompt templates changed by a code update; a chunk that recorded none) is
    removed, to be written again: chunk n holds items n*size.. of the run, and a resumed or larger run must not
    reuse one as if it held them."""
    if not path.exists():
        return
    if chunk_asked(path) != asked or (items is not None and chunk_items(path) != items):
        path.unlink()


def chunk_items(path: Path) -> str | None:
    """The digest of the items a chunk was written for (None: it recorded none)."""
    with safe_open(path, "pt") as f:
        return (f.metadata() or {}).get("items")


def chunk_asked(path: Path) -> int:
    """The items (prompts, passages) a chunk was written for: its ``asked`` metadata, or for chunks written before
    it was recorded, the conversations it holds."""
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
        return int(meta["asked"]) if "asked" in meta else int(f.get_slice("prompt_lens").get_shape()[0])


def write_chunk(
    path: Path, convs: list[Conversation], feats: Features, *, asked: int, items: str | None = None
) -> None:
    lens = [len(c.tokens) for c in convs]
    offsets = torch.tensor([0, *lens]).cumsum(0)
    tensors = {
        "tokens": torch.tensor([t for c in convs for t in c.tokens], dtype=torch.int32),
        "offsets": offsets.to(torch.int64),
        "prompt_lens": torch.tensor([c.prompt_len for c in convs], dtype=torch.int64),
        "features": torch.cat(feats.final).contiguous(),
    }
    if feats.aux is not None:
        tensors["aux_features"] = torch.cat(feats.aux).contiguous()
    # (the bytes written into the file write_durably made: safetensors' own save_file renames a temporary file of
    # its making over the path, which a killed write would leave behind under a name nothing recognises)
    meta = {"asked": str(asked)} | ({} if items is None else {"items": items})
    data = safetensors_bytes(tensors, metadata=meta)
    write_durably(path, lambda tmp: tmp.write_bytes(data))  # whole or absent


@dataclass(frozen=True)
class Sample:
    tokens: torch.Tensor  # [n] long
    features: torch.Tensor  # [n, H] float16
    prompt_len: int
    aux: torch.Tensor | None = None  # [n, A*H] float16 (EAGLE-3 data)


def claim_data_dir(out: Path, settings: dict[str, Any]) -> None:
    """Record what a data directory's chunks were written with (``manifest.json``); a later run may reuse them
    (resume, or more prompts of the same kind) only with the same settings."""
    out.mkdir(parents=True, exist_ok=True)
    drop_leftovers(out)  # chunks (or the manifest) whose writes were killed midway
    manifest = out / "manifest.json"
    settings = json.loads(json.dumps(settings))  # tuples as lists, as read back
    if manifest.exists():
        try:
            held = json.loads(manifest.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise SettingsError(f"{manifest} cannot be read ({e}); use another work dir") from None
        if not isinstance(held, dict):
            raise SettingsError(f"{manifest} is not a settings record; use another work dir")
        differ = sorted(k for k in held.keys() | settings.keys() if held.get(k) != settings.get(k))
        if differ:
            shown = ", ".join(f"{k}: {held.get(k)!r} there, {settings.get(k)!r} now" for k in differ)
            raise SettingsError(f"{out} holds data written with other settings ({shown}); use another work dir")
    elif any(out.glob("chunk_*.safetensors")):
        raise SettingsError(f"{out} holds data chunks without a manifest.json (settings unknown); use another work dir")
    else:
        text = json.dumps(settings, indent=1) + "\n"
        write_durably(manifest, lambda tmp: tmp.write_text(text))  # (a manifest cut short would stop every later run)


def iter_samples(chunks: Path | list[Path], *, aux: bool = False) -> Iterator[Sample]:
    """The conversations of these chunk files (a directory: all of its chunks); ``aux``: with their EAGLE-3
    features (a clear error without)."""
    files = sorted(chunks.glob("chunk_*.safetensors")) if isinstance(chunks, Path) else chunks
    if isinstance(chunks, Path) and not files:
        raise FileNotFoundError(f"no chunk_*.safetensors in {chunks}: run the data step first")
    for f in files:
        d = load_file(f)
        if aux and "aux_features" not in d:
            raise SettingsError(f"{f} holds no aux_features (written for an EAGLE-1/2 head): use another work dir")
        off = d["offsets"].tolist()
        for i, plen in enumerate(d["prompt_lens"].tolist()):
            a, b = off[i], off[i + 1]
            extra = d["aux_features"][a:b] if aux else None
            yield Sample(d["tokens"][a:b].long(), d["features"][a:b], plen, extra)
