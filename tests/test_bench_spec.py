"""`specserve bench spec --prompts FILE.jsonl`: the prompts file format and one small real run."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.bench.prompt_sets import load_prompts
from specserve.config import SpecConfig, SpecMethod
from specserve.errors import InvalidRequestError


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_prompts_file_in_the_mt_bench_layout(tmp_path: Path) -> None:
    rows = [
        {"question_id": 7, "category": "quoting", "turns": ["Summarise: the cat sat.", "Again."]},
        {"question_id": 8, "category": "coding", "turns": ["Write a loop."]},
    ]
    prompts = load_prompts(_write(tmp_path / "p.jsonl", rows))
    assert [(p.question_id, p.category, p.text) for p in prompts] == [
        (7, "quoting", "Summarise: the cat sat."),
        (8, "coding", "Write a loop."),
    ]
    assert len(load_prompts(tmp_path / "p.jsonl", limit=1)) == 1
    # JSON may hold U+2028, U+2029 and U+0085 raw; lines end at LF or CR LF; a UTF-8 BOM is allowed
    raw = json.dumps({"question_id": 9, "category": "c", "turns": ["a\u2028b\u2029c\x85d"]}, ensure_ascii=False)
    (tmp_path / "s.jsonl").write_bytes(b"\xef\xbb\xbf" + f"{raw}\r\n\r\n".encode())
    assert [p.text for p in load_prompts(tmp_path / "s.jsonl")] == ["a\u2028b\u2029c\x85d"]


SURROGATE_CATEGORY = '{"question_id": 2, "category": "\\udc00", "turns": ["a"]}'


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (['{"question_id": 1, "category": "x"}'], "line 1"),
        (['{"question_id": 1, "category": "x", "turns": ["a"]}', "not json"], "line 2"),
        (['{"question_id": 1, "category": "x", "turns": []}'], "non-empty list"),
        (['{"question_id": 1, "category": "x", "turns": [" \\n"]}'], "is blank"),
        ([""], "no prompts"),
        (['{"question_id": 1.9, "category": "x", "turns": ["a"]}'], "must be an integer"),
        (['{"question_id": true, "category": "x", "turns": ["a"]}'], "must be an integer"),
        (['{"question_id": 1, "category": null, "turns": ["a"]}'], "must be a string"),
        (['{"question_id": 1, "category": ["a", "b"], "turns": ["a"]}'], "must be a string"),
        (["[" * 100_000 + "]" * 100_000], "line 1"),  # nested past the parser's recursion limit
        # a lone surrogate, which JSON's escapes reach: the template's encoding refused it after the models loaded
        (['{"question_id": 1, "category": "x", "turns": ["a \\ud800 b"]}'], r"line 1.*'turns\[0\]' is not UTF-8"),
        (['{"question_id": 1, "category": "x", "turns": ["a"]}', SURROGATE_CATEGORY], "line 2.*'category' is not UTF"),
    ],
)
def test_bad_prompts_files_name_the_problem(tmp_path: Path, rows: list[str], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        load_prompts(_write(tmp_path / "bad.jsonl", rows))
    with pytest.raises(InvalidRequestError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


@pytest.mark.real_model
def test_bench_spec_runs_methods_side_by_side_and_checks_equality(tmp_path: Path) -> None:
    from specserve.cli import main

    prompts = _write(
        tmp_path / "p.jsonl",
        [
            {"question_id": 1, "category": "a", "turns": ["Name three rivers in Europe."]},
            {"question_id": 2, "category": "b", "turns": ["What is 12 times 7?"]},
        ],
    )
    out = tmp_path / "out"
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "--max-tokens", "12"]
    argv += ["--methods", "chain", "ddd", "--budget", "8", "--out", str(out)]
    argv += ["--drafters", "model", "lookup+model", "--free-sl", "3", "--free-budget", "6", "--guarded-default"]
    argv += ["--by-category"]
    assert main(argv) == 0
    rows = list(csv.DictReader((out / "spec.csv").open()))
    methods = ["plain", "chain SL=4", "DDD x=-0.3 T=8", "lookup+model: chain SL=3", "lookup+model: DDD T=6"]
    methods.append("serving default (guarded)")
    assert [r["method"] for r in rows if r["category"] == "all"] == methods
    assert [r["category"] for r in rows] == ["all"] * 6 + ["a"] * 6 + ["b"] * 6  # one row per method and category
    assert all(float(r["greedy_equal"]) == 1.0 for r in rows)
    whole = {r["method"]: r for r in rows if r["category"] == "all"}
    assert all(r["device"].startswith("CPU: ") for r in rows)  # the machine of the figures
    plain_tok_s = float(whole["plain"]["tok_s"])
    assert all(float(r["ratio"]) == pytest.approx(float(r["tok_s"]) / plain_tok_s, rel=1e-3) for r in whole.values())
    assert float(whole["plain"]["tau"]) == 1.0 and all(float(r["tau"]) > 1.0 for r in rows if r["method"] != "plain")
    assert float(whole["plain"]["rows_step"]) == 0.0  # verified drafted nodes per step: none for plain decoding
    assert 0.5 < float(whole["chain SL=4"]["rows_step"]) <= 4.0  # a chain of 4 verifies up to 4 (less at the end)
    assert float(whole["DDD x=-0.3 T=8"]["rows_step"]) <= 7.0  # a tree of budget 8: the root and up to 7 nodes
    # prefills: one step per prompt, tens of decoding steps' time each; not all of it
    assert all(0.0 < float(r["prefill_share"]) < 0.9 for r in whole.values())


@pytest.mark.real_model
def test_a_repeat_that_differs_from_plain_is_reported_though_another_was_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --repeats, only the fastest run's tokens were held against plain's: a guard or a measured floor learns
    across repeats, so a speculative run that went wrong in a slower repeat passed as greedy-equal."""
    from dataclasses import replace

    from specserve.bench import spec
    from specserve.cli import main

    calls: dict[int, int] = {}
    generate = spec._generate_timed

    def second_of_chain_differs(engine: Any, prompt: list[int], params: Any, times: list[float]) -> Any:
        out = generate(engine, prompt, params, times)
        calls[id(engine)] = calls.get(id(engine), 0) + 1
        if len(calls) == 2 and calls[id(engine)] == 2:  # the chain engine's second repeat: wrong, and slowest
            times[-1] += 100.0
            return replace(out, token_ids=[*out.token_ids[:-1], out.token_ids[-1] + 1])
        return out

    monkeypatch.setattr(spec, "_generate_timed", second_of_chain_differs)
    prompts = _write(tmp_path / "p.jsonl", [{"question_id": 1, "category": "a", "turns": ["Name a river."]}])
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "--methods", "chain"]
    argv += ["--chain-sl", "1", "--repeats", "2", "--max-tokens", "4", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "o" / "spec.csv").open()))
    assert [(r["method"], float(r["greedy_equal"])) for r in rows] == [("plain", 1.0), ("chain SL=1", 0.5)]
    assert (
        "chain SL=1 (smollm2-eagle, pass 1, all) differs from plain greedy decoding on 50.0%" in capsys.readouterr().err
    )


