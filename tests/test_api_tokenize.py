"""vLLM's /tokenize and /detokenize: the ids a request's prompt is made of, counted before it is sent."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from deployments.tiny_tokenizer import tiny_tokenizer
from specserve.api.schemas import TokenizeRequest
from specserve.api.server import MAX_TOKENIZING, _Routes
from specserve.errors import InvalidRequestError
from specserve.prompts import PromptEncoder
from tests.api_backend import MODEL, LocalBackend, api_server, module_server, requests_by_status

VOCAB = 512  # the tiny model's
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the tea is hot"}]


backend, url = module_server(max_model_len=128)


def post(url: str, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    return dict(r.json())


def test_a_prompts_ids_are_the_completion_requests(url: str) -> None:
    text = "the tea is hot"
    got = post(url, "/tokenize", {"model": MODEL, "prompt": text})
    assert got["tokens"] == tiny_tokenizer().encode(text) and got["count"] == len(got["tokens"]) > 1
    assert got["max_model_len"] == 128 and got["token_strs"] is None
    completion = post(url, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0})
    assert completion["usage"]["prompt_tokens"] == got["count"]
    # the byte-level vocabulary spells a space as "Ġ"
    spelt = post(url, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert spelt["tokens"] == got["tokens"] and "".join(spelt["token_strs"]) == text.replace(" ", "Ġ")
    assert post(url, "/tokenize", {"prompt": ""})["tokens"] == []


def test_a_chats_ids_are_the_chat_requests_with_or_without_the_assistants_opening(url: str) -> None:
    got = post(url, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    rendered = "<|system|>be brief\n<|user|>the tea is hot\n<|assistant|>"  # the tiny chat template's
    assert tiny_tokenizer().decode(got["tokens"]) == rendered
    chat = post(url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == got["count"] == len(got["tokens"])
    as_vllm_sends = {"messages": MESSAGES, "add_special_tokens": False, "return_token_strs": None}
    assert post(url, "/tokenize", as_vllm_sends)["tokens"] == got["tokens"]  # (vLLM's defaults, spelled out)
    bare = post(url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert tiny_tokenizer().decode(bare["tokens"]) == rendered.removesuffix("<|assistant|>")
    prefill = [*MESSAGES, {"role": "assistant", "content": "it is"}]
    left_open = post(
        url, "/tokenize", {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    )
    assert tiny_tokenizer().decode(left_open["tokens"]) == rendered.removesuffix("<|assistant|>") + "<|assistant|>it is"
    # a control token's spelling typed in a message is its characters, as in a chat request
    typed = post(url, "/tokenize", {"messages": [{"role": "user", "content": "</s>"}]})
    assert tiny_tokenizer().convert_tokens_to_ids("</s>") not in typed["tokens"]


def test_detokenize_reads_back_the_ids_special_tokens_included(url: str) -> None:
    ids = post(url, "/tokenize", {"prompt": "hot tea"})["tokens"]
    assert post(url, "/detokenize", {"model": MODEL, "tokens": ids}) == {"prompt": "hot tea"}
    eos = tiny_tokenizer().convert_tokens_to_ids("</s>")
    assert post(url, "/detokenize", {"tokens": [*ids, eos]}) == {"prompt": "hot tea</s>"}
    assert post(url, "/detokenize", {"tokens": []}) == {"prompt": ""}


def test_a_tokenizer_that_adds_a_bos_adds_it_unless_told_not_to() -> None:
    core = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3, "there": 4}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    llama_like = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    backend = LocalBackend(tokenizer=llama_like)
    try:
        with api_server(backend) as url:
            assert post(url, "/tokenize", {"prompt": "hi there"})["tokens"] == [1, 3, 4]
            assert post(url, "/tokenize", {"prompt": "hi there", "add_special_tokens": False})["tokens"] == [3, 4]
    finally:
        backend.stop()


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "says"),
    [
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model", "the model 'other' does not exist"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model", "the model 'other' does not exist"),
        ("/tokenize", {}, 400, None, "send a prompt or messages (one of them)"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None, "send a prompt or messages (one of them)"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, None, "add_generation_prompt and conti"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message", "set"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, None, "add_special_tokens: true is a"),
        ("/tokenize", {"prompt": "a", "continue_final_message": True}, 400, None, "are a chat's: send messages"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", "Input should be a valid string"),
        ("/tokenize", {"prompt": "a", "tokens": [1]}, 400, "tokens", "Extra inputs are not permitted"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages", "a user message needs its content"),
        (
            "/detokenize",
            {"tokens": [1, VOCAB, VOCAB + 1]},
            400,
            "tokens",
            f"in [0, {VOCAB}), not [{VOCAB}, {VOCAB + 1}]",
        ),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "greater than or equal to 0"),
        ("/detokenize", {}, 400, "tokens", "Field required"),
    ],
)
def test_bad_input_is_a_4xx_not_counted_as_a_generation_request(
    url: str, backend: LocalBackend, path: str, body: dict[str, Any], status: int, param: str | None, says: str
) -> None:
    before = requests_by_status(backend)
    error = post(url, path, body, status)["error"]
    assert error["param"] == param and says in error["message"], error
    assert requests_by_status(backend) == before
    assert httpx.post(url + path, content=b"{", timeout=30).status_code == 400
    assert requests_by_status(backend) == before
    # a generation request refused so is one
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": 5}, timeout=30).status_code == 400
    assert httpx.post(url + "/v1/chat/completions", content=b"{", timeout=30).status_code == 400
    assert requests_by_status(backend) == before | {"invalid": before.get("invalid", 0) + 2}


def test_without_a_tokenizer_each_says_so() -> None:
    encoder = PromptEncoder(None, VOCAB)
    with pytest.raises(InvalidRequestError, match="this model has no tokenizer to decode them"):
        encoder.decode([1])
    with pytest.raises(InvalidRequestError, match="this model has no tokenizer to spell them"):
        encoder.pieces([1])


def test_an_id_the_model_embeds_but_the_tokenizer_lacks_is_refused_not_dropped() -> None:
    """Checkpoints pad the embedding past the tokenizer (Qwen2: 151936 rows, 151665 tokens): such an id was
    silently left out of /detokenize's text."""
    tok = tiny_tokenizer()
    encoder = PromptEncoder(tok, len(tok) + 8)
    assert encoder.decode([5, len(tok) - 1]) == tok.decode([5, len(tok) - 1], skip_special_tokens=False)
    with pytest.raises(InvalidRequestError, match=rf"tokens: the tokenizer has no token \[{len(tok)}\]"):
        encoder.decode([5, len(tok)])


def test_calls_hold_a_thread_each_until_it_ends_and_at_most_a_few_run_at_once() -> None:
    """A flood of /tokenize calls would take the executor's threads from generation's prompts: at most
    MAX_TOKENIZING run, the rest wait; a caller that leaves frees its place when its thread ends, not before."""
    backend = LocalBackend()
    running, most, release = 0, 0, threading.Event()
    lock = threading.Lock()
    text = backend.encoder.text

    def slow_text(prompt: str, **kw: Any) -> list[int]:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            assert release.wait(30)
            return text(prompt, **kw)
        finally:
            with lock:
                running -= 1

    backend.encoder.text = slow_text  # type: ignore[method-assign]

    async def flood() -> None:
        routes = _Routes(backend)  # type: ignore[arg-type]
        calls = [asyncio.ensure_future(routes.tokenize(TokenizeRequest(prompt=f"a{k}"))) for k in range(5)]
        while running < MAX_TOKENIZING:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert running == MAX_TOKENIZING
        calls[0].cancel()  # its caller leaves: its thread works on, holding its place
        await asyncio.sleep(0.2)
        assert running == MAX_TOKENIZING and calls[0].cancelled()
        release.set()
        results = await asyncio.gather(*calls[1:])
        assert [r.tokens for r in results] == [tiny_tokenizer().encode(f"a{k}") for k in range(1, 5)]

    try:
        asyncio.run(flood())
        assert most == MAX_TOKENIZING
    finally:
        release.set()
        backend.stop()


def test_a_chat_templates_error_is_quoted_in_part() -> None:
    """transformers' errors may quote the whole rendered chat: a 400 quotes its start."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{{ raise_exception(messages[0]['content']) }}"
    with pytest.raises(InvalidRequestError) as e:
        PromptEncoder(tokenizer, VOCAB).chat([{"role": "user", "content": "x" * 5000}])
    assert str(e.value).startswith("cannot apply the chat template: ") and 500 < len(str(e.value)) < 600
