"""Switch: a model's decoder layers run from C++ (``csrc/decoder_stack.cpp``) instead of the Python loop.

The C++ stack calls the ATen ops of ``DecoderLayer.forward`` (``linear``, ``attention``) without the Python
interpreter between ~25 ops per layer, which on a 2-core CPU cost as much as a third of a decode step
(docs/benchmarks.md, "Decoder layers from C++"). By default (``fused``) RMSNorm with its residual add and RoPE with
the KV write are single passes (float32 or bfloat16): the same values up to float rounding; built with
``fused=False`` it runs exactly the Python loop's ATen ops, bit for bit (the tests' reference). It is built once
per machine with the torch it runs against (``torch.utils.cpp_extension``, ~20-60 s with gcc and ninja) and
cached; where it cannot be built, or a model uses something it does not cover (CUDA, int8 dynamic layers), the
Python loop runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import stat
import struct
import subprocess
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from specserve.config import HeadQuant
from specserve.cpu import cpu_info
from specserve.durable import write_durably
from specserve.errors import SettingsError
from specserve.models.llama import PAD_WIDTH, LlamaModel, drop_native_stack
from specserve.models.q4 import Q4_GROUP, Q4Blocks, Q4Linear, Q8Blocks, quantize_q4_1, quantize_q8_0
from specserve.models.sources import cache_dir, store_json
from specserve.spec_decode.eagle_head import EagleHead
from specserve.timing import interleaved_medians

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "decoder_stack.cpp"
SOURCES = tuple(
    SOURCE.parent / name
    for name in ("decoder_stack.cpp", "small_gemm.cpp", "attention.cpp", "int8_q4.cpp", "lumped_kld.cpp", "argmax.cpp")
)
HEADERS = tuple(
    SOURCE.parent / name for name in ("small_gemm.h", "attention.h", "simd.h", "int8_q4.h", "lumped_kld.h", "argmax.h")
)
SMALL_GEMM_ROWS = 64  # the kernel's most rows (small_gemm.cpp: kMaxRows)
EVERY_ROW = (1 << SMALL_GEMM_ROWS) - 1  # a row mask (llama.reads_copy): products of 1..64 rows read the copy
# Row counts at which kernel_plan_for times the kernel's variants; a count's choice holds up to the next probe.
PLAN_PROBES = (1, 2, 4, 6, 8, 16)
# A variant other than the built-in one (packed copies, another prefetch) must be this much faster to be chosen: the
# variants at 1-3 rows measure within a few % of each other, and noise alone would flip them from load to load.
PLAN_MARGIN = 0.97
# A stored plan's choice at one row is timed again at each load (about 0.1-0.2 s): this much slower than the other
# choice, and the plan is measured again (a plan measured on a busy machine stays wrong for every later load)
RECHECK_MARGIN = 1.25
RECHECK_REPEATS = 5
Q8_HEAD_NAMES = ("model.embed_tokens.weight", "lm_head.weight")  # the LM head's blocks: tied, or its own
# No -march: portable code. No contraction: RoPE rounds as the Python loop. OpenMP: at::parallel_for is a header
# template that runs serially without it, and the kernel's products then used one core (small_gemm.cpp,
# parallel_threads); linked by soname, it is the libgomp torch already loaded, so one runtime and torch's thread count.
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_LOCK = "specserve.flock"  # held (flock) by the one process loading or building the extension
TORCH_BATON = "lock"  # torch.utils.cpp_extension's lock file in the build directory


class NativeStackUnavailable(RuntimeError):
    """The C++ stack could not be built or does not cover this model."""


def compiler_identity(cxx: str) -> str:
    """What ``cxx --version`` says (empty where it does not run): the int8 kernels are built only by a compiler
    new enough (csrc/int8_q4.cpp), and torch's build file names the compiler by command alone, so an upgraded
    ``c++`` would have kept loading the old build without them."""
    try:
        run = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return run.stdout.strip()


def extension_build_dir(sources: tuple[Path, ...] = SOURCES, headers: tuple[Path, ...] = HEADERS) -> Path:
    """The build directory of these sources: named by their code, torch's version, the flags and the compiler, and
    by where the sources, torch and Python's headers lie. The build file torch writes holds those paths, so two
    checkouts or virtual environments sharing one directory rewrote it in turn, and each rebuilt the extension
    (minutes on 2 cores) after the other had used it."""
    code = b"".join(path.read_bytes() for path in (*sources, *headers))
    places = [str(p.resolve().parent) for p in (sources[0], Path(torch.__file__))] + [sysconfig.get_path("include")]
    cxx = os.environ.get("CXX", "c++")  # (torch.utils.cpp_extension's choice)
    setting = f"{torch.__version__} {list(CFLAGS)} {list(LDFLAGS)} {places} {cxx} {compiler_identity(cxx)}"
    ident = hashlib.sha256(code + setting.encode()).hexdigest()[:12]
    return cache_dir() / "extensions" / f"specserve_decoder_stack_{ident}"


@functools.cache
def _build() -> ModuleType | NativeStackUnavailable:
    """The compiled extension, built on first use into the specserve cache (``SPECSERVE_CACHE``) and loaded from
    there afterwards. The name carries a hash of the source and the torch version and flags (``extension_build_dir``),
    so a changed source or torch never loads a stale build.

    Concurrent processes are kept apart by an ``flock`` on the build directory, which the kernel drops when its
    holder dies. torch's own lock is a file that a process killed mid-load (a timeout, a killed actor) leaves
    behind, after which every later load waited for ever: while this process holds the flock no other specserve
    process is loading, so any such file is stale and is removed.

    ninja trusts its log, not the library's bytes: a library cut short (a host that crashed before the linker's
    writes reached the disk, a partial copy of the cache) was loaded as built, and the process died of SIGBUS. A
    loaded library's size and sha256 are kept beside it (``<name>.so.sha256``) and checked before each load; one
    that differs, or without that record whose ELF header says it is cut short, is built again. A build directory
    this process cannot write (a cache baked into a read-only image) is imported from as it is if its library
    checks out."""
    from torch.utils.cpp_extension import load

    build_dir = extension_build_dir()
    name = build_dir.name
    start = time.perf_counter()
    try:
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            if (doubt := _untrusted(build_dir, build_dir / f"{name}.so")) is not None:
                return NativeStackUnavailable(f"not loading a library from {build_dir}: {doubt}")
            held = open(build_dir / BUILD_LOCK, "w")  # noqa: SIM115 (closed below, after the flock's use)
        except OSError as e:
            library = build_dir / f"{name}.so"
            if not library.is_file() or not _library_whole(library):
                raise
            log.info("the build directory %s is not writable (%s): importing its library as it is", build_dir, e)
            return _import_library(name, library)
        with held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / TORCH_BATON).unlink(missing_ok=True)
            _drop_damaged_build(build_dir, name)
            module = load(
                name=name,
                sources=[str(path) for path in SOURCES],
                extra_cflags=list(CFLAGS),  # (a copy: torch appends to the lists it is given)
                extra_ldflags=list(LDFLAGS),
                build_directory=str(build_dir),
                verbose=os.environ.get("SPECSERVE_BUILD_VERBOSE") == "1",
            )
            _record_library(build_dir / f"{name}.so")
    # no compiler, no ninja, a failed build, a compiler that fails torch's version check (CalledProcessError)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:
        return NativeStackUnavailable(f"building {SOURCE.name} failed: {e}")
    log.info("C++ decoder stack ready in %.1f s (%s)", time.perf_counter() - start, build_dir)
    return module


def _untrusted(*paths: Path) -> str | None:
    """Why code in these paths (the build directory, its library) may be another user's, or None: one owned by a
    user other than this process's or root, or writable by any user, could have had a library put in place that
    the record beside it vouches for (whoever writes the one writes the other). A directory its group may write is
    taken as the owner's (a umask of 002 makes every new one so)."""
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if st.st_uid not in (os.getuid(), 0):
            return f"{path} belongs to another user (uid {st.st_uid})"
        if st.st_mode & stat.S_IWOTH:
            return f"{path} is writable by any user (mode {stat.filemode(st.st_mode)})"
    return None


