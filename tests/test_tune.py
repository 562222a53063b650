"""Budget auto-tune: the tau estimators, the cached verify profile and an end-to-end pick on a tiny pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.config import Drafter, SLPolicyKind, SpecConfig, SpecMethod
from specserve.models.tiny import noisy_copy, tiny_model
from specserve.tune import autotune, tau_at_budget, tau_at_length, verify_profile


def test_tau_at_budget_cuts_paths_at_the_first_dropped_rank() -> None:
    paths = [[0, 1, 5], [2], []]  # ranks of accepted nodes, in depth order
    assert tau_at_budget(paths, 2) == pytest.approx((2 + 1 + 1) / 3)  # keeps rank 0 only
    assert tau_at_budget(paths, 4) == pytest.approx((3 + 2 + 1) / 3)  # ranks 0..2
    assert tau_at_budget(paths, 7) == pytest.approx((4 + 2 + 1) / 3)


def test_tau_at_length_truncates_chains() -> None:
    assert tau_at_length([0, 3, 8], 2) == pytest.approx((1 + 3 + 3) / 3)
    assert tau_at_length([0, 3, 8], 8) == pytest.approx((1 + 4 + 9) / 3)


def test_verify_profile_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import specserve.tune as tune

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    model = tiny_model(seed=0)
    first = verify_profile(model, (1, 4))
    assert set(first) == {1, 4} and all(v > 0 for v in first.values())

    def boom(*args: object, **kwargs: object) -> dict[int, float]:
        raise AssertionError("profiled again")

    monkeypatch.setattr(tune, "time_verify", boom)
    assert verify_profile(model, (1, 4)) == first
    (path,) = (tmp_path / "profiles").glob("verify-*.json")
    for bad in ('{"1": NaN, "4": 0.01}', '{"1": 0.01, "4": -1}', '{"1": 0, "4": 0.01}', '{"1": Infinity, "4": 1}'):
        path.write_text(bad)  # valid JSON, no time (a NaN made autotune's pick depend on the rows' order)
        monkeypatch.setattr(tune, "time_verify", lambda *a, **k: {1: 0.5, 4: 0.75})
        assert verify_profile(model, (1, 4)) == {1: 0.5, 4: 0.75}, bad


def test_the_verify_sizes_are_timed_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each size was timed whole before the next: a host that slowed meanwhile bent the profile's curve."""
    import specserve.tune as tune

    calls: list[int] = []
    real = tune.interleaved_medians

    def recording(fns: list[object], repeats: int, device: torch.device) -> list[float]:
        calls.append(len(fns))
        return real(fns, repeats, device)  # type: ignore[arg-type]

    monkeypatch.setattr(tune, "interleaved_medians", recording)
    prof = tune.time_verify(tiny_model(seed=0), (1, 4, 8), context=16, repeats=2)
    assert calls == [3] and list(prof) == [1, 4, 8] and all(v > 0 for v in prof.values())


