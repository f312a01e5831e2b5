"""Producer-owned ring of fd-backed slots: loan -> write -> publish, with leases.

Lifetime protocol (one writer per buffer; readers map read-only; only the owner frees):

- ``loan()`` hands the producer a slot that no consumer holds (never published first,
  then the oldest published). It never waits for consumers: admission control keeps
  ``sum(max_inflight) + max_loans <= slots``, so a free slot always exists.
- ``publish()`` stamps a new sequence. Subscribed consumers get the frame pushed and
  held for them while they have credit (``max_inflight``); a consumer without credit
  skips the frame, so a slow consumer never stalls the producer. Other consumers
  ``ACQUIRE`` a handle they received elsewhere (a ROS topic, a goal); a handle whose
  slot was rewritten since is stale and refused.
- Every ``RELEASE`` is acknowledged. A consumer that disconnects (EOF, killed) drops
  all its holds. A hold older than ``lease_s`` is revoked: the slot gets a fresh buffer
  and a new generation, so the producer writes elsewhere and the late reader still sees
  its old, complete frame (never a torn one) until it lets go.
"""
import dataclasses
import os
import selectors
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple
import weakref

import numpy as np

from edge_llm_ros.ipc import channel, protocol as proto
from edge_llm_ros.ipc.allocators import (Allocator, Buffer, DMA_BUF_SYNC_END, DMA_BUF_SYNC_START,
                                         DMA_BUF_SYNC_WRITE, page_align, select_allocator)
from edge_llm_ros.ipc.descriptor import check_pool_id, describe_array, TensorDescriptor
from edge_llm_ros.ipc.errors import (DescriptorError, IpcError, PeerCredentialsError,
                                     PoolClosedError, PoolExhaustedError, ProtocolError,
                                     StaleHandleError)
from edge_llm_ros.ipc.mapping import Mapping


@dataclasses.dataclass
class PoolConfig:
    """Configuration of a producer's pool."""

    pool_id: str
    slot_nbytes: int
    slots: int = 4
    allocator: str = 'auto'
    lease_s: float = 2.0
    socket_dir: Optional[str] = None
    max_loans: int = 1
    max_consumers: int = 32

    def __post_init__(self) -> None:
        check_pool_id(self.pool_id)
        if self.slot_nbytes <= 0:
            raise ValueError(f'slot_nbytes must be > 0, got {self.slot_nbytes}')
        if self.max_loans < 1:
            raise ValueError(f'max_loans must be >= 1, got {self.max_loans}')
        if self.slots < self.max_loans + 1:
            raise ValueError(f'slots={self.slots} leaves no slot for consumers: need at least '
                             f'max_loans + 1 = {self.max_loans + 1}')
        if self.lease_s <= 0:
            raise ValueError(f'lease_s must be > 0, got {self.lease_s}')


@dataclasses.dataclass
class ConsumerStats:
    """What the producer knows about one connected consumer."""

    name: str
    pid: int
    max_inflight: int
    subscribed: bool
    held: int
    delivered: int
    skipped: int
    revoked: int


@dataclasses.dataclass
class PoolStats:
    """Counters of a pool (for diagnostics and tests)."""

    published: int
    revocations: int
    consumers: List[ConsumerStats]


_DONTWAIT = int(socket.MSG_DONTWAIT)
# Longest a subscriber's release ack waits for a frame to travel with (>= 20 Hz streams).
ACK_DELAY_S = 0.05


class _Slot:
    __slots__ = ('index', 'buffer', 'mapping', 'generation', 'sequence', 'loaned', 'holders',
                 'descriptor')

    def __init__(self, index: int, buffer: Buffer) -> None:
        self.index = index
        self.buffer = buffer
        self.mapping = Mapping(buffer.fd, buffer.size, buffer.kind, writable=True, own_fd=False)
        self.generation = 0
        self.sequence = 0          # 0: nothing readable in this slot
        self.loaned = False
        self.holders: Set[int] = set()   # session ids holding the current generation
        self.descriptor: Optional[TensorDescriptor] = None


@dataclasses.dataclass
class _Hold:
    slot: int
    generation: int
    sequence: int
    deadline: float


