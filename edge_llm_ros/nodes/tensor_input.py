"""Consumer side of a tensor topic: map handles without copying, or fall back to copies.

``TensorInput`` subscribes to a TensorHandle topic. While the producer's pool socket is
reachable (same host, same user, same socket_dir) each handle is resolved into a
read-only view of the producer's buffer. When it is not (another host, a socket folder
this process cannot enter, another user), 'auto' transport logs why once and subscribes
to ``<topic>_copy`` instead, where the producer then publishes the bytes; it probes the
pool again every few seconds and goes back to mapping once it can.

Subscription callbacks only park the latest message (a newer one replaces an unread
one: consumers always get the freshest frame); ``take()`` resolves it on the caller's
thread, so inference never runs inside the executor.
"""
import dataclasses
import threading
import time
from typing import Any, Callable, Optional, Tuple

import numpy as np
from rclpy.node import Node
from rclpy.qos import QoSProfile
from sensor_msgs.msg import Image
from std_msgs.msg import Header, UInt8MultiArray

from edge_llm_msgs.msg import TensorHandle
from edge_llm_ros.ipc.descriptor import TensorDescriptor
from edge_llm_ros.ipc.errors import (DescriptorError, IpcError, PeerCredentialsError,
                                     StaleHandleError, UnknownPoolError)
from edge_llm_ros.ipc.resolver import TensorResolver
from edge_llm_ros.nodes import copy_codec
from edge_llm_ros.nodes.handles import from_handle
from edge_llm_ros.nodes.tensor_output import copy_topic, CopyKind, SENSOR_QOS

TRANSPORTS = ('auto', 'zero_copy', 'copy')
# Errors that mean "this process cannot map that pool" rather than "this handle is bad".
UNREACHABLE = (UnknownPoolError, PeerCredentialsError)
REPROBE_S = 5.0
LOG_THROTTLE_S = 5.0


