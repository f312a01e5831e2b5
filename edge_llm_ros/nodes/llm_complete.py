"""llm_node's ~/complete service: one-shot generation through the same queue as the action.

The callback is a coroutine that awaits the goal's end, so a queued call holds no executor
thread; it is in a reentrant group, and it always answers (an unexpected failure is logged
and answered, see Admission.refusal).
"""
from __future__ import annotations

from dataclasses import replace
import time
from typing import Any
import uuid

from rclpy.callback_groups import ReentrantCallbackGroup
from unique_identifier_msgs.msg import UUID

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_msgs.srv import Complete
from edge_llm_ros.metrics import figures
from edge_llm_ros.nodes.llm_admission import Admission, error_kind_of, NodeGoal
from edge_llm_ros.nodes.messages import error_kind, fill_result, stopped_kind
from edge_llm_ros.runtime.types import GenerationResult, StopReason
from edge_llm_ros.serving.goal import CancelReason, error_result


class CompleteService:
    """The ~/complete service of one llm_node."""

    def __init__(self, node: Any, admission: Admission) -> None:
        self._node = node
        self._admission = admission
        self._group = ReentrantCallbackGroup()
        self._srv = node.create_service(Complete, '~/complete', self.on_complete,
                                        callback_group=self._group)

    # ---- the call ----------------------------------------------------------------------------
    async def on_complete(self, request: Complete.Request,
                          response: Complete.Response) -> Complete.Response:
        with self._admission.answering_request():
            try:
                return await self._complete(request, response)
            except Exception as exc:  # noqa: B902 - a service must answer, never end the process
                response.success = False
                response.error_message = self._admission.refusal(exc, '~/complete')
                return response

    async def _complete(self, request: Complete.Request,
                        response: Complete.Response) -> Complete.Response:
        node = self._node
        goal = NodeGoal(None, stamp=node.get_clock().now().to_msg())
        goal_id = UUID(uuid=list(uuid.uuid4().bytes))
        problem = self._admission.admit(goal)
        if problem:
            node.get_logger().warn(f'complete refused: {problem}')
            worker = node.worker
            kind = (Generate.Result.ERROR_QUEUE_FULL if worker is not None and worker.accepting
                    else Generate.Result.ERROR_UNAVAILABLE)
            return self._finish_service(response, goal_id, request, goal,
                                        error_result(problem), accepted=False, kind=kind)
        try:
            self._admission.enqueue(request, goal)
        except Exception as exc:  # noqa: B902 - answered with the message (see refusal)
            return self._finish_service(response, goal_id, request, goal,
                                        error_result(self._admission.refusal(exc, '~/complete')),
                                        kind=error_kind_of(exc))
        await goal.done_future
        result = goal.result
        if result.stop_reason is StopReason.CANCELLED and not result.error:
            result = replace(result, error=self._admission.stopped_message(goal.cancel_reason))
        stopped = goal.cancel_reason is not CancelReason.NONE
        known = goal.error_kind or stopped_kind(goal.cancel_reason)
        return self._finish_service(response, goal_id, request, goal, result,
                                    kind=error_kind(result, known, stopped, goal.refused))

    def _finish_service(self, response, goal_id, request, goal: NodeGoal,
                        result: GenerationResult, accepted: bool = True,
                        kind: str = '') -> Complete.Response:
        fill_result(response, result, token_strings=self._admission.token_strings, kind=kind)
        response.success = result.stop_reason in (StopReason.STOP, StopReason.LENGTH,
                                                  StopReason.TOOL_CALLS)
        if accepted:
            self._node.figures.goal_ended(
                figures.SUCCEEDED if response.success else figures.ABORTED,
                response.error_kind or response.finish_reason, result,
                time.monotonic() - goal.accepted_at, goal.queued)
        self._admission.publish_transcript(Transcript.SOURCE_SERVICE, goal_id, request,
                                           goal.ran or goal.request, response, accepted=accepted,
                                           accepted_stamp=goal.stamp,
                                           error=response.error_message, model=goal.model)
        return response
