"""fd-backed buffer allocators behind one interface: DMA heap, udmabuf, sealed memfd.

Choice is best-first at run time (``select_allocator('auto')``: dma_heap, udmabuf,
memfd) or forced by name. Every buffer is a file descriptor a producer can pass to
consumers with SCM_RIGHTS; consumers map it read-only (see mapping.py).

- ``dma_heap``: ``/dev/dma_heap/system`` + ``DMA_HEAP_IOCTL_ALLOC`` -> a dma-buf.
- ``udmabuf``: a sealed memfd turned into a dma-buf by ``/dev/udmabuf``
  (``UDMABUF_CREATE``); the memfd needs F_SEAL_SHRINK and must not carry F_SEAL_WRITE.
- ``memfd``: a sealed memfd (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL); always works.
  Consumers get a read-only reopen of it, so they cannot map it writable.

CPU access to a dma-buf must be bracketed with ``DMA_BUF_IOCTL_SYNC`` (``cpu_access``);
for a memfd this is a no-op. Buffers are named (``DMA_BUF_SET_NAME`` / memfd name) so
``/proc/<pid>/fdinfo`` and ``/sys/kernel/debug/dma_buf/bufinfo`` show who owns what.

Extension point (Jetson, CUDA): subclass :class:`Allocator`, give it a unique ``name``
and a :class:`BufferKind`, and :func:`register_allocator` it (``priority`` places it in
the 'auto' order). What an implementation must provide:

- ``available()``: whether the device/library works here (never raise).
- ``allocate(size, name)``: a :class:`Buffer` whose ``fd`` the producer maps
  (``mappable=True``) and whose ``share_fd`` is what consumers receive.
- ``BufferKind.NVBUF`` (NvBufSurface, JetPack >= 5): ``NvBufSurfaceCreate`` with
  ``NVBUF_MEM_SURFACE_ARRAY`` and take ``surfaceList[0].bufferDesc`` (a dma-buf fd) as
  ``fd``/``share_fd``; ``cpu_access`` must call ``NvBufSurfaceSyncForCpu`` /
  ``NvBufSurfaceSyncForDevice`` instead of ``DMA_BUF_IOCTL_SYNC`` (override
  :meth:`Buffer.sync`), and consumers import it with ``NvBufSurfaceImport`` for GPU use
  (CPU mmap of the dma-buf works for pitch-linear layouts only).
- CUDA VMM: ``cuMemCreate`` with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` and
  ``cuMemExportToShareableHandle`` give the fd; it is not CPU-mappable (``mappable=False``),
  so the consumer side needs a matching importer (``cuMemImportFromShareableHandle`` +
  ``cuMemMap``) registered with :func:`edge_llm_ros.ipc.mapping.register_importer`.
No such implementation ships here: this machine has neither, and a fake would prove nothing.
"""
from contextlib import contextmanager
import dataclasses
import enum
import errno
import fcntl
import os
import struct
from typing import Callable, Dict, Iterator, List, Optional, Type

from edge_llm_ros.ipc import choices
from edge_llm_ros.ipc.errors import AllocationError, AllocatorUnavailableError

PAGE_SIZE = os.sysconf('SC_PAGE_SIZE')

# ioctl numbers are the same on x86_64 and aarch64 (asm-generic ioctl encoding).
DMA_HEAP_IOCTL_ALLOC = 0xC0184800   # struct dma_heap_allocation_data {u64 len; u32 fd;
DMA_HEAP_ALLOC_FMT = '=QIIQ'        # u32 fd_flags; u64 heap_flags}
UDMABUF_CREATE = 0x40187542         # struct udmabuf_create {u32 memfd; u32 flags;
UDMABUF_CREATE_FMT = '=IIQQ'        # u64 offset; u64 size} -> returns the dma-buf fd
UDMABUF_FLAGS_CLOEXEC = 0x01
DMA_BUF_IOCTL_SYNC = 0x40086200     # struct dma_buf_sync {u64 flags}
DMA_BUF_SET_NAME = 0x40086201       # const char * (<= 32 bytes with the NUL)
DMA_BUF_SYNC_READ = 1
DMA_BUF_SYNC_WRITE = 2
DMA_BUF_SYNC_START = 0
DMA_BUF_SYNC_END = 4
DMA_BUF_NAME_LEN = 32
UDMABUF_MAX_SIZE = 64 << 20         # udmabuf's default size_limit_mb module parameter

