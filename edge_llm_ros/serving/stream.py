"""Goals over a backend that streams whole generations: the remote backend (serving/remote.py).

Such a backend has no slots and no prefill/decode to plan: its ``generate(request)`` returns an
iterator of TokenEvent (with ``.result`` once exhausted and a thread-safe ``.cancel()``), and
the tokens are made elsewhere (an HTTP server). StreamScheduler runs the same queue, plans and
reports as the KV scheduler, one goal at a time: an admission plan starts the head's stream, an
event plan takes its next event (StreamExecutor blocks on it). Preempt flags are ignored (a
preempting head waits like any other); cancel interrupts the blocked read.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.types import GenerationResult, StopReason
from edge_llm_ros.serving.goal import (cancelled_result, CancelReason, error_result, Goal,
                                       GoalState)
from edge_llm_ros.serving.queue import GoalQueue
from edge_llm_ros.serving.scheduler import Report


@dataclass
class StreamPlan:
    start: Optional[Goal] = None     # begin this goal's stream
    next_of: Optional[Goal] = None   # take the next event of this goal's stream
    ended: List[Goal] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.start is None and self.next_of is None and not self.ended


@dataclass
class StreamOutputs:
    started: Any = None                  # the stream (an iterator with .result/.cancel)
    start_error: Optional[BaseException] = None
    event: Any = None                    # the next TokenEvent, or None at the end
    result: Optional[GenerationResult] = None
    error: Optional[BaseException] = None


class StreamScheduler:
    """One goal at a time over a streaming backend (see the module docstring)."""

    slots = 1

    def __init__(self) -> None:
        self._queue = GoalQueue()
        self._current: Optional[Goal] = None
        self._next_is_event = False

    def submit(self, goal: Goal) -> Goal:
        return self._queue.submit(goal)

    def cancel(self, goal: Goal, reason: CancelReason = CancelReason.CLIENT) -> bool:
        ended = self._queue.cancel(goal, reason)
        stream = goal.sequence
        if not ended and stream is not None:
            stream.cancel()   # a read blocked in the executor returns now
        return ended

    def waiting(self) -> List[Goal]:
        return self._queue.waiting()

    def take_waiting(self) -> List[Goal]:
        """Remove the waiting goals, unsubmitted (any thread; GoalQueue.take_all)."""
        return self._queue.take_all()

    def live(self) -> List[Goal]:
        return [self._current] if self._current is not None else []

    def paused(self) -> List[Goal]:
        return []

    def busy(self) -> bool:
        return self._current is not None

    def has_work(self, admit: bool = True) -> bool:
        return self.busy() or (admit and bool(len(self._queue)))

    def idle(self) -> bool:
        return not self.busy() and not len(self._queue)

    def settle(self) -> None:
        """Return no end ops: a stream goal holds no KV here."""
        return None

    def schedule(self, admit: bool = True) -> StreamPlan:
        plan = StreamPlan()
        if self._next_is_event:
            self._next_is_event = False
            if self._current is not None:
                plan.next_of = self._current
            return plan
        self._next_is_event = True
        current = self._current
        if current is not None and current.cancelled and current.sequence is None:
            self._end(current, cancelled_result(), plan.ended)
        if self._current is None and admit:
            goal = self._queue.pop()
            if goal is not None:
                goal.queue_wait_s = goal.wait_time()
                goal.state = GoalState.DECODE
                self._current = goal
                plan.start = goal
        return plan

    def update(self, plan: StreamPlan, out: StreamOutputs) -> Report:
        report = Report(ended=list(plan.ended))
        if plan.start is not None:
            goal = plan.start
            report.started.append(goal)
            if out.start_error is not None:
                exc = out.start_error
                text = str(exc) if isinstance(exc, InvalidRequestError) else \
                    f'{type(exc).__name__}: {exc}'
                self._end(goal, error_result(text), report.ended)
            else:
                goal.sequence = out.started
                if goal.cancelled:
                    out.started.cancel()
        goal = plan.next_of
        if goal is not None and not goal.done:
            if out.error is not None:
                self._end(goal, error_result(f'{type(out.error).__name__}: {out.error}'),
                          report.ended)
            elif out.event is not None:
                goal.output.add(out.event)
                report.tokens.append(goal)
            else:
                self._end(goal, out.result, report.ended)
        return report

    def _end(self, goal: Goal, result: GenerationResult, ended: List[Goal]) -> None:
        if self._current is goal:
            self._current = None
        if goal.cancelled and result.stop_reason is not StopReason.ERROR:
            result = replace(result, stop_reason=StopReason.CANCELLED)
        goal.finish(replace(result, timings=replace(result.timings,
                                                    queue_wait_s=goal.queue_wait_s)))
        ended.append(goal)

    def abort(self, reason: CancelReason = CancelReason.SHUTDOWN) -> StreamPlan:
        for goal in self.live() + self.waiting():
            self.cancel(goal, reason)
        plan = StreamPlan()
        if self._current is not None:
            self._end(self._current, cancelled_result(), plan.ended)
        return plan


class StreamExecutor:
    """Starts streams and takes their events (blocking; see the module docstring)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._iters: dict = {}

    def run(self, plan: StreamPlan) -> StreamOutputs:
        out = StreamOutputs()
        if plan.start is not None:
            goal = plan.start
            try:
                stream = self._backend.generate(goal.enter_embeddings())
                self._iters[goal.uid] = iter(stream)
                out.started = stream
            except Exception as exc:  # noqa: B902 - one bad goal must not stop the others
                out.start_error = exc
        goal = plan.next_of
        if goal is not None and goal.uid in self._iters:
            try:
                out.event = next(self._iters[goal.uid])
            except StopIteration:
                del self._iters[goal.uid]
                out.result = goal.sequence.result
            except Exception as exc:  # noqa: B902 - one bad generation must not stop others
                del self._iters[goal.uid]
                out.error = exc
        return out
