"""Verify-budget auto-tune (docs/algorithms.md §2.5): profile the target's step time against the number of verified
tokens on this device, estimate the accepted tokens at each budget from one calibration run, and pick the
budget T (trees) or chain length SL that maximises expected tokens per second.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from specserve.config import ChainDraft, Drafter, SLPolicyKind, SpecConfig, SpecMethod
from specserve.cpu import cpu_info
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.sources import cache_dir, store_json
from specserve.spec_decode.eagle_head import EagleHead
from specserve.timing import interleaved_medians

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def time_verify(
    model: LlamaModel, sizes: Sequence[int], *, context: int = 256, repeats: int = 5, causal: bool = False
) -> dict[int, float]:
    """Median seconds of one batch-1 target forward over T new tokens after ``context`` tokens: tree-masked, or
    causal as a chain verifies (``causal``). The sizes are timed in turn, pass after pass (a host that drifts while
    one size after another was timed whole bent the curve autotune maximises, and the profile is kept)."""
    forwards = [verify_forward(model, t, context=context, tree_mask=not causal) for t in sizes]
    return dict(zip(sizes, interleaved_medians(forwards, repeats, model.device), strict=True))  # after a warm-up


def verify_forward(
    model: LlamaModel, rows: int, *, context: int, tree_mask: bool, logits: int | None = None
) -> Callable[[], None]:
    """One batch-1 forward over ``rows`` new tokens after ``context`` cached ones, as the profilers and benchmarks
    time it: causal (a chain's verification, a prefill) or with the explicit mask a tree's verification passes
    (``tree_mask``; one row is a plain step either way), with the logits of the last ``logits`` rows (None: every
    row's, as a verification needs; a prefill needs the last row's). Every call cuts the cache back to the context."""
    cache = model.new_cache(1, context + rows + 1)
    slot = cache.allocate()
    gen = torch.Generator().manual_seed(0)
    if context:
        prefix = torch.randint(0, model.cfg.vocab_size, (context,), generator=gen)
        model(ForwardBatch.build(cache, [slot], [prefix], device=model.device), cache)
    tokens = torch.randint(0, model.cfg.vocab_size, (rows,), generator=gen)
    masks = [torch.ones(rows, rows, dtype=torch.bool).tril()] if tree_mask and rows > 1 else None
    positions = [list(range(context, context + rows))]

    def forward() -> None:
        num_logits = None if logits is None else [logits]
        batch = ForwardBatch.build(
            cache, [slot], [tokens], tree_masks=masks, positions=positions, num_logits=num_logits, device=model.device
        )
        model(batch, cache)
        cache.truncate(slot, context)

    return forward


def batch_decode_forward(model: LlamaModel, batch: int, *, context: int) -> Callable[[], None]:
    """One plain decoding step of ``batch`` sequences (one new token each) after ``context`` cached tokens each, in
    consecutive KV slots, as a batch of that size decodes. Every call cuts the caches back to the context."""
    cache = model.new_cache(batch, context + 2)
    slots = [cache.allocate() for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    if context:
        for slot in slots:  # one prefill per sequence: the KV of a long batched prefill is the same
            prefix = torch.randint(0, model.cfg.vocab_size, (context,), generator=gen)
            model(ForwardBatch.build(cache, [slot], [prefix], device=model.device), cache)
    tokens = [torch.randint(0, model.cfg.vocab_size, (1,), generator=gen) for _ in slots]

    def forward() -> None:
        model(ForwardBatch.build(cache, slots, tokens, device=model.device), cache)
        for slot in slots:
            cache.truncate(slot, context)

    return forward


def execution_path(model: LlamaModel) -> str:
    """What the model's forward runs through besides its shape: the C++ stack and attention kernel, and each
    linear's kernel (row-major, packed copies, Q4_1 / Q8_0 records, their row ranges and prefetch), dynamic int8 or
    int4 modules: each changes a verify's time."""

    def path(m: nn.Module) -> tuple[str, ...]:
        packed = tuple((lo, hi) for lo, hi, _ in getattr(m, "mkl_packed", ()))  # (the copies: their row ranges)
        return (
            type(m).__name__,
            *(str(getattr(m, name, None)) for name in ("small_rows", "small_copy_rows", "small_record_rows")),
            str(getattr(m, "small_prefetch", None)),
            str(getattr(m, "gemv_rows", None)),  # row-major copies (attach_gemv_copies)
            str(getattr(m, "pad_from", None)),  # zero-row padding (attach_row_padding)
            str(packed),  # MKL's packed copies (attach_mkl_packed)
            str(getattr(m, "int8_records", None) is not None),  # int8 products (attach_int8_reads / _head)
        )

    linears = sorted({path(m) for m in model.modules() if isinstance(m, nn.Linear) or "Linear" in type(m).__name__})
    stack = type(model.native_stack).__name__ if model.native_stack is not None else None
    return f"{stack}|{model.attention_kernel is not None}|{model.use_flash_attn}|{linears}"


def profile_key(model: LlamaModel, context: int) -> str:
    """The verify profile's key: the model's shape, dtype, device and execution path, the CPU and its flags (a VM
    may move to another), torch's version and threads, and the context."""
    cfg = model.cfg
    cpu, flags = cpu_info()
    ident = f"{cfg}|{model.dtype}|{model.device}|{execution_path(model)}|{cpu}|{sorted(flags)}"
    if model.device.type == "cuda":  # the accelerator's own timings: the same host may hold another GPU, a MIG slice
        props = torch.cuda.get_device_properties(model.device)
        ident += f"|{props.name}|{props.major}.{props.minor}|{props.total_memory}|{torch.version.cuda}"
    ident += f"|{torch.get_num_threads()}|{context}|{torch.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def verify_profile(
    model: LlamaModel, sizes: Sequence[int] = DEFAULT_SIZES, *, context: int = 256, causal: bool = False
) -> dict[int, float]:
    """time_verify, cached on disk under ``profile_key`` and the mask kind. An unreadable file is measured again
    and replaced; a file that cannot be written leaves the profile measured, with a warning."""
    kind = "-causal" if causal else ""
    path = cache_dir() / "profiles" / f"verify-{profile_key(model, context)}{kind}.json"
    try:
        cached = {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
        # every size's time there and a positive finite number (JSON takes NaN, Infinity and negatives)
        if all(t in cached and math.isfinite(cached[t]) and cached[t] > 0 for t in sizes):
            return {t: cached[t] for t in sizes}
    except (OSError, ValueError, AttributeError, TypeError):  # none yet, or cut short by a killed writer
        pass
    prof = time_verify(model, sizes, context=context, causal=causal)
    store_json(path, prof)
    return prof


def tau_at_budget(path_ranks: Sequence[Sequence[int]], budget: int) -> float:
    """Mean tokens per step had the tree kept only its best budget-1 nodes (greedy verification).

    Exact for greedy: the kept set is a prefix of the score order and closed under ancestors, so the accepted
    path is cut at its first node ranked >= budget-1.
    """
    total = 0
    for ranks in path_ranks:
        n = 0
        while n < len(ranks) and ranks[n] < budget - 1:
            n += 1
        total += n + 1
    return total / max(1, len(path_ranks))


def tau_at_length(accepted: Sequence[int], sl: int) -> float:
    """Mean tokens per step of a greedy chain of length sl, from runs at a longer length."""
    return sum(min(a, sl) + 1 for a in accepted) / max(1, len(accepted))


@dataclass(frozen=True)
class TuneRow:
    size: int  # T for trees, SL for chains
    tau: float
    draft_s: float
    verify_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tau / (self.draft_s + self.verify_s)


@dataclass(frozen=True)
class TuneResult:
    method: SpecMethod
    best: int
    rows: list[TuneRow]

    def to_json(self) -> str:
        return json.dumps({"method": self.method.value, "best": self.best, "rows": [asdict(r) for r in self.rows]})


def autotune(
    target: LlamaModel,
    draft: LlamaModel | EagleHead,
    prompts: Sequence[list[int]],
    spec: SpecConfig,
    *,
    candidates: Sequence[int] | None = None,
    max_tokens: int = 48,
) -> TuneResult:
    """Calibrate on ``prompts`` at the largest candidate, then predict tokens/s for every candidate."""
    from specserve.engine import Engine
    from specserve.sampling import SamplingParams

    is_chain = spec.method == SpecMethod.chain
    cands = sorted(candidates or ((1, 2, 3, 4, 5, 6, 8, 10, 12) if is_chain else (4, 6, 8, 10, 12, 16, 24, 32, 48, 64)))
    biggest = cands[-1]
    # the draft model at a fixed length or budget every step: DSDE would set each step's depth, a cap or a floor cut
    # it, and a model-free drafter draft instead, while the costs below are read as ``biggest``'s
    fixed: dict[str, object] = {
        "policy": SLPolicyKind.static,
        "drafter": Drafter.model,
        "max_sl": None,
        "model_max_sl": None,
    }
    fixed |= {"tree_min_prob": 0.0, "adaptive_floor": False}
    calib = spec.model_copy(
        update=fixed
        | ({"sl": biggest, "chain_draft": ChainDraft.greedy} if is_chain else {"budget": biggest, "model_budget": None})
    )
    engine = Engine(target, None, draft=draft, speculation=calib, max_batch_size=1, spec_headroom=biggest + 1)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(list(prompts[:1]), params)  # untimed: the first calls' one-off costs (kernels, allocator)
    before = replace(engine.loop.stats.timing)
    engine.loop.stats.record_steps = True
    engine.generate(list(prompts), params)
    records = [r for step in engine.loop.stats.records for r in step if r.depth > 0]
    timed = engine.loop.stats.timing - before
    draft_per_step = timed.decode_draft_s / max(1, timed.decode_steps)  # the prompts' prefills left out
    verify = verify_profile(target, sorted({c + 1 for c in cands} if is_chain else set(cands)), causal=is_chain)
    rows = []
    for c in cands:
        if is_chain:
            per_level = draft_per_step / biggest
            rows.append(TuneRow(c, tau_at_length([r.accepted for r in records], c), per_level * c, verify[c + 1]))
        else:  # a budget-c tree drafts at most c - 1 levels (SpecConfig.static_depth): its share of the drafting
            levels = spec.model_copy(update={"budget": c}).static_depth / max(1, calib.static_depth)
            tau = tau_at_budget([r.path_ranks for r in records], c)
            rows.append(TuneRow(c, tau, draft_per_step * min(1.0, levels), verify[c]))
    best = max(rows, key=lambda r: r.tokens_per_s).size
    return TuneResult(spec.method, best, rows)
