"""Pool lifetime protocol in one process: loans, holds, stale handles, leases, views."""
import gc
import os
import shutil
import socket
import tempfile
import time
import types

from ipc_support import (
    ALLOCATORS, Baseline, fill_frame, frame_ok, require_allocator, shared_mapped_bytes)
import numpy as np
import pytest

from edge_llm_ros.ipc import channel, protocol as proto
from edge_llm_ros.ipc.descriptor import array_from_bytes, TensorDescriptor
from edge_llm_ros.ipc.errors import (AdmissionError, DescriptorError, InflightLimitError,
                                     InvalidHandleError, IpcError, PoolClosedError,
                                     PoolExhaustedError, SlotOutOfRangeError, StaleHandleError,
                                     UnknownPoolError)
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.ipc.resolver import TensorResolver

SHAPE = (64, 256, 3)   # 48 KiB frames: fast under emulation, several pages


@pytest.fixture
def sock_dir():
    # Short path: unix socket names are limited to 108 bytes.
    path = tempfile.mkdtemp(prefix='ipc')
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=ALLOCATORS)
def allocator_name(request):
    require_allocator(request.param)
    return request.param


def make_pool(sock_dir, allocator='memfd', **kw):
    cfg = {'pool_id': 'cam', 'slot_nbytes': int(np.prod(SHAPE)), 'slots': 4,
           'allocator': allocator, 'socket_dir': sock_dir}
    cfg.update(kw)
    return TensorPool(PoolConfig(**cfg))


def publish(pool):
    loan = pool.loan()
    fill_frame(loan.ndarray('uint8', SHAPE), pool.stats().published + 1)
    return loan.publish()


def test_loan_publish_resolve_release(sock_dir, allocator_name):
    base = Baseline()
    pool = make_pool(sock_dir, allocator_name)
    resolver = TensorResolver(socket_dir=sock_dir, name='unit')
    desc = publish(pool)
    assert desc.buffer_kind == pool.kind and desc.nbytes == np.prod(SHAPE)
    view = resolver.resolve(desc)
    assert not view.flags.writeable and frame_ok(view, desc.sequence)
    assert pool.stats().consumers[0].held == 1
    resolver.release(desc)
    resolver.flush()
    assert pool.stats().consumers[0].held == 0
    with pytest.raises(InvalidHandleError, match='not held'):
        resolver.release(desc)
    del view
    resolver.close()
    pool.close()
    base.check()


def test_views_keep_their_mapping_after_everything_closed(sock_dir, allocator_name):
    base = Baseline()
    pool = make_pool(sock_dir, allocator_name)
    resolver = TensorResolver(socket_dir=sock_dir)
    desc = publish(pool)
    view = resolver.resolve(desc)
    resolver.release(desc)
    resolver.close()
    pool.close()          # the owner frees its buffers; our view still maps the pages
    gc.collect()
    assert frame_ok(view, desc.sequence)
    assert shared_mapped_bytes() - base.mapped >= desc.nbytes
    del view
    gc.collect()
    base.check()


def test_slow_reader_gets_stale_not_torn(sock_dir):
    pool = make_pool(sock_dir)
    resolver = TensorResolver(socket_dir=sock_dir)
    first = publish(pool)
    for _ in range(pool.slot_count):
        publish(pool)     # the ring wraps: first's slot has been rewritten
    with pytest.raises(StaleHandleError, match='no longer holds frame 1'):
        resolver.resolve(first)
    latest = publish(pool)
    assert frame_ok(resolver.resolve(latest), latest.sequence)
    resolver.close()
    pool.close()


def test_held_slot_is_never_loaned(sock_dir):
    pool = make_pool(sock_dir)
    resolver = TensorResolver(socket_dir=sock_dir, max_inflight=2)
    held = publish(pool)
    view = resolver.resolve(held)
    for _ in range(3 * pool.slot_count):
        assert publish(pool).slot != held.slot
    assert frame_ok(view, held.sequence)
    resolver.release(held)
    resolver.flush()
    slots = {publish(pool).slot for _ in range(pool.slot_count)}
    assert held.slot in slots
    resolver.close()
    pool.close()


