"""`specserve` on the command line: bad arguments are a usage error on stderr with exit status 2, never a
traceback (before any model loads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.cli import main
from specserve.sampling import SamplingParams
from specserve.structured import FormatKind, OutputFormat
from tests.conftest import forbid_model_loads


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--max-tokens", "0"], "argument --max-tokens: must be at least 1, not 0"),
        (["--top-k", "x"], "argument --top-k: 'x' is not an integer"),
        (["--top-p", "2"], "--top-p: Input should be less than or equal to 1"),  # (named top_p: not a flag)
        (["--min-p", "1.5"], "--min-p: "),
        (["--temperature", "-1"], "--temperature: "),
        (["--max-model-len", "8"], "--max-model-len: Input should be greater than or equal to 16"),
        (["--device", "bogus"], "'bogus' is not a torch device"),
        (["--draft", "none", "--method", "ddd"], "--method ddd needs a draft"),  # was ignored: plain decoding
        (["--draft", "smollm2-eagel"], "--draft 'smollm2-eagel' is not 'auto'"),  # was "no config.json in ..."
        (["--draft", "h" * 300], "is not 'auto', 'none', a built-in pair"),  # a name too long for a path: a traceback
        (["--draft", "~no-such-user-here/head"], "is not 'auto', 'none', a built-in pair"),  # expanduser raised
        (["--temperature", "nan"], "argument --temperature: must be a finite number, not nan"),  # was "<= 100"
        (["--top-p", "inf"], "argument --top-p: must be a finite number, not inf"),
        (["--logit-bias", "5"], "argument --logit-bias: ID=BIAS (a token id and a number), not '5'"),
        (["--logit-bias", "x=1"], "argument --logit-bias: 'x' is not an integer"),
        (["--logit-bias", "5=nan"], "argument --logit-bias: must be a finite number, not nan"),
        (["--logit-bias", "5=101"], "a bias is in [-100, 100], not 101.0"),
        (["--stop-token-id", "-1"], "argument --stop-token-id: must be at least 0, not -1"),
        (["--min-tokens", "9", "--max-tokens", "8"], "min_tokens (9) must be at most max_tokens (8)"),
        (["--json", "--regex", "a"], "argument --regex: not allowed with argument --json"),
        (["--json-schema", "{not json"], "--json-schema: not JSON"),
        (["--json-schema", "/no/such/schema.json"], "--json-schema: cannot read '/no/such/schema.json'"),
        (["--json-schema", "[1]"], "--json-schema: a JSON schema is an object (or true / false)"),  # "cannot read"
        (["--grammar", "/no/such.lark"], "--grammar: cannot read '/no/such.lark'"),
        (["--choice", "a", "--grammar", "start: x"], "argument --grammar: not allowed with argument --choice"),
        (["--json", "--ignore-eos"], "a structured answer ends where its grammar is satisfied: not with ignore_eos"),
    ],
)
def test_bad_generate_arguments_are_usage_errors(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main(["generate", "hello", *args])
    except SystemExit as e:  # argparse's own usage errors
        status = int(e.code or 0)
    assert status == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "spec", "--num-prompts", "0"], "argument --num-prompts: must be at least 1, not 0"),
        (["bench", "spec", "--budget", "-1"], "argument --budget: must be at least 0, not -1"),
        (["bench", "spec", "--budget", "1", "--num-prompts", "1"], "--budget 1: Input should be greater than or equal"),
        (["bench", "spec", "--ddd-x", "0.5"], "--ddd-x 0.5: Input should be less than or equal"),  # was ddd_threshold
        (["bench", "spec", "--free-budget", "1"], "--free-budget 1: Input should be greater"),
        (["bench", "catch-up", "--switch-after", "0"], "argument --switch-after: must be at least 1, not 0"),
        (["bench", "catch-up", "--windows", "0"], "argument --windows: must be at least 1, not 0"),
        (["bench", "overhead", "--repeats", "0"], "argument --repeats: must be at least 1, not 0"),
        (["bench", "runner", "--rows", "4", "0"], "argument --rows: must be at least 1, not 0"),
        (["bench", "agreement", "--per-set", "0"], "argument --per-set: must be at least 1, not 0"),
        (["train-draft", "--out", "x", "--epochs", "0"], "argument --epochs: must be at least 1, not 0"),
        (["train-draft", "--out", "x", "--prompts", "-1"], "argument --prompts: must be at least 0, not -1"),
        (["train-draft", "--out", "x", "--prompts", "0"], "no training data"),
        (["train-draft", "--out", "x", "--seed", str(1 << 40)], "argument --seed: must be below 2^32"),
        # a chunk's index past 2^20 (--batch-size 1) overflowed its request seeds after all other data was made
        (["train-draft", "--out", "x", "--self-prompts", str((1 << 20) + 1)], "--self-prompts: must be at most"),
        (["train-draft", "--out", "x", "--batch-size", "2048"], "argument --batch-size: must be at most 1024"),
        (["train-draft", "--out", "x", "--lr", "inf"], "argument --lr: must be a positive finite number"),
        (["train-draft", "--out", "x", "--work-dir", __file__], "is not a directory results can be written to"),
        # a name too long for a path: OSError from exists() or is_dir(), a traceback past argparse
        (["train-draft", "--out", "o" * 300], "argument --out: " + repr("o" * 300) + " is not a directory results"),
        (["bench", "overhead", "--out", "o" * 300 + "/x.csv"], "argument --out: " + repr("o" * 300 + "/x.csv")),
        # an empty path was the current directory: a head's files and its work data went there
        (["train-draft", "--out", ""], "argument --out: an empty path is no directory to write results to"),
        (["train-draft", "--out", "x", "--work-dir", " "], "argument --work-dir: an empty path is no directory"),
        (["bench", "overhead", "--out", ""], "argument --out: an empty path is no file to write results to"),
        (["bench", "attention", "--heads", "9", "--kv-heads", "4"], "--heads 9 is not a multiple of --kv-heads 4"),
        (["bench", "overhead", "--out", str(Path(__file__).parent)], "is a directory; this --out names the file"),
        (["bench", "llamacpp", "--workdir", __file__], "is not a directory results can be written to"),
        (["bench", "spec", "--ddd-x", "nan"], "argument --ddd-x: must be a finite number, not nan"),
        # more sequences than a loop runs failed only after the smaller batch sizes' runs, naming max_batch_size
        (["bench", "batch", "--batch-sizes", "1", "2048"], "argument --batch-sizes: must be at most 1024, not 2048"),
        (["bench", "ar", "--batch-sizes", "8", "2048"], "argument --batch-sizes: must be at most 1024, not 2048"),
        (["bench", "catch-up", "--switch-batch", "2048"], "argument --switch-batch: must be at most 1024, not 2048"),
        (["bench", "overhead", "--batch", "2048"], "argument --batch: must be at most 1024, not 2048"),
        # more prompts than MT-bench has ran its 80 (the summary named the number asked)
        (["bench", "ar", "--num-prompts", "200"], "--num-prompts 200: MT-bench has 80 first turns"),
        (["bench", "agreement", "--sets", "mt-bench", "--per-set", "100"], "--per-set 100: MT-bench has 80 first"),
        (["bench", "spec", "--tree-min-prob", "x"], "argument --tree-min-prob: 'x' is not a number"),
        (["bench", "catch-up", "--tree-min-prob", "inf"], "argument --tree-min-prob: must be a finite number"),
        (["bench", "batch", "--synthetic-mix", "nan"], "argument --synthetic-mix: must be a finite number"),
        (["train-draft", "--out", "x", "--lr", "nan"], "argument --lr: must be a positive finite number, not nan"),
    ],
)
def test_bad_bench_and_training_arguments_are_usage_errors(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import specserve.bench.spec
    import specserve.models.loader

    forbid_model_loads(monkeypatch, specserve.models.loader, specserve.bench.spec)
    try:
        status = main(argv)
    except SystemExit as e:
        status = int(e.code or 0)
    assert status == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_bench_agreement_refuses_a_set_it_cannot_make_before_loading_the_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without WordNet the lexicon set (a default one) failed after the target loaded and the sets before it ran."""
    import specserve.bench.agreement as agreement
    from specserve.train.lexicon_prompts import WordNetMissing

    def no_wordnet(*_: object, **__: object) -> list[str]:
        raise WordNetMissing("WordNet not found in /nowhere: install the Debian package wordnet-base")

    def no_model(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded before every set's prompts were made")

    monkeypatch.setattr(agreement, "lexicon_prompts", no_wordnet)
    monkeypatch.setattr(agreement, "load_model", no_model)
    assert main(["bench", "agreement", "--sets", "seeds", "lexicon", "--per-set", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "WordNet not found" in err and "Traceback" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA accepts --device cuda")
def test_a_cuda_device_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hello", "--device", "cuda"])
    assert exit_.value.code == 2 and "this torch has no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["mps", "meta", "xpu"])
def test_a_device_models_cannot_run_on_is_a_usage_error(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hello", "--device", device])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "models run on cpu or cuda" in err and "Traceback" not in err


def test_an_unreadable_gguf_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unreadable = tmp_path / "model.gguf"
    unreadable.symlink_to(Path("/proc/self/mem"))  # a regular file whose first bytes cannot be read (EIO)
    assert main(["models", "pull", str(unreadable)]) == 2
    err = capsys.readouterr().err
    assert "specserve: error: cannot read GGUF file" in err and "Traceback" not in err


def test_an_unwritable_out_dir_is_a_usage_error_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "spec", "--out", str(blocker / "spec")])  # under a file: no directory can be made there
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "results can be written" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "batch", "--min-tokens", "50", "--max-tokens", "10"], "exceeds --max-tokens"),
        (["bench", "batch", "--workloads", "synthetic", "--synthetic-mix", "1.5"], "--synthetic-mix"),
        (["bench", "batch", "--workloads", "synthetic", "--synthetic-mix", "0"], "--synthetic-mix"),
        (["bench", "spec", "--prompts", "/nonexistent/prompts.jsonl"], "prompts.jsonl"),
        pytest.param(  # a KVCapacityError once the target's copies had loaded (its config is read: real_model)
            ["bench", "runner", "--context", "8190", "--rows", "1", "4"],
            "--context 8190 and --rows 4 need 8194 positions; the target has 8192",
            marks=pytest.mark.real_model,
        ),
    ],
)
def test_bench_settings_fail_before_any_model_loads(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from specserve.bench import batch_sweep, runner, spec

    forbid_model_loads(monkeypatch, batch_sweep, runner, spec)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_train_draft_without_wordnet_fails_before_loading_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import specserve.models.loader as loader

    forbid_model_loads(monkeypatch, loader)
    argv = ["train-draft", "--out", str(tmp_path / "h"), "--lexicon-prompts", "5", "--wordnet-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "WordNet not found" in err and "Traceback" not in err, err


def test_train_draft_with_a_corrupt_wordnet_fails_before_loading_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed line of cntlist.rev was an unpacking ValueError, after the seed prompts' data step (hours)."""
    import specserve.models.loader as loader

    forbid_model_loads(monkeypatch, loader)
    (tmp_path / "data.noun").write_text("00001740 03 n 01 entity 0 000 | that which exists\n")
    (tmp_path / "cntlist.rev").write_text("entity%1:03:00:: 1 11\nthis line has four fields\n")
    argv = ["train-draft", "--out", str(tmp_path / "h"), "--lexicon-prompts", "5", "--wordnet-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cntlist.rev line 2 is not in WordNet's format" in err and "Traceback" not in err, err


@pytest.mark.real_model
def test_train_draft_refuses_a_target_without_a_chat_template_before_it_loads() -> None:
    from specserve.config import ModelSpec
    from specserve.errors import SettingsError
    from specserve.models.loader import load_tokenizer
    from specserve.train.pipeline import check_chat_template

    tokenizer = load_tokenizer(ModelSpec())
    check_chat_template(tokenizer, self_prompts=True)
    tokenizer.chat_template = None
    with pytest.raises(SettingsError, match="chat template"):
        check_chat_template(tokenizer, self_prompts=False)


def test_a_prompts_file_that_is_not_utf8_or_has_an_infinite_id_is_a_clear_error(tmp_path: Path) -> None:
    from specserve.bench.prompt_sets import load_prompts
    from specserve.errors import InvalidRequestError

    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(InvalidRequestError, match="cannot read the prompts file"):
        load_prompts(binary)
    infinite = tmp_path / "inf.jsonl"
    infinite.write_text('{"question_id": Infinity, "category": "x", "turns": ["hi"]}\n')
    with pytest.raises(InvalidRequestError, match="line 1: want a JSON object"):
        load_prompts(infinite)


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback() -> None:
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # `specserve ... | head -c 1` once head has exited
    try:
        done = subprocess.run(
            [sys.executable, "-m", "specserve.cli", "models", "list"], stdout=write, stderr=subprocess.PIPE, timeout=120
        )
    finally:
        os.close(write)
    assert done.returncode == 1 and b"Traceback" not in done.stderr and b"BrokenPipeError" not in done.stderr, done


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "attention", "--batch-sizes", "100000000"], "--batch-sizes x (--context + --tokens) needs"),
        (["bench", "attention", "--context", "100000000"], "GiB available here"),
        (["bench", "lm-head", "--tiny", "--evict-mb", "100000000"], "--evict-mb 100000000 needs"),
        (["bench", "lm-head", "--tiny", "--rows", "100000000"], "--rows 100000000 needs"),
        (["bench", "agreement", "--sets", "seeds", "--seed-offset", "1000000000000"], "at most their first"),
        (["bench", "agreement", "--per-set", "2000"], "--per-set 2000: a set's prompts run as one batch"),
    ],
)
def test_bench_sizes_beyond_this_machine_are_refused_before_allocating(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sizes no host has ended in an allocator traceback (or a kernel OOM kill), and a seed offset of 1e12
    enumerated prompts for ever: each is now a one-line error before the work."""
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_bench_overhead_refuses_answers_longer_than_its_context_before_starting_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every answer is --max-tokens long on both sides: past the context, an AssertionError once Ray had started."""
    import ray

    assert main(["bench", "overhead", "--tiny", "--max-tokens", "1100", "--out", str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 1100: the longest prompt (12 tokens) and the answer exceed" in err and "Traceback" not in err
    assert not ray.is_initialized()


def test_bench_overheads_engine_runs_the_loop_the_apps_lanes_run() -> None:
    """The in-process side ran without the app's throughput guard and step budget (a pair's serving defaults), so
    its "overhead" mixed in a difference of speculation."""
    from deployments.app_args import AppArgs
    from specserve.bench.overhead import _engine

    raw = {"tiny": {}, "throughput_guard": True, "max_step_tokens": 40, "max_batch_size": 4, "freeze_gc": False}
    args = AppArgs.model_validate(raw)
    engine = _engine(args)
    assert engine.loop.planner.guard is not None and engine.loop.planner.max_step_tokens == 40
    assert engine.loop.features is None  # a draft model (the default tiny draft) reads no target features


def test_bench_overheads_engine_drafts_with_the_apps_tiny_head() -> None:
    """With ``tiny: {draft_head: true}`` the app's draft actor builds a random EAGLE head, and the in-process side
    drafted with a noisy copy of the target instead."""
    from deployments.app_args import AppArgs
    from specserve.bench.overhead import _engine
    from specserve.workers.head_draft import HeadDraftWorker

    engine = _engine(AppArgs.model_validate({"tiny": {"draft_head": True}, "max_batch_size": 2, "freeze_gc": False}))
    assert isinstance(engine.loop.draft, HeadDraftWorker) and engine.loop.features is not None


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"data": {"num_prompts": "abc"}}'])
def test_a_heads_unreadable_provenance_is_a_named_error(tmp_path: Path, text: str) -> None:
    """The held-out sets start past a compared head's training prompts, read from its provenance.json: one that
    is not a record (cut off while written, another file) was a JSONDecodeError, AttributeError or ValueError."""
    from specserve.bench.agreement import trained_prompts
    from specserve.errors import CorruptModelError

    (tmp_path / "provenance.json").write_text(text)
    with pytest.raises(CorruptModelError, match=r"provenance\.json: not a provenance record of train-draft"):
        trained_prompts([str(tmp_path)])
    (tmp_path / "provenance.json").write_text('{"data": {"num_prompts": 3072, "lexicon_prompts": null}}')
    assert trained_prompts([str(tmp_path)]) == {"seeds": 3072, "lexicon": 0}


def test_train_draft_reads_its_corpus_before_loading_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corpus file named directly that is not UTF-8 failed only after the other data steps (hours in)."""
    import specserve.models.loader as loader

    forbid_model_loads(monkeypatch, loader)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    argv = ["train-draft", "--out", str(tmp_path / "h"), "--corpus", str(tmp_path / "latin1.txt")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "Traceback" not in err, err


def test_train_draft_counts_its_corpus_passages_before_loading_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corpus without a passage long enough was dropped without a word (or, alone, called "no training data"
    after the load); fewer passages than asked for are said."""
    import specserve.models.loader as loader

    forbid_model_loads(monkeypatch, loader)
    short = tmp_path / "short.txt"
    short.write_text("A line.\n\nAnother short paragraph.\n")
    assert main(["train-draft", "--out", str(tmp_path / "h"), "--corpus", str(short)]) == 2
    err = capsys.readouterr().err
    assert f"--corpus {short}: no passage of 300-2000 characters" in err and "Traceback" not in err, err
    one = tmp_path / "one.txt"
    one.write_text(" ".join(["A sentence of a paragraph long enough to be a passage."] * 8) + "\n")
    with pytest.raises(AssertionError, match="a model was loaded"):  # the run goes on to the load
        main(["train-draft", "--out", str(tmp_path / "h"), "--corpus", str(one), "--corpus-passages", "5"])
    assert f"--corpus {one}: 1 passages, not the 5 asked for" in capsys.readouterr().err


def test_draft_auto_says_when_it_finds_no_pair_for_the_target(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dtype bfloat16 has no built-in pair: 'auto' turned speculation off without a word. Said only for a run that
    goes on: with --method it announced a run, then refused it."""
    import specserve.models.loader as loader

    def no_load(*args: object) -> None:
        raise AssertionError("the run went on to load the tokenizer")

    monkeypatch.setattr(loader, "load_tokenizer", no_load)
    for argv, said in (([], True), (["--draft", "none"], False), (["--dtype", "float32"], False)):
        with pytest.raises(AssertionError, match="the run went on"):
            main(["generate", "hi", "--dtype", "bfloat16", *argv])
        assert ("--draft auto: no built-in pair has this target" in capsys.readouterr().err) == said, argv
    assert main(["generate", "hi", "--dtype", "bfloat16", "--method", "ddd"]) == 2
    err = capsys.readouterr().err
    assert "--method ddd needs a draft" in err and "--draft auto" not in err.split("--method")[0], err


@pytest.mark.real_model
def test_bench_batch_runs_the_policies_in_balanced_orders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every repeat ran the policies in one order: plain decoding always first, right after the last policy of the
    batch size before. Each policy now takes every place in turn. And the sweep's first run, plain decoding's,
    paid alone for the process's first forwards: every policy now runs once untimed first."""
    from specserve.bench import batch_sweep
    from specserve.bench.machine import cpu_summary

    tables: list[dict[Any, Any]] = []
    specs: list[object] = []
    policies = batch_sweep.policies
    monkeypatch.setattr(batch_sweep, "policies", lambda args: tables.append(policies(args)) or tables[-1])

    def fake_run(engine: object, prompts: object, lengths: object, spec: object, accepts: object) -> dict[str, float]:
        specs.append(spec)
        keys = ("tok_s", "seconds", "steps", "idle_fraction", "mean_sl", "spec_steps", "mean_cap", "p50_latency_s")
        keys += ("p99_latency_s", "draft_frac", "verify_frac")
        return dict.fromkeys(keys, 1000.0 if len(specs) <= 3 else 1.0)  # cold: slow

    monkeypatch.setattr(batch_sweep, "run_one", fake_run)
    argv = ["bench", "batch", "--pair", "smollm2-int8", "--batch-sizes", "1", "--workloads", "real"]
    argv += ["--policies", "plain", "static", "ddd", "--repeats", "3", "--out", str(tmp_path)]
    assert main(argv) == 0
    names = [next(n.value for n, s in tables[0].items() if s is spec) for spec in specs]
    assert sorted(names[:3]) == ["ddd", "plain", "static"], names  # the untimed first runs
    firsts = names[3::3]
    assert len(names) == 12 and sorted(firsts) == ["ddd", "plain", "static"], names  # each first once
    import csv

    rows = list(csv.DictReader((tmp_path / "batch.csv").open()))
    assert len(rows) == 3 and all(r["cpu"] == cpu_summary() for r in rows)  # the machine of the figures
    assert all(float(r["tok_s"]) == 1.0 for r in rows)  # none of the first runs' figures


@pytest.mark.real_model
def test_bench_ar_warms_both_sides_up_and_runs_them_in_turn_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh engine in every timed run (its first-call work timed each time) against a transformers model kept
    warm, and this runner always first: a bias against it, of the first call's cost."""
    from specserve.bench import ar
    from specserve.engine import Engine

    calls: list[tuple[str, int]] = []
    engines: list[int] = []

    class Recording(Engine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engines.append(id(self))

        def generate(self, prompts: Any, params: Any = None, **kwargs: Any) -> Any:
            calls.append(("ours", params.max_tokens))
            return super().generate(prompts, params, **kwargs)

    def hf(model: object, tok: object, prompts: list[list[int]], max_tokens: int) -> int:
        calls.append(("theirs", max_tokens))
        return len(prompts) * max_tokens

    monkeypatch.setattr(ar, "Engine", Recording)
    monkeypatch.setattr(ar, "_hf_generate", hf)
    argv = ["bench", "ar", "--batch-sizes", "2", "--num-prompts", "2", "--max-tokens", "3", "--runs", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    warm_up, even, odd = [("ours", 4), ("theirs", 4)], [("ours", 3), ("theirs", 3)], [("theirs", 3), ("ours", 3)]
    assert calls == [*warm_up, *even, *odd, *even]
    assert len(engines) == 1  # one engine for the batch size, kept across runs


def test_ctrl_c_ends_a_command_with_status_130_and_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import specserve.cli as cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_models", interrupted)
    try:
        status = main(["models", "list"])
    except KeyboardInterrupt:  # (caught here, so the escape fails this test rather than stopping pytest)
        pytest.fail("Ctrl-C escaped main as a KeyboardInterrupt")
    assert status == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.real_model
def test_generate_on_a_model_without_a_chat_template_says_to_pass_no_chat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A base model has no chat template: `generate` said only "this model's tokenizer has no chat template", not
    what to do about it; with --no-chat it generates."""
    from specserve.config import ModelSpec
    from specserve.models.sources import resolve

    base = tmp_path / "base"
    base.mkdir()
    for f in resolve(ModelSpec()).iterdir():
        if f.name != "chat_template.jinja":
            (base / f.name).symlink_to(f)
    argv = ["generate", "hello", "--model", str(base), "--draft", "none", "--max-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has no chat template: pass --no-chat" in err and "Traceback" not in err
    assert main([*argv, "--no-chat"]) == 0
    assert "[2 tokens, finish_reason=length]" in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_text_is_a_clear_error() -> None:
    """Bytes that are not UTF-8 in a command-line prompt reach Python as lone surrogates: `generate --no-chat` died
    with the tokenizer's TypeError and a traceback, and a chat prompt's error named only that TypeError."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specserve.errors import InvalidRequestError
    from specserve.prompts import PromptEncoder

    core = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1, "caf": 2}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    encoder = PromptEncoder(tokenizer, 3)
    assert encoder.text("hi caf") == [1, 2] and encoder.chat([{"role": "user", "content": "hi"}]) == [1]
    latin1 = b"hi caf\xe9".decode("utf-8", "surrogateescape")  # as sys.argv holds `caf\xe9` from a Latin-1 shell
    with pytest.raises(InvalidRequestError, match=r"the prompt is not UTF-8 text: character 6 is a lone surrogate"):
        encoder.text(latin1)
    with pytest.raises(InvalidRequestError, match=r"a message is not UTF-8 text: character 6") as e:
        encoder.chat([{"role": "user", "content": latin1}])
    assert e.value.param == "messages"


def test_generate_writes_text_its_console_cannot_encode_escaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an ASCII console (an ASCII or Latin-1 locale, PYTHONIOENCODING=ascii) the first token it could not encode
    raised UnicodeEncodeError: a traceback after half a line."""
    import io
    import sys
    from types import SimpleNamespace

    from specserve.engine import Engine

    outs = [SimpleNamespace(text=t, finish_reason=None, num_output_tokens=i + 1) for i, t in enumerate(["caf", "é ✓"])]
    engine = SimpleNamespace(tokenizer=SimpleNamespace(chat_template="t"), stream=lambda prompt, params, chat: outs)
    monkeypatch.setattr(Engine, "from_config", lambda config, tokenizer: engine)
    monkeypatch.setattr("specserve.models.loader.load_tokenizer", lambda spec: engine.tokenizer)
    console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", console)
    assert main(["generate", "hi", "--draft", "none"]) == 0
    console.flush()
    assert console.buffer.getvalue() == b"caf\\xe9 \\u2713\n"  # type: ignore[attr-defined]
    assert console.errors == "strict"  # as it was: a caller running the command in-process keeps its streams


@pytest.mark.parametrize("module", ["load.straggler", "load.simulate", "load.guard_replay", "specserve.bench.overhead"])
def test_every_command_writes_text_its_console_cannot_encode_escaped(
    module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m load.straggler report` into a folder named café on an ASCII console wrote its report, then took
    the UnicodeEncodeError of its last line for a bad argument (exit 2)."""
    import importlib
    import io
    import sys

    command = importlib.import_module(module)
    monkeypatch.setattr(command, "_main", lambda argv: print("wrote café/report.md") or 0)
    console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", console)
    assert command.main([]) == 0
    console.flush()
    assert console.buffer.getvalue() == b"wrote caf\\xe9/report.md\n" and console.errors == "strict"


def test_generate_sets_the_context_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-model-len reaches the engine's config (the default, 2048, refused prompts the model's 8192 positions
    hold, with no flag to change it); a context out of bounds is a usage error naming the field."""
    from types import SimpleNamespace

    from deployments.tiny_tokenizer import tiny_tokenizer
    from specserve.engine import Engine

    configs: list[Any] = []
    engine = SimpleNamespace(tokenizer=tiny_tokenizer(), stream=lambda prompt, params, chat: [])
    monkeypatch.setattr(Engine, "from_config", lambda config, tokenizer: configs.append(config) or engine)
    loaded: list[Any] = []
    monkeypatch.setattr("specserve.models.loader.load_tokenizer", lambda spec: loaded.append(spec) or engine.tokenizer)
    assert main(["generate", "hi", "--draft", "none", "--max-model-len", "6000"]) == 0
    assert main(["generate", "hi", "--draft", "none"]) == 0
    assert [c.max_model_len for c in configs] == [6000, 2048]
    assert main(["generate", "hi", "--draft", "none", "--max-model-len", "8"]) == 2  # under LoopConfig's 16
    assert len(loaded) == 2  # (said before the tokenizer's model is fetched: a hub model was downloaded first)


def test_generate_passes_the_target_side_options_to_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from deployments.tiny_tokenizer import tiny_tokenizer
    from specserve.engine import Engine

    asked: list[SamplingParams] = []
    engine = SimpleNamespace(  # (a real tokenizer: a format is compiled against it before the models load)
        tokenizer=tiny_tokenizer(), stream=lambda prompt, params, chat: asked.append(params) or []
    )
    monkeypatch.setattr(Engine, "from_config", lambda config, tokenizer: engine)
    monkeypatch.setattr("specserve.models.loader.load_tokenizer", lambda spec: engine.tokenizer)
    flags = ["--stop-token-id", "7", "--stop-token-id", "9", "--ignore-eos", "--min-tokens", "4", "--stop", "x"]
    bias = ["--logit-bias", "5=-100", "--logit-bias", "3=2.5", "--logit-bias", "5=1"]  # (the last for an id wins)
    assert main(["generate", "hi", "--draft", "none", *flags, *bias]) == 0
    assert asked == [
        SamplingParams(
            max_tokens=256, stop=("x",), stop_token_ids=frozenset({7, 9}), ignore_eos=True, min_tokens=4,
            logit_bias={3: 2.5, 5: 1.0},
        )
    ]  # fmt: skip
    asked.clear()
    assert main(["generate", "hi", "--draft", "none"]) == 0
    assert asked == [SamplingParams(max_tokens=256)]
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(schema)
    lark, lark_file = 'start: "a" | "b"', tmp_path / "v1:ab.lark"  # (a file's name may have a colon)
    long_lark = 'start: "a"' + ' | "a"' * 60
    lark_file.write_text(lark)
    (tmp_path / "latin1.lark").write_bytes(b'start: "\xe9"')
    held = {
        "--json": OutputFormat(kind=FormatKind.json_object, param="--json"),
        "--regex=[a-z]+": OutputFormat(kind=FormatKind.regex, pattern="[a-z]+", param="--regex"),
        "--json-schema=" + schema: OutputFormat(kind=FormatKind.json_schema, schema_text=schema, param="--json-schema"),
        f"--json-schema={schema_file}": OutputFormat(
            kind=FormatKind.json_schema, schema_text=schema, param="--json-schema"
        ),
        "--grammar=" + lark: OutputFormat(kind=FormatKind.grammar, grammar_text=lark, param="--grammar"),
        f"--grammar={lark_file}": OutputFormat(kind=FormatKind.grammar, grammar_text=lark, param="--grammar"),
        # a grammar too long for a path (ENAMETOOLONG from is_file: a traceback)
        "--grammar=" + long_lark: OutputFormat(kind=FormatKind.grammar, grammar_text=long_lark, param="--grammar"),
    }
    for flag, fmt in held.items():
        asked.clear()
        assert main(["generate", "hi", "--draft", "none", flag]) == 0
        assert asked == [SamplingParams(max_tokens=256, output_format=fmt)], flag
    asked.clear()
    assert main(["generate", "hi", "--draft", "none", "--choice", "yes", "--choice", "no"]) == 0
    assert asked[0].output_format == OutputFormat(kind=FormatKind.choice, choices=("yes", "no"), param="--choice")
    asked.clear()
    assert main(["generate", "hi", "--draft", "none", "--json-schema", "true"]) == 0  # (a schema, not a file)
    assert asked[0].output_format == OutputFormat(
        kind=FormatKind.json_schema, schema_text="true", param="--json-schema"
    )
    asked.clear()
    assert main(["generate", "hi", "--draft", "none", "--regex", "[a-"]) == 2 and asked == []  # refused before
    assert main(["generate", "hi", "--draft", "none", "--grammar", "start: foo"]) == 2 and asked == []
    for flag in ("--grammar", "--json-schema"):  # (was a traceback)
        assert main(["generate", "hi", "--draft", "none", flag, str(tmp_path / "latin1.lark")]) == 2 and asked == []


def test_generate_says_a_tokenizer_has_no_chat_template_before_the_models_load(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said so only once the target and its draft had loaded (minutes, for a large model on a CPU)."""
    from types import SimpleNamespace

    from specserve.engine import Engine

    def loaded(config: object, tokenizer: object) -> None:
        raise AssertionError("the models loaded before the tokenizer was checked")

    monkeypatch.setattr(Engine, "from_config", loaded)
    monkeypatch.setattr("specserve.models.loader.load_tokenizer", lambda spec: SimpleNamespace(chat_template=None))
    assert main(["generate", "hi", "--draft", "none"]) == 2
    assert "tokenizer has no chat template: pass --no-chat" in capsys.readouterr().err
