"""`specserve bench spec`: speculative methods vs plain decoding (and transformers assisted generation).

Batch 1, greedy (T = 0), the first turn of each prompt through the chat template, the same number of new tokens for
every method (EOS ignored), every method side by side in one process, interleaved prompt by prompt (in balanced
orders, ``run_order``) so a noisy machine hits all of them alike. Per method: whether its output equals plain greedy
decoding token for token (a method that differs on any run is also named on stderr under the table), tau (tokens per
target forward incl. the bonus, and the EOS a stopped answer ends at, as the engine's own count), mean draft depth,
tokens/s and the ratio to plain, and the drafting and verifying ms of a step that prefills no prompt (from the runs
tok/s counts: each prompt's fastest repeat). Every engine (and ``--assisted``'s transformers models) runs the first
prompt once untimed before the timed runs; assisted generation runs after the engines on each prompt, and its
greedy_equal compares the tokens before the first EOS the engine emitted (transformers bans EOS to reach the same
length: ``_same_greedy``). Every engine must hold the longest prompt and its answer within its context limit (its
models' positions less one speculative step's headroom), or the run is refused.
Drafts: every ``--pairs`` entry that shares the target (an EAGLE head, a quantised copy), and with ``--drafters``
the model-free drafters alone (``lookup``, ``suffix``) or leading the pair's draft (``lookup+model``,
``suffix+model``). ``--by-category`` adds a table per prompt category; ``--passes 2`` runs the prompts again
(a repeated-request workload: the suffix drafter's cross-request cache then holds the first pass's outputs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple, cast

import torch
from pydantic import ValidationError

from specserve.arg_types import finite_float, non_negative_int, out_dir_arg, positive_int, present_device_arg
from specserve.bench.machine import device_summary
from specserve.bench.policies import check_steps_arg
from specserve.bench.prompt_sets import BenchPrompt, load_prompts, mt_bench_prompts, per_category
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import (
    MODEL_PAIRS,
    ChainDraft,
    Drafter,
    DraftSpec,
    DType,
    HeadQuant,
    HeadSpec,
    ModelSpec,
    SLPolicyKind,
    SpecConfig,
    SpecMethod,
    serving_speculation,
)
from specserve.engine import Completion, Engine
from specserve.errors import SettingsError, SpecServeError, settings_problems
from specserve.heap import freeze_loaded_objects
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_draft, load_model, load_tokenizer
from specserve.models.sources import resolve
from specserve.prompts import PromptEncoder
from specserve.sampling import SamplingParams
from specserve.spec_decode.eagle_head import EagleHead, HeadKind
from specserve.spec_decode.head_checkpoint import checkpoint_kind
from specserve.spec_decode.suffix_tree import SuffixCache
from specserve.step_events import StepTiming
from specserve.timing import balanced_orders
from specserve.tune import autotune

METHODS = ("chain", "eagle2", "ddd")
DRAFTERS = ("model", "lookup", "suffix", "lookup+model", "suffix+model")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompts", nargs="+", default=["mt-bench"], help="JSONL files in the MT-bench layout, or 'mt-bench'"
    )
    p.add_argument("--per-category", type=positive_int, default=None, help="the first N prompts of each category")
    p.add_argument("--pairs", nargs="+", default=["smollm2-eagle"], choices=sorted(MODEL_PAIRS), help="drafts")
    p.add_argument(
        "--heads", nargs="+", type=Path, default=[], help="more EAGLE head directories, loaded like the shipped head"
    )
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--num-prompts", type=positive_int, default=80, help="at most this many, in file order (default 80)")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--chain-sl", type=positive_int, nargs="+", default=[4])
    p.add_argument("--ddd-x", type=finite_float, nargs="+", default=[None], help="DDD threshold(s) x (default: config)")
    p.add_argument("--beam-width", type=positive_int, default=None, help="EAGLE-2 w (default: SpecConfig)")
    p.add_argument(
        "--tree-min-prob",
        type=finite_float,
        nargs="+",
        default=[None],
        help="trees: the least path draft probability kept",
    )
    p.add_argument(
        "--adaptive-floor",
        action="store_true",
        help="trees: also each floor measured as the engine runs, starting from each --tree-min-prob "
        "(SpecConfig.adaptive_floor)",
    )
    p.add_argument(
        "--budget", type=non_negative_int, nargs="+", default=[0], help="tree verify budget(s) T; 0 = auto-tune"
    )
    p.add_argument(
        "--tree-depth", type=positive_int, nargs="+", default=[None], help="EAGLE-2 depth(s) D (default: SpecConfig)"
    )
    p.add_argument(
        "--ddd-checks",
        type=check_steps_arg,
        nargs="+",
        default=[None],
        help="DDD check steps to compare, each comma-separated, e.g. 5,7,9 2,3,4 (default: SpecConfig)",
    )
    p.add_argument("--ddd-max-depth", type=positive_int, default=None, help="DDD n (default: SpecConfig)")
    p.add_argument(
        "--draft-vocab",
        type=positive_int,
        nargs="+",
        default=None,
        help="heads: reduced vocabulary size(s) V_d to compare",
    )
    p.add_argument(
        "--head-reads",
        nargs="+",
        choices=["bf16", "f32"],
        default=None,
        help="heads: how the kernel reads bf16-exact weights, to compare (HeadSpec.bf16_reads; default: the spec's)",
    )
    p.add_argument(
        "--head-layer",
        nargs="+",
        choices=["native", "python"],
        default=None,
        help="heads: whether the head's layer runs from the C++ stack, to compare (HeadSpec.native_layer)",
    )
    p.add_argument(
        "--head-quant",
        nargs="+",
        choices=[q.value for q in HeadQuant],
        default=None,
        help="heads: the head's weights as loaded or quantised at load, to compare (HeadSpec.quantize)",
    )
    p.add_argument(
        "--head-products",
        nargs="+",
        choices=["float", "int8"],
        default=None,
        help="heads: float or int8 activations for the quantised linears, to compare (HeadSpec.int8_products)",
    )
    p.add_argument("--dsde", action="store_true", help="also run each chain / DDD method under DSDE + SL_cap")
    p.add_argument("--assisted", action="store_true", help="add transformers assisted generation (draft models)")
    p.add_argument("--drafters", nargs="+", default=["model"], choices=DRAFTERS, help="who drafts")
    p.add_argument("--free-sl", type=positive_int, nargs="+", default=[5], help="model-free drafters: chain SL(s)")
    p.add_argument(
        "--free-budget", type=positive_int, nargs="+", default=[8], help="model-free drafters: DDD budget(s) T"
    )
    p.add_argument(
        "--model-budget",
        type=positive_int,
        default=None,
        help="X+model DDD: the model's tree budget T (default: --free-budget)",
    )
    p.add_argument(
        "--count-scores",
        choices=("measured", "share"),
        nargs="+",
        default=["measured"],
        help="model-free drafters: score nodes by their acceptance as measured or by their count share, to compare "
        "(ModelFreeConfig.calibrated)",
    )
    p.add_argument("--by-category", action="store_true", help="also a table per prompt category")
    p.add_argument("--passes", type=positive_int, default=1, help="run the prompts this many times (rows per pass)")
    p.add_argument("--repeats", type=positive_int, default=1, help="time each prompt R times in a row; keep the min")
    p.add_argument("--stop-at-eos", action="store_true", help="end each answer at EOS (default: max-tokens each)")
    p.add_argument("--guarded-default", action="store_true", help="add the serving default, throughput guard on")
    p.add_argument(
        "--mkl-packed",
        type=positive_int,
        nargs="*",
        default=[],
        help="targets with MKL-packed weights for these row counts",
    )
    p.add_argument(
        "--target-argmax",
        nargs="+",
        choices=["bounded", "full"],
        default=None,
        help="each target once per choice: greedy tokens from the bf16 LM-head copy or the full logits, to compare "
        "(ModelSpec.bounded_argmax; default: the spec's)",
    )
    p.add_argument(
        "--target-reads",
        nargs="+",
        choices=["q4+q8", "q4", "f32", "int8+q8"],
        default=None,
        help="each target once per choice: the kernel reads the decoder weights' Q4_1 records and the LM head's Q8_0 "
        "records where they measure faster, only the former, or float32 only (ModelSpec.q4_reads, q8_head_reads; the "
        "same bits), or the decoder's Q4_1 blocks with int8 activations (AMX tiles, VNNI or AVX2) and the LM head's "
        "records (ModelSpec.int8_reads: other bits, greedy-equal within the target), to compare (default: the spec's)",
    )
    p.add_argument(
        "--device", default="cpu", type=present_device_arg, help="where the models run, e.g. cuda (default: cpu)"
    )
    p.add_argument(
        "--dtype", choices=[d.value for d in DType], default=None, help="every model's dtype (default: the pair's)"
    )
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/spec"))


@dataclass(frozen=True)
class Method:
    name: str
    draft: str  # the pair whose draft it uses ("" for plain decoding and model-free drafters alone)
    spec: SpecConfig
    guard: bool = False  # the throughput guard on


def _tree_fields(args: argparse.Namespace) -> dict[str, object]:
    fields = {"beam_width": args.beam_width, "ddd_max_depth": args.ddd_max_depth}
    return {k: v for k, v in fields.items() if v is not None}


def methods_for(
    args: argparse.Namespace,
    pair: str | None,
    target: LlamaModel,
    draft: LlamaModel | EagleHead,
    prompts: list[list[int]],
    *,
    label: str | None = None,
    free: bool = True,
    target_label: str = "",
) -> list[Method]:
    """The methods run with one draft of ``pair`` (None: a head directory); ``label``: that draft's name in the table
    (a variant of the pair's draft or target: ``draft_variants``, ``draft_pairs``), the pair's name by default. The
    guarded default is the pair's own, whatever the variant. ``free``, ``target_label``: ``model_free_methods``'."""
    label = label or pair or "draft"
    out = model_free_methods(args, label, free=free, target_label=target_label)
    if "model" not in args.drafters:
        return out + _guarded(args, pair, label)
    model: list[Method] = []
    if "chain" in args.methods:
        for sl in args.chain_sl:
            spec = SpecConfig(method=SpecMethod.chain, sl=sl, chain_draft=ChainDraft.greedy)
            model.append(Method(f"chain SL={sl}", label, spec))
    tree = SpecConfig(method=SpecMethod.eagle2, **_tree_fields(args))  # type: ignore[arg-type]
    for budget in args.budget:
        t = budget
        if t == 0 and not ({"eagle2", "ddd"} & set(args.methods)):
            break  # no trees: nothing to tune
        if t == 0:
            tuned = autotune(target, draft, prompts[:3], tree, max_tokens=32)
            t = tuned.best
            print(f"{label}: auto-tuned verify budget T = {t}")
            for r in tuned.rows:
                print(
                    f"  T={r.size:3d} tau={r.tau:.2f} draft={r.draft_s * 1e3:.1f}ms verify={r.verify_s * 1e3:.1f}ms "
                    f"-> {r.tokens_per_s:.1f} tok/s predicted"
                )
        size = f"T={t}" + (" (auto)" if budget == 0 else "")
        if "eagle2" in args.methods:
            depths: list[int] = []
            for depth in args.tree_depth:
                depth_field = {} if depth is None else {"tree_depth": depth}
                capped = tree.model_copy(update={"budget": t, **depth_field})  # drafts at most T - 1 levels
                if capped.static_depth not in depths:  # two depths past T - 1 draft the same tree
                    depths.append(capped.static_depth)
                    for pruned in _min_prob_variants(args, capped):
                        name = f"EAGLE-2 D={capped.static_depth} {size}{_min_prob_label(pruned)}"
                        model.append(Method(name, label, pruned))
        if "ddd" in args.methods:
            for checks in args.ddd_checks:
                for x in args.ddd_x:
                    update: dict[str, object] = {"method": SpecMethod.ddd, "budget": t}
                    if x is not None:
                        update["ddd_threshold"] = x
                    if checks is not None:
                        update["ddd_check_steps"] = checks
                    shown = "" if checks is None else f" checks={','.join(map(str, checks))}"
                    for spec in _min_prob_variants(args, tree.model_copy(update=update)):
                        name = f"DDD x={spec.ddd_threshold:g}{shown} {size}{_min_prob_label(spec)}"
                        model.append(Method(name, label, spec))
    return _with_dsde(args, model) + out + _guarded(args, pair, label)


def _min_prob_variants(args: argparse.Namespace, spec: SpecConfig) -> list[SpecConfig]:
    fixed = [spec if p is None else _spec(spec.model_dump(), tree_min_prob=p) for p in args.tree_min_prob]
    adaptive = [s.model_copy(update={"adaptive_floor": True}) for s in fixed] if args.adaptive_floor else []
    return fixed + adaptive


def _min_prob_label(spec: SpecConfig) -> str:
    if spec.adaptive_floor:
        return f" p>=measured (from {spec.tree_min_prob:g})"
    return f" p>={spec.tree_min_prob:g}" if spec.tree_min_prob > 0 else ""


def greedy_mismatches(rows: list[dict[str, object]]) -> list[str]:
    """A line for each row whose tokens differ from plain greedy decoding's on some run (its greedy_equal below 1:
    a lossless method's never should, and its speed is then no like-for-like comparison)."""
    return [
        f"warning: {row['method']} ({row['draft']}, pass {row['pass']}, {row['category']}) differs from plain greedy "
        f"decoding on {1 - float(cast(float, row['greedy_equal'])):.1%} of its runs"
        for row in rows
        if float(cast(float, row["greedy_equal"])) < 1.0
    ]


def measured_floors(methods: list[Method], engines: list[Engine]) -> list[str]:
    """What each method with a measured tree floor ended on: seconds a verify row, tokens a second, the floor."""
    lines = []
    for method, engine in zip(methods, engines, strict=True):
        floor = engine.loop.planner.floor
        if not method.spec.adaptive_floor or floor is None:
            continue
        cost, rate, p = floor.row_cost(1), floor.tokens_per_s(1), floor.floor(1)
        shown = (
            "not measured"
            if cost is None or rate is None or p is None
            else (f"a verify row {cost * 1e3:.2f} ms x {rate:.1f} tok/s -> floor {p:.3f}")
        )
        lines.append(f"{method.name}: {shown}")
    return lines


def _with_dsde(args: argparse.Namespace, methods: list[Method]) -> list[Method]:
    """With ``--dsde``, each chain / DDD method again under DSDE (it sets each sequence's SL or depth budget)."""
    if not args.dsde:
        return methods
    return methods + [
        Method(m.name + " +DSDE", m.draft, m.spec.model_copy(update={"policy": SLPolicyKind.dsde}))
        for m in methods
        if m.spec.method in (SpecMethod.chain, SpecMethod.ddd)
    ]


def _guarded(args: argparse.Namespace, pair: str | None, label: str) -> list[Method]:
    """With ``--guarded-default``, what the pair serves with by default (``serving_speculation``), guard on."""
    if not args.guarded_default:
        return []
    return [Method("serving default (guarded)", label, serving_speculation(pair, args.device), guard=True)]


def model_free_methods(
    args: argparse.Namespace, pair: str, *, free: bool = True, target_label: str = ""
) -> list[Method]:
    """The model-free drafters of ``--drafters``: chains of ``--free-sl``, DDD trees of ``--free-budget`` (with the
    tree options given and the first ``--ddd-checks``); the ``X+model`` forms fall back to the pair's draft capped
    at the first ``--chain-sl`` (``model_max_sl``) and, in trees, at ``--model-budget``. ``free``: also the forms
    with no fallback, which use no draft: once per target (``target_label`` its name, as its plain row's), not once
    per pair or draft variant of it (identical engines timed again, rows that could not be told apart)."""
    out = []
    for d in (d for d in args.drafters if d != "model"):
        kind, fallback = d.removesuffix("+model"), d.endswith("+model")
        if not (fallback or free):
            continue
        base: dict[str, object] = {
            "drafter": Drafter(kind),
            "model_fallback": fallback,
            "chain_draft": ChainDraft.greedy,
        }
        if fallback:
            base["model_max_sl"] = args.chain_sl[0]
        tree = {**base, **_tree_fields(args)}
        if args.ddd_checks[0] is not None:
            tree["ddd_check_steps"] = args.ddd_checks[0]
        if args.ddd_x[0] is not None:  # the first, as for --ddd-checks: the model's trees, and share-scored count
            # trees (measured scores skip DDD's cut, docs/algorithms.md §10.6)
            tree["ddd_threshold"] = args.ddd_x[0]
        if fallback and args.model_budget is not None:
            tree["model_budget"] = args.model_budget
        specs = []
        if "chain" in args.methods:
            specs += [(f"chain SL={sl}", _spec(base, method=SpecMethod.chain, sl=sl)) for sl in args.free_sl]
        if "ddd" in args.methods:
            shown = "" if "model_budget" not in tree else f" (model T={args.model_budget})"
            for t in args.free_budget:  # the floor (fixed or measured) prunes both drafters' trees
                for spec in _min_prob_variants(args, _spec(tree, method=SpecMethod.ddd, budget=t)):
                    specs.append((f"DDD T={t}{shown}{_min_prob_label(spec)}", spec))
        for scores in args.count_scores:
            shown = "" if args.count_scores == ["measured"] else f" ({scores} scores)"
            methods = [
                Method(
                    f"{d}: {name}{shown}" + ("" if fallback else target_label),
                    pair if fallback else "",
                    _scored(spec, scores == "measured"),
                )
                for name, spec in specs
            ]
            out += _with_dsde(args, methods)
    return out


def _scored(spec: SpecConfig, measured: bool) -> SpecConfig:
    return spec.model_copy(update={"model_free": spec.model_free.model_copy(update={"calibrated": measured})})


def _spec(fields: dict[str, object], **more: object) -> SpecConfig:
    return SpecConfig.model_validate({**fields, **more})


def _hf_twin(model: LlamaModel, path: Path, int8: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype).eval()
    if int8:
        hf = torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8)
    return hf


