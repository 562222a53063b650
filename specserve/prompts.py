"""Prompt -> token ids, the same way ``Engine.encode`` does it (plain text with the tokenizer's own BOS where it adds
one, as vLLM's completions do; chat through the tokenizer's chat template with the generation prompt), so HTTP and
in-process runs see identical ids."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from specserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class PromptEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # each special token's string as plain text, encoded once here: ``split_special_tokens`` is a flag the
        # tokenizer sets on its shared Rust object for the call, so one request's encode would race another's
        self._special_ids = _specials_as_text(tokenizer)
        self._special_pattern = (
            re.compile("|".join(map(re.escape, sorted(self._special_ids, key=len, reverse=True))))
            if self._special_ids
            else None
        )
        if tokenizer is not None and len(tokenizer) > vocab_size:  # added tokens past the embedding's rows
            logger.warning(
                "the tokenizer has %d tokens but the model embeds only %d (ids %d and up, added tokens the model was "
                "not resized for): a prompt that tokenizes to one of them is refused with a 400",
                len(tokenizer),
                vocab_size,
                vocab_size,
            )

    def token_ids(self, ids: list[int]) -> list[int]:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return list(ids)

    def text(self, prompt: str) -> list[int]:
        """A completion prompt's ids: a Llama-2/3 or Mistral tokenizer starts them with its BOS, which the model saw
        at the start of every training text (the chat templates write it themselves)."""
        return self._in_vocabulary(self._tokenizer().encode(prompt, add_special_tokens=True), "prompt")

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat template's ids. A message's text is text: a special token's string typed in it (``<|im_end|>``)
        is tokenized as its characters, as the OpenAI API does, so no message can close its turn and forge another.
        """
        tokenizer = self._tokenizer()
        if tokenizer.chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template")
        specials = self._special_pattern
        texts = [c if isinstance(c := m.get("content"), str) else "" for m in messages]
        if specials is None or not any(specials.search(t) for t in texts):
            return self._in_vocabulary(self._apply_template(messages, tokenize=True), "messages")
        # each special string in a message becomes a marker no text holds; the rendered prompt is tokenized as
        # usual between markers (the template's own special tokens stay special) and each marker as plain text
        marker = f"\ue000{uuid.uuid4().hex}"
        found: list[str] = []

        def to_marker(m: re.Match[str]) -> str:
            found.append(m.group(0))
            return f"{marker}{len(found) - 1}\ue001"

        safe = [{**m, "content": specials.sub(to_marker, t)} if t else m for m, t in zip(messages, texts, strict=True)]
        parts = re.split(f"{marker}(\\d+)\ue001", self._apply_template(safe, tokenize=False))
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self._special_ids[found[int(part)]]
            elif part:
                ids += tokenizer.encode(part, add_special_tokens=False)
        return self._in_vocabulary(ids, "messages")

    def _in_vocabulary(self, ids: list[int], param: str) -> list[int]:
        """The tokenizer's ids, refused where one is past the model's embedding (a tokenizer with added tokens the
        checkpoint was not resized for): on CUDA such an index is a device-side assert that takes the worker down."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"the {param} tokenizes to token id {bad}, which this model cannot embed: its vocabulary has "
                f"{self.vocab_size} tokens (ids [0, {self.vocab_size}))",
                param=param,
            )
        return ids

    def _apply_template(self, messages: list[dict[str, Any]], *, tokenize: bool) -> Any:
        try:
            out: Any = self._tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
        except Exception as e:  # jinja errors for malformed messages
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
        if not tokenize:
            return out
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass the prompt as a list of token ids")
        return self.tokenizer


def _specials_as_text(tokenizer: PreTrainedTokenizerBase | None) -> dict[str, list[int]]:
    """The strings the tokenizer reads as special tokens -> their ids when tokenized as characters."""
    if tokenizer is None:
        return {}
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    words = {t.content for t in decoder.values() if t.special and t.content}
    ids = {w: tokenizer.encode(w, add_special_tokens=False, split_special_tokens=True) for w in sorted(words)}
    tokenizer.encode("", add_special_tokens=False)  # sets the flag back to the tokenizer's default for the requests
    return ids
