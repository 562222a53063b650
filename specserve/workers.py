"""Workers own a model and its KV cache. The scheduler talks to them only through ``specserve.protocol``.

The same classes run in-process behind the Engine and as Ray actors in the deployment.
"""

from __future__ import annotations

import torch

from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel
from specserve.protocol import VerifyItem, VerifyOutput
from specserve.sampling import SamplingParams, make_generator, process_logits
from specserve.verify import DraftTree, verify_chain_sampled, verify_tree


def step_layout(tree: DraftTree, num_pending: int, start: int) -> tuple[torch.Tensor | None, list[int] | None]:
    """Mask and positions for ``num_pending`` causal tokens followed by a tree; (None, None) = plain causal."""
    if tree.num_nodes == 1:
        return None, None
    n = num_pending + tree.num_nodes
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:num_pending, :num_pending] = torch.ones(num_pending, num_pending, dtype=torch.bool).tril()
    mask[num_pending:, :num_pending] = True
    mask[num_pending:, num_pending:] = tree.ancestor_mask()
    positions = list(range(start, start + num_pending)) + (start + num_pending + tree.depths()).tolist()
    return mask, positions


class SlotTable:
    """seq_id -> KV slot of one worker's cache."""

    def __init__(self, model: LlamaModel, num_slots: int, max_len: int) -> None:
        self.cache = model.new_cache(num_slots, max_len)
        self.slots: dict[int, int] = {}

    def slot(self, seq_id: int) -> int:
        if seq_id not in self.slots:
            self.slots[seq_id] = self.cache.allocate()
        return self.slots[seq_id]

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            slot = self.slots.pop(seq_id, None)
            if slot is not None:
                self.cache.free(slot)


class TargetWorker:
    """Runs the target model: prefill and verification of every sequence's draft in one ragged forward."""

    def __init__(self, model: LlamaModel, *, num_slots: int, max_len: int) -> None:
        self.model = model
        self.table = SlotTable(model, num_slots, max_len)
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}

    @property
    def cache(self) -> KVCache:
        return self.table.cache

    def add(self, seq_id: int, params: SamplingParams) -> None:
        self.params[seq_id] = params
        self.generators[seq_id] = make_generator(params.seed)

    def release(self, seq_ids: list[int]) -> None:
        self.table.release(seq_ids)
        for seq_id in seq_ids:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        trees, slots, tokens, positions, masks, starts = [], [], [], [], [], []
        for it in items:
            slot = self.table.slot(it.seq_id)
            tree = DraftTree(
                tokens=torch.tensor([it.new_tokens[-1], *it.draft_tokens]),
                parents=torch.tensor([0, *it.draft_parents]),
            )
            start = self.cache.length(slot)
            mask, pos = step_layout(tree, len(it.new_tokens) - 1, start)
            trees.append(tree)
            slots.append(slot)
            starts.append(start)
            tokens.append(it.new_tokens[:-1] + tree.tokens.tolist())
            positions.append(pos)
            masks.append(mask)
        batch = ForwardBatch.build(
            self.cache,
            slots,
            tokens,
            positions=positions,
            tree_masks=masks,
            num_logits=[t.num_nodes for t in trees],
            device=self.model.device,
        )
        logits = self.model(batch, self.cache).split([t.num_nodes for t in trees])  # per sequence [T, V]
        outputs = []
        for it, tree, slot, start, lg in zip(items, trees, slots, starts, logits, strict=True):
            p = process_logits(lg, self.params[it.seq_id])
            gen = self.generators[it.seq_id]
            if it.q_idx is not None and it.q_prob is not None:
                res = verify_chain_sampled(tree.tokens[1:], torch.tensor(it.q_idx), torch.tensor(it.q_prob), p, gen)
            else:
                res = verify_tree(tree, p, gen)
            num_pending = len(it.new_tokens) - 1
            self.cache.keep(slot, start, [*range(num_pending + 1), *(num_pending + a for a in res.accepted_nodes)])
            outputs.append(VerifyOutput(seq_id=it.seq_id, accepted=res.accepted_nodes, tokens=res.tokens))
        return outputs
