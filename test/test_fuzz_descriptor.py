"""Property tests: hostile TensorHandle / TensorDescriptor values and bytes.

Contract (edge_llm_ros/ipc): a descriptor either validates, and then describes exactly one
in-bounds tensor, or is rejected with DescriptorError (a message naming the field). At a
live pool every hostile handle ends in a typed IpcError and leaks nothing; a producer fed
random datagrams drops that consumer and keeps serving the others.
"""
import shutil
import socket
import tempfile
import types

from fuzz_support import accepted_or_typed, fuzz, JUNK
from hypothesis import assume, example, given, strategies as st
from ipc_support import Baseline, fill_frame, frame_ok
from llm_node_harness import wait_for
import numpy as np
import pytest

from edge_llm_msgs.msg import TensorHandle
from edge_llm_ros.ipc import channel, protocol as proto
from edge_llm_ros.ipc.allocators import BufferKind
from edge_llm_ros.ipc.descriptor import (array_from_bytes, DTYPES, HANDLE_FIELDS, MAX_NDIM,
                                         TensorDescriptor, U32, U64)
from edge_llm_ros.ipc.errors import DescriptorError, IpcError, SlotOutOfRangeError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.ipc.resolver import TensorResolver

SMALL = 1 << 20   # descriptors up to this many bytes are also materialized

counts = st.one_of(st.integers(0, 6), st.integers(0, U32 + 2), st.integers(-3, -1))
u64ish = st.one_of(st.integers(0, 64), st.integers(0, U64 + 1), st.integers(-(2**65), -1),
                   st.sampled_from([U32, U64, U64 + 1, 2**63]),
                   st.integers(0, 2**31).map(np.int64))
pool_ids = st.one_of(st.from_regex(r'[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}', fullmatch=True),
                     st.sampled_from(['', '.', '..', '../x', 'a/b', '-x', 'x' * 65, 'é',
                                      'a\x00b', ' cam']),
                     st.text(max_size=70), JUNK)
kinds = st.one_of(st.sampled_from(list(BufferKind)), st.integers(-2, 300), JUNK)
dtypes = st.one_of(st.sampled_from(DTYPES), st.sampled_from(['float', '<f4', 'object', 'U8',
                                                             'complex64', 'V4', 'datetime64']),
                   st.text(max_size=10), JUNK)
dims = st.lists(counts, max_size=MAX_NDIM + 2)
shapes = st.one_of(dims, dims.map(tuple), dims.map(lambda d: np.array(d, dtype=object)),
                   st.text(max_size=4), JUNK)
stride_lists = st.lists(st.one_of(st.integers(-8, 64).map(lambda s: s * 4), u64ish),
                        max_size=MAX_NDIM + 1)
strides = st.one_of(st.just(()), stride_lists, JUNK)
nbytes = st.one_of(st.just(-1), u64ish, JUNK)


def check_invariants(desc: TensorDescriptor) -> None:
    """Assert what every accepted descriptor guarantees (consumers' mappings rely on it)."""
    assert desc.dtype in DTYPES and isinstance(desc.buffer_kind, BufferKind)
    assert len(desc.shape) <= MAX_NDIM and all(0 <= d <= U32 for d in desc.shape)
    assert desc.nbytes == desc.span() and 0 <= desc.nbytes <= U64
    assert (desc.nbytes == 0) == any(d == 0 for d in desc.shape)
    assert desc.byte_offset % desc.itemsize == 0
    # Packed form and message form round-trip exactly.
    assert TensorDescriptor.unpack(desc.pool_id, desc.pack()) == desc
    assert TensorDescriptor.from_msg(desc.to_msg(TensorHandle())) == desc
    # Fits a buffer of exactly offset + nbytes, and one byte less is refused.
    end = desc.byte_offset + desc.nbytes
    desc.check_fits(end, desc.slot + 1)
    with pytest.raises(SlotOutOfRangeError):
        desc.check_fits(end, desc.slot)
    if desc.nbytes:
        with pytest.raises(DescriptorError, match='spans bytes'):
            desc.check_fits(end - 1, desc.slot + 1)
    if desc.nbytes <= SMALL:
        # Every element lies inside the nbytes the descriptor claims: numpy checks the
        # bounds of an ndarray over exactly that buffer, and reading it touches them all.
        arr = array_from_bytes(desc, bytes(desc.nbytes))
        assert arr.shape == desc.shape and not arr.flags.writeable
        assert int(np.count_nonzero(arr)) == 0


