"""The C++ decoder stack gives the Python layer loop's values bit for bit, for every batch layout and CPU path."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.config import ModelSpec
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.models.llama import (
    LlamaModel,
    attach_gemv_copies,
    attach_mkl_packed,
    attach_row_padding,
    quantize_int8_dynamic,
)
from specserve.models.native_stack import (
    BUILD_LOCK,
    TORCH_BATON,
    NativeStackUnavailable,
    attach_native_stack,
    build_stack,
    extension,
    extension_build_dir,
)
from specserve.models.q4 import Q4Blocks, Q4Linear
from specserve.models.tiny import tiny_config, tiny_model

try:
    extension()
except NativeStackUnavailable as e:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip(f"the C++ stack cannot be built here: {e}", allow_module_level=True)

Step = Callable[[LlamaModel, KVCache], list[torch.Tensor]]


class DispatchedOps(TorchDispatchMode):
    """Every ATen op that reaches the dispatcher, from Python or from C++, with its tensor arguments' shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        flat = [a for arg in args for a in (arg if isinstance(arg, list | tuple) else [arg])]
        self.ops.append((str(func), tuple(tuple(a.shape) for a in flat if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def both_paths(model: LlamaModel, step: Step, num_slots: int = 4) -> None:
    """Run ``step`` on fresh caches through the Python loop and the unfused C++ stack: the same ATen ops on the
    same shapes in the same order, and every output and every KV entry identical (not close)."""
    stack = build_stack(model, fused=False)
    results = []
    for native in (None, stack):
        model.native_stack = native
        cache = model.new_cache(num_slots, 64)
        with DispatchedOps() as dispatched:
            outs = step(model, cache)
        results.append((outs, cache, dispatched.ops))
    (ref, ref_cache, ref_ops), (got, got_cache, got_ops) = results
    assert got_ops == ref_ops
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    for layer in range(model.cfg.num_layers):
        assert torch.equal(ref_cache.k[layer], got_cache.k[layer])
        assert torch.equal(ref_cache.v[layer], got_cache.v[layer])


def ragged_then_decode(model: LlamaModel, cache: KVCache) -> list[torch.Tensor]:
    """A ragged prefill (padded queries), a decode step, a chain verify of one sequence after its cache."""
    gen = torch.Generator().manual_seed(3)
    slots = [cache.allocate() for _ in range(3)]
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in (7, 3, 12)]
    outs = [model(ForwardBatch.build(cache, slots, prompts), cache)]
    outs.append(model(ForwardBatch.build(cache, slots, [[5], [6], [7]]), cache))
    outs.append(model(ForwardBatch.build(cache, slots[:1], [[8, 9, 10, 11]]), cache))
    return outs


def non_consecutive_slots(model: LlamaModel, cache: KVCache) -> list[torch.Tensor]:
    slots = [cache.allocate() for _ in range(4)]
    outs = [model(ForwardBatch.build(cache, slots, [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]), cache)]
    pair = [slots[3], slots[0]]  # gathered, out of order
    outs.append(model(ForwardBatch.build(cache, pair, [[11, 12], [13]]), cache))
    return outs


def tree_verify(model: LlamaModel, cache: KVCache) -> list[torch.Tensor]:
    slots = [cache.allocate() for _ in range(2)]
    model(ForwardBatch.build(cache, slots, [list(range(1, 9)), list(range(9, 14))]), cache)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    batch = ForwardBatch.build(
        cache, slots, [[20, 21, 22, 23], [24, 25]], positions=[[8, 9, 9, 10], [5, 6]], tree_masks=[tree, None]
    )
    return [model(batch, cache)]


def hidden_with_aux(model: LlamaModel, cache: KVCache) -> list[torch.Tensor]:
    """EAGLE-3's inputs: the final hidden states and the inputs of three layers (given out of order)."""
    slot = cache.allocate()
    final, aux = model.hidden_states(ForwardBatch.build(cache, [slot], [[3, 1, 4, 1, 5]]), cache, (2, 0, 1))
    assert aux is not None
    return [final, aux]


STEPS = [ragged_then_decode, non_consecutive_slots, tree_verify, hidden_with_aux]


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.__name__)
@pytest.mark.parametrize(
    ("model_type", "extra"),
    [("llama", {}), ("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 32})],
)
def test_stack_equals_python_loop(step: Step, model_type: str, extra: dict) -> None:
    model = tiny_model(tiny_config(model_type, num_hidden_layers=3, **extra), seed=4)
    both_paths(model, step)


def test_stack_equals_python_loop_in_bfloat16() -> None:
    model = tiny_model(tiny_config("llama", num_hidden_layers=3), seed=5).to(torch.bfloat16)
    both_paths(model, ragged_then_decode)


def fused_and_python(model: LlamaModel, step: Step) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """(Python loop outputs, fused stack outputs, the ATen ops the fused stack dispatched)."""
    model.native_stack = None
    ref = step(model, model.new_cache(4, 64))
    model.native_stack = build_stack(model, fused=True)
    with DispatchedOps() as dispatched:
        got = step(model, model.new_cache(4, 64))
    return ref, got, [name for name, _ in dispatched.ops]


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.__name__)
@pytest.mark.parametrize(
    ("model_type", "extra", "dtype", "tol"),
    [
        ("llama", {}, torch.float32, 1e-4),
        ("qwen2", {"tie_word_embeddings": True}, torch.float32, 1e-4),
        ("llama", {}, torch.bfloat16, 1e-2),
    ],
)
def test_fused_stack_matches_python_loop_to_rounding(
    step: Step, model_type: str, extra: dict, dtype: torch.dtype, tol: float
) -> None:
    """Fused norms (with the residual add; the model's final norm too) and RoPE with the KV write: the same values up
    to the dtype's rounding (the norms sum squares in another order), and the fused kernels really ran (no ATen
    RMS norm or RoPE negation was dispatched)."""
    model = tiny_model(tiny_config(model_type, num_hidden_layers=3, **extra), seed=11).to(dtype)
    ref, got, ops = fused_and_python(model, step)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol * a.abs().max().item())
    assert "aten.rms_norm.default" not in ops  # the final norm too (DecoderStack.final_norm)
    assert "aten.neg.default" not in ops


def wide_decode(model: LlamaModel, cache: KVCache) -> list[torch.Tensor]:
    """One token for each of 40 sequences: an MLP activation of 40 x 1000 elements, past ATen's grain."""
    slots = [cache.allocate() for _ in range(40)]
    return [model(ForwardBatch.build(cache, slots, [[i + 1] for i in range(40)]), cache)]


@pytest.mark.parametrize("fused", [False, True])
def test_the_stack_takes_a_wide_mlp_activation_in_row_groups_as_python_does(fused: bool) -> None:
    """ATen splits SiLU past 32768 elements between threads at element counts, and a split inside a row moved some
    of its elements between a vectorised and a scalar exp: a row's values depended on the batch. Both paths take
    the activation in groups of rows below the grain (``llama.silu_mul``), each SiLU one thread's."""
    model = tiny_model(tiny_config(num_hidden_layers=2, intermediate_size=1000), seed=4)
    if not fused:
        both_paths(model, wide_decode, num_slots=40)
        return
    model.native_stack = build_stack(model, fused=True)
    with DispatchedOps() as dispatched:
        wide_decode(model, model.new_cache(40, 8))
    silu = [shapes[0] for name, shapes in dispatched.ops if name == "aten.silu.default"]
    assert len(silu) == 2 * 2 and all(rows * cols < 32768 for rows, cols in silu), silu  # 2 groups a layer


def test_fused_stack_runs_the_aten_ops_where_it_cannot_fuse() -> None:
    """float16 activations: the fused stack falls back to exactly the Python loop's ops and values."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=2), seed=12).to(torch.float16)
    ref, got, ops = fused_and_python(model, non_consecutive_slots)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert "aten.neg.default" in ops and "aten.index_put_.default" in ops


def test_stack_takes_the_gemv_padding_and_packed_paths_as_python_does() -> None:
    """GEMV copies at 1-3 rows, zero-row padding for 10-15 rows and MKL-packed weights: the C++ stack must pick
    the same path per row count (the dispatched ops show which)."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=2), seed=6)
    attach_gemv_copies(model, rows=3)
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mod.pad_from = 10  # type: ignore[assignment]

    def rows_1_to_16(model: LlamaModel, cache: KVCache) -> list[torch.Tensor]:
        outs = []
        for rows in (1, 2, 3, 4, 11, 13, 16):
            slot = cache.allocate()
            outs.append(model(ForwardBatch.build(cache, [slot], [list(range(1, rows + 1))]), cache))
        return outs

    both_paths(model, rows_1_to_16, num_slots=8)
    if attach_mkl_packed(model, (4, 16)):
        both_paths(model, rows_1_to_16, num_slots=8)


def test_stack_runs_packed_4bit_projections_as_python_does() -> None:
    """Q4Linear projections (the int4 kernel, and the bf16 dense copy from 4 rows) inside the C++ stack."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=2), seed=9)
    gen = torch.Generator().manual_seed(0)

    def q4(out_features: int, in_features: int) -> Q4Linear:
        q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=gen)
        d = (torch.rand(out_features, in_features // 32, generator=gen) * 0.05 + 1e-3).half().float()
        m = (-torch.rand(out_features, in_features // 32, generator=gen) * 0.3).half().float()
        return Q4Linear(Q4Blocks(q, d, m), dense_from=4)

    for layer in model.decoder_layers():
        layer.swap_projections(
            **{name: q4(*getattr(layer, name).weight.shape) for name in ("qkv", "o_proj", "gate_up", "down")}
        )
    both_paths(model, ragged_then_decode)
    both_paths(model, non_consecutive_slots)


def test_a_switch_that_changes_the_projections_drops_the_stack() -> None:
    """GEMV copies, row padding or MKL-packed weights attached after the stack: the stack would not take them, so
    the model falls back to the Python loop until the stack is attached again."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=14)
    for switch in (lambda: attach_gemv_copies(model, rows=2), lambda: attach_row_padding(model, 10)):
        assert attach_native_stack(model) and model.native_stack is not None
        switch()
        assert model.native_stack is None
    assert attach_native_stack(model)
    if attach_mkl_packed(model, (4,)):
        assert model.native_stack is None


def test_stack_sees_in_place_weight_changes() -> None:
    """The stack holds the model's tensors, not copies: an in-place update reaches both paths alike."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=2), seed=7)
    model.native_stack = build_stack(model)
    cache = model.new_cache(1, 16)
    slot = cache.allocate()
    before = model(ForwardBatch.build(cache, [slot], [[1, 2, 3]]), cache)
    with torch.no_grad():
        model.decoder_layers()[0].gate_up.weight.mul_(2.0)
    cache.truncate(slot, 0)
    after = model(ForwardBatch.build(cache, [slot], [[1, 2, 3]]), cache)
    assert not torch.equal(before, after)
    both_paths(model, ragged_then_decode)


def test_uncovered_models_keep_the_python_loop() -> None:
    int8 = quantize_int8_dynamic(tiny_model(tiny_config("llama", num_hidden_layers=2), seed=8))
    with pytest.raises(NativeStackUnavailable, match="does not cover"):
        build_stack(int8)
    assert attach_native_stack(int8) is False
    assert int8.native_stack is None
    meta = LlamaModel(tiny_config("llama", num_hidden_layers=2), device="meta")
    with pytest.raises(NativeStackUnavailable, match="CPU"):
        build_stack(meta)


def test_model_spec_switch() -> None:
    assert ModelSpec(source="smollm2-135m-instruct").native_stack is True
    assert ModelSpec(source="smollm2-135m-instruct", native_stack=False).native_stack is False


@pytest.mark.real_model
def test_the_loaded_target_runs_the_fused_stack_and_agrees_with_the_python_loop() -> None:
    """The real model as `load_model` serves it: the stack is attached (so the real-model greedy and transformers
    tests exercise it), and a prefill plus decode steps give the Python loop's argmax at every position."""
    from specserve.models.loader import load_model

    target = load_model(ModelSpec())
    assert target.native_stack is not None
    # csrc/attention.cpp, in both loops (tests/test_attention_kernel.py), where this CPU runs it
    assert (target.attention_kernel is not None) == extension().attention_supported(target.cfg.head_dim)
    prompt = torch.randint(0, target.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    logits = []
    for native in (target.native_stack, None):
        target.native_stack = native
        cache = target.new_cache(1, 64)
        slot = cache.allocate()
        steps = [target(ForwardBatch.build(cache, [slot], [prompt]), cache)]
        steps += [target(ForwardBatch.build(cache, [slot], [[t]]), cache) for t in (5, 17, 99)]
        logits.append(torch.cat(steps))
    fused, python = logits
    assert torch.equal(fused.argmax(-1), python.argmax(-1))
    torch.testing.assert_close(fused, python, rtol=1e-4, atol=1e-4 * python.abs().max().item())
    assert load_model(ModelSpec(native_stack=False)).native_stack is None
    assert load_model(ModelSpec(native_attention=False)).attention_kernel is None


def test_fused_kv_write_refuses_positions_outside_the_cache() -> None:
    """The fused RoPE writes the cache through raw pointers: a bad index is an error, not a stray write."""
    model = tiny_model(tiny_config("llama", num_hidden_layers=1), seed=13)
    model.native_stack = build_stack(model, fused=True)
    cache = model.new_cache(1, 8)
    batch = ForwardBatch.build(cache, [cache.allocate()], [[1, 2]])
    bad = dataclasses.replace(batch, write_pos=torch.tensor([7, 8]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        model(bad, cache)


def test_each_checkout_builds_into_its_own_directory(tmp_path: Path) -> None:
    """The build file holds the sources' paths: two checkouts of the same code shared one directory by its hash
    alone and rebuilt the extension after each other (a fresh clone's CI beside the working copy; minutes each)."""
    from specserve.models import native_stack

    copies = []
    for path in (*native_stack.SOURCES, *native_stack.HEADERS):
        copies.append(tmp_path / path.name)
        copies[-1].write_bytes(path.read_bytes())
    sources, headers = tuple(copies[: len(native_stack.SOURCES)]), tuple(copies[len(native_stack.SOURCES) :])
    here = extension_build_dir()
    assert extension_build_dir() == here  # a checkout keeps its directory
    copy = extension_build_dir(sources, headers)
    assert copy != here and extension_build_dir(sources, headers) == copy
    sources[0].write_bytes(sources[0].read_bytes() + b"\n")
    assert extension_build_dir(sources, headers) not in (copy, here)  # and the code still names it


def test_a_new_compiler_builds_into_a_directory_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiler decides what is built (the int8 kernels need GCC 11 or clang 12): an upgraded ``c++`` under the
    same name reused the old directory, and ninja, seeing the same command, kept loading the old build."""
    compiler = tmp_path / "c++"
    monkeypatch.setenv("CXX", str(compiler))
    builds = []
    for version in ("c++ (Debian 10.2.1-6) 10.2.1", "c++ (Debian 12.2.0-14) 12.2.0"):
        compiler.write_text(f"#!/bin/sh\necho '{version}'\n")
        compiler.chmod(0o755)
        builds.append(extension_build_dir())
        assert extension_build_dir() == builds[-1]
    assert builds[0] != builds[1]
    monkeypatch.delenv("CXX")
    assert extension_build_dir() not in builds


def test_a_lock_left_by_a_killed_load_does_not_hang_the_next_process() -> None:
    """torch's build lock is a plain file: a process killed while loading the extension (a timeout, a killed
    actor) left it behind, and every later process then waited for it for ever (found with a stale lock here)."""
    baton = extension_build_dir() / TORCH_BATON
    baton.touch()
    try:
        code = "from specserve.models.native_stack import extension; extension(); print('loaded')"
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
            timeout=180,
        )  # fmt: skip
        assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
        assert not baton.exists()
    finally:
        baton.unlink(missing_ok=True)


def test_a_library_cut_short_is_built_again_not_loaded(tmp_path: Path) -> None:
    """ninja trusts its log, not the library: a library cut short (a crash before the linker's writes reached the
    disk, a partial copy of the cache) was loaded as built and the process died of SIGBUS. A library that differs
    from the record kept when it last loaded, or without one is shorter than its ELF header says, is dropped with
    ninja's outputs so the load builds it again."""
    from specserve.models import native_stack

    extension()
    built = extension_build_dir()
    name = built.name
    library = built / f"{name}.so"
    assert native_stack._library_whole(library)
    assert (built / f"{name}.so{native_stack.LIBRARY_RECORD}").is_file()  # recorded when it loaded
    copy = tmp_path / name
    copy.mkdir()
    for path in built.iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    (copy / ".ninja_log").write_text("# ninja log v5\n")
    cut = copy / f"{name}.so"
    record = copy / f"{name}.so{native_stack.LIBRARY_RECORD}"
    assert native_stack._library_whole(cut)
    record.unlink()
    assert native_stack._library_whole(cut)  # no record: the ELF header's section table lies within the file
    cut.write_bytes(library.read_bytes()[:400_000])
    assert not native_stack._library_whole(cut)
    record.write_text(native_stack._library_digest(library) + "\n")
    assert not native_stack._library_whole(cut)  # a record, and bytes that differ from it
    native_stack._drop_damaged_build(copy, name)
    left = sorted(p.name for p in copy.iterdir())
    assert "build.ninja" in left and BUILD_LOCK in left
    assert not [n for n in left if n.endswith((".so", ".o", ".sha256")) or n.startswith(".ninja_")]
    cut.write_bytes(b"")
    assert not native_stack._library_whole(cut)


def test_a_build_directory_it_cannot_write_is_imported_from_as_it_is(tmp_path: Path) -> None:
    """A cache baked into a read-only image (or another user's) held a whole build, and the C++ stack was off:
    opening the build lock failed before anything was read."""
    extension()
    built = extension_build_dir()
    cache = tmp_path / "cache"
    copy = cache / "extensions" / built.name
    copy.mkdir(parents=True)
    for path in built.iterdir():
        if path.is_file() and path.name != BUILD_LOCK:
            (copy / path.name).write_bytes(path.read_bytes())
    (copy / BUILD_LOCK).mkdir()  # the lock cannot be opened for writing (as root, chmod would not stop it)
    code = "from specserve.models.native_stack import extension; extension(); print('loaded')"
    env = {**os.environ, "SPECSERVE_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
        timeout=180, env=env,
    )  # fmt: skip
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    copy.chmod(0o777)  # any user could have put a library there, with a record to match: not loaded
    code = "from specserve.models.native_stack import _build; print(_build())"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
        timeout=180, env=env,
    )  # fmt: skip
    assert done.returncode == 0 and "is writable by any user" in done.stdout, (done.stdout, done.stderr[-2000:])
    copy.chmod(0o755)
    (copy / f"{built.name}.so").write_bytes((built / f"{built.name}.so").read_bytes()[:400_000])
    code = "from specserve.models.native_stack import _build; print(type(_build()).__name__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
        timeout=180, env=env,
    )  # fmt: skip
    assert done.returncode == 0 and "NativeStackUnavailable" in done.stdout, done.stderr[-2000:]


def test_the_extension_refuses_shapes_it_would_read_or_write_past() -> None:
    """Entry points exported to Python check the layouts they index: a KV cache of another head count or head dim
    was written past its end (memory beyond it changed), a short qkv projection read past its rows, a norm weight
    of another width read past its end, an empty mask ran as no mask, and a bias of another shape broadcast."""
    ext = extension()
    torch.manual_seed(0)
    hq, hkv, d, h = 2, 1, 8, 16

    def proj(n: int, k: int) -> Any:
        p = ext.Proj()
        p.weight, p.bias = torch.randn(n, k), None
        return p

    def stack(*, qkv_rows: int = (hq + 2 * hkv) * d, norm: int = h) -> Any:
        s = ext.DecoderStack(hq, hkv, d, 1e-6, True, False)
        s.add_layer(torch.ones(norm), torch.ones(h), proj(qkv_rows, h), proj(h, hq * d), proj(2 * h, h), proj(h, h))
        return s

    def ids(*a: int) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.long)

    def run(s: Any, k: torch.Tensor, v: torch.Tensor) -> Any:
        x, cos, sin = torch.randn(1, h), torch.ones(1, 1, d), torch.zeros(1, 1, d)
        return s.forward(x, cos, sin, [k], [v], ids(0), ids(3), ids(0), None, ids(0), 0, 1, 1, 1, 4, [], None)

    memory_k, memory_v = torch.zeros(64), torch.zeros(64)
    small_k, small_v = memory_k[:16].view(1, 1, 4, 4), memory_v[:16].view(1, 1, 4, 4)  # head dim 4, not 8
    with pytest.raises(RuntimeError, match="KV caches"):
        run(stack(), small_k, small_v)
    assert not memory_k[16:].any() and not memory_v[16:].any()
    fits = torch.zeros(1, hkv, 6, d), torch.zeros(1, hkv, 6, d)
    with pytest.raises(RuntimeError, match=r"qkv \[N, \(Hq \+ 2 Hkv\) D\]"):
        run(stack(qkv_rows=(hq + 2 * hkv) * d - 8), *fits)
    with pytest.raises(RuntimeError, match="rms norm"):
        run(stack(norm=h - 4), *fits)
    run(stack(), *fits)  # the shapes it was built for

    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 8, 64), torch.randn(2, 2, 8, 64)
    with pytest.raises(RuntimeError, match="attend to nothing"):
        ext.attend(q, k, v, ids(0, 1), ids(0, 1), ids(0, 1), torch.ones(2, 1, 1, 0, dtype=torch.bool), 1)
    with pytest.raises(RuntimeError, match="q's head dim 128 is not the caches' 64"):  # was: "128 is not served"
        ext.attend(torch.randn(2, 4, 128), k, v, ids(0, 1), ids(0, 1), ids(0, 1), None, 1)
    linear = proj(5, 64)
    linear.small_rows = 64
    for bias in (torch.randn(3, 5), torch.randn(5, dtype=torch.float64), torch.randn(4)):
        linear.bias = bias
        with pytest.raises(RuntimeError, match=r"a bias is float32 \[N\]"):
            linear(torch.randn(3, 64))


