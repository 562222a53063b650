"""Self-distillation data for a draft head: the target answers seed prompts through its chat template
(greedy, as it serves them; answers end in EOS when the target finished), then one prefill over each whole
conversation records the target's features.

The data set is a directory of chunk files ``chunk_NNNNN.safetensors``, each holding
``tokens`` [N] int32 (conversations concatenated), ``offsets`` [S+1] int64, ``prompt_lens`` [S] int64 and
``features`` [N, H] float16 (the target's last hidden state after the final norm, one row per token), and for an
EAGLE-3 head ``aux_features`` [N, A*H] float16 (the inputs of the target's decoder layers ``aux_layers``, the
features the head fuses; the final features still give the target's next-token distributions).
Chunks already on disk are skipped, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerBase

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


def chat_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)  # type: ignore[arg-type]


AnswerFn = Callable[[list[list[int]], int], list[list[int]]]  # (chat-formatted prompt ids, max new tokens) -> answers


@dataclass
class Features:
    final: list[torch.Tensor]  # per conversation [n_i, H] float16
    aux: list[torch.Tensor] | None = None  # per conversation [n_i, A*H] float16 (EAGLE-3)


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
        final.append(f.to(torch.float16))
        if a is not None:
            aux.append(a.to(torch.float16))
    return Features(final, aux if aux_layers else None)


def build_dataset(
    model: LlamaModel,
    tokenizer: PreTrainedTokenizerBase,
    answer: AnswerFn,
    out: Path,
    prompts: list[str],
    cfg: DistillConfig,
    progress: ProgressFn | None = None,
) -> Path:
    """Generate answers and features chunk by chunk into ``out`` (resumable)."""
    size = cfg.chunk_size
    _distill_chunks(
        model,
        tokenizer,
        answer,
        out,
        len(prompts),
        size,
        lambda n: prompts[n * size : (n + 1) * size],
        progress,
        cfg.aux_layers,
        cfg.max_new_tokens,
    )
    (out / "meta.json").write_text(
        json.dumps({"num_prompts": len(prompts), "seed": cfg.seed, "max_new_tokens": cfg.max_new_tokens}, indent=1)
    )
    return out


def build_self_dataset(
    model: LlamaModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: Callable[[int, int], list[str]],
    answer: AnswerFn,
    out: Path,
    num_requests: int,
    cfg: DistillConfig,
    progress: ProgressFn | None = None,
) -> Path:
    """``build_dataset`` over requests the target writes itself (``specserve.train.self_prompts``): chunk ``n``
    asks ``requests(chunk_size, seed)`` for its prompts with a seed of its own, so chunks are independent and an
    interrupted run resumes. A chunk holds the requests that survived filtering (fewer than asked)."""
    size = cfg.chunk_size

    def prompts_of(n: int) -> list[str]:
        return requests(min(size, num_requests - n * size), (cfg.seed << 20) + n)

    _distill_chunks(
        model, tokenizer, answer, out, num_requests, size, prompts_of, progress, cfg.aux_layers, cfg.max_new_tokens
    )
    return out


def _distill_chunks(
    model: LlamaModel,
    tokenizer: PreTrainedTokenizerBase,
    answer: AnswerFn,
    out: Path,
    total: int,
    chunk_size: int,
    prompts_of: Callable[[int], list[str]],
    progress: ProgressFn | None,
    aux_layers: tuple[int, ...] = (),
    max_new_tokens: int = 256,
) -> None:
    """Chunk ``n`` of ``ceil(total / chunk_size)``: ``prompts_of(n)`` answered by the target, with its features;
    chunks already on disk are skipped (``prompts_of`` is not called for them)."""
    out.mkdir(parents=True, exist_ok=True)
    for n in range(-(-total // chunk_size)):
        path = out / f"chunk_{n:05d}.safetensors"
        if not path.exists():
            ids = [chat_ids(tokenizer, p) for p in prompts_of(n)]
            convs = [Conversation(p + a, len(p)) for p, a in zip(ids, answer(ids, max_new_tokens), strict=True)]
            write_chunk(path, convs, target_features(model, convs, aux_layers))
        if progress is not None:
            progress(min((n + 1) * chunk_size, total), total)


def build_text_dataset(
    model: LlamaModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    pairs: list[tuple[str, str]],
    chunk_size: int = 64,
    progress: ProgressFn | None = None,
    aux_layers: tuple[int, ...] = (),
) -> Path:
    """Teacher-forced conversations (prompt, an offline text as the answer): features from one prefill each, no
    generation, so ~6x cheaper per token than ``build_dataset``. The head still learns the target's own
    next-token distributions (the trainer computes them from the features)."""
    out.mkdir(parents=True, exist_ok=True)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for n in range(0, len(pairs), chunk_size):
        path = out / f"chunk_{n // chunk_size:05d}.safetensors"
        if not path.exists():
            convs = []
            for prompt, text in pairs[n : n + chunk_size]:
                ids = chat_ids(tokenizer, prompt)
                convs.append(Conversation(ids + tokenizer.encode(text, add_special_tokens=False) + eos, len(ids)))
            write_chunk(path, convs, target_features(model, convs, aux_layers))
        if progress is not None:
            progress(min(n + chunk_size, len(pairs)), len(pairs))
    return out


def write_chunk(path: Path, convs: list[Conversation], feats: Features) -> None:
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
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp)
    tmp.rename(path)  # a chunk exists only when complete


@dataclass(frozen=True)
class Sample:
    tokens: torch.Tensor  # [n] long
    features: torch.Tensor  # [n, H] float16
    prompt_len: int
    aux: torch.Tensor | None = None  # [n, A*H] float16 (EAGLE-3 data)


def iter_samples(data_dir: Path, *, aux: bool = False) -> Iterator[Sample]:
    """The conversations of a data directory; ``aux``: with their EAGLE-3 features (a clear error without)."""
    files = sorted(data_dir.glob("chunk_*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no chunk_*.safetensors in {data_dir}: run the data step first")
    for f in files:
        d = load_file(f)
        if aux and "aux_features" not in d:
            raise ValueError(f"{f} holds no aux_features (written for an EAGLE-1/2 head): use another work dir")
        off = d["offsets"].tolist()
        for i, plen in enumerate(d["prompt_lens"].tolist()):
            a, b = off[i], off[i + 1]
            extra = d["aux_features"][a:b] if aux else None
            yield Sample(d["tokens"][a:b].long(), d["features"][a:b], plen, extra)
