from __future__ import annotations

import gc
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_model


@pytest.fixture(autouse=True)
def _thaw_gc() -> Iterator[None]:
    """Entry points freeze the collector once per process (specserve/heap.py); one test process runs many, so
    each test hands frozen objects back to the collector (a cycle frozen by one test would never be freed)."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny() -> LlamaModel:
    return tiny_model(seed=0)


@pytest.fixture
def dsde_observed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(drafted, accepted) of every step a DSDE state observes during the test."""
    from specserve.policy import SequenceDSDE

    observed: list[tuple[int, int]] = []
    observe = SequenceDSDE.observe

    def recording(self: SequenceDSDE, klds: list[float], num_drafted: int, num_accepted: int, *, cut: bool) -> None:
        observed.append((num_drafted, num_accepted))
        observe(self, klds, num_drafted, num_accepted, cut=cut)

    monkeypatch.setattr(SequenceDSDE, "observe", recording)
    return observed


def greedy_reference(model: LlamaModel, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain greedy decoding by re-running the whole sequence every token (no cache reuse)."""
    from specserve.models.batch import ForwardBatch

    tokens = list(prompt)
    out: list[int] = []
    for _ in range(n):
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(ForwardBatch.build(cache, [cache.allocate()], [tokens], num_logits=[1]), cache)
        tok = int(torch.argmax(logits[-1]))
        if tok == eos:
            break
        out.append(tok)
        tokens.append(tok)
    return out


def forbid_model_loads(monkeypatch: pytest.MonkeyPatch, *modules: ModuleType) -> None:
    """``load_model`` in these modules fails the test: what is checked must be checked before any model loads. The
    modules that bind ``load_model`` by name are imported first: one first imported while the loader's is replaced
    kept the replacement for good (a later real-model test of it failed, in some test orders only)."""
    import importlib
    import pkgutil

    import specserve.bench

    for found in pkgutil.iter_modules(specserve.bench.__path__):
        importlib.import_module(f"specserve.bench.{found.name}")
    for name in ("specserve.engine", "deployments.recipe_models", "load.straggler", "load.simulate"):
        importlib.import_module(name)

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded before the arguments were checked")

    for module in modules:
        monkeypatch.setattr(module, "load_model", no_load)
