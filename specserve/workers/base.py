"""The worker interfaces the step loop drives, and the slot table each worker keeps for its KV cache."""

from __future__ import annotations

from typing import Protocol

from specserve.messages import Proposal, ProposeItem, VerifyItem, VerifyOutput
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel
from specserve.sampling import SamplingParams


class WorkerAPI(Protocol):
    def add(self, seq_id: int, params: SamplingParams, position: int) -> None:
        """Register a sequence that has ``position`` tokens now (its random draws start a stream there), afresh:
        whatever the worker still held for this id is released first."""

    def release(self, seq_ids: list[int]) -> None: ...


class TargetWorkerAPI(WorkerAPI, Protocol):
    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]: ...


class DraftWorkerAPI(WorkerAPI, Protocol):
    def propose(self, items: list[ProposeItem]) -> list[Proposal]: ...


class SlotTable:
    """seq_id -> KV slot of one worker's cache."""

    def __init__(self, model: LlamaModel, num_slots: int, max_len: int) -> None:
        self.cache: KVCache = model.new_cache(num_slots, max_len)
        self.slots: dict[int, int] = {}

    def slot(self, seq_id: int) -> int:
        if seq_id not in self.slots:
            self.slots[seq_id] = self.cache.allocate()
        return self.slots[seq_id]

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            slot = self.slots.get(seq_id)
            if slot is not None:  # freed, then forgotten: a release cut between the two is retried whole
                if self.cache.allocated(slot):
                    self.cache.free(slot)
                del self.slots[seq_id]
