"""Typed vision errors. Every message says what was wrong and what to change."""


class VisionError(Exception):
    """Base class of every error the vision layer raises on purpose."""


class SourceError(VisionError, ValueError):
    """A frame source specification cannot be used (unknown kind, missing path, no images)."""


class FrameDecodeError(SourceError):
    """One image or video packet cannot be decoded; the source itself may go on."""


class SourceUnavailableError(SourceError):
    """The source needs a library or device this machine does not have (PyAV, a camera)."""


class FrameSizeError(VisionError, ValueError):
    """A frame width/height is out of range, or an input image does not have the set size."""


class VisionModelLoadError(VisionError):
    """The perception ONNX model file is missing or onnxruntime cannot load it."""


class ModelMismatchError(VisionError, ValueError):
    """The model's input (dtype, rank, fixed dimensions) does not accept the frames."""


class TornFrameError(VisionError):
    """A synthetic frame's pixels do not match its own counter (mixed content of two frames)."""
