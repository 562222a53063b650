"""A step's features as one buffer between the actors and the router (``deployments/wire.py``)."""

from __future__ import annotations

import pickle

import pytest
import torch

from deployments.wire import attach_features, strip_features
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
