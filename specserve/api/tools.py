"""Tool calls read back from an answer held to its tools' schemas (``ChatCompletionRequest.output_format``):
a named function's answer is its arguments; tool_choice 'required''s a JSON list of ``{"name", "parameters"}``."""

from __future__ import annotations

import json
import uuid
from typing import Any

from specserve.api.schemas import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta, ToolSpec


def offered_tools(tools: list[ToolSpec] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (OpenAI's form, unset fields left out)."""
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def named_call(name: str, arguments: str) -> ToolCall:
    """The call of the function tool_choice names: the answer is its arguments (a prefix of them where it was cut,
    as vLLM's)."""
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))


def required_calls(answer: str) -> list[ToolCall] | None:
    """tool_choice 'required''s calls (None: the answer was cut before its list closed)."""
    try:
        listed = json.loads(answer, parse_float=_Number, parse_int=_Number)
        calls = [FunctionCall(name=c["name"], arguments=_as_json(c["parameters"])) for c in listed]
        return [ToolCall(id=call_id(), function=call) for call in calls]
    except (ValueError, TypeError, KeyError, RecursionError):  # (cut; of another shape; too deep)
        return None


class _Number(str):
    """A JSON number as the answer wrote it. Read as a float, 0.99999999999999999 (which a schema's
    exclusiveMaximum 1 allows) came back 1.0, and 1e999 could not be written back at all."""


def _as_json(value: Any) -> str:
    """Arguments read from the answer written back as JSON (", " and ": " between items), numbers and characters
    as the answer had them, as a named function's arguments are the answer itself."""
    if isinstance(value, _Number):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_as_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_as_json(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def call_deltas(calls: list[ToolCall]) -> list[ToolCallDelta]:
    """Whole calls as one chunk's parts."""
    return [
        ToolCallDelta(
            index=i,
            id=c.id,
            type=c.type,
            function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments),
        )
        for i, c in enumerate(calls)
    ]