@fuzz(600)
@given(pool_id=pool_ids, slot=st.one_of(counts, JUNK), generation=st.one_of(u64ish, JUNK),
       sequence=st.one_of(u64ish, JUNK), kind=kinds, dtype=dtypes, shape=shapes,
       strides=strides, offset=st.one_of(u64ish, JUNK), nbytes=nbytes)
def test_random_fields_validate_or_raise_descriptor_error(pool_id, slot, generation, sequence,
                                                          kind, dtype, shape, strides, offset,
                                                          nbytes):
    ok, desc = accepted_or_typed(
        lambda: TensorDescriptor(pool_id=pool_id, slot=slot, generation=generation,
                                 sequence=sequence, buffer_kind=kind, dtype=dtype, shape=shape,
                                 strides=strides, byte_offset=offset, nbytes=nbytes),
        (DescriptorError,), what='TensorDescriptor(...)')
    if ok:
        check_invariants(desc)


@st.composite
def consistent(draw):
    """Draw the fields of a valid, possibly strided and offset descriptor."""
    dtype = draw(st.sampled_from(DTYPES))
    item = np.dtype(dtype).itemsize
    shape = draw(st.lists(st.integers(0, 9), max_size=4))
    strided = draw(st.booleans())
    steps = [item * draw(st.integers(1, 40)) for _ in shape] if strided else []
    return {'pool_id': draw(st.sampled_from(['cam0', 'x', 'a.b-c_9', 'P' * 64])),
            'slot': draw(st.integers(0, 8)), 'generation': draw(st.integers(0, 5)),
            'sequence': draw(st.integers(0, 5)),
            'buffer_kind': draw(st.sampled_from(BufferKind)), 'dtype': dtype, 'shape': shape,
            'strides': steps, 'byte_offset': item * draw(st.integers(0, 1000))}


@fuzz(300)
@given(fields=consistent(), field=st.sampled_from(HANDLE_FIELDS + ('none',)),
       value=st.one_of(JUNK, u64ish, dims, stride_lists, dtypes))
def test_one_mutated_field_of_a_valid_descriptor(fields, field, value):
    ok, desc = accepted_or_typed(lambda: TensorDescriptor(**fields), (DescriptorError,))
    assume(ok)
    check_invariants(desc)
    if field != 'none':
        fields[field] = value
        ok, desc = accepted_or_typed(lambda: TensorDescriptor(**fields), (DescriptorError,))
        if ok:
            check_invariants(desc)


@fuzz(500)
@given(data=st.binary(max_size=400), offset=st.integers(0, 40))
@example(data=b'\x00' * 38 + b'\x07float32', offset=0)
@example(data=b'\xff' * 300, offset=0)
def test_unpack_of_random_bytes(data, offset):
    ok, desc = accepted_or_typed(lambda: TensorDescriptor.unpack('cam', data, offset),
                                 (DescriptorError,), what='unpack')
    if ok:
        check_invariants(desc)


@fuzz(300)
@given(fields=consistent(), cuts=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)),
                                          min_size=1, max_size=6),
       truncate=st.one_of(st.none(), st.integers(0, 400)))
def test_unpack_of_mutated_packed_descriptors(fields, cuts, truncate):
    ok, desc = accepted_or_typed(lambda: TensorDescriptor(**fields), (DescriptorError,))
    assume(ok)
    raw = bytearray(desc.pack())
    for pos, byte in cuts:
        raw[pos % len(raw)] = byte
    if truncate is not None:
        raw = raw[:truncate]
    ok, back = accepted_or_typed(lambda: TensorDescriptor.unpack(desc.pool_id, bytes(raw)),
                                 (DescriptorError,), what='unpack')
    if ok:
        check_invariants(back)


