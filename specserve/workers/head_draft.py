"""The draft-head worker: an EAGLE head's slots, its small KV cache and forwards; drafting itself is the same
chain / EAGLE-2 + DDD code the draft-model worker calls (docs/algorithms.md §8.3).

The head's cache holds (token, feature) pairs: pair j = (t_{j+1}, f_j) at RoPE position j, where f_j is the
target's hidden state at position j (it arrives with the step's ProposeItem, computed by the target during
verification: no extra forward). Only pairs built from the target's own features are kept across steps; tree
nodes (fed with the head's own outputs as features) are dropped at the next step, so rollback is one truncation.
A sequence without the target feature of the position before its root (its first step) drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.config import SpecMethod
from specserve.errors import blame
from specserve.messages import FeatureRequest, Proposal, ProposeItem
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.sampling import SamplingParams, make_generator
from specserve.spec_decode.chain import chain_proposal, draft_chains
from specserve.spec_decode.draft_state import DraftState, with_draft_qs
from specserve.spec_decode.eagle2 import grow_trees, tree_proposal
from specserve.spec_decode.eagle_head import EagleHead, HeadKind


def feature_request(head: EagleHead) -> FeatureRequest:
    """What the target must return for this head: its final-norm hidden state, or EAGLE-3's aux layers."""
    return FeatureRequest(aux_layers=head.cfg.aux_layers if head.cfg.kind == HeadKind.eagle3 else None)


@dataclass
class _HeadSeq:
    slot: int
    length: int = 0  # committed tokens seen so far
    unpaired: list[int] = field(default_factory=list)  # the last of them, from position next_pair + 1 on: a pair's
    # token is the one after its feature's position (the router owns the sequence; this is what is left to pair)
    pos0: int = 0  # RoPE position of cache entry 0 (> 0 when the features before it were lost)
    pairs: int = 0  # pairs built from target features, cached at entries 0..pairs-1
    features: torch.Tensor | None = None  # [n, H] target features of positions pos0 + pairs .. not yet paired
    rows: torch.Tensor | None = None  # [F+1, H] this step's head outputs: row 0 = the root's, then tree / chain rows

    @property
    def next_pair(self) -> int:
        """Position of the next pair to build."""
        return self.pos0 + self.pairs


