"""Frame readers: where frame_source gets its pixels (no rclpy here).

``parse_source(text)`` decides the kind from the text alone or from what the path is:

- ``synthetic``: the counter pattern of :mod:`edge_llm_ros.vision.synthetic` (default)
- ``topic:<image topic>``: an existing ``sensor_msgs/Image`` camera topic (the node
  subscribes; no reader here)
- ``/dev/videoN``: a V4L2 camera, read through PyAV (FFmpeg's v4l2 input)
- an existing folder: its PNG/JPEG images in name order (Pillow), looped
- an existing image file: that image, repeated
- any other existing file: a video, decoded with PyAV (FFmpeg), looped

Every reader writes uint8 RGB frames of exactly the configured width x height into the
array it is given (a loaned pool slot): decoding into the slot is the one copy at ingress.
"""
import dataclasses
import enum
import glob
import os
from typing import Any, List, Optional

import numpy as np

from edge_llm_ros.vision import synthetic
from edge_llm_ros.vision.errors import FrameDecodeError, SourceError, SourceUnavailableError

IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg')
TOPIC_PREFIX = 'topic:'
PYAV_HINT = 'install PyAV (`pip install av`, binary wheels bundle FFmpeg)'


class SourceKind(enum.Enum):
    """What a source text names."""

    SYNTHETIC = 'synthetic'
    TOPIC = 'topic'
    V4L2 = 'v4l2'
    IMAGE_FOLDER = 'image_folder'
    IMAGE_FILE = 'image_file'
    VIDEO_FILE = 'video_file'


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """A parsed source: its kind and location (path or topic name)."""

    kind: SourceKind
    location: str = ''


def parse_source(text: str) -> SourceSpec:
    """Classify a source text; SourceError says what is accepted."""
    text = text.strip()
    if text == 'synthetic':
        return SourceSpec(SourceKind.SYNTHETIC)
    if text.startswith(TOPIC_PREFIX):
        topic = text[len(TOPIC_PREFIX):].strip()
        if not topic:
            raise SourceError("source 'topic:' needs an image topic, e.g. "
                              "'topic:/camera/image_raw'")
        return SourceSpec(SourceKind.TOPIC, topic)
    if text.startswith('/dev/video'):
        return SourceSpec(SourceKind.V4L2, text)
    if os.path.isdir(text):
        return SourceSpec(SourceKind.IMAGE_FOLDER, text)
    if os.path.isfile(text):
        if text.lower().endswith(IMAGE_EXTENSIONS):
            return SourceSpec(SourceKind.IMAGE_FILE, text)
        return SourceSpec(SourceKind.VIDEO_FILE, text)
    raise SourceError(
        f'source {text!r} is not usable: give "synthetic", "topic:<sensor_msgs/Image topic>", '
        'a V4L2 device (/dev/videoN), an existing folder of PNG/JPEG images, an image file '
        'or a video file')


class FrameReader:
    """Writes successive frames into caller-provided uint8 [height, width, 3] arrays."""

    def __init__(self, width: int, height: int) -> None:
        synthetic.check_size(width, height)
        self.width = width
        self.height = height

    @property
    def shape(self) -> tuple:
        """Shape of every frame."""
        return (self.height, self.width, synthetic.CHANNELS)

    def read_into(self, out: np.ndarray) -> None:
        """Write the next frame into out."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the log."""
        raise NotImplementedError

    def close(self) -> None:
        """Release files and devices."""


class SyntheticReader(FrameReader):
    """The counter pattern; frame k carries k (consumers verify every byte)."""

    def __init__(self, width: int, height: int, start: int = 0) -> None:
        super().__init__(width, height)
        self.counter = start

    def read_into(self, out: np.ndarray) -> None:
        synthetic.synthetic_frame(self.counter, self.height, self.width, out=out)
        self.counter += 1

    def describe(self) -> str:
        return f'synthetic pattern {self.width}x{self.height}'


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise SourceUnavailableError(
            'reading PNG/JPEG images needs Pillow (`pip install pillow`)') from exc
    return Image


class ImageFolderReader(FrameReader):
    """PNG/JPEG files in name order, resized to the frame size when they differ; looped."""

    def __init__(self, paths: List[str], width: int, height: int, what: str) -> None:
        super().__init__(width, height)
        self._image = _pillow()
        if not paths:
            raise SourceError(f'{what} holds no {"/".join(IMAGE_EXTENSIONS)} images')
        self.paths = paths
        self._what = what
        self._index = 0

    @classmethod
    def folder(cls, path: str, width: int, height: int) -> 'ImageFolderReader':
        """Read every image directly inside path (sub-folders are ignored)."""
        paths = sorted(p for p in glob.glob(os.path.join(glob.escape(path), '*'))
                       if p.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(p))
        return cls(paths, width, height, f'folder {path}')

    def read_into(self, out: np.ndarray) -> None:
        path = self.paths[self._index]
        self._index = (self._index + 1) % len(self.paths)
        try:
            with self._image.open(path) as img:
                img = img.convert('RGB')
                if img.size != (self.width, self.height):
                    img = img.resize((self.width, self.height), self._image.BILINEAR)
                out[...] = np.asarray(img)
        except (OSError, ValueError) as exc:
            raise FrameDecodeError(f'cannot decode image {path}: {exc}') from exc

    def describe(self) -> str:
        return f'{len(self.paths)} image(s) of {self._what} at {self.width}x{self.height}'


