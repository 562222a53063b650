"""Tool calls (specserve/api/tools.py): OpenAI's ``tools`` and ``tool_choice``. A named function's call and
tool_choice 'required''s calls are answers held to the tools' schemas, read back as ``tool_calls``; each is checked
against the same request answered as structured output under a schema written here, and against the schemas."""

from __future__ import annotations

import functools
import json
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator

from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.schemas import ChatMessage, TokenizeRequest, ToolCallIn
from specserve.api.tools import required_calls
from tests.api_backend import MODEL, module_server

# renders the tools and earlier calls, so a test can see them in the prompt
TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% for c in m.get('tool_calls') or [] %}<call {{ c['function']['name'] }} "
    "unit={{ c['function']['arguments']['unit'] }}>{% endfor %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "windy": {"type": "boolean"}},
    "required": ["unit", "windy"],
    "additionalProperties": False,
}
DICE = {
    "type": "object",
    "properties": {"sides": {"enum": [4, 6, 20]}},
    "required": ["sides"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "roll", "parameters": DICE}},
    {"type": "function", "function": {"name": "now"}},  # (no parameters: it takes none)
]
SCHEMAS = {
    "get_weather": WEATHER,
    "roll": DICE,
    "now": {"type": "object", "properties": {}, "additionalProperties": False},
}
MESSAGES = [{"role": "user", "content": "what is the weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _calls_schema(one: bool) -> dict[str, Any]:
    """tool_choice 'required''s answer, written out: a list of {"name", "parameters"} objects, one per call."""
    call = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in SCHEMAS.items()
    ]
    return {"type": "array", "items": {"anyOf": call}, "minItems": 1} | ({"maxItems": 1} if one else {})


def _tool_tokenizer() -> Any:
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


backend, url = module_server(max_model_len=256, tokenizer=_tool_tokenizer())


def _chat(url: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "tools": TOOLS} | fields
    headers = {"content-type": "application/json"}  # (JSON's own escapes: a lone surrogate as \\ud800)
    return httpx.post(url + "/v1/chat/completions", content=json.dumps(body), headers=headers, timeout=60)


def _held_text(url: str, schema: dict[str, Any]) -> str:
    """The same request answered as structured output (tools offered, none called): the reference."""
    r = _chat(url, tool_choice="none", structured_outputs={"json": schema})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # (the schemas' answers are short: enums and booleans)
    return str(choice["message"]["content"])


def test_a_named_function_is_called_with_arguments_its_schema_holds(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60.0)
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=120,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # (OpenAI's for a forced call)
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments == _held_text(url, WEATHER)
    Draft202012Validator(WEATHER).validate(json.loads(call.function.arguments))


def test_a_named_call_streams_its_name_first_then_its_arguments(url: str) -> None:
    whole = _chat(url, tool_choice=NAMED).json()["choices"][0]["message"]["tool_calls"][0]
    r = _chat(url, tool_choice=NAMED, stream=True)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    first = deltas[0]["tool_calls"][0]
    assert deltas[0]["role"] == "assistant" and "content" not in deltas[0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    parts = [d["tool_calls"] for d in deltas[1:] if d]
    assert all(p[0].keys() == {"index", "function"} and p[0]["function"].keys() == {"arguments"} for p in parts)
    assert "".join(p[0]["function"]["arguments"] for p in parts) == whole["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("parallel", [False, None], ids=["one-call", "parallel"])
def test_required_calls_are_the_held_list_read_back(url: str, parallel: bool | None) -> None:
    fields: dict[str, Any] = {"tool_choice": "required"}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    choice = _chat(url, **fields).json()["choices"][0]
    listed = json.loads(_held_text(url, _calls_schema(one=parallel is False)))
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (c["name"], c["parameters"]) for c in listed
    ]
    assert len({c["id"] for c in calls}) == len(calls) and (parallel is not False or len(calls) == 1)
    for c in calls:
        Draft202012Validator(SCHEMAS[c["function"]["name"]]).validate(json.loads(c["function"]["arguments"]))
    r = _chat(url, stream=True, **fields)  # streamed: the calls whole in the last chunk, nothing before
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    # the first chunk opens the message with no content (content "" there made the SDK's accumulated message
    # "" where the whole one has null)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["choices"][0]["delta"] == {} for c in chunks[1:-1])
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    streamed = [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in last["delta"]["tool_calls"]]
    assert streamed == [(i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(calls)]


@functools.cache
def _compiler() -> Any:
    from specserve.structured import GrammarCompiler

    tok = tiny_tokenizer()
    return GrammarCompiler(tok, [tok.eos_token_id])


def _held(tools: list[dict[str, Any]], calls: list[dict[str, Any]], choice: Any = "required") -> bool:
    """Whether the grammar of a request offering ``tools`` under ``choice`` lets the answer be ``calls`` (named: the
    first call's arguments)."""
    return _holds(tools, json.dumps(calls if choice == "required" else calls[0]["parameters"]), choice)


def _holds(tools: list[dict[str, Any]], text: str, choice: Any = "required") -> bool:
    """Whether that grammar lets the answer be ``text``."""
    from specserve.api.schemas import ChatCompletionRequest
    from specserve.structured import GrammarDeadEnd

    body = {"model": MODEL, "messages": MESSAGES, "tools": tools, "tool_choice": choice}
    fmt = ChatCompletionRequest.model_validate(body).output_format()
    assert fmt is not None
    grammar = _compiler().compile(fmt)
    try:
        grammar.follow(tiny_tokenizer().encode(text, add_special_tokens=False))
    except GrammarDeadEnd:
        return False
    return bool(grammar.matcher.is_accepting())


def test_required_takes_tools_as_deep_as_a_named_call_does() -> None:
    """'required''s list of calls holds each tool's schema two levels down: a tool within the nesting limit on its
    own was a 400 under 'required' (and only there) for the last two levels."""
    from pydantic import ValidationError

    from specserve.api.schemas import ChatCompletionRequest

    def level(k: int) -> dict[str, Any]:  # objects within objects: 2k + 1 levels of containers
        if k == 0:
            return {"type": "integer"}
        props = {"x": level(k - 1)}
        return {"type": "object", "properties": props, "required": ["x"], "additionalProperties": False}

    def value(k: int) -> Any:
        return 1 if k == 0 else {"x": value(k - 1)}

    tools = [{"type": "function", "function": {"name": "deep", "parameters": level(31)}}]  # 63 levels: the limit's 64
    call = {"name": "deep", "parameters": value(31)}
    assert _held(tools, [call], {"type": "function", "function": {"name": "deep"}})
    assert _held(tools, [call])
    assert not _held(tools, [{"name": "deep", "parameters": value(30)}])
    too_deep = [{"type": "function", "function": {"name": "deep", "parameters": {"a": level(32)}}}]  # 66 levels
    for choice in ("required", {"type": "function", "function": {"name": "deep"}}):
        body = {"model": MODEL, "messages": MESSAGES, "tools": too_deep, "tool_choice": choice}
        with pytest.raises(ValidationError, match="nested deeper than 64 levels"):
            ChatCompletionRequest.model_validate(body)


def test_required_calls_hold_each_tool_to_its_own_schemas_references() -> None:
    """A tool's "$ref" resolves from its own schema's root under tool_choice 'required' as when it is named: nested
    in the list of calls, "#" named the list (a tree's child had to be a list of calls) and "#/$defs/X" found no
    $defs (a 400 for Pydantic's nested models)."""

    tree = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    place = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/Loc"}, "near": {"$ref": "#/definitions/Loc"}},
        "required": ["at"],
        "additionalProperties": False,
        "$defs": {"Loc": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "definitions": {"Loc": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }
    tools = [
        {"type": "function", "function": {"name": "tree", "parameters": tree}},
        {"type": "function", "function": {"name": "place", "parameters": place}},
    ]

    def held(calls: list[dict[str, Any]], choice: Any = "required") -> bool:
        return _held(tools, calls, choice)

    nested = {"name": "tree", "parameters": {"name": "a", "child": {"name": "b", "child": {"name": "c"}}}}
    located = {"name": "place", "parameters": {"at": {"x": 1}, "near": {"x": 2}}}
    assert held([nested, located])
    assert held([nested], {"type": "function", "function": {"name": "tree"}})  # (as named)
    assert not held([{"name": "tree", "parameters": {"name": "a", "child": [nested]}}])  # the list is no tree
    assert not held([{"name": "place", "parameters": {"at": {"y": 1}}}])
    # left as they are: an anchor, a subschema with its own $id (its references resolve against it), data that
    # looks like a reference, and a property named as a data keyword holding a reference
    loc = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools[1]["function"]["parameters"] = {
        "type": "object",
        "properties": {
            "at": {"$ref": "#here"},
            "far": {"$id": "https://example.com/far.json", "$ref": "#/$defs/L", "$defs": {"L": loc}},
            "tag": {"const": {"$ref": "#/x"}},
            "default": {"$ref": "#/$defs/L"},
        },
        "required": ["at", "far", "tag", "default"],
        "additionalProperties": False,
        "$defs": {"A": {"$anchor": "here", **loc}, "L": loc},
    }
    marked = {
        "name": "place",
        "parameters": {"at": {"x": 1}, "far": {"x": 2}, "tag": {"$ref": "#/x"}, "default": {"x": 3}},
    }
    assert held([marked])
    assert held([marked], {"type": "function", "function": {"name": "place"}})


def test_required_calls_keep_each_tools_anchors_and_ids_its_own() -> None:
    """Under tool_choice 'required' each tool's schema is a resource of its own: two tools that declare one anchor,
    or nest subschemas under one relative "$id", each read their own. Moved under the list as pointers, they shared
    anchors and ids: the first tool's "#num" read the second's string, so its own integer was refused and a string
    it refuses was forced."""
    int_field, str_field = {"type": "integer"}, {"type": "string"}

    def tool(name: str, key: str, field: dict[str, Any], how: str) -> dict[str, Any]:
        if how == "anchor":
            params = {"properties": {key: {"$ref": "#num"}}, "$defs": {"n": {"$anchor": "num", **field}}}
        else:  # a nested resource, relative to its tool's
            params = {"properties": {key: {"$id": "part.json", "$ref": "#/$defs/N", "$defs": {"N": field}}}}
        parameters = {"type": "object", "required": [key], "additionalProperties": False, **params}
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    for how in ("anchor", "id"):
        tools = [tool("count", "n", int_field, how), tool("label", "s", str_field, how)]
        assert _held(tools, [{"name": "count", "parameters": {"n": 1}}, {"name": "label", "parameters": {"s": "a"}}])
        assert not _held(tools, [{"name": "count", "parameters": {"n": "a"}}]), how
        assert not _held(tools, [{"name": "label", "parameters": {"s": 1}}]), how
    # a tool whose schema has a root "$id" is referred to by it
    own = {"$id": "https://example.com/count.json", "type": "object", "properties": {"n": {"$ref": "#/$defs/N"}},
           "required": ["n"], "additionalProperties": False, "$defs": {"N": int_field}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "count", "parameters": own}}]
    tools.append(tool("label", "s", str_field, "id"))
    assert _held(tools, [{"name": "count", "parameters": {"n": 1}}])
    assert not _held(tools, [{"name": "count", "parameters": {"n": "a"}}])
    # ... unless another tool's has it too (a copied template's): each then its own
    label = {**own, "properties": {"n": {"$ref": "#/$defs/N"}}, "$defs": {"N": str_field}}
    tools[1] = {"type": "function", "function": {"name": "label", "parameters": label}}
    assert _held(tools, [{"name": "count", "parameters": {"n": 1}}, {"name": "label", "parameters": {"n": "a"}}])
    assert not _held(tools, [{"name": "count", "parameters": {"n": "a"}}])
    assert not _held(tools, [{"name": "label", "parameters": {"n": 1}}])


@pytest.mark.parametrize("root_id", ["", "#", 5])
def test_a_tool_whose_root_id_names_no_resource_gets_a_base_of_its_own(root_id: Any) -> None:
    """Kept as the tool's name in the list, "" and "#" named the list itself, whose root the tool's schema then
    became (the answer: bare arguments, as text); 5 (no URI) was a 400."""
    count = {"$id": root_id, "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
             "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "count", "parameters": count}}]
    assert _held(tools, [{"name": "count", "parameters": {"n": 1}}])
    assert not _held(tools, [{"name": "count", "parameters": {"n": "a"}}])
    assert not _holds(tools, '{"n": 1}')


def test_required_calls_cut_by_max_tokens_come_back_as_text(url: str) -> None:
    choice = _chat(url, tool_choice="required", max_tokens=3).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == _chat(url, tool_choice="none", max_tokens=3, structured_outputs={
        "json": _calls_schema(one=False)}).json()["choices"][0]["message"]["content"]  # fmt: skip


def test_tool_choice_none_answers_in_text_and_the_template_sees_the_tools_and_earlier_calls(url: str) -> None:
    choice = _chat(url, tool_choice="none").json()["choices"][0]
    assert "tool_calls" not in choice["message"] and isinstance(choice["message"]["content"], str)
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "f"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = httpx.post(url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.post(url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert text == (
        "<|tools|>[get_weather][roll][now]<|user|>what is the weather?\n"  # (jinja's trim_blocks: no newline)
        "<|assistant|><call get_weather unit=f>\n<|tool|>sunny\n<|assistant|>"
    )
    assert _chat(url, messages=history, tool_choice=NAMED).status_code == 200


def test_an_earlier_calls_arguments_reach_the_template_as_an_object_where_they_are_json() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}
    message = ChatMessage.model_validate({"role": "assistant", "tool_calls": [call, call | {"function": {
        "name": "g", "arguments": "not json"}}]})  # fmt: skip
    assert message.for_template()["tool_calls"] == [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": [1, 2]}}},
        {"id": "c", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({}, "tool_choice", "tool_choice 'auto' (the default beside tools)"),
        ({"tool_choice": "auto"}, "tool_choice", "no parser"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [], "tool_choice": NAMED}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "'fly', which is not one"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "none"}, "tools", "twice: ['get_weather']"),
        ({"tool_choice": NAMED, "continue_final_message": True, "add_generation_prompt": False}, "tool_choice",
         "not a continuation"),
        ({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "description": "\ud800"}}}]}, "tools", "a tool is not UTF-8 text"),
        ({"tool_choice": "none", "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 129}]}, "messages",
         "at most 128"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "no response format"),
        ({"tool_choice": NAMED, "structured_outputs": {"regex": "a"}}, "tool_choice", "no response format"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools",
         "String should match pattern"),
        ({"tool_choice": "required", "ignore_eos": True}, "tools", "not with ignore_eos"),
        ({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"maximum": float("nan")}}}}}]}, "tools", "NaN or Infinity"),
        ({"tool_choice": "required", "stream": True, "resume_from": "1-2-00000000"}, "resume_from",
         "cannot be resumed"),
        ({"tool_choice": "none", "messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages",
         "only an assistant message makes tool_calls"),
    ],
)  # fmt: skip
def test_a_tool_request_this_server_cannot_answer_is_a_400(
    url: str, fields: dict[str, Any], param: str, says: str
) -> None:
    r = _chat(url, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    if "tool_choice" not in fields:
        assert "'required'" in error["message"]  # (it says what to send instead)


def test_tokenize_takes_tools_with_messages_only(url: str) -> None:
    r = httpx.post(url + "/tokenize", json={"prompt": "hi", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and "tools are a chat's" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("parameters", [{}, None], ids=["empty", "left-out"])
def test_a_function_without_parameters_is_called_with_an_empty_object(url: str, parameters: Any) -> None:
    tool = {"type": "function", "function": {"name": "now"} | ({} if parameters is None else {"parameters": {}})}
    named = {"type": "function", "function": {"name": "now"}}
    choice = _chat(url, tools=[tool], tool_choice=named).json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == "{}" and choice["finish_reason"] == "stop"


def test_each_choice_reads_back_its_own_calls(url: str) -> None:
    """n choices of a 'required' stream: each format kept the texts of its own choice (a shared list doubled them,
    and the calls came back as text)."""
    whole = _chat(url, tool_choice="required").json()["choices"][0]["message"]["tool_calls"]
    r = _chat(url, tool_choice="required", stream=True, n=2)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    last = {c["choices"][0]["index"]: c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]}
    for index in (0, 1):
        calls = last[index]["delta"]["tool_calls"]
        assert [c["function"] for c in calls] == [c["function"] for c in whole], index


def test_a_blank_last_event_id_is_no_resume_and_deep_arguments_are_text(url: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", headers={"Last-Event-ID": ""}, timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "tools": TOOLS,
        "tool_choice": "required", "stream": True})  # fmt: skip
    assert r.status_code == 200 and '"finish_reason":"tool_calls"' in r.text, r.text
    deep = "[" * 3000 + "]" * 3000  # (past Python's JSON recursion: was a 500)
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": deep}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    r = httpx.post(url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text  # (the text: the template's ['unit'] of it is undefined, rendered empty)
    call["function"]["arguments"] = '{"unit": ' + "[" * 70 + "]" * 70 + "}"  # (past MAX_SCHEMA_DEPTH: the text)
    assert ToolCallIn.model_validate(call).for_template()["function"]["arguments"] == call["function"]["arguments"]


def test_required_calls_too_deep_to_read_come_back_as_text() -> None:
    deep = "[" * 1500 + "]" * 1500  # (past Python's JSON recursion: a RecursionError, a 500)
    assert required_calls('[{"name": "f", "parameters": {"a": ' + deep + "}}]") is None
    (call,) = required_calls('[{"name": "f", "parameters": {"a": 1.5}}]') or []
    assert call.function.name == "f" and call.function.arguments == '{"a": 1.5}'
    # as deep as JSON reads is a call (written back through Python's own recursion, it came back as text)
    written = '{"a": ' + "[" * 400 + "]" * 400 + "}"
    answer = '[{"name": "f", "parameters": ' + written + "}]"
    assert _holds([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], answer)
    (call,) = required_calls(answer) or []
    assert call.function.arguments == written


@pytest.mark.parametrize(
    "answer",
    [
        *('{"name": "f"}', '["f"]', '[{"name": "f"}]', '[{"parameters": {}}]', '[{"name": 1, "parameters": {}}]'),
        *("[1]", "{}", '""', "[]", "1"),
    ],
)
def test_required_calls_of_another_shape_come_back_as_text(answer: str) -> None:
    assert required_calls(answer) is None


def test_required_calls_keep_the_numbers_and_characters_the_answer_wrote() -> None:
    """Read through a float, 0.99999999999999999 (which the schema's exclusiveMaximum 1 allows, and the grammar
    held) came back 1.0, which the schema refuses; 1e999 could not be written back (json.dumps: Infinity) and
    the call came back as text; non-ASCII came back escaped. A named function's arguments are the answer as is."""
    schema = {"type": "object", "properties": {"x": {"type": "number", "exclusiveMaximum": 1}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    written = '{"x": 0.99999999999999999, "n": [12345678901234567890, 1e999, -0.0], "city": "Zürich"}'
    answer = '[{"name": "f", "parameters": ' + written + "}]"
    assert _holds(tools, answer)  # (an answer the grammar allows)
    (call,) = required_calls(answer) or []
    assert call.function.arguments == written
    assert json.loads(call.function.arguments, parse_float=Decimal)["x"] < 1
    written = '{"x": 0.5, "s": "a\\tb\\n\\"c\\\\", "y": [1, 2]}'
    answer = '[{"name": "f", "parameters": ' + written + '}, {"name": "f", "parameters": {}}]'
    assert _holds(tools, answer)
    assert [c.function.arguments for c in required_calls(answer) or []] == [written, "{}"]
    # escapes the grammar does not write, as written too (read, a lone surrogate's could not be encoded as UTF-8: the
    # response was a 500)
    written = '{"s": "\\ud800 \\u00fc \\/", "\\ud83d": 1}'
    (call,) = required_calls('[{"name": "f", "parameters": ' + written + "}]") or []
    assert json.loads(call.model_dump_json())["function"]["arguments"] == written
    # a repeated key: its last value, as JSON is read
    (call,) = required_calls('[{"name": "f", "parameters": {"a": 1}, "name": "g", "parameters": {"b": 2}}]') or []
    assert (call.function.name, call.function.arguments) == ("g", '{"b": 2}')


def test_tokenize_reads_tools_as_chat_does() -> None:
    assert TokenizeRequest.model_validate({"messages": MESSAGES, "tools": []}).tools is None
    with pytest.raises(ValueError, match="twice"):
        TokenizeRequest.model_validate({"messages": MESSAGES, "tools": [TOOLS[0], TOOLS[0]]})


def test_required_tools_whose_schemas_together_pass_the_limit_are_refused_saying_so(url: str) -> None:
    """Each tool's schema within the 65536-character limit, the three together past it: 'required' holds them in one
    schema the server builds, and the 400 quoted the limit of a string the client never sent."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 300} for i in range(100)}}
    tools = [{"type": "function", "function": {"name": f"t{k}", "parameters": big}} for k in range(3)]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": tools}
    r = httpx.post(f"{url}/v1/chat/completions", json=body | {"tool_choice": "required"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "'required' holds every tool's schema in one" in error["message"], error
    named = {"type": "function", "function": {"name": "t1"}}  # (its own schema alone: not this refusal)
    assert (
        "holds every tool's schema"
        not in httpx.post(f"{url}/v1/chat/completions", json=body | {"tool_choice": named}, timeout=60).text
    )