LIBRARY_RECORD = ".sha256"  # beside the library: "<size> <sha256>" of the library as last loaded


def _library_digest(library: Path) -> str:
    return f"{library.stat().st_size} {hashlib.sha256(library.read_bytes()).hexdigest()}"


def _library_whole(library: Path) -> bool:
    """Whether the library matches the record kept when it last loaded or, without one, whether its ELF header's
    section table lies within the file (a library cut short loses its tail, where the linker writes that table)."""
    record = library.with_name(library.name + LIBRARY_RECORD)
    try:
        if record.is_file():
            return record.read_text().strip() == _library_digest(library)
        with library.open("rb") as f:
            head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF":
            return False
        if head[4] != 2 or head[5] != 1:  # not 64-bit little-endian: no structural check here
            return True
        shoff, shentsize, shnum = struct.unpack_from("<Q", head, 0x28)[0], *struct.unpack_from("<HH", head, 0x3A)
        return shoff + shentsize * shnum <= library.stat().st_size
    except OSError:
        return False


def _drop_damaged_build(build_dir: Path, name: str) -> None:
    """A library that does not check out (``_library_whole``) removed with ninja's outputs and log, so that the load
    builds it again. Call with the build lock held."""
    library = build_dir / f"{name}.so"
    if not library.exists() or _library_whole(library):
        return
    log.warning("%s is damaged (cut short, or not the library last loaded): building it again", library)
    for path in build_dir.iterdir():
        if path.suffix in (".so", ".o", LIBRARY_RECORD) or path.name in (".ninja_log", ".ninja_deps"):
            path.unlink(missing_ok=True)


def _record_library(library: Path) -> None:
    record = library.with_name(library.name + LIBRARY_RECORD)
    digest = _library_digest(library)
    with contextlib.suppress(OSError):
        if record.is_file() and record.read_text().strip() == digest:
            return
    try:
        write_durably(record, lambda tmp: tmp.write_text(digest + "\n"))
    except OSError as e:
        log.warning("could not record %s (%s); it is checked by its header next time", library, e)


def _import_library(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extension() -> ModuleType:
    """The extension, or NativeStackUnavailable (a failed build is tried once per process)."""
    built = _build()
    if isinstance(built, NativeStackUnavailable):
        raise built
    return built


def _proj(ext: ModuleType, mod: nn.Module) -> Any:
    proj = ext.Proj()
    if isinstance(mod, Q4Linear):
        proj.q4 = True
        proj.packed, proj.scales_and_zeros = mod.packed, mod.scales_and_zeros
        proj.dense, proj.dense_from = mod.dense, mod.dense_from or 0
        proj.in_features, proj.out_features = mod.in_features, mod.out_features
        return proj
    if type(mod) is not nn.Linear:
        raise NativeStackUnavailable(f"the C++ stack does not cover a {type(mod).__name__} projection")
    proj.weight, proj.bias = mod.weight.detach(), None if mod.bias is None else mod.bias.detach()
    proj.weight_t, proj.gemv_rows = getattr(mod, "weight_t", None), getattr(mod, "gemv_rows", 0)
    proj.mkl_packed = list(getattr(mod, "mkl_packed", ()))
    proj.pad_from, proj.pad_width = getattr(mod, "pad_from", 0), PAD_WIDTH
    proj.small_rows = getattr(mod, "small_rows", 0) if getattr(mod, "small_gemm", None) is not None else 0
    proj.small_chunks = getattr(mod, "small_chunks", 0)
    proj.small_prefetch = list(getattr(mod, "small_prefetch", ()))  # the kernel's plan (kernel_plan_for)
    own = getattr(mod, "small_packed", None)  # the kernel's own packed copy: float32, or bf16 (a draft head's)
    if own is not None:
        proj.small_packed, proj.small_packed_rows = own, getattr(mod, "small_copy_rows", 0)
    records = getattr(mod, "small_records", None)  # Q4_1 / Q8_0 records (attach_q4_reads, attach_q8_head)
    if records is not None:
        proj.small_records, proj.small_record_rows = records, getattr(mod, "small_record_rows", 0)
    proj.int8_records = getattr(mod, "int8_records", None)  # records for int8 products (attach_int8_reads, ...)
    proj.int8_q8 = bool(getattr(mod, "int8_q8", False))  # ... Q8_0 ones (a draft head's, attach_head_records)
    return proj


def build_stack(model: LlamaModel, *, fused: bool = True) -> Any:
    """A C++ ``DecoderStack`` holding (not copying) the model's layer weights, as the Python path would use them:
    call after every switch that changes a projection (native_q4, GEMV copies, row padding; those switches drop
    an attached stack). ``fused``: float32 / bfloat16 norms with their residual adds and RoPE with the KV write as
    one pass each (the norms agree with ATen's to float rounding); without it, exactly the Python loop's ATen ops."""
    if model.device.type != "cpu":
        raise NativeStackUnavailable("the C++ stack is for the CPU (on a GPU the step is kernel-bound)")
    if Q4_GROUP != 32:  # the C++ side hard-codes the kernel's group size
        raise NativeStackUnavailable("Q4 group size changed")
    ext = extension()
    cfg = model.cfg
    native_attention = model.attention_kernel is not None
    stack = ext.DecoderStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, fused, native_attention)
    for layer in model.decoder_layers():
        stack.add_layer(
            layer.input_norm.detach(),
            layer.post_norm.detach(),
            *(_proj(ext, getattr(layer, name)) for name in ("qkv", "o_proj", "gate_up", "down")),
        )
    return stack


