"""csrc/argmax.cpp: greedy tokens from float32 logits, the same indices as ``sampling.greedy_draw`` row for row (the
first maximum; V where a row's maximum is not finite), and ``lm_head.argmax_rows`` takes them where the model's
layers run from C++."""

from __future__ import annotations

import pytest
import torch

import specserve.models.lm_head as lm_head
from specserve.messages import VerifyItem
from specserve.models.native_stack import NativeStackUnavailable, attach_native_stack, extension
from specserve.models.tiny import tiny_model
from specserve.sampling import SamplingParams, greedy_draw
from specserve.workers.target import TargetWorker

try:
    ext = extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ extension cannot be built here: {e}", allow_module_level=True)

INF, NAN = float("inf"), float("nan")


def rows_of(vocab: int, g: torch.Generator) -> torch.Tensor:
    """Rows that tell the rules apart: ties (the first wins) in the 8-wide body and in the tail, the maximum in the
    last element, a NaN in the body or the tail, +inf, a row of -inf, -inf beside finite values, signed zeros."""
    x = 3 * torch.randn(12, vocab, generator=g)
    last = vocab - 1
    x[1, [last // 3, last // 2, last]] = 50.0  # a tie: the first of the three
    x[2, last] = 60.0  # the maximum in the last element (the tail where vocab % 8)
    x[3, last // 2] = NAN  # a NaN anywhere
    x[4, last] = NAN
    x[5, last // 3] = INF
    x[6] = -INF
    x[7, ::2] = -INF
    x[8] = 0.0
    x[8, 0] = -0.0  # equal to +0.0: index 0
    x[9] = x[9].round()  # many ties of integers
    x[10, 0] = 70.0  # the maximum first
    x[11, [last, 0]] = torch.tensor([80.0, 80.0])
    return x


@pytest.mark.parametrize("portable", [False, True], ids=["vector", "scalar"])
@pytest.mark.parametrize("vocab", [49152, 517, 13, 7, 1])
def test_the_extensions_first_max_ids_are_greedy_draw(vocab: int, portable: bool) -> None:
    """On this CPU's path (AVX2 where it has it) and on the scalar one other CPUs run."""
    g = torch.Generator().manual_seed(vocab)
    x = rows_of(vocab, g) if vocab > 2 else torch.tensor([[1.0], [NAN], [-INF], [INF], [-2.5]])
    got = ext.first_max_ids(x, portable)
    assert got.dtype == torch.int64 and torch.equal(got, greedy_draw(x))
    assert torch.equal(ext.first_max_ids(x[:1], portable), greedy_draw(x[:1]))  # one row: no parallel split
    if vocab > 2:
        assert got[3].item() == got[4].item() == got[5].item() == got[6].item() == vocab  # not finite: V
        assert got[1].item() == (vocab - 1) // 3 and got[2].item() == vocab - 1 and got[8].item() == 0


def test_many_rows_and_a_strided_view() -> None:
    """Rows split over the threads, and logits that are a view (a step's rows of a larger tensor, transposed)."""
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(41, 3001, generator=g)).round()  # ties in most rows
    assert torch.equal(ext.first_max_ids(x), greedy_draw(x))
    view = (3 * torch.randn(300, 37, generator=g)).t()[5:20]  # [15, 300], not contiguous
    assert not view.is_contiguous() and torch.equal(ext.first_max_ids(view), greedy_draw(view))


def test_the_extensions_first_max_ids_refuse_other_tensors() -> None:
    for bad, message in [
        (torch.randn(2, 8, dtype=torch.float64), "float32"),
        (torch.randn(8), "float32"),
        (torch.randn(2, 0), "empty vocabulary"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            ext.first_max_ids(bad)


def counted_first_max_ids(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the extension's argmax calls (on the extension itself, so the callers' choice of path is what is
    tested); the count is the list's one element."""
    calls = [0]
    native = ext.first_max_ids

    def counted(logits: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return native(logits)

    monkeypatch.setattr(ext, "first_max_ids", counted)
    return calls


def test_argmax_rows_takes_the_extension_where_the_layers_run_from_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counted_first_max_ids(monkeypatch)
    model = tiny_model(seed=0)
    x = 3 * torch.randn(3, model.cfg.vocab_size, generator=torch.Generator().manual_seed(2))
    assert torch.equal(lm_head.argmax_rows(model, x), greedy_draw(x)) and calls[0] == 0  # Python layers
    assert attach_native_stack(model)
    assert torch.equal(lm_head.argmax_rows(model, x), greedy_draw(x)) and calls[0] == 1
    assert torch.equal(lm_head.argmax_rows(model, x.double()), greedy_draw(x)) and calls[0] == 1  # float32 only


def test_a_target_workers_greedy_step_takes_the_extensions_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy prefill through ``TargetWorker.verify`` on C++ layers gets its token from the extension, the same
    token as the Python layers' step."""
    calls = counted_first_max_ids(monkeypatch)
    tokens = []
    for cpp in (False, True):
        worker = TargetWorker(tiny_model(seed=3), num_slots=1, max_len=16)
        if cpp:
            assert attach_native_stack(worker.model)
        worker.add(0, SamplingParams(temperature=0.0), position=0)
        tokens.append(worker.verify([VerifyItem(0, [5, 9, 33, 71])])[0].tokens)
        assert calls[0] == int(cpp)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 1
