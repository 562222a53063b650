"""Streaming in chunks (specserve/coalesce.py): held outputs join into one that carries exactly their news."""

from __future__ import annotations

import random

import pytest

from specserve.coalesce import OutputCoalescer
from specserve.sequence import FinishReason, RequestOutput, RequestStats


def _out(rid: str, tokens: list[int], step: int, total: int, *, done: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        token_ids=tokens,
        text="".join(f"<{t}>" for t in tokens),
        finish_reason=FinishReason.length if done else None,
        num_prompt_tokens=7,
        num_output_tokens=total,
        stats=RequestStats(target_forwards=step),
        committed=len(tokens),
    )


def _steps(rid: str, sizes: list[int]) -> list[RequestOutput]:
    """Outputs of one request, ``sizes`` tokens a step (0: a step that settled none), the last one finishing."""
    outs, total, t = [], 0, 100
    for i, n in enumerate(sizes):
        tokens = list(range(t, t + n))
        t, total = t + n, total + n
        outs.append(_out(rid, tokens, i + 1, total, done=i == len(sizes) - 1))
    return outs


def test_then_joins_the_news_and_keeps_the_later_totals() -> None:
    a, b = _out("r", [1, 2], 1, 2), _out("r", [3], 2, 3, done=True)
    joined = a.then(b)
    assert joined.token_ids == [1, 2, 3] and joined.text == "<1><2><3>" and joined.committed == 3
    assert joined.num_output_tokens == 3 and joined.stats == RequestStats(target_forwards=2)
    assert joined.finish_reason is FinishReason.length and joined.num_prompt_tokens == 7
    assert a.token_ids == [1, 2] and b.token_ids == [3]  # neither is changed


def test_then_refuses_another_requests_output_or_one_after_the_end() -> None:
    with pytest.raises(ValueError, match="'r' and 's'"):
        _out("r", [1], 1, 1).then(_out("s", [2], 1, 1))
    with pytest.raises(ValueError, match="has finished"):
        _out("r", [1], 1, 1, done=True).then(_out("r", [2], 2, 2))


def test_an_interval_of_one_hands_out_every_output_as_it_comes() -> None:
    coalescer = OutputCoalescer(1)
    outs = _steps("r", [1, 0, 2, 1])
    assert [coalescer.offer(o) for o in outs] == outs
    assert coalescer.holding == 0


def test_the_first_tokens_pass_at_once_then_chunks_of_the_interval_and_the_end() -> None:
    coalescer = OutputCoalescer(3)
    passed = [coalescer.offer(o) for o in _steps("r", [0, 1, 1, 1, 2, 1, 1, 1])]
    sizes = [None if p is None else len(p.token_ids) for p in passed]
    # held: the empty prefill step; first tokens at once; then held until 3 are pending; the end with what is held
    assert sizes == [None, 1, None, None, 4, None, None, 3]
    assert passed[1] is not None and passed[1].token_ids == [100]
    last = passed[-1]
    assert last is not None and last.finished and last.num_output_tokens == 8 and coalescer.holding == 0


@pytest.mark.parametrize("seed", range(20))
def test_what_passes_carries_every_token_and_character_once_in_order(seed: int) -> None:
    rng = random.Random(seed)
    interval = rng.randint(1, 6)
    coalescer = OutputCoalescer(interval)
    requests = {f"r{i}": _steps(f"r{i}", [rng.randint(0, 4) for _ in range(rng.randint(1, 12))]) for i in range(3)}
    passed: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    queues = {rid: list(outs) for rid, outs in requests.items()}
    while any(queues.values()):  # the requests' steps interleaved, as a batch's are
        rid = rng.choice([r for r, q in queues.items() if q])
        out = coalescer.offer(queues[rid].pop(0))
        if out is not None:
            passed[rid].append(out)
    for rid, outs in requests.items():
        got = passed[rid]
        assert [t for o in got for t in o.token_ids] == [t for o in outs for t in o.token_ids]
        assert "".join(o.text for o in got) == "".join(o.text for o in outs)
        assert sum(o.committed for o in got) == sum(o.committed for o in outs)
        assert got[-1].finished and got[-1].num_output_tokens == outs[-1].num_output_tokens
        assert not any(o.finished for o in got[:-1])
        if interval > 1:  # between the first tokens and the end, whole chunks (an interval of 1 passes even empty news)
            assert all(len(o.token_ids) >= interval for o in got[1:-1])
    assert coalescer.holding == 0


