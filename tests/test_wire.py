"""A step's features as one buffer between the actors and the router (``deployments/wire.py``)."""

from __future__ import annotations

import pickle

import pytest
import torch

from deployments.wire import FeatureWire, attach_features, strip_features
from specserve.config import SpecConfig, SpecMethod
from specserve.messages import ProposeItem, VerifyOutput


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_features_come_back_bit_for_bit_in_their_messages(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    feats = [torch.randn(n, 12, generator=gen).to(dtype) if n is not None else None for n in (3, None, 1, 0, 5)]
    feats[2][0, 0] = float("nan")  # type: ignore[index]  # any bit pattern crosses as it is
    outputs = [VerifyOutput(i, [1], [7, 8], features=f) for i, f in enumerate(feats)]
    stripped, wire = strip_features(outputs)
    assert wire is not None and [o.features for o in stripped] == [None] * 5
    assert [o.tokens for o in stripped] == [[7, 8]] * 5
    back = attach_features(*pickle.loads(pickle.dumps((stripped, wire))))
    assert [o.seq_id for o in back] == list(range(5))
    for out, f in zip(back, feats, strict=True):
        if f is None:
            assert out.features is None
            continue
        assert out.features is not None and out.features.dtype == dtype and out.features.shape == f.shape
        assert torch.equal(out.features.view(torch.uint8), f.view(torch.uint8))
        assert out.features.untyped_storage().nbytes() == out.features.nbytes  # its own rows, not the step's buffer


def test_a_step_whose_features_have_no_rows_crosses_too() -> None:
    outputs = [VerifyOutput(0, [], [1], features=torch.zeros(0, 6)), VerifyOutput(1, [], [2])]
    stripped, wire = strip_features(outputs)
    assert wire is not None and wire.data == b"" and wire.rows == (0, None)
    back = attach_features(stripped, wire)
    assert back[0].features is not None and back[0].features.shape == (0, 6) and back[1].features is None


def test_features_of_different_kinds_in_one_step_are_refused() -> None:
    for other in (torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(1, 5)):
        outputs = [VerifyOutput(0, [], [1], features=torch.zeros(2, 4)), VerifyOutput(1, [], [2], features=other)]
        with pytest.raises(ValueError, match="differ in dtype or width"):
            strip_features(outputs)


def test_propose_items_cross_the_same_way_and_messages_without_features_cross_as_they_are() -> None:
    spec = SpecConfig(method=SpecMethod.ddd)
    items = [
        ProposeItem(0, [5], [], 3, spec=spec, features=torch.ones(2, 4), feature_start=9),
        ProposeItem(1, [6], [], 2),
    ]
    stripped, wire = strip_features(items)
    assert wire is not None and wire.rows == (2, None)
    back = attach_features(stripped, wire)
    assert back[1] == items[1] and back[0].feature_start == 9 and back[0].spec == spec
    assert back[0].features is not None and torch.equal(back[0].features, torch.ones(2, 4))
    plain = [ProposeItem(2, [1], [], 1)]
    assert strip_features(plain) == (plain, None) and attach_features(plain, None) == plain


def test_features_for_other_messages_are_refused() -> None:
    outputs = [
        VerifyOutput(0, [], [1], features=torch.zeros(2, 3)),
        VerifyOutput(1, [], [2], features=torch.zeros(1, 3)),
    ]
    stripped, wire = strip_features(outputs)
    with pytest.raises(ValueError, match="features for 2 messages arrived with 1"):
        attach_features(stripped[:1], wire)


def test_float32_features_cross_as_float16_and_come_back_as_float32() -> None:
    """``FeatureWire.float16``: half the bytes on the wire (16 EAGLE-3 rows of SmolLM2 stay under Ray's 100 KiB
    inline limit); each message gets its rows back in float32, as float16 rounded them."""
    gen = torch.Generator().manual_seed(1)
    feats = [torch.randn(3, 12, generator=gen) * 300.0, None, torch.randn(1, 12, generator=gen) * 1e-3]
    outputs = [VerifyOutput(i, [], [7], features=f) for i, f in enumerate(feats)]
    stripped, wire = strip_features(outputs, FeatureWire.float16)
    assert wire is not None and wire.dtype == torch.float16 and wire.restore == torch.float32
    assert len(wire.data) == 4 * 12 * 2
    back = attach_features(*pickle.loads(pickle.dumps((stripped, wire))))
    for out, f in zip(back, feats, strict=True):
        if f is None:
            assert out.features is None
            continue
        assert out.features is not None and out.features.dtype == torch.float32 and out.features.shape == f.shape
        assert torch.equal(out.features, f.half().float())
        assert not torch.equal(out.features, f)  # rounded: these values are not all float16 numbers
        assert out.features.untyped_storage().nbytes() == out.features.nbytes
    native = strip_features(outputs)[1]
    assert native is not None and native.dtype == torch.float32 and native.restore is None


@pytest.mark.parametrize(
    "rows",
    [
        torch.tensor([[1.0, 7.0e4]]),  # past float16's largest value: it would arrive as inf
        torch.tensor([[1.0, float("nan")]]),
        torch.tensor([[-float("inf"), 1.0]]),
        torch.tensor([[1.0, 3.3]], dtype=torch.bfloat16),  # already two bytes a value
        torch.tensor([[1.0, 3.3]], dtype=torch.float16),
    ],
)
def test_rows_float16_cannot_hold_and_other_dtypes_cross_as_they_are(rows: torch.Tensor) -> None:
    other = torch.ones(2, 2, dtype=rows.dtype)  # the step's other rows: float16 could hold them
    outputs = [VerifyOutput(0, [], [7], features=rows), VerifyOutput(1, [], [8], features=other)]
    stripped, wire = strip_features(outputs, FeatureWire.float16)
    assert wire is not None and wire.restore is None and wire.dtype == rows.dtype
    back = attach_features(stripped, wire)
    assert back[0].features is not None and back[0].features.dtype == rows.dtype
    assert torch.equal(back[0].features.view(torch.uint8), rows.view(torch.uint8))
    assert back[1].features is not None and torch.equal(back[1].features, other)  # the whole step crossed as it is


def test_a_worker_actor_keeps_the_feature_wire_it_was_built_with() -> None:
    pytest.importorskip("ray")
    from deployments.actors import KVGeometry, TargetActor
    from deployments.app_args import AppArgs, TinyModels, WorkerRole
    from specserve.messages import FeatureRequest, VerifyItem
    from specserve.sampling import SamplingParams

    args = AppArgs(tiny=TinyModels(draft_head=True))
    for wire, dtype in ((FeatureWire.float16, torch.float16), (FeatureWire.native, torch.float32)):
        host = TargetActor(args.recipe(WorkerRole.target), "cpu", None, False, wire)  # in this process, no Ray
        host.start(KVGeometry(1, 16))
        host.add(0, SamplingParams(max_tokens=2), 0)
        _, sent = host.verify([VerifyItem(0, [5, 9, 33], features=FeatureRequest())])
        assert sent is not None and sent.dtype == dtype


def test_a_draft_proxy_sends_its_features_as_its_wire_says() -> None:
    pytest.importorskip("ray")
    from deployments.actors import RemoteDraft
    from deployments.app_args import WorkerRole

    sent: list[object] = []

    class Method:
        def remote(self, items: object, features: object) -> tuple[object, object]:
            sent.append(features)
            return items, features

    class Handle:
        propose = Method()

    items = [ProposeItem(0, [5], [], 3, features=torch.full((2, 4), 0.1))]
    for wire, dtype in ((FeatureWire.float16, torch.float16), (FeatureWire.native, torch.float32)):
        proxy = RemoteDraft(Handle(), "draft", WorkerRole.draft, feature_wire=wire)  # type: ignore[arg-type]
        proxy._started = None
        proxy._call = lambda method, *args: method.remote(*args)  # type: ignore[method-assign]
        proxy.propose(items)
        assert sent[-1].dtype == dtype  # type: ignore[attr-defined]


def test_the_factory_gives_each_actor_and_its_proxy_the_apps_feature_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    import deployments.actors as actors
    from deployments.app_args import AppArgs, WorkerRole

    created: list[tuple[object, ...]] = []

    class ActorClass:
        def options(self, **_: object) -> ActorClass:
            return self

        def remote(self, *args: object) -> object:
            created.append(args)
            return object()

    monkeypatch.setattr(actors.ray, "remote", lambda cls: ActorClass())
    for wire in (FeatureWire.float16, FeatureWire.native):
        args = AppArgs.model_validate({"tiny": {"draft_head": True}, "feature_wire": wire.value})
        for role in (WorkerRole.target, WorkerRole.draft):
            proxy = actors.WorkerFactory(args, None, "t").create(0, role, 0)
            assert created[-1][-1] == wire and proxy.feature_wire == wire
    assert AppArgs().feature_wire == FeatureWire.float16
