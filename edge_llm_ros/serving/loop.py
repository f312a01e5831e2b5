"""The step loop: plan, run, advance. The one driver of every backend.

    loop = StepLoop(scheduler, executor, lock)
    report = loop.step()        # one plan: ends, admissions, one model call over rows

The worker thread (serving/worker.py) calls ``step(emit=...)``, which hands the report over
before the next step; Engine.generate (serving/engine.py) calls ``step()`` on the caller's
thread. The lock makes one plan's
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
        """Run one plan; with `emit`, hand its report over too."""
        report = self.run_plan(admit)
        if emit is not None:
            emit(report)
        return report

    def abort(self, reason: Any) -> Report:
        """End every goal (cancelled with `reason`); return the report of their ends."""
        with self.lock:
            plan = self.scheduler.abort(reason)
            return self.scheduler.update(plan, self.executor.run(plan))
