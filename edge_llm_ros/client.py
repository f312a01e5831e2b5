"""LLMClient: call llm_node's ~/generate action from robot code, streaming or not.

    client = LLMClient(node)                       # node: any rclpy Node
    client.wait_until_active(timeout=60.0)         # the model is loaded (NodeNotActiveError)
    handle = client.generate('What color is the sky?', temperature=0.0)
    for delta in handle:                           # text as it streams
        print(delta, end='', flush=True)
    outcome = handle.result(timeout=30.0)          # GenerationOutcome (text, timings, ...)

Spinning: if `node` is in no executor when the client is made, the client adds it to a
private one and its blocking calls (`result`, iteration, `wait_for_server`,
`wait_until_active`, `complete`) spin it while they wait. If it is (the usual robot node
spinning in a MultiThreadedExecutor on another thread), they only wait: never call them from
a callback of a single-threaded executor that spins the same node (it would wait for
itself); use `add_done_callback` there instead.

Telling refusals apart (docs/interfaces.md): rclpy cannot carry a reason with a rejection,
so on a rejected goal the client asks the node's lifecycle state (~/get_state) and raises
QueueFullError (it is active: its queue is full) or NodeInactiveError (it is not active),
both GoalRejectedError. A request the node finds invalid is accepted and aborted with
finish_reason 'error', error_kind 'invalid_request' and an error_message saying what to fix:
`outcome.raise_for_error()` turns that into InvalidGoalError.
"""
from __future__ import annotations

from dataclasses import dataclass
import json
import threading
import time
from typing import (Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple)
import uuid

from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import State
from lifecycle_msgs.srv import GetState
import numpy as np
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from unique_identifier_msgs.msg import UUID

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import ChatMessage, LoraScale, SamplingParams, Timings, ToolSpec
from edge_llm_msgs.srv import (Complete, Detokenize, Embed, GetModelInfo, GetSession,
                               ListAdapters, ListSessions, Rerank, ResetSession, Tokenize,
                               WarmPrompt)
from edge_llm_ros.embed_reply import EmbedReplyError, EmbedReplyReader
from edge_llm_ros.lifecycle_state import LifecycleStateError, wait_for_state
from edge_llm_ros.qos import FEEDBACK_QOS
from edge_llm_ros.rclpy_internals import (accepted_goal_handle, FeedbackListenersMixin,
                                          LockedActionClient)

# After the result arrives, how long to wait for feedback still in flight (topic vs service).
FEEDBACK_GRACE_S = 1.0
SAMPLING_FIELDS = ('temperature', 'top_k', 'top_p', 'min_p', 'repetition_penalty',
                   'presence_penalty', 'frequency_penalty', 'seed', 'top_logprobs',
                   'logit_bias_token_ids', 'logit_bias_values', 'logit_bias')
# A rejected goal whose ~/get_state query got no answer in this long stays a GoalRejectedError.
STATE_QUERY_TIMEOUT_S = 2.0
TERMINAL_STATUSES = (GoalStatus.STATUS_SUCCEEDED, GoalStatus.STATUS_ABORTED,
                     GoalStatus.STATUS_CANCELED)
STATUS_NAMES = {GoalStatus.STATUS_SUCCEEDED: 'succeeded', GoalStatus.STATUS_ABORTED: 'aborted',
                GoalStatus.STATUS_CANCELED: 'canceled', GoalStatus.STATUS_UNKNOWN: 'unknown'}


class LLMClientError(RuntimeError):
    """Base class of the client's errors."""


class GoalRejectedError(LLMClientError):
    """llm_node refused the goal: it is not active, or its queue is full.

    Raised as one of the two subclasses when the node's state could be asked.
    """


class QueueFullError(GoalRejectedError):
    """llm_node is active but its queue is full: retry later (or raise its queue.depth)."""


class ServerUnavailableError(LLMClientError):
    """No llm_node answered within the timeout, or it disappeared while a goal ran."""


class NodeNotActiveError(LLMClientError):
    """llm_node did not become active in time (or the caller's give_up said why not)."""


class NodeInactiveError(GoalRejectedError, NodeNotActiveError):
    """llm_node rejected the goal because it is not active (unconfigured or inactive)."""


class GoalAbortedError(LLMClientError):
    """Base of what GenerationOutcome.raise_for_error raises; `outcome` is the outcome."""

    def __init__(self, message: str, outcome: 'GenerationOutcome') -> None:
        super().__init__(message)
        self.outcome = outcome


class InvalidGoalError(GoalAbortedError, ValueError):
    """The node found the goal invalid (error_kind invalid_request): fix what it says."""


class NodeUnavailableError(GoalAbortedError):
    """The node stopped serving (deactivated, shutting down) while the goal waited or ran."""


class GenerationFailedError(GoalAbortedError):
    """The goal failed while running (error_kind failed); see the message."""


_ABORT_ERRORS = {Generate.Result.ERROR_INVALID_REQUEST: InvalidGoalError,
                 Generate.Result.ERROR_UNAVAILABLE: NodeUnavailableError,
                 # Cancelled at the end of a model update's drain: retry on the new model.
                 Generate.Result.ERROR_MODEL_UPDATE: NodeUnavailableError,
                 Generate.Result.ERROR_FAILED: GenerationFailedError}


@dataclass(frozen=True)
class WatchdogConfig:
    """How LLMClient's watchdog treats goals whose responses do not come."""

    period_s: float = 0.5            # how often the live goals are checked
    # The action server not discovered for this long ends the goals with
    # ServerUnavailableError (a crashed node is only undiscovered after its DDS lease, ~20 s).
    server_gone_s: float = 5.0
    # The status topic lists the goal but no goal response came: use the status as one.
    response_grace_s: float = 2.0
    # The status topic says the goal ended but no result came: ask for the result again.
    result_grace_s: float = 2.0


@dataclass(frozen=True)
class GenerationOutcome:
    """The result of one goal, with its terminal status."""

    text: str
    token_ids: List[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error_message: str
    status: str                 # succeeded, aborted or canceled
    error_kind: str = ''        # Generate.Result.ERROR_* when aborted
    tool_calls: tuple = ()      # edge_llm_msgs ToolCall messages
    reasoning: str = ''
    logprobs: tuple = ()        # edge_llm_msgs TokenLogprob messages
    dropped_turns: int = 0      # session turns left out: the conversation outgrew the context
    # A grounding model's boxes and points (edge_llm_msgs Detection2D, the frame's pixels).
    detections: tuple = ()

    @property
    def ok(self) -> bool:
        return self.status == 'succeeded'

    def raise_for_error(self) -> 'GenerationOutcome':
        """Raise the error of an aborted goal by its error_kind; else return the outcome.

        InvalidGoalError (invalid_request), NodeUnavailableError (unavailable) or
        GenerationFailedError (failed, or an older node that sends no error_kind).
        """
        if self.status != 'aborted':
            return self
        error = _ABORT_ERRORS.get(self.error_kind, GenerationFailedError)
        raise error(self.error_message or f'goal aborted ({self.finish_reason})', self)


def _outcome(result: Generate.Result, status: int) -> GenerationOutcome:
    return GenerationOutcome(
        text=result.text, token_ids=list(result.token_ids), finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        timings=result.timings, error_message=result.error_message,
        status=STATUS_NAMES.get(status, str(status)), error_kind=result.error_kind,
        tool_calls=tuple(result.tool_calls), reasoning=result.reasoning,
        logprobs=tuple(result.logprobs), dropped_turns=int(result.dropped_turns),
        detections=tuple(getattr(result, 'detections', ())))


class _GoalClient(FeedbackListenersMixin, LockedActionClient):
    """LLMClient's action client: thread-safe, with feedback listeners that outlive results.

    Both bases live in rclpy_internals (they override private rclpy members); the mixin
    comes first so that feedback is delivered outside LockedActionClient's lock.
    """


class _Waiter:
    """Blocking waits: spin the node here when no executor owns it, else just wait."""

    def __init__(self, node: Node) -> None:
        self._executor: Optional[SingleThreadedExecutor] = None
        self._lock = threading.Lock()
        if node.executor is None:
            self._executor = SingleThreadedExecutor(context=node.context)
            self._executor.add_node(node)

    @property
    def spins(self) -> bool:
        return self._executor is not None

    def pump(self, timeout: float) -> None:
        """Run callbacks for up to `timeout` s (only when this waiter spins the node)."""
        if self._executor is None:
            time.sleep(timeout)
            return
        with self._lock:
            self._executor.spin_once(timeout_sec=timeout)

    def wait(self, event: threading.Event, timeout: Optional[float]) -> bool:
        if self._executor is None:
            return event.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not event.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.pump(0.05 if left is None else min(0.05, left))
        return True

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(timeout_sec=0)
            self._executor = None


class GenerationHandle:
    """A running goal: iterate it for text deltas, `result()` for the outcome, `cancel()`.

    Besides the action's own responses, LLMClient's watchdog calls `_check` periodically:
    a goal whose response or result never arrived (a response lost under load) is recovered
    from the status topic, and a goal whose server disappeared ends with
    ServerUnavailableError instead of waiting forever.
    """

    def __init__(self, waiter: _Waiter, client: _GoalClient, goal: Generate.Goal,
                 on_feedback: Optional[Callable[[Generate.Feedback], None]] = None,
                 watchdog: Optional[WatchdogConfig] = None,
                 state_query: Optional[Callable[[Callable[[Any], None]], bool]] = None
                 ) -> None:
        """`state_query(callback)` asks the node's lifecycle state (False: cannot ask)."""
        self._waiter = waiter
        self._state_query = state_query
        self._rejected_at: Optional[float] = None
        self._client = client
        self._watchdog = watchdog or WatchdogConfig()
        self._user_feedback = on_feedback
        self._cond = threading.Condition()
        self._deltas: List[str] = []
        self._seen_tokens = 0
        # Set when a token-carrying chunk shows that earlier chunks never came (a feedback
        # subscription matched late): the stream then ends with the rest of the result text.
        self._gap = False
        self._goal_handle: Any = None
        self._responded = threading.Event()
        self._finished = threading.Event()
        self._outcome: Optional[GenerationOutcome] = None
        self._error: Optional[BaseException] = None
        self._result_at = 0.0
        self._done_callbacks: List[Callable[['GenerationHandle'], None]] = []
        self._uuid = UUID(uuid=list(uuid.uuid4().bytes))
        self._key = bytes(self._uuid.uuid)
        self._status_seen_at: Optional[float] = None
        self._terminal_at: Optional[float] = None
        self._result_requested_at = 0.0
        self._server_gone_since: Optional[float] = None
        self.result_requests = 0       # get_result requests sent (more than 1 = recovered)
        self.queue_position = 0
        # True while the node has paused this goal for a preempting one (feedback.paused).
        self.paused = False
        self.sent_at = time.monotonic()
        self.first_feedback_at: Optional[float] = None
        client.watch(self._key, self._on_status)
        client.listen(self._key, self._on_feedback)
        self._goal_future = client.send_goal_async(goal, goal_uuid=self._uuid)
        self._goal_future.add_done_callback(self._on_goal_response)

    @property
    def goal_id(self) -> str:
        """Return the goal's UUID in hex (llm_node's transcripts and logs name goals by it)."""
        return self._key.hex()

    @property
    def responded(self) -> bool:
        """Tell whether the goal response (accepted or rejected) is in; does not wait."""
        return self._responded.is_set()

    # ---- callbacks (executor threads) --------------------------------------------------------
    def _on_feedback(self, message) -> None:
        feedback = message.feedback
        with self._cond:
            self.queue_position = feedback.queue_position
            self.paused = feedback.paused
            if feedback.text_delta or feedback.completion_tokens:
                if self.first_feedback_at is None and feedback.token_ids:
                    self.first_feedback_at = time.monotonic()
                first_token = feedback.completion_tokens - len(feedback.token_ids)
                if feedback.token_ids and first_token != self._seen_tokens:
                    self._gap = True
                if not self._gap:
                    self._deltas.append(feedback.text_delta)
                self._seen_tokens = max(self._seen_tokens, feedback.completion_tokens)
            self._cond.notify_all()
        if self._user_feedback is not None:
            self._user_feedback(feedback)

    def _on_status(self, status: int) -> None:
        now = time.monotonic()
        with self._cond:
            if self._status_seen_at is None:
                self._status_seen_at = now
            if status in TERMINAL_STATUSES and self._terminal_at is None:
                self._terminal_at = now

    def _on_goal_response(self, future) -> None:
        try:
            goal_handle = future.result()
        except Exception as exc:   # the request failed in rclpy: end the goal with it
            self._fail(LLMClientError(f'sending the goal failed: {type(exc).__name__}: {exc}'))
            return
        self._accept(goal_handle)

    def _accept(self, goal_handle) -> None:
        with self._cond:
            if self._goal_handle is not None or self._finished.is_set():
                return   # the recovered handle and the late real response: first one wins
            self._goal_handle = goal_handle
            if not goal_handle.accepted:
                self._error = GoalRejectedError(
                    'llm_node rejected the goal: it is not active or its queue is full '
                    '(see its log or /diagnostics)')
        self._responded.set()
        if goal_handle.accepted:
            self._request_result()
        else:
            self._classify_rejection()

    def _classify_rejection(self) -> None:
        """Ask the node's state, to raise QueueFullError or NodeInactiveError (docs/interfaces.md).

        The goal ends when the answer is in (or after STATE_QUERY_TIMEOUT_S, see _check).
        """
        with self._cond:
            self._rejected_at = time.monotonic()
        if self._state_query is None or not self._state_query(self._on_state):
            self._finish()

    def _on_state(self, state: Any) -> None:
        """Classify a rejection by the node's lifecycle State (None: the query failed)."""
        with self._cond:
            if self._finished.is_set():
                return
            if state is not None and state.id == State.PRIMARY_STATE_ACTIVE:
                self._error = QueueFullError(
                    'llm_node rejected the goal: its queue is full (it is active); retry '
                    'later or raise its queue.depth parameter')
            elif state is not None:
                self._error = NodeInactiveError(
                    f'llm_node rejected the goal: it is {state.label or "not active"}, not '
                    'active; activate it (autostart:=true, or lifecycle configure then '
                    'activate) and wait with LLMClient.wait_until_active')
        self._finish()

    def _request_result(self) -> None:
        with self._cond:
            self._result_requested_at = time.monotonic()
            self.result_requests += 1
        self._goal_handle.get_result_async().add_done_callback(self._on_result)

    def _on_result(self, future) -> None:
        try:
            response = future.result()
        except Exception as exc:
            self._fail(LLMClientError(f'getting the result failed: {type(exc).__name__}: '
                                      f'{exc}'))
            return
        with self._cond:
            if self._finished.is_set() or self._outcome is not None:
                return   # a second (re-requested) result
            self._outcome = _outcome(response.result, response.status)
            self._result_at = time.monotonic()
            self._cond.notify_all()
        self._finish()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._finished.is_set() or self._outcome is not None:
                return
            self._error = error
        self._responded.set()
        self._finish()

    def _finish(self) -> None:
        self._client.unwatch(self._key)
        with self._cond:
            if self._finished.is_set():
                return
            self._finished.set()
            self._cond.notify_all()
            callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            callback(self)

    def _check(self, now: float, server_ready: bool) -> None:
        """Watchdog step (LLMClient's timer): recover lost responses, notice a gone server."""
        if self._finished.is_set():
            return
        with self._cond:
            rejected_at = self._rejected_at
        if rejected_at is not None:
            if now - rejected_at >= STATE_QUERY_TIMEOUT_S:
                self._finish()   # no state answer: stays a plain GoalRejectedError
            return
        config = self._watchdog
        if server_ready:
            self._server_gone_since = None
        elif self._server_gone_since is None:
            self._server_gone_since = now
        elif now - self._server_gone_since >= config.server_gone_s:
            self._fail(ServerUnavailableError(
                f'the llm_node action server disappeared (not discovered for '
                f'{config.server_gone_s:g} s) before goal {self.goal_id} ended: check that '
                'llm_node is running (its log says why it stopped)'))
            return
        with self._cond:
            responded = self._goal_handle is not None
            status_seen = self._status_seen_at
            terminal = self._terminal_at
            asked = self._result_requested_at
        if not responded and status_seen is not None and \
                now - status_seen >= config.response_grace_s:
            # The server lists the goal, so it accepted it, but its response never came.
            self._accept(accepted_goal_handle(self._client, self._goal_future, self._uuid,
                                              Generate))
        elif responded and terminal is not None and \
                now - max(terminal, asked) >= config.result_grace_s and \
                self._goal_handle.accepted:
            # The goal ended on the server, its result did not come: ask again (the server
            # keeps results for its result_timeout, 15 min by default).
            self._request_result()

    # ---- user side ---------------------------------------------------------------------------
    @property
    def accepted(self) -> bool:
        """Wait for the goal response (spinning if needed); True if accepted."""
        self._waiter.wait(self._responded, None)
        return self._error is None

    def done(self) -> bool:
        return self._finished.is_set()

    def add_done_callback(self, callback: Callable[['GenerationHandle'], None]) -> None:
        """Call `callback(handle)` once the result (or the rejection) is in."""
        with self._cond:
            if not self._finished.is_set():
                self._done_callbacks.append(callback)
                return
        callback(self)

    def result(self, timeout: Optional[float] = None) -> GenerationOutcome:
        """Block until the goal ends and return its outcome.

        Raises GoalRejectedError, TimeoutError after `timeout`, or ServerUnavailableError
        when the action server disappeared (see WatchdogConfig.server_gone_s), also with
        no timeout.
        """
        if not self._waiter.wait(self._finished, timeout):
            raise TimeoutError(f'no result from llm_node within {timeout} s')
        if self._error is not None:
            raise self._error
        return self._outcome

    def cancel(self, timeout: Optional[float] = 5.0) -> bool:
        """Ask llm_node to stop; True if the cancel was accepted (the result follows)."""
        if not self._waiter.wait(self._responded, timeout) or self._goal_handle is None:
            return False
        if not self._goal_handle.accepted or self._finished.is_set():
            return False
        answered = threading.Event()
        box: list = []

        def on_cancel(future) -> None:
            box.append(future.result())
            answered.set()
        self._goal_handle.cancel_goal_async().add_done_callback(on_cancel)
        if not self._waiter.wait(answered, timeout):
            return False
        return bool(box and box[0].goals_canceling)

    def stream(self, timeout: Optional[float] = None) -> Iterator[str]:
        """Yield text deltas in order until the goal ended and its feedback is complete.

        Raises GoalRejectedError when the node refused the goal, TimeoutError after `timeout`.

        The result comes over a service and the feedback over a topic, so the last chunks can
        arrive after the result: the stream waits up to FEEDBACK_GRACE_S for them (llm_node's
        last feedback carries completion_tokens == the result's). Chunks that never come (a
        gap in the token counts, or the grace ran out) are not lost: the stream ends with the
        rest of the result's text, so the deltas always add up to it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        index = 0
        yielded: List[str] = []
        spins_itself = self._waiter.spins
        while True:
            with self._cond:
                if index < len(self._deltas):
                    chunk = self._deltas[index]
                    index += 1
                elif self._stream_complete():
                    if self._error is not None:
                        raise self._error
                    rest = self._missing_tail(''.join(yielded))
                    if rest:
                        yield rest
                    return
                else:
                    chunk = None
                    if not spins_itself:
                        self._cond.wait(0.05)
            if chunk is not None:
                if chunk:
                    yielded.append(chunk)
                    yield chunk
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f'stream did not end within {timeout} s')
            if spins_itself:
                self._waiter.pump(0.05)

    def _stream_complete(self) -> bool:
        if not self._finished.is_set():
            return False
        if self._outcome is None or self._gap:
            return True
        if self._seen_tokens >= self._outcome.completion_tokens:
            return True
        return time.monotonic() - self._result_at > FEEDBACK_GRACE_S

    def _release_feedback(self, now: float) -> bool:
        """Stop listening for feedback once none can still be due; True when released."""
        with self._cond:
            if not self._finished.is_set():
                return False
            due = (self._outcome is not None and not self._gap
                   and self._seen_tokens < self._outcome.completion_tokens
                   and now - self._result_at <= FEEDBACK_GRACE_S)
        if due:
            return False
        self._client.unlisten(self._key)
        return True

    def _missing_tail(self, streamed: str) -> str:
        """Return the part of the result text the feedback did not deliver (often '')."""
        text = self._outcome.text if self._outcome is not None else ''
        if text.startswith(streamed):
            return text[len(streamed):]
        return ''   # not a prefix: a server whose feedback is not the result's text

    def __iter__(self) -> Iterator[str]:
        return self.stream()

    @property
    def streamed_text(self) -> str:
        with self._cond:
            return ''.join(self._deltas)


class VideoWindow(NamedTuple):
    """A goal's clip as a time window: the perception node, the last `seconds`, a frame cap."""

    source: str
    seconds: float
    max_frames: int = 0   # 0: as many as llm_node holds at once (8)


def make_goal(prompt: str = '', messages: Sequence[Any] = (), system_prompt: str = '',
              max_tokens: int = 0, stop: Sequence[str] = (), json_schema: str = '',
              session_id: str = '', prefix_embeddings: Sequence[Any] = (),
              request_type=Generate.Goal, *, tools: Sequence[Any] = (), tool_choice: str = '',
              parallel_tool_calls: bool = True, grammar: str = '', regex: str = '',
              choices: Sequence[str] = (), reasoning: Optional[bool] = None,
              reasoning_budget: Optional[int] = None, priority: int = 0,
              preempt: bool = False, history_mode: int = Generate.Goal.HISTORY_AUTO,
              no_speculation: bool = False, images: Sequence[Any] = (),
              raw_prompt: bool = False, max_image_tokens: int = 0,
              lora: Optional[Mapping[str, float]] = None, video_frames: Sequence[Any] = (),
              video_timestamps: Sequence[float] = (), video_fps: float = 0.0,
              video_window: Optional['VideoWindow'] = None, **sampling) -> Any:
    """Build a Generate goal (or a Complete request); unknown sampling names raise TypeError.

    `messages` may hold ChatMessage messages or (role, content) pairs; sampling fields not
    given stay UNSET (the node's defaults apply); `logit_bias` may be given as
    {token id: bias}. `tools` holds ToolSpec messages or dicts (name, description,
    parameters as a dict or JSON text, or OpenAI's {"type": "function", "function": {...}}).
    `reasoning` None keeps the model's default; `reasoning_budget` None = no limit.
    With a `session_id`, the node remembers the conversation: `history_mode` says whether
    `messages` are only the new turns or the whole history (Generate.Goal.HISTORY_*).
    `priority` (higher is served first; the node accepts Generate.Goal.PRIORITY_MIN..MAX) and
    `preempt` (pause a lower-priority running goal) exist only on Generate goals: ~/complete
    requests run at priority 0, so asking one for anything else raises TypeError.
    `no_speculation` (Generate only) decodes this goal plainly where the node speculates.
    `images` (Generate only): TensorHandle messages of RGB [H, W, 3] uint8 frames in a pool,
    one per `<__media__>` marker of the prompt; `raw_prompt` (Generate only): the prompt is
    fed as is, without the chat template; `max_image_tokens` (Generate only): the most tokens
    one image may take, 0 = the node's vision.max_image_tokens. `lora` (Generate only):
    adapter name -> scale, the LoRA adapters of this goal (lora.adapters / ~/load_adapter).
    `video_frames`, `video_timestamps`, `video_fps` (Generate only): a clip for a Qwen-VL
    model (TensorHandle messages of its frames, oldest first, a timestamp in seconds each,
    the sampling rate); it takes the `<__media__>` marker after the images' ones.
    `video_window` (Generate only): the clip as a perception node's time window instead of
    handles, a VideoWindow or (source node, seconds[, max_frames]): the node asks that node's
    ~/window for the last `seconds`, sampled at `video_fps` (docs/vision.md).
    """
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f'unknown sampling field(s) {sorted(unknown)}; known: '
                        f'{", ".join(SAMPLING_FIELDS)}')
    goal = request_type()
    if hasattr(goal, 'priority'):
        goal.priority = int(priority)
        goal.preempt = bool(preempt)
        goal.no_speculation = bool(no_speculation)
        goal.images = list(images)
        goal.raw_prompt = bool(raw_prompt)
        goal.max_image_tokens = int(max_image_tokens)
        goal.lora = [LoraScale(name=str(n), scale=float(s)) for n, s in (lora or {}).items()]
        goal.video_frames = list(video_frames)
        goal.video_timestamps = [float(t) for t in video_timestamps]
        goal.video_fps = float(video_fps)
        if video_window is not None:
            window = VideoWindow(*video_window)
            goal.video_window_source = window.source
            goal.video_window_seconds = float(window.seconds)
            goal.video_window_max_frames = int(window.max_frames)
    elif priority or preempt or no_speculation or images or raw_prompt or max_image_tokens \
            or lora or video_frames or video_window:
        raise TypeError(f'{request_type.__name__} has no priority/preempt/images/raw_prompt/'
                        'max_image_tokens/lora: '
                        'send a Generate goal (LLMClient.generate) for those')
    goal.prompt = prompt
    goal.messages = [m if isinstance(m, ChatMessage) else ChatMessage(role=m[0], content=m[1])
                     for m in messages]
    goal.system_prompt = system_prompt
    goal.sampling = _sampling(sampling)
    goal.max_tokens = int(max_tokens)
    goal.stop = list(stop)
    goal.json_schema = json_schema
    goal.session_id = session_id
    goal.history_mode = int(history_mode)
    goal.prefix_embeddings = list(prefix_embeddings)
    goal.tools = [tool_spec(t) for t in tools]
    goal.tool_choice = tool_choice
    goal.no_parallel_tool_calls = not parallel_tool_calls
    goal.grammar = grammar
    goal.regex = regex
    goal.choices = list(choices)
    goal.reasoning_mode = (Generate.Goal.REASONING_DEFAULT if reasoning is None else
                           Generate.Goal.REASONING_ON if reasoning else
                           Generate.Goal.REASONING_OFF)
    goal.reasoning_budget = (Generate.Goal.REASONING_BUDGET_NONE if reasoning_budget is None
                             else int(reasoning_budget))
    return goal


def _sampling(values: Dict[str, Any]) -> SamplingParams:
    params = SamplingParams()
    bias = values.pop('logit_bias', None)
    if bias:
        params.logit_bias_token_ids = [int(t) for t in bias]
        params.logit_bias_values = [float(v) for v in bias.values()]
    for name, value in values.items():
        current = getattr(params, name)
        if isinstance(current, float):
            setattr(params, name, float(value))
        elif isinstance(current, int):
            setattr(params, name, int(value))
        else:   # an array field
            setattr(params, name, list(value))
    return params


def tool_spec(tool: Any) -> ToolSpec:
    """Return the ToolSpec message of a ToolSpec, an OpenAI tool dict or a plain dict."""
    if isinstance(tool, ToolSpec):
        return tool
    fn = tool.get('function', tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get('name'), str):
        raise TypeError(f'a tool must be a ToolSpec message or a dict with a name, not '
                        f'{tool!r}')
    parameters = fn.get('parameters', '')
    if not isinstance(parameters, str):
        parameters = json.dumps(parameters)
    return ToolSpec(name=fn['name'], description=str(fn.get('description', '')),
                    parameters=parameters)


class EmbedRefusedError(RuntimeError):
    """~/embed or ~/rerank refused the request; kind is the node's error class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f'{kind}: {message}')
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class EmbedReply:
    """~/embed's answer: vectors [n, dimensions] float32, tokens per text, the model."""

    vectors: np.ndarray
    token_counts: Tuple[int, ...]
    model_id: str


@dataclass(frozen=True)
class RerankReply:
    """~/rerank's answer: one score per document (input order), indices best first."""

    scores: np.ndarray
    order: Tuple[int, ...]


class LLMClient:
    """Client of one llm_node (`server` is its fully qualified name)."""

    def __init__(self, node: Node, server: str = '/llm_node', callback_group=None,
                 watchdog: WatchdogConfig = WatchdogConfig()) -> None:
        self._node = node
        self._waiter = _Waiter(node)
        self.server = server.rstrip('/')
        self.watchdog = watchdog
        self._action = _GoalClient(node, Generate, f'{self.server}/generate',
                                   callback_group=callback_group,
                                   feedback_sub_qos_profile=FEEDBACK_QOS)

        def service(kind, name: str):
            return node.create_client(kind, f'{self.server}/{name}',
                                      callback_group=callback_group)
        self._complete = service(Complete, 'complete')
        self._tokenize = service(Tokenize, 'tokenize')
        self._detokenize = service(Detokenize, 'detokenize')
        self._reset_session = service(ResetSession, 'reset_session')
        self._warm_prompt = service(WarmPrompt, 'warm_prompt')
        self._get_session = service(GetSession, 'get_session')
        self._list_sessions = service(ListSessions, 'list_sessions')
        self._list_adapters = service(ListAdapters, 'list_adapters')
        self._model_info = service(GetModelInfo, 'get_model_info')
        self._embed = service(Embed, 'embed')
        self._rerank = service(Rerank, 'rerank')
        self._replies = EmbedReplyReader('llm_client')   # large ~/embed results
        self._get_state = service(GetState, 'get_state')
        self._live: List[GenerationHandle] = []
        self._live_lock = threading.Lock()
        self._timer = node.create_timer(watchdog.period_s, self._check_live,
                                        callback_group=callback_group)

    def _check_live(self) -> None:
        now = time.monotonic()
        with self._live_lock:
            self._live = [h for h in self._live if not h._release_feedback(now)]
            live = list(self._live)
        if not live:
            return
        ready = self._action.server_is_ready()
        for handle in live:
            handle._check(now, ready)

    def wait_for_server(self, timeout: Optional[float] = None) -> bool:
        """Wait until the action server is discovered (it exists in every lifecycle state).

        Also waits for its feedback publisher to be known here, so that the first goal's
        first chunks are not sent before this client's feedback subscription can match.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        feedback_topic = f'{self.server}/generate/_action/feedback'
        while not (self._action.server_is_ready()
                   and self._node.count_publishers(feedback_topic) > 0):
            if deadline is not None and time.monotonic() > deadline:
                return False
            self._waiter.pump(0.05)
        return True

    def wait_until_active(self, timeout: float,
                          give_up: Optional[Callable[[], Optional[str]]] = None) -> None:
        """Wait until llm_node is active (goals sent before are rejected), via ~/get_state.

        An llm_node serves its action server in every lifecycle state, but accepts goals
        only once it is active, i.e. has loaded its model. `give_up()`, checked between
        polls, may return a reason to stop waiting (NodeProcess: the node exited).
        Raises NodeNotActiveError saying what to check.
        """
        try:
            wait_for_state(self._node, self.server, 'active', timeout, self._waiter.pump,
                           give_up)
        except LifecycleStateError as exc:
            if exc.gave_up:
                raise NodeNotActiveError(str(exc)) from None
            if not exc.seen:
                hint = ('is llm_node running under that name, with the same ROS_DOMAIN_ID '
                        '(source scripts/ros_env.sh in every terminal)?')
            else:
                hint = ('check its log and /diagnostics (a model that failed to load leaves it '
                        'unconfigured), or activate it: autostart:=true, or `ros2 lifecycle '
                        f'set {self.server} configure` then `activate`')
            raise NodeNotActiveError(f'{exc}: {hint}') from None

    def generate(self, prompt: str = '', *, messages: Sequence[Any] = (),
                 on_feedback: Optional[Callable[[Generate.Feedback], None]] = None,
                 **kwargs) -> GenerationHandle:
        """Send a goal; see make_goal for the keyword arguments."""
        return self.generate_goal(make_goal(prompt, messages, **kwargs), on_feedback)

    def generate_goal(self, goal: Generate.Goal,
                      on_feedback: Optional[Callable[[Generate.Feedback], None]] = None
                      ) -> GenerationHandle:
        """Send a Generate goal built by the caller (e.g. with make_goal)."""
        handle = GenerationHandle(self._waiter, self._action, goal, on_feedback, self.watchdog,
                                  state_query=self._query_state)
        with self._live_lock:
            self._live.append(handle)
        return handle

    def _query_state(self, callback: Callable[[Any], None]) -> bool:
        """Ask ~/get_state without waiting; `callback(State or None)` runs on the answer."""
        if not self._get_state.service_is_ready():
            return False

        def done(future) -> None:
            try:
                callback(future.result().current_state)
            except Exception:  # noqa: B902 - no answer: the rejection stays unclassified
                callback(None)
        self._get_state.call_async(GetState.Request()).add_done_callback(done)
        return True

    def complete(self, prompt: str = '', *, messages: Sequence[Any] = (),
                 timeout: Optional[float] = None, **kwargs) -> Complete.Response:
        """One-shot ~/complete call (blocking)."""
        request = make_goal(prompt, messages, request_type=Complete.Request, **kwargs)
        return self._call(self._complete, request, timeout)

    def tokenize(self, text: str = '', *, messages: Sequence[Any] = (),
                 add_generation_prompt: bool = True,
                 timeout: Optional[float] = None) -> Tokenize.Response:
        request = Tokenize.Request(text=text, add_generation_prompt=add_generation_prompt)
        request.messages = [m if isinstance(m, ChatMessage)
                            else ChatMessage(role=m[0], content=m[1]) for m in messages]
        return self._call(self._tokenize, request, timeout)

    def detokenize(self, token_ids: Sequence[int],
                   timeout: Optional[float] = None) -> Detokenize.Response:
        """Text of token ids (~/detokenize, blocking)."""
        request = Detokenize.Request(token_ids=[int(t) for t in token_ids])
        return self._call(self._detokenize, request, timeout)

    def reset_session(self, session_id: str = '',
                      timeout: Optional[float] = None) -> ResetSession.Response:
        """Forget one conversation, '' = every one (~/reset_session, blocking)."""
        return self._call(self._reset_session, ResetSession.Request(session_id=session_id),
                          timeout)

    def warm_prompt(self, text: str = '', path: str = '',
                    timeout: Optional[float] = None) -> WarmPrompt.Response:
        """Pin one more warm prompt: its text, or a file's path (~/warm_prompt, blocking)."""
        return self._call(self._warm_prompt, WarmPrompt.Request(text=text, path=path), timeout)

    def get_session(self, session_id: str,
                    timeout: Optional[float] = None) -> GetSession.Response:
        """Return one session's turns, token count and KV bytes (~/get_session, blocking)."""
        return self._call(self._get_session, GetSession.Request(session_id=session_id),
                          timeout)

    def list_adapters(self, timeout: Optional[float] = None) -> ListAdapters.Response:
        """Return the LoRA adapters the node holds (~/list_adapters, blocking)."""
        return self._call(self._list_adapters, ListAdapters.Request(), timeout)

    def list_sessions(self, timeout: Optional[float] = None) -> ListSessions.Response:
        """Return the sessions the node keeps (~/list_sessions, blocking)."""
        return self._call(self._list_sessions, ListSessions.Request(), timeout)

    def history(self, session_id: str, timeout: Optional[float] = None) -> List[ChatMessage]:
        """Return the turns the node remembers of a session ([] for an unknown one).

        Raises LLMClientError when the node cannot say (not configured, remote backend).
        """
        answer = self.get_session(session_id, timeout)
        if not answer.success:
            raise LLMClientError(f'{self.server}/get_session: {answer.message}')
        return list(answer.turns)

    def conversation(self, session_id: str, **defaults) -> 'Conversation':
        """Return a Conversation helper: ask() repeatedly, the node remembers the turns."""
        return Conversation(self, session_id, defaults)

    def model_info(self, timeout: Optional[float] = None) -> GetModelInfo.Response:
        """Return the served model and its capabilities (~/get_model_info, blocking)."""
        return self._call(self._model_info, GetModelInfo.Request(), timeout)

    def embed(self, texts: Sequence[str], *, is_query: bool = False, dimensions: int = 0,
              truncate: bool = False, timeout: Optional[float] = None) -> 'EmbedReply':
        """Return the texts' vectors (~/embed, blocking); EmbedRefusedError when refused."""
        request = Embed.Request(texts=list(texts), is_query=is_query,
                                dimensions=int(dimensions), truncate=truncate)
        response = self._call(self._embed, request, timeout)
        if not response.success:
            raise EmbedRefusedError(response.error_kind, response.message)
        try:
            vectors = self._replies.vectors(response, len(texts))
        except EmbedReplyError as exc:
            raise EmbedRefusedError('ReplyUnreadable', str(exc)) from None
        return EmbedReply(vectors, tuple(response.token_counts), response.model_id)

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int = 0,
               truncate: bool = False, timeout: Optional[float] = None) -> 'RerankReply':
        """Return each document's score and the order, best first (~/rerank, blocking)."""
        request = Rerank.Request(query=query, documents=list(documents), top_n=int(top_n),
                                 truncate=truncate)
        response = self._call(self._rerank, request, timeout)
        if not response.success:
            raise EmbedRefusedError(response.error_kind, response.message)
        return RerankReply(np.asarray(response.scores, np.float32), tuple(response.order))

    def _call(self, client, request, timeout: Optional[float]):
        if not client.wait_for_service(timeout_sec=timeout):
            raise ServerUnavailableError(f'{client.srv_name} not available within {timeout} s')
        done = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _: done.set())
        if not self._waiter.wait(done, timeout):
            raise TimeoutError(f'{client.srv_name} did not answer within {timeout} s')
        return future.result()

    def destroy(self) -> None:
        self._node.destroy_timer(self._timer)
        self._waiter.close()
        self._action.destroy()
        for client in (self._complete, self._tokenize, self._detokenize, self._reset_session,
                       self._get_session, self._list_sessions, self._list_adapters,
                       self._model_info,
                       self._get_state, self._embed, self._rerank):
            self._node.destroy_client(client)
        self._replies.close()


class Conversation:
    """A session the node remembers: each ask() sends one new user turn.

        chat = client.conversation('kitchen')
        chat.ask('My name is Ada.')
        print(chat.ask('What is my name?').text)

    `defaults` are make_goal keywords applied to every turn (temperature, max_tokens, ...);
    ask() keywords override them. The turns live in llm_node (and its sessions.store), not
    here: history() asks the node, reset() forgets them.
    """

    def __init__(self, client: LLMClient, session_id: str,
                 defaults: Optional[Dict[str, Any]] = None) -> None:
        if not session_id:
            raise ValueError('a Conversation needs a session_id')
        self.client = client
        self.session_id = session_id
        self.defaults = dict(defaults or {})

    def send(self, text: str, **kwargs) -> GenerationHandle:
        """Send one user turn; return its handle (stream it, or wait for its result)."""
        options = dict(self.defaults, **kwargs)
        options.setdefault('history_mode', Generate.Goal.HISTORY_APPEND)
        return self.client.generate(text, session_id=self.session_id, **options)

    def ask(self, text: str, timeout: Optional[float] = None, **kwargs) -> GenerationOutcome:
        """Send one user turn and return its outcome (raises on an aborted goal)."""
        return self.send(text, **kwargs).result(timeout=timeout).raise_for_error()

    def history(self, timeout: Optional[float] = None) -> List[ChatMessage]:
        return self.client.history(self.session_id, timeout)

    def reset(self, timeout: Optional[float] = None) -> ResetSession.Response:
        return self.client.reset_session(self.session_id, timeout)
