"""The perception node's time window: the last N seconds of its camera, as pool handles.

The node copies each frame it takes once into a slot of its own window pool (frame_source's
ring is a few slots deep, so its slots cannot be kept for seconds) and records it here by its
header stamp. `FrameWindow` is only the index: stamps and the items (descriptors, headers) the
node gives it, never pixels. It is bounded twice: by `seconds` (frames older than the newest by
more are forgotten) and by `max_frames` (the window pool's frame slots, so its memory is known
before the first frame: max_frames x one frame's bytes, see `window_frames`).

A request names a window either as "the last N seconds" (up to the node's clock now) or by two
stamps; `select` returns the frames in it, oldest first, sampled at `fps` (frames at least
1/fps apart, the newest kept) and at most `max_count` of them (spread evenly, the newest kept).
A window that holds no frame, or that starts before the oldest frame held (more than one frame
interval), is a WindowRangeError whose message says what the node holds: the caller asked for
more than is there, and silently giving less would answer another question.
No rclpy here.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
import threading
from typing import Any, Callable, Deque, List, Optional, Tuple

from edge_llm_ros.vision.errors import VisionError

NS = 1_000_000_000


class WindowError(VisionError, ValueError):
    """A time window request cannot be served; the message says why and what to change."""


class WindowRequestError(WindowError):
    """The request itself is malformed (both forms, end before start, negative values)."""


class WindowRangeError(WindowError):
    """The window holds no frame, or reaches past what the node holds (named in the message)."""


class WindowBudgetError(WindowError):
    """window.max_mb cannot hold even one frame of this size."""


@dataclass(frozen=True)
class WindowRequest:
    """One window, validated: [start_ns, end_ns] of header stamps, sampling rate and count."""

    start_ns: int
    end_ns: int
    fps: float = 0.0
    max_count: int = 0


@dataclass(frozen=True)
class Held:
    """One frame of the window: its header stamp (ns) and the node's item (handle parts)."""

    stamp_ns: int
    item: Any


def window_request(last_seconds: float, start_ns: int, end_ns: int, fps: float,
                   max_count: int, now_ns: int) -> WindowRequest:
    """Validate a request's fields (GetWindow's) into a WindowRequest; end_ns 0 = now."""
    if fps < 0 or max_count < 0 or last_seconds < 0:
        raise WindowRequestError(f'fps {fps:g}, max_frames {max_count} and last_seconds '
                                 f'{last_seconds:g} must be >= 0')
    if last_seconds > 0:
        if start_ns or end_ns:
            raise WindowRequestError('give either last_seconds or start/end, not both')
        return WindowRequest(now_ns - round(last_seconds * NS), now_ns, fps, max_count)
    if not start_ns:
        raise WindowRequestError('no window: give last_seconds > 0, or a start stamp (and an '
                                 'end stamp, or none for now)')
    end_ns = end_ns or now_ns
    if end_ns < start_ns:
        raise WindowRequestError(f'end {end_ns / NS:.3f} s is before start {start_ns / NS:.3f}'
                                 ' s: swap them')
    return WindowRequest(start_ns, end_ns, fps, max_count)


def window_frames(seconds: float, max_frames: int, max_bytes: int, frame_nbytes: int,
                  spare: int) -> int:
    """Return how many frames the window pool keeps: max_frames, or fewer to fit max_bytes.

    spare: the pool's slots beyond the window (its consumers' holds and the producer's loan),
    which count against the budget too. WindowBudgetError when not even one frame fits.
    """
    fit = max_bytes // max(frame_nbytes, 1) - spare
    if fit < 1:
        raise WindowBudgetError(
            f'window.max_mb ({max_bytes / 2 ** 20:g} MiB) holds no {frame_nbytes}-byte frame '
            f'beside the {spare} slots its consumers and the producer need: raise window.max_mb '
            f'to at least {(spare + 1) * frame_nbytes / 2 ** 20:.1f} or set window.seconds 0')
    return min(max_frames, fit)


class FrameWindow:
    """The window's index (thread-safe): frames by stamp, bounded by seconds and count."""

    def __init__(self, seconds: float, max_frames: int) -> None:
        if seconds <= 0 or max_frames < 1:
            raise WindowRequestError(f'a window needs seconds > 0 and max_frames >= 1, got '
                                     f'{seconds:g} s and {max_frames}')
        self.seconds = float(seconds)
        self.max_frames = int(max_frames)
        self._frames: Deque[Held] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._frames)

    def add(self, stamp_ns: int, item: Any) -> List[Held]:
        """Record the newest frame; return the frames it pushed out (oldest first).

        A stamp older than the newest held one (a camera's clock stepped back) starts the
        window again: the older frames are returned as pushed out.
        """
        out: List[Held] = []
        with self._lock:
            frames = self._frames
            if frames and stamp_ns < frames[-1].stamp_ns:
                out.extend(frames)
                frames.clear()
            frames.append(Held(int(stamp_ns), item))
            oldest = stamp_ns - round(self.seconds * NS)
            while len(frames) > self.max_frames or frames[0].stamp_ns < oldest:
                out.append(frames.popleft())
        return out

    def drop(self, predicate: Callable[[Any], bool]) -> int:
        """Forget the frames whose item matches (e.g. a slot the pool hands out again)."""
        with self._lock:
            kept = collections.deque(h for h in self._frames if not predicate(h.item))
            dropped = len(self._frames) - len(kept)
            self._frames = kept
        return dropped

    def span(self) -> Tuple[int, Optional[int], Optional[int]]:
        """Return (frames held, oldest stamp ns, newest stamp ns)."""
        with self._lock:
            if not self._frames:
                return 0, None, None
            return len(self._frames), self._frames[0].stamp_ns, self._frames[-1].stamp_ns

    def describe(self) -> str:
        """Say what the window holds, for error messages and logs."""
        count, oldest, newest = self.span()
        bounds = f'window.seconds {self.seconds:g}, window frames {self.max_frames}'
        if not count:
            return f'the node holds no frame yet ({bounds}): is its camera publishing?'
        return (f'the node holds {count} frame(s) from {oldest / NS:.3f} s to '
                f'{newest / NS:.3f} s ({(newest - oldest) / NS:.2f} s; {bounds})')

    def select(self, request: WindowRequest) -> List[Held]:
        """Return the window's frames, oldest first, sampled (see the module docstring)."""
        with self._lock:
            frames = list(self._frames)
        if not frames:
            raise WindowRangeError(f'no frame in the window: {self.describe()}')
        interval = ((frames[-1].stamp_ns - frames[0].stamp_ns) // (len(frames) - 1)
                    if len(frames) > 1 else 0)
        if request.start_ns < frames[0].stamp_ns - interval:
            raise WindowRangeError(
                f'the window starts at {request.start_ns / NS:.3f} s, before the oldest frame '
                f'held: {self.describe()}; ask for a shorter or later window, or raise '
                'window.seconds')
        chosen = [h for h in frames if request.start_ns <= h.stamp_ns <= request.end_ns]
        if not chosen:
            raise WindowRangeError(
                f'no frame between {request.start_ns / NS:.3f} s and {request.end_ns / NS:.3f}'
                f' s: {self.describe()}')
        if request.fps > 0:
            chosen = _at_rate(chosen, round(NS / request.fps))
        if request.max_count and len(chosen) > request.max_count:
            chosen = _spread(chosen, request.max_count)
        return chosen


