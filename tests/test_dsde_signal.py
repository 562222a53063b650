"""The KLD values DSDE is fed, checked against KL(p || q) computed here from separate target and draft forwards
over the same contexts (docs/algorithms.md §4.1 and §6): the signal's position rule, its direction, and the
sparse q's tail model all show in the numbers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch

from specserve.config import KLDMode, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import SequenceError
from specserve.messages import DraftQ, Proposal, ProposeItem, VerifyItem, VerifyOutput
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.native_stack import NativeStackUnavailable, attach_native_stack, extension, lumped_kld_kernel
from specserve.models.tiny import noisy_copy, tiny_model
from specserve.policy.dsde import DSDEConfig, SequenceDSDE
from specserve.policy.kld import PROB_FLOOR, SparseTail, kld_exact, kld_sparse
from specserve.sampling import SamplingParams
from specserve.spec_decode.draft_state import DraftState, draft_q, target_ids
from specserve.step_events import StepEvent, StepObserver
from specserve.workers.target import KLD_ROWS, TargetWorker

TOP_K = 8  # of the tiny model's 512 ids: the tail carries real mass


def _next_probs(model: LlamaModel, tokens: list[int]) -> np.ndarray:
    cache = model.new_cache(1, len(tokens) + 1)
    logits = model(ForwardBatch.build(cache, [cache.allocate()], [tokens], num_logits=[1]), cache)
    return torch.softmax(logits[-1].double(), -1).numpy()


def _kl(p: np.ndarray, q: np.ndarray, mode: KLDMode, tail: SparseTail) -> float:
    floor = 1e-8
    if mode == KLDMode.exact:
        p, q = np.maximum(p, floor), np.maximum(q, floor)
        return float((p * np.log(p / q)).sum())
    top = np.argsort(-q, kind="stable")[:TOP_K]
    if tail == SparseTail.uniform:  # q's leftover mass spread over the other ids
        spread = np.full_like(q, (1 - q[top].sum()) / (len(q) - TOP_K))
        spread[top] = q[top]
        p, spread = np.maximum(p, floor), np.maximum(spread, floor)
        return float((p * np.log(p / spread)).sum())
    p_rest, q_rest = max(1 - p[top].sum(), floor), max(1 - q[top].sum(), floor)  # lumped: "the rest" one outcome
    pk, qk = np.maximum(p[top], floor), np.maximum(q[top], floor)
    return float((pk * np.log(pk / qk)).sum() + p_rest * math.log(p_rest / q_rest))


def _path(proposal: Proposal, node: int) -> list[int]:
    """The drafted tokens from the root to ``node`` (node 0 is the root), by the tree's parents."""
    return [] if node == 0 else [*_path(proposal, proposal.parents[node - 1]), proposal.tokens[node - 1]]


