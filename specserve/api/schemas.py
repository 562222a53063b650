"""OpenAI-compatible request and response schemas (completions, chat completions, models, errors).

Extensions beyond OpenAI's API: ``top_k``, ``min_p``, ``stop_token_ids``, ``include_stop_str_in_output``,
``min_tokens``, ``ignore_eos``, ``return_token_ids`` and ``cache_salt`` (as vLLM names them; vLLM's
``repetition_penalty`` only at its neutral 1), ``speculation`` (per-request speculative decoding options) and
``resume_from`` (resume a stream); ``usage.speculation`` reports what speculation did, ``seed`` the seed a sampled
request drew with, a choice's ``stop_reason`` (vLLM's) the stop string or stop token id that ended it.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from enum import Enum
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specserve.config import Drafter, SLPolicyKind, SpecMethod
from specserve.errors import InvalidRequestError
from specserve.sampling import LOGIT_BIAS_BOUND, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from specserve.structured import MAX_CHOICES as MAX_FORMAT_CHOICES
from specserve.structured import (
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    FormatKind,
    OutputFormat,
    check_choices,
    check_json_data,
)

# Past this many fields a request object does not define, it gets one error naming the first few: pydantic builds an
# error per unknown key, and FastAPI and the handler copy the list, all on the event loop (a 3.7 MB body of 380k
# unknown keys held it ~4 s, stalling every stream of the replica: docs/benchmarks.md, "Unknown fields").
MAX_UNKNOWN_FIELDS = 8


class ClosedModel(BaseModel):
    """A request object that refuses fields it does not define."""

    model_config = ConfigDict(extra="forbid")
    # OpenAI fields this object does not take, accepted when null or [] (unset: OpenAI's SDK sends them so in an
    # assistant message it returned) and refused by name otherwise
    unset_when_empty: ClassVar[frozenset[str]] = frozenset()
    # what the OpenAI SDK's stream and parse helpers add to a message they return (their client-side readings of its
    # content or calls: ``parsed``, a call's ``index``, ``parsed_arguments``), dropped whatever their value, so that
    # message can be sent back as it is
    sdk_readings: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.sdk_readings:
            data = {k: v for k, v in data.items() if k not in cls.sdk_readings}
        if isinstance(data, dict) and cls.unset_when_empty:
            data = {k: v for k, v in data.items() if not (k in cls.unset_when_empty and (v is None or v == []))}
        if isinstance(data, dict) and len(data) > MAX_UNKNOWN_FIELDS:
            known = {f.alias or name for name, f in cls.model_fields.items()}  # a body names a field by its alias
            unknown = [k for k in data if k not in known]
            if len(unknown) > MAX_UNKNOWN_FIELDS:
                first = ", ".join(repr(str(k)[:40]) for k in unknown[:3])
                raise ValueError(f"{len(unknown)} unknown fields ({first}, ...)")
        return data


class SpeculationOptions(ClosedModel):
    """Per-request speculation: ``policy`` is the SL policy (``static`` or ``dsde``); ``"none"`` is accepted as
    another way to say ``enabled: false``."""

    enabled: StrictBool = True
    method: SpecMethod | None = Field(default=None, description="chain, eagle2 (tree) or ddd (tree, dynamic depth)")
    drafter: Drafter | None = Field(
        default=None, description="model (the deployment's draft), lookup (prompt lookup) or suffix (suffix trees)"
    )
    model_fallback: StrictBool | None = Field(
        default=None, description="lookup / suffix: let the draft model draft where they find no match"
    )
    policy: SLPolicyKind | None = None
    max_sl: StrictInt | None = Field(default=None, ge=1, le=64, description="caps the chain length / tree depth")

    @model_validator(mode="before")
    @classmethod
    def _policy_none_is_off(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("policy") == "none":
            enabled = data.get("enabled", False)  # (one that is not a boolean is left for its own 400)
            return {**data, "policy": None, "enabled": False if isinstance(enabled, bool) else enabled}
        return data


# JSON types are strict (``"stream": "yes"`` and ``"max_tokens": "10"`` are 400s, not coerced); numbers may be given
# as integers where a float is expected. Every constraint below is one the server enforces, so /openapi.json (built
# from these models) documents exactly what is accepted.
StrictFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # NaN, Infinity: JSON has neither
# the end of the signed 64-bit range, exclusive (OpenAPI bounds are floats, and 2**63 - 1 is not one): Python's JSON
# parser takes integers of up to 4300 digits, and one of those in an error message cannot even be printed
INT64_END = 2**63
TokenId = Annotated[StrictInt, Field(ge=0, lt=INT64_END)]  # below the vocabulary size, which the model decides
# a token id as a JSON object's key: canonical decimal ("03" would be a second key for id 3), at most 18 digits
BIAS_KEY = re.compile(r"0|[1-9][0-9]{0,17}")
BiasTokenId = Annotated[str, Field(pattern=f"^({BIAS_KEY.pattern})$")]
Bias = Annotated[StrictFloat, Field(ge=-LOGIT_BIAS_BOUND, le=LOGIT_BIAS_BOUND)]
# (pydantic writes the key pattern as patternProperties, which alone would document any other key as allowed)
LogitBias = Annotated[dict[BiasTokenId, Bias], Field(json_schema_extra={"additionalProperties": False})]


def _exactly(kind: type[bool] | type[int]) -> BeforeValidator:
    """A JSON type for a Literal field: a Literal compares by ==, so 0 would pass for false, and true or 1.0 for 1."""
    name = "boolean" if kind is bool else "integer"

    def check(v: object) -> object:
        if v is not None and type(v) is not kind:
            raise ValueError(f"must be a JSON {name}")
        return v

    return BeforeValidator(check)


class StreamOptions(ClosedModel):
    include_usage: StrictBool | None = Field(default=False, description="null: false (as an SDK sends unset)")
    include_obfuscation: Annotated[Literal[False] | None, _exactly(bool)] = Field(
        default=None, description="only false or null: chunks carry no obfuscation padding"
    )
    continuous_usage_stats: StrictBool | None = Field(
        default=False,
        description="extension (vLLM's), with include_usage: every content chunk carries its choice's usage so far",
    )


MAX_STOP_CHARS = 1024  # the step loop looks for every stop string's prefixes at the end of the text each step


def _json_kind(value: Any) -> str | None:
    """Which member of a string-or-list union a JSON value is for: only that member's errors are reported."""
    if isinstance(value, str):
        return STRING_MEMBER
    if isinstance(value, list):
        return LIST_MEMBER
    return None


