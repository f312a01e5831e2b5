"""A video file -> a clip (runtime.media.VideoClip) of frames sampled at a given rate.

The CLI's --video files come through here (PyAV, FFmpeg's decoders). Frames are taken at
`fps` by their presentation times, as FFmpeg's fps filter does for llama.cpp's mtmd-helper:
the first frame, then the first frame at or after each 1 / fps step (fps 0: every frame),
at most `max_frames` of them from the start (the clip's token count grows with each pair).
"""
from __future__ import annotations

import math
import os
from typing import List, Union

import numpy as np

from edge_llm_ros.runtime.media import ImageInputError, VideoClip

DEFAULT_MAX_FRAMES = 16


def read_clip(path: Union[str, os.PathLike], fps: float = 2.0,
              max_frames: int = DEFAULT_MAX_FRAMES, what: str = '') -> VideoClip:
    """Return the clip of `path` sampled at fps (ImageInputError names what is wrong)."""
    what = what or f'the video {path}'
    if not math.isfinite(fps) or fps < 0:
        raise ImageInputError(f'{what}: fps must be >= 0 (0: every frame), got {fps}')
    if max_frames < 1:
        raise ImageInputError(f'{what}: the frame cap must be >= 1, got {max_frames}')
    try:
        import av
    except ImportError:
        raise ImageInputError(f'{what} needs PyAV to decode: pip install av') from None
    frames: List[np.ndarray] = []
    stamps: List[float] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ImageInputError(f'{what} has no video stream')
            stream = container.streams.video[0]
            step = 1.0 / fps if fps else 0.0
            due = None
            for index, frame in enumerate(container.decode(stream)):
                t = (float(frame.pts * stream.time_base) if frame.pts is not None
                     else index / float(stream.average_rate or 1))
                if due is not None and t < due - 1e-9 or (stamps and t <= stamps[-1]):
                    continue
                frames.append(frame.to_ndarray(format='rgb24'))
                stamps.append(t)
                due = (due if due is not None else t) + step
                while step and due <= t:
                    due += step
                if len(frames) == max_frames:
                    break
    except ImageInputError:
        raise
    except FileNotFoundError:
        raise ImageInputError(f'{what}: no such file') from None
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise ImageInputError(f'{what} cannot be decoded: {exc}') from None
    if not frames:
        raise ImageInputError(f'{what} holds no video frames')
    return VideoClip(tuple(frames), tuple(stamps), float(fps))
