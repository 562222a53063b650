"""The README's Python example runs as written on the real model (its chains asked for a draft model the default
engine does not load, and raised)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.real_model
def test_the_readmes_python_example_runs() -> None:
    text = README.read_text()
    block = re.search(r"^In Python:\n\n```python\n(.*?)^```", text, re.S | re.M)
    assert block is not None, "the README's 'In Python:' example"
    scope: dict[str, object] = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)
    done = scope["done"]
    assert isinstance(done, list) and len(done) == 2 and all(c.token_ids for c in done)  # type: ignore[attr-defined]
    assert done[1].stats.draft_steps > 0  # type: ignore[attr-defined]  # the chains drafted (prompt lookup)
