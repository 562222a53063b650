"""Every citation of docs/algorithms.md in the code reads `docs/algorithms.md §N.M` and names a section that
exists there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = "algorithms" + ".md"  # spelled apart so that this file does not cite itself
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", re.MULTILINE)
SECTION = re.compile(r"§(\d+(?:\.\d+)?)")
OLD_NUMBERING = re.compile(r"\b[Ss]pec \d\.\d")  # the reference spec's "spec 4.7" style


def _sections() -> set[str]:
    return set(HEADING.findall((REPO / "docs" / DOC).read_text()))


def _code_lines() -> list[tuple[str, str]]:
    return [
        (f"{path.relative_to(REPO)}:{i}", line)
        for folder in ("specserve", "deployments", "load", "tests")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.name != Path(__file__).name
        for i, line in enumerate(path.read_text().splitlines(), 1)
    ]


def test_algorithms_sections_are_numbered() -> None:
    assert {"1.1", "1.2", "1.3", "2.5", "3.3", "4.9", "5", "6", "7", "8.4", "9"} <= _sections()


def test_every_citation_names_an_existing_section() -> None:
    sections = _sections()
    cited = [(where, line) for where, line in _code_lines() if DOC in line]
    assert cited, "the code cites docs/algorithms.md"
    bad = [f"{where}: not 'docs/{DOC} §N.M'" for where, line in cited if f"docs/{DOC} §" not in line]
    bad += [
        f"{where}: §{s} does not exist" for where, line in cited for s in SECTION.findall(line) if s not in sections
    ]
    bad += [f"{where}: old numbering" for where, line in _code_lines() if OLD_NUMBERING.search(line)]
    assert not bad, bad


def test_the_guards_try_budget_is_quoted_as_the_code_sets_it() -> None:
    """docs/load.md still said 1.5% after explore_cost became 0.75%."""
    from specserve.guard import GuardConfig

    quoted = {
        f"{name}: {share}%"
        for name in ("README.md", "docs/algorithms.md", "docs/load.md")
        for share in re.findall(r"costs? at most ~?([\d.]+)%", (REPO / name).read_text())
    }
    assert len(quoted) == 3 and all(q.endswith(f" {GuardConfig().explore_cost * 100:g}%") for q in quoted), quoted