def test_bad_handles_are_rejected_with_typed_errors(sock_dir):
    pool = make_pool(sock_dir)
    resolver = TensorResolver(socket_dir=sock_dir)
    desc = publish(pool)
    with pytest.raises(UnknownPoolError, match="no pool 'nope'"):
        resolver.resolve(desc.replace(pool_id='nope'))
    with pytest.raises(StaleHandleError, match='generation 0, handle has 5'):
        resolver.resolve(desc.replace(generation=5))
    with pytest.raises(StaleHandleError, match='no longer holds frame 9'):
        resolver.resolve(desc.replace(sequence=9))
    with pytest.raises(SlotOutOfRangeError, match='slot 4 is out of range'):
        resolver.resolve(desc.replace(slot=4))
    with pytest.raises(DescriptorError, match='slot buffers of pool .* hold'):
        resolver.resolve(desc.replace(shape=(4096, 4096), nbytes=-1))
    with pytest.raises(DescriptorError, match='nbytes=3 does not match'):
        resolver.resolve(types.SimpleNamespace(**{**desc.__dict__, 'nbytes': 3}))
    with pytest.raises(InvalidHandleError, match='buffer_kind DMA_HEAP'):
        resolver.resolve(desc.replace(buffer_kind=1))
    # The producer checks too: a raw ACQUIRE with a slot out of range is denied.
    sock = channel.connect('cam', sock_dir)
    proto.send(sock, proto.HELLO.pack(proto.Msg.HELLO, proto.VERSION, 1, 0) + b'raw')
    assert proto.recv(sock)[0][0] == proto.Msg.WELCOME
    proto.send(sock, proto.ACQUIRE.pack(proto.Msg.ACQUIRE, 7, 99, 0, desc.sequence))
    data, _ = proto.recv(sock)
    assert proto.DENY.unpack_from(data) == (proto.Msg.DENY, 7, proto.Code.SLOT_RANGE)
    proto.send(sock, b'\xff garbage')   # a protocol violation ends the connection
    assert proto.recv(sock) == (b'', [])
    sock.close()
    # The good handle still works after all that.
    assert frame_ok(resolver.resolve(desc), desc.sequence)
    resolver.close()
    pool.close()


def test_inflight_limit_and_admission(sock_dir):
    pool = make_pool(sock_dir, slots=4)   # 3 slots for consumers (1 for the producer)
    one = TensorResolver(socket_dir=sock_dir, max_inflight=1)
    a, b = publish(pool), publish(pool)
    one.resolve(a)
    with pytest.raises(InflightLimitError, match='max_inflight=1'):
        one.resolve(b)
    one.resolve(a)           # the same frame again is a reference, not a new hold
    one.release(a)
    one.release(a)
    one.resolve(b)
    two = TensorResolver(socket_dir=sock_dir, max_inflight=2)
    two.resolve(b)
    greedy = TensorResolver(socket_dir=sock_dir, max_inflight=1)
    with pytest.raises(AdmissionError, match='max_inflight=1 does not fit'):
        greedy.resolve(b)
    for r in (one, two, greedy):
        r.close()
    pool.close()


def test_lease_expiry_replaces_the_buffer(sock_dir, allocator_name):
    base = Baseline()
    pool = make_pool(sock_dir, allocator_name, lease_s=0.2)
    stalled = TensorResolver(socket_dir=sock_dir, max_inflight=1, name='stalled')
    other = TensorResolver(socket_dir=sock_dir, max_inflight=1, name='other')
    old = publish(pool)
    view = stalled.resolve(old)
    deadline = time.monotonic() + 30
    while pool.stats().revocations == 0:
        assert time.monotonic() < deadline, 'lease never expired'
        time.sleep(0.05)
    # The slot now has a fresh buffer: the old handle is stale, the old view intact.
    with pytest.raises(StaleHandleError, match='buffer replaced'):
        other.resolve(old)
    assert frame_ok(view, old.sequence)
    newer = [publish(pool) for _ in range(2 * pool.slot_count)]
    assert any(d.slot == old.slot and d.generation == old.generation + 1 for d in newer)
    assert frame_ok(view, old.sequence)   # writes went to the new buffer, not ours
    stalled.release(old)                  # accepted as a no-op: the producer revoked it
    latest = newer[-1]
    assert frame_ok(stalled.resolve(latest), latest.sequence)   # credit is back
    stats = {c.name: c for c in pool.stats().consumers}
    assert stats['stalled'].revoked == 1 and stats['other'].revoked == 0
    del view
    stalled.close()
    other.close()
    pool.close()
    base.check()


