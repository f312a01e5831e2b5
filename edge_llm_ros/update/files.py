"""Durable file writing for installs: hash while copying, fsync, a full disk as one error."""
from __future__ import annotations

import errno
import hashlib
import os
import pathlib
from typing import Iterable

from edge_llm_ros.update.errors import DiskFullError
from edge_llm_ros.update.manifest import CHUNK, FileEntry

# errno values that mean "no room" (EFBIG: the file size limit, RLIMIT_FSIZE or the fs's).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_room(exc: OSError, path: pathlib.Path, needed: int) -> DiskFullError:
    """Build the DiskFullError of a write that failed for lack of space."""
    return DiskFullError(
        f'no space left while writing {path} ({os.strerror(exc.errno)}; the update needs '
        f'{needed} bytes on that filesystem): free some space and apply it again; nothing was '
        'installed')


def write_chunks(path: pathlib.Path, chunks: Iterable[bytes], needed: int) -> FileEntry:
    """Write a new file from chunks, fsync it; return its hash. DiskFullError when full."""
    digest = hashlib.sha256()
    size = 0
    try:
        with open(path, 'xb') as fh:
            for chunk in chunks:
                digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    written = fh.write(view)
                    view = view[written:]
                size += len(chunk)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise no_room(exc, path, needed) from None
        raise
    return FileEntry(digest.hexdigest(), size)


def read_chunks(path: pathlib.Path) -> Iterable[bytes]:
    with open(path, 'rb') as fh:
        while True:
            chunk = fh.read(CHUNK)
            if not chunk:
                return
            yield chunk


def split(data: bytes) -> Iterable[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), CHUNK):
        yield view[start:start + CHUNK]


def fsync_dir(path: pathlib.Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