def _assisted(
    target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], n: int, repeats: int, *, stop_at_eos: bool
) -> tuple[list[int], float]:
    """transformers assisted generation of one prompt: its tokens and the fastest of ``repeats`` runs (as
    ``_timed``). Without ``stop_at_eos`` it is held to n tokens (its EOS is then banned, so only the tokens before
    the first EOS compare with an engine that emits EOS and goes on: ``_same_greedy``)."""
    generate = cast(Callable[..., torch.Tensor], target.generate)  # an HF model: returns the token ids
    ids = torch.tensor([prompt])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = generate(
                ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=draft,
                max_new_tokens=n,
                min_new_tokens=0 if stop_at_eos else n,
                do_sample=False,
            )
        times.append(time.perf_counter() - t0)
    return out[0, len(prompt) :].tolist(), min(times)


def _same_greedy(theirs: list[int], ours: list[int], eos: set[int]) -> bool:
    """Whether transformers' greedy tokens are the engine's: where the engine emitted an EOS it ignores (and went
    on), transformers had to pick another token (it bans EOS below min_new_tokens), so the tokens before it are
    compared; where the engine stopped at EOS (not emitted), transformers' answer holds that EOS last."""

    def before_eos(tokens: list[int]) -> list[int]:
        return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]

    mine, other = before_eos(ours), before_eos(theirs)
    return other[: len(mine)] == mine if len(mine) < len(ours) else other == mine


