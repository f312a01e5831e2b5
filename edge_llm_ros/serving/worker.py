"""One thread that owns the engine and runs its step loop over the submitted goals.

No rclpy here: llm_node (nodes/llm_action.py) submits Goals and receives their feedback and
ends through the goal's callbacks. The engine is created *inside* the worker thread so that CPU
pinning applied to that thread is inherited by the ONNX Runtime threads the engine's session
creates.

The worker drives the engine's StepLoop (serving/loop.py, docs/batching.md): up to
``parallel_sequences`` goals decode together, the rest wait by priority then arrival, and a
``preempt`` goal may pause a lower-priority one (its feedback says paused, then resumed). A
backend without a loop of its own (the remote backend, test fakes: anything whose
``generate()`` streams TokenEvents) runs through serving/stream.py's StreamScheduler.

Feedback: each goal's Output is the one copy of its tokens; the worker sends slices of it
(every FeedbackPolicy.tokens tokens or period_s seconds, the first token at once) and, at the
end, the rest with the final count, so joined feedback always equals the result.

What other threads read about goals (queue positions, running and waiting counts) comes from a
QueueView the worker publishes after every change, never from the scheduler's live state.

Threading contract:
- `submit`, `cancel`, `cancel_all`, `take_waiting`, `snapshot`, `position`,
  `run_between_jobs` may be called from any thread.
- `Goal.on_feedback` and `Goal.on_done` run on the worker thread, except when a goal is
  cancelled while still queued (then `on_done` runs on the cancelling thread) and when a
  session goal's committed turn is being written to sessions.store (then `on_done` runs on
  the store's writer thread once the turn is on disk).
- `on_done` is called exactly once per submitted goal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from edge_llm_ros.runtime.tools.parser import ToolCallDelta
from edge_llm_ros.runtime.types import GenerationResult, StopReason
from edge_llm_ros.serving.goal import (CancelReason, error_result, Feedback, FeedbackPolicy,
                                       Goal)
from edge_llm_ros.serving.loop import StepLoop
from edge_llm_ros.serving.scheduler import Report
from edge_llm_ros.serving.stream import StreamExecutor, StreamScheduler

__all__ = ['EngineWorker', 'QueueFullError', 'QueueView', 'WorkerStoppedError',
           'tool_call_tail']


def _at_once(goal: Goal, done: Callable[[], None]) -> None:
    """Deliver a goal's end at once (a backend without sessions.store)."""
    done()


def tool_call_tail(streamed, calls) -> tuple:
    """Deltas that complete `calls` (the result's) after the `streamed` deltas.

    So the last feedback carries what the stream missed: joined per index, the deltas' id,
    name and arguments equal the result's tool calls.
    """
    sent: dict = {}
    for delta in streamed:
        sent[delta.index] = sent.get(delta.index, '') + delta.arguments
    tail = []
    for index, call in enumerate(calls):
        if index not in sent:
            tail.append(ToolCallDelta(index, call.id, call.name, call.arguments))
        elif call.arguments.startswith(sent[index]) and len(call.arguments) > len(sent[index]):
            tail.append(ToolCallDelta(index, arguments=call.arguments[len(sent[index]):]))
    return tuple(tail)


@dataclass(eq=False)
class _Between:
    """An action waiting to run between two goals (EngineWorker.run_between_jobs)."""

    action: Callable[[Any], Any]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: Optional[BaseException] = None


@dataclass
class WorkerStats:
    """Goals finished per stop reason and the last error, for diagnostics (read unlocked)."""

    finished: dict = field(default_factory=lambda: {r.value: 0 for r in StopReason})
    last_error: str = ''


@dataclass(frozen=True)
class QueueView:
    """What the worker last published about its goals (safe to read from any thread)."""

    free_slots: int = 0          # slots no goal holds (running or paused goals hold one each)
    running: int = 0             # goals holding a slot, or paused
    waiting: int = 0
    positions: Dict[int, int] = field(default_factory=dict)   # goal.uid -> 1-based place


@dataclass(frozen=True)
class WorkerSnapshot:
    waiting: int
    running: bool
    queue_depth: int


class QueueFullError(RuntimeError):
    """All queue slots are taken; retry later or raise the node's queue_depth."""


class WorkerStoppedError(RuntimeError):
    """The worker is not running (node not configured, or shutting down)."""


class EngineWorker:
    """Runs goals on a dedicated thread that owns the engine (batched when it can)."""

    def __init__(self, engine_factory: Callable[[], Any], queue_depth: int,
                 feedback: FeedbackPolicy = FeedbackPolicy(),
                 thread_setup: Callable[[], None] = lambda: None,
                 pacer: Any = None) -> None:
        """Prepare a worker; nothing runs until `start`.

        :param engine_factory: builds the engine; called on the worker thread.
        :param queue_depth: goals allowed to wait behind the running ones (one per slot).
        :param thread_setup: called first on the worker thread (CPU pinning).
        :param pacer: object whose `token_pause_s` attribute (the thermal governor's) is
            slept after each plan that made tokens when non-zero; None = never pause.
        """
        self._engine_factory = engine_factory
        self._thread_setup = thread_setup
        self._pacer = pacer
        self.feedback = feedback  # replaced as a whole; read once per goal
        self.queue_depth = queue_depth
        self._lock = threading.Condition()
        self._announce_lock = threading.Lock()
        self._loop: Optional[StepLoop] = None   # set on the worker thread
        self._when_saved: Callable[[Goal, Callable[[], None]], None] = _at_once
        self._goals: List[Goal] = []   # submitted and not finished, in submission order
        self._between: list = []       # _Between actions waiting for no goal mid-flight
        self._stepping = False         # the worker thread is inside a step
        self._reserved = 0
        self._accepting = False
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._loaded = threading.Event()
        self._load_error: Optional[BaseException] = None
        self._view = QueueView()
        self._slots = 1
        self.engine: Any = None
        self.stats = WorkerStats()

    # ---- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and wait until the engine is loaded; re-raise a load failure."""
        self._thread = threading.Thread(target=self._main, name='llm_engine_worker', daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def stop(self, reason: CancelReason = CancelReason.SHUTDOWN, timeout: float = 30.0) -> None:
        """Cancel every goal, end the thread and close the engine (idempotent)."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self.cancel_all(reason)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError('engine worker did not stop within %.0f s' % timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def slots(self) -> int:
        """Goals that run at once (the engine's parallel_sequences; 1 before loading)."""
        return self._slots

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._stopping

    # ---- producer side ----------------------------------------------------------------------
    def set_accepting(self, accepting: bool) -> None:
        """Open or close the queue (the node's active state); closing drops reservations."""
        with self._lock:
            self._accepting = accepting
            if not accepting:
                self._reserved = 0

    def has_room(self) -> bool:
        with self._lock:
            return self.accepting and self._in_flight() < self._capacity()

    def _capacity(self) -> int:
        # Room is for one running goal per slot plus queue_depth waiting (or reserved) ones.
        return self.queue_depth + self._slots

    def _in_flight(self) -> int:
        return len(self._goals) + self._reserved

    def reserve(self) -> bool:
        """Hold a place for a goal that will be submitted soon; False when full.

        Admission (the action's goal callback) and submission (its accepted callback) are
        separate steps: without a reservation, a burst of goals could all be admitted.
        """
        with self._lock:
            if not self.accepting or self._in_flight() >= self._capacity():
                return False
            self._reserved += 1
            return True

    def unreserve(self) -> None:
        """Give back a reservation that will not be submitted (invalid request)."""
        with self._lock:
            self._reserved = max(0, self._reserved - 1)

    def submit(self, goal: Goal, reserved: bool = False) -> int:
        """Queue a goal (using a reservation if given); return its position (0: runs now)."""
        with self._lock:
            if reserved:
                self._reserved = max(0, self._reserved - 1)
            if not self.accepting or not self.alive or self._loop is None:
                raise WorkerStoppedError('llm_node stopped serving (deactivated or shutting '
                                         'down) before the request could be queued')
            if self._in_flight() >= self._capacity():
                raise QueueFullError(
                    'queue full: %d goal(s) waiting (queue_depth=%d)'
                    % (self._view.waiting, self.queue_depth))
            self._loop.scheduler.submit(goal)
            if goal.done:   # cancelled before it was submitted: ended at once
                ended = True
            else:
                ended = False
                self._goals.append(goal)
                self._publish()
                self._lock.notify_all()
            position = self._view.positions.get(goal.uid, 0)
            last = not ended and self._loop.scheduler.waiting()[-1:] == [goal]
        if ended:
            self._done(goal)
            return 0
        if position > 0:
            # Ahead of some waiting goal (higher priority): their positions moved too.
            self._announce_positions(only=goal if last else None)
        return position

    @property
    def view(self) -> QueueView:
        """Return the queue view last published (immutable; safe from any thread)."""
        return self._view

    def position(self, goal: Goal) -> int:
        """Return where the goal waits: 1 = next (0: it holds a slot or has ended)."""
        return self._view.positions.get(goal.uid, 0)

    def cancel(self, goal: Goal, reason: CancelReason = CancelReason.CLIENT) -> None:
        """Stop a running or paused goal within one step, or drop it from the queue."""
        with self._lock:
            if goal.done or goal.cancelled:
                return
            if self._loop is None or not goal.submitted_at:
                goal.cancel_reason = reason   # not submitted yet: submit() ends it at once
                return
            dropped = self._loop.scheduler.cancel(goal, reason)
            if dropped:
                self._forget(goal)
                self._publish()
        if dropped:
            self._done(goal)
            self._announce_positions()

    def cancel_all(self, reason: CancelReason) -> None:
        with self._lock:
            goals = list(self._goals)
        for goal in goals:
            self.cancel(goal, reason)

    def take_waiting(self) -> List[Goal]:
        """Remove the goals that wait for a slot and hand them back, never submitted.

        Running and paused goals go on. A model update takes the waiting goals so that they
        run on the new model, prepared for it, instead of on this worker's.
        """
        with self._lock:
            if self._loop is None:
                return []
            goals = self._loop.scheduler.take_waiting()
            for goal in goals:
                self._forget(goal)
            self._publish()
        return goals

    def unfinished(self) -> int:
        """Return how many submitted goals have not ended (running, paused or waiting)."""
        with self._lock:
            return len(self._goals)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no goal runs or waits; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._goals:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def run_between_jobs(self, action: Callable[[Any], Any], timeout: float) -> Any:
        """Return `action(engine)`, run while no goal is mid-flight (e.g. dropping KV sessions).

        At once when no goal holds a slot (holding the lock, so no step starts meanwhile),
        else on the worker thread as soon as the running goals have ended: no new goal is
        admitted while an action waits, so it never starves, and a running generation is
        never disturbed (paused goals keep their KV apart and are not affected). Raises
        TimeoutError when the running goals did not end within `timeout` (the action still
        runs after them) and WorkerStoppedError without an engine.
        """
        with self._lock:
            if self.engine is None or not self.alive or self._stopping:
                raise WorkerStoppedError('the engine is not loaded (node not configured, or '
                                         'shutting down)')
            if not self._stepping and not self._loop.scheduler.busy():
                return action(self.engine)
            pending = _Between(action)
            self._between.append(pending)
            self._lock.notify_all()
        if not pending.done.wait(timeout):
            raise TimeoutError(f'a generation is still running after {timeout:g} s; the '
                               'action runs once it ends')
        if pending.error is not None:
            raise pending.error
        return pending.value

    def _run_between(self) -> None:
        """Run the actions that waited for the running goals to end (worker thread, locked)."""
        pending, self._between = self._between, []
        for item in pending:
            try:
                item.value = item.action(self.engine)
            except Exception as exc:  # noqa: B902 - handed to the caller, who re-raises it
                item.error = exc
            item.done.set()

    def snapshot(self) -> WorkerSnapshot:
        view = self._view
        return WorkerSnapshot(view.waiting, view.running > 0, self.queue_depth)

    # ---- worker thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._thread_setup()
            self.engine = self._engine_factory()
            loop = getattr(self.engine, 'loop', None)
            if not isinstance(loop, StepLoop):
                loop = StepLoop(StreamScheduler(), StreamExecutor(self.engine))
            self._loop = loop
            # A session goal's end waits until its turn is on disk (Engine.when_saved).
            self._when_saved = getattr(self.engine, 'when_saved', _at_once)
            self._slots = loop.scheduler.slots
            self._publish(counts=True)
        except BaseException as exc:  # noqa: B902 - handed to start() and re-raised there
            self._load_error = exc
            self._loaded.set()
            return
        self._loaded.set()
        try:
            while self._wait_for_work():
                admit = not self._between
                try:
                    loop.step(admit, self._route)
                except Exception as exc:  # noqa: B902 - a scheduler bug must not strand goals
                    self._fail_all(exc)
                finally:
                    with self._lock:
                        self._stepping = False
                        self._publish(counts=True)
        finally:
            engine, self.engine = self.engine, None
            engine.close()

    def _wait_for_work(self) -> bool:
        """Block until a step has something to do (True) or the worker is done (False)."""
        sched = self._loop.scheduler
        with self._lock:
            while True:
                if self._between and not sched.busy():
                    self._run_between()
                if self._stopping and not self._goals:
                    return False
                # Stopping: only drain (cancelled goals end at the next step).
                admit = not self._between and not self._stopping
                if sched.has_work(admit) or (self._stopping and self._goals):
                    self._stepping = True
                    return True
                self._lock.wait()

    def _publish(self, counts: bool = False) -> None:
        """Publish the queue view (locked).

        counts True (the worker thread, between plans): recount the slots' goals. Other
        threads keep the last published counts and only re-rank the waiting goals, which the
        scheduler's queue gives thread-safely: they never read its live slots.
        """
        sched = self._loop.scheduler
        view = self._view
        running, free = view.running, view.free_slots
        if counts:
            running = len(sched.live()) + len(sched.paused())
            free = max(sched.slots - running, 0)
        waiting = sched.waiting()
        self._view = QueueView(
            free_slots=free, running=running, waiting=len(waiting),
            positions={g.uid: max(0, i + 1 - free) for i, g in enumerate(waiting)})

    def _announce_positions(self, only: Optional[Goal] = None) -> None:
        """Send waiting goals their current queue position (1 = next).

        View and sends happen under one lock, so a client never sees an older position after
        a newer one.
        """
        with self._announce_lock:
            with self._lock:
                if self._loop is None:
                    return
                view = self._view
                waiting = self._loop.scheduler.waiting()
            for goal in waiting:
                position = view.positions.get(goal.uid, 0)
                if goal.on_feedback is not None and only in (None, goal) and position > 0:
                    goal.on_feedback(Feedback(queue_position=position))

    def _route(self, report: Report) -> None:
        """Send each goal's feedback, paused state and end for one plan's report."""
        now = time.monotonic()
        policy = self.feedback
        moved = report.started or report.ended or report.resumed or report.paused
        if moved:   # before any feedback: a client that saw it sees the new counts too
            with self._lock:
                self._publish(counts=True)
        for goal in report.tokens:
            if goal.done:
                continue   # its end below sends the rest
            if goal.on_feedback is None:
                continue
            pending = len(goal.output) - goal.sent
            # The first token goes out at once (time to first feedback ~ engine TTFT).
            if pending and (goal.sent == 0 or pending >= policy.tokens
                            or (policy.period_s and now - goal.last_sent >= policy.period_s)):
                self._flush(goal, now)
        for goal, paused in [(g, True) for g in report.paused] + \
                [(g, False) for g in report.resumed]:
            if goal.on_feedback is not None:
                self._flush(goal, now, paused=paused)
        for goal in report.ended:
            self._finish(goal)
        pacer = self._pacer
        if report.tokens and pacer is not None and pacer.token_pause_s:
            time.sleep(pacer.token_pause_s)   # the SoC runs hot: let it cool
        if moved:
            self._announce_positions()

    @staticmethod
    def _flush(goal: Goal, now: float, paused: bool = False) -> None:
        """Send the goal's Output since its cursor (and the paused state)."""
        out, start = goal.output, goal.sent
        end = len(out)
        deltas = out.tool_call_deltas(start, end)
        goal.on_feedback(Feedback(out.text(start, end), tuple(out.token_ids(start, end)), end,
                                  reasoning_delta=out.reasoning(start, end),
                                  tool_call_deltas=deltas, paused=paused))
        goal.sent = end
        goal.last_sent = now or time.monotonic()

    def _finish(self, goal: Goal) -> None:
        result = goal.result
        if goal.on_feedback is not None and (len(goal.output) or
                                             result.stop_reason is not StopReason.ERROR):
            self._final_feedback(goal, result)
        self._record(result)
        with self._lock:
            self._forget(goal)
        self._when_saved(goal, lambda: self._done(goal))

    @staticmethod
    def _final_feedback(goal: Goal, result: GenerationResult) -> None:
        """Send the rest of the Output and the final count: joined feedback equals the result.

        A goal that failed before its first token gets no feedback, only its end.
        """
        out, start = goal.output, goal.sent
        streamed_deltas = out.tool_call_deltas(0, start)
        goal.on_feedback(Feedback(
            out.text(start), tuple(out.token_ids(start)), result.completion_tokens,
            reasoning_delta=out.reasoning(start),
            tool_call_deltas=out.tool_call_deltas(start) + tool_call_tail(
                streamed_deltas + out.tool_call_deltas(start), result.tool_calls)))
        goal.sent = len(out)

    def _done(self, goal: Goal) -> None:
        if goal.on_done is not None:
            goal.on_done(goal)

    def _fail_all(self, exc: Exception) -> None:
        """End every goal with ERROR after an unexpected failure of a whole step."""
        message = 'engine step failed: %s: %s' % (type(exc).__name__, exc)
        with self._lock:
            goals = list(self._goals)
        try:
            self._loop.abort(CancelReason.SHUTDOWN)
        except Exception:  # noqa: B902 - the goals end below either way
            pass
        for goal in goals:
            if goal in self._goals:
                goal.finish(error_result(message))
                self._finish(goal)

    def _forget(self, goal: Goal) -> None:
        """Mark a goal finished (locked)."""
        if goal in self._goals:
            self._goals.remove(goal)
        self._lock.notify_all()

    def _record(self, result: GenerationResult) -> None:
        stats = self.stats
        stats.finished[result.stop_reason.value] = stats.finished.get(
            result.stop_reason.value, 0) + 1
        if result.stop_reason is StopReason.ERROR:
            stats.last_error = result.error