def _at_rate(frames: List[Held], period_ns: int) -> List[Held]:
    """Keep frames at least period_ns apart, walking back from the newest."""
    kept = [frames[-1]]
    for held in reversed(frames[:-1]):
        if kept[-1].stamp_ns - held.stamp_ns >= period_ns:
            kept.append(held)
    return kept[::-1]


def _spread(frames: List[Held], count: int) -> List[Held]:
    """Pick `count` frames evenly spaced by position, the newest always among them."""
    if count == 1:
        return [frames[-1]]
    last = len(frames) - 1
    picks = sorted({last - round(i * last / (count - 1)) for i in range(count)})
    return [frames[i] for i in picks]


# Slots of the window pool beyond its frames: the holds its consumers may take (llm_node asks
# for 8: nodes/embeddings.WINDOW_INFLIGHT) and the producer's one loan.
CONSUMER_HOLDS = 8


class WindowRing:
    """The window pool (one copy of each frame) and its index; made at the first frame.

    `pool_config(frame_nbytes, frames)` builds the pool's config; the pool is an ipc TensorPool
    created by the caller's factory, so this module stays free of sockets until it is used.
    """

    def __init__(self, seconds: float, max_frames: int, max_bytes: int,
                 make_pool: Callable[[int, int], Any]) -> None:
        self.seconds, self.max_frames, self.max_bytes = seconds, max_frames, max_bytes
        self._make_pool = make_pool
        self.pool: Any = None
        self.index: Optional[FrameWindow] = None
        self._layout: Optional[Tuple[str, Tuple[int, ...]]] = None
        self.copies = 0

    def add(self, frame: Any, stamp_ns: int, header: Any) -> Optional[str]:
        """Copy one frame into the ring and index it; return a log line when the pool is made.

        WindowRequestError when the camera changes the frame's size or dtype.
        """
        made = None
        layout = (frame.dtype.name, tuple(int(d) for d in frame.shape))
        if self.pool is None:
            frames = window_frames(self.seconds, self.max_frames, self.max_bytes,
                                   frame.nbytes, CONSUMER_HOLDS + 1)
            self.pool = self._make_pool(frame.nbytes, frames + CONSUMER_HOLDS + 1)
            self.index = FrameWindow(self.seconds, frames)
            self._layout = layout
            made = (f'window: the last {self.seconds:g} s, at most {frames} frames of '
                    f'{layout[0]} {list(layout[1])} in pool {self.pool.pool_id!r} '
                    f'({self.pool.slot_count} slots, '
                    f'{self.pool.slot_count * frame.nbytes / 2 ** 20:.1f} MiB)')
        elif layout != self._layout:
            raise WindowRequestError(
                f'a {layout[0]} {list(layout[1])} frame does not fit the window of '
                f'{self._layout[0]} {list(self._layout[1])} frames: the camera changed; '
                'restart perception for the new size')
        loan = self.pool.loan()
        try:
            # The pool hands out the oldest slot no consumer holds: forget its old frame.
            self.index.drop(lambda item: item[0].slot == loan.slot)
            view = loan.ndarray(*layout)
            view[...] = frame
            desc = loan.publish()
        except BaseException:
            loan.discard()
            raise
        self.index.add(stamp_ns, (desc, header))
        self.copies += 1
        return made

    def select(self, request: WindowRequest) -> List[Held]:
        """Return the frames for `request` (FrameWindow.select); items are (desc, header)."""
        if self.index is None:
            raise WindowRangeError(f'no frame in the window: the node holds no frame yet '
                                   f'(window.seconds {self.seconds:g}): is its camera '
                                   'publishing?')
        return self.index.select(request)

    def span(self) -> Tuple[int, Optional[int], Optional[int]]:
        """Return (frames held, oldest stamp ns, newest stamp ns)."""
        return self.index.span() if self.index is not None else (0, None, None)

    def close(self) -> None:
        """Free the window pool (consumers' mapped views stay valid)."""
        if self.pool is not None:
            self.pool.close()
