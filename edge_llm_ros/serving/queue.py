"""Goals waiting for a slot: priority first, then arrival; thread-safe submit and cancel.

Both schedulers (serving/scheduler.py over KV slots, serving/stream.py over a streaming
backend) keep their waiting goals here, so submission, cancel-while-waiting and the admission
order are one piece of code.
"""
from __future__ import annotations

import bisect
import itertools
import threading
import time
from typing import List, Optional

from edge_llm_ros.runtime.types import Timings
from edge_llm_ros.serving.goal import cancelled_result, CancelReason, Goal, GoalState


class WaitQueue:
    """Waiting goals, highest priority first, then arrival (not thread-safe)."""

    def __init__(self) -> None:
        self._keys: List[tuple] = []
        self._items: List[Goal] = []

    @staticmethod
    def key(goal: Goal) -> tuple:
        return (-goal.priority, goal.arrival)

    def push(self, goal: Goal) -> None:
        i = bisect.bisect(self._keys, self.key(goal))
        self._keys.insert(i, self.key(goal))
        self._items.insert(i, goal)

    def head(self) -> Optional[Goal]:
        return self._items[0] if self._items else None

    def pop(self) -> Goal:
        self._keys.pop(0)
        return self._items.pop(0)

    def remove(self, goal: Goal) -> bool:
        for i, item in enumerate(self._items):
            if item is goal:
                del self._keys[i]
                del self._items[i]
                return True
        return False

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> List[Goal]:
        return list(self._items)


class GoalQueue:
    """The thread-safe front of a scheduler: submit, cancel, waiting, pop (see module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._queue = WaitQueue()
        self._arrivals = itertools.count()

    def submit(self, goal: Goal) -> Goal:
        """Queue a goal (any thread)."""
        with self.lock:
            if goal.state is not GoalState.WAITING or goal.submitted_at:
                raise ValueError('a goal can be submitted once')
            goal.arrival = next(self._arrivals)
            goal.submitted_at = time.monotonic()
            if goal.cancelled:   # cancelled before it was submitted: it ends at once, here
                self._end_waiting(goal)
            else:
                self._queue.push(goal)
        return goal

    def cancel(self, goal: Goal, reason: CancelReason) -> bool:
        """Set the goal's cancel flag (any thread); end it here if it was still waiting.

        Returns True when it ended here (its result is set; no report will carry it).
        """
        with self.lock:
            if goal.done or goal.cancelled:
                return False
            goal.cancel_reason = reason
            if goal.state is GoalState.WAITING and self._queue.remove(goal):
                self._end_waiting(goal)
                return True
        return False

    @staticmethod
    def _end_waiting(goal: Goal) -> None:
        goal.finish(cancelled_result(Timings(queue_wait_s=goal.wait_time())))

    def waiting(self) -> List[Goal]:
        """Return the waiting goals in the order they will be admitted."""
        with self.lock:
            return self._queue.items()

    def head(self) -> Optional[Goal]:
        with self.lock:
            return self._queue.head()

    def first(self, admissible) -> Optional[Goal]:
        """Return the first waiting goal, in admission order, that admissible(goal) accepts."""
        with self.lock:
            return next((g for g in self._queue.items() if admissible(g)), None)

    def take(self, goal: Optional[Goal]) -> bool:
        """Remove a waiting goal to admit it; False when it is no longer waiting."""
        if goal is None:
            return False
        with self.lock:
            return self._queue.remove(goal)

    def pop(self) -> Optional[Goal]:
        with self.lock:
            return self._queue.pop() if len(self._queue) else None

    def take_all(self) -> List[Goal]:
        """Remove every waiting goal, in admission order, as never submitted (any thread).

        They may be submitted again (a model update prepares them anew for the new model).
        """
        with self.lock:
            goals = self._queue.items()
            self._queue = WaitQueue()
        for goal in goals:
            goal.arrival, goal.submitted_at = 0, 0.0
        return goals

    def __len__(self) -> int:
        return len(self._queue)
