"""StepLoop: continuous batching over a target worker (and, with speculation, a draft worker).

One step: plan SL -> propose -> verify -> commit/stream -> policy update. The loop owns every request's token
state (``Sequence``); workers hold only caches. Observers see each step through one channel (``step_events``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Collection
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from specserve.config import Drafter, SLPolicyKind, SpecConfig, SpecMethod
from specserve.detok import ByteRuns, IncrementalText
from specserve.errors import InvalidRequestError, PartialStepError, SequenceError, blame
from specserve.guard import Outlook
from specserve.messages import FeatureRequest, Proposal, ProposeItem, VerifyItem, VerifyOutput
from specserve.policy import SequenceDSDE
from specserve.policy.planner import SLPlanner, StepPlan
from specserve.sequence import FinishReason, Request, RequestOutput, Sequence
from specserve.spec_decode.model_free import ModelFreeDrafter
from specserve.step_events import StepEvent, StepObserver, StepStats
from specserve.structured import AnswerGrammar, GrammarCompiler, GrammarDeadEnd
from specserve.workers.base import DraftWorkerAPI, TargetWorkerAPI

logger = logging.getLogger(__name__)

CATCH_UP = 2  # a draft model more tokens than this behind a sequence (it missed plain steps) first catches up


class StepLoop:
    def __init__(
        self,
        target: TargetWorkerAPI,
        draft: DraftWorkerAPI | None = None,
        *,
        speculation: SpecConfig | None = None,
        spec_headroom: int = 0,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: set[int],
        max_batch_size: int,
        max_model_len: int,
        planner: SLPlanner | None = None,
        features: FeatureRequest | None = None,
        model_free: ModelFreeDrafter | None = None,
        metrics_window: int = 10_000,
    ) -> None:
        self.target = target
        self.draft = draft  # None while detached (``detach_draft``): its sequences decode plainly
        self.serves_drafts = draft is not None  # requests that need the draft model are admitted
        self.speculation = speculation or SpecConfig(method=SpecMethod.none)
        self.spec_headroom = spec_headroom  # KV room beyond max_model_len for one step's drafted tokens
        self.tokenizer = tokenizer
        self.byte_runs = ByteRuns.of(tokenizer)  # once: a vocabulary's worth of names to read
        self.grammars = GrammarCompiler(tokenizer, eos_token_ids)  # structured answers' (its vocabulary on first use)
        self.eos_token_ids = eos_token_ids
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.planner = planner or SLPlanner()
        self.features = features  # the target hidden states a draft head reads (None: a draft model needs none)
        self.model_free = model_free or ModelFreeDrafter()  # prompt lookup / suffix trees, here in the loop's process
        if self.speculation.method != SpecMethod.none and self.speculation.drafter == Drafter.suffix:
            self.model_free.use_cache()  # the default drafts from it: every output counts from the first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}
        self._unreleased: set[int] = set()  # finished or aborted sequences a worker failed to release: retried
        # outputs committed but not yet returned: a step cut short after some rows committed (a KeyboardInterrupt)
        # leaves them for the next step to return first
        self._undelivered: list[RequestOutput] = []
        self.stats = StepStats(metrics_window)
        self.observers: list[StepObserver] = [self.stats]
        self._last_planned = False  # the last recorded step was planned to speculate (a catch-up after: within it)

    # -- requests in and out --------------------------------------------------------------------------
    def add_request(self, request: Request, grammar: AnswerGrammar | None = None) -> None:
        """``grammar``: the request's format compiled already (by ``self.grammars``, off the thread that steps);
        None: compiled here."""
        if request.request_id in self._by_request:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(request.prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(request.prompt_ids)} tokens; the context limit is {self.max_model_len} "
                "and leaves no room to generate"
            )
        done = request.delivered.token_ids if request.delivered is not None else ()
        if len(done) >= request.params.max_tokens or len(request.prompt_ids) + len(done) >= self.max_model_len:
            raise InvalidRequestError("the delivered output already reaches the request's max_tokens or the context")
        request = replace(request, params=request.params.seeded())
        spec = request.speculation or self.speculation
        if spec.method != SpecMethod.none:
            if not self.serves_drafts and spec.needs_model:
                raise InvalidRequestError(
                    f"speculation {spec.method.value!r} needs a draft model; none is loaded", param="speculation"
                )
            if spec.max_verify_tokens > self.spec_headroom:
                raise InvalidRequestError(
                    f"speculation verifies up to {spec.max_verify_tokens} tokens per step; "
                    f"this engine reserves room for {self.spec_headroom}",
                    param="speculation",
                )
            spec = spec.fit_draft_rows(self.spec_headroom)  # its trees no deeper than the KV slot's room
        text = IncrementalText(
            self.tokenizer,
            request.params.stop,
            request.prompt_ids,
            self.byte_runs,
            include_stop=request.params.include_stop_str_in_output,
            floor=request.params.min_tokens,
        )
        if request.delivered is not None:  # a continuation: its first step prefills prompt and output
            text.resume(done, request.delivered.text)
        seq = Sequence(
            next(self._ids), request, text, spec=spec, output=list(done), delivered=len(done), suspect=request.suspect
        )
        if request.params.output_format is not None:
            if spec.synthetic_accept is not None:  # (its accepted paths are made up: the grammar would not hold)
                raise InvalidRequestError("a structured answer cannot be drafted in the synthetic benchmark mode")
            seq.grammar = grammar or self.grammars.compile(request.params.output_format)
        seq.prompt_logprobs_sent = request.delivered is not None  # (a continuation's first lane sent them)
        if spec.policy == SLPolicyKind.dsde and spec.method != SpecMethod.none:
            seq.sl_state = SequenceDSDE(spec.dsde, request.params.temperature)
        if spec.method != SpecMethod.none and spec.drafter == Drafter.suffix:
            self.model_free.use_cache()
        self._by_request[request.request_id] = seq
        self.waiting.append(seq)
        try:
            for obs in self.observers:
                obs.on_request(seq)
        except BaseException:  # not admitted after all: nothing may run it or count it
            del self._by_request[request.request_id]
            self.waiting.remove(seq)
            raise

    def abort(self, request_id: str, *, remember: bool = True) -> bool:
        """``remember=False``: the request goes on elsewhere (another lane of this replica, which shares the
        cross-request cache): its output joins the cache once, when it finishes there, not also now."""
        self._undelivered = [o for o in self._undelivered if o.request_id != request_id]  # its news goes with it
        seq = self._by_request.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._release([seq], remember=remember)
        return True

    def recover(self, *, target: bool, draft: bool) -> None:
        """After a worker was replaced by a fresh one: re-register every running sequence with it and resend
        its whole token state on the next step (the new worker re-prefills from the router's tokens)."""
        for seq in self.running:
            if target:
                self.target.add(seq.seq_id, seq.request.params, seq.length)
                seq.target_seen = 0
            if draft and self.draft is not None and seq.spec.uses_model:
                self.draft.add(seq.seq_id, seq.request.params, seq.length)
                seq.draft_seen = seq.features_sent = 0
                seq.last_accepted = []
                seq.model_proposed = False  # its next step re-reads everything: a catch-up, untimed by the guard

    def detach_draft(self) -> None:
        """The draft worker is gone (a fresh one is on its way): every sequence decodes plainly, lossless as ever,
        until ``attach_draft``; requests that ask for the draft model are still admitted."""
        self.draft = None
        for seq in self.running:
            seq.last_accepted, seq.model_proposed = [], False

    def attach_draft(self, draft: DraftWorkerAPI) -> None:
        """A fresh draft worker after ``detach_draft``: the running sequences are registered with it and it catches
        up on their next step (as after a restart)."""
        self.draft = draft
        self.recover(target=False, draft=True)

    def reset(self, seq_ids: Collection[int]) -> None:
        """After a failed step: drop what the workers cached for these running sequences (part of that step may be
        in it) and register them afresh, so their next step re-prefills from the loop's tokens."""
        seqs = [s for s in self.running if s.seq_id in seq_ids]
        for seq in seqs:  # first: should a release fail, the next step still registers (and so resets) them afresh
            seq.registered = False
        ids = [s.seq_id for s in seqs]
        self.target.release(ids)
        if self.draft is not None:
            self.draft.release(ids)

    def request_id(self, seq_id: int) -> str | None:
        """The running request whose sequence this is (None: none is running)."""
        return next((s.request.request_id for s in self.running if s.seq_id == seq_id), None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._undelivered)

    # -- one step -------------------------------------------------------------------------------------
    def step(self, only: Collection[int] | None = None) -> list[RequestOutput]:
        """plan SL -> propose -> verify -> commit/stream -> policy update.

        ``only``: step just these sequences (by seq_id), as drafted without the throughput guard; the rest wait,
        and no new request is admitted but those among them (a suspect, which joins no batch before a step of it
        alone has committed: ``next_suspect``).

        A step cut short in its commit or after it (an interrupt) loses no output: each row commits whole or not at
        all, and the outputs of the rows it committed come first in the next step's return.
        """
        t0 = time.perf_counter()
        self._retire()  # sequences a step cut short had finished (they must not run past their end)
        self._admit(only)
        if not (batch := [s for s in self.running if only is None or s.seq_id in only]):
            return self._hand_out()
        self._register(batch)
        # a step over ``only`` (a suspect group isolating a failed step) drafts as each sequence's SL says, whatever
        # the guard would choose: its re-prefill would make the guard plan plain decoding and hide a drafting failure
        prefills, guarded = any(s.prefills for s in batch), only is None
        plan = self._plan(batch, prefills=prefills, guarded=guarded)
        proposals = self._propose(batch, plan)
        t1 = time.perf_counter()
        items, dead = self._verify_items(batch, proposals)
        if dead:  # held answers their grammar lets go no further: failed alone, before the target sees the step
            ok = [i for i, s in enumerate(batch) if s.seq_id not in dead]
            batch, plan, proposals = [batch[i] for i in ok], plan.select(ok), [proposals[i] for i in ok]
            if not batch:
                raise PartialStepError(self._hand_out(), dead)
        verified = self.target.verify(items)
        t2 = time.perf_counter()
        outputs, failures = self._commit_rows(batch, proposals, verified)
        self._calibrate(batch, proposals, verified, failures)  # before the finished ones' release forgets them
        self._retire()
        cut_prefilled = any(len(it.new_tokens) > 1 for it, s in zip(items, batch, strict=True) if s.seq_id in failures)
        if failures:  # the step as the committed rows saw it
            ok = [i for i, s in enumerate(batch) if s.seq_id not in failures]
            batch, plan = [batch[i] for i in ok], plan.select(ok)
            proposals, items = [proposals[i] for i in ok], [items[i] for i in ok]
            verified = [verified[i] for i in ok]
        cut = len(failures) + len(dead)
        end = time.perf_counter()
        event = StepEvent(batch, plan, proposals, items, verified, outputs, t0, t1, t2, end, cut, cut_prefilled)
        failures |= self._after_commit(event) | dead
        if failures:
            raise PartialStepError(self._hand_out(), failures)
        return self._hand_out()

    def _hand_out(self) -> list[RequestOutput]:
        """The outputs committed and not yet returned (this step's, after any a step cut short left)."""
        outputs, self._undelivered = self._undelivered, []
        return outputs

    def _outlook(self, batch: list[Sequence], room: list[int]) -> Outlook | None:
        """For the guard (None: no guard): the tokens the draft model would read before drafting (sequences it is
        more than ``CATCH_UP`` behind: after plain steps, or never seen) and those the batch may still emit. Only
        sequences the draft model alone drafts for count: one a model-free drafter serves falls behind the draft
        model whenever the drafter finds a match, and the model reads that only if it falls back."""
        if self.planner.guard is None:
            return None
        behind = (self._draft_reads(s) for s in batch if self.draft is not None and s.spec.needs_model)
        return Outlook(sum(m for m in behind if m > CATCH_UP), sum(room))

    def _draft_reads(self, seq: Sequence) -> int:
        """Tokens the draft would read before drafting: all it has not seen (a draft model), at most the newest
        ``catch_up_window`` of them (a draft head, fed from the sequence's bounded feature queue)."""
        behind = seq.draft_behind()
        return behind if self.features is None else min(behind, seq.spec.catch_up_window)

    def _admit(self, only: Collection[int] | None = None) -> None:
        """The waiting sequences in order while there is room (``only``: those among them), but suspects, which
        only a step of their own admits (or, first in line, one with nothing running beside it: a caller that
        never steps one alone, the Engine, would otherwise wait for ever)."""
        if self._unreleased:  # slots a failed release left held: free them before anyone new needs one
            self._release_ids(sorted(self._unreleased))
        if only is None and not self.running and self.waiting and self.waiting[0].suspect:
            self.running.append(self.waiting.popleft())
            return
        while len(self.running) < self.max_batch_size:
            admitted = (s for s in self.waiting if (not s.suspect if only is None else s.seq_id in only))
            if (seq := next(admitted, None)) is None:
                return
            self.waiting.remove(seq)
            self.running.append(seq)

    def next_suspect(self) -> int | None:
        """A suspect to step alone now: one running already (its step alone did not commit: a lost draft, a worker
        replaced), else a waiting one there is room for (None: none)."""
        if (running := next((s.seq_id for s in self.running if s.suspect), None)) is not None:
            return running
        if len(self.running) >= self.max_batch_size:
            return None
        return next((s.seq_id for s in self.waiting if s.suspect), None)

    def is_suspect(self, seq_id: int) -> bool:
        """Whether this running sequence came as a suspect and has not yet committed a step here."""
        return any(s.seq_id == seq_id and s.suspect for s in self.running)

    def _register(self, batch: list[Sequence]) -> None:
        """Add newly admitted (or reset) sequences to the workers; their first step sends all their tokens."""
        for seq in batch:
            if seq.registered:
                continue
            with blame(seq.seq_id):
                self.target.add(seq.seq_id, seq.request.params, seq.length)
                seq.target_seen = 0
                if self.draft is not None and seq.spec.uses_model:
                    self.draft.add(seq.seq_id, seq.request.params, seq.length)
                    seq.draft_seen = seq.features_sent = 0
                    seq.last_accepted = []
            seq.registered = True

    def _plan(self, batch: list[Sequence], *, prefills: bool, guarded: bool) -> StepPlan:
        room = [s.remaining(self.max_model_len) for s in batch]  # the tokens each may still emit
        outlook = self._outlook(batch, room)
        model = self.draft is not None  # (none loaded, or detached: model_fallback rows draft from lookup alone)
        plan = self.planner.plan(batch, prefills=prefills, outlook=outlook, guarded=guarded, room=room, model=model)
        if self.draft is None and self.serves_drafts:  # detached: no model drafts, and none planned (nor timed)
            plan = _undrafted(plan, [s.spec.drafter == Drafter.model for s in batch])
        if all(s.grammar is None for s in batch):
            return plan
        # a structured answer whose grammar would take longer than its budget over a drafted tree's rows (its cost
        # a row times the nodes the tree may hold) decodes plainly: the batch would wait on it
        levels = [max(d, plan.free_depth(i)) for i, d in enumerate(plan.depths)]
        costly = [
            s.grammar is not None
            and d > 0
            and not s.grammar.affords(1 + (s.spec.max_tree_nodes if s.spec.is_tree else d))
            for s, d in zip(batch, levels, strict=True)
        ]
        return _undrafted(plan, costly) if any(costly) else plan

    def _propose(self, batch: list[Sequence], plan: StepPlan) -> list[Proposal | None]:
        """Model-free drafters first (where a sequence asks for one); the draft model for the rest, and where they
        found no match (``model_fallback``)."""
        proposals: dict[int, Proposal] = {}
        to_model: list[tuple[Sequence, int]] = []
        current = {s.seq_id: s.model_proposed for s in batch}  # the draft model saw each one's last step
        in_step = {s.seq_id: s.reads_every_unsent for s in batch}  # ... and a head reads all it was not sent
        for i, (s, d) in enumerate(zip(batch, plan.depths, strict=True)):
            s.model_proposed, s.draft_caught_up, s.draft_prefilled = False, 0, False
            if d == 0:
                continue
            if s.spec.drafter != Drafter.model:
                p = self.model_free.propose(
                    s.seq_id,
                    s.tokens,
                    s.spec,
                    plan.free_depth(i),
                    want_q=s.sl_state is not None,
                    cache_salt=s.request.cache_salt,
                    min_prob=plan.min_prob if s.spec.adaptive_floor else None,
                )
                if p is not None:
                    proposals[s.seq_id] = p
                    continue
            if self.draft is not None and s.spec.uses_model:
                to_model.append((s, s.spec.model_depth(d)))
        if to_model:
            assert self.draft is not None
            # (first position, rows) or None; in step: the head drafted the last step, from features (a first
            # step drafts nothing, and a step after a reset or a new worker is a catch-up: at most the window)
            queued = [s.queued_features(in_step=in_step[s.seq_id]) for s, _ in to_model]
            items = [
                ProposeItem(
                    s.seq_id,
                    s.unsent(s.draft_seen),
                    s.last_accepted,
                    d,
                    s.spec,
                    kld_mode=None if s.sl_state is None else s.spec.kld_mode,
                    features=None if q is None else q[1],
                    feature_start=s.features_from if q is None else q[0],
                    root_position=s.length - 1,
                    min_prob=plan.min_prob if s.spec.adaptive_floor else None,
                )
                for (s, d), q in zip(to_model, queued, strict=True)
            ]
            for (s, _), q in zip(to_model, queued, strict=True):
                missed = self._draft_reads(s)  # the draft missed 2+ steps' tokens (not a new prompt, not a cheap step)
                s.draft_caught_up = missed if not current[s.seq_id] and s.target_seen > 0 and missed > CATCH_UP else 0
                # a head that drafted its admission step had no features then: it reads the prompt's now
                s.draft_prefilled = q is not None and current[s.seq_id] and s.features_sent == 0
            proposals.update((p.seq_id, p) for p in self.draft.propose(items))
            for s, _ in to_model:
                s.draft_seen = s.length
                s.features_went()
                s.model_proposed = True
        # a draft head without features for a sequence yet (its first step) drafts nothing: a plain step
        return [p if (p := proposals.get(s.seq_id)) is not None and p.tokens else None for s in batch]

    def _verify_items(
        self, batch: list[Sequence], proposals: list[Proposal | None]
    ) -> tuple[list[VerifyItem], dict[int, SequenceError]]:
        """Each sequence's verify item, but for a held answer whose grammar allows nothing after it (its request's
        format is at fault: failed alone, its batch unharmed)."""
        items, dead = [], {}
        for seq, proposal in zip(batch, proposals, strict=True):
            try:
                items.append(self._verify_item(seq, proposal))
            except SequenceError as e:
                if not isinstance(e.__cause__, GrammarDeadEnd):
                    raise
                dead[seq.seq_id] = e
        return items, dead

    def _verify_item(self, seq: Sequence, proposal: Proposal | None) -> VerifyItem:
        spec = seq.spec
        features = self.features if spec.uses_model else None  # the head reads them only where it may draft
        params = seq.request.params
        banned = params.banned_before(self.eos_token_ids) if len(seq.output) < params.min_tokens else ()
        below = len(seq.request.prompt_ids) + params.min_tokens if banned else 0  # (the sequence position)
        # (its new tokens start with the prompt)
        prompt = params.prompt_logprobs is not None and not seq.prompt_logprobs_sent and seq.target_seen == 0
        allowed = None
        if seq.grammar is not None:  # a structured answer: the tokens its grammar allows at each row
            with blame(seq.seq_id):
                seq.grammar.follow(seq.output)
                allowed = seq.grammar.masks(*(([], []) if proposal is None else (proposal.tokens, proposal.parents)))
        if proposal is None:
            return VerifyItem(
                seq.seq_id,
                seq.unsent(seq.target_seen),
                features=features,
                banned=banned,
                banned_below=below,
                prompt_logprobs=prompt,
                allowed=allowed,
            )
        return VerifyItem(
            seq.seq_id,
            seq.unsent(seq.target_seen),
            proposal.tokens,
            proposal.parents,
            proposal.q_idx,
            proposal.q_prob,
            draft_q=proposal.draft_q,
            kld_past_rejection=spec.dsde.record_past_rejection and not spec.is_tree,
            kld_tail=spec.kld_tail,
            synthetic_accept=spec.synthetic_accept,
            features=features,
            banned=banned,
            banned_below=below,
            prompt_logprobs=prompt,
            allowed=allowed,
        )

    def _commit_rows(
        self, batch: list[Sequence], proposals: list[Proposal | None], verified: list[VerifyOutput]
    ) -> tuple[list[RequestOutput], dict[int, SequenceError]]:
        """Commit row by row: a sequence failing to commit leaves the others' news intact (issue 16). A failed row
        is rolled back (not finished, so not retired with the finished ones: its request is failed instead)."""
        outputs, failures = [], {}
        for seq, proposal, out in zip(batch, proposals, verified, strict=True):
            try:
                with blame(seq.seq_id):
                    outputs.append(self._commit_row(seq, proposal, out))
            except SequenceError as e:
                failures[seq.seq_id] = e
        return outputs, failures

    def _commit_row(self, seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> RequestOutput:
        """One row's commit, whole or not at all: its output is kept for the step's return (``_undelivered``), and
        whatever stops it before (a failure, an interrupt) puts its sequence's token state back; the caches and
        counters of a step that raised are the caller's to reset (``reset``: the row re-prefills)."""
        saved = seq.checkpoint()
        try:
            output = self._commit(seq, proposal, out)
            self._undelivered.append(output)
            seq.suspect = False  # a step of it alone went through: it joins the batch
        except BaseException:
            seq.rollback(saved)
            raise
        return output

    def _after_commit(self, event: StepEvent) -> dict[int, SequenceError]:
        """The policy update, the guard's and floor's records and the observers, once the step committed: nothing
        here may lose its outputs. An unfinished sequence whose SL update fails is returned to fail alone; a failed
        record or observer is logged (a lost measurement, never lost tokens)."""
        failures = self._update_sl(event)
        for record in (self._record, *(obs.on_step for obs in self.observers)):
            try:
                record(event)
            except Exception:
                logger.exception("recording a committed step failed (%s); its outputs stand", record)
        return failures

    def _update_sl(self, event: StepEvent) -> dict[int, SequenceError]:
        """This step's KLD values set each DSDE sequence's next SL (docs/algorithms.md §4.6)."""
        failures: dict[int, SequenceError] = {}
        for i, (seq, proposal, out) in enumerate(zip(event.batch, event.proposals, event.verified, strict=True)):
            if seq.sl_state is None or proposal is None:
                continue
            drafted = proposal.verified_depth  # a tree's levels the target verified (§3.3), not those grown
            try:
                with blame(seq.seq_id):
                    cut = event.plan.was_cut(i, by_model=seq.model_proposed)
                    seq.sl_state.observe(out.kld, drafted, min(len(out.accepted), drafted), cut=cut)
            except SequenceError as e:
                if seq.finish_reason is None:
                    failures[seq.seq_id] = e
                else:  # its request is complete and delivered
                    logger.exception("the SL update of a finished sequence failed: %s", e)
        return failures

    def _calibrate(
        self,
        batch: list[Sequence],
        proposals: list[Proposal | None],
        verified: list[VerifyOutput],
        failed: Collection[int],
    ) -> None:
        """The model-free drafter learns how often its nodes are accepted (docs/algorithms.md §10.6), from the rows
        that committed (as the guard and the observers do): a lost measurement is logged, never raised."""
        try:
            for seq, proposal, out in zip(batch, proposals, verified, strict=True):
                if seq.seq_id not in failed:
                    self.model_free.observe(seq.seq_id, proposal, out.accepted)
        except Exception:
            logger.exception("calibrating the model-free drafter failed; the step's outputs stand")

    def _record(self, event: StepEvent) -> None:
        """The throughput guard records the step unless some sequence (re-)prefilled in it or it cut rows: a prompt's
        prefill costs both modes alike and takes several decode steps' time, so a mode's average would say more
        about admissions than about its decoding (docs/algorithms.md §7). The tree floor's fit takes the same steps
        where they were planned to speculate: their verify seconds against verified rows, their tokens a second
        (docs/algorithms.md §2.3)."""
        if event.prefills or event.rows_cut or not any(s.spec.method != SpecMethod.none for s in event.batch):
            return  # (a step rows were cut from: its time is not the committed rows', nor perhaps a decode step's)
        # a draft head's prefill (it read an admitted prompt's features: 19 ms against a step's 12 on the Zen 4, 20%
        # on speculation's average step time at once) is a request's cost, as the target's is, not a step's rate
        draft_prefill = any(s.draft_prefilled for s in event.batch)
        # the draft model drafted for some sequence (its tree may have kept no node: still a speculative step's
        # cost), or a model-free drafter found a match
        drafted_any = any(p is not None for p in event.proposals) or any(s.model_proposed for s in event.batch)
        caught_up = sum(s.draft_caught_up for s in event.batch)
        guard = self.planner.guard
        # a step planned to speculate may find no draft, or have no draft worker: then plain, but not a try of plain
        planned = event.plan.speculate
        switch = caught_up > 0 and not self._last_planned  # the draft re-read what plain steps left it
        self._last_planned = planned
        # the floor fits steps that were to draft (their trees may have kept no node), not plain ones
        floor = self.planner.floor if any(event.plan.depths) and self.planner.adaptive(event.batch) else None
        # trees sized before their floor was measured (a cold start's wide ones: 2x a step on some CPUs) are not the
        # speculation the guard chooses between: it records the bucket's steps once the floor is measured
        settling = floor is not None and floor.settling(len(event.batch))
        if guard is not None and not settling and not draft_prefill:
            guard.record(
                len(event.batch), drafted_any, event.emitted, event.total_s, caught_up_tokens=caught_up, planned=planned
            )
        if floor is not None:
            rows = sum(len(it.new_tokens) + len(it.draft_tokens) for it in event.items)
            floor.record_verify(len(event.batch), rows, event.verify_s)
            # a catch-up within speculation (rows the token budget left undrafted: at batch 16 under the serving
            # budget, some row in every step) is what speculating costs there, as the guard times it; one after plain
            # steps is a switch's, not speculation's rate (left out, every such bucket went unmeasured for good)
            if not switch and not draft_prefill:
                floor.record_rate(len(event.batch), event.emitted, event.total_s)

    def _commit(self, seq: Sequence, proposal: Proposal | None, out: VerifyOutput) -> RequestOutput:
        # a drafted node the grammar has no way on from, accepted: the tokens after it were drawn from a row that
        # allowed everything, so the answer stops there; unless that ends it, it fails (plain decoding's fails at
        # the next step, its dead end at the root) and the row is rolled back (``_commit_row``)
        dead = None if seq.grammar is None else seq.grammar.first_dead(out.accepted)
        if dead is not None:
            logprobs = None if out.logprobs is None else out.logprobs[: dead + 1]
            out = replace(out, accepted=out.accepted[: dead + 1], tokens=out.tokens[: dead + 1], logprobs=logprobs)
        if out.features is not None:
            seq.add_features(out.features, start=seq.target_seen)  # rows from the target's old cache length on
        prompt_logprobs = None
        if out.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs = out.prompt_logprobs[: len(seq.request.prompt_ids) - 1]
            seq.prompt_logprobs_sent = True
        seq.target_seen = len(seq.tokens) + len(out.accepted)  # the target cached the accepted path
        if seq.model_proposed:  # the draft model's cache holds its own proposal's accepted nodes
            seq.last_accepted = out.accepted
        seq.stats.target_forwards += 1
        if proposal is not None:
            seq.stats.drafted += len(proposal.tokens)
            seq.stats.draft_steps += 1
            seq.stats.depth_sum += proposal.depth
        params = seq.request.params
        before = len(seq.output)
        # EOS ends the output without joining it; a stop token id joins the token ids, and the text only with
        # include_stop_str_in_output (as vLLM's)
        at_eos = at_stop_id = False
        eos_logprob = None  # the EOS's entry: not in the output's ids, but in its logprobs (vLLM lists it)
        for i, tok in enumerate(out.tokens):
            if tok in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = FinishReason.stop
                at_eos = True
                eos_logprob = None if out.logprobs is None else out.logprobs[i]
                break
            seq.output.append(tok)
            if out.logprobs is not None:
                seq.pending_logprobs.append(out.logprobs[i])
            if (  # first, as vLLM's: a stop token id that is the last token allowed ends with length, its text kept
                len(seq.output) >= params.max_tokens
                or len(seq.request.prompt_ids) + len(seq.output) >= self.max_model_len
            ):
                seq.finish_reason = FinishReason.length
                break
            if tok in params.stop_token_ids:
                seq.finish_reason = FinishReason.stop
                at_stop_id = True
                break
        if at_stop_id:  # its own text completes no stop string (vLLM checks stop ids first), and joins the text
            # only with include_stop_str_in_output
            text = seq.text.update(seq.output[:-1], final=True, drop_open=True)
            if params.include_stop_str_in_output and not seq.text.stopped:
                text += seq.text.update(seq.output, final=True, search=False)
        else:
            text = seq.text.update(seq.output, final=seq.finish_reason is not None)
        if seq.text.stopped:
            seq.finish_reason = FinishReason.stop
            # a speculative step can accept tokens past the stop string: they are not output
            del seq.output[seq.text.settled(len(seq.output)) :]
        if dead is not None and seq.finish_reason is None:
            raise seq.grammar.dead_after_accepted()  # type: ignore[union-attr]
        # accepted drafts that were emitted: a step emits its tokens up to EOS (counted), max_tokens or a stop string,
        # the first of them the forward's own, so drafts cut with the rest of the step do not count (accepted +
        # forwards = tokens emitted; DSDE observes the verifier's own count)
        committed = max(0, len(seq.output) - before)
        emitted = committed + (at_eos and not seq.text.stopped)
        seq.stats.accepted += min(len(out.accepted), max(0, emitted - 1))
        # handed out: the tokens no later step can cut at a stop string (with byte fallback a stop string complete
        # at a token can be hidden in this step's text until its character's last byte comes)
        settled = len(seq.output) if seq.finish_reason is not None else seq.text.settled(len(seq.output))
        new = seq.output[seq.delivered : settled]
        logprobs = None
        if params.logprobs is not None:
            logprobs, seq.pending_logprobs = seq.pending_logprobs[: len(new)], seq.pending_logprobs[len(new) :]
            if eos_logprob is not None and not seq.text.stopped:  # (the answer ended at EOS: all else delivered)
                logprobs.append(eos_logprob)
        seq.delivered = max(seq.delivered, settled)
        return RequestOutput(
            request_id=seq.request.request_id,
            token_ids=new,
            text=text,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.request.prompt_ids),
            num_output_tokens=seq.delivered,
            stats=replace(seq.stats),  # a snapshot: the sequence's own goes on counting
            committed=committed,
            stop_reason=seq.text.stop_string if seq.text.stopped else seq.output[-1] if at_stop_id else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _retire(self) -> None:
        """Finished sequences leave the batch, then their workers' state goes: after the step committed, so a
        failure there (a worker's release, the suffix cache's insert) is logged and the outputs stand."""
        done = [s for s in self.running if s.finish_reason is not None]
        if done:
            self.running = [s for s in self.running if s.finish_reason is None]
            for s in done:
                self._by_request.pop(s.request.request_id, None)
            try:
                self._release(done)
            except Exception:
                logger.exception("releasing %d finished sequences failed; their outputs stand", len(done))

    def _release(self, seqs: list[Sequence], *, remember: bool = True) -> None:
        self._release_ids([s.seq_id for s in seqs])
        for s in seqs if remember else []:  # last: the workers' slots are free whatever the cache's insert does
            try:
                self.model_free.remember(s.output, s.request.cache_salt)
            except Exception:  # the sequences have left the loop: a failed insert costs the cache, never an output
                # (raised out of an abort, it reached whichever caller stepped, the step's other outputs lost)
                logger.exception("adding request %s's output to the suffix cache failed", s.request.request_id)

    def _release_ids(self, ids: list[int]) -> None:
        """Every owner releases these sequences, each whatever the others do (releasing is idempotent). Ids an
        owner failed to release are kept and retried before the next admission, so a transient failure holds
        no slot for good; the failure is logged, never raised: the sequences have already left the loop."""
        releases = [self.target.release, self.model_free.release]
        if self.draft is not None:
            releases.append(self.draft.release)
        self._unreleased.update(ids)  # first: an interrupt (Ctrl-C) mid-release leaves them to the retry too
        failed = False
        for release in releases:
            try:
                release(ids)
            except Exception:
                failed = True
                logger.exception("%s of sequences %s failed; retried before the next admission", release, ids)
        if not failed:
            self._unreleased.difference_update(ids)


def _undrafted(plan: StepPlan, rows: list[bool]) -> StepPlan:
    """``plan`` with no levels for the ``rows`` marked."""

    def zeroed(levels: list[int]) -> list[int]:
        return [0 if r else d for r, d in zip(rows, levels, strict=True)]

    return replace(
        plan, depths=zeroed(plan.depths), free_depths=None if plan.free_depths is None else zeroed(plan.free_depths)
    )
