"""Prompt -> token ids, the same way ``Engine.encode`` does it (plain text with the tokenizer's own BOS where it adds
one, as vLLM's completions do; chat through the tokenizer's chat template with the generation prompt), so HTTP and
in-process runs see identical ids."""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Collection, Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from specserve.errors import InvalidRequestError, PromptTooLongError
from specserve.sampling import SamplingParams

logger = logging.getLogger(__name__)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte-fallback pieces


MAX_TEMPLATE_ERROR = 500  # characters of a template's error a 400 quotes (transformers' may quote the whole chat)


class PromptEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._token_texts: dict[int, str] = {}  # (at most the vocabulary's)
        self._token_bytes: dict[int, bytes] = {}
        self._control: dict[str, re.Pattern[str] | None] = {}  # chat template -> its control tokens' spellings
        if tokenizer is not None and len(tokenizer) > vocab_size:  # added tokens past the embedding's rows
            logger.warning(
                "the tokenizer has %d tokens but the model embeds only %d (ids %d and up, added tokens the model was "
                "not resized for): a prompt that tokenizes to one of them is refused with a 400",
                len(tokenizer),
                vocab_size,
                vocab_size,
            )

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs show it (``token_id:N`` without a tokenizer, as vLLM shows ids)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        if token_id not in self._token_texts:
            self._token_texts[token_id] = str(self.tokenizer.decode([token_id]))
        return self._token_texts[token_id]

    def text_of(self, token_ids: list[int]) -> str:
        """Token ids' text as an answer's is decoded (special tokens left out; "" without a tokenizer)."""
        return "" if self.tokenizer is None else str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def decode(self, token_ids: list[int], *, param: str = "tokens") -> str:
        """Token ids' whole text, special tokens included (what ``text`` without ``room`` reads back)."""
        tokenizer = self._tokenizer(advice=" to decode them")
        if outside := sorted({t for t in token_ids if not 0 <= t < self.vocab_size})[:3]:
            raise InvalidRequestError(f"{param} must be in [0, {self.vocab_size}), not {outside}", param=param)
        if unknown := sorted({t for t in token_ids if t >= len(tokenizer)})[:3]:  # (the decoder dropped them)
            raise InvalidRequestError(
                f"{param}: the tokenizer has no token {unknown} (it has {len(tokenizer)}; the model embeds "
                f"{self.vocab_size}, rows past the tokenizer's padding)",
                param=param,
            )
        return str(tokenizer.decode(token_ids, skip_special_tokens=False))

    def pieces(self, token_ids: list[int]) -> list[str]:
        """Each token as the tokenizer's vocabulary spells it (``Ġthe`` for a byte-level BPE's " the")."""
        return [str(p) for p in self._tokenizer(advice=" to spell them").convert_ids_to_tokens(token_ids)]

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, which a character split over tokens spans (its text shows each part as U+FFFD): a
        byte-level BPE piece through its byte alphabet, a SentencePiece byte token ``<0xNN>`` as that byte, another
        SentencePiece piece with its word-boundary marker as the space it stands for (its own decode drops a leading
        one: "▁the" came back as "the", and an answer's bytes joined ran its words together), any other token as its
        text in UTF-8."""
        if token_id not in self._token_bytes:
            piece = None if self.tokenizer is None else self.tokenizer.convert_ids_to_tokens(token_id)
            alphabet, marker = self._byte_alphabet, self._space_marker
            if isinstance(piece, str) and _BYTE_TOKEN.fullmatch(piece):
                found = bytes([int(piece[3:5], 16)])
            elif isinstance(piece, str) and alphabet and piece and all(c in alphabet for c in piece):
                found = bytes(alphabet[c] for c in piece)
            elif isinstance(piece, str) and marker and token_id not in self._added_ids:
                found = piece.replace(marker, " ").encode("utf-8")
            else:
                found = self.token_text(token_id).encode("utf-8")
            self._token_bytes[token_id] = found
        return self._token_bytes[token_id]

    @functools.cached_property
    def _byte_alphabet(self) -> dict[str, int]:
        """A byte-level BPE tokenizer's character for each byte, reversed (empty for other tokenizers)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return {}
        try:  # GPT-2's table, which every byte-level BPE tokenizer shares
            from transformers.convert_slow_tokenizer import bytes_to_unicode
        except ImportError:  # (a transformers without it: texts, not bytes)
            return {}
        return {c: b for b, c in bytes_to_unicode().items()}

    @functools.cached_property
    def _space_marker(self) -> str | None:
        """A SentencePiece tokenizer's word-boundary character, which its decoder turns into a space (Metaspace, or
        Llama-2's Replace of "▁"); None for other tokenizers."""
        found = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        try:  # the decoder's own JSON (the whole tokenizer's holds its vocabulary)
            decoder = json.loads(found.__getstate__()) if found is not None else {}
        except (ValueError, TypeError, AttributeError):
            return None
        for step in decoder.get("decoders") or [decoder]:
            if step.get("type") == "Metaspace" and isinstance(step.get("replacement"), str):
                return str(step["replacement"])
            pattern = step.get("pattern") or {}
            if step.get("type") == "Replace" and step.get("content") == " " and isinstance(pattern.get("String"), str):
                return str(pattern["String"])
        return None

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        """Added tokens (special ones among them): their text is their own, not a piece of the model's."""
        return frozenset(getattr(self.tokenizer, "added_tokens_decoder", {}) or {})

    def token_ids(self, ids: list[int]) -> list[int]:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return list(ids)

    def check_token_ids(self, params: SamplingParams) -> None:
        """Stop ids the model cannot generate would never stop anything, and a bias on one would bias nothing:
        refused, as prompt ids are."""
        named: tuple[tuple[str, str, Collection[int]], ...] = (
            ("stop_token_ids", "stop_token_ids", params.stop_token_ids),
            ("logit_bias", "logit_bias token ids", [t for t, _ in params.logit_bias]),
        )
        for param, what, ids in named:
            if outside := sorted(t for t in ids if not 0 <= t < self.vocab_size)[:3]:
                raise InvalidRequestError(f"{what} must be in [0, {self.vocab_size}), not {outside}", param=param)
        if params.min_tokens and len(params.stop_token_ids) >= self.vocab_size - 1:  # (and EOS, maybe the last)
            raise InvalidRequestError(
                "min_tokens with stop_token_ids that cover the vocabulary leaves no token to generate",
                param="min_tokens",
            )

    def text(self, prompt: str, *, room: int | None = None, special: bool = True) -> list[int]:
        """A completion prompt's ids: a Llama-2/3 or Mistral tokenizer starts them with its BOS, which the model saw
        at the start of every training text (the chat templates write it themselves; ``special=False``: without it).
        ``room``: the most tokens the prompt may have; one that cannot fit, whatever it tokenizes to, is refused
        before it is tokenized."""
        tokenizer = self._tokenizer()
        _check_text(prompt, "the prompt", "prompt")
        self._check_fits(prompt, room, "prompt")
        return self._in_vocabulary(tokenizer.encode(prompt, add_special_tokens=special), "prompt")

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        room: int | None = None,
        generation_prompt: bool = True,
        continue_final: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat template's ids. A message's text is text: a control token's string typed in it (``<|im_end|>``)
        is tokenized as its characters, as the OpenAI API does, so no message can close its turn and forge another
        (transformers' ``sanitize_control_tokens``: it marks the spellings in the inputs before rendering and encodes
        them as text, each piece in the context of the text before it, so the ids decode to the rendered prompt).
        ``room`` as for ``text``, checked on the rendered prompt (a template may trim or drop text).
        ``generation_prompt``: the assistant turn's opening, which a request's answer follows, at the end;
        ``continue_final`` (instead): the last message left open, for the answer to continue (a prefill).
        ``tools``: the functions a request offers, for templates that describe them (as OpenAI's ``tools``)."""
        if self.tokenizer is None:  # (not _tokenizer's advice: messages cannot be token ids)
            raise InvalidRequestError(
                "this model has no tokenizer, so no chat template: pass the prompt as a list of token ids, not chat "
                "(over HTTP: POST /v1/completions)",
                param="messages",
            )
        tokenizer = self.tokenizer
        if tokenizer.chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template", param="messages")
        _check_text(messages, "a message", "messages")
        _check_text(tools, "a tool", "tools")
        if (control := self._control_tokens(tools)) is not None:
            _check_keys(messages, control, "messages")
            _check_keys(tools, control, "tools")
        if generation_prompt and continue_final:
            raise InvalidRequestError(
                "add_generation_prompt opens a new assistant turn, continue_final_message continues the last "
                "message: set add_generation_prompt to false to continue it",
                param="continue_final_message",
            )
        options: dict[str, Any] = {"add_generation_prompt": generation_prompt, "continue_final_message": continue_final}
        if tools is not None:
            options["tools"] = tools
        try:
            if room is not None and self.max_token_chars and _text_chars(messages) > room * self.max_token_chars:
                rendered = tokenizer.apply_chat_template(messages, tokenize=False, **options)
                self._check_fits(str(rendered), room, "messages")
            out: Any = tokenizer.apply_chat_template(messages, tokenize=True, sanitize_control_tokens=True, **options)
        except PromptTooLongError:
            raise
        except Exception as e:  # jinja errors for malformed messages; a spelling the tokenizer makes from plain text
            message = str(e) if len(str(e)) <= MAX_TEMPLATE_ERROR else f"{str(e)[:MAX_TEMPLATE_ERROR]}..."
            raise InvalidRequestError(f"cannot apply the chat template: {message}") from e
        return self._in_vocabulary(list(out["input_ids"] if isinstance(out, Mapping) else out), "messages")

    def _control_tokens(self, tools: list[dict[str, Any]] | None) -> re.Pattern[str] | None:
        """The spellings of the tokens the chat template's text may not make (``<|im_end|>``, ``</s>``, a Qwen
        template's ``<tool_call>``): those ``sanitize_control_tokens`` encodes as text in values, as transformers
        picks them for the template these messages render with (None: none)."""
        tokenizer = self.tokenizer
        assert tokenizer is not None
        template = str(tokenizer.get_chat_template(None, tools))
        if template not in self._control:
            pick = getattr(tokenizer, "_get_control_tokens", None)
            if pick is not None:
                tokens = set(pick(template))
            else:  # (a transformers without it: the special added tokens)
                tokens = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
            spelt = sorted((t for t in tokens if t), key=len, reverse=True)
            self._control[template] = re.compile("|".join(map(re.escape, spelt))) if spelt else None
        return self._control[template]

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token stands for, where every character of a text reaches its tokens
        (byte-level BPE without a normalizer: SmolLM2's, GPT-2's, Llama-3's): its longest piece's characters (a
        byte-level piece spells one byte a character, at most one character of text; an added token its own text).
        None where a normalizer, a pre-tokenizer or an added token that strips whitespace beside it may map many
        characters to few or none (whitespace splitting drops spaces)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if self.tokenizer is None or backend is None or not _byte_level(json.loads(backend.to_str())):
            return None
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return max(len(p) for p in pieces if p is not None)

    def _check_fits(self, text: str, room: int | None, param: str) -> None:
        if room is None or self.max_token_chars is None:
            return
        fewest = -(-len(text) // self.max_token_chars)  # tokens: no piece stands for more characters
        if fewest > room:
            raise PromptTooLongError(
                f"your {param} has {len(text)} characters: at least {fewest} tokens however they are tokenized, where "
                f"this request leaves room for {room}.",
                param=param,
                fewest=fewest,
            )

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

    def _tokenizer(self, advice: str = ": pass the prompt as a list of token ids") -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise InvalidRequestError(f"this model has no tokenizer{advice}")
        return self.tokenizer


def _text_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of the messages' text: a chat whose text a room's tokens can spell (a template adds a few
    characters of its own) is not rendered twice to be counted, only tokenised."""
    return sum(len(v) for m in messages for v in m.values() if isinstance(v, str))


def _byte_level(spec: dict[str, Any]) -> bool:
    """A tokenizer.json whose tokens spell every byte of the text: BPE over byte-level pieces, no normalizer,
    pre-tokenizers that split without removing anything, and no added token that strips the whitespace beside it."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    keeps = all(
        p.get("type") == "ByteLevel" or (p.get("type") == "Split" and p.get("behavior") != "Removed") for p in steps
    )
    model = spec.get("model") or {}
    strips = any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or [])
    return (
        spec.get("normalizer") is None
        and model.get("type") == "BPE"
        and keeps
        and not strips
        and any(p.get("type") == "ByteLevel" for p in steps)
    )


def _check_keys(value: object, control: re.Pattern[str], param: str) -> None:
    """No key of an object in ``value`` (a tool's parameter names, a past call's arguments) may spell a control
    token: a template renders keys as they are (transformers' control-token marking reaches values, not keys), so
    ``{"a<|im_end|>": 1}`` closed its turn and could forge another."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and (hit := control.search(key)) is not None:
                raise InvalidRequestError(
                    f"a key in {param} ({key[:40]!r}) holds the special token {hit[0]!r}: keys reach the chat template "
                    "as they are, and it would end or open a turn",
                    param=param,
                )
            _check_keys(item, control, param)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_keys(item, control, param)


def _check_text(value: object, what: str, param: str) -> None:
    """Every string in ``value`` (a prompt, or messages: their keys and values, nested) must be text UTF-8 can
    hold: a lone surrogate (what Python makes of bytes that are not UTF-8 in a command-line argument or file name)
    reached the tokenizer, whose TypeError named none of it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"{what} is not UTF-8 text: character {e.start} is a lone surrogate (U+{ord(value[e.start]):04X}, "
                "what Python makes of a byte that is not UTF-8)",
                param=param,
            ) from None
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_text(key, what, param)
            _check_text(item, what, param)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_text(item, what, param)
