"""TensorDescriptor validation, message conversion and the copying fallback."""
import types

import numpy as np
import pytest

from edge_llm_ros.ipc.allocators import BufferKind
from edge_llm_ros.ipc.descriptor import (array_from_bytes, describe_array, HANDLE_FIELDS,
                                         TensorDescriptor)
from edge_llm_ros.ipc.errors import DescriptorError, InvalidHandleError, SlotOutOfRangeError


def make(**kw):
    fields = {'pool_id': 'cam0', 'slot': 1, 'generation': 2, 'sequence': 3,
              'buffer_kind': BufferKind.MEMFD, 'dtype': 'uint8', 'shape': (4, 5, 3)}
    fields.update(kw)
    return TensorDescriptor(**fields)


def test_contiguous_nbytes_is_computed_and_checked():
    d = make()
    assert d.nbytes == 60
    assert d.effective_strides == (15, 3, 1)
    assert make(dtype='float32', shape=(2, 3), nbytes=24).nbytes == 24
    with pytest.raises(DescriptorError, match='nbytes=61 does not match'):
        make(nbytes=61)


def test_strided_views_span():
    base = np.zeros((8, 10), np.float32)
    view = base[::2, 1:9]   # non-contiguous: strides (80, 4)
    dtype, shape, strides = describe_array(view)
    d = make(dtype=dtype, shape=shape, strides=strides, byte_offset=4)
    assert d.nbytes == 3 * 80 + 7 * 4 + 4
    assert d.effective_strides == (80, 4)


@pytest.mark.parametrize('kw, message', [
    ({'dtype': 'complex64'}, "dtype 'complex64' is not supported"),
    ({'dtype': 'float32', 'strides': (12,)}, 'strides .* do not match shape'),
    ({'dtype': 'float32', 'shape': (4,), 'strides': (6,)}, 'not a multiple of the float32'),
    ({'dtype': 'float32', 'shape': (4,), 'byte_offset': 2}, 'byte_offset=2 is not aligned'),
    ({'shape': (4, -1)}, r'shape\[1\]=-1 is outside'),
    ({'shape': (2,), 'strides': (-1,)}, r'strides\[0\]=-1 is outside'),
    ({'shape': (1,) * 17}, 'at most 16 are supported'),
    ({'shape': 'abc'}, 'sequence of integers'),
    ({'shape': (2.0,)}, 'must be an integer'),
    ({'slot': -1}, 'slot=-1 is outside'),
    ({'slot': True}, 'must be an integer'),
    ({'buffer_kind': 9}, 'buffer_kind 9 is unknown'),
    ({'pool_id': '../etc'}, "pool_id '../etc' is invalid"),
    ({'pool_id': 'a/b'}, 'is invalid'),
    ({'pool_id': ''}, 'is invalid'),
    ({'pool_id': 'x' * 65}, 'is invalid'),
])
def test_inconsistent_descriptors_are_rejected(kw, message):
    with pytest.raises(DescriptorError, match=message):
        make(**kw)


def test_descriptor_errors_are_invalid_handle_and_value_errors():
    with pytest.raises(InvalidHandleError):
        make(dtype='object')
    with pytest.raises(ValueError):
        make(dtype='object')


def test_check_fits_slot_and_buffer_size():
    d = make(byte_offset=4096 - 60)
    d.check_fits(4096, slot_count=2)
    with pytest.raises(SlotOutOfRangeError, match='slot 1 is out of range.*1 slots'):
        d.check_fits(4096, slot_count=1)
    with pytest.raises(DescriptorError, match=r'spans bytes \[4037, 4097\)'):
        make(byte_offset=4096 - 59).check_fits(4096, slot_count=2)


def test_empty_tensor_has_zero_bytes():
    assert make(shape=(0, 3)).nbytes == 0


def test_pack_roundtrip():
    for d in (make(), make(dtype='float16', shape=(3, 2), strides=(8, 2), byte_offset=64),
              make(shape=(), dtype='int64')):
        assert TensorDescriptor.unpack('cam0', d.pack()) == d
    with pytest.raises(DescriptorError, match='malformed'):
        TensorDescriptor.unpack('cam0', make().pack()[:20])


def test_msg_roundtrip_with_a_namespace():
    d = make(strides=(15, 3, 1))
    msg = d.to_msg(types.SimpleNamespace())
    assert TensorDescriptor.from_msg(msg) == d
    del msg.nbytes
    with pytest.raises(DescriptorError, match='missing nbytes'):
        TensorDescriptor.from_msg(msg)


def test_msg_roundtrip_with_the_real_message():
    handle_mod = pytest.importorskip('edge_llm_msgs.msg')
    msg = handle_mod.TensorHandle()
    assert set(HANDLE_FIELDS) <= set(msg.get_fields_and_field_types())
    assert msg.KIND_DMA_HEAP == BufferKind.DMA_HEAP and msg.KIND_NVBUF == BufferKind.NVBUF
    d = make(dtype='float32', shape=(2, 3), buffer_kind=BufferKind.UDMABUF)
    back = TensorDescriptor.from_msg(d.to_msg(msg))
    assert back == d
    msg.nbytes = 7   # a message edited into inconsistency is rejected on the way in
    with pytest.raises(DescriptorError, match='nbytes=7'):
        TensorDescriptor.from_msg(msg)


def test_array_from_bytes():
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = make(dtype='float32', shape=(3, 4))
    arr = array_from_bytes(d, src.tobytes())
    assert not arr.flags.writeable
    np.testing.assert_array_equal(arr, src)
    with pytest.raises(DescriptorError, match='holds 44 bytes'):
        array_from_bytes(d, src.tobytes()[:44])


def test_describe_array_rejects_foreign_dtypes():
    with pytest.raises(DescriptorError, match='cannot travel'):
        describe_array(np.zeros(3, '>f4'))
    with pytest.raises(DescriptorError, match='cannot travel'):
        describe_array(np.zeros(3, np.complex64))
