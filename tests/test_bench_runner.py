"""The runner benchmarks' plumbing (issue 14): what `bench runner` times, and how `bench llamacpp` reads PyPI and
llama-bench. The builds and timings themselves are benchmarks, not tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.bench.llamacpp import parse_llama_bench, sdist_url
from specserve.bench.runner import csv_name, in_order, path_matmuls, weight_linears
from specserve.models.batch import ForwardBatch
from specserve.models.tiny import tiny_model
from specserve.tune import batch_decode_forward, verify_forward


def test_bare_matmuls_read_every_weight_the_forward_reads() -> None:
    model = tiny_model(seed=0)
    weights = weight_linears(model)
    assert len(weights) == 4 * model.cfg.num_layers + 1  # qkv, o, gate_up, down per layer, and the LM head
    n_params = sum(w.numel() for w in weights)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert n_params == linear_params  # tied LM head counted once, as the forward reads it
    calls: list[tuple[int, ...]] = []
    real = torch.nn.functional.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((x.shape[0], *w.shape))
        return real(x, w, b)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "linear", spy)
        path_matmuls(in_order(model), 4)()
    assert calls == [(4, *w.shape) for w in weights]


@pytest.mark.parametrize("tree_mask", [True, False])
def test_verify_forward_leaves_the_context_as_it_found_it(tree_mask: bool) -> None:
    model = tiny_model(seed=0)
    caches = []
    real_new_cache = model.new_cache

    def new_cache(num_slots: int, max_len: int | None = None):  # type: ignore[no-untyped-def]
        caches.append(real_new_cache(num_slots, max_len))
        return caches[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "new_cache", new_cache)
        fn = verify_forward(model, 4, context=10, tree_mask=tree_mask)
    assert caches[0].length(0) == 10
    for _ in range(2):  # repeatable: every call appends 4 tokens and cuts the cache back to the context
        fn()
        assert caches[0].length(0) == 10


def test_batch_decode_forward_steps_every_sequence_once_and_cuts_back() -> None:
    model = tiny_model(seed=0)
    caches = []
    real_new_cache = model.new_cache
    batches: list[ForwardBatch] = []
    real_forward = model.forward

    def new_cache(num_slots: int, max_len: int | None = None):  # type: ignore[no-untyped-def]
        caches.append(real_new_cache(num_slots, max_len))
        return caches[-1]

    def forward(batch: ForwardBatch, cache):  # type: ignore[no-untyped-def]
        batches.append(batch)
        return real_forward(batch, cache)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "new_cache", new_cache)
        fn = batch_decode_forward(model, 3, context=10)
        mp.setattr(model, "forward", forward)
        for _ in range(2):
            fn()
            assert [caches[0].length(s) for s in range(3)] == [10, 10, 10]
    assert [b.num_new for b in batches] == [(1, 1, 1)] * 2
    assert batches[0].slot_range == (0, 3)


def test_llama_bench_json_and_pypi_sdist() -> None:
    rows = [
        {"n_prompt": 16, "n_gen": 0, "avg_ts": 812.5},
        {"n_prompt": 0, "n_gen": 64, "avg_ts": 47.25},
    ]
    assert parse_llama_bench(json.dumps(rows)) == {"pp16": 812.5, "tg64": 47.25}
    slow_one = [{"n_prompt": 0, "n_gen": 64, "avg_ts": 33.0, "samples_ts": [47.0, 5.0, 47.5]}]  # one slow repetition
    assert parse_llama_bench(json.dumps(slow_one)) == {"tg64": 47.0}  # the median, as this runner's side
    doc = {
        "info": {"version": "11434.0.0"},
        "urls": [
            {"packagetype": "bdist_wheel", "url": "https://x/a.whl"},
            {"packagetype": "sdist", "url": "../../packages/a.tar.gz"},
        ],
    }
    assert sdist_url(doc) == ("11434.0.0", "../../packages/a.tar.gz")
    with pytest.raises(RuntimeError, match="no sdist"):
        sdist_url({"info": {"version": "1"}, "urls": []})


def test_llamacpp_pp_asks_for_the_last_rows_logits_as_llama_bench_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-bench's prompt test outputs only the last token's logits; the runner's pp16 computed the LM head over
    all 16 rows (~8% more time on this CPU), which understated it against llama.cpp."""
    from specserve.bench import llamacpp

    model = tiny_model(seed=0)
    asked: list[tuple[int, tuple[int, ...]]] = []
    real_build = ForwardBatch.build

    def build(*args, **kwargs):  # type: ignore[no-untyped-def]
        batch = real_build(*args, **kwargs)
        asked.append((batch.tokens.numel(), batch.num_logits))
        return batch

    monkeypatch.setattr(ForwardBatch, "build", build)
    rates = llamacpp.runner_rates(model, repeats=1)
    assert set(rates) == {"pp16", "tg64"}
    assert [logits for n, logits in asked if n == 16] == [(1,), (1,)]  # the untimed pass and the one timed