class _Session:
    def __init__(self, sid: int, sock: socket.socket, pid: int) -> None:
        self.id = sid
        self.sock = sock
        self.pid = pid
        self.name = ''
        self.max_inflight = 0
        self.subscribed = False
        self.admitted = False
        self.dead = False
        self.refusal: Optional[str] = None   # set for a peer of another uid
        self.deferred: List[bytes] = []      # RELEASED acks waiting for the next FRAME
        self.ack_deadline = 0.0
        self.holds: Dict[Tuple[int, int], _Hold] = {}
        self.sent: Set[Tuple[int, int]] = set()  # (slot, generation) whose fd it has
        self.delivered = 0
        self.skipped = 0
        self.revoked = 0


class Loan:
    """A slot lent to the producer for writing; publish() or discard() ends it."""

    def __init__(self, pool: 'TensorPool', slot: _Slot) -> None:
        self._pool = pool
        self._slot = slot
        self.slot = slot.index
        self.generation = slot.generation
        self.size = slot.buffer.size
        self._views: List[weakref.ref] = []
        self._layout: Optional[TensorDescriptor] = None   # validated by the last ndarray()
        self.done = False

    def ndarray(self, dtype: str, shape: Sequence[int], strides: Sequence[int] = (),
                byte_offset: int = 0) -> np.ndarray:
        """Return a writable view into the slot; its layout becomes publish()'s default."""
        self._check_open()
        desc = self._pool._describe(self._slot, dtype, shape, strides, byte_offset, 0)
        arr = self._slot.mapping.ndarray(desc.dtype, desc.shape, desc.strides, desc.byte_offset)
        self._views.append(weakref.ref(arr))
        self._layout = desc
        return arr

    def memoryview(self) -> memoryview:  # noqa: A003 (mirrors the builtin on purpose)
        """Return the whole slot buffer as a writable memoryview."""
        self._check_open()
        return self._slot.mapping.memoryview()

    def publish(self, dtype: Optional[str] = None, shape: Optional[Sequence[int]] = None,
                strides: Sequence[int] = (), byte_offset: int = 0) -> TensorDescriptor:
        """Publish what was written; layout defaults to the last ndarray() call."""
        self._check_open()
        if dtype is None or shape is None:
            if self._layout is None:
                raise DescriptorError('publish() needs dtype and shape (or call ndarray() '
                                      'first)')
            return self._pool._publish(self, self._layout)
        return self._pool._publish(self, self._pool._describe(
            self._slot, dtype, shape, strides, byte_offset, 0))

    def discard(self) -> None:
        """Give the slot back unpublished."""
        if not self.done:
            self._pool._end_loan(self, published=False)

    def _freeze_views(self) -> None:
        # Published bytes must not change under readers: drop write access to our views.
        for ref in self._views:
            arr = ref()
            if arr is not None:
                arr.flags.writeable = False
        self._views.clear()

    def _check_open(self) -> None:
        if self.done:
            raise IpcError(f'loan of slot {self.slot} already ended (published or discarded)')

    def __enter__(self) -> 'Loan':
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