@pytest.mark.real_model
def test_every_engine_of_a_run_holds_the_longest_prompt_and_its_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The methods' engines held 1024 tokens and plain decoding's 2048: a ~1000-token prompt's speculative answers
    stopped at 1024 and were reported not greedy-equal; an answer the target cannot hold is named up front."""
    from specserve.cli import main

    long_turn = "Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 100
    prompts = _write(tmp_path / "p.jsonl", [{"question_id": 1, "category": "a", "turns": [long_turn]}])
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "--methods", "chain"]
    argv += ["--chain-sl", "1", "--repeats", "1"]
    assert main([*argv, "--max-tokens", "48", "--out", str(tmp_path / "o")]) == 0
    rows = list(csv.DictReader((tmp_path / "o" / "spec.csv").open()))
    assert [r["method"] for r in rows] == ["plain", "chain SL=1"] and all(float(r["greedy_equal"]) == 1.0 for r in rows)
    assert main([*argv, "--max-tokens", "8000", "--out", str(tmp_path / "o2")]) == 2
    assert "--max-tokens 8000: the longest prompt" in capsys.readouterr().err
    # within the target's positions but not its engines' (each keeps one speculative step's headroom): the answers
    # stopped short of --max-tokens, and a method with more headroom was reported not greedy-equal
    from specserve.config import MODEL_PAIRS
    from specserve.models.loader import load_tokenizer
    from specserve.prompts import PromptEncoder

    target = MODEL_PAIRS["smollm2-eagle"][0]
    tok = load_tokenizer(target)
    n = len(PromptEncoder(tok, len(tok)).chat([{"role": "user", "content": long_turn}]))
    near = str(8192 - n - 10)
    assert main([*argv, "--max-tokens", near, "--out", str(tmp_path / "o3")]) == 2
    assert f"--max-tokens {near}: the longest prompt and its answer take 8182 positions" in capsys.readouterr().err


def test_a_target_read_both_ways_decodes_the_same_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--target-reads: the target with Q4_1 and Q8_0 records, with Q4_1 records only and with float32 reads, side by
    side; each later plain row reports how many runs gave the first plain row's tokens: all of them (the same
    products, bit for bit)."""
    from specserve.cli import main

    prompts = _write(
        tmp_path / "p.jsonl",
        [
            {"question_id": 1, "category": "a", "turns": ["Name three rivers in Europe."]},
            {"question_id": 2, "category": "b", "turns": ["Write a haiku about rain."]},
        ],
    )
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "--max-tokens", "16"]
    argv += ["--methods", "chain", "--chain-sl", "1", "--target-reads", "q4+q8", "q4", "f32"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    rows = list(csv.DictReader((tmp_path / "o" / "spec.csv").open()))
    plains = ["plain (float32)", "plain (float32 q4 reads)", "plain (float32 f32 reads)"]
    assert [r["method"] for r in rows] == [m for p in plains for m in (p, "chain SL=1")]
    assert all(float(r["greedy_equal"]) == 1.0 for r in rows)
    out = capsys.readouterr().out
    assert all(f"{p}: the first plain's tokens on 2 of 2 runs" in out for p in plains[1:])


def test_assisted_generation_is_refused_off_the_cpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from specserve.cli import main

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # --device cuda parses on this CPU too
    assert main(["bench", "spec", "--assisted", "--device", "cuda", "--pairs", "smollm2-int8"]) != 0
    assert "--assisted (transformers assisted generation) runs on the CPU only" in capsys.readouterr().err


def test_assisted_generation_skips_a_draft_transformers_cannot_hold(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """smollm2-q4's draft runs torch's int4 kernel; its transformers twin was loaded from the target's float32
    weights, so the row labelled assisted generation with the 4-bit draft had the target drafting for itself."""
    import argparse

    from specserve.bench import spec
    from specserve.config import ModelSpec

    loaded: list[bool] = []
    monkeypatch.setattr(spec, "resolve", lambda s: Path("/nowhere"))
    monkeypatch.setattr(spec, "_hf_twin", lambda model, path, int8: loaded.append(int8) or torch.nn.Linear(1, 1))
    parser = argparse.ArgumentParser()
    spec.add_args(parser)
    names = ["smollm2-q4", "smollm2-int8", "smollm2-eagle", "smollm2-bf16"]
    pairs = spec.draft_pairs(parser.parse_args(["--pairs", *names]))
    twins = spec._assisted_twins(pairs, ModelSpec(), None)  # type: ignore[arg-type]
    assert [pair for pair, _, _ in twins] == ["smollm2-int8", "smollm2-bf16"]
    assert twins[1][2].weight.dtype == torch.bfloat16  # smollm2-bf16's draft, as the pair has it
    said = capsys.readouterr().out
    assert "no transformers twin for smollm2-q4's draft" in said and "for smollm2-eagle's draft (an EAGLE head)" in said
    assert loaded == [False, True, False, False]  # (target, draft) per twin: int8 for smollm2-int8's draft only
    # --dtype retypes every pair's draft for the engine rows: the twin drafts as they do (it kept bf16, another
    # draft under the pair's name)
    retyped = spec.draft_pairs(parser.parse_args(["--pairs", "smollm2-bf16", "--dtype", "float32"]))
    assert retyped[0].target == ModelSpec()  # (the target float32 already: still the benchmarked one)
    twins = spec._assisted_twins(retyped, ModelSpec(), None)  # type: ignore[arg-type]
    assert [(pair, d.weight.dtype) for pair, _, d in twins] == [("smollm2-bf16", torch.float32)]
    # a retyped target (--target-argmax full here) is not the pairs' own: every twin skipped, each saying so (the
    # row vanished unexplained)
    capsys.readouterr()
    twins = spec._assisted_twins(pairs, ModelSpec(bounded_argmax=False), None)  # type: ignore[arg-type]
    said = capsys.readouterr().out
    assert twins == [] and all(f"{p}'s target is not the benchmarked target as loaded" in said for p in names)


def test_extra_heads_load_like_the_shipped_head_of_their_layout(tmp_path: Path) -> None:
    import argparse

    from specserve.bench.spec import add_args, draft_pairs
    from specserve.config import MODEL_PAIRS, HeadSpec
    from specserve.errors import UnsupportedModelError

    for name in ("smollm2-eagle1", "smollm2-eagle3"):  # copies of the shipped heads' files (links)
        (tmp_path / name).mkdir()
        for f in HeadSpec(head=name).path().iterdir():
            (tmp_path / name / f.name).symlink_to(f)
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = ["--pairs", "smollm2-int8", "--heads", str(tmp_path / "smollm2-eagle1"), str(tmp_path / "smollm2-eagle3")]
    pairs = draft_pairs(parser.parse_args(args))
    assert [p.label for p in pairs] == ["smollm2-int8", "head smollm2-eagle1", "head smollm2-eagle3"]
    assert [p.pair for p in pairs] == ["smollm2-int8", None, None]  # a head directory's guarded row: the generic one
    target, _ = MODEL_PAIRS["smollm2-eagle"]
    assert pairs[1][1] == pairs[2][1] == target
    # the EAGLE-1/2 head keeps smollm2-eagle1's 2048 ids; the EAGLE-3 head drafts over its own LM head
    assert pairs[1][2] == HeadSpec(head=str(tmp_path / "smollm2-eagle1"), draft_vocab=2048)
    assert pairs[2][2] == HeadSpec(head=str(tmp_path / "smollm2-eagle3"), draft_vocab=None)
    both = draft_pairs(parser.parse_args(["--pairs", "smollm2-eagle", "--target-argmax", "bounded", "full"]))
    assert [(label, t.bounded_argmax) for label, t, _, _ in both] == [
        ("smollm2-eagle bounded argmax", True),
        ("smollm2-eagle full argmax", False),
    ]
    assert both[0][1].model_copy(update={"bounded_argmax": False}) == both[1][1] and both[0][2] == both[1][2]
    reads = draft_pairs(parser.parse_args(["--pairs", "smollm2-eagle", "--target-reads", "q4+q8", "q4", "f32"]))
    assert [(label, t.q4_reads, t.q8_head_reads) for label, t, _, _ in reads] == [
        ("smollm2-eagle q4+q8 reads", True, True),
        ("smollm2-eagle q4 reads", True, False),
        ("smollm2-eagle f32 reads", False, False),
    ]
    assert reads[0][1].model_copy(update={"q4_reads": False, "q8_head_reads": False}) == reads[2][1]
    assert reads[0][2] == reads[1][2] == reads[2][2]
    assert {p.pair for p in reads} == {p.pair for p in both} == {"smollm2-eagle"}  # a target variant keeps its pair
    (int8,) = draft_pairs(parser.parse_args(["--pairs", "smollm2-eagle", "--target-reads", "int8+q8"]))
    assert (int8[0], int8[1].q4_reads, int8[1].q8_head_reads, int8[1].int8_reads) == (
        "smollm2-eagle int8+q8 reads",
        True,
        True,
        True,
    )
    assert not reads[0][1].int8_reads and int8[1].model_copy(update={"int8_reads": False}) == reads[0][1]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModelError, match=r"no model\.safetensors"):
        draft_pairs(parser.parse_args(["--heads", str(tmp_path / "empty")]))


def test_head_variants_by_vocabulary_and_weight_reads() -> None:
    from specserve.bench.spec import add_args, draft_variants
    from specserve.config import MODEL_PAIRS, HeadSpec

    parser = argparse.ArgumentParser()
    add_args(parser)
    _, head = MODEL_PAIRS["smollm2-eagle1"]
    args = parser.parse_args(["--draft-vocab", "1024", "2048", "--head-reads", "bf16", "f32"])
    got = draft_variants(args, "p", head)
    assert list(got) == ["p V=1024 bf16 reads", "p V=1024 f32 reads", "p V=2048 bf16 reads", "p V=2048 f32 reads"]
    assert got["p V=2048 f32 reads"] == HeadSpec(head=head.head, draft_vocab=2048, bf16_reads=False)
    assert all(isinstance(d, HeadSpec) and d.bf16_reads for k, d in got.items() if "bf16" in k)
    layers = draft_variants(parser.parse_args(["--head-layer", "native", "python"]), "p", head)
    assert layers == {
        "p native layer": head.model_copy(update={"native_layer": True}),
        "p python layer": head.model_copy(update={"native_layer": False}),
    }
    quants = draft_variants(parser.parse_args(["--head-quant", "none", "q8_0", "q4_1"]), "p", head)
    assert {k: v.quantize.value for k, v in quants.items()} == {"p none": "none", "p q8_0": "q8_0", "p q4_1": "q4_1"}
    products = draft_variants(parser.parse_args(["--head-products", "float", "int8"]), "p", head)
    assert {k: v.int8_products for k, v in products.items()} == {"p float products": False, "p int8 products": True}
    q4 = MODEL_PAIRS["smollm2-q4"][1]
    assert draft_variants(args, "q", q4) == {"q": q4}  # a draft model: no head variants
    assert draft_variants(parser.parse_args([]), "p", head) == {"p": head}


def test_tree_depths_and_ddd_check_steps_become_methods(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from specserve.bench.spec import add_args, methods_for
    from specserve.config import SpecMethod
    from specserve.models.tiny import tiny_model

    parser = argparse.ArgumentParser()
    add_args(parser)
    argv = ["--methods", "eagle2", "ddd", "--budget", "8", "--tree-depth", "2", "3", "9", "12"]
    argv += ["--ddd-checks", "2,3,4", "5,7,9"]
    model = tiny_model(seed=0)
    methods = methods_for(parser.parse_args(argv), "smollm2-eagle", model, model, [])
    names = ["EAGLE-2 D=2 T=8", "EAGLE-2 D=3 T=8", "EAGLE-2 D=7 T=8"]  # depths past T - 1 are capped (once)
    names += ["DDD x=-0.3 checks=2,3,4 T=8", "DDD x=-0.3 checks=5,7,9 T=8"]
    assert [m.name for m in methods] == names
    assert [m.spec.tree_depth for m in methods[:3]] == [2, 3, 9]
    assert [m.spec.ddd_check_steps for m in methods[3:]] == [(2, 3, 4), (5, 7, 9)]
    assert all(m.spec.method == SpecMethod.ddd and m.spec.budget == 8 for m in methods[3:])
    for bad in ("3,2", "0,1", "a,b"):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["--ddd-checks", bad])
        assert exit_.value.code == 2 and "--ddd-checks" in capsys.readouterr().err


def test_path_probability_floors_become_methods() -> None:
    import argparse

    from specserve.bench.spec import add_args, methods_for
    from specserve.models.tiny import tiny_model

    parser = argparse.ArgumentParser()
    add_args(parser)
    argv = ["--methods", "eagle2", "ddd", "--budget", "6", "--tree-depth", "2", "--tree-min-prob", "0", "0.06"]
    model = tiny_model(seed=0)
    methods = methods_for(parser.parse_args(argv), "smollm2-eagle", model, model, [])
    names = ["EAGLE-2 D=2 T=6", "EAGLE-2 D=2 T=6 p>=0.06", "DDD x=-0.3 T=6", "DDD x=-0.3 T=6 p>=0.06"]
    assert [m.name for m in methods] == names
    assert [m.spec.tree_min_prob for m in methods] == [0.0, 0.06, 0.0, 0.06]
    with pytest.raises(ValueError, match="tree_min_prob"):
        methods_for(parser.parse_args([*argv, "1.5"]), "smollm2-eagle", model, model, [])
    measured = methods_for(parser.parse_args([*argv, "--adaptive-floor"]), "smollm2-eagle", model, model, [])
    assert [m.name for m in measured][-2:] == [
        "DDD x=-0.3 T=6 p>=measured (from 0)",
        "DDD x=-0.3 T=6 p>=measured (from 0.06)",
    ]
    assert [(m.spec.adaptive_floor, m.spec.tree_min_prob) for m in measured] == [
        (False, 0.0),
        (False, 0.06),
        (True, 0.0),
        (True, 0.06),
    ] * 2


def test_model_free_trees_take_the_tree_options_and_fall_back_to_a_capped_model() -> None:
    import argparse

    from specserve.bench.spec import add_args, methods_for
    from specserve.config import SERVING_SPECULATION, Drafter, SpecMethod, serving_speculation
    from specserve.models.tiny import tiny_model

    parser = argparse.ArgumentParser()
    add_args(parser)
    argv = ["--methods", "ddd", "--drafters", "lookup+model", "suffix", "--free-budget", "6", "8"]
    argv += ["--ddd-checks", "2,3,4", "--beam-width", "5", "--chain-sl", "2", "--model-budget", "4"]
    argv += ["--guarded-default"]
    model = tiny_model(seed=0)
    methods = methods_for(parser.parse_args(argv), "smollm2-eagle", model, model, [])
    default = methods.pop()  # the pair's own serving default, guarded
    assert (default.spec, default.guard, default.draft) == (serving_speculation("smollm2-eagle"), True, "smollm2-eagle")
    assert default.spec != SERVING_SPECULATION
    with pytest.MonkeyPatch.context() as patch:  # --device cuda parses on this CPU too
        patch.setattr("torch.cuda.is_available", lambda: True)
        on_cuda = parser.parse_args([*argv, "--device", "cuda"])
    on_gpu = methods_for(on_cuda, "smollm2-eagle", model, model, [])[-1]
    assert on_gpu.spec == serving_speculation("smollm2-eagle", "cuda") != default.spec  # the device's own default
    assert [m.name for m in methods] == [
        "lookup+model: DDD T=6 (model T=4)",
        "lookup+model: DDD T=8 (model T=4)",
        "suffix: DDD T=6",
        "suffix: DDD T=8",
    ]
    assert [(m.spec.model_budget, m.spec.model_tree_budget) for m in methods] == [(4, 4), (4, 4), (None, 6), (None, 8)]
    assert [m.spec.budget for m in methods] == [6, 8, 6, 8]
    assert all(m.spec.method == SpecMethod.ddd and m.spec.ddd_check_steps == (2, 3, 4) for m in methods)
    assert all(m.spec.beam_width == 5 for m in methods)
    assert [(m.spec.drafter, m.spec.model_fallback, m.spec.model_max_sl, m.draft) for m in methods[1:3]] == [
        (Drafter.lookup, True, 2, "smollm2-eagle"),
        (Drafter.suffix, False, None, ""),
    ]


def test_transformers_greedy_tokens_compare_up_to_the_first_eos() -> None:
    """The engine emits an EOS it was told to ignore and goes on; transformers bans EOS below min_new_tokens (or
    stops after it): the two agree when the tokens before either's first EOS agree, and only then."""
    from specserve.bench.spec import _same_greedy

    eos = {2}
    assert _same_greedy([5, 6, 9, 9], [5, 6, 2, 7], eos)  # transformers banned the EOS the engine emitted
    assert _same_greedy([5, 6, 2], [5, 6], eos)  # stopping at EOS: transformers keeps it, the engine does not
    assert _same_greedy([5, 6, 7], [5, 6, 7], eos)
    assert not _same_greedy([5, 8, 9, 9], [5, 6, 2, 7], eos)
    assert not _same_greedy([5, 6, 2], [5, 6, 7], eos)
    assert not _same_greedy([5, 6], [5, 6, 7], eos)


def test_a_rows_greedy_column_and_tau_come_from_the_outputs_against_plain() -> None:
    """A method's row against plain decoding's tokens: the share of runs whose tokens are plain's, tau as tokens
    per target forward, drafted nodes per forward, tokens a second over the method's own time."""
    from specserve.bench.spec import Method, _row
    from specserve.config import SpecConfig, SpecMethod
    from specserve.engine import Completion
    from specserve.sequence import FinishReason, RequestStats

    def done(tokens: list[int], forwards: int, drafted: int, eos: bool = False) -> Completion:
        accepted = len(tokens) + eos - forwards  # every forward emits one token more than it accepted
        stats = RequestStats(
            target_forwards=forwards, drafted=drafted, accepted=accepted, draft_steps=forwards, depth_sum=2 * forwards
        )
        return Completion("r", [1], tokens, "", FinishReason.stop if eos else FinishReason.length, stats)

    plain = [[5, 6, 7, 8], [9, 9, 9, 9], [1, 2, 3, 4]]
    outs = [done([5, 6, 7, 8], 2, 4), done([9, 9, 9, 3], 3, 3), done([1, 2, 3, 4], 1, 3)]
    row = _row(Method("chain", "pair", SpecConfig(method=SpecMethod.chain, sl=3)), outs, 2.0, plain, None)
    assert row["greedy_equal"] == pytest.approx(2 / 3)  # the second run's last token differs
    # ... said under the table (a mismatch read only as a number in it, the run exiting 0 as if lossless)
    from specserve.bench.spec import greedy_mismatches

    same = _row(Method("plain", None, SpecConfig(method=SpecMethod.none)), outs[:1], 1.0, plain[:1], None)
    said = greedy_mismatches([same | {"pass": 1, "category": "all"}, row | {"pass": 1, "category": "all"}])
    assert said == ["warning: chain (pair, pass 1, all) differs from plain greedy decoding on 33.3% of its runs"]
    # with --repeats, a repeat that differs counts though a run that agreed was faster (the guard and the measured
    # floor learn across repeats: only the fastest run's tokens were held against plain's)
    repeats = [[[5, 6, 7, 8], [5, 6, 7, 0]], [[9, 9, 9, 3]] * 2, [[1, 2, 3, 4]] * 2]
    every = _row(Method("chain", "pair", SpecConfig(method=SpecMethod.chain, sl=3)), outs, 2.0, plain, None, repeats)
    assert every["greedy_equal"] == pytest.approx(3 / 6)
    assert row["tau"] == pytest.approx(12 / 6) and row["rows_step"] == pytest.approx(10 / 6)
    assert row["tok_s"] == pytest.approx(6.0) and row["mean_depth"] == pytest.approx(2.0)
    # --stop-at-eos: the EOS the last forward emitted counts (token_ids leave it out): plain decoding's tau is 1
    stopped = [done([5, 6, 7], 4, 0, eos=True), done([9, 9, 9, 9], 4, 0)]
    row = _row(Method("plain", "", SpecConfig(method=SpecMethod.none)), stopped, 1.0, [[5, 6, 7], [9, 9, 9, 9]], None)
    assert row["tau"] == 1.0  # was 7 / 8
    row = _row(
        Method("chain", "pair", SpecConfig(method=SpecMethod.chain, sl=3)),
        [done([5, 6, 7], 2, 4, True)],
        1.0,
        [[5, 6, 7]],
        None,
    )
    assert row["tau"] == 2.0  # 3 tokens and the EOS over 2 forwards


def test_a_rows_step_times_leave_out_the_steps_that_prefill() -> None:
    """draft_ms_step / verify_ms_step divided whole-run times by every step: the prompt's forward, spread over
    a speculative method's fewer steps, inflated its per-step cost more than plain decoding's."""

    from specserve.bench.spec import Method, _row
    from specserve.config import SpecConfig, SpecMethod
    from specserve.engine import Completion, Engine
    from specserve.models.tiny import tiny_model
    from specserve.sampling import SamplingParams
    from specserve.sequence import FinishReason, RequestStats
    from specserve.step_events import StepTiming

    timing = StepTiming(steps=10, draft_s=0.5, verify_s=1.0, decode_steps=9, decode_draft_s=0.18, decode_verify_s=0.45)
    out = Completion("r", [1], [3] * 10, "", FinishReason.length, RequestStats(target_forwards=10))
    row = _row(Method("m", "", SpecConfig(method=SpecMethod.none)), [out], 1.0, [[3] * 10], timing)
    assert row["verify_ms_step"] == pytest.approx(50.0) and row["draft_ms_step"] == pytest.approx(20.0)
    real = Engine(tiny_model(seed=0), None, max_batch_size=2, max_model_len=128)
    real.generate([[5] * 40, [6] * 30], SamplingParams(max_tokens=8, ignore_eos=True))
    t = real.loop.stats.timing
    assert t.steps - t.decode_steps >= 1 and 0 < t.decode_verify_s < t.verify_s  # the prefilling steps apart


def test_a_rows_step_times_come_from_the_repeat_its_tok_s_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """tok/s took each prompt's fastest repeat and the per-step columns every repeat's steps: a slow first
    repeat (a one-off cost) raised a step's draft and verify ms above what tok/s and tau implied."""
    from types import SimpleNamespace

    from specserve.bench import spec
    from specserve.sampling import SamplingParams
    from specserve.step_events import StepTiming

    timing = StepTiming()
    engine = SimpleNamespace(
        loop=SimpleNamespace(model_free=SimpleNamespace(cache=None), stats=SimpleNamespace(timing=timing))
    )
    runs = iter([(3.0, 2.0, [3]), (1.0, 0.5, [2]), (2.0, 1.0, [3])])  # (seconds, drafting, tokens)

    def run(engine: Any, prompt: list[int], params: SamplingParams, times: list[float]) -> Any:
        secs, draft, tokens = next(runs)
        out = SimpleNamespace(token_ids=tokens)
        t = engine.loop.stats.timing
        t.steps, t.decode_steps = t.steps + 5, t.decode_steps + 4
        t.draft_s, t.decode_draft_s = t.draft_s + draft + 0.1, t.decode_draft_s + draft
        times.append(secs)
        return out

    monkeypatch.setattr(spec, "_generate_timed", run)
    out, secs, steps, every = spec._timed(engine, [1], SamplingParams(max_tokens=4), 3)  # type: ignore[arg-type]
    assert (out.token_ids, secs) == ([2], 1.0)  # tau and depth come from the fastest run too, not the last
    assert every == [[3], [2], [3]]  # every run's tokens, for the greedy check
    assert (steps.steps, steps.decode_steps) == (5, 4) and steps.decode_draft_s == pytest.approx(0.5)
    assert timing.decode_steps == 12  # the engine's running total is left as it was


@pytest.mark.real_model
def test_every_engine_runs_once_untimed_before_its_timed_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing ran the models before the first timed run: the first calls' one-off costs (a kernel's first use,
    the allocator's growth) fell in plain decoding's first prompt and in each method's per-step times. The
    untimed run leaves the suffix drafter's cross-request cache empty: the same prompt is timed next."""
    from specserve.bench import spec
    from specserve.cli import main

    first: dict[int, tuple[int, int]] = {}
    timed = spec._timed

    def recording(engine: Any, *args: Any) -> Any:
        cache = engine.loop.model_free.cache
        first.setdefault(id(engine), (engine.loop.stats.timing.steps, -1 if cache is None else cache.tokens))
        return timed(engine, *args)

    monkeypatch.setattr(spec, "_timed", recording)
    prompts = _write(tmp_path / "p.jsonl", [{"question_id": 1, "category": "a", "turns": ["Name a river."]}])
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "--methods", "chain"]
    argv += ["--chain-sl", "1", "--drafters", "model", "suffix", "--free-sl", "2", "--repeats", "1"]
    argv += ["--max-tokens", "4", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    assert len(first) == 3 and all(steps > 0 for steps, _ in first.values())  # plain, the head's chain, suffix's
    assert all(tokens == 0 for _, tokens in first.values())  # every engine here keeps the cache


@pytest.mark.real_model
def test_draft_free_rows_run_once_per_target_named_by_it(tmp_path: Path) -> None:
    """A model-free drafter with no model fallback uses no draft: its rows ran once per pair and per draft variant of
    a target (identical engines timed again), and, with two targets, under one name for both."""
    from specserve.cli import main

    prompts = _write(tmp_path / "p.jsonl", [{"question_id": 1, "category": "a", "turns": ["Name a river."]}])
    out = tmp_path / "o"
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "smollm2-eagle1"]
    argv += ["--methods", "chain", "--drafters", "lookup", "--free-sl", "2", "--max-tokens", "4"]
    assert main([*argv, "--target-reads", "q4+q8", "f32", "--out", str(out)]) == 0
    names = [r["method"] for r in csv.DictReader((out / "spec.csv").open())]
    plain = [n for n in names if n.startswith("plain")]
    assert len(plain) == 2 and len(set(plain)) == 2  # two targets
    assert names == [m for p in plain for m in (p, p.replace("plain", "lookup: chain SL=2", 1))]


