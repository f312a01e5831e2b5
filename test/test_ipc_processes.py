"""Producer and consumers in separate processes: checksums, skipping, kills, leases."""
import os
import select
import shutil
import signal
import tempfile
import time

from ipc_support import ALLOCATORS, Baseline, Child, fill_frame, frame_ok, require_allocator
import numpy as np
import pytest

from edge_llm_ros.ipc.descriptor import TensorDescriptor
from edge_llm_ros.ipc.errors import PoolClosedError, StaleHandleError, UnknownPoolError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.ipc.resolver import TensorResolver

SHAPE = (128, 256, 3)   # 96 KiB


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix='ipc')
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=ALLOCATORS)
def allocator_name(request):
    require_allocator(request.param)
    return request.param


def _wait_for_pool(fn, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except UnknownPoolError:   # not started yet (PoolUnreachableError included)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _publish(pool):
    loan = pool.loan()
    fill_frame(loan.ndarray('uint8', SHAPE), pool.stats().published + 1)
    return loan.publish()


# --- children ----------------------------------------------------------------------------
def _producer(tell, sock_dir, allocator, frames, period_s, consumers, lease_s=2.0, slots=5,
              handle_fd=None, done_fd=None):
    pool = TensorPool(PoolConfig('cam', int(np.prod(SHAPE)), slots=slots, allocator=allocator,
                                 socket_dir=sock_dir, lease_s=lease_s))
    deadline = time.monotonic() + 30
    while len(pool.stats().consumers) < consumers:
        assert time.monotonic() < deadline, 'consumers never connected'
        time.sleep(0.01)
    start = time.monotonic()
    for i in range(frames):
        desc = _publish(pool)
        assert desc.sequence == i + 1
        if handle_fd is not None:   # stands in for a ROS topic carrying TensorHandles
            os.write(handle_fd, desc.pack().hex().encode() + b'\n')
        time.sleep(max(0.0, start + (i + 1) * period_s - time.monotonic()))
    time.sleep(0.2)
    if handle_fd is not None:   # end of the topic; serve the reader until it says it is done
        os.close(handle_fd)
        # The parent writes to done_fd once the reader returned: polling the consumer list
        # instead could miss a reader that connects and leaves between two polls.
        ready, _, _ = select.select([done_fd], [], [], 240)
        assert ready, 'reader never finished'
        os.close(done_fd)
    stats = pool.stats()
    pool.close()
    return {'published': stats.published, 'revocations': stats.revocations,
            'consumers': {c.name: {'delivered': c.delivered, 'skipped': c.skipped,
                                   'revoked': c.revoked} for c in stats.consumers}}


def _subscriber(tell, sock_dir, name, max_inflight, hold_s, stall_first_s=0.0):
    base = Baseline()
    resolver = TensorResolver(socket_dir=sock_dir, name=name)
    sub = _wait_for_pool(lambda: resolver.subscribe('cam', max_inflight))
    tell({'subscribed': name})
    received, torn, sequences, stalled_ok = 0, 0, [], None
    while True:
        try:
            frame = sub.receive(timeout_s=10.0)
        except PoolClosedError:
            break
        if frame is None:
            break
        seq = frame.descriptor.sequence
        ok = frame_ok(frame.array, seq)
        wait = stall_first_s if received == 0 and stall_first_s else hold_s
        time.sleep(wait)
        ok = ok and frame_ok(frame.array, seq)   # nobody wrote into it while we held it
        if received == 0 and stall_first_s:
            stalled_ok = ok
        torn += not ok
        received += 1
        sequences.append(seq)
        frame.release()
        del frame
    sub.close()
    resolver.close()
    base.check()
    return {'received': received, 'torn': torn, 'sequences': sequences,
            'stalled_frame_intact': stalled_ok}


def _handle_reader(tell, sock_dir, fd, other_end, hold_s):
    """Resolve handles read from a pipe: the ROS path (handles travel on a topic)."""
    os.close(other_end)
    resolver = TensorResolver(socket_dir=sock_dir, name='reader', max_inflight=1)
    resolved, stale, skipped, torn, buf = 0, 0, 0, 0, b''
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b'\n')
        if not lines:
            continue
        skipped += len(lines) - 1          # like a keep-last-1 subscription: newest only
        desc = TensorDescriptor.unpack('cam', bytes.fromhex(lines[-1].decode()))
        try:
            view = resolver.resolve(desc)
        except StaleHandleError:           # rewritten before we got to it: skip
            stale += 1
            continue
        time.sleep(hold_s)
        torn += not frame_ok(view, desc.sequence)
        resolver.release(desc)
        del view
        resolved += 1
    resolver.close()
    return {'resolved': resolved, 'stale': stale, 'skipped': skipped, 'torn': torn}


# --- tests -------------------------------------------------------------------------------
def test_two_consumers_checksums_and_a_slow_one_skips(sock_dir, allocator_name):
    fast = Child(_subscriber, sock_dir, 'fast', 2, 0.0)
    slow = Child(_subscriber, sock_dir, 'slow', 1, 0.06)
    producer = Child(_producer, sock_dir, allocator_name, 60, 0.01, 2)
    try:
        stats = producer.join(120)
        results = {'fast': fast.join(60), 'slow': slow.join(60)}
    finally:
        for child in (fast, slow, producer):
            child.close()
    assert stats['published'] == 60            # the producer never stalled nor failed
    for name, res in results.items():
        assert res['torn'] == 0, f'{name} saw torn frames'
        assert res['sequences'] == sorted(set(res['sequences']))
        per = stats['consumers'][name]
        assert per['delivered'] == res['received']
        assert per['delivered'] + per['skipped'] == 60   # every frame: delivered xor skipped
    assert stats['consumers']['slow']['skipped'] > 0
    assert results['fast']['received'] > results['slow']['received']


