"""The GPU cluster's install steps (cluster/gpu-cluster.yaml, cluster/Dockerfile) agree with pyproject.toml: a
Python it supports, and, for the editable install without build isolation, the build requirements and torch
installed first (flash-attn's build imports torch; pip then uses the setuptools already there)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def cluster_setup() -> list[str]:
    return yaml.safe_load((REPO / "cluster/gpu-cluster.yaml").read_text())["setup_commands"]


def dockerfile_steps() -> list[str]:
    """The Dockerfile's RUN commands, split at ``&&`` into one install step each."""
    text = (REPO / "cluster/Dockerfile").read_text().replace("\\\n", " ")
    runs = [line.removeprefix("RUN ") for line in text.splitlines() if line.startswith("RUN ")]
    return [step.strip() for run in runs for step in run.split("&&")]


def python_versions() -> dict[str, str]:
    """Where each install gets its interpreter -> that interpreter's version."""
    venv = [c for c in cluster_setup() if "-m venv" in c]
    assert len(venv) == 1, venv
    cluster = re.search(r"python(\d)\.(\d+) -m venv", venv[0])
    image = re.search(r"^FROM \S+-py(\d)(\d+)\b", (REPO / "cluster/Dockerfile").read_text(), re.MULTILINE)
    assert cluster and image, "the cluster's venv or the image's tag names no Python minor version"
    return {"gpu-cluster.yaml": ".".join(cluster.groups()), "Dockerfile": ".".join(image.groups())}


@pytest.mark.parametrize("where", ["gpu-cluster.yaml", "Dockerfile"])
def test_the_cluster_installs_a_python_the_project_supports(where: str) -> None:
    """The AMI's python3 is 3.10, where asyncio.timeout (the HTTP guard) does not exist: every POST was a 500."""
    assert python_versions()[where] in SpecifierSet(PYPROJECT["project"]["requires-python"])


@pytest.mark.parametrize("steps", [cluster_setup, dockerfile_steps], ids=["gpu-cluster.yaml", "Dockerfile"])
def test_an_install_without_build_isolation_finds_its_build_requirements(steps: Callable[[], list[str]]) -> None:
    """A stock venv's setuptools (59-65) rejects pyproject's license field; the image had no torch."""
    commands = steps()
    editable = [i for i, c in enumerate(commands) if "--no-build-isolation" in c]
    assert editable, "no editable install found"
    before = " ".join(commands[: editable[0]])
    for requirement in PYPROJECT["build-system"]["requires"]:
        assert f'"{requirement}"' in before, f"{requirement} (pyproject's build-system) is not installed first"
    assert re.search(r"pip install[^;]* torch==", before), "flash-attn's build imports torch: install it first"