@pytest.mark.real_model
def test_llamacpps_f32_row_is_the_float32_model_and_the_records_have_their_own() -> None:
    """The F32 row, compared with llama.cpp's F32 GGUF, took the defaults, which read the Q4_1 and Q8_0 records
    (2.8x faster decoding here): it was not float32 at all."""
    from specserve.bench.llamacpp import RUNNER_WEIGHTS
    from specserve.models.loader import load_model

    def records(spec_key: str) -> int:
        model = load_model(RUNNER_WEIGHTS[spec_key][0])
        return sum(getattr(m, "small_records", None) is not None for m in model.modules())

    assert records("F32") == 0
    assert records("Q4_1 records") > 0
    assert {peer for _, peer in RUNNER_WEIGHTS.values()} == {"F32", "Q4_1"}


@pytest.mark.real_model
def test_llamacpps_int8_row_runs_int8_products_or_is_left_out() -> None:
    """The int8 row times int8 products where the CPU runs them, and is left out elsewhere (it would time the float32
    products under the int8 name)."""
    from specserve.bench.llamacpp import RUNNER_WEIGHTS, runner_weights
    from specserve.models.loader import load_model
    from specserve.models.native_stack import extension

    here = runner_weights()
    if not extension().int8_kernels():
        assert "Q4_1 int8" not in here and set(here) == set(RUNNER_WEIGHTS) - {"Q4_1 int8"}
        return
    assert set(here) == set(RUNNER_WEIGHTS)
    model = load_model(here["Q4_1 int8"][0])
    assert all(getattr(layer.down, "int8_records", None) is not None for layer in model.decoder_layers())


@pytest.mark.real_model
def test_bench_runner_without_the_small_product_kernel_leaves_its_settings_columns_empty(tmp_path: Path) -> None:
    """In bfloat16 the kernel is absent, so the models loaded with one of its settings changed are the model
    itself: their columns repeated the runner's own timings under other names."""
    import csv

    from specserve.cli import main

    args = ["--dtype", "bfloat16", "--rows", "1", "--repeats", "1", "--out", str(tmp_path)]
    assert main(["bench", "runner", *args]) == 0
    (row,) = csv.DictReader((tmp_path / "runner_bfloat16.csv").open())
    assert row["small_gemm"] == ""
    empty = ("blas_runner_ms", "rowmajor_runner_ms", "kpacked_bare_ms", "unplanned_runner_ms", "f32_reads_runner_ms")
    assert all(row[col] == "nan" for col in empty)
    assert float(row["runner_ms"]) > 0 and float(row["sdpa_runner_ms"]) > 0  # what runs without the kernel is timed


def test_a_one_row_forward_reads_the_records_its_products_read() -> None:
    """``bench runner``'s floor: a linear's bytes are its int8 records' where it has them (every row count; the loader
    then keeps no float32 records beside them), else the kernel's records or copy where one row reads them, else its
    float weight."""
    from specserve.bench.runner import one_row_bytes
    from specserve.models.native_stack import (
        attach_int8_reads,
        attach_q4_reads,
        attach_small_gemm,
        extension,
        small_gemm_available,
    )
    from tests.test_q4_reads import q4_tiny_model

    if not small_gemm_available():
        pytest.skip("the small-product kernel is not available on this CPU")
    model, blocks = q4_tiny_model(5, hidden_size=256, intermediate_size=256)
    down = model.decoder_layers()[0].down
    float_bytes = down.weight.numel() * 4
    assert one_row_bytes(down) == float_bytes
    assert attach_small_gemm(model) and attach_q4_reads(model, blocks)
    assert one_row_bytes(down) == down.small_records.data.numel() < float_bytes // 4  # 6 bits a weight, not 32
    if not extension().int8_kernels():
        return
    model, blocks = q4_tiny_model(5, hidden_size=256, intermediate_size=256)
    down = model.decoder_layers()[0].down
    assert attach_small_gemm(model) and attach_int8_reads(model, blocks)  # as the loader: no float32 records
    assert one_row_bytes(down) == down.int8_records.data.numel() < float_bytes // 4


def test_a_llamacpp_build_is_kept_per_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built with -march=native into one directory, a build from another machine's CPU (a shared or copied cache)
    was reused here and died of SIGILL: each CPU (model and flags) now has its own."""
    from specserve.bench import llamacpp

    built: list[Path] = []

    def cmake(cmd: list[str], check: bool) -> None:
        if "--build" in cmd:
            out = Path(cmd[cmd.index("--build") + 1]) / "bin"
            out.mkdir(parents=True)
            for target in llamacpp.BUILD_TARGETS:
                (out / target).touch()
            built.append(out)

    monkeypatch.setattr(llamacpp.subprocess, "run", cmake)
    avx2 = ("AMD EPYC", frozenset({"avx2", "fma"}))
    avx512 = ("AMD EPYC", frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    first = llamacpp.build(tmp_path, 2, avx512)
    assert llamacpp.build(tmp_path, 2, avx512) == first and len(built) == 1  # kept for the same CPU
    other = llamacpp.build(tmp_path, 2, avx2)
    assert other != first and built == [first, other]  # built again for another one


def test_bench_runner_names_each_forward_shapes_csv_and_refuses_a_batch_with_a_tree_mask(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A --tree-mask run wrote the causal run's file (same --out: one overwrote the other), and --batch took
    --tree-mask silently (a batch decode step has no tree)."""
    from specserve.cli import main

    names = {csv_name(torch.float32, batch=b, tree_mask=t) for b, t in ((False, False), (False, True), (True, False))}
    assert names == {"runner_float32.csv", "runner_float32_tree.csv", "runner_float32_batch.csv"}
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "runner", "--batch", "--tree-mask"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
