"""A step's device work does not grow with its sequences: GPU steps of small models are launch-bound, so every
per-sequence copy, kernel or host read is paid B times a step (docs/benchmarks.md, "A third GPU lease").

CPU stand-ins for the device: the ``meta`` device for the step's layout, and a tensor subclass that logs what is
done to the target's outputs for verification."""

from __future__ import annotations

import collections
import pickle
import random
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.messages import FeatureRequest, VerifyItem, VerifyOutput
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_config, tiny_model
from specserve.sampling import SamplingParams
from specserve.spec_decode.eagle2 import TreeBuilder, expand_level
from specserve.workers.target import TargetWorker


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model()


def _reference_mask(starts: list[int], num_new: list[int], trees: list[torch.Tensor | None]) -> torch.Tensor:
    """The rule, row by row: a causal row sees the cache and the new tokens up to itself; a tree's rows see every
    key before their window and, inside it, what their mask says; a padded row sees the keys before its window
    (the cache, for a causal sequence) and key 0."""
    q_len = max(num_new)
    k_len = max(s + n for s, n in zip(starts, num_new, strict=True))
    mask = torch.zeros(len(starts), q_len, k_len, dtype=torch.bool)
    for b, (start, n, tree) in enumerate(zip(starts, num_new, trees, strict=True)):
        lo = start if tree is None else start + n - tree.shape[1]
        for j in range(q_len):
            for k in range(k_len):
                if j >= n:
                    mask[b, j, k] = k < lo or k == 0
                elif tree is None:
                    mask[b, j, k] = k <= start + j
                else:
                    mask[b, j, k] = k < lo or (lo <= k < start + n and bool(tree[j, k - lo]))
    return mask


def test_the_step_mask_follows_the_rule_row_by_row() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(60):
        b_size = rng.randint(1, 5)
        cache = tiny_model().new_cache(b_size, 64)
        slots = [cache.allocate() for _ in range(b_size)]
        starts, num_new, trees, tokens, positions = [], [], [], [], []
        for slot in slots:
            start, n = rng.randint(0, 12), rng.randint(1, 6)
            if start:
                cache.begin_append([slot], [start])
            tree = None
            if rng.random() < 0.5:  # a window over the last w keys: some cached entries, then the new tokens
                width = rng.randint(n, start + n)
                tree = torch.rand(n, width) < 0.5
            starts.append(start)
            num_new.append(n)
            trees.append(tree)
            tokens.append([rng.randrange(512) for _ in range(n)])
            positions.append([start + rng.randrange(8) for _ in range(n)] if tree is not None else None)
        batch = ForwardBatch.build(cache, slots, tokens, positions=positions, tree_masks=trees)
        want_pos = [
            p if p is not None else list(range(s, s + n)) for p, s, n in zip(positions, starts, num_new, strict=True)
        ]
        assert batch.tokens.tolist() == [t for ts in tokens for t in ts]
        assert batch.positions.tolist() == [p for ps in want_pos for p in ps]
        if batch.attn_mask is None:  # one causal sequence: SDPA's own causal mask
            assert b_size == 1 and trees[0] is None
            continue
        assert torch.equal(batch.attn_mask[:, 0], _reference_mask(starts, num_new, trees))
        checked += 1
    assert checked > 40


VIEWS = {torch.ops.aten.select, torch.ops.aten.slice, torch.ops.aten.unsqueeze, torch.ops.aten.view}  # no launch


class _DeviceOps(TorchDispatchMode):
    """Counts the operations other than views whose inputs or outputs live on the ``meta`` device (the stand-in
    for a GPU): each is a kernel or a copy there."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors) and func.overloadpacket not in VIEWS:
            self.ops[str(func)] += 1
        return out


def _layout_ops(b_size: int, *, trees: int = 0) -> collections.Counter[str]:
    cache = tiny_model().new_cache(b_size, 64)
    slots = [cache.allocate() for _ in range(b_size)]
    for i, slot in enumerate(slots):
        cache.begin_append([slot], [5 + i])  # ragged caches: a padded mask
    masks = [torch.ones(3, 3, dtype=torch.bool).tril() if i < trees else None for i in range(b_size)]
    tokens = [[7, 8, 9] if i < trees else [7] for i in range(b_size)]
    with _DeviceOps() as counter:
        ForwardBatch.build(cache, slots, tokens, tree_masks=masks, device="meta")
    return counter.ops


def test_a_steps_layout_takes_the_same_device_ops_for_any_number_of_sequences() -> None:
    """Tokens, positions, mask and indices: a fixed number of copies and kernels; a tree adds its window's copy."""
    two, twelve = _layout_ops(2), _layout_ops(12)
    assert two == twelve and sum(two.values()) <= 25, (two, twelve)
    with_trees = _layout_ops(12, trees=4)
    assert sum(with_trees.values()) - sum(twelve.values()) <= 4, with_trees