CASES = {
    "chain-exact": SpecConfig(method=SpecMethod.chain, kld_mode=KLDMode.exact),
    "chain-sparse-lumped": SpecConfig(method=SpecMethod.chain, kld_tail=SparseTail.lumped),
    "chain-sparse-uniform": SpecConfig(method=SpecMethod.chain, kld_tail=SparseTail.uniform),
    # a budget that keeps every drafted level (no node reranked away), so the deepest node is the depth drafted
    "ddd-sparse-lumped": SpecConfig(method=SpecMethod.ddd, beam_width=4, budget=64),
    # the reference code's choice: a KLD at every drafted position, past the first rejection too
    "chain-past-rejection": SpecConfig(method=SpecMethod.chain, dsde=DSDEConfig(record_past_rejection=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dsde_is_fed_kl_of_target_against_draft_at_the_verified_positions(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = CASES[name].model_copy(update={"policy": SLPolicyKind.dsde, "kld_top_k": TOP_K})
    target = tiny_model(seed=0)
    draft = noisy_copy(target, 0.4, seed=2)
    engine = Engine(target, None, draft=draft, speculation=spec, eos_token_ids=set(), max_batch_size=1)
    observed: list[tuple[list[float], int, int]] = []
    real_observe = SequenceDSDE.observe

    def observe(self: SequenceDSDE, klds: list[float], num_drafted: int, num_accepted: int, *, cut: bool) -> None:
        observed.append((list(klds), num_drafted, num_accepted))
        real_observe(self, klds, num_drafted, num_accepted, cut=cut)

    monkeypatch.setattr(SequenceDSDE, "observe", observe)
    expected: list[tuple[list[float], int, int]] = []
    checked: list[tuple[float, float]] = []

    class Check(StepObserver):
        def on_step(self, event: StepEvent) -> None:
            for seq, proposal, out in zip(event.batch, event.proposals, event.verified, strict=True):
                if proposal is None:
                    continue
                a = len(out.accepted)
                root = len(seq.tokens) - (a + 1) - 1  # the step committed a accepted drafts and one more token
                if seq.finish_reason is None:
                    assert seq.tokens[root + 1 : root + 1 + a] == _path(proposal, out.accepted[-1] if a else 0)
                # levels drafted: a chain's length, a tree's deepest node
                levels = max(len(_path(proposal, n)) for n in range(1, len(proposal.tokens) + 1))
                expected.append((list(out.kld), levels, min(a, levels)))
                # the root and each accepted node, where the draft has a q (a chain's last draft, a tree's
                # leaves are never fed back)
                fed = set(range(len(proposal.tokens))) if proposal.draft_q is None else set(proposal.draft_q.nodes)
                verified = range(len(proposal.tokens) + 1) if spec.dsde.record_past_rejection else [0, *out.accepted]
                nodes = [n for n in verified if n in fed]
                assert len(out.kld) == len(nodes)
                if seq.finish_reason is not None:
                    continue
                for n, got in zip(nodes, out.kld, strict=True):
                    context = seq.tokens[: root + 1] + _path(proposal, n)
                    want = _kl(_next_probs(target, context), _next_probs(draft, context), spec.kld_mode, spec.kld_tail)
                    checked.append((got, want))

    engine.loop.observers.append(Check())
    engine.generate([[5, 9, 33, 71, 2]], SamplingParams(max_tokens=48, ignore_eos=True))
    assert observed == expected and len(checked) >= 10
    got, want = np.array(checked).T
    assert want.max() > 0.05  # a draft that disagrees: the values are not all ~0
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-5)


def test_a_requests_temperature_reaches_its_dsde_state() -> None:
    """kld_over_temperature divides by the request's temperature: the engine must hand it over (the pure function's
    tests cannot see a state built with the default 1). The engine's state predicts as a twin built with the
    request's temperature does, not as one built with 1."""
    import random

    cfg = DSDEConfig(kld_over_temperature=True)
    target = tiny_model(seed=0)
    spec = SpecConfig(method=SpecMethod.chain, policy=SLPolicyKind.dsde, dsde=cfg)
    engine = Engine(target, None, draft=noisy_copy(target, 0.4, seed=2), speculation=spec, eos_token_ids=set())
    engine.submit([5, 9, 33], SamplingParams(temperature=0.25, seed=1, max_tokens=8))
    state = engine.loop.waiting[0].sl_state
    assert isinstance(state, SequenceDSDE)
    twins = {t: SequenceDSDE(cfg, t) for t in (0.25, 1.0)}
    rng = random.Random(0)
    predicted: dict[object, list[int]] = {s: [] for s in (state, *twins.values())}
    for _ in range(60):
        klds = [rng.uniform(0.0, 0.3) for _ in range(3)]
        for s, sls in predicted.items():
            s.observe(klds, 3, 2)
            sls.append(s.next_sl())
    assert predicted[state] == predicted[twins[0.25]] != predicted[twins[1.0]]


def _native_kernel() -> Callable[..., torch.Tensor]:
    try:
        return cast(Callable[..., torch.Tensor], extension().lumped_kld)
    except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
        pytest.skip(f"the C++ extension cannot be built here: {e}")


def _worker(native: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[TargetWorker, list[int]]:
    """A tiny target's worker, its layers from C++ (and so its lumped KLDs from the extension) where ``native``, and
    how many times the extension's lumped KLD ran (counted on the extension itself, so the worker's own choice of
    path is what is tested)."""
    worker = TargetWorker(tiny_model(seed=0), num_slots=1, max_len=8)
    calls = [0]
    try:
        kernel = extension().lumped_kld
    except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
        if native:
            pytest.skip(f"the C++ extension cannot be built here: {e}")
        return worker, calls

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return kernel(*args)

    monkeypatch.setattr(extension(), "lumped_kld", counted)
    assert lumped_kld_kernel(worker.model) is None  # the Python layers: the torch path
    if native:
        assert attach_native_stack(worker.model) and lumped_kld_kernel(worker.model) is not None
    return worker, calls


@pytest.mark.parametrize("native", [False, True], ids=["torch", "extension"])
def test_one_step_scores_every_kind_of_q_as_each_sequence_alone(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target scores a step's draft distributions together (one computation per kind of q, one host read):
    sequences sending dense q, sparse q under either tail, ragged rows (a model-free drafter's counts) and none at all
    each get KL(p || q) of their own logits rows at their own verified nodes, as ``kld_exact`` / ``kld_sparse`` give
    for that sequence alone; with the C++ layers, the lumped rows of each width through the extension's kernel."""
    g = torch.Generator().manual_seed(3)
    worker, calls = _worker(native, monkeypatch)
    vocab = worker.model.cfg.vocab_size
    sizes = [4, 3, 5, 2, 4]  # tree nodes per sequence (the root and its drafts)
    logits = 3 * torch.randn(sum(sizes), vocab, generator=g)
    dense_q = torch.randn(3, vocab, generator=g)

    def sparse(n: int, widths: tuple[int, ...] | None, k: int = 6) -> DraftQ:
        idx = np.stack([torch.randperm(vocab, generator=g)[:k].numpy().astype(np.int32) for _ in range(n)])
        prob = (torch.rand(n, k, generator=g) / k).numpy()
        return DraftQ(list(range(n)), idx=idx, prob=prob, widths=widths)

    qs = [
        DraftQ([0, 1, 2], dense_logits=dense_q),
        sparse(2, None),
        sparse(4, (6, 2, 5, 2)),
        None,
        sparse(3, None),
    ]
    tails = [SparseTail.lumped, SparseTail.lumped, SparseTail.lumped, SparseTail.lumped, SparseTail.uniform]
    accepted = [[1, 2], [1], [2, 3], [], [1]]  # node 3 of the first has no q: not scored
    items = [
        VerifyItem(i, [7], draft_tokens=[1] * (n - 1), draft_parents=list(range(n - 1)), draft_q=q, kld_tail=t)
        for i, (n, q, t) in enumerate(zip(sizes, qs, tails, strict=True))
    ]
    outputs = [VerifyOutput(i, a, [1] * (len(a) + 1)) for i, a in enumerate(accepted)]
    got = worker._with_klds(items, outputs, logits, sizes)

    rows = logits.split(sizes)
    want = [
        kld_exact(rows[0][[0, 1, 2]], dense_q).tolist(),
        [float(kld_sparse(rows[1][[n]], *map(torch.from_numpy, _as_row(qs[1], n)), tail=tails[1])) for n in (0, 1)],
        [float(kld_sparse(rows[2][[n]], *map(torch.from_numpy, _as_row(qs[2], n)), tail=tails[2])) for n in (0, 2, 3)],
        [],
        [float(kld_sparse(rows[4][[n]], *map(torch.from_numpy, _as_row(qs[4], n)), tail=tails[4])) for n in (0, 1)],
    ]
    assert [o.seq_id for o in got] == list(range(5)) and got[3] is outputs[3]
    for out, w in zip(got, want, strict=True):
        assert len(out.kld) == len(w)
        np.testing.assert_allclose(out.kld, w, rtol=1e-5, atol=1e-6)
    assert len({round(v, 4) for o in got for v in o.kld}) > 5  # distinct values: nothing shared between rows
    assert calls[0] == (3 if native else 0)  # lumped rows of widths 6, 2 and 5: one group each


def _malformed(vocab: int) -> dict[str, DraftQ]:
    ids = np.array([[3, 5], [7, 9]], dtype=np.int32)
    probs = np.full((2, 2), 0.1, dtype=np.float32)
    return {
        "an id outside the vocabulary": DraftQ([0, 1], idx=np.array([[3, vocab], [1, 2]], dtype=np.int32), prob=probs),
        "a negative id": DraftQ([0, 1], idx=-ids, prob=probs),
        "fewer probabilities than ids": DraftQ([0, 1], idx=ids, prob=probs[:, :1]),
        "fewer rows than nodes": DraftQ([0, 1, 2], idx=ids, prob=probs),
        "a width past K": DraftQ([0, 1], idx=ids, prob=probs, widths=(2, 3)),
        "dense logits of another vocabulary": DraftQ([0, 1], dense_logits=torch.zeros(2, vocab + 1)),
        "no ids": DraftQ([0, 1]),
    }


@pytest.mark.parametrize("case", list(_malformed(512)))
def test_a_malformed_q_fails_its_own_sequence(case: str) -> None:
    """The step's KLDs are computed together, yet a q whose shapes disagree or whose ids leave the vocabulary is
    named on its sequence (the lane fails that request alone), before anything is computed."""
    worker = TargetWorker(tiny_model(seed=0), num_slots=1, max_len=8)
    vocab = worker.model.cfg.vocab_size
    assert vocab == 512
    g = torch.Generator().manual_seed(5)
    good = DraftQ([0, 1], idx=np.array([[1, 2], [3, 4]], dtype=np.int32), prob=np.full((2, 2), 0.2, dtype=np.float32))
    items = [
        VerifyItem(i, [7], draft_tokens=[1, 2], draft_parents=[0, 1], draft_q=q)
        for i, q in enumerate([good, good, _malformed(vocab)[case]])
    ]
    outputs = [VerifyOutput(i, [1], [1, 2]) for i in range(3)]
    with pytest.raises(SequenceError) as caught:
        worker._with_klds(items, outputs, 3 * torch.randn(9, vocab, generator=g), [3, 3, 3])
    assert caught.value.seq_id == 2
    assert len(worker._with_klds(items[:2], outputs[:2], 3 * torch.randn(6, vocab, generator=g), [3, 3])[1].kld) == 2


@pytest.mark.parametrize("native", [False, True], ids=["torch", "extension"])
def test_a_step_of_more_rows_than_one_computation_takes_keeps_each_sequences_klds(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch whose scored rows of one kind of q outnumber ``KLD_ROWS`` is computed in pieces; every sequence still
    gets the KLDs of its own rows, in node order."""
    g = torch.Generator().manual_seed(4)
    worker, calls = _worker(native, monkeypatch)
    vocab = worker.model.cfg.vocab_size
    n = KLD_ROWS // 3 + 5  # sequences of 4 nodes, 3 scored each: pieces end inside a sequence's rows
    assert KLD_ROWS % 3
    logits = 3 * torch.randn(4 * n, vocab, generator=g)
    qs = []
    for _ in range(n):
        idx = np.stack([torch.randperm(vocab, generator=g)[:8].numpy().astype(np.int32) for _ in range(4)])
        qs.append(DraftQ([0, 1, 2, 3], idx=idx, prob=(torch.rand(4, 8, generator=g) / 8).numpy()))
    items = [VerifyItem(i, [7], draft_tokens=[1, 2, 3], draft_parents=[0, 1, 2], draft_q=q) for i, q in enumerate(qs)]
    outputs = [VerifyOutput(i, [1, 2], [1, 2, 3]) for i in range(n)]
    got = worker._with_klds(items, outputs, logits, [4] * n)
    for i, out in enumerate(got):
        rows = logits[4 * i : 4 * i + 3]
        ids, probs = torch.from_numpy(qs[i].idx[:3]).long(), torch.from_numpy(qs[i].prob[:3])
        np.testing.assert_allclose(out.kld, kld_sparse(rows, ids, probs, tail=SparseTail.lumped), rtol=1e-5, atol=1e-6)
    assert calls[0] == (-(-3 * n // KLD_ROWS) if native else 0)


@pytest.mark.parametrize(
    ("vocab", "k", "spread"),
    [(512, 8, 3.0), (49152, 256, 3.0), (49152, 256, 12.0), (49152, 1, 3.0), (1000, 1000, 2.0)],
    ids=["tiny", "smollm2-top256", "peaked", "one-id", "every-id"],
)
def test_the_extensions_lumped_kld_is_kld_sparse(vocab: int, k: int, spread: float) -> None:
    """csrc/lumped_kld.cpp gives ``kld_sparse(tail=lumped)`` of the rows it is pointed at: drafts far from the
    target, close to it (q = p's top-K: ~0), peaked ones, a single id and the whole vocabulary (the exact KLD)."""
    kernel = _native_kernel()
    g = torch.Generator().manual_seed(7)
    logits = spread * torch.randn(6, vocab, generator=g)
    rows = torch.tensor([4, 0, 4, 2])
    q_far, ids = torch.softmax(spread * torch.randn(4, vocab, generator=g), -1).topk(k, dim=-1)  # another's top-K
    p_top, p_ids = torch.softmax(logits[rows], -1).topk(k, dim=-1)  # a draft equal to the target on its top-K
    for idx, prob in ((ids, q_far), (p_ids, p_top)):
        got = kernel(logits, rows, idx.to(torch.int32), prob, PROB_FLOOR)
        want = kld_sparse(logits[rows], idx, prob, tail=SparseTail.lumped)
        assert got.dtype == torch.float32 and got.shape == (4,)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
    assert kernel(logits, rows, ids.to(torch.int32), q_far, PROB_FLOOR).min() > 0.01  # far from the target
    assert kernel(logits, rows, p_ids.to(torch.int32), p_top, PROB_FLOOR).max() < 1e-4  # the target's own top-K


def test_the_extensions_lumped_kld_refuses_what_it_cannot_read() -> None:
    """An id outside the vocabulary or a row outside the logits is an error, not a read past the tensor."""
    kernel = _native_kernel()
    logits, prob = torch.randn(3, 50), torch.full((2, 4), 0.1)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    rows = torch.tensor([0, 2])
    assert kernel(logits, rows, ids, prob, PROB_FLOOR).shape == (2,)
    bad = {
        "token id 50 outside": (logits, rows, torch.where(ids == 8, 50, ids), prob),
        "token id -1 outside": (logits, rows, -ids.clamp(max=1), prob),
        "row 3 outside": (logits, torch.tensor([0, 3]), ids, prob),
        "idx must be": (logits, rows, ids.long(), prob),
        "prob must be": (logits, rows, ids, prob[:, :3]),
        "logits must be": (logits.double(), rows, ids, prob),
    }
    for message, args in bad.items():
        with pytest.raises(RuntimeError, match=message):
            kernel(*args, PROB_FLOOR)


def _as_row(q: DraftQ | None, r: int) -> tuple[np.ndarray, np.ndarray]:
    assert q is not None
    ids, probs = q.row(r)
    return ids[None].astype(np.int64), probs[None]


def test_a_reduced_vocabulary_ships_q_in_target_ids() -> None:
    """A head drafting over a reduced vocabulary ships, at each fed node (its logits row, in any order), the top-K of
    its temperature-1 distribution under the target ids its columns stand for; one column maps as well."""
    g = torch.Generator().manual_seed(8)
    token_ids = torch.randperm(512, generator=g)[:40]  # draft column c is target id token_ids[c]
    rows = [torch.randn(1, 40, generator=g), 3 * torch.randn(2, 40, generator=g)]
    item = ProposeItem(0, [7], [], 2, spec=SpecConfig(kld_top_k=5), kld_mode=KLDMode.sparse)
    s = DraftState(item, SamplingParams(), None, [7], 0, q_logits=rows, token_ids=token_ids, vocab_size=512)
    q = draft_q(s, [(0, 2), (1, 0)])  # node 0's logits are row 2, node 1's row 0
    assert q is not None and q.nodes == [0, 1] and q.idx is not None and q.prob is not None
    assert q.idx.dtype == np.int32 and q.idx.shape == q.prob.shape == (2, 5)
    for r, row in enumerate((rows[1][1], rows[0][0])):
        probs = np.exp(row.double().numpy()) / np.exp(row.double().numpy()).sum()
        top = np.argsort(-probs, kind="stable")[:5]
        assert q.idx[r].tolist() == token_ids[top].tolist()
        np.testing.assert_allclose(q.prob[r], probs[top], rtol=1e-5)
    assert int(target_ids(s, torch.tensor(3))) == int(token_ids[3])
