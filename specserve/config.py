"""Small self-validating configuration objects."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)


class SourceKind(str, Enum):
    builtin = "builtin"  # a name from specserve.models.sources.BUILTIN_MODELS
    hf_dir = "hf_dir"  # local directory with config.json + *.safetensors (+ tokenizer files)
    gguf = "gguf"  # a local .gguf file
    hub = "hub"  # a Hugging Face hub id ("org/name"); needs a reachable hub


class ModelSpec(BaseModel):
    """Where a model comes from and how to run it."""

    model_config = ConfigDict(frozen=True)

    source: str = "smollm2-135m-instruct"
    kind: SourceKind | None = Field(default=None, description="inferred from `source` when not given")
    dtype: DType = DType.float32
    int8_dynamic: bool = Field(default=False, description="dynamic int8 quantisation of the linear layers")
    revision: str | None = None

    def resolved_kind(self) -> SourceKind:
        if self.kind is not None:
            return self.kind
        from specserve.models.sources import BUILTIN_MODELS

        if self.source in BUILTIN_MODELS:
            return SourceKind.builtin
        path = Path(self.source).expanduser()
        if self.source.endswith(".gguf"):
            return SourceKind.gguf
        if path.is_dir():
            return SourceKind.hf_dir
        if self.source.count("/") == 1 and not self.source.startswith((".", "/", "~")):
            return SourceKind.hub
        return SourceKind.hf_dir  # a path that does not exist: loading reports it clearly


class EngineConfig(BaseModel):
    """An in-process engine: which model, on which device, with what batch and context limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: ModelSpec = ModelSpec()
    device: str = "cpu"
    max_batch_size: int = Field(default=16, ge=1, le=1024)
    max_model_len: int = Field(default=2048, ge=16, le=1_048_576)
