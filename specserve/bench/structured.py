"""`specserve bench structured`: what holding answers to a format costs, plain and speculative, side by side.

For each prompt (MT-bench's first turns, through the chat template) every (method, format) pair generates the
answer greedily at batch 1, pairs interleaved prompt by prompt and pass by pass. Formats: free text, any JSON
object (``json_object``) and a small JSON schema. Methods: plain decoding and the pair's serving speculation
(its default drafter and trees, no guard). Per pair it prints the median decoding rate (tokens after the first
output's over the time after it: the prefill left out, so an answer a format ends early is not slower for it), the
paired ratio to the same method's free text (the format's cost) and to plain decoding under the same format (what
speculation buys there), tau, and whether every answer equals plain decoding's under its format; a CSV.

    .venv/bin/specserve bench structured --num-prompts 8 --max-tokens 64 --passes 3 --out bench_out/structured
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from specserve.arg_types import out_dir_arg, positive_int, present_device_arg
from specserve.bench.machine import device_summary
from specserve.bench.prompt_sets import mt_bench_prompts
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import DEFAULT_PAIR, MODEL_PAIRS, SpecConfig, SpecMethod, serving_speculation
from specserve.engine import Engine
from specserve.heap import freeze_loaded_objects
from specserve.models.loader import load_draft, load_model, load_tokenizer
from specserve.prompts import PromptEncoder
from specserve.sampling import SamplingParams
from specserve.sequence import RequestOutput
from specserve.structured import FormatKind, OutputFormat

SCHEMA = {  # a small record: strings, an integer, an enum and a list
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "kind": {"enum": ["essay", "poem", "list", "code", "other"]},
        "points": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["title", "year", "kind", "points"],
    "additionalProperties": False,
}
FORMATS: dict[str, OutputFormat | None] = {
    "text": None,
    "json_object": OutputFormat(kind=FormatKind.json_object),
    "json_schema": OutputFormat(kind=FormatKind.json_schema, schema_text=json.dumps(SCHEMA)),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default=DEFAULT_PAIR, choices=sorted(MODEL_PAIRS))
    p.add_argument("--num-prompts", type=positive_int, default=8, help="MT-bench's first prompts")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--passes", type=positive_int, default=3)
    p.add_argument("--device", type=present_device_arg, default="cpu")
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/structured"))


def run(args: argparse.Namespace) -> int:
    target_spec, draft_spec = MODEL_PAIRS[args.pair]
    target = load_model(target_spec, device=args.device)
    draft = load_draft(draft_spec, target, device=args.device)
    tok = load_tokenizer(target_spec)
    spec = serving_speculation(args.pair, args.device)
    methods = {"plain": SpecConfig(method=SpecMethod.none), f"{spec.method.value} ({args.pair})": spec}
    prompts_text = [p.text for p in mt_bench_prompts(args.num_prompts)]
    encoder = PromptEncoder(tok, target.cfg.vocab_size)  # as Engine.encode(text, chat=True)
    prompts = [encoder.chat([{"role": "user", "content": t}]) for t in prompts_text]
    context = max(len(p) for p in prompts) + args.max_tokens
    engines = {
        name: Engine(
            target,
            tok,
            draft=draft if s.method != SpecMethod.none else None,
            speculation=s,
            max_batch_size=1,
            max_model_len=context,
            spec_headroom=max(64, s.budget),
        )
        for name, s in methods.items()
    }
    pairs = [(m, f) for m in engines for f in FORMATS]
    params = {f: SamplingParams(max_tokens=args.max_tokens, output_format=fmt) for f, fmt in FORMATS.items()}
    freeze_loaded_objects()
    for m, f in pairs:  # untimed: first calls' one-off costs (and each format's grammar's first compile)
        engines[m].generate(prompts[0], params[f])
    rates: dict[tuple[str, str], list[float]] = {k: [] for k in pairs}
    outs: dict[tuple[str, str], list[list[int]]] = {k: [] for k in pairs}
    ends: dict[tuple[str, str], list[RequestOutput]] = {k: [] for k in pairs}
    for r in range(args.passes * len(prompts)):
        prompt = prompts[r % len(prompts)]
        order = pairs if r % 2 == 0 else pairs[::-1]  # interleaved, alternating order
        for m, f in order:
            ids, last, rate = _decoded(engines[m], prompt, params[f])
            rates[(m, f)].append(rate)
            outs[(m, f)].append(ids)
            ends[(m, f)].append(last)
    rows = [_row(m, f, rates, outs, ends) for m, f in pairs]
    print(f"# bench structured: {args.pair}, {len(prompts)} MT-bench prompts x {args.passes} passes, greedy, "
          f"up to {args.max_tokens} tokens; {device_summary(args.device)}")  # fmt: skip
    print(markdown_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "structured.csv", [row | {"device": device_summary(args.device)} for row in rows])
    print(f"wrote {args.out / 'structured.csv'}")
    return 0


def _decoded(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], RequestOutput, float]:
    """The answer's ids, its last output and its decoding rate: tokens after the first output's over the time from
    that output to the last (the prefill left out: an answer a format ends early would otherwise read slower for
    its share of a shorter run)."""
    ids: list[int] = []
    first_at, first_n = 0.0, 0
    last = None
    for out in engine.stream(prompt, params):
        if last is None:
            first_at, first_n = time.perf_counter(), len(out.token_ids)
        ids += out.token_ids
        last = out
    assert last is not None
    seconds = time.perf_counter() - first_at
    return ids, last, (len(ids) - first_n) / seconds if seconds > 0 and len(ids) > first_n else float("nan")


def _row(
    method: str,
    fmt: str,
    rates: dict[tuple[str, str], list[float]],
    outs: dict[tuple[str, str], list[list[int]]],
    ends: dict[tuple[str, str], list[RequestOutput]],
) -> dict[str, Any]:
    def ratio(a: list[float], b: list[float]) -> float:
        paired = [x / y for x, y in zip(a, b, strict=True) if x == x and y == y]  # (NaN: no rate, one output)
        return statistics.median(paired) if paired else float("nan")

    mine, done = rates[(method, fmt)], ends[(method, fmt)]
    forwards = sum(o.stats.target_forwards for o in done)
    finished = sum(o.finish_reason is not None and o.finish_reason.value == "stop" for o in done)
    return {
        "method": method,
        "format": fmt,
        "decode_tok_s": statistics.median(x for x in mine if x == x),
        "x_own_text": ratio(mine, rates[(method, "text")]),
        "x_plain_same_format": ratio(mine, rates[("plain", fmt)]),
        "tau": sum(len(ids) for ids in outs[(method, fmt)]) / forwards if forwards else float("nan"),
        "mean_tokens": statistics.mean(len(ids) for ids in outs[(method, fmt)]),
        "ended_by_format": finished / len(done),
        "greedy_eq_plain": "-" if method == "plain" else str(outs[(method, fmt)] == outs[("plain", fmt)]),
    }
