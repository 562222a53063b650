"""`specserve bench lm-head`: a greedy step's LM head, the full float32 logits and their argmax against the bounded
argmax over the bfloat16 copy (``ModelSpec.bounded_argmax``, specserve/models/lm_head.py) and, where the target
holds them, the logits from the LM head's Q8_0 records (``ModelSpec.q8_head_reads``) and the greedy path the
engine takes with them (the records' argmax for the row counts the plan gave them, else the bounded copy).

For each row count it times them on the same hidden states (the target's final-norm states over random tokens),
interleaved repeat by repeat, each call after a ``--evict-mb`` read that pushes the LM head out of cache as a decode
step's layers do; the float32 and bounded columns read the same target loaded without the records. It checks that
all give the same tokens; prints the medians and writes a CSV.

    .venv/bin/specserve bench lm-head --rows 1 2 4 6 8 10 --out bench_out/lm_head
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from specserve.arg_types import non_negative_int, out_dir_arg, positive_int
from specserve.bench.machine import check_fits, cpu_summary
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import DEFAULT_PAIR, MODEL_PAIRS
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.lm_head import ARGMAX_ROWS, attach_bounded_argmax, bounded_ids, greedy_ids
from specserve.models.loader import load_model
from specserve.models.native_stack import attach_small_gemm, extension
from specserve.timing import timed


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default=DEFAULT_PAIR, choices=sorted(MODEL_PAIRS), help="whose target's LM head")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 4, 6, 8])
    p.add_argument("--repeats", type=positive_int, default=15)
    p.add_argument(
        "--evict-mb", type=non_negative_int, default=256, help="read this much memory before each call (0: warm)"
    )
    p.add_argument("--tiny", action="store_true", help="a small random model instead (tests)")
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/lm_head"))


def _model(args: argparse.Namespace, q8_head_reads: bool = False) -> LlamaModel:
    if args.tiny:
        from specserve.models.tiny import tiny_config, tiny_model

        model = tiny_model(tiny_config("llama", hidden_size=128, vocab_size=4096), seed=0)
        model.requires_grad_(False)
        attach_small_gemm(model)
        attach_bounded_argmax(model)
        return model
    return load_model(MODEL_PAIRS[args.pair][0].model_copy(update={"q8_head_reads": q8_head_reads}))


def _full_argmax(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    return model.logits(hidden).argmax(-1)


def _records_argmax(records: object, hidden: torch.Tensor) -> torch.Tensor:
    """The argmax of the logits from the LM head's Q8_0 records, at any row count (the plan aside)."""
    return extension().small_linear_packed(hidden, records, None, None).argmax(-1)


def run(args: argparse.Namespace) -> int:
    check_fits(args.evict_mb << 20, f"--evict-mb {args.evict_mb}")
    model = _model(args)
    check_fits(8 * max(args.rows) * (model.cfg.vocab_size + model.cfg.hidden_size), f"--rows {max(args.rows)}")
    with_q8 = None if args.tiny else _model(args, q8_head_reads=True)
    records = None if with_q8 is None else getattr(with_q8.lm_head, "small_records", None)
    if records is None:
        print("no Q8_0 records for the LM head here (ModelSpec.q8_head_reads: a GGUF whose head is Q8_0 blocks)")
    if model.bounded_argmax is None:  # dropped at load where it measured slower at every count: timed here anyway
        attach_bounded_argmax(model)
    if model.bounded_argmax is None:
        print("the bounded argmax is not attached here (no small-product kernel, or not float32)")
        return 1
    if max(args.rows) > ARGMAX_ROWS:
        print(f"note: past {ARGMAX_ROWS} rows greedy_ids computes the full logits (both columns the same path)")
    cpu = cpu_summary()
    print(cpu)
    cache = model.new_cache(1, max(args.rows) + 1)
    slot = cache.allocate()
    tokens = torch.randint(0, model.cfg.vocab_size, (max(args.rows),), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden_all = model.final_hidden(ForwardBatch.build(cache, [slot], [tokens]), cache)
    junk = torch.ones(max(1, args.evict_mb) << 18)  # float32: 4 bytes each

    def cold(fn: Callable[[], object]) -> float:
        if args.evict_mb:
            junk.sum()
        return timed(model.device, fn)

    rows = []
    with torch.inference_mode():
        for r in args.rows:
            hidden = hidden_all[:r].contiguous()
            full_ids = model.logits(hidden).argmax(-1)
            if not torch.equal(greedy_ids(model, hidden), full_ids):
                raise AssertionError(f"{r} rows: the bounded argmax differs from the full logits' argmax")
            fns = {"full": partial(_full_argmax, model, hidden), "bounded": partial(bounded_ids, model, hidden)}
            if with_q8 is not None and records is not None:
                fns["q8"] = partial(_records_argmax, records, hidden)
                fns["greedy"] = partial(greedy_ids, with_q8, hidden)
            for name, fn in fns.items():
                if not torch.equal(fn(), full_ids):
                    raise AssertionError(f"{r} rows: {name} differs from the full logits' argmax")
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.repeats):  # interleaved: machine noise hits all alike
                for name, fn in fns.items():
                    times[name].append(cold(fn))
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            row = {"rows": r, "full_ms": ms["full"], "bounded_ms": ms["bounded"]}
            row["full_over_bounded"] = ms["full"] / ms["bounded"]
            row["q8_ms"], row["greedy_ms"] = ms.get("q8", float("nan")), ms.get("greedy", float("nan"))
            row["bounded_over_greedy"] = ms["bounded"] / row["greedy_ms"]
            rows.append({**row, "cpu": cpu})
    cols = ["rows", "full_ms", "bounded_ms", "full_over_bounded", "q8_ms", "greedy_ms", "bounded_over_greedy"]
    print(markdown_table(rows, cols))
    path = args.out / "lm_head.csv"
    write_csv(path, rows)
    print(f"wrote {path}")
    return 0
