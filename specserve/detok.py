"""Incremental detokenisation with stop strings: streams only text that can no longer change."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from transformers import PreTrainedTokenizerBase

from specserve.errors import InvalidRequestError

CONTEXT = 4  # tokens decoded before the settled point with the ones after it (a token's text may depend on them)
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback (Llama-2, Mistral): one byte a token
MAX_CHAR_BYTES = 4  # UTF-8
RESUME_STEP = 16  # output tokens a resume feeds at a time, as steps would (``IncrementalText.resume``)


def skipped_ids(tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The ids decoding drops (``skip_special_tokens``): the named special tokens and every added token marked
    special, named or not (Mistral's control tokens). A duck-typed tokenizer may skip none."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return frozenset(ids)


@dataclass(frozen=True)
class ByteRuns:
    """What runs of byte tokens are made of in a byte-fallback vocabulary (Llama-2's, Mistral's; byte-level BPE,
    SmolLM2's or GPT-2's, has none). Its decoder turns a run of byte tokens into its characters when the run is UTF-8
    as a whole, else into U+FFFD for every byte: a run's text can change with each byte that joins it ("€" + the
    first byte of "😀" decodes to 4 x U+FFFD), so it is only settled once a token that is not a byte ends the run.
    Tokens that decoding skips (special tokens) do not end a run: the bytes on both sides join."""

    bytes: frozenset[int] = frozenset()
    skipped: frozenset[int] = frozenset()
    continuation: frozenset[int] = frozenset()  # the byte tokens 0x80-0xBF: never a character's first byte
    widths: Mapping[int, int] = field(default_factory=dict, hash=False)  # a first byte's token: its character's bytes

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase | None) -> ByteRuns:
        if tokenizer is None:
            return cls()
        found = {i: int(t[3:5], 16) for t, i in tokenizer.get_vocab().items() if BYTE_TOKEN.fullmatch(t)}
        if not found:
            return cls()
        continuation = frozenset(i for i, b in found.items() if 0x80 <= b < 0xC0)
        widths = {i: 2 if b < 0xE0 else 3 if b < 0xF0 else 4 for i, b in found.items() if 0xC0 <= b < 0xF8}
        return cls(frozenset(found), skipped_ids(tokenizer), continuation, widths)

    def char_start(self, token_ids: Sequence[int], i: int) -> int:
        """``i``, or where the tokens before it end inside a character spelt in byte tokens (its first byte and
        fewer of the rest than it has; skipped tokens among them join the run), that first byte's index: the run
        decoded from there is its characters, from inside one U+FFFD for every byte. A complete character before
        ``i`` is not gone back into (a skipped token after it was taken for the middle of one). At most
        ``MAX_CHAR_BYTES`` bytes back: a run of more continuation bytes is not UTF-8 wherever it starts."""
        k, rest = i, 0
        while 0 < k <= len(token_ids) and self._in_run(token_ids[k - 1]) and rest < MAX_CHAR_BYTES:
            k -= 1
            if token_ids[k] in self.continuation:
                rest += 1
            elif token_ids[k] not in self.skipped:
                return k if rest + 1 < self.widths.get(token_ids[k], 1) else i
        return i

    def open_run(self, token_ids: Sequence[int]) -> int:
        """How many tokens at the end belong to a run of byte tokens a later byte may still join: from the run's
        first byte token on (skipped tokens inside or after it included)."""
        n = start = len(token_ids)
        while n and self._in_run(token_ids[n - 1]):
            n -= 1
            if token_ids[n] in self.bytes:
                start = n
        return len(token_ids) - start

    def inside(self, token_ids: Sequence[int], i: int) -> bool:
        """Whether a run of byte tokens may go on across the boundary before token i."""
        return 0 < i < len(token_ids) and self._in_run(token_ids[i]) and self._in_run(token_ids[i - 1])

    def _in_run(self, token: int) -> bool:
        return token in self.bytes or token in self.skipped


class IncrementalText:
    """Turns a growing list of token ids into stable text deltas, stopping at the first stop string.

    ``update`` rebinds its state's attributes and mutates no object they hold: a shallow copy is a snapshot to go back
    to (``Sequence.checkpoint``)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        stop: Sequence[str] = (),
        prompt_ids: Sequence[int] = (),
        runs: ByteRuns | None = None,
        *,
        include_stop: bool = False,
        floor: int = 0,
    ) -> None:
        """``prompt_ids``: its last CONTEXT tokens are decoded before the output's first ones, whose text may
        depend on them (a SentencePiece tokenizer drops the leading space of the first token it decodes);
        ``runs``: ``ByteRuns.of(tokenizer)``, which a caller with many requests computes once; ``include_stop``:
        the text ends with the stop string that stopped it (vLLM's ``include_stop_str_in_output``), not before it;
        ``floor``: a stop string counts only where a token after the first ``floor`` output tokens completes it, one
        ending in their text does not (vLLM's ``min_tokens``)."""
        if stop and tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", param="stop")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.floor = floor
        # the length of the first ``floor`` tokens' text (None: not known yet, before more than ``floor`` tokens)
        self._floor_chars: int | None = None if floor else 0
        self.runs = ByteRuns.of(tokenizer) if runs is None else runs
        # (not from inside a character spelt in byte tokens: a run's bytes decode as a whole, and the output's
        # first bytes may join the prompt's last run)
        self._skipped = skipped_ids(tokenizer)
        start = self.runs.char_start(prompt_ids, max(0, len(prompt_ids) - CONTEXT))
        start = self._with_text(prompt_ids, start, len(prompt_ids))
        self._prefix = list(prompt_ids[start:]) if tokenizer is not None else []
        self._prefix_text = self._decode_ids(self._prefix) if self._prefix else ""
        # the hold-back (``_hold``) reads each character once: per stop string, a matcher's state after the text
        # held back at the last update, which the next one extends
        self._fails = tuple(failure_table(s) for s in self.stop)
        self._reach = max(map(len, self.stop), default=1) - 1  # the longest tail a hold-back can be
        self._states = (0,) * len(self.stop)
        self._read = ""  # the last ``_reach`` characters the states read (a later text must extend them) ...
        self._read_len = 0  # ... and how many they read in all
        self.text = ""  # final text so far (after stop truncation)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False
        self.stop_tokens: int | None = None  # once stopped: output tokens through the one completing the stop string
        self.stop_string: str | None = None  # ... and that stop string (the earliest to start; ties in list order)
        self._seen = 0  # tokens of the last update that found no stop string, short of a run of byte tokens at its end
        self._seen_chars = 0  # ... and the length of their text: no text past it is handed out before they settle
        self._checked = 0  # prefixes whose text was searched for a stop string, without a match
        self._fixed = 0  # leading output tokens whose text is settled: decoded once, not again every update
        self._fixed_text = ""  # their text

    def update(
        self, token_ids: Sequence[int], *, final: bool = False, drop_open: bool = False, search: bool = True
    ) -> str:
        """Feed all output token ids so far; return the new stable text (everything left when final). ``drop_open``
        (with ``final``): the output goes on with a token that is not decoded (a stop token id, as vLLM's), so an
        incomplete character at the end is dropped, not output as U+FFFD, and no stop string is looked for in it.
        ``search`` False: no stop string is looked for (the text a stop token id adds, as vLLM's)."""
        if self.tokenizer is None or self.stopped:
            return ""
        full = self._text_of(token_ids)
        whole_text = final and not drop_open  # a trailing U+FFFD is a character of the text (no byte will follow)
        run = 0 if final else self.runs.open_run(token_ids)  # a run of byte tokens at the end may still change
        if run:
            kept, added = self._since_seen(token_ids, len(token_ids) - run, self._seen_window(token_ids))
            before_run = kept + len(added)
        else:
            before_run = len(full)
        stop_at = None
        past_floor = len(token_ids) > self.floor
        if past_floor and self._floor_chars is None:
            # (the characters they complete: of a run of byte tokens they leave open, not the U+FFFD the run is
            # while a character of it is incomplete)
            complete = self.runs.char_start(token_ids, self.floor)
            self._floor_chars = len(_settled(self._decode(token_ids[:complete]), False))
        past_floor = past_floor and search
        # (only where a stop string may end past the text an earlier update searched: that text cannot change)
        offset = max(0, self._seen_chars - self._reach)
        found = past_floor and self._holds_stop(_settled(full[offset:], whole_text), offset)
        # ... or one that may have been complete in the text of a shorter prefix only (bytes since joined a run of
        # byte tokens and turned its characters into U+FFFD)
        if found or (past_floor and self.stop and any(t in self.runs.bytes for t in token_ids[self._seen :])):
            stop_at = self._tokens_through_stop(token_ids, whole_text) or (len(token_ids) if found else None)
        if stop_at is not None:
            # the text as decoding one token a step would stop it: at the first token that completes a stop
            # string, cut at the earliest stop string in that prefix's text (a later, longer one that starts
            # earlier was not complete yet), however many tokens this update brought
            self.stop_tokens = stop_at
            whole = whole_text and stop_at == len(token_ids)
            through = _settled(self._decode(token_ids[:stop_at]), whole)
            starts = {s: through.find(s, self._first_start(s, 0)) for s in self.stop}
            cut = min(i for i in starts.values() if i >= 0)
            self.stop_string = next(s for s in self.stop if starts[s] == cut)
            end = cut + len(self.stop_string) if self.include_stop else cut
            self.text, self.stopped, final = through[:end], True, True
        else:
            self.text = full if not drop_open else _settled(full, whole_text)
            # not past a text ending in U+FFFD, nor into a run of byte tokens at the end: with a byte-fallback
            # tokenizer, a later byte can hide a run's characters (a stop string's, complete a token before)
            if not full.endswith("\ufffd"):
                self._seen, self._seen_chars = len(token_ids) - run, before_run
        stable = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
                stable = len(self.text.rstrip("\ufffd"))
            stable = min(stable, before_run)  # nor the text of a run of byte tokens that may still change
            if self.stop:  # not past the tokens a later update may still cut (``settled``): text and ids agree
                stable = min(stable, self._seen_chars)
            stable -= self._hold(self.text[:stable])  # a tail that may still become a stop string
        delta = self.text[self.emitted : stable] if stable > self.emitted else ""
        self.emitted = max(self.emitted, stable)
        return delta

    def settled(self, n: int) -> int:
        """Of the n output tokens of the last update, those no later update can cut at a stop string: through the
        one completing it once stopped; else those of the last update whose text did not end in U+FFFD (a stop
        string is searched for past them, ``_tokens_through_stop``)."""
        if self.stopped:
            return min(n, cast(int, self.stop_tokens))
        return n if not self.stop else min(n, self._seen)

    def resume(self, token_ids: Sequence[int], text: str) -> None:
        """Take up an output that was produced and ``text`` of it handed out elsewhere: the next update's delta
        starts after that text. Raises InvalidRequestError where the tokens do not decode to it, or stop. Fed
        ``RESUME_STEP`` tokens at a time: one update of them all searched every prefix for a stop string from the
        first token (a byte token anywhere leaves no earlier search to start from), each decoded whole, quadratic
        in the output on the lane's thread."""
        for n in range(RESUME_STEP, len(token_ids), RESUME_STEP):
            self.update(token_ids[:n])
            if self.stopped:
                break
        self.update(token_ids)
        if self.stopped or not self.text.startswith(text):
            raise InvalidRequestError("the delivered text is not what the delivered tokens decode to")
        self.emitted = len(text)

    def _hold(self, head: str) -> int:
        """The longest k such that ``head`` ends with some stop string's first k characters (k < its length). Reads
        only what ``head`` adds to the last update's, where it extends it (the settled text only grows); else its
        last ``_reach`` characters afresh."""
        reach, done, tail = self._reach, self._read_len, head[max(0, len(head) - self._reach) :]
        if done <= len(head) and head.startswith(self._read, done - len(self._read)) and len(head) - done <= reach:
            new, states = head[done:], self._states
        else:
            new, states = tail, (0,) * len(self.stop)
        self._states = tuple(
            longest_start(s, fail, q, new) for s, fail, q in zip(self.stop, self._fails, states, strict=True)
        )
        self._read, self._read_len = tail, len(head)
        return max(self._states, default=0)

    def _text_of(self, token_ids: Sequence[int]) -> str:
        """decode(token_ids) from the settled text and the tokens after it (decoded with CONTEXT tokens before
        them, whose text is then cut off), so a long output is not decoded whole at every step. Falls back to
        the whole decode where a character straddles the settled point."""
        fixed = self._fixed
        if fixed > len(token_ids):  # (outputs only grow; a caller feeding a shorter list starts over)
            self._fixed, self._fixed_text, fixed = 0, "", 0
        start = self._with_text(token_ids, max(0, fixed - CONTEXT), fixed)
        context = self._decode(token_ids[start:fixed], first=start == 0)
        while context.startswith("\ufffd") and start > max(0, fixed - 3 * CONTEXT):
            # the window starts inside a character: back to its first byte (a byte-fallback tokenizer, Llama-2's or
            # Mistral's, decodes a run of byte tokens that is not UTF-8 as a whole as U+FFFD for every byte)
            start -= 1
            context = self._decode(token_ids[start:fixed], first=start == 0)
        tail = self._decode(token_ids[start:], first=start == 0)
        if not tail.startswith(context):
            return self._decode(token_ids)
        text = self._fixed_text + tail[len(context) :]
        # the last tokens stay open: a later token may change their text, a byte token's that of its whole run (a
        # window starting inside an open run decodes it as U+FFFD, and the whole output was decoded every update)
        settle = len(token_ids) - max(CONTEXT, self.runs.open_run(token_ids))
        if settle - fixed >= CONTEXT:
            head = self._decode(token_ids[start:settle], first=start == 0)
            settled = head[len(context) :]
            whole = head.startswith(context) and not settled.endswith("\ufffd")  # no character cut at `settle`
            if whole and text.startswith(settled, len(self._fixed_text)):
                self._fixed, self._fixed_text = settle, self._fixed_text + settled
        return text

    def _seen_window(self, token_ids: Sequence[int]) -> tuple[int, str]:
        """(start, context): the tokens after ``_seen`` are decoded from ``start``, CONTEXT tokens before them (not
        from inside a run of byte tokens, whose bytes decode as a whole), and the text of those tokens cut off."""
        start = max(0, self._seen - CONTEXT)
        while self.runs.inside(token_ids, start):
            start -= 1
        start = self._with_text(token_ids, start, self._seen)
        return start, self._decode(token_ids[start : self._seen], first=start == 0)

    def _with_text(self, token_ids: Sequence[int], start: int, end: int) -> int:
        """``start``, or earlier: a window token_ids[start:end] that is all tokens decoding skips (special tokens: an
        EOS run under ignore_eos) decodes to nothing, and a SentencePiece decoder then drops the leading space of the
        first token after it, which the window was to keep ("x</s></s></s></s> a" streamed as "xa"). Back to the last
        token decoding keeps (or to 0: the output is then decoded after the prompt's tokens)."""
        if start < end and all(t in self._skipped for t in token_ids[start:end]):
            while start > 0 and token_ids[start] in self._skipped:
                start -= 1
        return start

    def _since_seen(self, token_ids: Sequence[int], n: int, window: tuple[int, str]) -> tuple[int, str]:
        """The text of the first n tokens as (k, added): the first k characters of the text through ``_seen``
        (where no run of byte tokens is open, so later tokens only add to it), then ``added``. The work grows with
        the tokens since ``_seen``, not with the output."""
        start, context = window
        if n >= self._seen:
            tail = self._decode(token_ids[start:n], first=start == 0)
            if tail.startswith(context):
                return self._seen_chars, tail[len(context) :]
        return 0, self._decode(token_ids[:n])

    def _decode(self, token_ids: Sequence[int], *, first: bool = True) -> str:
        """The text of output tokens; ``first``: they start at the output's first token, so they are decoded
        after the prompt's last tokens (whose text is then cut off)."""
        if not (first and self._prefix):
            return self._decode_ids(token_ids)
        both = self._decode_ids([*self._prefix, *token_ids])
        return both[len(self._prefix_text) :] if both.startswith(self._prefix_text) else self._decode_ids(token_ids)

    def _decode_ids(self, token_ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return cast(str, self.tokenizer.decode(cast(list[int], list(token_ids)), skip_special_tokens=True))

    def _first_start(self, stop: str, offset: int) -> int:
        """Where in a text starting at character ``offset`` of the output's a match of ``stop`` that counts may
        start: one ending in the first ``floor`` tokens' text does not."""
        return max(0, (self._floor_chars or 0) - len(stop) + 1 - offset)

    def _holds_stop(self, text: str, offset: int) -> bool:
        return any(text.find(s, self._first_start(s, offset)) >= 0 for s in self.stop)

    def _tokens_through_stop(self, token_ids: Sequence[int], final: bool) -> int | None:
        """The shortest prefix whose text holds a stop string (None: none does): a step that emitted several tokens
        (speculation) may have gone past it, and those tokens are not part of the output. Searched from the last
        update whose text did not end in U+FFFD and left no run of byte tokens open: with byte fallback, a stop
        string complete at a token can vanish again in the next one's text (its run of bytes then not UTF-8 as a
        whole). Prefixes searched by an earlier update are not searched again (their text cannot change)."""
        checked = self._checked if not final else min(self._checked, len(token_ids) - 1)
        window, reach = self._seen_window(token_ids), max(map(len, self.stop)) - 1
        for n in range(max(self._seen, checked, self.floor) + 1, len(token_ids) + 1):
            kept, added = self._since_seen(token_ids, n, window)
            # the text through ``_seen`` holds no stop string: only one ending in what the tokens after it add
            offset = max(0, kept - reach)
            if self._holds_stop(_settled(self.text[offset:kept] + added, final and n == len(token_ids)), offset):
                return n
        self._checked = len(token_ids)
        return None


def _settled(text: str, final: bool) -> str:
    """The text a stop string is looked for in: before the last update, without a trailing U+FFFD (the first bytes
    of a character whose next bytes are still to come decode as one)."""
    return text if final else text.rstrip("\ufffd")


def failure_table(s: str) -> tuple[int, ...]:
    """Knuth-Morris-Pratt's: per i, the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


def longest_start(s: str, fail: tuple[int, ...], state: int, text: str) -> int:
    """The longest k < len(s) for which (a text ending with s[:state]) + ``text`` ends with s[:k]: the matcher of s
    (``fail`` its ``failure_table``) run on, a character at a time."""
    for c in text:
        while state and s[state] != c:
            state = fail[state - 1]
        if s[state] == c:
            state += 1
        if state == len(s):  # the whole of s: a hold-back is shorter (a stop string found is cut elsewhere)
            state = fail[state - 1]
    return state
