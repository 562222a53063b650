"""Python's garbage collector in a serving process.

A loaded process tracks a few hundred thousand container objects (torch, transformers, the tokenizer, the models'
modules), and every full (generation-2) collection walks all of them: 0.2-0.3 s on the 2-core CPU, a stall of
several batch-16 steps that the cyclic collector triggers from allocation counts, about once per hundred steps
of the step loop. None of those objects is garbage, so after loading they are moved into the collector's permanent
generation (``gc.freeze``, as serving engines do after start-up): later collections walk only what serving
allocates. Frozen objects are still freed by reference counting; only a reference cycle among them is never
collected, so this is a step for a process that serves until it exits (the Serve actors, ``specserve generate``, a
benchmark), not for a library user who builds and drops engines (docs/algorithms.md §7).
"""

from __future__ import annotations

import gc


def freeze_loaded_objects() -> int:
    """Collect what is garbage now, then exempt every surviving object from later collections; returns how many
    objects the permanent generation holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