def test_take_hands_back_what_is_held_and_forgets_the_request() -> None:
    coalescer = OutputCoalescer(4)
    first, second, third = _steps("r", [1, 2, 1])[:3]
    assert coalescer.offer(first) is first
    assert coalescer.offer(second) is None
    held = coalescer.take("r")
    assert held is not None and held.token_ids == second.token_ids and coalescer.holding == 0
    assert coalescer.take("r") is None
    assert coalescer.offer(third) is third  # a request submitted again starts afresh: its first tokens pass


def test_a_finished_request_is_forgotten() -> None:
    """Finishing forgets a request as ``take`` does: its id used again (a request moved back to this lane, or a
    client's id reused) starts afresh, its first tokens passing at once (and the coalescer keeps no entry per
    request it ever served)."""
    coalescer = OutputCoalescer(4)
    first, second, last = _steps("r", [1, 1, 1])
    assert coalescer.offer(first) is first
    assert coalescer.offer(second) is None
    finished = coalescer.offer(last)
    assert finished is not None and finished.finished and coalescer.holding == 0
    again = _steps("r", [1, 2])[0]
    assert coalescer.offer(again) is again


def test_an_interval_below_one_token_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 token"):
        OutputCoalescer(0)


def test_flush_hands_out_everything_held_and_keeps_each_requests_first_tokens_passed() -> None:
    coalescer = OutputCoalescer(8)
    a, b = _steps("a", [1, 2, 2]), _steps("b", [1, 3, 1])
    for out in (a[0], b[0], a[1], b[1]):  # the first tokens pass, the second steps are held
        coalescer.offer(out)
    flushed = {o.request_id: o.token_ids for o in coalescer.flush()}
    assert flushed == {"a": a[1].token_ids, "b": b[1].token_ids} and coalescer.holding == 0
    assert coalescer.flush() == []
    assert coalescer.offer(_out("a", [9], 3, 4)) is None  # not a first output again: held for its chunk


def test_switching_to_an_interval_of_one_keeps_what_was_held() -> None:
    coalescer = OutputCoalescer(4)
    steps = _steps("r", [1, 1, 1])
    coalescer.offer(steps[0])
    assert coalescer.offer(steps[1]) is None
    coalescer.interval = 1
    out = coalescer.offer(steps[2])
    assert out is not None and out.token_ids == steps[1].token_ids + steps[2].token_ids


def test_the_first_text_passes_at_once_after_tokens_without_text() -> None:
    """A first token without text (a character's first byte, text held for a stop string) marked the request
    started: the client got no event for it, and its first text then waited a whole interval (4 steps here). Tokens
    without text pass at once until text has, or until an interval's worth did; without a tokenizer (no text
    ever) the first tokens start the request, as before."""
    coalescer = OutputCoalescer(4)

    def out(tokens: list[int], text: str) -> RequestOutput:
        return RequestOutput("r", tokens, text, None, 7, 0, RequestStats(), committed=len(tokens))

    assert coalescer.offer(out([1], "")) is not None  # no text yet: passes (as before)
    first_text = coalescer.offer(out([2], "é"))
    assert first_text is not None and first_text.text == "é"  # was held until 4 tokens were pending
    assert coalescer.offer(out([3], "a")) is None  # started: held as usual
    tokenless = OutputCoalescer(3)
    passed = [tokenless.offer(RequestOutput("t", [i], "", None, 7, 0, RequestStats(), committed=1)) for i in range(6)]
    assert [p is not None for p in passed] == [True, True, True, False, False, True]
    no_tokenizer = OutputCoalescer(3, texts=False)
    passed = [
        no_tokenizer.offer(RequestOutput("t", [i], "", None, 7, 0, RequestStats(), committed=1)) for i in range(4)
    ]
    assert [p is not None for p in passed] == [True, False, False, True]
