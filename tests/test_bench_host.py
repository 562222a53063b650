"""`specserve bench host`: its tables are the planner's and the drafters' own answers on the stated inputs."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from specserve.cli import main


def test_bench_host_writes_the_planner_and_drafter_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "host"
    argv = ["bench", "host", "--batch-sizes", "4", "16", "70", "--sl", "12", "--continuations", "20"]
    assert main([*argv, "--repeats", "2", "--out", str(out)]) == 0
    planner = list(csv.DictReader((out / "planner.csv").open()))
    # 64 tokens a step: 4 rows draft 4 x 12 (fits 60), 16 rows share 48, 70 rows none
    assert [(r["batch"], r["drafted"]) for r in planner] == [("4", "48"), ("16", "48"), ("70", "0")]
    drafters = list(csv.DictReader((out / "drafters.csv").open()))
    assert len(drafters) == 8 and {r["context"] for r in drafters} == {"62"}
    suffix = [r for r in drafters if r["drafter"] == "suffix"]
    assert suffix and all(r["drafted"] == "0" for r in suffix)  # each continuation seen once: nothing is kept
    assert all(float(r["propose_ms"]) > 0 for r in drafters) and "| batch |" in capsys.readouterr().out
