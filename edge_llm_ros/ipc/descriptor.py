"""TensorDescriptor: what travels instead of the bytes (topics, goals, the pool socket).

Validation is strict: a descriptor whose shape, dtype, strides, offset and nbytes do
not describe exactly one in-bounds tensor is rejected with DescriptorError before any
memory is touched. Conversion to and from an ``edge_llm_msgs/msg/TensorHandle`` is
duck-typed by attribute name, so this module imports neither rclpy nor the message
package: the node layer passes a message object in.
"""
import dataclasses
import re
import struct
from typing import Any, Dict, Optional, Tuple

import numpy as np

from edge_llm_ros.ipc.allocators import BufferKind
from edge_llm_ros.ipc.errors import DescriptorError, SlotOutOfRangeError

# numpy dtype names accepted in handles (little-endian, native to every target board).
DTYPES = ('bool', 'uint8', 'int8', 'uint16', 'int16', 'uint32', 'int32', 'uint64', 'int64',
          'float16', 'float32', 'float64')
MAX_NDIM = 16
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
# pool_id names a socket file: keep it to a safe file name (no '/', no leading '.').
POOL_ID_RE = re.compile(r'^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$')

HANDLE_FIELDS = ('pool_id', 'slot', 'generation', 'sequence', 'buffer_kind', 'dtype', 'shape',
                 'strides', 'byte_offset', 'nbytes')


def check_pool_id(pool_id: Any) -> str:
    """Return pool_id if it is a safe socket file name, else raise DescriptorError."""
    if not isinstance(pool_id, str) or not POOL_ID_RE.match(pool_id):
        raise DescriptorError(
            f'pool_id {pool_id!r} is invalid: use 1-64 characters [A-Za-z0-9_.-], '
            'not starting with "." or "-"')
    return pool_id


def _as_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise DescriptorError(f'{name} must be an integer, got {type(value).__name__}')
    value = int(value)
    if not low <= value <= high:
        raise DescriptorError(f'{name}={value} is outside [{low}, {high}]')
    return value


def _as_int_tuple(name: str, values: Any, low: int, high: int) -> Tuple[int, ...]:
    if isinstance(values, (str, bytes)):
        raise DescriptorError(f'{name} must be a sequence of integers, got {values!r}')
    try:
        items = list(values)
    except TypeError as exc:
        raise DescriptorError(f'{name} must be a sequence of integers') from exc
    return tuple(_as_int(f'{name}[{i}]', v, low, high) for i, v in enumerate(items))


