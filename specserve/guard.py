"""Throughput guard: speculate only where it pays on this device at this batch size.

Speculation costs draft forwards and wider verification; on a CPU, or at large batch where the forward is
compute-bound, that can cost more than the accepted tokens save. Per power-of-two batch-size bucket and mode the
guard keeps moving averages of a step's tokens (per sequence in the batch: a bucket spans b/2+1..b) and of its
seconds, and compares their ratios, so a slow step counts by its time, as it does in throughput (the loop records
only steps in which every sequence decodes: an admitted prompt's prefill costs both modes alike and would swamp
either average; nor the step after, in which a draft head reads that prompt's features). It runs the faster mode
and re-tries the other after ``explore_every`` steps of the bucket, doubling the interval while the tries confirm the
choice.
Before its first decision in a bucket it measures ``warmup`` steps of plain decoding, then speculative ones, and
starts each average from their mean tokens and median seconds: one noisy first step (a page fault, another process)
does not set the choice. Speculation's warm-up goes on, up to ``max_warmup`` steps, while its mean tokens per step
lie within ``warmup_z`` standard errors of the tokens a step of its time must emit to match plain decoding: at batch
1 a step emits 1-4 tokens, and three of them chose plain decoding for a draft head that runs 1.2x faster (each step
of a large batch averages over its sequences and decides after ``warmup``).

The speculative step right after plain ones, in which the draft catches up on sequences it had already seen
(``caught_up_tokens``: it re-reads the tokens the target decoded alone while the guard kept plain steps), is not
measured: for a draft model that costs several of its steps, a cost of switching, not the rate speculation runs at.
Catch-ups within speculation (rows that a step's token budget left undrafted for a few steps, at large batch
every step) are measured: they are what speculating costs there. A try of speculation is therefore that switch
step and one measured step, and its cost is bounded: after a try that confirms plain
decoding, the next one waits until the plain steps in between took 1 / ``explore_cost`` times what the try cost
(the time of the switch step and of the measured step beyond plain decoding's for the tokens they emitted: a 4-bit draft
model catching up 16 sequences costs ~10-35 plain steps, an EAGLE head's catch-up and 2.4x-slower step at batch
16 ~7, which a try every 20 steps would pay again and again).

Switching to speculation where the batch cannot pay the draft's catch-up back is avoided: the loop says before
each step how many tokens the draft would first re-read and how many the batch may still emit (``Outlook``), and
the guard speculates only if those remaining tokens would save more than the catch-up costs (``switch_pays``),
or once the switch has been put off ``max_try_spacing`` steps in a row (the catch-up's cost is measured only where
one runs: an estimate too high would otherwise never come down). Plain steps run for that reason are measurements
of plain decoding, not tries of it.

The mode the bucket's last decision chose holds until the other measures ``margin`` (5%) faster (hysteresis):
near break-even, where a shared host's step times drift by more than the two modes differ, each flip to
speculation paid a catch-up and the choice flipped every few steps. And after the running mode's own step flips
the choice, the first measured step of the mode taken up replaces that mode's step time as a try's does
(``refresh_on_flip``, from batch ``warmup`` on): its average dates from its last run, and blended it let a host
that had slowed for both modes flip the choice back and forth (docs/benchmarks.md, "The guard near break-even").

Tokens per step are averaged with a longer memory (``token_smoothing``) than step time, starting as the plain
mean of the steps so far: they are acceptance, which jumps between 1 and 4 from one step to the next at batch 1.

A try's step time replaces the average step time of the mode it measures (that average is as old as the mode's
last run), and a choice flipped by the running mode's own step (one slowed by the host) is re-checked soon
(docs/algorithms.md §7). With ``measured_tries`` (off) a try of speculation instead measures on as its warm-up
does, until its tokens per step tell the modes apart (at least ``warmup`` sequences' steps: as many steps at batch
1, one from batch ``warmup`` on), and the try's cost is every one of its steps' time beyond plain decoding's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Self

from pydantic import ConfigDict, Field, model_validator

from specserve.validated import Validated

MIN_STEP_S = 1e-9  # the shortest step time recorded


@dataclass(frozen=True)
class Outlook:
    """A step's batch as the guard weighs a switch to speculation: what the draft must read first, and how much
    the batch can still emit for it to pay that back."""

    draft_missed: int  # tokens the draft would read before drafting (after plain steps; prompts it never saw)
    horizon: int  # tokens the sequences may still emit (max_tokens, the context limit), summed over the batch


def bucket(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, 8, ...)."""
    return 1 << (batch_size - 1).bit_length()


