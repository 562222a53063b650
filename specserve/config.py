"""Small self-validating configuration objects."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from specserve.arg_types import device_problem
from specserve.errors import ModelSourceError
from specserve.guard import GuardConfig
from specserve.policy import DSDEConfig, SparseTail
from specserve.sampling import MAX_BATCH_SIZE, MAX_CONTEXT
from specserve.validated import Validated


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)


class SourceKind(str, Enum):
    builtin = "builtin"  # a name from specserve.models.builtin.BUILTIN_MODELS
    hf_dir = "hf_dir"  # local directory with config.json + *.safetensors (+ tokenizer files)
    gguf = "gguf"  # a local .gguf file
    hub = "hub"  # a Hugging Face hub id ("org/name"); needs a reachable hub


class ModelSpec(Validated):
    """Where a model comes from and how to run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(default="smollm2-135m-instruct", min_length=1)  # ("" had read as the current directory)
    kind: SourceKind | None = Field(default=None, description="inferred from `source` when not given")
    dtype: DType = DType.float32
    int8_dynamic: bool = Field(
        default=False,
        description="dynamic int8 quantisation of the linear layers; drafts only (one activation scale per product: "
        "a target's rows would depend on their batch)",
    )
    native_q4: bool = Field(
        default=False,
        description="CPU: the decoder layers' matmuls read the GGUF's packed Q4_1 weights (int4 kernel, bf16 "
        "activations) instead of their float32 dequantisation; GGUF sources only",
    )
    q4_dense_from: int | None = Field(
        default=None,
        ge=1,
        description="with native_q4: products of at least this many rows use a bf16 copy of the dequantised "
        "weights (far faster at 16+ rows; 4x the packed bytes; no longer batch-invariant: drafts only, a target "
        "with it is refused)",
    )
    small_gemm: bool = Field(
        default=True,
        description="CPU float32: products of 1-64 rows (decode steps, verifies, batches) through specserve's "
        "own kernel (models/csrc/small_gemm.cpp, AVX-512F or AVX2 + FMA, detected): each weight row read once for "
        "all rows, and batch-invariant, so a token verified in a step of <= 64 rows gets the products it gets "
        "decoded alone; where it is on, gemv_copies and pad_rows are not needed and not attached "
        "(docs/benchmarks.md, 'Small products')",
    )
    small_gemm_chunks: int = Field(
        default=128,
        ge=0,
        le=MAX_CONTEXT,
        description="with small_gemm: products of 65 up to this many rows (a short prompt prefilled with its drafts "
        "or beside other sequences, verifies of large batches) through the kernel 64 rows at a time, so a row gets "
        "the same bits as decoded alone and greedy speculation equals plain decoding in such forwards too; larger "
        "products run through BLAS (the kernel's chunks cost nothing up to 128 rows on a Zen 3, 1.1x at 192-256 "
        "rows, 1.3x at 512-1024: docs/benchmarks.md, 'Forwards of more than 64 rows'); 0: BLAS past 64 rows",
    )
    small_gemm_packed: bool | None = Field(
        default=None,
        description="with small_gemm: the kernel reads its own copy of each weight laid out as one sequential "
        "stream per block of 4 rows (the same products bit for bit; one more copy of the weights in memory; "
        "docs/benchmarks.md, 'Packed weights for the kernel'): True for products of every row count, False never, "
        "None for the row counts where it measures faster at load on this machine (small_gemm_plan; none: the "
        "copy is dropped; without the plan, every row count)",
    )
    q4_reads: bool = Field(
        default=True,
        description="with small_gemm, from a GGUF whose decoder weights are Q4_1 blocks (the builtin): the kernel "
        "reads each projection's 4-bit blocks and forms its float32 weights in registers by the dequantisation's own "
        "arithmetic, the same products bit for bit from 0.19x the bytes, for the row counts where that measures "
        "faster at load (read before small_gemm_packed's copies, which keep the other counts; docs/benchmarks.md, "
        "'Q4_1 records for the kernel')",
    )
    q8_head_reads: bool = Field(
        default=True,
        description="with small_gemm, from a GGUF whose LM head (or the token embedding it shares) is Q8_0 blocks (the "
        "builtin): the kernel reads those 8-bit blocks and forms the float32 weights by the dequantisation's own "
        "multiply, the same logits bit for bit from 0.28x the bytes, for the row counts where that measures faster "
        "at load; greedy steps of those counts take the exact argmax of those logits instead of bounded_argmax's "
        "copy (docs/benchmarks.md, 'Q8_0 records for the LM head')",
    )
    int8_reads: bool = Field(
        default=False,
        description="with small_gemm and q4_reads, on a CPU with AMX-INT8 (Intel Sapphire Rapids and later), "
        "AVX512-VNNI (Intel Ice Lake and later, AMD Zen 4 and later) or AVX2 and FMA (Intel Haswell and later, AMD "
        "Zen and later): every decoder product reads its Q4_1 blocks with the activations rounded to int8 per row "
        "and group of 32 as llama.cpp's Q4_1 dot products round them, on the AMX tiles where the CPU has them, else "
        "with VNNI, else with AVX2: the same bits on each. A different arithmetic from the float32 products (relative "
        "error ~6e-3 a product), batch-invariant like them, so greedy speculation stays equal to plain decoding under "
        "it; a tile multiplies up to 16 rows for about the price of one, VNNI a row for a quarter of the float32 FMAs' "
        "instructions, AVX2 for about half (docs/benchmarks.md, 'AMX-INT8 products over the Q4_1 blocks', 'AVX512-VNNI "
        "products over the same records', 'AVX2 products over the same records'). Without any the float32 products "
        "serve (a logged reason)",
    )
    small_gemm_plan: bool = Field(
        default=True,
        description="with small_gemm: at load, time the kernel's variants (weight layout, prefetch into L1 or L2) "
        "over the model's own weights at 1-16 rows and run each row count with the fastest, a variant other than "
        "the built-in one only where it wins by 3% (the same bits either way; 2-5 s on the first load on a machine, "
        "then kept in the cache's profiles/; docs/benchmarks.md, 'The kernel's plan, measured at load'); off: packed "
        "copies per small_gemm_packed and the built-in prefetch (none for one row, L1 for more)",
    )
    gemv_copies: bool = Field(
        default=True,
        description="CPU: transposed weight copies for the 1-3 row products where they measure faster on this "
        "machine at load (up to 2x weights)",
    )
    pad_rows: bool = Field(
        default=True,
        description="CPU: products of 10-15 rows (verifies, batches) padded with zero rows to 16 where that measures "
        "faster at load (MKL's 16-row kernel; docs/benchmarks.md, 'Row padding to 16')",
    )
    mkl_packed_widths: tuple[int, ...] = Field(
        default=(),
        description="CPU float32: weight copies in MKL's packed layout for these row counts: the first width "
        "serves exactly its rows, each later width w the rows above the previous one, zero-padded to w (2-5x "
        "the weights per width; e.g. (4, 16): 4 rows, and 5-16 rows, packed); rows the small_gemm kernel serves "
        "(1-64, and its chunks up to small_gemm_chunks) take the kernel instead and get no copy",
    )
    native_stack: bool = Field(
        default=True,
        description="CPU: the decoder layers run from C++ (the Python loop's matmuls and attention; RMSNorm with its "
        "residual add and RoPE with the KV write as single passes: the same values up to float rounding), built "
        "once per machine with the local compiler; the Python loop where it cannot be built or with int8_dynamic "
        "(docs/benchmarks.md, 'Decoder layers from C++')",
    )
    native_attention: bool = Field(
        default=True,
        description="CPU float32: attention of the new tokens reads the KV cache in place through csrc/attention.cpp "
        "(one task per token and KV head, grouped query heads together; batch-invariant) instead of SDPA over a "
        "padded, gathered batch; where the CPU has AVX2 + FMA and the head dim is 64 or 128 (docs/benchmarks.md, "
        "'Attention from C++')",
    )
    bounded_argmax: bool = Field(
        default=True,
        description="CPU float32: a greedy step of at most 8 rows takes its tokens from a bfloat16 copy of the LM "
        "head (half the bytes) and recomputes in float32 only the tokens whose rounding bound reaches the best: the "
        "full logits' argmax exactly, for ~56 MB more memory (specserve/models/lm_head.py; docs/benchmarks.md, "
        "'Greedy tokens from a bfloat16 LM head'); with small_gemm_plan only for the row counts where it measures "
        "faster than the head's own logits at load, and not kept where it wins none",
    )
    revision: str | None = None

    @model_validator(mode="after")
    def _native_q4_settings(self) -> ModelSpec:
        if self.q4_dense_from is not None and not self.native_q4:
            raise ValueError("q4_dense_from applies to native_q4 weights")
        if self.native_q4 and self.resolved_kind() not in (SourceKind.builtin, SourceKind.gguf):
            raise ValueError("native_q4 reads a GGUF's blocks: its source is a builtin model or a .gguf file")
        if self.native_q4 and (self.dtype != DType.float32 or self.int8_dynamic):
            raise ValueError("native_q4 serves float32 weights beside its blocks, without int8_dynamic")
        if self.int8_dynamic and self.dtype != DType.float32:
            raise ValueError("int8_dynamic quantises float32 weights: leave dtype float32")
        if any(w < 1 for w in self.mkl_packed_widths):
            raise ValueError(f"mkl_packed_widths are row counts (>= 1), got {list(self.mkl_packed_widths)}")
        return self

    def resolved_kind(self) -> SourceKind:
        if self.kind is not None:
            return self.kind
        from specserve.models.builtin import BUILTIN_MODELS

        if self.source in BUILTIN_MODELS:
            return SourceKind.builtin
        path = local_path(self.source)
        if path.is_dir():  # (before the suffix: a checkpoint directory may be named like a GGUF file)
            return SourceKind.hf_dir
        if self.source.endswith(".gguf"):
            return SourceKind.gguf
        if self.source.count("/") == 1 and not self.source.startswith((".", "/", "~")):
            return SourceKind.hub
        return SourceKind.hf_dir  # a path that does not exist: loading reports it clearly


