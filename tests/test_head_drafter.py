"""The EAGLE-head drafter inside the engine: lossless for every drafting method, and fed with the target's own
hidden states at the right positions (docs/algorithms.md §8.3)."""

from __future__ import annotations

import pytest
import torch

from specserve.config import ChainDraft, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.guard import Outlook, ThroughputGuard
from specserve.messages import Proposal, ProposeItem
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_model
from specserve.policy.tree_floor import TreeFloor
from specserve.sampling import SamplingParams
from specserve.spec_decode.eagle_head import EagleHead, EagleHeadConfig, HeadKind
from specserve.workers import HeadDraftWorker

METHODS = [
    SpecConfig(method=SpecMethod.chain, sl=4, chain_draft=ChainDraft.greedy),
    SpecConfig(method=SpecMethod.eagle2, beam_width=8, budget=30, tree_depth=5),
    SpecConfig(method=SpecMethod.ddd, beam_width=8, budget=30),
    SpecConfig(method=SpecMethod.ddd, beam_width=8, budget=30, policy=SLPolicyKind.dsde),
]


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(seed=0)


def random_head(target: LlamaModel, kind: HeadKind = HeadKind.eagle, std: float = 0.2) -> EagleHead:
    extra = {"kind": kind, "aux_layers": (0, 1)} if kind == HeadKind.eagle3 else {}
    if kind == HeadKind.eagle3:
        extra["draft_vocab_size"] = target.cfg.vocab_size // 2
    head = EagleHead(EagleHeadConfig.for_target(target, **extra), target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    if kind == HeadKind.eagle3:  # d2t: draft row i is target id 2i
        head.draft_ids = torch.arange(0, target.cfg.vocab_size, 2)
    return head.eval()


PROMPTS = [[5, 9, 33, 71, 2 + i] for i in range(4)]


def last_token_target() -> LlamaModel:
    """A target whose next-token logits are lm_head(embed(t)) of the last token t: its layers add nothing, its
    embeddings have RMS 1 and its final norm weight is 1 (the norm then leaves them as they are)."""
    target = tiny_model(seed=0)
    with torch.no_grad():
        e = target.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
        target.norm.fill_(1.0)
        for layer in target.decoder_layers():
            layer.o_proj.weight.zero_()
            layer.down.weight.zero_()
    return target


def near_head(target: LlamaModel, noise: float) -> EagleHead:
    """An EAGLE head that passes its token's embedding through (fc = [I + noise; 0], a layer that adds nothing):
    over a last-token target its q is the target's p but for the noise, so it drafts what the target accepts."""
    head = random_head(target)
    h = target.cfg.hidden_size
    with torch.no_grad():
        head.layer.o_proj.weight.zero_()
        head.layer.down.weight.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h) + noise * torch.randn(h, h, generator=torch.Generator().manual_seed(7))
    return head


def test_a_full_size_draft_vocabulary_in_another_order_is_mapped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A published EAGLE-3 head may map its V draft columns onto the target's V ids in another order (d2t not 0):
    the worker took a full-size vocabulary for the identity and drafted column c as target id c. The same head
    with its LM-head rows permuted and that permutation as its d2t must draft exactly what it drafts."""
    from specserve.spec_decode.head_checkpoint import load_eagle_head, save_eagle_head

    target = tiny_model(seed=0)
    vocab = target.cfg.vocab_size
    cfg = EagleHeadConfig.for_target(target, kind=HeadKind.eagle3, aux_layers=(0, 1), draft_vocab_size=vocab)
    plain = EagleHead(cfg, target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in plain.parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    perm = torch.randperm(vocab, generator=gen)
    permuted = EagleHead(cfg, target)
    permuted.load_state_dict(plain.state_dict())
    with torch.no_grad():
        permuted.lm_head.weight.copy_(plain.lm_head.weight[perm])
    permuted.draft_ids = perm
    save_eagle_head(permuted, tmp_path / "permuted", dtype=torch.float32)
    loaded = load_eagle_head(tmp_path / "permuted", target)
    assert torch.equal(loaded.draft_ids, perm) and loaded.maps_draft_ids and not plain.maps_draft_ids
    spec = SpecConfig(method=SpecMethod.eagle2, beam_width=3, budget=8, tree_depth=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    drafts: list[list[list[int]]] = []
    for head in (plain.eval(), loaded.eval()):
        engine = Engine(target, None, draft=head, speculation=spec, eos_token_ids=set(), max_batch_size=4)
        worker = engine.loop.draft
        assert isinstance(worker, HeadDraftWorker)
        seen: list[list[int]] = []
        propose = worker.propose

        def spy(items, propose=propose, seen=seen):  # type: ignore[no-untyped-def]
            return [seen.append(p.tokens) or p for p in propose(items)]

        worker.propose = spy  # type: ignore[method-assign]
        engine.generate(PROMPTS, params)
        drafts.append(seen)
    assert len(drafts[0]) > 10 and drafts[0] == drafts[1]  # the same target ids, drafted in the same trees


def test_a_draft_vocabulary_set_after_the_move_lives_on_the_heads_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader moves a head to its device and then sets its draft vocabulary from CPU ids: on CUDA the ids
    stayed on the CPU, and indexing the device's logits or its cache with them raised (the meta device stands in;
    the LM head's slice, which copies data, is tests/test_cuda.py's)."""
    target = tiny_model(seed=0)  # (its own: the move takes the head's modules along)
    head = random_head(target).to("meta")
    monkeypatch.setattr(head, "_slice_lm_head", lambda: None)
    head.set_draft_vocab(torch.arange(0, target.cfg.vocab_size, 2))
    assert head.draft_ids.device.type == "meta" and head.draft_ids.dtype == torch.long