# Tags of a union's members appear in an error's location; they are written so that no field name can be one, and
# the error body leaves them out (``prompt.0: ...``, not the member's type).
STRING_MEMBER, LIST_MEMBER = "<string>", "<list>"
TEXTS_MEMBER, ID_LISTS_MEMBER = "<texts>", "<id lists>"  # a completions batch: a list of texts, or of id lists


def is_union_member(loc_part: object) -> bool:
    return loc_part in (STRING_MEMBER, LIST_MEMBER, TEXTS_MEMBER, ID_LISTS_MEMBER)


def _prompt_kind(value: Any) -> str | None:
    """A completions prompt's form: a text, token ids, or OpenAI's batch of either (by its first item)."""
    if isinstance(value, list) and value and isinstance(value[0], str):
        return TEXTS_MEMBER
    if isinstance(value, list) and value and isinstance(value[0], list):
        return ID_LISTS_MEMBER
    return _json_kind(value)


def by_json_type(expected: str) -> Discriminator:
    """A ``string | list`` union's member chosen by the JSON type, with one error naming both if it is neither."""
    return Discriminator(_json_kind, custom_error_type="union_type", custom_error_message=f"Input should be {expected}")


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[
    Annotated[StopString, Tag(STRING_MEMBER)] | Annotated[list[StopString], Field(max_length=4), Tag(LIST_MEMBER)],
    by_json_type("a string or a list of up to 4 strings"),
]


class JsonSchemaSpec(ClosedModel):
    """OpenAI's ``response_format.json_schema``."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: Annotated[dict[str, Any], BeforeValidator(check_json_data)] = Field(
        default_factory=dict, alias="schema", description="the JSON schema ({}: any JSON)"
    )
    strict: StrictBool | None = Field(default=None, description="always strict here: the answer is held to the schema")


class ResponseFormat(ClosedModel):
    """OpenAI's: plain text (``{"type": "text"}``, what SDK wrappers send by default), any JSON object
    (``json_object``) or JSON valid against a schema (``json_schema``), the answer held to it as it is drawn."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = Field(default=None, description="json_schema's: the schema, with a name")

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, v: object) -> object:
        if isinstance(v, str) and v not in ("text", "json_object", "json_schema"):
            raise ValueError(
                f"response_format type {v[:40]!r} is not supported: 'text', 'json_object' or 'json_schema'"
            )
        return v

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("a json_schema response_format takes its json_schema (and only it does)")
        return self

    def output_format(self) -> OutputFormat | None:
        if self.type == "text":
            return None
        if self.json_schema is None:
            return OutputFormat(kind=FormatKind.json_object)
        return OutputFormat(kind=FormatKind.json_schema, schema_text=json.dumps(self.json_schema.schema_))


def _schema_from_text(value: object) -> object:
    """A JSON schema sent as its text (vLLM takes ``structured_outputs.json`` as a string or an object) read into
    the object; other values pass as they came."""
    if not isinstance(value, str):
        return value
    if len(value) > MAX_SCHEMA_CHARS:
        raise ValueError(f"a JSON schema as text takes at most {MAX_SCHEMA_CHARS} characters")
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"json is not valid JSON: {e}") from None
    except RecursionError:  # nested past the parser's own limit, far past check_json_data's
        raise ValueError("a JSON schema nested too deep to read") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json as text must hold a JSON object (a schema), not {type(schema).__name__}")
    return schema


class StructuredOutputs(ClosedModel):
    """vLLM's ``structured_outputs``: one of a JSON schema (an object or its text), any JSON object, a regular
    expression, a choice of strings or a grammar (Lark or GBNF)."""

    json_: Annotated[dict[str, Any], BeforeValidator(check_json_data), BeforeValidator(_schema_from_text)] | None = (
        Field(default=None, alias="json", description="a JSON schema, as an object or as its text")
    )
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_SCHEMA_CHARS)
    choice: Annotated[list[str], AfterValidator(check_choices)] | None = Field(
        default=None, min_length=1, max_length=MAX_FORMAT_CHOICES
    )
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_SCHEMA_CHARS, description="Lark or GBNF")
    json_object: Annotated[Literal[True] | None, _exactly(bool)] = Field(default=None, description="any JSON object")

    @model_validator(mode="after")
    def _one_of_them(self) -> StructuredOutputs:
        if sum(v is not None for v in (self.json_, self.regex, self.choice, self.grammar, self.json_object)) != 1:
            raise ValueError("structured_outputs takes one of json, regex, choice, grammar or json_object")
        return self

    def output_format(self) -> OutputFormat:
        param = "structured_outputs"
        if self.json_ is not None:
            return OutputFormat(kind=FormatKind.json_schema, schema_text=json.dumps(self.json_), param=param)
        if self.regex is not None:
            return OutputFormat(kind=FormatKind.regex, pattern=self.regex, param=param)
        if self.grammar is not None:
            return OutputFormat(kind=FormatKind.grammar, grammar_text=self.grammar, param=param)
        if self.json_object:
            return OutputFormat(kind=FormatKind.json_object, param=param)
        return OutputFormat(kind=FormatKind.choice, choices=tuple(cast(list[str], self.choice)), param=param)


