"""Speculative decoding end to end: lossless greedy output for every method, DDD stopping, statistics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specserve.config import ChainDraft, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import InvalidRequestError, UnsupportedModelError
from specserve.messages import ProposeItem
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from specserve.policy import DSDEConfig
from specserve.sampling import SamplingParams
from specserve.sequence import FinishReason
from specserve.workers import DraftWorker
from tests.conftest import greedy_reference

PROMPTS = [[5, 9, 13], [100, 200, 300, 400, 7, 8, 9], [42], [7, 7, 7, 7, 7, 1, 2]]
METHODS = [
    SpecConfig(method=SpecMethod.chain, sl=3),
    SpecConfig(method=SpecMethod.chain, sl=6, chain_draft=ChainDraft.greedy),
    SpecConfig(method=SpecMethod.eagle2, tree_depth=4, beam_width=3, budget=12),
    SpecConfig(method=SpecMethod.ddd, beam_width=3, budget=12, ddd_max_depth=7, ddd_check_steps=(2, 4, 6)),
]


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(seed=0)


@pytest.mark.parametrize("noise", [0.0, 0.02, 0.1])
@pytest.mark.parametrize("spec", METHODS, ids=lambda s: f"{s.method.value}-{s.chain_draft.value}")
def test_greedy_output_equals_plain_greedy(target: LlamaModel, spec: SpecConfig, noise: float) -> None:
    draft = noisy_copy(target, noise, seed=3)
    engine = Engine(target, None, draft=draft, speculation=spec, max_batch_size=3, eos_token_ids=set())
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=16))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 16)
        assert out.stats.draft_steps == out.stats.target_forwards
    if noise == 0.0:  # a draft identical to the target gets every token accepted (chains: tau = SL + 1)
        for out in outs:
            # at least the first draft of every step: the target's greedy token is the draft's top child, which
            # every tree keeps (the highest-scored node of level 1)
            assert out.stats.accepted >= out.stats.target_forwards
            if spec.method == SpecMethod.chain:
                assert out.stats.accepted == out.stats.drafted  # an identical draft is never rejected
                assert out.stats.tokens_per_forward >= min(16, spec.sl + 1) * 0.75
    assert engine.loop.target.cache.num_free == 3 and engine.loop.draft.cache.num_free == 3  # type: ignore[union-attr]


def test_acceptance_falls_with_draft_noise(target: LlamaModel) -> None:
    taus = []
    for noise in (0.0, 0.02, 0.1):
        engine = Engine(target, None, draft=noisy_copy(target, noise), speculation=METHODS[0], eos_token_ids=set())
        stats = [o.stats for o in engine.generate(PROMPTS, SamplingParams(max_tokens=24))]
        taus.append(sum(s.accepted for s in stats) / sum(s.drafted for s in stats))
    assert taus[0] == 1.0 and taus[0] > taus[1] > taus[2]


def test_mixed_methods_in_one_batch_and_per_request_override(target: LlamaModel) -> None:
    engine = Engine(target, None, draft=noisy_copy(target, 0.3), speculation=METHODS[0], eos_token_ids=set())
    rids = [
        engine.submit(p, SamplingParams(max_tokens=12), speculation=s) for p, s in zip(PROMPTS, METHODS, strict=True)
    ]
    rids.append(
        engine.submit(PROMPTS[0], SamplingParams(max_tokens=12), speculation=SpecConfig(method=SpecMethod.none))
    )
    got: dict[str, list[int]] = {r: [] for r in rids}
    while engine.loop.has_work:
        for out in engine.loop.step():
            got[out.request_id] += out.token_ids
    for rid, prompt in zip(rids, [*PROMPTS, PROMPTS[0]], strict=True):
        assert got[rid] == greedy_reference(target, prompt, 12)


def test_sampling_with_speculation_is_seeded_and_valid(target: LlamaModel) -> None:
    draft = noisy_copy(target, 0.3)
    for spec in METHODS:
        engine = Engine(target, None, draft=draft, speculation=spec, eos_token_ids=set())
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20)
        a = engine.generate(PROMPTS[:2], params)
        b = engine.generate(PROMPTS[:2], params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert all(len(o.token_ids) == 20 for o in a)
        assert all(0 <= t < target.cfg.vocab_size for o in a for t in o.token_ids)


def test_vocab_mismatch_and_missing_draft_are_clear_errors(target: LlamaModel) -> None:
    other = tiny_model(tiny_config(vocab_size=300))
    with pytest.raises(UnsupportedModelError, match="vocabulary"):
        Engine(target, None, draft=other)
    plain = Engine(target, None, eos_token_ids=set())
    with pytest.raises(InvalidRequestError, match="needs a draft model") as missing:
        plain.generate(PROMPTS[0], speculation=METHODS[0])
    small = Engine(target, None, draft=target, spec_headroom=8, eos_token_ids=set())
    with pytest.raises(InvalidRequestError, match="reserves room for") as wide:
        small.generate(PROMPTS[0], speculation=SpecConfig(method=SpecMethod.eagle2, budget=60))
    assert missing.value.param == wide.value.param == "speculation"  # the 400's param: the request field at fault
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer") as stop:
        plain.generate(PROMPTS[0], SamplingParams(stop=["."]))
    assert stop.value.param == "stop"
    # a chain's request-level max_sl bounds what it verifies: SL 64 (or DSDE's hard maximum 64) under max_sl 4 fits
    for long in (SpecConfig(sl=64), SpecConfig(policy=SLPolicyKind.dsde, dsde=DSDEConfig(sl_hard_max=64))):
        assert long.model_copy(update={"max_sl": 4}).max_verify_tokens == 5
        with pytest.raises(InvalidRequestError, match="reserves room for"):
            small.generate(PROMPTS[0], SamplingParams(max_tokens=4), speculation=long)
        out = small.generate(
            PROMPTS[0], SamplingParams(max_tokens=4), speculation=long.model_copy(update={"max_sl": 4})
        )
        assert out[0].token_ids == greedy_reference(target, PROMPTS[0], 4)


def test_accepted_drafts_count_only_what_was_emitted(target: LlamaModel) -> None:
    """A step that runs past max_tokens (or EOS, or a stop string) accepts drafts that are cut: usage's acceptance
    and the accepted-tokens metric counted them (a perfect draft of 8 at max_tokens 2: 8 accepted, 2 emitted)."""
    engine = Engine(target, None, draft=target, speculation=SpecConfig(sl=8), eos_token_ids=set())
    for max_tokens in (1, 2, 5, 23):
        out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=max_tokens))[0]
        assert len(out.token_ids) == max_tokens
        assert out.stats.accepted + out.stats.target_forwards == max_tokens  # a perfect draft: every token counted
        assert out.stats.drafted >= out.stats.accepted
    reference = greedy_reference(target, PROMPTS[0], 24)
    eos = reference[6]  # the step that reaches it emits the tokens before it and the EOS, not what follows
    first = reference.index(eos)
    stopping = Engine(target, None, draft=target, speculation=SpecConfig(sl=8), eos_token_ids={eos})
    out = stopping.generate(PROMPTS[0], SamplingParams(max_tokens=24))[0]
    assert out.token_ids == reference[:first] and out.finish_reason == FinishReason.stop
    assert out.stats.accepted + out.stats.target_forwards == first + 1


class ScriptedDraft(LlamaModel):
    """A draft that puts mass ``top`` on token 10 and spreads the rest thinly: the beam's mass is H_d ~ d log(top)."""

    def __init__(self, base: LlamaModel, top: float) -> None:
        super().__init__(base.hf_config)
        self.load_state_dict(base.state_dict())
        self.top = top

    def forward(self, batch, cache):  # type: ignore[no-untyped-def, override]
        out = super().forward(batch, cache)  # keeps the KV bookkeeping real
        vocab = out.shape[-1]
        logits = torch.full_like(out, float(torch.log(torch.tensor((1 - self.top) / (vocab - 1)))))
        logits[:, 10] = float(torch.log(torch.tensor(self.top)))
        return logits