class GuardConfig(Validated):
    """The guard's settings (the module docstring says what each does)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # steps of a bucket between tries of the slower mode, doubling up to ``max_explore_every`` while the tries
    # confirm the choice (back to the start when one flips it; one above the max stays where it starts): a try
    # costs a slow step, and after plain steps the draft first re-reads what it missed
    explore_every: int = Field(default=20, ge=1)
    max_explore_every: int = Field(default=640, ge=1)
    # steps a try's cost may space the next one by at most: a try measured while the host was swamped (two other
    # processes on the 2-core Zen 3 made speculative steps at batch 1 take 1.1-1.2 s against ~30 ms) had put the
    # next ~9000 steps away, plain decoding long after the host recovered; the costliest honest try measured, a
    # 4-bit draft model's catch-up of ~35 plain steps, costs 1.4% at this cap
    max_try_spacing: int = Field(default=2560, ge=1)
    # weight of the newest step in the moving averages of step time ...
    smoothing: float = Field(default=0.3, gt=0, le=1)
    # ... and of tokens per step (after a plain mean of the first 1 / this steps): an acceptance statistic, 1-4
    # tokens from one step to the next at batch 1 (at 0.3 two short steps in a row took the head's 2.1-token average
    # below break-even)
    token_smoothing: float = Field(default=0.05, gt=0, le=1)
    # steps of each mode per bucket before the first decision (they start the averages), and of speculation at most
    # ``max_warmup``, while its tokens per step lie within ``warmup_z`` standard errors of break-even
    warmup: int = Field(default=3, ge=1)
    max_warmup: int = Field(default=12, ge=1)
    warmup_z: float = Field(default=1.0, ge=0)
    # a try (switch step + its measured step's excess) costs at most this share of the plain time before the next
    # (at 3% the guarded EAGLE head measured 0.96-0.99x plain at batch 16, where plain decoding wins; at 1.5% its
    # batch-4 tries still cost 1.4-1.7% of each run of the straggler sweep, half of what a bar of 0.97 leaves)
    explore_cost: float = Field(default=0.0075, gt=0, le=1)
    # a running mode's step counts as at most this many times its average step time
    outlier_clip: float = Field(default=2.0, ge=1)
    # switch: a try of speculation measures on as its warm-up does (its mean tokens and median seconds over steps
    # until they tell the modes apart, up to ``max_warmup``), not one step whose time replaces speculation's
    # average. Off: at batch 1 one-step tries kept an EAGLE head 1.08x faster than plain decoding in plain steps
    # half the time, but in alternating straggler sweeps the guard did no better with it (docs/benchmarks.md, "The
    # guard's tries measured as its warm-up")
    measured_tries: bool = False
    # hysteresis: the mode the bucket's last decision did not choose must measure this much faster to take over
    # (each switch to speculation costs a catch-up; near break-even, step-time drift on a shared host flipped the
    # choice every few steps: docs/benchmarks.md, "The guard near break-even")
    margin: float = Field(default=0.05, ge=0, lt=1)
    # switch: after the running mode's own step flips the choice, the first measured step of the mode it flips to
    # replaces that mode's step time, as a try's does (that average is as old as the mode's last run); from batch
    # ``warmup`` on, where one step averages over that many sequences (at batch 1 one step's time follows its own
    # acceptance)
    refresh_on_flip: bool = True
    # switch: speculation's average step time counts as moved by as much as plain decoding's average moved since
    # speculation last ran beside it, in a try or its warm-up (``follow_drift``): a plain step's work is fixed per
    # sequence, so its average follows the host. Off, a host drifting slower made speculation's old time look faster
    # at batch 32, where it ran ~16% slower: a switch step and a measured step, a few times a run
    follow_drift: bool = False
    # ... once this many tries of speculation in a row confirmed plain decoding: a try that happened to measure
    # speculation slow is then not held against it while the host drifts (at 0, where speculation won by 10-30%, the
    # replay lost 0.1-2.2 points: the drift-made flips were also the guard's quickest way back to speculation)
    drift_after_tries: int = Field(default=2, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.warmup > self.max_warmup:
            raise ValueError(f"warmup must be 1 to max_warmup ({self.max_warmup}) steps per mode, got {self.warmup}")
        if self.max_try_spacing < self.max_explore_every:
            spacing, every = self.max_try_spacing, self.max_explore_every
            raise ValueError(f"max_try_spacing ({spacing}) must be at least max_explore_every ({every})")
        return self


@dataclass
class ThroughputGuard:
    cfg: GuardConfig = field(default_factory=GuardConfig)
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # (bucket, speculative) -> tokens/s/seq
    samples: dict[tuple[int, bool], int] = field(default_factory=dict)  # (bucket, speculative) -> steps measured
    intervals: dict[int, int] = field(default_factory=dict)  # current exploration interval per bucket
    next_try: dict[int, int] = field(default_factory=dict)  # step count of the bucket's next exploration
    work: dict[tuple[int, bool], tuple[float, float]] = field(default_factory=dict)  # -> avg (tokens/seq, s) a step
    warm: dict[tuple[int, bool], list[tuple[float, float]]] = field(default_factory=dict)  # the steps of warm-ups
    # in progress (a mode's warm-up is over once it has ``warmup`` samples and no entry here)
    switch_s: dict[int, float] = field(default_factory=dict)  # bucket -> cost of its last try of speculation: the
    # switch step's time plus what its measured step took beyond plain decoding's time for the same tokens
    catch_up_s: dict[int, float] = field(default_factory=dict)  # bucket -> its switch step not yet in a try's cost
    deferred: set[int] = field(default_factory=set)  # buckets whose last answer was plain decoding only because
    # the catch-up would not pay: their plain steps are measurements, not tries of plain decoding
    deferred_since: dict[int, int] = field(default_factory=dict)  # bucket -> its step count when that began
    overdue: set[int] = field(default_factory=set)  # buckets whose switch ran though it would not pay, deferred
    # ``max_try_spacing`` steps: its catch-up's cost replaces the estimate that had kept it from paying
    chosen: dict[int, bool] = field(default_factory=dict)  # bucket -> the mode its last recorded step was planned in
    # the mode the last recorded step of any bucket was planned in: how far the draft fell behind depends on the
    # steps that ran, whatever their batch size (a switch is the speculative step after plain ones, of any bucket)
    last_planned: bool = False
    catch_up_work: tuple[float, float] | None = None  # avg (tokens re-read, seconds beyond a measured step) of a
    # catch-up: their ratio weighs each by its size (a catch-up of 3 tokens costs about a step, nothing per token)
    trying: set[int] = field(default_factory=set)  # buckets whose try of speculation is measuring on
    # (``measured_tries``): its steps are a warm-up of speculation, their cost the try's
    held: dict[int, bool] = field(default_factory=dict)  # bucket -> the mode its last decision chose (``margin``)
    stale: set[tuple[int, bool]] = field(default_factory=set)  # (bucket, mode) whose next measured step replaces
    # its step time (``refresh_on_flip``)
    drift_base: dict[int, float] = field(default_factory=dict)  # bucket -> plain decoding's average step time when
    # speculation's average was measured beside it (``follow_drift``; absent: no drift to follow)
    confirmed_plain: dict[int, int] = field(default_factory=dict)  # bucket -> tries of speculation in a row that
    # confirmed plain decoding

    @property
    def steps(self) -> dict[int, int]:
        """Steps measured per bucket, both modes."""
        return {b: self._steps(b) for b, _ in self.samples}

    @property
    def plain_step_s(self) -> dict[int, float]:
        """Average time of a plain step per bucket."""
        return {b: sec for (b, spec), (_, sec) in self.work.items() if not spec}

    @property
    def missed_token_s(self) -> float | None:
        """A catch-up's seconds per token the draft re-reads (None: no catch-up measured yet)."""
        if self.catch_up_work is None:
            return None
        tok, sec = self.catch_up_work
        return sec / tok

    def _steps(self, b: int) -> int:
        return self.samples.get((b, True), 0) + self.samples.get((b, False), 0)

    def faster(self, batch_size: int) -> bool | None:
        """Whether speculation measured faster at this batch size (None: either mode not yet warmed up)."""
        b = bucket(batch_size)
        if not (self._warmed((b, True)) and self._warmed((b, False))):
            return None
        spec, plain = self._spec_rate(b), self.rates[(b, False)]
        held = self.held.get(b)  # the mode the bucket's last decision chose: the other must beat it by ``margin``
        if held is None:
            return spec >= plain
        return spec * (1 + self.cfg.margin) >= plain if held else spec >= plain * (1 + self.cfg.margin)

    def _spec_rate(self, b: int) -> float:
        """Speculation's rate in bucket ``b``; with ``follow_drift``, its step time scaled by plain decoding's drift
        since speculation last ran (1 while speculation runs: plain decoding's average stands still then)."""
        rate = self.rates[(b, True)]
        base, plain = self.drift_base.get(b), self.work.get((b, False))  # (kept only with ``follow_drift``)
        if base is None or plain is None:
            return rate
        return rate * base / max(plain[1], MIN_STEP_S)

    def _warmed(self, key: tuple[int, bool]) -> bool:
        """Whether a (bucket, speculative) mode's warm-up is over (``warm`` holds the steps of one in progress)."""
        return self.samples.get(key, 0) >= self.cfg.warmup and key not in self.warm

    def _warm_over(self, b: int, speculative: bool) -> bool:
        """Whether a mode's warm-up in bucket ``b`` ends with the steps it has: ``warmup`` steps, and for speculation
        then until its mean tokens per step lies ``warmup_z`` standard errors from break-even with plain decoding
        (the tokens a step of its median time must emit to match plain's rate), or ``max_warmup`` steps."""
        steps = self.warm[(b, speculative)]
        n = len(steps)
        trying = speculative and b in self.trying  # a try (``measured_tries``) takes ``warmup`` sequences' steps at
        # least, as many steps at batch 1, one from batch ``warmup`` on (where one step of a large batch decided)
        if n < (max(1, math.ceil(self.cfg.warmup / b)) if trying else self.cfg.warmup):
            return False
        plain = self.work.get((b, False))  # (absent where a guard's rates were seeded from outside)
        if not speculative or n >= self.cfg.max_warmup or not self._warmed((b, False)) or plain is None:
            return True
        tokens = [t for t, _ in steps]
        plain_tok, plain_s = plain
        even = plain_tok / plain_s * statistics.median(sec for _, sec in steps)
        # a step's tokens per sequence vary by at least half a token at batch 1 (its first draft token taken or not),
        # by 1/sqrt(b) of that over b sequences: three equal steps do not make a certainty
        spread = max(statistics.stdev(tokens) if n > 1 else 0.0, 0.5 / math.sqrt(b)) / math.sqrt(n)
        return abs(statistics.fmean(tokens) - even) >= self.cfg.warmup_z * spread

    def speculate(self, batch_size: int, *, measured: bool = True, outlook: Outlook | None = None) -> bool:
        """The mode of the next step. ``measured=False``: a step the loop will not record (it admits a prompt):
        it runs the mode measured faster, or plain decoding before the first decision, and never starts a try
        (a try's step would go unrecorded, so every such step until a recorded one would run the slower mode).
        ``outlook``: speculation that must first catch the draft up happens only if the batch's remaining tokens
        can pay for that (``switch_pays``); a try put off stays due."""
        b = bucket(batch_size)
        better = self.faster(batch_size)
        if better is None:  # measure plain decoding first (it needs no draft prefill), then speculation
            go, hold = measured and self.samples.get((b, False), 0) >= self.cfg.warmup, False
        else:
            explore = measured and self._steps(b) >= self.next_try.get(b, self.cfg.explore_every - 1)
            go = better != explore
            hold = better and explore and b in self.deferred  # a try of plain decoding due while speculation waits
            # for a catch-up that pays: plain decoding runs anyway, measured, so the try is moot until it pays
        if (go or hold) and outlook is not None and not self.switch_pays(batch_size, outlook, expected=better is True):
            # put off for at most ``max_try_spacing`` steps: the catch-up's cost is measured only where one runs, so
            # an estimate too high (one slow first catch-up of a few tokens) would otherwise put it off for ever
            waited = self._steps(b) - self.deferred_since.setdefault(b, self._steps(b))
            if not measured or waited < self.cfg.max_try_spacing:  # (a step not recorded measures no catch-up)
                self.deferred.add(b)
                if better and self._spec_rate(b) < self.rates[(b, False)]:  # held within the margin but slower:
                    # with a catch-up due, plain decoding takes the hold (else each plain step's drift would flip it)
                    self.held[b] = False
                return False
            # overdue: the switch runs, its catch-up measured afresh; a try of plain decoding due meanwhile is spent
            # (the plain steps run while it waited measured plain decoding)
            self.overdue.add(b)
            if hold:
                self.next_try[b] = self._steps(b) + self.intervals.get(b, self.cfg.explore_every)
            go = True
        if not (measured or go):  # a step not recorded (an admission) considers no try: one put off stays put off,
            # its wait counted on (cleared here, steady admissions had kept an overdue try from ever running)
            return go
        self.deferred.discard(b)
        self.deferred_since.pop(b, None)
        return go

    def switch_pays(self, batch_size: int, outlook: Outlook, *, expected: bool) -> bool:
        """Whether the time the batch's remaining tokens would save by speculating exceeds the draft's catch-up
        (its measured seconds per re-read token x the tokens it missed). ``expected``: the saving at the two modes'
        measured rates; otherwise (a try, a first measurement) the most any speculation could save, all of plain
        decoding's time. True while the catch-up's cost or plain decoding's rate is unmeasured."""
        b = bucket(batch_size)
        plain_rate = self.rates.get((b, False), 0.0)  # tokens/s per sequence
        if outlook.draft_missed <= 0 or self.missed_token_s is None or plain_rate <= 0:
            return True
        per_seq = outlook.horizon / batch_size  # a step advances every sequence of the batch
        saved = per_seq / plain_rate
        spec_rate = self._spec_rate(b) if (b, True) in self.rates else 0.0
        if expected and spec_rate > 0:
            saved -= per_seq / spec_rate
        return saved > outlook.draft_missed * self.missed_token_s

    def record(
        self,
        batch_size: int,
        speculative: bool,
        tokens: int,
        seconds: float,
        *,
        caught_up_tokens: int = 0,
        planned: bool | None = None,
    ) -> None:
        """One step. ``caught_up_tokens`` > 0: a catch-up, the draft first re-read that many tokens it had missed.
        ``planned``: the mode the step was planned in (None: ``speculative``). A step planned to speculate whose
        drafters found nothing ran as a plain step: measured as one, but not a try of plain decoding."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a step's seconds must be finite and non-negative, got {seconds}")
        seconds = max(seconds, MIN_STEP_S)  # a coarse clock's 0: a zero average would clip every later step to 0
        b = bucket(batch_size)
        if not (speculative and caught_up_tokens > 0):  # the overdue switch ran no catch-up (no drafts, no room):
            self.overdue.discard(b)  # a later one is blended as usual
        if speculative and caught_up_tokens > 0:  # the draft re-reading what it missed. For the catch-up rate: its
            # time beyond what a measured speculative step of the bucket takes (before the first, a plain one: the
            # catch-up that begins speculation's warm-up)
            base = self.work.get((b, True)) or self.work.get((b, False)) or (0.0, 0.0)
            new = (float(caught_up_tokens), max(0.0, seconds - base[1]))
            tok, sec = new if b in self.overdue else self.catch_up_work or new
            self.overdue.discard(b)
            self.catch_up_work = (tok + self.cfg.smoothing * (new[0] - tok), sec + self.cfg.smoothing * (new[1] - sec))
            if not self.last_planned:  # after steps planned plain, a switch: not speculation's rate (module
                # docstring); it costs its time beyond plain decoding's for the tokens it emitted (the whole step
                # while plain decoding is unmeasured), and the steps after it are speculation's own
                switch = self.catch_up_s[b] = self._excess_over_plain(
                    b, (tokens / batch_size, seconds), unmeasured=seconds
                )
                if self.faster(batch_size) is None:  # the warm-up's start: spaces the first try if the warm-up
                    # chooses plain. Any other switch is a try's (which takes it up) or a return to the faster
                    # speculation (forgotten): ``switch_s`` stays the last try's cost
                    self.switch_s[b] = switch
                self.chosen[b] = self.last_planned = True
                return
            # within speculation (rows a step's token budget left undrafted for a few steps, a draft worker attached
            # afresh, the draft model after model-free drafts) the catch-up is part of what speculating costs here:
            # measured as speculation's step (not a switch, which would space the tries by what no try costs)
        before = self.faster(batch_size)
        chosen = self.chosen[b] = self.last_planned = speculative if planned is None else planned
        # a try ran the mode it was planned in: a try of speculation whose drafters found nothing was a plain step,
        # measured as one, and the try stays due
        tried = (
            before is not None
            and chosen != before
            and speculative == chosen
            and not (b in self.deferred and not chosen)
        )
        if speculative and not tried:  # a switch step's cost belongs to the try right after it; a switch no try
            # followed (the warm-up's start, a return to the faster speculation) has been paid for, not by a later try
            self.catch_up_s.pop(b, None)
        key = (b, speculative)
        step = (tokens / batch_size, seconds)  # per sequence: a bucket spans batch sizes b/2+1..b
        n = self.samples[key] = self.samples.get(key, 0) + 1
        if tried and speculative and self.cfg.measured_tries:  # a try of speculation: measured on as its warm-up
            self.warm[key], self.switch_s[b] = [], self.catch_up_s.pop(b, 0.0)
            self.trying.add(b)
        try_step = speculative and b in self.trying
        blended = False  # the step moved its mode's average (not started or replaced it)
        if key in self.warm or n <= self.cfg.warmup:  # the warm-up's mean tokens and median seconds start the
            # averages: one slow first step does not set them
            steps = self.warm.setdefault(key, [])
            steps.append(step)
            self.work[key] = (statistics.fmean(t for t, _ in steps), statistics.median(sec for _, sec in steps))
            if try_step:  # what the try costs beyond plain decoding spaces the next one (with its switch step)
                self.switch_s[b] += self._excess_over_plain(b, step)
            if self._warm_over(b, speculative):
                del self.warm[key]
                if try_step:  # the try is over: decided as a one-step try is, below
                    self.trying.discard(b)
                    before, tried = False, True
        elif tried:  # a try: the mode's step time is as old as its last run,
            if speculative:  # what the try cost beyond plain decoding spaces the next one (with its switch step)
                self.switch_s[b] = self.catch_up_s.pop(b, 0.0) + self._excess_over_plain(b, step)
            # so the fresh step's time replaces it (blended, one stale slow step would outlive tries); its tokens per
            # step, an acceptance statistic that one step estimates poorly, are blended as usual
            tok, _ = self.work.get(key, step)
            self.work[key] = (tok + self._token_weight(n) * (step[0] - tok), step[1])
        elif key in self.stale:  # the first step of the mode a flip took up: its time replaces the old average as
            # a try's does, up to ``outlier_clip`` times that average (a pause stays a pause); not a try's cost
            tok, sec = self.work.get(key, step)
            self.work[key] = (tok + self._token_weight(n) * (step[0] - tok), min(step[1], self.cfg.outlier_clip * sec))
        else:  # moving averages of tokens and of seconds per step: their ratio weighs a slow step by its time,
            # up to ``outlier_clip`` times the average (a GC pause or another process's burst, 6x a step, would
            # flip the choice for several steps; a real slowdown still moves the average within a few steps)
            tok, sec = self.work.get(key, step)  # (rates seeded from outside start from this step)
            seconds = min(step[1], self.cfg.outlier_clip * sec)
            self.work[key] = (tok + self._token_weight(n) * (step[0] - tok), sec + self.cfg.smoothing * (seconds - sec))
            blended = True
        self.stale.discard(key)
        tok, sec = self.work[key]
        self.rates[key] = tok / max(sec, 1e-9)
        if self.cfg.follow_drift:
            self._note_drift_base(b, speculative, blended)
        if b in self.trying:  # a try measuring on decides nothing yet
            return
        if before is None and self.faster(batch_size) is False:  # the warm-up chose plain: space the first try
            self.next_try[b] = max(self.cfg.explore_every, self._steps(b) + self._amortising_steps(b)) - 1
        after = self.faster(batch_size)
        if before is None and after:  # the warm-up chose speculation: its start's catch-up (whole prompts) is no
            # try's cost, and would space the re-check after a flip by it
            self.switch_s.pop(b, None)
        if tried:  # that was a try of the slower mode
            interval = self.intervals.get(b, self.cfg.explore_every)
            most = max(self.cfg.explore_every, self.cfg.max_explore_every)  # (never below where it starts)
            interval = self.cfg.explore_every if after != before else min(2 * interval, most)
            self.intervals[b] = interval
            self.next_try[b] = self._steps(b) + max(interval, self._amortising_steps(b) if not after else 0) - 1
        elif before is not None and after != before:  # the running mode's own step flipped the choice (the host
            # slowed it): the other mode's average is old, so re-check the mode just left soon, plain after
            # ``warmup`` steps, speculation once its switch is amortised
            self.intervals[b] = self.cfg.explore_every
            self.next_try[b] = self._steps(b) + (self.cfg.warmup if after else max(1, self._amortising_steps(b))) - 1
            if self.cfg.refresh_on_flip and b >= self.cfg.warmup and after != speculative:  # (plain steps run while
                # speculation held, deferred, that flip the choice to plain: plain's average is fresh)
                self.stale.add((b, bool(after)))
        if after is not None:
            self.held[b] = after
        if self.cfg.follow_drift:  # drift is followed once enough tries in a row confirmed plain decoding
            if after:
                self.confirmed_plain.pop(b, None)
            elif tried and speculative:
                self.confirmed_plain[b] = self.confirmed_plain.get(b, 0) + 1
            if self.confirmed_plain.get(b, 0) < self.cfg.drift_after_tries:
                self.drift_base.pop(b, None)

    def _note_drift_base(self, b: int, speculative: bool, blended: bool) -> None:
        """``follow_drift``: after a step of bucket ``b``, the plain average speculation's time is as of, if any."""
        plain = self.work.get((b, False))
        if speculative and not self.held.get(b, False) and plain is not None:  # a try (or the warm-up) of
            # speculation while plain decoding runs: its time is as of plain decoding's average now
            self.drift_base[b] = plain[1]
        elif speculative or not blended:  # speculation running, or plain decoding's average replaced (a try, a
            # flip's refresh): no drift to follow until speculation's next try
            self.drift_base.pop(b, None)

    def _token_weight(self, n: int) -> float:
        """Weight of the n-th measured step in its mode's tokens-per-step average: 1 / n, a plain mean of the steps
        so far (the warm-up's among them), until ``token_smoothing`` takes over (a moving average
        from the warm-up's median alone would need ~1 / token_smoothing steps to leave it: the 4-bit copy's 9-token
        start against its ~12-token mean)."""
        return max(self.cfg.token_smoothing, 1.0 / n)

    def _excess_over_plain(self, b: int, step: tuple[float, float], *, unmeasured: float = 0.0) -> float:
        """Seconds a (tokens per sequence, seconds) step took beyond plain decoding's average for those tokens
        (``unmeasured`` while plain decoding has no average in the bucket)."""
        plain_tok, plain_s = self.work.get((b, False), (0.0, 0.0))
        if plain_tok <= 0:
            return unmeasured
        return max(0.0, step[1] - step[0] / plain_tok * plain_s)

    def _amortising_steps(self, b: int) -> int:
        """Plain steps of bucket ``b`` that make its last try's cost ``explore_cost`` of the time between tries (at
        most ``max_try_spacing``)."""
        step_s = self.plain_step_s.get(b, 0.0)
        if b not in self.switch_s or step_s <= 0:
            return 0
        # (bounded before the ceil: a tiny explore_cost makes the quotient infinite)
        return math.ceil(min(float(self.cfg.max_try_spacing), self.switch_s[b] / (self.cfg.explore_cost * step_s)))
