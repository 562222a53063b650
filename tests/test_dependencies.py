"""Every third-party module the installed packages import is declared in pyproject.toml (a dependency or an
extra): one that arrives only through another's requirements (starlette through fastapi) can go with its next
release."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INSTALLED = ("specserve", "deployments", "load")  # pyproject's packages.find


def _dist(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match is not None, requirement
    return normalised(match.group(0))


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    return {_dist(r) for r in [*project["dependencies"], *extras]}


def imported_modules() -> dict[str, Path]:
    """Top-level module -> a file importing it, for every absolute import outside the stdlib and the project."""
    found: dict[str, Path] = {}
    for package in INSTALLED:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in (*INSTALLED, "__future__"):
                        found.setdefault(top, path)
    return found


def test_every_imported_third_party_module_is_declared() -> None:
    distributions = packages_distributions()  # module -> the distributions providing it (flash_attn: not here)
    known = declared()
    modules = imported_modules()
    assert {"torch", "fastapi", "starlette", "ray"} <= set(modules)  # the scan sees the imports it should
    missing = {
        module: str(path.relative_to(REPO))
        for module, path in modules.items()
        if not {normalised(d) for d in distributions.get(module, [module])} & known
    }
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
