"""Pool sockets: private directory, fd passing, peer credentials, hostile producers."""
import array
import mmap
import os
import shutil
import socket
import tempfile
import threading

from ipc_support import ALLOCATORS, Baseline, Child, nobody_uid, require_allocator
import numpy as np
import pytest

from edge_llm_ros.ipc import channel, protocol as proto
from edge_llm_ros.ipc.allocators import BufferKind, create_sealed_memfd, select_allocator
from edge_llm_ros.ipc.descriptor import TensorDescriptor
from edge_llm_ros.ipc.errors import (BufferValidationError, InsecureDirectoryError, IpcError,
                                     PeerCredentialsError, PoolUnreachableError, ProtocolError)
from edge_llm_ros.ipc.mapping import import_buffer
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.ipc.resolver import TensorResolver


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix='ipc')
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_socket_dir_is_created_private(sock_dir, monkeypatch):
    root = os.path.join(sock_dir, 'run', 'pools')
    path = channel.socket_dir(root)
    assert os.stat(path).st_mode & 0o777 == 0o700
    monkeypatch.setenv('EDGE_LLM_IPC_DIR', root)
    assert str(channel.default_socket_dir()) == root
    monkeypatch.delenv('EDGE_LLM_IPC_DIR')
    monkeypatch.setenv('XDG_RUNTIME_DIR', '/run/user/1000')
    assert str(channel.default_socket_dir()) == '/run/user/1000/edge_llm_ros'
    monkeypatch.delenv('XDG_RUNTIME_DIR')
    assert str(channel.default_socket_dir()) == f'/tmp/edge_llm_ros-{os.getuid()}'


@pytest.mark.parametrize('spoil, message', [
    (lambda p: os.chmod(p, 0o755), 'has mode 755, not 700'),
    (lambda p: os.chown(p, nobody_uid(), -1), 'is owned by uid'),
    (lambda p: (os.rmdir(p), os.symlink('/tmp', p)), 'symlink'),
])
def test_insecure_socket_dirs_are_refused(sock_dir, spoil, message):
    path = os.path.join(sock_dir, 'pools')
    os.mkdir(path, 0o700)
    spoil(path)
    with pytest.raises(InsecureDirectoryError, match=message):
        TensorPool(PoolConfig('cam', 4096, socket_dir=path, allocator='memfd'))
    with pytest.raises(InsecureDirectoryError, match=message):
        channel.connect('cam', path)


def _send_buffer(tell, sock, allocator):
    alloc = select_allocator(allocator)
    buf = alloc.allocate(3 * 4096, 'child:0:0')
    view = np.frombuffer(mmap.mmap(buf.fd, buf.size), np.uint8)
    with buf.cpu_access():
        view[:] = np.arange(buf.size) % 199
    proto.send(sock, proto.GRANT.pack(proto.Msg.GRANT, 1, 0, 0, buf.size), [buf.share_fd])
    buf.close()   # the owner frees; the receiver's fd keeps the buffer alive
    return {'pid': os.getpid(), 'kind': int(buf.kind)}


@pytest.mark.parametrize('allocator', ALLOCATORS)
def test_fd_passing_between_two_processes(allocator):
    require_allocator(allocator)
    base = Baseline()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = Child(_send_buffer, theirs, allocator)
    theirs.close()
    info = child.join()
    data, fds = proto.recv(ours)
    assert proto.GRANT.unpack_from(data)[0] == proto.Msg.GRANT and len(fds) == 1
    size = proto.GRANT.unpack_from(data)[4]
    mapping = import_buffer(fds[0], size, BufferKind(info['kind']))
    mapping.begin_read()
    assert np.array_equal(mapping.ndarray('uint8', (size,), (), 0), np.arange(size) % 199)
    mapping.end_read()
    mapping.release()
    ours.close()
    child.close()
    base.check()


def test_truncated_control_data_closes_every_fd():
    base = Baseline()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = [create_sealed_memfd(4096, f'f{i}') for i in range(proto.MAX_FDS + 3)]
    a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds))])
    for fd in fds:
        os.close(fd)
    with pytest.raises(ProtocolError, match='MSG_CTRUNC'):
        proto.recv(b)
    a.close()
    b.close()
    base.check()


# --- peers running as another user (we run as root in CI; the child drops to nobody) ------
def _impostor_producer(tell, listener):
    os.setgid(nobody_uid())
    os.setuid(nobody_uid())
    listener.listen(1)   # SO_PEERCRED reports the credentials of listen() time
    tell({'listening': True})
    conn, _ = listener.accept()
    conn.recv(100)
    return True


