"""OpenAI-compatible request and response schemas (completions, chat completions, models, errors).

Extensions beyond OpenAI's API: ``top_k``, ``ignore_eos``, ``return_token_ids`` (as vLLM names them) and
``speculation`` (per-request speculative decoding options); ``usage.speculation`` reports what speculation did.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.config import Drafter, SLPolicyKind, SpecMethod


class SpeculationOptions(BaseModel):
    """Per-request speculation: ``policy`` is the SL policy (``static`` or ``dsde``); ``"none"`` is accepted as
    another way to say ``enabled: false``."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    method: SpecMethod | None = Field(default=None, description="chain, eagle2 (tree) or ddd (tree, dynamic depth)")
    drafter: Drafter | None = Field(
        default=None, description="model (the deployment's draft), lookup (prompt lookup) or suffix (suffix trees)"
    )
    model_fallback: bool | None = Field(
        default=None, description="lookup / suffix: let the draft model draft where they find no match"
    )
    policy: SLPolicyKind | None = None
    max_sl: int | None = Field(default=None, ge=1, le=64, description="caps the chain length / tree depth")

    @model_validator(mode="before")
    @classmethod
    def _policy_none_is_off(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("policy") == "none":
            return {**data, "policy": None, "enabled": False}
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, description="extension: keep the k most likely tokens")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, description="a 64-bit signed integer")
    stop: str | list[str] | None = Field(default=None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    user: str | None = None
    ignore_eos: bool = Field(default=False, description="extension: keep generating past EOS")
    return_token_ids: bool = Field(default=False, description="extension: token ids alongside the text")
    speculation: SpeculationOptions | None = Field(default=None, description="extension: speculative decoding")

    @field_validator("n")
    @classmethod
    def _single_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("presence and frequency penalties are not supported; use 0")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _utf8(text: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can encode: reject them as bad input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode ({e.reason} at position {e.start})") from None
    return text


Utf8Str = Annotated[str, AfterValidator(_utf8)]


class CompletionRequest(GenerationRequest):
    prompt: Utf8Str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None


class ChatRole(str, Enum):
    system = "system"
    developer = "developer"
    user = "user"
    assistant = "assistant"
    tool = "tool"


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Utf8Str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: ChatRole
    content: Utf8Str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, description="OpenAI's newer name of max_tokens")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ----------------------------------------------------------------------------------------


class FinishReasonOut(str, Enum):
    stop = "stop"
    length = "length"


class SpeculationUsage(BaseModel):
    target_forwards: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float = Field(description="tau: tokens emitted per target forward, incl. the bonus")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: SpeculationUsage | None = Field(default=None, description="extension: speculative decoding stats")


def _now() -> int:
    return int(time.time())


def _is_none(value: object) -> bool:
    return value is None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReasonOut | None = None
    logprobs: None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # extension: return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReasonOut | None = None
    logprobs: None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # extension: return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReasonOut | None = None
    logprobs: None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # extension: return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    """A streamed completion event: OpenAI sends ``text_completion`` objects, one per delta."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorType(str, Enum):
    invalid_request = "invalid_request_error"
    not_found = "not_found_error"
    rate_limit = "rate_limit_error"
    server = "server_error"
    unavailable = "service_unavailable_error"


class ErrorCode(str, Enum):
    invalid_value = "invalid_value"
    invalid_json = "invalid_json"
    context_length_exceeded = "context_length_exceeded"
    model_not_found = "model_not_found"
    not_found = "not_found"
    method_not_allowed = "method_not_allowed"
    rate_limit_exceeded = "rate_limit_exceeded"
    internal_error = "internal_error"
    worker_failed = "worker_failed"


class ErrorDetail(BaseModel):
    message: str
    type: ErrorType
    param: str | None = None
    code: ErrorCode | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthStatus(str, Enum):
    ok = "ok"
    degraded = "degraded"  # a lane is down


class Health(BaseModel):
    status: HealthStatus
    lanes: int
    lanes_alive: int
