"""Sampling parameters and logits processing (temperature, top-k, top-p), shared by drafts and targets."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """Per-request sampling. temperature 0 = greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_k: int | None = Field(default=None, ge=1, description="keep the k most likely tokens; None = off")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, description="any 64-bit signed integer")
    max_tokens: int = Field(default=128, ge=1, le=1_000_000)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] float32 after temperature, top-k and top-p.

    Greedy (temperature 0) returns the one-hot of the argmax, so greedy and sampling share one code path
    in verification (a point mass is accepted exactly when it is the argmax).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shift the maximum to 0 first: at any temperature the scaled logits are <= 0 (tiny temperatures give -inf
    # below the maximum, never inf or nan), so the softmax stays a distribution
    logits = (logits - logits.max(-1, keepdim=True).values) / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu", *, stream: int = 0) -> torch.Generator:
    """A generator for one request's ``stream`` (0: the target's draws, 1: the draft's); any 64-bit seed maps
    into the range torch accepts."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed((seed + stream) % 2**63)
    return gen
