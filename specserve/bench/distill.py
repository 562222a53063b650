"""`specserve bench distill`: train-draft's data step, two ways, on the same prompts: the target's answers from the
Engine, then one prefill per conversation for the features (``prefill_distiller``), against the features kept
from the forwards that generate the answers (``greedy_distiller``). The two alternate ``--repeats`` times; the
table gives median seconds, answer tokens per second and how many of the second way's conversations are the first's
(the engine's plain greedy answers).

    .venv/bin/specserve bench distill --prompts 64 --max-new-tokens 128 --repeats 3
    .venv/bin/specserve bench distill --tiny
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specserve.arg_types import out_dir_arg, positive_int
from specserve.bench.machine import cpu_summary
from specserve.bench.stats import markdown_table, write_csv
from specserve.build import eos_ids_of
from specserve.config import MODEL_PAIRS, ModelSpec
from specserve.engine import Engine
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_model, load_tokenizer
from specserve.models.tiny import tiny_model
from specserve.sampling import SamplingParams
from specserve.sequence import FinishReason
from specserve.spec_decode.eagle_head import default_aux_layers
from specserve.train.distill import AnswerFn, Distiller, chat_ids, greedy_distiller, prefill_distiller
from specserve.train.seed_prompts import seed_prompts

TINY_EOS = 2
HELD_OUT = 100_000  # seed prompts are drawn from this index on: past any training run's


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=positive_int, default=64, help="conversations, generated together")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--eagle1", action="store_true", help="final features only (default: EAGLE-3's aux layers too)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model and token-id prompts: seconds")
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/distill"))


def _engine_answers(engine: Engine, stop_id: int) -> AnswerFn:
    """Greedy answers from the Engine, ending in ``stop_id`` where the target finished (as train-draft wrote them
    before it kept the generating forwards' features)."""

    def answer(ids: list[list[int]], max_new: int) -> list[list[int]]:
        done = engine.generate(ids, SamplingParams(max_tokens=max_new, temperature=0.0))
        return [c.token_ids + ([stop_id] if c.finish_reason is FinishReason.stop else []) for c in done]

    return answer


def answer_tokens(convs: list[list[int]], prompts: list[list[int]], stop_id: int) -> int:
    """Tokens the target generated: each conversation past its prompt, less the stop id written where it finished."""
    return sum(len(c) - len(p) - (len(c) > len(p) and c[-1] == stop_id) for c, p in zip(convs, prompts, strict=True))


def _setup(args: argparse.Namespace) -> tuple[LlamaModel, list[list[int]], int, Engine]:
    if args.tiny:
        model = tiny_model(seed=0)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, 512, (int(n),), generator=gen).tolist() for n in torch.randint(4, 24, (args.prompts,))
        ]
        engine = Engine(model, None, max_batch_size=args.prompts, max_model_len=256, eos_token_ids={TINY_EOS})
        return model, prompts, TINY_EOS, engine
    spec = ModelSpec(source=MODEL_PAIRS["smollm2-eagle"][0].source, gemv_copies=False)
    model, tokenizer = load_model(spec), load_tokenizer(spec)
    texts = seed_prompts(HELD_OUT + args.prompts, 0)[HELD_OUT:]
    stop_id = tokenizer.eos_token_id
    if eos_ids_of(sorted(model.eos_token_ids), tokenizer) != {stop_id}:
        raise ValueError("this comparison needs a target with a single EOS id")
    engine = Engine(model, tokenizer, max_batch_size=args.prompts, max_model_len=1024, eos_token_ids={stop_id})
    return model, [chat_ids(tokenizer, t) for t in texts], stop_id, engine


def run(args: argparse.Namespace) -> int:
    model, prompts, stop_id, engine = _setup(args)
    aux = () if args.eagle1 else default_aux_layers(model.cfg.num_layers)

    ways: dict[str, Distiller] = {
        "answers, then a prefill each": prefill_distiller(model, _engine_answers(engine, stop_id)),
        "features from generation": greedy_distiller(model, {stop_id}, len(prompts)),
    }
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    convs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, distill in ways.items():
            t0 = time.perf_counter()
            out, _feats = distill(prompts, args.max_new_tokens, aux)
            seconds[name].append(time.perf_counter() - t0)
            convs[name] = [c.tokens for c in out]
    reference = "answers, then a prefill each"
    base = statistics.median(seconds[reference])
    rows = [
        {
            "data step": name,
            "prompts": len(prompts),
            "median s": statistics.median(s),
            "answer tokens": answer_tokens(convs[name], prompts, stop_id),
            "answer tok/s": answer_tokens(convs[name], prompts, stop_id) / statistics.median(s),
            "speed-up": base / statistics.median(s),
            # the first way's answers are the engine's plain greedy decoding: the reference the other is held to
            "same conversations": None
            if name == reference
            else sum(a == b for a, b in zip(convs[name], convs[reference], strict=True)),
        }
        for name, s in seconds.items()
    ]
    print(markdown_table(rows))
    cpu = cpu_summary()
    print(cpu)
    write_csv(args.out / "distill.csv", [row | {"cpu": cpu} for row in rows])
    return 0
