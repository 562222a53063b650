"""Sampling parameters and logits processing (temperature, min-p, top-k, top-p), shared by drafts and targets; the
target's logit bias."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from specserve.structured import OutputFormat
from specserve.validated import Validated

MAX_CONTEXT = 1_048_576  # the longest context (EngineConfig.max_model_len) anything is sized for
MAX_BATCH_SIZE = 1024  # sequences one loop runs at once (LoopConfig.max_batch_size)
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias
MAX_LOGPROBS = 20  # likeliest alternatives a request may ask for per output token (vLLM's default max_logprobs)
LOGIT_BIAS_BOUND = 100.0  # OpenAI's: each bias is in [-100, 100]


class SamplingParams(Validated):
    """Per-request sampling. temperature 0 = greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_k: int | None = Field(
        default=None, ge=1, description="keep the k most likely tokens (and any tied with the k-th); None = off"
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(
        default=0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p times the most likely; 0 = off"
    )
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, description="any 64-bit signed integer")
    max_tokens: int = Field(default=128, ge=1, le=MAX_CONTEXT)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = Field(
        default=frozenset(),
        max_length=MAX_STOP_TOKEN_IDS,
        description="tokens that end generation when generated, with ignore_eos too (an EOS id without it stays "
        "EOS, left out); as vLLM's, the one that ends it is in the output's ids, and in its text only with "
        "include_stop_str_in_output; as the last token max_tokens allows, it ends with length",
    )
    include_stop_str_in_output: bool = Field(
        default=False, description="the text keeps the stop string, or stop token's text, that ended it (vLLM's)"
    )
    logit_bias: tuple[tuple[int, float], ...] = Field(
        default=(),
        max_length=MAX_LOGIT_BIAS,
        description="given as a mapping token id -> a value in [-100, 100] added to its logit before any other "
        "processing (OpenAI's), kept as (id, bias) pairs in id order without the zeros; the target applies it, "
        "drafts do not (verification keeps the output the target's)",
    )

    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each output token's log-probability under the target and this many likeliest tokens' (None: "
        "none); of the target's own distribution, before the logit bias, temperature or any cut (vLLM's default)",
    )

    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="as logprobs, for the prompt's tokens after its first (vLLM's), with the first output",
    )
    min_tokens: int = Field(
        default=0,
        ge=0,
        le=MAX_CONTEXT,
        description="output tokens before EOS (unless ignore_eos) or a stop token id may be drawn: the target draws "
        "without them until then, and a stop string completed by one of the first min_tokens tokens does not stop "
        "it (vLLM's); at most max_tokens",
    )

    output_format: OutputFormat | None = Field(
        default=None,
        description="the form the answer must take (structured output): the target draws only the tokens its "
        "grammar allows after the answer so far, so the answer ends (with EOS) only where the grammar is satisfied",
    )

    @field_validator("output_format")
    @classmethod
    def _format_can_end(cls, v: OutputFormat | None, info: ValidationInfo) -> OutputFormat | None:
        # (declared last: the others were validated before it)
        if v is not None and info.data.get("ignore_eos"):
            raise ValueError("a structured answer ends where its grammar is satisfied: not with ignore_eos")
        if v is not None and info.data.get("min_tokens"):
            raise ValueError("a structured answer's length is its grammar's: not with min_tokens")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens_fit(cls, v: int, info: ValidationInfo) -> int:
        # (declared after max_tokens and stop: validated after them; an invalid one has its own error)
        if v and "max_tokens" in info.data and v > info.data["max_tokens"]:
            raise ValueError(f"min_tokens ({v}) must be at most max_tokens ({info.data['max_tokens']})")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if isinstance(v, str):
            return (v,)
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _token_ids(cls, v: object) -> object:
        if isinstance(v, str | bytes) or not isinstance(v, Iterable):
            raise ValueError(f"a collection of token ids, not {type(v).__name__}")
        items = list(v)
        if any(isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer) or t < 0 for t in items):
            raise ValueError("token ids are non-negative integers")
        return frozenset(int(t) for t in items)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_entries(cls, v: object) -> object:
        """A mapping (or the pairs a validated one keeps) as sorted pairs: immutable and hashable, as the params
        are (a dict would be shared with, and could be changed under, the request it was checked for)."""
        # (pairs also as lists of two: the params' own JSON, model_dump_json, writes them so)
        items = list(v.items()) if isinstance(v, Mapping) else v if isinstance(v, tuple | list) else None
        if items is None:
            raise ValueError(f"a mapping of token ids to biases, not {type(v).__name__}")
        if len(items) > MAX_LOGIT_BIAS:  # (before its entries: one error for the map, not one per entry)
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, not {len(items)}")
        pairs: dict[int, float] = {}
        for entry in items:
            if not isinstance(entry, tuple | list) or len(entry) != 2:
                raise ValueError(f"(token id, bias) pairs, not {entry!r:.40}")
            t, b = entry
            if isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer) or t < 0:
                raise ValueError(f"token ids are non-negative integers, not {t!r:.40}")
            if isinstance(b, bool | np.bool_) or not isinstance(b, int | float | np.integer | np.floating):
                raise ValueError(f"a bias is a number, not {b!r:.40}")
            if not -LOGIT_BIAS_BOUND <= b <= LOGIT_BIAS_BOUND:  # (nan fails too; compared exactly, not as a float)
                raise ValueError(f"a bias is in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], not {b!r:.40}")
            pairs[int(t)] = float(b)
        return tuple(sorted((t, b) for t, b in pairs.items() if b != 0.0))  # (a bias of 0 changes nothing)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def banned_before(self, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
        """The tokens not drawn before ``min_tokens`` output tokens: EOS (unless ignore_eos) and the stop ids."""
        if not self.min_tokens:
            return ()
        return tuple(sorted(self.stop_token_ids | (set() if self.ignore_eos else set(eos_token_ids))))

    @property
    def raw_argmax(self) -> bool:
        """Greedy without a logit bias or a grammar: the tokens are the argmaxes of the target's logits as
        computed."""
        return self.greedy and not self.logit_bias and self.output_format is None

    def seeded(self) -> SamplingParams:
        """These params with a seed: sampled requests draw by (seed, position) (docs/algorithms.md §1.4), so one
        without a seed gets a random one (greedy ones need none)."""
        if self.greedy or self.seed is not None:
            return self
        return self.model_copy(update={"seed": secrets.randbits(63)})