def test_chains_are_profiled_causally_and_cached_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chains verify as a causal batch, trees with their mask: the profiler times each as it runs."""
    from specserve.models.batch import ForwardBatch

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    model = tiny_model(seed=0)
    masked: list[bool] = []
    real_build = ForwardBatch.build

    def build(*args: object, **kwargs: object) -> ForwardBatch:
        masked.append(kwargs.get("tree_masks") is not None)
        return real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ForwardBatch, "build", staticmethod(build))
    verify_profile(model, (4,), causal=True)
    chain_calls, masked[:] = masked[1:], []  # the first build is the context's prefill
    verify_profile(model, (4,))
    assert chain_calls and not any(chain_calls) and all(masked[1:])
    assert len(list((tmp_path / "profiles").glob("verify-*.json"))) == 2


@pytest.mark.parametrize("method", [SpecMethod.chain, SpecMethod.eagle2])
def test_autotune_picks_the_hand_computed_optimum(
    method: SpecMethod, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a verify cost that grows quadratically in the verified tokens, the best size is interior; the pick
    equals argmax tau / (draft + verify) computed here from the calibrated taus."""
    import specserve.tune as tune

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(tune, "verify_profile", lambda model, sizes, **kw: {t: 1e-3 * t * t for t in sizes})
    target = tiny_model(seed=0)
    spec = SpecConfig(method=method, beam_width=3, tree_depth=4)
    result = autotune(target, noisy_copy(target, 0.02), [[5, 9, 13], [42, 7]], spec, max_tokens=12)
    taus = [r.tau for r in result.rows]
    assert taus == sorted(taus) and taus[-1] > 1.0  # more room never accepts fewer tokens
    verified = [r.size + 1 if method == SpecMethod.chain else r.size for r in result.rows]
    rates = [r.tau / (r.draft_s + 1e-3 * v * v) for r, v in zip(result.rows, verified, strict=True)]
    assert result.best == result.rows[rates.index(max(rates))].size
    assert result.best != result.rows[-1].size  # the quadratic cost makes the largest candidate lose


