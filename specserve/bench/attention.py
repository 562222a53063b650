"""`specserve bench attention`: one layer's attention, SDPA against the C++ kernel (``ModelSpec.native_attention``).

For each batch size B and new tokens per sequence Q (Q > 1: a tree verify's causal mask over the new tokens) after
``--context`` cached tokens per sequence in a one-layer KV cache of SmolLM2's geometry (9 query heads over 3 KV heads of
64), it times ``models.attention.attention`` through SDPA and through ``csrc/attention.cpp``, interleaved repeat by
repeat, and prints the medians. Writes a CSV.

    .venv/bin/specserve bench attention --batch-sizes 1 4 32 --tokens 1 8 --out bench_out/attention
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from specserve.arg_types import non_negative_int, out_dir_arg, positive_int
from specserve.bench.machine import check_fits, cpu_summary
from specserve.bench.stats import markdown_table, write_csv
from specserve.errors import SettingsError
from specserve.models.attention import attention
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.models.native_stack import extension
from specserve.timing import interleaved_medians


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4, 32])
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 8], help="new tokens per sequence")
    p.add_argument("--context", type=non_negative_int, default=256, help="cached tokens per sequence before them")
    p.add_argument("--heads", type=positive_int, default=9)
    p.add_argument("--kv-heads", type=positive_int, default=3)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=21)
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/attention"))


def run(args: argparse.Namespace) -> int:
    if args.heads % args.kv_heads:
        raise SettingsError(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    b, q_len = max(args.batch_sizes), max(args.tokens)
    kv = 2 * b * (args.context + q_len) * args.kv_heads * args.head_dim  # K and V, float32
    check_fits(4 * (kv + 3 * b * q_len * args.heads * args.head_dim), "--batch-sizes x (--context + --tokens)")
    ext = extension()
    if not ext.attention_supported(args.head_dim):
        print(f"the attention kernel does not run head dim {args.head_dim} on this CPU")
        return 1
    cpu = cpu_summary()
    print(cpu)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in args.batch_sizes:
        for q_len in args.tokens:
            cache = KVCache(
                num_layers=1, num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_slots=b,
                max_len=args.context + q_len, dtype=torch.float32, device="cpu",
            )  # fmt: skip
            cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
            cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
            slots = [cache.allocate() for _ in range(b)]
            for slot in slots:
                cache.begin_append([slot], [args.context])
            tree = torch.ones(q_len, q_len, dtype=torch.bool).tril() if q_len > 1 else None
            batch = ForwardBatch.build(cache, slots, [[1] * q_len] * b, tree_masks=[tree] * b)
            q = torch.randn(b * q_len, args.heads, args.head_dim, generator=gen)
            k, v = cache.k[0], cache.v[0]
            fns = {
                "sdpa": partial(attention, q, k, v, batch, use_flash=False),
                "kernel": partial(attention, q, k, v, batch, use_flash=False, kernel=ext.attend),
            }
            sdpa, kernel = (s * 1e6 for s in interleaved_medians([fns["sdpa"], fns["kernel"]], args.repeats))
            rows.append({"batch": b, "tokens": q_len, "context": args.context, "sdpa_us": sdpa, "kernel_us": kernel,
                         "sdpa_over_kernel": sdpa / kernel, "cpu": cpu})  # fmt: skip
    print(markdown_table(rows, ["batch", "tokens", "context", "sdpa_us", "kernel_us", "sdpa_over_kernel"]))
    path = args.out / "attention.csv"
    write_csv(path, rows)
    print(f"wrote {path}")
    return 0
