"""Tensors as ordinary ROS messages, for consumers that cannot map the producer's buffers.

Frames travel as ``sensor_msgs/Image`` (rgb8), any other tensor as
``std_msgs/UInt8MultiArray`` whose layout describes its bytes: one dimension per tensor
dimension (labels ``dim0``, ``dim1``, ...) and a last dimension labelled with the numpy
dtype whose size is the item size. Strides follow the std_msgs convention (bytes spanned
by a dimension and everything inside it), so ``[196, 576] float32`` becomes the layout
``dim0 196/451584, dim1 576/2304, float32 4/4``.

The same Image decoding serves frame_source's camera adapter (one copy into the pool).
"""
import array
from typing import Optional, Tuple

import numpy as np
from sensor_msgs.msg import Image
from std_msgs.msg import Header, MultiArrayDimension, UInt8MultiArray

from edge_llm_ros.ipc.descriptor import DTYPES


class CopyCodecError(ValueError):
    """A copy message cannot be decoded (unknown encoding, inconsistent sizes)."""


_RGB = slice(0, 3)
_BGR = slice(2, None, -1)
# encoding -> (channels, the slice picking R, G, B from them; mono8 is broadcast)
ENCODINGS = {
    'rgb8': (3, _RGB),
    'bgr8': (3, _BGR),
    'rgba8': (4, _RGB),
    'bgra8': (4, _BGR),
    'mono8': (1, slice(0, 1)),
}


def frame_to_image(frame: np.ndarray, header: Optional[Header] = None) -> Image:
    """Build an rgb8 Image of a uint8 [height, width, 3] frame (the message copies it)."""
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise CopyCodecError(f'frames travel as rgb8 images: need uint8 [h, w, 3], got '
                             f'{frame.dtype} {list(frame.shape)}')
    msg = Image(height=frame.shape[0], width=frame.shape[1], encoding='rgb8',
                is_bigendian=0, step=frame.shape[1] * 3)
    if header is not None:
        msg.header = header
    msg.data = _byte_array(frame)
    return msg


def _byte_array(values: np.ndarray) -> array.array:
    """Copy values' bytes (C order) into an array('B'), which rclpy keeps without a copy."""
    data = array.array('B')
    data.frombytes(np.ascontiguousarray(values).reshape(-1).view(np.uint8).data)
    return data


def _image_pixels(msg: Image) -> Tuple[np.ndarray, slice]:
    """[h, w, channels] uint8 view of an Image's data and the slice of its R, G, B."""
    if msg.encoding not in ENCODINGS:
        raise CopyCodecError(f'image encoding {msg.encoding!r} is not supported; use one of '
                             f'{", ".join(ENCODINGS)}')
    channels, order = ENCODINGS[msg.encoding]
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    data = np.frombuffer(msg.data, np.uint8)
    if step < w * channels or data.size < h * step:
        raise CopyCodecError(f'{msg.encoding} image {w}x{h} with step {step} needs '
                             f'{h * step} bytes of data, has {data.size}')
    rows = data[:h * step].reshape(h, step)[:, :w * channels]
    return rows.reshape(h, w, channels), order


def image_to_rgb(msg: Image, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Return the RGB uint8 [h, w, 3] pixels of an Image, converted into out when given.

    Without out, an rgb8 image without row padding is returned as a read-only view of the
    message data (no copy).
    """
    pixels, rgb = _image_pixels(msg)
    shape = pixels.shape[:2] + (3,)
    if out is None:
        if msg.encoding == 'rgb8' and pixels.flags.c_contiguous:
            pixels.flags.writeable = False
            return pixels
        out = np.empty(shape, np.uint8)
    elif out.shape != shape or out.dtype != np.uint8:
        raise CopyCodecError(f'{msg.encoding} image is {msg.width}x{msg.height}; the frame '
                             f'buffer is {out.dtype} {list(out.shape)} (set width/height to '
                             'the camera resolution)')
    out[...] = pixels[:, :, rgb]    # one pass; mono8's single channel broadcasts
    return out


def tensor_to_multiarray(tensor: np.ndarray) -> UInt8MultiArray:
    """Build a UInt8MultiArray of tensor's bytes (C order) with a layout naming its dtype."""
    dtype = np.dtype(tensor.dtype)
    if dtype.name not in DTYPES or dtype.byteorder == '>':
        raise CopyCodecError(f'dtype {dtype} cannot travel as a copy; use one of '
                             f'{", ".join(DTYPES)}')
    sizes = list(tensor.shape) + [dtype.itemsize]
    labels = [f'dim{i}' for i in range(tensor.ndim)] + [dtype.name]
    dims, stride = [], 1
    for size in reversed(sizes):
        stride *= size
        dims.append(stride)
    dims.reverse()
    msg = UInt8MultiArray()
    msg.layout.dim = [MultiArrayDimension(label=lab, size=size, stride=stride)
                      for lab, size, stride in zip(labels, sizes, dims)]
    msg.layout.data_offset = 0
    msg.data = _byte_array(tensor)
    return msg


def multiarray_to_tensor(msg: UInt8MultiArray) -> np.ndarray:
    """Return a read-only array over a UInt8MultiArray from tensor_to_multiarray (no copy)."""
    dims = list(msg.layout.dim)
    if not dims or dims[-1].label not in DTYPES:
        raise CopyCodecError('UInt8MultiArray layout does not name a dtype in its last '
                             f'dimension (labels {[d.label for d in dims]})')
    dtype = np.dtype(dims[-1].label)
    if dims[-1].size != dtype.itemsize:
        raise CopyCodecError(f'last dimension {dims[-1].label!r} has size {dims[-1].size}, '
                             f'not the item size {dtype.itemsize}')
    shape = tuple(int(d.size) for d in dims[:-1])
    offset = int(msg.layout.data_offset)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    data = np.frombuffer(msg.data, np.uint8)
    if data.size != offset + nbytes:
        raise CopyCodecError(f'{dtype.name} {list(shape)} needs {nbytes} bytes after offset '
                             f'{offset}; the message holds {data.size}')
    array = data[offset:].view(dtype).reshape(shape)
    array.flags.writeable = False
    return array
