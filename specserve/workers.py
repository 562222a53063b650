"""Workers own a model and its KV cache. The scheduler talks to them only through ``specserve.protocol``.

The same classes run in-process behind the Engine and as Ray actors in the deployment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.config import ChainDraft, KLDMode, SpecMethod
from specserve.draft.tree import TreeBuilder, beam_mass, ddd_should_stop, is_check_step
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel
from specserve.policy import kld_exact, kld_sparse, sparse_topk_q
from specserve.protocol import DraftQ, Proposal, ProposeItem, VerifyItem, VerifyOutput
from specserve.sampling import SamplingParams, make_generator, process_logits
from specserve.synthetic import synthetic_kld, synthetic_verify
from specserve.verify import DraftTree, draft_sample_sparse, sparse_topk, verify_chain_sampled, verify_tree


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


def kld_nodes(accepted: list[int], num_nodes: int, past_rejection: bool) -> list[int]:
    """Nodes whose next-token distributions were verified: the root and each accepted node (the last of them is
    where the first rejection, or the bonus, happened); with past_rejection (chains) every drafted position."""
    if past_rejection:
        return list(range(num_nodes))
    return [0, *accepted]


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

    @staticmethod
    def _kld(it: VerifyItem, logits: torch.Tensor, accepted: list[int]) -> list[float]:
        """KL(p || q) at the verified positions that the draft sent q for (temperature 1). logits: [T, V]."""
        assert it.kld is not None
        row_of = {node: i for i, node in enumerate(it.kld.nodes)}
        nodes = [n for n in kld_nodes(accepted, len(it.draft_tokens) + 1, it.kld_past_rejection) if n in row_of]
        if not nodes:
            return []
        rows = [row_of[n] for n in nodes]
        p_logits = logits[nodes]  # [n, V]
        if it.kld.dense_logits is not None:
            return kld_exact(p_logits, it.kld.dense_logits[rows].to(p_logits.device)).tolist()
        assert it.kld.idx is not None and it.kld.prob is not None
        idx = torch.tensor([it.kld.idx[r] for r in rows])
        prob = torch.tensor([it.kld.prob[r] for r in rows])
        return kld_sparse(p_logits, idx, prob, tail=it.kld_tail).tolist()  # host sync

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
            if it.synthetic_accept is not None:
                tokens_h = [it.new_tokens[-1], *it.draft_tokens]
                res = synthetic_verify(tokens_h, [0, *it.draft_parents], p, it.synthetic_accept, gen)
            elif it.q_idx is not None and it.q_prob is not None:
                res = verify_chain_sampled(tree.tokens[1:], torch.tensor(it.q_idx), torch.tensor(it.q_prob), p, gen)
            else:
                res = verify_tree(tree, p, gen)
            num_pending = len(it.new_tokens) - 1
            self.cache.keep(slot, start, [*range(num_pending + 1), *(num_pending + a for a in res.accepted_nodes)])
            kld = self._kld(it, lg, res.accepted_nodes) if it.kld is not None else []
            if it.synthetic_accept is not None and kld:
                kld = synthetic_kld(it.synthetic_accept, len(kld), gen)
            outputs.append(VerifyOutput(seq_id=it.seq_id, accepted=res.accepted_nodes, tokens=res.tokens, kld=kld))
        return outputs


@dataclass
class _Drafting:
    """One sequence's state inside a propose call."""

    item: ProposeItem
    slot: int
    feed: list[int]  # tokens fed at level 0: what the draft has not cached yet, ending with the root
    root_idx: int  # cache index (= position) of the root
    tokens: list[int] = field(default_factory=list)  # chain mode
    q_idx: list[torch.Tensor] = field(default_factory=list)
    q_prob: list[torch.Tensor] = field(default_factory=list)
    builder: TreeBuilder | None = None  # tree modes
    q_logits: list[torch.Tensor] = field(default_factory=list)  # draft logits per fed node row, in row order
    anc: torch.Tensor | None = None  # [F+1, F+1] ancestor rows of the root and the F forwarded beam nodes
    row_of: torch.Tensor | None = None  # [1 + candidates] forwarded row of each candidate (index 0: root)
    depth: int = 0  # levels drafted
    done: bool = False