@fuzz(200)
@given(present=st.sets(st.sampled_from(HANDLE_FIELDS)), value=st.one_of(JUNK, u64ish))
def test_from_msg_of_objects_that_are_not_handles(present, value):
    obj = types.SimpleNamespace(**{f: value for f in present})
    ok, desc = accepted_or_typed(lambda: TensorDescriptor.from_msg(obj), (DescriptorError,))
    if ok:
        check_invariants(desc)
    elif len(present) < len(HANDLE_FIELDS):
        assert 'not a TensorHandle' in str(desc)


# --- at a live pool ------------------------------------------------------------------------
SLOT_BYTES = 4096 * 3
# A call still running after this long hangs (its own timeouts are 2 s): generous for CI load.
HANG_S = 30.0


@pytest.fixture(scope='module')
def live():
    """Serve a memfd pool with one published frame, and a resolver of this process."""
    sock_dir = tempfile.mkdtemp(prefix='fz')
    base = Baseline()
    pool = TensorPool(PoolConfig(pool_id='fz', slot_nbytes=SLOT_BYTES, slots=4,
                                 allocator='memfd', socket_dir=sock_dir))
    loan = pool.loan()
    fill_frame(loan.ndarray('uint8', (SLOT_BYTES,)), 7)
    good = loan.publish()
    resolver = TensorResolver(socket_dir=sock_dir, name='fuzz', max_inflight=2)
    yield types.SimpleNamespace(pool=pool, good=good, resolver=resolver, sock_dir=sock_dir)
    resolver.close()
    pool.close()
    base.check()
    shutil.rmtree(sock_dir, ignore_errors=True)


def _good_still_resolves(live) -> None:
    view = live.resolver.resolve(live.good)
    try:
        assert frame_ok(view, 7)
    finally:
        live.resolver.release(live.good)


@fuzz(150)
@given(field=st.sampled_from(HANDLE_FIELDS),
       value=st.one_of(u64ish, dims, stride_lists, dtypes, kinds, pool_ids))
def test_hostile_handles_at_a_live_pool_end_in_typed_errors(live, field, value):
    msg = live.good.to_msg(types.SimpleNamespace())
    setattr(msg, field, value)
    ok, view = accepted_or_typed(lambda: live.resolver.resolve(msg), (IpcError,), HANG_S,
                                 'resolve')
    if ok:
        # Only an in-bounds view of the real frame can come back, and read-only.
        desc = TensorDescriptor.from_msg(msg)
        assert desc.byte_offset + desc.nbytes <= live.pool.buffer_size
        assert not view.flags.writeable
        del view
        live.resolver.release(msg)
    assert live.resolver.held('fz') == 0
    _good_still_resolves(live)


def _raw_consumer(sock_dir: str) -> socket.socket:
    sock = channel.connect('fz', sock_dir)
    sock.settimeout(2.0)
    return sock


HELLO = proto.HELLO.pack(proto.Msg.HELLO, proto.VERSION, 1, 0) + b'raw'
messages = st.one_of(
    st.binary(max_size=64),
    st.tuples(st.sampled_from(list(proto.Msg)), st.binary(max_size=40)).map(
        lambda t: bytes([t[0]]) + t[1]),
    st.builds(lambda *a: proto.ACQUIRE.pack(proto.Msg.ACQUIRE, *a),
              st.integers(0, U32), st.integers(0, U32), st.integers(0, U64),
              st.integers(0, U64)),
    st.builds(lambda *a: proto.RELEASE.pack(proto.Msg.RELEASE, *a),
              st.integers(0, U32), st.integers(0, U64), st.integers(0, U64)))


@fuzz(100)
@given(hello=st.booleans(), burst=st.lists(messages, min_size=1, max_size=8))
def test_producer_survives_random_datagrams(live, hello, burst):
    sock = _raw_consumer(live.sock_dir)
    try:
        if hello:
            sock.send(HELLO)
            assert sock.recv(4096)[0] == proto.Msg.WELCOME
        for payload in burst:
            try:
                sock.send(payload)
            except OSError:
                break   # the producer hung up on us: the expected answer to garbage
    finally:
        sock.close()
    _good_still_resolves(live)
    # The producer sees our EOF on its own thread: whatever the garbage acquired is dropped.
    wait_for(lambda: all(c.held == 0 for c in live.pool.stats().consumers), 30.0,
             "the producer to drop the raw consumer's holds")


