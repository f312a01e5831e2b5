"""TensorHandle conversion and the copy codecs (ROS messages, no processes)."""
import numpy as np
import pytest
from sensor_msgs.msg import Image
from std_msgs.msg import Header, MultiArrayDimension, UInt8MultiArray

from edge_llm_msgs.msg import TensorHandle
from edge_llm_ros.ipc.allocators import BufferKind
from edge_llm_ros.ipc.descriptor import TensorDescriptor
from edge_llm_ros.ipc.errors import DescriptorError
from edge_llm_ros.nodes import copy_codec
from edge_llm_ros.nodes.copy_codec import CopyCodecError
from edge_llm_ros.nodes.handles import from_handle, KIND_CONSTANTS, to_handle


def test_buffer_kinds_equal_the_message_constants():
    assert set(KIND_CONSTANTS) == set(BufferKind)
    assert all(int(kind) == value for kind, value in KIND_CONSTANTS.items())


def test_descriptor_round_trips_through_a_handle_message():
    desc = TensorDescriptor(pool_id='cam', slot=3, generation=7, sequence=99,
                            buffer_kind=BufferKind.UDMABUF, dtype='float16', shape=(4, 8),
                            strides=(32, 2), byte_offset=64)
    header = Header(frame_id='camera')
    header.stamp.sec = 12
    msg = to_handle(desc, header)
    assert isinstance(msg, TensorHandle) and msg.header.frame_id == 'camera'
    assert msg.buffer_kind == TensorHandle.KIND_UDMABUF and msg.nbytes == 3 * 32 + 7 * 2 + 2
    assert from_handle(msg) == desc


@pytest.mark.parametrize('change, match', [
    ({'nbytes': 5}, 'nbytes=5 does not match'),
    ({'dtype': 'complex64'}, "dtype 'complex64' is not supported"),
    ({'pool_id': '../etc'}, 'pool_id'),
    ({'buffer_kind': 9}, 'buffer_kind 9 is unknown'),
])
def test_malformed_handles_are_refused(change, match):
    msg = to_handle(TensorDescriptor(pool_id='cam', slot=0, generation=0, sequence=1,
                                     buffer_kind=BufferKind.MEMFD, dtype='uint8',
                                     shape=(2, 3)))
    for key, value in change.items():
        setattr(msg, key, value)
    with pytest.raises(DescriptorError, match=match):
        from_handle(msg)


# --- frames as sensor_msgs/Image -------------------------------------------------------------
FRAME = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)


def _image(encoding: str, pixels: np.ndarray, pad: int = 0) -> Image:
    rows = pixels.reshape(pixels.shape[0], -1)
    rows = np.concatenate([rows, np.full((rows.shape[0], pad), 0xEE, np.uint8)], axis=1)
    return Image(height=pixels.shape[0], width=pixels.shape[1], encoding=encoding,
                 step=rows.shape[1], data=rows.tobytes())


def test_rgb8_frames_round_trip_and_decode_without_copy():
    header = Header(frame_id='cam')
    msg = copy_codec.frame_to_image(FRAME, header)
    assert (msg.encoding, msg.step, msg.header.frame_id) == ('rgb8', 21, 'cam')
    view = copy_codec.image_to_rgb(msg)
    assert np.array_equal(view, FRAME) and not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(msg.data, np.uint8))


@pytest.mark.parametrize('encoding, pixels', [
    ('bgr8', FRAME[:, :, ::-1]),
    ('rgba8', np.dstack([FRAME, np.full(FRAME.shape[:2], 9, np.uint8)])),
    ('bgra8', np.dstack([FRAME[:, :, ::-1], np.full(FRAME.shape[:2], 9, np.uint8)])),
])
def test_camera_encodings_convert_to_rgb_in_one_pass(encoding, pixels):
    out = np.zeros_like(FRAME)
    assert copy_codec.image_to_rgb(_image(encoding, pixels, pad=5), out) is out
    assert np.array_equal(out, FRAME)


def test_mono8_is_spread_over_the_three_channels():
    rgb = copy_codec.image_to_rgb(_image('mono8', FRAME[:, :, 1].copy(), pad=1))
    assert all(np.array_equal(rgb[:, :, c], FRAME[:, :, 1]) for c in range(3))


@pytest.mark.parametrize('msg, out, match', [
    (_image('yuv422', FRAME), None, "'yuv422' is not supported"),
    (Image(height=5, width=7, encoding='rgb8', step=21, data=b'\0' * 50), None,
     'needs 105 bytes'),
    (Image(height=5, width=7, encoding='rgb8', step=20, data=b'\0' * 200), None,
     'step 20'),
    (_image('rgb8', FRAME), np.zeros((4, 7, 3), np.uint8), 'set width/height'),
])
def test_bad_images_are_refused(msg, out, match):
    with pytest.raises(CopyCodecError, match=match):
        copy_codec.image_to_rgb(msg, out)


def test_only_uint8_three_channel_frames_travel_as_images():
    with pytest.raises(CopyCodecError, match='rgb8'):
        copy_codec.frame_to_image(FRAME.astype(np.float32))


# --- tensors as std_msgs/UInt8MultiArray -----------------------------------------------------
@pytest.mark.parametrize('tensor', [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(24, dtype=np.int64).reshape(2, 3, 4)[:, ::2],     # not contiguous
    np.array([True, False, True]),
    np.array(3.5, np.float16),
    np.zeros((0, 5), np.uint16),
])
def test_tensors_round_trip_through_a_multiarray(tensor):
    msg = copy_codec.tensor_to_multiarray(tensor)
    labels = [d.label for d in msg.layout.dim]
    assert labels == [f'dim{i}' for i in range(tensor.ndim)] + [tensor.dtype.name]
    assert msg.layout.dim[0].stride == tensor.nbytes
    back = copy_codec.multiarray_to_tensor(msg)
    assert back.dtype == tensor.dtype and np.array_equal(back, tensor)
    assert not back.flags.writeable


def test_malformed_multiarrays_are_refused():
    good = copy_codec.tensor_to_multiarray(np.ones((2, 3), np.float32))
    short = copy_codec.tensor_to_multiarray(np.ones((2, 3), np.float32))
    short.data = short.data[:-1]
    with pytest.raises(CopyCodecError, match='needs 24 bytes'):
        copy_codec.multiarray_to_tensor(short)
    plain = UInt8MultiArray(data=good.data)
    plain.layout.dim = [MultiArrayDimension(label='x', size=24, stride=24)]
    with pytest.raises(CopyCodecError, match='does not name a dtype'):
        copy_codec.multiarray_to_tensor(plain)
    with pytest.raises(CopyCodecError, match='cannot travel'):
        copy_codec.tensor_to_multiarray(np.ones(2, '>f4'))
