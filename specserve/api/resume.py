"""Resumable streams: every SSE event carries an id naming how far the stream has got; a client that lost the
connection resends the same request with that id and gets the rest, token-identical (docs/algorithms.md §1.4:
output is a function of the request alone, so the server regenerates it and skips what was delivered).

An id is ``<tokens>-<bytes>-<crc32>``: output tokens sent, UTF-8 bytes of text sent, and the CRC-32 of that text,
so a replay that would not reproduce the delivered text is reported instead of spliced. The last events add the
phase they close: ``-f`` on the event carrying ``finish_reason``, ``-u`` on the usage event, so that every id is
unique and a resume after either sends neither again.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, replace
from enum import Enum

from specserve.api.error_bodies import APIError, ResumeMismatchError
from specserve.sequence import RequestOutput

_MARK = re.compile(r"(\d{1,12})-(\d{1,15})-([0-9a-f]{8})(?:-([fu]))?")
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
    crc: int = 0  # CRC-32 of the text's first ``text_bytes`` UTF-8 bytes
    phase: StreamPhase = StreamPhase.content

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
        return cls(int(m[1]), int(m[2]), int(m[3], 16), StreamPhase(m[4] or ""))

    def after(self, token_ids: list[int], text: bytes) -> StreamMark:
        return StreamMark(self.tokens + len(token_ids), self.text_bytes + len(text), zlib.crc32(text, self.crc))

    def at(self, phase: StreamPhase) -> StreamMark:
        return replace(self, phase=phase)


class StreamCursor:
    """Follows a request's outputs from its first token and passes on only what lies after ``resume`` (None: all).

    ``advance`` returns the part of an output the client has not seen (None when it has seen all of it), and checks
    on the way that the regenerated text matches what the client was sent.
    """

    def __init__(self, resume: StreamMark | None = None) -> None:
        self.resuming = resume is not None  # the client has had the stream's opening event
        self.resume = resume or StreamMark()
        self.mark = StreamMark()

    def advance(self, out: RequestOutput) -> RequestOutput | None:
        before, text = self.mark, out.text.encode()
        self.mark = before.after(out.token_ids, text)
        cut = self.resume
        if before.text_bytes < cut.text_bytes <= self.mark.text_bytes:
            seen = text[: cut.text_bytes - before.text_bytes]
            if zlib.crc32(seen, before.crc) != cut.crc:
                raise ResumeMismatchError(
                    "the regenerated text differs from what this stream sent before the resume point: resend the "
                    "request unchanged, with the seed the server returned",
                    param=RESUME_PARAM,
                )
        new_text = text[max(0, cut.text_bytes - before.text_bytes) :]
        new_ids = out.token_ids[max(0, cut.tokens - before.tokens) :]
        if not new_text and not new_ids and (not out.finished or self.sent(StreamPhase.finished)):
            return None
        return replace(out, token_ids=new_ids, text=new_text.decode(errors="replace"))

    def sent(self, phase: StreamPhase) -> bool:
        """Whether the client had this phase's event before it resumed."""
        return self.resuming and self.resume.phase.rank >= phase.rank

    def check_reached(self) -> None:
        """At the end of a replay: a resume point beyond everything the request produces was never sent."""
        if self.mark.text_bytes < self.resume.text_bytes or self.mark.tokens < self.resume.tokens:
            raise ResumeMismatchError(
                f"the resume point {self.resume.render()} lies beyond the end of the regenerated stream "
                f"({self.mark.render()})",
                param=RESUME_PARAM,
            )
