"""Benchmarks: each prints a table and writes CSV (and PNG where it plots)."""

from __future__ import annotations

import argparse


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_cmd", required=True)
    from specserve.bench import ar

    ar.add_args(sub.add_parser("ar", help="plain decoding: this runner vs transformers generate"))


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd == "ar":
        from specserve.bench import ar

        return ar.run(args)
    raise ValueError(f"unknown benchmark {args.bench_cmd!r}")