def test_the_guarded_default_of_a_draft_variant_is_its_pairs() -> None:
    """``--head-quant`` (and the other draft variants) label each draft "<pair> <variant>"; the guarded row still
    runs what the pair serves with, not the generic serving default an unknown name would get."""
    import argparse

    from specserve.bench.spec import add_args, methods_for
    from specserve.config import SERVING_SPECULATION, serving_speculation
    from specserve.models.tiny import tiny_model

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--methods", "chain", "--chain-sl", "1", "--guarded-default", "--head-quant", "q8_0"])
    model = tiny_model(seed=0)
    methods = methods_for(args, "smollm2-eagle", model, model, [], label="smollm2-eagle q8_0")
    assert [(m.name, m.draft) for m in methods] == [
        ("chain SL=1", "smollm2-eagle q8_0"),
        ("serving default (guarded)", "smollm2-eagle q8_0"),
    ]
    assert methods[-1].guard and methods[-1].spec == serving_speculation("smollm2-eagle")
    assert methods[-1].spec != SERVING_SPECULATION


@pytest.mark.real_model
def test_the_guarded_row_of_a_target_variant_runs_its_pairs_serving_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--target-reads`` labels the pair "<pair> <reads> reads"; that label, taken for the pair's name, had made the
    guarded row run the generic serving default (chains under DSDE) instead of the pair's DDD trees."""
    import specserve.bench.spec as bench_spec
    from specserve.cli import main
    from specserve.config import serving_speculation

    guarded: list[tuple[str, SpecConfig]] = []
    methods_for = bench_spec.methods_for

    def spy(*args: Any, **kwargs: Any) -> list[bench_spec.Method]:
        methods = methods_for(*args, **kwargs)
        guarded.extend((m.draft, m.spec) for m in methods if m.guard)
        return methods

    monkeypatch.setattr(bench_spec, "methods_for", spy)
    prompts = _write(tmp_path / "p.jsonl", [{"question_id": 1, "category": "a", "turns": ["Name a river."]}])
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "--methods", "chain"]
    argv += ["--chain-sl", "1", "--max-tokens", "4", "--guarded-default", "--target-reads", "q4+q8"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    assert guarded == [("smollm2-eagle q4+q8 reads", serving_speculation("smollm2-eagle"))]
    assert guarded[0][1].method == SpecMethod.ddd


def test_model_free_drafters_with_only_methods_they_cannot_draft_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--drafters lookup --methods eagle2: no row but plain decoding's, and exit 0; now a usage error before any
    model loads."""
    from specserve.bench import spec
    from specserve.cli import main
    from tests.conftest import forbid_model_loads

    forbid_model_loads(monkeypatch, spec)

    argv = ["bench", "spec", "--methods", "eagle2", "--drafters", "lookup", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "draft chains and DDD trees only" in capsys.readouterr().err
    # beside the model drafter as well: the model's EAGLE-2 rows ran, the lookup rows vanished unsaid
    assert main([*argv[:-2], "model", "suffix", "--out", str(tmp_path / "o")]) == 2
    assert "the model-free --drafters lookup suffix draft chains and DDD trees only" in capsys.readouterr().err
    # the mirror case, and a flag only X+model trees read: the model's methods with no model drafter vanished unsaid
    for extra, says in (
        (["--drafters", "lookup", "--methods", "chain", "eagle2"], "--methods eagle2: EAGLE-2 trees are drafted by"),
        (["--drafters", "model", "lookup", "--model-budget", "6"], "--model-budget: the model's tree budget under an"),
        # chains read it nowhere
        (["--drafters", "lookup+model", "--methods", "chain", "--model-budget", "6"], "budget in an X+model drafter's"),
    ):
        assert main(["bench", "spec", *extra, "--out", str(tmp_path / "o")]) == 2
        assert says in capsys.readouterr().err


def test_head_variant_flags_without_a_head_pair_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--head-quant (or any head variant) with only draft-model pairs ran as if it were not given."""
    from specserve.bench import spec
    from specserve.cli import main
    from tests.conftest import forbid_model_loads

    forbid_model_loads(monkeypatch, spec)
    argv = ["bench", "spec", "--pairs", "smollm2-int8", "--head-quant", "q4_1", "--head-reads", "f32"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "--head-reads, --head-quant vary an EAGLE head's draft; no pair of this run" in capsys.readouterr().err


def test_draft_vocab_sizes_a_head_cannot_take_are_refused_before_any_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A size below 2, one for the default pair's EAGLE-3 head (its own LM head: no reduced vocabulary to choose),
    and one beyond the head's vocabulary were refused only once the target had loaded."""
    from specserve.bench import spec
    from specserve.cli import main
    from tests.conftest import forbid_model_loads

    forbid_model_loads(monkeypatch, spec)
    for argv, says in (
        (["--draft-vocab", "1"], "--draft-vocab 1: Input should be greater than or equal to 2"),
        (["--draft-vocab", "2048"], "applies to EAGLE-1/2 heads; smollm2-eagle's is EAGLE-3"),
        (["--pairs", "smollm2-eagle1", "--draft-vocab", "1024", "100000"], "100000 exceeds smollm2-eagle1's 49152"),
    ):
        assert main(["bench", "spec", *argv, "--out", str(tmp_path / "o")]) == 2
        assert says in capsys.readouterr().err


def test_a_category_named_all_is_refused_by_category(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--by-category names the whole set's rows 'all': a category of that name gave two groups of rows under one
    name, in the table and the CSV."""
    from specserve.bench import spec
    from specserve.cli import main
    from tests.conftest import forbid_model_loads

    forbid_model_loads(monkeypatch, spec)
    rows = [{"question_id": i, "category": c, "turns": ["Question."]} for i, c in enumerate(("all", "math"))]
    argv = ["bench", "spec", "--prompts", str(_write(tmp_path / "p.jsonl", rows)), "--out", str(tmp_path / "o")]
    assert main([*argv, "--by-category"]) == 2
    assert "a prompt's category is 'all'" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="a model was loaded"):  # without --by-category: no groups to mix
        main(argv)


def test_a_set_cut_to_num_prompts_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two files of 3 prompts under --num-prompts 4 lost the second file's last two without a word (with the
    default 80, MT-bench and grounded.jsonl together lost every humanities prompt)."""
    from specserve.bench import spec
    from specserve.cli import main
    from tests.conftest import forbid_model_loads

    forbid_model_loads(monkeypatch, spec)
    files = []
    for name in ("a", "b"):
        rows = [{"question_id": i, "category": name, "turns": [f"Question {i}."]} for i in range(3)]
        files.append(str(_write(tmp_path / f"{name}.jsonl", rows)))
    with pytest.raises(AssertionError, match="a model was loaded"):  # (the run goes on to the loads)
        main(["bench", "spec", "--prompts", *files, "--num-prompts", "4", "--out", str(tmp_path / "o")])
    assert "--num-prompts 4: the first 4 of the set's 6 prompts" in capsys.readouterr().out


@pytest.mark.real_model
def test_the_assisted_rows_ratio_is_to_plain_decoding_over_every_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --passes 2 the assisted row's tokens/s covered both passes and its ratio divided it by plain's first
    pass alone. And its first run, unlike every engine's, was timed cold: it now runs once untimed first."""
    from specserve.bench import spec
    from specserve.cli import main

    calls: list[int] = []

    def assisted(t: object, d: object, p: object, n: int, repeats: int, stop_at_eos: bool) -> tuple[list[int], float]:
        calls.append(repeats)
        return [7] * n, 100.0 if len(calls) == 1 else 1.0  # n tok/s, but for a slow first call

    monkeypatch.setattr(spec, "_assisted_twins", lambda args, target_spec, target: [("fake", None, None)])
    monkeypatch.setattr(spec, "_assisted", assisted)
    prompts = _write(tmp_path / "p.jsonl", [{"question_id": 1, "category": "a", "turns": ["Name a river."]}])
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "--methods", "chain"]
    argv += ["--chain-sl", "1", "--repeats", "1", "--passes", "2", "--assisted", "--max-tokens", "8"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    rows = list(csv.DictReader((tmp_path / "o" / "spec.csv").open()))
    plain = [float(r["tok_s"]) for r in rows if r["method"] == "plain"]
    (assisted,) = [r for r in rows if r["method"] == "transformers assisted"]
    over_both = 2 / sum(1 / t for t in plain)  # each pass the same greedy tokens: their rates' harmonic mean
    assert len(plain) == 2 and float(assisted["ratio"]) == pytest.approx(float(assisted["tok_s"]) / over_both, rel=1e-4)
    assert assisted["pass"] == "all" and float(assisted["tok_s"]) == pytest.approx(8.0)  # 2 x 8 tokens in 2 s
    assert calls == [1, 1, 1]  # the untimed first run, then one a pass
    # an answer that stopped at EOS holds it last in transformers' output: not a token the engine would count
    monkeypatch.setattr(spec, "_assisted", lambda t, d, p, n, repeats, stop_at_eos: ([7] * (n - 1) + [2], 1.0))
    assert main([*argv, "--stop-at-eos", "--out", str(tmp_path / "e")]) == 0
    rows = list(csv.DictReader((tmp_path / "e" / "spec.csv").open()))
    (assisted,) = [r for r in rows if r["method"] == "transformers assisted"]
    assert float(assisted["tok_s"]) == pytest.approx(7.0)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_method_runs_in_every_place_and_after_every_other_alike(n: int) -> None:
    """Forwards, then backwards, put plain decoding (method 0) right after itself or method 1 on every prompt."""
    from collections import Counter

    from specserve.bench.spec import run_order

    runs = 2 * n * (1 + n % 2)  # whole cycles of the orders
    orders = [run_order(n, r) for r in range(runs)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    places = Counter((m, i) for o in orders for i, m in enumerate(o))
    assert set(places.values()) == {runs // n} and len(places) == n * n
    follows = Counter((a, b) for o in orders for a, b in itertools.pairwise(o))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    assert run_order(1, 1) == [0]


@pytest.mark.real_model
def test_bench_spec_alternates_the_methods_order_prompt_by_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The methods ran in one order on every prompt: plain decoding always first, right after the last method's
    run on the previous prompt, so whatever one run leaves behind (caches, the collector, turbo) fell on the same
    method every time."""
    from specserve.bench import spec
    from specserve.cli import main

    called: list[int] = []
    timed = spec._timed

    def recording(engine: object, *args: object) -> object:
        called.append(id(engine))
        return timed(engine, *args)

    monkeypatch.setattr(spec, "_timed", recording)
    turns = ["Name a river.", "Name a sea.", "Name a lake."]
    rows = [{"question_id": i, "category": "a", "turns": [t]} for i, t in enumerate(turns)]
    prompts = _write(tmp_path / "p.jsonl", rows)
    argv = ["bench", "spec", "--prompts", str(prompts), "--pairs", "smollm2-eagle", "--methods", "chain"]
    argv += ["--chain-sl", "1", "--repeats", "1", "--max-tokens", "4", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    plain, chain = called[0], called[1]
    assert plain != chain and called == [plain, chain, chain, plain, plain, chain]


def test_model_free_trees_take_the_floor_the_threshold_and_both_scores() -> None:
    """The X+model rows draft the model's trees as the model rows do (DDD's x, the fixed or measured floor), and
    ``--count-scores`` runs the count trees scored both ways."""
    import argparse

    from specserve.bench.spec import add_args, methods_for
    from specserve.models.tiny import tiny_model

    parser = argparse.ArgumentParser()
    add_args(parser)
    argv = ["--methods", "ddd", "--drafters", "lookup+model", "--free-budget", "8", "--model-budget", "6"]
    argv += ["--ddd-x", "-0.03", "--tree-min-prob", "0.06", "--adaptive-floor", "--count-scores", "measured", "share"]
    model = tiny_model(seed=0)
    methods = methods_for(parser.parse_args(argv), "smollm2-eagle", model, model, [])
    free = [m for m in methods if m.name.startswith("lookup+model")]
    assert [m.name for m in free] == [
        "lookup+model: DDD T=8 (model T=6) p>=0.06 (measured scores)",
        "lookup+model: DDD T=8 (model T=6) p>=measured (from 0.06) (measured scores)",
        "lookup+model: DDD T=8 (model T=6) p>=0.06 (share scores)",
        "lookup+model: DDD T=8 (model T=6) p>=measured (from 0.06) (share scores)",
    ]
    assert [(m.spec.adaptive_floor, m.spec.model_free.calibrated) for m in free] == [
        (False, True),
        (True, True),
        (False, False),
        (True, False),
    ]
    assert all(m.spec.ddd_threshold == -0.03 and m.spec.tree_min_prob == 0.06 for m in free)
    one = methods_for(parser.parse_args(argv[:-3]), "smollm2-eagle", model, model, [])  # measured scores only
    assert next(m.name for m in one if m.name.startswith("lookup")) == "lookup+model: DDD T=8 (model T=6) p>=0.06"