NULLABLE_DEFAULTS = (
    "temperature",
    "top_p",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "include_stop_str_in_output",
    "stream",
    "ignore_eos",
    "echo",
)


def _document_nullable(schema: dict[str, Any]) -> None:
    """/openapi.json: the fields a null means the default for accept null."""
    for name in NULLABLE_DEFAULTS:
        prop = schema.get("properties", {}).get(name)
        if prop is not None:
            default = prop.pop("default", None)
            desc = prop.pop("description", None)
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], "default": default} | (
                {"description": desc} if desc else {}
            )


MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_METADATA_KEYS = 16  # OpenAI's bound
MAX_CHOICES = 16  # a request's n: each choice is a sequence of the batch (OpenAI allows up to 128)
# a conversation's messages: validating 120k one-character messages (a 3.9 MiB body, under the size limit) held the
# event loop 1.5 s and the chat template another 3.5 s, stalling every stream of the replica
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # tools a request offers, and calls an assistant message made
# and their content parts, counted over all messages: 39 messages of 4096 empty parts (a 4.8 MB body) held it 0.8 s
# (docs/benchmarks.md, "Content parts counted before validation")
MAX_CONTENT_PARTS = 4096


class GenerationRequest(ClosedModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(json_schema_extra=_document_nullable)

    model: str
    max_tokens: StrictInt | None = Field(
        default=None, ge=1, lt=INT64_END, description="at most the context length minus the prompt"
    )
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(
        default=None,
        ge=-1,
        lt=INT64_END,
        description=(
            "extension: keep the k most likely tokens (and ties with the k-th); "
            "-1 or 0 (as vLLM's clients send them): no top-k"
        ),
    )
    # lt 2**63 rather than le 2**63 - 1: OpenAPI bounds are floats, and 2**63 - 1 is not one
    seed: StrictInt | None = Field(default=None, ge=-INT64_END, lt=INT64_END, description="a 64-bit signed integer")
    stop: StopStrings | None = Field(default=None, description="up to 4 non-empty stop strings")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(
        default=1,
        ge=1,
        le=MAX_CHOICES,
        description="answers to generate (per prompt of a completions batch), each a choice with its index; "
        "sampled choice k (prompt p's i-th is k = p * n + i) draws with the request's seed (or the one drawn, "
        "returned as seed) plus k; streamed, their chunks come as they are made, without event ids (not resumable)",
    )
    presence_penalty: StrictFloat = Field(default=0.0, ge=0.0, le=0.0, description="not supported: only 0")
    frequency_penalty: StrictFloat = Field(default=0.0, ge=0.0, le=0.0, description="not supported: only 0")
    repetition_penalty: StrictFloat = Field(
        default=1.0, ge=1.0, le=1.0, description="extension (vLLM's), not supported: only 1"
    )
    min_p: StrictFloat = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="extension (as vLLM's): drop tokens less likely than min_p times the most likely token, after "
        "temperature and before top_k and top_p; 0: off",
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)] | None = Field(
        default=None,
        description="extension (as vLLM's): token ids that end generation when generated, with ignore_eos too; "
        "the one that ends it is in token_ids and completion_tokens, and in the text only with "
        "include_stop_str_in_output (an EOS id without ignore_eos stays EOS: in neither)",
    )
    include_stop_str_in_output: StrictBool = Field(
        default=False,
        description="extension (as vLLM's): the text keeps the stop string, or the stop token's text, that ended it",
    )
    # vLLM's, sent by clients that spell out its defaults: accepted at them (true or null), other values refused
    skip_special_tokens: Annotated[Literal[True] | None, _exactly(bool)] = Field(
        default=None, description="extension (vLLM's): only true (or null): special tokens are left out of the text"
    )
    spaces_between_special_tokens: Annotated[Literal[True] | None, _exactly(bool)] = Field(
        default=None, description="extension (vLLM's): only true (or null), which with skipped special tokens is moot"
    )
    min_tokens: StrictInt = Field(
        default=0,
        ge=0,
        lt=INT64_END,
        description="extension (as vLLM's): output tokens before EOS (unless ignore_eos) or a stop token id may be "
        "generated, and a stop string completed by one of the first min_tokens tokens does not stop it; at most "
        "max_tokens",
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        description="text (the default), any JSON object (json_object) or JSON valid against a schema (json_schema): "
        "the target draws only tokens the format allows, so EOS ends the answer only where it is complete "
        "(max_tokens, a stop string or a stop token id may cut it short)",
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None,
        description="extension (vLLM's): the answer held to a JSON schema, any JSON object, a regex, a choice or a "
        "grammar (Lark or GBNF)",
    )
    truncate_prompt_tokens: StrictInt | None = Field(
        default=None,
        ge=-1,
        lt=INT64_END,
        description="extension (vLLM's): the prompt is its last this many tokens (a chat's of the rendered "
        "template; -1: the context length), at most the context length",
    )
    user: str | None = None
    logit_bias: LogitBias | None = Field(
        default=None,
        max_length=MAX_LOGIT_BIAS,
        description="token id (a decimal string) -> a bias in [-100, 100] added to its logit before sampling (at -100 "
        "a token is practically never drawn, at 100 practically always); ids below the model's vocabulary size",
    )
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None,
        max_length=MAX_METADATA_KEYS,
        description="stored by OpenAI for its dashboard; accepted and unused here",
    )
    ignore_eos: StrictBool = Field(default=False, description="extension: keep generating past EOS")
    return_token_ids: StrictBool = Field(default=False, description="extension: token ids alongside the text")
    speculation: SpeculationOptions | None = Field(default=None, description="extension: speculative decoding")
    cache_salt: StrictStr | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="extension (as vLLM's): the suffix drafter's cache of recent outputs is partitioned by salt; a "
        "request drafts only from outputs of requests with its salt, so tenants with salts of their own cannot "
        "learn each other's outputs from speculation's speed or usage",
    )
    resume_from: str | None = Field(
        default=None,
        max_length=64,
        description="extension: the id of the last SSE event received (as the Last-Event-ID header); the stream "
        "continues after it. Send the same request, with the seed the server returned when it sampled.",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: object) -> object:
        """OpenAI's schema makes these fields nullable, and SDKs send null for "unset": the default then."""
        if isinstance(data, dict):  # (a field of the other endpoint's stays what it is there: unknown)
            nullable = set(NULLABLE_DEFAULTS) & set(cls.model_fields)
            return {k: v for k, v in data.items() if not (v is None and k in nullable)}
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int | None) -> int | None:
        return None if v is not None and v <= 0 else v

    @field_validator("structured_outputs")
    @classmethod
    def _one_format(cls, v: StructuredOutputs | None, info: ValidationInfo) -> StructuredOutputs | None:
        # (declared after response_format)
        held = info.data.get("response_format")
        if v is not None and held is not None and held.type != "text":
            raise ValueError("send response_format or structured_outputs, not both")
        return v

    def output_format(self) -> OutputFormat | None:
        """The form its answer must take (None: free text)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.output_format()
        return None if self.response_format is None else self.response_format.output_format()

    @property
    def format_param(self) -> str:
        """The field that sets the answer's form, for errors."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError(
                "truncate_prompt_tokens keeps the prompt's last tokens: at least 1 (-1: the context length)"
            )
        return v

    @field_validator("presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _no_penalty(cls, v: object) -> object:
        if isinstance(v, int | float) and not isinstance(v, bool) and v != 0:
            raise ValueError("presence and frequency penalties are not supported; use 0")
        return v

    @field_validator("skip_special_tokens", "spaces_between_special_tokens", mode="before")
    @classmethod
    def _special_tokens_skipped(cls, v: object, info: ValidationInfo) -> object:
        if v is False:  # (named, not a bare "Input should be True")
            raise ValueError(f"{info.field_name}: false is not supported; special tokens are always skipped")
        return v

    @field_validator("repetition_penalty", mode="before")
    @classmethod
    def _no_repetition_penalty(cls, v: object) -> object:
        if isinstance(v, int | float) and not isinstance(v, bool) and v != 1:
            raise ValueError("repetition_penalty is not supported; use 1")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # (declared after ``stream``: validated after it; an invalid stream has its own error, not this one too)
        if v is not None and "stream" in info.data and not info.data["stream"]:
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    # maps a body can fill are refused whole before their entries are validated (an error per bad entry: seconds of
    # the event loop for a few MiB of them)
    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_entries(cls, v: object) -> object:
        """One error for the map, naming its first bad entry (the typed checks after this find none)."""
        if not isinstance(v, dict):
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has at most {MAX_LOGIT_BIAS} entries, not {len(v)}")
        for key, bias in v.items():
            if not isinstance(key, str) or not BIAS_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys are token ids in decimal ('42'), not {str(key)[:24]!r}")
            number = isinstance(bias, int | float) and not isinstance(bias, bool)
            if not (number and -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND):  # (nan fails the bounds)
                shown = (str(bias) if number else repr(bias))[:24]
                raise ValueError(f"logit_bias values are numbers in [-100, 100], not {shown} (token {key})")
        return v

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_size(cls, v: object) -> object:
        if isinstance(v, dict) and len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata has at most {MAX_METADATA_KEYS} keys, not {len(v)}")
        return v

    @property
    def logprob_count(self) -> int | None:
        """The likeliest tokens to list beside each output token's log-probability (None: no logprobs)."""
        return None

    @property
    def echoes(self) -> bool:
        """The answer starts with the prompt (completions' ``echo``)."""
        return False

    @property
    def scores_prompt(self) -> bool:
        """It asks for no tokens (completions' ``max_tokens`` 0): only its prompt, with echo, and its logprobs."""
        return False

    @property
    def prompt_count(self) -> int:
        """Prompts it asks answers to (a completions batch has several): each has ``n`` choices."""
        return 1

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.include_usage_in_stream and bool(cast(StreamOptions, self.stream_options).continuous_usage_stats)


def _utf8(text: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can encode: reject them as bad input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode ({e.reason} at position {e.start})") from None
    return text


Utf8Str = Annotated[str, AfterValidator(_utf8)]
# Lists a request may fill up to the body limit validate up to their first bad item (fail_fast): an error per item
# of a 4 MiB list of bad ids took pydantic and FastAPI ~30 s to build on the event loop, stalling every stream.
PromptText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
PromptIds = Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]
MAX_PROMPTS = 128  # a completions batch (OpenAI's allows 2048); each prompt's choices take places in the batch
Prompt = Annotated[
    Annotated[PromptText, Tag(STRING_MEMBER)]
    | Annotated[PromptIds, Tag(LIST_MEMBER)]
    | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS), Tag(TEXTS_MEMBER)]
    | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS, fail_fast=True), Tag(ID_LISTS_MEMBER)],
    Discriminator(
        _prompt_kind,
        custom_error_type="union_type",
        custom_error_message="Input should be text, a list of token ids, or a list of either",
    ),
]


