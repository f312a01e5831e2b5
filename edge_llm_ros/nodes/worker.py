"""One thread that owns the engine and runs queued generation jobs in order.

No rclpy here: llm_node wraps jobs around action goals and service calls, and this
module can be tested with a fake engine. The engine is created *inside* the worker
thread so that CPU pinning applied to that thread is inherited by the ONNX Runtime
threads the engine's session creates.

Threading contract:
- `submit`, `cancel`, `cancel_all`, `snapshot`, `run_between_jobs` may be called from any
  thread.
- `Job.on_feedback` and `Job.on_done` run on the worker thread, except when a job is
  cancelled while still queued: then `on_done` runs on the cancelling thread.
- `on_done` is called exactly once per submitted job.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
import enum
import threading
import time
from typing import Any, Callable, ContextManager, Deque, Optional

import numpy as np

from edge_llm_ros.engine.errors import InvalidRequestError
from edge_llm_ros.engine.request import PreparedRequest
from edge_llm_ros.engine.tools.parser import ToolCallDelta
from edge_llm_ros.engine.types import GenerationResult, StopReason, Timings


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
    _generation: Any = field(default=None, init=False, repr=False)
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


class QueueFullError(RuntimeError):
    """All queue slots are taken; retry later or raise the node's queue_depth."""


class WorkerStoppedError(RuntimeError):
    """The worker is not running (node not configured, or shutting down)."""


def cancelled_result(text: str = '', token_ids=(), prompt_tokens: int = 0,
                     timings: Timings = Timings()) -> GenerationResult:
    return GenerationResult(text=text, token_ids=list(token_ids),
                            stop_reason=StopReason.CANCELLED, prompt_tokens=prompt_tokens,
                            completion_tokens=len(token_ids), timings=timings)


def error_result(message: str, timings: Timings = Timings()) -> GenerationResult:
    return GenerationResult(text='', token_ids=[], stop_reason=StopReason.ERROR,
                            prompt_tokens=0, completion_tokens=0, timings=timings,
                            error=message)


class EngineWorker:
    """Runs jobs one at a time on a dedicated thread that owns the engine."""

    def __init__(self, engine_factory: Callable[[], Any], queue_depth: int,
                 feedback: FeedbackPolicy = FeedbackPolicy(),
                 thread_setup: Callable[[], None] = lambda: None,
                 pacer: Any = None) -> None:
        """Prepare a worker; nothing runs until `start`.

        :param engine_factory: builds the engine; called on the worker thread.
        :param queue_depth: goals allowed to wait behind the running one.
        :param thread_setup: called first on the worker thread (CPU pinning).
        :param pacer: object whose `token_pause_s` attribute (the thermal governor's) is
            slept between tokens when non-zero; None = never pause.
        """
        self._engine_factory = engine_factory
        self._thread_setup = thread_setup
        self._pacer = pacer
        self.feedback = feedback  # replaced as a whole; read once per job
        self.queue_depth = queue_depth
        self._lock = threading.Condition()
        self._announce_lock = threading.Lock()
        self._queue: Deque[Job] = collections.deque()
        self._running: Optional[Job] = None
        self._between: list = []    # _Between actions waiting for the running job to end
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

    # ---- producer side ----------------------------------------------------------------------
    def set_accepting(self, accepting: bool) -> None:
        """Open or close the queue (the node's active state); closing drops reservations."""
        with self._lock:
            self._accepting = accepting
            if not accepting:
                self._reserved = 0

    def has_room(self) -> bool:
        with self._lock:
            return self._open() and self._in_flight() < self.queue_depth + 1

    def _open(self) -> bool:
        return self._accepting and not self._stopping

    def _in_flight(self) -> int:
        # Room is for one running job plus queue_depth waiting (or reserved) ones.
        return len(self._queue) + (1 if self._running is not None else 0) + self._reserved

    def reserve(self) -> bool:
        """Hold a slot for a job that will be submitted soon; False when full.

        Admission (the action's goal callback) and submission (its accepted callback) are
        separate steps: without a reservation, a burst of goals could all be admitted.
        """
        with self._lock:
            if not self._open() or self._in_flight() >= self.queue_depth + 1:
                return False
            self._reserved += 1
            return True

    def unreserve(self) -> None:
        """Give back a reservation that will not be submitted (invalid request)."""
        with self._lock:
            self._reserved = max(0, self._reserved - 1)

    def submit(self, job: Job, reserved: bool = False) -> int:
        """Queue a job (using a reservation if given); return its position (0: runs now)."""
        with self._lock:
            if reserved:
                self._reserved = max(0, self._reserved - 1)
            if not self._open() or not self.alive:
                raise WorkerStoppedError('llm_node stopped serving (deactivated or shutting '
                                         'down) before the request could be queued')
            busy = 1 if self._running is not None else 0
            if self._in_flight() >= self.queue_depth + 1:
                raise QueueFullError(
                    'queue full: %d goal(s) waiting (queue_depth=%d)'
                    % (len(self._queue), self.queue_depth))
            job.enqueued_at = time.monotonic()
            self._queue.append(job)
            position = len(self._queue) - 1 + busy
            self._lock.notify_all()
        if position > 0:
            self._announce_positions(only=job)
        return position

    def cancel(self, job: Job, reason: CancelReason = CancelReason.CLIENT) -> None:
        """Stop a running job within one decode step, or drop it from the queue."""
        with self._lock:
            if job._finished or job.cancel_reason is not CancelReason.NONE:
                return
            job.cancel_reason = reason
            queued = job in self._queue
            if queued:
                self._queue.remove(job)
                job._finished = True
            generation = job._generation
        if queued:
            job.on_done(JobOutcome(cancelled_result(
                timings=Timings(queue_wait_s=time.monotonic() - job.enqueued_at)), reason))
            self._announce_positions()
        elif generation is not None:
            generation.cancel()

    def cancel_all(self, reason: CancelReason) -> None:
        with self._lock:
            jobs = list(self._queue)
            if self._running is not None:
                jobs.insert(0, self._running)
        for job in jobs:
            self.cancel(job, reason)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job runs or waits; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queue or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def run_between_jobs(self, action: Callable[[Any], Any], timeout: float) -> Any:
        """Return `action(engine)`, run while no generation runs (e.g. dropping KV sessions).

        At once when idle (holding the lock, so no job starts meanwhile), else on the worker
        thread right after the running job, before the next queued one: a running generation
        is never disturbed. Raises TimeoutError when the running job did not end within
        `timeout` (the action still runs after it) and WorkerStoppedError without an engine.
        """
        with self._lock:
            if self.engine is None or not self.alive or self._stopping:
                raise WorkerStoppedError('the engine is not loaded (node not configured, or '
                                         'shutting down)')
            if self._running is None:
                return action(self.engine)
            pending = _Between(action)
            self._between.append(pending)
        if not pending.done.wait(timeout):
            raise TimeoutError(f'a generation is still running after {timeout:g} s; the '
                               'action runs once it ends')
        if pending.error is not None:
            raise pending.error
        return pending.value

    def _run_between(self) -> None:
        """Run the actions that waited for the job that just ended (worker thread, locked)."""
        pending, self._between = self._between, []
        for item in pending:
            try:
                item.value = item.action(self.engine)
            except Exception as exc:  # noqa: B902 - handed to the caller, who re-raises it
                item.error = exc
            item.done.set()

    def snapshot(self) -> WorkerSnapshot:
        with self._lock:
            return WorkerSnapshot(len(self._queue), self._running is not None,
                                  self.queue_depth, self.stats)

    # ---- worker thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._thread_setup()
            self.engine = self._engine_factory()
        except BaseException as exc:  # noqa: B902 - handed to start() and re-raised there
            self._load_error = exc
            self._loaded.set()
            return
        self._loaded.set()
        try:
            while True:
                job = self._next_job()
                if job is None:
                    break
                self._run(job)
        finally:
            engine, self.engine = self.engine, None
            engine.close()

    def _next_job(self) -> Optional[Job]:
        with self._lock:
            while not self._queue and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return None
            job = self._running = self._queue.popleft()
        self._announce_positions()
        return job

    def _announce_positions(self, only: Optional[Job] = None) -> None:
        """Send waiting jobs their current queue position (1 = next).

        Snapshot and sends happen under one lock, so a client never sees an older position
        after a newer one.
        """
        with self._announce_lock:
            with self._lock:
                waiting = list(self._queue)
                busy = 1 if self._running is not None else 0
            for index, job in enumerate(waiting):
                if job.on_feedback is not None and only in (None, job):
                    job.on_feedback(FeedbackChunk(queue_position=index + busy))

    def _run(self, job: Job) -> None:
        queue_wait = time.monotonic() - job.enqueued_at
        self.stats.started += 1
        try:
            result = self._generate(job)
        except InvalidRequestError as exc:
            # Validated at admission; what only running can find: the embeddings' frames
            # could not be mapped (stale handle) or hold NaN.
            result = error_result(str(exc))
        except Exception as exc:  # noqa: B902 - one bad job must not kill the worker
            result = error_result('%s: %s' % (type(exc).__name__, exc))
        result = replace(result, timings=replace(result.timings, queue_wait_s=queue_wait))
        self._record(result)
        with self._lock:
            job._finished = True
            job._generation = None
            self._running = None
            self._run_between()
            self._lock.notify_all()
        job.on_done(JobOutcome(result, job.cancel_reason))

    def _generate(self, job: Job) -> GenerationResult:
        if job.embeddings is None:
            return self._stream(job, job.request)
        with job.embeddings() as array:
            return self._stream(job, job.request.bind(array))

    def _stream(self, job: Job, request: PreparedRequest) -> GenerationResult:
        generation = self.engine.generate(request)
        with self._lock:
            job._generation = generation
            cancelled = job.cancel_reason is not CancelReason.NONE
        if cancelled:
            generation.cancel()
        policy = self.feedback
        send = job.on_feedback
        text: list = []
        ids: list = []
        reasoning: list = []
        deltas: list = []
        sent_ids = sent_deltas = 0
        last_sent = time.monotonic()
        pacer = self._pacer
        for event in generation:
            text.append(event.text_delta)
            ids.append(event.token_id)
            reasoning.append(event.reasoning_delta)
            deltas.extend(event.tool_call_deltas)
            if pacer is not None and pacer.token_pause_s:
                time.sleep(pacer.token_pause_s)   # the SoC runs hot: let it cool
            if send is None:
                continue
            now = time.monotonic()
            # The first token goes out at once (time to first feedback ~ engine TTFT).
            if (sent_ids == 0 or len(ids) - sent_ids >= policy.tokens
                    or (policy.period_s and now - last_sent >= policy.period_s)):
                send(FeedbackChunk(''.join(text[sent_ids:]), tuple(ids[sent_ids:]), len(ids),
                                   reasoning_delta=''.join(reasoning[sent_ids:]),
                                   tool_call_deltas=tuple(deltas[sent_deltas:])))
                sent_ids, sent_deltas = len(ids), len(deltas)
                last_sent = now
        result = generation.result
        if send is not None:
            # The last feedback always carries the final count, so a client knows it has
            # every chunk once it sees completion_tokens == result.completion_tokens.
            streamed = ''.join(text[:sent_ids])
            tail = ''
            if result.text.startswith(streamed):
                tail = result.text[len(streamed):]
            else:
                self.stats.last_error = 'engine: streamed text is not a prefix of the result'
            thought = ''.join(reasoning[:sent_ids])
            send(FeedbackChunk(tail, tuple(result.token_ids[sent_ids:]),
                               result.completion_tokens,
                               reasoning_delta=(result.reasoning[len(thought):]
                                                if result.reasoning.startswith(thought) else ''),
                               tool_call_deltas=tool_call_tail(deltas[:sent_deltas],
                                                               result.tool_calls)))
        return result

    def _record(self, result: GenerationResult) -> None:
        stats = self.stats
        stats.finished[result.stop_reason.value] = stats.finished.get(
            result.stop_reason.value, 0) + 1
        if result.stop_reason is StopReason.ERROR:
            stats.last_error = result.error
        elif result.completion_tokens:
            stats.last_ttft_s = result.timings.time_to_first_token_s
            stats.last_decode_tps = result.timings.decode_tokens_per_second