def test_handles_from_another_channel_resolve_or_are_stale(sock_dir, allocator_name):
    r, w = os.pipe()
    done_r, done_w = os.pipe()
    reader = Child(_handle_reader, sock_dir, r, w, 0.03)
    os.close(r)
    producer = Child(_producer, sock_dir, allocator_name, 40, 0.005, 0, 2.0, 3, w, done_r)
    os.close(w)
    os.close(done_r)
    try:
        res = reader.join(240)
        os.write(done_w, b'done')
        stats = producer.join(60)
    finally:
        os.close(done_w)
        reader.close()
        producer.close()
    assert stats['published'] == 40
    assert res['torn'] == 0 and res['resolved'] > 0 and res['stale'] + res['skipped'] > 0
    assert res['resolved'] + res['stale'] + res['skipped'] == 40


def _holder(tell, sock_dir, frames):
    resolver = TensorResolver(socket_dir=sock_dir, name='victim')
    sub = _wait_for_pool(lambda: resolver.subscribe('cam', frames))
    held = [sub.receive(10.0) for _ in range(frames)]
    tell({'holding': [f.descriptor.slot for f in held]})
    time.sleep(3600)


def test_consumer_killed_while_holding_frames(sock_dir, allocator_name):
    base = Baseline()
    victim = Child(_holder, sock_dir, 2)
    pool = TensorPool(PoolConfig('cam', int(np.prod(SHAPE)), slots=4, socket_dir=sock_dir,
                                 allocator=allocator_name))
    other = TensorResolver(socket_dir=sock_dir, name='other', max_inflight=1)
    try:
        deadline = time.monotonic() + 30
        while not pool.stats().consumers:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _publish(pool)
        _publish(pool)
        held = set(victim.wait_for('holding')['holding'])
        assert pool.stats().consumers[0].held == 2
        free = {_publish(pool).slot for _ in range(8)}
        assert not free & held                      # held slots are never rewritten
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        while pool.stats().consumers:              # EOF: the producer drops its holds
            assert time.monotonic() < deadline + 30
            time.sleep(0.01)
        slots = {_publish(pool).slot for _ in range(8)}
        assert slots == set(range(4))              # every slot is back in the ring
        desc = _publish(pool)
        assert frame_ok(other.resolve(desc), desc.sequence)   # others are unaffected
        other.release(desc)
    finally:
        victim.close()
        other.close()
        pool.close()
    base.check()


def _doomed_producer(tell, sock_dir, allocator):
    pool = TensorPool(PoolConfig('cam', int(np.prod(SHAPE)), slots=4, socket_dir=sock_dir,
                                 allocator=allocator))
    tell({'handles': [_publish(pool).pack().hex() for _ in range(3)]})
    time.sleep(3600)


def test_producer_killed_while_consumers_hold_views(sock_dir, allocator_name):
    base = Baseline()
    producer = Child(_doomed_producer, sock_dir, allocator_name)
    try:
        handles = [TensorDescriptor.unpack('cam', bytes.fromhex(h))
                   for h in producer.wait_for('handles')['handles']]
        resolver = TensorResolver(socket_dir=sock_dir, max_inflight=2)
        views = [resolver.resolve(h) for h in handles[:2]]
        os.kill(producer.pid, signal.SIGKILL)
        producer.wait()
        # The pages outlive their owner: reading every byte neither faults nor changes.
        for view, handle in zip(views, handles):
            assert frame_ok(view, handle.sequence)
            assert int(np.asarray(view, dtype=np.uint64).sum()) > 0
        with pytest.raises((PoolClosedError, UnknownPoolError)):
            resolver.resolve(handles[2])
        for handle in handles[:2]:
            resolver.release(handle)          # no-op: nobody to tell
        with pytest.raises(UnknownPoolError, match='unreachable'):
            resolver.resolve(handles[2])      # a dead producer's socket refuses connections
        assert all(frame_ok(v, h.sequence) for v, h in zip(views, handles))
        del views, view
        resolver.close()
    finally:
        producer.close()
    base.check()


def test_consumer_stalled_past_its_lease(sock_dir, allocator_name):
    fast = Child(_subscriber, sock_dir, 'fast', 2, 0.0)
    stalled = Child(_subscriber, sock_dir, 'stalled', 1, 0.0, 1.0)
    producer = Child(_producer, sock_dir, allocator_name, 60, 0.02, 2, 0.4)
    try:
        stats = producer.join(120)
        results = {'fast': fast.join(60), 'stalled': stalled.join(60)}
    finally:
        for child in (fast, stalled, producer):
            child.close()
    assert stats['published'] == 60
    assert stats['revocations'] >= 1 and stats['consumers']['stalled']['revoked'] >= 1
    assert stats['consumers']['fast']['revoked'] == 0
    assert results['stalled']['stalled_frame_intact'] is True   # old buffer, whole frame
    assert results['stalled']['received'] > 1                   # and it carried on
    assert results['fast']['torn'] == 0 and results['stalled']['torn'] == 0
    assert results['fast']['received'] > results['stalled']['received']