def _document_completion(schema: dict[str, Any]) -> None:
    _document_nullable(schema)
    # max_tokens 0 scores a prompt: only with echo (its 400 names max_tokens)
    scoring = {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]}
    schema["if"], schema["then"] = scoring, {"properties": {"echo": {"const": True}}, "required": ["echo"]}


TOOL_BASE = "https://specserve.invalid/tools/"  # each tool's base URI under tool_choice 'required' (never fetched)


def _root_id(schema: dict[str, Any]) -> str | None:
    """A schema's root "$id" where it names a resource: a string with more than a fragment ("" and "#" name the
    document they are in, under 'required' the whole list; a number is no URI)."""
    found = schema.get("$id")
    return found if isinstance(found, str) and found.partition("#")[0] else None


REQUIRED_NESTING = 2  # 'required''s list of calls holds each tool's schema this deep: "$defs", then its own name


def _own_resources(schemas: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """Each tool's arguments schema as a resource of its own in 'required''s list of calls, and the URI the list
    refers to it by: its references ("#", "#/$defs/X", an anchor "#name") and its subschemas' relative "$id"s resolve
    in it, as when the tool is named. Pointers rewritten to its place in the list had left anchors and "$id"s shared,
    so two tools declaring one anchor each read the other's schema. A schema with a root "$id" no other tool has is
    one already; one several share (a copied template's), or one that names no resource, is given a base of its own
    like the rest."""
    ids = Counter(_root_id(s) for s in schemas)
    owned = []
    for i, schema in enumerate(schemas):
        if (found := _root_id(schema)) is not None and ids[found] == 1:
            owned.append((schema, found))
        else:
            uri = f"{TOOL_BASE}{i}/"
            owned.append((schema | {"$id": uri}, uri))
    return owned


class CompletionRequest(GenerationRequest):
    model_config = ConfigDict(json_schema_extra=_document_completion)

    prompt: Prompt = Field(
        description=f"text, token ids, or a batch of up to {MAX_PROMPTS} of either (choices index prompt * n + i)"
    )
    max_tokens: StrictInt | None = Field(
        default=16,
        ge=0,
        lt=INT64_END,
        description="at most the context length minus the prompt; 0, with echo alone: the prompt scored, nothing "
        "generated (vLLM's prompt-only scoring)",
    )
    echo: StrictBool = Field(
        default=False,
        description="the answer's text starts with the prompt's, and with logprobs its tokens' come first (the first "
        "null), as OpenAI's; streamed, the first chunk's text starts with the prompt's",
    )
    best_of: Annotated[Literal[1] | None, _exactly(int)] = Field(default=None, description="not supported: only 1")
    suffix: None = Field(default=None, description="not supported (text after an insertion): only null")
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        default=None,
        description="each output token's log-probability under the model (before the temperature, logit bias or any "
        "cut, as vLLM's default) and this many likeliest tokens'; null or false: none",
        json_schema_extra=lambda schema: cast(list[Any], schema["anyOf"]).insert(
            1, {"type": "boolean", "const": False}
        ),
    )

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, v: object) -> object:
        if v is True:  # (one error: a union of int and false named its members' internals)
            raise ValueError("logprobs is a count of likeliest tokens, 0 to 20 (false or null: none), not true")
        return None if v is False else v

    @property
    def echoes(self) -> bool:
        return self.echo

    @property
    def scores_prompt(self) -> bool:
        return self.max_tokens == 0

    @field_validator("best_of", "suffix", mode="before")
    @classmethod
    def _no_best_of_or_suffix(cls, v: object, info: ValidationInfo) -> object:
        # each by name, as n is, not as a bare "Input should be 1 / None"
        if info.field_name == "best_of" and type(v) is int and v != 1:
            raise ValueError("best_of is not supported; send 1 or null")
        if info.field_name == "suffix" and isinstance(v, str):
            raise ValueError("suffix (text after an insertion) is not supported; send null")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """Its prompts: one, or a batch's (OpenAI's list of texts or of token lists)."""
        single = isinstance(self.prompt, str) or not isinstance(self.prompt[0], str | list)
        return [cast(str | list[int], self.prompt)] if single else cast(list[str | list[int]], self.prompt)

    @property
    def prompt_count(self) -> int:
        return len(self.prompts)