def _plain(target: LlamaModel, params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for c in Engine(target, None, eos_token_ids=set()).generate(PROMPTS, params)]


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: f"{s.method.value}-{s.policy.value}")
def test_head_drafting_is_greedy_equal(target: LlamaModel, spec: SpecConfig) -> None:
    """A random head (its drafts nearly all rejected) and one the target mostly accepts (the accepted path's
    commits, KV rollback and features in play)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    agreeing = last_token_target()
    for model, head in ((target, random_head(target)), (agreeing, near_head(agreeing, 0.01))):
        engine = Engine(model, None, draft=head, speculation=spec, eos_token_ids=set(), max_batch_size=4)
        out = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in out] == _plain(model, params)
        assert all(o.stats.draft_steps >= (30 if model is target else 8) for o in out)  # every step after the first
    accepted, steps = sum(o.stats.accepted for o in out), sum(o.stats.draft_steps for o in out)
    assert accepted >= steps > 0, (accepted, steps)  # at least one drafted token accepted a step, on average


def test_trees_pruned_by_path_probability_stay_greedy_equal(target: LlamaModel) -> None:
    """``tree_min_prob`` verifies fewer nodes, some steps only the root, alongside sequences with full trees."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    head = random_head(target)
    drafted, steps = [], []
    for floor in (0.0, 0.6):
        spec = METHODS[2].model_copy(update={"tree_min_prob": floor})
        engine = Engine(target, None, draft=head, speculation=spec, eos_token_ids=set(), max_batch_size=4)
        out = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in out] == _plain(target, params)
        drafted.append(sum(o.stats.drafted for o in out))
        steps.append(sum(o.stats.draft_steps for o in out))
    assert 0 < drafted[1] < drafted[0]
    assert steps[1] < steps[0]  # steps whose tree kept no node verified the root alone


class _FixedFloor(TreeFloor):
    def floor(self, batch_size: int) -> float | None:
        return 0.6


