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
from typing import Any, Iterator

from rclpy.task import Future

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_ros.errors import EngineError
from edge_llm_ros.metrics import figures
from edge_llm_ros.nodes.messages import build_transcript, queue_order, to_request
from edge_llm_ros.qos import TRANSCRIPT_QOS
from edge_llm_ros.serving.goal import CancelReason, check_priority, error_result, Goal
from edge_llm_ros.serving.worker import EngineWorker, QueueFullError, WorkerStoppedError


@dataclass(eq=False)
class NodeGoal(Goal):
    """A Goal with its ROS glue (see the module docstring)."""

    stamp: Any = None                   # builtin_interfaces/Time of acceptance
    source: str = Transcript.SOURCE_ACTION
    done_future: Future = field(default_factory=Future, repr=False)
    # Done once rclpy has recorded an accepted client cancel (the goal is CANCELING).
    cancel_applied: Future = field(default_factory=Future, repr=False)
    # Generate.Result.ERROR_* decided at admission (invalid request), '' otherwise.
    error_kind: str = ''
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
        self._transcript_pub = node.create_publisher(Transcript, '~/transcript',
                                                     TRANSCRIPT_QOS)

    # ---- admission and validation ------------------------------------------------------------
    def admit(self) -> str:
        """Reserve a queue slot for a new request; return why not ('' when reserved)."""
        node = self._node
        worker = node.worker
        if worker is None or not worker.accepting:
            node.figures.goal_rejected(figures.REJECTED_NOT_ACTIVE)
            return (f'{node.get_name()} is {node.lifecycle_state()}, not active: activate it '
                    'with lifecycle change_state (or start it with autostart:=true)')
        if not worker.reserve():
            node.figures.goal_rejected(figures.REJECTED_QUEUE_FULL)
            return (f'queue full ({worker.queue_depth} goal(s) already wait behind the '
                    f'running one): retry later or raise ~/queue.depth')
        return ''

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
            images = resolver.describe_images(list(getattr(msg, 'images', ())))  # Generate only
            goal.request = engine.prepare(to_request(
                msg, node.runtime.defaults, described.declared if described else None,
                images.declared if images else ()))
        except BaseException:
            worker.unreserve()
            raise
        # The frames are mapped on the worker, only while the goal runs (see embeddings.py).
        if goal.request.embeddings is not None:
            goal.embeddings = functools.partial(resolver.hold, described.descriptors)
        if images is not None:
            goal.images = functools.partial(resolver.hold_images, images.descriptors)
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
        try:
            worker.submit(goal, reserved=True)
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
        why = {CancelReason.DEACTIVATED: 'was deactivated',
               CancelReason.SHUTDOWN: 'is shutting down'}.get(reason, 'stopped the goal')
        return (f'{self._node.get_name()} {why} while the goal was waiting or running; partial '
                'text kept')

    # ---- transcript, shutdown ----------------------------------------------------------------
    def publish_transcript(self, source: str, goal_id, request_msg, engine_request,
                           outcome_msg, accepted: bool, accepted_stamp=None,
                           error: str = '') -> None:
        node = self._node
        engine = node.engine
        self._transcript_pub.publish(build_transcript(
            source, goal_id, request_msg, engine_request, outcome_msg, accepted=accepted,
            model=engine.model_name if engine is not None else '',
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
