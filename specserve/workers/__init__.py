"""Workers own a model and its KV cache; the step loop talks to them only through ``specserve.messages``.

``base.py`` holds the interfaces (``TargetWorkerAPI``, ``DraftWorkerAPI``) that both these in-process workers and
the Ray actor proxies in ``deployments/actors.py`` satisfy.
"""

from specserve.workers.base import DraftWorkerAPI, SlotTable, TargetWorkerAPI, WorkerAPI
from specserve.workers.draft import DraftWorker
from specserve.workers.head_draft import HeadDraftWorker
from specserve.workers.target import TargetWorker

__all__ = [
    "DraftWorker",
    "DraftWorkerAPI",
    "HeadDraftWorker",
    "SlotTable",
    "TargetWorker",
    "TargetWorkerAPI",
    "WorkerAPI",
]
