"""Draft-head training: the training-time-test mask, vocabulary selection, determinism and resume, the seed
prompts' and self-written requests' independence from the evaluation set, and `specserve train-draft --quick`
end to end."""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import shutil
import subprocess
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.errors import (
    CorruptModelError,
    InvalidRequestError,
    SettingsError,
    TrainingDivergedError,
    UnsupportedModelError,
)
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_config, tiny_model
from specserve.spec_decode.eagle_head import HeadKind, dense_weight
from specserve.spec_decode.head_checkpoint import load_eagle_head, save_eagle_head
from specserve.train import trainer as trainer_module
from specserve.train.distill import (
    Conversation,
    Sample,
    generate_with_features,
    greedy_distiller,
    iter_samples,
    stored_features,
    target_features,
)
from specserve.train.lexicon_prompts import WORDNET_DIR, WordNetMissing, lexicon_prompts, load_nouns
from specserve.train.seed_prompts import seed_prompts, text_passages
from specserve.train.self_prompts import BannedRuns, keep_requests, mt_bench_runs, self_prompts, user_turn_prefix
from specserve.train.trainer import TrainConfig, init_head, starting_head, train_head, ttt_loss, ttt_mask
from specserve.train.vocab import column_of, coverage, token_counts, top_vocab


def test_ttt_mask_matches_what_a_tree_node_sees() -> None:
    n = 6
    # step 0: plain causal over the true pairs
    assert torch.equal(ttt_mask(n, 0), torch.ones(n, n, dtype=torch.bool).tril())
    m = ttt_mask(n, 2)  # depth-2 node at pair j: true pairs <= j-2, its parent (step 1, pair j-1), itself (step 2, j)
    j = 4
    assert m[j, :n].nonzero().flatten().tolist() == [0, 1, 2]
    assert m[j, n : 2 * n].nonzero().flatten().tolist() == [3]
    assert m[j, 2 * n :].nonzero().flatten().tolist() == [4]
    assert m.shape == (n, 3 * n)


def test_top_vocab_forces_specials_and_orders_by_frequency() -> None:
    counts = token_counts([torch.tensor([5, 5, 5, 3, 3, 9, 1]), torch.tensor([3, 7])], vocab_size=12)
    assert counts[3] == 3 and counts[5] == 3 and counts[11] == 0
    ids = top_vocab(counts, 3, forced=[11])
    assert ids.tolist() == [3, 5, 11]  # 3 and 5 most frequent (tie: lower id first), 11 forced
    assert coverage(counts, ids) == pytest.approx(6 / 9)
    col = column_of(ids, 12)
    assert col[5] == 1 and col[4] == -1
    with pytest.raises(ValueError):
        top_vocab(counts, 1, forced=[0, 1])


def test_the_data_step_records_its_targets_weights_not_only_its_name() -> None:
    from specserve.models.tiny import tiny_model
    from specserve.train.pipeline import weights_fingerprint

    model = tiny_model(seed=0)
    same = weights_fingerprint(model)
    assert weights_fingerprint(tiny_model(seed=0)) == same and weights_fingerprint(tiny_model(seed=1)) != same
    with torch.no_grad():  # one projection changed, the rest untouched
        next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).weight.mul_(1.01)
    assert weights_fingerprint(model) != same


def test_a_request_written_again_in_another_chunk_is_trained_on_once() -> None:
    from specserve.train.pipeline import first_of_each_prompt

    def sample(prompt: list[int], answer: list[int]) -> Sample:
        tokens = torch.tensor(prompt + answer)
        return Sample(tokens, torch.zeros(len(tokens), 4, dtype=torch.float16), len(prompt))

    chunk_0 = [sample([1, 2], [5]), sample([1, 3], [6])]
    chunk_1 = [sample([1, 2], [7, 8]), sample([1], [2, 3]), sample([1, 3, 4], [6])]  # [1, 2] asked again
    kept = first_of_each_prompt(chunk_0 + chunk_1)
    assert [s.tokens.tolist() for s in kept] == [[1, 2, 5], [1, 3, 6], [1, 2, 3], [1, 3, 4, 6]]


def test_a_vocabulary_map_led_by_a_heads_own_ids_keeps_them_by_frequency(tmp_path: Path) -> None:
    """The head's ids were written as forced ids, which sort by id, not by count; and a forced id outside them
    (an EOS the published head's d2t lacks) went ahead of some of them."""
    from specserve.train.pipeline import write_vocab_map

    counts = torch.tensor([0, 1, 50, 3, 40, 7, 0, 9, 100, 2])
    write_vocab_map(tmp_path, counts, forced=[0, 6], lead=[0, 2, 4, 7, 8])  # 6: forced, not the head's
    order = json.loads((tmp_path / "vocab_map.json").read_text())["by_frequency"]
    assert order[:5] == [0, 8, 2, 4, 7]  # forced first, then by falling count
    assert order[5:] == [6, 5, 3, 9, 1]  # 0-count id 6 kept: it is forced
    write_vocab_map(tmp_path, counts, forced=[0, 6])
    assert json.loads((tmp_path / "vocab_map.json").read_text())["by_frequency"][:4] == [0, 6, 8, 2]


def test_every_id_generation_stops_at_is_forced_into_the_draft_vocabulary() -> None:
    """A Llama-3-style config stops at three EOS ids while its tokenizer names one: the other two fell out of a
    draft vocabulary picked from the training counts, where the head could never propose them."""
    from types import SimpleNamespace

    from specserve.train.pipeline import special_ids

    tokenizer = SimpleNamespace(all_special_ids=[0, 1, 9], eos_token_id=9)
    assert special_ids(tokenizer, [7, 8, 9]) == [0, 1, 7, 8, 9]  # type: ignore[arg-type]
    assert special_ids(tokenizer, 9) == [0, 1, 9]  # type: ignore[arg-type]
    assert special_ids(None, 4) == [4]