def small_gemm_available() -> bool:
    """True where the extension builds and the CPU has AVX-512F or AVX2 + FMA (detected, not assumed)."""
    try:
        return bool(extension().small_gemm_supported())
    except NativeStackUnavailable:
        return False
    except RuntimeError as e:  # the extension's check of SPECSERVE_SMALL_GEMM_ISA (a name, or one this CPU lacks)
        raise SettingsError(str(e).splitlines()[0]) from e


def attach_small_gemm(
    model: nn.Module,
    rows: int = SMALL_GEMM_ROWS,
    *,
    packed: bool = False,
    bf16_reads: bool = False,
    chunks: int = 0,
) -> bool:
    """Switch: float32 products of 1..``rows`` rows (decode steps, verifies, batches of up to 64 rows, a
    draft head's levels) run through ``csrc/small_gemm.cpp``: each weight row read once for all rows, and
    batch-invariant (a row's result is the same bit for bit whatever the other rows). Attached to every float32
    ``nn.Linear`` on the CPU, and to an EAGLE head's LM-head slice. ``packed`` (a LlamaModel's frozen weights
    only): the kernel reads a copy of each weight in its packed layout (blocks of 4 rows as one sequential stream;
    the same products bit for bit, one more copy of the weights in memory; ``ModelSpec.small_gemm_packed``).
    ``bf16_reads`` (frozen weights, e.g. a loaded draft head): a weight whose every value bfloat16 holds exactly (a
    head shipped in bf16, computed in float32) is read from a bfloat16 copy in the packed layout, each element widened
    to the same float32 in a register: the same products bit for bit from half the bytes (``HeadSpec.bf16_reads``).
    False (nothing attached, a logged reason) where
    the extension cannot be built, the CPU has no AVX-512F / AVX2 + FMA, or nothing is float32 on the CPU. On a
    LlamaModel call it before ``attach_native_stack`` (a switch drops an attached stack). ``chunks``: products of
    more rows, up to this many (larger verifies, short prefills), run through it ``rows`` rows at a time, so that a
    row's bits are the same in a forward of any such size (``ModelSpec.small_gemm_chunks``); BLAS computes larger
    ones."""
    if not 1 <= rows <= SMALL_GEMM_ROWS:
        raise ValueError(f"small_gemm serves 1..{SMALL_GEMM_ROWS} rows, not {rows}")
    if packed and not isinstance(model, LlamaModel):
        raise ValueError("packed copies are for a target's frozen weights (a LlamaModel), not a trainable head")
    lins = [
        m
        for m in model.modules()
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    ]
    if not lins:
        return False
    if not small_gemm_available():
        log.warning("the small-product kernel is not available here (no extension or no AVX-512F / AVX2 + FMA)")
        return False
    ext = extension()
    for mod in [*lins, *([model] if isinstance(model, EagleHead) else [])]:
        own: Any = None
        mod.small_gemm, mod.small_copy_gemm = ext.small_linear, None  # type: ignore[assignment]
        if packed and isinstance(mod, nn.Linear):
            own, mod.small_copy_gemm = ext.small_pack(mod.weight.detach()), ext.small_linear_packed
        elif bf16_reads and isinstance(mod, nn.Linear) and bf16_exact(mod.weight):
            own, mod.small_copy_gemm = ext.small_pack(mod.weight.detach().to(torch.bfloat16)), ext.small_linear_packed
        mod.small_rows, mod.small_packed, mod.small_chunks = rows, own, chunks  # type: ignore[assignment]
        mod.small_copy_rows = EVERY_ROW if own is not None else 0  # type: ignore[assignment]
    if isinstance(model, LlamaModel):
        drop_native_stack(model)
    return True