def test_other_python_threads_run_while_a_kernel_runs() -> None:
    """The kernels touch no Python object, so they release the GIL: a thread serving HTTP or streaming beside an
    in-process engine used to stall for a whole forward (seconds for a long prefill)."""
    ext = extension()
    x, w = torch.randn(64, 2048), torch.randn(16384, 2048)  # one call of ~0.1 s here
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=spin)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # the caller waits at most ~0.5 ms for the GIL before it enters the call
    thread.start()
    try:
        time.sleep(0.01)
        t0 = time.perf_counter()
        ext.small_linear(x, w)
        t1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    # while the caller holds the GIL through the call the other thread cannot run at all: not in the call's middle
    # half (its first moments may still be the other thread's, until the caller takes the GIL back for the call)
    middle = [s for s in stamps if t0 + (t1 - t0) / 4 < s < t1 - (t1 - t0) / 4]
    assert middle


def test_a_compiler_that_fails_its_version_check_leaves_the_python_loop(tmp_path: Path) -> None:
    """torch checks the compiler's version first: one that exits non-zero there (``CXX=/bin/false``) raised
    ``CalledProcessError`` out of every model load, not the fallback to the Python layer loop."""
    script = (
        "from specserve.models.native_stack import small_gemm_available, extension, NativeStackUnavailable\n"
        "assert small_gemm_available() is False\n"
        "try:\n    extension()\nexcept NativeStackUnavailable as e:\n    print('unavailable:', e)\n"
    )
    env = os.environ | {"SPECSERVE_CACHE": str(tmp_path), "CXX": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "unavailable: building" in done.stdout


@pytest.mark.parametrize("native", [False, True], ids=["python", "stack"])
def test_aux_features_are_the_inputs_of_their_layers_as_transformers_numbers_them(native: bool) -> None:
    """EAGLE-3's aux layer i is the input of decoder layer i: transformers' ``hidden_states[i]`` (0: the embeddings).
    Every other test compares hidden_states with itself (loop, stack, training, serving), so outputs taken one
    layer late passed them all, and a published head would read features it was not trained on."""
    from transformers import LlamaForCausalLM

    from specserve.models.tiny import hf_state_dict

    config = tiny_config("llama", num_hidden_layers=3)
    model = tiny_model(config, seed=4)
    cfg = model.cfg
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict({k: v.detach().clone() for k, v in hf_state_dict(model).items()}, strict=True)
    tokens = [3, 1, 4, 1, 5]
    with torch.no_grad():
        want = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # (L + 1) x [1, T, hidden]
    model.native_stack = build_stack(model, fused=False) if native else None
    cache = model.new_cache(1, 64)
    _, aux = model.hidden_states(ForwardBatch.build(cache, [cache.allocate()], [tokens]), cache, (0, 1, 2))
    assert aux is not None
    blocks = aux.split(cfg.hidden_size, dim=-1)
    assert torch.equal(blocks[0], model.embed_tokens(torch.tensor(tokens)))
    for i, block in enumerate(blocks):
        torch.testing.assert_close(block, want[i][0], rtol=1e-4, atol=1e-4)
        if i:
            assert not torch.allclose(block, want[i + 1][0], rtol=1e-2, atol=1e-2)  # (not the layer's output)
