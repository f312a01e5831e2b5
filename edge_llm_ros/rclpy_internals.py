"""The private rclpy members this package relies on, in one place.

Each use names the rclpy branches it was checked against (Humble and Jazzy, the commits of
the API extracts in test/data/rclpy_api) and test/test_rclpy_internals.py fails when a member
disappears or its signature changes.

PRIVATE_MEMBERS lists every such member: where it is (module.Class.member), what kind it is
(a method, or an instance attribute the JSON extracts cannot show), the signature (methods:
inspect.signature on the installed Jazzy rclpy) or the shape (attributes) the code expects,
the rclpy commits it was read at, and why the package needs it. Every function and class
below that touches one names its entry in the docstring. No other module of edge_llm_ros may
touch a private rclpy member (test_rclpy_internals checks that too): add a helper here.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from rclpy.action import ActionClient
from rclpy.action.client import ClientGoalHandle
from rclpy.executors import await_or_execute, Executor
from rclpy.task import Future


@dataclass(frozen=True)
class RclpyCommit:
    """One rclpy source the members were read at (test/data/rclpy_api/<branch>.json)."""

    branch: str
    version: str      # rclpy/package.xml at the commit
    commit: str


HUMBLE = RclpyCommit('humble', '3.3.15', 'b488272b1ba88c703080bfd605417f013697ee40')
JAZZY = RclpyCommit('jazzy', '7.1.3', '85415f713bf7f03152799496dc4287a75df1fc36')
# Signatures were recorded on the installed Jazzy rclpy (7.1.6); the JSON commits above give
# the range the members' existence and behaviour were read in.
CHECKED = (HUMBLE, JAZZY)

METHOD = 'method'
ATTRIBUTE = 'attribute'   # set in __init__: absent from the extracts, checked at run time


@dataclass(frozen=True)
class PrivateMember:
    """One rclpy member the package relies on beyond rclpy's public API."""

    where: str            # module.Class.member, Class the one defining it
    kind: str             # METHOD or ATTRIBUTE
    why: str
    signature: str = ''   # METHOD: str(inspect.signature(...)) on the installed rclpy
    shape: str = ''       # ATTRIBUTE: the type and contents the code expects
    checked: Tuple[RclpyCommit, ...] = CHECKED

    @property
    def owner(self) -> str:
        """Return the qualified name of the class that defines the member."""
        return self.where.rpartition('.')[0]

    @property
    def name(self) -> str:
        return self.where.rpartition('.')[2]


_CLIENT = 'rclpy.action.client.ActionClient'
GET_RESULT_ASYNC = PrivateMember(
    f'{_CLIENT}._get_result_async', METHOD, signature='(self, goal_handle)',
    why='ClientGoalHandle.get_result_async calls it; it sends the request before '
        'registering the future (ros2/rclpy#1123): LockedActionClient locks it.')
CANCEL_GOAL_ASYNC = PrivateMember(
    f'{_CLIENT}._cancel_goal_async', METHOD, signature='(self, goal_handle)',
    why='ClientGoalHandle.cancel_goal_async calls it; same race as _get_result_async: '
        'LockedActionClient locks it.')
REMOVE_PENDING_GOAL_REQUEST = PrivateMember(
    f'{_CLIENT}._remove_pending_goal_request', METHOD, signature='(self, future)',
    why='Done callback of goal futures, runs on executor threads: LockedActionClient locks '
        'it; accepted_goal_handle calls it to drop a goal request whose response was lost.')
REMOVE_PENDING_CANCEL_REQUEST = PrivateMember(
    f'{_CLIENT}._remove_pending_cancel_request', METHOD, signature='(self, future)',
    why='Done callback of cancel futures, runs on executor threads: LockedActionClient '
        'locks it.')
REMOVE_PENDING_RESULT_REQUEST = PrivateMember(
    f'{_CLIENT}._remove_pending_result_request', METHOD, signature='(self, future)',
    why='Done callback of result futures: LockedActionClient locks it. It also deletes the '
        "goal's _feedback_callbacks entry, which FeedbackListenersMixin works around.")
EXECUTE = PrivateMember(
    f'{_CLIENT}.execute', METHOD, signature='(self, taken_data)',
    shape="taken_data: the dict take_data builds, keys 'goal', 'cancel', 'result', "
          "'feedback', 'status' (each present only when taken)",
    why='Public, but LockedActionClient and FeedbackListenersMixin override it and read '
        "take_data's private dict layout: the 'feedback' and 'status' keys.")
FEEDBACK_CALLBACKS = PrivateMember(
    f'{_CLIENT}._feedback_callbacks', ATTRIBUTE,
    shape='dict: goal id bytes -> the feedback_callback given to send_goal_async',
    why="FeedbackListenersMixin.execute delivers feedback of goals sent with rclpy's own "
        'feedback_callback from it, as the base execute would.')
FUTURES = PrivateMember(
    'rclpy.waitable.Waitable._futures', ATTRIBUTE,
    shape='list of rclpy.task.Future, appended by add_future, removed by remove_future',
    why='The executor walks waitable._futures outside any lock while done callbacks remove '
        'from it: LockedActionClient.add_future/remove_future replace the list (copy on '
        'write) so that walk never skips an entry.')
CLIENT_GOAL_HANDLE_INIT = PrivateMember(
    'rclpy.action.client.ClientGoalHandle.__init__', METHOD,
    signature='(self, action_client, goal_id, goal_response)',
    why='Only rclpy builds ClientGoalHandles (from the goal response); accepted_goal_handle '
        'builds one for an accepted goal whose response never arrived.')
STATE_MACHINE = PrivateMember(
    'rclpy.lifecycle.node.LifecycleNodeMixin._state_machine', ATTRIBUTE,
    shape='rcl LifecycleStateMachine; current_state is an (id: int, label: str) pair',
    why="rclpy has no public getter of a lifecycle node's own state: lifecycle_state reads "
        'it as LifecycleNodeMixin does to answer ~/get_state.')
THREAD_POOL = PrivateMember(
    'rclpy.executors.MultiThreadedExecutor._executor', ATTRIBUTE,
    shape='concurrent.futures.ThreadPoolExecutor running the callbacks',
    why='MultiThreadedExecutor.shutdown joins its pool only since ros2/rclpy#1309 (Jazzy '
        '7.1.8): executor_thread_pool hands it out so shutdown can wait for the callbacks.')
PARAMETER_OVERRIDES = PrivateMember(
    'rclpy.node.Node._parameter_overrides', ATTRIBUTE,
    shape='dict: parameter name -> rclpy.parameter.Parameter, every override that applies to '
          'the node (-p arguments, params files, parameter_overrides=), declared or not',
    why='rclpy keeps overrides of undeclared names without a word and has no public getter '
        'of them: parameter_override_names lets the nodes refuse a misspelled parameter.')

PRIVATE_MEMBERS: Tuple[PrivateMember, ...] = (
    GET_RESULT_ASYNC, CANCEL_GOAL_ASYNC, REMOVE_PENDING_GOAL_REQUEST,
    REMOVE_PENDING_CANCEL_REQUEST, REMOVE_PENDING_RESULT_REQUEST, EXECUTE, FEEDBACK_CALLBACKS,
    FUTURES, CLIENT_GOAL_HANDLE_INIT, STATE_MACHINE, THREAD_POOL, PARAMETER_OVERRIDES)


# Entry: rclpy.lifecycle.node.LifecycleNodeMixin._state_machine (STATE_MACHINE).
def lifecycle_state(node: Any) -> str:
    """Return a lifecycle node's current state label ('unconfigured', 'configuring', ...).

    rclpy has no public getter: LifecycleNodeMixin keeps the rcl state machine in
    `_state_machine` and reads `current_state` (an (id, label) pair) itself to answer
    ~/get_state. Checked: rclpy humble and jazzy (rclpy/lifecycle/node.py).
    """
    return node._state_machine.current_state[1]


def parameter_override_names(node: Any) -> Tuple[str, ...]:
    """Return the names of every parameter override given to a node, declared or not.

    Node.__init__ keeps them in `_parameter_overrides` (humble and jazzy, rclpy/node.py):
    the global and node-specific arguments' values, then the parameter_overrides argument.
    Entry: rclpy.node.Node._parameter_overrides (PARAMETER_OVERRIDES).
    """
    return tuple(node._parameter_overrides)


def executor_thread_pool(executor: Executor) -> Optional[ThreadPoolExecutor]:
    """Return a MultiThreadedExecutor's callback thread pool (None for other executors).

    Entry: rclpy.executors.MultiThreadedExecutor._executor (THREAD_POOL).
    """
    pool = getattr(executor, '_executor', None)
    return pool if isinstance(pool, ThreadPoolExecutor) else None


def accepted_goal_handle(client: ActionClient, goal_future: Future, goal_id: Any,
                         action_type: Any) -> ClientGoalHandle:
    """Return the handle of a goal the server accepted but whose goal response was lost.

    The pending goal request is dropped first, so a response arriving after all is ignored
    (rclpy logs 'Ignoring unexpected goal response') instead of completing `goal_future`.
    `goal_id` is the goal's unique_identifier_msgs UUID, `action_type` the action (Generate).
    Entries: rclpy.action.client.ActionClient._remove_pending_goal_request
    (REMOVE_PENDING_GOAL_REQUEST), rclpy.action.client.ClientGoalHandle.__init__
    (CLIENT_GOAL_HANDLE_INIT).
    """
    client._remove_pending_goal_request(goal_future)
    response = action_type.Impl.SendGoalService.Response(accepted=True)
    return ClientGoalHandle(client, goal_id, response)


class LockedActionClient(ActionClient):
    """rclpy's ActionClient with its request bookkeeping made thread-safe (ros2/rclpy#1123).

    Jazzy's ActionClient sends a goal/result/cancel request and only then registers the
    future awaiting its response; when an executor thread processes the response in between,
    the response is dropped ('Ignoring unexpected goal response') and the goal hangs forever.
    As upstream's fix does, one lock covers sending+registering (all three request kinds),
    taking the responses and status out of the bookkeeping in `execute`, and the removal of
    finished requests (done callbacks that run concurrently on other executor threads).
    Nothing that can suspend runs under the lock: feedback never reaches this `execute`
    (put FeedbackListenersMixin before this class in the bases: it takes the feedback first
    and calls its callbacks unlocked).

    It also reports every status update of a watched goal (`watch`), which GenerationHandle
    uses to notice a result or goal response that never arrived.
    Entries: GET_RESULT_ASYNC, CANCEL_GOAL_ASYNC, REMOVE_PENDING_GOAL_REQUEST,
    REMOVE_PENDING_CANCEL_REQUEST, REMOVE_PENDING_RESULT_REQUEST, FUTURES, EXECUTE.
    """

    def __init__(self, *args, **kwargs) -> None:
        self._request_lock = threading.RLock()
        self._status_listeners: Dict[bytes, Callable[[int], None]] = {}
        super().__init__(*args, **kwargs)

    # ---- requests (user and executor threads) ------------------------------------------------
    def send_goal_async(self, *args, **kwargs):
        """Lock rclpy's public send_goal_async: it registers its future after sending too."""
        with self._request_lock:
            return super().send_goal_async(*args, **kwargs)

    def _get_result_async(self, goal_handle):
        """Lock it. Entry: rclpy.action.client.ActionClient._get_result_async."""
        with self._request_lock:
            return super()._get_result_async(goal_handle)

    def _cancel_goal_async(self, goal_handle):
        """Lock it. Entry: rclpy.action.client.ActionClient._cancel_goal_async."""
        with self._request_lock:
            return super()._cancel_goal_async(goal_handle)

    def _remove_pending_goal_request(self, future) -> None:
        """Lock it. Entry: rclpy.action.client.ActionClient._remove_pending_goal_request."""
        with self._request_lock:
            super()._remove_pending_goal_request(future)

    def _remove_pending_cancel_request(self, future) -> None:
        """Lock it. Entry: rclpy.action.client.ActionClient._remove_pending_cancel_request."""
        with self._request_lock:
            super()._remove_pending_cancel_request(future)

    def _remove_pending_result_request(self, future) -> None:
        """Lock it. Entry: rclpy.action.client.ActionClient._remove_pending_result_request."""
        with self._request_lock:
            super()._remove_pending_result_request(future)

    # The executor walks `_futures` (to hand them its reference) outside any lock while done
    # callbacks remove from it: copy on write, so that walk never skips an entry.
    def add_future(self, future) -> None:
        """Entry: rclpy.waitable.Waitable._futures (FUTURES), replaced, never mutated."""
        with self._request_lock:
            self._futures = self._futures + [future]

    def remove_future(self, future) -> None:
        """Entry: rclpy.waitable.Waitable._futures (FUTURES), replaced, never mutated."""
        with self._request_lock:
            self._futures = [f for f in self._futures if f is not future]

    # ---- responses (executor threads) --------------------------------------------------------
    async def execute(self, taken_data) -> None:
        """Take responses and status under the lock, then report statuses to watchers.

        Entry EXECUTE: rclpy.action.client.ActionClient.execute (taken_data's keys).
        """
        with self._request_lock:
            # Without feedback, the base execute never awaits: it completes right here.
            await super().execute(taken_data)
        if 'status' in taken_data:
            for status in taken_data['status'].status_list:
                listener = self._status_listeners.get(bytes(status.goal_info.goal_id.uuid))
                if listener is not None:
                    listener(status.status)

    def watch(self, goal_id: bytes, listener: Callable[[int], None]) -> None:
        """Call `listener(status)` for each status the server publishes for `goal_id`."""
        self._status_listeners[goal_id] = listener

    def unwatch(self, goal_id: bytes) -> None:
        self._status_listeners.pop(goal_id, None)


class FeedbackListenersMixin:
    """Feedback listeners that outlive a goal's result: a workaround for rclpy's ActionClient.

    Put before rclpy's ActionClient in the bases: `class C(FeedbackListenersMixin, ...)`.

    Upstream behaviour (rclpy/action/client.py, Humble and Jazzy alike):
    `ActionClient.send_goal_async` stores the goal's feedback callback in
    `_feedback_callbacks`, and `_get_result_async` adds `_remove_pending_result_request` as a
    done callback of the result future; that function deletes the goal's entry from
    `_feedback_callbacks` as soon as the result response arrives ("remove feedback_callback
    if user is aware of result and it's been received"). `execute` then drops any later
    feedback message of the goal without a word.

    But the result comes over a service and feedback over a topic: nothing orders them, so
    the last feedback chunks of a stream can arrive just after the result, and LLMClient's
    stream needs them. This mixin keeps its own listeners until they are removed explicitly
    (LLMClient removes a goal's once no feedback can still be due), and delivers each
    feedback message to the goal's listener, or else to the callback rclpy still holds.
    Entries: rclpy.action.client.ActionClient._feedback_callbacks (FEEDBACK_CALLBACKS),
    rclpy.action.client.ActionClient.execute (EXECUTE).
    """

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
        Entries: rclpy.action.client.ActionClient.execute (EXECUTE: the 'feedback' key),
        rclpy.action.client.ActionClient._feedback_callbacks (FEEDBACK_CALLBACKS).
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