def allowed_only(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [T, V] and bit rows [T, W] int32 (bit j of word w: token 32 w + j may be drawn; tokens past 32 W
    may not: ids the tokenizer never names) -> logits [T, V] with every other token at -inf (out of place): a
    grammar's tokens, which sampling renormalises over."""
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)  # (unpacked where the logits are: |V| / 8 bytes a row)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()  # [T, min(V, 32 W)]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))  # [T, V] (False past them)
    return logits.masked_fill(~allowed, float("-inf"))


def greedy_draw(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] long: each row's argmax, or V (out of range, for the caller to reject as a row without
    mass) where the row's maximum is not finite. NaN logits would otherwise draw the first NaN's token (token 0
    for a row of NaN) and +inf ones a token no distribution gives; a sampled row with either has no mass too."""
    top, best = logits.max(-1)  # [N] each; the first maximum's index, as argmax (a NaN counts as the maximum)
    return torch.where(torch.isfinite(top), best, logits.shape[-1])


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> float32 [N, V] with the request's logit bias added (a new tensor; the same one without a
    bias). Only the target applies it: a draft's columns need not be target ids, and verification against the biased
    target keeps the output the biased target's whatever the draft proposed."""
    if not params.logit_bias:
        return logits.float()
    ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long).to(logits.device, non_blocking=True)  # [B]
    bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32).to(logits.device, non_blocking=True)
    return logits.float().index_add(-1, ids, bias.expand(logits.shape[0], -1))


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] float32 after temperature, min-p, top-k and top-p (vLLM's order).

    Greedy (temperature 0) returns the one-hot of the argmax, so greedy and sampling share one code path
    in verification (a point mass is accepted exactly when it is the argmax); a row without a finite maximum is
    all zeros (``greedy_draw``), a row without mass.
    """
    logits = logits.float()
    if params.greedy:  # a row without a finite maximum draws V, whose one-hot column is cut: a row without mass
        return torch.nn.functional.one_hot(greedy_draw(logits), logits.shape[-1] + 1)[:, :-1].float()
    # shift the maximum to 0 first: at any temperature the scaled logits are <= 0 (tiny temperatures give -inf
    # below the maximum, never inf or nan), so the softmax stays a distribution; a temperature below float32's
    # smallest normal (it could round to 0, and 0 / 0 is nan) divides as that smallest one
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if params.min_p > 0.0:  # p_i / p_max = exp(logit_i) now that the maximum is 0: no softmax needed
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # stable: a cut inside a group of tied logits keeps its lowest ids, the same set at any batch shape or on any
        # device (an unstable sort's pick among ties may differ between plain decoding's rows and a verify's)
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        drop_sorted[..., 0] = False  # and always the most likely token (a top_p that rounds to 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_GENERATOR_KEYS = 0x6E5F_7C1B_2D93_A4E8  # the workers' generators: a key space apart from the keyed draws'


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _as_int64(x: int) -> int:
    """A 64-bit pattern as the signed value an int64 tensor holds (its arithmetic wraps modulo 2**64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix64_stream(keys: torch.Tensor, n: int) -> torch.Tensor:
    """[P, n] int64: outputs 1..n of splitmix64 seeded with each of keys [P] (int64 bit patterns), in place."""
    z = torch.arange(1, n + 1, dtype=torch.int64, device=keys.device).mul_(_as_int64(_GOLDEN)).unsqueeze(0)
    z = z + keys[:, None]  # [P, n]
    shifted = torch.empty_like(z)

    def xor_shift(bits: int) -> None:  # z ^= z >> bits, logical: int64's >> copies the sign bit
        torch.bitwise_right_shift(z, bits, out=shifted)
        z.bitwise_xor_(shifted.bitwise_and_((1 << (64 - bits)) - 1))

    xor_shift(30)
    z.mul_(_as_int64(_MIX1))
    xor_shift(27)
    z.mul_(_as_int64(_MIX2))
    xor_shift(31)
    return z


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of a request's random draw for the token at ``position`` (its index in prompt + output)."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(position))


def keyed_exponentials(seed: int, positions: list[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] float32 Exp(1) noise; row i is a function of (seed, positions[i]) alone, the same stream on every
    device (docs/algorithms.md §1.4). A counter-based stream over all 64 bits of the key: torch's CPU generator
    keeps only a seed's low 32, so two positions of one request would share noise once in ~4e9 pairs of keys.
    Drawn once per distinct position (a tree's nodes at one depth share it)."""
    distinct = sorted(set(positions))
    keys = torch.tensor([_as_int64(position_key(seed, pos)) for pos in distinct], dtype=torch.int64)
    # non_blocking: a blocking upload waits for the device's queue (once per chain a level, per row in verify)
    keys = keys.to(device, non_blocking=True)
    bits = _splitmix64_stream(keys, vocab).bitwise_right_shift_(12).bitwise_and_((1 << 52) - 1)  # [P, V] top 52
    noise = bits.double().add_(0.5).mul_(2.0**-52).log_().neg_().float()  # [P, V]; u in (0, 1) exactly: E > 0
    if len(distinct) == len(positions) and distinct == positions:
        return noise
    index = {pos: i for i, pos in enumerate(distinct)}
    rows = torch.tensor([index[p] for p in positions]).to(noise.device, non_blocking=True)
    return noise[rows]  # [N, V]


def keyed_sample(
    probs: torch.Tensor,  # [N, V'] float, rows with positive mass (need not be normalised)
    seed: int,
    positions: list[int],  # [N] the index in the sequence of the token each row draws
    vocab: int,  # V, the target's vocabulary: the noise is drawn over it
    columns: torch.Tensor | None = None,  # [V'] long, target id of each column of probs (None: V' == V, identity)
) -> torch.Tensor:
    """Exponential-race (Gumbel-max) draw: argmax_v p(v) / E_v with E_v ~ Exp(1) keyed by (seed, position).

    Exactly a sample of p, and the same token for the same (seed, position, p) whatever else runs in the batch:
    a drafter that draws with the same key is coupled to the target (it proposes the target's own draw whenever
    its distribution puts that token first in the race). A row without mass, or with nan in it (non-finite logits),
    gives V' (out of range), as ``inverse_cdf_sample`` does.
    """
    noise = keyed_exponentials(seed, positions, vocab, probs.device)  # [N, V]
    if columns is not None:
        noise = noise[:, columns.to(probs.device)]  # [N, V']
    race = probs.float() / noise  # [N, V']; p = 0 never wins a row with mass
    best = race.argmax(-1)  # [N]
    no_mass = ~(probs.sum(-1) > 0)  # [N]; also a row with nan (a +inf logit is one after the shift: inf - inf)
    return torch.where(no_mass, torch.full_like(best, probs.shape[-1]), best)


def make_generator(
    seed: int | None, device: torch.device | str = "cpu", *, stream: int = 0, position: int = 0
) -> torch.Generator:
    """A generator for one request's ``stream`` (0: the target's draws, 1: the draft's) from ``position`` on (the
    sequence's length when a worker registers it): a sequence registered again later (a new worker, a reset, a move
    to another lane) draws afresh instead of repeating the draws it began with. Any 64-bit seed maps into the range
    torch accepts (on CPU its generator keeps the low 32 bits: two requests' streams coincide once in ~4e9 pairs,
    which keyed draws avoid)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(_splitmix64(position_key(seed, position) ^ _splitmix64(_GENERATOR_KEYS + stream)) % 2**63)
    return gen