@dataclasses.dataclass
class Sample:
    """One received tensor: a read-only array, valid until release() (or the with-block)."""

    array: np.ndarray
    header: Optional[Header]
    descriptor: Optional[TensorDescriptor]    # None for copies
    zero_copy: bool
    _release: Optional[Callable[[], None]] = None

    def release(self) -> None:
        """Give a mapped frame back to its producer (no-op for copies; idempotent)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> 'Sample':
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclasses.dataclass
class InputStats:
    """Counters of a TensorInput."""

    handles: int = 0      # handle messages received
    copies: int = 0       # copy messages received
    mapped: int = 0       # samples delivered zero-copy
    copied: int = 0       # samples delivered from copies
    dropped: int = 0      # replaced by a newer message before take()
    stale: int = 0        # slot rewritten before we asked (consumer too slow)
    rejected: int = 0     # handles of another pool than the one configured
    errors: int = 0       # malformed or unresolvable for another reason


class TensorInput:
    """Latest-wins tensor input over TensorHandles, with a copying fallback."""

    def __init__(self, node: Node, topic: str, kind: CopyKind, *,
                 socket_dir: Optional[str] = None, transport: str = 'auto', pool_id: str = '',
                 max_inflight: int = 1, name: str = '', qos: QoSProfile = SENSOR_QOS,
                 callback_group: Any = None, resolver: Optional[TensorResolver] = None,
                 reprobe_s: float = REPROBE_S) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f'transport {transport!r} is not one of {", ".join(TRANSPORTS)}')
        self.kind = kind
        self.transport = transport
        self.pool_id = pool_id
        self.stats = InputStats()
        self._node = node
        self._qos = qos
        self._group = callback_group
        self._reprobe_s = reprobe_s
        self._own_resolver = resolver is None
        self._resolver = resolver or TensorResolver(socket_dir=socket_dir,
                                                    max_inflight=max_inflight,
                                                    name=name or node.get_name())
        self._cond = threading.Condition()
        self._pending: Optional[Tuple[str, Any]] = None
        self._last_handle: Optional[TensorHandle] = None
        self._last_probe = 0.0
        self._last_log = {}
        self._copy_sub = None
        self._closed = False
        self._handle_sub = node.create_subscription(TensorHandle, topic, self._on_handle, qos,
                                                    callback_group=callback_group)
        self.copy_topic = copy_topic(self._handle_sub.topic_name)
        if transport == 'copy':
            self._subscribe_copies()

    # --- executor callbacks: park the latest message -----------------------------------
    def _park(self, kind: str, msg: Any) -> None:
        if self._pending is not None:
            self.stats.dropped += 1
        self._pending = (kind, msg)
        self._cond.notify_all()

    def _on_handle(self, msg: TensorHandle) -> None:
        with self._cond:
            self.stats.handles += 1
            if self.pool_id and msg.pool_id != self.pool_id:
                self.stats.rejected += 1
                self._log('warn', 'pool', f'ignoring handles of pool {msg.pool_id!r}: this '
                          f'input only accepts pool {self.pool_id!r}')
                return
            if self._copy_sub is not None:
                self._last_handle = msg     # only kept to probe the pool again later
                return
            self._park('handle', msg)

    def _on_copy(self, msg: Any) -> None:
        with self._cond:
            self.stats.copies += 1
            if self._copy_sub is not None:
                self._park('copy', msg)

    # --- consumer thread ---------------------------------------------------------------
    @property
    def topic(self) -> str:
        """Fully resolved handle topic."""
        return self._handle_sub.topic_name

    @property
    def mode(self) -> str:
        """'zero_copy' while handles are mapped, 'copy' while copies are received."""
        return 'copy' if self._copy_sub is not None else 'zero_copy'

    def take(self, timeout_s: float) -> Optional[Sample]:
        """Return the freshest tensor received (mapped or copied), or None after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self._closed:
            self._maybe_reprobe()
            with self._cond:
                if self._pending is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    # Wake up at least every reprobe_s to probe an unreachable pool again.
                    self._cond.wait(min(left, self._reprobe_s))
                item, self._pending = self._pending, None
            if item is None:
                continue
            sample = self._open_handle(item[1]) if item[0] == 'handle' else \
                self._open_copy(item[1])
            if sample is not None:
                return sample
        return None

    def _open_handle(self, msg: TensorHandle) -> Optional[Sample]:
        try:
            desc = from_handle(msg)
            view = self._resolver.resolve(desc)
        except DescriptorError as exc:
            self._count_error('handle', f'malformed handle: {exc}')
            return None
        except UNREACHABLE as exc:
            if self.transport == 'auto':
                self._subscribe_copies(msg.pool_id, exc)
            else:
                self._count_error('unreachable', f'pool {msg.pool_id!r} is unreachable and '
                                  f'input transport is {self.transport!r}: {exc}')
            return None
        except StaleHandleError:
            self.stats.stale += 1
            return None
        except IpcError as exc:
            self._count_error('ipc', f'cannot map a frame of pool {msg.pool_id!r}: {exc}')
            return None
        self.stats.mapped += 1
        return Sample(view, msg.header, desc, True, lambda: self._release(desc))

    def _open_copy(self, msg: Any) -> Optional[Sample]:
        try:
            if isinstance(msg, Image):
                return self._copied(copy_codec.image_to_rgb(msg), msg.header)
            return self._copied(copy_codec.multiarray_to_tensor(msg), None)
        except copy_codec.CopyCodecError as exc:
            self._count_error('copy', f'undecodable copy on {self.copy_topic}: {exc}')
            return None

    def _copied(self, array: np.ndarray, header: Optional[Header]) -> Sample:
        self.stats.copied += 1
        return Sample(array, header, None, False)

    def _release(self, desc: TensorDescriptor) -> None:
        try:
            self._resolver.release(desc)
        except IpcError:
            pass    # the producer died or revoked the lease: nothing left to give back

    # --- switching between mapping and copies ------------------------------------------
    def _subscribe_copies(self, pool_id: str = '', reason: Optional[Exception] = None) -> None:
        with self._cond:
            if self._copy_sub is not None or self._closed:
                return
            msg_type = Image if self.kind is CopyKind.IMAGE else UInt8MultiArray
            self._copy_sub = self._node.create_subscription(
                msg_type, self.copy_topic, self._on_copy, self._qos,
                callback_group=self._group)
            self._last_probe = time.monotonic()
        if reason is not None:
            self._node.get_logger().warn(
                f'pool {pool_id!r} cannot be mapped from this process ({reason}); receiving '
                f'copies on {self.copy_topic} instead (slower: every frame crosses DDS)')

    def _maybe_reprobe(self) -> None:
        if self.transport != 'auto':
            return
        with self._cond:
            handle = self._last_handle
            due = self._copy_sub is not None and handle is not None and \
                time.monotonic() - self._last_probe >= self._reprobe_s
            if due:
                self._last_probe = time.monotonic()
        if not due or not self._resolver.reachable(handle.pool_id):
            return
        with self._cond:
            sub, self._copy_sub = self._copy_sub, None
            self._last_handle = None
            if self._pending is not None and self._pending[0] == 'copy':
                self._pending = None
        if sub is not None:
            self._node.destroy_subscription(sub)
            self._node.get_logger().info(f'pool {handle.pool_id!r} is reachable again: '
                                         'mapping frames without copies')

    # --- misc ---------------------------------------------------------------------------
    def _log(self, level: str, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -LOG_THROTTLE_S) >= LOG_THROTTLE_S:
            self._last_log[key] = now
            getattr(self._node.get_logger(), level)(text)

    def _count_error(self, key: str, text: str) -> None:
        self.stats.errors += 1
        self._log('error', key, text)

    def close(self) -> None:
        """Remove the subscriptions and disconnect from the producers (they drop our holds)."""
        with self._cond:
            self._closed = True
            subs = [s for s in (self._handle_sub, self._copy_sub) if s is not None]
            self._copy_sub = None
            self._cond.notify_all()
        for sub in subs:
            self._node.destroy_subscription(sub)
        if self._own_resolver:
            self._resolver.close()
