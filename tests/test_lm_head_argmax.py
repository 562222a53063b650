"""models/lm_head.py: greedy tokens from a bfloat16 copy of the LM head equal the full float32 logits' argmax."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pytest
import torch

from specserve.config import ModelSpec
from specserve.models.lm_head import BF16_ROUNDING, attach_bounded_argmax, greedy_ids, rounding_bound
from specserve.models.native_stack import NativeStackUnavailable, attach_small_gemm, extension
from specserve.models.tiny import tiny_config, tiny_model

try:
    ext = extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ extension cannot be built here: {e}", allow_module_level=True)
if not ext.small_gemm_supported():  # pragma: no cover - a CPU without AVX-512F or AVX2 + FMA
    pytest.skip("the small-product kernel is not available on this CPU", allow_module_level=True)


def bounded(weight: torch.Tensor) -> tuple[object, torch.Tensor, float]:
    return (
        ext.small_pack(weight.to(torch.bfloat16)),
        (weight.double().norm(dim=1) * (1 + 2.0**-20)).float(),
        rounding_bound(weight.shape[1]),
    )


def test_the_bound_holds_where_the_rounding_is_worst() -> None:
    """Weights just under halfway between two bfloat16 values (each rounds by ~2^-8 of itself, all the same way)
    against equal activations: Cauchy-Schwarz is tight and the error nearly reaches the bound, never past it."""
    k = 576
    w = torch.full((4, k), 1 + 2.0**-8 - 2.0**-20)  # bf16 step at 1 is 2^-7: these round down by ~2^-8
    w[1] *= -1
    w[2, ::2] = 3.0  # exact in bf16
    x = torch.ones(3, k)
    x[1] = 0.5
    exact = ext.small_linear(x, w)
    approx = ext.small_linear_bf16(x, w.to(torch.bfloat16))
    bound = rounding_bound(k) * x.norm(dim=1)[:, None] * w.norm(dim=1)[None, :]
    err = (approx - exact).abs()
    assert (err <= bound).all()
    assert (err[:, 0] >= 0.95 * bound[:, 0]).all()  # the worst case is reached: a looser bound would still pass,
    assert rounding_bound(k) < 1.05 * BF16_ROUNDING  # a tighter one (say 2^-9) would fail the line above


def test_near_ties_and_exact_ties_give_the_full_argmax() -> None:
    """Rows a float32 ulp apart (the same in bfloat16), exact ties (the first one wins, as argmax), random rows."""
    gen = torch.Generator().manual_seed(0)
    v, k = 1001, 64
    w = torch.randn(v, k, generator=gen) * 0.1
    x = torch.randn(8, k, generator=gen)
    best = ext.small_linear(x, w).argmax(-1)
    for r in range(8):  # near-ties: copies of each row's winner nudged by one float32 ulp, either way
        j = int(best[r])
        for t, step in [(900 + r, 1.0), (950 + r, -1.0)]:
            w[t] = w[j]
            i = int(x[r].abs().argmax())
            w[t, i] = torch.nextafter(w[j, i], torch.tensor(step * float(x[r, i].sign()) * float("inf")))
    w[990] = w[int(best[0])]  # an exact tie of row 0's winner, later in the vocabulary
    packed, norms, c = bounded(w)
    full = ext.small_linear(x, w)
    ids, ok = ext.small_bounded_argmax(x, packed, w, norms, c)
    assert ok
    assert torch.equal(ids, full.argmax(-1))
    assert {int(i) for i in ids} & set(range(900, 958))  # the nudged-up copies won somewhere: near-ties were hit


def test_an_overflowing_logit_hands_back_to_the_full_product() -> None:
    w = torch.ones(16, 8)
    w[3] = 3e38
    packed, norms, c = bounded(w)
    _, ok = ext.small_bounded_argmax(torch.full((1, 8), 10.0), packed, w, norms, c)
    assert not ok


def test_an_exact_logit_that_overflows_where_its_copy_does_not_hands_back_too() -> None:
    """A weight that bfloat16 rounds down: the copy's logit stays just below FLT_MAX, the exact one is +inf, which
    the full logits refuse as a maximum (``greedy_draw`` gives V); the kernel had returned that row as the argmax."""
    k, fmax = 32, torch.finfo(torch.float32).max
    v, ulp = 2.0**120, 2.0**113  # a bfloat16 value and its spacing there
    w = torch.ones(2, k)
    w[0] = v + 0.45 * ulp  # rounds down to v in bfloat16
    assert torch.equal(w[0].bfloat16().float(), torch.full((k,), v))
    x = torch.full((1, k), fmax / (k * (v + 0.2 * ulp)))  # k v x < FLT_MAX < k w x
    packed, norms, c = bounded(w)
    assert torch.isfinite(ext.small_linear_packed(x, packed, None)).all()
    assert torch.isinf(ext.small_linear(x, w, None)[0, 0])
    _, ok = ext.small_bounded_argmax(x, packed, w, norms, c)
    assert not ok


def test_greedy_ids_on_a_model_with_and_without_the_switch() -> None:
    model = tiny_model(tiny_config("llama", hidden_size=128, vocab_size=3000), seed=3)
    model.requires_grad_(False)
    hidden = torch.randn(12, 128, generator=torch.Generator().manual_seed(5))
    assert attach_bounded_argmax(model) is False  # no kernel on its LM head yet
    assert attach_small_gemm(model)
    assert attach_bounded_argmax(model) is True
    want = model.logits(hidden).argmax(-1)
    for rows in (1, 3, 8, 12):  # 12: past ARGMAX_ROWS, the full logits
        assert torch.equal(greedy_ids(model, hidden[:rows]), want[:rows])
    nan = hidden[:2].clone()
    nan[1, 0] = float("nan")  # row 1's logits all NaN: no token, out of range for verification to reject
    assert greedy_ids(model, nan).tolist() == [int(want[0]), 3000]
    assert ModelSpec().bounded_argmax is True
    # a subnormal weight is rounded by more than the bound's relative c_K: the copy is not used (it picked another
    # token in 1 of 50 trials on a head of such weights)
    model.bounded_argmax = None
    model.lm_head.weight[7, 3] = 1e-39
    assert attach_bounded_argmax(model) is False and model.bounded_argmax is None


@torch.inference_mode()
def test_a_context_shorter_than_the_probes_is_measured_within_it() -> None:
    """The load's timing probes hold up to 8 rows in one cache: a model of 2 to 8 positions failed its load there
    with a KV capacity error."""
    for positions in (2, 4, 8):
        model = tiny_model(tiny_config("llama", max_position_embeddings=positions), seed=4).requires_grad_(False)
        assert attach_small_gemm(model)
        attach_bounded_argmax(model, measure=True)  # (a mask or no copy: either is a load)


@torch.inference_mode()
def test_the_copy_serves_the_row_counts_it_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """attach_bounded_argmax(measure=True) times the copy against the full logits at the probes: a valid mask, or no
    copy where it won no count; greedy_ids reads the copy exactly for the counts in the mask, the full logits
    elsewhere, and the same tokens either way."""
    from specserve.models import lm_head

    model = tiny_model(tiny_config("llama", hidden_size=128, vocab_size=3000), seed=4)
    model.requires_grad_(False)
    assert attach_small_gemm(model)
    if attach_bounded_argmax(model, measure=True):
        mask = model.bounded_argmax.rows
        assert 0 < mask <= lm_head.EVERY_BOUNDED
        # probes 1, 2, 4, 6, 8: 3 rows follow 2, 5 follow 4, 7 follow 6 (bit r - 1 for r rows)
        assert all((mask >> (r - 1) & 1) == (mask >> (r - 2) & 1) for r in (3, 5, 7))
    else:
        assert model.bounded_argmax is None
    hidden = torch.randn(8, 128, generator=torch.Generator().manual_seed(6))
    want = model.logits(hidden).argmax(-1)
    calls: list[int] = []
    real = lm_head.bounded_ids

    def spy(m: object, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(m, x)  # type: ignore[arg-type]

    monkeypatch.setattr(lm_head, "bounded_rows", lambda m: 0)  # slower at every count: not kept
    assert not attach_bounded_argmax(model, measure=True) and model.bounded_argmax is None
    assert torch.equal(greedy_ids(model, hidden[:2]), want[:2])
    assert attach_bounded_argmax(model)
    monkeypatch.setattr(lm_head, "bounded_ids", spy)
    model.bounded_argmax = lm_head.BoundedArgmax(**{**model.bounded_argmax.__dict__, "rows": 0b111})  # 1-3 rows
    for rows in range(1, 9):
        assert torch.equal(greedy_ids(model, hidden[:rows]), want[:rows])
    assert calls == [1, 2, 3]


@pytest.mark.real_model
def test_real_model_greedy_tokens_equal_the_full_logits() -> None:
    """SmolLM2's hidden states over random tokens: every position's token from the bounded copy equals the full
    logits' argmax (the MT-bench greedy-equality tests run every pair with the switch on)."""
    from specserve.models.batch import ForwardBatch
    from specserve.models.loader import load_model

    model = load_model(ModelSpec(q8_head_reads=False, small_gemm_plan=False))  # the copy for 1-8 rows, unmeasured
    assert model.bounded_argmax is not None and model.bounded_argmax.rows == (1 << 8) - 1
    cache = model.new_cache(1, 300)
    slot = cache.allocate()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (40,), generator=gen)
    with torch.inference_mode():
        hidden = model.final_hidden(ForwardBatch.build(cache, [slot], [tokens]), cache)
        for start in range(0, 40, 8):
            rows = hidden[start : start + 8]
            assert torch.equal(greedy_ids(model, rows), model.logits(rows).argmax(-1))


