"""Benchmarks: each prints a table and writes CSV (and PNG where it plots)."""

from __future__ import annotations

import argparse


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_cmd", required=True)
    from specserve.bench import ar, batch, spec

    ar.add_args(sub.add_parser("ar", help="plain decoding: this runner vs transformers generate"))
    spec.add_args(sub.add_parser("spec", help="speculative methods vs plain decoding vs transformers assisted"))
    batch.add_args(sub.add_parser("batch", help="policies x batch sizes: throughput, idle fraction, latency"))


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd == "ar":
        from specserve.bench import ar

        return ar.run(args)
    if args.bench_cmd == "batch":
        from specserve.bench import batch

        return batch.run(args)
    if args.bench_cmd == "spec":
        from specserve.bench import spec

        return spec.run(args)
    raise ValueError(f"unknown benchmark {args.bench_cmd!r}")