@pytest.mark.parametrize("method", [SpecMethod.chain, SpecMethod.eagle2])
def test_autotune_calibrates_the_draft_model_at_a_fixed_size_whatever_the_spec_serves_with(
    method: SpecMethod, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec served with DSDE, prompt lookup in front, caps and a tree floor calibrated under them: DSDE set the
    depths, lookup drafted, and the taus (read as the largest size's) came out other than the draft model's."""
    import specserve.tune as tune

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(tune, "verify_profile", lambda model, sizes, **kw: {t: 1e-3 * t for t in sizes})
    target, prompts = tiny_model(seed=0), [[5, 9, 13, 5, 9, 13, 5, 9], [42, 7]]
    draft = noisy_copy(target, 0.02)
    plain = SpecConfig(method=method, beam_width=3, tree_depth=4)
    served = plain.model_copy(
        update={
            "policy": SLPolicyKind.dsde,
            "drafter": Drafter.lookup,
            "model_fallback": True,
            "max_sl": 2,
            "model_max_sl": 2,
            "tree_min_prob": 0.2,
        }
    )
    taus = [[r.tau for r in autotune(target, draft, prompts, s, max_tokens=12).rows] for s in (plain, served)]
    assert taus[0] == taus[1]


def test_autotunes_draft_cost_leaves_out_the_first_calls_and_the_prompts_forwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft cost a step was the mean over every calibration step: a first call's one-off cost (a kernel's
    first use, the allocator's growth) and the prompts' prefills inflated it, and the tune then favoured shallow
    drafts. Here both cost 100 s more; the tuned draft cost must not see them."""
    from dataclasses import replace

    import specserve.tune as tune
    from specserve.step_events import StepEvent, StepStats

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(tune, "verify_profile", lambda model, sizes, **kw: {t: 1e-3 for t in sizes})
    on_step = StepStats.on_step
    steps: list[StepEvent] = []

    def with_one_off_costs(self: StepStats, event: StepEvent) -> None:
        steps.append(event)
        if len(steps) <= 2 or event.prefills:
            event = replace(event, started=event.started - 100.0)  # 100 s more drafting, where it drafted
        on_step(self, event)

    monkeypatch.setattr(StepStats, "on_step", with_one_off_costs)
    target = tiny_model(seed=0)
    spec = SpecConfig(method=SpecMethod.chain)
    result = autotune(target, noisy_copy(target, 0.02), [[5, 9, 13], [42, 7]], spec, max_tokens=12)
    # one 100 s step counted among a row's (12 tokens: at most 12 steps) puts its mean over 8 s; a tiny model's real
    # draft costs ~ms, so 5 s bounds no speed, only whether the one-off costs were left out
    assert len(steps) > 2 and all(0.0 < r.draft_s < 5.0 for r in result.rows)


def test_the_verify_profile_is_keyed_by_the_cpu_and_the_models_execution_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key held the model's shape, dtype, device, threads and torch alone: a model with the C++ stack or the
    small-product kernel, or the same model after a VM moved to a CPU with other flags, reused another's timings
    (and autotune its tree budget)."""
    import specserve.tune as tune
    from specserve.models.llama import drop_native_stack
    from specserve.models.native_stack import NativeStackUnavailable, attach_native_stack, extension

    plain = tiny_model(seed=0)
    key = tune.profile_key(plain, 256)
    assert tune.profile_key(tiny_model(seed=5), 256) == key  # weights alone do not change a verify's time
    monkeypatch.setattr(tune, "cpu_info", lambda: ("Another CPU", frozenset({"avx2"})))
    assert tune.profile_key(plain, 256) != key
    monkeypatch.undo()
    # nor the row-major copies, the zero-row padding, MKL's packed copies or int8 records (the key ignored them;
    # checked before the C++ stack's skip)
    from specserve.models.llama import attach_gemv_copies, attach_row_padding

    copies = tiny_model(seed=0)
    attach_gemv_copies(copies, rows=4)
    padded = tiny_model(seed=0)
    attach_row_padding(padded, pad_from=10)
    packed = tiny_model(seed=0)
    for m in packed.modules():
        if type(m) is torch.nn.Linear:
            m.mkl_packed = ((1, 4, None),)  # type: ignore[assignment]  # (the ranges key it, not the copies)
    records = tiny_model(seed=0)
    for m in records.modules():
        if type(m) is torch.nn.Linear:
            m.int8_records = object()  # type: ignore[assignment]
    keys = {tune.profile_key(m, 256) for m in (copies, padded, packed, records)}
    assert len(keys) == 4 and key not in keys
    try:
        extension()
    except NativeStackUnavailable:  # pragma: no cover - a machine without a C++ compiler
        pytest.skip("the C++ stack cannot be built here")
    stacked = tiny_model(seed=0)
    assert attach_native_stack(stacked)
    assert tune.profile_key(stacked, 256) != key
    drop_native_stack(stacked)
    assert tune.profile_key(stacked, 256) == key


def test_the_verify_profile_of_a_gpu_is_keyed_by_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the timings are the accelerator's: hosts with one CPU model and different GPUs (or MIG slices of
    one), sharing a cache, took each other's profiles and so each other's tree budgets."""
    from types import SimpleNamespace

    import specserve.tune as tune
    from specserve.models.llama import LlamaModel

    model = tiny_model(seed=0)
    cpu_key = tune.profile_key(model, 256)
    monkeypatch.setattr(LlamaModel, "device", property(lambda self: torch.device("cuda:0")))
    keys = set()
    for name, mem in (("NVIDIA A10G", 24), ("NVIDIA H200", 141), ("NVIDIA H200 MIG 1g.18gb", 18)):
        props = SimpleNamespace(name=name, major=9, minor=0, total_memory=mem << 30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        keys.add(tune.profile_key(model, 256))
    assert len(keys) == 3 and cpu_key not in keys


def test_a_profile_cut_short_is_measured_again_and_an_unwritable_cache_only_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer killed mid-write (or a reader between its truncate and its write) left a file every later
    autotune failed on; a cache that cannot be written failed the run after the measurement."""
    import specserve.tune as tune

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    model = tiny_model(seed=0)
    path = tmp_path / "profiles" / f"verify-{tune.profile_key(model, 256)}.json"
    path.parent.mkdir()
    path.write_text('{"1": 0.001, "4": 0.0')
    profile = verify_profile(model, (1, 4))
    assert set(profile) == {1, 4} and {int(k): v for k, v in json.loads(path.read_text()).items()} == profile
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "afile"))
    (tmp_path / "afile").write_text("")
    with caplog.at_level("WARNING"):
        assert set(verify_profile(model, (1, 4))) == {1, 4}
    assert "could not store" in caplog.text
