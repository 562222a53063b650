"""Train an EAGLE head (EAGLE-1/2, or EAGLE-3 over fused features) on self-distilled features
(docs/algorithms.md §8.3).

Loss per unrolled step k = 0..K-1 (training-time test, as EAGLE-3 / HASS): the head's prediction at pair j
(token j+1, feature j) is scored against the target's next-token distribution p_{j+1} (soft cross-entropy
over the draft vocabulary, renormalised there) and against the target's feature f_{j+1} (smooth L1). Step 0
feeds the target's features; step k feeds, at pair j, the head's own output of step k-1 at pair j-1, and
attends to the true pairs up to j-k plus its own chain of earlier unrolled pairs: exactly what a node at
depth k sees when the tree is drafted.

An EAGLE-3 head takes ``fc`` over the target's aux-layer features at step 0 and its own outputs (which skip
``fc``) after; its outputs live in its own space, so it is scored by the cross-entropy alone, through its own
norm and LM head (initialised from the target's final norm and LM-head rows of the draft vocabulary).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import pickle
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specserve.durable import drop_leftovers, write_durably
from specserve.errors import CorruptModelError, SettingsError, TrainingDivergedError
from specserve.models.llama import LlamaModel, apply_rope, rms_norm
from specserve.models.sources import sha256_file
from specserve.spec_decode.eagle_head import EagleHead, EagleHeadConfig, HeadKind, dense_weight
from specserve.spec_decode.head_checkpoint import load_eagle_head, weights_path
from specserve.train.distill import Sample
from specserve.train.vocab import column_of


@dataclass(frozen=True)
class TrainConfig:
    kind: HeadKind = HeadKind.eagle
    epochs: int = 4
    batch_tokens: int = 2048  # padded tokens per optimiser step
    max_len: int = 640  # conversations are cut to this many tokens
    lr: float = 6e-4
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    unroll: int = 3  # K training-time-test steps
    unroll_decay: float = 0.8  # weight of step k: decay**k
    feature_weight: float = 0.2  # smooth-L1 feature loss next to the soft cross-entropy (EAGLE-1/2 only)
    prompt_weight: float = 0.3  # loss weight of rows that predict prompt tokens (answers weigh 1)
    noise: float = 0.0  # uniform noise on the true input features (EAGLE's augmentation), as a share of their std
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers whose inputs the head fuses
    seed: int = 0
    init_from_last_layer: bool = False  # start the decoder layer from the target's last layer (measured: worse)
    init_head: Path | None = None  # fine-tune: start from this head (same kind, target and features; its vocabulary)
    checkpoint_every: int = 50


def ttt_mask(n: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, (k+1)n] bool: row j of unroll step k sees true pairs 0..j-k and pair j-(k-m) of each step m=1..k."""
    j = torch.arange(n, device=device)
    blocks = [j[None, :] <= (j[:, None] - k)]  # true pairs, causal shifted by k
    for m in range(1, k + 1):
        blocks.append(j[None, :] == (j[:, None] - (k - m)))
    return torch.cat(blocks, dim=1)


