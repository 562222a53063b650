"""Load tooling: SSE parsing, the loopback guard, trace recording from the engine, the one-lane simulator, the
straggler CLI on tiny models, and (``-m load``) a short Locust run against a tiny Serve deployment."""

from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI

from load.client import (
    ALLOW_REMOTE_ENV,
    EventKind,
    LoadSettings,
    RemoteHostError,
    SSEDecoder,
    SSEEvent,
    StreamStats,
    check_loopback,
    parse_sse_data,
    parse_sse_text,
    sse_lines,
)
from load.cost import (
    HOST_TERMS,
    CostModel,
    Curve,
    FitKind,
    RooflineName,
    fit_knots,
    fit_quality,
    level_rows,
    measure_cost_model,
    run_weights,
)
from load.simulate import (
    SimConfig,
    SimRequest,
    SimResult,
    ValidationMode,
    simulate,
    trace_pool,
    tree_nodes,
    validate,
)
from load.traces import (
    CostSample,
    RunSettings,
    RunTrace,
    SeqStep,
    SeqTrace,
    StepRecorder,
    StepTrace,
    TreeSeqTrace,
    TreeStep,
    WorkloadKind,
    cost_samples,
    level_tokens,
    read_traces,
    sequence_traces,
    tree_sequence_traces,
    write_traces,
)
from specserve.bench.batch_sweep import run_one
from specserve.bench.policies import PolicyName, policy_specs
from specserve.config import Drafter, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from tests.ports import serve_app

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny forwards are dominated by thread start-up; on a shared 2-core box two threads run ~50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ─────────────────────────── SSE and the loopback guard ───────────────────────────


def _chunk(
    delta: dict[str, str] | None = None,
    finish: str | None = None,
    usage: dict[str, int] | None = None,
    *,
    ascii: bool = True,  # False: every character raw, as pydantic writes them
) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=ascii)}\n\n"


CHAT_STREAM = "".join(
    [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}),
        ": keep-alive\n\n",
        _chunk({"content": "lo"}),
        _chunk({"content": " world"}, "length"),
        _chunk(usage={"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}),
        "data: [DONE]\n\n",
    ]
)


def test_sse_stream_statistics() -> None:
    stats = parse_sse_text(CHAT_STREAM, dt=0.01)  # line i arrives at i * 10 ms; an event with its blank line
    assert stats.text == "Hello world"
    assert stats.done and stats.failure() is None
    assert stats.finish_reason == "length"
    assert (stats.prompt_tokens, stats.completion_tokens, stats.output_tokens) == (7, 5, 5)
    assert stats.chunk_times == pytest.approx([0.03, 0.07, 0.09])
    assert stats.ttft_s == pytest.approx(0.03)
    assert stats.tpot_s == pytest.approx((0.09 - 0.03) / 4)  # per token after the first, from usage
    assert stats.itl_s == pytest.approx([0.04, 0.02])
    # usage on the last chunk with text (servers that send it there), or on every chunk (vLLM's
    # continuous_usage_stats): the last one counts, as the usage chunk's does (it was read off no chunk with a choice,
    # and the TPOT came from 3 chunks for 8 tokens)
    with_choices = "".join(
        [
            _chunk({"content": "Hel"}, usage={"prompt_tokens": 7, "completion_tokens": 2}),
            _chunk({"content": "lo"}),
            _chunk({"content": " world"}, "length", usage={"prompt_tokens": 7, "completion_tokens": 8}),
            "data: [DONE]\n\n",
        ]
    )
    stats = parse_sse_text(with_choices, dt=0.01)
    assert (stats.prompt_tokens, stats.completion_tokens, stats.output_tokens) == (7, 8, 8)
    assert stats.tpot_s == pytest.approx((stats.chunk_times[-1] - stats.chunk_times[0]) / 7)
    # the last step's tokens have no text (an EOS run under ignore_eos): its chunk, finish reason and no content,
    # is when they came (TPOT read 2 chunks' time over 9 tokens, half its value, and ITL lost the last gap)
    textless_end = "".join(
        [
            _chunk({"content": "Hel"}),
            _chunk({"content": "lo"}),
            _chunk({}, "length"),
            _chunk(usage={"prompt_tokens": 7, "completion_tokens": 10}),
            "data: [DONE]\n\n",
        ]
    )
    stats = parse_sse_text(textless_end, dt=0.01)
    assert stats.chunk_times == pytest.approx([0.01, 0.03])
    assert stats.tpot_s == pytest.approx((0.05 - 0.01) / 9)
    assert stats.itl_s == pytest.approx([0.02, 0.02])


def test_sse_events_and_failures() -> None:
    decoder = SSEDecoder()
    assert [decoder.feed(line) for line in ["", ": comment", "event: x", "", b"data: [DONE]\n", "\n"]] == [
        None, None, None, None, None, "[DONE]",
    ]  # fmt: skip
    assert parse_sse_data("[DONE]").kind == EventKind.done
    text = parse_sse_data('{"choices":[{"text":"abc","finish_reason":null}]}')  # /v1/completions chunks
    assert text.kind == EventKind.content and text.text == "abc"
    err = parse_sse_text('data: {"error":{"message":"lane died","type":"server_error"}}\n\n')
    assert err.failure() == "lane died"
    truncated = parse_sse_text(CHAT_STREAM.replace("data: [DONE]", ""))
    assert truncated.failure() is not None and "DONE" in truncated.failure()  # type: ignore[operator]
    assert parse_sse_text("data: {not json\n\ndata: [DONE]\n\n").failure().startswith("malformed")  # type: ignore[union-attr]
    no_usage = parse_sse_text("".join(line for line in CHAT_STREAM.splitlines(keepends=True) if "usage" not in line))
    assert no_usage.output_tokens == 3 and no_usage.failure() is None  # content chunks: a lower bound


SEPARATED = "one\u2028two\u2029three\x85four"  # JSON leaves them raw; str.splitlines and httpx break lines there


def test_sse_lines_break_only_where_the_sse_format_does() -> None:
    body = (
        b"id: 1\r\n" + _chunk({"content": SEPARATED}, ascii=False).replace("\n\n", "\r\n\r\n").encode()
        + b"data: [DONE]\r" + b"\r"
    )  # fmt: skip
    whole = list(sse_lines([body]))
    assert whole == ["id: 1", _chunk({"content": SEPARATED}, ascii=False).strip(), "", "data: [DONE]", ""]
    for cut in range(1, len(body)):  # a CR LF or a character may arrive split across two reads
        assert list(sse_lines([body[:cut], body[cut:]])) == whole
    stats = parse_sse_text(_chunk({"content": SEPARATED}, ascii=False) + "data: [DONE]\n\n")
    assert stats.failure() is None and stats.text == SEPARATED


def test_an_event_is_assembled_from_its_lines_as_the_sse_format_says() -> None:
    """``data`` lines join with a newline (one JSON chunk over two lines was two malformed payloads); a blank line
    dispatches the event, so an event the stream's end cuts off counts for nothing; one space after the colon goes,
    none is needed; ``id`` holds for the events after it."""
    split = 'data: {"choices":[{"index":0,\ndata:"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    stats = parse_sse_text(split + "data:[DONE]\n\n")
    assert stats.failure() is None and stats.text == "hi"
    cut = parse_sse_text(split + "data: [DONE]\n")  # the sentinel's event never ended
    assert cut.text == "hi" and cut.failure() == "the stream ended without data: [DONE]"
    decoder = SSEDecoder()
    lines = ["id: 7", "data:  two spaces", "data", "", "data: x", "", "retry: 10", "event: e", "id", "data: y", ""]
    assert [d for line in lines if (d := decoder.feed(line)) is not None] == [" two spaces\n", "x", "y"]
    assert decoder.last_event_id == ""  # (the last ``id`` line had no value)

    import httpx

    from load.straggler import _stream_one

    body = (split + "data: [DONE]\n\n").encode()
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body))) as client:
        swept = _stream_one(client, "http://127.0.0.1:1", {}, 60.0)
    assert swept.failure() is None and swept.text == "hi"


def test_an_event_ended_by_bare_crs_is_dispatched_with_the_read_that_ends_it() -> None:
    """A CR at the end of a read ends its line at once (an LF opening the next read is dropped as its pair): held
    back for a possible LF, a CR-ended event came out with the next read, up to a keep-alive interval late."""
    reads: list[bytes] = []

    def arriving(chunks: list[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            reads.append(chunk)
            yield chunk

    def dispatched(chunks: list[bytes]) -> list[tuple[str, int]]:
        reads.clear()
        decoder, out = SSEDecoder(), []
        for line in sse_lines(arriving(chunks)):
            if (data := decoder.feed(line)) is not None:
                out.append((data, len(reads)))
        return out

    assert dispatched([b'data: {"a":1}\r\r', b": keep-alive\r\r", b"data: [DONE]\r\r"]) == [
        ('{"a":1}', 1), ("[DONE]", 3),
    ]  # fmt: skip
    # a CR LF split across reads (an empty read between) is one break, not a CR and an empty line
    assert dispatched([b"data: x\r", b"", b"\n\r", b"\ndata: y\r\n", b"\r\n"]) == [("x", 3), ("y", 5)]
    # one byte order mark before the first line is no part of it
    assert dispatched([b"\xef\xbb\xbfdata: z\n\n"]) == [("z", 1)]


def test_the_sweeps_client_reads_a_chunk_with_line_separators_in_its_text() -> None:
    import httpx

    from load.straggler import _stream_one

    body = (_chunk({"content": SEPARATED}, ascii=False) + _chunk({}, "length") + "data: [DONE]\n\n").encode()
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body))) as client:
        stats = _stream_one(client, "http://127.0.0.1:1", {}, 60.0)
    assert stats.failure() is None and stats.text == SEPARATED


MISSHAPEN_CHUNKS = [
    '{"choices": [{"delta": "hi"}]}',
    '{"choices": [{"text": 5}]}',
    '{"choices": [{"delta": {"content": ["a"]}}]}',
    '{"choices": ["a"]}',
    '{"choices": {"0": {"text": "a"}}}',
    '{"choices": [{"text": "a", "finish_reason": 1}]}',
    '{"choices": [{"text": "a", "token_ids": ["1"]}]}',
    '{"choices": [], "usage": {"completion_tokens": "3"}}',
    '{"choices": [], "usage": 3}',
    '{"choices": [], "seed": "7"}',
    "5",
]


@pytest.mark.parametrize("payload", MISSHAPEN_CHUNKS)
def test_a_misshapen_chunk_fails_its_request_in_the_sweeps_client_not_the_sweep(payload: str) -> None:
    import httpx

    from load.straggler import _stream_one

    body = (_chunk({"content": "ok"}) + f"data: {payload}\n\n" + "data: [DONE]\n\n").encode()
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body))) as client:
        stats = _stream_one(client, "http://127.0.0.1:1", {}, 60.0)
    assert stats.failure() is not None and "unexpected SSE payload" in stats.failure()  # type: ignore[operator]
    assert stats.text == "ok"


@pytest.mark.parametrize("payload", ["1" * 5000, "[" * 100_000, '{"choices": [{"text": ' + "9" * 5000 + "}]}"])
def test_json_python_refuses_to_read_fails_its_request_not_the_sweep(payload: str) -> None:
    """An integer past int()'s digit limit is a ValueError and deep nesting a RecursionError, not a
    JSONDecodeError: either ended the whole sweep with a traceback."""
    import httpx

    from load.straggler import _stream_one

    body = (_chunk({"content": "ok"}) + f"data: {payload}\n\n" + "data: [DONE]\n\n").encode()
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body))) as client:
        stats = _stream_one(client, "http://127.0.0.1:1", {}, 60.0)
    assert stats.failure() is not None and "malformed SSE payload" in stats.failure()  # type: ignore[operator]
    assert stats.text == "ok"


