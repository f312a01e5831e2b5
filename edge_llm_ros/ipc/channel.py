"""Pool sockets: one unix SOCK_SEQPACKET socket per producer in a private directory.

The directory is ``<root>/<pool_id>.sock`` where root is, first found:
``socket_dir`` argument, ``$EDGE_LLM_IPC_DIR``, ``$XDG_RUNTIME_DIR/edge_llm_ros``,
``/tmp/edge_llm_ros-<uid>``. It must be a real directory (not a symlink), owned by
us and mode 0700: only our uid can even connect. Both ends additionally check the
peer's uid with SO_PEERCRED. Nothing is ever named in /dev/shm: buffers are
anonymous fds passed over these sockets.
"""
import errno
import os
import pathlib
import socket
import stat
from typing import Optional, Union

from edge_llm_ros.ipc.descriptor import check_pool_id
from edge_llm_ros.ipc.errors import (InsecureDirectoryError, IpcError, PoolUnreachableError,
                                     UnknownPoolError)
from edge_llm_ros.ipc.protocol import check_peer

PathLike = Union[str, os.PathLike]
ENV_DIR = 'EDGE_LLM_IPC_DIR'


def default_socket_dir() -> pathlib.Path:
    """Return the socket directory used when none is configured."""
    if os.environ.get(ENV_DIR):
        return pathlib.Path(os.environ[ENV_DIR])
    if os.environ.get('XDG_RUNTIME_DIR'):
        return pathlib.Path(os.environ['XDG_RUNTIME_DIR']) / 'edge_llm_ros'
    return pathlib.Path('/tmp') / f'edge_llm_ros-{os.getuid()}'


def _verify_private(path: pathlib.Path) -> None:
    st = os.lstat(path)
    problems = []
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problems.append('is not a directory (or is a symlink)')
    if st.st_uid != os.getuid():
        problems.append(f'is owned by uid {st.st_uid}, not {os.getuid()}')
    if stat.S_IMODE(st.st_mode) & 0o077:
        problems.append(f'has mode {stat.S_IMODE(st.st_mode):o}, not 700')
    if problems:
        raise InsecureDirectoryError(
            f'socket directory {path} {" and ".join(problems)}: another user could reach or '
            'replace pool sockets. Remove it or point socket_dir/EDGE_LLM_IPC_DIR elsewhere.')


def socket_dir(root: Optional[PathLike] = None, create: bool = True) -> pathlib.Path:
    """Return the private socket directory, creating it (0700) if asked."""
    path = pathlib.Path(root) if root is not None else default_socket_dir()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
    _verify_private(path)
    return path


def socket_path(pool_id: str, root: Optional[PathLike] = None, create: bool = False
                ) -> pathlib.Path:
    """Socket file of a pool (pool_id is validated: it becomes a file name)."""
    return socket_dir(root, create=create) / f'{check_pool_id(pool_id)}.sock'


def _new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)


def listen(pool_id: str, root: Optional[PathLike] = None, backlog: int = 16) -> socket.socket:
    """Bind and listen on a pool's socket; a stale socket left by a dead producer is replaced.

    Raises IpcError if a live producer already serves this pool_id.
    """
    path = socket_path(pool_id, root, create=True)
    sock = _new_socket()
    try:
        try:
            sock.bind(str(path))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            probe = _new_socket()
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)  # left behind by a producer that was killed
            else:
                raise IpcError(f'pool {pool_id!r} is already served by a live producer at '
                               f'{path}: pick another pool_id') from exc
            finally:
                probe.close()
            sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(pool_id: str, root: Optional[PathLike] = None,
            timeout_s: float = 2.0) -> socket.socket:
    """Connect to a pool's producer and check it runs as our uid.

    UnknownPoolError: no such socket; PoolUnreachableError: socket present but nobody
    listening (producer dead) or not permitted; PeerCredentialsError: wrong uid.
    """
    root_path = pathlib.Path(root) if root is not None else default_socket_dir()
    try:
        path = socket_path(pool_id, root_path, create=False)
    except FileNotFoundError as exc:
        raise UnknownPoolError(
            f'no pool {pool_id!r}: socket directory {root_path} does not exist (no producer '
            'has started on this host with this socket_dir)') from exc
    except PermissionError as exc:
        raise PoolUnreachableError(
            f'pool {pool_id!r}: socket directory {root_path} is not accessible to uid '
            f'{os.getuid()}') from exc
    sock = _new_socket()
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        check_peer(sock)
    except FileNotFoundError as exc:
        sock.close()
        raise UnknownPoolError(f'no pool {pool_id!r}: {path} does not exist (producer not '
                               'started, or on another host: use the copy topic)') from exc
    except (ConnectionRefusedError, PermissionError, socket.timeout) as exc:
        sock.close()
        raise PoolUnreachableError(
            f'pool {pool_id!r} at {path} is unreachable ({exc.__class__.__name__}): producer '
            'dead or not ours') from exc
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock
