"""`specserve bench overhead`: the Ray Serve deployment's overhead over the in-process Engine, on the same models
and settings.

For each batch size B, B requests (MT-bench prompts; token ids in tiny mode) run at once with greedy decoding and
``ignore_eos``, so both sides generate exactly B * max_tokens tokens: through ``Engine.generate`` in this process,
and through HTTP against a local Serve app (router + one lane of target and draft actors). Prints a
table and writes a CSV; ``slowdown`` = Engine tokens/s / Serve tokens/s (goal <= 1.15). Engine and Serve runs
alternate (``--repeats`` times, median reported), so that other load on the machine hits both alike.

    .venv/bin/specserve bench overhead --pair smollm2-int8 --batch 1 16 --max-tokens 32
    .venv/bin/specserve bench overhead --tiny
"""

from __future__ import annotations

import argparse
import concurrent.futures
import socket
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from deployments.app_args import AppArgs, WorkerRole
from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.arg_types import batch_size, out_file_arg, positive_int
from specserve.bench.machine import cpu_summary
from specserve.bench.prompt_sets import mt_bench_prompts
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import ModelSpec, SpecConfig
from specserve.console import console_safe
from specserve.engine import Engine
from specserve.errors import SettingsError
from specserve.heap import freeze_loaded_objects
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_draft, load_model, load_tokenizer
from specserve.models.tiny import noisy_copy, tiny_config, tiny_head, tiny_model
from specserve.sampling import SamplingParams
from specserve.spec_decode.eagle_head import EagleHead

if TYPE_CHECKING:
    import httpx

STEP_SECONDS = "specserve_step_seconds"
HTTP_TIMEOUT_S = 600.0


class Mode(str, Enum):
    engine = "engine"  # Engine.generate in this process
    serve = "serve"  # HTTP through the Serve app


@dataclass(frozen=True)
class Row:
    models: str
    mode: Mode
    batch: int
    tokens: int
    seconds: float
    tokens_per_s: float
    steps: float  # the median over the repeats
    ms_per_step: float
    slowdown: float | None = None


def _engine(args: AppArgs) -> Engine:
    tokenizer: PreTrainedTokenizerBase
    target_recipe, draft_recipe = args.recipe(WorkerRole.target), args.recipe(WorkerRole.draft)
    assert target_recipe is not None
    draft: LlamaModel | EagleHead | None
    if args.tiny is not None:
        target = tiny_model(tiny_config(), seed=args.tiny.seed)
        if draft_recipe is None:
            draft = None
        elif args.tiny.draft_head:  # as the app's draft actor builds it (deployments/actors.py)
            draft = tiny_head(target, seed=args.tiny.draft_seed)
        else:
            draft = noisy_copy(target, args.tiny.draft_noise, seed=args.tiny.draft_seed)
        tokenizer = tiny_tokenizer()
    else:
        assert isinstance(target_recipe.spec, ModelSpec)
        target = load_model(target_recipe.spec)
        draft = None if draft_recipe is None or draft_recipe.spec is None else load_draft(draft_recipe.spec, target)
        tokenizer = load_tokenizer(target_recipe.spec)
    engine = Engine(  # the loop the app's lanes run: its guard, step budget and suffix cache too
        target,
        tokenizer,
        draft=draft,
        speculation=args.speculation,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        spec_headroom=args.spec_headroom,
        max_step_tokens=args.max_step_tokens,
        throughput_guard=args.throughput_guard,
        suffix_cache_tokens=args.suffix_cache_tokens,
    )
    if args.freeze_gc:  # as the app's workers do after loading
        freeze_loaded_objects()
    return engine


def _prompts(args: AppArgs, n: int) -> list[Any]:
    texts = [p.text for p in mt_bench_prompts()]
    if args.tiny is not None:
        return [[(7 * i + j) % 500 + 3 for j in range(12)] for i in range(n)]
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]


def bench_engine(engine: Engine, prompts: list[Any], max_tokens: int, *, chat: bool) -> tuple[float, int, float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), chat=chat)  # warm-up
    steps0, total0 = engine.loop.stats.timing.steps, engine.loop.stats.timing.total_s
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, chat=chat)
    seconds = time.perf_counter() - t0
    assert all(len(o.token_ids) == max_tokens for o in outs)
    steps = engine.loop.stats.timing.steps - steps0
    return seconds, steps, (engine.loop.stats.timing.total_s - total0) / max(steps, 1)


def _step_seconds(url: str) -> tuple[float, int]:
    import httpx

    total, count = 0.0, 0
    for line in httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text.splitlines():
        if line.startswith(STEP_SECONDS + "_sum"):
            total += float(line.split()[-1])
        elif line.startswith(STEP_SECONDS + "_count"):
            count += int(float(line.split()[-1]))
    return total, count


