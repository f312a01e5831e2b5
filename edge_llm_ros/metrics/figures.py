"""The one source of llm_node's goal figures: counts by outcome and reason, and histograms.

The node calls `FigureRecorder.goal_ended` once per finished goal (or ~/complete call) and
`goal_rejected` / `invalid_request` once per refusal: O(1) work under a lock, never per token.
/diagnostics (nodes/diagnostics.py) and /metrics (metrics/exporter.py) read `snapshot()`,
so both report the same numbers. Gauges that are cheap to read (queue, KV, RSS, temperature)
are not stored here: the node builds a `Gauges` when one is asked for (timer or scrape).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
import math
import threading
from typing import Dict, Optional, Sequence, Tuple

from edge_llm_ros.runtime.types import GenerationResult, StopReason

# Action outcomes (the goal's terminal status, or a refusal before acceptance).
SUCCEEDED = 'succeeded'
CANCELED = 'canceled'
ABORTED = 'aborted'
REJECTED = 'rejected'
OUTCOMES = (SUCCEEDED, CANCELED, ABORTED, REJECTED)
# Reasons of a rejection: Generate.Result.ERROR_UNAVAILABLE / ERROR_QUEUE_FULL's values.
REJECTED_NOT_ACTIVE = 'unavailable'
REJECTED_QUEUE_FULL = 'queue_full'

# Bucket upper bounds, chosen for language models on edge boards (docs/metrics.md): a
# 135M model on a desktop CPU answers in tens of ms, a 7B one on a Raspberry Pi in seconds.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DECODE_TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0,
                        120.0)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Observations per bucket (`counts[i]` <= bounds[i]; the last one is +Inf) and their sum."""

    bounds: Tuple[float, ...]
    counts: Tuple[int, ...]
    total: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> Tuple[Tuple[float, int], ...]:
        """(upper bound, observations <= it) pairs, +Inf last: Prometheus' `le` buckets."""
        out, running = [], 0
        for bound, count in zip(self.bounds + (math.inf,), self.counts):
            running += count
            out.append((bound, running))
        return tuple(out)

    def quantile(self, q: float) -> Optional[float]:
        """Estimate the q-quantile as PromQL's histogram_quantile does (None: no data).

        Linear inside the bucket that holds the rank; the lowest bucket starts at 0; a rank
        in the +Inf bucket answers the highest finite bound.
        """
        total = self.count
        if not total:
            return None
        rank = q * total
        lower, below = 0.0, 0
        for bound, seen in self.cumulative():
            if seen >= rank and seen > below:
                if math.isinf(bound):
                    return self.bounds[-1] if self.bounds else None
                return lower + (bound - lower) * (rank - below) / (seen - below)
            lower, below = bound, seen
        return lower


class _Histogram:
    """Fixed buckets; not thread-safe (FigureRecorder holds its lock)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f'bucket bounds must be strictly increasing, got {bounds}')
        self._bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self._bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le = less or equal).
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self._bounds, tuple(self._counts), self._total)


@dataclass(frozen=True)
class Figures:
    """A consistent copy of everything the recorder holds."""

    goals: Dict[Tuple[str, str], int]      # (outcome, reason) -> count
    invalid_requests: int
    ttft_s: HistogramSnapshot
    decode_tps: HistogramSnapshot
    queue_wait_s: HistogramSnapshot
    duration_s: HistogramSnapshot
    last_ttft_s: float = 0.0
    last_decode_tps: float = 0.0
    # Speculative decoding totals over ended goals (docs/speculative.md).
    draft_passes: int = 0        # verify passes
    draft_tokens: int = 0        # drafted tokens fed to them
    accepted_draft_tokens: int = 0
    decode_steps: int = 0        # model calls after the prompts (plain steps + verify passes)
    decode_tokens: int = 0       # tokens those calls produced

    @property
    def acceptance_rate(self) -> float:
        """Return accepted / drafted tokens (0 before any draft)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Return tokens per decode model call (1.0 without speculation; 0 before any)."""
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def outcome_count(self, outcome: str, reason: str = '') -> int:
        """Goals that ended with `outcome` (and `reason` when given)."""
        return sum(n for (o, r), n in self.goals.items()
                   if o == outcome and (not reason or r == reason))


class FigureRecorder:
    """Thread-safe; lives as long as the node (counts survive configure/cleanup)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._goals: Dict[Tuple[str, str], int] = {}
        self._invalid = 0
        self._ttft = _Histogram(TTFT_BUCKETS_S)
        self._decode = _Histogram(DECODE_TPS_BUCKETS)
        self._queue_wait = _Histogram(QUEUE_WAIT_BUCKETS_S)
        self._duration = _Histogram(DURATION_BUCKETS_S)
        self._last_ttft = 0.0
        self._last_decode = 0.0
        self._spec = [0, 0, 0, 0, 0]   # Figures.draft_passes .. decode_tokens

    def goal_ended(self, outcome: str, reason: str, result: GenerationResult,
                   duration_s: float, queued: bool) -> None:
        """Record one accepted request's end.

        :param outcome: SUCCEEDED, CANCELED or ABORTED (the goal's terminal status).
        :param reason: its finish reason when it did not fail (stop, length, tool_calls,
            cancelled), else its error kind (invalid_request, unavailable, failed).
        :param duration_s: accepted -> terminal (end-to-end, as the node saw it).
        :param queued: it reached the worker's queue, so its queue wait is known.
        """
        if outcome not in (SUCCEEDED, CANCELED, ABORTED):
            raise ValueError(f'goal_ended: outcome {outcome!r} is not one of '
                             f'{SUCCEEDED}, {CANCELED}, {ABORTED}')
        timings = result.timings
        produced = result.completion_tokens > 0 and result.stop_reason is not StopReason.ERROR
        decode = timings.decode_tokens_per_second
        with self._lock:
            key = (outcome, reason)
            self._goals[key] = self._goals.get(key, 0) + 1
            self._duration.observe(duration_s)
            if queued:
                self._queue_wait.observe(timings.queue_wait_s)
            if timings.decode_steps:
                for i, v in enumerate((timings.draft_passes, timings.draft_tokens,
                                       timings.accepted_draft_tokens, timings.decode_steps,
                                       result.completion_tokens - 1)):
                    self._spec[i] += v
            if produced:
                self._ttft.observe(timings.time_to_first_token_s)
                self._last_ttft = timings.time_to_first_token_s
                if decode > 0.0:   # needs two tokens: one-token goals have no decode rate
                    self._decode.observe(decode)
                    self._last_decode = decode

    def goal_rejected(self, reason: str) -> None:
        """Count a request refused before acceptance (reason: unavailable or queue_full)."""
        with self._lock:
            key = (REJECTED, reason)
            self._goals[key] = self._goals.get(key, 0) + 1

    def invalid_request(self) -> None:
        """Count a request (any interface) refused for what it asked (llm_node._refusal)."""
        with self._lock:
            self._invalid += 1

    def snapshot(self) -> Figures:
        with self._lock:
            return Figures(goals=dict(self._goals), invalid_requests=self._invalid,
                           ttft_s=self._ttft.snapshot(), decode_tps=self._decode.snapshot(),
                           queue_wait_s=self._queue_wait.snapshot(),
                           duration_s=self._duration.snapshot(), last_ttft_s=self._last_ttft,
                           last_decode_tps=self._last_decode, draft_passes=self._spec[0],
                           draft_tokens=self._spec[1], accepted_draft_tokens=self._spec[2],
                           decode_steps=self._spec[3], decode_tokens=self._spec[4])


@dataclass(frozen=True)
class Gauges:
    """Figures read when asked (diagnostics timer, scrape), never on the decode path."""

    queue_waiting: int = 0          # goals waiting behind the running one
    queue_capacity: int = 0         # queue.depth (0: not configured)
    running: int = 0                # goals generating now
    kv_used: int = 0                # KV positions in use
    kv_capacity: int = 0
    rss_bytes: int = 0
    soc_temp_c: Optional[float] = None   # hottest watched zone; None: no reading
    throttled: bool = False

    @property
    def kv_occupancy(self) -> float:
        """Return used / capacity (0 when nothing is loaded)."""
        return self.kv_used / self.kv_capacity if self.kv_capacity else 0.0