class DraftWorker:
    """Runs the draft model: chains, EAGLE-2 trees and DDD, batched level by level across sequences."""

    def __init__(self, model: LlamaModel, *, num_slots: int, max_len: int) -> None:
        self.model = model
        self.table = SlotTable(model, num_slots, max_len)
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.last_nodes: dict[int, list[int | None]] = {}  # seq -> cache index of each node of its last proposal
        self.h_reads = 0  # host reads of DDD's H; only check steps may read it

    @property
    def cache(self) -> KVCache:
        return self.table.cache

    def add(self, seq_id: int, params: SamplingParams) -> None:
        self.params[seq_id] = params
        self.generators[seq_id] = make_generator(None if params.seed is None else params.seed + 1)

    def release(self, seq_ids: list[int]) -> None:
        self.table.release(seq_ids)
        for seq_id in seq_ids:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)
            self.last_nodes.pop(seq_id, None)

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        states = [self._commit(it) for it in items]
        logits = self._forward(states, [s.feed for s in states], num_logits=[1] * len(states))
        chains = [(s, lg) for s, lg in zip(states, logits, strict=True) if s.item.spec.method == SpecMethod.chain]
        trees = [(s, lg) for s, lg in zip(states, logits, strict=True) if s.item.spec.method != SpecMethod.chain]
        self._draft_chain(chains)
        self._draft_tree(trees)
        return [self._proposal(s) for s in states]

    def _commit(self, it: ProposeItem) -> _Drafting:
        """Keep the cached part of last step's accepted path; everything after it is fed again."""
        slot = self.table.slot(it.seq_id)
        nodes = self.last_nodes.pop(it.seq_id, None)
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
        return _Drafting(item=it, slot=slot, feed=feed, root_idx=self.cache.length(slot) + len(feed) - 1)

    def _forward(
        self,
        states: list[_Drafting],
        tokens: list[list[int]] | list[torch.Tensor],
        *,
        num_logits: list[int] | None = None,
        positions: list[list[int]] | None = None,
        masks: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """One ragged draft forward; per sequence the logits [m, V] of its last m new tokens."""
        batch = ForwardBatch.build(
            self.cache,
            [s.slot for s in states],
            tokens,
            positions=positions,
            tree_masks=masks,
            num_logits=num_logits,
            device=self.model.device,
        )
        return list(self.model(batch, self.cache).split(list(batch.num_logits)))

    # -- chains -----------------------------------------------------------------------------------------
    def _draft_chain(self, chains: list[tuple[_Drafting, torch.Tensor]]) -> None:
        active = [(s, lg) for s, lg in chains if s.item.depth > 0]
        while active:
            for s, lg in active:
                s.q_logits.append(lg[-1:])
                s.tokens.append(self._chain_token(s, lg))
                s.depth += 1
            active = [(s, lg) for s, lg in active if s.depth < s.item.depth]
            if active:
                out = self._forward([s for s, _ in active], [[s.tokens[-1]] for s, _ in active])
                active = [(s, lg) for (s, _), lg in zip(active, out, strict=True)]

    def _chain_token(self, s: _Drafting, logits: torch.Tensor) -> int:
        params = self.params[s.item.seq_id]
        if params.greedy or s.item.spec.chain_draft == ChainDraft.greedy:
            return int(logits[-1].argmax())  # host sync: the next level's input
        idx, prob = sparse_topk(process_logits(logits[-1:], params), s.item.spec.q_top_k)
        s.q_idx.append(idx[0])
        s.q_prob.append(prob[0])
        return int(draft_sample_sparse(idx, prob, self.generators[s.item.seq_id])[0])  # host sync

    # -- EAGLE-2 trees and DDD --------------------------------------------------------------------------
    def _draft_tree(self, trees: list[tuple[_Drafting, torch.Tensor]]) -> None:
        dev = self.model.device
        for s, lg in trees:
            if s.item.depth == 0:
                continue
            s.builder = TreeBuilder(width=s.item.spec.beam_width)
            s.q_logits.append(lg)
            s.builder.expand(torch.log_softmax(lg, dim=-1))
            s.anc = torch.ones(1, 1, dtype=torch.bool, device=dev)
            s.row_of = torch.zeros(1 + s.builder.num_candidates, dtype=torch.long, device=dev)
            s.depth = 1
        active = [s for s, _ in trees if s.builder is not None and not self._tree_done(s)]
        while active:
            tokens, masks, positions = [], [], []
            for s in active:
                assert s.builder is not None and s.anc is not None and s.row_of is not None
                beam, parents = s.builder.beam, s.builder.beam_parents()
                n, f1 = beam.numel(), s.anc.shape[0]
                new = torch.zeros(n, f1 + n, dtype=torch.bool, device=dev)  # [n, F+1+n]
                new[:, :f1] = s.anc[s.row_of[parents + 1]]
                new[:, f1:] = torch.eye(n, dtype=torch.bool, device=dev)
                s.anc = torch.cat([torch.nn.functional.pad(s.anc, (0, n)), new])  # [F+1+n, F+1+n]
                s.row_of = torch.nn.functional.pad(s.row_of, (0, s.builder.num_candidates + 1 - s.row_of.numel()))
                s.row_of[beam + 1] = torch.arange(f1, f1 + n, device=dev)
                tokens.append(s.builder.beam_tokens())
                masks.append(new)
                positions.append([s.root_idx + s.depth] * n)
            out = self._forward(active, tokens, positions=positions, masks=masks)
            for s, lg in zip(active, out, strict=True):
                assert s.builder is not None
                s.q_logits.append(lg)
                s.builder.expand(torch.log_softmax(lg, dim=-1))
                s.depth += 1
            active = [s for s in active if not self._tree_done(s)]

    def _tree_done(self, s: _Drafting) -> bool:
        """After expansion step s.depth: stop at the depth budget, or where DDD's H falls below x."""
        if s.depth >= s.item.depth:
            return True
        spec = s.item.spec
        if spec.method != SpecMethod.ddd or not is_check_step(s.depth, spec.ddd_check_steps, spec.ddd_check_every_step):
            return False
        assert s.builder is not None
        h = float(beam_mass(s.builder.beam_scores))  # host sync: DDD's check, only at check steps
        self.h_reads += 1
        return ddd_should_stop(h, s.depth, spec.ddd_check_steps, spec.ddd_threshold, spec.ddd_check_every_step)

    # -- results ----------------------------------------------------------------------------------------
    def _proposal(self, s: _Drafting) -> Proposal:
        seq_id = s.item.seq_id
        if s.builder is not None and s.row_of is not None:
            tree = s.builder.rerank(s.item.spec.budget)
            row_of = torch.nn.functional.pad(s.row_of, (0, s.builder.num_candidates + 1 - s.row_of.numel()))
            cand = torch.tensor(tree.candidates, dtype=torch.long, device=row_of.device)
            rows = row_of[cand + 1].tolist()  # host sync
            self.last_nodes[seq_id] = [s.root_idx] + [s.root_idx + r if r > 0 else None for r in rows]
            fed = [(0, 0)] + [(node, r) for node, r in enumerate(rows, start=1) if r > 0]  # (node, logits row)
            return Proposal(
                seq_id, tree.tokens, tree.parents, depth=s.depth, ranks=tree.ranks, kld=self._draft_q(s, fed)
            )
        n = len(s.tokens)
        self.last_nodes[seq_id] = [s.root_idx + i for i in range(n)] + [None]  # the last draft was never fed
        sampled = bool(s.q_idx)
        return Proposal(
            seq_id,
            s.tokens,
            list(range(n)),
            q_idx=torch.stack(s.q_idx).tolist() if sampled else None,
            q_prob=torch.stack(s.q_prob).tolist() if sampled else None,
            depth=s.depth,
            kld=self._draft_q(s, [(i, i) for i in range(n)]),
        )

    @staticmethod
    def _draft_q(s: _Drafting, fed: list[tuple[int, int]]) -> DraftQ | None:
        """The draft's distribution at each fed node (node, logits row), for the target's KLD signal."""
        mode = s.item.kld_mode
        if mode is None or not fed or not s.q_logits:
            return None
        logits = torch.cat(s.q_logits)[torch.tensor([r for _, r in fed])]  # [n, V]
        nodes = [node for node, _ in fed]
        if mode == KLDMode.exact:
            return DraftQ(nodes, dense_logits=logits)
        idx, prob = sparse_topk_q(logits, s.item.spec.q_top_k)
        return DraftQ(nodes, idx=idx.tolist(), prob=prob.tolist())  # host sync