def bench_serve(url: str, model: str, prompts: list[Any], max_tokens: int, *, chat: bool) -> tuple[float, int, float]:
    import httpx

    def one(client: httpx.Client, prompt: Any, n: int) -> int:
        body: dict[str, Any] = {"model": model, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        body.update({"messages": prompt} if chat else {"prompt": prompt})
        r = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    with (
        httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S) as client,
        concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool,
    ):
        one(client, prompts[0], 4)  # warm-up
        sum0, count0 = _step_seconds(url)
        t0 = time.perf_counter()
        tokens = list(pool.map(lambda p: one(client, p, max_tokens), prompts))
        seconds = time.perf_counter() - t0
        sum1, count1 = _step_seconds(url)
    assert all(t == max_tokens for t in tokens)
    steps = count1 - count0
    return seconds, steps, (sum1 - sum0) / max(steps, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--pair", default="smollm2-int8", help="a MODEL_PAIRS name")
    group.add_argument("--tiny", action="store_true", help="tiny random models (no download)")
    p.add_argument("--batch", type=batch_size, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--sl", type=positive_int, default=4, help="chain speculation length")
    p.add_argument(
        "--torch-threads", type=positive_int, default=2, help="per worker actor, and the in-process Engine's"
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per setting (the median is reported)")
    p.add_argument("--out", type=out_file_arg, default=Path("bench_out/serve_overhead.csv"))


def run(a: argparse.Namespace) -> int:
    import ray  # Ray and the Serve app load only when the benchmark runs
    from ray import serve

    from deployments.app import app_builder

    threads = {"num_cpus": 0.5, "torch_threads": a.torch_threads}
    raw: dict[str, Any] = {
        "speculation": SpecConfig(sl=a.sl).model_dump(),
        "max_batch_size": max(a.batch),
        "max_model_len": 1024,
        "router_resources": {"num_cpus": 0.1},
        "target_resources": threads,
        "draft_resources": threads,
        **({"tiny": {}} if a.tiny else {"pair": a.pair}),
    }
    args = AppArgs.model_validate(raw)
    chat = args.tiny is None
    prompts = _prompts(args, max(a.batch))
    torch.set_num_threads(a.torch_threads)  # the Engine's forwards on as many threads as each actor's (it ran on the
    engine = _engine(args)  # machine's count: on 16 cores, 16 threads against Serve's 2 a forward)
    longest = max(len(engine.encode(p, chat=chat)) for p in prompts)
    if longest + a.max_tokens > engine.loop.max_model_len:  # every answer must be max_tokens long, on both sides
        raise SettingsError(
            f"--max-tokens {a.max_tokens}: the longest prompt ({longest} tokens) and the answer exceed the "
            f"benchmark's context of {engine.loop.max_model_len} tokens"
        )

    port = _free_port()
    ray.init(address="local", include_dashboard=False)  # its own Ray: never a running cluster's (it shuts Serve down)
    runs: dict[tuple[Mode, int], list[tuple[float, int, float]]] = defaultdict(list)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder(raw), name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        for _ in range(a.repeats):  # alternate, so that load from elsewhere on the machine hits both alike
            for b in a.batch:
                runs[Mode.engine, b].append(bench_engine(engine, prompts[:b], a.max_tokens, chat=chat))
                runs[Mode.serve, b].append(bench_serve(url, args.model_name, prompts[:b], a.max_tokens, chat=chat))
    finally:
        serve.shutdown()
        ray.shutdown()
    # each field's median over the repeats (an even count: the mean of the middle two, not the slower run)
    results = {
        key: tuple(statistics.median(field) for field in zip(*values, strict=True)) for key, values in runs.items()
    }

    rows: list[Row] = []
    for b in a.batch:
        tps: dict[Mode, float] = {}
        for mode in Mode:
            seconds, steps, step_s = results[mode, b]
            tps[mode] = b * a.max_tokens / seconds
            slowdown = tps[Mode.engine] / tps[mode] if mode == Mode.serve else None
            row = Row(args.model_name, mode, b, b * a.max_tokens, seconds, tps[mode], steps, 1000 * step_s, slowdown)
            rows.append(row)
    table = [{**asdict(r), "mode": r.mode.value} for r in rows]
    print(markdown_table(table))
    cpu = cpu_summary()
    print(cpu)
    write_csv(a.out, [row | {"cpu": cpu} for row in table])
    print(f"wrote {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    with console_safe():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