def ttt_loss(
    head: EagleHead,
    tokens: torch.Tensor,  # [B, n] long
    feats: torch.Tensor,  # [B, n, H] float32: the target's final features
    weight: torch.Tensor,  # [B, n] float: loss weight of the row predicting token j+2 (0 = none)
    lm_w: torch.Tensor,  # [V_d, H] the target's LM head rows of the draft vocabulary
    cfg: TrainConfig,
    gen: torch.Generator | None = None,
    aux: torch.Tensor | None = None,  # [B, n, A*H] float32: EAGLE-3's aux-layer features
) -> tuple[torch.Tensor, dict[str, float]]:
    eagle3 = head.cfg.kind == HeadKind.eagle3
    if eagle3 and aux is None:
        raise ValueError("an EAGLE-3 head trains on aux-layer features: pass aux")
    tok_in, f_next = tokens[:, 1:], feats[:, 1:]  # pairs j = 0..n-2
    f_true = aux[:, :-1] if eagle3 and aux is not None else feats[:, :-1]
    w = weight[:, :-1]
    b, n, _ = f_true.shape
    layer, hcfg = head.layer, head.cfg
    device = tokens.device
    with torch.no_grad():
        p_next = torch.softmax(f_next @ lm_w.t(), dim=-1)  # [B, n, V_d] target distribution of token j+2
    pos = torch.arange(n, device=device)
    cos, sin = head.rope_cos[pos][:, None], head.rope_sin[pos][:, None]  # [n, 1, D]
    feat_in = f_true
    if cfg.noise > 0:
        scale = cfg.noise * f_true.std()
        u = torch.rand(f_true.shape, generator=gen).to(device)  # drawn on the host: the same noise on any device
        feat_in = f_true + (u * 2 - 1) * scale
    if eagle3:
        feat_in = head.fc(feat_in)  # [B, n, H]: fused into the head's space (its own outputs skip fc)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = torch.zeros((), device=device)
    stats: dict[str, float] = {}
    for k in range(cfg.unroll):
        a, residual = head.layer_input(tok_in, feat_in)  # [B, n, in], [B, n, H]
        q, kk, v = layer.qkv_split(a.reshape(b * n, -1))
        q = apply_rope(q.view(b, n, hcfg.num_heads, -1), cos, sin)
        kk = apply_rope(kk.view(b, n, hcfg.num_kv_heads, -1), cos, sin)
        keys.append(kk)
        values.append(v.view(b, n, hcfg.num_kv_heads, -1))
        mask = ttt_mask(n, k, device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            torch.cat(keys, dim=1).transpose(1, 2),
            torch.cat(values, dim=1).transpose(1, 2),
            attn_mask=mask,
            enable_gqa=True,
        )  # [B, heads, n, D]
        h = layer.finish(residual, out.transpose(1, 2).reshape(b, n, -1))  # [B, n, H]
        if eagle3:
            logq = torch.log_softmax(head.lm_head(rms_norm(h, head.norm, hcfg.rms_norm_eps)), dim=-1)
        else:
            logq = torch.log_softmax(h @ lm_w.t(), dim=-1)
        wk = w * (pos >= k).to(w.dtype)  # pair j of step k needs a root at j-k >= 0
        denom = wk.sum().clamp_min(1e-6)
        ce = -(p_next * logq).sum(-1)
        if eagle3:
            loss_k = (ce * wk).sum() / denom
        else:
            reg = F.smooth_l1_loss(h, f_next, reduction="none").mean(-1)
            loss_k = ((ce + cfg.feature_weight * reg) * wk).sum() / denom
        total = total + cfg.unroll_decay**k * loss_k
        with torch.no_grad():
            hit = (logq.argmax(-1) == p_next.argmax(-1)).to(w.dtype)
            stats[f"acc{k}"] = float((hit * (wk > 0)).sum() / (wk > 0).sum().clamp_min(1))
            stats[f"ce{k}"] = float((ce * wk).sum() / denom)
        feat_in = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)  # step k+1 feeds pair j with h_{j-1}
    return total, stats


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, n] long
    feats: torch.Tensor  # [B, n, H] float32
    weight: torch.Tensor  # [B, n] loss weight of the row predicting token j+2
    aux: torch.Tensor | None = None  # [B, n, A*H] float32 (EAGLE-3)

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        aux = None if self.aux is None else move(self.aux)
        return Batch(move(self.tokens), move(self.feats), move(self.weight), aux)