class HeadDraftWorker:
    def __init__(self, head: EagleHead, *, num_slots: int, max_len: int) -> None:
        self.head = head
        self.cache: KVCache = head.new_cache(num_slots, max_len)
        self.seqs: dict[int, _HeadSeq] = {}
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.token_ids = head.draft_ids if head.maps_draft_ids else None  # draft columns -> target ids
        self.h_reads = 0

    @property
    def features(self) -> FeatureRequest:
        return feature_request(self.head)

    def add(self, seq_id: int, params: SamplingParams, position: int) -> None:
        self.release([seq_id])  # registering afresh: nothing a failed reset left behind may be read
        self.params[seq_id] = params
        self.generators[seq_id] = make_generator(params.seed, self.head.device, stream=1, position=position)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            st = self.seqs.get(seq_id)
            if st is not None:  # freed, then forgotten: a release cut between the two is retried whole
                if self.cache.allocated(st.slot):
                    self.cache.free(st.slot)
                del self.seqs[seq_id]
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        ready: list[tuple[DraftState, list[int], torch.Tensor, list[int]]] = []
        states = []
        for it in items:
            with blame(it.seq_id):
                s, feed = self._rollback(it)
            states.append(s)
            if feed is not None:
                ready.append((s, *feed))
        if ready:
            out = self._catch_up(ready)
            pairs = list(zip([r[0] for r in ready], out, strict=True))
            draft_chains([(s, lg) for s, lg in pairs if s.item.spec.method == SpecMethod.chain], self._forward)
            trees = [(s, lg) for s, lg in pairs if s.item.spec.method != SpecMethod.chain]
            self.h_reads += grow_trees(trees, self._forward, self.head.device)
        built = []
        for s in states:
            with blame(s.item.seq_id):
                proposal, _, fed = tree_proposal(s) if s.tree is not None else chain_proposal(s)
            built.append((s, proposal, fed))
        return with_draft_qs(built)

    # -- cache state -----------------------------------------------------------------------------------
    def _rollback(self, it: ProposeItem) -> tuple[DraftState, tuple[list[int], torch.Tensor, list[int]] | None]:
        """Drop last step's tree nodes, take in the new tokens and features; returns the drafting state and, when
        the head can draft, the pairs to feed (tokens, features, positions) ending with the root's pair."""
        st = self.seqs.get(it.seq_id)
        if st is None:
            st = self.seqs[it.seq_id] = _HeadSeq(self.cache.allocate())
        st.unpaired += it.new_tokens
        st.length += len(it.new_tokens)
        if it.features is not None:
            self._take_features(st, it.features, it.feature_start)
        keep = max(0, st.length - st.next_pair - 1)  # (the first token, or those before a restart's gap, pair none)
        del st.unpaired[: max(0, len(st.unpaired) - keep)]
        self.cache.truncate(st.slot, st.pairs)  # last step's tree nodes go (after a restart, every old pair)
        root = st.length - 1
        s = DraftState(
            item=it,
            params=self.params[it.seq_id],
            generator=self.generators[it.seq_id],
            feed=[],
            root_idx=root - 1,  # the root's pair sits at position root - 1; depth-d nodes at root - 1 + d
            token_ids=self.token_ids,
            vocab_size=self.head.cfg.vocab_size,
        )
        n_feat = 0 if st.features is None else st.features.shape[0]
        last = min(root - 1, st.next_pair + n_feat - 1)  # the last pair position buildable now
        if last < root - 1 or last < st.next_pair:
            return s, None  # no target feature yet for the position before the root: nothing to draft
        n = last - st.next_pair + 1
        assert st.features is not None
        positions = list(range(st.next_pair, last + 1))
        tokens = st.unpaired[:n]  # positions next_pair + 1 .. last + 1
        del st.unpaired[:n]
        feats = st.features[:n]
        st.features = st.features[n:] if n < n_feat else None
        st.pairs += n
        return s, (tokens, feats, positions)

    @staticmethod
    def _take_features(st: _HeadSeq, feats: torch.Tensor, start: int) -> None:
        """Append target features of positions start..; those already paired are skipped; a gap restarts the
        head's cache at ``start`` (after a restart lost what came before: still lossless, only less context)."""
        have_end = st.next_pair + (0 if st.features is None else st.features.shape[0])
        if start > have_end:
            st.pairs, st.pos0, st.features = 0, start, None
            have_end = start
        skip = have_end - start
        if skip >= feats.shape[0]:
            return
        new = feats[skip:]
        st.features = new if st.features is None else torch.cat([st.features, new])

    # -- forwards -------------------------------------------------------------------------------------
    def _catch_up(self, ready: list[tuple[DraftState, list[int], torch.Tensor, list[int]]]) -> list[torch.Tensor]:
        """Level 0: feed every sequence's new pairs; the last row's output is the root's (row 0 of the step)."""
        states = [r[0] for r in ready]
        feats = [self.head.fuse(r[2].to(self.head.device)) for r in ready]  # target features -> head space
        hidden = self._head_forward(states, [r[1] for r in ready], feats, [r[3] for r in ready])
        out = []
        for s, h in zip(states, hidden, strict=True):
            self.seqs[s.item.seq_id].rows = h[-1:]
            out.append(self.head.logits(h[-1:]))  # [1, V_d]
        return out

    def _forward(
        self,
        states: list[DraftState],
        tokens: list[list[int]] | list[torch.Tensor],
        *,
        num_logits: list[int] | None = None,
        positions: list[list[int]] | None = None,
        masks: list[torch.Tensor] | None = None,
        parent_rows: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """A draft level: each new node is fed with its parent row's output as its feature (a chain: the last row)."""
        feats, pos = [], []
        for i, s in enumerate(states):
            st = self.seqs[s.item.seq_id]
            assert st.rows is not None
            n = len(tokens[i])
            rows = parent_rows[i] if parent_rows is not None else torch.full((n,), st.rows.shape[0] - 1)
            feats.append(st.rows[rows])
            pos.append(positions[i] if positions is not None else [s.root_idx + s.depth] * n)
        hidden = self._head_forward(states, tokens, feats, pos, masks)
        out = []
        for s, h in zip(states, hidden, strict=True):
            st = self.seqs[s.item.seq_id]
            assert st.rows is not None
            st.rows = torch.cat([st.rows, h])
            out.append(self.head.logits(h))  # [n, V_d]
        return out

    def _head_forward(
        self,
        states: list[DraftState],
        tokens: list[list[int]] | list[torch.Tensor],
        feats: list[torch.Tensor],
        positions: list[list[int]],
        masks: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """One ragged head forward over head-space features; per state the outputs [n, H] of its new pairs."""
        batch = ForwardBatch.build(
            self.cache,
            [self.seqs[s.item.seq_id].slot for s in states],
            tokens,
            positions=positions,
            tree_masks=masks,
            device=self.head.device,
        )
        hidden = self.head(batch.tokens, torch.cat(feats), batch, self.cache)  # [N, H]
        return list(hidden.split(list(batch.num_new)))
