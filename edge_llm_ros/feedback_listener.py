"""Feedback listeners that outlive a goal's result: a workaround for rclpy's ActionClient.

Upstream behaviour (rclpy/action/client.py, ros2/rclpy, Humble and Jazzy alike):
`ActionClient.send_goal_async` stores the goal's feedback callback in `_feedback_callbacks`,
and `_get_result_async` adds `_remove_pending_result_request` as a done callback of the result
future; that function deletes the goal's entry from `_feedback_callbacks` as soon as the
result response arrives ("remove feedback_callback if user is aware of result and it's been
received"). `execute` then drops any later feedback message of the goal without a word.

But the result comes over a service and feedback over a topic: nothing orders them, so the
last feedback chunks of a stream can arrive just after the result, and LLMClient's stream
needs them. FeedbackListenersMixin keeps its own listeners until they are removed
explicitly (LLMClient removes a goal's once no feedback can still be due), and delivers each
feedback message to the goal's listener, or else to the callback rclpy still holds.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict

from rclpy.executors import await_or_execute


class FeedbackListenersMixin:
    """Put before rclpy's ActionClient in the bases: `class C(FeedbackListenersMixin, ...)`."""

    def __init__(self, *args, **kwargs) -> None:
        self._listeners_lock = threading.Lock()
        self._feedback_listeners: Dict[bytes, Callable[[Any], None]] = {}
        super().__init__(*args, **kwargs)

    def listen(self, goal_id: bytes, listener: Callable[[Any], None]) -> None:
        """Call `listener(feedback_message)` for `goal_id`'s feedback until `unlisten`."""
        with self._listeners_lock:
            self._feedback_listeners[goal_id] = listener

    def unlisten(self, goal_id: bytes) -> None:
        with self._listeners_lock:
            self._feedback_listeners.pop(goal_id, None)

    async def execute(self, taken_data) -> None:
        """Hand everything but feedback to the base class, then deliver the feedback.

        Feedback is delivered last and outside the base class's execute, so a subclass that
        serializes its bookkeeping under a lock never holds it while a callback runs.
        """
        feedback = taken_data.get('feedback')
        rest = {key: value for key, value in taken_data.items() if key != 'feedback'}
        if rest:
            await super().execute(rest)
        if feedback is None:
            return
        key = bytes(feedback.goal_id.uuid)
        with self._listeners_lock:
            callback = self._feedback_listeners.get(key)
        if callback is None:   # a goal sent with rclpy's own feedback_callback
            callback = self._feedback_callbacks.get(key)
        if callback is not None:
            await await_or_execute(callback, feedback)
