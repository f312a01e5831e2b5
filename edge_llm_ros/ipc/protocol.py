"""Wire protocol of a pool socket (unix SOCK_SEQPACKET: one datagram = one message).

Consumer -> producer:
  HELLO    version, max_inflight, flags (SUBSCRIBE: push every frame), name
  ACQUIRE  req_id, slot, generation, sequence   (hold a published frame)
  RELEASE  slot, generation, sequence
Producer -> consumer:
  WELCOME  version, slot_count, buffer_size, buffer_kind, lease_s, pool_id
  REFUSE   code, text                            (then the producer closes)
  GRANT    req_id, slot, generation, size [+ 1 fd the first time for slot+generation]
  DENY     req_id, code, text
  FRAME    size, packed descriptor [+ 1 fd]      (subscribers: already held for them)
  RELEASED slot, generation, sequence, status    (every RELEASE is acknowledged)
  REVOKED  slot, generation                      (lease expired: the hold is gone)
Fds travel with SCM_RIGHTS; receivers refuse truncated control data (MSG_CTRUNC).
"""
import array
import enum
import os
import socket
import struct
from typing import List, Sequence, Tuple

from edge_llm_ros.ipc.errors import PeerCredentialsError, ProtocolError

VERSION = 1
MAX_MESSAGE = 4096
MAX_FDS = 4


class Msg(enum.IntEnum):
    """Message type byte."""

    HELLO = 1
    WELCOME = 2
    REFUSE = 3
    ACQUIRE = 4
    GRANT = 5
    DENY = 6
    FRAME = 7
    RELEASE = 8
    RELEASED = 9
    REVOKED = 10


class Code(enum.IntEnum):
    """Why a request was denied or a consumer refused."""

    OK = 0
    SLOT_RANGE = 1
    STALE = 2
    INFLIGHT = 3
    ADMISSION = 4
    PEER_UID = 5
    BAD_REQUEST = 6
    VERSION = 7
    UNKNOWN_HOLD = 8
    CLOSING = 9


SUBSCRIBE = 0x1

HELLO = struct.Struct('<BHIB')          # type version max_inflight flags | name
WELCOME = struct.Struct('<BHIQBd')      # type version slots buffer_size kind lease_s | pool_id
REFUSE = struct.Struct('<BH')           # type code | text
ACQUIRE = struct.Struct('<BIIQQ')       # type req_id slot generation sequence
GRANT = struct.Struct('<BIIQQ')         # type req_id slot generation size (+fd)
DENY = struct.Struct('<BIH')            # type req_id code | text
FRAME = struct.Struct('<BQ')            # type size | packed descriptor (+fd)
RELEASE = struct.Struct('<BIQQ')        # type slot generation sequence
RELEASED = struct.Struct('<BIQQH')      # type slot generation sequence status
REVOKED = struct.Struct('<BIQ')         # type slot generation


def peer_uid(sock: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from SO_PEERCRED (set at connect()/listen() time)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize('3i'))
    return struct.unpack('3i', raw)


def check_peer(sock: socket.socket) -> int:
    """Return the peer pid; raise PeerCredentialsError unless it runs as our uid."""
    pid, uid, _ = peer_uid(sock)
    if uid != os.getuid():
        raise PeerCredentialsError(
            f'peer pid {pid} runs as uid {uid}, we run as uid {os.getuid()}: pools are only '
            'shared between processes of the same user')
    return pid


def send(sock: socket.socket, payload: bytes, fds: Sequence[int] = (),
         flags: int = 0) -> None:
    """Send one message, with fds as SCM_RIGHTS ancillary data."""
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds).tobytes())]
        sock.sendmsg([payload], anc, flags)
    else:
        sock.send(payload, flags)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# Plain ints: socket's flag enums make every | and & a slow Python-level call (hot path).
_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_CTRUNC = int(socket.MSG_CTRUNC)
_TRUNC = int(socket.MSG_TRUNC)
_FDS_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array('i').itemsize)


def recv(sock: socket.socket, flags: int = 0) -> Tuple[bytes, List[int]]:
    """Receive one message and any fds. b'' means the peer closed the connection.

    Raises ProtocolError (after closing whatever fds did arrive) if the payload or the
    control data was truncated: a partial fd set would leak or desynchronize slots.
    """
    data, anc, msg_flags, _ = sock.recvmsg(MAX_MESSAGE, _FDS_SPACE, int(flags) | _CMSG_CLOEXEC)
    fds: List[int] = []
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array('i')
            arr.frombytes(cdata[:len(cdata) - len(cdata) % arr.itemsize])
            fds.extend(arr)
    if msg_flags & _CTRUNC:
        _close_all(fds)
        raise ProtocolError('control data truncated (MSG_CTRUNC): the peer sent more than '
                            f'{MAX_FDS} fds in one message; closing them all')
    if msg_flags & _TRUNC:
        _close_all(fds)
        raise ProtocolError(f'message longer than {MAX_MESSAGE} bytes: peer is not speaking '
                            'this protocol')
    return data, fds


def expect_fds(fds: List[int], count: int, what: str) -> None:
    """Raise ProtocolError (closing them) unless exactly count fds came with a message."""
    if len(fds) != count:
        _close_all(fds)
        raise ProtocolError(f'{what} carried {len(fds)} fds, expected {count}')


def unpack(fmt: struct.Struct, data: bytes, what: str) -> Tuple:
    """Unpack a fixed header; ProtocolError if the message is too short."""
    if len(data) < fmt.size:
        raise ProtocolError(f'{what} message too short ({len(data)} < {fmt.size} bytes)')
    return fmt.unpack_from(data)


def text(data: bytes, fmt: struct.Struct) -> str:
    """Decode the UTF-8 tail of a message after its fixed header."""
    return data[fmt.size:].decode('utf-8', 'replace')