class ChatRole(str, Enum):
    system = "system"
    developer = "developer"
    user = "user"
    assistant = "assistant"
    tool = "tool"


class TextPart(ClosedModel):
    type: Literal["text"]
    text: Utf8Str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v: object) -> object:
        # an image, audio, file or refusal part by its type, not as a missing "text" and an unknown field
        if isinstance(v, dict) and isinstance(kind := v.get("type"), str) and kind != "text":
            raise ValueError(f"content parts of type {kind[:40]!r} are not supported: this server reads text parts")
        return v


MessageContent = Annotated[
    Annotated[Utf8Str, Tag(STRING_MEMBER)]
    | Annotated[list[TextPart], Field(min_length=1, fail_fast=True), Tag(LIST_MEMBER)],
    by_json_type("a string or a list of text parts"),
]


def _none_if_empty(v: object) -> object:
    """A list field sent as [] is unset (OpenAI's SDKs send [] and null alike)."""
    return None if v == [] else v


class FunctionCallIn(ClosedModel):
    sdk_readings = frozenset({"parsed_arguments"})

    name: Utf8Str
    arguments: Utf8Str = Field(description="the arguments as JSON text")


class ToolCallIn(ClosedModel):
    """A call an earlier assistant message made (its answer follows in a tool message with its id)."""

    sdk_readings = frozenset({"index"})

    id: Utf8Str
    type: Literal["function"]
    function: FunctionCallIn

    def for_template(self) -> dict[str, Any]:
        """As chat templates read a call: the arguments as an object where they are JSON (as vLLM hands them)."""
        try:  # (nested past MAX_SCHEMA_DEPTH, or past what Python's JSON parser recurses into: the text)
            arguments: Any = check_json_data(json.loads(self.function.arguments))
        except (ValueError, RecursionError):
            arguments = self.function.arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(ClosedModel):
    unset_when_empty = frozenset({"refusal", "function_call", "audio", "annotations"})
    sdk_readings = frozenset({"parsed"})

    role: ChatRole
    content: MessageContent | None = None
    name: Utf8Str | None = Field(default=None, description="the participant, handed to the chat template")
    tool_call_id: Utf8Str | None = Field(default=None, description="a tool message's call (required there)")
    tool_calls: list[ToolCallIn] | None = Field(
        default=None, max_length=MAX_TOOLS, description="an assistant message's calls ([] or null: none)"
    )

    _none_when_empty = field_validator("tool_calls", mode="before")(_none_if_empty)

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != ChatRole.assistant:
            raise ValueError(f"only an assistant message makes tool_calls, not a {self.role.value} message")
        if self.content is None and self.tool_calls is None:  # (OpenAI's: an assistant's may be its calls alone)
            article = "an" if self.role == ChatRole.assistant else "a"
            raise ValueError(f"{article} {self.role.value} message needs its content")
        if self.role == ChatRole.tool and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (templates that know ``name``, ``tool_call_id`` or
        ``tool_calls`` use them)."""
        extra: dict[str, Any] = {"name": self.name, "tool_call_id": self.tool_call_id}
        if self.tool_calls is not None:
            extra["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return {"role": self.template_role, "content": self.text} | {k: v for k, v in extra.items() if v is not None}

    @property
    def template_role(self) -> str:
        """The role the chat template knows: OpenAI's ``developer`` messages are the system prompt of newer models."""
        return ChatRole.system.value if self.role == ChatRole.developer else self.role.value

    @property
    def text(self) -> str:
        """A list of text parts is one text, the parts on lines of their own (as vLLM joins them)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


def _few_enough_messages(v: object) -> object:
    """Messages and their parts counted before they are validated one by one (max_length alone counts after)."""
    if not isinstance(v, list):
        return v
    if len(v) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages, got {len(v)}")
    parts = sum(len(m["content"]) for m in v if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > MAX_CONTENT_PARTS:
        raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts in all messages together, got {parts}")
    calls = sum(len(m["tool_calls"]) for m in v if isinstance(m, dict) and isinstance(m.get("tool_calls"), list))
    if calls > MAX_CONTENT_PARTS:
        raise ValueError(f"at most {MAX_CONTENT_PARTS} tool_calls in all messages together, got {calls}")
    return v


def _continue_without_a_new_turn(continue_final_message: bool, info: ValidationInfo) -> bool:
    """(A validator of continue_final_message, declared after add_generation_prompt: validated after it.)"""
    if continue_final_message and info.data.get("add_generation_prompt", False):
        raise ValueError(
            "continue_final_message continues the last message, add_generation_prompt (on by default) opens a new "
            "assistant turn: set add_generation_prompt to false to continue it"
        )
    return continue_final_message


class FunctionSpec(ClosedModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Utf8Str | None = None
    parameters: Annotated[dict[str, Any], BeforeValidator(check_json_data)] | None = Field(
        default=None, description="a JSON schema of the arguments object (left out or {}: the function takes none)"
    )
    strict: StrictBool | None = Field(default=None, description="always strict here where a call is forced")

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters or NO_ARGUMENTS  # ({} too: OpenAI's "no parameters")


NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolSpec(ClosedModel):
    type: Literal["function"]
    function: FunctionSpec


def _each_tool_named_once(tools: list[ToolSpec] | None) -> list[ToolSpec] | None:
    names = [t.function.name for t in tools or []]
    if len(set(names)) < len(names):
        raise ValueError(f"tools name a function twice: {sorted({n for n in names if names.count(n) > 1})}")
    return tools


class NamedFunction(ClosedModel):
    name: str


class NamedToolChoice(ClosedModel):
    type: Literal["function"]
    function: NamedFunction


class ToolMode(str, Enum):
    """How a request's answer calls its tools: ``named``, one call of the function tool_choice names (the answer
    is its arguments); ``required``, one or more calls of any of them (the answer a JSON list of
    ``{"name", "parameters"}``, as vLLM's)."""

    named = "named"
    required = "required"


AUTO_TOOL_CHOICE = (
    "tool_choice 'auto' (the default beside tools) lets the model answer or call a tool in its own format, which "
    'this server has no parser for: send tool_choice \'required\' (one or more calls) or {"type": "function", '
    '"function": {"name": ...}} (that call), each held to the tools\' schemas as it is drawn, or \'none\''
)


class ChatCompletionRequest(GenerationRequest):
    unset_when_empty = frozenset(
        {"functions", "function_call", "reasoning_effort", "audio"}
        | {"prediction", "web_search_options", "verbosity", "prompt_cache_retention", "prompt_cache_options"}
        | {"moderation"}
    )

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_completion_tokens: StrictInt | None = Field(
        default=None, ge=1, lt=INT64_END, description="OpenAI's newer name of max_tokens"
    )
    store: Annotated[Literal[False] | None, _exactly(bool)] = Field(
        default=None, description="only the no-op false: nothing is stored"
    )
    logprobs: StrictBool | None = Field(
        default=None,
        description="each output token's log-probability under the model (before the temperature, logit bias or any "
        "cut, as vLLM's default), in choices[].logprobs.content",
    )
    top_logprobs: StrictInt | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="this many likeliest tokens' beside each output token's; above 0 only with logprobs: true",
    )
    # what this server does, sent as values by clients that spell them out: accepted; other values are refused
    modalities: list[Literal["text"]] | None = Field(default=None, max_length=1, description="only ['text']")
    service_tier: Literal["auto", "default"] | None = Field(
        default=None, description="only the standard tier: 'auto' or 'default'"
    )
    # OpenAI's hints for its abuse detection and its prompt-cache routing, accepted and unused here (as ``user``)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    add_generation_prompt: StrictBool = Field(
        default=True, description="extension (vLLM's): the prompt ends with the assistant turn's opening"
    )
    continue_final_message: StrictBool = Field(
        default=False,
        description="extension (vLLM's): the answer continues the last message, left open (a prefill of the "
        "assistant's answer); needs add_generation_prompt: false",
    )

    tools: list[ToolSpec] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description="functions the answer may call: handed to the chat template, and with tool_choice 'required' or "
        "a named function the answer is held to their schemas and read back as tool_calls ([] or null: none)",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        validate_default=True,
        description="'none' (no calls; the default without tools), 'required' (one or more calls) or a named "
        "function (one call of it); 'auto', the default beside tools, is refused: no parser reads this model's own "
        "tool-call format",
    )
    parallel_tool_calls: StrictBool | None = Field(
        default=None, description="false: tool_choice 'required' makes exactly one call (null: true)"
    )

    _continue = field_validator("continue_final_message")(_continue_without_a_new_turn)

    _no_tools_when_empty = field_validator("tools", mode="before")(_none_if_empty)
    _named_once = field_validator("tools")(_each_tool_named_once)

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_the_tools(
        cls, v: Literal["none", "auto", "required"] | NamedToolChoice | None, info: ValidationInfo
    ) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
        # (declared after tools, response_format and structured_outputs: validated after them)
        if "tools" not in info.data:  # (the tools' own error says what is wrong)
            return v
        tools: list[ToolSpec] = info.data["tools"] or []
        names = [t.function.name for t in tools]
        choice = v if v is not None else "auto" if tools else "none"
        if choice == "none":
            return v
        if not tools:
            raise ValueError("a tool_choice other than 'none' needs tools")
        if choice == "auto":
            raise ValueError(AUTO_TOOL_CHOICE)
        if info.data.get("continue_final_message"):
            raise ValueError("a tool call is a whole answer: not a continuation (continue_final_message)")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name[:64]!r}, which is not one of the tools")
        held = info.data.get("response_format")
        if info.data.get("structured_outputs") is not None or (held is not None and held.type != "text"):
            raise ValueError("a tool call's arguments are held to its tool's schema: send no response format beside")
        return v

    @property
    def tool_mode(self) -> ToolMode | None:
        """How the answer calls the tools (None: it makes no calls)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolMode.named
        return ToolMode.required if self.tool_choice == "required" else None

    def output_format(self) -> OutputFormat | None:
        """A forced call's arguments, or the required calls, as JSON their tools' schemas hold; else as asked."""
        if self.tool_mode is None:
            return super().output_format()
        tools = [t.function for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            named = self.tool_choice.function.name
            schema = next(f for f in tools if f.name == named).arguments_schema
        else:  # each tool's schema under the list's $defs, a resource of its own
            owned = _own_resources([f.arguments_schema for f in tools])
            call = [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "parameters": {"$ref": uri}},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for f, (_, uri) in zip(tools, owned, strict=True)
            ]
            defs = {f"tool{i}": own for i, (own, _) in enumerate(owned)}
            schema = {"type": "array", "items": {"anyOf": call}, "minItems": 1, "$defs": defs}
            if self.parallel_tool_calls is False:
                schema["maxItems"] = 1
        text = json.dumps(schema)
        if self.tool_mode is ToolMode.required and len(text) > MAX_SCHEMA_CHARS:  # (the limit's own message named a
            # string the client never sent)
            raise InvalidRequestError(
                f"tools: tool_choice 'required' holds every tool's schema in one: {len(text)} characters as JSON, at "
                f"most {MAX_SCHEMA_CHARS} (each tool's own is within it: name one, or send fewer)",
                param="tools",
            )
        depth = MAX_SCHEMA_DEPTH + (REQUIRED_NESTING if self.tool_mode is ToolMode.required else 0)
        return OutputFormat(kind=FormatKind.json_schema, schema_text=text, max_depth=depth, param="tools")

    @property
    def format_param(self) -> str:
        return "tools" if self.tool_mode is not None else super().format_param

    _few_enough_messages = field_validator("messages", mode="before")(_few_enough_messages)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        # (declared after ``logprobs``: validated after it; an invalid logprobs has its own error, not this one too)
        if v and "logprobs" in info.data and not info.data["logprobs"]:
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("service_tier", mode="before")
    @classmethod
    def _standard_tier(cls, v: object) -> object:
        if isinstance(v, str) and v not in ("auto", "default"):
            raise ValueError(f"service_tier {v[:40]!r} is not supported; only 'auto' or 'default'")
        return v

    @field_validator("store", mode="before")
    @classmethod
    def _nothing_stored(cls, v: object) -> object:
        if v is True:
            raise ValueError("store: true is not supported; this server stores no completions")
        return v

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(ClosedModel):
    """vLLM's /tokenize: a completion prompt's token ids, or a chat's with its template applied."""

    model: str | None = Field(default=None, description="the served model's name; left out: it")
    prompt: Utf8Str | None = Field(default=None, description="a completion prompt's text (or messages)")
    messages: list[ChatMessage] | None = Field(
        default=None, min_length=1, max_length=MAX_MESSAGES, fail_fast=True, description="a chat (or prompt)"
    )
    add_special_tokens: StrictBool | None = Field(
        default=None,
        description="a prompt's (default true): the tokens (a BOS) a completion's prompt starts with; messages' only "
        "false (their special tokens are the template's)",
    )
    add_generation_prompt: StrictBool = Field(
        default=True, description="messages': end with the assistant turn's opening, as a chat request's prompt does"
    )
    continue_final_message: StrictBool = Field(
        default=False, description="messages': the last one left open (needs add_generation_prompt: false)"
    )
    return_token_strs: StrictBool | None = Field(default=False, description="each token as the vocabulary spells it")
    tools: list[ToolSpec] | None = Field(
        default=None, max_length=MAX_TOOLS, description="messages': the tools a chat request offers its template"
    )

    _no_tools_when_empty = field_validator("tools", mode="before")(_none_if_empty)  # (as chat reads them)
    _named_once = field_validator("tools")(_each_tool_named_once)

    _few_enough_messages = field_validator("messages", mode="before")(_few_enough_messages)

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, v: bool, info: ValidationInfo) -> bool:
        if info.data.get("prompt") is not None:  # (the prompt's own error says what is wrong)
            return v
        return _continue_without_a_new_turn(v, info)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send a prompt or messages (one of them)")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens: true is a prompt's: a chat's special tokens are its template's")
        if self.prompt is not None and {"add_generation_prompt", "continue_final_message"} & self.model_fields_set:
            raise ValueError("add_generation_prompt and continue_final_message are a chat's: send messages")
        if self.prompt is not None and self.tools:
            raise ValueError("tools are a chat's: send messages")
        return self


class DetokenizeRequest(ClosedModel):
    """vLLM's /detokenize: token ids' text, special tokens included."""

    model: str | None = Field(default=None, description="the served model's name; left out: it")
    tokens: list[TokenId] = Field(fail_fast=True)


# -- responses ----------------------------------------------------------------------------------------


class FinishReasonOut(str, Enum):
    stop = "stop"
    length = "length"
    tool_calls = "tool_calls"  # the answer is the calls tool_choice 'required' asked for


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


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: per output token its text, log-probability, the likeliest tokens' (text ->
    log-probability) and where its text starts in the answer (counted over the tokens' own texts); with echo the
    prompt's tokens first, the first of them without (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


STOP_REASON = (
    "extension (vLLM's): the stop string or stop token id that ended the answer; null for EOS, a limit, or not yet"
)
TOKEN_IDS = "extension (vLLM's, with return_token_ids): the output's token ids (of this chunk, streamed)"
PROMPT_TOKEN_IDS = (
    "extension (vLLM's, with return_token_ids): the prompt's token ids, as the model read them (streamed: in the "
    "first chunk)"
)
SEED = "extension: the seed a sampled request drew with (resend it to regenerate the same answer)"


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReasonOut | None = None
    stop_reason: str | int | None = Field(default=None, description=STOP_REASON)
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none, description=TOKEN_IDS)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none, description=PROMPT_TOKEN_IDS)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    seed: int | None = Field(default=None, exclude_if=_is_none, description=SEED)


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments object as JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="the answer's text (null: it is its tool_calls)")
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's own bytes (of a character split over tokens, its part; its token: U+FFFD)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReasonOut | None = None
    stop_reason: str | int | None = Field(default=None, description=STOP_REASON)
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none, description=TOKEN_IDS)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    seed: int | None = Field(default=None, exclude_if=_is_none, description=SEED)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none, description=PROMPT_TOKEN_IDS)


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_is_none)
    arguments: str | None = Field(default=None, exclude_if=_is_none)