@dataclasses.dataclass(frozen=True)
class TensorDescriptor:
    """Where a tensor lives in a producer's pool and how to read it.

    ``strides`` are byte strides, one per dimension; empty means C-contiguous.
    ``nbytes`` is the byte span the tensor occupies from ``byte_offset`` (for a
    C-contiguous tensor: prod(shape) * itemsize). Negative strides are not supported.
    """

    pool_id: str
    slot: int
    generation: int
    sequence: int
    buffer_kind: BufferKind
    dtype: str
    shape: Tuple[int, ...]
    strides: Tuple[int, ...] = ()
    byte_offset: int = 0
    nbytes: int = -1  # -1: computed from shape/dtype/strides

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalize fields in place
        set_(self, 'pool_id', check_pool_id(self.pool_id))
        set_(self, 'slot', _as_int('slot', self.slot, 0, U32))
        set_(self, 'generation', _as_int('generation', self.generation, 0, U64))
        set_(self, 'sequence', _as_int('sequence', self.sequence, 0, U64))
        try:
            set_(self, 'buffer_kind', BufferKind(int(self.buffer_kind)))
        except (ValueError, TypeError) as exc:
            raise DescriptorError(
                f'buffer_kind {self.buffer_kind!r} is unknown; known: '
                f'{", ".join(f"{k.value}={k.name}" for k in BufferKind)}') from exc
        if self.dtype not in DTYPES:
            raise DescriptorError(f'dtype {self.dtype!r} is not supported; use one of '
                                  f'{", ".join(DTYPES)}')
        shape = _as_int_tuple('shape', self.shape, 0, U32)
        if len(shape) > MAX_NDIM:
            raise DescriptorError(f'{len(shape)} dimensions; at most {MAX_NDIM} are supported')
        set_(self, 'shape', shape)
        itemsize = self.itemsize
        strides = _as_int_tuple('strides', self.strides, 0, U32 * itemsize)
        if strides and len(strides) != len(shape):
            raise DescriptorError(f'strides {strides} do not match shape {shape}: one byte '
                                  'stride per dimension, or none for C-contiguous')
        for i, s in enumerate(strides):
            if s % itemsize:
                raise DescriptorError(f'strides[{i}]={s} is not a multiple of the {self.dtype} '
                                      f'item size {itemsize} (misaligned)')
        set_(self, 'strides', strides)
        set_(self, 'byte_offset', _as_int('byte_offset', self.byte_offset, 0, U64))
        if self.byte_offset % itemsize:
            raise DescriptorError(f'byte_offset={self.byte_offset} is not aligned to the '
                                  f'{self.dtype} item size {itemsize}')
        span = self.span()
        if self.nbytes == -1:
            set_(self, 'nbytes', span)
        set_(self, 'nbytes', _as_int('nbytes', self.nbytes, 0, U64))
        if self.nbytes != span:
            raise DescriptorError(
                f'nbytes={self.nbytes} does not match shape {shape}, dtype {self.dtype} and '
                f'strides {strides or "(C-contiguous)"}, which span {span} bytes')

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return np.dtype(self.dtype).itemsize

    @property
    def effective_strides(self) -> Tuple[int, ...]:
        """Byte strides, computed for C order when none were given."""
        if self.strides:
            return self.strides
        out, acc = [], self.itemsize
        for dim in reversed(self.shape):
            out.append(acc)
            acc *= dim
        return tuple(reversed(out))

    def span(self) -> int:
        """Bytes from the first to one past the last element (0 for an empty tensor)."""
        if any(d == 0 for d in self.shape):
            return 0
        return sum((d - 1) * s for d, s in zip(self.shape, self.effective_strides)) + \
            self.itemsize

    @property
    def key(self) -> Tuple[str, int, int, int]:
        """Identity of the published frame: (pool_id, slot, generation, sequence)."""
        return (self.pool_id, self.slot, self.generation, self.sequence)

    def check_fits(self, buffer_size: int, slot_count: int) -> None:
        """Raise unless the slot exists and the tensor lies inside the slot's buffer."""
        if self.slot >= slot_count:
            raise SlotOutOfRangeError(
                f'slot {self.slot} is out of range: pool {self.pool_id!r} has {slot_count} '
                'slots')
        if self.byte_offset + self.nbytes > buffer_size:
            raise DescriptorError(
                f'tensor spans bytes [{self.byte_offset}, {self.byte_offset + self.nbytes}) '
                f'but slot buffers of pool {self.pool_id!r} hold {buffer_size} bytes')

    def replace(self, **changes: Any) -> 'TensorDescriptor':
        """Return a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_ids(self, slot: int, generation: int, sequence: int,
                 check: bool = True) -> 'TensorDescriptor':
        """Return this (validated) layout with other slot/generation/sequence: the hot path.

        check=False is for ids that cannot be out of range (our own counters, or values
        just decoded from fixed-width struct fields).
        """
        if check:
            slot = _as_int('slot', slot, 0, U32)
            generation = _as_int('generation', generation, 0, U64)
            sequence = _as_int('sequence', sequence, 0, U64)
        new = object.__new__(TensorDescriptor)
        d = new.__dict__   # frozen dataclass: write the instance dict directly
        d.update(self.__dict__)
        d['slot'], d['generation'], d['sequence'] = slot, generation, sequence
        return new

    # --- edge_llm_msgs/msg/TensorHandle, duck-typed ------------------------------------
    def to_msg(self, msg: Any) -> Any:
        """Fill a TensorHandle-like object's fields (header is left to the caller)."""
        msg.pool_id = self.pool_id
        msg.slot = self.slot
        msg.generation = self.generation
        msg.sequence = self.sequence
        msg.buffer_kind = int(self.buffer_kind)
        msg.dtype = self.dtype
        msg.shape = list(self.shape)
        msg.strides = list(self.strides)
        msg.byte_offset = self.byte_offset
        msg.nbytes = self.nbytes
        return msg

    @classmethod
    def from_msg(cls, msg: Any) -> 'TensorDescriptor':
        """Build (and validate) a descriptor from a TensorHandle-like object."""
        if isinstance(msg, TensorDescriptor):
            return msg
        missing = [f for f in HANDLE_FIELDS if not hasattr(msg, f)]
        if missing:
            raise DescriptorError(f'{type(msg).__name__} is not a TensorHandle: missing '
                                  f'{", ".join(missing)}')
        return cls(pool_id=msg.pool_id, slot=msg.slot, generation=msg.generation,
                   sequence=msg.sequence, buffer_kind=msg.buffer_kind, dtype=msg.dtype,
                   shape=msg.shape, strides=msg.strides, byte_offset=msg.byte_offset,
                   nbytes=msg.nbytes)

    # --- compact binary form used on the pool socket -------------------------------------
    _HEAD = struct.Struct('<IQQBBBxQQ')  # slot gen seq kind ndim has_strides | offset nbytes

    def pack(self) -> bytes:
        """Serialize everything but pool_id (the socket already names the pool)."""
        layout = self.__dict__.get('_packed_layout')   # shared by with_ids() copies
        if layout is None:
            ndim = len(self.shape)
            dtype = self.dtype.encode()
            layout = b''.join((
                _LAYOUT_HEAD.pack(int(self.buffer_kind), ndim, 1 if self.strides else 0,
                                  self.byte_offset, self.nbytes),
                struct.pack(f'<B{len(dtype)}s', len(dtype), dtype),
                struct.pack(f'<{ndim}Q', *self.shape),
                struct.pack(f'<{ndim}q', *self.strides) if self.strides else b''))
            self.__dict__['_packed_layout'] = layout
        return _IDS.pack(self.slot, self.generation, self.sequence) + layout

    @classmethod
    def unpack(cls, pool_id: str, data: bytes, offset: int = 0) -> 'TensorDescriptor':
        """Inverse of pack() (the descriptor runs to the end of data); DescriptorError if bad.

        A layout already validated for this pool is reused: a stream of frames of one
        shape pays for full validation once.
        """
        key = (pool_id, bytes(data[offset + _IDS.size:]))
        proto = _LAYOUTS.get(key)
        if proto is not None:
            try:
                slot, gen, seq = _IDS.unpack_from(data, offset)
            except struct.error as exc:
                raise DescriptorError(f'malformed packed descriptor: {exc}') from exc
            return proto.with_ids(slot, gen, seq, check=False)
        desc = cls._unpack_checked(pool_id, data, offset)
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[key] = desc
        return desc

    @classmethod
    def _unpack_checked(cls, pool_id: str, data: bytes, offset: int) -> 'TensorDescriptor':
        try:
            slot, gen, seq, kind, ndim, has_strides, byte_offset, nbytes = \
                cls._HEAD.unpack_from(data, offset)
            offset += cls._HEAD.size
            (dlen,) = struct.unpack_from('<B', data, offset)
            dtype = bytes(data[offset + 1:offset + 1 + dlen]).decode()
            offset += 1 + dlen
            shape = struct.unpack_from(f'<{ndim}Q', data, offset)
            offset += 8 * ndim
            strides = struct.unpack_from(f'<{ndim}q', data, offset) if has_strides else ()
        except (struct.error, UnicodeDecodeError) as exc:
            raise DescriptorError(f'malformed packed descriptor: {exc}') from exc
        return cls(pool_id=pool_id, slot=slot, generation=gen, sequence=seq, buffer_kind=kind,
                   dtype=dtype, shape=shape, strides=strides, byte_offset=byte_offset,
                   nbytes=nbytes)