class TensorPool:
    """A producer's ring of N fd-backed slots served on its own unix socket."""

    def __init__(self, config: PoolConfig, allocator: Optional[Allocator] = None) -> None:
        self.config = config
        self.pool_id = config.pool_id
        self._own_allocator = allocator is None
        self._allocator = allocator or select_allocator(config.allocator)
        self.kind = self._allocator.kind
        self.buffer_size = page_align(config.slot_nbytes)
        self._lock = threading.RLock()
        self._slots: List[_Slot] = []
        self._sessions: Dict[int, _Session] = {}
        self._next_sid = 1
        self._sequence = 0
        self._loans = 0
        self._revocations = 0
        self._closed = False
        self._service_error: Optional[Exception] = None
        try:
            for i in range(config.slots):
                self._slots.append(_Slot(i, self._allocate(i, 0)))
            self._listener = channel.listen(self.pool_id, config.socket_dir)
        except BaseException:
            self._free_slots()
            if self._own_allocator:
                self._allocator.close()
            raise
        self.socket_path = self._listener.getsockname()
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, name=f'pool-{self.pool_id}',
                                        daemon=True)
        self._thread.start()

    # --- producer API --------------------------------------------------------------------
    @property
    def slot_count(self) -> int:
        """Return the number of slots in the ring."""
        return len(self._slots)

    def loan(self) -> Loan:
        """Lend a slot nobody reads for writing. Never waits for consumers."""
        with self._lock:
            self._check_open()
            if self._loans >= self.config.max_loans:
                raise PoolExhaustedError(
                    f'pool {self.pool_id!r}: {self._loans} loan(s) outstanding '
                    f'(max_loans={self.config.max_loans}): publish or discard them first')
            slot = self._pick_free_slot()
            if slot is None:
                self._expire_leases(time.monotonic())
                slot = self._pick_free_slot()
            if slot is None:
                raise PoolExhaustedError(
                    f'pool {self.pool_id!r}: all {self.slot_count} slots are held by '
                    'consumers within their lease: raise slots or lower max_inflight')
            slot.loaned = True
            slot.sequence = 0          # handles to its previous frame are stale from now on
            slot.descriptor = None
            self._loans += 1
        slot.buffer.sync(DMA_BUF_SYNC_START | DMA_BUF_SYNC_WRITE)
        return Loan(self, slot)

    def publish_array(self, array: np.ndarray) -> TensorDescriptor:
        """Copy an array into a loaned slot and publish it (the one copy at ingress)."""
        dtype, shape, _ = describe_array(np.asarray(array))
        loan = self.loan()
        try:
            loan.ndarray(dtype, shape)[...] = array
            return loan.publish()
        except BaseException:
            loan.discard()
            raise

    def copy_out(self, desc: TensorDescriptor) -> bytes:
        """Copy a published tensor's bytes out (the fallback for consumers on other hosts).

        Pair with descriptor.array_from_bytes() on the receiving side.
        """
        with self._lock:
            self._check_open()
            slot = self._current(desc)
            view = slot.mapping.memoryview()
            try:
                return bytes(view[desc.byte_offset:desc.byte_offset + desc.nbytes])
            finally:
                view.release()

    def stats(self) -> PoolStats:
        """Snapshot of the pool's counters."""
        with self._lock:
            consumers = [ConsumerStats(s.name, s.pid, s.max_inflight, s.subscribed,
                                       len(s.holds), s.delivered, s.skipped, s.revoked)
                         for s in self._sessions.values() if s.admitted]
            return PoolStats(self._sequence, self._revocations, consumers)

    def close(self) -> None:
        """Stop serving, drop every connection and free the buffers (consumers' views stay)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        os.write(self._wake_w, b'x')
        self._thread.join()
        with self._lock:
            for session in list(self._sessions.values()):
                self._drop_session(session)
            self._selector.close()
            self._listener.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._free_slots()
            if self._own_allocator:
                self._allocator.close()

    def __enter__(self) -> 'TensorPool':
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- slots ---------------------------------------------------------------------------
    def _allocate(self, index: int, generation: int) -> Buffer:
        return self._allocator.allocate(self.buffer_size,
                                        f'{self.pool_id}:{index}:{generation}')

    def _free_slots(self) -> None:
        for slot in self._slots:
            slot.mapping.release()
            slot.buffer.close()

    def _pick_free_slot(self) -> Optional[_Slot]:
        free = [s for s in self._slots if not s.loaned and not s.holders]
        # Never-published slots first, then the oldest frame: recent handles stay valid.
        return min(free, key=lambda s: s.sequence, default=None)

    def _describe(self, slot: _Slot, dtype: str, shape: Sequence[int], strides: Sequence[int],
                  byte_offset: int, sequence: int) -> TensorDescriptor:
        desc = TensorDescriptor(pool_id=self.pool_id, slot=slot.index,
                                generation=slot.generation, sequence=sequence,
                                buffer_kind=self.kind, dtype=dtype, shape=tuple(shape),
                                strides=tuple(strides), byte_offset=byte_offset)
        desc.check_fits(slot.buffer.size, self.slot_count)
        return desc

    def _publish(self, loan: Loan, layout: TensorDescriptor) -> TensorDescriptor:
        slot = loan._slot
        with self._lock:
            self._check_open()
            desc = layout.with_ids(slot.index, slot.generation, self._sequence + 1, check=False)
            loan._freeze_views()
            slot.buffer.sync(DMA_BUF_SYNC_END | DMA_BUF_SYNC_WRITE)
            self._sequence += 1
            slot.sequence = self._sequence
            slot.descriptor = desc
            self._end_loan(loan, published=True)
            self._push(slot, desc)
            return desc

    def _end_loan(self, loan: Loan, published: bool) -> None:
        with self._lock:
            if loan.done:
                return
            loan.done = True
            loan._slot.loaned = False
            self._loans -= 1
            if not published:
                loan._freeze_views()
                if not self._closed:
                    loan._slot.buffer.sync(DMA_BUF_SYNC_END | DMA_BUF_SYNC_WRITE)

    def _current(self, desc: TensorDescriptor) -> _Slot:
        """Return the slot a handle names, if it still holds the handle's frame."""
        if desc.pool_id != self.pool_id:
            raise StaleHandleError(f'handle of pool {desc.pool_id!r} given to {self.pool_id!r}')
        desc.check_fits(self.buffer_size, self.slot_count)
        slot = self._slots[desc.slot]
        if desc.generation != slot.generation:
            raise StaleHandleError(
                f'slot {desc.slot} of pool {self.pool_id!r} is at generation '
                f'{slot.generation}, the handle has {desc.generation} (buffer replaced)')
        if slot.loaned or desc.sequence != slot.sequence or slot.descriptor != desc:
            raise StaleHandleError(
                f'slot {desc.slot} of pool {self.pool_id!r} no longer holds frame '
                f'{desc.sequence} (rewritten): the consumer was too slow, skip it')
        return slot

    def _replace_buffer(self, slot: _Slot) -> None:
        """Give a slot a fresh buffer and a new generation (old readers keep the old one)."""
        buffer = self._allocate(slot.index, slot.generation + 1)
        for session in self._sessions.values():
            session.sent.discard((slot.index, slot.generation))
        slot.mapping.release()
        slot.buffer.close()      # the owner frees; readers' mappings keep the pages alive
        slot.buffer = buffer
        slot.mapping = Mapping(buffer.fd, buffer.size, buffer.kind, writable=True, own_fd=False)
        slot.generation += 1
        slot.sequence = 0
        slot.descriptor = None
        slot.holders.clear()
        self._revocations += 1

    # --- consumers -----------------------------------------------------------------------
    def _push(self, slot: _Slot, desc: TensorDescriptor) -> None:
        """Deliver a new frame to subscribers that have credit; the rest skip it."""
        packed = None
        now = time.monotonic()
        for session in self._sessions.values():
            if not (session.admitted and session.subscribed) or session.dead:
                continue
            if len(session.holds) >= session.max_inflight:
                session.skipped += 1
                self._flush_acks(session)
                continue
            packed = packed or desc.pack()
            key = (slot.index, slot.generation)
            fds = [] if key in session.sent else [slot.buffer.share_fd]
            payload = proto.FRAME.pack(proto.Msg.FRAME, slot.buffer.size) + packed
            try:
                proto.send(session.sock, payload, fds, _DONTWAIT)
            except BlockingIOError:
                session.skipped += 1   # its socket is full: it is not reading, skip
                continue
            except OSError:
                self._mark_dead(session)
                continue
            # Deferred acks go right behind the frame: queued before the consumer wakes for
            # the frame, read in the same wake-up (sent first, they would wake it alone).
            self._flush_acks(session)
            session.sent.add(key)
            session.holds[key] = _Hold(slot.index, slot.generation, desc.sequence,
                                       now + self.config.lease_s)
            slot.holders.add(session.id)
            session.delivered += 1

    def _mark_dead(self, session: _Session) -> None:
        session.dead = True
        try:
            os.write(self._wake_w, b'x')
        except BlockingIOError:
            pass

    def _drop_session(self, session: _Session) -> None:
        """Forget a consumer and everything it held (it died or disconnected)."""
        for key in list(session.holds):
            self._unhold(session, key)
        self._sessions.pop(session.id, None)
        try:
            self._selector.unregister(session.sock)
        except (KeyError, ValueError):
            pass
        session.sock.close()

    def _unhold(self, session: _Session, key: Tuple[int, int]) -> Optional[_Hold]:
        hold = session.holds.pop(key, None)
        if hold is not None:
            slot = self._slots[hold.slot]
            if slot.generation == hold.generation:
                slot.holders.discard(session.id)
        return hold

    def _expire_leases(self, now: float) -> None:
        for session in list(self._sessions.values()):
            for key, hold in list(session.holds.items()):
                if hold.deadline > now:
                    continue
                self._unhold(session, key)
                session.revoked += 1
                slot = self._slots[hold.slot]
                if slot.generation == hold.generation:
                    self._replace_buffer(slot)
                self._reply(session, proto.REVOKED.pack(proto.Msg.REVOKED, hold.slot,
                                                        hold.generation))

    def _reply(self, session: _Session, payload: bytes, fds: Sequence[int] = ()) -> bool:
        if session.dead:
            return False
        try:
            proto.send(session.sock, payload, fds, _DONTWAIT)
            return True
        except OSError:
            # A consumer whose socket is full while it waits for nothing is stuck: drop it.
            self._mark_dead(session)
            return False

    def _handle_hello(self, session: _Session, data: bytes) -> None:
        _, version, max_inflight, flags = proto.unpack(proto.HELLO, data, 'HELLO')
        session.name = proto.text(data, proto.HELLO)[:64]
        if version != proto.VERSION:
            return self._refuse(session, proto.Code.VERSION,
                                f'protocol version {version} unsupported (producer speaks '
                                f'{proto.VERSION}): update both sides')
        admitted = [s for s in self._sessions.values() if s.admitted]
        committed = sum(s.max_inflight for s in admitted)
        capacity = self.slot_count - self.config.max_loans
        if max_inflight < 1 or committed + max_inflight > capacity:
            return self._refuse(
                session, proto.Code.ADMISSION,
                f'pool {self.pool_id!r} has {self.slot_count} slots, {self.config.max_loans} '
                f'for the producer and {committed} promised to {len(admitted)} consumer(s): '
                f'max_inflight={max_inflight} does not fit; lower it or raise the pool slots')
        if len(admitted) >= self.config.max_consumers:
            return self._refuse(session, proto.Code.ADMISSION,
                                f'pool {self.pool_id!r} already serves '
                                f'{self.config.max_consumers} consumers')
        session.max_inflight = max_inflight
        session.subscribed = bool(flags & proto.SUBSCRIBE)
        session.admitted = True
        self._reply(session, proto.WELCOME.pack(
            proto.Msg.WELCOME, proto.VERSION, self.slot_count, self.buffer_size, int(self.kind),
            self.config.lease_s) + self.pool_id.encode())

    def _refuse(self, session: _Session, code: proto.Code, text: str) -> None:
        self._reply(session, proto.REFUSE.pack(proto.Msg.REFUSE, code) + text.encode())
        self._mark_dead(session)

    def _deny(self, session: _Session, req: int, code: proto.Code, text: str) -> None:
        self._reply(session, proto.DENY.pack(proto.Msg.DENY, req, code) + text.encode())

    def _handle_acquire(self, session: _Session, data: bytes) -> None:
        _, req, slot_index, generation, sequence = proto.unpack(proto.ACQUIRE, data, 'ACQUIRE')
        if slot_index >= self.slot_count:
            return self._deny(session, req, proto.Code.SLOT_RANGE,
                              f'slot {slot_index} is out of range: pool {self.pool_id!r} has '
                              f'{self.slot_count} slots')
        slot = self._slots[slot_index]
        if generation != slot.generation:
            return self._deny(session, req, proto.Code.STALE,
                              f'slot {slot_index} is at generation {slot.generation}, handle has '
                              f'{generation} (buffer replaced after a lease expired)')
        if slot.loaned or sequence != slot.sequence or sequence == 0:
            return self._deny(session, req, proto.Code.STALE,
                              f'slot {slot_index} no longer holds frame {sequence} (rewritten): '
                              'skip this handle')
        key = (slot_index, generation)
        if key in session.holds:
            return self._deny(session, req, proto.Code.BAD_REQUEST,
                              f'frame {sequence} is already held by this consumer')
        if len(session.holds) >= session.max_inflight:
            return self._deny(session, req, proto.Code.INFLIGHT,
                              f'consumer holds {len(session.holds)} frames '
                              f'(max_inflight={session.max_inflight}): release one first')
        fds = [] if key in session.sent else [slot.buffer.share_fd]
        if not self._reply(session, proto.GRANT.pack(proto.Msg.GRANT, req, slot_index,
                                                     generation, slot.buffer.size), fds):
            return None
        session.sent.add(key)
        session.holds[key] = _Hold(slot_index, generation, sequence,
                                   time.monotonic() + self.config.lease_s)
        slot.holders.add(session.id)
        session.delivered += 1
        return None

    def _handle_release(self, session: _Session, data: bytes) -> None:
        _, slot_index, generation, sequence = proto.unpack(proto.RELEASE, data, 'RELEASE')
        hold = session.holds.get((slot_index, generation))
        status = proto.Code.UNKNOWN_HOLD
        if hold is not None and hold.sequence == sequence:
            self._unhold(session, (slot_index, generation))
            status = proto.Code.OK
        ack = proto.RELEASED.pack(proto.Msg.RELEASED, slot_index, generation, sequence, status)
        if not session.subscribed:
            self._reply(session, ack)
            return
        # A subscriber sleeps on this socket: an ack now would wake it once more per frame.
        # Send it just ahead of the next frame (same wake-up), or after ACK_DELAY_S at most.
        if not session.deferred:
            session.ack_deadline = time.monotonic() + ACK_DELAY_S
        session.deferred.append(ack)

    def _flush_acks(self, session: _Session) -> None:
        acks, session.deferred = session.deferred, []
        for ack in acks:
            if not self._reply(session, ack):
                return

    def _handle(self, session: _Session, data: bytes, fds: List[int]) -> None:
        proto.expect_fds(fds, 0, 'a consumer message')
        if not data:
            raise ProtocolError('empty message')
        kind = data[0]
        if session.refusal is not None:
            return self._refuse(session, proto.Code.PEER_UID, session.refusal)
        if not session.admitted:
            if kind != proto.Msg.HELLO:
                raise ProtocolError(f'expected HELLO first, got message type {kind}')
            return self._handle_hello(session, data)
        if kind == proto.Msg.ACQUIRE:
            return self._handle_acquire(session, data)
        if kind == proto.Msg.RELEASE:
            return self._handle_release(session, data)
        raise ProtocolError(f'unexpected message type {kind} from a consumer')

    # --- service thread ------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        refusal = None
        try:
            pid = proto.check_peer(sock)
        except PeerCredentialsError as exc:
            # Refused at its first message: closing now, with its HELLO unread, would reset
            # the connection and the peer would never learn why.
            pid, refusal = proto.peer_uid(sock)[0], str(exc)
        sock.setblocking(False)
        session = _Session(self._next_sid, sock, pid)
        session.refusal = refusal
        self._next_sid += 1
        self._sessions[session.id] = session
        self._selector.register(sock, selectors.EVENT_READ, session)

    def _serve_session(self, session: _Session) -> None:
        try:
            data, fds = proto.recv(session.sock, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ProtocolError):
            return self._drop_session(session)
        if not data:
            return self._drop_session(session)   # EOF: the consumer is gone
        try:
            self._handle(session, data, fds)
        except (ProtocolError, DescriptorError):
            self._drop_session(session)
        return None

    def _serve(self) -> None:
        try:
            self._serve_forever()
        except Exception as exc:  # a bug here must not leave a pool that silently serves no one
            with self._lock:
                self._service_error = exc

    def _serve_forever(self) -> None:
        tick = self.config.lease_s / 4
        while True:
            with self._lock:
                deadlines = [s.ack_deadline for s in self._sessions.values() if s.deferred]
            timeout = tick if not deadlines else \
                max(0.0, min(tick, min(deadlines) - time.monotonic()))
            events = self._selector.select(timeout)
            with self._lock:
                if self._closed:
                    return
                for key, _ in events:
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    elif key.data is not None and not key.data.dead:
                        self._serve_session(key.data)
                now = time.monotonic()
                self._expire_leases(now)
                for session in self._sessions.values():
                    if session.deferred and session.ack_deadline <= now:
                        self._flush_acks(session)
                for session in [s for s in self._sessions.values() if s.dead]:
                    self._drop_session(session)

    def _check_open(self) -> None:
        if self._service_error is not None:
            raise PoolClosedError(f'pool {self.pool_id!r} stopped serving consumers: '
                                  f'{self._service_error!r}') from self._service_error
        if self._closed:
            raise PoolClosedError(f'pool {self.pool_id!r} is closed')