def layer_q4_blocks(model: LlamaModel, blocks: dict[str, Q4Blocks]) -> dict[nn.Linear, Q4Blocks] | None:
    """Each decoder projection of ``model`` -> its Q4_1 blocks from ``blocks`` (a GGUF's, by HF tensor name;
    ``gguf_layer_blocks``), fused as the runner holds them (q/k/v, gate/up); None unless every projection has them."""
    out = {}
    for i, layer in enumerate(model.decoder_layers()):
        p, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        for name, parts in (
            ("qkv", (att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight")),
            ("o_proj", (att + "o_proj.weight",)),
            ("gate_up", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
            ("down", (p + "mlp.down_proj.weight",)),
        ):
            mod = getattr(layer, name)
            if type(mod) is not nn.Linear or any(n not in blocks for n in parts):
                return None
            out[mod] = Q4Blocks.cat([blocks[n] for n in parts])
    return out


def matching_q4_blocks(model: LlamaModel, blocks: dict[str, Q4Blocks], switch: str) -> dict[nn.Linear, Q4Blocks] | None:
    """Each decoder projection's Q4_1 blocks, where every projection has them, has no bias and they dequantise to
    exactly its loaded weight; else None, with the reason logged under ``switch``."""
    found = layer_q4_blocks(model, blocks)
    if found is None:
        log.warning("%s: the GGUF does not hold every decoder projection as Q4_1 blocks", switch)
        return None
    for mod, b in found.items():
        if mod.bias is not None:
            log.warning("%s: a decoder projection has a bias", switch)
            return None
        if not torch.equal(b.dequantize(), mod.weight.detach()):
            log.warning("%s: the GGUF's blocks do not dequantise to the loaded weights; reading float32", switch)
            return None
    return found


def attach_q4_reads(model: LlamaModel, blocks: dict[str, Q4Blocks]) -> bool:
    """Switch: the kernel reads each decoder projection from its Q4_1 blocks (``small_pack_q4``: 4-bit values and
    their group's scale and minimum, 0.19x the float32 bytes), forming each float32 weight in a register by the
    dequantisation's own arithmetic: the same products bit for bit as over the float32 weights, which the model holds
    only because they are the GGUF's Q4_1 blocks dequantised (``ModelSpec.q4_reads``; docs/benchmarks.md, "Q4_1
    records for the kernel"). All or nothing: False (nothing attached, a logged reason) unless every projection is
    on the kernel and its blocks dequantise to exactly its float32 weight. The records (``small_records``) are read
    before any other copy, for every row count until ``kernel_plan_for`` measures which counts they win
    (``small_record_rows``). Call after ``attach_small_gemm`` and before the plan and ``attach_native_stack``."""
    ext = extension()
    found = matching_q4_blocks(model, blocks, "Q4_1 reads")
    if found is None:
        return False
    if any(getattr(mod, "small_gemm", None) is None for mod in found):
        log.warning("Q4_1 reads: a decoder projection is not on the small-product kernel; reading float32")
        return False
    for mod, blk in found.items():
        mod.small_records = ext.small_pack_q4(blk.q, blk.d, blk.m)  # type: ignore[assignment]
        mod.small_records_gemm, mod.small_record_rows = ext.small_linear_packed, EVERY_ROW  # type: ignore[assignment]
    drop_native_stack(model)
    return True


def attach_int8_reads(model: LlamaModel, blocks: dict[str, Q4Blocks]) -> bool:
    """Switch: every decoder product reads its Q4_1 blocks with int8 activations (``csrc/int8_q4.cpp``: rounded per
    row and group of 32; ``ModelSpec.int8_reads``) on the AMX tiles, with AVX512-VNNI or with AVX2, the same bits on
    each, at every row count, before any other copy. All or nothing: False (nothing attached, a logged reason) on a
    CPU or process with none of them, or unless every projection's blocks dequantise to exactly its loaded weight
    and fit the records (no bias, N a multiple of 64). Call after ``attach_small_gemm``; drops an attached C++ stack
    (built again by ``attach_native_stack``)."""
    ext = extension()
    kernels = ext.int8_kernels()
    if not kernels:
        log.warning("int8 reads: this CPU or process has no int8 kernel (AMX-INT8, AVX512-VNNI, AVX2); float32 serves")
        return False
    found = matching_q4_blocks(model, blocks, "int8 reads")
    if found is None:
        return False
    if any(mod.out_features % 64 or mod.in_features % Q4_GROUP for mod in found):
        log.warning("int8 reads: a decoder projection has a shape the records do not take")
        return False
    for mod, blk in found.items():
        mod.int8_records = ext.int8_pack_q4(blk.q, blk.d, blk.m)  # type: ignore[assignment]
        mod.int8_gemm = ext.int8_linear  # type: ignore[assignment]
    log.info("int8 reads: %d decoder projections on the %s kernel", len(found), kernels[0])
    drop_native_stack(model)
    return True


def attach_int8_head(model: LlamaModel, blocks: dict[str, Q8Blocks]) -> bool:
    """Switch, with the decoder's int8 reads (``ModelSpec.int8_reads``): the LM head reads its Q8_0 blocks with the
    activations rounded to int8 as the decoder's products round them (``csrc/int8_q4.cpp``, ``linear_q8``:
    AVX512-VNNI or AVX2), at every row count and before any other copy, so that greedy tokens are the argmax of those
    logits (``lm_head.greedy_ids``) and verification and decoding agree. The blocks are the head's own or, with tied
    embeddings, the token embedding's. False (nothing attached, a logged reason) without either, or unless the head
    has no bias, N is a multiple of 64 and the blocks dequantise to exactly its float32 weight."""
    ext = extension()
    head = model.lm_head
    name = Q8_HEAD_NAMES[0] if model.cfg.tie_word_embeddings else Q8_HEAD_NAMES[1]
    blk = blocks.get(name)
    if not ext.int8_q8_supported():
        log.warning("int8 head reads: this CPU or process has neither AVX512-VNNI nor AVX2; the LM head reads float32")
        return False
    if blk is None or head.bias is not None or head.out_features % 64 or head.in_features % Q4_GROUP:
        log.warning("int8 head reads: no Q8_0 blocks for %s, or a head with a bias or a shape they do not take", name)
        return False
    if blk.q.shape != head.weight.shape or not torch.equal(blk.dequantize(), head.weight.detach()):
        log.warning("int8 head reads: the GGUF's blocks do not dequantise to the loaded LM head; reading float32")
        return False
    head.int8_records = ext.int8_pack_q8(blk.q, blk.d)  # type: ignore[assignment]
    head.int8_gemm = ext.int8_linear_q8  # type: ignore[assignment]
    return True


def attach_q8_head(model: LlamaModel, blocks: dict[str, Q8Blocks]) -> bool:
    """Switch: the kernel reads the LM head from its Q8_0 blocks (``small_pack_q8``: 8-bit values and their group's
    scale, 0.28x the float32 bytes), forming each float32 weight by the dequantisation's own multiply, exact in
    float32: the same logits bit for bit (``ModelSpec.q8_head_reads``; docs/benchmarks.md, "Q8_0 records for the LM
    head"). The blocks are the head's own (``lm_head.weight``) or, with tied embeddings, the token embedding's. False
    (nothing attached, a logged reason) unless the head is on the kernel, has no bias and the blocks dequantise to
    exactly its float32 weight. Read before any other copy until ``kernel_plan_for`` measures which row counts they
    win (``KernelPlan.q8_rows``). Call after ``attach_small_gemm`` and before the plan and ``attach_native_stack``."""
    head = model.lm_head
    name = Q8_HEAD_NAMES[0] if model.cfg.tie_word_embeddings else Q8_HEAD_NAMES[1]
    blk = blocks.get(name)
    if blk is None:
        log.info("Q8_0 head reads: the GGUF does not hold %s as Q8_0 blocks", name)
        return False
    if getattr(head, "small_gemm", None) is None or head.bias is not None:
        log.warning("Q8_0 head reads: the LM head is not on the small-product kernel or has a bias")
        return False
    if blk.q.shape != head.weight.shape or not torch.equal(blk.dequantize(), head.weight.detach()):
        log.warning("Q8_0 head reads: the GGUF's blocks do not dequantise to the loaded LM head; reading float32")
        return False
    head.small_records = extension().small_pack_q8(blk.q, blk.d)  # type: ignore[assignment]
    head.small_records_gemm, head.small_record_rows = extension().small_linear_packed, EVERY_ROW  # type: ignore[assignment]
    return True


@dataclass(frozen=True)
class KernelPlan:
    """How the kernel runs a model's products of each row count on this machine (the same bits either way):
    ``packed_rows`` a row mask (``llama.reads_copy``) of the counts that read the packed copies, ``prefetch`` [r - 1]
    what a product of r rows prefetches (``ext.Prefetch``), ``q4_rows`` the counts that read Q4_1 records (where a
    decoder projection holds them: ``attach_q4_reads``; before any other copy), ``q8_rows`` those that read the LM
    head's Q8_0 records (``attach_q8_head``); ``q4_prefetch`` and ``q8_prefetch`` [r - 1] what the records prefetch
    at the counts they serve (empty: as ``prefetch``)."""

    packed_rows: int
    prefetch: tuple[Any, ...]
    q4_rows: int = 0
    q8_rows: int = 0
    q4_prefetch: tuple[Any, ...] = ()
    q8_prefetch: tuple[Any, ...] = ()

    def prefetch_of(self, record_rows: int, record_prefetch: tuple[Any, ...]) -> tuple[Any, ...]:
        """[r - 1]: a product's prefetch where it reads records for ``record_rows`` and a copy for the rest."""
        if not record_prefetch:
            return self.prefetch
        pairs = zip(self.prefetch, record_prefetch, strict=True)
        return tuple(rec if record_rows >> r & 1 else pf for r, (pf, rec) in enumerate(pairs))

    def describe(self) -> str:
        parts = []
        for label, prefetch in (
            ("", self.prefetch),
            ("Q4_1 records' ", self.prefetch_of(self.q4_rows, self.q4_prefetch)),
            ("the LM head's records' ", self.prefetch_of(self.q8_rows, self.q8_prefetch)),
        ):
            if label and prefetch == self.prefetch:
                continue
            names = sorted({p.name for p in prefetch})
            masks = {n: sum(1 << r for r, p in enumerate(prefetch) if p.name == n) for n in names}
            parts.append(f"{label}prefetch " + ", ".join(f"{n} for {describe_rows(m)}" for n, m in masks.items()))
        q4 = [f"Q4_1 records for {describe_rows(self.q4_rows)}"] if self.q4_rows else []
        q4 += [f"the LM head's Q8_0 records for {describe_rows(self.q8_rows)}"] if self.q8_rows else []
        packed = f"packed copies for {describe_rows(self.packed_rows & ~self.q4_rows)}"
        head = self.packed_rows & ~self.q8_rows  # the LM head's copy: the counts its own records (if any) do not read
        if head != self.packed_rows & ~self.q4_rows:
            packed += f" (the LM head's for {describe_rows(head)})"
        return "; ".join([*q4, packed, *parts])


def kernel_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's products that run on the kernel (attach_small_gemm)."""
    return [m for m in model.modules() if type(m) is nn.Linear and getattr(m, "small_gemm", None) is not None]


def kernel_plan_for(
    model: LlamaModel,
    layouts: tuple[bool, ...] = (True, False),
    probes: tuple[int, ...] = PLAN_PROBES,
    repeats: int = 3,
) -> KernelPlan:
    """Measure and set how the kernel runs the model's products on this machine: at each probe r (``time_variants``:
    every kernel product of the model in one pass, as a step reads them) each layout in ``layouts`` (True: the
    packed copies, which the model must hold) with each prefetch (one row: none or l2; more: l1 or l2); the fastest
    serves r .. (next probe - 1) rows, where a variant other than the built-in one (row-major, none at one row, l1
    at more) must win by 3% (PLAN_MARGIN). Copies no count reads are dropped (a float32 copy of the weights freed).
    An AMD EPYC (Zen 5) read the packed copies 8-15% faster at 1-8 rows with l1; an AMX Xeon read both layouts 10-12%
    faster at 8-16 rows with l2 than with l1, and the row-major ones as fast as the packed (docs/benchmarks.md,
    "The kernel's plan, measured at load")."""
    ext = extension()
    lins = kernel_linears(model)
    if not lins:
        return KernelPlan(0, ())
    if True in layouts and not all(isinstance(getattr(m, "small_packed", None), ext.SmallPacked) for m in lins):
        raise ValueError("measuring the packed layout needs every kernel linear's packed copy (attach_small_gemm)")
    wins, prefetch = [], []
    for rows in probes:
        # the built-in prefetch first: the other replaces it only where it wins by PLAN_MARGIN, like the layout
        pfs = probe_prefetches(rows)
        variants = [(packed, pf) for packed in layouts for pf in pfs]
        times = dict(zip(variants, time_variants(lins, rows, variants, repeats), strict=True))
        best = {packed: faster(times[packed, pfs[0]], times[packed, pfs[1]]) for packed in layouts}
        packed = True in best and (False not in best or best[True][1] < PLAN_MARGIN * best[False][1])
        wins.append(packed)
        prefetch.append(pfs[best[packed][0]])
    # records where products hold them (the decoder projections' Q4_1, the LM head's Q8_0, each set timed on its own),
    # each prefetch against the float32 variant just chosen: what a copy wants is not what records want (a Cascade
    # Lake Xeon, one row: the float32 copies 3% faster with l2 than none, the Q4_1 records 25%)
    held = [m for m in lins if getattr(m, "small_records", None) is not None]
    masks: list[int] = []
    record_prefetch: list[tuple[Any, ...]] = []
    for group in ([m for m in held if m is not model.lm_head], [m for m in held if m is model.lm_head]):
        record_wins, group_prefetch = [], []
        for rows, packed, pf in zip(probes, wins, prefetch, strict=True) if group else ():
            pfs = probe_prefetches(rows)
            f32_s, record_s = time_records(group, rows, packed, pf, pfs, repeats)
            i, best_s = faster(*record_s)
            record_wins.append(best_s < PLAN_MARGIN * f32_s)  # like any variant other than the built-in one
            group_prefetch.append(pfs[i])
        masks.append(probe_mask(probes, record_wins) if group else 0)
        record_prefetch.append(tuple(spread(probes, group_prefetch)) if group else ())
    plan = KernelPlan(
        probe_mask(probes, wins),
        tuple(spread(probes, prefetch)),
        q4_rows=masks[0],
        q8_rows=masks[1],
        q4_prefetch=record_prefetch[0],
        q8_prefetch=record_prefetch[1],
    )
    apply_plan(model, plan)
    log.info("the kernel's plan, measured at load: %s", plan.describe())
    return plan


def probe_prefetches(rows: int) -> tuple[Any, Any]:
    """The prefetches a plan times at ``rows`` rows, the built-in one first (one row: none or l2; more: l1 or l2)."""
    ext = extension()
    return (ext.Prefetch.none, ext.Prefetch.l2) if rows == 1 else (ext.Prefetch.l1, ext.Prefetch.l2)


@torch.inference_mode()
def time_records(
    lins: list[nn.Linear], rows: int, packed: bool, prefetch: Any, record_prefetches: tuple[Any, ...], repeats: int
) -> tuple[float, tuple[float, ...]]:
    """Median seconds of the products of ``rows`` rows over ``lins`` in one pass: float32 weights in the layout
    ``packed`` chose with ``prefetch``, and their records with each of ``record_prefetches``, interleaved
    (``interleaved_medians``)."""
    ext = extension()
    gen = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(rows, k, generator=gen) for k in {m.in_features for m in lins}}

    def products(records: bool, pf: Any) -> None:
        for m in lins:
            x = xs[m.in_features]
            if records:
                ext.small_linear_packed(x, m.small_records, m.bias, pf)
            elif packed:
                ext.small_linear_packed(x, m.small_packed, m.bias, pf)
            else:
                ext.small_linear(x, m.weight.detach(), m.bias, pf)

    variants = [(False, prefetch), *((True, pf) for pf in record_prefetches)]
    f32_s, *record_s = interleaved_medians([functools.partial(products, *v) for v in variants], repeats)
    return f32_s, tuple(record_s)


def apply_plan(model: LlamaModel, plan: KernelPlan) -> None:
    """Set ``plan`` on every kernel product of the model; packed copies and records no row count reads are
    dropped."""
    ext = extension()
    for m in kernel_linears(model):
        m.small_prefetch = plan.prefetch  # type: ignore[assignment]
        packed_rows = plan.packed_rows
        if getattr(m, "small_records", None) is not None:
            record_rows = plan.q8_rows if m is model.lm_head else plan.q4_rows
            record_prefetch = plan.q8_prefetch if m is model.lm_head else plan.q4_prefetch
            m.small_prefetch = plan.prefetch_of(record_rows, record_prefetch)  # type: ignore[assignment]
            m.small_record_rows = record_rows  # type: ignore[assignment]
            packed_rows &= ~record_rows  # the records are read first: the copy serves the other counts only
            if not record_rows:
                m.small_records, m.small_records_gemm = None, None  # type: ignore[assignment]
        if isinstance(getattr(m, "small_packed", None), ext.SmallPacked):
            m.small_copy_rows = packed_rows  # type: ignore[assignment]
            if not packed_rows:
                m.small_packed, m.small_copy_gemm = None, None  # type: ignore[assignment]
    drop_native_stack(model)


def cached_kernel_plan(
    model: LlamaModel, layouts: tuple[bool, ...] = (True, False), probes: tuple[int, ...] = PLAN_PROBES
) -> KernelPlan:
    """``kernel_plan_for``, measured once per machine and model: kept in the specserve cache (``profiles/``, as the
    verify profile is) under a key of the CPU, the kernel's build and instruction set, torch's version and thread
    count, the products' shapes and the variants measured; later loads set it timing only its choice at one row
    against the other (``contradicted_at_one_row``), not the whole plan (2-5 s a load), and measure it again where
    that contradicts it. Delete the file to measure again; an unreadable one is measured again and replaced."""
    lins = kernel_linears(model)
    if not lins:
        return KernelPlan(0, ())
    path = cache_dir() / "profiles" / f"kernel-plan-{plan_key(lins, layouts, probes)}.json"
    plan = read_plan(path)
    if plan is not None and (slower := contradicted_at_one_row(model, plan, lins)) is not None:
        log.warning(
            "the kernel's stored plan %s reads %.1fx slower at one row than its other choice measures now (measured "
            "while the machine was busy?): measuring it again",
            path,
            slower,
        )
        plan = None
    if plan is not None:
        apply_plan(model, plan)
        log.info("the kernel's plan, measured on this machine before (%s): %s", path, plan.describe())
        return plan
    plan = kernel_plan_for(model, layouts, probes)
    stored = {
        "packed_rows": plan.packed_rows,
        "prefetch": [p.name for p in plan.prefetch],
        "q4_rows": plan.q4_rows,
        "q8_rows": plan.q8_rows,
        "q4_prefetch": [p.name for p in plan.q4_prefetch],
        "q8_prefetch": [p.name for p in plan.q8_prefetch],
    }
    store_json(path, stored)  # whole or not at all, for a process loading beside this one
    return plan


def contradicted_at_one_row(
    model: LlamaModel, plan: KernelPlan, lins: list[nn.Linear], repeats: int = RECHECK_REPEATS
) -> float | None:
    """How many times slower a stored plan's choice of records or float32 weights at one row (a decode step's
    products) reads than the other choice, timed now, where that is more than RECHECK_MARGIN (else None). A plan
    measured while another process timed beside it chose float32 weights at one row where the Q4_1 records read
    3.5x faster, and every later load kept it (docs/benchmarks.md, "A kernel plan measured on a busy machine")."""
    held = [m for m in lins if getattr(m, "small_records", None) is not None]
    groups = (
        ([m for m in held if m is not model.lm_head], plan.q4_rows, plan.q4_prefetch),
        ([m for m in held if m is model.lm_head], plan.q8_rows, plan.q8_prefetch),
    )
    for group, record_rows, record_prefetch in groups:
        if not group:
            continue
        packed = bool(plan.packed_rows & 1) and all(
            isinstance(getattr(m, "small_packed", None), extension().SmallPacked) for m in group
        )
        prefetch = record_prefetch[0] if record_prefetch else plan.prefetch[0]
        f32_s, records_s = time_records(group, 1, packed, plan.prefetch[0], (prefetch,), repeats)
        record_s = records_s[0]
        chosen, other = (record_s, f32_s) if record_rows & 1 else (f32_s, record_s)
        if chosen > RECHECK_MARGIN * other:
            return chosen / other
    return None


def plan_key(lins: list[nn.Linear], layouts: tuple[bool, ...], probes: tuple[int, ...]) -> str:
    ext = extension()
    model_name, flags = cpu_info()
    ident = [
        model_name,
        sorted(flags),
        ext.__name__,  # a hash of the kernel's source, torch's version and the build flags (_build)
        ext.small_gemm_isa(),
        torch.get_num_threads(),
        [[m.out_features, m.in_features, m.bias is not None] for m in lins],
        [getattr(m, "small_records", None) is not None for m in lins],  # which products hold records
        list(layouts),
        list(probes),
        PLAN_MARGIN,
        "records timed with each prefetch",  # plans stored before that chose the records' prefetch by the copies'
    ]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def read_plan(path: Path) -> KernelPlan | None:
    """The plan stored at ``path``, or None where there is none or it does not parse as one."""
    try:
        raw = json.loads(path.read_text())
        members = extension().Prefetch.__members__
        prefetch = tuple(members[name] for name in raw["prefetch"])
        packed_rows = int(raw["packed_rows"])
        q4_rows = int(raw.get("q4_rows", 0))
        q8_rows = int(raw.get("q8_rows", 0))
        q4_prefetch = tuple(members[name] for name in raw.get("q4_prefetch", ()))
        q8_prefetch = tuple(members[name] for name in raw.get("q8_prefetch", ()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("the kernel's stored plan %s is unreadable (%s); measuring it again", path, e)
        return None
    if len(prefetch) != SMALL_GEMM_ROWS or not 0 <= packed_rows <= EVERY_ROW:
        log.warning("the kernel's stored plan %s does not cover 1-%d rows; measuring it again", path, SMALL_GEMM_ROWS)
        return None
    if not (0 <= q4_rows <= EVERY_ROW and 0 <= q8_rows <= EVERY_ROW):
        log.warning("the kernel's stored plan %s has no valid row mask for records; measuring it again", path)
        return None
    if any(len(p) not in (0, SMALL_GEMM_ROWS) for p in (q4_prefetch, q8_prefetch)):
        log.warning("the kernel's stored plan %s does not cover 1-%d rows; measuring it again", path, SMALL_GEMM_ROWS)
        return None
    return KernelPlan(packed_rows, prefetch, q4_rows, q8_rows, q4_prefetch, q8_prefetch)


def faster(default_s: float, other_s: float) -> tuple[int, float]:
    """(index, seconds) of the variant a plan takes: the other (1) only where it beats the default (0) by the margin."""
    return (1, other_s) if other_s < PLAN_MARGIN * default_s else (0, default_s)


@torch.inference_mode()
def time_variants(lins: list[nn.Linear], rows: int, variants: list[tuple[bool, Any]], repeats: int) -> list[float]:
    """Median seconds of the kernel's products of ``rows`` rows over every linear in one pass, per (packed layout,
    prefetch) variant, interleaved (``interleaved_medians``: the order changes each pass, so that no variant always
    runs right after a pass over the same weights)."""
    ext = extension()
    gen = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(rows, k, generator=gen) for k in {m.in_features for m in lins}}

    def products(packed: bool, pf: Any) -> None:
        for m in lins:
            if packed:
                ext.small_linear_packed(xs[m.in_features], m.small_packed, m.bias, pf)
            else:
                ext.small_linear(xs[m.in_features], m.weight.detach(), m.bias, pf)

    return interleaved_medians([functools.partial(products, packed, pf) for packed, pf in variants], repeats)


def spread(probes: tuple[int, ...], per_probe: list[Any]) -> list[Any]:
    """[64]: each row count's value, that of the largest probe at or below it."""
    check_probes(probes)
    return [per_probe[max(i for i, p in enumerate(probes) if p <= rows)] for rows in range(1, SMALL_GEMM_ROWS + 1)]


def check_probes(probes: tuple[int, ...]) -> None:
    if not probes or probes[0] != 1 or list(probes) != sorted(set(probes)) or probes[-1] > SMALL_GEMM_ROWS:
        raise ValueError(f"probes must ascend from 1 to at most {SMALL_GEMM_ROWS}, not {probes}")


def probe_mask(probes: tuple[int, ...], wins: list[bool]) -> int:
    """A row mask (bit r - 1: r rows) holding, for each probe that won, its rows up to the next probe (the last: to
    64). probes ascending from 1."""
    return sum(1 << r for r, won in enumerate(spread(probes, wins)) if won)


def describe_rows(mask: int) -> str:
    """A row mask as row ranges, e.g. '1-15 rows', '1 row', 'no rows'."""
    spans, row = [], 1
    while row <= SMALL_GEMM_ROWS:
        if mask >> (row - 1) & 1:
            end = row
            while end < SMALL_GEMM_ROWS and mask >> end & 1:
                end += 1
            spans.append(f"{row}-{end}" if end > row else f"{row}")
            row = end + 1
        else:
            row += 1
    if not spans:
        return "no rows"
    return f"{spans[0]} row" if spans == ["1"] else f"{', '.join(spans)} rows"


def attach_head_records(head: EagleHead, quant: HeadQuant, *, int8: bool = False) -> bool:
    """Switch: each of the head's linears on the kernel (its fc, the layer's projections, EAGLE-3's LM head) is
    quantised to Q8_0 or Q4_1 blocks, its float weight replaced by their dequantisation, and the kernel reads the
    records (``HeadSpec.quantize``): the Python path and the kernel then compute the same products, from 0.28x /
    0.19x the float32 bytes. With ``int8`` (``HeadSpec.int8_products``) the same blocks are multiplied with the
    activations rounded to int8 per row and group of 32 (``csrc/int8_q4.cpp``), where the CPU runs that kernel
    (Q8_0: AVX512-VNNI or AVX2; Q4_1: those or AMX) and the linear's N is a multiple of 64; elsewhere the records are
    multiplied with float32 activations, with a logged reason (the float records stay beside the int8 ones, which
    every float32 product reads first). A draft's weights and products only change its proposals, never
    what verification accepts. Call after ``attach_small_gemm`` and before ``attach_head_stack``; False (nothing
    changed) for ``none`` or where no linear is on the kernel."""
    if quant == HeadQuant.none:
        if int8:
            log.warning("head int8 products: the head's weights are not quantised (quantize: none); float serves")
        return False
    lins = [m for m in kernel_linears(head) if m.in_features % Q4_GROUP == 0]
    if not lins:
        log.warning("head quantisation: none of the head's linears is on the small-product kernel")
        return False
    ext = extension()
    int8_here = ext.int8_q8_supported() if quant == HeadQuant.q8_0 else bool(ext.int8_kernels())
    if int8 and not int8_here:
        log.warning("head int8 products: this CPU or process has no int8 kernel for %s records; float serves", quant)
    int8_lins = 0
    for mod in lins:
        weight = mod.weight.detach()
        int8_fits = int8 and int8_here and mod.out_features % 64 == 0  # (a bias is added after the product)
        if quant == HeadQuant.q8_0:
            q8 = quantize_q8_0(weight)
            values, records = q8.dequantize(), ext.small_pack_q8(q8.q, q8.d)
            int8_records = ext.int8_pack_q8(q8.q, q8.d) if int8_fits else None
        else:
            q4 = quantize_q4_1(weight)
            values, records = q4.dequantize(), ext.small_pack_q4(q4.q, q4.d, q4.m)
            int8_records = ext.int8_pack_q4(q4.q, q4.d, q4.m) if int8_fits else None
        with torch.no_grad():
            weight.copy_(values.to(weight.dtype))
        mod.small_records, mod.small_records_gemm = records, ext.small_linear_packed  # type: ignore[assignment]
        mod.small_record_rows = EVERY_ROW  # type: ignore[assignment]
        mod.small_packed, mod.small_copy_rows = None, 0  # type: ignore[assignment]  # the bf16 copy is stale now
        # the int8 products' records of these blocks, or none (set either way: none of an earlier call's stays)
        q8_records = int8_records is not None and quant == HeadQuant.q8_0
        mod.int8_records, mod.int8_q8 = int8_records, q8_records  # type: ignore[assignment]
        int8_gemm = None if int8_records is None else ext.int8_linear_q8 if q8_records else ext.int8_linear
        mod.int8_gemm = int8_gemm  # type: ignore[assignment]
        int8_lins += int8_records is not None
    if int8 and int8_here and int8_lins < len(lins):
        log.warning(
            "head int8 products: %d of the head's %d linears have an N that is not a multiple of 64; they multiply "
            "their records with float32 activations",
            len(lins) - int8_lins,
            len(lins),
        )
    head.native_stack = None  # built again by attach_head_stack over the records
    return True


def follow_target_plan(head: EagleHead, target: LlamaModel) -> bool:
    """The head's kernel products prefetch as the target's plan, measured on this machine, says for each row count
    (``ModelSpec.small_gemm_plan``) for its LM head, the target's products closest to the head's own (Q8_0 records
    where both hold them): without it they took the kernel's default (no prefetch for one row), and on an AVX-512 Xeon
    a draft forward's products read right after a verify took 0.65 ms instead of 0.42 (docs/benchmarks.md, "The
    head's weights as Q8_0 records"). False where the target has no plan. Call before ``attach_head_stack``."""
    plan = getattr(target.lm_head, "small_prefetch", None)
    if plan is None:
        return False
    for m in kernel_linears(head):
        m.small_prefetch = plan  # type: ignore[assignment]
    head.native_stack = None  # built again by attach_head_stack with the plan
    return True


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether bfloat16 holds every value of this float32 weight exactly (widening it back changes no bit)."""
    w = weight.detach()
    return bool(torch.equal(w.to(torch.bfloat16).to(w.dtype), w))


def attach_head_stack(head: EagleHead) -> bool:
    """Switch on: a frozen draft head's decoder layer runs from the C++ stack (its attention input, the embedding
    and feature halves it builds in Python, passed as the layer's first input; RoPE with the KV write and the post
    norm fused), and its norms through the stack's fused norm: the same values up to float rounding, ~0.25 ms
    less per head forward on a 2-core Xeon (docs/benchmarks.md, "The draft head's layer from C++"). For drafting only
    (no autograd); attach after ``attach_small_gemm`` so the stack reads its weight copies. False (nothing attached,
    a logged reason) where the extension cannot be built or the head is not on the CPU, or not float32 or bfloat16
    (the stack's norm and RoPE kernels' dtypes)."""
    if head.device.type != "cpu":
        head.native_stack = None
        return False
    if (dtype := head.fc.weight.dtype) not in (torch.float32, torch.bfloat16):
        log.warning("the stack runs float32 or bfloat16 heads, not %s: the draft head's layer runs in Python", dtype)
        head.native_stack = None
        return False
    try:
        ext = extension()
    except NativeStackUnavailable as e:
        log.warning("%s; the draft head's layer runs in Python", e)
        head.native_stack = None
        return False
    cfg, layer = head.cfg, head.layer
    stack = ext.DecoderStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, True, False)
    unused_norm = torch.ones_like(layer.post_norm.detach())  # the layer's input comes normed (first_input)
    stack.add_layer(
        unused_norm,
        layer.post_norm.detach(),
        *(_proj(ext, getattr(layer, n)) for n in ("qkv", "o_proj", "gate_up", "down")),
    )
    head.native_stack, head.native_norm = stack, ext.rms_norm
    return True


def attach_native_attention(model: LlamaModel) -> bool:
    """Switch on: the model's float32 attention (the Python layer loop's and the C++ stack's) runs through
    ``csrc/attention.cpp``: each new token's keys read in place from its KV slot, its query heads grouped per KV head,
    the same bits whatever else is in the batch. False (nothing attached, a logged reason) where the extension cannot
    be built, the CPU lacks AVX2 + FMA, the head dim is not 64 or 128, or the model is not float32 on the CPU. Call
    before ``attach_native_stack`` (attaching drops a built stack)."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    try:
        ext = extension()
    except NativeStackUnavailable as e:
        log.warning("%s; attention runs through SDPA", e)
        return False
    if not ext.attention_supported(model.cfg.head_dim):
        log.warning("the attention kernel does not serve head dim %d on this CPU; SDPA runs", model.cfg.head_dim)
        return False
    model.attention_kernel = ext.attend
    drop_native_stack(model)
    return True


def attach_native_stack(model: LlamaModel) -> bool:
    """Switch on: ``model.hidden_states`` runs its layers through the C++ stack. False (nothing attached, a logged
    reason) where it cannot be built or does not cover the model."""
    try:
        model.native_stack = build_stack(model)
    except NativeStackUnavailable as e:
        log.warning("%s; the decoder layers run in Python", e)
        model.native_stack = None
        return False
    return True


def lumped_kld_kernel(model: LlamaModel) -> Callable[..., torch.Tensor] | None:
    """The extension's lumped-tail KLD (``csrc/lumped_kld.cpp``: ``kld_sparse(tail=lumped)`` in one call) where the
    model's layers run from C++ (the extension is loaded and the model on the CPU), else None."""
    return extension().lumped_kld if model.native_stack is not None else None
