"""The target worker: prefill and verification of every sequence's draft in one ragged forward."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import cast

import numpy as np
import torch

from specserve.errors import blame
from specserve.messages import TokenLogprob, VerifyItem, VerifyOutput
from specserve.models.batch import ForwardBatch
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel
from specserve.models.lm_head import argmax_rows, greedy_ids
from specserve.models.native_stack import lumped_kld_kernel
from specserve.policy import PROB_FLOOR, SparseTail, kld_exact, kld_nodes, kld_sparse
from specserve.sampling import (
    SamplingParams,
    allowed_only,
    apply_logit_bias,
    greedy_draw,
    keyed_sample,
    make_generator,
    process_logits,
)
from specserve.spec_decode.draft_tree import DraftTree, step_layout
from specserve.spec_decode.synthetic import synthetic_kld, synthetic_verify
from specserve.spec_decode.verify import VerifyResult, chain_outcome, chain_result, tree_draws, walk_tree
from specserve.workers.base import SlotTable

PIN_LIMIT_BYTES = 1 << 20  # other sequences' feature rows one sequence's view may keep alive
PROMPT_CHUNK = 256  # prompt rows whose logits are computed at once for prompt logprobs


class TargetWorker:
    def __init__(self, model: LlamaModel, *, num_slots: int, max_len: int) -> None:
        self.model = model
        self.table = SlotTable(model, num_slots, max_len)
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}

    @property
    def cache(self) -> KVCache:
        return self.table.cache

    def add(self, seq_id: int, params: SamplingParams, position: int) -> None:
        self.release([seq_id])  # registering afresh: nothing a failed reset left behind may be read
        self.params[seq_id] = params
        self.generators[seq_id] = make_generator(params.seed, self.model.device, position=position)

    def release(self, seq_ids: list[int]) -> None:
        self.table.release(seq_ids)
        for seq_id in seq_ids:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)

    @torch.inference_mode()
    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        if not items:  # (a forward batch needs a sequence)
            return []
        trees, slots, tokens, positions, masks, starts, draw_positions = [], [], [], [], [], [], []
        greedy = [False] * len(items)  # per item: its tokens are the argmaxes of its logits (no KLD, not synthetic)
        for i, it in enumerate(items):
            with blame(it.seq_id):
                params = self.params[it.seq_id]
                # (biased, or with tokens not drawn yet: from the logits as processed)
                greedy[i] = it.by_argmax(params.raw_argmax)
                slot = self.table.slot(it.seq_id)
                tree = DraftTree(
                    tokens=torch.tensor([it.new_tokens[-1], *it.draft_tokens]),
                    parents=torch.tensor([0, *it.draft_parents]),
                )
                start = self.cache.length(slot)
                mask, pos = step_layout(tree, len(it.new_tokens) - 1, start)
            # the index in the sequence of the token drawn at each node: one past the node's own position
            first = start + len(it.new_tokens) - 1  # the root's position
            node_pos = pos[len(it.new_tokens) - 1 :] if pos else list(range(first, first + tree.num_nodes))
            draw_positions.append([q + 1 for q in node_pos])
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
        want_logprobs = [self.params[it.seq_id].logprobs is not None for it in items]
        argmax_only = not any(want_logprobs) and all(
            g and it.draft_q is None for g, it in zip(greedy, items, strict=True)
        )
        logits, ids, features, prompt_rows = self._forward(
            batch, items, argmax_only=argmax_only, any_greedy=any(greedy)
        )
        if ids is not None:
            ids = ids.cpu()  # host sync: the step's argmaxes, once for every greedy sequence
        sizes = [t.num_nodes for t in trees]
        logits_per_seq = [None] * len(items) if logits is None else logits.split(sizes)  # per sequence [T, V]
        outputs = []
        ids_per_seq = [None] * len(items) if ids is None else ids.split(sizes)  # per sequence [T], on the host
        staged: list[_Staged] = []
        rows = zip(items, trees, draw_positions, logits_per_seq, ids_per_seq, strict=True)
        for it, tree, draw_pos, lg, top in rows:
            with blame(it.seq_id):
                staged.append(self._stage_one(it, tree, draw_pos, lg, top))
        read = iter(read_back([st.values for st in staged if st.values is not None]))
        for it, st, slot, start in zip(items, staged, slots, starts, strict=True):
            with blame(it.seq_id):
                res = st.result
                if st.finish is not None:
                    res = st.finish(st.host if st.values is None else list(islice(read, st.values.numel())))
                assert res is not None
                self._rollback(slot, start, len(it.new_tokens) - 1, res.accepted_nodes)
                outputs.append(VerifyOutput(it.seq_id, res.accepted_nodes, res.tokens))
        if logits is not None and any(it.draft_q is not None for it in items):
            outputs = self._with_klds(items, outputs, logits, sizes)
        if logits is not None and any(want_logprobs):
            outputs = self._with_logprobs(items, outputs, logits, sizes)
        if prompt_rows is not None:
            outputs = self._with_prompt_logprobs(items, outputs, prompt_rows)
        return outputs if features is None else self._with_features(items, outputs, features, batch.num_new)

    def _with_prompt_logprobs(
        self, items: list[VerifyItem], outputs: list[VerifyOutput], prompt_rows: list[torch.Tensor | None]
    ) -> list[VerifyOutput]:
        """Each output whose item asked gets the logprobs of its new tokens after the first (row j of its final
        hidden states [n - 1, H] predicts token j + 1), from the raw logits, computed PROMPT_CHUNK rows at a time
        (a prompt's [n, V] logits at once could be hundreds of MiB)."""
        updated = list(outputs)
        for i, (it, hidden) in enumerate(zip(items, prompt_rows, strict=True)):
            if hidden is None:
                continue
            want = min(cast(int, self.params[it.seq_id].prompt_logprobs), self.model.cfg.vocab_size)
            entries: list[TokenLogprob] = []
            for start in range(0, hidden.shape[0], PROMPT_CHUNK):
                rows = hidden[start : start + PROMPT_CHUNK]  # [c, H]
                lp = self.model.logits(rows).log_softmax(-1)  # [c, V]
                chosen = torch.tensor(it.new_tokens[start + 1 : start + 1 + rows.shape[0]], device=lp.device)
                picked = lp.gather(-1, chosen[:, None])[:, 0]  # [c]
                top = lp.topk(want, -1) if want else None
                parts = [picked] if top is None else [picked, top.values.flatten(), top.indices.flatten().float()]
                host = torch.cat(parts).cpu().tolist()  # host sync: a prefill's prompt logprobs, a chunk at a time
                c = rows.shape[0]
                values, ids = host[c : c + c * want], host[c + c * want :]
                for r in range(c):
                    top_r = tuple((int(ids[r * want + j]), _finite(values[r * want + j])) for j in range(want))
                    entries.append(TokenLogprob(it.new_tokens[start + 1 + r], _finite(host[r]), top_r))
            updated[i] = replace(outputs[i], prompt_logprobs=entries)
        return updated

    def _stage_one(
        self,
        it: VerifyItem,
        tree: DraftTree,
        draw_positions: list[int],
        logits: torch.Tensor | None,
        greedy: torch.Tensor | None,
    ) -> _Staged:
        """One sequence's verification up to what the host must read: its draws (or a sampled chain's outcome)
        from its logits [T, V] (None where every item of the step is greedy and needs no KLD: only their argmaxes
        ``greedy`` [T], on the host, were computed)."""
        params = self.params[it.seq_id]
        vocab = self.model.cfg.vocab_size
        walk = functools.partial(walk_tree, tree, vocab=vocab)
        if it.by_argmax(params.raw_argmax):
            assert greedy is not None
            return _Staged(finish=walk, host=greedy.tolist())  # the argmaxes, read (as one-hot rows would draw)
        if logits is None:
            raise AssertionError("a sampled, biased or synthetic item in a step verified by argmax only")
        logits = apply_logit_bias(logits, params)  # [T, V] float32 (the step's own rows without a bias)
        # min_tokens: EOS and the stop ids not drawn yet (a configured EOS id past the vocabulary is never drawn)
        ids = [t for t in it.banned if t < vocab]
        if ids and (rows := it.banned_rows(draw_positions)):
            at = torch.tensor(rows, device=logits.device)[:, None], torch.tensor(ids, device=logits.device)
            logits = logits.index_put(at, torch.tensor(float("-inf"), device=logits.device))  # (out of place)
        if it.allowed is not None:  # a structured answer: its grammar's tokens at each row
            logits = allowed_only(logits, torch.from_numpy(it.allowed))
        if params.greedy and it.synthetic_accept is None:  # what the one-hot rows of process_logits would draw
            return _Staged(greedy_draw(logits), walk)  # (and a seed's T x V keyed noise, spent for it)
        p = process_logits(logits, params)  # [T, V]
        gen = self.generators[it.seq_id]
        if it.synthetic_accept is not None:  # (not lossless, §9: read to the host in its own calls)
            tokens_h = [it.new_tokens[-1], *it.draft_tokens]
            return _Staged(result=synthetic_verify(tokens_h, [0, *it.draft_parents], p, it.synthetic_accept, gen))
        if it.q_idx is not None and it.q_prob is not None:
            q_idx, q_prob = torch.tensor(it.q_idx), torch.tensor(it.q_prob)
            return _Staged(
                chain_outcome(tree.tokens[1:], q_idx, q_prob, p, gen), functools.partial(chain_result, vocab=vocab)
            )
        if params.seed is not None:  # drawn by position: the same tokens alone, in any batch, any drafter
            return _Staged(keyed_sample(p, params.seed, draw_positions, vocab), walk)
        return _Staged(tree_draws(tree, p, gen), walk)

    def _with_logprobs(
        self, items: list[VerifyItem], outputs: list[VerifyOutput], logits: torch.Tensor, sizes: list[int]
    ) -> list[VerifyOutput]:
        """Each output whose request asked for logprobs gets, per emitted token, its log-probability under the
        target's raw distribution (before bias, temperature or cuts, as vLLM's default) and the likeliest tokens':
        a token is drawn at the root's row or the accepted node before it. One computation over the step's rows of
        those outputs, read to the host once."""
        rows: list[int] = []  # logits rows, each output's emitted tokens in order
        chosen: list[int] = []
        asking: list[int] = []  # indices of the outputs that asked
        first = 0
        for i, (it, out, size) in enumerate(zip(items, outputs, sizes, strict=True)):
            if self.params[it.seq_id].logprobs is not None:
                asking.append(i)
                rows += (first + node for node in [0, *out.accepted])
                chosen += out.tokens
            first += size
        logprobs = logits[torch.tensor(rows, device=logits.device)].float().log_softmax(-1)  # [n, V]
        picked = logprobs.gather(-1, torch.tensor(chosen, device=logits.device)[:, None])[:, 0]  # [n]
        k = min(max(cast(int, self.params[items[i].seq_id].logprobs) for i in asking), logits.shape[-1])
        top = logprobs.topk(k, -1) if k > 0 else None  # [n, k] values and ids, most likely first
        parts = [picked] if top is None else [picked, top.values.flatten(), top.indices.flatten().float()]
        host = torch.cat(parts).cpu().tolist()  # host sync: the step's logprobs, once (ids < 2**24: exact as float)
        n = len(rows)
        values, ids = host[n : n + n * k], host[n + n * k :]
        updated = list(outputs)
        at = 0
        for i in asking:
            want = min(cast(int, self.params[items[i].seq_id].logprobs), k)  # (no more than the vocabulary)
            per_token = []
            for r in range(at, at + len(outputs[i].tokens)):
                top_r = tuple((int(ids[r * k + j]), _finite(values[r * k + j])) for j in range(want))
                per_token.append(TokenLogprob(chosen[r], _finite(host[r]), top_r))
            updated[i] = replace(outputs[i], logprobs=per_token)
            at += len(outputs[i].tokens)
        return updated

    @staticmethod
    def _with_features(
        items: list[VerifyItem], outputs: list[VerifyOutput], features: torch.Tensor, num_new: tuple[int, ...]
    ) -> list[VerifyOutput]:
        """Attach to each output that asked for them the features [n, F] of the positions its sequence cached (the
        pending tokens, the root, the accepted path) out of the batch's ``features`` [N, F]: one gather for the step,
        none where every row is kept (plain steps), so a step's device work does not grow with its sequences."""
        index: list[int] = []
        sizes: list[int] = []
        offset = 0
        for it, out, n in zip(items, outputs, num_new, strict=True):
            if it.features is not None:
                num_pending = len(it.new_tokens) - 1
                rows = [*range(num_pending + 1), *(num_pending + a for a in out.accepted)]
                index += (offset + r for r in rows)
                sizes.append(len(rows))
            offset += n
        whole = index == list(range(features.shape[0]))
        kept = features if whole else features[torch.tensor(index, device=features.device)]  # [sum(sizes), F]
        row_bytes = kept.shape[1] * kept.element_size()
        # a sequence keeps its rows for up to catch_up_window steps: a view that would hold much more of the step
        # alive (a decode row beside another sequence's long prefill) gets its own copy
        per_seq = iter(
            rows.clone() if (kept.shape[0] - rows.shape[0]) * row_bytes > PIN_LIMIT_BYTES else rows
            for rows in kept.split(sizes)
        )
        pairs = zip(items, outputs, strict=True)
        return [out if it.features is None else replace(out, features=next(per_seq)) for it, out in pairs]

    def _forward(
        self, batch: ForwardBatch, items: list[VerifyItem], *, argmax_only: bool, any_greedy: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, list[torch.Tensor | None] | None]:
        """Logits [R, V] of the batch's logit rows (None with ``argmax_only``: every item greedy and sending no
        draft q for a KLD, so only the argmaxes are computed, ``lm_head.greedy_ids``), their argmaxes [R] (None
        where no item is greedy), and the hidden states [N, F] of every new token when an item asked for features
        (one request kind per batch: the lane's draft head decides it)."""
        want = next((it.features for it in items if it.features is not None), None)
        final, aux = self.model.hidden_states(batch, self.cache, () if want is None else want.aux_layers or ())
        features = None if want is None else final if want.aux_layers is None else aux
        prompt_rows = None  # per item, the final hidden states of its new tokens but the last, where it asked
        if any(it.prompt_logprobs for it in items):
            starts = np.cumsum([0, *batch.num_new]).tolist()
            prompt_rows = [
                final[a : a + len(it.new_tokens) - 1] if it.prompt_logprobs else None
                for it, a in zip(items, starts, strict=False)
            ]
        hidden = final[batch.logit_rows]
        if argmax_only:
            return None, greedy_ids(self.model, hidden), features, prompt_rows
        logits = self.model.logits(hidden)
        return logits, argmax_rows(self.model, logits) if any_greedy else None, features, prompt_rows

    def _rollback(self, slot: int, start: int, num_pending: int, accepted: list[int]) -> None:
        """Keep the pending tokens, the root and the accepted path; drop the rejected nodes' KV."""
        self.cache.keep(slot, start, [*range(num_pending + 1), *(num_pending + a for a in accepted)])

    def _with_klds(
        self, items: list[VerifyItem], outputs: list[VerifyOutput], logits: torch.Tensor, sizes: list[int]
    ) -> list[VerifyOutput]:
        """Each output whose draft sent q gets KL(p || q) (temperature 1) at the nodes ``kld_nodes`` names that q
        covers. logits: the step's [R, V], ``sizes`` rows per item. The step's rows of one kind of q go through one
        computation (``KLDRows``), and the step reads its KLDs to the host once."""
        vocab = logits.shape[-1]
        groups: dict[tuple[bool, int, SparseTail | None], KLDRows] = {}  # (dense, width, tail) -> rows
        counts: list[int] = []  # KLDs per item
        first = total = 0  # the item's first logits row; the KLDs of the items before it
        for it, out, size in zip(items, outputs, sizes, strict=True):
            q, n = it.draft_q, 0
            if q is not None:
                with blame(it.seq_id):  # a malformed q fails its own sequence, not the step
                    q.check(vocab)
                    row_of = {node: i for i, node in enumerate(q.nodes)}
                    scored = kld_nodes(out.accepted, len(it.draft_tokens) + 1, it.kld_past_rejection)
                    for node in (m for m in scored if m in row_of):
                        key: tuple[bool, int, SparseTail | None]
                        row_q: torch.Tensor | tuple[np.ndarray, np.ndarray]
                        if q.dense_logits is not None:
                            key, row_q = (True, 0, None), q.dense_logits[row_of[node]]
                        else:
                            ids, probs = q.row(row_of[node])
                            key, row_q = (False, ids.size, it.kld_tail), (ids, probs)
                        groups.setdefault(key, KLDRows(key[2])).add(total + n, first + node, row_q)
                        n += 1
            counts.append(n)
            first, total = first + size, total + n
        flat = [0.0] * total
        if groups:
            lumped = lumped_kld_kernel(self.model)
            values = _joined([g.klds(logits, lumped) for g in groups.values()]).tolist()  # host sync: the step's KLDs
            for slot, v in zip((s for g in groups.values() for s in g.slots), values, strict=True):
                flat[slot] = v
        done, start = [], 0
        for it, out, n in zip(items, outputs, counts, strict=True):
            kld, start = flat[start : start + n], start + n
            if it.synthetic_accept is not None and kld:
                kld = synthetic_kld(it.synthetic_accept, len(kld), self.generators[it.seq_id])
            done.append(out if it.draft_q is None else replace(out, kld=kld))
        return done


@dataclass(frozen=True)
class _Staged:
    """A sequence's verification before the step's host sync: ``values`` for the host to read (draws [T], or a
    sampled chain's outcome; or ``host``, read already) and ``finish`` to read them with, or its ``result``."""

    values: torch.Tensor | None = None
    finish: Callable[[list[int]], VerifyResult] | None = None
    host: list[int] = field(default_factory=list)
    result: VerifyResult | None = None


def read_back(values: list[torch.Tensor]) -> list[int]:
    """The step's sampled rows' draws and outcomes ([T_i] long each, on the logits' device), joined."""
    return torch.cat(values).tolist() if values else []  # host sync: every sampled row's, once for the step


KLD_ROWS = 32  # logits rows one KLD computation takes: [32, 49k] float32 is 6 MB; 128 rows at once ran 1.5-2.3x slower
# than in 2-row pieces, 32 rows 2.1-2.2x faster (docs/benchmarks.md, "DSDE's signal, lighter")


@dataclass
class KLDRows:
    """A step's scored rows of one kind of q: dense (``tail`` None), or sparse of one width under ``tail``."""

    tail: SparseTail | None
    slots: list[int] = field(default_factory=list)  # each row's place among the step's KLDs
    rows: list[int] = field(default_factory=list)  # ... its row of the step's logits
    qs: list[torch.Tensor | tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # ... its q: logits [V], or
    # (ids [K], probabilities [K])

    def add(self, slot: int, row: int, q: torch.Tensor | tuple[np.ndarray, np.ndarray]) -> None:
        self.slots.append(slot)
        self.rows.append(row)
        self.qs.append(q)

    def klds(self, logits: torch.Tensor, lumped: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """KL(p || q) [m] of these rows; logits: the step's [R, V]. The rows' index and sparse q reach the logits'
        device in one copy each; ``index_select``: indexing by a list took 6x as long. ``lumped``: the extension's
        lumped-tail KLD (``native_stack.lumped_kld_kernel``), taken for float32 logits on the CPU."""
        device = logits.device
        index = torch.tensor(self.rows).to(device)  # [m]
        if self.tail is None:  # dense q (one process): stacked a piece at a time, as their [m, V] rows are large
            dense = cast(list[torch.Tensor], self.qs)
            starts = range(0, len(dense), KLD_ROWS)
            return _joined(
                [
                    kld_exact(logits.index_select(0, rows), torch.stack(dense[lo : lo + len(rows)]).to(device))
                    for lo, (rows,) in zip(starts, _pieces(index), strict=True)
                ]
            )
        pairs = cast(list[tuple[np.ndarray, np.ndarray]], self.qs)
        ids = torch.from_numpy(np.stack([ids for ids, _ in pairs]))  # [m, K]
        prob = torch.from_numpy(np.stack([probs for _, probs in pairs]))  # [m, K]
        if (
            self.tail is SparseTail.lumped
            and lumped is not None
            and device.type == "cpu"
            and logits.dtype == torch.float32
        ):
            ids, prob = ids.to(torch.int32), prob.to(torch.float32)  # the kernel's dtypes (no copy where they are)
            return _joined([lumped(logits, rows, i, p, PROB_FLOOR) for rows, i, p in _pieces(index, ids, prob)])
        ids, prob = ids.to(device), prob.to(device)
        pieces = _pieces(index, ids, prob)
        return _joined([kld_sparse(logits.index_select(0, rows), i, p, tail=self.tail) for rows, i, p in pieces])


LOGPROB_FLOOR = -9999.0  # a log-probability of -inf as JSON can carry it (vLLM's)


def _finite(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # (nan too: never a number JSON cannot carry)


def _pieces(*tensors: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
    """The tensors' rows in pieces of at most ``KLD_ROWS``: the tensors themselves where they fit."""
    if tensors[0].shape[0] <= KLD_ROWS:
        return [tensors]
    return zip(*(t.split(KLD_ROWS) for t in tensors), strict=True)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
