"""Synthetic test pattern whose every byte depends on the frame counter.

Frame ``k`` of size H x W is ``(x + 2y + 85c + 3k) mod 256`` (a diagonal gradient that
moves by 3 levels per frame), with ``k`` written as 8 little-endian bytes at the start
and at the end of the frame. A consumer reads ``k`` back and recomputes the whole frame:
any mix of two frames (a torn read) fails the comparison, and a frame from another
producer fails on the counter.
"""
import functools
from typing import Optional

import numpy as np

from edge_llm_ros.bringup.parameters import MAX_FRAME_SIDE, MIN_FRAME_SIDE
from edge_llm_ros.vision.errors import FrameSizeError, TornFrameError

CHANNELS = 3
COUNTER_BYTES = 8


def check_size(width: int, height: int) -> None:
    """Raise FrameSizeError unless width and height are usable frame sides."""
    for name, value in (('width', width), ('height', height)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
                not MIN_FRAME_SIDE <= value <= MAX_FRAME_SIDE:
            raise FrameSizeError(f'{name}={value!r} is out of range: frames need '
                                 f'{MIN_FRAME_SIDE} <= width, height <= {MAX_FRAME_SIDE} pixels')


@functools.lru_cache(maxsize=4)
def _gradient(height: int, width: int) -> np.ndarray:
    y = np.arange(height, dtype=np.int64)[:, None, None]
    x = np.arange(width, dtype=np.int64)[None, :, None]
    c = np.arange(CHANNELS, dtype=np.int64)[None, None, :]
    grad = ((x + 2 * y + 85 * c) % 256).astype(np.uint8)
    grad.flags.writeable = False
    return grad


def synthetic_frame(counter: int, height: int, width: int,
                    out: Optional[np.ndarray] = None) -> np.ndarray:
    """Write frame ``counter`` (uint8 [height, width, 3]) into out (or a new array)."""
    check_size(width, height)
    if out is None:
        out = np.empty((height, width, CHANNELS), np.uint8)
    elif out.shape != (height, width, CHANNELS) or out.dtype != np.uint8:
        raise FrameSizeError(f'out is {out.dtype} {out.shape}, need uint8 '
                             f'{(height, width, CHANNELS)}')
    np.add(_gradient(height, width), np.uint8((3 * counter) % 256), out=out)
    stamp = np.frombuffer(int(counter).to_bytes(COUNTER_BYTES, 'little'), np.uint8)
    flat = out.reshape(-1)
    flat[:COUNTER_BYTES] = stamp
    flat[-COUNTER_BYTES:] = stamp
    return out


def read_counter(frame: np.ndarray) -> int:
    """Return the counter written at the start of a synthetic frame."""
    return int.from_bytes(np.ascontiguousarray(frame).reshape(-1)[:COUNTER_BYTES].tobytes(),
                          'little')


def check_frame(frame: np.ndarray) -> int:
    """Return the frame's counter; raise TornFrameError unless every byte matches it."""
    if frame.ndim != 3 or frame.shape[2] != CHANNELS or frame.dtype != np.uint8:
        raise TornFrameError(f'not a synthetic frame: {frame.dtype} {frame.shape}')
    counter = read_counter(frame)
    expected = synthetic_frame(counter, frame.shape[0], frame.shape[1])
    if not np.array_equal(frame, expected):
        bad_rows = np.nonzero((frame != expected).any(axis=(1, 2)))[0]
        raise TornFrameError(
            f'frame with counter {counter} differs from the pattern in {len(bad_rows)} of '
            f'{frame.shape[0]} rows (first: row {int(bad_rows[0])}): torn or overwritten')
    return counter
