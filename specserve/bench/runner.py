"""`specserve bench runner`: how close the runner's forward is to the hardware (issue 14).

For each row count r it times, interleaved repeat by repeat in one process: the runner's batch-1 forward over r new
tokens after ``--context`` cached ones (r = 1 is a decode step, r > 1 a chain verification, causal as the target
verifies chains; ``--tree-mask`` times the explicit-mask path trees take), and the bare matmuls of the same
weights (every linear of every layer and the LM head over r rows, nothing else, through the paths the runner takes:
the small-product kernel where it is on). ``overhead`` = runner / bare: what norms, RoPE, attention, dispatch and
Python add to the weight reads; ``python`` is the same forward with the C++ layer stack switched off
(``ModelSpec.native_stack``); ``blas bare`` / ``blas runner`` the bare products and the runner with the
small-product kernel off (the same model loaded with ``ModelSpec.small_gemm=False``: BLAS, with the GEMV
copies and row padding that setting attaches where they measure faster); ``rowmajor bare`` / ``rowmajor runner`` the
same with the kernel reading the row-major weights at every row count (``ModelSpec.small_gemm_packed`` False; the
same bits), ``kpacked`` its packed copies at every row count (True); the runner itself reads them where they measured
faster at load (None, the default); ``unplanned`` the model without the kernel's plan measured at load
(``ModelSpec.small_gemm_plan`` off: packed copies at every row count, the built-in prefetch); ``sdpa`` the model
with SDPA's attention in place of the C++ kernel (``ModelSpec.native_attention`` off); ``f32 reads`` the kernel
reading float32 weights only (``ModelSpec.q4_reads`` and ``q8_head_reads`` off; ``rowmajor`` and ``kpacked`` read
float32 too). Also the floor one step cannot beat: the bytes a one-row forward reads (records where it reads them,
the LM head's included) over the read
bandwidth measured here (``x.sum()`` over 1 GiB). Prints a table and writes a CSV.

    .venv/bin/specserve bench runner --rows 1 4 16 --out bench_out/runner
    .venv/bin/specserve bench runner --batch --rows 16 32 --out bench_out/runner_batch   # plain decoding at batch r
    .venv/bin/specserve bench runner --dtype bfloat16
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specserve.arg_types import non_negative_int, out_dir_arg, positive_int
from specserve.bench.machine import cpu_summary
from specserve.config import DEFAULT_PAIR, MODEL_PAIRS, DType, ModelSpec
from specserve.errors import SettingsError
from specserve.models.llama import PAD_WIDTH, LlamaModel, attach_mkl_packed, linear
from specserve.models.loader import load_model, model_config
from specserve.models.native_stack import build_stack, describe_rows, extension
from specserve.timing import interleaved_medians, timed
from specserve.tune import batch_decode_forward, verify_forward

BANDWIDTH_BYTES = 1 << 30
F32_READS = {"q4_reads": False, "q8_head_reads": False}  # the kernel reads float32 weights only
Fn = Callable[[], None]


# timings of the model loaded with a setting of the small-product kernel changed: without the kernel, not taken
KERNEL_SETTINGS = frozenset(
    {"blas_bare", "blas", "rowmajor_bare", "rowmajor", "kpacked_bare", "kpacked", "unplanned_bare", "unplanned"}
    | {"f32_bare", "f32"}
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=[d.value for d in DType], default=None, help="default: the pair's target")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 4, 16], help="new tokens per forward")
    p.add_argument("--context", type=non_negative_int, default=256, help="cached tokens before them")
    p.add_argument("--repeats", type=positive_int, default=15)
    shape = p.add_mutually_exclusive_group()  # (a batch decode step has no tree)
    shape.add_argument("--tree-mask", action="store_true", help="verify with an explicit mask, as trees do")
    shape.add_argument(
        "--batch",
        action="store_true",
        help="rows are sequences: a plain decoding step of that many sequences, one new token each after --context",
    )
    p.add_argument(
        "--mkl-packed",
        type=positive_int,
        nargs="*",
        default=[],
        help="also time the runner with MKL-packed weights for these widths (ModelSpec.mkl_packed_widths)",
    )
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/runner"))


def csv_name(dtype: torch.dtype, *, batch: bool, tree_mask: bool) -> str:
    """One file per dtype and forward shape: a tree-mask run beside a causal one in the same --out keeps both."""
    mode = "_batch" if batch else "_tree" if tree_mask else ""
    return f"runner_{str(dtype).removeprefix('torch.')}{mode}.csv"


def weight_linears(model: LlamaModel) -> list[torch.Tensor]:
    """Every matmul weight one forward reads, in order (fused QKV / gate-up as the runner holds them)."""
    weights = [
        m.weight for layer in model.decoder_layers() for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    ]
    return [*weights, model.lm_head.weight]


def one_row_bytes(mod: nn.Linear) -> int:
    """The bytes a one-row product reads: its int8 products' records (every row count: a target's loader then keeps
    no float32 records beside them), else the Q4_1 / Q8_0 records or the kernel's copy where one row reads them."""
    int8 = getattr(mod, "int8_records", None)
    if int8 is not None:
        return int(int8.data.numel() * int8.data.element_size())
    for copy, rows in (("small_records", "small_record_rows"), ("small_packed", "small_copy_rows")):
        c = getattr(mod, copy, None)
        if c is not None and getattr(mod, rows, 0) & 1:
            return int(c.data.numel() * c.data.element_size())
    return mod.weight.numel() * mod.weight.element_size()


def in_order(model: LlamaModel) -> list[nn.Linear]:
    """Every linear one forward runs, in order (the LM head last)."""
    layers = [m for layer in model.decoder_layers() for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    return [*layers, model.lm_head]


def path_matmuls(linears: list[nn.Linear], rows: int) -> Callable[[], None]:
    """The linears' products over ``rows`` rows through the paths the runner takes (``llama.linear``: the
    small-product kernel, GEMV copies, padding, ... as attached), nothing else."""
    inputs = {
        m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype, device=m.weight.device) for m in linears
    }

    def run() -> None:
        for m in linears:
            linear(m, inputs[m.in_features])

    return run


def read_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (``x.sum()`` over 1 GiB of float32)."""
    x = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    x.sum()
    best = min(timed(device, x.sum) for _ in range(repeats))
    return BANDWIDTH_BYTES / best


def check_positions(spec: ModelSpec, args: argparse.Namespace) -> None:
    """``--context`` and the most rows a forward adds fit the target's positions, checked before its copies load (a
    KVCapacityError after them)."""
    positions = model_config(spec).max_position_embeddings
    need = args.context + (1 if args.batch else max(args.rows))
    if need > positions:
        rows = "one new token" if args.batch else f"--rows {max(args.rows)}"
        raise SettingsError(f"--context {args.context} and {rows} need {need} positions; the target has {positions}")


def run(args: argparse.Namespace) -> int:
    target = MODEL_PAIRS[DEFAULT_PAIR][0]
    spec = target if args.dtype is None else target.model_copy(update={"dtype": DType(args.dtype)})
    check_positions(spec, args)
    model = load_model(spec)
    nn.Module.eval(model)
    weights = weight_linears(model)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    # what a one-row forward reads: a projection's kernel copy where one row reads it (Q4_1 records: 0.19x)
    read_bytes = sum(one_row_bytes(m) for m in in_order(model))
    print(
        f"{spec.source} {model.dtype}: {weight_bytes / 1e6:.0f} MB of matmul weights per forward, "
        f"{read_bytes / 1e6:.0f} MB read by a one-row forward"
    )
    native = model.native_stack is not None  # as loaded (attaching packed copies drops it: rebuilt below)
    packed = attach_mkl_packed(model, tuple(args.mkl_packed))
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    stash = {id(m): getattr(m, "mkl_packed", ()) for m in linears}
    pad_from = {id(m): getattr(m, "pad_from", 0) for m in linears}  # as measured at load (ModelSpec.pad_rows)
    print(f"row padding to {PAD_WIDTH} from {max(pad_from.values(), default=0) or '-'} rows (measured at load)")

    # the same model loaded with the small-product kernel off (BLAS, with the GEMV copies and row padding that
    # ModelSpec.small_gemm=False attaches where they measure faster), timed interleaved
    small = any(getattr(m, "small_gemm", None) is not None for m in linears)
    blas_model = load_model(spec.model_copy(update={"small_gemm": False})) if small else model
    nn.Module.eval(blas_model)
    isa = extension().small_gemm_isa() if small else ""  # the kernel's instruction-set path
    print(f"small-product kernel: {'yes (' + isa + ')' if small else 'no'}")
    own = describe_rows(getattr(model.lm_head, "small_copy_rows", 0)) if small else "-"
    # the same model with the kernel reading its row-major weights, and its packed copies, at every row count
    # (float32 reads, as these settings were measured before ModelSpec.q4_reads)
    rowmajor_model, packed_model = (
        load_model(spec.model_copy(update={"small_gemm_packed": layout, **F32_READS})) if small else model
        for layout in (False, True)
    )
    # and the kernel reading float32 weights only (ModelSpec.q4_reads off), as planned at load
    f32_model = load_model(spec.model_copy(update=F32_READS)) if small else model
    # and without the plan measured at load: packed copies at every row count, the built-in prefetch
    unplanned_model = load_model(spec.model_copy(update={"small_gemm_plan": False})) if small else model
    # and with SDPA's attention instead of csrc/attention.cpp
    sdpa_model = load_model(spec.model_copy(update={"native_attention": False}))
    for m in (rowmajor_model, packed_model, unplanned_model, sdpa_model, f32_model):
        nn.Module.eval(m)
    print(f"the kernel reads packed copies for: {own} (ModelSpec.small_gemm_packed={spec.small_gemm_packed})")
    records = [c for m in linears if m is not model.lm_head and (c := getattr(m, "small_records", None)) is not None]
    if records:
        q4_rows = describe_rows(int(getattr(model.decoder_layers()[0].down, "small_record_rows", 0)))
        mb = sum(c.data.numel() for c in records) / 1e6
        print(f"Q4_1 records for {len(records)} projections, {mb:.0f} MB, read for {q4_rows} (ModelSpec.q4_reads)")
    head_records = getattr(model.lm_head, "small_records", None)
    if head_records is not None:
        q8_rows = describe_rows(int(getattr(model.lm_head, "small_record_rows", 0)))
        mb = head_records.data.numel() / 1e6
        print(f"the LM head's Q8_0 records, {mb:.0f} MB, read for {q8_rows} (ModelSpec.q8_head_reads)")
    # the decoder projections and the LM head each prefetch as measured for what they read (records or copies)
    for name, owner in (("decoder projections", model.decoder_layers()[0].down), ("LM head", model.lm_head)):
        plan = getattr(owner, "small_prefetch", None)
        if plan is not None:
            rows = " ".join(f"{r + 1}:{p.name}" for r, p in enumerate(plan[:16]))
            print(f"the kernel's prefetch for the {name}, measured at load: {rows}")

    def set_paths(with_packed: bool, padded: bool) -> None:
        for m in linears:
            m.mkl_packed = stash[id(m)] if with_packed else ()  # type: ignore[assignment]
            m.pad_from = pad_from[id(m)] if padded else 0  # type: ignore[assignment]

    stacks: dict[tuple[bool, bool], object] = {}  # (packed, padded) -> a C++ stack built over those paths
    if native:
        for paths in ((False, True), (False, False), (True, True)):
            set_paths(*paths)
            stacks[paths] = build_stack(model)
    set_paths(False, True)
    print(f"decoder layers from C++: {'yes' if stacks else 'no (the Python loop)'}")

    def forward_of(m: LlamaModel, r: int) -> Fn:
        if args.batch:
            return batch_decode_forward(m, r, context=args.context)
        return verify_forward(m, r, context=args.context, tree_mask=args.tree_mask)

    def runner(r: int, with_packed: bool, padded: bool = True, native: bool = True) -> Fn:
        fwd = forward_of(model, r)

        def run() -> None:  # the same model with and without packed copies / padding / the C++ stack, interleaved
            set_paths(with_packed, padded)
            model.native_stack = stacks.get((with_packed, padded)) if native else None
            fwd()

        return run

    def paths_bare(r: int) -> Fn:
        run = path_matmuls(in_order(model), r)

        def bare() -> None:
            set_paths(False, True)
            run()

        return bare

    kinds: list[tuple[str, Callable[[int], Fn]]] = [
        ("bare", paths_bare),
        ("runner", lambda r: runner(r, False)),
        ("python", lambda r: runner(r, False, native=False)),
        ("unpadded", lambda r: runner(r, False, padded=False)),
        ("blas_bare", lambda r: path_matmuls(in_order(blas_model), r)),
        ("blas", lambda r: forward_of(blas_model, r)),
        ("rowmajor_bare", lambda r: path_matmuls(in_order(rowmajor_model), r)),
        ("rowmajor", lambda r: forward_of(rowmajor_model, r)),
        ("kpacked_bare", lambda r: path_matmuls(in_order(packed_model), r)),
        ("kpacked", lambda r: forward_of(packed_model, r)),
        ("unplanned_bare", lambda r: path_matmuls(in_order(unplanned_model), r)),
        ("unplanned", lambda r: forward_of(unplanned_model, r)),
        ("sdpa", lambda r: forward_of(sdpa_model, r)),
        ("f32_bare", lambda r: path_matmuls(in_order(f32_model), r)),
        ("f32", lambda r: forward_of(f32_model, r)),
    ]
    if packed:
        kinds.append(("packed", lambda r: runner(r, True)))
    if not small:  # those models are this one: their columns would repeat its timings
        kinds = [(kind, make) for kind, make in kinds if kind not in KERNEL_SETTINGS]
    fns = {(kind, r): make(r) for r in args.rows for kind, make in kinds}
    with torch.inference_mode():
        medians = dict(zip(fns, interleaved_medians(list(fns.values()), args.repeats, model.device), strict=True))
        bandwidth = read_bandwidth(model.device)
    floor_ms = read_bytes / bandwidth * 1e3
    rows_out = []
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s -> floor {floor_ms:.1f} ms per forward (weights once)")
    print(
        f"{'rows':>5} {'bare ms':>9} {'runner ms':>10} {'overhead':>9} {'runner/floor':>13} {'python ms':>10}"
        f" {'unpadded ms':>12} {'packed ms':>10} {'blas bare ms':>13} {'blas runner ms':>15}"
        f" {'rowmajor bare ms':>17} {'rowmajor runner ms':>19} {'kpacked bare ms':>16} {'kpacked runner ms':>18}"
        f" {'unplanned bare ms':>18} {'unplanned runner ms':>20} {'sdpa runner ms':>15}"
        f" {'f32 reads bare ms':>18} {'f32 reads runner ms':>20}"
    )
    cpu = cpu_summary()
    for r in args.rows:
        bare, eager, python, unpadded, blas_bare, blas, rm_bare, rm, kp_bare, kp, up_bare, up, sdpa, f_bare, f32r = (
            medians[(k, r)] * 1e3 if (k, r) in medians else float("nan")
            for k in (
                "bare",
                "runner",
                "python",
                "unpadded",
                "blas_bare",
                "blas",
                "rowmajor_bare",
                "rowmajor",
                "kpacked_bare",
                "kpacked",
                "unplanned_bare",
                "unplanned",
                "sdpa",
                "f32_bare",
                "f32",
            )
        )
        packed_ms = medians[("packed", r)] * 1e3 if packed else float("nan")
        rows_out.append(
            {
                "rows": r,
                "mode": "batch decode" if args.batch else "tree verify" if args.tree_mask else "causal verify",
                "bare_ms": bare,
                "runner_ms": eager,
                "overhead": eager / bare,
                "native_stack": bool(stacks),
                "python_ms": python,
                "python_overhead": python / bare,
                "unpadded_ms": unpadded,
                "pad_from": max(pad_from.values(), default=0),
                "packed_ms": packed_ms,
                "packed_widths": " ".join(map(str, args.mkl_packed)) if packed else "",
                "small_gemm": isa,
                "blas_bare_ms": blas_bare,
                "blas_runner_ms": blas,
                "kernel_packed_rows": own,
                "rowmajor_bare_ms": rm_bare,
                "rowmajor_runner_ms": rm,
                "kpacked_bare_ms": kp_bare,
                "kpacked_runner_ms": kp,
                "unplanned_bare_ms": up_bare,
                "unplanned_runner_ms": up,
                "f32_reads_bare_ms": f_bare,
                "f32_reads_runner_ms": f32r,
                "sdpa_runner_ms": sdpa,
                "floor_ms": floor_ms,
                "dtype": str(model.dtype),
                "cpu": cpu,
            }
        )
        line = f"{r:>5} {bare:>9.1f} {eager:>10.1f} {eager / bare:>8.2f}x {eager / floor_ms:>12.2f}x"
        line += f" {python:>10.1f} {unpadded:>12.1f} {packed_ms:>10.1f} {blas_bare:>13.1f} {blas:>15.1f}"
        line += f" {rm_bare:>17.1f} {rm:>19.1f} {kp_bare:>16.1f} {kp:>18.1f} {up_bare:>18.1f} {up:>20.1f}"
        print(line + f" {sdpa:>15.1f} {f_bare:>18.1f} {f32r:>20.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / csv_name(model.dtype, batch=args.batch, tree_mask=args.tree_mask)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)
    print(f"wrote {path}")
    return 0
