"""`specserve bench ar`: greedy plain-decoding tokens/s of this runner vs transformers `generate`.

Same weights, same prompts (MT-bench first turns, chat template), same number of new tokens (EOS ignored),
both engines run alternately inside one process, medians over runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from specserve.arg_types import batch_size, out_dir_arg, positive_int
from specserve.bench.machine import cpu_summary
from specserve.bench.prompt_sets import mt_bench_prompts
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import DType, ModelSpec
from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.loader import load_model, load_tokenizer
from specserve.models.sources import resolve
from specserve.sampling import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=[d.value for d in DType])
    p.add_argument("--batch-sizes", type=batch_size, nargs="+", default=[1, 8])
    p.add_argument(
        "--num-prompts", type=positive_int, default=8, help="prompts per run (run in groups of the batch size)"
    )
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--runs", type=positive_int, default=3)
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/ar"))


def _hf_generate(
    model: torch.nn.Module, tok: PreTrainedTokenizerBase, prompts: list[list[int]], max_tokens: int
) -> int:
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    generate = cast(Callable[..., torch.Tensor], model.generate)  # an HF model: returns the token ids
    with torch.inference_mode():
        out = generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return (out.shape[1] - width) * len(prompts)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    if args.num_prompts > (n := len(mt_bench_prompts())):  # (it ran MT-bench's and reported the number asked)
        raise InvalidRequestError(f"--num-prompts {args.num_prompts}: MT-bench has {n} first turns")

    spec = ModelSpec(source=args.model, dtype=DType(args.dtype))
    model = load_model(spec)
    tok = load_tokenizer(spec)
    hf = AutoModelForCausalLM.from_pretrained(resolve(spec), dtype=spec.dtype.torch).eval()
    prompts = [p.text for p in mt_bench_prompts(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    engines = {bs: Engine(model, tok, max_batch_size=bs) for bs in args.batch_sizes}  # one each, kept across runs
    encoded = [engines[args.batch_sizes[0]].encode(p, chat=True) for p in prompts]
    warm_up = SamplingParams(max_tokens=4, ignore_eos=True)
    for bs, engine in engines.items():  # untimed, both sides: first-call work (allocations, caches) is in no run
        engine.generate(encoded[:bs], warm_up)
        _hf_generate(hf, tok, encoded[:bs], 4)

    def time_ours(engine: Engine, groups: list[list[list[int]]]) -> tuple[int, float]:
        t0 = time.perf_counter()
        n = sum(len(c.token_ids) for g in groups for c in engine.generate(g, params))
        return n, time.perf_counter() - t0

    def time_theirs(groups: list[list[list[int]]]) -> tuple[int, float]:
        t0 = time.perf_counter()
        n = sum(_hf_generate(hf, tok, g, args.max_tokens) for g in groups)
        return n, time.perf_counter() - t0

    for run_idx in range(args.runs):
        for bs, engine in engines.items():
            groups = [encoded[i : i + bs] for i in range(0, len(encoded), bs)]
            if run_idx % 2 == 0:  # in turn first: neither side always runs after the other
                (n_ours, t_ours), (n_theirs, t_hf) = time_ours(engine, groups), time_theirs(groups)
            else:
                (n_theirs, t_hf), (n_ours, t_ours) = time_theirs(groups), time_ours(engine, groups)
            for name, n, t in (("specserve", n_ours, t_ours), ("transformers", n_theirs, t_hf)):
                rows.append({"run": run_idx, "engine": name, "batch": bs, "tokens": n, "seconds": t, "tok_s": n / t})
                print(f"run {run_idx} batch {bs:3d} {name:12s} {n:5d} tokens {t:7.2f} s {n / t:8.1f} tok/s", flush=True)
    summary = []
    for bs in args.batch_sizes:
        tok_s = {(r["run"], r["engine"]): r["tok_s"] for r in rows if r["batch"] == bs}
        ours = [tok_s[i, "specserve"] for i in range(args.runs)]
        theirs = [tok_s[i, "transformers"] for i in range(args.runs)]
        summary.append(
            {
                "batch": bs,
                "specserve_tok_s": statistics.median(ours),
                "transformers_tok_s": statistics.median(theirs),
                "ratio_of_medians": statistics.median(ours) / statistics.median(theirs),
                "median_ratio": statistics.median(o / t for o, t in zip(ours, theirs, strict=True)),  # run by run
            }
        )
    cpu = cpu_summary()
    write_csv(args.out / "runs.csv", [row | {"cpu": cpu} for row in rows])
    write_csv(args.out / "summary.csv", [row | {"cpu": cpu} for row in summary])
    print(f"\nmedian of {args.runs} runs, {args.num_prompts} prompts x {args.max_tokens} new tokens, greedy")
    print(markdown_table(summary))
    print(cpu)
    return 0