def _samples(n: int, seed: int, hidden: int, aux_width: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 20 + 3 * i
        tokens, feats = torch.randint(0, 512, (length,), generator=g), torch.randn(length, hidden, generator=g)
        aux = torch.randn(length, aux_width, generator=g) if aux_width else None
        out.append(Sample(tokens, feats, 6, aux))
    return out


def _frozen_target() -> LlamaModel:
    target = tiny_model(seed=0)
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def _ttt_config(kind: HeadKind, **kw: object) -> TrainConfig:
    return TrainConfig(kind=kind, aux_layers=(0, 1) if kind == HeadKind.eagle3 else (), **kw)  # type: ignore[arg-type]


def _greedy_by_recompute(model: LlamaModel, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Reference: every token from a fresh forward over the whole sequence so far (no KV cache reuse, no batch)."""
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new and (len(seq) == len(prompt) or seq[-1] not in eos):
        cache = model.new_cache(1, len(seq))
        batch = ForwardBatch.build(cache, [cache.allocate()], [seq], num_logits=[1])
        seq.append(int(model(batch, cache)[-1].argmax()))
    return seq[len(prompt) :]


def test_generating_with_features_gives_greedy_answers_and_the_prefills_features() -> None:
    model = tiny_model(seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 2, 7)]
    free = [_greedy_by_recompute(model, p, 12, set()) for p in prompts]
    eos = {free[1][3]}  # the second prompt's answer stops at its 4th token; others may stop at it too, or run to 12
    expected = [_greedy_by_recompute(model, p, 12, eos) for p in prompts]
    assert len(expected[1]) == 4 and {len(e) for e in expected} != {4}
    convs, feats = generate_with_features(model, prompts, 12, eos, aux_layers=(0, 1))
    assert [c.tokens[c.prompt_len :] for c in convs] == expected
    assert [c.tokens[: c.prompt_len] for c in convs] == prompts
    ref = target_features(model, convs, (0, 1))
    assert feats.aux is not None and ref.aux is not None
    for c, f, a, rf, ra in zip(convs, feats.final, feats.aux, ref.final, ref.aux, strict=True):
        assert f.shape == (len(c.tokens), 64) and a.shape == (len(c.tokens), 128) and f.dtype == torch.float16
        torch.testing.assert_close(f, rf, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(a, ra, atol=2e-2, rtol=1e-2)
    # in batches of 3 (a batch of 1 left over): the same conversations; EAGLE-1/2 data carries no aux features
    convs3, feats3 = greedy_distiller(model, eos, batch_size=3)(prompts, 12, ())
    assert [c.tokens for c in convs3] == [c.tokens for c in convs] and feats3.aux is None
    assert [f.shape for f in feats3.final] == [f.shape for f in feats.final]
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_with_features(model, prompts, 0, eos)
    with pytest.raises(ValueError, match="positions"):
        generate_with_features(model, [[5] * 500], 12, eos)  # the tiny model has 512


@pytest.mark.parametrize("kind", [HeadKind.eagle, HeadKind.eagle3])
def test_unrolled_training_scores_what_the_drafting_head_computes(kind: HeadKind) -> None:
    """ttt_loss (one masked pass per unrolled step) against the serving head run pair by pair through its own KV
    cache: step 0 appends the true pairs (token j+1, target feature j); step 1 at pair j drafts from the cache
    of true pairs 0..j-1 with (token j+1, the head's step-0 output at j-1), as a depth-1 tree node does."""
    target = _frozen_target()
    cfg = _ttt_config(kind, unroll=2, unroll_decay=0.5, feature_weight=0.0)
    ids = torch.arange(0, 512, 2)
    head = init_head(target, ids, cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # away from the initialisation (fc = identity, zero blocks) so every input matters
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    n = 12
    tokens = torch.randint(3, 512, (n,), generator=gen)
    cache = target.new_cache(1, n)
    batch = ForwardBatch.build(cache, [cache.allocate()], [tokens])
    final, aux = target.hidden_states(batch, cache, cfg.aux_layers)
    final = final.clone()  # out of inference mode
    aux = aux.clone() if aux is not None else None
    lm_w = dense_weight(target.lm_head)[ids]
    aux_b = aux[None] if aux is not None else None
    loss, _ = ttt_loss(head, tokens[None], final[None], torch.ones(1, n), lm_w, cfg, aux=aux_b)

    with torch.no_grad():
        feats = head.fuse(aux if aux is not None else final)  # [n, H] the head's view of f_0..f_{n-1}
    p_next = torch.softmax(final[1:] @ lm_w.t(), dim=-1)  # [n-1, V_d] the target's distribution of token j+2

    def ce(h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return -(p * torch.log_softmax(head.logits(h), dim=-1)).sum(-1)

    hc = head.new_cache(1, n)
    slot = hc.allocate()
    h0 = head.forward(tokens[1:], feats[:-1], ForwardBatch.build(hc, [slot], [tokens[1:]]), hc)  # [n-1, H]
    step1 = []
    for j in range(1, n - 1):
        hc = head.new_cache(1, n)
        s1 = hc.allocate()
        head.forward(tokens[1 : j + 1], feats[:j], ForwardBatch.build(hc, [s1], [tokens[1 : j + 1]]), hc)
        node = ForwardBatch.build(hc, [s1], [tokens[j + 1 : j + 2]])
        step1.append(head.forward(tokens[j + 1 : j + 2], h0[j - 1 : j], node, hc))
    ref = ce(h0, p_next).mean() + 0.5 * ce(torch.cat(step1), p_next[1:]).mean()
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-4, atol=1e-5)


def _head_bytes(head: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in head.parameters()]


def _training_setup(kind: HeadKind) -> tuple[LlamaModel, list[Sample], torch.Tensor]:
    """The tiny target, 12 random samples (with aux features for EAGLE-3) and a 256-id draft vocabulary."""
    target = _frozen_target()
    aux_width = 2 * target.cfg.hidden_size if kind == HeadKind.eagle3 else 0
    return target, _samples(12, 0, target.cfg.hidden_size, aux_width), torch.arange(0, 512, 2)


class _Runs:
    """An object whose unpickling runs code: it creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (self.marker,))


def test_a_checkpoint_holding_other_objects_is_refused_without_unpickling_them(tmp_path: Path) -> None:
    """A resume reads its checkpoint as tensors and plain values only: a file holding any other object (one that
    runs code as it is unpickled) is refused by name, and nothing in it runs."""
    target, samples, ids = _training_setup(HeadKind.eagle)
    cfg = _ttt_config(HeadKind.eagle, epochs=1, batch_tokens=96, max_len=64, warmup_steps=2, checkpoint_every=2)
    work = tmp_path / "w"
    train_head(target, samples, ids, cfg, work, system_len=2, max_steps=2)
    state = torch.load(work / "ckpt.pt", weights_only=True)  # what it writes reads as plain values
    assert state["step"] == 2 and state["config"]["kind"] == HeadKind.eagle.value
    marker = tmp_path / "ran"
    torch.save({**state, "extra": _Runs(marker)}, work / "ckpt.pt")
    torch.load(work / "ckpt.pt", weights_only=False)  # (unpickled in full, it runs)
    assert marker.exists()
    marker.unlink()
    killed = work / ".ckpt.pt.0123456789abcdef.tmp"  # a checkpoint's write killed midway
    killed.write_bytes(b"half")
    with pytest.raises(ValueError, match="more than tensors and plain values"):
        train_head(target, samples, ids, cfg, work, system_len=2)
    assert not marker.exists() and not killed.exists()


@pytest.mark.parametrize("kind", [HeadKind.eagle, HeadKind.eagle3])
def test_training_is_deterministic_and_resumes_bit_for_bit(tmp_path: Path, kind: HeadKind) -> None:
    target, samples, ids = _training_setup(kind)
    cfg = _ttt_config(kind, epochs=2, batch_tokens=96, max_len=64, warmup_steps=2, checkpoint_every=3, noise=0.1)
    losses: list[float] = []
    a = train_head(
        target, samples, ids, cfg, tmp_path / "a", system_len=2, log=lambda s, t, loss, st: losses.append(loss)
    )
    b = train_head(target, samples, ids, cfg, tmp_path / "b", system_len=2)
    for x, y in zip(_head_bytes(a), _head_bytes(b), strict=True):
        assert torch.equal(x, y)
    assert losses[-1] < losses[0]  # it learns something even here
    train_head(target, samples, ids, cfg, tmp_path / "c", system_len=2, max_steps=4)  # interrupted ...
    c = train_head(target, samples, ids, cfg, tmp_path / "c", system_len=2)  # ... and resumed
    for x, y in zip(_head_bytes(a), _head_bytes(c), strict=True):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="other settings"):
        train_head(target, samples, ids, _ttt_config(kind, epochs=3), tmp_path / "c", system_len=2)
    with pytest.raises(ValueError, match="other data"):  # a checkpoint resumes only on the data it trained on
        train_head(target, samples[:-1], ids, cfg, tmp_path / "c", system_len=2)
    with pytest.raises(ValueError, match="other draft vocabulary"):  # ... and with the ids its LM head rows are
        train_head(target, samples, torch.arange(1, 512, 2), cfg, tmp_path / "c", system_len=2)
    if kind == HeadKind.eagle3:
        assert a.cfg.kind == HeadKind.eagle3 and torch.equal(a.draft_ids, ids)
        with pytest.raises(ValueError, match="aux"):  # EAGLE-3 data without its fused features
            train_head(target, _samples(4, 0, target.cfg.hidden_size), ids, cfg, tmp_path / "d", system_len=2)


@pytest.mark.parametrize("attention_bias", [False, True])
def test_a_head_started_from_the_targets_last_layer_has_its_attention_biases(attention_bias: bool) -> None:
    target = tiny_model(tiny_config(attention_bias=attention_bias), seed=1)
    head = init_head(target, torch.arange(0, 512, 2), _ttt_config(HeadKind.eagle, init_from_last_layer=True))
    last = target.decoder_layers()[-1]
    for mine, theirs in ((head.layer.qkv, last.qkv), (head.layer.o_proj, last.o_proj)):
        assert torch.equal(mine.weight, theirs.weight)
        assert (mine.bias is None) == (theirs.bias is None) == (not attention_bias)
        if attention_bias:
            assert torch.equal(mine.bias, theirs.bias)
    assert init_head(target, torch.arange(0, 512, 2), _ttt_config(HeadKind.eagle)).layer.qkv.bias is None


def _disk_full(*_: object) -> None:
    raise OSError("disk full")


def test_a_non_finite_loss_stops_training_before_the_step_reaches_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sample with an infinite feature: training stops at the step that reads it, naming the step, and the
    checkpoint keeps the step before it with finite weights (AdamW would have written NaN into every weight)."""
    target, samples, ids = _training_setup(HeadKind.eagle)
    feats = samples[7].features.clone()
    feats[4, 0] = float("inf")
    samples[7] = replace(samples[7], features=feats)
    cfg = _ttt_config(HeadKind.eagle, epochs=1, batch_tokens=96, max_len=64, warmup_steps=2, checkpoint_every=50)
    work = tmp_path / "w"
    with pytest.raises(TrainingDivergedError, match=r"the step was not applied") as err:
        train_head(target, samples, ids, cfg, work, system_len=2)
    found = re.search(r"step (\d+) of \d+: the loss is nan .*samples \[([0-9, ]+)\]", str(err.value))
    assert found is not None and "7" in found[2].split(", "), str(err.value)
    step = int(found[1])
    assert step > 1  # (the seeded order reaches that sample after some clean steps)
    state = torch.load(work / "ckpt.pt", weights_only=True)
    assert state["step"] == step - 1 and f"holds the head as of step {step - 1}" in str(err.value)
    assert all(bool(torch.isfinite(t).all()) for t in state["head"].values())
    # a checkpoint that cannot be written does not hide why training stopped
    with monkeypatch.context() as m:
        m.setattr(trainer_module, "write_durably", _disk_full)
        with pytest.raises(TrainingDivergedError, match=rf"step {step} of .*not applied; writing .* failed: disk full"):
            train_head(target, samples, ids, cfg, tmp_path / "full", system_len=2)
    # (written at the failure: checkpoint_every is past the end) and resumable: the head trained that far
    clean = train_head(target, samples, ids, cfg, tmp_path / "clean", system_len=2, max_steps=step - 1)
    for name, t in clean.state_dict().items():
        torch.testing.assert_close(state["head"][name], t, rtol=0, atol=0)


def test_a_checkpoint_of_another_heads_tensors_is_refused_by_name(tmp_path: Path) -> None:
    """A checkpoint written by an older version (a head built differently under the same settings) is a clear error
    naming the file, not load_state_dict's missing keys."""
    target, samples, ids = _training_setup(HeadKind.eagle)
    cfg = _ttt_config(HeadKind.eagle, epochs=1, batch_tokens=96, max_len=64, warmup_steps=2, checkpoint_every=2)
    work = tmp_path / "w"
    train_head(target, samples, ids, cfg, work, system_len=2, max_steps=2)
    state = torch.load(work / "ckpt.pt", weights_only=True)
    state["head"]["layer.o_proj.bias"] = torch.zeros(target.cfg.hidden_size)
    torch.save(state, work / "ckpt.pt")
    with pytest.raises(SettingsError, match=r"(?s)ckpt\.pt holds another head's tensors .*o_proj\.bias.*remove it"):
        train_head(target, samples, ids, cfg, work, system_len=2)


def test_features_beyond_float16_are_refused_not_stored_as_infinity() -> None:
    x = torch.tensor([[1.5, -2.0], [65504.0, 3.0]])
    kept = stored_features(x, "last hidden states")
    assert kept.dtype == torch.float16 and torch.equal(kept.float(), x)
    with pytest.raises(UnsupportedModelError, match=r"aux layer inputs reach 7e\+04, beyond float16"):
        stored_features(torch.tensor([[70000.0, 0.0]]), "aux layer inputs")
    with pytest.raises(UnsupportedModelError, match="non-finite last hidden states"):
        stored_features(torch.tensor([[float("nan"), 0.0]]), "last hidden states")
    model = tiny_model(seed=3)  # a target whose final norm scales its features past float16
    with torch.no_grad():
        model.norm.mul_(1e6)
    with pytest.raises(UnsupportedModelError, match="last hidden states reach"):
        generate_with_features(model, [[5, 6, 7]], 2, set())
    with pytest.raises(UnsupportedModelError, match="last hidden states reach"):
        target_features(model, [Conversation([5, 6, 7], 2)])


@pytest.mark.parametrize("kind", [HeadKind.eagle, HeadKind.eagle3])
def test_fine_tuning_starts_from_the_given_head(tmp_path: Path, kind: HeadKind) -> None:
    target, samples, ids = _training_setup(kind)
    cfg = _ttt_config(kind, epochs=2, batch_tokens=96, max_len=64, warmup_steps=2, checkpoint_every=100)
    scratch: list[float] = []
    base = train_head(
        target, samples, ids, cfg, tmp_path / "base", system_len=2, log=lambda s, t, loss, st: scratch.append(loss)
    )
    save_eagle_head(base, tmp_path / "head", dtype=torch.float32)
    other_ids = torch.arange(1, 512, 2)
    tuned_cfg = replace(cfg, init_head=tmp_path / "head", lr=1e-4)
    start = train_head(target, samples, other_ids, tuned_cfg, tmp_path / "t0", system_len=2, max_steps=0)
    for x, y in zip(_head_bytes(base), _head_bytes(start), strict=True):
        assert torch.equal(x, y)  # the trained head's weights, not a fresh initialisation
    # an EAGLE-3 head keeps the vocabulary its LM head was trained on; an EAGLE-1/2 head takes the one asked for
    assert torch.equal(start.draft_ids, ids if kind == HeadKind.eagle3 else other_ids)
    tuned: list[float] = []
    tuned_head = train_head(
        target, samples, ids, tuned_cfg, tmp_path / "t1", system_len=2, log=lambda s, t, loss, st: tuned.append(loss)
    )
    assert tuned[0] < scratch[0]  # it starts where the base training got to
    # another head trained into the same place: the checkpoint (named by path) must not pass for its fine-tune
    save_eagle_head(tuned_head, tmp_path / "head", dtype=torch.float32)
    with pytest.raises(ValueError, match="another starting head"):
        train_head(target, samples, ids, tuned_cfg, tmp_path / "t1", system_len=2)
    other_kind = HeadKind.eagle3 if kind == HeadKind.eagle else HeadKind.eagle
    with pytest.raises(ValueError, match=f"holds an {kind.value} head"):
        train_head(
            target,
            samples,
            ids,
            replace(_ttt_config(other_kind), init_head=tmp_path / "head"),
            tmp_path / "x",
            system_len=2,
        )
    if kind == HeadKind.eagle3:
        with pytest.raises(ValueError, match=r"fuses target layers \[0, 1\]"):
            train_head(target, samples, ids, replace(tuned_cfg, aux_layers=(1, 0)), tmp_path / "y", system_len=2)


def test_seed_prompts_are_not_the_evaluation_set() -> None:
    raw = resources.files("specserve.bench").joinpath("data/mt_bench.jsonl").read_text()
    turns = [t for line in raw.splitlines() if line.strip() for t in json.loads(line)["turns"]]

    def shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
        words = re.findall(r"[a-z0-9']+", text.lower())
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    bench = set().union(*(shingles(t) for t in turns))
    prompts = seed_prompts(3000, seed=0)
    assert len(set(prompts)) == 3000
    assert seed_prompts(50, seed=0) == prompts[:50]  # deterministic for a seed
    assert seed_prompts(50, seed=1) != prompts[:50]
    short_turns = mt_bench_runs(6)  # and the turns of fewer than 6 words, whole
    shared = [p for p in prompts if shingles(p) & bench or short_turns.hit(p)]
    assert not shared, shared[:3]
    # the teacher-forced docstrings (every one the shipped head saw) share no 8-word run with MT-bench; 6-word
    # runs do occur, all the API phrase "value is a list of strings", so 8 is the check here
    # the passages come from the running interpreter's stdlib: 1354 on the machine that trained the head, a few
    # fewer where an optional module (curses, readline, dbm.gnu, ...) does not import
    texts = text_passages(10_000, seed=0)
    assert texts[:400] == text_passages(400, seed=0) and 1300 <= len(texts) <= 1400
    bench8 = set().union(*(shingles(t, 8) for t in turns))
    leaked = [q for q, a in texts if (shingles(q, 8) | shingles(a, 8)) & bench8]
    assert not leaked, leaked[:3]


def test_the_largest_seed_gives_every_self_written_request_a_valid_draw_seed(tmp_path: Path) -> None:
    """A ``--seed`` from 2^31 up was accepted, then every self-written request's seed overflowed 63 bits: a
    ValidationError after all other data was made (hours into a run)."""
    from specserve.sampling import SamplingParams
    from specserve.train.distill import DistillConfig, build_self_dataset
    from specserve.train.pipeline import _seed, request_seeds

    largest = _seed(str((1 << 32) - 1))
    with pytest.raises(argparse.ArgumentTypeError):
        _seed(str(1 << 32))
    chunk_seeds: list[int] = []

    def requests(n: int, seed: int) -> list[str]:
        chunk_seeds.append(seed)
        return [f"request {seed} {i}" for i in range(n)]

    cfg = DistillConfig(seed=largest, chunk_size=4, max_new_tokens=2)
    build_self_dataset(_echo_distiller, _ChatTokenizer(), requests, tmp_path / "self", 12, cfg)
    assert len(chunk_seeds) == 3
    seeds = [s for c in chunk_seeds for s in request_seeds(c, 4096)]
    assert len(set(seeds)) == len(seeds)
    for s in (seeds[0], seeds[-1], max(seeds)):
        assert SamplingParams(temperature=1.0, seed=s).seed == s
    assert request_seeds(7, 2) == [7 * 4096, 7 * 4096 + 1]  # below the bound: the same draws as before
    # seeds 2^31 apart drew the same requests (a mask dropped bit 31; a modulus then shared 39 of a chunk's 64)
    for chunk in range(3):
        low, high = request_seeds((5 << 20) + chunk, 64), request_seeds(((5 + (1 << 31)) << 20) + chunk, 64)
        assert not set(low) & set(high) and low[0] == (5 << 32) + (chunk << 12)
    assert request_seeds(((1 << 32) - 1) << 20, 1) == [-(1 << 32)]  # the 64 bits as a signed seed


def test_self_written_requests_are_filtered_and_never_the_evaluation_set() -> None:
    raw = resources.files("specserve.bench").joinpath("data/mt_bench.jsonl").read_text()
    bench_turn = json.loads(raw.splitlines()[3])["turns"][0]
    banned = mt_bench_runs()
    drawn = [
        "  How do I repot a cactus without hurting my hands?\n",
        None,  # did not finish
        "Hi!",  # too short
        "x" * 2000,  # too long
        "Write a poem about tea.<|im_end|>",  # special-token text
        "How do I repot a cactus without hurting my hands?",  # a duplicate once stripped
        "Please answer this: " + bench_turn,  # MT-bench inside
        "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    ]
    kept = keep_requests(drawn, banned, ["<|im_end|>", "<|im_start|>"])
    assert kept == [
        "How do I repot a cactus without hurting my hands?",
        "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    ]
    assert keep_requests([bench_turn[: len(bench_turn) // 2 + 60]], banned, []) == []  # a part of one, too
    # every turn asked alone, shorter than 8 words too ("Prove the Pythagorean theorem."), curly apostrophes or not
    turns = [t for line in raw.splitlines() if line.strip() for t in json.loads(line)["turns"]]
    assert sum(len(re.findall(r"[a-z0-9']+", t.lower())) < 8 for t in turns) >= 5
    assert keep_requests(turns, banned, []) == []
    assert keep_requests([t.replace("'", "\u2019") + " Thanks!" for t in turns], banned, []) == []
    assert keep_requests(["Tell me: can you parallelize it?", "Can you paralyze it?"], banned, []) == [
        "Can you paralyze it?"
    ]


def _mini_wordnet(root: Path, planted_gloss: str) -> Path:
    """A WordNet dict directory in the wndb(5WN) format with a handful of nouns; ``cape`` carries ``planted_gloss``."""
    nouns = [  # (lemma, lexicographer file, tagged count, gloss)
        ("kettle", 6, 4, "a metal pot for boiling water"),
        ("cape", 6, 3, planted_gloss),
        ("otter", 5, 2, "freshwater carnivorous mammal; webbed feet"),
        ("barley", 13, 5, "a grain used as food"),
        ("erosion", 22, 7, "the wearing away of rock by water or wind"),
        ("patience", 7, 3, "good-natured tolerance of delay"),
        ("carpenter", 18, 6, "a woodworker who makes or repairs wooden objects"),
        ("nurse", 18, 9, "one skilled in caring for the sick"),
        ("Lisbon", 15, 2, "capital and largest city of Portugal"),
        ("obscure_thing", 6, 0, "never seen in the tagged corpus"),
    ]
    root.mkdir()
    lines = ["  1 This software and database is being provided ... (licence header)"]
    cnt = []
    for i, (lemma, lexfile, count, gloss) in enumerate(nouns):
        lines.append(f"{1000 + i:08d} {lexfile:02d} n 01 {lemma} 0 000 | {gloss}  ")
        cnt.append(f"{lemma.lower()}%1:{lexfile:02d}:00:: 1 {count}")
    (root / "data.noun").write_text("\n".join(lines) + "\n")
    (root / "cntlist.rev").write_text("\n".join(cnt) + "\n")
    return root


def test_lexicon_prompts_draw_on_wordnet_and_never_the_evaluation_set(tmp_path: Path) -> None:
    raw = resources.files("specserve.bench").joinpath("data/mt_bench.jsonl").read_text()
    words = re.findall(r"[A-Za-z']+", json.loads(raw.splitlines()[5])["turns"][0])
    planted = " ".join(words[:12])  # an MT-bench turn's first 12 words as a gloss
    wn = _mini_wordnet(tmp_path / "wn", planted)
    nouns = {n.lemma: n for n in load_nouns(wn)}
    assert "obscure thing" not in nouns and "Lisbon" in nouns  # only nouns seen twice or more in the corpus
    assert nouns["otter"].gloss == "freshwater carnivorous mammal" and nouns["nurse"].count == 9
    prompts = lexicon_prompts(300, seed=3, wordnet_dir=wn)
    assert len(set(prompts)) == 300 and prompts[:40] == lexicon_prompts(40, seed=3, wordnet_dir=wn)
    assert lexicon_prompts(40, seed=4, wordnet_dir=wn) != prompts[:40]
    assert any("kettle" in p for p in prompts) and any("Lisbon" in p for p in prompts)
    assert not [p for p in prompts if planted in p]  # the glosses show up, but never the planted MT-bench text
    assert any("a metal pot for boiling water" in p for p in prompts)
    with pytest.raises(WordNetMissing, match="wordnet-base"):
        lexicon_prompts(5, wordnet_dir=tmp_path / "nowhere")
    thin = tmp_path / "thin"
    thin.mkdir()
    (thin / "data.noun").write_text("00001000 06 n 01 kettle 0 000 | a pot  \n")
    (thin / "cntlist.rev").write_text("kettle%1:06:00:: 1 4\n")
    with pytest.raises(ValueError, match="no ideas, people, four nouns"):
        lexicon_prompts(5, wordnet_dir=thin)


@pytest.mark.skipif(not (WORDNET_DIR / "data.noun").exists(), reason="the Debian package wordnet-base is not installed")
def test_lexicon_prompts_from_the_installed_wordnet_are_varied() -> None:
    prompts = lexicon_prompts(4800, seed=0)
    assert len(set(prompts)) == 4800
    bench = mt_bench_runs(6)  # stricter than the generator's own 8-word filter
    assert not [p for p in prompts if bench.hit(p)]
    vocab = {w for p in prompts for w in re.findall(r"[a-z]+", p.lower())}
    assert len(vocab) > 4000  # thousands of distinct words, against ~300 in the templated seed prompts
    seeds = {w for p in seed_prompts(4800, 0) for w in re.findall(r"[a-z]+", p.lower())}
    assert len(vocab) > 2 * len(seeds)  # the seed prompts include stdlib docstrings


@pytest.mark.real_model
def test_a_passage_quoting_special_token_text_is_answered_to_its_end() -> None:
    """Parsed, ``<|im_end|>`` in a passage (docs/benchmarks.md quotes it) was the EOS id mid-answer: the head
    learned to go on after an end of turn."""
    from specserve.config import ModelSpec
    from specserve.models.loader import load_tokenizer
    from specserve.train.distill import chat_ids, teacher_forced

    tokenizer = load_tokenizer(ModelSpec())
    conv = teacher_forced(tokenizer, "Write a passage.", "It ends each turn with <|im_end|> and goes on.")
    assert conv.prompt_len == len(chat_ids(tokenizer, "Write a passage."))
    answer = conv.tokens[conv.prompt_len :]
    assert answer[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in answer[:-1]
    assert not set(answer[:-1]) & set(tokenizer.all_special_ids)
    assert tokenizer.decode(answer[:-1]) == "It ends each turn with <|im_end|> and goes on."


@pytest.mark.real_model
def test_self_prompts_ask_from_the_user_header_of_the_chat_template() -> None:
    from specserve.config import ModelSpec
    from specserve.models.loader import load_tokenizer
    from specserve.train.distill import chat_ids

    tokenizer = load_tokenizer(ModelSpec())
    prefix = user_turn_prefix(tokenizer)
    assert tokenizer.decode(prefix).endswith("<|im_start|>user\n")
    request = "Name three rivers in Africa."
    body = tokenizer.encode(request, add_special_tokens=False)
    assert chat_ids(tokenizer, request)[: len(prefix) + len(body)] == prefix + body  # the user's text follows it
    asked: list[tuple[list[int], int, int]] = []

    def ask(prefix_ids: list[int], n: int, seed: int) -> list[list[int] | None]:
        asked.append((prefix_ids, n, seed))
        return [body, None, tokenizer.encode(" " + request + " ", add_special_tokens=False)][:n]

    assert self_prompts(tokenizer, ask, 3, 7, BannedRuns.of([])) == [request]
    assert asked == [(prefix, 3, 7)]


@pytest.mark.real_model
def test_train_draft_quick_writes_a_loadable_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specserve.cli import main
    from specserve.config import ModelSpec
    from specserve.models.loader import load_model, load_tokenizer

    out = tmp_path / "head"
    wn = _mini_wordnet(tmp_path / "wn", "a sleeveless garment")
    args = ["--text-passages", "3", "--self-prompts", "5", "--lexicon-prompts", "6", "--lexicon-max-new-tokens", "3"]
    paragraph = " ".join(f"Sentence {i} of the corpus says something plain." for i in range(8))
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"{k}: {paragraph}" for k in range(6)))  # passages 0-4, 5
    args += ["--corpus", str(tmp_path / "corpus.txt"), "--corpus-passages", "5"]
    argv = ["train-draft", "--quick", *args, "--wordnet-dir", str(wn), "--out", str(out)]
    assert main(argv) == 0
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["command"] == shlex.join(["specserve", *argv])  # the command run (it read pytest's own sys.argv)
    kept = prov["data"]["self_prompts_kept"]
    assert prov["data"]["self_prompts_asked"] == 5 and 1 <= kept <= 5
    assert prov["data"]["conversations"] == 8 + 3 + 2 + 6 + kept and prov["data"]["text_passages"] == 3
    assert prov["data"]["corpus"]["passages"] == 2 and prov["data"]["corpus"]["files"] == [str(tmp_path / "corpus.txt")]
    tokenizer = load_tokenizer(ModelSpec())
    corpus_answers = sorted(tokenizer.decode(s.tokens[s.prompt_len :]) for s in iter_samples(out / "work" / "corpus"))
    assert corpus_answers[0].startswith("0: Sentence 0") and corpus_answers[1].startswith("5: Sentence 0")
    assert prov["data"]["lexicon_prompts"] == 6
    lexicon_manifest = json.loads((out / "work" / "lexicon" / "manifest.json").read_text())
    assert prov["data"]["lexicon"] == {"wordnet_dir": str(wn), "wordnet_sha256": lexicon_manifest["wordnet_sha256"]}
    assert len(list((out / "work" / "self").glob("chunk_*.safetensors"))) == 2  # 5 requests in chunks of 4
    # the seed prompts and text passages come from this interpreter's stdlib docs: a resume under another Python
    # would add chunks drawn from another list (its manifest then refuses the work dir)
    manifests = [json.loads(m.read_text()) for m in (out / "work").glob("*/manifest.json")]
    assert len(manifests) >= 5 and all(m["python"] == platform.python_version() for m in manifests)
    # and by content, not by name: other WordNet files under the same path are refused, and so is another
    # checkpoint under the target's name, before any chunk of theirs is mixed in
    with (wn / "cntlist.rev").open("a") as f:
        f.write("3 cape%1:06:01:: 1\n")
    again = ["train-draft", "--quick", *args, "--wordnet-dir", str(wn), "--out", str(tmp_path / "again")]
    capsys.readouterr()
    assert main([*again, "--work-dir", str(out / "work")]) == 2
    assert "wordnet_sha256" in capsys.readouterr().err and not (tmp_path / "again").exists()
    answer_lens = {
        name: [len(s.tokens) - s.prompt_len for s in iter_samples(out / "work" / name)] for name in ("data", "lexicon")
    }
    assert len(answer_lens["lexicon"]) == 6 and max(answer_lens["lexicon"]) <= 3  # their own answer length
    assert max(answer_lens["data"]) > 3  # the seed prompts' answers run to the quick mode's 16 tokens
    assert prov["sha256"] in (out / "model.safetensors.sha256").read_text()
    # sha256sum's record of every file a load reads (a head shipped from it must have them all)
    assert subprocess.run(["sha256sum", "--check", "--strict", "model.safetensors.sha256"], cwd=out).returncode == 0
    listed = [line.split()[1] for line in (out / "model.safetensors.sha256").read_text().splitlines()]
    assert listed == ["model.safetensors", "config.json", "vocab_map.json"]
    vocab = json.loads((out / "vocab_map.json").read_text())
    assert vocab["by_frequency"][: len(vocab["forced"])] == vocab["forced"]
    target = load_model(ModelSpec())
    head = load_eagle_head(out, target)
    assert head.trained_for == "smollm2-135m-instruct"
    assert head.draft_vocab_size == 512 and 2 in head.draft_ids.tolist()  # EOS forced into the draft vocabulary
    with torch.no_grad():  # another model of the same shapes: each token's row is its neighbour's
        target.embed_tokens.weight.copy_(target.embed_tokens.weight.roll(1, dims=0))
    with pytest.raises(UnsupportedModelError, match="trained for another target"):
        load_eagle_head(out, target)
    assert starting_head(target, TrainConfig(init_head=out)).trained_for == "smollm2-135m-instruct"  # fine-tuned for it


@pytest.mark.real_model
def test_train_draft_quick_eagle3_head_loads_and_drafts_losslessly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specserve.cli import main
    from specserve.config import HeadSpec, ModelSpec, SpecConfig, SpecMethod
    from specserve.engine import Engine
    from specserve.errors import ModelSourceError
    from specserve.models.loader import frequent_ids, load_draft, load_model, load_tokenizer
    from specserve.sampling import SamplingParams
    from specserve.spec_decode.head_checkpoint import checkpoint_kind

    out = tmp_path / "head3"
    assert (
        main(["train-draft", "--quick", "--kind", "eagle3", "--batch-size", "8", "--device", "cpu", "--out", str(out)])
        == 0
    )
    assert len(list((out / "work" / "data").glob("chunk_*.safetensors"))) == 1  # a given batch size is the chunk's
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["device"].startswith("CPU: ")
    assert prov["train"]["kind"] == "eagle3" and prov["train"]["aux_layers"] == [2, 15, 27]
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    target = load_model(ModelSpec())
    head = load_eagle_head(out, target)
    assert head.cfg.kind == HeadKind.eagle3 and head.cfg.aux_layers == (2, 15, 27)
    assert checkpoint_kind(out) == HeadKind.eagle3
    assert checkpoint_kind(HeadSpec(head="smollm2-eagle1").path()) == HeadKind.eagle
    with pytest.raises(ModelSourceError, match="EAGLE-3"):  # its vocabulary is its own LM head's
        load_draft(HeadSpec(head=str(out), draft_vocab=256), target)
    assert head.draft_vocab_size == 512 and 2 in head.draft_ids.tolist()  # EOS forced in, through d2t
    tok = load_tokenizer(ModelSpec())
    prompts = [[{"role": "user", "content": "Name two rivers."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = Engine(target, tok).generate(prompts, params)
    spec = SpecConfig(method=SpecMethod.ddd, budget=8)
    drafted = Engine(target, tok, draft=head, speculation=spec).generate(prompts, params)
    assert drafted[0].token_ids == plain[0].token_ids
    assert drafted[0].stats.draft_steps > 0
    # fine-tuned on other data (teacher-forced passages alone): it starts from this head and keeps its vocabulary
    tuned = tmp_path / "tuned"
    ft_args = [
        "train-draft",
        "--quick",
        "--kind",
        "eagle3",
        "--init-head",
        str(out),
        "--lr",
        "1e-4",
        "--out",
        str(tuned),
    ]
    assert main([*ft_args, "--prompts", "0", "--text-passages", "2"]) == 0
    prov = json.loads((tuned / "provenance.json").read_text())
    assert prov["train"]["init_head"] == str(out.resolve()) and prov["train"]["lr"] == 1e-4
    assert prov["init_head_sha256"] in (out / "model.safetensors.sha256").read_text()
    assert prov["data"]["conversations"] == 2
    assert (tuned / "vocab_map.json").read_text() == (out / "vocab_map.json").read_text()
    assert torch.equal(load_eagle_head(tuned, target).draft_ids, head.draft_ids)
    # a head without a vocabulary map (as published EAGLE-3 heads come): the map written leads with its ids
    published = tmp_path / "published"
    shutil.copytree(out, published, ignore=shutil.ignore_patterns("vocab_map.json", "work"))
    assert main(["train-draft", "--quick", "--kind", "eagle3", "--init-head", str(published), "--prompts", "0",
                 "--text-passages", "2", "--out", str(tmp_path / "tuned2")]) == 0  # fmt: skip
    assert torch.equal(frequent_ids(tmp_path / "tuned2", 512, target.cfg.vocab_size), head.draft_ids)
    # an EAGLE-1/2 run: refused before any data, as a one-line error
    assert main(["train-draft", "--quick", "--init-head", str(out), "--out", str(tmp_path / "wrong")]) == 2
    assert "holds an eagle3 head" in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists()
    assert main([*ft_args, "--prompts", "0", "--out", str(tmp_path / "none")]) == 2
    assert "no training data" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main([*ft_args, "--lr", "0"])
    assert exit_.value.code == 2 and "--lr" in capsys.readouterr().err


def test_bench_distill_both_data_steps_write_the_engines_greedy_conversations(tmp_path: Path) -> None:
    import csv

    from specserve.cli import main

    assert main(["bench", "distill", "--tiny", "--prompts", "6", "--max-new-tokens", "16", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "distill.csv").open()))
    assert [r["data step"] for r in rows] == ["answers, then a prefill each", "features from generation"]
    assert [r["same conversations"] for r in rows] == ["", "6"]  # the second against the engine's greedy answers
    for r in rows:  # each way's own count, at most --max-new-tokens a conversation
        assert 0 < int(r["answer tokens"]) <= 6 * 16
        assert float(r["answer tok/s"]) * float(r["median s"]) == pytest.approx(int(r["answer tokens"]))
    from specserve.bench.machine import cpu_summary

    assert all(r["cpu"] == cpu_summary() for r in rows)  # the machine of the figures


def test_bench_distill_counts_answer_tokens_without_the_stop_id_or_the_prompt() -> None:
    from specserve.bench.distill import answer_tokens

    prompts = [[5, 6], [7], [8, 9, 10]]
    convs = [[5, 6, 11, 12, 2], [7, 13], [8, 9, 10, 2]]  # stopped after 2, ran out after 1, stopped at once
    assert answer_tokens(convs, prompts, stop_id=2) == 3
    assert answer_tokens([[5, 6]], [[5, 6]], stop_id=6) == 0  # a prompt ending in the stop id is not an answer


def test_depth_zero_agreement_is_the_serving_heads_top_1_against_the_targets() -> None:
    """bench agreement at depth 0 against the head run the way drafting runs it (its own KV cache over the true
    pairs), its argmax mapped to target ids, compared with the target's argmax; out-of-vocabulary tokens miss."""
    from specserve.bench.agreement import depth_agreement
    from specserve.models.tiny import tiny_head

    target = tiny_model(seed=2)
    head = tiny_head(target, seed=3, std=0.5)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 512, (30,), generator=gen)
    prompt_len = 9
    cache = target.new_cache(1, 30)
    final = target.final_hidden(ForwardBatch.build(cache, [cache.allocate()], [tokens.tolist()]), cache)  # [30, H]
    lm = dense_weight(target.lm_head).float()
    target_next = (final @ lm.t()).argmax(-1)  # the target's token after each position
    # a few-token draft vocabulary holding every 4th scored target token: a random head then hits some of them,
    # and the other scored tokens cannot be drafted at all
    vocab = sorted({int(target_next[j + 1]) for j in range(prompt_len - 1, 28, 4)})
    head.set_draft_vocab(torch.tensor(vocab))
    hcache = head.new_cache(1, 30)
    batch = ForwardBatch.build(hcache, [hcache.allocate()], [tokens[1:].tolist()], positions=[list(range(29))])
    drafted = head.draft_ids[head.logits(head(batch.tokens, head.fuse(final[:-1]), batch, hcache)).argmax(-1)]
    # pair j (token j+1, feature j) drafts token j+2; scored: the answer's tokens after its first (token prompt_len,
    # drafted by pair prompt_len - 2, is the target's at prefill: never drafted)
    hits = [int(drafted[j] == target_next[j + 1]) for j in range(prompt_len - 1, 28)]
    in_vocab = [int(int(target_next[j + 1]) in vocab) for j in range(prompt_len - 1, 28)]
    rate, agree = depth_agreement(head, lm, tokens, final, None, prompt_len, depths=2)
    assert 0 < sum(in_vocab) < len(in_vocab) and sum(hits) > 0  # both kinds of position occur
    assert rate == pytest.approx(sum(in_vocab) / len(in_vocab))
    assert agree[0] == pytest.approx(sum(hits) / len(hits))
    assert 0 <= agree[1] <= rate


def test_agreement_by_confidence_splits_positions_by_the_targets_probability_of_its_token() -> None:
    """Each answer position lands in the bucket of the target's probability of its own token, and a bucket's
    hits are the serving head's top-1 matches there (an out-of-vocabulary token a miss); rows give shares."""
    from specserve.bench.agreement import confidence_agreement, confidence_rows
    from specserve.models.tiny import tiny_head

    target = tiny_model(seed=2)
    head = tiny_head(target, seed=3, std=0.5)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 512, (30,), generator=gen)
    prompt_len = 9
    cache = target.new_cache(1, 30)
    final = target.final_hidden(ForwardBatch.build(cache, [cache.allocate()], [tokens.tolist()]), cache)  # [30, H]
    lm = dense_weight(target.lm_head).float()
    probs = torch.softmax(final @ lm.t(), -1)
    target_next = probs.argmax(-1)
    vocab = sorted({int(target_next[j + 1]) for j in range(prompt_len - 1, 28, 3)})
    head.set_draft_vocab(torch.tensor(vocab))
    hcache = head.new_cache(1, 30)
    batch = ForwardBatch.build(hcache, [hcache.allocate()], [tokens[1:].tolist()], positions=[list(range(29))])
    drafted = head.draft_ids[head.logits(head(batch.tokens, head.fuse(final[:-1]), batch, hcache)).argmax(-1)]
    scored = range(prompt_len - 1, 28)  # (the answer's first token is the target's at prefill: never drafted)
    p_own = [float(probs[j + 1, target_next[j + 1]]) for j in scored]
    edges = (0.0, sorted(p_own)[len(p_own) // 3], sorted(p_own)[2 * len(p_own) // 3])  # three filled buckets
    expected = [[0, 0], [0, 0], [0, 0]]
    for j, p in zip(scored, p_own, strict=True):
        b = sum(p >= e for e in edges) - 1
        expected[b][0] += 1
        expected[b][1] += int(drafted[j] == target_next[j + 1])
    got = confidence_agreement(head, lm, tokens, final, None, prompt_len, edges)
    assert [c for c, _ in got] == [c for c, _ in expected] and all(c > 0 for c, _ in expected)
    assert [h for _, h in got] == pytest.approx([h for _, h in expected])
    assert sum(h for _, h in expected) > 0

    rows = confidence_rows("s", "h", [[(2, 1.0), (2, 2.0)], [(0, 0.0), (4, 1.0)]], edges=(0.0, 0.5))
    assert [(r["target_p"], r["positions"]) for r in rows] == [("0.0 <= p < 0.5", 2), ("0.5 <= p <= 1", 6)]
    assert rows[0]["share"] == pytest.approx(0.25) and rows[1]["agree_d0"] == pytest.approx(0.5)


def test_agreement_held_out_sets_start_past_the_heads_training_prompts(tmp_path: Path) -> None:
    """The shipped EAGLE-3 head trained on the first 3072 seed and 14400 lexicon prompts (its provenance): the
    held-out sets start past them, and an offset reaching into them is refused."""
    from argparse import Namespace

    from specserve.bench.agreement import held_out_offsets
    from specserve.errors import InvalidRequestError

    trained = json.loads(Path("specserve/heads/smollm2-eagle3/provenance.json").read_text())["data"]
    assert (trained["num_prompts"], trained["lexicon_prompts"]) == (3072, 14400)
    unrecorded = tmp_path / "head"  # a head directory without a provenance.json: the fixed least offsets
    unrecorded.mkdir()

    def ns(heads: list[str], seed_offset: int | None = None, lexicon_offset: int | None = None) -> Namespace:
        sets = ["mt-bench", "seeds", "lexicon"]
        return Namespace(heads=heads, seed_offset=seed_offset, lexicon_offset=lexicon_offset, sets=sets, per_set=10)

    assert held_out_offsets(ns(["smollm2-eagle3", str(unrecorded)])) == {"seeds": 3900, "lexicon": 14400}
    assert held_out_offsets(ns([str(unrecorded)])) == {"seeds": 3900, "lexicon": 9600}
    assert held_out_offsets(ns(["smollm2-eagle3"], 5000, 20000)) == {"seeds": 5000, "lexicon": 20000}
    with pytest.raises(InvalidRequestError, match="14400 training prompts"):
        held_out_offsets(ns(["smollm2-eagle3"], None, 9600))
    with pytest.raises(InvalidRequestError, match="at most their first 200000"):  # enumerated for ever before
        held_out_offsets(ns(["smollm2-eagle3"], 10**12))


def test_agreement_by_category_takes_each_categorys_first_turns_and_gives_a_row_each() -> None:
    from specserve.bench.agreement import agreement_rows, set_prompts
    from specserve.bench.prompt_sets import mt_bench_prompts

    pairs = set_prompts("mt-bench", 2, {}, by_category=True)
    first = {}
    for p in mt_bench_prompts():
        first.setdefault(p.category, []).append(p.text)
    assert len(first) == 8 and len(pairs) == 16
    for category, texts in first.items():
        assert [t for t, g in pairs if g == category] == texts[:2]
    assert {g for _, g in set_prompts("mt-bench", 4, {})} == {"mt-bench"}  # without it: one group, the set

    per_conv = [(1.0, [0.5, 0.25]), (0.5, [0.25, 0.0]), (1.0, [1.0, 0.5])]  # (in vocab, agreement at depth 0, 1)
    rows = agreement_rows("mt-bench", "h", ["writing", "math", "writing"], per_conv)
    assert [(r["set"], r["prompts"]) for r in rows] == [
        ("mt-bench", 3),
        ("mt-bench: math", 1),
        ("mt-bench: writing", 2),
    ]
    assert rows[0]["in_vocab"] == pytest.approx(2.5 / 3) and rows[0]["agree_d0"] == pytest.approx(1.75 / 3)
    assert rows[2]["agree_d0"] == pytest.approx(0.75) and rows[2]["agree_d1"] == pytest.approx(0.375)
    assert rows[1]["in_vocab"] == 0.5 and rows[1]["agree_d1"] == 0.0
    assert len(agreement_rows("seeds", "h", ["seeds"] * 3, per_conv)) == 1  # one group: the set's row alone


class _ChatTokenizer:
    """apply_chat_template as chat_ids calls it: a prompt's characters as ids."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[int]:
        return [1, *(ord(c) % 500 + 3 for c in messages[0]["content"]), 2]


def _echo_distiller(prompts: list[list[int]], max_new_tokens: int, aux_layers: tuple[int, ...]):
    from specserve.train.distill import Conversation, Features

    convs = [Conversation(p + p[:max_new_tokens], len(p)) for p in prompts]
    return convs, Features([torch.zeros(len(c.tokens), 4, dtype=torch.float16) for c in convs])


def test_a_data_directory_is_reused_only_with_its_settings_and_only_its_chunks_are_read(tmp_path: Path) -> None:
    from specserve.train.distill import DistillConfig, build_dataset, claim_data_dir

    out, tok = tmp_path / "data", _ChatTokenizer()
    prompts = [f"prompt number {i}" for i in range(10)]
    settings = {"target": "t", "seed": 0, "aux_layers": (), "max_new_tokens": 4, "chunk_size": 4}
    claim_data_dir(out, settings)
    chunks = build_dataset(_echo_distiller, tok, out, prompts, DistillConfig(chunk_size=4, max_new_tokens=4))
    assert len(chunks) == 3 and len(list(iter_samples(chunks))) == 10
    claim_data_dir(out, dict(settings))  # the same settings: resumed, more or fewer prompts alike
    cfg = DistillConfig(chunk_size=4, max_new_tokens=4)
    fewer = build_dataset(_echo_distiller, tok, out, prompts[:5], cfg)
    assert fewer == chunks[:2] and len(list(iter_samples(fewer))) == 5  # its chunks, not every chunk on disk
    # the partial last chunk of one count is not the same chunk of another (a 6- / 8- / 3-conversation mix before)
    more = build_dataset(_echo_distiller, tok, out, [*prompts, "eleven", "twelve"], cfg)
    assert [s.tokens[1:-5].tolist() for s in iter_samples(more)] == [
        [ord(c) % 500 + 3 for c in p] for p in [*prompts, "eleven", "twelve"]
    ]
    for change in ({"seed": 1}, {"max_new_tokens": 8}, {"chunk_size": 8}, {"aux_layers": (1, 2, 3)}):
        with pytest.raises(ValueError, match=f"{next(iter(change))}: .* there, .* now"):
            claim_data_dir(out, settings | change)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "chunk_00000.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="without a manifest"):
        claim_data_dir(tmp_path / "old", settings)
    for text in ("", "[1, 2]", '{"seed": 0'):  # a manifest cut short or not a record: a clear error
        (tmp_path / "old" / "manifest.json").write_text(text)
        with pytest.raises(SettingsError, match=r"manifest\.json"):
            claim_data_dir(tmp_path / "old", settings)


def test_a_chunk_written_for_other_items_is_written_again(tmp_path: Path) -> None:
    """Chunks are matched on the items they hold, not only on the settings and their count: the text passages
    depend on which stdlib modules a Python has (one fewer: ~100 passages doubled, ~100 never trained on) and seed
    prompt templates on the code, and a resumed run must train on what it would have made afresh."""
    from deployments.tiny_tokenizer import tiny_tokenizer
    from specserve.models.tiny import tiny_config
    from specserve.train.distill import DistillConfig, build_dataset, build_text_dataset

    tok, cfg = _ChatTokenizer(), DistillConfig(chunk_size=4, max_new_tokens=4)
    prompts = [f"prompt number {i}" for i in range(6)]
    build_dataset(_echo_distiller, tok, tmp_path / "d", prompts, cfg)
    moved = ["a prompt the old list did not have", *prompts[:5]]  # as many, but others
    chunks = build_dataset(_echo_distiller, tok, tmp_path / "d", moved, cfg)
    assert [s.tokens[1:-5].tolist() for s in iter_samples(chunks)] == [[ord(c) % 500 + 3 for c in p] for p in moved]

    target, ttok = tiny_model(tiny_config(), seed=0), tiny_tokenizer()
    ttok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    pairs = [(f"ask {i}", f"a passage {i}") for i in range(5)]
    build_text_dataset(target, ttok, tmp_path / "t", pairs, chunk_size=4)
    shifted = [("ask x", "a passage the old list did not have"), *pairs[:4]]
    chunks = build_text_dataset(target, ttok, tmp_path / "t", shifted, chunk_size=4)
    held = [ttok.decode(s.tokens[s.prompt_len : -1].tolist()) for s in iter_samples(chunks)]
    assert held == [text for _, text in shifted]


def test_a_passage_longer_than_the_targets_window_is_cut_to_it(tmp_path: Path) -> None:
    """Teacher-forced passages were not cut to the target's positions: on a 512-position target a long passage
    failed the run in the KV cache ("adding 523 exceeds its capacity of 512"), after the generation step."""
    from deployments.tiny_tokenizer import tiny_tokenizer
    from specserve.models.tiny import tiny_config
    from specserve.train.distill import build_text_dataset

    target, tok = tiny_model(tiny_config(), seed=0), tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    passage = " ".join(f"word{i}" for i in range(2 * target.max_positions))
    chunks = build_text_dataset(target, tok, tmp_path / "t", [("ask", passage), ("ask", "short")], chunk_size=4)
    lengths = [len(s.tokens) for s in iter_samples(chunks)]
    assert lengths[0] == target.max_positions and lengths[1] < 20


class _SpecialChatTokenizer(_ChatTokenizer):
    all_special_ids = (1, 2)
    eos_token_id = 2


def _tiny_train_draft(asked: list[int] | None = None) -> tuple[Any, Any, Any, TrainConfig, Any]:
    """(target, tokenizer, distill, train settings, TrainDraftConfig) of a seconds-long train_draft on the tiny
    target: each answer repeats its prompt; ``asked`` records how many prompts each distill call got."""
    from specserve.train.distill import Conversation, DistillConfig
    from specserve.train.pipeline import TrainDraftConfig

    target, tok = _frozen_target(), _SpecialChatTokenizer()

    def distill(prompts: list[list[int]], max_new_tokens: int, aux_layers: tuple[int, ...]):
        if asked is not None:
            asked.append(len(prompts))
        convs = [Conversation(p + p[:max_new_tokens], len(p)) for p in prompts]
        return convs, target_features(target, convs, aux_layers)

    train = TrainConfig(epochs=1, batch_tokens=64, max_len=64, warmup_steps=1, checkpoint_every=100)
    cfg = TrainDraftConfig("tiny", DistillConfig(num_prompts=4, max_new_tokens=4, chunk_size=4), train, draft_vocab=64)
    return target, tok, distill, train, cfg


class _SelfWritingTokenizer(_SpecialChatTokenizer):
    """Text as ids (a character each), with a user header: what self_prompts needs to ask and read requests."""

    all_special_tokens = ("<s>", "</s>")

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: object) -> Any:
        return "<u>" + messages[0]["content"] if kw.get("tokenize") is False else super().apply_chat_template(messages)

    def encode(self, text: str, **_: object) -> list[int]:
        return [ord(c) % 500 + 3 for c in text]

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(chr(i - 3) for i in ids)


def test_self_written_requests_whose_answers_would_not_fit_are_dropped(tmp_path: Path) -> None:
    """A request written within ASK_MAX_TOKENS can take more in its chat turn: one whose answer did not fit the
    target's positions failed the data step, which runs after all the other data."""
    from specserve.train.pipeline import train_draft

    target, _, distill, _, cfg = _tiny_train_draft()
    tok = _SelfWritingTokenizer()
    room = target.max_positions - cfg.data.max_new_tokens - 1 - 2  # (the chat turn adds 2 ids)
    fits, too_long = "a request that fits " * 2, "x" * (room + 1)

    def ask(prefix: list[int], n: int, seed: int) -> list[list[int] | None]:
        assert tok.decode(prefix) == "<u>"
        return [tok.encode(t) for t in (fits, too_long, "y" * room)[:n]]  # (the last fits exactly)

    settings = replace(cfg, self_prompts=3, data=replace(cfg.data, num_prompts=0))
    train_draft(target, tok, distill, settings, tmp_path / "w", tmp_path / "h", ask=ask, log=lambda _: None)
    prov = json.loads((tmp_path / "h" / "provenance.json").read_text())["data"]
    assert (prov["self_prompts_asked"], prov["self_prompts_kept"]) == (3, 2)


def test_provenance_records_the_optimiser_steps_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head's record says how many steps it trained (they follow from the data's lengths, not the command)."""
    from specserve.train.pipeline import train_draft

    target, tok, distill, train, cfg = _tiny_train_draft()
    taken: list[int] = []
    adamw_step = torch.optim.AdamW.step

    def counted(self: torch.optim.AdamW, *a: Any, **kw: Any) -> Any:
        taken.append(1)
        return adamw_step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    settings = replace(cfg, train=replace(train, epochs=2, batch_tokens=16))
    train_draft(target, tok, distill, settings, tmp_path / "w", tmp_path / "h", log=lambda _: None)
    assert len(taken) > 2
    assert json.loads((tmp_path / "h" / "provenance.json").read_text())["steps"] == len(taken)


def test_self_written_requests_kept_by_another_filter_are_refused_on_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MT-bench filter runs when a chunk is written: a rerun reused chunks an older filter had kept (one that let
    "Prove the Pythagorean theorem." through) and trained on them, its provenance saying none shares a run with
    MT-bench. The manifest records the filter, so such chunks are refused."""
    from specserve.train import pipeline, self_prompts

    target, _, distill, _, cfg = _tiny_train_draft()
    tok = _SelfWritingTokenizer()

    def ask(prefix: list[int], n: int, seed: int) -> list[list[int] | None]:
        return [tok.encode(t) for t in ("Prove the Pythagorean theorem.", "a harmless request of mine")[:n]]

    settings = replace(cfg, self_prompts=2, data=replace(cfg.data, num_prompts=0))
    older = self_prompts.BannedRuns.of([])  # a filter that bans nothing
    monkeypatch.setattr(pipeline, "mt_bench_runs", lambda: older)
    pipeline.train_draft(target, tok, distill, settings, tmp_path / "w", tmp_path / "h0", ask=ask, log=lambda _: None)
    assert json.loads((tmp_path / "h0" / "provenance.json").read_text())["data"]["self_prompts_kept"] == 2
    monkeypatch.setattr(pipeline, "mt_bench_runs", self_prompts.mt_bench_runs)
    with pytest.raises(SettingsError, match=r"data written with other settings \(filter: "):
        pipeline.train_draft(
            target, tok, distill, settings, tmp_path / "w", tmp_path / "h1", ask=ask, log=lambda _: None
        )
    pipeline.train_draft(target, tok, distill, settings, tmp_path / "w2", tmp_path / "h2", ask=ask, log=lambda _: None)
    assert json.loads((tmp_path / "h2" / "provenance.json").read_text())["data"]["self_prompts_kept"] == 1


def test_data_written_for_another_eos_is_not_reused(tmp_path: Path) -> None:
    """EOS decides where greedy answers stop and ends every text answer: a tokenizer whose EOS moved between two of
    its special tokens had the same fingerprint, and its old chunks were mixed with new ones."""
    from specserve.train.pipeline import tokenizer_fingerprint, train_draft

    target, tok, distill, _, cfg = _tiny_train_draft()
    other = _SpecialChatTokenizer()
    other.eos_token_id = 1  # (2 before: both special)
    assert sorted(other.all_special_ids) == sorted(tok.all_special_ids) and other.eos_token_id != tok.eos_token_id
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    train_draft(target, tok, distill, cfg, tmp_path / "w", tmp_path / "h0", log=lambda _: None)
    with pytest.raises(SettingsError, match=r"data written with other settings \(eos_ids: .*tokenizer: "):
        train_draft(target, other, distill, cfg, tmp_path / "w", tmp_path / "h1", log=lambda _: None)


def test_a_fine_tune_keeps_its_heads_draft_vocabulary_size_unless_told_otherwise(tmp_path: Path) -> None:
    """--init-head says it keeps the head's vocabulary, but the size was --draft-vocab's default (8192): a head
    trained with 16384 ids came out drafting over 8192. Here: trained with 64, fine-tuned without a size."""
    from specserve.train.pipeline import DRAFT_VOCAB, train_draft
    from specserve.train.trainer import trained_vocab_size

    target, tok, distill, train, cfg = _tiny_train_draft()
    assert target.cfg.vocab_size < DRAFT_VOCAB  # (the default alone is refused for this 512-token target)
    train_draft(target, tok, distill, replace(cfg, draft_vocab=64), tmp_path / "w0", tmp_path / "h", log=lambda _: None)
    assert trained_vocab_size(tmp_path / "h") == 64 and trained_vocab_size(tmp_path) is None
    start = replace(train, init_head=tmp_path / "h", lr=1e-4)
    for size, out in ((None, "kept"), (96, "told")):
        tuned = replace(cfg, draft_vocab=size, train=start)
        train_draft(target, tok, distill, tuned, tmp_path / f"w-{out}", tmp_path / out, log=lambda _: None)
        assert load_eagle_head(tmp_path / out, target).draft_ids.numel() == (size or 64)
    (tmp_path / "h" / "provenance.json").write_text('{"draft_vocab": {"size": "many"}}')
    with pytest.raises(CorruptModelError, match=r"draft_vocab\.size must be a positive integer"):
        trained_vocab_size(tmp_path / "h")


def test_an_eagle3_fine_tune_notes_special_ids_its_own_vocabulary_lacks(tmp_path: Path) -> None:
    """An EAGLE-3 head keeps its own draft ids, but the note on special ids it lacks read the first --draft-vocab
    ids of its vocab_map.json: with a --draft-vocab larger than the head's 64 ids the note was not said."""
    from specserve.train.pipeline import train_draft

    target, tok, distill, train, cfg = _tiny_train_draft()
    e3 = replace(cfg, train=replace(train, kind=HeadKind.eagle3, aux_layers=(0, 1)), draft_vocab=64)
    train_draft(target, tok, distill, e3, tmp_path / "w0", tmp_path / "h", log=lambda _: None)

    class _MoreSpecial(_SpecialChatTokenizer):  # another target's tokenizer: a special id the head never kept
        all_special_ids = (1, 2, 499)

    tuned = replace(e3, draft_vocab=512, train=replace(e3.train, init_head=tmp_path / "h", lr=1e-4))
    said: list[str] = []
    train_draft(target, _MoreSpecial(), distill, tuned, tmp_path / "w1", tmp_path / "t", log=said.append)
    assert 499 not in load_eagle_head(tmp_path / "t", target).draft_ids.tolist()
    assert any("lacks this target's special ids [499]" in line for line in said), said
    assert any("keeps its own 64 draft ids; --draft-vocab 512 is not used" in line for line in said), said
    from specserve.train.trainer import trained_vocab_size

    assert trained_vocab_size(tmp_path / "t") == 64  # (the size it drafts over)


def test_a_checkpoint_trained_for_another_target_is_not_resumed(tmp_path: Path) -> None:
    """The data folder refuses another target's run, but with it rebuilt for the new target, the old checkpoint
    (which recorded only tokens: teacher-forced text is the same tokens whatever the target) resumed, trained no
    step, and shipped the first target's head as the second's."""
    from specserve.train.distill import Conversation
    from specserve.train.pipeline import train_draft

    target, tok, distill, _, cfg = _tiny_train_draft()
    train_draft(target, tok, distill, cfg, tmp_path / "w", tmp_path / "a", log=lambda _: None)
    other = tiny_model(seed=7)  # the same shapes and tokenizer, other weights
    for p in other.parameters():
        p.requires_grad_(False)

    def distill_other(prompts: list[list[int]], max_new_tokens: int, aux_layers: tuple[int, ...]) -> Any:
        convs = [Conversation(p + p[:max_new_tokens], len(p)) for p in prompts]
        return convs, target_features(other, convs, aux_layers)

    with pytest.raises(SettingsError, match="data"):  # the data folder: written for the first target
        train_draft(other, tok, distill_other, cfg, tmp_path / "w", tmp_path / "b", log=lambda _: None)
    shutil.rmtree(tmp_path / "w" / "data")
    with pytest.raises(SettingsError, match=r"ckpt\.pt was trained on other data"):
        train_draft(other, tok, distill_other, cfg, tmp_path / "w", tmp_path / "b", log=lambda _: None)


def test_train_draft_checks_the_starting_head_before_the_data_and_records_its_digest(tmp_path: Path) -> None:
    """train_draft end to end on the tiny target: a fine-tune written over its own starting head records the
    starting weights' digest (it hashed the new ones); a malformed vocabulary map in the starting head and a draft
    vocabulary smaller than the forced special ids fail before any data is made (were tracebacks after it)."""
    from specserve.errors import ModelSourceError
    from specserve.models.sources import sha256_file
    from specserve.train.pipeline import train_draft

    asked: list[int] = []
    target, tok, distill, train, cfg = _tiny_train_draft(asked)
    head_dir = tmp_path / "head"
    train_draft(target, tok, distill, cfg, tmp_path / "w0", head_dir, log=lambda _: None)
    before = sha256_file(head_dir / "model.safetensors")
    tuned = replace(cfg, train=replace(train, init_head=head_dir, lr=1e-4))
    train_draft(target, tok, distill, tuned, tmp_path / "w1", head_dir, log=lambda _: None)
    provenance = json.loads((head_dir / "provenance.json").read_text())
    assert provenance["init_head_sha256"] == before != provenance["sha256"]
    assert provenance["init_head_trained_for"] == "tiny"
    # a fine-tune on fewer prompts still counts its starting head's: the agreement benchmark's held-out prompts
    # started past the fine-tune's own 2, inside the 4 its starting head trained on
    from specserve.bench.agreement import trained_prompts

    fewer = replace(tuned, data=replace(tuned.data, num_prompts=2))
    train_draft(target, tok, distill, fewer, tmp_path / "w12", tmp_path / "h12", log=lambda _: None)
    seen = json.loads((tmp_path / "h12" / "provenance.json").read_text())["prompts_seen"]
    assert seen == {"seeds": 4, "lexicon": 0, "seed": 0}
    assert trained_prompts([str(tmp_path / "h12")]) == {"seeds": 4, "lexicon": 0}
    # prompts of another data seed are other prompts: the held-out sets (seed 0's past the count) may hold them
    other_seed = replace(tuned, data=replace(tuned.data, num_prompts=2, seed=3))
    train_draft(target, tok, distill, other_seed, tmp_path / "w13", tmp_path / "h13", log=lambda _: None)
    assert json.loads((tmp_path / "h13" / "provenance.json").read_text())["prompts_seen"]["seed"] is None  # mixed
    with pytest.raises(InvalidRequestError, match="several data seeds"):
        trained_prompts([str(head_dir), str(tmp_path / "h13")])
    assert trained_prompts([str(tmp_path / "h13")], ["mt-bench"])  # (MT-bench alone: compared)
    fresh = replace(cfg, data=replace(cfg.data, seed=3))
    train_draft(target, tok, distill, fresh, tmp_path / "w14", tmp_path / "h14", log=lambda _: None)
    with pytest.raises(InvalidRequestError, match="seeds prompts of data seed 3"):
        trained_prompts([str(tmp_path / "h14")], ["seeds"])
    said: list[str] = []  # a head trained for another target: fine-tuned (its shapes fit), with a note
    train_draft(
        target, tok, distill, replace(tuned, target_name="other"), tmp_path / "w7", tmp_path / "h7", log=said.append
    )
    assert any("was trained for tiny; fine-tuning it for other" in line for line in said)
    assert not any("special ids" in line for line in said)  # its vocabulary holds the tokenizer's special ids

    class _MoreSpecial(_SpecialChatTokenizer):  # another target's tokenizer: a special id the map never forced in
        all_special_ids = (1, 2, 499)

    said.clear()
    train_draft(target, _MoreSpecial(), distill, tuned, tmp_path / "w8", tmp_path / "h8", log=said.append)
    assert any("lacks this target's special ids [499]" in line for line in said), said

    asked.clear()
    (head_dir / "vocab_map.json").write_bytes(b'{"by_frequency": [1, 2')  # its digest, beside the weights, says so
    with pytest.raises(CorruptModelError, match=r"vocab_map\.json does not match model\.safetensors\.sha256"):
        train_draft(target, tok, distill, tuned, tmp_path / "w2", tmp_path / "h2", log=lambda _: None)
    record = head_dir / "model.safetensors.sha256"
    record.write_text(record.read_text().splitlines()[0] + "\n")  # the weights' digest alone: the map is read
    for broken in (b'{"by_frequency": [1, 2', b"\xff\xfe not UTF-8"):  # the second was a UnicodeDecodeError traceback
        (head_dir / "vocab_map.json").write_bytes(broken)
        with pytest.raises(ModelSourceError, match="vocabulary map"):
            train_draft(target, tok, distill, tuned, tmp_path / "w2", tmp_path / "h2", log=lambda _: None)
    with pytest.raises(SettingsError, match="cannot hold the 2 special ids"):
        train_draft(target, tok, distill, replace(cfg, draft_vocab=1), tmp_path / "w3", tmp_path / "h3")

    class _SpecialBeyond(_SpecialChatTokenizer):  # a ValueError traceback, after every conversation was made
        all_special_ids = (1, 2, 600)

    with pytest.raises(SettingsError, match=r"special ids \[600\] are outside the target's 512-token vocabulary"):
        train_draft(target, _SpecialBeyond(), distill, cfg, tmp_path / "w9", tmp_path / "h9")
    assert not (tmp_path / "w9").exists() or not any((tmp_path / "w9").rglob("chunk_*"))  # before any data
    with pytest.raises(SettingsError, match=r"larger than the target's vocabulary \(512\)"):  # was cut silently
        train_draft(target, tok, distill, replace(cfg, draft_vocab=10**6), tmp_path / "w6", tmp_path / "h6")
    too_long = replace(cfg.data, max_new_tokens=target.max_positions)
    with pytest.raises(SettingsError, match=f"max_new_tokens {target.max_positions}: answers that long do not fit"):
        train_draft(target, tok, distill, replace(cfg, data=too_long), tmp_path / "w4", tmp_path / "h4")
    lexicon = replace(cfg, lexicon_prompts=2, lexicon_max_new_tokens=target.max_positions - 1)
    with pytest.raises(SettingsError, match="lexicon_max_new_tokens"):
        train_draft(target, tok, distill, lexicon, tmp_path / "w5", tmp_path / "h5")
    assert asked == []  # no data was made for any
    said.clear()  # a fine-tune keeping its head's map forces nothing in: it notes the ids the map lacks, as before
    (head_dir / "vocab_map.json").write_text((tmp_path / "h8" / "vocab_map.json").read_text())
    train_draft(target, _SpecialBeyond(), distill, tuned, tmp_path / "w10", tmp_path / "h10", log=said.append)
    assert any("lacks this target's special ids [600]" in line for line in said), said

    class _WrapsBeyond(_SpecialChatTokenizer):  # a template emitting 600: the embedding's IndexError in the data step
        def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[int]:
            return [600, *super().apply_chat_template(messages)]

    asked.clear()
    for settings, head in ((tuned, "h11"), (cfg, "h13")):  # keeping the head's map, and with a new vocabulary
        with pytest.raises(SettingsError, match=r"chat template encodes ids \[600\] outside the target's 512-token"):
            train_draft(target, _WrapsBeyond(), distill, settings, tmp_path / f"w_{head}", tmp_path / head)
    assert asked == []
    # answers that fit the positions alone, not after their prompts: the data step found a lexicon prompt too long
    # only after the seed prompts' data (hours, on the real target)
    asked.clear()
    near = target.max_positions - 3
    wn = _mini_wordnet(tmp_path / "wn", "a sleeveless garment")
    for settings, name in (
        (replace(cfg, data=replace(cfg.data, max_new_tokens=near)), "max_new_tokens"),
        (replace(cfg, lexicon_prompts=2, lexicon_max_new_tokens=near, wordnet_dir=wn), "lexicon_max_new_tokens"),
    ):
        with pytest.raises(SettingsError, match=rf"{name} {near}: the longest prompt \(\d+ tokens\) and its answer"):
            train_draft(target, tok, distill, settings, tmp_path / "w11", tmp_path / "h11")
    assert asked == []


class _SystemTurnTokenizer(_SpecialChatTokenizer):
    """The same vocabulary and weights with a chat template that adds a default system turn."""

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: object) -> list[int]:
        return [1, 7, 7, 7, *super().apply_chat_template(messages, **kw)[1:]]


def test_a_training_run_into_a_heads_folder_cut_short_in_its_writes_leaves_no_stale_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rerun into an existing head's folder replaced the weights, then wrote the rest: stopped before the digest,
    it left the new weights beside the old digest, and every load of the folder refused them from then on."""
    from specserve.train import pipeline, trainer
    from specserve.train.pipeline import train_draft

    target, tok, distill, train, cfg = _tiny_train_draft()
    head_dir = tmp_path / "head"
    train_draft(target, tok, distill, cfg, tmp_path / "w0", head_dir, log=lambda _: None)
    load_eagle_head(head_dir, target)

    def disk_full(out: Path, info: dict[str, object]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "write_provenance", disk_full)
    again = replace(cfg, train=replace(train, lr=3e-3, seed=1))  # other weights
    with pytest.raises(OSError, match="No space left"):
        train_draft(target, tok, distill, again, tmp_path / "w1", head_dir, log=lambda _: None)
    assert not (head_dir / "model.safetensors.sha256").exists()
    assert not (head_dir / "provenance.json").exists()  # the old run's record, beside other weights, is gone too
    load_eagle_head(head_dir, target)  # the new weights, unchecked (was: "does not match model.safetensors.sha256")
    monkeypatch.setattr(pipeline, "write_provenance", trainer.write_provenance)
    train_draft(target, tok, distill, again, tmp_path / "w2", head_dir, log=lambda _: None)
    assert (head_dir / "model.safetensors.sha256").exists() and load_eagle_head(head_dir, target) is not None
    assert not list(head_dir.glob(".*.tmp"))


@pytest.mark.parametrize("name", ["config.json", "vocab_map.json"])
def test_a_heads_file_cut_short_while_written_is_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Each of a head's files is written whole (to a temporary file, then renamed): a rerun into the folder that
    dies mid-write (a full disk) leaves the old file, not half a JSON document."""
    from specserve.train.pipeline import train_draft

    target, tok, distill, train, cfg = _tiny_train_draft()
    head_dir = tmp_path / "head"
    train_draft(target, tok, distill, cfg, tmp_path / "w0", head_dir, log=lambda _: None)
    before = (head_dir / name).read_text()
    real_write_text = Path.write_text

    def torn(path: Path, data: str, *args: Any, **kwargs: Any) -> int:
        if name in path.name:
            real_write_text(path, data[: len(data) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real_write_text(path, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", torn)
    again = replace(cfg, train=replace(train, lr=3e-3, seed=1))
    with pytest.raises(OSError, match="No space left"):
        train_draft(target, tok, distill, again, tmp_path / "w1", head_dir, log=lambda _: None)
    assert (head_dir / name).read_text() == before and json.loads(before)


def test_a_changed_chat_template_under_the_same_weights_is_not_served_the_old_data(tmp_path: Path) -> None:
    """A rerun in the same work dir with another chat template was handed the old template's chunks and
    checkpoint and shipped the old head: the data step records the tokenizer, and the checkpoint its system
    prefix."""
    from specserve.train.distill import Conversation, DistillConfig
    from specserve.train.pipeline import TrainDraftConfig, tokenizer_fingerprint, train_draft

    target = _frozen_target()

    def distill(prompts: list[list[int]], max_new_tokens: int, aux_layers: tuple[int, ...]):
        convs = [Conversation(p + p[:max_new_tokens], len(p)) for p in prompts]
        return convs, target_features(target, convs, aux_layers)

    old, new = _SpecialChatTokenizer(), _SystemTurnTokenizer()
    assert tokenizer_fingerprint(old) == tokenizer_fingerprint(_SpecialChatTokenizer()) != tokenizer_fingerprint(new)
    train = TrainConfig(epochs=1, batch_tokens=64, max_len=64, warmup_steps=1, checkpoint_every=100)
    cfg = TrainDraftConfig("tiny", DistillConfig(num_prompts=4, max_new_tokens=4, chunk_size=4), train, draft_vocab=64)
    train_draft(target, old, distill, cfg, tmp_path / "w", tmp_path / "h0", log=lambda _: None)
    # the checkpoint's system prefix is read first (before the data step); without it, the data's tokenizer
    with pytest.raises(SettingsError, match=r"ckpt\.pt was trained with another chat template"):
        train_draft(target, new, distill, cfg, tmp_path / "w", tmp_path / "h1", log=lambda _: None)
    (tmp_path / "w" / "train" / "ckpt.pt").unlink()
    with pytest.raises(SettingsError, match=r"data written with other settings \(tokenizer: "):
        train_draft(target, new, distill, cfg, tmp_path / "w", tmp_path / "h1", log=lambda _: None)
    samples, ids = _training_setup(HeadKind.eagle)[1:]
    small = _ttt_config(HeadKind.eagle, epochs=1, batch_tokens=96, max_len=64, warmup_steps=1, checkpoint_every=1)
    train_head(target, samples, ids, small, tmp_path / "t", system_len=2, max_steps=1)
    with pytest.raises(SettingsError, match="with another chat template"):
        train_head(target, samples, ids, small, tmp_path / "t", system_len=5)


def test_the_progress_bar_times_the_steps_of_this_process_after_a_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed at step 50, each step taking a second: the rate is 1 s/step (it divided the time since the resume by
    all 60 steps) and the first line comes at once, not at step 1 or the next tenth."""
    from specserve.train import pipeline

    now = [0.0]
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: now[0])
    lines: list[str] = []
    bar = pipeline._progress(lines.append)
    for step in range(51, 61):
        now[0] += 1.0
        bar(step, 100, 1.0, {})
    assert lines[0].startswith("train: step 51/100") and "(1.0s/step, 1 min left)" in lines[0]
    assert lines[-1].startswith("train: step 60/100") and "(1.0s/step, 1 min left)" in lines[-1]


def test_provenance_records_the_text_passages_used_not_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This Python's stdlib documents ~1354 names: --text-passages 5000 used those and recorded 5000, and said
    nothing (a short --corpus says so)."""
    from specserve.train import pipeline

    target, _, distill, _, cfg = _tiny_train_draft()

    class _TextTokenizer(_SpecialChatTokenizer):  # encodes a passage's characters as ids, as chat_ids does
        def encode(self, text: str, **_: object) -> list[int]:
            return [ord(c) % 500 + 3 for c in text]

    tok = _TextTokenizer()
    given: list[int] = []

    def few(n: int, seed: int = 0) -> list[tuple[str, str]]:
        given.append(n)
        return [("a", "b c"), ("b", "c a")]

    monkeypatch.setattr(pipeline, "text_passages", few)
    said: list[str] = []
    pipeline.train_draft(
        target, tok, distill, replace(cfg, text_passages=5), tmp_path / "w", tmp_path / "h", log=said.append
    )
    provenance = json.loads((tmp_path / "h" / "provenance.json").read_text())
    assert given == [5] and provenance["data"]["text_passages"] == 2
    assert any("--text-passages 5: the stdlib's docstrings give 2; using those" in line for line in said), said


@pytest.mark.real_model
def test_prompts_rendered_by_a_template_that_prints_the_date_do_not_change_with_the_clock() -> None:
    """Llama 3's template prints strftime_now's date unless given a date_string: the data (and the tokenizer
    fingerprint a resume checks) would depend on the day it was written. Here the clock is read to the microsecond,
    so two renderings differ unless the date is fixed."""
    import copy

    from specserve.config import ModelSpec
    from specserve.models.loader import load_tokenizer
    from specserve.train.distill import TRAINING_DATE, chat_ids
    from specserve.train.pipeline import tokenizer_fingerprint

    tokenizer = copy.deepcopy(load_tokenizer(ModelSpec()))
    tokenizer.chat_template = (
        '{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y %H:%M:%S.%f") %}'
        "{%- endif %}<|im_start|>system\nToday Date: {{ date_string }}<|im_end|>\n"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    first = chat_ids(tokenizer, "Name a river.")
    assert TRAINING_DATE in tokenizer.decode(first)
    assert chat_ids(tokenizer, "Name a river.") == first
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(tokenizer)
    assert f"Today Date: {TRAINING_DATE}<|im_end|>" in tokenizer.decode(user_turn_prefix(tokenizer))


def test_a_checkpoint_this_run_cannot_resume_is_refused_before_any_data(tmp_path: Path) -> None:
    """A finished run leaves its ckpt.pt in the work dir: a rerun there with other training settings (--epochs) and
    more prompts made all its data first (hours on the CPU), then stopped on that checkpoint."""
    from specserve.train.pipeline import train_draft

    asked: list[int] = []
    target, tok, distill, train, cfg = _tiny_train_draft(asked)
    train_draft(target, tok, distill, cfg, tmp_path / "w", tmp_path / "h", log=lambda _: None)
    asked.clear()
    more = replace(cfg, data=replace(cfg.data, num_prompts=8), train=replace(train, epochs=2))
    with pytest.raises(SettingsError, match=r"ckpt\.pt was written with other settings"):
        train_draft(target, tok, distill, more, tmp_path / "w", tmp_path / "h", log=lambda _: None)
    assert asked == []  # refused before the target answered a prompt
    train_draft(target, tok, distill, cfg, tmp_path / "w", tmp_path / "h", log=lambda _: None)  # the same: resumes
    assert asked == []  # (its data is on disk)
