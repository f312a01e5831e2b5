"""The step loop: plan, run, advance. The one driver of every backend.

    loop = StepLoop(scheduler, executor, lock)
    report = loop.step()        # an admission plan (+ one prefill chunk), then a decode plan

The worker thread (serving/worker.py) calls ``step(emit=...)`` so that what the admission plan
produced (a new goal's first token) is routed before the batched decode runs; Engine.generate
(serving/engine.py) calls ``step()`` on the caller's thread. The lock makes one plan's
schedule-run-update atomic against engine maintenance (session resets, close).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from edge_llm_ros.serving.scheduler import Report


class StepLoop:
    """A scheduler and its executor (KV or stream), run one plan at a time."""

    def __init__(self, scheduler: Any, executor: Any,
                 lock: Optional[threading.RLock] = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.lock = lock if lock is not None else threading.RLock()

    def run_plan(self, admit: bool = True) -> Report:
        """Schedule, run and advance one plan; return its report."""
        with self.lock:
            plan = self.scheduler.schedule(admit)
            if plan.empty:
                return Report()
            report = self.scheduler.update(plan, self.executor.run(plan))
            ends = self.scheduler.settle()
            if ends is not None:
                self.executor.run(ends)
            return report

    def step(self, admit: bool = True,
             emit: Optional[Callable[[Report], None]] = None) -> Report:
        """Run an admission plan and a decode plan; with `emit`, hand over each report.

        Without emit, the two reports are returned joined.
        """
        first = self.run_plan(admit)
        if emit is not None:
            emit(first)
            second = self.run_plan(admit)
            emit(second)
            return second
        first += self.run_plan(admit)
        return first

    def abort(self, reason: Any) -> Report:
        """End every goal (cancelled with `reason`); return the report of their ends."""
        with self.lock:
            plan = self.scheduler.abort(reason)
            return self.scheduler.update(plan, self.executor.run(plan))
