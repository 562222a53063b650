"""Preallocated per-sequence KV slots: allocate, append, keep(indices) compaction, truncate, free.

The cache owns all KV memory of one model. A forward pass appends its new tokens' K/V at the end of each
slot (``begin_append``); speculative rollback is ``keep`` for the target and a draft model (a tree's accepted path,
or a chain's prefix, kept compacted) and ``truncate`` for the EAGLE head's own cache.
"""

from __future__ import annotations

import torch

from specserve import host_memory
from specserve.errors import KVCapacityError


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KVCache needs num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        shape = (num_slots, num_kv_heads, max_len, head_dim)  # [S, H_kv, L, D]
        if torch.device(device).type == "cpu":
            itemsize = torch.empty((), dtype=dtype).element_size()
            kv_bytes = 2 * num_layers * num_slots * num_kv_heads * max_len * head_dim * itemsize
            host_memory.check_host_fits(kv_bytes, num_slots, max_len, available=host_memory.host_available_bytes())
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self._lengths = [0] * num_slots
        self._written = [0] * num_slots  # entries of each slot written since it was last cleared (a high-water mark)
        self._free = list(range(num_slots))  # kept sorted: lowest slot first keeps batches contiguous

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    # -- slot lifecycle -------------------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free:
            raise KVCapacityError(f"all {self.num_slots} KV slots are in use")
        slot = self._free.pop(0)
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """The slot's written entries are zeroed for its next sequence: a batched read (SDPA over a padded batch)
        takes every row's entries up to the longest row's length and masks the rest, and a mask does not hide a
        non-finite value (inf + -inf, 0 * inf: NaN). A sequence whose K/V overflowed (fp16) had poisoned each later
        sequence in its slot that stepped beside a longer one. Once a sequence, proportional to what it wrote."""
        self._check_slot(slot)
        written = self._written[slot]
        if written:
            for cache in (*self.k, *self.v):
                cache[slot, :, :written].zero_()
        self._written[slot] = 0  # after the zeroing: a free cut short in it (an interrupt) zeroes again when retried
        self._lengths[slot] = 0
        self._free.append(slot)
        self._free.sort()

    def allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and slot not in self._free

    @property
    def num_free(self) -> int:
        return len(self._free)

    def in_use(self) -> list[int]:
        free = set(self._free)
        return [s for s in range(self.num_slots) if s not in free]

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    # -- append / rollback ----------------------------------------------------------------------------
    def begin_append(self, slots: list[int], num_new: list[int]) -> list[int]:
        """Reserve room for ``num_new[i]`` tokens at the end of ``slots[i]``; return each old length."""
        if len(set(slots)) != len(slots):  # each would be checked against the old length, and write the same rows
            raise ValueError(f"a slot appears more than once in one append: {list(slots)}")
        starts = []
        for slot, n in zip(slots, num_new, strict=True):
            self._check_slot(slot)
            start = self._lengths[slot]
            if start + n > self.max_len:
                raise KVCapacityError(
                    f"KV slot {slot} holds {start} tokens; adding {n} exceeds its capacity of {self.max_len}"
                )
            starts.append(start)
        for slot, n in zip(slots, num_new, strict=True):
            self._lengths[slot] += n
            self._written[slot] = max(self._written[slot], self._lengths[slot])
        return starts

    def truncate(self, slot: int, length: int) -> None:
        self._check_slot(slot)
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self._lengths[slot]} to {length}")
        self._lengths[slot] = length

    def keep(self, slot: int, start: int, indices: list[int]) -> None:
        """Keep entries ``start + indices`` (ascending) compacted to ``start..start+len(indices)``; drop the rest."""
        self._check_slot(slot)
        end = self._lengths[slot]
        if not 0 <= start <= end:
            raise ValueError(f"keep from {start}: slot {slot} holds {end} entries")
        if any(not 0 <= i < end - start for i in indices) or sorted(set(indices)) != list(indices):
            raise ValueError(f"keep indices {indices} must be ascending and inside [0, {end - start})")
        m = len(indices)
        if indices != list(range(m)):  # a chain prefix needs no copy
            src = torch.tensor(indices, device=self.k[0].device) + start
            for cache in (*self.k, *self.v):
                cache[slot, :, start : start + m] = cache[slot, :, src]
        self._lengths[slot] = start + m

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"KV slot {slot} is not allocated")