def propose_once(draft: LlamaModel, spec: SpecConfig) -> tuple[int, int]:
    worker = DraftWorker(draft, num_slots=1, max_len=128)
    worker.add(0, SamplingParams(), 4)
    prop = worker.propose([ProposeItem(0, [1, 2, 3, 4], [], spec.static_depth, spec)])[0]
    return prop.depth, worker.h_reads


def test_ddd_stops_exactly_where_h_crosses_the_threshold(target: LlamaModel) -> None:
    # H_d = d log 0.9 = -0.105 d (plus ~1e-3): first below x = -0.3 at d = 3. Checked at {2, 4, 6}: stop at 4.
    draft = ScriptedDraft(target, top=0.9)
    spec = SpecConfig(
        method=SpecMethod.ddd, beam_width=2, budget=60, ddd_max_depth=9, ddd_check_steps=(2, 4, 6), ddd_threshold=-0.3
    )
    assert propose_once(draft, spec) == (4, 2)  # H read on the host at depths 2 and 4 only
    every = spec.model_copy(update={"ddd_check_every_step": True})
    assert propose_once(draft, every) == (3, 3)  # read after every level: stops at the first crossing
    assert propose_once(draft, spec.model_copy(update={"ddd_threshold": -5.0})) == (9, 3)  # never crosses
    assert propose_once(ScriptedDraft(target, top=0.5), spec) == (2, 1)  # H_2 = -1.39: stops at the first check
    eagle2 = SpecConfig(method=SpecMethod.eagle2, beam_width=2, budget=60, tree_depth=5)
    assert propose_once(draft, eagle2) == (5, 0)  # fixed depth never reads H