NAME_MAX = 255  # bytes in one part of a path on Linux's filesystems


def local_path(text: str | Path) -> Path:
    """``text`` as a path on this machine, ``~`` expanded; a ModelSourceError where it can name no file (a ``~user``
    of no user, a part longer than NAME_MAX): Path.expanduser and Path.is_dir raise for those."""
    try:
        path = Path(text).expanduser()
    except RuntimeError as e:
        raise ModelSourceError(f"{str(text)[:200]!r}: {e}") from None
    if long := next((part for part in path.parts if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX), None):
        raise ModelSourceError(
            f"{str(text)[:80]!r}...: its part {long[:40]!r}... is longer than {NAME_MAX} bytes, which no file's name is"
        )
    return path


BUILTIN_HEADS_DIR = Path(__file__).parent / "heads"  # heads shipped with the package: heads/<name>/


class HeadQuant(str, Enum):
    none = "none"  # the head's weights as loaded (the shipped heads' bf16 values, read as bf16 with bf16_reads)
    q8_0 = "q8_0"  # quantised at load to Q8_0 blocks the kernel reads (8-bit values, a float16 scale per 32)
    q4_1 = "q4_1"  # ... to Q4_1 blocks (4-bit values, a float16 scale and minimum per 32)


class HeadSpec(Validated):
    """An EAGLE draft head for the target: a directory (config.json + weights, either published layout) or the
    name of a head shipped in ``specserve/heads/``. It shares the target's embedding (and EAGLE-1/2 LM head)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    head: str = Field(default="smollm2-eagle3", min_length=1)
    dtype: DType = DType.float32  # compute dtype (the shipped weights are bf16)
    draft_vocab: int | None = Field(
        default=None, ge=2, description="EAGLE-1/2: keep the N most frequent ids of the head's vocab_map.json"
    )
    bf16_reads: bool = True  # switch: the kernel reads weights that bf16 holds exactly (shipped bf16) as bf16
    native_layer: bool = True  # switch: with the target's C++ stack, the head's layer runs from it too
    quantize: HeadQuant = Field(
        default=HeadQuant.q8_0,  # the shipped head on an AVX-512 Xeon: the same tau, 0.3-0.4 ms less drafting a step
        # (docs/benchmarks.md, "The head's weights as Q8_0 records"); Q4_1 saved more but lost 2.4% of tau
        description="switch: the head's linears quantised at load and read by the kernel as Q8_0 / Q4_1 records "
        "(fewer bytes a draft forward; drafts only, so verification stays lossless; docs/algorithms.md §8.3)",
    )

    int8_products: bool = Field(
        default=False,
        description="switch: the quantised linears multiply their blocks with the activations rounded to int8 per "
        "row and group of 32 where the CPU runs the int8 kernel (Q8_0: AVX512-VNNI or AVX2; Q4_1: those or AMX), float "
        "elsewhere; drafts only (docs/algorithms.md §8.3)",
    )

    def path(self) -> Path:
        return BUILTIN_HEADS_DIR / self.head if self.shipped else local_path(self.head)

    @property
    def shipped(self) -> bool:
        """``head`` names a head shipped in ``specserve/heads/``."""
        if "/" in self.head or self.head in ("", ".", ".."):
            return False
        try:
            return (BUILTIN_HEADS_DIR / self.head).is_dir()
        except OSError:  # a name too long for a path (Path.is_dir raises for that): no shipped head's
            return False


_HEAD_ONLY = frozenset(HeadSpec.model_fields) - frozenset(ModelSpec.model_fields)
_MODEL_ONLY = frozenset(ModelSpec.model_fields) - frozenset(HeadSpec.model_fields)


def _draft_kind(value: Any) -> str | None:
    """'head' or 'model' by the fields given; None (refused) where only fields both have are given: ``{dtype:
    bfloat16}`` had silently become the default head in bf16, not a bf16 copy of the default model."""
    if isinstance(value, HeadSpec | ModelSpec):
        return "head" if isinstance(value, HeadSpec) else "model"
    if not isinstance(value, dict):
        return None
    if _HEAD_ONLY & value.keys():
        return "head"
    return "model" if _MODEL_ONLY & value.keys() else None


DraftSpec = Annotated[  # a draft head, or a draft model (a smaller model or a quantised copy)
    Annotated[HeadSpec, Tag("head")] | Annotated[ModelSpec, Tag("model")],
    Discriminator(
        _draft_kind,
        custom_error_type="draft_kind",
        custom_error_message="a draft names its `head` (an EAGLE head) or its `source` (a draft model)",
    ),
]


class SpecMethod(str, Enum):
    none = "none"  # plain decoding
    chain = "chain"  # a chain of SL drafted tokens
    eagle2 = "eagle2"  # EAGLE-2 dynamic tree, fixed depth
    ddd = "ddd"  # EAGLE-2 tree with DDD dynamic depth


class ChainDraft(str, Enum):
    greedy = "greedy"  # draft takes argmax q; verified by docs/algorithms.md §1.2
    keyed = "keyed"  # draft takes its own keyed draw (the target's noise at that position); §1.2 and §1.4
    sampled = "sampled"  # draft samples from its top-K truncated q; verified by docs/algorithms.md §1.1


class Drafter(str, Enum):
    model = "model"  # the loaded draft model or EAGLE head
    lookup = "lookup"  # prompt lookup: n-gram matches in the request's own tokens (docs/algorithms.md §10.1)
    suffix = "suffix"  # suffix trees over the request's tokens and recent outputs (docs/algorithms.md §10.2)


class ModelFreeConfig(Validated):
    """Model-free drafting (docs/algorithms.md §10). Defaults: prompt lookup as vLLM's n-gram drafter runs it
    (match 4 down to 2 tokens), suffix decoding's minimum token probability 0.1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ngram_max: int = Field(default=4, ge=1, le=32, description="longest suffix of the tokens to match")
    ngram_min: int = Field(default=2, ge=1, le=32, description="shortest match that may propose")
    max_matches: int = Field(default=8, ge=1, le=256, description="lookup: most recent matches merged into a tree")
    min_score: float = Field(
        default=0.1, ge=0.0, le=1.0, description="drop nodes whose path score (shares or measured) is below this"
    )
    suffix_depth: int = Field(default=24, ge=2, le=128, description="suffix trie depth: match + continuation")
    alpha: float = Field(default=1.0, gt=0.0, description="DSDE's empirical q: count / (total + alpha)")
    calibrated: bool = Field(
        default=True,
        description="switch: score a node by how often nodes like it (match length, the parent's total, its share: the "
        "only continuation, the larger or a smaller of several; depth) were accepted, as measured, not by its count "
        "share (docs/algorithms.md §10.6)",
    )

    @model_validator(mode="after")
    def _ranges(self) -> ModelFreeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} > ngram_max {self.ngram_max}")
        if self.ngram_max >= self.suffix_depth:
            raise ValueError(f"ngram_max {self.ngram_max} leaves no continuation in a depth-{self.suffix_depth} trie")
        return self


