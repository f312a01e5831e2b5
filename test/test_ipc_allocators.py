"""Allocators: allocation, mapping, DMA_BUF_IOCTL_SYNC, naming, received-fd validation."""
import errno
import fcntl
import mmap
import os

from ipc_support import ALLOCATORS, Baseline, require_allocator
import numpy as np
import pytest

from edge_llm_ros.ipc import allocators, choices
from edge_llm_ros.ipc.allocators import (BufferKind, create_sealed_memfd, DMA_BUF_SYNC_READ,
                                         DMA_BUF_SYNC_START, REQUIRED_MEMFD_SEALS,
                                         select_allocator)
from edge_llm_ros.ipc.errors import (AllocationError, AllocatorUnavailableError,
                                     BufferValidationError)
from edge_llm_ros.ipc.mapping import fdinfo, import_buffer, Mapping


@pytest.fixture(params=ALLOCATORS)
def allocator(request):
    require_allocator(request.param)
    alloc = select_allocator(request.param)
    yield alloc
    alloc.close()


def test_allocate_map_sync_and_share(allocator):
    base = Baseline()
    buf = allocator.allocate(100_000, 'unit:0:0')
    assert buf.size == 102_400 and buf.size % mmap.PAGESIZE == 0
    assert buf.kind == allocator.kind
    owner = Mapping(buf.fd, buf.size, buf.kind, writable=True, own_fd=False)
    with buf.cpu_access(write=True):
        owner.ndarray('uint8', (buf.size,), (), 0)[:] = np.arange(buf.size) % 241
    # What a consumer gets: a read-only mapping of share_fd, validated.
    reader = import_buffer(os.dup(buf.share_fd), buf.size, buf.kind)
    reader.begin_read()
    view = reader.ndarray('uint8', (buf.size,), (), 0)
    assert not view.flags.writeable
    assert np.array_equal(view, np.arange(buf.size) % 241)
    reader.end_read()
    with pytest.raises(ValueError):
        view[0] = 1
    del view
    reader.release()
    owner.release()
    buf.close()
    buf.close()  # idempotent
    base.check()


@pytest.mark.parametrize('name', ['udmabuf', 'dma_heap'])
def test_dmabuf_is_named_and_reports_its_exporter(name):
    require_allocator(name)
    allocator = select_allocator(name)
    buf = allocator.allocate(4096, 'cam0:3:7')
    allocator.close()
    info = fdinfo(buf.fd)
    assert info['exp_name'] == {'dma_heap': 'system', 'udmabuf': 'udmabuf'}[name]
    assert info['name'] == 'cam0:3:7'
    assert int(info['size']) == 4096
    buf.sync(DMA_BUF_SYNC_START | DMA_BUF_SYNC_READ)  # a real ioctl on a real dma-buf
    buf.close()


def test_memfd_is_sealed_named_and_shared_read_only():
    alloc = select_allocator('memfd')
    buf = alloc.allocate(5000, 'cam0:1:0')
    assert os.readlink(f'/proc/self/fd/{buf.fd}').startswith('/memfd:edge_llm:cam0:1:0')
    seals = fcntl.fcntl(buf.share_fd, fcntl.F_GET_SEALS)
    assert seals & REQUIRED_MEMFD_SEALS == REQUIRED_MEMFD_SEALS
    with pytest.raises(PermissionError):
        os.ftruncate(buf.fd, 100)  # F_SEAL_SHRINK
    # A consumer holding share_fd cannot get write access to the pages.
    with pytest.raises(PermissionError):
        mmap.mmap(buf.share_fd, buf.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    assert fcntl.fcntl(buf.share_fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    buf.close()


def test_cpu_access_is_noop_for_memfd_and_not_a_fake_for_dmabuf():
    buf = select_allocator('memfd').allocate(4096, 'x')
    with buf.cpu_access():
        pass
    buf.close()
    # DMA_BUF_IOCTL_SYNC on a non-dma-buf must reach the kernel and fail there.
    fd = create_sealed_memfd(4096, 'plain')
    with pytest.raises(OSError) as err:
        allocators.dmabuf_sync(fd, DMA_BUF_SYNC_START | DMA_BUF_SYNC_READ)
    assert err.value.errno in (errno.ENOTTY, errno.EINVAL)
    os.close(fd)


def test_selection_best_first_and_forced():
    names = allocators.allocator_names()
    assert names[:3] == ['dma_heap', 'udmabuf', 'memfd'] == list(choices.ALLOCATORS)
    best = select_allocator('auto')
    assert best.name == allocators.available_allocators()[0]
    best.close()
    with pytest.raises(AllocatorUnavailableError, match="unknown allocator 'bogus'"):
        select_allocator('bogus')
    with pytest.raises(AllocatorUnavailableError, match='extension point'):
        select_allocator('nvbuf')
    for name in ('dma_heap', 'udmabuf'):
        if name not in allocators.available_allocators():
            with pytest.raises(AllocatorUnavailableError, match='does not exist'):
                select_allocator(name)


def test_forced_device_path_that_is_missing_is_an_error():
    with pytest.raises(AllocatorUnavailableError, match='cannot open /nonexistent'):
        allocators.DmaHeapAllocator('/nonexistent/heap')


def test_udmabuf_size_limit_is_explained():
    require_allocator('udmabuf')
    alloc = select_allocator('udmabuf')
    with pytest.raises(AllocationError, match='limited to 64 MiB'):
        alloc.allocate(65 << 20, 'big')
    alloc.close()


def test_register_allocator_rejects_duplicates():
    class Other(allocators.MemfdAllocator):
        name = 'memfd'
    with pytest.raises(ValueError, match='already registered'):
        allocators.register_allocator(Other)


# --- what a consumer refuses -----------------------------------------------------------
def test_unsealed_memfd_is_refused_and_closed():
    base = Baseline()
    fd = os.memfd_create('unsealed', os.MFD_CLOEXEC)
    os.ftruncate(fd, 8192)
    with pytest.raises(BufferValidationError, match='not sealed against resizing'):
        import_buffer(fd, 8192, BufferKind.MEMFD)
    base.check()   # the fd was closed by import_buffer


def test_truncated_memfd_is_refused():
    base = Baseline()
    fd = create_sealed_memfd(4096, 'short')
    with pytest.raises(BufferValidationError, match='holds 4096 bytes but the producer '
                                                    'announced 8192'):
        import_buffer(fd, 8192, BufferKind.MEMFD)
    base.check()


def test_wrong_kind_is_refused():
    fd = create_sealed_memfd(4096, 'pretends')
    with pytest.raises(BufferValidationError, match='expected a dma-buf'):
        import_buffer(fd, 4096, BufferKind.DMA_HEAP)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(BufferValidationError, match='expected a memfd'):
        import_buffer(r, 4096, BufferKind.MEMFD)
    with pytest.raises(BufferValidationError, match='no importer for buffer kind NVBUF'):
        import_buffer(create_sealed_memfd(4096, 'nv'), 4096, BufferKind.NVBUF)