def test_ddd_sequences_stop_independently_in_one_batch(target: LlamaModel) -> None:
    """Each sequence of a batch stops on its own H, at a check step or its depth budget: the same tree as drafted
    alone, and the batch's depths differ (the test had asserted only what the depth budgets and the rerank hold
    anyway, so it passed with DDD's stop rule switched off)."""
    draft = noisy_copy(target, 0.5)
    spec = SpecConfig(
        method=SpecMethod.ddd, beam_width=3, budget=30, ddd_max_depth=8, ddd_check_steps=(2, 4, 6), ddd_threshold=-2.0
    )

    def propose(ids: list[int]) -> list[Any]:
        worker = DraftWorker(draft, num_slots=4, max_len=128)
        for i in ids:
            worker.add(i, SamplingParams(), len(PROMPTS[i]))
        return worker.propose([ProposeItem(i, PROMPTS[i], [], 8, spec) for i in ids])

    batch = propose([0, 1, 2, 3])
    alone = [propose([i])[0] for i in range(4)]
    assert [(p.tokens, p.parents, p.depth) for p in batch] == [(p.tokens, p.parents, p.depth) for p in alone]
    depths = [p.depth for p in batch]
    assert set(depths) <= {2, 4, 6, 8} and len(set(depths)) > 1  # stopped at check steps, not all at one
    for p in batch:
        assert len(p.tokens) == len(p.parents) <= spec.budget - 1
        assert all(0 <= par <= i for i, par in enumerate(p.parents))  # parents precede children


def test_recover_after_worker_restart_continues_the_same_greedy_output(target: LlamaModel) -> None:
    from specserve.workers import TargetWorker

    draft = noisy_copy(target, 0.02)
    engine = Engine(target, None, draft=draft, speculation=METHODS[2], eos_token_ids=set())
    rid = engine.submit(PROMPTS[1], SamplingParams(max_tokens=20))
    tokens: list[int] = []
    for step in range(40):
        if step == 2:  # both workers die: fresh ones with empty caches take over
            engine.loop.target = TargetWorker(target, num_slots=16, max_len=256)
            engine.loop.draft = DraftWorker(draft, num_slots=16, max_len=256)
            engine.loop.recover(target=True, draft=True)
        for out in engine.loop.step():
            if out.request_id == rid:
                tokens += out.token_ids
        if not engine.loop.has_work:
            break
    assert tokens == greedy_reference(target, PROMPTS[1], 20)


FULL_DEPTH_TREES = [  # an identical draft passes every depth check (x = -30): every step drafts the whole depth
    SpecConfig(method=SpecMethod.ddd, ddd_threshold=-30.0),  # n = 11, w = 10: 100 rows past the root
    SpecConfig(method=SpecMethod.eagle2, tree_depth=12, budget=60),
]


@pytest.mark.parametrize("spec", FULL_DEPTH_TREES, ids=lambda s: s.method.value)
def test_full_depth_trees_run_to_the_end_of_the_context(target: LlamaModel, spec: SpecConfig) -> None:
    """A tree's levels append w rows each to the draft's KV past the committed tokens; the slot has room for them
    (the headroom counts them), so a sequence decodes up to max_model_len and ends with `length` as plain decoding
    does, instead of overflowing its draft slot in its last steps."""
    assert spec.max_draft_rows == (spec.static_depth - 1) * spec.beam_width > spec.max_verify_tokens
    engine = Engine(target, None, draft=noisy_copy(target, 0.0), speculation=spec, max_model_len=200,
                    eos_token_ids=set())  # fmt: skip
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=1000))[0]
    assert out.finish_reason.value == "length" and out.token_ids == greedy_reference(target, PROMPTS[0], 197)
    assert engine.loop.spec_headroom >= spec.max_draft_rows