# Seals every shared memfd must carry: its size can never change (no SIGBUS for a reader
# whose mapping outlives a malicious truncate) and no one can add or remove seals.
REQUIRED_MEMFD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

DEFAULT_HEAP_PATH = '/dev/dma_heap/system'
DEFAULT_UDMABUF_PATH = '/dev/udmabuf'


class BufferKind(enum.IntEnum):
    """Kind of buffer; values equal edge_llm_msgs/msg/TensorHandle KIND_* constants."""

    MEMFD = 0
    DMA_HEAP = 1
    UDMABUF = 2
    NVBUF = 3

    @property
    def is_dmabuf(self) -> bool:
        """Whether CPU access needs DMA_BUF_IOCTL_SYNC bracketing."""
        return self is not BufferKind.MEMFD


def page_align(size: int) -> int:
    """Round size up to a whole number of pages (at least one page)."""
    return max(PAGE_SIZE, (size + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE)


def dmabuf_sync(fd: int, flags: int) -> None:
    """Issue DMA_BUF_IOCTL_SYNC on a dma-buf fd (retrying EINTR/EAGAIN as the uapi says)."""
    arg = struct.pack('=Q', flags)
    while True:
        try:
            fcntl.ioctl(fd, DMA_BUF_IOCTL_SYNC, arg)
            return
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise


def dmabuf_set_name(fd: int, name: str) -> None:
    """Name a dma-buf for debugging (shown in fdinfo and debugfs bufinfo)."""
    raw = name.encode('utf-8', 'replace')[:DMA_BUF_NAME_LEN - 1] + b'\0'
    # fcntl.ioctl passes a pointer to its copy of the bytes: exactly the const char* wanted.
    fcntl.ioctl(fd, DMA_BUF_SET_NAME, raw)


@dataclasses.dataclass
class Buffer:
    """One fd-backed buffer. The allocating side owns it: only the owner calls close().

    ``fd`` is what the owner maps read-write; ``share_fd`` is what consumers receive
    (a read-only reopen for memfd, the dma-buf itself otherwise).
    """

    fd: int
    share_fd: int
    size: int
    kind: BufferKind
    name: str
    mappable: bool = True
    _closed: bool = dataclasses.field(default=False, repr=False)

    def sync(self, flags: int) -> None:
        """Bracket CPU access (DMA_BUF_SYNC_START/END | READ/WRITE); no-op for memfd."""
        if self.kind.is_dmabuf:
            dmabuf_sync(self.fd, flags)

    @contextmanager
    def cpu_access(self, write: bool = True) -> Iterator['Buffer']:
        """Context manager bracketing CPU reads (and writes) with DMA_BUF_IOCTL_SYNC."""
        mode = DMA_BUF_SYNC_READ | (DMA_BUF_SYNC_WRITE if write else 0)
        self.sync(DMA_BUF_SYNC_START | mode)
        try:
            yield self
        finally:
            self.sync(DMA_BUF_SYNC_END | mode)

    @property
    def closed(self) -> bool:
        """Whether close() ran."""
        return self._closed

    def close(self) -> None:
        """Close the owner's fds; consumers' fds and mappings keep the memory alive."""
        if self._closed:
            return
        self._closed = True
        if self.share_fd != self.fd:
            os.close(self.share_fd)
        os.close(self.fd)


class Allocator:
    """Interface of a buffer allocator. Subclasses set ``name``, ``kind``, ``priority``."""

    name = ''
    kind = BufferKind.MEMFD
    priority = 0  # higher is tried first by select_allocator('auto')

    @classmethod
    def available(cls) -> bool:
        """Whether this allocator works on this machine (must not raise)."""
        return cls.unavailable_reason() is None

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None when usable, else a sentence telling the user why and what to do."""
        raise NotImplementedError

    def allocate(self, size: int, name: str) -> Buffer:
        """Allocate a buffer of at least size bytes (page aligned), named for debugging."""
        raise NotImplementedError

    def close(self) -> None:
        """Release allocator resources (open device fds). Buffers stay valid."""


def create_sealed_memfd(size: int, name: str, seals: int = REQUIRED_MEMFD_SEALS) -> int:
    """Create a memfd of size bytes (page aligned) carrying the given seals."""
    fd = os.memfd_create(name[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reopen_read_only(fd: int) -> int:
    """Open a new read-only file description of fd's file (for memfd: same pages, same seals).

    A consumer holding only this fd cannot map the memory writable (EACCES).
    """
    return os.open(f'/proc/self/fd/{fd}', os.O_RDONLY | os.O_CLOEXEC)


class MemfdAllocator(Allocator):
    """Sealed memfd: plain shared memory, available on every Linux >= 3.17."""

    name = choices.MEMFD
    kind = BufferKind.MEMFD
    priority = 0

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if not hasattr(os, 'memfd_create'):
            return 'os.memfd_create missing: this needs Linux and Python >= 3.8'
        return None

    def allocate(self, size: int, name: str) -> Buffer:
        size = page_align(size)
        fd = create_sealed_memfd(size, f'edge_llm:{name}')
        try:
            share = reopen_read_only(fd)
        except BaseException:
            os.close(fd)
            raise
        return Buffer(fd=fd, share_fd=share, size=size, kind=self.kind, name=name)


class _DeviceAllocator(Allocator):
    """Common part of allocators that open a character device once."""

    device_path = ''
    device_flags = os.O_RDONLY

    def __init__(self, device_path: Optional[str] = None) -> None:
        self.device_path = device_path or self.device_path
        try:
            self._dev = os.open(self.device_path, self.device_flags | os.O_CLOEXEC)
        except OSError as exc:
            raise AllocatorUnavailableError(
                f'{self.name}: cannot open {self.device_path}: {exc.strerror}. '
                f'{self._fix_hint()}') from exc

    @classmethod
    def _fix_hint(cls) -> str:
        return 'Use another allocator (memfd always works) or fix the device permissions.'

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if not os.path.exists(cls.device_path):
            return f'{cls.device_path} does not exist (kernel without this driver)'
        if not os.access(cls.device_path, os.R_OK | (
                os.W_OK if cls.device_flags == os.O_RDWR else 0)):
            return f'{cls.device_path} is not accessible to uid {os.getuid()}'
        return None

    def close(self) -> None:
        if self._dev >= 0:
            os.close(self._dev)
            self._dev = -1

    def _named(self, fd: int, size: int, name: str) -> Buffer:
        try:
            dmabuf_set_name(fd, name)
        except OSError as exc:
            os.close(fd)
            raise AllocationError(f'DMA_BUF_SET_NAME failed on a {self.name} buffer: '
                                  f'{exc.strerror} (kernel older than 5.2?)') from exc
        return Buffer(fd=fd, share_fd=fd, size=size, kind=self.kind, name=name)


class DmaHeapAllocator(_DeviceAllocator):
    """dma-buf from a DMA heap (default: the system heap)."""

    name = choices.DMA_HEAP
    kind = BufferKind.DMA_HEAP
    priority = 20
    device_path = DEFAULT_HEAP_PATH
    device_flags = os.O_RDONLY

    def allocate(self, size: int, name: str) -> Buffer:
        size = page_align(size)
        arg = bytearray(struct.pack(DMA_HEAP_ALLOC_FMT, size, 0, os.O_RDWR | os.O_CLOEXEC, 0))
        try:
            fcntl.ioctl(self._dev, DMA_HEAP_IOCTL_ALLOC, arg, True)
        except OSError as exc:
            raise AllocationError(
                f'DMA_HEAP_IOCTL_ALLOC of {size} bytes on {self.device_path} failed: '
                f'{exc.strerror} (out of memory? lower the slot size or count)') from exc
        _, fd, _, _ = struct.unpack(DMA_HEAP_ALLOC_FMT, arg)
        return self._named(fd, size, name)


class UdmabufAllocator(_DeviceAllocator):
    """dma-buf made from a sealed memfd by /dev/udmabuf."""

    name = choices.UDMABUF
    kind = BufferKind.UDMABUF
    priority = 10
    device_path = DEFAULT_UDMABUF_PATH
    device_flags = os.O_RDWR

    def allocate(self, size: int, name: str) -> Buffer:
        size = page_align(size)
        if size > UDMABUF_MAX_SIZE:
            raise AllocationError(
                f'udmabuf buffers are limited to {UDMABUF_MAX_SIZE >> 20} MiB by default '
                f'({size} requested): use dma_heap or memfd, or raise udmabuf.size_limit_mb')
        memfd = create_sealed_memfd(size, f'edge_llm:{name}')
        try:
            arg = bytearray(struct.pack(UDMABUF_CREATE_FMT, memfd, UDMABUF_FLAGS_CLOEXEC, 0, size))
            # With a mutable buffer, fcntl.ioctl returns the syscall's result: the new fd.
            fd = fcntl.ioctl(self._dev, UDMABUF_CREATE, arg, True)
        except OSError as exc:
            raise AllocationError(
                f'UDMABUF_CREATE of {size} bytes failed: {exc.strerror}') from exc
        finally:
            os.close(memfd)  # the udmabuf holds the pages; the memfd is no longer needed
        return self._named(fd, size, name)


_REGISTRY: Dict[str, Type[Allocator]] = {}


def register_allocator(cls: Type[Allocator]) -> Type[Allocator]:
    """Add an allocator class (usable as a decorator); its name must be unique."""
    if not cls.name or cls.name in ('auto',):
        raise ValueError(f'allocator {cls!r} needs a unique name other than "auto"')
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f'an allocator named {cls.name!r} is already registered')
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (DmaHeapAllocator, UdmabufAllocator, MemfdAllocator):
    register_allocator(_cls)


def allocator_names() -> List[str]:
    """Return the registered allocator names, best first."""
    return [c.name for c in sorted(_REGISTRY.values(), key=lambda c: -c.priority)]


def available_allocators() -> List[str]:
    """Names of the allocators that work here, best first."""
    return [n for n in allocator_names() if _REGISTRY[n].available()]


def select_allocator(name: str = 'auto',
                     factory: Optional[Callable[[Type[Allocator]], Allocator]] = None
                     ) -> Allocator:
    """Return an allocator: the best available for 'auto', else exactly the one named.

    A named allocator that cannot work raises AllocatorUnavailableError (no silent
    fallback: a forced choice is a requirement).
    """
    make = factory or (lambda cls: cls())
    if name == 'auto':
        reasons = []
        for candidate in allocator_names():
            cls = _REGISTRY[candidate]
            reason = cls.unavailable_reason()
            if reason is None:
                try:
                    return make(cls)
                except AllocatorUnavailableError as exc:
                    reason = str(exc)
            reasons.append(f'{candidate}: {reason}')
        raise AllocatorUnavailableError('no allocator works here: ' + '; '.join(reasons))
    if name not in _REGISTRY:
        hint = ''
        if name == 'nvbuf':
            hint = (' (NvBufSurface is an extension point: register an Allocator subclass '
                    'with kind BufferKind.NVBUF; see edge_llm_ros.ipc.allocators)')
        raise AllocatorUnavailableError(
            f'unknown allocator {name!r}; known: auto, {", ".join(allocator_names())}{hint}')
    cls = _REGISTRY[name]
    reason = cls.unavailable_reason()
    if reason is not None:
        raise AllocatorUnavailableError(
            f'allocator {name!r} is unavailable: {reason}. Use "auto" or "memfd".')
    return make(cls)
