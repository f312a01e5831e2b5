"""llm_node's request front: the ~/generate action, ~/complete and ~/transcript.

How a goal is refused:
- Not active, or the queue is full: the goal is REJECTED (rclpy cannot attach a reason to a
  rejection), the reason is logged, counted in /diagnostics and published on ~/transcript.
- Anything wrong with the request itself (empty prompt, unknown role, bad sampling value,
  invalid JSON schema, a priority out of range, too long for the context, unresolvable tensor
  handle): the goal is ACCEPTED and ABORTED at once with finish_reason 'error' and an
  error_message saying what to fix, so the client gets the reason. It gives its reserved
  queue slot back at once.
Defaults: SamplingParams fields at UNSET take ~/sampling.*, max_tokens 0 takes ~/max_tokens,
an empty system_prompt takes ~/system_prompt. A max_tokens that does not fit in the context
after the prompt is an error, not clamped: the caller asked for more than can be delivered.

One goal is one NodeGoal from acceptance to result: the serving Goal (serving/goal.py: the
prepared request, priority, cancel flag, Output) plus what ROS needs to answer it (the
futures the execute coroutine awaits, the acceptance stamp, the error kind decided here).

Threading: a goal is validated once (Engine.prepare) and queued in the action's accepted
callback; its execute callback and ~/complete are coroutines that await the worker's result,
so a waiting request holds no executor thread; feedback is published from the worker thread.
The action server has its own mutually exclusive group (goals are admitted in arrival order,
and a cancel is fully recorded by rclpy before the goal's end is decided, see on_cancel);
~/complete is reentrant.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
import functools
import threading
import time
import traceback
from typing import Any, Dict, Iterator, List
import uuid

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.task import Future
from unique_identifier_msgs.msg import UUID

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_msgs.srv import Complete
from edge_llm_ros.errors import EngineError
from edge_llm_ros.metrics import figures
from edge_llm_ros.nodes.messages import (build_transcript, error_kind, fill_result,
                                         queue_order, to_request, tool_call_delta_msgs)
from edge_llm_ros.qos import FEEDBACK_QOS, TRANSCRIPT_QOS
from edge_llm_ros.runtime.types import GenerationResult, StopReason
from edge_llm_ros.serving.goal import (CancelReason, check_priority, error_result, Feedback,
                                       Goal)
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


class GenerateServer:
    """Admission, validation, queueing and answers of ~/generate and ~/complete."""

    def __init__(self, node: Any) -> None:
        self._node = node
        self._goals: Dict[bytes, NodeGoal] = {}   # accepted goals until their result is built
        self._cancels_recorded: List[Future] = []   # see on_cancel
        self._cancels_lock = threading.Lock()
        self._answering = threading.Condition()   # see wait_requests_answered
        self._answering_count = 0
        self._action_group = MutuallyExclusiveCallbackGroup()
        self._complete_group = ReentrantCallbackGroup()
        self._server = ActionServer(
            node, Generate, '~/generate', execute_callback=self.execute,
            goal_callback=self.on_goal, handle_accepted_callback=self.on_accepted,
            cancel_callback=self.on_cancel,
            callback_group=self._action_group, feedback_pub_qos_profile=FEEDBACK_QOS)
        # In the action server's group: runs only after the cancel request that triggered it.
        self._cancels_recorded_gc = node.create_guard_condition(
            self._on_cancels_recorded, callback_group=self._action_group)
        self._complete_srv = node.create_service(
            Complete, '~/complete', self.on_complete, callback_group=self._complete_group)
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
            goal.request = engine.prepare(to_request(msg, node.runtime.defaults,
                                                     resolver.describe(handles)))
        except BaseException:
            worker.unreserve()
            raise
        # The frames are mapped on the worker, only while the goal runs (see embeddings.py).
        if goal.request.embeddings is not None:
            goal.embeddings = functools.partial(resolver.hold, handles)
        goal.on_done = self._resolve
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

    def _submit(self, worker: EngineWorker, goal: NodeGoal) -> None:
        """Queue a prepared goal on its reserved slot; its end completes goal.done_future."""
        try:
            worker.submit(goal, reserved=True)
        except (QueueFullError, WorkerStoppedError) as exc:
            # Deactivated or cleaned up between admission and now.
            goal.cancel_reason = CancelReason.DEACTIVATED
            goal.finish(error_result(str(exc)))
            self._resolve(goal)

    def _resolve(self, goal: NodeGoal) -> None:
        """Wake the coroutine awaiting this goal's end (worker thread, or a canceller)."""
        self._set(goal.done_future)

    def _set(self, future: Future) -> None:
        if not future.done():
            future.set_result(True)
        executor = self._node.executor
        if executor is not None:
            executor.wake()

    # ---- the action --------------------------------------------------------------------------
    def on_goal(self, goal: Generate.Goal) -> GoalResponse:
        problem = self.admit()
        if not problem:
            return GoalResponse.ACCEPT
        self._node.get_logger().warn(f'goal rejected: {problem}')
        self.publish_transcript(Transcript.SOURCE_ACTION, UUID(), goal, None, None,
                                accepted=False, error=problem)
        return GoalResponse.REJECT

    def on_accepted(self, goal_handle) -> None:
        """Validate and queue the goal at once, then let its execute coroutine await it.

        Runs right after the goal response is sent, so the worker can start before the
        execute coroutine runs (one executor hop less to the first token). The goal is queued
        last: the woken worker then never waits for the GIL while this executor thread still
        publishes the EXECUTING status and schedules the coroutine.
        """
        goal = NodeGoal(None, stamp=self._node.get_clock().now().to_msg())
        self._goals[bytes(goal_handle.goal_id.uuid)] = goal
        goal_handle.execute()
        try:
            worker = self.prepare(goal_handle.request, goal)
        except Exception as exc:  # noqa: B902 - every failure aborts the goal with a message
            goal.error_kind = error_kind_of(exc)
            goal.finish(error_result(self.refusal(exc, '~/generate')))
            self._resolve(goal)
        else:
            goal.on_feedback = functools.partial(self._send_feedback, goal_handle)
            self._submit(worker, goal)

    def on_cancel(self, goal_handle) -> CancelResponse:
        """Accept every cancel request and stop the goal.

        rclpy marks the goal CANCELING only after this returns, and the goal can end before
        that (at once when it was still queued): execute then awaits cancel_applied, which
        _on_cancels_recorded resolves. That callback shares the action server's mutually
        exclusive group, so it runs only once this cancel request has been handled in full.
        A goal that already ended just keeps its terminal state.
        """
        goal = self._goals.get(bytes(goal_handle.goal_id.uuid))
        if goal is None:
            return CancelResponse.ACCEPT
        with self._cancels_lock:
            self._cancels_recorded.append(goal.cancel_applied)
        self._cancels_recorded_gc.trigger()
        worker = self._node.worker
        if goal.request is not None and worker is not None:
            worker.cancel(goal, CancelReason.CLIENT)
        return CancelResponse.ACCEPT

    def _on_cancels_recorded(self) -> None:
        """Tell the goals whose cancel request rclpy has now recorded (see on_cancel)."""
        with self._cancels_lock:
            recorded, self._cancels_recorded = self._cancels_recorded, []
        for future in recorded:
            self._set(future)

    async def execute(self, goal_handle) -> Generate.Result:
        key = bytes(goal_handle.goal_id.uuid)
        goal = self._goals[key]
        with self.answering_request():
            try:
                await goal.done_future
                if goal.cancel_reason is CancelReason.CLIENT:
                    await goal.cancel_applied   # the goal is CANCELING from here on
            finally:
                self._goals.pop(key, None)
            return self._finish_goal(goal_handle, goal)

    def _finish_goal(self, goal_handle, goal: NodeGoal) -> Generate.Result:
        """Set the goal's terminal state and build its result (and transcript)."""
        node = self._node
        result, reason = goal.result, goal.cancel_reason
        error = result.error
        stopped = reason in (CancelReason.DEACTIVATED, CancelReason.SHUTDOWN)
        if result.stop_reason is StopReason.CANCELLED:
            if reason is CancelReason.CLIENT and goal_handle.is_cancel_requested:
                goal_handle.canceled()
                outcome = figures.CANCELED
            else:
                error = error or self.stopped_message(reason)
                stopped = True
                goal_handle.abort()
                outcome = figures.ABORTED
        elif result.stop_reason is StopReason.ERROR:
            goal_handle.abort()
            outcome = figures.ABORTED
        else:
            goal_handle.succeed()
            outcome = figures.SUCCEEDED
        if error:
            node.get_logger().warn(f'goal aborted: {error}')
        msg = fill_result(Generate.Result(), result, error, self._token_strings,
                          error_kind(result, goal.error_kind, stopped))
        node.figures.goal_ended(outcome, msg.error_kind or msg.finish_reason, result,
                                time.monotonic() - goal.accepted_at, goal.queued)
        self.publish_transcript(Transcript.SOURCE_ACTION, goal_handle.goal_id,
                                goal_handle.request, goal.request, msg, accepted=True,
                                accepted_stamp=goal.stamp, error=error)
        return msg

    def stopped_message(self, reason: CancelReason) -> str:
        why = {CancelReason.DEACTIVATED: 'was deactivated',
               CancelReason.SHUTDOWN: 'is shutting down'}.get(reason, 'stopped the goal')
        return (f'{self._node.get_name()} {why} while the goal was waiting or running; partial '
                'text kept')

    def _send_feedback(self, goal_handle, chunk: Feedback) -> None:
        """Publish one feedback message (worker thread)."""
        msg = Generate.Feedback(text_delta=chunk.text_delta, token_ids=list(chunk.token_ids),
                                completion_tokens=chunk.completion_tokens,
                                queue_position=chunk.queue_position,
                                reasoning_delta=chunk.reasoning_delta,
                                tool_call_deltas=tool_call_delta_msgs(chunk.tool_call_deltas),
                                paused=chunk.paused)
        try:
            goal_handle.publish_feedback(msg)
        except Exception as exc:  # noqa: B902 - a lost feedback must not fail the generation
            node = self._node
            if node.context.ok():   # after Ctrl-C the context is gone first: nothing to say
                node.get_logger().warn(f'feedback not published: {exc}',
                                       throttle_duration_sec=5.0)

    # ---- ~/complete ----------------------------------------------------------------------------
    async def on_complete(self, request: Complete.Request,
                          response: Complete.Response) -> Complete.Response:
        with self.answering_request():
            try:
                return await self._complete(request, response)
            except Exception as exc:  # noqa: B902 - a service must answer, never end the process
                response.success = False
                response.error_message = self.refusal(exc, '~/complete')
                return response

    async def _complete(self, request: Complete.Request,
                        response: Complete.Response) -> Complete.Response:
        node = self._node
        goal = NodeGoal(None, stamp=node.get_clock().now().to_msg(),
                        source=Transcript.SOURCE_SERVICE)
        goal_id = UUID(uuid=list(uuid.uuid4().bytes))
        problem = self.admit()
        if problem:
            node.get_logger().warn(f'complete refused: {problem}')
            worker = node.worker
            kind = (Generate.Result.ERROR_QUEUE_FULL if worker is not None and worker.accepting
                    else Generate.Result.ERROR_UNAVAILABLE)
            return self._finish_service(response, goal_id, request, goal,
                                        error_result(problem), accepted=False, kind=kind)
        try:
            worker = self.prepare(request, goal)
        except Exception as exc:  # noqa: B902 - answered with the message (see refusal)
            return self._finish_service(response, goal_id, request, goal,
                                        error_result(self.refusal(exc, '~/complete')),
                                        kind=error_kind_of(exc))
        self._submit(worker, goal)
        await goal.done_future
        result = goal.result
        if result.stop_reason is StopReason.CANCELLED and not result.error:
            result = replace(result, error=self.stopped_message(goal.cancel_reason))
        stopped = goal.cancel_reason is not CancelReason.NONE
        return self._finish_service(response, goal_id, request, goal, result,
                                    kind=error_kind(result, '', stopped))

    def _finish_service(self, response, goal_id, request, goal: NodeGoal,
                        result: GenerationResult, accepted: bool = True,
                        kind: str = '') -> Complete.Response:
        fill_result(response, result, token_strings=self._token_strings, kind=kind)
        response.success = result.stop_reason in (StopReason.STOP, StopReason.LENGTH,
                                                  StopReason.TOOL_CALLS)
        if accepted:
            self._node.figures.goal_ended(
                figures.SUCCEEDED if response.success else figures.ABORTED,
                response.error_kind or response.finish_reason, result,
                time.monotonic() - goal.accepted_at, goal.queued)
        self.publish_transcript(Transcript.SOURCE_SERVICE, goal_id, request, goal.request,
                                response, accepted=accepted, accepted_stamp=goal.stamp,
                                error=response.error_message)
        return response

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

    def _token_strings(self, ids) -> list:
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
