"""Freezing the collector after loading (specserve/heap.py) and the entry points that do it."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.actors import ACTOR_CLASSES
from deployments.app_args import ModelRecipe, TinyModels, WorkerRole
from load import straggler
from specserve import engine as engine_module
from specserve.config import EngineConfig
from specserve.engine import Engine
from specserve.heap import freeze_loaded_objects
from specserve.models.llama import LlamaModel
from specserve.models.tiny import tiny_model


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def tracked(obj: object) -> bool:
    """Whether the cyclic collector would walk ``obj`` (frozen objects are outside every generation)."""
    return any(o is obj for o in gc.get_objects())


def test_freeze_collects_garbage_then_exempts_the_survivors() -> None:
    gc.unfreeze()
    garbage, live = Node(), Node()
    garbage.other, live.other = garbage, live  # two cycles; only ``live`` stays referenced
    gone = weakref.ref(garbage)
    del garbage
    assert tracked(live) and gone() is not None
    frozen = freeze_loaded_objects()
    assert gone() is None  # collected first, not frozen forever
    # Frozen objects still die by reference count (another thread's, or this frame's temporaries), so the count
    # may only fall after the freeze.
    assert frozen >= gc.get_freeze_count() > 0
    assert not tracked(live)
    assert tracked(later := Node()) and later.other is None  # what serving allocates is still collected
    gc.unfreeze()
    assert tracked(live)


@pytest.mark.parametrize("freeze", [True, False])
def test_worker_actor_freezes_after_loading_its_model(freeze: bool) -> None:
    gc.unfreeze()
    host = ACTOR_CLASSES[WorkerRole.target](ModelRecipe(role=WorkerRole.target, tiny=TinyModels()), "cpu", None, freeze)
    assert isinstance(host.model, LlamaModel)
    assert tracked(host.model) is not freeze
    assert (gc.get_freeze_count() > 0) is freeze


@pytest.mark.parametrize("freeze", [True, False])
def test_engine_from_config_freezes_after_loading_if_asked(freeze: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "load_model", lambda spec, device: tiny_model(seed=0))
    monkeypatch.setattr(engine_module, "load_tokenizer", lambda spec: None)
    gc.unfreeze()
    engine = Engine.from_config(EngineConfig(freeze_gc=freeze, max_batch_size=1))
    assert tracked(engine.model) is not freeze
    assert tracked(engine.loop) is not freeze
    assert not EngineConfig().freeze_gc  # a library user may build and drop engines: off unless asked


@pytest.mark.parametrize("flags", [[], ["--no-freeze-gc"]])
def test_straggler_sweep_freezes_unless_told_not_to(flags: list[str], tmp_path: Path) -> None:
    gc.unfreeze()
    argv = ["--pair", "tiny", "--batch-sizes", "1", "--policies", "plain", "--workloads", "synthetic"]
    argv += ["--requests-per-slot", "1", "--min-tokens", "2", "--max-tokens", "2", "--out", str(tmp_path), *flags]
    assert straggler.main(argv) == 0
    assert (gc.get_freeze_count() > 0) == (not flags)


def test_specserve_generate_asks_its_engine_to_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    from specserve.cli import main

    class Built(Exception):
        """Raised in place of building the engine: the config is what this test reads."""

    configs: list[EngineConfig] = []

    def capture(config: EngineConfig, tokenizer: object) -> Engine:
        configs.append(config)
        raise Built

    monkeypatch.setattr(Engine, "from_config", staticmethod(capture))
    monkeypatch.setattr("specserve.models.loader.load_tokenizer", lambda spec: SimpleNamespace(chat_template="t"))
    with pytest.raises(Built):
        main(["generate", "hello", "--max-tokens", "1"])
    assert configs[0].freeze_gc
