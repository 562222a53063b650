"""``specserve train-draft``: self-distilled data -> reduced vocabulary -> EAGLE head -> a shippable directory.

Every stage resumes: data chunks on disk are skipped, training continues from its last checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from specserve.arg_types import (
    batch_size,
    non_negative_int,
    out_dir_arg,
    positive_float,
    positive_int,
    present_device_arg,
)
from specserve.bench.machine import device_summary
from specserve.build import eos_ids_of
from specserve.durable import write_durably
from specserve.errors import SettingsError
from specserve.models.llama import LlamaModel
from specserve.models.sources import sha256_file
from specserve.spec_decode.eagle_head import EagleHead, HeadKind, default_aux_layers
from specserve.spec_decode.head_checkpoint import (
    DIGESTED_BESIDE,
    TARGET_SAMPLE_KEY,
    embedding_sample,
    load_eagle_head,
    save_eagle_head,
    weights_path,
)
from specserve.train.corpus import CorpusError, corpus_digest, corpus_files, corpus_passages
from specserve.train.distill import (
    DistillConfig,
    Distiller,
    Sample,
    build_dataset,
    build_self_dataset,
    build_text_dataset,
    chat_ids,
    claim_data_dir,
    greedy_distiller,
    iter_samples,
)
from specserve.train.lexicon_prompts import WORDNET_DIR, check_wordnet, lexicon_prompts, load_nouns
from specserve.train.seed_prompts import seed_prompts, text_passages
from specserve.train.self_prompts import AskFn, filter_record, mt_bench_runs, self_prompts, user_turn_prefix
from specserve.train.trainer import (
    PROVENANCE_FILE,
    TrainConfig,
    check_checkpoint,
    check_starting_head,
    prompts_seen,
    schedule,
    train_head,
    trained_vocab_size,
    write_provenance,
)
from specserve.train.vocab import coverage, frequency_order, token_counts, top_vocab

DRAFT_VOCAB, QUICK_DRAFT_VOCAB = 8192, 512
NO_DATA = "no training data: ask for seed prompts, text passages, corpus passages, lexicon or self-written prompts"


@dataclass(frozen=True)
class TrainDraftConfig:
    target_name: str
    data: DistillConfig = field(default_factory=DistillConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    draft_vocab: int | None = None  # None: DRAFT_VOCAB (QUICK_DRAFT_VOCAB quick), a fine-tuned head's own size
    text_passages: int = 0  # teacher-forced offline texts (stdlib docstrings) next to the distilled answers
    self_prompts: int = 0  # requests the target writes itself (Magpie), answered like the seed prompts
    lexicon_prompts: int = 0  # task templates over WordNet's nouns (specserve.train.lexicon_prompts)
    lexicon_max_new_tokens: int = 128  # their answers: shorter, for more prompts per hour
    wordnet_dir: Path = WORDNET_DIR
    corpus: tuple[Path, ...] = ()  # plain-text files or directories for teacher-forced passages
    corpus_passages: int = 0  # how many passages to draw from them (specserve.train.corpus)
    quick: bool = False

    def __post_init__(self) -> None:
        data = (self.data.num_prompts, self.text_passages, self.self_prompts, self.lexicon_prompts)
        if not (any(data) or self.corpus_passages):
            raise SettingsError(NO_DATA)  # before any model loads
        if bool(self.corpus) != bool(self.corpus_passages):
            raise SettingsError("corpus passages need corpus paths, and corpus paths a number of passages")

    @staticmethod
    def quick_mode(target_name: str) -> TrainDraftConfig:
        """Seconds, not hours: a handful of prompts and steps (for tests and a first look)."""
        return TrainDraftConfig(
            target_name,
            DistillConfig(num_prompts=8, max_new_tokens=16, chunk_size=4),
            TrainConfig(epochs=1, batch_tokens=256, max_len=128, warmup_steps=2, checkpoint_every=2),
            quick=True,
        )


def check_chat_template(tokenizer: PreTrainedTokenizerBase, self_prompts: bool) -> None:
    """The target answers every prompt through its chat template (and writes its own requests after the template's
    user header): a tokenizer without one is a clear error, not a transformers traceback after the model loads."""
    try:
        chat_ids(tokenizer, "a")
        if self_prompts:
            user_turn_prefix(tokenizer)
    except ValueError as e:
        raise SettingsError(f"train-draft needs the target tokenizer's chat template: {e}") from None


def first_of_each_prompt(samples: Iterable[Sample]) -> list[Sample]:
    """The samples in order, less any whose prompt an earlier one had (a request the target wrote again in another
    chunk): each request is trained on once, the same ones however often a run resumed."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for s in samples:
        prompt = tuple(s.tokens[: s.prompt_len].tolist())
        if prompt not in seen:
            seen.add(prompt)
            out.append(s)
    return out


def weights_fingerprint(model: LlamaModel) -> str:
    """sha256 over a strided sample (~4096 values) of every tensor in the model's state dict, with names and
    shapes: another checkpoint, quantisation or fine-tune under the same name reads differently (~0.1 s)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().flatten()
        h.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        h.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over what the data reads of the tokenizer: its vocabulary and rules (a fast tokenizer's JSON), its
    chat template, its special ids, and two chat prompts as encoded: a changed template under the same weights
    writes other prompts."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else b"-")
    h.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    h.update(repr(sorted(getattr(tokenizer, "all_special_ids", ()))).encode())
    h.update(repr(getattr(tokenizer, "eos_token_id", None)).encode())  # (text answers end with it; one of the above)
    for probe in ("a", "Write a short poem."):
        h.update(repr(chat_ids(tokenizer, probe)).encode())
    return h.hexdigest()


def special_ids(tokenizer: PreTrainedTokenizerBase | None, config_eos: int | list[int] | None = None) -> list[int]:
    """Every id generation stops at (the config's EOS ids and the tokenizer's) and the chat template's special
    tokens: always in the draft vocabulary."""
    ids = eos_ids_of(config_eos, tokenizer)
    if tokenizer is not None:
        ids |= set(tokenizer.all_special_ids)
    return sorted(ids)


def system_prefix_len(tokenizer: PreTrainedTokenizerBase) -> int:
    """Tokens every chat prompt starts with (the template's system turn): no loss is taken there."""
    a, b = chat_ids(tokenizer, "a"), chat_ids(tokenizer, "zzz qqq")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


VOCAB_MAP = "vocab_map.json"
TEXT_CHUNK = 64  # teacher-forced passages per chunk file
DEFAULT_BATCH = 64  # conversations generated together
DEFAULT_CORPUS_PASSAGES = 2048
DIGEST_FILE = "model.safetensors.sha256"  # beside the weights (head_checkpoint.check_digest)
ASK_MAX_TOKENS = 128  # a self-written request longer than this is dropped


def write_vocab_map(out_dir: Path, counts: torch.Tensor, forced: list[int], lead: list[int] | None = None) -> None:
    """The target ids seen in training, most frequent first (forced ids first; ``lead``: these ids before all
    others, as a fine-tuned EAGLE-3 head's own are, in the same order among themselves): any prefix is a draft
    vocabulary (``HeadSpec.draft_vocab`` picks one at load time)."""
    order = frequency_order(counts, forced)
    if lead is not None:  # a stable partition: the lead ids in that order, then the rest
        in_lead = torch.isin(order, torch.tensor(lead, dtype=order.dtype))  # [V]
        order = torch.cat([order[in_lead], order[~in_lead]])
    kept = set(forced) | set(lead or [])
    seen = int((counts > 0).sum()) + len([i for i in kept if counts[i] == 0])
    body = {"forced": forced, "by_frequency": order[:seen].tolist(), "counts": counts[order[:seen]].tolist()}
    write_durably(out_dir / VOCAB_MAP, lambda tmp: tmp.write_text(json.dumps(body)))


def train_draft(
    target: LlamaModel,
    tokenizer: PreTrainedTokenizerBase,
    distill: Distiller,
    cfg: TrainDraftConfig,
    work_dir: Path,
    out_dir: Path,
    *,
    ask: AskFn | None = None,
    command: str = "",
    log: Callable[[str], None] = print,
) -> EagleHead:
    t0 = time.perf_counter()
    eagle3 = cfg.train.kind == HeadKind.eagle3
    start = None if cfg.train.init_head is None else load_eagle_head(cfg.train.init_head, target, check_target=False)
    default_aux = default_aux_layers(target.cfg.num_layers) if start is None else start.cfg.aux_layers
    aux_layers = (cfg.train.aux_layers or default_aux) if eagle3 else ()
    cfg = replace(cfg, train=replace(cfg.train, aux_layers=aux_layers), data=replace(cfg.data, aux_layers=aux_layers))
    if start is not None:
        check_starting_head(start, cfg.train)  # a mismatch fails now, not after hours of data
        if start.trained_for not in (None, cfg.target_name):  # the shapes fit (checked): said, not refused
            log(
                f"note: {cfg.train.init_head} was trained for {start.trained_for}; fine-tuning it for {cfg.target_name}"
            )
    forced = special_ids(tokenizer, sorted(target.eos_token_ids))
    source = cfg.train.init_head
    # a fine-tune keeps its head's size too (it took the default's 8192 of a head trained with 16384)
    size = (
        cfg.draft_vocab or (source and trained_vocab_size(source)) or (QUICK_DRAFT_VOCAB if cfg.quick else DRAFT_VOCAB)
    )
    if eagle3 and start is not None:  # an EAGLE-3 head's LM head is over its own draft ids: it keeps them
        if cfg.draft_vocab is not None and cfg.draft_vocab != (own := start.draft_ids.numel()):
            log(
                f"note: the EAGLE-3 head {source} keeps its own {own} draft ids; "
                f"--draft-vocab {cfg.draft_vocab} is not used"
            )
        size = start.draft_ids.numel()  # (checked against the target as it loaded; special ids it lacks: a note)
    elif size > target.cfg.vocab_size:
        raise SettingsError(f"draft_vocab {size} is larger than the target's vocabulary ({target.cfg.vocab_size})")
    elif size < len(forced):
        raise SettingsError(f"draft_vocab {size} cannot hold the {len(forced)} special ids forced into it: {forced}")
    answers = {"max_new_tokens": cfg.data.max_new_tokens if cfg.data.num_prompts or cfg.self_prompts else 0}
    answers["lexicon_max_new_tokens"] = cfg.lexicon_max_new_tokens if cfg.lexicon_prompts else 0
    for name, n in answers.items():  # (a prompt takes positions too: at least its first token)
        if n + 2 > target.max_positions:
            raise SettingsError(
                f"{name} {n}: answers that long do not fit the target's {target.max_positions} positions"
            )
    has_map = source is not None and (source / VOCAB_MAP).exists()
    beyond = [i for i in forced if not 0 <= i < target.cfg.vocab_size]
    if beyond and not has_map:  # a new vocabulary forces them in (a ValueError after all the data had been made); a
        # fine-tune keeps its head's map, and notes the special ids it lacks
        raise SettingsError(
            f"the tokenizer's special ids {beyond} are outside the target's {target.cfg.vocab_size}-token vocabulary: "
            "the draft vocabulary forces them in (a tokenizer that does not match the target?)"
        )
    # the ids the chat template wraps every prompt in (a fine-tune keeping its map forces none in, but the target
    # reads them: its embedding's IndexError in the data step, after the other data)
    wrapped = sorted({i for i in chat_ids(tokenizer, "Hi") if not 0 <= i < target.cfg.vocab_size})
    if wrapped:
        raise SettingsError(
            f"the chat template encodes ids {wrapped} outside the target's {target.cfg.vocab_size}-token vocabulary "
            "(a tokenizer that does not match the target?)"
        )
    # fine-tuning keeps the vocabulary the head was trained with: its map read and checked now, as its digest
    from specserve.models.loader import frequent_ids

    inherited_ids = frequent_ids(source, size, target.cfg.vocab_size) if source is not None and has_map else None
    inherited = (source / VOCAB_MAP).read_text() if source is not None and has_map else None  # (checked readable)
    init_sha256 = None if source is None else sha256_file(weights_path(source))  # (before --out overwrites it)
    init_seen = {"seeds": 0, "lexicon": 0, "seed": 0} if source is None else prompts_seen(source)  # (... and its
    # provenance); prompts of two data seeds are two sets, which counts cannot name
    seen_seed = cfg.data.seed if init_seen["seeds"] == init_seen["lexicon"] == 0 else init_seen["seed"]
    if seen_seed != cfg.data.seed and cfg.data.num_prompts + cfg.lexicon_prompts > 0:
        seen_seed = None
    # (an EAGLE-3 head keeps its own draft ids whatever --draft-vocab says: its vocab_map's prefix is not them)
    kept = start.draft_ids.cpu() if start is not None and eagle3 else inherited_ids
    if kept is not None and (missing := sorted(set(forced) - set(kept.tolist()))):  # said, not refused (as above)
        log(
            f"note: the draft vocabulary kept from {source} lacks this target's special ids {missing}: the head can "
            "never propose them (the target still emits them); train without --init-head to draft them"
        )
    # the prompts the target answers, each fitting its answer in the target's positions: checked before any data (the
    # data step found a lexicon prompt too long after the other data, hours in)
    prompts = seed_prompts(cfg.data.num_prompts, cfg.data.seed) if cfg.data.num_prompts else []
    asks = lexicon_prompts(cfg.lexicon_prompts, cfg.data.seed, cfg.wordnet_dir) if cfg.lexicon_prompts else []
    check_answers_fit(tokenizer, prompts, cfg.data.max_new_tokens, target.max_positions, "max_new_tokens")
    check_answers_fit(tokenizer, asks, cfg.lexicon_max_new_tokens, target.max_positions, "lexicon_max_new_tokens")
    check_checkpoint(work_dir / "train", cfg.train, system_len=system_prefix_len(tokenizer))
    data_dir = work_dir / "data"
    samples: list[Sample] = []
    written = {"target": cfg.target_name, "seed": cfg.data.seed, "aux_layers": aux_layers}  # what a chunk depends on
    written["target_weights"] = weights_fingerprint(target)  # the name alone: a file replaced under it went unseen
    written["tokenizer"] = tokenizer_fingerprint(tokenizer)  # a new chat template under the same weights too
    written["python"] = platform.python_version()  # seed prompts and text passages read its stdlib's docs
    written["eos_ids"] = sorted(eos_ids_of(sorted(target.eos_token_ids), tokenizer))  # where greedy answers stop
    answered = written | {"max_new_tokens": cfg.data.max_new_tokens, "chunk_size": cfg.data.chunk_size}
    if cfg.data.num_prompts:
        claim_data_dir(data_dir, answered | {"prompts": "seed_prompts"})
        chunks = build_dataset(
            distill, tokenizer, data_dir, prompts, cfg.data, lambda d, n: log(f"data: {d}/{n} conversations")
        )
        samples += iter_samples(chunks, aux=eagle3)

    def teacher_forced(name: str, pairs: list[tuple[str, str]], settings: dict[str, Any]) -> list[Sample]:
        claim_data_dir(work_dir / name, written | {"chunk_size": TEXT_CHUNK} | settings)
        chunks = build_text_dataset(
            target,
            tokenizer,
            work_dir / name,
            pairs,
            TEXT_CHUNK,
            progress=lambda d, n: log(f"{name}: {d}/{n} passages"),
            aux_layers=aux_layers,
        )
        return list(iter_samples(chunks, aux=eagle3))

    texts = text_passages(cfg.text_passages, cfg.data.seed) if cfg.text_passages else []
    if len(texts) < cfg.text_passages:  # (this interpreter's stdlib holds so many documented names)
        log(f"note: --text-passages {cfg.text_passages}: the stdlib's docstrings give {len(texts)}; using those")
    if texts:
        samples += teacher_forced("text", texts, {"prompts": "text_passages"})
    corpus_record = lexicon_record = None
    if cfg.corpus_passages:
        files = corpus_files(list(cfg.corpus))
        digest = corpus_digest(files)
        pairs = corpus_passages(files, cfg.corpus_passages, cfg.data.seed, mt_bench_runs())
        samples += teacher_forced("corpus", pairs, {"prompts": "corpus", "corpus_sha256": digest})
        corpus_record = {"files": [str(f) for f in files], "sha256": digest, "passages": len(pairs)}
    if cfg.lexicon_prompts:
        lexicon_dir = work_dir / "lexicon"
        wordnet = hashlib.sha256(b"".join(sha256_file(f).encode() for f in check_wordnet(cfg.wordnet_dir)))
        lexicon = answered | {"max_new_tokens": cfg.lexicon_max_new_tokens, "wordnet_sha256": wordnet.hexdigest()}
        lexicon_record = {"wordnet_dir": str(cfg.wordnet_dir), "wordnet_sha256": wordnet.hexdigest()}
        claim_data_dir(lexicon_dir, lexicon | {"prompts": "lexicon_prompts"})
        chunks = build_dataset(
            distill,
            tokenizer,
            lexicon_dir,
            asks,
            replace(cfg.data, max_new_tokens=cfg.lexicon_max_new_tokens),
            lambda d, n: log(f"lexicon: {d}/{n} conversations"),
        )
        samples += list(iter_samples(chunks, aux=eagle3))
    num_self = 0
    if cfg.self_prompts:
        if ask is None:
            raise ValueError("self_prompts needs an ask function (the target sampling user requests)")
        banned = mt_bench_runs()

        def requests(n: int, seed: int) -> list[str]:
            # a request within ASK_MAX_TOKENS as written can take more in its chat turn: one whose answer would not
            # fit the target's positions is dropped (the data step had failed on it, after all the other data)
            written = self_prompts(tokenizer, ask, n, seed, banned)
            room = target.max_positions - cfg.data.max_new_tokens - 1
            return [r for r in written if len(chat_ids(tokenizer, r)) <= room]

        self_dir = work_dir / "self"
        claim_data_dir(self_dir, answered | {"prompts": "self_prompts", "filter": filter_record(banned)})
        chunks = build_self_dataset(
            distill,
            tokenizer,
            requests,
            self_dir,
            cfg.self_prompts,
            cfg.data,
            lambda d, n: log(f"self: {d}/{n} requests asked"),
        )
        self_samples = first_of_each_prompt(iter_samples(chunks, aux=eagle3))  # (chunks filter only their own)
        num_self = len(self_samples)
        samples += self_samples
    if not samples:
        raise SettingsError(NO_DATA)
    t_data = time.perf_counter() - t0
    counts = token_counts((s.tokens for s in samples), target.cfg.vocab_size)
    draft_ids = top_vocab(counts, size, forced) if inherited_ids is None else inherited_ids
    bar = _progress(log)
    head = train_head(
        target, samples, draft_ids, cfg.train, work_dir / "train", system_len=system_prefix_len(tokenizer), log=bar
    )
    draft_ids = head.draft_ids.cpu()  # an EAGLE-3 head fine-tuned keeps its own
    log(f"draft vocabulary: {draft_ids.numel()} tokens cover {coverage(counts, draft_ids):.2%} of the training tokens")
    t_train = time.perf_counter() - t0 - t_data
    sample = [round(v, 6) for v in embedding_sample(target.embed_tokens.weight).tolist()]
    digest_file = out_dir / DIGEST_FILE
    # a run into a head's folder that stops in the writes below must leave no digest naming the old weights (every
    # load of the folder then refused the new ones): the digest goes first, and comes back last, each file whole
    digest_file.unlink(missing_ok=True)
    (out_dir / PROVENANCE_FILE).unlink(missing_ok=True)  # ... nor a record of the old run beside the new weights
    weights = save_eagle_head(
        head, out_dir, extra_config={"specserve_target": cfg.target_name, TARGET_SAMPLE_KEY: sample}
    )
    if inherited is not None:
        write_durably(out_dir / VOCAB_MAP, lambda tmp: tmp.write_text(inherited))
    else:  # a fine-tuned EAGLE-3 head without a map (a published one) kept its ids: they lead the map, as d2t says
        write_vocab_map(out_dir, counts, forced, draft_ids.tolist() if start is not None and eagle3 else None)
    digest = sha256_file(weights)
    write_provenance(
        out_dir,
        {
            "target": cfg.target_name,
            "command": command,
            "data": {
                **asdict(cfg.data),
                "source": "specserve.train.seed_prompts (templates + Python stdlib docs), answered greedily by the "
                "target through its chat template; never MT-bench",
                "text_passages": len(texts),  # (the number asked for, where there were that many)
                "text_source": "specserve.train.seed_prompts.text_passages: Python standard-library docstrings as "
                "teacher-forced answers",
                "lexicon_prompts": cfg.lexicon_prompts,
                "lexicon_max_new_tokens": cfg.lexicon_max_new_tokens,
                "lexicon": lexicon_record,
                "lexicon_source": "specserve.train.lexicon_prompts: task templates filled with WordNet 3.0 nouns "
                "(Debian wordnet-base's files, the folder and digest in `lexicon`) seen in its tagged corpus, and "
                "their glosses; answered greedily; none sharing an 8-word run with MT-bench",
                "corpus": corpus_record,
                "corpus_source": "specserve.train.corpus: passages of the named plain-text files as teacher-forced "
                "answers to generic requests; none sharing an 8-word run with MT-bench",
                "self_prompts_asked": cfg.self_prompts,
                "self_prompts_kept": num_self,
                "self_source": "specserve.train.self_prompts: user requests the target sampled from its chat "
                "template's user header (Magpie; temperature 1, top-p 0.95, at most 128 tokens, finished ones kept, "
                "none sharing an 8-word run with MT-bench), answered greedily",
                "conversations": len(samples),
                "tokens": int(sum(len(s.tokens) for s in samples)),
            },
            "train": asdict(cfg.train),
            "steps": len(schedule(samples, cfg.train)),  # the optimiser steps trained (a resumed run's included)
            "draft_vocab": {"size": int(draft_ids.numel()), "coverage": coverage(counts, draft_ids)},
            # what it has trained on, its starting head's included: the agreement benchmark's held-out sets start
            # past them (a fine-tune's own counts alone put them inside its starting head's training prompts)
            "prompts_seen": {
                "seeds": max(cfg.data.num_prompts, init_seen["seeds"] or 0),
                "lexicon": max(cfg.lexicon_prompts, init_seen["lexicon"] or 0),
                "seed": seen_seed,
            },
            "init_head_sha256": init_sha256,
            "init_head_trained_for": None if start is None else start.trained_for,
            "seconds": {"data": round(t_data), "train": round(t_train)},
            "sha256": digest,
            "device": device_summary(target.device),
            "torch": torch.__version__,
            "python": platform.python_version(),  # the text passages come from this interpreter's stdlib
        },
    )
    beside = [out_dir / name for name in DIGESTED_BESIDE]  # (both written above)
    record = "".join(f"{d}  {f.name}\n" for d, f in [(digest, weights), *((sha256_file(f), f) for f in beside)])
    write_durably(digest_file, lambda tmp: tmp.write_text(record))
    return head


def _progress(log: Callable[[str], None]) -> Callable[[int, int, float, dict[str, float]], None]:
    t0 = time.perf_counter()
    resumed_at: list[int] = []  # the step this process started from (a resumed run's earlier steps took no time here)

    def bar(step: int, total: int, loss: float, stats: dict[str, float]) -> None:
        first = not resumed_at
        if first:
            resumed_at.append(step - 1)
        if first or step % 10 == 0 or step == total:
            rate = (time.perf_counter() - t0) / (step - resumed_at[0])
            acc = " ".join(f"{k}={v:.3f}" for k, v in stats.items() if k.startswith("acc"))
            eta = rate * (total - step)
            log(f"train: step {step}/{total} loss {loss:.4f} {acc} ({rate:.1f}s/step, {eta / 60:.0f} min left)")
            sys.stdout.flush()

    return bar


def check_answers_fit(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int, positions: int, name: str
) -> None:
    """The longest of ``prompts`` through the chat template, and an answer of ``max_new_tokens``, fit ``positions``
    (as ``generate_with_features`` needs them to)."""
    if not prompts:
        return
    longest = max(len(chat_ids(tokenizer, p)) for p in prompts)
    if (need := longest + max_new_tokens + 1) > positions:
        raise SettingsError(
            f"{name} {max_new_tokens}: the longest prompt ({longest} tokens) and its answer need {need} positions; "
            f"the target has {positions}"
        )


def request_seeds(chunk_seed: int, n: int) -> list[int]:
    """The draw seeds of a chunk's self-written requests: ``(chunk_seed << 12) + i`` read as a signed 64-bit integer
    (a request seed's range; the draws read a seed's 64 bits alike either way). A chunk's seed is ``--seed`` shifted
    by 20 bits, so seeds from 2^31 up overflowed 63 bits after all other data was made; a mask then dropped
    ``--seed``'s bit 31, and seeds 2^31 apart drew the same requests. Below 2^63, as for every seed under 2^31, a
    seed is its own."""
    seeds = [(chunk_seed << 12) + i for i in range(n)]
    assert all(0 <= s < 1 << 64 for s in seeds), "--seed below 2^32, a chunk's index below 2^20, n at most 4096"
    return [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]


MAX_SELF_PROMPTS = 1 << 20  # a chunk's index stays below 2^20 at any --batch-size (``request_seeds``)


def _self_prompts(text: str) -> int:
    value = non_negative_int(text)
    if value > MAX_SELF_PROMPTS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SELF_PROMPTS}, not {value}")
    return value


def _seed(text: str) -> int:
    """``--seed``: 0 to 2^32 - 1 (the trainer derives per-step torch seeds from it, which must stay in 64 bits)."""
    value = non_negative_int(text)
    if value >= 1 << 32:
        raise argparse.ArgumentTypeError(f"must be below 2^32, got {text}")
    return value


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="the target: built-in name, HF dir or .gguf")
    p.add_argument(
        "--out", type=out_dir_arg, required=True, help="directory for the head (model.safetensors, config.json)"
    )
    p.add_argument("--work-dir", type=out_dir_arg, default=None, help="data and checkpoints (default: OUT/work)")
    p.add_argument("--prompts", type=non_negative_int, default=None, help="self-distillation prompts (default 2048)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None)
    p.add_argument("--epochs", type=positive_int, default=None)
    p.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=None,
        help=f"reduced draft vocabulary size (default {DRAFT_VOCAB}, {QUICK_DRAFT_VOCAB} with --quick; with "
        "--init-head the starting head's)",
    )
    p.add_argument("--text-passages", type=non_negative_int, default=0, help="teacher-forced stdlib docstrings to add")
    p.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        default=(),
        help="plain-text files or directories (.gz/.dz read too) for teacher-forced passages",
    )
    p.add_argument(
        "--corpus-passages", type=non_negative_int, default=None, help="passages drawn from --corpus (default 2048)"
    )
    p.add_argument(
        "--self-prompts",
        type=_self_prompts,
        default=0,
        help=f"user requests the target writes itself to ask (at most {MAX_SELF_PROMPTS})",
    )
    p.add_argument(
        "--lexicon-prompts",
        type=non_negative_int,
        default=0,
        help="task templates over WordNet's nouns (needs wordnet-base)",
    )
    p.add_argument("--lexicon-max-new-tokens", type=positive_int, default=128)
    p.add_argument("--wordnet-dir", type=Path, default=WORDNET_DIR, help="WordNet's dict files (data.noun, ...)")
    p.add_argument(
        "--kind",
        choices=[k.value for k in HeadKind],
        default=HeadKind.eagle.value,
        help="eagle: EAGLE-1/2 over the last hidden state; eagle3: fused low/mid/high layer features, own LM head",
    )
    p.add_argument(
        "--init-head",
        default=None,
        help="fine-tune this head (shipped name or directory) instead of starting from scratch; keeps its vocabulary "
        "and its size (an EAGLE-1/2 head without a vocab_map.json takes the new data's top --draft-vocab ids)",
    )
    p.add_argument(
        "--lr", type=positive_float, default=None, help="peak learning rate (default 6e-4; lower to fine-tune)"
    )
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument(
        "--batch-size",
        type=batch_size,  # the self-prompt step runs them in one loop
        default=None,
        help=f"conversations generated together (default {DEFAULT_BATCH}); if given, also per data chunk",
    )
    p.add_argument(
        "--device",
        default="cpu",
        type=present_device_arg,
        help="where the target answers and the head trains, e.g. cuda",
    )
    p.add_argument("--quick", action="store_true", help="a few prompts and steps: seconds, for tests")


def run(args: argparse.Namespace) -> int:
    from specserve.build import eos_ids_of
    from specserve.config import HeadSpec, ModelSpec
    from specserve.engine import Engine
    from specserve.models.loader import load_model, load_tokenizer
    from specserve.sampling import SamplingParams
    from specserve.sequence import FinishReason

    cfg = TrainDraftConfig.quick_mode(args.model) if args.quick else TrainDraftConfig(args.model)
    data: dict[str, Any] = {"seed": args.seed}
    if args.batch_size is not None:
        data["chunk_size"] = args.batch_size  # one chunk file per generating batch
    batch_size = args.batch_size or DEFAULT_BATCH
    if args.prompts is not None:
        data["num_prompts"] = args.prompts
    if args.max_new_tokens is not None:
        data["max_new_tokens"] = args.max_new_tokens
    train = {"seed": args.seed, "kind": HeadKind(args.kind)}
    if args.epochs is not None:
        train["epochs"] = args.epochs
    if args.lr is not None:
        train["lr"] = args.lr
    if args.init_head is not None:
        train["init_head"] = HeadSpec(head=args.init_head).path().resolve()
    cfg = replace(
        cfg,
        data=replace(cfg.data, **data),
        train=replace(cfg.train, **train),
        draft_vocab=args.draft_vocab or cfg.draft_vocab,
        text_passages=args.text_passages,
        self_prompts=args.self_prompts,
        lexicon_prompts=args.lexicon_prompts,
        lexicon_max_new_tokens=args.lexicon_max_new_tokens,
        wordnet_dir=args.wordnet_dir,
        corpus=tuple(args.corpus),
        corpus_passages=(DEFAULT_CORPUS_PASSAGES if args.corpus else 0)
        if args.corpus_passages is None
        else args.corpus_passages,
    )
    if cfg.corpus_passages:  # a missing, unreadable or non-UTF-8 file, or one without passages, fails now, not
        # after the other data (hours in)
        files = corpus_files(list(cfg.corpus))
        found = len(corpus_passages(files, cfg.corpus_passages, cfg.data.seed, mt_bench_runs()))
        where = ", ".join(map(str, cfg.corpus))
        if not found:
            raise CorpusError(f"--corpus {where}: no passage of 300-2000 characters (paragraphs) to train on")
        if found < cfg.corpus_passages:
            print(f"--corpus {where}: {found} passages, not the {cfg.corpus_passages} asked for", file=sys.stderr)
    if cfg.lexicon_prompts and not load_nouns(cfg.wordnet_dir):  # missing or corrupt: found after hours otherwise
        raise SettingsError(f"no noun in {cfg.wordnet_dir} is common enough to fill the lexicon prompts")
    spec = ModelSpec(source=args.model, gemv_copies=False)
    tokenizer = load_tokenizer(spec)
    check_chat_template(tokenizer, cfg.self_prompts > 0)  # before the target loads
    target = load_model(spec, device=args.device)
    for p in target.parameters():
        p.requires_grad_(False)
    distill = greedy_distiller(target, eos_ids_of(sorted(target.eos_token_ids), tokenizer), batch_size)

    @functools.cache
    def asking_engine() -> Engine:  # built on the first request asked: its KV cache is sized for the whole batch
        return Engine(target, tokenizer, max_batch_size=batch_size, max_model_len=1024)

    def ask(prefix: list[int], n: int, seed: int) -> list[list[int] | None]:
        sample = SamplingParams(max_tokens=ASK_MAX_TOKENS, temperature=1.0, top_p=0.95)
        params = [sample.model_copy(update={"seed": s}) for s in request_seeds(seed, n)]
        done = asking_engine().generate([prefix] * n, params)
        return [c.token_ids if c.finish_reason is FinishReason.stop else None for c in done]

    command = shlex.join(args.command_line)  # (one a shell runs again: a path with a space stays one argument)
    work = args.work_dir or args.out / "work"
    train_draft(target, tokenizer, distill, cfg, work, args.out, ask=ask, command=command)
    print(f"wrote {args.out}")
    return 0
