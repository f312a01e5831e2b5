"""Consumer side: turn TensorHandles into read-only numpy views, and give them back.

``TensorResolver.resolve(handle)`` connects to the producer named by ``handle.pool_id``
(once), asks it to hold the frame, receives the buffer fd the first time it sees that
slot + generation, validates it (seals/size/kind) and returns a read-only view.
``release(handle)`` gives the frame back; until then the producer will not rewrite it.
A view stays mapped after release and after the producer dies (no SIGBUS), but its
bytes are only guaranteed while the frame is held.

``TensorResolver.subscribe(pool_id)`` is the push mode used without ROS: every frame
the producer publishes arrives held (while the consumer has credit) and skipped
otherwise.
"""
import collections
from contextlib import contextmanager
import dataclasses
import itertools
import select
import socket
import struct
import threading
import time
from typing import Any, Deque, Dict, Iterator, Optional, Tuple

import numpy as np

from edge_llm_ros.ipc import channel, protocol as proto
from edge_llm_ros.ipc.allocators import BufferKind
from edge_llm_ros.ipc.descriptor import TensorDescriptor
from edge_llm_ros.ipc.errors import (AdmissionError, BufferValidationError, DescriptorError,
                                     InflightLimitError, InvalidHandleError, IpcError,
                                     PeerCredentialsError, PoolClosedError, PoolUnreachableError,
                                     ProtocolError, SlotOutOfRangeError, StaleHandleError)
from edge_llm_ros.ipc.mapping import import_buffer, Mapping

_DENY_ERRORS = {
    proto.Code.SLOT_RANGE: SlotOutOfRangeError,
    proto.Code.STALE: StaleHandleError,
    proto.Code.INFLIGHT: InflightLimitError,
    proto.Code.BAD_REQUEST: InvalidHandleError,
}
_DONTWAIT = int(socket.MSG_DONTWAIT)
_REQ = struct.Struct('<BI')  # type, req_id: the common head of GRANT and DENY
_REFUSE_ERRORS = {
    proto.Code.ADMISSION: AdmissionError,
    proto.Code.PEER_UID: PeerCredentialsError,
}


@dataclasses.dataclass
class _Held:
    mapping: Mapping
    refs: int = 1
    revoked: bool = False


@dataclasses.dataclass
class Frame:
    """A pushed frame: held for this consumer until release()."""

    descriptor: TensorDescriptor
    array: np.ndarray
    _connection: '_Connection'

    def release(self) -> None:
        """Give the frame back to the producer (idempotent)."""
        self._connection.release(self.descriptor)

    def __enter__(self) -> 'Frame':
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Connection:
    """One consumer's connection to one pool."""

    def __init__(self, pool_id: str, socket_dir: Optional[str], max_inflight: int, name: str,
                 subscribe: bool, timeout_s: float) -> None:
        self.pool_id = pool_id
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self._lock = threading.RLock()
        self._sock = channel.connect(pool_id, socket_dir, timeout_s)
        self._req = itertools.count(1)
        self._cache: Dict[int, Tuple[int, Mapping]] = {}      # slot -> (generation, mapping)
        self._held: Dict[Tuple[int, int, int], _Held] = {}    # (slot, gen, seq) -> hold
        self._frames: Deque[Tuple[TensorDescriptor, Mapping]] = collections.deque()
        self._replies: Dict[int, Tuple[bytes, list]] = {}
        self.pending_acks = 0
        self.closed = False
        try:
            proto.send(self._sock, proto.HELLO.pack(
                proto.Msg.HELLO, proto.VERSION, max_inflight,
                proto.SUBSCRIBE if subscribe else 0) + name.encode()[:64])
            data, fds = self._recv_until(time.monotonic() + timeout_s)
            proto.expect_fds(fds, 0, 'WELCOME')
            if data[0] == proto.Msg.REFUSE:
                _, code = proto.unpack(proto.REFUSE, data, 'REFUSE')
                raise _REFUSE_ERRORS.get(code, IpcError)(
                    f'pool {pool_id!r} refused this consumer: {proto.text(data, proto.REFUSE)}')
            if data[0] != proto.Msg.WELCOME:
                raise ProtocolError(f'expected WELCOME, got message type {data[0]}')
            _, _, self.slot_count, self.buffer_size, kind, self.lease_s = proto.unpack(
                proto.WELCOME, data, 'WELCOME')
            try:
                self.kind = BufferKind(kind)
            except ValueError:
                raise ProtocolError(f'pool {pool_id!r} announced unknown buffer kind {kind}') \
                    from None
        except BaseException:
            self._sock.close()
            raise

    # --- socket --------------------------------------------------------------------------
    def _recv(self, deadline: Optional[float]) -> Optional[Tuple[bytes, list]]:
        """One message, waiting until deadline (None: do not wait); None on timeout."""
        while True:
            try:   # try first: a message is often waiting already (one syscall, no select)
                data, fds = proto.recv(self._sock, _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                timeout = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
                if timeout <= 0.0:
                    return None
                select.select([self._sock], [], [], min(timeout, 3600.0))
                continue
            except ProtocolError:
                self._fail()
                raise
            except ConnectionError:
                data, fds = b'', []
            if not data:
                self._on_closed()
                raise PoolClosedError(f'pool {self.pool_id!r} closed the connection '
                                      '(producer stopped or died); held views stay readable')
            return data, fds

    def _recv_until(self, deadline: float) -> Tuple[bytes, list]:
        msg = self._recv(deadline)
        if msg is None:
            raise PoolUnreachableError(f'pool {self.pool_id!r} did not answer within '
                                       f'{self.timeout_s} s (producer stalled?)')
        return msg

    def _fail(self) -> None:
        """Stop trusting this connection: the producer misbehaved."""
        self._on_closed()
        self._sock.close()

    def _on_closed(self) -> None:
        self.closed = True
        for hold in self._held.values():
            hold.revoked = True

    @contextmanager
    def _untrusted(self) -> Iterator[None]:
        """Hang up on a producer whose message is malformed or whose buffer is a lie."""
        try:
            yield
        except (ProtocolError, BufferValidationError, DescriptorError):
            self._fail()
            raise

    def _dispatch(self, data: bytes, fds: list) -> None:
        try:   # _untrusted() inlined: this runs for every message
            self._dispatch_one(data, fds)
        except (ProtocolError, BufferValidationError, DescriptorError):
            self._fail()
            raise

    def _dispatch_one(self, data: bytes, fds: list) -> None:
        """Handle an unsolicited message; replies are parked for their waiter."""
        kind = data[0]
        if kind in (proto.Msg.GRANT, proto.Msg.DENY):
            _, req = proto.unpack(_REQ, data, 'GRANT/DENY')
            self._replies[req] = (data, fds)
        elif kind == proto.Msg.FRAME:
            try:
                _, size = proto.unpack(proto.FRAME, data, 'FRAME')
                desc = TensorDescriptor.unpack(self.pool_id, data, proto.FRAME.size)
                self._check_handle(desc)   # a pushed frame must fit the pool like a handle
            except InvalidHandleError as exc:
                proto._close_all(fds)
                raise ProtocolError(f'producer pushed a frame its pool cannot hold: {exc}') \
                    from None
            except BaseException:
                proto._close_all(fds)
                raise
            mapping = self._mapping_for(desc.slot, desc.generation, size, fds)
            mapping.begin_read()
            self._held[(desc.slot, desc.generation, desc.sequence)] = _Held(mapping)
            self._frames.append((desc, mapping))
        elif kind == proto.Msg.RELEASED:
            proto.expect_fds(fds, 0, 'RELEASED')
            self.pending_acks -= 1
        elif kind == proto.Msg.REVOKED:
            proto.expect_fds(fds, 0, 'REVOKED')
            _, slot, generation = proto.unpack(proto.REVOKED, data, 'REVOKED')
            for key, hold in self._held.items():
                if key[:2] == (slot, generation):
                    hold.revoked = True   # the producer forgot it; our view stays intact
            cached = self._cache.get(slot)
            if cached is not None and cached[0] == generation:
                del self._cache[slot]
        else:
            proto.expect_fds(fds, 0, 'an unexpected message')
            raise ProtocolError(f'unexpected message type {kind} from producer')

    def drain(self) -> None:
        """Process whatever the producer sent without waiting."""
        while not self.closed:
            msg = self._recv(None)
            if msg is None:
                return
            self._dispatch(*msg)

    def _mapping_for(self, slot: int, generation: int, size: int, fds: list) -> Mapping:
        if fds:
            proto.expect_fds(fds, 1, 'a buffer message')
            if size < self.buffer_size:
                proto._close_all(fds)
                raise ProtocolError(f'slot {slot}: announced size {size} < pool buffers '
                                    f'{self.buffer_size}')
            mapping = import_buffer(fds[0], size, self.kind)
            old = self._cache.get(slot)
            if old is not None:
                old[1].release()
            self._cache[slot] = (generation, mapping)
            return mapping
        cached = self._cache.get(slot)
        if cached is None or cached[0] != generation:
            raise ProtocolError(f'producer sent no fd for slot {slot} generation {generation} '
                                'and none is cached')
        return cached[1]

    def _active_holds(self) -> int:
        return sum(1 for h in self._held.values() if not h.revoked)

    # --- API -----------------------------------------------------------------------------
    def acquire(self, desc: TensorDescriptor) -> np.ndarray:
        with self._lock:
            key = (desc.slot, desc.generation, desc.sequence)
            held = self._held.get(key)
            if held is not None and not held.revoked:
                held.refs += 1
                return held.mapping.ndarray(desc.dtype, desc.shape, desc.strides,
                                            desc.byte_offset)
            self._check_handle(desc)
            self.drain()
            if self.closed:
                raise PoolClosedError(f'pool {self.pool_id!r} is gone')
            if self._active_holds() >= self.max_inflight:
                raise InflightLimitError(
                    f'this consumer holds {self._active_holds()} frames of pool '
                    f'{self.pool_id!r} (max_inflight={self.max_inflight}): release one first')
            req = next(self._req)
            proto.send(self._sock, proto.ACQUIRE.pack(proto.Msg.ACQUIRE, req, desc.slot,
                                                      desc.generation, desc.sequence))
            deadline = time.monotonic() + self.timeout_s
            while req not in self._replies:
                self._dispatch(*self._recv_until(deadline))
            data, fds = self._replies.pop(req)
            with self._untrusted():
                return self._take_reply(desc, data, fds)

    def _take_reply(self, desc: TensorDescriptor, data: bytes, fds: list) -> np.ndarray:
        if data[0] == proto.Msg.DENY:
            proto.expect_fds(fds, 0, 'DENY')
            _, _, code = proto.unpack(proto.DENY, data, 'DENY')
            raise _DENY_ERRORS.get(code, IpcError)(
                f'pool {self.pool_id!r}: {proto.text(data, proto.DENY)}')
        _, _, slot, generation, size = proto.unpack(proto.GRANT, data, 'GRANT')
        if (slot, generation) != (desc.slot, desc.generation):
            raise ProtocolError(f'GRANT for slot {slot}/{generation}, asked '
                                f'{desc.slot}/{desc.generation}')
        mapping = self._mapping_for(slot, generation, size, fds)
        view = mapping.ndarray(desc.dtype, desc.shape, desc.strides, desc.byte_offset)
        mapping.begin_read()
        self._held[(desc.slot, desc.generation, desc.sequence)] = _Held(mapping)
        return view

    def _check_handle(self, desc: TensorDescriptor) -> None:
        if desc.buffer_kind != self.kind:
            raise InvalidHandleError(
                f'handle says buffer_kind {desc.buffer_kind.name}, pool {self.pool_id!r} '
                f'serves {self.kind.name}')
        desc.check_fits(self.buffer_size, self.slot_count)

    def release(self, desc: TensorDescriptor) -> bool:
        """Drop one reference; at zero tell the producer. False if it was not held."""
        with self._lock:
            key = (desc.slot, desc.generation, desc.sequence)
            held = self._held.get(key)
            if held is None:
                return False
            held.refs -= 1
            if held.refs > 0:
                return True
            del self._held[key]
            held.mapping.end_read()
            if held.revoked or self.closed:
                return True   # the producer already dropped it (lease expired, or gone)
            try:
                proto.send(self._sock, proto.RELEASE.pack(proto.Msg.RELEASE, *key))
                self.pending_acks += 1
            except OSError:
                self._on_closed()
            return True

    def receive(self, timeout_s: Optional[float]) -> Optional[Frame]:
        with self._lock:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not self._frames:
                if self.closed:
                    raise PoolClosedError(f'pool {self.pool_id!r} is gone')
                msg = self._recv(deadline if deadline is not None else float('inf'))
                if msg is None:
                    return None
                self._dispatch(*msg)
            desc, mapping = self._frames.popleft()
            view = mapping.ndarray(desc.dtype, desc.shape, desc.strides, desc.byte_offset)
            return Frame(desc, view, self)

    def flush(self, timeout_s: float) -> None:
        """Wait until every release was acknowledged."""
        with self._lock:
            deadline = time.monotonic() + timeout_s
            while self.pending_acks > 0 and not self.closed:
                self._dispatch(*self._recv_until(deadline))

    def held_count(self) -> int:
        with self._lock:
            return self._active_holds()

    def close(self) -> None:
        """Disconnect and forget every hold (the producer drops them on EOF)."""
        with self._lock:
            self.closed = True
            for hold in self._held.values():
                hold.mapping.end_read()
            self._held.clear()
            self._frames.clear()
            for _, mapping in self._cache.values():
                mapping.release()
            self._cache.clear()
            self._sock.close()


class TensorResolver:
    """Consumer-side handle resolution; one connection per pool, opened on first use."""

    def __init__(self, socket_dir: Optional[str] = None, max_inflight: int = 2,
                 name: str = '', timeout_s: float = 2.0, try_inflight: int = 0) -> None:
        """Set up the resolver; no connection is opened yet.

        try_inflight > max_inflight: ask each pool for that many holds first (a window pool
        sized for it admits them), and fall back to max_inflight where the pool refuses (a
        camera ring of a few slots).
        """
        self.socket_dir = socket_dir
        self.max_inflight = max_inflight
        self.try_inflight = try_inflight
        self.name = name
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._connections: Dict[str, _Connection] = {}
        # Connections whose producer went away: their holds can still be release()d (no-op).
        self._retired: Dict[str, _Connection] = {}

    def _connection(self, pool_id: str) -> _Connection:
        with self._lock:
            conn = self._connections.get(pool_id)
            if conn is None or conn.closed:
                if conn is not None:
                    self._retire(pool_id, conn)
                conn = None
                if self.try_inflight > self.max_inflight:
                    try:
                        conn = _Connection(pool_id, self.socket_dir, self.try_inflight,
                                           self.name, subscribe=False, timeout_s=self.timeout_s)
                    except AdmissionError:
                        conn = None
                if conn is None:
                    conn = _Connection(pool_id, self.socket_dir, self.max_inflight, self.name,
                                       subscribe=False, timeout_s=self.timeout_s)
                self._connections[pool_id] = conn
            return conn

    def resolve(self, handle: Any) -> np.ndarray:
        """Hold the frame a handle (TensorDescriptor or TensorHandle msg) names; return a view.

        Raises a typed IpcError subclass for every bad handle: UnknownPoolError /
        PoolUnreachableError (no producer here: use the copy topic), StaleHandleError,
        SlotOutOfRangeError, DescriptorError, InflightLimitError, BufferValidationError,
        PeerCredentialsError.
        """
        desc = TensorDescriptor.from_msg(handle)
        return self._connection(desc.pool_id).acquire(desc)

    def _retire(self, pool_id: str, conn: _Connection) -> None:
        old = self._retired.pop(pool_id, None)
        if old is not None:
            old.close()
        self._retired[pool_id] = conn

    def release(self, handle: Any) -> None:
        """Give a resolved frame back (a no-op if the producer is gone or revoked it)."""
        desc = TensorDescriptor.from_msg(handle)
        with self._lock:
            conns = [c for c in (self._connections.get(desc.pool_id),
                                 self._retired.get(desc.pool_id)) if c is not None]
        if not any(conn.release(desc) for conn in conns):
            raise InvalidHandleError(f'frame {desc.key} is not held by this resolver')

    @contextmanager
    def borrow(self, handle: Any) -> Iterator[np.ndarray]:
        """resolve() for the duration of a with-block, then release()."""
        desc = TensorDescriptor.from_msg(handle)
        view = self.resolve(desc)
        try:
            yield view
        finally:
            self.release(desc)

    def reachable(self, pool_id: str) -> bool:
        """Whether the pool's producer can be reached from here (else use the copy topic)."""
        try:
            self._connection(pool_id)
            return True
        except IpcError:
            return False

    def inflight(self, pool_id: str) -> int:
        """Frames of the pool this resolver may hold at once (connects when needed)."""
        return self._connection(pool_id).max_inflight

    def held(self, pool_id: str) -> int:
        """Frames of a pool this resolver holds right now."""
        with self._lock:
            conn = self._connections.get(pool_id)
        return 0 if conn is None else conn.held_count()

    def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the producers acknowledged every release sent so far."""
        with self._lock:
            conns = list(self._connections.values())
        for conn in conns:
            if not conn.closed:
                conn.flush(timeout_s)

    def subscribe(self, pool_id: str, max_inflight: Optional[int] = None) -> 'Subscription':
        """Receive every frame the pool publishes (skipping while max_inflight are held)."""
        conn = _Connection(pool_id, self.socket_dir, max_inflight or self.max_inflight,
                           self.name, subscribe=True, timeout_s=self.timeout_s)
        return Subscription(conn)

    def close(self) -> None:
        """Drop all connections (held frames are released by the producer on EOF)."""
        with self._lock:
            conns = list(self._connections.values()) + list(self._retired.values())
            self._connections.clear()
            self._retired.clear()
        for conn in conns:
            conn.close()

    def __enter__(self) -> 'TensorResolver':
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscription:
    """Push-mode consumer of one pool."""

    def __init__(self, connection: _Connection) -> None:
        self._conn = connection
        self.pool_id = connection.pool_id

    def receive(self, timeout_s: Optional[float] = None) -> Optional[Frame]:
        """Next pushed frame (held: release it), or None on timeout."""
        return self._conn.receive(timeout_s)

    def fileno(self) -> int:
        """Return the socket's fd, for select()/poll() integration in an executor."""
        return self._conn._sock.fileno()

    def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until every release was acknowledged."""
        self._conn.flush(timeout_s)

    def held(self) -> int:
        """Frames held right now."""
        return self._conn.held_count()

    def close(self) -> None:
        """Disconnect; the producer drops our holds."""
        self._conn.close()

    def __enter__(self) -> 'Subscription':
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
