"""llm_node's admission: one NodeGoal per request, validated once, queued, answered.

How a request is refused:
- Not active, or the queue is full: an action goal is REJECTED (rclpy cannot attach a reason
  to a rejection; ~/complete answers success false), the reason is logged, counted in
  /diagnostics and published on ~/transcript.
- Anything wrong with the request itself (empty prompt, unknown role, bad sampling value,
  invalid JSON schema, a priority out of range, too long for the context, unresolvable tensor
  handle, an image the model cannot take): it is accepted and ended at once with
  finish_reason 'error' and an error_message saying what to fix, so the client gets the
  reason. It gives its reserved queue slot back. A handle only its producer can find stale
  (its slot rewritten since) ends the goal the same way when it starts (invalid_request).
Defaults: SamplingParams fields at UNSET take ~/sampling.*, max_tokens 0 takes ~/max_tokens,
an empty system_prompt takes ~/system_prompt. A max_tokens that does not fit in the context
after the prompt is an error, not clamped: the caller asked for more than can be delivered.

One request is one NodeGoal from acceptance to result: the serving Goal (serving/goal.py: the
prepared request, priority, cancel flag, Output) plus what ROS needs to answer it (the
futures its coroutine awaits, the acceptance stamp, the error kind decided here).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
import functools
import threading
import time
import traceback
from typing import Any, Iterator, List, Optional

from rclpy.task import Future

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_ros.errors import EngineError
from edge_llm_ros.metrics import figures
from edge_llm_ros.nodes.messages import build_transcript, goal_media, queue_order, to_request
from edge_llm_ros.qos import TRANSCRIPT_QOS
from edge_llm_ros.serving.goal import (cancelled_result, CancelReason, check_priority,
                                       error_result, Feedback, Goal)
from edge_llm_ros.serving.worker import EngineWorker, QueueFullError, WorkerStoppedError


@dataclass(eq=False)
class NodeGoal(Goal):
    """A Goal with its ROS glue (see the module docstring)."""

    stamp: Any = None                   # builtin_interfaces/Time of acceptance
    done_future: Future = field(default_factory=Future, repr=False)
    # Done once rclpy has recorded an accepted client cancel (the goal is CANCELING).
    cancel_applied: Future = field(default_factory=Future, repr=False)
    # Generate.Result.ERROR_* decided at admission (invalid request), '' otherwise.
    error_kind: str = ''
    # The model it was prepared for (and runs on): a model update may swap the node's first.
    model: str = ''
    # The request message, kept so that a model update can prepare it again for the new model.
    msg: Any = field(default=None, repr=False)
    reserved: bool = False              # holds a reservation on the worker (admit)
    accepted_at: float = field(default_factory=time.monotonic)   # for goal_duration_seconds

    @property
    def queued(self) -> bool:
        """Whether it reached the worker's queue (so its queue wait is known)."""
        return self.submitted_at > 0.0


def error_kind_of(exc: BaseException) -> str:
    """Generate.Result.ERROR_* of a request that failed before it was queued."""
    if isinstance(exc, WorkerStoppedError):
        return Generate.Result.ERROR_UNAVAILABLE
    if isinstance(exc, EngineError):
        return Generate.Result.ERROR_INVALID_REQUEST
    return Generate.Result.ERROR_FAILED


class Admission:
    """Reserve, validate and queue requests; publish their transcripts (see module doc)."""

    def __init__(self, node: Any) -> None:
        self._node = node
        self._answering = threading.Condition()   # see wait_requests_answered
        self._answering_count = 0
        # While a model update drains and swaps, admitted requests wait here, unprepared, in
        # arrival order (None: not holding). The lock orders holding against enqueueing: once
        # hold() returns, no request is being prepared for the old model.
        self._hold_lock = threading.RLock()
        self._held: Optional[List[NodeGoal]] = None
        self._hold_capacity = 0
        self._transcript_pub = node.create_publisher(Transcript, '~/transcript',
                                                     TRANSCRIPT_QOS)

    # ---- admission and validation ------------------------------------------------------------
    def admit(self, goal: NodeGoal) -> str:
        """Reserve a queue slot for a new request; return why not ('' when admitted).

        While a model update holds requests, the place is one of the hold's.
        """
        node = self._node
        with self._hold_lock:
            if self._held is not None:
                if len(self._held) < self._hold_capacity:
                    return ''
                node.figures.goal_rejected(figures.REJECTED_QUEUE_FULL)
                return (f'queue full ({len(self._held)} goal(s) wait for the model update to '
                        'finish): retry later or raise ~/queue.depth')
        worker = node.worker
        if worker is None or not worker.accepting:
            node.figures.goal_rejected(figures.REJECTED_NOT_ACTIVE)
            return (f'{node.get_name()} is {node.lifecycle_state()}, not active: activate it '
                    'with lifecycle change_state (or start it with autostart:=true)')
        if not worker.reserve():
            node.figures.goal_rejected(figures.REJECTED_QUEUE_FULL)
            return (f'queue full ({worker.queue_depth} goal(s) already wait behind the '
                    f'running one): retry later or raise ~/queue.depth')
        goal.reserved = True
        return ''

    def give_back(self, goal: NodeGoal) -> None:
        """Give back the queue place `goal` reserved, if it holds one (it will not be queued)."""
        if goal.reserved:
            goal.reserved = False
            worker = self._node.worker
            if worker is not None:
                worker.unreserve()

    def enqueue(self, msg, goal: NodeGoal) -> None:
        """Prepare an admitted request and queue it, or hold it while a model update runs.

        Raises what prepare() raises (the request was not queued).
        """
        goal.msg = msg
        with self._hold_lock:
            if self._held is not None:
                self._hold(goal)
                return
            worker = self.prepare(msg, goal)
            self.submit(worker, goal)

    def prepare(self, msg, goal: NodeGoal) -> EngineWorker:
        """Validate an admitted request once into `goal`; on failure give the reservation back.

        Raises InvalidRequestError subclasses (bad request) or WorkerStoppedError (the node
        was deactivated or cleaned up since admission).
        """
        node = self._node
        configured = node.configured
        engine = node.engine
        if configured is None or engine is None:
            raise WorkerStoppedError(f'{node.get_name()} is {node.lifecycle_state()}, not '
                                     'configured')
        worker, resolver = configured.worker, configured.embeddings
        try:
            handles = list(msg.prefix_embeddings)
            priority, preempt = queue_order(msg)
            goal.priority, goal.preempt = check_priority(priority), preempt
            described = resolver.describe(handles)
            # Generate only: its images' handles, then its clip's frames (goal_media).
            images = resolver.describe_images(list(getattr(msg, 'images', ())) +
                                              list(getattr(msg, 'video_frames', ())))
            goal.model = engine.model_name
            goal.request = engine.prepare(to_request(
                msg, node.runtime.defaults, described.declared if described else None,
                goal_media(msg, images.declared) if images else ()))
        except BaseException:
            self.give_back(goal)
            raise
        # The frames are mapped on the worker, only while the goal runs (see embeddings.py).
        if goal.request.embeddings is not None:
            goal.embeddings = functools.partial(resolver.hold, described.descriptors)
        if images is not None:
            goal.images = functools.partial(resolver.hold_images, images.descriptors,
                                            len(getattr(msg, 'images', ())))
        goal.on_done = self.resolve
        return worker

    def refusal(self, exc: Exception, what: str) -> str:
        """Say why `what` could not take a request; log the failures that are not the request's.

        EngineError (a bad request, or e.g. a chat template the sandbox refused) and
        WorkerStoppedError are answers; anything else is a bug, logged with its traceback and
        answered too, so that one request never takes the node down.
        """
        node = self._node
        if isinstance(exc, (EngineError, WorkerStoppedError)):
            node.figures.invalid_request()
            return str(exc)
        node.get_logger().error(f'{what} failed unexpectedly: '
                                f'{"".join(traceback.format_exception(exc)).rstrip()}')
        return (f'{node.get_name()} {what} failed unexpectedly ({type(exc).__name__}: {exc}); '
                'see the node log')

    def submit(self, worker: EngineWorker, goal: NodeGoal) -> None:
        """Queue a prepared goal on its reserved slot; its end completes goal.done_future."""
        reserved, goal.reserved = goal.reserved, False
        try:
            worker.submit(goal, reserved=reserved)
        except (QueueFullError, WorkerStoppedError) as exc:
            # Deactivated or cleaned up between admission and now.
            goal.cancel_reason = CancelReason.DEACTIVATED
            goal.finish(error_result(str(exc)))
            self.resolve(goal)

    def resolve(self, goal: NodeGoal) -> None:
        """Wake the coroutine awaiting this goal's end (worker thread, or a canceller)."""
        self.wake(goal.done_future)

    def wake(self, future: Future) -> None:
        if not future.done():
            future.set_result(True)
        executor = self._node.executor
        if executor is not None:
            executor.wake()

    def stopped_message(self, reason: CancelReason) -> str:
        if reason is CancelReason.MODEL_UPDATE:
            return (f'{self._node.get_name()} updated its model: the goal still ran when '
                    'update.drain_timeout_s ran out; partial text kept (a retry runs on the '
                    'new model)')
        why = {CancelReason.DEACTIVATED: 'was deactivated',
               CancelReason.SHUTDOWN: 'is shutting down'}.get(reason, 'stopped the goal')
        return (f'{self._node.get_name()} {why} while the goal was waiting or running; partial '
                'text kept')

    # ---- holding requests through a model update ---------------------------------------------
    def hold(self, capacity: int) -> None:
        """Hold new requests (up to `capacity`) instead of queueing them on the worker."""
        with self._hold_lock:
            if self._held is None:
                self._held, self._hold_capacity = [], capacity

    def hold_waiting(self, worker: EngineWorker) -> None:
        """Hold the goals waiting in the worker's queue too, ahead of those held since."""
        with self._hold_lock:
            self._held[:0] = worker.take_waiting()
            for place, goal in enumerate(self._held, 1):
                if goal.on_feedback is not None:
                    goal.on_feedback(Feedback(queue_position=place))

    def _hold(self, goal: NodeGoal) -> None:
        self.give_back(goal)
        self._held.append(goal)
        if goal.on_feedback is not None:
            goal.on_feedback(Feedback(queue_position=len(self._held)))

    def cancel_held(self, goal: NodeGoal, reason: CancelReason) -> bool:
        """End a held goal as cancelled; False when it is not held."""
        with self._hold_lock:
            if self._held is None or goal not in self._held:
                return False
            self._held.remove(goal)
        goal.cancel_reason = reason
        goal.finish(cancelled_result())
        self.resolve(goal)
        return True

    def release_held(self) -> int:
        """Queue the held requests on the worker, each prepared for the model it now serves.

        A request the new model refuses (too long for its context, an image it cannot take)
        ends with that reason, as at admission. When the node no longer serves, each ends
        ABORTED with error_kind unavailable. Returns how many were held.
        """
        with self._hold_lock:
            held, self._held = self._held or [], None
            for goal in held:
                self._requeue(goal)
        return len(held)

    def _requeue(self, goal: NodeGoal) -> None:
        problem = self.admit(goal)
        if problem:
            goal.error_kind = Generate.Result.ERROR_UNAVAILABLE
            goal.finish(error_result(problem))
            self.resolve(goal)
            return
        try:
            worker = self.prepare(goal.msg, goal)
        except Exception as exc:  # noqa: B902 - every failure ends the goal with a message
            goal.error_kind = error_kind_of(exc)
            goal.finish(error_result(self.refusal(exc, 'a request held by a model update')))
            self.resolve(goal)
            return
        self.submit(worker, goal)

    def end_held(self, reason: CancelReason) -> None:
        """End every held request (the node shuts down while an update holds them)."""
        with self._hold_lock:
            held, self._held = self._held or [], None
        for goal in held:
            goal.cancel_reason = reason
            goal.finish(cancelled_result())
            self.resolve(goal)

    # ---- transcript, shutdown ----------------------------------------------------------------
    def publish_transcript(self, source: str, goal_id, request_msg, engine_request,
                           outcome_msg, accepted: bool, accepted_stamp=None,
                           error: str = '', model: str = '') -> None:
        """Publish one request's transcript; `model`: the one it ran on ('' = the node's)."""
        node = self._node
        engine = node.engine
        if not model and engine is not None:
            model = engine.model_name
        self._transcript_pub.publish(build_transcript(
            source, goal_id, request_msg, engine_request, outcome_msg, accepted=accepted,
            model=model,
            accepted_stamp=accepted_stamp, finished_stamp=node.get_clock().now().to_msg(),
            error=error))

    def token_strings(self, ids) -> list:
        """Token texts for logprobs ('' each when the engine cannot say, e.g. remote)."""
        try:
            return list(self._node.engine.token_strings(ids))
        except Exception:  # noqa: B902 - names are a courtesy: never fail a result for them
            return [''] * len(ids)

    def wait_requests_answered(self, timeout: float) -> bool:
        """Wait until no goal or ~/complete call is being answered (the executor spins)."""
        with self._answering:
            return self._answering.wait_for(lambda: self._answering_count == 0, timeout)

    @contextlib.contextmanager
    def answering_request(self) -> Iterator[None]:
        with self._answering:
            self._answering_count += 1
        try:
            yield
        finally:
            with self._answering:
                self._answering_count -= 1
                self._answering.notify_all()