def test_loan_rules(sock_dir):
    pool = make_pool(sock_dir, max_loans=1)
    loan = pool.loan()
    with pytest.raises(PoolExhaustedError, match='max_loans=1'):
        pool.loan()
    arr = loan.ndarray('uint8', SHAPE)
    with pytest.raises(DescriptorError, match='hold'):
        loan.ndarray('float32', (pool.buffer_size,))
    loan.publish()
    assert not arr.flags.writeable   # published bytes are frozen for readers
    with pytest.raises(IpcError, match='already ended'):
        loan.publish()
    with pool.loan() as discarded:     # leaving the block unpublished gives it back
        discarded.memoryview()[:3] = b'abc'
    pool.loan().discard()
    pool.close()
    with pytest.raises(PoolClosedError):
        pool.loan()


def test_copy_out_is_the_remote_fallback(sock_dir):
    pool = make_pool(sock_dir)
    src = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::2, :]   # strided
    loan = pool.loan()
    loan.ndarray('float32', (2, 3, 4))[...] = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    desc = loan.publish('float32', (2, 2, 4), strides=(48, 32, 4))
    data = pool.copy_out(desc)
    assert len(data) == desc.nbytes
    np.testing.assert_array_equal(array_from_bytes(desc, data), src)
    msg = desc.to_msg(types.SimpleNamespace())   # what a remote node would receive
    np.testing.assert_array_equal(array_from_bytes(TensorDescriptor.from_msg(msg), data), src)
    for _ in range(pool.slot_count):
        publish(pool)
    with pytest.raises(StaleHandleError):
        pool.copy_out(desc)
    pool.close()


def test_pool_ids_are_exclusive_and_stale_sockets_replaced(sock_dir):
    pool = make_pool(sock_dir)
    with pytest.raises(IpcError, match='already served by a live producer'):
        make_pool(sock_dir)
    pool.close()
    # A socket file left by a killed producer (nobody listening) is replaced.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(os.path.join(sock_dir, 'cam.sock'))
    dead.close()
    with pytest.raises(IpcError, match='unreachable'):
        TensorResolver(socket_dir=sock_dir).resolve(
            TensorDescriptor('cam', 0, 0, 1, 0, 'uint8', (1,)))
    pool = make_pool(sock_dir)
    resolver = TensorResolver(socket_dir=sock_dir)
    with resolver.borrow(publish(pool)) as view:
        assert view.shape == SHAPE
    assert resolver.held('cam') == 0
    resolver.close()
    pool.close()
    assert not os.path.exists(os.path.join(sock_dir, 'cam.sock'))


def test_publish_array_copies_once(sock_dir):
    pool = make_pool(sock_dir)
    resolver = TensorResolver(socket_dir=sock_dir)
    frame = np.random.default_rng(0).integers(0, 255, SHAPE, dtype=np.uint8)
    desc = pool.publish_array(frame)
    np.testing.assert_array_equal(resolver.resolve(desc), frame)
    assert resolver.reachable('cam') and not resolver.reachable('other')
    resolver.close()
    pool.close()


def test_a_failing_service_thread_is_reported_not_silent(sock_dir, monkeypatch):
    pool = make_pool(sock_dir)

    def broken(*args):
        raise RuntimeError('injected bug')

    monkeypatch.setattr(pool, '_handle', broken)
    with pytest.raises(IpcError):
        TensorResolver(socket_dir=sock_dir, timeout_s=0.5).resolve(publish(pool))
    with pytest.raises(PoolClosedError, match='stopped serving consumers.*injected bug'):
        pool.loan()
    pool.close()
