"""One thread that owns the engine and runs the queued generation jobs.

No rclpy here: llm_node wraps jobs around action goals and service calls, and this
module can be tested with a fake engine. The engine is created *inside* the worker
thread so that CPU pinning applied to that thread is inherited by the ONNX Runtime
threads the engine's session creates.

The worker drives the engine's scheduler (engine/scheduler.py, docs/batching.md): up to
``parallel_sequences`` jobs decode together, the rest wait by priority then arrival, and a
``preempt`` job may pause a lower-priority one (its feedback says paused, then resumed). An
engine without ``scheduler()`` (the remote backend, test fakes) runs one job at a time
through a SerialScheduler over its ``generate``.

Threading contract:
- `submit`, `cancel`, `cancel_all`, `snapshot`, `run_between_jobs` may be called from any
  thread.
- `Job.on_feedback` and `Job.on_done` run on the worker thread, except when a job is
  cancelled while still queued: then `on_done` runs on the cancelling thread.
- `on_done` is called exactly once per submitted job.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
import enum
import threading
import time
from typing import Any, Callable, ContextManager, List, Optional

import numpy as np

from edge_llm_ros.runtime.request import PreparedRequest
from edge_llm_ros.runtime.tools.parser import ToolCallDelta
from edge_llm_ros.runtime.types import GenerationResult, StopReason
from edge_llm_ros.serving.scheduler import (cancelled_result, error_result, SeqEvent, Sequence,
                                            SerialScheduler)

__all__ = ['CancelReason', 'EngineWorker', 'FeedbackChunk', 'FeedbackPolicy', 'Job',
           'JobOutcome', 'QueueFullError', 'WorkerStoppedError', 'cancelled_result',
           'error_result', 'tool_call_tail']


class CancelReason(str, enum.Enum):
    """Who cancelled a job (the node maps it to an action terminal state)."""

    NONE = ''
    CLIENT = 'client'            # the action client asked for it
    DEACTIVATED = 'deactivated'  # the node left the active state
    SHUTDOWN = 'shutdown'        # the node is shutting down


@dataclass(frozen=True)
class FeedbackPolicy:
    """Send streamed text every `tokens` tokens or `period_s` seconds (0: off), whichever first."""

    tokens: int = 4
    period_s: float = 0.05


@dataclass(frozen=True)
class FeedbackChunk:
    """What one feedback message carries (queue_position > 0 only while waiting)."""

    text_delta: str = ''
    token_ids: tuple = ()
    completion_tokens: int = 0
    queue_position: int = 0
    reasoning_delta: str = ''
    tool_call_deltas: tuple = ()     # engine.tools.parser.ToolCallDelta
    paused: bool = False             # preempted: its KV is kept, it resumes later


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
    """An action waiting to run between two jobs (EngineWorker.run_between_jobs)."""

    action: Callable[[Any], Any]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class JobOutcome:
    result: GenerationResult
    cancel_reason: CancelReason = CancelReason.NONE


@dataclass(eq=False)
class Job:
    """A prepared request waiting for, or running on, the worker."""

    request: PreparedRequest          # validated once, by Engine.prepare at admission
    on_done: Callable[[JobOutcome], None]
    on_feedback: Optional[Callable[[FeedbackChunk], None]] = None
    # Entered on the worker thread around the generation; yields the prefix-embedding array
    # bound into the request (llm_node maps tensor handles only while the job runs).
    embeddings: Optional[Callable[[], ContextManager[np.ndarray]]] = None
    priority: int = 0                 # higher runs first; ties keep arrival order
    preempt: bool = False             # may pause the lowest-priority running sequence
    # Set by the worker/canceller under the worker's lock.
    enqueued_at: float = field(default=0.0, init=False)
    cancel_reason: CancelReason = field(default=CancelReason.NONE, init=False)
    _seq: Any = field(default=None, init=False, repr=False)       # its scheduler Sequence
    _stream: Any = field(default=None, init=False, repr=False)    # its _FeedbackStream
    _finished: bool = field(default=False, init=False, repr=False)


@dataclass
class WorkerStats:
    """Counters and last-generation figures for diagnostics (read without locking)."""

    started: int = 0
    finished: dict = field(default_factory=lambda: {r.value: 0 for r in StopReason})
    last_ttft_s: float = 0.0
    last_decode_tps: float = 0.0
    last_error: str = ''


@dataclass(frozen=True)
class WorkerSnapshot:
    waiting: int
    running: bool
    queue_depth: int
    stats: WorkerStats


class _FeedbackStream:
    """One job's streamed output and what of it was sent (feedback batching per job)."""

    def __init__(self, job: Job, policy: FeedbackPolicy) -> None:
        self.send = job.on_feedback
        self.policy = policy
        self.text: list = []
        self.ids: list = []
        self.reasoning: list = []
        self.deltas: list = []
        self.sent_ids = self.sent_deltas = 0
        self.last_sent = time.monotonic()

    def add(self, event) -> None:
        self.text.append(event.text_delta)
        self.ids.append(event.token_id)
        self.reasoning.append(event.reasoning_delta)
        self.deltas.extend(event.tool_call_deltas)
        if self.send is None:
            return
        now = time.monotonic()
        policy = self.policy
        # The first token goes out at once (time to first feedback ~ engine TTFT).
        if (self.sent_ids == 0 or len(self.ids) - self.sent_ids >= policy.tokens
                or (policy.period_s and now - self.last_sent >= policy.period_s)):
            self.flush()

    def flush(self, paused: bool = False) -> None:
        """Send what is pending (and the paused state)."""
        ids = self.ids
        self.send(FeedbackChunk(''.join(self.text[self.sent_ids:]), tuple(ids[self.sent_ids:]),
                                len(ids), reasoning_delta=''.join(self.reasoning[self.sent_ids:]),
                                tool_call_deltas=tuple(self.deltas[self.sent_deltas:]),
                                paused=paused))
        self.sent_ids, self.sent_deltas = len(ids), len(self.deltas)
        self.last_sent = time.monotonic()

    def finish(self, result: GenerationResult) -> str:
        """Send the last feedback: the rest of the result and its final count.

        Returns an error text when the stream and the result disagree ('' when fine).
        """
        if self.send is None:
            return ''
        # The last feedback always carries the final count, so a client knows it has
        # every chunk once it sees completion_tokens == result.completion_tokens.
        streamed = ''.join(self.text[:self.sent_ids])
        tail, problem = '', ''
        if result.text.startswith(streamed):
            tail = result.text[len(streamed):]
        else:
            problem = 'engine: streamed text is not a prefix of the result'
        thought = ''.join(self.reasoning[:self.sent_ids])
        self.send(FeedbackChunk(tail, tuple(result.token_ids[self.sent_ids:]),
                                result.completion_tokens,
                                reasoning_delta=(result.reasoning[len(thought):]
                                                 if result.reasoning.startswith(thought)
                                                 else ''),
                                tool_call_deltas=tool_call_tail(self.deltas[:self.sent_deltas],
                                                                result.tool_calls)))
        return problem


class QueueFullError(RuntimeError):
    """All queue slots are taken; retry later or raise the node's queue_depth."""


class WorkerStoppedError(RuntimeError):
    """The worker is not running (node not configured, or shutting down)."""


class EngineWorker:
    """Runs jobs on a dedicated thread that owns the engine (batched when it can)."""

    def __init__(self, engine_factory: Callable[[], Any], queue_depth: int,
                 feedback: FeedbackPolicy = FeedbackPolicy(),
                 thread_setup: Callable[[], None] = lambda: None,
                 pacer: Any = None) -> None:
        """Prepare a worker; nothing runs until `start`.

        :param engine_factory: builds the engine; called on the worker thread.
        :param queue_depth: goals allowed to wait behind the running ones (one per slot).
        :param thread_setup: called first on the worker thread (CPU pinning).
        :param pacer: object whose `token_pause_s` attribute (the thermal governor's) is
            slept after each step that made tokens when non-zero; None = never pause.
        """
        self._engine_factory = engine_factory
        self._thread_setup = thread_setup
        self._pacer = pacer
        self.feedback = feedback  # replaced as a whole; read once per job
        self.queue_depth = queue_depth
        self._lock = threading.Condition()
        self._announce_lock = threading.Lock()
        self._sched: Any = None     # the engine's scheduler (set on the worker thread)
        self._jobs: List[Job] = []  # submitted and not finished, in submission order
        self._between: list = []    # _Between actions waiting for no job to be mid-flight
        self._stepping = False      # the worker thread is inside a scheduler step
        self._reserved = 0
        self._accepting = False
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._loaded = threading.Event()
        self._load_error: Optional[BaseException] = None
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
        """Cancel every job, end the thread and close the engine (idempotent)."""
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
        """Jobs that run at once (the engine's parallel_sequences; 1 before loading)."""
        return self._sched.slots if self._sched is not None else 1

    # ---- producer side ----------------------------------------------------------------------
    def set_accepting(self, accepting: bool) -> None:
        """Open or close the queue (the node's active state); closing drops reservations."""
        with self._lock:
            self._accepting = accepting
            if not accepting:
                self._reserved = 0

    def has_room(self) -> bool:
        with self._lock:
            return self._open() and self._in_flight() < self._capacity()

    def _open(self) -> bool:
        return self._accepting and not self._stopping

    def _capacity(self) -> int:
        # Room is for one running job per slot plus queue_depth waiting (or reserved) ones.
        return self.queue_depth + self.slots

    def _in_flight(self) -> int:
        return len(self._jobs) + self._reserved

    def reserve(self) -> bool:
        """Hold a place for a job that will be submitted soon; False when full.

        Admission (the action's goal callback) and submission (its accepted callback) are
        separate steps: without a reservation, a burst of goals could all be admitted.
        """
        with self._lock:
            if not self._open() or self._in_flight() >= self._capacity():
                return False
            self._reserved += 1
            return True

    def unreserve(self) -> None:
        """Give back a reservation that will not be submitted (invalid request)."""
        with self._lock:
            self._reserved = max(0, self._reserved - 1)

    def submit(self, job: Job, reserved: bool = False) -> int:
        """Queue a job (using a reservation if given); return its position (0: runs now).

        ValueError when job.priority is outside PRIORITY_MIN..PRIORITY_MAX.
        """
        with self._lock:
            if reserved:
                self._reserved = max(0, self._reserved - 1)
            if not self._open() or not self.alive or self._sched is None:
                raise WorkerStoppedError('llm_node stopped serving (deactivated or shutting '
                                         'down) before the request could be queued')
            if self._in_flight() >= self._capacity():
                raise QueueFullError(
                    'queue full: %d goal(s) waiting (queue_depth=%d)'
                    % (len(self._sched.waiting()), self.queue_depth))
            seq = Sequence(job.request, job.priority, job.preempt, job.embeddings, tag=job)
            # Cancelled before it was submitted: it runs to a CANCELLED end at once.
            seq.cancel_asked = job.cancel_reason is not CancelReason.NONE
            self._sched.submit(seq)   # checks the priority range first
            job._seq = seq
            job.enqueued_at = time.monotonic()
            self._jobs.append(job)
            position = self._positions().get(id(job), 0)
            # Ahead of some waiting job (higher priority): their positions moved too.
            last = self._sched.waiting()[-1:] == [seq]
            self._lock.notify_all()
        if position > 0:
            self._announce_positions(only=job if last else None)
        return position

    def _positions(self) -> dict:
        """Return the 1-based queue position of every waiting job (locked).

        Priority order, behind the free slots' worth of jobs admitted at the next step.
        """
        sched = self._sched
        free = sched.slots - len(sched.live()) - len(sched.paused())
        return {id(seq.tag): max(0, index + 1 - max(free, 0))
                for index, seq in enumerate(sched.waiting())}

    def cancel(self, job: Job, reason: CancelReason = CancelReason.CLIENT) -> None:
        """Stop a running or paused job within one step, or drop it from the queue."""
        with self._lock:
            if job._finished or job.cancel_reason is not CancelReason.NONE:
                return
            job.cancel_reason = reason
            if job._seq is None:
                return   # not submitted yet: submit() starts it cancelled
            dropped = self._sched.cancel(job._seq)
            if dropped:
                self._forget(job)
        if dropped:
            job.on_done(JobOutcome(job._seq.result, reason))
            self._announce_positions()

    def cancel_all(self, reason: CancelReason) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            self.cancel(job, reason)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job runs or waits; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def run_between_jobs(self, action: Callable[[Any], Any], timeout: float) -> Any:
        """Return `action(engine)`, run while no job is mid-flight (e.g. dropping KV sessions).

        At once when no job holds a slot (holding the lock, so no step starts meanwhile), else
        on the worker thread as soon as the running jobs have ended: no new job is admitted
        while an action waits, so it never starves, and a running generation is never
        disturbed (paused jobs keep their KV apart and are not affected). Raises TimeoutError
        when the running jobs did not end within `timeout` (the action still runs after them)
        and WorkerStoppedError without an engine.
        """
        with self._lock:
            if self.engine is None or not self.alive or self._stopping:
                raise WorkerStoppedError('the engine is not loaded (node not configured, or '
                                         'shutting down)')
            if not self._stepping and not self._sched.busy():
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
        """Run the actions that waited for the running jobs to end (worker thread, locked)."""
        pending, self._between = self._between, []
        for item in pending:
            try:
                item.value = item.action(self.engine)
            except Exception as exc:  # noqa: B902 - handed to the caller, who re-raises it
                item.error = exc
            item.done.set()

    def snapshot(self) -> WorkerSnapshot:
        with self._lock:
            sched = self._sched
            waiting = len(sched.waiting()) if sched is not None else 0
            running = sched is not None and bool(sched.live() or sched.paused())
            return WorkerSnapshot(waiting, running, self.queue_depth, self.stats)

    # ---- worker thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._thread_setup()
            self.engine = self._engine_factory()
            make = getattr(self.engine, 'scheduler', None)
            self._sched = make() if callable(make) else SerialScheduler(self.engine)
        except BaseException as exc:  # noqa: B902 - handed to start() and re-raised there
            self._load_error = exc
            self._loaded.set()
            return
        self._loaded.set()
        try:
            while self._wait_for_work():
                admit = not self._between
                try:
                    events = self._sched.step(admit, self._route)
                except Exception as exc:  # noqa: B902 - a scheduler bug must not strand jobs
                    events = []
                    self._fail_all(exc)
                finally:
                    with self._lock:
                        self._stepping = False
                self._route(events)
        finally:
            engine, self.engine = self.engine, None
            engine.close()

    def _wait_for_work(self) -> bool:
        """Block until a step has something to do (True) or the worker is done (False)."""
        sched = self._sched
        with self._lock:
            while True:
                if self._between and not sched.busy():
                    self._run_between()
                if self._stopping and not self._jobs:
                    return False
                # Stopping: only drain (cancelled jobs end at the next step).
                admit = not self._between and not self._stopping
                if sched.has_work(admit) or (self._stopping and self._jobs):
                    self._stepping = True
                    return True
                self._lock.wait()

    def _announce_positions(self, only: Optional[Job] = None) -> None:
        """Send waiting jobs their current queue position (1 = next).

        Snapshot and sends happen under one lock, so a client never sees an older position
        after a newer one.
        """
        with self._announce_lock:
            with self._lock:
                if self._sched is None:
                    return
                positions = self._positions()
                waiting = [seq.tag for seq in self._sched.waiting()]
            for job in waiting:
                position = positions[id(job)]
                if job.on_feedback is not None and only in (None, job) and position > 0:
                    job.on_feedback(FeedbackChunk(queue_position=position))

    def _route(self, events: List[SeqEvent]) -> None:
        """Hand each event to its job: feedback (batched per job), paused state, the end."""
        tokens = False
        admitted = False
        for event in events:
            job = event.seq.tag
            if job._stream is None:
                job._stream = _FeedbackStream(job, self.feedback)
                self.stats.started += 1
                admitted = True
            if event.token is not None:
                tokens = True
                job._stream.add(event.token)
            elif event.paused is not None:
                if job.on_feedback is not None:
                    job._stream.flush(paused=event.paused)
            elif event.result is not None:
                self._finish(job, event.result)
        pacer = self._pacer
        if tokens and pacer is not None and pacer.token_pause_s:
            time.sleep(pacer.token_pause_s)   # the SoC runs hot: let it cool
        if admitted:
            self._announce_positions()

    def _finish(self, job: Job, result: GenerationResult) -> None:
        stream = job._stream
        # A job that failed before running (stale embeddings) gets no feedback, only its end.
        if stream.ids or result.stop_reason is not StopReason.ERROR:
            problem = stream.finish(result)
            if problem:
                self.stats.last_error = problem
        result = replace(result, timings=replace(result.timings,
                                                 queue_wait_s=job._seq.queue_wait_s))
        self._record(result)
        with self._lock:
            self._forget(job)
        job.on_done(JobOutcome(result, job.cancel_reason))

    def _fail_all(self, exc: Exception) -> None:
        """End every job with ERROR after an unexpected failure of a whole step."""
        message = 'engine step failed: %s: %s' % (type(exc).__name__, exc)
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            self._sched.cancel(job._seq)
        try:
            self._sched.abort()
        except Exception:  # noqa: B902 - the jobs end below either way
            pass
        for job in jobs:
            if job._stream is None:
                job._stream = _FeedbackStream(job, self.feedback)
            if not job._finished:
                self._finish(job, error_result(message))

    def _forget(self, job: Job) -> None:
        """Mark a job finished (locked)."""
        job._finished = True
        self._jobs.remove(job)
        self._lock.notify_all()

    def _record(self, result: GenerationResult) -> None:
        stats = self.stats
        stats.finished[result.stop_reason.value] = stats.finished.get(
            result.stop_reason.value, 0) + 1
        if result.stop_reason is StopReason.ERROR:
            stats.last_error = result.error
        elif result.completion_tokens:
            stats.last_ttft_s = result.timings.time_to_first_token_s
            stats.last_decode_tps = result.timings.decode_tokens_per_second
