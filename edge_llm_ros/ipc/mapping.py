"""Mapping buffers into memory, and checking fds received from another process.

A :class:`Mapping` owns one ``mmap``; numpy arrays made from it hold the mmap object
as their base, so a view keeps its memory mapped after the Mapping is released (the
kernel keeps a memfd's pages or a dma-buf alive while any mapping exists: a producer
that exits or is killed never turns a consumer's view into SIGBUS).
"""
import fcntl
import mmap
import os
from typing import Callable, Dict, Optional, Sequence
import weakref

import numpy as np

from edge_llm_ros.ipc.allocators import (BufferKind, DMA_BUF_SYNC_END, DMA_BUF_SYNC_READ,
                                         DMA_BUF_SYNC_START, dmabuf_sync, REQUIRED_MEMFD_SEALS)
from edge_llm_ros.ipc.errors import BufferValidationError, PoolClosedError

# dma-buf exporter names (fdinfo "exp_name") expected for each kind.
EXPORTER_NAMES = {
    BufferKind.DMA_HEAP: ('system', 'system-uncached'),
    BufferKind.UDMABUF: ('udmabuf',),
}


class Mapping:
    """A shared mapping of a buffer fd, read-only unless writable=True.

    ``own_fd`` hands fd to the Mapping: it is closed once the mapping and every view
    of it are gone (dma-bufs keep it for DMA_BUF_IOCTL_SYNC; a memfd's fd is closed at
    once, since the mmap holds its own reference).
    """

    def __init__(self, fd: int, size: int, kind: BufferKind, writable: bool = False,
                 own_fd: bool = True) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            self._mm: Optional[mmap.mmap] = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        except BaseException:
            if own_fd:
                os.close(fd)
            raise
        self.size = size
        self.kind = kind
        self.writable = writable
        self._fd = fd
        if own_fd and kind.is_dmabuf:
            weakref.finalize(self._mm, os.close, fd)
        elif own_fd:
            os.close(fd)
            self._fd = -1

    @property
    def released(self) -> bool:
        """Whether release() ran (views made before may still be alive)."""
        return self._mm is None

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise PoolClosedError('this mapping was released; resolve the handle again')
        return self._mm

    def sync(self, flags: int) -> None:
        """DMA_BUF_IOCTL_SYNC on the mapped dma-buf (no-op for memfd)."""
        if self.kind.is_dmabuf and self._fd >= 0 and self._mm is not None:
            dmabuf_sync(self._fd, flags)

    def begin_read(self) -> None:
        """Start a CPU read window (dma-buf cache maintenance)."""
        self.sync(DMA_BUF_SYNC_START | DMA_BUF_SYNC_READ)

    def end_read(self) -> None:
        """End a CPU read window."""
        self.sync(DMA_BUF_SYNC_END | DMA_BUF_SYNC_READ)

    def ndarray(self, dtype: str, shape: Sequence[int], strides: Optional[Sequence[int]],
                byte_offset: int) -> np.ndarray:
        """Return a numpy view (read-only unless writable); it keeps the mmap alive."""
        return np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=self._map(),
                          offset=byte_offset, strides=tuple(strides) if strides else None)

    def memoryview(self) -> memoryview:  # noqa: A003 (mirrors the builtin on purpose)
        """Return a memoryview of the whole mapping (it keeps the mmap alive)."""
        return memoryview(self._map())

    def address(self) -> int:
        """Virtual address of the mapping (for onnxruntime IOBinding and similar)."""
        view = np.frombuffer(self._map(), dtype=np.uint8, count=1)
        return view.__array_interface__['data'][0]

    def release(self) -> None:
        """Drop this object's reference; the memory goes once the last view is gone."""
        self._mm = None


def fdinfo(fd: int) -> Dict[str, str]:
    """Parse /proc/self/fdinfo/<fd> (dma-bufs report size and exp_name there)."""
    with open(f'/proc/self/fdinfo/{fd}', 'r', encoding='utf-8', errors='replace') as f:
        out = {}
        for line in f:
            key, _, value = line.partition(':')
            out[key.strip()] = value.strip()
        return out


def _check_memfd(fd: int, size: int) -> None:
    target = os.readlink(f'/proc/self/fd/{fd}')
    if not target.startswith('/memfd:'):
        raise BufferValidationError(f'expected a memfd, received {target!r}: the producer is '
                                    'misbehaving or its buffer kind is wrong')
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & REQUIRED_MEMFD_SEALS != REQUIRED_MEMFD_SEALS:
        raise BufferValidationError(
            f'memfd {target!r} is not sealed against resizing (seals 0x{seals:x}, need '
            f'0x{REQUIRED_MEMFD_SEALS:x}): a producer could truncate it under our mapping '
            '(SIGBUS); refusing it')
    actual = os.fstat(fd).st_size
    if actual < size:
        raise BufferValidationError(
            f'memfd {target!r} holds {actual} bytes but the producer announced {size}: '
            'refusing a truncated buffer')


def _check_dmabuf(fd: int, size: int, kind: BufferKind) -> None:
    info = fdinfo(fd)
    exporter = info.get('exp_name')
    if exporter is None:
        raise BufferValidationError(
            f'expected a dma-buf ({kind.name}), received {os.readlink(f"/proc/self/fd/{fd}")!r}')
    allowed = EXPORTER_NAMES.get(kind)
    if allowed is not None and exporter not in allowed:
        raise BufferValidationError(
            f'dma-buf exported by {exporter!r} announced as {kind.name} (expected one of '
            f'{allowed})')
    actual = int(info.get('size', '0'))
    if actual < size:
        raise BufferValidationError(
            f'dma-buf holds {actual} bytes but the producer announced {size}: refusing it')


Importer = Callable[[int, int, BufferKind], Mapping]
_IMPORTERS: Dict[BufferKind, Importer] = {}


def register_importer(kind: BufferKind, importer: Importer) -> None:
    """Install how consumers map fds of a kind (the NVBUF / CUDA VMM extension point)."""
    _IMPORTERS[kind] = importer


def import_buffer(fd: int, size: int, kind: BufferKind) -> Mapping:
    """Validate a received fd against what the producer announced and map it read-only.

    Takes ownership of fd: it is closed on every error path.
    """
    try:
        if kind in _IMPORTERS:
            return _IMPORTERS[kind](fd, size, kind)
        if kind == BufferKind.MEMFD:
            _check_memfd(fd, size)
        elif kind in EXPORTER_NAMES:
            _check_dmabuf(fd, size, kind)
        else:
            raise BufferValidationError(
                f'no importer for buffer kind {kind.name}: register one with '
                'edge_llm_ros.ipc.mapping.register_importer')
    except BaseException:
        os.close(fd)
        raise
    return Mapping(fd, size, kind, writable=False, own_fd=True)
