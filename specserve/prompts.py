"""Prompt -> token ids, the same way ``Engine.encode`` does it (plain text without special tokens; chat through
the tokenizer's chat template with the generation prompt), so HTTP and in-process runs see identical ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from specserve.errors import InvalidRequestError


class PromptEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def token_ids(self, ids: list[int]) -> list[int]:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        return list(ids)

    def text(self, prompt: str) -> list[int]:
        return self._tokenizer().encode(prompt, add_special_tokens=False)

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        tokenizer = self._tokenizer()
        if tokenizer.chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template")
        try:
            out: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja errors for malformed messages
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass the prompt as a list of token ids")
        return self.tokenizer
