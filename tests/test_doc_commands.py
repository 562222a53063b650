"""Every `specserve ...`, `python -m load.straggler ...`, `python -m load.simulate ...` and `python -m load.guard_replay
...` command in the README and docs/ parses with today's command line, its flags spelt out (a renamed or removed flag
fails here, and so does one that parses only as an abbreviation of another, so that the recorded commands stay
runnable); the straggler study's also passes its settings' checks."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from load import guard_replay, simulate, straggler
from specserve import cli

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "deployments" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:\.venv/bin/)?(?:specserve|python -m load\.(?:straggler|simulate|guard_replay))(?= |$)")
BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.S | re.M)
ASSIGNMENT = re.compile(r"^(\w+)=[\"']([^\"']*)[\"']", re.M)
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]*>")  # "--pair X ... --out", "<target dir>": elided on purpose
# names a recorded command may use that are gone, each said so beside its command in the docs
RETIRED = {"smollm2-eagle-bf16"}


def doc_commands() -> Iterator[tuple[str, str]]:
    for path in DOCS:
        for block in BLOCK.findall(path.read_text()):
            text = re.sub(r"\\\n\s*", " ", block)  # continuation lines
            for name, value in ASSIGNMENT.findall(text):
                text = text.replace(f"${{{name}}}", value).replace(f"${name}", value)
            for line in text.splitlines():
                found = COMMAND.search(line)
                if found is None or line.lstrip().startswith("#"):
                    continue
                command = re.split(r"\s+(?:#|&&|\|\|?|;|>)\s*", line[found.start() :])[0].strip()
                if PLACEHOLDER.search(command) or any(name in command for name in RETIRED):
                    continue
                yield f"{path.relative_to(REPO)}: {command[:90]}", command


COMMANDS = list(doc_commands())


def test_the_docs_hold_commands_of_each_tool() -> None:
    tools = {COMMAND.findall(c)[0].removeprefix(".venv/bin/") for _, c in COMMANDS}
    assert tools == {
        "specserve", "python -m load.straggler", "python -m load.simulate", "python -m load.guard_replay"
    }, tools  # fmt: skip
    assert len(COMMANDS) > 50


class ParseError(Exception):
    """argparse's usage error, raised instead of exiting the process."""


def _raise(self: argparse.ArgumentParser, message: str) -> None:
    raise ParseError(f"{self.prog}: {message}")


@pytest.mark.parametrize("command", [c for _, c in COMMANDS], ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(argparse.ArgumentParser, "error", _raise)
    monkeypatch.setattr(argparse.ArgumentParser, "_get_option_tuples", lambda self, option: [])  # no abbreviations
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # GPU commands parse on this CPU too
    argv = shlex.split(command)
    if "--help" in argv:
        with pytest.raises(SystemExit, match="0"):
            _parse(argv)
        return
    _parse(argv)


def _parse(argv: list[str]) -> None:
    if argv[0].endswith("specserve"):
        cli.build_parser().parse_args(argv[1:])
    elif argv[2] == "load.straggler":
        if argv[3:4] == ["report"]:
            assert argv[4:], "report needs traces"
        else:
            straggler.parse_args(argv[3:])
    elif argv[2] == "load.simulate":
        simulate.build_parser().parse_args(argv[3:])
    else:
        guard_replay.build_parser().parse_args(argv[3:])


def test_the_makefiles_bench_targets_parse_spelt_out_and_take_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make bench-spec` said `--pair`, which parsed only as an abbreviation of `--pairs`; the README's "add
    --assisted" could not reach the command (make took it for its own option): ARGS now can."""
    monkeypatch.setattr(argparse.ArgumentParser, "error", _raise)
    monkeypatch.setattr(argparse.ArgumentParser, "_get_option_tuples", lambda self, option: [])  # no abbreviations
    recipes = re.findall(r"^\t\$\(VENV\)/bin/specserve (bench .*)$", (REPO / "Makefile").read_text(), re.M)
    assert len(recipes) >= 4 and all(recipe.endswith(" $(ARGS)") for recipe in recipes), recipes
    for recipe in recipes:
        cli.build_parser().parse_args(shlex.split(recipe.removesuffix(" $(ARGS)")))
    spec = next(r for r in recipes if r.startswith("bench spec"))
    assert cli.build_parser().parse_args([*shlex.split(spec.removesuffix(" $(ARGS)")), "--assisted"]).assisted