def test_a_measured_floor_reaches_the_drafter_and_stays_greedy_equal(target: LlamaModel) -> None:
    """The loop's measured floor prunes trees exactly as the same fixed floor does; a real fit measures the steps."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    head = random_head(target)
    fixed = METHODS[2].model_copy(update={"tree_min_prob": 0.6})
    adaptive = METHODS[2].model_copy(update={"adaptive_floor": True})  # from tree_min_prob 0
    runs = []
    for spec, floor in ((fixed, None), (adaptive, _FixedFloor()), (adaptive, None)):
        engine = Engine(target, None, draft=head, speculation=spec, eos_token_ids=set(), max_batch_size=4)
        if floor is not None:
            engine.loop.planner.floor = floor
        out = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in out] == _plain(target, params)
        runs.append((sum(o.stats.drafted for o in out), sum(o.stats.draft_steps for o in out)))
        measured = engine.loop.planner.floor
    assert runs[1] == runs[0]
    assert measured is not None and measured.fits[4].steps >= 30  # every decoding step of the batch of 4
    # the rows varied enough for the slope to be read; its sign is timing noise here (a tiny model's row costs
    # ~10-20 us, and on a loaded CI host the fit once read none above zero), so only a slope kept is checked
    assert measured.fits[4].spread >= measured.min_spread and measured.tokens_per_s(4) is not None


def test_reduced_vocabulary_and_eagle3_heads_stay_lossless(target: LlamaModel) -> None:
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    reduced = random_head(target)
    reduced.set_draft_vocab(torch.arange(1, target.cfg.vocab_size, 3))
    for head in (reduced, random_head(target, HeadKind.eagle3)):
        engine = Engine(target, None, draft=head, speculation=METHODS[2], eos_token_ids=set(), max_batch_size=4)
        worker = engine.loop.draft
        assert isinstance(worker, HeadDraftWorker)
        proposals = record_proposals(worker)
        out = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in out] == _plain(target, params)
        drafted = [t for p in proposals for t in p.tokens]
        assert len(drafted) >= 20 and set(drafted) <= set(head.draft_ids.tolist())  # draft-vocabulary tokens only


def record_proposals(worker: HeadDraftWorker) -> list[Proposal]:
    """Every proposal the worker makes from now on."""
    proposals: list[Proposal] = []
    real = worker.propose

    def spy(items: list[ProposeItem]) -> list[Proposal]:
        out = real(items)
        proposals.extend(out)
        return out

    worker.propose = spy  # type: ignore[method-assign]
    return proposals


@pytest.mark.parametrize("kind", [HeadKind.eagle, HeadKind.eagle3])
def test_sampled_chains_from_a_reduced_vocabulary_describe_their_drafts(target: LlamaModel, kind: HeadKind) -> None:
    """Sampled chains (``chain_draft=sampled``) send the sparse q each draft was drawn from; verification reads
    q(x) there. With draft columns that are not target ids, q's support must be target ids too: every drafted token
    lies in its own q's support with positive mass, and that support in the draft vocabulary."""
    head = random_head(target, kind)
    if kind == HeadKind.eagle:
        head.set_draft_vocab(torch.arange(1, target.cfg.vocab_size, 2))
    allowed = set(head.draft_ids.tolist())
    spec = SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft.sampled)
    engine = Engine(target, None, draft=head, speculation=spec, eos_token_ids=set(), max_batch_size=4)
    worker = engine.loop.draft
    assert isinstance(worker, HeadDraftWorker)
    proposals = record_proposals(worker)
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 20 for o in out)
    checked = 0
    for p in proposals:
        if not p.tokens:
            continue
        assert p.q_idx is not None and p.q_prob is not None and len(p.q_idx) == len(p.tokens)
        for token, idx, prob in zip(p.tokens, p.q_idx, p.q_prob, strict=True):
            assert set(idx) <= allowed and token in allowed
            assert token in idx and prob[idx.index(token)] > 0
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("kind", [HeadKind.eagle, HeadKind.eagle3])
def test_head_cache_holds_pairs_of_the_targets_own_features(target: LlamaModel, kind: HeadKind) -> None:
    """After several speculative steps, the head's cached keys equal a from-scratch head forward over the pairs
    (t_{j+1}, f_j), f_j from one plain target forward over the committed tokens: positions line up."""
    head = random_head(target, kind)
    engine = Engine(target, None, draft=head, speculation=METHODS[1], eos_token_ids=set(), max_batch_size=4)
    for p in PROMPTS:
        engine.submit(p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(8):
        engine.loop.step()
    worker = engine.loop.draft
    assert isinstance(worker, HeadDraftWorker)
    checked = 0
    for seq in engine.loop.running:
        st = worker.seqs[seq.seq_id]
        n = st.pairs
        assert st.pos0 == 0 and n >= len(seq.request.prompt_ids)
        tokens = seq.tokens[: n + 1]
        want = _reference_keys(target, head, kind, tokens, n)
        got = worker.cache.k[0][st.slot, :, :n]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        checked += 1
    assert checked == len(PROMPTS)


@torch.inference_mode()
def _reference_keys(
    target: LlamaModel, head: EagleHead, kind: HeadKind, tokens: list[int], n: int, start: int = 0
) -> torch.Tensor:
    """The head's keys for pairs start..n-1 (t_{j+1}, f_j) at their own positions j, from one plain target forward."""
    cache = target.new_cache(1, 128)
    slot = cache.allocate()
    final, aux = target.hidden_states(ForwardBatch.build(cache, [slot], [tokens]), cache, (0, 1))
    feats = head.fuse(aux if kind == HeadKind.eagle3 else final)[start:n]  # f_start .. f_{n-1}
    hcache = head.new_cache(1, 128)
    hslot = hcache.allocate()
    batch = ForwardBatch.build(hcache, [hslot], [tokens[start + 1 : n + 1]], positions=[list(range(start, n))])
    head(batch.tokens, feats, batch, hcache)
    return hcache.k[0][hslot, :, : n - start].clone()


class _ScriptedGuard(ThroughputGuard):
    """Speculates on the steps whose index is in ``spec_steps``, decodes plainly on the others."""

    def __init__(self, spec_steps: set[int]) -> None:
        super().__init__()
        self.spec_steps = spec_steps
        self.outlooks: list[Outlook | None] = []  # per step asked

    def speculate(self, batch_size: int, *, measured: bool = True, outlook: Outlook | None = None) -> bool:
        self.outlooks.append(outlook)
        return len(self.outlooks) - 1 in self.spec_steps


@pytest.mark.parametrize("kind", [HeadKind.eagle, HeadKind.eagle3])
def test_a_catch_up_reads_only_the_newest_features_and_restarts_the_heads_cache(
    target: LlamaModel, kind: HeadKind
) -> None:
    """Prompts longer than ``catch_up_window`` and plain steps between speculative ones: each catch-up feeds the
    head only the newest W pairs (what the guard is told it costs), and its cache then holds exactly a from-scratch
    forward over them at their own positions (no pair from before the restart stays); the output stays greedy-equal."""
    window = 6
    head = random_head(target, kind)
    spec = METHODS[1].model_copy(update={"catch_up_window": window})
    prompts = [[5 + i, *range(40, 52)] for i in range(3)]  # 13 tokens each
    engine = Engine(target, None, draft=head, speculation=spec, eos_token_ids=set(), max_batch_size=3)
    guard = engine.loop.planner.guard = _ScriptedGuard({1, 2, 9, 10})  # step 0 prefills; plain steps 3-8
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ids = [engine.submit(p, params) for p in prompts]
    worker = engine.loop.draft
    assert isinstance(worker, HeadDraftWorker)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    starts: dict[int, list[int]] = {}
    step = 0
    while engine.loop.has_work:
        for out in engine.loop.step():
            tokens[out.request_id] += out.token_ids
        if step in (1, 9):  # after the first speculative step, and after the catch-up following the plain steps
            for seq in engine.loop.running:
                st = worker.seqs[seq.seq_id]
                end = st.next_pair
                starts.setdefault(seq.seq_id, []).append(st.pos0)
                assert st.pos0 == end - st.pairs > 0 and st.pairs <= window  # restarted late in the sequence
                assert worker.cache.length(st.slot) >= st.pairs  # (and this step's tree nodes)
                want = _reference_keys(target, head, kind, seq.tokens[: end + 1], end, st.pos0)
                torch.testing.assert_close(worker.cache.k[0][st.slot, :, : st.pairs], want, atol=2e-4, rtol=2e-4)
        step += 1
    assert len(starts) == len(prompts) and all(late > first >= 7 for first, late in starts.values())
    # the guard weighs a switch by what the head will read: the window of each sequence, not its 13-14 tokens
    assert [o.draft_missed if o else None for o in guard.outlooks[:2]] == [len(prompts) * window] * 2
    assert guard.outlooks[9] is not None and guard.outlooks[9].draft_missed == len(prompts) * window
    assert [tokens[rid] for rid in ids] == [
        c.token_ids for c in Engine(target, None, eos_token_ids=set()).generate(prompts, params)
    ]


def test_feature_queue_keeps_the_newest_window_and_restarts_on_a_gap() -> None:
    from specserve.detok import IncrementalText
    from specserve.sequence import Request, Sequence

    spec = SpecConfig(method=SpecMethod.chain, catch_up_window=4)
    seq = Sequence(0, Request("r", [1, 2, 3], SamplingParams()), IncrementalText(None, ()), spec=spec)
    rows = torch.arange(24.0).unsqueeze(1)  # row i: the feature of position i

    def queued(in_step: bool = False) -> tuple[int, list[float]] | None:
        q = seq.queued_features(in_step)
        return None if q is None else (q[0], q[1].flatten().tolist())

    assert queued() is None
    seq.add_features(rows[0:3], start=0)
    seq.add_features(rows[3:5], start=3)  # contiguous: queued behind, past the window: position 0 drops out
    assert queued() == (1, [1.0, 2.0, 3.0, 4.0])
    for i in range(5, 9):  # one row a step (plain steps): the queue's memory stays bounded
        seq.add_features(rows[i : i + 1], start=i)
        assert seq.features_queued <= 4 + 2
    assert queued() == (5, [5.0, 6.0, 7.0, 8.0])
    seq.add_features(rows[12:13], start=12)  # a gap: the queue restarts there
    assert queued() == (12, [12.0]) and seq.features_from == 12
    seq.add_features(rows[13:15], start=13)
    assert queued() == (12, [12.0, 13.0, 14.0])
    seq.features_went()  # sent to the head: not again
    assert queued() is None and queued(in_step=True) is None
    seq.model_proposed = True  # the head drafted this step, from the features it was sent
    seq.add_features(rows[15:20], start=15)  # more than the window at once
    assert queued() == (16, [16.0, 17.0, 18.0, 19.0])  # the head missed steps: the newest window, from a gap
    # the head drafted the last step: every row of this one (it used to lose the oldest and restart its context)
    assert queued(in_step=True) == (15, [15.0, 16.0, 17.0, 18.0, 19.0])
    seq.features_went()
    seq.add_features(rows[20:21], start=20)  # rows sent and past the window go, the oldest tensor cut to them
    assert seq.features_from == 17 and seq.features_queued == 4 and queued(in_step=True) == (20, [20.0])
    seq.features_sent = 0  # a new draft worker: the newest window again, though the old one had it
    assert queued() == (17, [17.0, 18.0, 19.0, 20.0])
    seq.drop_features()  # the target re-prefilled: the next rows start a queue wherever they are
    seq.add_features(rows[0:2], start=0)
    assert queued() == (0, [0.0, 1.0])


def test_a_long_prompts_features_shrink_to_the_window_when_the_head_did_not_draft() -> None:
    """The head reads at most the newest window after a step it did not draft (a prompt it had no features for, a
    plain step): the rest of a long prompt's rows must not stay queued through the plain steps that follow (an
    8B target's 4k-token prompt is ~200 MB of float32 rows on the router)."""
    from specserve.detok import IncrementalText
    from specserve.sequence import Request, Sequence

    spec = SpecConfig(method=SpecMethod.chain, catch_up_window=4)
    seq = Sequence(0, Request("r", list(range(100)), SamplingParams()), IncrementalText(None, ()), spec=spec)
    rows = torch.arange(110.0).unsqueeze(1)  # row i: the feature of position i
    seq.add_features(rows[0:100], start=0)  # the prompt's prefill, planned plain: nothing sent yet
    assert sum(t.shape[0] for t in seq.features) == 4 and seq.features_from == 96
    seq.add_features(rows[100:101], start=100)  # a plain step
    assert sum(t.shape[0] for t in seq.features) <= 4 + 1
    q = seq.queued_features(in_step=False)
    assert q is not None and (q[0], q[1].flatten().tolist()) == (97, [97.0, 98.0, 99.0, 100.0])
    # the head drafted from features it was sent: the next read takes every unsent row, so none may be cut
    seq.features_went()
    seq.model_proposed = True
    seq.add_features(rows[101:109], start=101)
    q = seq.queued_features(in_step=True)
    assert q is not None and (q[0], q[1].flatten().tolist()) == (101, [float(i) for i in range(101, 109)])


def test_steps_that_commit_more_than_the_window_keep_the_heads_context(target: LlamaModel) -> None:
    """The window bounds what the head re-reads after steps it missed; it also cut the rows of steps it drafted,
    so with a window at most a step's tokens every good step restarted the head's cache on its newest W pairs."""
    head = random_head(target)
    spec = SpecConfig(method=SpecMethod.chain, sl=6, chain_draft=ChainDraft.greedy, synthetic_accept=0.99)
    engine = Engine(target, None, draft=head, speculation=spec.model_copy(update={"catch_up_window": 4}))
    engine.loop.planner.guard = None
    engine.submit([5, 9, 33], SamplingParams(max_tokens=40, ignore_eos=True))  # within the window: all read
    worker = engine.loop.draft
    assert isinstance(worker, HeadDraftWorker)
    seen: list[tuple[int, int]] = []  # (the head's first position, its pairs) after each step
    while engine.loop.has_work:
        engine.loop.step()
        seen += [(st.pos0, st.pairs) for s in engine.loop.running if (st := worker.seqs.get(s.seq_id))]
    assert len(seen) >= 4 and seen[-1][1] > 20 and all(pos0 == 0 for pos0, _ in seen)


def test_sampled_chains_q_supports_are_read_for_the_whole_step_at_once() -> None:
    """Each sampled chain's q support (ids and probabilities per draft) was read to the host on its own, two copies
    per sequence a step; now in one copy per support size, and each chain gets its own rows back."""
    from specserve.messages import ProposeItem
    from specserve.spec_decode.draft_state import DraftState, sampled_chain_qs

    g = torch.Generator().manual_seed(0)

    def state(sl: int, k: int) -> DraftState:
        s = DraftState(ProposeItem(0, [7], [], max(sl, 1)), SamplingParams(temperature=1.0), None, [7], 0)
        s.q_idx = [torch.randperm(50, generator=g)[:k] for _ in range(sl)]
        s.q_prob = [torch.rand(k, generator=g) for _ in range(sl)]
        return s

    states = [state(3, 4), state(0, 4), state(1, 2), state(2, 4), state(4, 2)]  # state(0, ...): not a sampled chain
    got = sampled_chain_qs(states)
    assert got[1] is None
    for s, q in zip(states, got, strict=True):
        if s.q_idx:
            assert q == ([t.tolist() for t in s.q_idx], [t.tolist() for t in s.q_prob])


def test_the_head_keeps_only_the_tokens_it_has_still_to_pair(target: LlamaModel) -> None:
    """The worker kept a copy of every committed token of a sequence, growing with it (the router owns those); it
    keeps only the ones past its last pair, at most a step's, and drafts as before (greedy-equal)."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    spec = SpecConfig(method=SpecMethod.chain, sl=4, chain_draft=ChainDraft.greedy)
    engine = Engine(target, None, draft=random_head(target), speculation=spec, eos_token_ids=set())
    engine.loop.planner.guard = None
    engine.submit(PROMPTS[0], params)
    worker = engine.loop.draft
    assert isinstance(worker, HeadDraftWorker)
    kept: list[int] = []
    tokens: list[int] = []
    while engine.loop.has_work:
        tokens += [t for out in engine.loop.step() for t in out.token_ids]
        kept += [len(st.unpaired) for s in engine.loop.running if (st := worker.seqs.get(s.seq_id))]
    assert len(kept) >= 10 and max(kept) <= spec.sl + 1, kept
    assert tokens == _plain(target, params)[0]


@pytest.mark.parametrize("reset", [False, True])
def test_a_prompt_longer_than_the_window_costs_the_head_the_window_whatever_its_first_step(
    target: LlamaModel, reset: bool
) -> None:
    """Without a guard a request's first step (its prefill) is planned to speculate; the head then counted as in
    step and read the whole prompt on the next. After a failed step's reset, likewise."""
    head = random_head(target)
    spec = SpecConfig(method=SpecMethod.chain, sl=3, catch_up_window=4)
    engine = Engine(target, None, draft=head, speculation=spec, eos_token_ids=set())
    engine.loop.planner.guard = None
    engine.submit(list(range(40, 60)), SamplingParams(max_tokens=20, ignore_eos=True))
    worker = engine.loop.draft
    assert isinstance(worker, HeadDraftWorker)
    for _ in range(3 if reset else 2):
        engine.loop.step()
    (seq,) = engine.loop.running
    if reset:
        engine.loop.reset([seq.seq_id])
        engine.loop.step()  # the re-prefill (nothing to draft from), then the catch-up
        engine.loop.step()
    st = worker.seqs[seq.seq_id]
    assert st.pos0 > 0 and st.pairs <= 4 + 1, (st.pos0, st.pairs)  # the window (and the step's new pair)


def test_a_new_draft_worker_reads_the_newest_window_not_only_the_last_steps_rows(target: LlamaModel) -> None:
    """The feature queue was emptied at every propose, so a head worker that replaced a lost one (``recover``) got
    the one or two rows committed since, and drafted from almost no context."""
    head = random_head(target)
    spec = SpecConfig(method=SpecMethod.eagle2, beam_width=4, budget=12, tree_depth=4, catch_up_window=16)
    engine = Engine(target, None, draft=head, speculation=spec, eos_token_ids=set())
    engine.loop.planner.guard = None
    engine.submit([5, *range(40, 70)], SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(3):
        engine.loop.step()
    old = engine.loop.draft
    assert isinstance(old, HeadDraftWorker)
    engine.loop.draft = fresh = HeadDraftWorker(head, num_slots=old.cache.num_slots, max_len=old.cache.max_len)
    engine.loop.recover(target=False, draft=True)
    engine.loop.step()
    (seq,) = engine.loop.running
    st = fresh.seqs[seq.seq_id]
    assert st.pairs == 16 and st.pos0 + st.pairs == st.next_pair  # the newest window, ending at the root's pair


def _reference_blocks(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Dequantised weights from llama.cpp's per-block formulas, one 32-block at a time (float16 scales)."""
    out = torch.empty_like(w)
    for n in range(w.shape[0]):
        for k0 in range(0, w.shape[1], 32):
            x = w[n, k0 : k0 + 32].double()
            if fmt == "q8_0":
                d = float(torch.tensor(float(x.abs().max()) / 127).half())
                q = [0 if d == 0 else max(-128, min(127, round(float(v) / d))) for v in x]
                out[n, k0 : k0 + 32] = torch.tensor([d * v for v in q])
            else:
                lo = float(torch.tensor(float(x.min())).half())
                d = float(torch.tensor((float(x.max()) - lo) / 15).half())
                q = [0 if d == 0 else max(0, min(15, round((float(v) - lo) / d))) for v in x]
                out[n, k0 : k0 + 32] = torch.tensor([d * v + lo for v in q])
    return out


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_quantisers_follow_the_block_formulas(fmt: str) -> None:
    from specserve.models.q4 import quantize_q4_1, quantize_q8_0

    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * 0.3
    w[1, :32] = 0.0  # a block of zeros: d = 0
    blocks = quantize_q8_0(w) if fmt == "q8_0" else quantize_q4_1(w)
    want = _reference_blocks(w, fmt)
    torch.testing.assert_close(blocks.dequantize(), want, atol=1e-6, rtol=0)  # a rounding tie may go either way
    assert bool((blocks.d == blocks.d.half().float()).all())
    bound = 127 if fmt == "q8_0" else 15
    assert int(blocks.q.int().abs().max()) <= bound + (fmt == "q8_0")


@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
def test_a_head_quantised_at_load_reads_records_drafts_as_its_float_weights_and_stays_lossless(
    target: LlamaModel, quant: str
) -> None:
    """attach_head_records: the kernel reads the head's records, which give the same logits bit for bit as the
    kernel over the float weights they dequantise to; drafting with them stays greedy-equal to plain decoding."""
    from specserve.config import HeadQuant
    from specserve.models.native_stack import attach_head_records, attach_head_stack, attach_small_gemm
    from specserve.models.q4 import quantize_q4_1, quantize_q8_0

    quantize = quantize_q8_0 if quant == "q8_0" else quantize_q4_1
    for kind in (HeadKind.eagle, HeadKind.eagle3):
        head, by_hand = random_head(target, kind), random_head(target, kind)
        if not attach_small_gemm(head):
            pytest.skip("the small-product kernel is not available on this CPU")
        attach_small_gemm(by_hand)
        linears = [m for m in by_hand.modules() if type(m) is torch.nn.Linear]
        with torch.no_grad():
            for mod in linears:
                mod.weight.copy_(quantize(mod.weight).dequantize())
        assert attach_head_records(head, HeadQuant(quant))
        assert all(getattr(m, "small_records", None) is not None for m in head.modules() if type(m) is torch.nn.Linear)
        for h in (head, by_hand):
            attach_head_stack(h)
        tokens, feats = torch.tensor([5, 9, 13, 2]), torch.randn(4, head.cfg.feature_size)
        assert torch.equal(_head_logits(head, tokens, feats), _head_logits(by_hand, tokens, feats))
        assert _drafts_losslessly(target, head)
    assert not attach_head_records(random_head(target), HeadQuant.none)


def _head_logits(head: EagleHead, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The head's logits over one sequence of (token, target feature) pairs, from an empty cache."""
    cache = head.new_cache(1, 16)
    batch = ForwardBatch.build(cache, [cache.allocate()], [tokens.tolist()])
    return head.logits(head(batch.tokens, head.fuse(feats), batch, cache))


def _drafts_losslessly(target: LlamaModel, head: EagleHead) -> bool:
    """Whether DDD trees drafted by the head emit the target's plain greedy tokens."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine = Engine(target, None, draft=head, speculation=METHODS[2], eos_token_ids=set(), max_batch_size=4)
    return [o.token_ids for o in engine.generate(PROMPTS, params)] == _plain(target, params)


@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
def test_a_head_on_int8_products_rounds_its_activations_and_stays_lossless(target: LlamaModel, quant: str) -> None:
    """HeadSpec.int8_products: each of the head's quantised linears multiplies its blocks with the activations
    rounded to int8 per row and group of 32 (the rule written here), in the Python path and in the C++ stack
    (whose Q8_0 records take the other int8 entry); drafting with them stays greedy-equal to plain decoding."""
    from specserve.config import HeadQuant
    from specserve.models.llama import linear
    from specserve.models.native_stack import attach_head_records, attach_head_stack, attach_small_gemm, extension
    from specserve.models.q4 import quantize_q4_1, quantize_q8_0
    from tests.test_int8_reads import int8_rounded

    if not (extension().int8_q8_supported() if quant == "q8_0" else extension().int8_kernels()):
        pytest.skip(f"no int8 kernel for {quant} records on this CPU")
    quantize = quantize_q8_0 if quant == "q8_0" else quantize_q4_1
    for kind in (HeadKind.eagle, HeadKind.eagle3):
        head, floats = random_head(target, kind), random_head(target, kind)
        if not attach_small_gemm(head):
            pytest.skip("the small-product kernel is not available on this CPU")
        attach_small_gemm(floats)
        assert attach_head_records(head, HeadQuant(quant), int8=True)
        assert attach_head_records(floats, HeadQuant(quant))
        linears = [m for m in head.modules() if type(m) is torch.nn.Linear]
        assert linears and all(getattr(m, "int8_q8", None) == (quant == "q8_0") for m in linears)
        assert not any(getattr(m, "int8_records", None) is not None for m in floats.modules())
        x_gen = torch.Generator().manual_seed(7)
        for mod in linears:
            x = torch.randn(5, mod.in_features, generator=x_gen)
            x[1, 3] = 40.0  # an outlier owns its group's scale
            w = quantize(mod.weight.detach()).dequantize().double()
            rounded = int8_rounded(x)
            bound = (rounded.abs() @ w.abs().T) * 2e-6 + 1e-30  # float32 sums of the group terms
            assert ((linear(mod, x).double() - rounded @ w.T).abs() <= bound).all()
        tokens, feats = torch.tensor([5, 9, 13, 2, 40, 41]), torch.randn(6, head.cfg.feature_size, generator=x_gen)
        python_loop = _head_logits(head, tokens, feats)
        assert attach_head_stack(head)
        stack = _head_logits(head, tokens, feats)  # the layer's products through the C++ stack's own int8 entries
        # float records in the stack's layer would differ from the Python loop's int8 products by far more than the
        # fused norms' rounding (and Q4_1 records given to the Q8_0 entry, or the reverse, raise)
        torch.testing.assert_close(stack, python_loop, rtol=1e-4, atol=1e-4)
        assert (stack - _head_logits(floats, tokens, feats)).abs().max() > 1e-3  # float records: no rounding
        assert _drafts_losslessly(target, head)


@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
def test_int8_products_without_quantised_weights_or_a_kernel_leave_the_float_path(
    target: LlamaModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, quant: str
) -> None:
    """Int8 products over weights not quantised, or on a CPU without the kernel for the records: a logged reason,
    and the records multiplied with float32 activations; records of an earlier call with int8 do not stay."""
    import logging

    from specserve.config import HeadQuant
    from specserve.models import native_stack
    from specserve.models.native_stack import attach_head_records, attach_small_gemm, extension

    head = random_head(target, HeadKind.eagle3)
    if not attach_small_gemm(head):
        pytest.skip("the small-product kernel is not available on this CPU")
    with caplog.at_level(logging.WARNING):
        assert not attach_head_records(head, HeadQuant.none, int8=True)
    assert "not quantised" in caplog.text

    class NoInt8:
        def __getattr__(self, name: str) -> object:
            if name in ("int8_kernels", "int8_q8_supported"):
                return lambda: [] if name == "int8_kernels" else False
            return getattr(extension(), name)

    if extension().int8_q8_supported() if quant == "q8_0" else extension().int8_kernels():
        assert attach_head_records(head, HeadQuant(quant), int8=True)  # attached here, then called again below
        assert all(getattr(m, "int8_records", None) is not None for m in head.modules() if type(m) is torch.nn.Linear)
    monkeypatch.setattr(native_stack, "extension", NoInt8)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert attach_head_records(head, HeadQuant(quant), int8=True)
    assert "no int8 kernel for" in caplog.text
    linears = [m for m in head.modules() if type(m) is torch.nn.Linear]
    assert all(getattr(m, "small_records", None) is not None for m in linears)
    assert not any(getattr(m, "int8_records", None) is not None for m in linears)


def test_an_interrupted_commit_leaves_no_features_past_the_kept_tokens(
    target: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in a row's detokenisation, after the commit queued the step's target features: the rollback takes
    them back with the tokens (they used to stay, and the head re-read them after the reset as the context of
    tokens it never got), and the row still ends as plain decoding does."""
    from specserve.detok import IncrementalText

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    spec = METHODS[0]
    engine = Engine(target, None, draft=random_head(target), speculation=spec, eos_token_ids=set(), max_batch_size=4)
    ids = [engine.submit(p, params) for p in PROMPTS[:2]]
    cut = engine.loop.waiting[1]
    real_update = IncrementalText.update
    fired: list[int] = []

    def update(text: IncrementalText, token_ids: list[int], *, final: bool = False, drop_open: bool = False) -> str:
        if text is cut.text and len(cut.output) > 8 and not fired:
            fired.append(cut.features_from + cut.features_queued)
            raise KeyboardInterrupt
        return real_update(text, token_ids, final=final, drop_open=drop_open)

    monkeypatch.setattr(IncrementalText, "update", update)
    with pytest.raises(KeyboardInterrupt):
        engine.collect([ids[0]])
    assert fired and fired[0] > len(cut.tokens) - 1  # the step had queued rows past the rolled-back tokens
    assert cut.features_from + cut.features_queued == len(cut.tokens) - 1  # all the target had read, and no more
    assert engine.collect([ids[1]])[0].token_ids == _plain(target, params)[1]
