"""llm_node's ~/generate action: accept, queue, stream, cancel, answer.

The goal callback only admits a goal: it reserves its place in the queue (Admission.admit)
and answers ACCEPT or REJECT. The accepted callback that rclpy calls right after, with the
goal handle, validates and queues it (Admission.enqueue; an invalid request is ended at once
and aborted with its reason), so every feedback message is published straight from the
worker thread through the handle, in order. A reservation whose accepted callback never came
(rclpy failed to answer the goal) is given back at the next goal. The execute callback is a
coroutine that awaits the worker's result, so a waiting goal holds no executor thread. The
action server has its own mutually exclusive group: goals are admitted in arrival order,
and a cancel is fully recorded by rclpy before the goal's end is decided (see on_cancel).
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Dict, List, Optional, Tuple
import uuid

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.task import Future
from unique_identifier_msgs.msg import UUID

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_ros.metrics import figures
from edge_llm_ros.nodes.llm_admission import Admission, error_kind_of, NodeGoal
from edge_llm_ros.nodes.llm_window import fill_clip, window_ask, WindowCalls
from edge_llm_ros.nodes.messages import (error_kind, fill_result, ros_string, stopped_kind,
                                         tool_call_delta_msgs)
from edge_llm_ros.qos import FEEDBACK_QOS
from edge_llm_ros.runtime.types import StopReason
from edge_llm_ros.serving.goal import cancelled_result, CancelReason, error_result, Feedback


class GenerateServer:
    """The ~/generate action server of one llm_node."""

    def __init__(self, node: Any, admission: Admission) -> None:
        self._node = node
        self._admission = admission
        self._goals: Dict[bytes, NodeGoal] = {}   # accepted goals until their result is built
        # The goal on_goal admitted (its request message, its NodeGoal holding a reservation),
        # for the on_accepted call right after it: rclpy runs both in one task of this
        # server's mutually exclusive group, with no await in between, so no other goal's
        # callbacks come between the two.
        self._admitted: Optional[Tuple[Any, NodeGoal]] = None
        self._cancels_recorded: List[Future] = []   # see on_cancel
        self._cancels_lock = threading.Lock()
        self._group = MutuallyExclusiveCallbackGroup()
        self._server = ActionServer(
            node, Generate, '~/generate', execute_callback=self.execute,
            goal_callback=self.on_goal, handle_accepted_callback=self.on_accepted,
            cancel_callback=self.on_cancel,
            callback_group=self._group, feedback_pub_qos_profile=FEEDBACK_QOS)
        # In the action server's group: runs only after the cancel request that triggered it.
        self._cancels_recorded_gc = node.create_guard_condition(
            self._on_cancels_recorded, callback_group=self._group)
        # Goals that name a perception node's time window wait here for its frames.
        self._windows = WindowCalls(node, lambda: node.runtime.window_timeout_s)

    # ---- callbacks --------------------------------------------------------------------------
    def on_goal(self, msg: Generate.Goal) -> GoalResponse:
        """Admit a goal: reserve its place in the queue, or reject it (with the reason logged).

        An invalid request is accepted too, and aborted in on_accepted with its reason.
        """
        self._give_back_unclaimed()
        goal, problem = self._admit()
        if problem:
            self._node.get_logger().warn(f'goal rejected: {problem}')
            self._admission.publish_transcript(Transcript.SOURCE_ACTION, UUID(), msg, None,
                                               None, accepted=False, error=problem)
            return GoalResponse.REJECT
        self._admitted = (msg, goal)
        return GoalResponse.ACCEPT

    def _admit(self) -> Tuple[NodeGoal, str]:
        goal = NodeGoal(None, stamp=self._node.get_clock().now().to_msg())
        return goal, self._admission.admit(goal)

    def _give_back_unclaimed(self) -> None:
        """Give back the place of an admitted goal whose accepted callback never came."""
        pending, self._admitted = self._admitted, None
        if pending is not None:
            self._admission.give_back(pending[1])

    def on_accepted(self, goal_handle) -> None:
        """Validate and queue the goal admitted by on_goal; its execute coroutine awaits it."""
        msg = goal_handle.request
        pending, self._admitted = self._admitted, None
        if pending is not None and pending[0] is msg:
            goal = pending[1]
        else:   # not the goal on_goal admitted (cannot happen with rclpy's action server)
            if pending is not None:
                self._admission.give_back(pending[1])
            goal, problem = self._admit()
            if problem:
                goal.error_kind = Generate.Result.ERROR_UNAVAILABLE
                goal.finish(error_result(problem))
        goal.on_feedback = functools.partial(self._send_feedback, goal_handle)
        self._goals[bytes(goal_handle.goal_id.uuid)] = goal
        goal_handle.execute()
        if goal.done:
            self._admission.resolve(goal)
            return
        try:
            ask = window_ask(msg)
            if ask is not None:   # the clip is a perception node's window: ask it first
                self._check_video()
                self._windows.start(goal, ask, functools.partial(self._window_done, msg, goal,
                                                                 ask))
                return
        except Exception as exc:  # noqa: B902 - every failure aborts the goal with a message
            self._refuse(goal, exc)
            return
        # Queued last: the woken worker then never waits for the GIL while this thread still
        # publishes the EXECUTING status and schedules the execute coroutine.
        self._enqueue(msg, goal)

    def _enqueue(self, msg, goal: NodeGoal) -> None:
        try:
            self._admission.enqueue(msg, goal)
        except Exception as exc:  # noqa: B902 - every failure aborts the goal with a message
            self._refuse(goal, exc)

    def _refuse(self, goal: NodeGoal, exc: BaseException) -> None:
        """End an accepted goal that was never queued, with why (its place given back)."""
        self._admission.give_back(goal)
        goal.error_kind = error_kind_of(exc)
        goal.finish(error_result(self._admission.refusal(exc, '~/generate')))
        self._admission.resolve(goal)

    def _check_video(self) -> None:
        """Refuse a window for a model that takes no clip, before asking for any frame."""
        check = getattr(self._node.engine, 'check_video', None)   # a remote engine: its own
        if check is not None:
            check("the goal's video window")

    def _window_done(self, msg, goal: NodeGoal, ask, response, error) -> None:
        """Take the window's reply (or why none came) as the goal's clip, then queue the goal."""
        try:
            if error is not None:
                raise error
            fill_clip(msg, ask, response)
        except Exception as exc:  # noqa: B902 - every failure aborts the goal with a message
            self._refuse(goal, exc)
            return
        self._enqueue(msg, goal)

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
        self._stop(goal)
        return CancelResponse.ACCEPT

    def _stop(self, goal: NodeGoal) -> None:
        """Cancel a goal for its client, wherever it is: held by a model update, or queued."""
        if self._admission.cancel_held(goal, CancelReason.CLIENT):
            return
        if self._windows.cancel(goal):   # still waiting for its window: never queued
            self._admission.give_back(goal)
            goal.cancel_reason = CancelReason.CLIENT
            goal.finish(cancelled_result())
            self._admission.resolve(goal)
            return
        worker = self._node.worker
        if goal.request is not None and worker is not None:
            worker.cancel(goal, CancelReason.CLIENT)

    def _on_cancels_recorded(self) -> None:
        """Tell the goals whose cancel request rclpy has now recorded (see on_cancel)."""
        with self._cancels_lock:
            recorded, self._cancels_recorded = self._cancels_recorded, []
        for future in recorded:
            self._admission.wake(future)

    async def execute(self, goal_handle) -> Generate.Result:
        key = bytes(goal_handle.goal_id.uuid)
        goal = self._goals[key]
        with self._admission.answering_request():
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
        stopped = reason in (CancelReason.DEACTIVATED, CancelReason.SHUTDOWN,
                             CancelReason.MODEL_UPDATE)
        if result.stop_reason is StopReason.CANCELLED:
            if reason is CancelReason.CLIENT and goal_handle.is_cancel_requested:
                goal_handle.canceled()
                outcome = figures.CANCELED
            else:
                error = error or self._admission.stopped_message(reason)
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
        msg = fill_result(Generate.Result(), result, error, self._admission.token_strings,
                          error_kind(result, goal.error_kind or stopped_kind(reason), stopped,
                                     goal.refused))
        if outcome == figures.SUCCEEDED:
            self._ground(goal_handle, goal, msg)
        node.figures.goal_ended(outcome, msg.error_kind or msg.finish_reason, result,
                                time.monotonic() - goal.accepted_at, goal.queued)
        self._admission.publish_transcript(Transcript.SOURCE_ACTION, goal_handle.goal_id,
                                           goal_handle.request, goal.ran or goal.request, msg,
                                           accepted=True, accepted_stamp=goal.stamp,
                                           error=error, model=goal.model)
        return msg

    def _ground(self, goal_handle, goal: NodeGoal, msg: Generate.Result) -> None:
        """Give a grounding model's answer its detections, and publish them (llm_detections)."""
        detections = self._node.detections
        if detections is None or not detections.frame:
            return
        prepared = goal.ran or goal.request
        grounded = detections.ground(msg.text, getattr(prepared, 'image_sizes', ()),
                                     list(goal_handle.request.images))
        if not grounded:
            return
        goal_id = str(uuid.UUID(bytes=bytes(goal_handle.goal_id.uuid)))
        msg.detections = detections.result_detections(grounded, goal_id)
        detections.publish(grounded, goal_id)

    def _send_feedback(self, goal_handle, chunk: Feedback) -> None:
        """Publish one feedback message (worker thread)."""
        msg = Generate.Feedback(text_delta=ros_string(chunk.text_delta),
                                token_ids=list(chunk.token_ids),
                                completion_tokens=chunk.completion_tokens,
                                queue_position=chunk.queue_position,
                                reasoning_delta=ros_string(chunk.reasoning_delta),
                                tool_call_deltas=tool_call_delta_msgs(chunk.tool_call_deltas),
                                paused=chunk.paused)
        try:
            goal_handle.publish_feedback(msg)
        except Exception as exc:  # noqa: B902 - a lost feedback must not fail the generation
            node = self._node
            if node.context.ok():   # after Ctrl-C the context is gone first: nothing to say
                node.get_logger().warn(f'feedback not published: {exc}',
                                       throttle_duration_sec=5.0)
