"""Streaming in chunks of several tokens (``stream_interval``, as vLLM and SGLang call it).

Every output handed to a client stream costs the serving side the same whatever it carries: a wake-up of the event
loop, an SSE event, a message from the router to Serve's HTTP proxy and a write to the socket. At one token a step
that is a share of every token's cost, and on a shared CPU it is taken from the model's forward (docs/benchmarks.md,
"Streaming in chunks"). ``OutputCoalescer`` holds a request's outputs, joined, until ``interval`` tokens are
pending; a request's first text (its time to first token: tokens without text yet, a character's first bytes,
pass at once too, up to an interval's worth) and its last output pass at once. It only delays when
a client sees tokens, never what they are: the joined output carries the same tokens and text as the ones it
replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.sequence import RequestOutput


@dataclass
class OutputCoalescer:
    interval: int = 1  # tokens a held output must reach to pass (1: every output passes as it comes)
    texts: bool = True  # whether outputs carry text (False: a loop without a tokenizer, started by its first tokens)
    _held: dict[str, RequestOutput] = field(default_factory=dict)
    _started: set[str] = field(default_factory=set)  # requests whose first text has passed
    # tokens passed at once with no text yet (a character's first bytes, text held for a stop string: no event for
    # the client, whose first text then waited a whole interval), up to ``interval``
    _textless: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"stream interval must be at least 1 token, got {self.interval}")

    def offer(self, out: RequestOutput) -> RequestOutput | None:
        """The output to hand out now (``out`` joined to what was held for its request), or None: held."""
        held = self._held.pop(out.request_id, None)
        if held is not None:
            out = held.then(out)
        if self.interval == 1:
            return out
        rid = out.request_id
        first = rid not in self._started and bool(out.token_ids)
        if out.finished or first or len(out.token_ids) >= self.interval:
            if out.finished:
                self._started.discard(rid)
                self._textless.pop(rid, None)
            elif out.text or not self.texts:
                self._started.add(rid)
                self._textless.pop(rid, None)
            elif out.token_ids:
                self._textless[rid] = passed = self._textless.get(rid, 0) + len(out.token_ids)
                if passed >= self.interval:
                    self._started.add(rid)
                    del self._textless[rid]
            return out
        self._held[out.request_id] = out
        return None

    def flush(self) -> list[RequestOutput]:
        """Everything held, for a lane that will not step its requests for a while (a target starting, a step over
        a few of them while a failure is isolated): a held token waits for the next chunk, not for the lane."""
        held, self._held = list(self._held.values()), {}
        return held

    def take(self, request_id: str) -> RequestOutput | None:
        """What is held for a request that leaves without finishing (failed, moved, aborted), which forgets it."""
        self._started.discard(request_id)
        self._textless.pop(request_id, None)
        return self._held.pop(request_id, None)

    @property
    def holding(self) -> int:
        return len(self._held)
