"""Prompt -> token ids, the same way ``Engine.encode`` does it (plain text with the tokenizer's own BOS where it adds
one, as vLLM's completions do; chat through the tokenizer's chat template with the generation prompt), so HTTP and
in-process runs see identical ids."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from specserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class PromptEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
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
        """The chat template's ids. A message's text is text: a control token's string typed in it (``<|im_end|>``)
        is tokenized as its characters, as the OpenAI API does, so no message can close its turn and forge another
        (transformers' ``sanitize_control_tokens``: it marks the spellings in the inputs before rendering and encodes
        them as text, each piece in the context of the text before it, so the ids decode to the rendered prompt)."""
        tokenizer = self._tokenizer()
        if tokenizer.chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template")
        try:
            out: Any = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, sanitize_control_tokens=True
            )
        except Exception as e:  # jinja errors for malformed messages; a spelling the tokenizer makes from plain text
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
        return self._in_vocabulary(list(out["input_ids"] if isinstance(out, Mapping) else out), "messages")

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

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass the prompt as a list of token ids")
        return self.tokenizer