def test_a_requests_trees_are_cut_to_the_engines_room(target: LlamaModel) -> None:
    """A request asking for deeper trees than the engine's KV slots have room for drafts shallower ones (its draft
    model's depth capped), with the same output, to the end of the context."""
    engine = Engine(target, None, draft=noisy_copy(target, 0.0), speculation=METHODS[0], max_model_len=200,
                    eos_token_ids=set())  # fmt: skip
    room = engine.loop.spec_headroom
    deep = FULL_DEPTH_TREES[0]
    assert deep.max_draft_rows > room
    fitted = deep.fit_draft_rows(room)
    assert fitted.max_draft_rows <= room and fitted.model_max_sl == 1 + room // deep.beam_width
    assert deep.fit_draft_rows(deep.max_draft_rows) is deep and METHODS[0].fit_draft_rows(0) is METHODS[0]
    rid = engine.submit(PROMPTS[1], SamplingParams(max_tokens=1000), speculation=deep)
    tokens, finish = [], None
    while engine.loop.has_work:
        for out in engine.loop.step():
            if out.request_id == rid:
                tokens += out.token_ids
                finish = out.finish_reason or finish
    assert finish is not None and finish.value == "length"
    assert tokens == greedy_reference(target, PROMPTS[1], 200 - len(PROMPTS[1]))


@pytest.mark.parametrize("spec", [METHODS[1], METHODS[3]], ids=["chain", "ddd"])
def test_nothing_is_drafted_past_max_tokens_or_the_context(target: LlamaModel, spec: SpecConfig) -> None:
    """A step emits its accepted drafts and one token of the target's, so drafting more than the tokens left costs
    draft levels and verify rows for nothing (and counted those drafts as accepted: a 2-token answer reported tau
    7). With an identical draft every drafted level is accepted, and every forward's tokens are output but for the
    one draft of a step with a single token left (a step planned to speculate still drafts one), which is not
    counted as accepted."""
    draft = noisy_copy(target, 0.0, seed=3)
    prompt = PROMPTS[1]
    for max_tokens, max_model_len in [(1, 64), (2, 64), (7, 64), (16, 16)]:
        engine = Engine(target, None, draft=draft, speculation=spec, eos_token_ids=set(), max_model_len=max_model_len)
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]
        n = min(max_tokens, max_model_len - len(prompt))
        assert out.token_ids == greedy_reference(target, prompt, n)
        # every drafted level accepted, and counted where it was output: all but a last step's one draft with a
        # single token left (the step's first token is its forward's own); accepted + forwards = tokens output
        assert out.stats.depth_sum - out.stats.accepted in (0, 1)
        assert out.stats.accepted + out.stats.target_forwards == n, (max_tokens, max_model_len, out.stats)


def test_a_sequences_unsent_tokens_are_its_context_from_an_index() -> None:
    """``unsent(seen)`` slices the output past the prompt instead of building the whole context each step: the same
    tokens from every index, in the prompt, at its end and in the output."""
    from specserve.sequence import Request, Sequence

    seq = Sequence(0, Request("r", [1, 2, 3, 4], SamplingParams()), None, output=[5, 6, 7])  # type: ignore[arg-type]
    assert [seq.unsent(seen) for seen in range(9)] == [[1, 2, 3, 4, 5, 6, 7][seen:] for seen in range(9)]
    assert seq.length == 7


def test_an_empty_batch_is_an_empty_answer_from_every_worker(target: LlamaModel) -> None:
    """The head's drafter answered [] and the others a bare ValueError from the forward batch: the same call, two
    contracts."""
    from specserve.models.tiny import tiny_head
    from specserve.workers import HeadDraftWorker, TargetWorker

    assert TargetWorker(target, num_slots=2, max_len=64).verify([]) == []
    assert DraftWorker(noisy_copy(target, 0.1), num_slots=2, max_len=64).propose([]) == []
    assert HeadDraftWorker(tiny_head(target), num_slots=2, max_len=64).propose([]) == []