def test_the_target_worker_decodes_greedy_steps_without_full_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain greedy steps and a drafted chain through the worker: with the copy attached the full logits are never
    computed (model.logits would raise), and the tokens equal those of the same model without the switch."""
    from specserve.messages import VerifyItem
    from specserve.sampling import SamplingParams
    from specserve.workers import TargetWorker

    cfg = tiny_config("llama", hidden_size=128, vocab_size=3000)
    fast, full = tiny_model(cfg, seed=4), tiny_model(cfg, seed=4)
    for m in (fast, full):
        m.requires_grad_(False)
        assert attach_small_gemm(m)
    assert attach_bounded_argmax(fast)

    def no_logits(hidden: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a greedy step computed the full logits")

    monkeypatch.setattr(fast, "logits", no_logits)
    tokens: dict[str, list[int]] = {}
    for name, m in (("fast", fast), ("full", full)):
        worker = TargetWorker(m, num_slots=1, max_len=64)
        worker.add(0, SamplingParams(temperature=0.0, max_tokens=32), 4)
        seq = [5, 17, 29, 4]
        out = worker.verify([VerifyItem(0, seq)])[0]
        seq += out.tokens
        for _ in range(6):
            out = worker.verify([VerifyItem(0, [seq[-1]])])[0]
            seq += out.tokens
        out = worker.verify([VerifyItem(0, [seq[-1]], draft_tokens=[7, 8, 9], draft_parents=[0, 1, 2])])[0]
        tokens[name] = seq + out.tokens
    assert tokens["fast"] == tokens["full"]


def test_the_lm_head_benchmark_writes_a_row_per_row_count(tmp_path: Path) -> None:
    from specserve.bench.lm_head import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--tiny", "--rows", "1", "3", "--repeats", "1", "--evict-mb", "1"])
    args.out = tmp_path
    assert run(args) == 0
    with (tmp_path / "lm_head.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["rows"] for r in rows] == ["1", "3"]
    assert all(float(r["full_ms"]) > 0 and float(r["bounded_ms"]) > 0 for r in rows)


@pytest.mark.real_model
def test_the_lm_head_benchmark_times_the_q8_records_of_the_builtin_target(tmp_path: Path) -> None:
    """The builtin's LM head shares its GGUF's Q8_0 token embedding: the records' and the engine's greedy columns
    are filled (run() raises where any column's tokens differ from the full logits' argmax)."""
    from specserve.bench.lm_head import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--rows", "1", "4", "--repeats", "1", "--evict-mb", "1", "--out", str(tmp_path)])
    assert run(args) == 0
    with (tmp_path / "lm_head.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["rows"] for r in rows] == ["1", "4"]
    assert all(float(r["q8_ms"]) > 0 and float(r["greedy_ms"]) > 0 for r in rows)