def batch_groups(samples: list[Sample], cfg: TrainConfig, rng: random.Random) -> list[list[int]]:
    """Length-bucketed groups of about ``batch_tokens`` padded tokens, in a seeded random order."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].tokens), i))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = min(len(samples[i].tokens), cfg.max_len)
        if cur and (len(cur) + 1) * n > cfg.batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


TRAINED_ON = {  # what a checkpoint records of its run, and how a change is named
    "data": "on other data",
    "draft_ids": "on other draft vocabulary ids",
    "init_head_sha256": "from another starting head (--init-head) than the one now there",
    "system_len": "with another chat template (its system prefix, where no loss is taken, differs)",
}


def make_batch(samples: list[Sample], group: list[int], cfg: TrainConfig, system_len: int) -> Batch:
    n = max(min(len(samples[i].tokens), cfg.max_len) for i in group)
    hidden = samples[group[0]].features.shape[1]
    tokens = torch.zeros(len(group), n, dtype=torch.long)
    feats = torch.zeros(len(group), n, hidden)
    weight = torch.zeros(len(group), n)
    first_aux = samples[group[0]].aux
    aux = None if first_aux is None else torch.zeros(len(group), n, first_aux.shape[1])
    for r, i in enumerate(group):
        s = samples[i]
        m = min(len(s.tokens), cfg.max_len)
        tokens[r, :m] = s.tokens[:m]
        feats[r, :m] = s.features[:m].float()
        if aux is not None:
            if s.aux is None:
                raise ValueError("a sample without aux features among EAGLE-3 data")
            aux[r, :m] = s.aux[:m].float()
        target = torch.arange(m) + 2  # row j predicts token j+2
        wrow = torch.where(target >= s.prompt_len, 1.0, cfg.prompt_weight)
        weight[r, :m] = torch.where((target >= system_len) & (target < m), wrow, 0.0)
    return Batch(tokens, feats, weight, aux)


def init_head(target: LlamaModel, draft_ids: torch.Tensor, cfg: TrainConfig) -> EagleHead:
    torch.manual_seed(cfg.seed)
    if cfg.init_head is not None:
        head = starting_head(target, cfg)
        if cfg.kind == HeadKind.eagle:  # an EAGLE-3 head keeps the vocabulary its LM head was trained on
            head.set_draft_vocab(draft_ids)
        return head
    if cfg.kind == HeadKind.eagle3:
        return _init_eagle3(target, draft_ids, cfg)
    # a copy of the target's last layer has its attention biases (an MLP bias the head has no place for)
    biases = {"qkv_bias": target.cfg.qkv_bias, "o_bias": target.cfg.o_bias} if cfg.init_from_last_layer else {}
    head = EagleHead(EagleHeadConfig.for_target(target, fc_bias=True, **biases), target=None)
    with torch.no_grad():
        head.fc.weight.normal_(0.0, 0.02)  # EAGLE's initialisation: small logits, no head start
        head.fc.bias.zero_()
        for lin in (head.layer.qkv, head.layer.o_proj, head.layer.gate_up, head.layer.down):
            lin.weight.normal_(0.0, 0.02)
        if cfg.init_from_last_layer:
            last = target.decoder_layers()[-1]
            for mine, theirs in ((head.layer.qkv, last.qkv), (head.layer.o_proj, last.o_proj)):
                mine.weight.copy_(theirs.weight)
                if theirs.bias is not None:
                    mine.bias.copy_(theirs.bias)
            head.layer.post_norm.copy_(last.post_norm)
            head.layer.gate_up.weight.copy_(last.gate_up.weight)
            head.layer.down.weight.copy_(last.down.weight)
    head.bind(target)
    head.set_draft_vocab(draft_ids)
    return head


def starting_head(target: LlamaModel, cfg: TrainConfig) -> EagleHead:
    """The trained head ``cfg.init_head`` to fine-tune, in float32, checked against the run's kind and fused layers."""
    if cfg.init_head is None:
        raise ValueError("no head to start from (TrainConfig.init_head)")
    head = load_eagle_head(cfg.init_head, target, dtype=torch.float32, check_target=False)
    check_starting_head(head, cfg)
    return head.requires_grad_(True)


def check_starting_head(head: EagleHead, cfg: TrainConfig) -> None:
    if head.cfg.kind != cfg.kind:
        raise SettingsError(f"{cfg.init_head} holds an {head.cfg.kind.value} head; training asks for {cfg.kind.value}")
    if cfg.kind == HeadKind.eagle3 and tuple(head.cfg.aux_layers) != tuple(cfg.aux_layers):
        raise SettingsError(
            f"{cfg.init_head} fuses target layers {list(head.cfg.aux_layers)}; "
            f"the training data has {list(cfg.aux_layers)}"
        )


def _init_eagle3(target: LlamaModel, draft_ids: torch.Tensor, cfg: TrainConfig) -> EagleHead:
    if not cfg.aux_layers:
        raise ValueError("an EAGLE-3 head needs the target layers it fuses (TrainConfig.aux_layers)")
    hcfg = EagleHeadConfig.for_target(
        target, kind=HeadKind.eagle3, aux_layers=tuple(cfg.aux_layers), draft_vocab_size=int(draft_ids.numel())
    )
    head = EagleHead(hcfg, target=None)
    h = hcfg.hidden_size
    with torch.no_grad():
        for lin in (head.layer.qkv, head.layer.o_proj, head.layer.gate_up, head.layer.down):
            lin.weight.normal_(0.0, 0.02)
        # fc starts as the highest aux layer's residual stream (its other inputs at zero) and the output goes
        # through the target's own final norm and LM-head rows: sane logits from step 0, not noise at scale
        head.fc.weight.zero_()
        head.fc.weight[:, -h:].copy_(torch.eye(h))
        head.norm.copy_(target.norm.detach().float())
        head.lm_head.weight.copy_(dense_weight(target.lm_head).float()[draft_ids])
    head.draft_ids = draft_ids.to(torch.long)
    head.bind(target)
    return head


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


LogFn = Callable[[int, int, float, dict[str, float]], None]  # step, total, loss, stats