class _OnDevice(torch.Tensor):
    """The target's outputs as if on a GPU: logs every operation on them; ``cpu()`` brings them to the host."""

    log: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in ("__get__", "__repr__", "shape", "dim", "device", "dtype"):
            cls.log.append(name)
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if name in ("cpu", "to") and isinstance(out, torch.Tensor) else out


class _Ids(_OnDevice):
    log: ClassVar[list[str]] = []


class _Feats(_OnDevice):
    log: ClassVar[list[str]] = []


HOST_READS = ("cpu", "to", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _verify_logged(
    monkeypatch: pytest.MonkeyPatch, target: LlamaModel, step: Callable[[int], VerifyItem], b_size: int
) -> list[VerifyOutput]:
    """One prefill, then ``step(i)`` for each of ``b_size`` sequences with the argmaxes and features logged."""
    worker = TargetWorker(target, num_slots=b_size, max_len=64)
    for i in range(b_size):
        worker.add(i, SamplingParams(max_tokens=8), 0)
    worker.verify([VerifyItem(i, [5 + i, 9, 33], features=FeatureRequest()) for i in range(b_size)])
    forward = worker._forward

    def logged(*args: Any, **kwargs: Any) -> tuple[torch.Tensor | None, ...]:
        logits, ids, feats, prompt_rows = forward(*args, **kwargs)
        _Ids.log.clear()
        _Feats.log.clear()
        return (
            logits,
            None if ids is None else ids.as_subclass(_Ids),
            None if feats is None else feats.as_subclass(_Feats),
            prompt_rows,
        )

    monkeypatch.setattr(worker, "_forward", logged)
    return worker.verify([step(i) for i in range(b_size)])


def test_greedy_verification_reads_the_argmaxes_to_the_host_once_a_step(
    monkeypatch: pytest.MonkeyPatch, target: LlamaModel
) -> None:
    """Not once per sequence: each read is a device-to-host copy and a sync."""
    for step in (
        lambda i: VerifyItem(i, [40 + i], features=FeatureRequest()),  # plain
        lambda i: VerifyItem(i, [40 + i], [3, 4, 5, 6], [0, 0, 1, 2], features=FeatureRequest()),  # a tree
    ):
        outputs = _verify_logged(monkeypatch, target, step, 8)
        assert len(outputs) == 8
        assert sum(_Ids.log.count(op) for op in HOST_READS) == 1, _Ids.log


def test_a_steps_features_take_one_gather_or_none(monkeypatch: pytest.MonkeyPatch, target: LlamaModel) -> None:
    """Plain steps keep every row: the outputs are the step's rows, split; a tree's step gathers once. Each output
    still holds the rows of its positions (the pending tokens, the root, the accepted path)."""
    plain = _verify_logged(monkeypatch, target, lambda i: VerifyItem(i, [40 + i], features=FeatureRequest()), 8)
    assert "__getitem__" not in _Feats.log and "index_select" not in _Feats.log and len(_Feats.log) <= 2, _Feats.log
    assert [o.features.shape[0] for o in plain if o.features is not None] == [1] * 8

    def tree(i: int) -> VerifyItem:
        return VerifyItem(i, [40 + i, 41], [3, 4, 5, 6], [0, 0, 1, 2], features=FeatureRequest() if i % 2 else None)

    outputs = _verify_logged(monkeypatch, target, tree, 8)
    assert _Feats.log.count("__getitem__") + _Feats.log.count("index_select") == 1 and len(_Feats.log) <= 3
    for i, out in enumerate(outputs):
        assert (out.features is None) == (i % 2 == 0)
        if out.features is not None:  # the pending token, the root and the accepted nodes
            assert out.features.shape == (2 + len(out.accepted), target.cfg.hidden_size)


def test_the_target_actor_sends_a_steps_features_in_one_buffer(target: LlamaModel) -> None:
    """Ray pickled each sequence's features as a tensor of its own (~0.5 ms each on 2 cores; a view carried its
    whole storage): the step's rows now leave as one byte buffer of exactly those rows, and come back to each
    sequence as the worker computed them, in storage of their own."""
    pytest.importorskip("ray")
    from deployments.actors import TargetActor
    from deployments.wire import attach_features

    actor = TargetActor.__new__(TargetActor)  # the actor's class in-process: no Ray
    actor.model = target
    actor.worker = TargetWorker(target, num_slots=8, max_len=32)
    local = TargetWorker(target, num_slots=8, max_len=32)  # the same steps without the actor
    for worker in (actor.worker, local):
        for i in range(8):
            worker.add(i, SamplingParams(max_tokens=4), 0)

    def items() -> list[VerifyItem]:
        return [VerifyItem(i, [5, 9, 33, 71 + i], features=FeatureRequest() if i != 3 else None) for i in range(8)]

    stripped, wire = actor.verify(items())
    assert wire is not None and all(o.features is None for o in stripped)
    rows = 7 * 4 * target.cfg.hidden_size * 4  # 7 sequences asked, 4 float32 rows each
    assert rows <= len(pickle.dumps(wire)) < rows + 2048
    outputs, expected = attach_features(stripped, wire), local.verify(items())
    for out, ref in zip(outputs, expected, strict=True):
        assert out.tokens == ref.tokens and (out.features is None) == (ref.features is None) == (out.seq_id == 3)
        if out.features is not None and ref.features is not None:
            assert torch.equal(out.features, ref.features)
            assert out.features.untyped_storage().nbytes() == out.features.nbytes  # its own rows only


def test_a_target_actor_set_to_float16_sends_its_features_rounded(target: LlamaModel) -> None:
    pytest.importorskip("ray")
    from deployments.actors import TargetActor
    from deployments.wire import FeatureWire, attach_features

    actor = TargetActor.__new__(TargetActor)  # the actor's class in-process: no Ray
    actor.model, actor.feature_wire = target, FeatureWire.float16
    actor.worker = TargetWorker(target, num_slots=2, max_len=32)
    local = TargetWorker(target, num_slots=2, max_len=32)
    for worker in (actor.worker, local):
        for i in range(2):
            worker.add(i, SamplingParams(max_tokens=4), 0)
    items = [VerifyItem(i, [5, 9, 33, 71 + i], features=FeatureRequest()) for i in range(2)]
    stripped, wire = actor.verify(items)
    assert wire is not None and len(wire.data) == 2 * 4 * target.cfg.hidden_size * 2  # float16 rows
    for out, ref in zip(attach_features(stripped, wire), local.verify(items), strict=True):
        assert out.tokens == ref.tokens and out.features is not None and ref.features is not None
        assert out.features.dtype == torch.float32 and torch.equal(out.features, ref.features.half().float())


def test_the_draft_actor_drafts_from_features_that_crossed_as_one_buffer(target: LlamaModel) -> None:
    """RemoteDraft strips a step's features into one buffer; DraftActor.propose puts them back: it drafts what a
    local head worker drafts from the same items."""
    pytest.importorskip("ray")
    from deployments.actors import DraftActor
    from deployments.wire import strip_features
    from specserve.config import SpecConfig, SpecMethod
    from specserve.messages import ProposeItem
    from specserve.models.tiny import tiny_head
    from specserve.workers.head_draft import HeadDraftWorker

    head = tiny_head(target, seed=3)
    verifier = TargetWorker(target, num_slots=2, max_len=48)
    prompts = [[5, 9, 33, 71], [8, 2, 40]]
    for i in range(2):
        verifier.add(i, SamplingParams(max_tokens=4), 0)
    outs = verifier.verify([VerifyItem(i, p, features=FeatureRequest()) for i, p in enumerate(prompts)])
    spec = SpecConfig(method=SpecMethod.ddd, beam_width=3, budget=6)
    items = [
        ProposeItem(i, p + o.tokens, [], 3, spec, features=o.features)
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    actor = DraftActor.__new__(DraftActor)  # the actor's class in-process: no Ray
    actor.model = head
    actor.worker = HeadDraftWorker(head, num_slots=2, max_len=48)
    local = HeadDraftWorker(head, num_slots=2, max_len=48)
    for worker in (actor.worker, local):
        for i in range(2):
            worker.add(i, SamplingParams(max_tokens=4), 0)
    stripped, wire = strip_features(items)
    assert wire is not None and all(it.features is None for it in stripped)
    expected = local.propose(items)
    assert all(p.tokens for p in expected) and actor.propose(stripped, wire) == expected


def test_a_decode_row_beside_a_long_prefill_does_not_keep_the_prefill_alive() -> None:
    """A sequence keeps its features for up to ``catch_up_window`` steps: a view of the step's rows would keep
    another sequence's whole prefill with it; decode rows beside decode rows stay views (no copy a sequence)."""
    wide = tiny_model(tiny_config(hidden_size=1024, intermediate_size=256, num_attention_heads=8))
    worker = TargetWorker(wide, num_slots=3, max_len=400)
    for i in range(3):
        worker.add(i, SamplingParams(max_tokens=8), 0)
    worker.verify([VerifyItem(i, [5 + i, 9], features=FeatureRequest()) for i in range(2)])
    long_prompt = [7 + k % 50 for k in range(300)]  # 300 rows x 4 KiB: past the 1 MiB a view may keep alive
    decoding = [VerifyItem(i, [40 + i], features=FeatureRequest()) for i in range(2)]
    outputs = worker.verify([*decoding, VerifyItem(2, long_prompt, features=FeatureRequest())])
    decode, prefill = outputs[0].features, outputs[2].features
    assert decode is not None and prefill is not None and prefill.shape[0] == 300
    assert decode.untyped_storage().nbytes() == decode.nbytes  # its own row only
    plain = worker.verify([VerifyItem(i, [50 + i], features=FeatureRequest()) for i in range(3)])
    storages = {o.features.untyped_storage().data_ptr() for o in plain if o.features is not None}
    assert len(storages) == 1  # the step's rows, split: no copy a sequence


class _HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name, kwargs = getattr(func, "__name__", ""), kwargs or {}
        # a non-blocking upload (a keyed draw's keys) does not wait for the device
        self.reads += name in HOST_READS and not (name == "to" and kwargs.get("non_blocking"))
        return func(*args, **kwargs)


def test_a_levels_trees_expand_with_one_host_read_and_as_each_alone() -> None:
    """A level of a batch's trees: one log-softmax, top-k and host read for every builder sharing a width and a
    column map, and the same candidates, scores and beam as each builder expanded alone."""
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    token_ids = torch.randperm(500, generator=gen)[:vocab]  # a reduced draft vocabulary's columns -> target ids
    specs = [(10, token_ids), (10, token_ids), (4, token_ids), (10, token_ids), (10, None), (10, token_ids)]
    batched = [TreeBuilder(w, min_score=-6.0) for w, _ in specs]
    alone = [TreeBuilder(w, min_score=-6.0) for w, _ in specs]
    for depth in range(4):
        logits = [torch.randn(len(b.beam) if depth else 1, vocab, generator=gen) * 3 for b in batched]
        level = [(b, lg, m) for b, lg, (_, m) in zip(batched, logits, specs, strict=True) if depth == 0 or b.beam]
        with _HostReads() as counter:
            expand_level(level)
        groups = {(b.width, id(m)) for b, _, m in level}
        assert counter.reads == 2 * len(groups)  # the values and the ids, once per group (not per builder)
        for b, lg, (_, m) in zip(alone, logits, specs, strict=True):
            if depth == 0 or b.beam:
                b.expand(torch.log_softmax(lg, dim=-1), m)
    for b, a in zip(batched, alone, strict=True):
        assert (b.tokens, b.parents, b.scores, b.depths, b.beam, b.set_aside) == (
            a.tokens,
            a.parents,
            a.scores,
            a.depths,
            a.beam,
            a.set_aside,
        )
    assert sum(b.num_candidates for b in batched) > 100


@pytest.mark.parametrize(
    ("chain_draft", "temperature"),
    [("greedy", 0.0), ("keyed", 0.8), ("sampled", 0.8)],
)
def test_a_levels_chains_read_their_tokens_to_the_host_once(
    monkeypatch: pytest.MonkeyPatch, chain_draft: str, temperature: float
) -> None:
    """Each chain's next token was read alone: B device waits a level, where the docs promise one; the chains'
    tokens are those each drafts alone."""
    from specserve.config import ChainDraft, SpecConfig, SpecMethod
    from specserve.messages import ProposeItem
    from specserve.models.tiny import noisy_copy
    from specserve.spec_decode import chain
    from specserve.workers import DraftWorker
    from specserve.workers import draft as draft_module

    model = noisy_copy(tiny_model(seed=0), 0.05, seed=3)
    spec = SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft(chain_draft))
    depth, b_size = 3, 8
    reads: list[int] = []

    def counted(chains: Any, forward: Callable[..., Any]) -> None:
        counter = _HostReads()
        in_forwards = 0

        def forward_uncounted(*args: Any, **kwargs: Any) -> Any:
            nonlocal in_forwards
            before = counter.reads
            out = forward(*args, **kwargs)
            in_forwards += counter.reads - before
            return out

        with counter:
            chain.draft_chains(chains, forward_uncounted)
        reads.append(counter.reads - in_forwards)

    monkeypatch.setattr(draft_module, "draft_chains", counted)

    def drafted(seq_ids: list[int]) -> list[list[int]]:
        worker = DraftWorker(model, num_slots=b_size, max_len=64)
        for i in seq_ids:
            worker.add(i, SamplingParams(max_tokens=8, temperature=temperature, seed=100 + i), 0)
        items = [ProposeItem(i, [5 + i, 9, 33, 71], [], depth, spec, root_position=3) for i in seq_ids]
        return [p.tokens for p in worker.propose(items)]

    together = drafted(list(range(b_size)))
    assert reads == [depth]  # one read a level, for the whole batch
    assert together == [drafted([i])[0] for i in range(b_size)]
    assert all(len(tokens) == depth for tokens in together)


@pytest.mark.parametrize("method", ["chain", "ddd"])
def test_a_steps_draft_distributions_reach_the_host_in_one_copy(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """DSDE's sparse draft q (top-K ids and probabilities at every fed node) was copied to the host twice per
    sequence; now twice per step, each sequence's rows as it computes them alone."""
    from specserve.config import KLDMode, SpecConfig, SpecMethod
    from specserve.messages import ProposeItem
    from specserve.models.tiny import noisy_copy
    from specserve.spec_decode import draft_state
    from specserve.workers import DraftWorker
    from specserve.workers import draft as draft_module

    model = noisy_copy(tiny_model(seed=0), 0.05, seed=3)
    spec = SpecConfig(method=SpecMethod(method), sl=3, beam_width=3, budget=8, ddd_max_depth=3, kld_top_k=6)
    b_size = 6
    reads: list[int] = []

    class DeviceToHost(TorchFunctionMode):  # copies off the device (casts with .to(dtype) are not)
        def __init__(self) -> None:
            super().__init__()
            self.reads = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = getattr(func, "__name__", "")
            to_device = (  # a blocking move (a non-blocking upload does not wait for the device)
                name == "to"
                and not (kwargs or {}).get("non_blocking")
                and any(isinstance(a, str | torch.device) for a in (*args[1:], *(kwargs or {}).values()))
            )
            self.reads += to_device or name in ("cpu", "tolist", "item", "__int__", "__float__", "__bool__")
            return func(*args, **(kwargs or {}))

    def counted(built: Any) -> Any:
        with DeviceToHost() as counter:
            out = draft_state.with_draft_qs(built)
        reads.append(counter.reads)
        return out

    monkeypatch.setattr(draft_module, "with_draft_qs", counted)

    def drafted(seq_ids: list[int]) -> list[Any]:
        worker = DraftWorker(model, num_slots=b_size, max_len=64)
        for i in seq_ids:
            worker.add(i, SamplingParams(max_tokens=8), 0)
        items = [ProposeItem(i, [5 + i, 9, 33, 71], [], 3, spec, kld_mode=KLDMode.sparse) for i in seq_ids]
        return [p.draft_q for p in worker.propose(items)]

    together = drafted(list(range(b_size)))
    assert reads == [2]  # the ids and the probabilities, for the whole batch
    for i, q in enumerate(together):
        alone = drafted([i])[0]
        assert q is not None and alone is not None and q.nodes == alone.nodes and len(q.nodes) > 1
        np.testing.assert_array_equal(q.idx, alone.idx)
        np.testing.assert_allclose(q.prob, alone.prob, rtol=1e-4)  # (a batched forward rounds its own way)