# --- a producer that lies: the consumer's side of the same decoding ----------------------
class LyingProducer:
    """A fake producer on a real pool socket that pushes whatever FRAME it is given."""

    BUFFER = 4096

    def __init__(self, sock_dir: str) -> None:
        from edge_llm_ros.ipc.allocators import select_allocator
        self.sock_dir = sock_dir
        self.listener = channel.listen('liar', sock_dir)
        self.allocator = select_allocator('memfd')
        self.buffer = self.allocator.allocate(self.BUFFER, 'liar')

    def serve_one(self, payload: bytes, with_fd: bool) -> socket.socket:
        """Accept one consumer, welcome it and push one FRAME (returns the socket)."""
        conn, _ = self.listener.accept()
        conn.recv(4096)
        conn.send(proto.WELCOME.pack(proto.Msg.WELCOME, proto.VERSION, 4, self.BUFFER,
                                     int(BufferKind.MEMFD), 2.0) + b'liar')
        proto.send(conn, payload, [self.buffer.share_fd] if with_fd else [])
        return conn

    def close(self) -> None:
        self.listener.close()
        self.buffer.close()
        self.allocator.close()


@pytest.fixture(scope='module')
def liar():
    sock_dir = tempfile.mkdtemp(prefix='fl')
    producer = LyingProducer(sock_dir)
    yield producer
    producer.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


def _pushed(liar, payload: bytes, with_fd: bool):
    """Subscribe, let the liar push payload, return (frame or error, fd leak check)."""
    import threading
    base = Baseline()
    box = {}
    server = threading.Thread(target=lambda: box.update(conn=liar.serve_one(payload, with_fd)))
    server.start()
    resolver = TensorResolver(socket_dir=liar.sock_dir, name='victim')
    try:
        sub = resolver.subscribe('liar')
        server.join(HANG_S)
        ok, frame = accepted_or_typed(lambda: sub.receive(2.0), (IpcError,), HANG_S, 'receive')
        if ok and frame is not None:
            desc = frame.descriptor
            # Whatever is delivered lies inside the pool's buffers and ring.
            assert desc.slot < 4 and desc.byte_offset + desc.nbytes <= LyingProducer.BUFFER
            assert frame.array.nbytes <= desc.nbytes and not frame.array.flags.writeable
            frame.release()
            del frame
        sub.close()
    finally:
        resolver.close()
        server.join(HANG_S)
        box['conn'].close()
    base.check()
    return ok


frame_descriptors = st.one_of(
    consistent().map(lambda f: TensorDescriptor(**{**f, 'buffer_kind': BufferKind.MEMFD,
                                                   'pool_id': 'liar'}).pack()),
    st.binary(max_size=80))


@fuzz(60)
@given(packed=frame_descriptors, size=st.sampled_from([0, 100, 4096, 8192]),
       with_fd=st.booleans())
@example(packed=TensorDescriptor('liar', 0, 0, 1, 0, 'uint8', (1 << 20,)).pack(), size=4096,
         with_fd=True)   # larger than the buffer
@example(packed=TensorDescriptor('liar', 99, 0, 1, 0, 'uint8', (16,)).pack(), size=4096,
         with_fd=True)   # slot outside the ring
@example(packed=b'\xff' * 40, size=4096, with_fd=True)   # garbage with an fd attached
def test_consumer_refuses_lying_frames_without_leaking(liar, packed, size, with_fd):
    consistent_desc = False
    try:
        desc = TensorDescriptor.unpack('liar', packed)
        consistent_desc = (desc.slot < 4 and desc.byte_offset + desc.nbytes <= liar.BUFFER
                           and desc.buffer_kind == BufferKind.MEMFD)
    except DescriptorError:
        pass
    accepted = _pushed(liar, proto.FRAME.pack(proto.Msg.FRAME, size) + packed, with_fd)
    if accepted:
        assert consistent_desc and with_fd and size >= liar.BUFFER
