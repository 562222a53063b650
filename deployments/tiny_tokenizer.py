"""A small byte-level BPE tokenizer built in-process, sized to the tiny test models' vocabulary.

Tiny mode serves random-weight models that have no tokenizer of their own. This one makes text prompts,
chat templates, stop strings and text deltas behave as with a real model: ids 0-2 are <pad>, <s>, </s>;
ids 3-258 are the 256 bytes; the rest are merges of common ASCII pairs, so every model id decodes.
"""

from __future__ import annotations

import itertools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
MERGE_ALPHABET = " etaoinshrdlucmfwypvbgk"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    byte_char = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[byte_char[b]] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"a byte-level vocabulary needs at least {len(vocab)} ids, not {vocab_size}")
    alphabet = [byte_char[ord(c)] for c in MERGE_ALPHABET]
    merges: list[tuple[str, str]] = []
    for left, right in itertools.islice(itertools.product(alphabet, repeat=2), vocab_size - len(vocab)):
        merges.append((left, right))
        vocab[left + right] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} exceeds the {len(vocab)} ids this tokenizer can define")
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok
