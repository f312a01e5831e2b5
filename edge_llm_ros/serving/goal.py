"""One request from admission to result: a Goal.

A Goal is created once its request is prepared (runtime/request.py: validated, tokenized) and
is the only state of that request until its result: identity, priority and preempt flag, the
prefix embeddings to bind, the one cancel flag, where it is (waiting, prefilling, decoding,
paused, done), its Output (every token, accumulated once) and the feedback cursor over it.
The scheduler plans with it, the executor runs its rows, the worker sends its feedback from
its Output, and the node (nodes/llm_action.py) extends it with the ROS glue of one goal.

Thread safety: `cancel` may be called from any thread (it sets the flag under the scheduler's
lock, see Scheduler.cancel); everything else is written on the thread that owns the engine.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
import enum
import itertools
import time
from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.output import Output
from edge_llm_ros.runtime.types import GenerationResult, StopReason, Timings

# Goal priorities (Generate.Goal.PRIORITY_MIN/MAX are the same numbers: test_interfaces).
PRIORITY_MIN, PRIORITY_MAX = -100, 100
_ids = itertools.count(1)


class CancelReason(str, enum.Enum):
    """Who cancelled a goal (the node maps it to an action terminal state)."""

    NONE = ''
    CLIENT = 'client'            # the action client asked for it
    DEACTIVATED = 'deactivated'  # the node left the active state
    SHUTDOWN = 'shutdown'        # the node is shutting down, or the engine closes
    SESSION_RESET = 'session_reset'   # its session's KV was dropped under it
    SUPERSEDED = 'superseded'    # Engine.generate was called again before it ended
    MODEL_UPDATE = 'model_update'   # still running when a model update's drain ran out


class GoalState(str, enum.Enum):
    WAITING = 'waiting'
    PREFILL = 'prefill'
    DECODE = 'decode'
    PAUSED = 'paused'
    DONE = 'done'


LIVE = (GoalState.PREFILL, GoalState.DECODE)


@dataclass(frozen=True)
class FeedbackPolicy:
    """Send streamed text every `tokens` tokens or `period_s` seconds (0: off), whichever first."""

    tokens: int = 4
    period_s: float = 0.05


@dataclass(frozen=True)
class Feedback:
    """One feedback message's content: a slice of the goal's Output, or its queue place."""

    text_delta: str = ''
    token_ids: tuple = ()
    completion_tokens: int = 0
    queue_position: int = 0          # > 0 only while waiting
    reasoning_delta: str = ''
    tool_call_deltas: tuple = ()     # runtime.tools.parser.ToolCallDelta
    paused: bool = False             # preempted: its KV is kept, it resumes later


def check_priority(priority: Any) -> int:
    """Return the priority, or raise InvalidRequestError when it is not in range."""
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) \
            or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidRequestError(
            f'priority {priority!r} is outside [{PRIORITY_MIN}, {PRIORITY_MAX}] (an integer: '
            'higher runs first, 0 is normal)')
    return int(priority)


def cancelled_result(timings: Timings = Timings()) -> GenerationResult:
    return GenerationResult(text='', token_ids=[], stop_reason=StopReason.CANCELLED,
                            prompt_tokens=0, completion_tokens=0, timings=timings)


def error_result(message: str, timings: Timings = Timings()) -> GenerationResult:
    return GenerationResult(text='', token_ids=[], stop_reason=StopReason.ERROR,
                            prompt_tokens=0, completion_tokens=0, timings=timings,
                            error=message)


@dataclass(eq=False)
class Goal:
    """A prepared request and everything that happens to it (see the module docstring)."""

    request: Any                      # PreparedRequest (or what a streaming backend takes)
    priority: int = 0                 # higher runs first; ties keep arrival order
    preempt: bool = False             # may pause the lowest-priority running goal
    # Entered on the engine's thread when the goal gets a slot, left when it ends; yields the
    # prefix-embedding array to bind into the request (llm_node maps tensor handles then).
    embeddings: Optional[Callable[[], ContextManager[np.ndarray]]] = None
    # The same for the request's DeclaredImages: yields their frames (RGB [H, W, 3] uint8
    # arrays, in order) while the goal runs; the engine encodes them when it starts.
    images: Optional[Callable[[], ContextManager[Sequence[np.ndarray]]]] = None
    on_feedback: Optional[Callable[[Feedback], None]] = None
    on_done: Optional[Callable[['Goal'], None]] = None
    # Set by serving ---------------------------------------------------------------------------
    uid: int = field(default_factory=lambda: next(_ids), init=False)   # unique per process
    state: GoalState = field(default=GoalState.WAITING, init=False)
    cancel_reason: CancelReason = field(default=CancelReason.NONE, init=False)
    arrival: int = field(default=0, init=False)          # submission order
    submitted_at: float = field(default=0.0, init=False)  # time.monotonic()
    queue_wait_s: float = field(default=0.0, init=False)
    slot: int = field(default=-1, init=False)
    output: Output = field(default_factory=Output, init=False, repr=False)
    sequence: Any = field(default=None, init=False, repr=False)   # runtime Sequence / stream
    # The request as it ran: a session goal's with its whole conversation (set at admission).
    ran: Any = field(default=None, init=False, repr=False)
    result: Optional[GenerationResult] = field(default=None, init=False)
    # The request was found invalid only when it started (a stale embeddings handle, a
    # conversation that no longer leaves room): its ERROR result is the client's to fix.
    refused: bool = field(default=False, init=False)
    # Scheduler bookkeeping: prompt chunks still to prefill, the tokens to feed again before
    # the next one (a conv state rewound to a verify's start), the parked KV of a paused
    # goal, the state to resume into, and the bound embeddings' exit stack.
    chunks: Any = field(default=None, init=False, repr=False)
    replay: Tuple[int, ...] = field(default=(), init=False, repr=False)
    park: Any = field(default=None, init=False, repr=False)
    resume_state: GoalState = field(default=GoalState.DECODE, init=False, repr=False)
    exit_stack: Optional[contextlib.ExitStack] = field(default=None, init=False, repr=False)
    # Feedback cursor over `output` (the worker's).
    sent: int = field(default=0, init=False, repr=False)
    last_sent: float = field(default=0.0, init=False, repr=False)
    # When the request arrived (perf_counter): TTFT counts from here when set, else from slot
    # admission (Engine.generate sets it, so a script's TTFT includes tokenizing).
    t0: Optional[float] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.priority = check_priority(self.priority)
        self.preempt = bool(self.preempt)

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not CancelReason.NONE

    @property
    def done(self) -> bool:
        return self.state is GoalState.DONE

    def enter_embeddings(self) -> Any:
        """Bind the prefix embeddings and images (mapped now, released at the end).

        Returns the request with them.
        """
        if self.embeddings is None and self.images is None:
            return self.request
        stack = contextlib.ExitStack()
        try:
            request = self.request
            if self.embeddings is not None:
                request = request.bind(stack.enter_context(self.embeddings()))
            if self.images is not None:
                request = request.with_frames(list(stack.enter_context(self.images())))
        except BaseException:
            stack.close()
            raise
        self.exit_stack = stack
        return request

    def finish(self, result: GenerationResult) -> None:
        """Record the end: release the embeddings, keep the result (owner thread)."""
        stack, self.exit_stack = self.exit_stack, None
        if stack is not None:
            try:
                stack.close()   # releases the prefix embeddings (llm_node: the mapped frames)
            except Exception as exc:  # noqa: B902 - this goal's problem, not the step's
                result = error_result(f'releasing the prefix embeddings failed: '
                                      f'{type(exc).__name__}: {exc}', result.timings)
        self.state = GoalState.DONE
        self.result = result
        self.sequence = None
        self.park = None
        self.chunks = None

    def wait_time(self) -> float:
        return time.monotonic() - self.submitted_at if self.submitted_at else 0.0
