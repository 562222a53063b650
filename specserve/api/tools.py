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
        listed = json.loads(answer)
        if not isinstance(listed, list) or not listed:
            return None  # (of another shape: the grammar holds the answer to a list of one call or more)
        if not all(isinstance(c, dict) and {"name", "parameters"} <= c.keys() for c in listed):
            return None
        written = _parameters_as_written(answer)
        calls = [FunctionCall(name=c["name"], arguments=a) for c, a in zip(listed, written, strict=True)]
        return [ToolCall(id=call_id(), function=call) for call in calls]
    except (ValueError, RecursionError):  # (cut; too deep)
        return None


_VALUE = json.JSONDecoder().raw_decode


def _parameters_as_written(listed: str) -> list[str]:
    """Each call's ``parameters`` in a JSON list of call objects, as the text the answer wrote (numbers, escapes and
    spacing unchanged, as a named function's arguments are the answer itself: read and written back, a float made
    0.99999999999999999, which an exclusiveMaximum of 1 allows, 1.0; a repeated key: its last value, as json.loads
    reads it). ``listed`` is valid JSON of that shape."""
    texts: list[str] = []
    i = _past(listed, 0, "[")
    while listed[i] != "]":
        i = _past(listed, i, "{")
        while listed[i] != "}":
            key, i = _VALUE(listed, i)
            start = _past(listed, i, ":")
            _, i = _VALUE(listed, start)
            if key == "parameters":
                text = listed[start:i]
            i = _past(listed, i, ",")
        texts.append(text)
        i = _past(listed, i, "}")
        i = _past(listed, i, ",")
    return texts


def _past(text: str, i: int, mark: str) -> int:
    """Where the next value starts after ``text[i:]``'s spaces and ``mark`` (if it comes next) and their spaces."""
    i = _past_space(text, i)
    return _past_space(text, i + 1) if text[i] == mark else i


def _past_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


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
