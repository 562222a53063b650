"""`specserve bench spec`: speculative methods vs plain decoding vs transformers assisted generation.

Batch 1, greedy (T = 0), MT-bench first turns with the chat template, the same number of new tokens for every
method (EOS ignored), all methods side by side in one process. Reports tau (tokens per target forward, incl.
the bonus), tokens/s, speedup over plain decoding, draft and verify time per step, and checks that every
method's output equals plain greedy decoding token for token.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from specserve.bench.prompts import mt_bench_prompts
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import MODEL_PAIRS, ChainDraft, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_model, load_tokenizer
from specserve.models.sources import resolve
from specserve.sampling import SamplingParams
from specserve.tune import autotune


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="smollm2-bf16", choices=sorted(MODEL_PAIRS))
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--chain-sl", type=int, nargs="+", default=[2, 4, 6, 8])
    p.add_argument("--ddd-x", type=float, nargs="+", default=[-0.1, -0.3, -0.6, -1.0], help="DDD threshold sweep")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--budget", type=int, default=0, help="tree verify budget T; 0 = auto-tune on this machine")
    p.add_argument("--tree-depth", type=int, default=6)
    p.add_argument("--no-assisted", action="store_true", help="skip transformers assisted generation")
    p.add_argument("--out", type=Path, default=Path("bench_out/spec"))


def _hf_twin(model: LlamaModel, path: Path, int8: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype).eval()
    if int8:
        hf = torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8)
    return hf


def _assisted(
    target: torch.nn.Module, draft: torch.nn.Module, prompts: list[list[int]], n: int
) -> tuple[list[list[int]], float]:
    outs = []
    generate = cast(Callable[..., torch.Tensor], target.generate)  # an HF model: returns the token ids
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = generate(
                ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=draft,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    target_spec, draft_spec = MODEL_PAIRS[args.pair]
    target, draft = load_model(target_spec), load_model(draft_spec)
    tok = load_tokenizer(target_spec)
    plain_engine = Engine(target, tok, max_batch_size=1)
    prompts = [plain_engine.encode(p.text, chat=True) for p in mt_bench_prompts(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    tree = {"beam_width": args.beam_width, "tree_depth": args.tree_depth}
    budget = args.budget
    if budget == 0:
        tuned = autotune(target, draft, prompts[:3], SpecConfig(method=SpecMethod.eagle2, **tree), max_tokens=32)
        budget = tuned.best
        print("auto-tuned verify budget T =", budget)
        for r in tuned.rows:
            print(
                f"  T={r.size:3d} tau={r.tau:.2f} draft={r.draft_s * 1e3:.1f}ms verify={r.verify_s * 1e3:.1f}ms "
                f"-> {r.tokens_per_s:.1f} tok/s predicted"
            )
    methods: list[tuple[str, SpecConfig]] = [("plain", SpecConfig(method=SpecMethod.none))]
    methods += [
        (f"chain SL={sl}", SpecConfig(method=SpecMethod.chain, sl=sl, chain_draft=ChainDraft.greedy))
        for sl in args.chain_sl
    ]
    methods.append(
        (f"EAGLE-2 D={args.tree_depth} T={budget}", SpecConfig(method=SpecMethod.eagle2, budget=budget, **tree))
    )
    methods += [
        (f"DDD x={x} T={budget}", SpecConfig(method=SpecMethod.ddd, budget=budget, ddd_threshold=x, **tree))
        for x in args.ddd_x
    ]
    engines = [
        Engine(
            target,
            tok,
            draft=draft,
            speculation=spec,
            max_batch_size=1,
            max_model_len=1024,
            spec_headroom=max(64, budget),
        )
        for _, spec in methods
    ]
    seconds = [0.0] * len(methods)
    outs: list[list] = [[] for _ in methods]
    for i, p in enumerate(prompts):  # interleaved: load changes on a shared machine hit every method alike
        for m, engine in enumerate(engines):
            t0 = time.perf_counter()
            outs[m].append(engine.generate(p, params)[0])
            seconds[m] += time.perf_counter() - t0
        print(
            f"prompt {i + 1}/{len(prompts)}: "
            + "  ".join(
                f"{name.split()[0]} {sum(len(o.token_ids) for o in outs[m]) / seconds[m]:.1f}"
                for m, (name, _) in enumerate(methods)
            ),
            flush=True,
        )
    rows = []
    reference = [o.token_ids for o in outs[0]]
    for (name, _), engine, method_outs, secs in zip(methods, engines, outs, seconds, strict=True):
        tokens = [o.token_ids for o in method_outs]
        n = sum(len(t) for t in tokens)
        timing = engine.loop.timing
        forwards = sum(o.stats.target_forwards for o in method_outs)
        rows.append(
            {
                "method": name,
                "tau": n / forwards,
                "accept_rate": sum(o.stats.accepted for o in method_outs)
                / max(1, sum(o.stats.drafted for o in method_outs)),
                "mean_depth": sum(o.stats.depth_sum for o in method_outs)
                / max(1, sum(o.stats.draft_steps for o in method_outs)),
                "tok_s": n / secs,
                "speedup": 0.0,
                "draft_ms_step": 1e3 * timing.draft_s / timing.steps,
                "verify_ms_step": 1e3 * timing.verify_s / timing.steps,
                "other_ms_step": 1e3 * timing.overhead_s / timing.steps,
                "greedy_equal": sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(tokens),
            }
        )
    if not args.no_assisted:
        path = resolve(target_spec)
        hf_t, hf_d = _hf_twin(target, path, False), _hf_twin(draft, path, draft_spec.int8_dynamic)
        if draft_spec.int8_dynamic is False:
            hf_d = hf_d.to(draft_spec.dtype.torch)
        hf_outs, hf_seconds = _assisted(hf_t, hf_d, prompts, args.max_tokens)
        n = sum(len(o) for o in hf_outs)
        rows.append(
            {
                "method": "transformers assisted",
                "tau": float("nan"),
                "accept_rate": float("nan"),
                "mean_depth": float("nan"),
                "tok_s": n / hf_seconds,
                "speedup": 0.0,
                "draft_ms_step": float("nan"),
                "verify_ms_step": float("nan"),
                "other_ms_step": float("nan"),
                "greedy_equal": sum(a == b for a, b in zip(hf_outs, reference, strict=True)) / len(hf_outs),
            }
        )
        print(f"{'transformers assisted':28s} {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    base = rows[0]["tok_s"]
    for row in rows:
        row["speedup"] = row["tok_s"] / base
    write_csv(args.out / "spec.csv", rows)
    print(f"\n{args.pair}, {len(prompts)} MT-bench prompts x {args.max_tokens} new tokens, batch 1, greedy")
    print(markdown_table(rows))
    return 0