class ToolCallDelta(BaseModel):
    """A call's part in a chunk: its first carries its id, type and name; the rest more of its arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReasonOut | None = None
    stop_reason: str | int | None = Field(default=None, description=STOP_REASON)
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none, description=TOKEN_IDS)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    seed: int | None = Field(default=None, exclude_if=_is_none, description=SEED)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none, description=PROMPT_TOKEN_IDS)


class CompletionChunk(BaseModel):
    """A streamed completion event: OpenAI sends ``text_completion`` objects, one per delta."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    seed: int | None = Field(default=None, exclude_if=_is_none, description=SEED)


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
    invalid_api_key = "invalid_api_key"
    invalid_host = "invalid_host"
    request_too_large = "request_too_large"
    request_timeout = "request_timeout"
    not_found = "not_found"
    method_not_allowed = "method_not_allowed"
    rate_limit_exceeded = "rate_limit_exceeded"
    internal_error = "internal_error"
    worker_failed = "worker_failed"
    resume_mismatch = "resume_mismatch"


class ErrorDetail(BaseModel):
    message: str
    type: ErrorType
    param: str | None = None
    code: ErrorCode | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(description="the context length a prompt and its answer share")
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, description="with return_token_strs")


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthStatus(str, Enum):
    ok = "ok"
    degraded = "degraded"  # a lane is without its workers, or loading a replacement for one it lost
    # a lane thread has stopped, or no lane has its workers: the replica fails Serve's health check (503)
    failing = "failing"


class Health(BaseModel):
    status: HealthStatus
    lanes: int
    lanes_alive: int
