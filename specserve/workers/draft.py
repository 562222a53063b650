"""The draft worker: slots, the draft model's forwards, and calls into the drafters of ``specserve.spec_decode``
(chains, EAGLE-2 trees with DDD), batched level by level across sequences."""

from __future__ import annotations

import torch

from specserve.config import SpecMethod
from specserve.errors import blame
from specserve.messages import Proposal, ProposeItem
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel
from specserve.sampling import SamplingParams, make_generator
from specserve.spec_decode.chain import chain_proposal, draft_chains
from specserve.spec_decode.draft_state import DraftState, with_draft_qs
from specserve.spec_decode.eagle2 import grow_trees, tree_proposal
from specserve.workers.base import SlotTable


class DraftWorker:
    def __init__(self, model: LlamaModel, *, num_slots: int, max_len: int) -> None:
        self.model = model
        self.table = SlotTable(model, num_slots, max_len)
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.cached_nodes: dict[int, list[int | None]] = {}  # seq -> cache index of each node of its last proposal
        self.h_reads = 0  # host reads of DDD's H; only check steps may read it

    @property
    def cache(self) -> KVCache:
        return self.table.cache

    def add(self, seq_id: int, params: SamplingParams, position: int) -> None:
        self.release([seq_id])  # registering afresh: nothing a failed reset left behind may be read
        self.params[seq_id] = params
        self.generators[seq_id] = make_generator(params.seed, self.model.device, stream=1, position=position)

    def release(self, seq_ids: list[int]) -> None:
        self.table.release(seq_ids)
        for seq_id in seq_ids:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)
            self.cached_nodes.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        if not items:  # (a forward batch needs a sequence; the head's propose answers [] alike)
            return []
        states = []
        for it in items:
            with blame(it.seq_id):
                states.append(self._rollback(it))
        logits = self._forward(states, [s.feed for s in states], num_logits=[1] * len(states))
        pairs = list(zip(states, logits, strict=True))
        draft_chains([(s, lg) for s, lg in pairs if s.item.spec.method == SpecMethod.chain], self._forward)
        self.h_reads += grow_trees(
            [(s, lg) for s, lg in pairs if s.item.spec.method != SpecMethod.chain], self._forward, self.model.device
        )
        built = []
        for s in states:
            with blame(s.item.seq_id):
                proposal, cached, fed = tree_proposal(s) if s.tree is not None else chain_proposal(s)
            self.cached_nodes[s.item.seq_id] = cached
            built.append((s, proposal, fed))
        return with_draft_qs(built)

    def _rollback(self, it: ProposeItem) -> DraftState:
        """Keep the cached part of last step's accepted path; everything after it is fed again."""
        slot = self.table.slot(it.seq_id)
        nodes = self.cached_nodes.pop(it.seq_id, None)
        kept = 0
        if nodes is not None:
            root_idx = nodes[0]
            assert root_idx is not None
            path = [root_idx]
            for node in it.accepted:
                idx = nodes[node]
                if idx is None:
                    break
                path.append(idx)
            self.cache.keep(slot, root_idx, [i - root_idx for i in path])
            kept = len(path) - 1
        feed = it.new_tokens[kept:]
        return DraftState(
            item=it,
            params=self.params[it.seq_id],
            generator=self.generators[it.seq_id],
            feed=feed,
            root_idx=self.cache.length(slot) + len(feed) - 1,
        )

    def _forward(
        self,
        states: list[DraftState],
        tokens: list[list[int]] | list[torch.Tensor],
        *,
        num_logits: list[int] | None = None,
        positions: list[list[int]] | None = None,
        masks: list[torch.Tensor] | None = None,
        parent_rows: list[torch.Tensor] | None = None,  # a draft model reads its own cache, not parent features
    ) -> list[torch.Tensor]:
        batch = ForwardBatch.build(
            self.cache,
            [self.table.slots[s.item.seq_id] for s in states],
            tokens,
            positions=positions,
            tree_masks=masks,
            num_logits=num_logits,
            device=self.model.device,
        )
        return list(self.model(batch, self.cache).split(list(batch.num_logits)))