_IDS = struct.Struct('<IQQ')   # the head of _HEAD that changes from frame to frame
_LAYOUT_HEAD = struct.Struct('<BBBxQQ')   # the rest of _HEAD
_LAYOUTS: Dict[Tuple[str, bytes], TensorDescriptor] = {}
_MAX_LAYOUTS = 256


def describe_array(array: np.ndarray) -> Tuple[str, Tuple[int, ...], Tuple[int, ...]]:
    """(dtype name, shape, byte strides or () when C-contiguous) of a numpy array."""
    dtype = np.dtype(array.dtype)
    if dtype.byteorder == '>' or dtype.name not in DTYPES:
        raise DescriptorError(f'dtype {dtype} cannot travel in a handle; use one of '
                              f'{", ".join(DTYPES)} (native byte order)')
    strides = () if array.flags.c_contiguous else tuple(array.strides)
    return dtype.name, tuple(array.shape), strides


def array_from_bytes(desc: TensorDescriptor, data: Any,
                     data_offset: Optional[int] = 0) -> np.ndarray:
    """Read-only array over copied bytes (the copying fallback for remote consumers).

    ``data`` holds the descriptor's ``nbytes`` bytes starting at ``data_offset`` (the
    bytes a producer's ``TensorPool.copy_out`` returned); the array does not copy them.
    """
    view = memoryview(data).cast('B')
    start = data_offset or 0
    if len(view) - start != desc.nbytes:
        raise DescriptorError(
            f'copied payload holds {len(view) - start} bytes but the handle describes '
            f'{desc.nbytes}')
    arr = np.ndarray(desc.shape, dtype=np.dtype(desc.dtype), buffer=view, offset=start,
                     strides=desc.strides or None)
    arr.flags.writeable = False
    return arr
