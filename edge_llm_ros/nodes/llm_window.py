"""llm_node's time-window goals: "what just happened?" as a clip from a perception node.

A Generate goal may name a clip as a window of a perception node's camera instead of handles
(video_window_source, video_window_seconds, video_window_max_frames; interface version 9).
Before such a goal is prepared, llm_node asks that node's ~/window (edge_llm_msgs/GetWindow)
for the last video_window_seconds, sampled at the goal's video_fps, and takes the frames it
answers as the goal's clip: video_frames = the frames' handles (oldest first), video_timestamps
= their header stamps in seconds from the first frame. The goal message itself is filled in,
so the transcript records the clip the window resolved to (replay resends that clip) beside
the window fields, and a model update prepares the same clip again.

The call never blocks the executor: `WindowCalls.start` sends it (once the service is
discovered) and returns; a timer of its own callback group checks the deadline
(~/vision.window_timeout_s), and the reply or the deadline calls the goal's continuation.
Every failure is a VideoWindowError (an InvalidRequestError: the goal ends invalid_request
before any model work, and the node keeps serving).
"""
from __future__ import annotations

from dataclasses import dataclass
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from rclpy.callback_groups import ReentrantCallbackGroup

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.nodes.embeddings import WINDOW_INFLIGHT

POLL_S = 0.02
MAX_CLIENTS = 8   # perception nodes asked (a goal naming many unknown ones cannot pile them up)
NS = 1_000_000_000


class VideoWindowError(InvalidRequestError):
    """A goal's time window cannot become its clip; the message says why and what to change."""


@dataclass(frozen=True)
class WindowAsk:
    """One goal's window, validated: the service to call and what to ask it."""

    service: str
    seconds: float
    fps: float
    max_frames: int


def window_ask(goal: Any) -> Optional[WindowAsk]:
    """Validate a goal's video_window_* fields once; None when the goal names no window.

    VideoWindowError for a window without seconds > 0, one beside video_frames, or more frames
    than llm_node holds of one pool at once (WINDOW_INFLIGHT).
    """
    source = str(getattr(goal, 'video_window_source', '') or '').strip()
    seconds = float(getattr(goal, 'video_window_seconds', 0.0) or 0.0)
    count = int(getattr(goal, 'video_window_max_frames', 0) or 0)
    if not source:
        if seconds or count:
            raise VideoWindowError(
                'video_window_seconds / video_window_max_frames are set without '
                'video_window_source: name the perception node (e.g. /perception) whose '
                'window holds the frames')
        return None
    if getattr(goal, 'video_frames', ()):
        raise VideoWindowError('the goal names a time window (video_window_source) and gives '
                               'video_frames: give one clip, either the handles or the window')
    if not seconds > 0.0:
        raise VideoWindowError(f"video_window_seconds is {seconds:g}: give the window's "
                               'length in seconds (> 0), e.g. 2.0 for the last 2 seconds')
    if count > WINDOW_INFLIGHT:
        raise VideoWindowError(f'video_window_max_frames is {count}, but llm_node holds at '
                               f'most {WINDOW_INFLIGHT} frames of a window at once: ask for '
                               f'{WINDOW_INFLIGHT} or fewer (video_fps samples the window)')
    fps = float(getattr(goal, 'video_fps', 0.0) or 0.0)
    if fps < 0.0:
        raise VideoWindowError(f'video_fps is {fps:g}: give a rate >= 0 (0: every frame held)')
    return WindowAsk(source.rstrip('/') + '/window', seconds, fps, count or WINDOW_INFLIGHT)


def fill_clip(goal: Any, ask: WindowAsk, response: Any) -> None:
    """Make a GetWindow reply the goal's clip (see the module docstring); VideoWindowError."""
    if not response.success:
        raise VideoWindowError(f'{ask.service} gave no window for the last {ask.seconds:g} s: '
                               f'{response.error_message}')
    frames = list(response.frames)
    if not frames:   # a node answering success without frames (not perception's)
        raise VideoWindowError(f'{ask.service} answered an empty window for the last '
                               f'{ask.seconds:g} s: is its camera publishing?')
    stamps = [h.header.stamp.sec * NS + h.header.stamp.nanosec for h in frames]
    goal.video_frames = frames
    goal.video_timestamps = [(s - stamps[0]) / NS for s in stamps]


@dataclass(eq=False)
class _Pending:
    ask: WindowAsk
    client: Any
    deadline: float
    done: Callable[[Any, Optional[BaseException]], None]
    future: Any = None


class WindowCalls:
    """The node's ~/window calls in flight (see the module docstring)."""

    def __init__(self, node: Any, timeout_s: Callable[[], float]) -> None:
        self._node = node
        self._timeout_s = timeout_s
        self._group = ReentrantCallbackGroup()
        self._clients: Dict[str, Any] = {}
        self._pending: Dict[Any, _Pending] = {}   # by the key start() was given (the goal)
        self._lock = threading.Lock()
        self._timer = None

    def _client(self, service: str) -> Any:
        from edge_llm_msgs.srv import GetWindow
        client = self._clients.get(service)
        if client is None:
            try:
                client = self._node.create_client(GetWindow, service,
                                                  callback_group=self._group)
            except Exception as exc:  # noqa: B902 - rclpy's name errors have no common base
                raise VideoWindowError(
                    f'video_window_source gives the service name {service!r}, which ROS '
                    f'refuses ({type(exc).__name__}): name a node, e.g. /perception') from None
            self._forget_idle_clients()
            self._clients[service] = client
        return client

    def _forget_idle_clients(self) -> None:
        """Keep at most MAX_CLIENTS clients: destroy those no call in flight uses."""
        if len(self._clients) < MAX_CLIENTS:
            return
        with self._lock:
            busy = {p.ask.service for p in self._pending.values()}
        for name in [n for n in self._clients if n not in busy]:
            self._node.destroy_client(self._clients.pop(name))

    def start(self, key: Any, ask: WindowAsk,
              done: Callable[[Any, Optional[BaseException]], None]) -> None:
        """Ask `ask.service` for the window; `done(response, None)` or `done(None, error)`.

        `done` runs once, on an executor thread, unless cancel(key) came first.
        """
        timeout = float(self._timeout_s())
        pending = _Pending(ask, self._client(ask.service), time.monotonic() + timeout, done)
        with self._lock:
            self._pending[key] = pending
            # Never cancelled once made: cancelling it from another thread after the executor
            # took it as ready raised RCLError ('timer is canceled') and stopped the node. A
            # tick with nothing pending does nothing.
            if self._timer is None:
                self._timer = self._node.create_timer(POLL_S, self._tick,
                                                      callback_group=self._group)
        self._try_send(key, pending)

    def cancel(self, key: Any) -> bool:
        """Forget the call of `key`; False when none is in flight (its done ran or runs)."""
        pending = self._claim(key)
        if pending is None:
            return False
        if pending.future is not None:
            pending.client.remove_pending_request(pending.future)
        return True

    def _claim(self, key: Any) -> Optional[_Pending]:
        with self._lock:
            return self._pending.pop(key, None)

    def _try_send(self, key: Any, pending: _Pending) -> None:
        from edge_llm_msgs.srv import GetWindow
        if pending.future is not None or not pending.client.service_is_ready():
            return
        with self._lock:
            if self._pending.get(key) is not pending or pending.future is not None:
                return
            pending.future = pending.client.call_async(GetWindow.Request(
                last_seconds=pending.ask.seconds, fps=pending.ask.fps,
                max_frames=pending.ask.max_frames))
        pending.future.add_done_callback(lambda future: self._answered(key, pending, future))

    def _answered(self, key: Any, pending: _Pending, future: Any) -> None:
        if self._claim(key) is not pending:
            return
        if future.exception() is not None:
            pending.done(None, VideoWindowError(f'{pending.ask.service} failed: '
                                                f'{future.exception()}'))
        else:
            pending.done(future.result(), None)

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            items: List = list(self._pending.items())
        for key, pending in items:
            if now < pending.deadline:
                self._try_send(key, pending)
                continue
            if self._claim(key) is not pending:
                continue
            timeout = self._timeout_s()
            if pending.future is None:
                error = VideoWindowError(
                    f'no service {pending.ask.service} (waited {timeout:g} s): is '
                    'video_window_source a running perception node with window.seconds > 0? '
                    f"(or raise {self._node.get_name()}'s vision.window_timeout_s)")
            else:
                pending.client.remove_pending_request(pending.future)
                error = VideoWindowError(
                    f'{pending.ask.service} did not answer within {timeout:g} s: is the node '
                    f"busy or stopped? (or raise {self._node.get_name()}'s "
                    'vision.window_timeout_s)')
            pending.done(None, error)

    def close(self) -> None:
        """Destroy the clients and the timer (the calls in flight are dropped)."""
        with self._lock:
            self._pending.clear()
            timer, self._timer = self._timer, None
            clients, self._clients = list(self._clients.values()), {}
        if timer is not None:
            self._node.destroy_timer(timer)
        for client in clients:
            self._node.destroy_client(client)