class SLPolicyKind(str, Enum):
    static = "static"  # chain length `sl` / tree depth every step
    dsde = "dsde"  # per-sequence SL from KLD stability, under the batch cap SL_cap (docs/algorithms.md §4, §5)


class KLDMode(str, Enum):
    exact = "exact"  # dense draft distribution: draft and target share a process
    sparse = "sparse"  # top-K of q plus the leftover mass (what crosses actors)


class SpecConfig(Validated):
    """Speculation settings (docs/algorithms.md §1 to §5). Defaults follow the papers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: SpecMethod = SpecMethod.chain
    drafter: Drafter = Drafter.model
    model_fallback: bool = Field(
        default=True, description="model-free drafters: the draft model drafts where they find no match (if loaded)"
    )
    model_free: ModelFreeConfig = ModelFreeConfig()
    policy: SLPolicyKind = SLPolicyKind.static
    dsde: DSDEConfig = DSDEConfig()
    max_sl: int | None = Field(default=None, ge=1, le=64, description="per-request ceiling on SL / depth")
    model_max_sl: int | None = Field(
        default=None, ge=1, le=64, description="ceiling on the draft model's SL / depth (model-free drafts: max_sl)"
    )
    model_budget: int | None = Field(
        default=None, ge=2, le=1024, description="ceiling on the draft model's tree budget T (model-free trees: budget)"
    )
    kld_mode: KLDMode = KLDMode.sparse
    kld_tail: SparseTail = SparseTail.lumped  # the paper spreads the tail uniformly: biased, docs/algorithms.md §4.1
    kld_top_k: int = Field(default=256, ge=1, description="K of the draft distribution shipped for the KLD signal")
    synthetic_accept: float | None = Field(
        default=None,
        gt=0.0,
        lt=1.0,
        description="SYNTHETIC benchmark mode, never a default: accept each drafted token with this probability",
    )
    sl: int = Field(default=4, ge=1, le=64, description="chain length (a DSDE plan overrides it)")
    tree_depth: int = Field(default=6, ge=1, le=64, description="EAGLE-2 fixed depth D")
    chain_draft: ChainDraft = ChainDraft.keyed  # for temperature > 0; greedy requests draft greedily
    q_top_k: int = Field(default=64, ge=1, description="K of the shipped sparse draft distribution")
    beam_width: int = Field(default=10, ge=1, le=64, description="EAGLE-2 w (top_k)")
    budget: int = Field(default=60, ge=2, le=1024, description="EAGLE-2 T: verified nodes incl. the root")
    ddd_max_depth: int = Field(default=11, ge=1, le=64, description="DDD n")
    ddd_check_steps: tuple[int, ...] = Field(
        default=(5, 7, 9), description="DDD S: the draft forwards after which H is read (increasing, >= 1)"
    )
    ddd_threshold: float = Field(default=-0.3, le=0.0, description="DDD x: stop when H_d < x at a check step")
    ddd_check_every_step: bool = False  # read H on the host after every level (for comparison)
    tree_min_prob: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="trees: verify only drafted nodes whose path draft probability (a model-free drafter's path "
        "score) is at least this (0: the budget T alone sizes the tree; docs/algorithms.md §2.3, §10.6)",
    )
    adaptive_floor: bool = Field(
        default=False,
        description="trees: set the floor each step to the loop's measured seconds per verify row times its "
        "tokens per second (tree_min_prob until both are measured; docs/algorithms.md §2.3, §10.6)",
    )
    floor_beam: bool = Field(
        default=True,
        description="EAGLE-2 / DDD with a floor (tree_min_prob, adaptive_floor): forward only the beam nodes at or "
        "above it, the only ones whose subtrees can enter the tree (docs/algorithms.md §2.3)",
    )
    catch_up_window: int = Field(
        default=64,  # the shipped head's acceptance on MT-bench with 64: +0.1% to +1.8% of 2048's, with 32 -3% to
        # -6%, with 16 -3% to -20% (docs/benchmarks.md, "A bounded catch-up for the draft head")
        ge=1,
        le=1 << 20,
        description="a draft head reads at most this many of a sequence's newest target features at once (a prompt, "
        "the tokens of plain steps the guard ran): older positions drop out of its context, so a switch to "
        "speculation costs at most this many head rows a sequence (docs/algorithms.md §8.3)",
    )
    ddd_count_first_forward: bool = Field(
        default=True,
        description="check step d = the d-th draft forward, the first (the root's) included; False: count the "
        "forwards after it, as EAGLE-2's depth loop does (every check then happens one level deeper)",
    )

    @model_validator(mode="after")
    def _check_steps_increasing(self) -> SpecConfig:
        steps = self.ddd_check_steps
        if not steps or min(steps) < 1 or list(steps) != sorted(set(steps)):
            raise ValueError(f"ddd_check_steps must be increasing draft forwards >= 1, got {list(steps)}")
        return self

    @property
    def static_depth(self) -> int:
        """Levels drafted per step under the static policy (0 = no speculation). A tree verified with budget T keeps
        T - 1 nodes closed under ancestors, so no node deeper than T - 1 can be kept: deeper levels are not drafted."""
        return {
            SpecMethod.none: 0,
            SpecMethod.chain: self.sl,
            SpecMethod.eagle2: min(self.tree_depth, self.budget - 1),
            SpecMethod.ddd: min(self.ddd_max_depth, self.budget - 1),
        }[self.method]

    @property
    def model_tree_budget(self) -> int:
        """The verify budget T of the draft model's trees (``model_budget`` caps it below ``budget``)."""
        return self.budget if self.model_budget is None else min(self.budget, self.model_budget)

    @property
    def max_tree_nodes(self) -> int:
        """Drafted nodes a tree may hold: ``budget - 1``, or the draft model's own cap where only it drafts (a
        model-free drafter may fill the whole budget)."""
        return (self.model_tree_budget if self.needs_model else self.budget) - 1

    def model_depth(self, depth: int) -> int:
        """The draft model's share of a planned depth: ``model_max_sl`` caps it, and a tree's needs no level past its
        budget's T - 1 (see ``static_depth``)."""
        if self.is_tree:
            depth = min(depth, self.model_tree_budget - 1)
        return depth if self.model_max_sl is None else min(depth, self.model_max_sl)

    @property
    def needs_model(self) -> bool:
        """Whether only the draft model (or head) can draft for this request."""
        return self.method != SpecMethod.none and self.drafter == Drafter.model

    @property
    def uses_model(self) -> bool:
        """Whether the draft model (or head) may draft for this request."""
        return self.method != SpecMethod.none and (self.drafter == Drafter.model or self.model_fallback)

    @property
    def is_tree(self) -> bool:
        return self.method in (SpecMethod.eagle2, SpecMethod.ddd)

    @property
    def batch_dependent_draws(self) -> bool:
        """Whether a sampled request's text can depend on what runs beside it: the draft model's sampled chains
        (docs/algorithms.md §1.1) use up one uniform per drafted token, and the batch sets how many are drafted."""
        return self.method == SpecMethod.chain and self.chain_draft == ChainDraft.sampled and self.uses_model

    @property
    def free_tree_priced(self) -> bool:
        """A model-free drafter's trees whose every node is kept only where its measured acceptance clears a floor
        (``min_score``, ``tree_min_prob`` or the measured one): no SL policy sets their depth, only their static depth
        (docs/algorithms.md §10.6)."""
        floor = self.model_free.min_score > 0 or self.tree_min_prob > 0 or self.adaptive_floor
        return self.drafter != Drafter.model and self.is_tree and self.model_free.calibrated and floor

    @property
    def max_draft_rows(self) -> int:
        """Rows one step's drafting appends to the draft's KV past a sequence's committed tokens: a tree's beam (w
        rows) at each level after the root's, a chain's drafted tokens but its last."""
        if not self.uses_model:
            return 0
        if self.is_tree:
            return (self.model_depth(self.static_depth) - 1) * self.beam_width
        return self.max_verify_tokens - 2

    def fit_draft_rows(self, rows: int) -> SpecConfig:
        """This config, its draft model's trees made shallow enough (``model_max_sl``) that a step's drafting
        appends at most ``rows`` rows past the committed tokens (a KV slot's room beyond ``max_model_len``)."""
        if self.max_draft_rows <= rows or not self.is_tree:
            return self
        return self.model_copy(update={"model_max_sl": max(1, 1 + rows // self.beam_width)})

    @property
    def max_verify_tokens(self) -> int:
        """Tokens one verification appends at most: the root plus the drafted nodes."""
        if self.is_tree:
            return self.budget
        if self.method == SpecMethod.none:
            return 1
        sl = self.dsde.sl_hard_max if self.policy == SLPolicyKind.dsde else self.sl
        return (sl if self.max_sl is None else min(sl, self.max_sl)) + 1


FREEZE_GC_HELP = (
    "once the models are loaded, exempt every live object from Python's cyclic collector (a process-wide step: "
    "full collections then walk only what serving allocates; specserve/heap.py)"
)


class LoopConfig(Validated):
    """How one continuous-batching loop runs: the in-process ``EngineConfig`` and the Serve app's ``AppArgs``
    both extend it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    speculation: SpecConfig = SpecConfig(method=SpecMethod.none)
    max_batch_size: int = Field(default=16, ge=1, le=MAX_BATCH_SIZE)
    max_model_len: int = Field(default=2048, ge=16, le=MAX_CONTEXT)
    spec_headroom: int = Field(default=64, ge=1, le=1024, description="KV room for one step's drafted tokens")
    max_step_tokens: int | None = Field(
        default=None, ge=1, description="guard: cap on drafted tokens + batch size verified per step (None = off)"
    )
    throughput_guard: bool = Field(
        default=False, description="speculate only at batch sizes where it measured faster than plain decoding"
    )
    guard: GuardConfig = Field(
        default=GuardConfig(), description="the throughput guard's settings (used where throughput_guard is on)"
    )
    suffix_cache_tokens: int = Field(
        default=16384, ge=0, le=1 << 22, description="suffix drafter: recent outputs kept per replica (0 = none)"
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="CUDA: the fraction of the device the worker may fill; KV slots (<= max_batch_size) are sized "
        "from the memory free after loading (specserve/limits.py device_kv_slots). None: max_batch_size slots",
    )


def _verifiable(spec: ModelSpec) -> ModelSpec:
    if spec.int8_dynamic:
        raise ValueError(
            "int8_dynamic is for drafts: its activations share one scale per product, so a target's logits would "
            "depend on the rows verified with them (other requests', the draft's) and speculation would not give "
            "plain decoding's tokens"
        )
    if spec.q4_dense_from is not None:
        raise ValueError(
            "q4_dense_from is for drafts: products of that many rows switch to other weights, so a target's logits "
            "would depend on how many rows were verified with them and speculation would not give plain decoding's "
            "tokens"
        )
    return spec


TargetSpec = Annotated[ModelSpec, AfterValidator(_verifiable)]  # a model that verifies


def cpu_kernel(spec: object) -> str | None:
    """The CPU-only kernel a model spec runs (``native_q4``, ``int8_dynamic``; None: it runs on any device)."""
    if not isinstance(spec, ModelSpec):
        return None
    return "native_q4" if spec.native_q4 else "int8_dynamic" if spec.int8_dynamic else None


class EngineConfig(LoopConfig):
    """An in-process engine: which models, on which device, and its loop settings."""

    target: TargetSpec = ModelSpec()
    draft: DraftSpec | None = None
    device: str = Field(default="cpu", description="cpu, or a CUDA device this machine has (cuda, cuda:1)")
    freeze_gc: bool = Field(default=False, description=FREEZE_GC_HELP + "; `specserve generate` turns it on")

    @field_validator("device")
    @classmethod
    def _present_device(cls, value: str) -> str:
        problem = device_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _draft_for_speculation(self) -> EngineConfig:
        if self.speculation.needs_model and self.draft is None:
            raise ValueError(f"speculation {self.speculation.method.value!r} needs a draft model")
        return self

    @model_validator(mode="after")
    def _cpu_kernels_on_the_cpu(self) -> EngineConfig:
        """native_q4 and int8_dynamic run CPU kernels: on another device the load would fail, after the target's."""
        if torch.device(self.device).type == "cpu":  # (any spelling: "cpu:0")
            return self
        for role, spec in (("target", self.target), ("draft", self.draft)):
            if (kernel := cpu_kernel(spec)) is not None:
                raise ValueError(f"a {kernel} {role} runs on the CPU, not on {self.device}")
        return self


def derived_draft(target: ModelSpec, kind: str) -> ModelSpec:
    """A draft derived from the target: 'bf16', 'fp16' (lower-precision copies), 'int8' (dynamic int8) or 'q4' (the
    GGUF's packed Q4_1 weights, ``native_q4``)."""
    variants: dict[str, dict[str, Any]] = {
        "bf16": {"dtype": DType.bfloat16},
        "fp16": {"dtype": DType.float16},
        "int8": {"dtype": DType.float32, "int8_dynamic": True},
        "q4": {"dtype": DType.float32, "native_q4": True, "q4_dense_from": 16},
    }
    if kind not in variants:
        raise ValueError(f"unknown derived draft {kind!r}; choose one of {sorted(variants)}")
    return target.model_copy(update=variants[kind])


MODEL_PAIRS: dict[str, tuple[ModelSpec, DraftSpec]] = {
    # the shipped EAGLE-3 head (fused low/mid/high features, its own 8192-id LM head, lexicon data): accepts best
    "smollm2-eagle": (ModelSpec(), HeadSpec(head="smollm2-eagle3")),
    # the EAGLE-1/2 head on the seed data; the 2048 most frequent ids of its 8192, measured faster than 8192
    "smollm2-eagle1": (ModelSpec(), HeadSpec(head="smollm2-eagle1", draft_vocab=2048)),
    "smollm2-int8": (ModelSpec(), derived_draft(ModelSpec(), "int8")),
    "smollm2-bf16": (ModelSpec(), derived_draft(ModelSpec(), "bf16")),
    "smollm2-fp16": (ModelSpec(), derived_draft(ModelSpec(), "fp16")),
    # the target's own Q4_1 blocks (it is their float32 dequantisation) through the int4 CPU kernel: CPU only
    "smollm2-q4": (ModelSpec(), derived_draft(ModelSpec(), "q4")),
}

# What `serve run deployments/app.yaml` and `specserve generate` speculate with, on a CPU and a GPU alike: the shipped
# EAGLE-3 head. The 4-bit copy was the CPU's default until the target itself read the same Q4_1 records; its draft
# then cost a target step: at batch 1 its chains of one ran 0.71-0.73x plain and its guarded default 0.89-0.97x,
# where the head's guarded default ran 1.01-1.07x (docs/benchmarks.md, "Model-free drafts in front of the head" and
# "The EAGLE head as the deployment's default pair").
DEFAULT_PAIR = "smollm2-eagle"


# The serving default of a pair measured no better (the 4-bit copy, a head directory): chains, each sequence's SL set
# by DSDE under SL_cap (docs/benchmarks.md, "A 4-bit copy of the target as the draft"), behind the throughput guard,
# which keeps plain decoding at batch sizes where speculation measures slower.
SERVING_SPECULATION = SpecConfig(method=SpecMethod.chain, policy=SLPolicyKind.dsde)
# Pairs whose fastest lossless mode measured here is another; `deployments/app.yaml` states the default pair's (a
# test checks it) and `specserve generate` uses it. The SmolLM2 EAGLE-3 head's trees pay for a second
# level only where the head is sure of its first (its root's top-10 mass above e^-0.03 = 97%), not for the 5 levels
# DDD's paper check steps draft (docs/benchmarks.md, "Tree shape" and "DDD's first check at the root's forward";
# `specserve generate`), and each tree keeps only the nodes whose path probability under the head pays for their
# verify rows: the seconds a row adds times the tokens a second the loop makes, both measured as it runs, 6% until
# they are (docs/benchmarks.md, "Trees sized by the head's confidence" and "The tree floor measured as the loop
# runs"). Prompt lookup drafts first, its nodes scored by their measured acceptance and pruned by the same floor, and
# the head drafts where it finds nothing worth a row: 1.17-1.38x plain against the head's 1.04-1.13x over 256 tokens
# at batch 1 (docs/benchmarks.md, "Model-free drafts in front of the head"). DSDE sets the head's depth budget per
# sequence and SL_cap bounds the batch's stragglers (the lookup trees, priced node by node, take no depth from it):
# 1.18x plain at batch 1 beside 1.22x for the same trees without DSDE's signal, which costs ~0.3 ms a step
# (docs/benchmarks.md, "The EAGLE head as the deployment's default pair").
PAIR_SPECULATION: dict[str, SpecConfig] = {
    "smollm2-eagle": SpecConfig(
        method=SpecMethod.ddd,
        drafter=Drafter.lookup,
        budget=8,
        model_budget=6,
        ddd_check_steps=(1, 2, 3),
        ddd_threshold=-0.03,
        tree_min_prob=0.06,
        adaptive_floor=True,
        policy=SLPolicyKind.dsde,
    ),
}


# On a GPU a verify row costs little next to the launches of a step (the H200's fp32 SmolLM2 step is ~12 ms of them),
# so larger trees pay: DDD T = 32 with checks (2, 3, 4) measured 1.25x plain at batch 1 there, the CPU shape above
# 1.07x (docs/benchmarks.md, "GPU").
PAIR_SPECULATION_CUDA: dict[str, SpecConfig] = {
    "smollm2-eagle": SpecConfig(method=SpecMethod.ddd, budget=32, ddd_check_steps=(2, 3, 4), ddd_threshold=-0.03),
}


def serving_speculation(pair: str | None, device: str | torch.device = "cpu") -> SpecConfig:
    """What a pair speculates with by default on this device (``SERVING_SPECULATION`` unless measured otherwise)."""
    table = PAIR_SPECULATION_CUDA if torch.device(device).type == "cuda" else PAIR_SPECULATION
    return table.get(pair or "", PAIR_SPECULATION.get(pair or "", SERVING_SPECULATION))


SERVING_THROUGHPUT_GUARD = True
# At batch 16 DSDE's ~12-token chains make each step draft ~12 levels for every row; a 64-token step budget
# keeps SL ~3 there (1.38x plain in steady state) and does not bind at batch 1-4 (docs/benchmarks.md). The default
# pair's trees may verify 8 rows each, so on a CPU it binds from batch 9. The GPU's trees (T = 32) verify up to 32
# rows each, so there it lets one row a step draft from batch 3: the GPU sweeps were measured so (docs/benchmarks.md,
# "A third GPU lease"); a budget sized for a GPU has not been measured.
SERVING_MAX_STEP_TOKENS = 64