def _pyav(what: str) -> Any:
    try:
        import av
    except ImportError as exc:
        raise SourceUnavailableError(f'{what} needs PyAV: {PYAV_HINT}') from exc
    return av


class _AvReader(FrameReader):
    """Frames decoded by FFmpeg (through PyAV) and scaled to the frame size by swscale."""

    def __init__(self, width: int, height: int, loop: bool) -> None:
        super().__init__(width, height)
        self._loop = loop
        self._container: Any = None
        self._frames: Any = None

    def _open(self) -> Any:
        raise NotImplementedError

    def _next(self) -> Any:
        if self._container is None:
            self._container = self._open()
            self._frames = self._container.decode(video=0)
        try:
            return next(self._frames)
        except self._av.error.FFmpegError as exc:
            raise FrameDecodeError(f'{self.describe()}: cannot decode a frame: {exc}') from exc
        except StopIteration:
            if not self._loop:
                raise SourceError(f'{self.describe()}: end of stream') from None
            self._container.close()
            self._container = self._open()
            self._frames = self._container.decode(video=0)
            try:
                return next(self._frames)
            except StopIteration:
                raise SourceError(f'{self.describe()}: holds no video frames') from None

    def read_into(self, out: np.ndarray) -> None:
        frame = self._next()
        out[...] = frame.to_ndarray(format='rgb24', width=self.width, height=self.height)

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None


class VideoFileReader(_AvReader):
    """A video file (any container/codec FFmpeg decodes), looped at its end."""

    def __init__(self, path: str, width: int, height: int, loop: bool = True) -> None:
        super().__init__(width, height, loop)
        self._av = _pyav(f'reading the video file {path}')
        self.path = path
        self._container = self._open()     # fail now, not at the first frame
        self._frames = self._container.decode(video=0)

    def _open(self) -> Any:
        try:
            container = self._av.open(self.path)
        except (self._av.error.FFmpegError, OSError) as exc:
            raise SourceError(f'{self.path} is not a video FFmpeg can read: {exc}') from exc
        if not container.streams.video:
            container.close()
            raise SourceError(f'{self.path} has no video stream')
        return container

    def describe(self) -> str:
        return f'video {self.path} scaled to {self.width}x{self.height}'


class V4L2Reader(_AvReader):
    """A V4L2 camera through FFmpeg's v4l2 input (asks the device for width x height)."""

    def __init__(self, device: str, width: int, height: int, rate_hz: float) -> None:
        super().__init__(width, height, loop=False)
        if not os.path.exists(device):
            present = sorted(glob.glob('/dev/video*'))
            raise SourceError(f'V4L2 device {device} does not exist (present: '
                              f'{", ".join(present) or "none"})')
        self._av = _pyav(f'reading the V4L2 device {device}')
        self.device = device
        self.rate_hz = rate_hz
        self._container = self._open()
        self._frames = self._container.decode(video=0)

    def _open(self) -> Any:
        options = {'video_size': f'{self.width}x{self.height}',
                   'framerate': f'{self.rate_hz:g}'}
        try:
            return self._av.open(self.device, format='v4l2', options=options)
        except (self._av.error.FFmpegError, OSError) as exc:
            raise SourceError(f'cannot open V4L2 device {self.device} at '
                              f'{self.width}x{self.height}: {exc}') from exc

    def describe(self) -> str:
        return f'V4L2 device {self.device} at {self.width}x{self.height}'


def open_reader(spec: SourceSpec, width: int, height: int, rate_hz: float = 30.0,
                loop: bool = True) -> FrameReader:
    """Open the reader of a parsed source (TOPIC has none: the node subscribes instead)."""
    if spec.kind is SourceKind.SYNTHETIC:
        return SyntheticReader(width, height)
    if spec.kind is SourceKind.IMAGE_FOLDER:
        return ImageFolderReader.folder(spec.location, width, height)
    if spec.kind is SourceKind.IMAGE_FILE:
        return ImageFolderReader([spec.location], width, height, f'file {spec.location}')
    if spec.kind is SourceKind.VIDEO_FILE:
        return VideoFileReader(spec.location, width, height, loop)
    if spec.kind is SourceKind.V4L2:
        return V4L2Reader(spec.location, width, height, rate_hz)
    raise SourceError(f'source kind {spec.kind.value} has no frame reader')


def open_source(text: str, width: int, height: int, rate_hz: float = 30.0,
                loop: bool = True) -> Optional[FrameReader]:
    """Parse and open a source; None for a topic source (the node subscribes to it)."""
    synthetic.check_size(width, height)
    spec = parse_source(text)
    if spec.kind is SourceKind.TOPIC:
        return None
    return open_reader(spec, width, height, rate_hz, loop)