def _assisted_twins(
    pairs: list[BenchPair], target_spec: ModelSpec, target: LlamaModel
) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(pair, transformers target, transformers draft) for each pair transformers can run: a draft model (no EAGLE
    head) of the first target whose weights transformers can hold (not the int4 kernel's), as the engine rows load
    it (``--dtype`` retypes the draft too: its twin had kept the pair's own dtype, another draft under one name)."""
    twins = []
    for bp in pairs:
        pair, draft_spec = bp.label, bp.draft
        if bp.target != target_spec:  # another model, or the same one as another variant (--target-*)
            print(f"--assisted: {pair}'s target is not the benchmarked target as loaded; skipped")
            continue
        if isinstance(draft_spec, HeadSpec):
            print(f"--assisted: no transformers twin for {pair}'s draft (an EAGLE head); skipped")
            continue
        if draft_spec.native_q4:  # its twin would be the float32 target drafting for itself
            print(f"--assisted: no transformers twin for {pair}'s draft (torch's int4 kernel); skipped")
            continue
        path = resolve(target_spec)
        hf_t, hf_d = _hf_twin(target, path, False), _hf_twin(target, path, draft_spec.int8_dynamic)
        if not draft_spec.int8_dynamic:
            hf_d = hf_d.to(draft_spec.dtype.torch)
        twins.append((pair, hf_t, hf_d))
    return twins


def _row(
    method: Method,
    outs: list[Completion],
    secs: float,
    reference: list[list[int]],
    timing: StepTiming | None,
    runs: list[list[list[int]]] | None = None,
) -> dict[str, object]:
    """``timing``: the steps of the timed runs behind ``secs`` (None: no per-step times). ``runs``: every repeat's
    tokens for each prompt, each held against plain's (None: the completion alone)."""
    tokens = [o.token_ids for o in outs]
    every = [[t] for t in tokens] if runs is None else runs
    n = sum(len(t) for t in tokens)
    forwards = sum(o.stats.target_forwards for o in outs)
    # tau as the engine counts it (RequestStats.tokens_per_forward): the EOS a stopped answer ends at was emitted by
    # its last forward, though token_ids leave it out (with --stop-at-eos plain decoding showed tau 0.99)
    emitted = sum(o.stats.accepted + o.stats.target_forwards for o in outs)
    nan = float("nan")
    return {
        "method": method.name,
        "draft": method.draft or "-",
        "greedy_equal": sum(a == b for rs, b in zip(every, reference, strict=True) for a in rs)
        / sum(len(rs) for rs in every),
        "tau": emitted / max(1, forwards),
        "mean_depth": sum(o.stats.depth_sum for o in outs) / max(1, sum(o.stats.draft_steps for o in outs)),
        "tok_s": n / secs,
        "ratio": 0.0,
        # steps that prefill no prompt: a prefill spread over a run's steps weighed on the fewer steps of a
        # method that accepts more a step (8.7% on plain's verify and 14.9% on a chain's in a tiny run)
        "draft_ms_step": nan if timing is None else 1e3 * timing.decode_draft_s / max(1, timing.decode_steps),
        "verify_ms_step": nan if timing is None else 1e3 * timing.decode_verify_s / max(1, timing.decode_steps),
        "rows_step": sum(o.stats.drafted for o in outs) / max(1, forwards),  # drafted nodes verified per step
        "prefill_share": nan if timing is None else timing.prefill_s / max(timing.total_s, 1e-9),
    }


def _prompt_set(sources: list[str], each_category: int | None) -> list[BenchPrompt]:
    prompts = [p for src in sources for p in (mt_bench_prompts() if src == "mt-bench" else load_prompts(Path(src)))]
    return prompts if each_category is None else per_category(prompts, each_category)


def run_order(n_methods: int, run: int) -> list[int]:
    """The methods' order for one prompt: the balanced orders (``balanced_orders``) in turn, so that every method
    runs in every place, and right after every other, equally often. (Forwards, then backwards, as before, put
    plain decoding right after itself or the second method on every prompt, never after any other.)"""
    orders = balanced_orders(n_methods)
    return orders[run % len(orders)]


class Timed(NamedTuple):
    out: Completion  # the fastest run's
    secs: float
    steps: StepTiming
    runs: list[list[int]]  # every run's tokens: greedy equality is checked on each, not the fastest alone


def _timed(engine: Engine, prompt: list[int], params: SamplingParams, repeats: int) -> Timed:
    """The fastest of ``repeats`` back-to-back runs (the least disturbed on a shared machine): its completion, time
    and steps, so that every column (tau, depth and rows a step from the completion's counts) comes from the run
    tok/s does; a guard or a measured floor learns across repeats, so the runs may differ, and each run's tokens
    come back for the greedy-equality check. The suffix drafter's cross-request cache takes the output once, after
    the last repeat, so every repeat drafts from the same cache."""
    cache = engine.loop.model_free.cache
    times: list[float] = []
    steps: list[StepTiming] = []
    outs: list[Completion] = []
    for i in range(repeats):
        before = replace(engine.loop.stats.timing)
        if cache is not None and i < repeats - 1:
            with _frozen(cache):
                outs.append(_generate_timed(engine, prompt, params, times))
        else:
            outs.append(_generate_timed(engine, prompt, params, times))
        steps.append(engine.loop.stats.timing - before)
    fastest = min(range(repeats), key=times.__getitem__)
    return Timed(outs[fastest], times[fastest], steps[fastest], [o.token_ids for o in outs])


def _warm_up(engines: list[Engine], prompt: list[int], params: SamplingParams) -> None:
    """One untimed run of every engine over ``prompt``: a first call's one-off costs (a kernel's first use for a
    shape or dtype, the allocator's growth, lazy initialisation) fell in the first timed run, plain decoding's
    on the first prompt, every method's per-step times. The suffix cache does not take the output (the prompt
    is timed next); a guard and a tree floor keep what they measured, as a serving engine's do."""
    for engine in engines:
        cache = engine.loop.model_free.cache
        with _frozen(cache) if cache is not None else contextlib.nullcontext():
            engine.generate(prompt, params)


def _generate_timed(engine: Engine, prompt: list[int], params: SamplingParams, times: list[float]) -> Completion:
    t0 = time.perf_counter()
    out = engine.generate(prompt, params)[0]
    times.append(time.perf_counter() - t0)
    return out


@contextlib.contextmanager
def _frozen(cache: SuffixCache) -> Iterator[None]:
    add = cache.add
    cache.add = lambda tokens, salt=None: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        cache.add = add  # type: ignore[method-assign]


def _grouped_rows(
    methods: list[Method],
    outs: list[list[Completion]],
    secs: list[list[float]],
    steps: list[list[StepTiming]],
    plain_of: list[int],
    keep: list[int],
    runs: list[list[list[list[int]]]],
) -> list[dict[str, object]]:
    """One row per method over the prompts ``keep``; ratios to the first plain row of the same prompts."""
    rows = [
        _row(
            m,
            [outs[i][k] for k in keep],
            sum(secs[i][k] for k in keep),
            [outs[plain_of[i]][k].token_ids for k in keep],
            sum((steps[i][k] for k in keep), StepTiming()),
            [runs[i][k] for k in keep],
        )
        for i, m in enumerate(methods)
    ]
    base = float(cast(float, rows[0]["tok_s"]))
    for row in rows:
        row["ratio"] = float(cast(float, row["tok_s"])) / base
    return rows


HEAD_PAIRS = {HeadKind.eagle3: "smollm2-eagle", HeadKind.eagle: "smollm2-eagle1"}  # ``--heads`` load like these


class BenchPair(NamedTuple):
    label: str  # its name in the table: the pair or a head directory, with the target's variant
    target: ModelSpec
    draft: DraftSpec
    pair: str | None  # the built-in pair whose serving default its guarded row runs (None: a ``--heads`` directory,
    # which gets the generic default)


def draft_pairs(args: argparse.Namespace) -> list[BenchPair]:
    """Every ``--pairs`` entry and every ``--heads`` directory, loaded like the shipped head of its layout: same
    target, and for an EAGLE-1/2 head the same reduced draft vocabulary (``smollm2-eagle1``); an EAGLE-3 head drafts
    over its own LM head (``smollm2-eagle``). Each once per ``--target-argmax`` and ``--target-reads`` choice,
    labelled by it (``--dtype`` retypes every pair under its own name)."""
    pairs = [BenchPair(p, *MODEL_PAIRS[p], pair=p) for p in args.pairs]
    for d in args.heads:
        target, head = MODEL_PAIRS[HEAD_PAIRS[checkpoint_kind(d)]]
        assert isinstance(head, HeadSpec)
        pairs.append(BenchPair(f"head {d.name}", target, head.model_copy(update={"head": str(d.resolve())}), None))
    if args.dtype:
        retype = {"dtype": DType(args.dtype)}
        pairs = [
            p._replace(target=p.target.model_copy(update=retype), draft=p.draft.model_copy(update=retype))
            for p in pairs
        ]
    if args.target_argmax:
        pairs = [
            p._replace(
                label=f"{p.label} {how} argmax", target=p.target.model_copy(update={"bounded_argmax": how == "bounded"})
            )
            for how in args.target_argmax
            for p in pairs
        ]
    if args.target_reads:
        pairs = [
            p._replace(
                label=f"{p.label} {how} reads",
                target=p.target.model_copy(
                    update={
                        "q4_reads": how != "f32",
                        "q8_head_reads": how.endswith("+q8"),
                        "int8_reads": how.startswith("int8"),
                    }
                ),
            )
            for how in args.target_reads
            for p in pairs
        ]
    return pairs


def draft_variants(args: argparse.Namespace, pair: str, spec: DraftSpec) -> dict[str, DraftSpec]:
    """The drafts to compare for one pair, by label: a head once per ``--draft-vocab`` size, ``--head-reads``,
    ``--head-layer``, ``--head-quant`` and ``--head-products``."""
    if not isinstance(spec, HeadSpec):
        return {pair: spec}
    heads = [(pair, spec)]
    if args.draft_vocab:
        heads = [(f"{pair} V={v}", spec.model_copy(update={"draft_vocab": v})) for v in args.draft_vocab]
    if args.head_reads:
        heads = [
            (f"{label} {reads} reads", head.model_copy(update={"bf16_reads": reads == "bf16"}))
            for label, head in heads
            for reads in args.head_reads
        ]
    if args.head_layer:
        heads = [
            (f"{label} {layer} layer", head.model_copy(update={"native_layer": layer == "native"}))
            for label, head in heads
            for layer in args.head_layer
        ]
    if args.head_quant:
        heads = [
            (f"{label} {quant.value}", head.model_copy(update={"quantize": quant}))
            for label, head in heads
            for quant in map(HeadQuant, args.head_quant)
        ]
    if args.head_products:
        heads = [
            (f"{label} {products} products", head.model_copy(update={"int8_products": products == "int8"}))
            for label, head in heads
            for products in args.head_products
        ]
    return dict(heads)


def check_settings(args: argparse.Namespace) -> None:
    """The methods' numbers checked as SpecConfig checks them, before any model loads (a pydantic error: a usage
    error of the command line)."""
    given = [
        *({"sl": (sl, "--chain-sl")} for sl in args.chain_sl),
        *({"sl": (sl, "--free-sl")} for sl in args.free_sl),
        *({"budget": (t, "--budget")} for t in args.budget if t),  # 0: auto-tuned
        *({"budget": (t, "--free-budget")} for t in args.free_budget if t),
        *({"ddd_threshold": (x, "--ddd-x")} for x in args.ddd_x if x is not None),
        *({"tree_min_prob": (f, "--tree-min-prob")} for f in args.tree_min_prob if f is not None),
        *({"tree_depth": (d, "--tree-depth")} for d in args.tree_depth if d is not None),
        {
            "beam_width": (args.beam_width, "--beam-width"),
            "ddd_max_depth": (args.ddd_max_depth, "--ddd-max-depth"),
            "model_budget": (args.model_budget, "--model-budget"),
        },
    ]
    for fields in given:
        try:
            SpecConfig(**{k: v for k, (v, _) in fields.items() if v is not None})
        except ValidationError as e:
            flags = {k: f"{flag} {v}" for k, (v, flag) in fields.items()}
            raise SettingsError(f"invalid arguments: {settings_problems(e, flags=flags)}") from None
    free = [d for d in args.drafters if d != "model"]
    if free and not {"chain", "ddd"} & set(args.methods):  # they would run nothing (beside the model's rows)
        raise SettingsError(
            f"--methods {' '.join(args.methods)}: the model-free --drafters {' '.join(free)} draft chains "
            "and DDD trees only (add chain or ddd)"
        )
    if "model" not in args.drafters and "eagle2" in args.methods:  # its rows vanished unsaid
        raise SettingsError("--methods eagle2: EAGLE-2 trees are drafted by the model alone (add --drafters model)")
    if args.model_budget is not None and not any(d.endswith("+model") for d in args.drafters):
        raise SettingsError("--model-budget: the model's tree budget under an X+model drafter (give one in --drafters)")
    if args.model_budget is not None and "ddd" not in args.methods:  # chains read it nowhere: ignored unsaid
        raise SettingsError("--model-budget: the model's budget in an X+model drafter's DDD trees (add --methods ddd)")


def check_head_flags(args: argparse.Namespace, pairs: list[BenchPair]) -> None:
    """The heads' variant flags need a pair drafting with a head: with none they compared nothing, unsaid."""
    given = [
        flag
        for flag, value in (
            ("--draft-vocab", args.draft_vocab),
            ("--head-reads", args.head_reads),
            ("--head-layer", args.head_layer),
            ("--head-quant", args.head_quant),
            ("--head-products", args.head_products),
        )
        if value
    ]
    if given and not any(isinstance(bp.draft, HeadSpec) for bp in pairs):
        raise SettingsError(
            f"{', '.join(given)} vary an EAGLE head's draft; no pair of this run drafts with one "
            f"({', '.join(bp.label for bp in pairs)}; add a head pair or --heads)"
        )


def check_draft_vocab(args: argparse.Namespace, pairs: list[BenchPair]) -> None:
    """``--draft-vocab`` checked as HeadSpec and the loader check it, before any model loads: sizes of at least 2,
    for EAGLE-1/2 heads only (an EAGLE-3 head drafts over its own LM head), within each head's vocabulary."""
    for size in args.draft_vocab or []:
        try:
            HeadSpec(draft_vocab=size)
        except ValidationError as e:
            problems = settings_problems(e, flags={"draft_vocab": f"--draft-vocab {size}"})
            raise SettingsError(f"invalid arguments: {problems}") from None
        for bp in pairs:
            if not isinstance(bp.draft, HeadSpec):
                continue
            if checkpoint_kind(bp.draft.path()) == HeadKind.eagle3:
                raise SettingsError(
                    f"--draft-vocab applies to EAGLE-1/2 heads; {bp.label}'s is EAGLE-3, drafting over its own LM head"
                )
            try:
                vocab = json.loads((bp.draft.path() / "config.json").read_text()).get("vocab_size")
            except (OSError, ValueError, AttributeError):  # the loader names what is wrong with the head
                continue
            if isinstance(vocab, int) and size > vocab:
                raise SettingsError(f"--draft-vocab {size} exceeds {bp.label}'s {vocab}-token vocabulary")


def run(args: argparse.Namespace) -> int:
    """Every target of ``--pairs`` gets its own plain row (its greedy reference); ratios are to the first plain."""
    if args.assisted and torch.device(args.device).type != "cpu":
        raise SpecServeError("--assisted (transformers assisted generation) runs on the CPU only")
    check_settings(args)
    pairs = draft_pairs(args)
    check_head_flags(args, pairs)
    check_draft_vocab(args, pairs)
    target_specs: list[ModelSpec] = []
    for bp in pairs:
        if bp.target not in target_specs:
            target_specs.append(bp.target)
    every = _prompt_set(args.prompts, args.per_category)  # a bad file fails before the loads
    bench = every[: args.num_prompts]
    if len(every) > len(bench):
        print(f"--num-prompts {args.num_prompts}: the first {len(bench)} of the set's {len(every)} prompts")
    if args.by_category and any(b.category == "all" for b in bench):  # its rows and the whole set's, one name
        raise SettingsError("--by-category: a prompt's category is 'all', the name of the whole set's rows")
    packed = {"mkl_packed_widths": tuple(args.mkl_packed)}
    targets = {t: load_model(t.model_copy(update=packed), device=args.device) for t in target_specs}
    tok = load_tokenizer(target_specs[0])
    encoder = PromptEncoder(tok, targets[target_specs[0]].cfg.vocab_size)  # as Engine.encode(text, chat=True)
    prompts = [encoder.chat([{"role": "user", "content": p.text}]) for p in bench]
    # one context for every engine: a method cut short of plain decoding's length would not be greedy-equal to it
    context = max(len(p) for p in prompts) + args.max_tokens
    for t_spec, model in targets.items():
        if context > model.max_positions:
            raise SettingsError(
                f"--max-tokens {args.max_tokens}: the longest prompt ({context - args.max_tokens} tokens) and the "
                f"answer exceed {t_spec.source}'s {model.max_positions} positions"
            )
    first = Engine(targets[target_specs[0]], tok, max_batch_size=1, max_model_len=context)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)
    methods: list[Method] = []
    engines: list[Engine] = []
    plain_of: list[int] = []  # index of each method's plain row (its greedy reference)
    for t_spec in target_specs:
        target = targets[t_spec]
        argmax = " full argmax" if not t_spec.bounded_argmax else ""
        reads = " f32 reads" if not t_spec.q4_reads else " q4 reads" if not t_spec.q8_head_reads else ""
        reads += " int8 reads" if t_spec.int8_reads else ""
        t_label = "" if len(target_specs) == 1 else f" ({t_spec.dtype.value}{argmax}{reads})"
        plain_row = len(methods)
        methods.append(Method("plain" + t_label, "", SpecConfig(method=SpecMethod.none)))
        engines.append(first if plain_row == 0 else Engine(target, tok, max_batch_size=1, max_model_len=context))
        plain_of.append(plain_row)
        free = True  # the draft-free rows: with this target's first draft
        for bp in (p for p in pairs if p.target == t_spec):
            for label, d_spec in draft_variants(args, bp.label, bp.draft).items():
                draft = load_draft(d_spec, target, device=args.device)
                chosen = methods_for(
                    args, bp.pair, target, draft, prompts, label=label, free=free, target_label=t_label
                )
                free = False
                for method in chosen:
                    methods.append(method)
                    engines.append(
                        Engine(
                            target,
                            tok,
                            draft=draft if method.draft else None,
                            speculation=method.spec,
                            max_batch_size=1,
                            max_model_len=context,
                            spec_headroom=max(64, method.spec.budget),
                            throughput_guard=method.guard,
                        )
                    )
                    plain_of.append(plain_row)
    for method, engine in zip(methods, engines, strict=True):  # speculation's headroom lowers an engine's limit
        if engine.loop.max_model_len < context:
            raise SettingsError(
                f"--max-tokens {args.max_tokens}: the longest prompt and its answer take {context} positions, and "
                f"{method.name} keeps {engine.loop.max_model_len} (its models' positions less one speculative "
                "step's headroom): its answers would stop short of plain decoding's"
            )
    assisted = _assisted_twins(pairs, target_specs[0], targets[target_specs[0]]) if args.assisted else []
    freeze_loaded_objects()  # as serving does after loading (specserve/heap.py): no full collection mid-run
    n_runs = len(prompts) * args.passes
    secs: list[list[float]] = [[] for _ in methods]  # per method, per (pass, prompt)
    outs: list[list[Completion]] = [[] for _ in methods]
    steps: list[list[StepTiming]] = [[] for _ in methods]
    every_run: list[list[list[list[int]]]] = [[] for _ in methods]  # per method, (pass, prompt): every repeat
    _warm_up(engines, prompts[0], params)
    for _, hf_t, hf_d in assisted:  # transformers' first call as well
        _assisted(hf_t, hf_d, prompts[0], args.max_tokens, 1, stop_at_eos=args.stop_at_eos)
    hf_secs: list[list[float]] = [[] for _ in assisted]
    hf_outs: list[list[list[int]]] = [[] for _ in assisted]
    for r in range(n_runs):  # interleaved: load changes on a shared machine hit every method alike
        p = prompts[r % len(prompts)]
        for m in run_order(len(engines), r):
            timed = _timed(engines[m], p, params, args.repeats)
            outs[m].append(timed.out)
            secs[m].append(timed.secs)
            steps[m].append(timed.steps)
            every_run[m].append(timed.runs)
        for j, (_, hf_t, hf_d) in enumerate(assisted):
            tokens, seconds = _assisted(hf_t, hf_d, p, args.max_tokens, args.repeats, stop_at_eos=args.stop_at_eos)
            hf_outs[j].append(tokens)
            hf_secs[j].append(seconds)
        rates = [sum(len(o.token_ids) for o in outs[m]) / sum(secs[m]) for m in range(len(methods))]
        print(f"run {r + 1}/{n_runs}: " + "  ".join(f"{x:.1f}" for x in rates) + " tok/s", flush=True)
    rows = []
    categories = sorted({b.category for b in bench}) if args.by_category else []
    for pass_i in range(args.passes):
        runs = range(pass_i * len(prompts), (pass_i + 1) * len(prompts))
        groups = [("all", list(runs))] + [
            (c, [k for k in runs if bench[k % len(prompts)].category == c]) for c in categories
        ]
        for cat, keep in groups:
            for row in _grouped_rows(methods, outs, secs, steps, plain_of, keep, every_run):
                rows.append({"pass": pass_i + 1, "category": cat} | row)
    eos = first.loop.eos_token_ids
    plain_tok_s = sum(len(o.token_ids) for o in outs[0]) / sum(secs[0])  # over every run, as the assisted rows
    for j, (pair, _, _) in enumerate(assisted):  # side by side with the plain row over every run
        # tokens as the engine counts them: an answer that stopped at EOS holds it last in transformers' output only
        n = sum(len(o) - (args.stop_at_eos and bool(o) and o[-1] in eos) for o in hf_outs[j])
        agree = [_same_greedy(h, o.token_ids, eos) for h, o in zip(hf_outs[j], outs[0], strict=True)]
        nan = float("nan")
        tok_s = n / sum(hf_secs[j])
        head: dict[str, object] = {"pass": 1 if args.passes == 1 else "all", "category": "all"}
        rows.append(
            head
            | {"method": "transformers assisted", "draft": pair}
            | {"greedy_equal": sum(agree) / len(agree), "tau": nan}
            | {"mean_depth": nan, "tok_s": tok_s, "ratio": tok_s / plain_tok_s}
            | {"draft_ms_step": nan, "verify_ms_step": nan, "rows_step": nan, "prefill_share": nan}
        )
    write_csv(args.out / "spec.csv", [row | {"device": device_summary(args.device)} for row in rows])
    source = " + ".join(args.prompts)
    passes = f" x {args.passes} passes" if args.passes > 1 else ""
    print(f"\n{len(prompts)} prompts from {source}{passes} x {args.max_tokens} new tokens, batch 1, greedy")
    print(device_summary(args.device))
    print(markdown_table(rows))
    for line in measured_floors(methods, engines):
        print(line)
    for line in greedy_mismatches(rows):
        print(line, file=sys.stderr)
    for other in sorted(set(plain_of) - {0}):  # another target's plain decoding against the first's
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs[other], outs[0], strict=True))
        print(f"{methods[other].name}: the first plain's tokens on {same} of {len(outs[0])} runs")
    return 0
