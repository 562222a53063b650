"""Resumable streams: every SSE event carries an id naming how far the stream has got; a client that lost the
connection resends the same request with that id and gets the rest, token-identical (docs/algorithms.md §1.4:
output is a function of the request alone, so the server regenerates it and skips what was delivered).

An id is ``<tokens>-<bytes>-<crc32>``: output tokens sent, UTF-8 bytes of text sent, and a CRC-32 of both (that
text's CRC-32 xor the CRC-32 of those token ids as 4-byte little-endian integers), so a replay that would not
reproduce the delivered tokens and text is reported instead of spliced, checked before anything past the resume
point is sent. The last events add the phase they close: ``-f`` on the event carrying ``finish_reason``, ``-u`` on
the usage event, so that every id is unique and a resume after either sends neither again (and a replay that goes
on past a finished stream's end is reported).
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass, replace
from enum import Enum

from specserve.api.error_bodies import APIError, ResumeMismatchError
from specserve.sequence import RequestOutput

_MARK = re.compile(r"([0-9]{1,12})-([0-9]{1,15})-([0-9a-f]{8})(?:-([fu]))?")
RESUME_PARAM = "resume_from"


class StreamPhase(str, Enum):
    """What the stream has sent besides content, in order."""

    content = ""
    finished = "f"  # the event with finish_reason
    usage = "u"  # the usage event (stream_options.include_usage)

    @property
    def rank(self) -> int:
        return list(StreamPhase).index(self)


@dataclass(frozen=True)
class StreamMark:
    """How far a stream has got after one of its events."""

    tokens: int = 0
    text_bytes: int = 0
    text_crc: int = 0  # CRC-32 of the text's first ``text_bytes`` UTF-8 bytes
    token_crc: int = 0  # CRC-32 of the first ``tokens`` token ids (``_token_bytes``)
    phase: StreamPhase = StreamPhase.content

    @property
    def crc(self) -> int:
        return self.text_crc ^ self.token_crc

    def render(self) -> str:
        suffix = f"-{self.phase.value}" if self.phase != StreamPhase.content else ""
        return f"{self.tokens}-{self.text_bytes}-{self.crc:08x}{suffix}"

    @classmethod
    def parse(cls, value: str) -> StreamMark:
        m = _MARK.fullmatch(value.strip())
        if m is None:
            raise APIError(
                f"{RESUME_PARAM} / Last-Event-ID {value[:40]!r} is not an event id of this server "
                "(<tokens>-<bytes>-<crc32>[-f|-u])",
                param=RESUME_PARAM,
            )
        return cls(int(m[1]), int(m[2]), text_crc=int(m[3], 16), phase=StreamPhase(m[4] or ""))  # the combined CRC

    def after(self, token_ids: list[int], text: bytes) -> StreamMark:
        return StreamMark(
            self.tokens + len(token_ids),
            self.text_bytes + len(text),
            zlib.crc32(text, self.text_crc),
            zlib.crc32(_token_bytes(token_ids), self.token_crc),
        )

    def at(self, phase: StreamPhase) -> StreamMark:
        return replace(self, phase=phase)


class StreamCursor:
    """Follows a request's outputs from its first token and passes on only what lies after ``resume`` (None: all).

    ``advance`` returns the part of an output the client has not seen (None when it has seen all of it). Nothing
    is passed on until the regenerated stream has reached the resume point in both tokens and text and matched the
    point's CRC there; a resume after the finish event also requires the regenerated stream to end at it.
    """

    def __init__(self, resume: StreamMark | None = None) -> None:
        self.resuming = resume is not None  # the client has had the stream's opening event
        self.resume = resume or StreamMark()
        self.mark = StreamMark()
        self.text_crc_at_cut: int | None = None if self.resuming and self.resume.text_bytes else 0
        self.token_crc_at_cut: int | None = None if self.resuming and self.resume.tokens else 0
        self.checked = not self.resuming

    def advance(self, out: RequestOutput) -> RequestOutput | None:
        before, text = self.mark, out.text.encode()
        self.mark = before.after(out.token_ids, text)
        cut = self.resume
        if self.text_crc_at_cut is None and cut.text_bytes <= self.mark.text_bytes:
            inside = cut.text_bytes - before.text_bytes
            if 0 < inside < len(text) and text[inside] & 0xC0 == 0x80:  # a UTF-8 continuation byte: no event ends
                raise ResumeMismatchError(  # there, and the rest would start with the character's tail as U+FFFD
                    f"the resume point {cut.render()} falls inside a character: it is no event of this stream",
                    param=RESUME_PARAM,
                )
            self.text_crc_at_cut = zlib.crc32(text[:inside], before.text_crc)
        if self.token_crc_at_cut is None and cut.tokens <= self.mark.tokens:
            seen = _token_bytes(out.token_ids[: cut.tokens - before.tokens])
            self.token_crc_at_cut = zlib.crc32(seen, before.token_crc)
        if not self.checked:
            m = self.mark  # text is a function of the tokens: past the point in one, short of it in the other, never
            if (m.tokens < cut.tokens and m.text_bytes > cut.text_bytes) or (
                m.tokens > cut.tokens and m.text_bytes < cut.text_bytes
            ):
                raise ResumeMismatchError(
                    f"the resume point {cut.render()} is not a point of the regenerated stream (it reached "
                    f"{m.render()}): resend the request unchanged, with the seed the server returned",
                    param=RESUME_PARAM,
                )
            if self.text_crc_at_cut is None or self.token_crc_at_cut is None:
                return None  # the resume point lies further on
            if self.text_crc_at_cut ^ self.token_crc_at_cut != cut.crc:
                raise ResumeMismatchError(
                    "the regenerated output differs from what this stream sent before the resume point: resend the "
                    "request unchanged, with the seed the server returned",
                    param=RESUME_PARAM,
                )
            self.checked = True
        new_text = text[max(0, cut.text_bytes - before.text_bytes) :]
        new_ids = out.token_ids[max(0, cut.tokens - before.tokens) :]
        if (new_text or new_ids) and self.sent(StreamPhase.finished):
            raise ResumeMismatchError(
                f"the regenerated stream goes on past the end the client was sent ({cut.render()}): resend the "
                "request unchanged",
                param=RESUME_PARAM,
            )
        if not new_text and not new_ids and (not out.finished or self.sent(StreamPhase.finished)):
            return None
        skipped = len(out.token_ids) - len(new_ids)
        logprobs = None if out.logprobs is None else out.logprobs[skipped:]
        return replace(out, token_ids=new_ids, text=new_text.decode(errors="replace"), logprobs=logprobs)

    @staticmethod
    def passed_over(out: RequestOutput, part: RequestOutput | None) -> list[int]:
        """The tokens of ``out`` that ``advance`` did not pass on (``part``: what it did)."""
        return out.token_ids[: len(out.token_ids) - (0 if part is None else len(part.token_ids))]

    def sent(self, phase: StreamPhase) -> bool:
        """Whether the client had this phase's event before it resumed."""
        return self.resuming and self.resume.phase.rank >= phase.rank

    def check_reached(self) -> None:
        """At the end of a replay: a resume point beyond everything the request produces was never sent."""
        if not self.checked:
            raise ResumeMismatchError(
                f"the resume point {self.resume.render()} lies beyond the end of the regenerated stream "
                f"({self.mark.render()})",
                param=RESUME_PARAM,
            )


def _token_bytes(token_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)