def schedule(samples: list[Sample], cfg: TrainConfig) -> list[list[int]]:
    """The optimiser steps' sample groups, every epoch's, in order: a function of the data and the settings alone."""
    return [g for e in range(cfg.epochs) for g in batch_groups(samples, cfg, random.Random(cfg.seed * 1000 + e))]


def train_head(
    target: LlamaModel,
    samples: list[Sample],
    draft_ids: torch.Tensor,
    cfg: TrainConfig,
    work_dir: Path,
    *,
    system_len: int,
    log: LogFn | None = None,
    max_steps: int | None = None,
) -> EagleHead:
    """Train (or resume from ``work_dir/ckpt.pt``) and return the head in float32, on the target's device (the
    batches are built on the host and moved there; a GPU trains the same steps as the CPU, rounded differently)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    drop_leftovers(work_dir)  # a checkpoint's write killed midway
    device = target.device
    head = init_head(target, draft_ids, cfg).to(device)
    params = [p for n, p in head.named_parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    lm_w = dense_weight(target.lm_head).float()[head.draft_ids].contiguous()  # [V_d, H] the target's rows
    plan = schedule(samples, cfg)
    total = len(plan)  # the schedule's length; max_steps only stops early (a later call resumes)
    stop = total if max_steps is None else min(total, max_steps)
    step = 0
    ckpt = work_dir / "ckpt.pt"
    trained_on: dict[str, object] = {"data": data_fingerprint(samples), "draft_ids": head.draft_ids.tolist()}
    trained_on |= _known_before_data(cfg, system_len)
    if ckpt.exists():
        state = _resumable(ckpt, cfg, trained_on, device)
        try:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
        except (RuntimeError, ValueError) as e:  # another head's tensors (written by an older version, say)
            raise SettingsError(f"{ckpt} holds another head's tensors than these settings make ({e}); remove it") from e
        step = state["step"]

    def save_checkpoint(step: int) -> None:
        state = {"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "config": config_record(cfg)}
        write_durably(ckpt, functools.partial(torch.save, state | trained_on))

    head.train()
    while step < stop:
        batch = make_batch(samples, plan[step], cfg, system_len).to(device)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # resumes bit for bit
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, cfg)
        loss, stats = ttt_loss(head, batch.tokens, batch.feats, batch.weight, lm_w, cfg, gen, batch.aux)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        loss_value, norm_value = torch.stack([loss.detach(), grad_norm]).tolist()  # host sync: one per step
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):  # AdamW would write it into every weight
            problem = (
                f"step {step + 1} of {total}: the loss is {loss_value} and the gradient norm {norm_value} "
                f"(samples {plan[step]} of the data): the step was not applied"
            )
            try:
                save_checkpoint(step)  # the weights and the optimiser as the step before left them
            except OSError as e:
                raise TrainingDivergedError(f"{problem}; writing {ckpt} failed: {e}") from e
            raise TrainingDivergedError(f"{problem}; {ckpt} holds the head as of step {step}")
        opt.step()
        step += 1
        if log is not None:
            log(step, total, loss_value, stats)
        if step % cfg.checkpoint_every == 0 or step == stop:
            save_checkpoint(step)
    head.eval()
    return head


def _resumable(
    ckpt: Path, cfg: TrainConfig, trained_on: dict[str, object], device: torch.device | str, *, mmap: bool = False
) -> Any:
    """The checkpoint's state, where it was written with ``cfg`` and on ``trained_on`` (a SettingsError naming what
    differs where not). ``mmap``: its tensors stay in the file until read (a check that reads only the records)."""
    try:  # tensors and plain values only: unpickling anything else could run code from the file
        state = torch.load(ckpt, weights_only=True, map_location=device, mmap=mmap)
    except pickle.UnpicklingError as e:
        what = "holds more than tensors and plain values (an older version's?)"
        raise SettingsError(f"{ckpt} {what}: remove it") from e
    if state["config"] != config_record(cfg):
        raise SettingsError(f"{ckpt} was written with other settings; remove it or use the same ones")
    for key, now in trained_on.items():
        if state.get(key) != now:
            raise SettingsError(f"{ckpt} was trained {TRAINED_ON[key]}; remove it or rebuild the same data")
    return state


def check_checkpoint(work_dir: Path, cfg: TrainConfig, *, system_len: int) -> None:
    """Before any data is made: a checkpoint in ``work_dir`` (a finished run's stays there) that ``train_head``
    would refuse for its settings, its chat template's system prefix or its starting head is refused now, not
    after the data step (hours). Whether it was trained on the data this run makes is known only after it."""
    ckpt = work_dir / "ckpt.pt"
    if ckpt.exists():  # (mapped: the head and its optimiser's state are not read)
        _resumable(ckpt, cfg, _known_before_data(cfg, system_len), "cpu", mmap=True)


def _known_before_data(cfg: TrainConfig, system_len: int) -> dict[str, object]:
    """What a checkpoint records it was trained on that is known before the data step: the chat template's system
    prefix and the starting head's digest (the path alone would not tell a head trained again there since)."""
    known: dict[str, object] = {"system_len": system_len}
    if cfg.init_head is not None:
        known["init_head_sha256"] = sha256_file(weights_path(cfg.init_head))
    return known


def config_record(cfg: TrainConfig) -> dict[str, object]:
    """The settings as plain values (a path and an enum as strings, tuples as lists): what a checkpoint records."""
    return json.loads(json.dumps(asdict(cfg), default=str))  # type: ignore[no-any-return]


def data_fingerprint(samples: list[Sample]) -> str:
    """sha256 over the samples' tokens, prompt lengths and the first and last rows of their features, in order:
    what a resumed run must train on again. (Tokens alone did not tell another target's data: teacher-forced text
    is the same tokens whatever the target, and a checkpoint trained for one target resumed for another.)"""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.prompt_len.to_bytes(8, "little"))
        h.update(s.tokens.to(torch.int64).numpy().tobytes())
        for rows in (s.features, s.aux):
            if rows is not None and len(rows):
                h.update(rows[[0, -1]].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


PROVENANCE_FILE = "provenance.json"


def write_provenance(out: Path, info: dict[str, object]) -> None:
    info = {"written": time.strftime("%Y-%m-%d %H:%M:%S"), **info}
    text = json.dumps(info, indent=1, default=str) + "\n"
    write_durably(out / PROVENANCE_FILE, lambda tmp: tmp.write_text(text))


def prompts_seen(head_dir: Path) -> dict[str, int | None]:
    """How many of the seed and lexicon prompts (each set's first n of the data seed ``seed``) a head trained on, its
    starting heads' included, from its provenance.json ({"seeds": 0, "lexicon": 0, "seed": 0} for a head without one,
    a published head). ``seed`` is None where a fine-tune drew its prompts with another seed than its starting head:
    which prompts those were is not on record."""
    record = _provenance(head_dir)
    if record is None:
        return {"seeds": 0, "lexicon": 0, "seed": 0}
    provenance = head_dir / PROVENANCE_FILE
    try:  # (a train-draft run cut off while writing it, or a file of another kind)
        seen = record.get("prompts_seen")  # (recorded since fine-tunes carry their starting head's counts)
        data = record.get("data", {})
        if seen is None:
            seen = {"seeds": data.get("num_prompts"), "lexicon": data.get("lexicon_prompts")}
        seed = seen.get("seed", data.get("seed", 0))  # (recorded since; earlier records' data seed)
        return {
            "seeds": int(seen.get("seeds") or 0),
            "lexicon": int(seen.get("lexicon") or 0),
            "seed": None if seed is None else int(seed),
        }
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, TypeError) as e:
        raise CorruptModelError(f"{provenance}: not a provenance record of train-draft ({e})") from None


def _provenance(head_dir: Path) -> dict[str, Any] | None:
    """A head's provenance.json (None: a head without one, a published head)."""
    provenance = head_dir / PROVENANCE_FILE
    if not provenance.exists():
        return None
    try:
        record = json.loads(provenance.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptModelError(f"{provenance}: not a provenance record of train-draft ({e})") from None
    if not isinstance(record, dict):
        raise CorruptModelError(f"{provenance}: not a provenance record of train-draft (a {type(record).__name__})")
    return record


def trained_vocab_size(head_dir: Path) -> int | None:
    """The draft vocabulary size a head was trained with, from its provenance.json (None: a head without one)."""
    record = _provenance(head_dir)
    if record is None:
        return None
    provenance = head_dir / PROVENANCE_FILE
    try:
        size = record["draft_vocab"]["size"]
    except (KeyError, TypeError) as e:
        raise CorruptModelError(f"{provenance}: not a provenance record of train-draft ({e!r})") from None
    if type(size) is not int or size < 1:
        raise CorruptModelError(f"{provenance}: draft_vocab.size must be a positive integer, not {size!r}")
    return size


__all__ = [
    "TrainConfig",
    "column_of",
    "prompts_seen",
    "train_head",
    "trained_vocab_size",
    "ttt_loss",
    "ttt_mask",
    "write_provenance",
]