def test_consumer_refuses_a_producer_of_another_uid(sock_dir):
    if os.getuid() != 0:
        pytest.skip('needs root to start a process as nobody')
    path = channel.socket_path('cam', sock_dir, create=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    child = Child(_impostor_producer, listener)
    listener.close()
    child.wait_for('listening')
    with pytest.raises(PeerCredentialsError, match=f'runs as uid {nobody_uid()}'):
        TensorResolver(socket_dir=sock_dir).resolve(
            TensorDescriptor('cam', 0, 0, 1, 0, 'uint8', (4,)))
    child.close()


def _intruder_consumer(tell, sock_path, go_fd):
    os.setgid(nobody_uid())
    os.setuid(nobody_uid())
    # The resolver refuses the root-owned directory outright.
    try:
        TensorResolver(socket_dir=os.path.dirname(sock_path)).resolve(
            TensorDescriptor('cam', 0, 0, 1, 0, 'uint8', (4,)))
        resolver_error = None
    except IpcError as exc:
        resolver_error = type(exc).__name__
    tell({'resolver': resolver_error})
    # A raw client that ignores the directory check reaches the socket only because the
    # test opened the permissions; the producer's SO_PEERCRED check must still refuse it.
    os.read(go_fd, 1)   # until the parent has opened the permissions
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(sock_path)
    proto.send(sock, proto.HELLO.pack(proto.Msg.HELLO, proto.VERSION, 1, 0))
    data, fds = proto.recv(sock)
    eof = proto.recv(sock)[0] == b''
    return {'type': data[0], 'code': proto.REFUSE.unpack_from(data)[1], 'fds': len(fds),
            'text': data[proto.REFUSE.size:].decode(), 'eof': eof}


def test_producer_refuses_a_consumer_of_another_uid(sock_dir):
    if os.getuid() != 0:
        pytest.skip('needs root to start a process as nobody')
    os.chmod(sock_dir, 0o700)
    sock_path = os.path.join(sock_dir, 'cam.sock')
    go_r, go_w = os.pipe()
    child = Child(_intruder_consumer, sock_path, go_r)
    assert child.wait_for('resolver')['resolver'] in ('InsecureDirectoryError',
                                                      'PoolUnreachableError')
    pool = TensorPool(PoolConfig('cam', 4096, socket_dir=sock_dir, allocator='memfd'))
    os.chmod(sock_dir, 0o711)        # deliberately weakened for the test
    os.chmod(sock_path, 0o777)
    os.write(go_w, b'g')
    result = child.join()
    assert result['type'] == proto.Msg.REFUSE and result['code'] == proto.Code.PEER_UID
    assert 'runs as uid' in result['text'] and result['fds'] == 0 and result['eof']
    assert pool.stats().consumers == []
    pool.close()
    os.close(go_r)
    os.close(go_w)
    child.close()


# --- hostile producers --------------------------------------------------------------------
def _fake_producer(sock_dir, buffer_fd, size, extra_fds=0):
    """Listen, welcome one consumer and GRANT it buffer_fd, whatever that is."""
    listener = channel.listen('fake', sock_dir)

    def serve():
        conn, _ = listener.accept()
        proto.recv(conn)   # HELLO
        proto.send(conn, proto.WELCOME.pack(proto.Msg.WELCOME, proto.VERSION, 2, size,
                                            int(BufferKind.MEMFD), 1.0) + b'fake')
        data, _ = proto.recv(conn)   # ACQUIRE
        req = proto.ACQUIRE.unpack_from(data)[1]
        fds = [buffer_fd] + [os.dup(buffer_fd) for _ in range(extra_fds)]
        proto.send(conn, proto.GRANT.pack(proto.Msg.GRANT, req, 0, 0, size), fds)
        for fd in fds[1:]:
            os.close(fd)
        proto.recv(conn)   # until the consumer hangs up
        conn.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize('make_fd, size, extra, error, message', [
    (lambda: _unsealed(8192), 8192, 0, BufferValidationError, 'not sealed'),
    (lambda: create_sealed_memfd(4096, 'short'), 8192, 0, BufferValidationError,
     'truncated'),
    (lambda: create_sealed_memfd(8192, 'many'), 8192, proto.MAX_FDS, ProtocolError,
     'MSG_CTRUNC'),
    (lambda: create_sealed_memfd(8192, 'two'), 8192, 1, ProtocolError, 'carried 2 fds'),
])
def test_hostile_buffers_are_refused_without_leaks(sock_dir, make_fd, size, extra, error,
                                                   message):
    base = Baseline()
    fd = make_fd()
    thread = _fake_producer(sock_dir, fd, size, extra)
    resolver = TensorResolver(socket_dir=sock_dir)
    handle = TensorDescriptor('fake', 0, 0, 1, BufferKind.MEMFD, 'uint8', (16,))
    with pytest.raises(error, match=message):
        resolver.resolve(handle)
    # We hung up on the liar: the fake producer sees EOF and stops; nothing is retried.
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(PoolUnreachableError):
        resolver.resolve(handle)
    resolver.close()
    os.close(fd)
    base.check()


def _unsealed(size):
    fd = os.memfd_create('unsealed', os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd
