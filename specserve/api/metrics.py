"""Prometheus metrics of one router replica, in a registry of its own (``GET /metrics``).

Fed by the HTTP layer (requests, TTFT/TPOT, tokens, per-request acceptance) and by the lanes from the StepLoop's
per-step StepMetrics (batch, queue, step time, drafted depth per sequence, the last step's SL_cap and straggler
idle fraction, 0 where it capped or drafted nothing) and worker restarts.
"""

from __future__ import annotations

from enum import Enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.sequence import RequestOutput
from specserve.step_events import StepMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
DEPTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class RequestStatus(str, Enum):
    ok = "ok"
    invalid = "invalid"  # 4xx for bad input
    rejected = "rejected"  # 429: queue full
    aborted = "aborted"  # the client went away
    failed = "failed"  # 5xx


class LoadEstimate:
    """How long a request turned away now would wait for a batch slot, for a 429's Retry-After.

    The ``queued`` requests ahead of it, and one more, must finish first; the replica's ``slots`` (lanes x batch)
    finish ``slots / (steps_per_request * step_s)`` requests a second. Both rates are measured (exponential moving
    averages of lane step times and of finished requests' target forwards); None until both were seen.
    """

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight  # of the newest observation
        self.step_s: float | None = None
        self.steps_per_request: float | None = None

    def observe_step(self, step_s: float) -> None:
        self.step_s = self._average(self.step_s, step_s)

    def observe_request(self, steps: int) -> None:
        self.steps_per_request = self._average(self.steps_per_request, float(max(1, steps)))

    def wait_s(self, *, queued: int, slots: int) -> float | None:
        if self.step_s is None or self.steps_per_request is None:
            return None
        return (queued + 1) * self.steps_per_request * self.step_s / max(1, slots)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)


class ServeMetrics:
    def __init__(self) -> None:
        self.load = LoadEstimate()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specserve_requests",
            "Finished HTTP generation requests (each choice of an admitted one)",
            ["status"],
            registry=r,
        )
        self.running = Gauge("specserve_running_sequences", "Sequences in the lane's batch", ["lane"], registry=r)
        self.queue_depth = Gauge("specserve_queue_depth", "Requests waiting for a batch slot", ["lane"], registry=r)
        self.ttft = Histogram(
            "specserve_time_to_first_token_seconds",
            "Arrival to first token sent, of every request that got one (a resumed stream: after its replay)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "specserve_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specserve_prompt_tokens",
            "Prompt tokens of requests that got output (finished, aborted or failed), per choice: n choices, n times",
            registry=r,
        )
        self.generation_tokens = Counter(
            "specserve_generation_tokens",
            "Generated tokens delivered, also to requests aborted or failed after them (a resume's replay again)",
            registry=r,
        )
        self.target_forwards = Counter(
            "specserve_target_forwards", "Verification steps, summed over sequences", registry=r
        )
        self.drafted = Counter("specserve_draft_tokens", "Drafted tokens sent for verification", registry=r)
        self.accepted = Counter("specserve_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.acceptance_rate = Histogram(
            "specserve_request_acceptance_rate", "Accepted / drafted, per request", buckets=RATE_BUCKETS, registry=r
        )
        self.mean_accepted_length = Histogram(
            "specserve_request_mean_accepted_length",
            "tau: tokens per target forward incl. the bonus token, per request",
            buckets=TAU_BUCKETS,
            registry=r,
        )
        self.speculation_length = Histogram(
            "specserve_speculation_length",
            "Draft depth (SL) per drafting sequence per step",
            ["lane"],
            buckets=DEPTH_BUCKETS,
            registry=r,
        )
        self.sl_cap = Gauge(
            "specserve_sl_cap", "Batch-wide speculation length cap SL_cap, last step (0: none)", ["lane"], registry=r
        )
        self.idle_fraction = Gauge(
            "specserve_straggler_idle_fraction",
            "Fraction of drafted levels a sequence waits for longer drafts in its batch, last step (0: none drafted)",
            ["lane"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "specserve_step_seconds", "Wall time of one lane step", ["lane"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "specserve_batch_size", "Sequences per lane step", ["lane"], buckets=BATCH_BUCKETS, registry=r
        )
        self.worker_restarts = Counter(
            "specserve_worker_restarts",
            "Replacement worker actors made after one died (each try, started or not)",
            ["lane", "role"],
            registry=r,
        )
        self.draft_lost = Gauge(
            "specserve_draft_lost",
            "1 while the lane decodes plainly until its lost draft worker is back",
            ["lane"],
            registry=r,
        )
        self.failovers = Counter(
            "specserve_request_failovers",
            "Requests sent on to another lane after theirs lost or was replacing its workers, or stopped, by that lane",
            ["lane"],
            registry=r,
        )
        self.rebalanced = Counter(
            "specserve_requests_rebalanced",
            "Requests that waited for a slot on a full lane, moved to a lane with one free, by the full lane",
            ["lane"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- HTTP layer -------------------------------------------------------------------------------------
    def request_done(self, status: RequestStatus) -> None:
        self.requests.labels(status.value).inc()

    def request_finished(self, out: RequestOutput, *, ttft_s: float | None, tpot_s: float | None) -> None:
        self.load.observe_request(out.stats.target_forwards)
        self._work(out, ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if out.stats.drafted:
            self.acceptance_rate.observe(out.stats.acceptance_rate)
            self.mean_accepted_length.observe(out.stats.tokens_per_forward)
        self.request_done(RequestStatus.ok)  # last: a scrape that sees the request counted sees its work

    def request_unfinished(self, status: RequestStatus, last: RequestOutput | None, *, ttft_s: float | None) -> None:
        """A request that ended aborted or failed after it was admitted: its status, and the work it had done by
        its ``last`` output (None: none came), so that the token counters and the TTFT histogram also hold the
        requests clients gave up on; its tokens are those delivered by ``last``, not any generated after it and
        dropped with the request. The per-request histograms (TPOT, acceptance, tau) keep finished requests."""
        if last is not None:
            self._work(last, ttft_s)
        self.request_done(status)  # last: a scrape that sees the request counted sees its work

    def _work(self, out: RequestOutput, ttft_s: float | None) -> None:
        """``out``: a request's latest output (its totals so far)."""
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.target_forwards.inc(out.stats.target_forwards)
        if out.stats.drafted:
            self.drafted.inc(out.stats.drafted)
            self.accepted.inc(out.stats.accepted)

    # -- lanes ------------------------------------------------------------------------------------------
    def lane_step(self, lane: int, step: StepMetrics, *, running: int, waiting: int, step_s: float) -> None:
        """One lane step as the StepLoop recorded it; ``running`` / ``waiting`` after it retired and admitted."""
        label = str(lane)
        self.running.labels(label).set(running)
        self.queue_depth.labels(label).set(waiting)
        self.step_seconds.labels(label).observe(step_s)
        self.load.observe_step(step_s)
        self.batch_size.labels(label).observe(step.batch_size)
        histogram = self.speculation_length.labels(label)
        for depth in step.depths:
            if depth > 0:
                histogram.observe(depth)
        # the last step's: a value kept from the last DSDE step read as the cap of plain decoding that followed it
        self.sl_cap.labels(label).set(step.cap or 0)
        self.idle_fraction.labels(label).set(step.idle_fraction if step.levels > 0 else 0.0)

    def lane_queue(self, lane: int, *, running: int, waiting: int) -> None:
        self.running.labels(str(lane)).set(running)
        self.queue_depth.labels(str(lane)).set(waiting)

    def worker_restarted(self, lane: int, role: str) -> None:
        self.worker_restarts.labels(str(lane), role).inc()

    def draft_detached(self, lane: int, lost: bool) -> None:
        self.draft_lost.labels(str(lane)).set(int(lost))

    def request_failed_over(self, lane: int) -> None:
        self.failovers.labels(str(lane)).inc()

    def request_rebalanced(self, lane: int) -> None:
        self.rebalanced.labels(str(lane)).inc()