def test_well_formed_chunks_read_with_their_optional_fields() -> None:
    usage = parse_sse_data('{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}')
    assert usage == SSEEvent(EventKind.usage, completion_tokens=2, prompt_tokens=4)
    # the server's own usage chunk: its speculation extension is an object of its own
    spec = '"speculation": {"drafted": 6, "accepted": 4, "acceptance_rate": 0.67}'
    usage = parse_sse_data(f'{{"choices": [], "usage": {{"prompt_tokens": 4, "completion_tokens": 2, {spec}}}}}')
    assert usage == SSEEvent(EventKind.usage, completion_tokens=2, prompt_tokens=4)
    chat = parse_sse_data('{"choices": [{"delta": null, "finish_reason": "stop", "token_ids": [3]}], "seed": 1}')
    assert chat == SSEEvent(EventKind.other, finish_reason="stop")
    bare_error = parse_sse_data('{"error": "lane gone"}')
    assert bare_error == SSEEvent(EventKind.error, error="lane gone")


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8000", "http://localhost:8000/", "127.0.0.5:9000", "http://[::1]:8000", "https://localhost"],
)
def test_loopback_accepted(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_REMOTE_ENV, raising=False)
    assert check_loopback(url) == (url if "://" in url else f"http://{url}")  # a bare host:port is plain HTTP


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1",
        "http://localhost:abc",
        "localhost:99999",
        "ftp://localhost",
        "http://evil.example\\@127.0.0.1:8000",  # urllib3 (Locust) connects to evil.example; urlsplit read loopback
        "evil.example\\@localhost",
        "http://evil.example\t@127.0.0.1",
    ],
)
def test_a_url_that_names_no_host_is_refused_by_name(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad URLs ended in tracebacks from urlsplit / httpx (and after the engine sweep for load.straggler); ones that
    clients read as different hosts are refused, whatever SPECSERVE_ALLOW_REMOTE says."""
    monkeypatch.setenv(ALLOW_REMOTE_ENV, "1")
    with pytest.raises(RemoteHostError, match="cannot read a host"):
        check_loopback(url)


def test_straggler_refuses_a_server_it_cannot_use_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listening, and a server that is not an OpenAI one: a one-line --url error, exit 2 (were an
    httpx.ConnectError and a JSONDecodeError traceback, after the engine sweep)."""
    import http.server
    import threading

    from load.straggler import main
    from tests.ports import free_port

    assert main(["--url", f"127.0.0.1:{free_port()}", "--http-only", "--out", str(tmp_path)]) == 2
    assert "--url: cannot reach http://127.0.0.1:" in capsys.readouterr().err

    class NotOpenAI(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *args: object) -> None:
            """No request log on stderr (the test reads stderr)."""

    server = http.server.HTTPServer(("127.0.0.1", 0), NotOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert main(["--url", f"http://127.0.0.1:{server.server_port}", "--out", str(tmp_path)]) == 2
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert "did not answer with an OpenAI model list" in err and "Traceback" not in err, err


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000", "http://[::]:80"])
def test_remote_refused_unless_overridden(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_REMOTE_ENV, raising=False)
    with pytest.raises(RemoteHostError, match=ALLOW_REMOTE_ENV):
        check_loopback(url)
    assert check_loopback(url, allow_remote=True) == url
    monkeypatch.setenv(ALLOW_REMOTE_ENV, "1")
    assert check_loopback(url) == url
    with pytest.raises(RemoteHostError):
        check_loopback(None)


def test_load_settings_refuse_endless_timeouts_and_waits() -> None:
    """inf, and a finite value the socket's or the sleep's clock cannot hold (1e10 s: an OverflowError out of httpx
    ended the sweep with a traceback)."""
    from load.straggler import StudyConfig

    for name in ("SPECSERVE_TIMEOUT_S", "SPECSERVE_WAIT_MIN_S", "SPECSERVE_WAIT_MAX_S"):
        for value in ("inf", "1e10"):
            with pytest.raises(ValueError, match=name.removeprefix("SPECSERVE_").lower()):
                LoadSettings.from_env({name: value})
    assert LoadSettings.from_env({"SPECSERVE_TIMEOUT_S": "30"}).timeout_s == 30.0
    with pytest.raises(ValueError, match="http_timeout_s"):
        StudyConfig(http_timeout_s=1e10)
    assert StudyConfig(http_timeout_s=30.0).http_timeout_s == 30.0


def test_load_settings_from_env() -> None:
    s = LoadSettings.from_env(
        {"SPECSERVE_CATEGORIES": "coding:3, writing", "SPECSERVE_MAX_TOKENS": "32", "SPECSERVE_POLICY": "dsde"}
    )
    assert s.categories == {"coding": 3.0, "writing": 1.0} and s.max_tokens == 32
    assert s.policy == SLPolicyKind.dsde
    pool = s.prompt_pool()
    assert set(pool) == {"coding", "writing"} and all(pool.values())
    body = s.body(pool["coding"][0], "tiny")
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["speculation"] == {"policy": "dsde"} and body["max_tokens"] == 32
    with pytest.raises(ValueError, match="unknown MT-bench categories"):
        LoadSettings.from_env({"SPECSERVE_CATEGORIES": "nope"}).prompt_pool()
    for bad in (
        {"SPECSERVE_CATEGORIES": "coding:0"},  # every task would raise "total of weights must be greater than zero"
        {"SPECSERVE_CATEGORIES": "coding:-1,writing:1"},
        {"SPECSERVE_CATEGORIES": "coding:nan"},
        {"SPECSERVE_CATEGORIES": "coding:abc"},
        {"SPECSERVE_WAIT_MIN_S": "5", "SPECSERVE_WAIT_MAX_S": "1"},
        {"SPECSERVE_TEMPERATURE": "3"},  # above OpenAI's 2: the server refuses it on every request
    ):
        with pytest.raises(ValueError):
            LoadSettings.from_env(bad)


def test_locust_refuses_bad_settings_before_any_user_starts(tmp_path: Path) -> None:
    if importlib.util.find_spec("locust") is None:  # not imported here: Locust monkey-patches the process
        pytest.skip("locust is not installed (pip install locust)")
    env = dict(os.environ, SPECSERVE_MAX_TOKENS="0")
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "locust", "-f", "load/locustfile.py", "--headless", "-u", "1", "-r", "1", "-t", "30s"]
    out = subprocess.run(
        [*cmd, "--host", "http://127.0.0.1:9"], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "bad SPECSERVE_* load settings" in out.stderr, out.stderr[-2000:]


# ─────────────────────────── simulator ───────────────────────────


def _constant_cost(draft_level: float = 0.002, verify: float = 0.01, host: float = 0.001) -> CostModel:
    return CostModel(
        source="test",
        draft_level=Curve.constant(draft_level),
        verify=Curve.constant(verify),
        overhead=Curve.constant(host),
    )


def _seq(cls: str, accepts: list[bool], klds: list[float], max_tokens: int = 48, prompt_len: int = 8) -> SeqTrace:
    return SeqTrace(cls=cls, prompt_len=prompt_len, max_tokens=max_tokens, accepts=accepts, klds=klds)


def test_curve_and_lockstep_draft_cost() -> None:
    c = Curve(points=[(0, 1.0), (10, 1.0), (20, 3.0)])
    assert [c(x) for x in (-5, 0, 5, 10, 15, 20, 30)] == pytest.approx([1, 1, 1, 1, 2, 3, 5])
    assert Curve.linear(1.0, -1.0)(5) == 0.0  # never negative
    with pytest.raises(ValueError):
        Curve(points=[(1, 0), (1, 2)])
    cost = CostModel(source="t", draft_level=Curve.linear(1.0, 0.5), verify=Curve.constant(0.0))
    # depths 4,1,1: level 1 has 3 rows, levels 2-4 one row (the straggler) -> (1 + 1.5) + 3 * (1 + 0.5)
    assert cost.draft_s([4, 1, 1]) == pytest.approx(7.0)
    assert cost.draft_s([0, 0]) == 0.0


def test_all_accept_static_matches_analytic_throughput() -> None:
    sl, batch, m = 4, 8, 47
    pool = [_seq("a", [True] * 50, [0.01] * 50, max_tokens=m)]
    cost = _constant_cost()
    spec = policy_specs(static_sl=sl)[PolicyName.static]
    reqs = [SimRequest(pool[0], m, 8) for _ in range(batch)]
    res = simulate(reqs, SimConfig(batch_size=batch, policy=PolicyName.static, spec=spec), cost)
    # every drafted token accepted: SL + 1 tokens per row and step, until the last step's 2 tokens left (room for
    # 1 draft): 9 steps of SL 4 and one of SL 1
    depths = [sl] * (m // (sl + 1)) + [m % (sl + 1) - 1]
    assert sum(d + 1 for d in depths) == m and depths[-1] == 1
    seconds = sum(d * 0.002 + 0.01 + 0.001 for d in depths)
    assert res.steps == len(depths) and res.tokens == batch * m
    assert res.tok_s == pytest.approx(batch * m / seconds)
    assert res.idle_fraction == 0.0 and res.mean_sl == pytest.approx(sum(depths) / len(depths))
    assert res.ttft_s == pytest.approx([sl * 0.002 + 0.011] * batch)
    # two waves: the second batch is admitted when the first finishes
    res2 = simulate(reqs * 2, SimConfig(batch_size=batch, policy=PolicyName.static, spec=spec), cost)
    assert res2.steps == 2 * len(depths) and res2.tok_s == pytest.approx(res.tok_s)
    plain = simulate(reqs, SimConfig(batch_size=batch, policy=PolicyName.plain, spec=SpecConfig()), cost)
    assert plain.steps == m and plain.tok_s == pytest.approx(batch * m / (m * 0.011))


def test_the_simulator_replays_the_step_budget_a_sweep_ran_with() -> None:
    """A sweep with ``--max-step-tokens`` was replayed without it: every row drafted its whole SL each step."""
    sl, batch, m, budget = 4, 8, 47, 24
    pool = [_seq("a", [True] * 50, [0.01] * 50, max_tokens=m)]
    spec = policy_specs(static_sl=sl)[PolicyName.static]
    reqs = [SimRequest(pool[0], m, 8) for _ in range(batch)]
    free = simulate(reqs, SimConfig(batch_size=batch, policy=PolicyName.static, spec=spec), _constant_cost())
    cfg = SimConfig(batch_size=batch, policy=PolicyName.static, spec=spec, max_step_tokens=budget)
    capped = simulate(reqs, cfg, _constant_cost())
    assert capped.tokens == free.tokens == batch * m
    drafted = sum(d * c for d, c in capped.sl_hist.items())
    assert drafted <= (budget - batch) * capped.steps < sl * batch * capped.steps  # drafts + one row each per step
    assert capped.steps > free.steps
    # mean SL over every row of the drafting steps, rows the budget left at 0 too (as the engine sweep's): it was
    # over the drafting rows alone (1.0 here, each drafting one level), above the measured column beside it
    tight = SimConfig(batch_size=batch, policy=PolicyName.static, spec=spec, max_step_tokens=12)
    few = simulate(reqs, tight, _constant_cost())
    drafted = sum(d * c for d, c in few.sl_hist.items())
    assert set(few.sl_hist) == {1} and few.mean_sl < 0.6
    assert few.mean_sl == pytest.approx(drafted / (batch * few.steps), rel=0.05)


def test_a_row_the_step_budget_skips_has_its_draft_read_what_it_missed() -> None:
    """The draft reads every token it has not seen when its row drafts: the simulator charged a prompt only where
    its row drafted on its first step, and never what a skipped row missed (a budget of one drafted token a step:
    the two rows take turns; the second's prompt was never priced)."""
    spec = policy_specs(static_sl=4)[PolicyName.static]
    prompt, m = 10, 20
    pool = _seq("a", [True, True, False] * 20, [0.1] * 60, max_tokens=m, prompt_len=prompt)
    cost = CostModel(source="t", draft_level=Curve.constant(0.0), draft_prefill_token_s=1.0,
                     verify=Curve.constant(0.0), overhead=Curve.constant(0.001))  # fmt: skip
    reqs = [SimRequest(pool, m, prompt)] * 2
    free = simulate(reqs, SimConfig(batch_size=2, policy=PolicyName.static, spec=spec), cost)
    assert free.draft_s == 2 * (prompt - 1)  # both draft at their prefill: each reads its prompt, one token beyond
    turns = simulate(reqs, SimConfig(batch_size=2, policy=PolicyName.static, spec=spec, max_step_tokens=3), cost)
    drafting_steps = sum(turns.sl_hist.values())
    assert turns.sl_hist.keys() == {1} and drafting_steps == turns.steps  # one row drafts a step, in turn
    # the first: its prompt (9 beyond one); the second: its prompt and the token of the step it missed (10); every
    # later drafting step: the one token its row took while the other drafted
    assert turns.draft_s == (prompt - 1) + prompt + (drafting_steps - 2)


def test_the_cost_fit_counts_what_a_skipped_rows_draft_reads() -> None:
    """The fit took a drafting row's extra level-0 tokens as the target's (its prompt at its first step, else 0): a
    row that drafted only after plain steps read its prompt and those steps' tokens unpriced."""

    def step(*seqs: tuple[int, int, int]) -> StepTrace:  # (req, fed, depth)
        rows = [SeqStep(req=r, fed=f, depth=d, drafted=d, accepted=0) for r, f, d in seqs]
        return StepTrace(t_end=0.0, batch=len(rows), levels=max(d for _, _, d in seqs), cap=None, draft_s=0.0,
                         verify_s=0.0, overhead_s=0.0, emitted=len(rows), seqs=rows)  # fmt: skip

    steps = [step((0, 10, 2), (1, 7, 0)), step((0, 1, 0), (1, 1, 0)), step((0, 1, 2), (1, 1, 2))]
    run = _timed_run(PolicyName.static, 0, 100.0).model_copy(update={"steps": steps})
    # row 0: its prompt at once (9), then a step missed (1); row 1: prompt 7 and two steps' tokens (8)
    assert [x.draft_extra_fed for x in cost_samples([run])] == [9, 0, 1 + 8]


def test_the_simulator_drafts_a_chains_model_share_as_the_engine_does() -> None:
    """With model_max_sl a chain's draft model drafts at most that many levels of the planned SL (the step loop's
    model_depth); the simulator drafted, verified and accepted the whole planned SL."""
    sl, m, cap = 6, 40, 2
    pool = [_seq("a", [True] * 50, [0.01] * 50, max_tokens=m)]
    spec = policy_specs(static_sl=sl)[PolicyName.static].model_copy(update={"model_max_sl": cap})
    res = simulate([SimRequest(pool[0], m, 8)], SimConfig(batch_size=1, policy=PolicyName.static, spec=spec),
                   _constant_cost())  # fmt: skip
    assert res.tokens == m and res.steps == -(-m // (cap + 1))  # cap + 1 tokens a step (was SL + 1: 6 steps)
    assert res.sl_hist == {cap: m // (cap + 1), 1: 1}  # the last step, a token left, drafts one level


def test_a_policy_the_sweep_did_not_record_is_simulated_with_the_sweeps_settings() -> None:
    """dsde_ddd_nocap, simulated by default beside dsde_ddd, which the default sweep records, took the defaults'
    budget, beam and limits: the tree row's SL_cap gain compared other settings too."""
    from types import SimpleNamespace

    from load.simulate import _specs_from_runs

    recorded = policy_specs(budget=32, beam_width=8, static_sl=3)
    runs = [
        SimpleNamespace(policy=p, spec=recorded[p].model_copy(update={"max_sl": 5}))
        for p in (PolicyName.static, PolicyName.dsde_ddd)
    ]
    specs = _specs_from_runs(runs)  # type: ignore[arg-type]
    nocap = specs[PolicyName.dsde_ddd_nocap]
    assert (nocap.budget, nocap.beam_width, nocap.max_sl) == (32, 8, 5)
    assert nocap.policy == SLPolicyKind.dsde and not nocap.dsde.cap_enabled
    assert specs[PolicyName.dsde_ddd].dsde.cap_enabled and specs[PolicyName.ddd].policy == SLPolicyKind.static
    assert (specs[PolicyName.ddd].budget, specs[PolicyName.dsde_cap].max_sl) == (32, 5)
    assert specs[PolicyName.dsde_cap].policy == SLPolicyKind.dsde and specs[PolicyName.dsde_cap].dsde.cap_enabled
    assert specs[PolicyName.static].sl == 3 and specs[PolicyName.dsde_nocap].method == SpecMethod.chain


def test_the_simulator_refuses_guarded_traces_and_mixed_step_budgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from load import simulate as sim_cli

    plain, ddd = PolicyName.plain, PolicyName.ddd
    base = RunSettings(tiny_noise=0.01)
    guarded = base.model_copy(update={"guard": True})
    for name, settings, says in [
        ("guarded", [guarded, guarded], "under the throughput guard"),
        ("mixed", [base, base.model_copy(update={"max_step_tokens": 64})], "different step budgets"),
        ("threads", [base, base.model_copy(update={"threads": 1})], "whose steps cost differently"),
        ("pairs", [base, base.model_copy(update={"tiny_noise": 0.5})], "whose steps cost differently"),
    ]:
        pairs = zip((plain, ddd), settings, strict=True)
        runs = [_timed_run(p, 0, 50.0).model_copy(update={"settings": s}) for p, s in pairs]
        write_traces(tmp_path / name / "traces.jsonl", runs)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            sim_cli.main(["--traces", str(tmp_path / name / "traces.jsonl"), "--out", str(tmp_path / "sim")])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert sim_cli.step_budget([_timed_run(plain, 0, 50.0)]) is None  # traces recorded before runs kept settings
    # sweeps of other model pairs, or of other devices, threads or kernels, cannot share a cost model or a pool;
    # other seeds and lengths only draw other requests
    other_pair = _timed_run(ddd, 0, 50.0).model_copy(update={"pair": "smollm2-int8", "settings": base})
    assert "different model pairs" in str(sim_cli.replay_problem([_timed_run(plain, 0, 50.0), other_pair]))
    seeded = base.model_copy(update={"seed": 3, "min_tokens": 8, "max_tokens": 40})
    runs = [_timed_run(p, 0, 50.0).model_copy(update={"settings": s}) for p, s in ((plain, base), (ddd, seeded))]
    assert sim_cli.replay_problem(runs) is None


def _hetero_pool(seed: int = 0) -> dict[str, list[SeqTrace]]:
    rng = random.Random(seed)
    n = 400
    good = [_seq("good", [True] * n, [0.02 + 0.002 * rng.random() for _ in range(n)], max_tokens=200)]
    bad_acc = [rng.random() < 0.3 for _ in range(n)]
    bad = [_seq("bad", bad_acc, [0.8 + 0.4 * rng.random() for _ in range(n)], max_tokens=200)]
    return {"good": good, "bad": bad}


def test_sl_cap_lowers_idle_fraction_on_heterogeneous_batch() -> None:
    pool = _hetero_pool()
    # 4 waves through a batch of 16, long all-accepting requests among short low-acceptance ones: post-warm-up
    # sequences of both kinds share the batch (warm-up sequences are exempt from the cap)
    reqs = [SimRequest(pool["good"][0], 400, 8) if i % 2 else SimRequest(pool["bad"][0], 100, 8) for i in range(64)]
    # a GPU-like draft: a level costs the same however many rows are still drafting
    cost = CostModel(source="t", draft_level=Curve.constant(0.002), verify=Curve.constant(0.01))
    specs = policy_specs()
    nocap, cap = (
        simulate(reqs, SimConfig(batch_size=16, policy=p, spec=specs[p]), cost)
        for p in (PolicyName.dsde_nocap, PolicyName.dsde_cap)
    )
    assert cap.cap_hist and not nocap.cap_hist
    assert cap.idle_fraction < nocap.idle_fraction - 0.03
    assert cap.tok_s > 1.1 * nocap.tok_s
    assert cap.mean_sl < nocap.mean_sl
    again = simulate(reqs, SimConfig(batch_size=16, policy=PolicyName.dsde_cap, spec=specs[PolicyName.dsde_cap]), cost)
    assert again.tok_s == cap.tok_s  # deterministic


def _tree(steps: list[tuple[int, int, float]], cls: str = "t", max_tokens: int = 48) -> TreeSeqTrace:
    """A tree trace from (depth, accepted, kld) steps; 15 nodes per tree, the DDD stop rule's own depth."""
    return TreeSeqTrace(
        cls=cls,
        prompt_len=8,
        max_tokens=max_tokens,
        steps=[TreeStep(depth=d, stopped=True, drafted=15, accepted=a, kld=[k] * (a + 1)) for d, a, k in steps],
    )


def test_tree_replay_matches_analytic_throughput() -> None:
    # every recorded DDD step: 3 levels, 2 of its nodes accepted -> 3 tokens per row and step
    trace = _tree([(3, 2, 0.1)] * 20, max_tokens=30)
    spec = policy_specs(beam_width=4, budget=16)[PolicyName.ddd]
    reqs = [SimRequest(trace, 30, 8) for _ in range(4)]
    res = simulate(reqs, SimConfig(batch_size=4, policy=PolicyName.ddd, spec=spec), _constant_cost())
    # the last step has 3 tokens left: room for 2 levels, both accepted (3 tokens still)
    seconds = 9 * (3 * 0.002 + 0.011) + (2 * 0.002 + 0.011)
    assert res.steps == 10 and res.tokens == 120 and res.mean_sl == pytest.approx(2.9) and res.idle_fraction == 0.0
    assert res.tok_s == pytest.approx(120 / seconds)
    # a depth budget below the recorded depth cuts the tree: 2 levels, at most 2 accepted
    shallow = spec.model_copy(update={"ddd_max_depth": 2})
    res2 = simulate(reqs, SimConfig(batch_size=4, policy=PolicyName.ddd, spec=shallow), _constant_cost())
    assert res2.mean_sl == 2 and res2.steps == 10  # accepted 2 of the recorded 2: still 3 tokens per step
    deep = _tree([(3, 3, 0.1)] * 20, max_tokens=30)
    res3 = simulate([SimRequest(deep, 30, 8)], SimConfig(batch_size=1, policy=PolicyName.ddd, spec=shallow),
                    _constant_cost())  # fmt: skip
    assert res3.steps == 10  # cut to 2 levels: 2 accepted + bonus instead of 3 + bonus (8 steps)
    assert [tree_nodes(d, 4, 16) for d in (0, 1, 2, 5)] == [0, 4, 15, 15]


def test_a_cut_tree_is_priced_within_the_draft_models_own_budget_and_the_recorded_nodes() -> None:
    """A tree the replay cuts shorter than recorded verified what reranking keeps within ``budget``, though the
    draft model's trees are reranked within its own ``model_budget``: a recorded 4-level tree of 7 nodes cut to 2
    levels verified 15."""
    from load.simulate import _Seq

    spec = SpecConfig(method=SpecMethod.ddd, beam_width=4, budget=16, model_budget=8)
    trace = TreeSeqTrace(
        cls="c", prompt_len=8, max_tokens=32, steps=[TreeStep(depth=4, stopped=False, drafted=7, accepted=3)]
    )
    depth, _, nodes, accepted, _ = _Seq(SimRequest(trace, 32, 8), spec, None).tree_outcome(2, spec)
    assert (depth, accepted, nodes) == (2, 2, 7)
    wide = SpecConfig(method=SpecMethod.ddd, beam_width=4, budget=16)  # a recorded tree of 40 nodes (fewer kept)
    trace = trace.model_copy(update={"steps": [TreeStep(depth=4, stopped=False, drafted=40, accepted=3)]})
    assert _Seq(SimRequest(trace, 32, 8), wide, None).tree_outcome(2, wide)[2] == 15  # min(T - 1, 4 + 16)
    # KLDs where the accepted path had beams: a path accepted to the cut's last level ends at a leaf without q (the
    # engine's tree gives 2 values there; the replay gave 3, one from a node that is a leaf once cut)
    klds = [0.1, 0.2, 0.3, 0.4, 0.5]
    trace = trace.model_copy(update={"steps": [TreeStep(depth=5, stopped=False, drafted=30, accepted=4, kld=klds)]})
    assert _Seq(SimRequest(trace, 32, 8), wide, None).tree_outcome(2, wide)[4] == [0.1, 0.2]
    assert _Seq(SimRequest(trace, 32, 8), wide, None).tree_outcome(5, wide)[4] == klds  # uncut: as recorded


def test_the_replay_tells_dsde_the_verified_depth_as_serving_does(dsde_observed: list[tuple[int, int]]) -> None:
    """Serving's DSDE observes the depth of the tree verified (the rerank may drop levels the draft grew); the
    replay passed the levels grown, so its fully accepted trees counted as partly rejected. Recorded steps carry
    the verified depth; older traces (None) fall back to the levels grown."""
    observed = dsde_observed
    spec = policy_specs(beam_width=4, budget=16)[PolicyName.dsde_ddd]
    steps = [TreeStep(depth=6, stopped=True, verified=3, drafted=15, accepted=3, kld=[0.1] * 4)] * 12
    trace = TreeSeqTrace(cls="t", prompt_len=8, max_tokens=24, steps=steps)
    simulate(
        [SimRequest(trace, 24, 8)], SimConfig(batch_size=1, policy=PolicyName.dsde_ddd, spec=spec), _constant_cost()
    )
    assert observed and all(d == 3 for d, _ in observed)
    old = trace.model_copy(update={"steps": [st.model_copy(update={"verified": None}) for st in steps]})
    observed.clear()
    simulate([SimRequest(old, 24, 8)], SimConfig(batch_size=1, policy=PolicyName.dsde_ddd, spec=spec), _constant_cost())
    assert observed[0] == (4, 3)  # the levels replayed (DSDE's SL starts at 4)


def test_tree_sl_cap_lowers_idle_fraction() -> None:
    # DSDE as DDD's depth budget: confident sequences grow deep trees, hopeless ones shallow ones
    good = _tree([(11, 11, 0.02)] * 300, "good", 400)
    bad = _tree([(11, 0, 1.0)] * 300, "bad", 100)
    reqs = [SimRequest(good, 400, 8) if i % 2 else SimRequest(bad, 100, 8) for i in range(64)]
    cost = CostModel(source="t", draft_level=Curve.constant(0.002), verify=Curve.constant(0.01))
    specs = policy_specs(beam_width=4, budget=16)
    nocap, cap = (
        simulate(reqs, SimConfig(batch_size=16, policy=p, spec=specs[p]), cost)
        for p in (PolicyName.dsde_ddd_nocap, PolicyName.dsde_ddd)
    )
    assert cap.cap_hist and not nocap.cap_hist
    assert cap.idle_fraction < nocap.idle_fraction - 0.03 and cap.mean_sl < nocap.mean_sl
    assert max(nocap.sl_hist) == 11  # never deeper than recorded (DDD's n)


def _samples(truth: CostModel, n: int, seed: int = 0, trees: bool = False, plain: float = 0.0) -> list[CostSample]:
    """Random steps priced by ``truth``: chains, trees of width 4 when ``trees`` (half of them), and plain
    decoding steps with probability ``plain``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = rng.randint(1, 32)
        is_plain = rng.random() < plain
        depths = [0] * b if is_plain else [rng.randint(0, 8) for _ in range(b)]
        drafting = [d for d in depths if d > 0]
        width = 4 if trees and rng.random() < 0.5 else 1
        extra = rng.choice([0, 0, 0, rng.randint(10, 200)])
        s = CostSample(
            batch=b,
            levels=max(depths),
            depth_sum=sum(drafting),
            level_rows=level_rows(depths),
            level_tokens=level_tokens(depths, [width] * b) if width > 1 else None,
            tree_rows=len(drafting) if width > 1 else 0,
            tree_row_levels=sum(d - 1 for d in drafting) if width > 1 else 0,
            drafting_rows=len(drafting),
            draft_extra_fed=extra,
            verify_tokens=b + (15 * len(drafting) if width > 1 else sum(depths)) + extra,
            emitted=rng.randint(b, 3 * b),
            draft_s=0,
            verify_s=0,
            overhead_s=0,
        )
        d, v, h = truth.predict(s)
        out.append(s.model_copy(update={"draft_s": d, "verify_s": v, "overhead_s": h}))
    return out


def test_cost_model_fit_recovers_coefficients() -> None:
    truth = CostModel(
        source="truth",
        draft_level=Curve.linear(0.003, 0.0004),
        draft_prefill_token_s=1e-5,
        verify=Curve.linear(0.004, 0.0002),
        verify_row_s=1e-4,
        overhead=Curve.linear(0.0005, 5e-5),
        emit_token_s=2e-6,
    )
    samples = _samples(truth, 300)
    fitted = CostModel.fit(samples)
    assert all(abs(e) < 1e-6 for e in fit_quality(fitted, samples).values())
    assert fitted.verify(100) == pytest.approx(truth.verify(100), rel=1e-4)
    assert fitted.draft_level(10) == pytest.approx(truth.draft_level(10), rel=1e-4)


def test_fit_recovers_tree_terms_and_a_separate_plain_model() -> None:
    truth = CostModel(
        source="truth",
        draft_level=Curve.linear(0.003, 0.0004),
        tree_row_s=2e-4,
        tree_level_row_s=5e-5,
        verify=Curve.linear(0.004, 0.0002),
        verify_tree_row_s=3e-4,
        overhead=Curve.linear(0.0005, 5e-5),
        plain=CostModel(
            source="plain truth", draft_level=Curve.constant(0.0), verify=Curve.linear(0.002, 0.0001),
            overhead=Curve.linear(0.0002, 1e-5),
        ),
    )  # fmt: skip
    samples = _samples(truth, 500, seed=2, trees=True, plain=0.2)
    fitted = CostModel.fit(samples)
    assert fitted.plain is not None and all(abs(e) < 1e-6 for e in fit_quality(fitted, samples).values())
    assert fitted.tree_level_row_s == pytest.approx(5e-5, rel=1e-3)
    assert fitted.verify_tree_row_s == pytest.approx(3e-4, rel=1e-3)
    assert fitted.verify_s(8, 8) == pytest.approx(truth.plain.verify_s(8, 8), rel=1e-4)  # type: ignore[union-attr]
    # without its own model, plain steps are priced as speculative steps with no drafting rows: off here
    joint = CostModel.fit([s for s in samples if s.drafting_rows == 0][:5] + [s for s in samples if s.levels])
    assert joint.plain is None


def test_piecewise_fit_follows_non_monotonic_costs() -> None:
    # a CPU-like draft level: 2-3 rows cost more than 4 (different kernels), then linear
    bumpy = Curve(points=[(1, 0.003), (2, 0.006), (4, 0.004), (8, 0.005), (16, 0.007), (32, 0.011)])
    truth = CostModel(source="truth", draft_level=bumpy, verify=Curve.linear(0.004, 0.0002))
    samples = _samples(truth, 400, seed=1)
    linear, piecewise = CostModel.fit(samples), CostModel.fit(samples, FitKind.piecewise)
    top = max(s.drafting_rows for s in samples)
    assert [x for x, _ in piecewise.draft_level.points] == [1, 2, 4, 8, 16, top]  # knots up to the data
    assert all(piecewise.draft_level(r) == pytest.approx(bumpy(r), rel=1e-3) for r in (1, 2, 3, 4, 8, 16, top))
    assert abs(linear.draft_level(2) - bumpy(2)) > 0.001


def test_knots_only_where_there_is_data_and_runs_weigh_alike() -> None:
    xs = [1.0] * 5 + [2.0] * 5 + [4.0] * 5 + [1000.0] * 5  # decode steps and a few big prefills
    assert fit_knots(1, 1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    assert fit_knots(1, 1000, xs) == [1, 2, 4, 1000]  # no knot where nothing was measured
    truth = CostModel(source="t", draft_level=Curve.linear(0.003, 0.0004), verify=Curve.linear(0.004, 0.0002))
    samples = _samples(truth, 40)
    assert run_weights(samples) is None  # samples that do not know their run: unweighted
    timed = [s.model_copy(update={"run_s": 2.0 if i % 2 else 50.0}) for i, s in enumerate(samples)]
    assert run_weights(timed) == [0.02 if i % 2 == 0 else 0.5 for i in range(40)]
    assert CostModel.fit(timed).verify(64) == pytest.approx(truth.verify(64), rel=1e-4)  # exact data: same fit


def test_measure_cost_model_times_batched_forwards() -> None:
    target = tiny_model(seed=0)
    cost = measure_cost_model(target, noisy_copy(target, 0.1), rows=(1, 4), context=16)
    assert [x for x, _ in cost.draft_level.points] == [1.0, 4.0]
    assert [x for x, _ in cost.verify.points] == [5.0, 20.0]  # SL 4 + the root per row
    assert all(y > 0 for _, y in cost.draft_level.points + cost.verify.points)
    assert CostModel.model_validate_json(cost.model_dump_json()) == cost  # a JSON profile round trip


def test_the_drafts_prompt_read_is_timed_with_one_logit_row_as_the_draft_worker_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timed prompt read ran the LM head over all 128 tokens (a 49k vocabulary's projection each), the draft
    worker's over the last one: every prompt token the draft reads was overpriced. Verify forwards keep a row per
    token (each verified token's distribution)."""
    from load.cost import PREFILL_TIMING_TOKENS
    from specserve.models.batch import ForwardBatch

    seen: list[tuple[int, list[int] | None]] = []
    build = ForwardBatch.build

    def recording(cache: Any, slots: Any, tokens: list[list[int]], **kwargs: Any) -> Any:
        seen.append((len(tokens[0]), kwargs.get("num_logits")))
        return build(cache, slots, tokens, **kwargs)

    monkeypatch.setattr(ForwardBatch, "build", staticmethod(recording))
    target = tiny_model(seed=0)
    measure_cost_model(target, target, rows=(1,), context=8)
    prompt_reads = [logits for n, logits in seen if n == PREFILL_TIMING_TOKENS]
    assert len(prompt_reads) == 4 and all(logits == [1] for logits in prompt_reads)  # a warm-up and 3 timed
    verifies = [logits for n, logits in seen if n == 5]  # SL 4 + the root
    assert verifies and all(logits is None for logits in verifies)


def test_a_timed_or_roofline_model_prices_the_drafts_prompt_reads_and_the_fitted_host_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The draft reads each admitted prompt: a timed model priced that at nothing, as did the roofline (while the
    target's read of it cost 82 ms), and a timed model kept three of the fit's host terms, so speculative steps came
    out cheap beside plain ones."""
    import load.cost as cost_mod

    # a device whose forward costs 1 ms + 0.1 ms a token: the draft's prompt read costs 0.1 ms a token
    monkeypatch.setattr(cost_mod, "time_forward", lambda model, rows, n, context, **_: 1e-3 + 1e-4 * rows * n)
    target = tiny_model(seed=0)
    timed = measure_cost_model(target, target, rows=(1, 4))
    assert timed.draft_prefill_token_s == pytest.approx(1e-4)
    assert timed.draft_s([1], 100) == pytest.approx(timed.draft_s([1], 0) + 100 * 1e-4)
    roofline = RooflineName.h100_llama8b_1b.cost_model()
    draft_read = roofline.draft_s([1], 2000) - roofline.draft_s([1], 0)
    target_read = roofline.verify_s(1, 2001) - roofline.verify_s(1, 1)
    assert 0.1 < draft_read / target_read < 0.25  # about the draft's share of the parameters (1.24e9 / 8.03e9)
    host = {k: 1e-3 * (i + 1) for i, k in enumerate(HOST_TERMS) if k != "overhead"}
    plain_fit = CostModel(source="p", draft_level=Curve.constant(9.0), verify=Curve.constant(9.0), verify_row_s=7e-4)
    fitted = CostModel(source="f", draft_level=Curve.constant(9.0), verify=Curve.constant(9.0), plain=plain_fit)
    fitted = fitted.model_copy(update=host | {"overhead": Curve.linear(2e-3, 3e-4)})
    priced = timed.with_host_of(fitted)
    assert {k: getattr(priced, k) for k in HOST_TERMS} == {k: getattr(fitted, k) for k in HOST_TERMS}
    assert (priced.draft_level, priced.verify, priced.draft_prefill_token_s) == (
        timed.draft_level,
        timed.verify,
        timed.draft_prefill_token_s,
    )
    assert priced.plain is not None and priced.plain.verify == timed.verify and priced.plain.verify_row_s == 7e-4
    assert priced.verify_s(4, 20, drafting_rows=0) == pytest.approx(timed.verify(20) + 4 * 7e-4)


# ─────────────────────────── recording from the engine ───────────────────────────


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[Any, Any]:
    target = tiny_model(seed=0)
    return target, noisy_copy(target, 0.15, seed=1)


def _record(tiny_pair: tuple[Any, Any], policy: PolicyName, batch: int, accepts: list[float | None]) -> RunTrace:
    target, draft = tiny_pair
    spec = policy_specs()[policy]
    engine = Engine(target, None, draft=draft, speculation=spec, max_batch_size=batch)
    rec = StepRecorder.install(engine)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 20))] for _ in accepts]
    lengths = [rng.randint(20, 40) for _ in accepts]
    res = run_one(engine, prompts, lengths, spec, accepts)
    cats = ["x" if a is None else f"synthetic a={a:g}" for a in accepts]
    requests = rec.request_traces(cats)
    return RunTrace(
        pair="tiny",
        workload=WorkloadKind.real if accepts[0] is None else WorkloadKind.synthetic,
        synthetic=accepts[0] is not None,
        policy=policy,
        spec=spec,
        batch=batch,
        seconds=res["seconds"],
        tokens=sum(r.output_tokens for r in requests),
        requests=requests,
        steps=rec.steps,
    )


def test_trace_recording_from_engine(tiny_pair: tuple[Any, Any], tmp_path: Path) -> None:
    run = _record(tiny_pair, PolicyName.dsde_cap, 3, [None] * 6)
    assert run.has_kld and run.steps and len(run.requests) == 6
    assert all(r.output_tokens == r.max_tokens for r in run.requests)  # EOS ignored
    assert all(r.ttft_s is not None and r.tpot_s is not None for r in run.requests)
    assert max(st.batch for st in run.steps) == 3
    first = {s.req: s.fed for st in reversed(run.steps) for s in st.seqs}  # each request's first step
    assert all(first[i] == r.prompt_len for i, r in enumerate(run.requests))
    for st in run.steps:
        for s in st.seqs:
            assert s.drafted == s.depth and 0 <= s.accepted <= s.drafted
            assert len(s.kld) == min(s.accepted + 1, s.drafted)  # the verified positions (docs/algorithms.md §6)
    # each request emitted accepted + 1 tokens per step until max_tokens
    for i, r in enumerate(run.requests):
        steps = [s for st in run.steps for s in st.seqs if s.req == i]
        assert sum(s.accepted + 1 for s in steps[:-1]) < r.max_tokens <= sum(s.accepted + 1 for s in steps)
    seqs = sequence_traces(run)
    assert len(seqs) == 6 and all(len(s.accepts) == len(s.klds) for s in seqs)
    assert 0.0 < sum(s.acceptance for s in seqs) / 6 < 1.0
    path = tmp_path / "t.jsonl"
    write_traces(path, [run])
    assert read_traces(path)[0] == run
    samples = list(cost_samples([run]))
    assert len(samples) == len(run.steps) and samples[0].draft_extra_fed > 0  # prompts fed at level 0


def test_tree_traces_from_engine(tiny_pair: tuple[Any, Any]) -> None:
    ddd = _record(tiny_pair, PolicyName.ddd, 3, [None] * 6)
    spec = ddd.spec
    for i, r in enumerate(ddd.requests):  # planned: the depth budget, or the room for drafts a request has left
        emitted, steps = 0, [s for st in ddd.steps for s in st.seqs if s.req == i]
        for s in steps:
            assert s.uncapped == spec.ddd_max_depth and s.planned == min(s.uncapped, max(1, r.max_tokens - emitted - 1))
            emitted += s.accepted + 1
        assert any(s.planned < s.uncapped for s in steps)
    trees = tree_sequence_traces(ddd)
    assert len(trees) == 6 and not sequence_traces(ddd)
    steps = [t for tr in trees for t in tr.steps]
    assert all(t.depth <= spec.ddd_max_depth and t.accepted <= t.depth for t in steps) and any(t.stopped for t in steps)
    assert all(t.depth < spec.ddd_max_depth for t in steps if t.stopped)
    assert all(t.drafted == tree_nodes(t.depth, spec.beam_width, spec.budget) for t in steps)
    samples = list(cost_samples([ddd]))
    drafting = [x for x in samples if x.levels > 0]
    assert drafting and all(x.level_tokens and x.level_tokens[0] == x.drafting_rows for x in drafting)
    assert all(x.level_tokens[1:] == [spec.beam_width * n for n in x.level_rows[1:]] for x in drafting)  # type: ignore[index]
    both = _record(tiny_pair, PolicyName.dsde_ddd, 3, [None] * 6)
    assert both.has_kld
    pool = trace_pool([ddd, both], PolicyName.dsde_ddd)
    assert pool and all(t.kld for tr in pool["x"] for t in tr.steps)  # type: ignore[union-attr]
    assert trace_pool([ddd, both], PolicyName.ddd)["x"] == trees
    nocap = _record(tiny_pair, PolicyName.dsde_ddd_nocap, 3, [None] * 6)
    assert all(st.cap is None for st in nocap.steps) and any(st.cap is not None for st in both.steps)
    assert trace_pool([both, nocap], PolicyName.dsde_ddd)["x"] == tree_sequence_traces(nocap)  # depths not cut
    rows = validate([ddd, both], ValidationMode.in_sample, repeats=1)
    assert {r["policy"] for r in rows} == {"DDD", "DSDE+DDD"}
    assert all(r["sim_tok_s"] > 0 and math.isfinite(r["error"]) for r in rows)
    # a sweep of plain decoding and DDD alone (the straggler study's): plain has no chain runs' sequences to replay,
    # and validating it was an IndexError from an empty pool
    plain = _record(tiny_pair, PolicyName.plain, 3, [None] * 6)
    assert [r["policy"] for r in validate([plain, ddd], ValidationMode.in_sample, repeats=1)] == ["DDD"]


def test_simulated_sweep_gives_chain_and_tree_policies_one_workload(
    tiny_pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chains replay the chain runs' sequences and trees the tree runs': pools of other sizes. Each policy drew from
    its own pool with one seed, so the picks differed and sim.csv's tree-vs-chain columns compared other prompts
    and lengths; both now draw the runs' recorded requests and replay their own recording of each."""
    from load import simulate as sim_cli

    chains = [_record(tiny_pair, PolicyName.dsde_cap, 2, [None] * 4)]
    trees = [_record(tiny_pair, PolicyName.ddd, b, [None] * 4) for b in (1, 2)]  # the same 4 prompts, twice over
    drawn: list[list[SimRequest]] = []
    real_simulate = sim_cli.simulate

    def recording(requests: Sequence[SimRequest], cfg: SimConfig, cost: CostModel) -> SimResult:
        drawn.append(list(requests))
        return real_simulate(requests, cfg, cost)

    monkeypatch.setattr(sim_cli, "simulate", recording)
    study = sim_cli.SimStudy(
        traces=Path("t.jsonl"), batch_sizes=[2], policies=[PolicyName.dsde_cap, PolicyName.ddd],
        workloads=[WorkloadKind.real], requests_per_slot=3, repeats=2,
    )  # fmt: skip
    sim_cli.sweep(study, chains + trees, CostModel.fit(cost_samples(chains + trees)))
    assert len(drawn) == 4 and all(len(reqs) == 6 for reqs in drawn)  # (policy, repeat) in that order
    keys = [[(r.trace.prompt_key, r.prompt_len, r.max_tokens) for r in reqs] for reqs in drawn]
    assert keys[:2] == keys[2:]  # chain and tree, repeat by repeat: the same prompts, lengths and order
    assert keys[0] != keys[1]  # (repeats draw afresh)
    recorded = {(q.prompt_key, q.prompt_len, q.max_tokens) for q in chains[0].requests}
    assert all(k in recorded for ks in keys for k in ks)  # each its own prompt's recording


def test_simulator_replays_recorded_traces(tiny_pair: tuple[Any, Any]) -> None:
    runs = [
        _record(tiny_pair, p, b, [0.9, 0.3] * b)
        for b in (1, 4)
        for p in (PolicyName.plain, PolicyName.dsde_nocap, PolicyName.dsde_cap)
    ]
    pool = trace_pool(runs)
    assert set(pool) == {"synthetic a=0.9", "synthetic a=0.3"}
    hi, lo = (sum(s.acceptance for s in pool[c]) / len(pool[c]) for c in ("synthetic a=0.9", "synthetic a=0.3"))
    assert hi > 0.7 and lo < 0.5  # heterogeneity survives the recording
    rows = validate(runs, ValidationMode.in_sample, repeats=1)
    assert len(rows) == len(runs)
    for r in rows:
        assert r["sim_tok_s"] > 0 and math.isfinite(r["error"])
        assert r["same_prompt"] == 1.0  # every request replays its own prompt's recording (greedy: exact)


def test_simulator_reproduces_runs_priced_by_a_known_cost_model(tiny_pair: tuple[Any, Any]) -> None:
    """Engine runs whose every step is re-timed by a known linear cost model: the simulator, fitting its cost model
    from those steps and replaying each request's own greedy recording, must give the runs' throughput and idle
    fraction exactly, in-sample and at a batch size left out of the fit (interpolated)."""
    truth = CostModel(
        source="truth",
        draft_level=Curve.linear(0.002, 0.0005),
        verify=Curve.linear(0.008, 0.0003),
        overhead=Curve.linear(0.0005, 0.0001),
    )

    def priced(run: RunTrace) -> RunTrace:
        steps = []
        for step, sample in zip(run.steps, cost_samples([run]), strict=True):
            draft_s, verify_s, overhead_s = truth.predict(sample)
            steps.append(step.model_copy(update={"draft_s": draft_s, "verify_s": verify_s, "overhead_s": overhead_s}))
        return run.model_copy(update={"steps": steps, "seconds": sum(st.step_s for st in steps)})

    policies = (PolicyName.plain, PolicyName.static, PolicyName.dsde_nocap, PolicyName.dsde_cap, PolicyName.ddd,
                PolicyName.dsde_ddd)  # fmt: skip
    runs = [priced(_record(tiny_pair, p, b, [None, None] * b)) for b in (1, 2, 4) for p in policies]
    widest = runs[-1].requests
    assert len({q.prompt_len for q in widest}) < len(widest)  # prompts of one length: told apart by their ids
    in_sample = validate(runs, ValidationMode.in_sample, repeats=1)
    left_out = [r for r in validate(runs, ValidationMode.leave_batch_out, repeats=1) if r["batch"] == 2]
    assert len(in_sample) == len(runs) and len(left_out) == len(policies)
    for r in in_sample + left_out:
        assert r["same_prompt"] == 1.0
        assert abs(r["error"]) < 1e-6, r
        assert r["sim_idle"] == pytest.approx(r["measured_idle"], abs=1e-9), r
    assert max(r["measured_idle"] for r in in_sample) > 0.03  # the lock-step draft's idle rows are replayed too


def test_a_point_left_out_is_never_replayed_from_its_own_sequences(
    tiny_pair: tuple[Any, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """With no sequences of its workload at the other batch sizes, a left-out point fell back to a pool of every
    run, its own included: "leave-batch-out" was in-sample there, its error smaller than it should be."""
    runs = [_record(tiny_pair, PolicyName.dsde_cap, 1, [None]), _record(tiny_pair, PolicyName.dsde_cap, 2, [0.9, 0.9])]
    assert [r["batch"] for r in validate(runs, ValidationMode.in_sample, repeats=1)] == [1, 2]
    assert validate(runs, ValidationMode.leave_batch_out, repeats=1) == []  # neither workload at the other size
    assert "no recorded sequences outside batch 2" in capsys.readouterr().err
    # traces of one batch size: nothing outside it to fit the cost model on either (it was fitted in-sample)
    alone = [_record(tiny_pair, PolicyName.dsde_cap, 2, [0.9, 0.9])]
    assert [r["batch"] for r in validate(alone, ValidationMode.in_sample, repeats=1)] == [2]
    assert validate(alone, ValidationMode.leave_batch_out, repeats=1) == []
    assert "no runs outside batch 2 to fit on" in capsys.readouterr().err


def _timed_run(policy: PolicyName, repeat: int, tok_s: float, *, batch: int = 4, label: str = "real") -> RunTrace:
    return RunTrace(pair="tiny", workload=WorkloadKind.real, label=label, synthetic=False, policy=policy,
                    spec=SpecConfig(), batch=batch, repeat=repeat, seconds=100.0 / tok_s, tokens=100, requests=[],
                    steps=[])  # fmt: skip


def test_the_study_pairs_each_policy_with_plain_decoding_in_the_same_pass(tmp_path: Path) -> None:
    from load import straggler

    plain, ddd = PolicyName.plain, PolicyName.ddd
    # the host slows down and speeds up between passes; in the three passes with both, ddd's ratios 1.05, 1.04, 0.95
    runs = [_timed_run(plain, r, v) for r, v in enumerate([100.0, 50.0, 200.0])]
    runs += [_timed_run(ddd, r, v) for r, v in enumerate([105.0, 52.0, 190.0, 400.0])]  # pass 3 has no plain run
    rows = {r["policy"]: r for r in straggler.summarize(runs)}
    assert rows[ddd.label]["vs_plain"] == pytest.approx(147.5 / 100.0)  # the medians' ratio: all four runs
    assert straggler.paired_ratios(runs)[("real", 4, ddd)] == pytest.approx([1.05, 1.04, 0.95])
    paired = rows[ddd.label]
    assert paired["paired_vs_plain"] == pytest.approx(1.04)
    assert (paired["paired_lo"], paired["paired_hi"]) == pytest.approx((0.95, 1.05))
    assert paired["paired_coverage"] == 0.75  # three passes: the range covers the median 1 - 2 / 8 of the time
    # another workload in the same passes pairs with its own plain runs
    other = [_timed_run(plain, 0, 10.0, label="other"), _timed_run(ddd, 0, 20.0, label="other")]
    assert straggler.paired_ratios([*runs, *other])[("other", 4, ddd)] == [2.0]
    # two saved sweeps, each numbering its passes from 0: a policy's run pairs with plain's of its own sweep
    for name, (base, spec) in {"a": (100.0, 90.0), "b": (200.0, 210.0)}.items():
        write_traces(tmp_path / name / "traces.jsonl", [_timed_run(plain, 0, base), _timed_run(ddd, 0, spec)])
    # a third sweep of another batch size: its passes keep their numbers (pass 0 is what the SL plots draw)
    write_traces(
        tmp_path / "c" / "traces.jsonl", [_timed_run(plain, 0, 50.0, batch=16), _timed_run(ddd, 0, 40.0, batch=16)]
    )
    files = [tmp_path / name / "traces.jsonl" for name in "abc"]
    assert [(t.batch, t.repeat) for t in straggler.merged_traces(files)] == [
        (4, 0),
        (4, 0),
        (4, 1),
        (4, 1),
        (16, 0),
        (16, 0),
    ]
    # a sweep given twice, or a copy of it, counted its passes twice: the same interval reported at 97% coverage
    with pytest.raises(ValueError, match="a traces file is given twice"):
        straggler.merged_traces([*files, files[0]])
    (tmp_path / "a-backup").mkdir()
    (tmp_path / "a-backup" / "traces.jsonl").write_text((tmp_path / "a" / "traces.jsonl").read_text())
    with pytest.raises(ValueError, match=r"a-backup/traces\.jsonl and .*/a/traces\.jsonl hold the same run"):
        straggler.merged_traces([*files, tmp_path / "a-backup" / "traces.jsonl"])
    # several sweeps in one file (a cat of them) paired a's ddd with b's plain (0.45): refused, as is one sweep twice
    for name, parts in {"ab": "ab", "aa": "aa"}.items():
        text = "".join((tmp_path / part / "traces.jsonl").read_text() for part in parts)
        (tmp_path / name).mkdir()
        (tmp_path / name / "traces.jsonl").write_text(text)
        with pytest.raises(ValueError, match=rf"{name}/traces\.jsonl holds 2 runs of plain at batch 4, real, pass 0"):
            straggler.merged_traces([tmp_path / name / "traces.jsonl"])
    # sweeps of other seeds (other prompts and lengths; for the tiny pair, other weights) are not one workload
    seeded = [_timed_run(plain, 0, 100.0).model_copy(update={"settings": RunSettings(seed=s)}) for s in (0, 1)]
    with pytest.raises(ValueError, match=r"different settings: tiny_noise None; and tiny_noise None, seed 1$"):
        straggler.summarize(seeded)
    out = tmp_path / "merged"
    straggler.report_from_traces(files, out)
    merged = {(r["batch"], r["policy"]): r for r in csv.DictReader((out / "straggler.csv").open())}
    assert float(merged["4", ddd.label]["paired_vs_plain"]) == pytest.approx((0.9 + 1.05) / 2)
    assert float(merged["16", ddd.label]["paired_vs_plain"]) == pytest.approx(0.8)
    assert (
        "| vs_plain | idle_fraction | mean_sl | mean_cap | paired_vs_plain | paired_lo | paired_hi | paired_coverage |"
        in (out / "report.md").read_text()
    )


def _step(levels: int, depth: int, drafted: int, accepted: int) -> StepTrace:
    seq = SeqStep(req=0, fed=1, depth=depth, drafted=drafted, accepted=accepted)
    return StepTrace(t_end=0.0, batch=1, levels=levels, cap=None, draft_s=0.0, verify_s=0.0, overhead_s=0.0,
                     emitted=1 + accepted, seqs=[seq])  # fmt: skip


def test_a_pass_that_drafted_on_no_step_is_left_out_of_the_mean_sl_and_acceptance_medians() -> None:
    """A guarded pass that decoded plainly on every step has no mean SL and no acceptance: it gave 0.0 for both,
    and the median over passes mixed those in (0.05 reported where the passes that drafted went 0.09 deep)."""
    from load import straggler

    ddd = PolicyName.ddd
    drafting = [_step(2, 2, 4, 2), _step(0, 0, 0, 0), _step(0, 0, 0, 0), _step(0, 0, 0, 0)]  # drafted 1 step of 4
    plain = [_step(0, 0, 0, 0)] * 4
    runs = [_timed_run(ddd, r, 100.0).model_copy(update={"steps": s}) for r, s in enumerate([drafting, plain, plain])]
    row = straggler.row_from_trace(runs[1])
    assert math.isnan(row["mean_sl"]) and math.isnan(row["acceptance"]) and row["spec_steps"] == 0.0
    (summary,) = straggler.summarize(runs)
    assert summary["mean_sl"] == 2.0 and summary["acceptance"] == 0.5
    assert summary["spec_steps"] == 0.0  # the median pass drafted on no step
    assert straggler.row_from_trace(runs[0])["spec_steps"] == 0.25


def test_report_refuses_to_pool_runs_made_under_other_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A guarded sweep and an unguarded one of the same policies merged into one median (45 and 59 tok/s: 52)."""
    from load import straggler

    plain, ddd = PolicyName.plain, PolicyName.ddd
    cold = RunSettings(tiny_noise=0.01)  # what a sweep of the tiny pair records by default
    guarded = cold.model_copy(update={"guard": True, "max_step_tokens": 64})
    for name, settings, tok_s in (("a", guarded, 45.0), ("b", cold, 59.0), ("old", None, 50.0)):
        runs = [_timed_run(plain, 0, 60.0), _timed_run(ddd, 0, tok_s)]
        write_traces(tmp_path / name / "traces.jsonl", [r.model_copy(update={"settings": settings}) for r in runs])
    files = {name: tmp_path / name / "traces.jsonl" for name in ("a", "b", "old")}
    with pytest.raises(SystemExit) as exit_:
        straggler.main(["report", str(files["a"]), str(files["b"]), "--out", str(tmp_path / "ab")])
    assert exit_.value.code == 2
    assert "under different settings: guard True, max_step_tokens 64; and the default settings" in (
        capsys.readouterr().err
    )
    # traces recorded before runs kept their settings merge with any, and the report says so
    assert straggler.main(["report", str(files["a"]), str(files["old"]), "--out", str(tmp_path / "ao")]) == 0
    assert (
        "Settings: guard True, max_step_tokens 64 (2 runs recorded without theirs)."
        in (tmp_path / "ao" / "report.md").read_text()
    )


def test_straggler_refuses_outputs_the_context_limit_would_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny pair's context is 448 tokens: 600-token outputs stopped at 352 while the report said 600-600 and
    the simulator replayed 600. Every point is checked before the first run: here batch 1's and 2's requests fit
    (at most 413 and 428 tokens) and batch 8's do not (453), which would end the sweep after its first points."""
    from load import straggler

    argv = ["--pair", "tiny", "--policies", "plain", "--workloads", "real", "--requests-per-slot", "1"]
    for batches, tokens, longest in ((["1"], "600", 696), (["1", "2", "8"], "300", 453)):
        low, high = (tokens, tokens) if tokens == "600" else ("300", "360")
        out = tmp_path / tokens
        rest = ["--min-tokens", low, "--max-tokens", high, "--out", str(out)]
        assert straggler.main([*argv, "--batch-sizes", *batches, *rest]) == 2
        err = capsys.readouterr().err
        assert f"a request of {longest} tokens" in err and "does not fit the context limit of 448" in err
        assert not (out / "traces.jsonl").exists()


def test_straggler_and_simulator_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from load import simulate as sim_cli
    from load import straggler

    out = tmp_path / "study"
    argv = ["--pair", "tiny", "--batch-sizes", "1", "2", "--policies", "plain", "static", "dsde_nocap", "dsde_cap"]
    argv += ["--workloads", "synthetic", "--requests-per-slot", "1", "--min-tokens", "8", "--max-tokens", "16"]
    argv += ["--repeats", "2"]
    assert straggler.main([*argv, "--out", str(out)]) == 0
    names = {"straggler.csv", "traces.jsonl", "report.md", "straggler_synthetic.png", "straggler_sl_synthetic.png"}
    assert names <= {p.name for p in out.iterdir()}
    assert "SYNTHETIC" in (out / "report.md").read_text()
    # two mixes merged in one report: a plot each (the second had replaced the first, and the SL plot mixed them)
    mixes = read_traces(out / "traces.jsonl")
    mixes += [t.model_copy(update={"label": "SYNTHETIC 0.5"}) for t in mixes]
    assert [p.name for p in straggler.plot_sl_traces(mixes, tmp_path)] == [
        "straggler_sl_synthetic_0.9_0.3.png",
        "straggler_sl_synthetic_0.5.png",
    ]
    assert len(read_traces(out / "traces.jsonl")) == 2 * 2 * 4  # batch sizes x repeats x policies
    study_rows = list(csv.DictReader((out / "straggler.csv").open()))
    assert all(row["repeats"] == "2" for row in study_rows)
    merged = tmp_path / "merged"  # re-reported from the saved traces alone: the same table
    assert straggler.main(["report", str(out / "traces.jsonl"), "--out", str(merged)]) == 0
    assert list(csv.DictReader((merged / "straggler.csv").open())) == study_rows
    assert {t.settings for t in read_traces(out / "traces.jsonl")} == {
        RunSettings(requests_per_slot=1, min_tokens=8, max_tokens=16, tiny_noise=0.01)
    }
    assert "Settings: requests_per_slot 1, min_tokens 8, max_tokens 16." in (merged / "report.md").read_text()
    # every setting a run keeps is one a sweep is given: a renamed StudyConfig field cannot record a default instead
    assert set(RunSettings.model_fields) <= set(straggler.StudyConfig.model_fields)
    sim_out = tmp_path / "sim"
    assert sim_cli.main(["--traces", str(out / "traces.jsonl"), "--validate", "--batch-sizes", "1", "8",
                         "--workloads", "synthetic", "--repeats", "1", "--out", str(sim_out)]) == 0  # fmt: skip
    assert {"validation.csv", "sim.csv", "report.md", "sim_synthetic.png"} <= {p.name for p in sim_out.iterdir()}
    traces = ["--traces", str(out / "traces.jsonl"), "--batch-sizes", "1", "--repeats", "1", "--out", str(sim_out)]
    negative = tmp_path / "negative.json"  # a cost term below zero (and NaN) was replayed as 0 tok/s, exit 0
    fitted = CostModel.fit(cost_samples(read_traces(out / "traces.jsonl")), FitKind.piecewise)
    cost = json.loads(fitted.model_dump_json())
    negative.write_text(json.dumps({**cost, "verify_row_s": -1.0}))
    free = tmp_path / "free.json"  # every term zero: a plain step took 0 s, and the sweep reported 0 tok/s, exit 0
    free.write_text(
        CostModel(source="free", draft_level=Curve.constant(0.0), verify=Curve.constant(0.0)).model_dump_json()
    )
    for argv, says in [
        (["--workloads", "real"], "holds no recorded runs of ['real']"),  # wrote an empty report, exit 0
        (["--measure-target", str(tmp_path / "no-model"), "--measure-draft", "tiny"], "--measure-target / --measure"),
        (["--cost", str(negative)], "verify_row_s: Input should be greater than or equal to 0"),
        (["--cost", str(free)], "free.json: a plain step of one row costs 0 s"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            sim_cli.main([*traces, *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err and "Traceback" not in err, (argv, err)
    # runs of one policy under other settings (a sweep with --drafter lookup) are not pooled as its repeats
    runs = read_traces(out / "traces.jsonl")
    lookup = SpecConfig(method=SpecMethod.chain, drafter=Drafter.lookup)
    odd = runs[0].model_copy(update={"spec": lookup})
    with pytest.raises(ValueError, match="different settings"):
        straggler.summarize([*runs, odd])
    other_pair = runs[0].model_copy(update={"pair": "smollm2-int8"})  # a sweep of another pair, merged by `report`
    with pytest.raises(ValueError, match=r"different settings or model pairs \(tiny, smollm2-int8\)"):
        straggler.summarize([*runs, other_pair])
    assert straggler.summarize(runs) == straggler.summarize(list(reversed(runs)))
    # a policy of one pair beside plain of another (sweeps merged by `report`): its ratio was to the other's plain
    policy = next(t.policy for t in runs if t.policy != PolicyName.plain)
    mixed = [t for t in runs if t.policy != policy]
    mixed += [t.model_copy(update={"pair": "smollm2-int8"}) for t in runs if t.policy == policy]
    with pytest.raises(ValueError, match=r"of different model pairs \(tiny, smollm2-int8\)"):
        straggler.summarize(mixed)
    with pytest.raises(ValueError, match="drafter"):  # the simulator replays draft-model steps only
        sim_cli.SimConfig(batch_size=1, policy=PolicyName.static, spec=lookup)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measured_cost_times_the_draft_it_is_given(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--measure-draft tiny`` beside a real target timed a noisy copy of that target (the draft's curve was the
    target's); the tiny models ignored ``--measure-dtype``; unsorted ``--profile-rows`` failed after loading."""
    import load.simulate as sim_cli
    import specserve.models.loader as loader
    from specserve.config import DType

    big = tiny_model(tiny_config(hidden_size=128, intermediate_size=256, num_hidden_layers=4))
    monkeypatch.setattr(loader, "load_model", lambda spec, device: big.to(device, spec.dtype.torch))
    timed: dict[str, Any] = {}

    def measure(target: Any, draft: Any, rows: list[int], source: str) -> None:
        timed.update(target=target, draft=draft, rows=rows, source=source)
        raise StopIteration

    monkeypatch.setattr(sim_cli, "measure_cost_model", measure)
    study = sim_cli.SimStudy(traces=Path("t.jsonl"), out=Path("o"), measure_target="real/dir", measure_draft="tiny",
                             measure_dtype=DType(dtype), profile_rows=[8, 1, 2])  # fmt: skip
    with pytest.raises(StopIteration):
        sim_cli._measured(study, CostModel(source="f", draft_level=Curve.constant(0.0), verify=Curve.constant(1.0)))
    size = {k: sum(p.numel() for p in timed[k].parameters()) for k in ("target", "draft")}
    assert size["draft"] == sum(p.numel() for p in tiny_model().parameters()) < size["target"]
    assert {next(timed[k].parameters()).dtype for k in ("target", "draft")} == {DType(dtype).torch}
    assert timed["rows"] == [1, 2, 8] and timed["source"] == f"measured on cpu: real/dir + tiny ({dtype})"


@pytest.mark.parametrize(
    ("tool", "argv", "message"),
    [
        ("straggler", ["--batch-sizes", "4", "0"], "argument --batch-sizes: must be at least 1"),
        ("straggler", ["--repeats", "0"], "--repeats: Input should be greater than or equal to 1"),
        ("straggler", ["--min-tokens", "9", "--max-tokens", "8"], "error: min_tokens > max_tokens"),
        ("straggler", ["--batch-sizes", "4", "1", "4"], "batch_sizes repeats a value: [4, 1, 4]"),  # runs pair by size
        ("simulate", ["--traces", "t.jsonl", "--batch-sizes", "-1"], "--batch-sizes: Input should be greater than"),
        ("simulate", ["--traces", "t.jsonl", "--repeats", "0"], "--repeats: Input should be greater than"),
        ("simulate", ["--traces", "t.jsonl", "--batch-sizes", "8", "8"], "--batch-sizes repeats a value: [8, 8]"),
        ("straggler", ["--workloads", "real", "real"], "workloads repeats a value: ['real', 'real']"),
        ("straggler", ["--policies", "plain", "dsde_ddd", "plain"], "policies repeats a value: ['plain', 'dsde"),
        ("simulate", ["--traces", "t.jsonl", "--workloads", "real", "real"], "--workloads repeats a value: ['real'"),
        ("simulate", ["--traces", "t.jsonl", "--policies", "plain", "plain"], "--policies repeats a value: ['plain'"),
        # these five were tracebacks (pydantic, DType, KVCache) or silently ignored (--measure-draft alone)
        ("simulate", ["--traces", "t.jsonl", "--min-tokens", "10", "--max-tokens", "5"], "need 1 <= --min-tokens"),
        ("simulate", ["--traces", "t.jsonl", "--min-tokens", "5"], "give both --min-tokens and --max-tokens"),
        ("simulate", ["--traces", "t.jsonl", "--measure-draft", "tiny"], "--measure-draft needs --measure-target"),
        ("simulate", ["--traces", "t.jsonl", "--measure-dtype", "bogus"], "argument --measure-dtype: invalid choice"),
        ("simulate", ["--traces", "t.jsonl", "--profile-rows", "0"], "argument --profile-rows: must be at least 1"),
        ("simulate", ["--traces", "t.jsonl", "--write-cost", "/"], "is a directory"),
        # a real target timed beside a noisy copy of itself (the tiny pair's draft); rows a Curve then refused late
        ("simulate", ["--traces", "t.jsonl", "--measure-target", "some/dir"], "needs --measure-draft beside a real"),
        ("simulate", ["--traces", "t.jsonl", "--profile-rows", "1", "1"], "--profile-rows repeats a value: [1, 1]"),
        # two cost sources: the timed models were ignored under a roofline, the file under the timed models
        (
            "simulate",
            ["--traces", "t.jsonl", "--roofline", "h100-llama8b-1b", "--measure-target", "tiny"],
            "--measure-target and --roofline: give one cost source",
        ),
        (
            "simulate",
            ["--traces", "t.jsonl", "--cost", "c.json", "--measure-target", "tiny"],
            "--measure-target and --cost: give one cost source",
        ),
    ],
)
def test_study_settings_out_of_range_are_usage_errors(
    tool: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from load import simulate as sim_cli
    from load import straggler

    with pytest.raises(SystemExit) as exit_:
        (straggler.main if tool == "straggler" else sim_cli.main)(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_trace_and_cost_files_that_cannot_be_read_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from load import simulate as sim_cli
    from load import straggler

    bad, empty, cost = tmp_path / "bad.jsonl", tmp_path / "empty.jsonl", tmp_path / "cost.json"
    bad.write_text('{"pair": "tiny"}\n')
    empty.write_text("\n")
    cost.write_text('{"a": 1}')
    missing = str(tmp_path / "nope.jsonl")
    cases = [
        (sim_cli.main, ["--traces", missing], "cannot read"),
        (sim_cli.main, ["--traces", str(bad)], "bad.jsonl:1 is not a run trace (workload: Field required"),
        (sim_cli.main, ["--traces", str(empty)], "holds no runs"),
        (straggler.main, ["report", missing, "--out", str(tmp_path / "r")], "cannot read"),
        (straggler.main, ["report", str(bad), "--out", str(tmp_path / "r")], "bad.jsonl:1 is not a run trace"),
        (straggler.main, ["report", str(empty), "--out", str(tmp_path / "r")], "no runs in"),
    ]
    for main, argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and "Traceback" not in err, (argv, err)
    from load.traces import RunTrace

    good = tmp_path / "good.jsonl"
    run = RunTrace(pair="tiny", workload="real", synthetic=False, policy="plain", spec=SpecConfig(), batch=1,
                   seconds=1.0, tokens=0, requests=[], steps=[])  # fmt: skip
    good.write_text(run.model_dump_json() + "\n")
    with pytest.raises(SystemExit) as exit_:
        sim_cli.main(["--traces", str(good), "--cost", str(cost), "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "cost.json is not a cost model (source: Field required" in err, err
    lookup = tmp_path / "lookup.jsonl"  # a sweep drafted by prompt lookup: its SimConfig failed mid-sweep
    lookup.write_text(run.model_copy(update={"spec": SpecConfig(drafter=Drafter.lookup)}).model_dump_json() + "\n")
    with pytest.raises(SystemExit) as exit_:
        sim_cli.main(["--traces", str(lookup), "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "drafted by ['lookup']" in err and "Traceback" not in err, err
    for extra in ([], ["--validate-only"]):  # runs without recorded steps: no cost model to fit (a traceback)
        with pytest.raises(SystemExit) as exit_:
            sim_cli.main(["--traces", str(good), "--out", str(tmp_path / "s"), *extra])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "no recorded steps to fit" in err and "Traceback" not in err, (extra, err)


def test_study_max_sl_caps_every_speculative_policy(capsys: pytest.CaptureFixture[str]) -> None:
    from load import straggler

    specs = straggler.StudyConfig(pair="tiny", policies=list(PolicyName), max_sl=2).specs()
    assert specs[PolicyName.plain].max_sl is None
    assert {p: s.max_sl for p, s in specs.items() if p != PolicyName.plain} == {
        p: 2 for p in PolicyName if p != PolicyName.plain
    }
    assert straggler.parse_args(["--pair", "tiny", "--max-sl", "3"]).specs()[PolicyName.dsde_cap].max_sl == 3
    trees = straggler.parse_args(["--pair", "tiny", "--ddd-checks", "2,3,4", "--budget", "8"]).specs()
    assert trees[PolicyName.ddd].ddd_check_steps == trees[PolicyName.dsde_ddd].ddd_check_steps == (2, 3, 4)
    assert trees[PolicyName.ddd].budget == 8
    assert straggler.parse_args(["--pair", "tiny"]).specs()[PolicyName.ddd].ddd_check_steps == (5, 7, 9)
    floored = straggler.parse_args(["--pair", "tiny", "--tree-min-prob", "0.06"]).specs()
    assert floored[PolicyName.ddd].tree_min_prob == floored[PolicyName.dsde_ddd].tree_min_prob == 0.06
    assert straggler.parse_args(["--pair", "tiny"]).specs()[PolicyName.ddd].tree_min_prob == 0.0
    measured = straggler.parse_args(["--pair", "tiny", "--tree-min-prob", "0.06", "--adaptive-floor"]).specs()
    assert measured[PolicyName.ddd].adaptive_floor and measured[PolicyName.ddd].tree_min_prob == 0.06
    assert not straggler.parse_args(["--pair", "tiny"]).specs()[PolicyName.ddd].adaptive_floor
    with pytest.raises(ValueError, match="tree_min_prob"):
        straggler.StudyConfig(pair="tiny", tree_min_prob=1.5)
    with pytest.raises(SystemExit) as exit_:
        straggler.parse_args(["--pair", "tiny", "--ddd-checks", "4,2"])
    assert exit_.value.code == 2 and "--ddd-checks" in capsys.readouterr().err  # argparse's usage error
    with pytest.raises(ValueError, match="ddd_check_steps"):
        straggler.StudyConfig(pair="tiny", ddd_check_steps=(0, 2)).specs()
    assert straggler.parse_args(["--pair", "smollm2-eagle", "--head-quant", "none"]).head_quant == "none"
    assert straggler.parse_args(["--pair", "smollm2-eagle", "--head-products", "float"]).head_products == "float"
    for pair in ("tiny", "smollm2-q4"):  # no head to quantise
        for flag, value in (("--head-quant", "q8_0"), ("--head-products", "int8")):
            with pytest.raises(SystemExit) as exit_:
                straggler.parse_args(["--pair", pair, flag, value])
            field, err = flag[2:].replace("-", "_"), capsys.readouterr().err
            assert exit_.value.code == 2 and f"{field} applies to a pair that drafts with a head" in err
    assert straggler.parse_args(["--pair", "smollm2-eagle", "--int8-reads"]).int8_reads
    assert not straggler.parse_args(["--pair", "smollm2-eagle"]).int8_reads
    with pytest.raises(SystemExit) as exit_:
        straggler.parse_args(["--pair", "tiny", "--int8-reads"])
    assert exit_.value.code == 2 and "int8_reads" in capsys.readouterr().err


def test_int8_reads_loads_the_target_with_its_products_in_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    from load import straggler
    from specserve.config import MODEL_PAIRS
    from specserve.models import loader

    loaded: list[object] = []
    monkeypatch.setattr(loader, "load_model", lambda spec, device="cpu": loaded.append(spec) or spec)
    monkeypatch.setattr(loader, "load_draft", lambda spec, target, device="cpu": spec)
    monkeypatch.setattr(loader, "load_tokenizer", lambda spec: None)
    monkeypatch.setattr(straggler, "Engine", lambda *a, **k: None)
    for int8 in (True, False):
        straggler.load_models(straggler.StudyConfig(pair="smollm2-eagle", int8_reads=int8))
    target = MODEL_PAIRS["smollm2-eagle"][0]
    assert loaded == [target.model_copy(update={"int8_reads": True}), target]


def test_the_repeats_run_the_policies_in_balanced_orders() -> None:
    """Odd repeats ran the policies reversed: with three, the middle one never ran first. Now every policy takes
    every place and follows every other as often (two policies: as given, then reversed, as before)."""
    from collections import Counter

    from load import straggler

    specs = straggler.parse_args(["--pair", "tiny", "--policies", "plain", "ddd", "dsde_cap"]).specs()
    names = [[p for p, _ in straggler.pass_order(specs, r, alternate=True)] for r in range(6)]
    forward = [PolicyName.plain, PolicyName.ddd, PolicyName.dsde_cap]
    assert all(sorted(n, key=forward.index) == forward for n in names)
    assert set(Counter((p, i) for n in names for i, p in enumerate(n)).values()) == {2}  # each in each place twice
    follows = Counter((a, b) for n in names for a, b in itertools.pairwise(n))
    assert len(follows) == 6 and set(follows.values()) == {2}
    assert straggler.alternating("ab", 0, True) == ["a", "b"] and straggler.alternating("ab", 1, True) == ["b", "a"]
    assert [p for p, _ in straggler.pass_order(specs, 1, alternate=False)] == forward
    assert straggler.parse_args(["--pair", "tiny"]).alternate
    assert not straggler.parse_args(["--pair", "tiny", "--same-order"]).alternate


def test_study_drafter_applies_to_every_speculative_policy(capsys: pytest.CaptureFixture[str]) -> None:
    from load import straggler

    argv = ["--pair", "tiny", "--drafter", "lookup", "--model-max-sl", "2", "--model-budget", "6"]
    specs = straggler.parse_args(argv).specs()
    assert specs[PolicyName.plain].method == SpecMethod.none
    spec_policies = [s for p, s in specs.items() if p != PolicyName.plain]
    assert len(spec_policies) == len(specs) - 1 >= 5
    assert all(s.drafter == Drafter.lookup and s.model_fallback and s.model_max_sl == 2 for s in spec_policies)
    assert specs[PolicyName.ddd].model_tree_budget == 6 and specs[PolicyName.ddd].budget == 16
    default = straggler.parse_args(["--pair", "tiny"]).specs()
    assert {s.drafter for s in default.values()} == {Drafter.model}
    with pytest.raises(SystemExit) as exit_:
        straggler.parse_args(["--pair", "tiny", "--drafter", "ngram"])
    assert exit_.value.code == 2 and "--drafter" in capsys.readouterr().err


def test_the_engine_sweep_warms_every_policy_up_once_untimed_without_warm_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --warm-guard nothing ran untimed: the first timed run (plain, at the first batch size) paid the
    process's first forwards alone, and every policy's vs_plain there was inflated."""
    from load import straggler

    cfg = straggler.StudyConfig(pair="tiny", batch_sizes=[1, 2], policies=[PolicyName.plain, PolicyName.dsde_cap],
                                workloads=[WorkloadKind.synthetic], requests_per_slot=1, min_tokens=4, max_tokens=4,
                                repeats=1, out=tmp_path)  # fmt: skip
    real = straggler.run_engine_point
    runs: list[tuple[int, PolicyName, int | None]] = []  # (batch, policy, repeat: None untimed)

    def counted(
        cfg_: Any, models: Any, wl: Any, batch: int, policy: PolicyName, spec: Any, *args: Any, **kw: Any
    ) -> Any:
        runs.append((batch, policy, args[0] if args else None))
        return real(cfg_, models, wl, batch, policy, spec, *args, **kw)

    monkeypatch.setattr(straggler, "run_engine_point", counted)
    _, traces = straggler.engine_sweep(cfg)
    untimed = [(b, p) for b, p, r in runs if r is None]
    assert untimed == [(1, PolicyName.plain), (1, PolicyName.dsde_cap)]  # once, at the first point, every policy
    assert len(traces) == 4 and len(runs) == 6  # the untimed runs leave no trace


def test_warm_guard_carries_its_measurements_across_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from load import straggler
    from specserve.guard import GuardConfig, ThroughputGuard, bucket

    cfg = straggler.StudyConfig(pair="tiny", batch_sizes=[2], policies=[PolicyName.dsde_cap], guard=True,
                                workloads=[WorkloadKind.synthetic], requests_per_slot=1, min_tokens=40,
                                max_tokens=40, out=tmp_path)  # fmt: skip
    models = straggler.load_models(cfg)
    wl = straggler.make_workload(cfg, WorkloadKind.synthetic, 2, models.encode)
    spec = cfg.specs()[PolicyName.dsde_cap]
    _, fresh = straggler.run_engine_point(cfg, models, wl, 2, PolicyName.dsde_cap, spec)
    assert next(st.levels for st in fresh.steps if len(st.seqs) == 2) == 0  # a fresh guard measures plain first
    known = ThroughputGuard(GuardConfig(explore_every=1000))  # has measured speculation far faster at this batch size
    known.rates = {(bucket(2), True): 1e9, (bucket(2), False): 1.0}
    known.samples = {(bucket(2), True): known.cfg.warmup, (bucket(2), False): known.cfg.warmup}
    _, warm = straggler.run_engine_point(cfg, models, wl, 2, PolicyName.dsde_cap, spec, guard=known)
    both = [st.levels for st in warm.steps if len(st.seqs) == 2]
    assert len(both) >= 2 and all(levels > 0 for levels in both)  # it speculates from the first step
    assert known.steps[bucket(2)] >= len(both) - 1  # its counts go on in the same guard (prefill steps are not timed)
    with pytest.raises(ValueError, match="warm_guard needs guard"):
        straggler.StudyConfig(pair="tiny", warm_guard=True)
    out = tmp_path / "cli"
    argv = ["--pair", "tiny", "--batch-sizes", "2", "--policies", "plain", "dsde_cap", "--workloads", "synthetic"]
    argv += ["--requests-per-slot", "1", "--min-tokens", "8", "--max-tokens", "8", "--guard", "--warm-guard"]
    assert straggler.main([*argv, "--out", str(out)]) == 0
    assert len(read_traces(out / "traces.jsonl")) == 2  # the warm-up runs are not recorded
    assert "one per policy across its runs" in (out / "report.md").read_text()
    assert [t.settings.follow_drift for t in read_traces(out / "traces.jsonl")] == [False, False]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="follow_drift needs guard"):
        straggler.StudyConfig(pair="tiny", follow_drift=True)
    drifting = straggler.StudyConfig(pair="tiny", guard=True, follow_drift=True)
    engines: list[Any] = []
    real_engine = straggler.Engine
    monkeypatch.setattr(straggler, "Engine", lambda *a, **kw: engines.append(real_engine(*a, **kw)) or engines[-1])
    trace = straggler.run_engine_point(drifting, models, wl, 2, PolicyName.dsde_cap, spec)[1]
    assert trace.settings is not None and trace.settings.follow_drift  # runs under it are told apart
    guard = engines[-1].loop.planner.guard
    assert guard is not None and guard.cfg.follow_drift


# ─────────────────────────── a short Locust run against a tiny deployment ───────────────────────────

TINY_APP_ARGS: dict[str, Any] = {
    "tiny": {"seed": 0, "draft_noise": 0.1},
    "speculation": {"method": "chain", "policy": "dsde"},
    "max_batch_size": 4,
    "max_queued_requests": 16,
    "router_resources": {"num_cpus": 0.1},
    "target_resources": {"num_cpus": 0.1},
    "draft_resources": {"num_cpus": 0.1},
}


@pytest.fixture
def tiny_deployment(request: pytest.FixtureRequest) -> Iterator[str]:
    if "load" not in (request.config.option.markexpr or "") and os.environ.get("SPECSERVE_LOAD_TEST") != "1":
        pytest.skip("Locust run against a Serve app (~60 s): run with `pytest -m load` or SPECSERVE_LOAD_TEST=1")
    if importlib.util.find_spec("locust") is None:  # not imported here: Locust monkey-patches the process
        pytest.skip("locust is not installed (pip install locust)")
    try:
        from deployments.app import app_builder
    except ImportError as e:
        pytest.skip(f"deployments.app is not importable yet: {e}")
    # address="local": a fresh cluster of our own, never one another process on this machine is running
    with serve_app(app_builder(TINY_APP_ARGS), name="load-test", route_prefix="/", address="local", num_cpus=4) as url:
        yield url


@pytest.mark.load
def test_locust_short_run_has_no_failures(tiny_deployment: str, tmp_path: Path) -> None:
    prefix = tmp_path / "locust"
    env = {**os.environ, "SPECSERVE_MAX_TOKENS": "24", "SPECSERVE_CATEGORIES": "coding,writing"}
    env["SPECSERVE_MAX_PROMPT_CHARS"] = "600"  # the tiny models' context is 512 tokens
    env.pop(ALLOW_REMOTE_ENV, None)
    cmd = [sys.executable, "-m", "locust", "-f", "load/locustfile.py", "--headless", "-u", "4", "-r", "2"]
    cmd += ["-t", "30s", "--host", tiny_deployment, "--csv", str(prefix), "--only-summary", "--stop-timeout", "30"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    err = proc.stderr
    assert proc.returncode == 0, err[err.find("Traceback") :][:3000] if "Traceback" in err else err[-3000:]
    with open(f"{prefix}_stats.csv") as f:
        stats = list(csv.DictReader(f))
    by_type = {}
    for row in stats:
        by_type.setdefault(row["Type"], []).append(row)
        assert int(row["Failure Count"]) == 0, row
    assert {"POST", "TTFT", "TPOT", "TOKENS"} <= set(by_type), sorted(by_type)
    assert sum(int(r["Request Count"]) for r in by_type["POST"]) >= 4
    assert time.perf_counter() - t0 < 150


class Misbehaviour(str, Enum):
    ok = "ok"
    busy = "busy"  # a 429
    error_event = "error event"  # an SSE error event after a chunk
    no_done = "no [DONE]"  # the stream ends without the sentinel
    cut = "cut"  # the connection drops mid-body
    stall = "stall"  # keep-alive comments for 3 s before the rest: past the client's deadline, never a silent read


def _misbehaving_api() -> FastAPI:
    """A chat-completions endpoint that answers each request the next way of ``Misbehaviour`` in turn."""
    from fastapi.responses import JSONResponse, StreamingResponse

    api, turn = FastAPI(), itertools.count()
    chunk = 'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    # (one event's JSON over two data lines, which the SSE format joins: read line by line, every stream failed)
    usage = 'data: {"choices":[],\ndata: "usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'

    asked = itertools.count()

    @api.get("/v1/models")
    def models() -> Any:
        if next(asked) == 0:  # still starting: a user that guessed a model name then failed every request
            return JSONResponse({"error": {"message": "starting"}}, status_code=503)
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @api.post("/v1/chat/completions")
    def chat(body: dict[str, Any]) -> Any:
        if body.get("model") != "fake":
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}}, status_code=404)
        kind = list(Misbehaviour)[next(turn) % len(Misbehaviour)]
        if kind == Misbehaviour.busy:
            return JSONResponse({"error": {"message": "at capacity"}}, status_code=429, headers={"Retry-After": "1"})

        def events() -> Iterator[str]:
            yield chunk
            if kind == Misbehaviour.error_event:
                yield 'data: {"error":{"message":"the lane lost its workers","type":"server_error"}}\n\n'
            if kind == Misbehaviour.cut:
                raise RuntimeError("connection dropped")
            if kind == Misbehaviour.stall:
                for _ in range(12):
                    time.sleep(0.25)
                    yield ": keep-alive\n\n"
            yield chunk + usage
            if kind != Misbehaviour.no_done:
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return api


def test_locust_counts_each_broken_answer_as_that_requests_failure(tmp_path: Path) -> None:
    """The locustfile against a server that answers in turn a full stream, a 429, an error event, a stream without
    [DONE], a cut connection and a stream kept open by keep-alives past SPECSERVE_TIMEOUT_S (requests' timeout
    restarts at every byte: it counted as a success): each bad answer is a failure with its own reason; only full
    streams give latency."""
    if importlib.util.find_spec("locust") is None:  # not imported here: Locust monkey-patches the process
        pytest.skip("locust is not installed (pip install locust)")
    from tests.api_backend import serving

    prefix = tmp_path / "locust"
    env = {**os.environ, "SPECSERVE_WAIT_MAX_S": "0.01", "SPECSERVE_CATEGORIES": "coding", "SPECSERVE_TIMEOUT_S": "1.5"}
    env.pop(ALLOW_REMOTE_ENV, None)
    with serving(_misbehaving_api()) as url:
        # 20 s: with both cores busy, a 6 s run ended before Locust recorded a request
        cmd = [sys.executable, "-m", "locust", "-f", "load/locustfile.py", "--headless", "-u", "1", "-r", "1"]
        host = url.removeprefix("http://")  # a bare host:port is plain HTTP (every request failed with it before)
        cmd += ["-t", "20s", "--host", host, "--csv", str(prefix), "--only-summary", "--stop-timeout", "5"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]  # Locust's exit code when requests failed
    with open(f"{prefix}_stats.csv") as f:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    with open(f"{prefix}_failures.csv") as f:
        rows = list(csv.DictReader(f))
    failures = {row["Error"]: int(row["Occurrences"]) for row in rows if row["Method"] == "POST"}
    assert [(row["Name"], row["Occurrences"]) for row in rows if row["Method"] == "GET"] == [("/v1/models", "1")]
    post = stats["POST", "/v1/chat/completions [stream]"]
    sent, failed = int(post["Request Count"]), int(post["Failure Count"])
    assert sent >= 2 * len(Misbehaviour)
    reasons = {
        "HTTP 429": Misbehaviour.busy,
        "the lane lost its workers": Misbehaviour.error_event,
        "the stream ended without data: [DONE]": Misbehaviour.no_done,
        "stream broken": Misbehaviour.cut,
        "no end of stream within 1.5 s": Misbehaviour.stall,
    }
    seen = {kind: sum(n for error, n in failures.items() if reason in error) for reason, kind in reasons.items()}
    assert all(n >= 1 for n in seen.values()), failures
    assert sum(seen.values()) == failed == sum(failures.values())
    assert int(stats["TTFT", "coding"]["Request Count"]) == sent - failed  # latency from full streams only
    assert float(stats["TOKENS", "coding"]["Min Response Time"]) == 2  # the usage chunk's completion tokens


def test_the_locust_user_times_a_body_without_chunked_encoding_as_it_arrives() -> None:
    """A stream whose body ends when the server closes the connection (no Content-Length, no chunked encoding, as
    HTTP/1.0-style proxies send it): its first event is timed when it arrives, not when the body ends (requests'
    iter_content(None) read such a body whole, so every event was stamped at the close)."""
    if importlib.util.find_spec("locust") is None:  # not imported here: Locust monkey-patches the process
        pytest.skip("locust is not installed (pip install locust)")
    import re
    import socket
    import threading

    first = b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    last = b'data: {"choices":[{"delta":{"content":"!"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            while len(body) < length:  # the whole request read: a close with unread bytes is a reset, not an end
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + first)
            time.sleep(1.5)
            conn.sendall(last)  # then the close ends the body

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    script = (
        "from load.locustfile import _arriving\n"  # first: Locust patches the socket and ssl modules as it loads
        "import json, sys, time, requests\n"
        "from load.client import read_stream, sse_lines\n"
        "t0 = time.perf_counter()\n"
        "with requests.post(sys.argv[1], json={}, stream=True, timeout=30) as resp:\n"
        "    stats = read_stream(sse_lines(_arriving(resp)), t0, 30.0)\n"
        "print(json.dumps({'ttft': stats.ttft_s, 'end': stats.end_s, 'text': stats.text, 'done': stats.done}))\n"
    )
    url = f"http://127.0.0.1:{server.getsockname()[1]}/v1/chat/completions"
    with server:
        cmd = [sys.executable, "-c", script, url]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        thread.join(timeout=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["text"] == "hi!" and got["done"]
    assert got["end"] >= 1.5 and got["ttft"] < got["end"] - 1.0, got  # the first event before the second was sent


def test_a_dropped_stream_is_that_requests_failure_not_the_sweeps() -> None:
    """The HTTP sweep's per-request client: a connection cut mid-body, or refused, or a 429, is counted as the
    request's failure; a complete stream is not."""
    import httpx

    from load.straggler import _stream_one

    chunk = b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\n'

    class CutStream(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield chunk
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    def handler(request: httpx.Request) -> httpx.Response:
        kind = json.loads(request.content)["kind"]
        if kind == "refused":
            raise httpx.ConnectError("connection refused")
        if kind == "busy":
            return httpx.Response(429, headers={"Retry-After": "2"})
        if kind == "cut":
            return httpx.Response(200, stream=CutStream())
        done = chunk + b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, content=done)

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        kinds = ("ok", "cut", "refused", "busy")
        stats = {k: _stream_one(client, "http://127.0.0.1:1", {"kind": k}, 60.0) for k in kinds}
    assert stats["ok"].failure() is None
    assert "RemoteProtocolError" in (stats["cut"].failure() or "")
    assert "ConnectError" in (stats["refused"].failure() or "")
    assert stats["busy"].failure() == "HTTP 429"


def test_a_stream_kept_open_by_keep_alives_past_the_deadline_is_that_requests_failure() -> None:
    """httpx's timeout restarts at every byte, and the server sends a keep-alive comment while a request waits: a
    stalled request never timed out (a hung lane hung the sweep) and one that ended late counted as a success."""
    import httpx

    from load.straggler import _stream_one

    chunk = b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\n'

    class Stalled(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield chunk
            for _ in range(40):  # 2 s of keep-alives, then a complete ending
                time.sleep(0.05)
                yield b": keep-alive\n\n"
            yield chunk + b"data: [DONE]\n\n"

    class LateDone(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield chunk
            time.sleep(0.8)
            yield b"data: [DONE]\n\n"  # the one line past the deadline

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=LateDone() if request.content == b"{}" else Stalled())

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        late = _stream_one(client, "http://127.0.0.1:1", {"stalled": True}, 0.5)
        on_time = _stream_one(client, "http://127.0.0.1:1", {"stalled": True}, 60.0)
        done_late = _stream_one(client, "http://127.0.0.1:1", {}, 0.4)
    assert late.failure() == "no end of stream within 0.5 s" and late.text == "hi"
    assert on_time.failure() is None and on_time.text == "hihi"
    assert done_late.failure() == "no end of stream within 0.4 s"


def test_scrape_sums_counters_over_lanes_and_takes_a_gauges_largest() -> None:
    import httpx

    from load.straggler import scrape

    metrics = (
        "# TYPE specserve_sl_cap gauge\n"
        'specserve_sl_cap{lane="0"} 4\nspecserve_sl_cap{lane="1"} 4\n'
        "# TYPE specserve_straggler_idle_fraction gauge\n"
        'specserve_straggler_idle_fraction{lane="0"} 0.6\nspecserve_straggler_idle_fraction{lane="1"} 0.7\n'
        "# TYPE specserve_step_seconds histogram\n"
        'specserve_step_seconds_bucket{lane="0",le="+Inf"} 3\nspecserve_step_seconds_sum{lane="0"} 0.5\n'
        'specserve_step_seconds_count{lane="0"} 3\n'
        'specserve_step_seconds_bucket{lane="1",le="+Inf"} 2\nspecserve_step_seconds_sum{lane="1"} 0.25\n'
        'specserve_step_seconds_count{lane="1"} 2\n'
    )
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, text=metrics))) as client:
        got = scrape(client, "http://127.0.0.1:1")
    assert got["specserve_sl_cap"] == 4 and got["specserve_straggler_idle_fraction"] == 0.7
    assert got["specserve_step_seconds_count"] == 5 and got["specserve_step_seconds_sum"] == 0.75


def test_a_failed_metrics_scrape_leaves_the_points_server_columns_nan_and_its_requests_counted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 503 from /metrics (a replica restarting) raised out of the HTTP sweep: a traceback, and every point
    measured before it lost (http.csv is written at the end)."""
    import httpx

    import load.straggler as straggler

    def stream_one(client: Any, url: str, body: dict[str, Any], deadline_s: float) -> StreamStats:
        stats = StreamStats(chunk_times=[0.1, 0.2], text="ab", completion_tokens=2, finish_reason="length")
        stats.done, stats.end_s = True, 0.2
        return stats

    monkeypatch.setattr(straggler, "_stream_one", stream_one)
    answers = iter([200, 503])
    metrics = '# TYPE specserve_step_seconds histogram\nspecserve_step_seconds_count{lane="0"} 3\n'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(next(answers), text=metrics)

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        row = straggler._http_point(client, "http://127.0.0.1:1", 2, straggler.HTTP_POLICIES[0], [{}, {}], 60.0)
    assert row["requests"] == 2 and row["failures"] == 0 and row["tok_s"] > 0, row
    assert all(math.isnan(row[k]) for k in ("steps", "mean_step_s", "mean_sl_drafting", "sl_cap_last")), row
    assert "/metrics could not be read" in capsys.readouterr().err


def test_the_straggler_study_refuses_a_remote_url_as_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from load import straggler

    monkeypatch.delenv("SPECSERVE_ALLOW_REMOTE", raising=False)
    assert straggler.main(["--url", "http://10.0.0.1:8000", "--http-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--url: refusing to send load to '10.0.0.1'" in err and "Traceback" not in err


def test_the_straggler_studys_url_check_takes_a_trailing_slash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--url http://127.0.0.1:8000/`` was checked at ``...8000//v1/models``, a 404 that called a working server
    broken (the sweep itself strips the slash)."""
    from load import straggler

    asked: list[str] = []

    def served_model(client: object, url: str) -> str:
        asked.append(url)
        raise straggler.ServerError("stop here")

    monkeypatch.setattr(straggler, "served_model", served_model)
    assert straggler.main(["--url", "http://127.0.0.1:1/", "--http-only", "--out", str(tmp_path)]) == 2
    assert asked == ["http://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--pair", "smollm2-eagle"], "--pair"),
        (["--policies", "plain", "dsde_ddd"], "--policies"),
        (["--ddd-x", "-0.1", "--no-freeze-gc"], "--ddd-x, --no-freeze-gc"),
    ],
)
def test_http_only_refuses_the_engine_sweeps_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    """The HTTP sweep runs its own policies against the deployment's models: with --http-only such flags were
    accepted and did nothing, so a sweep the user believed was of DSDE on the head measured the server's settings."""
    from load import straggler

    with pytest.raises(SystemExit) as exit_:
        straggler.parse_args(["--url", "http://127.0.0.1:1", "--http-only", "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: {named} set the in-process engine sweep" in err, err
    # the HTTP sweep's own settings are taken
    cfg = straggler.parse_args(
        ["--url", "http://127.0.0.1:1", "--http-only", "--repeats", "3", "--batch-sizes", "2", "--seed", "5"]
    )
    assert (cfg.repeats, cfg.batch_sizes, cfg.seed, cfg.workloads) == (3, [2], 5, [])
    # and without --http-only, the engine sweep's flags are its own
    assert straggler.parse_args(["--url", "http://127.0.0.1:1", "--pair", "smollm2-eagle"]).pair == "smollm2-eagle"


def test_a_server_gone_by_the_http_sweep_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server answered the check before the engine sweep (hours, for a real pair) and not the HTTP sweep's own:
    its ServerError was a traceback."""
    from load import straggler

    answers = iter(["m"])

    def served_model(client: object, url: str) -> str:
        if (model := next(answers, None)) is None:
            raise straggler.ServerError("the server went away")
        return model

    monkeypatch.setattr(straggler, "served_model", served_model)
    assert straggler.main(["--url", "http://127.0.0.1:1", "--http-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: --url: the server went away" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--static-sl", "100"], "--static-sl: Input should be less than or equal to 64"),
        (["--max-sl", "500"], "--max-sl: Input"),
        (["--model-max-sl", "999"], "--model-max-sl: Input"),
        (["--beam-width", "100", "--policies", "static"], "--beam-width: Input"),
        (["--budget", "5000"], "--budget: Input"),
        (["--model-budget", "99999"], "--model-budget: Input"),
        (["--seed", str(10**23)], "--seed: Input should be less than"),
        (["--tiny-noise", "1e300"], "--tiny-noise: Input should be less than or equal to 10"),
        (["--batch-sizes", "1", "2000"], "argument --batch-sizes: must be at most 1024"),  # after batch 1's runs
        (["--ddd-x", "0.5"], "--ddd-x: Input should be less than or equal to 0"),  # (named --ddd-threshold)
    ],
)
def test_straggler_speculation_settings_are_usage_errors_before_any_model_loads(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Values beyond SpecConfig's ranges passed the command line and failed in engine_sweep, after the models
    loaded (minutes in, for a real pair): max_sl / model_max_sl went in through model_copy, which does not
    validate; a huge seed overflowed in tiny_model, a huge noise gave NaN weights."""
    from load import straggler

    with pytest.raises(SystemExit) as exit_:
        straggler.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and "Traceback" not in err, err


def test_the_http_sweep_runs_every_policy_on_the_same_requests_in_alternating_passes(tmp_path: Path) -> None:
    """Every (concurrency, policy) point drew its own prompts and lengths, ran once, in one order, cold: "DSDE
    against plain" at concurrency 1 compared two different prompts. Now one set of requests per concurrency runs
    under every policy, repeated in balanced orders, after one untimed request per policy."""
    import json
    import threading

    import httpx

    from load.straggler import HTTP_POLICIES, StudyConfig, http_sweep
    from specserve.timing import balanced_orders

    seen: list[tuple[str, str, int]] = []  # (policy, prompt, max_tokens) of each chat request, in order
    temperatures: list[object] = []  # greedy, as the engine sweep (the server's default is 1: each policy its text)
    lock = threading.Lock()
    names = {json.dumps(p.speculation, sort_keys=True): p.name for p in HTTP_POLICIES}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        body = json.loads(request.content)
        with lock:
            policy = names[json.dumps(body.get("speculation"), sort_keys=True)]
            seen.append((policy, body["messages"][0]["content"], body["max_tokens"]))
            temperatures.append(body.get("temperature"))
            if [p for p, _, _ in seen].count(policy) == 2 and policy == "plain":  # its first timed request
                return httpx.Response(500, json={"error": {"message": "boom"}})
        usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"], "total_tokens": 3 + body["max_tokens"]}
        events = [{"choices": [{"index": 0, "delta": {"content": "hi"}}]}, {"choices": [], "usage": usage}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    cfg = StudyConfig(
        url="http://127.0.0.1:9", workloads=[], batch_sizes=[1, 2], repeats=2, requests_per_slot=2, min_tokens=3,
        max_tokens=40, out=tmp_path,
    )  # fmt: skip
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        rows = http_sweep(cfg, client)
    policies = [p.name for p in HTTP_POLICIES]
    assert [p for p, _, _ in seen[: len(policies)]] == policies and all(n == 3 for _, _, n in seen[: len(policies)])
    timed = seen[len(policies) :]
    for conc, start in ((1, 0), (2, 2 * len(policies) * 2)):  # 2 requests a run at C=1, 4 at C=2; 2 passes each
        per_run = 2 * conc
        block = timed[start : start + 2 * len(policies) * per_run]
        runs = [block[i : i + per_run] for i in range(0, len(block), per_run)]
        orders = balanced_orders(len(policies))[:2]  # each pass in turn, in the first two balanced orders
        assert [r[0][0] for r in runs] == [policies[i] for order in orders for i in order]
        asks = {tuple(sorted((prompt, n) for _, prompt, n in run)) for run in runs}
        assert len(asks) == 1  # every policy, every pass: the same prompts and lengths
    assert len(rows) == 2 * len(policies) and all(r["repeats"] == 2 for r in rows)
    assert all(r["vs_plain"] > 0 for r in rows) and {r["concurrency"] for r in rows} == {1, 2}
    # counted over both passes (the median of [1, 0] was 0.5, and of [0, 0, 1] 0: the failure went unreported)
    assert [(r["concurrency"], r["policy"]) for r in rows if r["failures"]] == [(1, "plain")]
    assert all(r["requests"] == 2 * 2 * r["concurrency"] for r in rows) and sum(r["failures"] for r in rows) == 1
    assert temperatures and set(temperatures) == {0.0}
    # every pass's row was kept as it ended: a sweep stopped part way keeps its passes (http.csv is written at the end)
    passes = [json.loads(line) for line in (tmp_path / "http_passes.jsonl").read_text().splitlines()]
    assert len(passes) == 2 * 2 * len(policies)  # 2 concurrencies x 2 repeats x the policies
    assert sorted((r["concurrency"], r["policy"], r["repeat"]) for r in passes) == sorted(
        (c, p, k) for c in (1, 2) for p in policies for k in (0, 1)
    )
    assert [r for r in passes if r["failures"]] and sum(r["failures"] for r in passes) == 1


def test_the_http_sweep_and_locust_users_send_the_deployments_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyed deployment (the cluster configs need SPECSERVE_API_KEY) answered every request of the HTTP sweep and
    of the Locust users 401: neither sent a key."""
    import json

    import httpx

    from load.straggler import StudyConfig, http_sweep

    monkeypatch.setenv("SPECSERVE_API_KEY", " k3y\n")  # (a secret file's newline: the server strips it too)
    auths: set[str | None] = set()

    def answer(request: httpx.Request) -> httpx.Response:
        auths.add(request.headers.get("authorization"))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        sse = f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'hi'}}]})}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    cfg = StudyConfig(url="http://127.0.0.1:9", workloads=[], batch_sizes=[1], min_tokens=3, max_tokens=3, out=tmp_path)
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        rows = http_sweep(cfg, client)
    assert rows and all(r["failures"] == 0 for r in rows) and auths == {"Bearer k3y"}
    code = (
        "from locust.env import Environment\n"
        "from load.locustfile import SpecServeUser\n"
        "user = SpecServeUser(Environment(user_classes=[SpecServeUser], host='http://127.0.0.1:9'))\n"
        "user.on_start()\n"
        "print(user.client.headers.get('Authorization'))\n"
    )
    for key, sent in (("k3y", "Bearer k3y"), ("", "None")):
        env = {**os.environ, "SPECSERVE_MODEL": "m", "SPECSERVE_API_KEY": key}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == sent


def test_locust_users_draw_the_same_prompt_streams_for_the_same_seed() -> None:
    """Each user's generator was seeded from id(self), a memory address: SPECSERVE_SEED did not reproduce a run, and
    two runs meant as an A/B pair (SPECSERVE_POLICY none vs dsde) sent different prompt mixes. In a child process,
    as locust's other tests: importing locust patches this process's threads into greenlets."""
    import json

    code = (
        "import json\n"
        "from locust.env import Environment\n"
        "from load.locustfile import SpecServeUser\n"
        "env = Environment(user_classes=[SpecServeUser], host='http://127.0.0.1:9')\n"
        "users = [SpecServeUser(env) for _ in range(3)]\n"
        "for user in users:\n"
        "    user.on_start()\n"
        "print(json.dumps([[user.rng.random() for _ in range(4)] for user in users]))\n"
    )
    env = {**os.environ, "SPECSERVE_MODEL": "m", "SPECSERVE_SEED": "7"}  # (SPECSERVE_MODEL: no GET /v1/models)

    def users_draws() -> list[list[float]]:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, again = users_draws(), users_draws()
    assert first == again and len({tuple(d) for d in first}) == 3  # reproducible, and each user its own stream
